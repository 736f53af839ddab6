"""Which transformers versions the integration runs on, how it stays out of the way of the others, and every
convention of transformers' call path that the integration reads (the ONE place that reads them):

* the argument that carries the KV cache into an attention module (``cache`` since 5.24, ``past_key_values``
  before) and the cache's layer API the cache-bound states use (``cache_of_call``, ``cache_layer``,
  ``plain_dynamic_layer``, ``layer_tensors``);
* what a keyword reaching the attention function means (``keyword_roles``): read from transformers' own
  declarations (its attention functions' parameters, the ``TransformersKwargs``/``FlashAttentionKwargs`` typed
  dicts, the loss functions' parameters) of the installed version, not from a list frozen at one release;
* continuous batching (``generate_batch``): its entry point (``CONTINUOUS_BATCHING_ENTRY``), the manager's two
  checks of the implementation's name (``CONTINUOUS_BATCHING_SWITCH``, ``CONTINUOUS_BATCHING_MASKS``), the paged
  cache that marks its calls (``PAGED_CACHE``) and the keywords its packed calls carry (``PAGED_ARGUMENTS``).

tests/test_transformers_contract.py asserts each of these against the installed transformers and names the feature
that depends on it.

Supported: ``MIN_TRANSFORMERS`` and newer, no upper cap (CI tests ``CI_VERSIONS``). Older versions lack what the
integration relies on (5.3: GPT-2's attention module has no ``scaling`` attribute, so its per-head values could not
be created at build time; < 5.3: other signatures of the private methods hooked). There ``register()`` installs no
hook on ``PreTrainedModel`` except a guard on ``post_init`` (a public method with no arguments since transformers
4.0) that refuses models using our names with an error saying which versions work, and registers our names with a
function that raises the same error: models that do not use our names behave exactly as without ``import
hf_attnorm``.

Every private transformers internal the integration touches is listed in docs/internals.md with the guard.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import importlib.util
import inspect
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

import transformers
from transformers.cache_utils import Cache, DynamicLayer

from .. import supported
from ..registry import AttnormError

# the supported range and the versions CI runs live in hf_attnorm/supported.py (one place, read by .ci/run too)
MIN_TRANSFORMERS = supported.MIN_TRANSFORMERS
TESTED_NEWEST = supported.TESTED_NEWEST
CI_VERSIONS = supported.CI_VERSIONS
release = supported.release


def transformers_version_string() -> str:
    return str(transformers.__version__)


def unsupported_reason(version: str | None = None) -> str | None:
    """None when ``version`` (default: the installed transformers, read at call time) is supported, else why not."""
    v = version if version is not None else transformers.__version__
    if release(v) < release(MIN_TRANSFORMERS):
        return (f"hf_attnorm needs transformers >= {MIN_TRANSFORMERS} (tested up to {TESTED_NEWEST}); this is "
                f"transformers {v}. Upgrade with pip install 'transformers>={MIN_TRANSFORMERS}'")
    return None


def refusing_forward(name: str, reason: str) -> Callable[..., Any]:
    """The attention function registered for ``name`` on an unsupported transformers: raises ``reason``."""

    def refuse(module: Any, *args: Any, **kwargs: Any) -> Any:
        raise AttnormError(f"attention implementation {name!r}: {reason}")

    refuse.__name__ = f"hf_attnorm_{name}_unsupported"
    return refuse


def accepts(func: Callable[..., Any], *names: str) -> bool:
    """Whether ``func`` takes every keyword in ``names`` (or ``**kwargs``): hooks pass only what the hooked
    version accepts, so one wrapper serves every signature."""
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    return all(n in params for n in names)


def hook(owner: type, attr: str, make: Callable[[Callable[..., Any]], Callable[..., Any]],
         *, classmethod_: bool = False) -> bool:
    """Replace ``owner.attr`` by ``make(original)`` if ``owner`` defines it; False (nothing replaced) otherwise."""
    orig = inspect.getattr_static(owner, attr, None)
    if orig is None:
        return False
    func = orig.__func__ if isinstance(orig, (classmethod, staticmethod)) else orig
    new = functools.wraps(func)(make(func))
    setattr(owner, attr, classmethod(new) if classmethod_ else new)
    return True


# ------------------------------------------------------------------------------------------------ the KV cache

#: the keyword that carries the KV cache into an attention module's forward, newest name first (5.24 renamed
#: ``past_key_values`` to ``cache``, keeping the old name as a deprecated alias until 5.40)
CACHE_ARGUMENTS: tuple[str, ...] = ("cache", "past_key_values")


def cache_of_call(args: tuple, kwargs: Mapping[str, Any]) -> Cache | None:
    """The transformers ``Cache`` an attention module's call received (as read by a forward pre-hook with kwargs):
    by keyword under one of ``CACHE_ARGUMENTS``, else any positional argument that is a ``Cache``; None without."""
    for name in CACHE_ARGUMENTS:
        value = kwargs.get(name)
        if isinstance(value, Cache):
            return value
    for a in args:  # (a loop: Dynamo before torch 2.9 cannot trace next() over a generator)
        if isinstance(a, Cache):
            return a
    return None


def cache_kwargs(model: Any, cache: Cache | None) -> dict[str, Any]:
    """``{name: cache}`` for calling ``model(...)`` or ``model.generate(...)`` with a cache, under the name the
    installed transformers' model forward takes (``cache`` since 5.24, ``past_key_values`` before)."""
    params = inspect.signature(type(model).forward).parameters
    name = next((n for n in CACHE_ARGUMENTS if n in params), CACHE_ARGUMENTS[-1])
    return {name: cache}


def output_cache(outputs: Any) -> Cache | None:
    """The cache a model's output carries (``outputs.cache`` since 5.24, ``outputs.past_key_values`` before)."""
    for name in CACHE_ARGUMENTS:
        value = getattr(outputs, name, None)
        if isinstance(value, Cache):
            return value
    return None


def cache_layer(cache: Cache, layer_idx: object) -> Any | None:
    """Layer ``layer_idx`` of ``cache`` (``cache.layers[i]``, transformers >= 5.0), or None when there is none
    (an ``EncoderDecoderCache`` has no ``layers`` of its own)."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or not isinstance(layer_idx, int) or not 0 <= layer_idx < len(layers):
        return None
    return layers[layer_idx]


def cache_layers(cache: Cache) -> list[Any]:
    """Every layer of ``cache`` (empty for a cache without ``layers``)."""
    layers = getattr(cache, "layers", None)
    return layers if isinstance(layers, list) else []


def plain_dynamic_layer(layer: object) -> bool:
    """A layer that appends by concatenation (``DynamicLayer`` itself): each update makes new key/value tensors, so
    a state that remembers the tensors it was built for notices any change."""
    return type(layer) is DynamicLayer


def layer_tensors(layer: object) -> tuple[Any, Any]:
    """(keys [B, Hkv, L, D], values) a cache layer holds (None, None before its first update)."""
    return getattr(layer, "keys", None), getattr(layer, "values", None)


def layer_length(layer: object) -> int:
    """How many positions a cache layer holds (0 before its first update)."""
    keys = getattr(layer, "keys", None)
    return int(keys.shape[-2]) if keys is not None and keys.dim() >= 2 else 0


#: the ``DynamicLayer`` operations generation applies to a cache between steps (beam search, batched and assisted
#: decoding, offloading): selective attention's state follows each (``selective_cache.SelectiveLayer``)
DYNAMIC_LAYER_OPERATIONS = ("crop", "reorder_cache", "batch_select_indices", "batch_repeat_interleave", "reset",
                            "offload", "prefetch")


# ------------------------------------------------------------------------------------------------ keywords

#: where a keyword reaching the attention function comes from, and so what it means
IMPLEMENTED, IGNORED, PASSTHROUGH, ATTENTION, UNKNOWN = "implemented", "ignored", "passthrough", "attention", "unknown"


@dataclasses.dataclass(frozen=True)
class KeywordRole:
    kind: str  # one of IMPLEMENTED, IGNORED, PASSTHROUGH (accepted) / ATTENTION, UNKNOWN (refused)
    why: str

    @property
    def accepted(self) -> bool:
        return self.kind in (IMPLEMENTED, IGNORED, PASSTHROUGH)


#: the positional parameters every attention function takes (not keywords)
_POSITIONAL = ("module", "query", "key", "value", "attention_mask")


def _parameters(func: Callable[..., Any]) -> list[str]:
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def attention_function_keywords() -> dict[str, str]:
    """Keywords that change what attention computes, as transformers' own attention functions declare them: the
    named parameters of every function in ``ALL_ATTENTION_FUNCTIONS`` that is transformers' (sdpa, flash, flex,
    paged) and of ``_flash_attention_forward`` (the varlen/paged metadata flash reads from ``**kwargs``)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    out: dict[str, str] = {}
    funcs = [(name, f) for name, f in ALL_ATTENTION_FUNCTIONS._global_mapping.items()
             if str(getattr(f, "__module__", "")).startswith("transformers.")]
    try:
        from transformers import modeling_flash_attention_utils as fa

        funcs.append(("flash (varlen)", fa._flash_attention_forward))
    except (ImportError, AttributeError):  # pragma: no cover - every supported version has it
        pass
    for name, f in funcs:
        for p in _parameters(f):
            if p not in _POSITIONAL:
                out.setdefault(p, f"a parameter of transformers' {name} attention function")
    return out


def declared_passthrough_keywords() -> dict[str, str]:
    """Keywords transformers declares for a model's forward that do not concern attention, read from the installed
    version: the keys of ``TransformersKwargs`` and ``FlashAttentionKwargs`` (typed dicts every model's
    ``**kwargs`` is annotated with), the optional parameters of the loss functions (``LOSS_MAPPING``: models pass
    their ``**kwargs`` to the loss and to the layers alike, e.g. ``shift_labels``), and the cache argument."""
    out: dict[str, str] = {}
    from transformers.utils import generic

    dicts = [getattr(generic, "TransformersKwargs", None)]
    try:
        from transformers import modeling_flash_attention_utils as fa

        dicts.append(getattr(fa, "FlashAttentionKwargs", None))
    except ImportError:  # pragma: no cover
        pass
    for td in dicts:
        keys = getattr(td, "__required_keys__", frozenset()) | getattr(td, "__optional_keys__", frozenset())
        for k in sorted(keys):
            out.setdefault(k, f"declared in transformers' {td.__name__}")
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:  # pragma: no cover
        LOSS_MAPPING = {}
    for fn in LOSS_MAPPING.values():
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            continue
        for p in params:
            if p.default is not p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                out.setdefault(p.name, f"a parameter of transformers' loss function {fn.__name__}")
    for name in CACHE_ARGUMENTS:
        out.setdefault(name, "the KV cache: the module updates it before calling the attention function")
    return out


def keyword_roles(implemented: frozenset[str], ignored: Mapping[str, str],
                  refused: Mapping[str, str] | None = None) -> dict[str, KeywordRole]:
    """The role of every keyword transformers declares, given what hf_attnorm implements and deliberately ignores
    (``families.IMPLEMENTED_KEYWORDS`` / ``IGNORED_KEYWORDS``): implemented > ignored (with its reason) > a
    parameter of transformers' attention functions (refused: it would change attention) or a keyword of a module's
    own call whose meaning is known but not implemented (``refused``, ``families.UNIMPLEMENTED_KEYWORDS``: refused
    with that reason) > declared elsewhere (passed through, as transformers' own attention functions do). A keyword
    missing from the table is ``unknown_keyword``."""
    roles = {k: KeywordRole(PASSTHROUGH, why) for k, why in declared_passthrough_keywords().items()}
    roles.update({k: KeywordRole(ATTENTION, why) for k, why in attention_function_keywords().items()})
    roles.update({k: KeywordRole(ATTENTION, why) for k, why in (refused or {}).items()})
    roles.update({k: KeywordRole(IGNORED, why) for k, why in ignored.items()})
    roles.update({k: KeywordRole(IMPLEMENTED, "implemented by hf_attnorm") for k in implemented})
    return roles


def unknown_keyword(name: str) -> KeywordRole:
    """The role of a keyword transformers does not declare: refused, since it could change what attention computes."""
    return KeywordRole(UNKNOWN, f"transformers {transformers.__version__} declares no keyword {name!r} in its "
                                "attention functions, TransformersKwargs, FlashAttentionKwargs or loss functions")


# ------------------------------------------------------------------------------------------------ continuous batching

_CB = "transformers.generation.continuous_batching"
#: the first transformers on which continuous batching was checked to run hf_attnorm's implementations (5.18 and
#: older pass the paged cache to transformers' ``paged|`` attention functions instead: refused there)
CONTINUOUS_BATCHING_CHECKED = "5.24.0"

#: (class path, method) of continuous batching's one entry point (``generate_batch`` and the context manager go
#: through it; ``transformers serve`` builds the same manager without it)
CONTINUOUS_BATCHING_ENTRY = (f"{_CB}.continuous_api.ContinuousMixin", "init_continuous_batching")
#: (class path, method): the manager's check of the model's implementation name, called when a manager is built or
#: reused. It accepts only ``paged|eager``, ``sdpa`` or flash names, and first switches sdpa/eager models (and would
#: switch ours) to flash attention where it is installed: hooked so that an hf_attnorm name passes unchanged
CONTINUOUS_BATCHING_SWITCH = (f"{_CB}.continuous_api.ContinuousBatchingManager", "switch_to_cb_friendly_attn")
#: (class path, method that starts the manager's thread, the method it runs there): a new thread starts in an empty
#: context, so the caller's ``record_paths`` would not see the calls it makes for the caller; hooked so that the thread
#: runs in a copy of the starting thread's context (as an asyncio task does), for models running ours
CONTINUOUS_BATCHING_THREAD = (f"{_CB}.continuous_api.ContinuousBatchingManager", "start", "_run_generation_loop")
#: (module, function): whether the manager builds attention masks (the sdpa route: packed queries, keys gathered
#: per sequence, one block-diagonal mask) or leaves them to flash's varlen metadata; it decides by name
#: (``paged|eager``, ``sdpa``) and is imported by name into the modules that build the batch: hooked in each of them
#: so that an hf_attnorm name gets the masks
CONTINUOUS_BATCHING_MASKS = (f"{_CB}.utils", "attn_mask_is_needed")
#: (module, class): the cache the manager passes to the model; an attention module that receives it is running a
#: packed continuous-batching call
PAGED_CACHE = (f"{_CB}.cache", "PagedAttentionCache")
#: (module, typed dict): the keywords the manager passes to the model, which models hand down to the attention
#: function
PAGED_ARGUMENTS = (f"{_CB}.input_outputs", "PagedAttentionArgs")
#: the paged cache's update as the attention module calls it (5.24): it stores the new keys/values, returns every
#: scheduled sequence's keys/values gathered and selects the layer's ``cu_seq_lens_k`` in ``kwargs``. Before, the
#: cache reached transformers' ``paged|`` attention functions, which updated it themselves: an attention function of
#: ours would get the new keys only, so such a version is treated as lacking the integration's names
PAGED_CACHE_UPDATE = ("update", ("key_states", "value_states", "layer_idx", "kwargs"))

#: keywords of the manager's packed calls that the attention function takes on that route only (elsewhere they keep
#: the role ``keyword_roles`` gives them), each with why it changes nothing hf_attnorm computes; ``block_table`` is
#: taken only when None (``forward.py`` refuses a table: the keys were then not gathered)
CONTINUOUS_BATCHING_KEYWORDS: dict[str, str] = {
    "read_index": "the paged cache's read positions: PagedAttentionCache.update already gathered the keys/values "
                  "the function receives",
    "write_index": "the paged cache's write positions: PagedAttentionCache.update already stored the new keys/values",
    "block_table": "None on the sdpa route (the keys are gathered); a table is refused",
    "logits_indices": "the rows whose logits are sampled: read after the model",
    "logits_processor_args": "per-request sampling arguments: read after the model",
    "cu_seq_lens_q": "the packed sequences' query boundaries (also in the block-diagonal mask)",
    "cu_seq_lens_k": "the packed sequences' key boundaries (also in the block-diagonal mask)",
    "max_length_q": "the longest packed query run (flash's varlen metadata)",
    "max_length_k": "the longest packed key run (flash's varlen metadata)",
}


def _resolve(path: str, name: str) -> Any:
    """``path.name`` (a module attribute, or a class's attribute for ``module.Class`` paths), None when missing."""
    module_name, cls_name = path, None
    while module_name:
        try:
            module = __import__(module_name, fromlist=["_"])
            break
        except ImportError:
            module_name, _, tail = module_name.rpartition(".")
            cls_name = tail if cls_name is None else f"{tail}.{cls_name}"
    else:
        return None
    owner: Any = module
    for part in (cls_name.split(".") if cls_name else ()):
        owner = getattr(owner, part, None)
    return None if owner is None else getattr(owner, name, None)


def continuous_batching_owner() -> type | None:
    """The class defining continuous batching's entry point on the installed transformers, or None."""
    path, entry = CONTINUOUS_BATCHING_ENTRY
    module_name, _, cls_name = path.rpartition(".")
    cls = _resolve(module_name, cls_name)
    return cls if isinstance(cls, type) and hasattr(cls, entry) else None


#: what ``python -m hf_attnorm serve`` needs of transformers: the check for its serving extra and the server package
#: of ``transformers serve`` (cli/serving/: ModelManager, the generation managers; transformers 5.17 and later)
SERVE_AVAILABLE = ("transformers.utils.import_utils", "is_serve_available")
SERVE_PACKAGE = "transformers.cli.serving"


def serve_missing() -> list[str]:
    """The transformers names ``python -m hf_attnorm serve`` relies on that the installed version lacks (empty when
    every one is there); found without importing the server, whose modules need the serving extra."""
    missing = [] if _resolve(*SERVE_AVAILABLE) is not None else [".".join(SERVE_AVAILABLE)]
    try:
        found = importlib.util.find_spec(SERVE_PACKAGE) is not None
    except ImportError:
        found = False
    return missing + ([] if found else [SERVE_PACKAGE])


def serve_extra_installed() -> bool:
    """Whether transformers serve's own extra (fastapi, uvicorn, pydantic, openai) is installed (False when the
    installed transformers has no such check: see ``serve_missing``)."""
    available = _resolve(*SERVE_AVAILABLE)
    return bool(available is not None and available())


# What the serve command's guard (hf_attnorm/serve_guard.py) reads of transformers serve's server, without forking
# it: the app factory it wraps and the generation objects the factory receives.
_SERVING = "transformers.cli.serving"
#: (module, function): the factory of transformers serve's FastAPI app, imported by name inside ``Serve.__init__``
#: (cli/serve.py) after the model is loaded and before uvicorn starts: wrapped while the command builds its server,
#: so that the guard's middleware sits in front of the app and the kernels are built before the port opens
SERVE_APP_FACTORY = (f"{_SERVING}.server", "build_server")
#: the factory's parameters the guard reads (the objects are transformers serve's own)
SERVE_APP_ARGUMENTS = ("model_manager", "generation_state", "chat_handler", "completion_handler", "response_handler")
#: (class path, methods): the per-model generation managers' entry points, which receive the tokenized prompt and the
#: request's ``GenerationConfig`` (the guard checks the lengths there) and are wrapped per manager instance
SERVE_GENERATE = (f"{_SERVING}.utils.BaseGenerateManager", ("generate_streaming", "generate_non_streaming"))
#: (class path, methods): the shared generation state: ``get_manager(model_id, use_cb=...)`` hands out the managers
#: (wrapped per instance), ``is_cb_alive()`` is what /health answers, ``shutdown()`` stops (and forgets) the
#: continuous-batching manager, so that the next request starts a new one
SERVE_GENERATION_STATE = (f"{_SERVING}.utils.GenerationState", ("get_manager", "is_cb_alive", "shutdown"))
#: (class path, attribute): the continuous-batching generation manager of transformers serve and the attribute that
#: holds its ``ContinuousBatchingManager`` (None before its first request)
SERVE_CB_MANAGER = (f"{_SERVING}.utils.CBGenerateManager", "_cb")
#: the attribute of ``GenerationState`` that holds that manager (None until continuous batching's first request)
SERVE_CB_STATE_ATTRIBUTE = "_cb_manager"
#: the attribute of a request handler naming the typed dict of the fields it accepts (read to say what is allowed
#: when transformers serve refuses an unknown field)
SERVE_HANDLER_FIELDS = "_valid_params_class"


#: (class path, hidden option, its ``__init__`` parameter): transformers serve's command object (cli/serve.py). Run
#: with the hidden ``--non-blocking`` it starts uvicorn in a thread and returns itself, holding what the serve command
#: stops: ``SERVE_OBJECT_ATTRIBUTES``, and ``SERVE_STOP`` (stops the generation managers and unloads the model)
SERVE_COMMAND = ("transformers.cli.serve.Serve", "--non-blocking", "non_blocking")
#: the attributes of that object the serve command reads: uvicorn's thread, uvicorn's ``Server`` (``should_exit``,
#: ``force_exit``) and the shared ``GenerationState``; set by its methods (``__init__``, the server's start)
SERVE_OBJECT_ATTRIBUTES = ("_thread", "server", "_generation_state")
SERVE_STOP = "kill_server"


def _class(path: str) -> type | None:
    module_name, _, cls_name = path.rpartition(".")
    cls = _resolve(module_name, cls_name)
    return cls if isinstance(cls, type) else None


def serve_guard_missing() -> list[str]:
    """The names of transformers serve's server that the serve command's guard relies on and the installed version
    lacks (empty when every one is there). Imports the server: call it only when ``serve_extra_installed()``."""
    module, name = SERVE_APP_FACTORY
    factory = _resolve(module, name)
    missing = [] if factory is not None else [f"{module}.{name}"]
    if factory is not None:
        params = _parameters(factory)
        missing += [f"{module}.{name}({p})" for p in SERVE_APP_ARGUMENTS if p not in params]
    for path, methods in (SERVE_GENERATE, SERVE_GENERATION_STATE):
        cls = _class(path)
        missing += [f"{path}.{m}" for m in methods if cls is None or not callable(getattr(cls, m, None))]
    if _class(SERVE_CB_MANAGER[0]) is None:
        missing.append(SERVE_CB_MANAGER[0])
    path, option, parameter = SERVE_COMMAND
    command = _class(path)
    if command is None:
        return [*missing, path]
    if parameter not in _parameters(command.__init__):
        missing.append(f"{path}({parameter}) (the hidden {option})")
    if not callable(getattr(command, SERVE_STOP, None)):
        missing.append(f"{path}.{SERVE_STOP}")
    try:  # (instance attributes: assigned in the class's source)
        source = inspect.getsource(command)
    except (OSError, TypeError):  # pragma: no cover - no source shipped: checked when read (serve_object_attribute)
        source = None
    if source is not None:
        missing += [f"{path}.{a}" for a in SERVE_OBJECT_ATTRIBUTES if f"self.{a} =" not in source]
    return missing


def serve_object_attribute(server: Any, name: str) -> Any:
    """Attribute ``name`` (one of ``SERVE_OBJECT_ATTRIBUTES``) of the object transformers serve's command returned;
    an ``AttnormError`` naming it when this transformers does not set it."""
    if name not in SERVE_OBJECT_ATTRIBUTES:
        raise ValueError(f"{name!r} is not one of {SERVE_OBJECT_ATTRIBUTES}")
    value = getattr(server, name, None)
    if value is None:
        raise AttnormError(f"transformers serve's {SERVE_COMMAND[0]} object has no {name!r} (transformers "
                           f"{transformers.__version__}); python -m hf_attnorm serve needs it to stop the server")
    return value


def serve_stop(server: Any) -> None:
    """Stop transformers serve's generation managers and unload the model (``SERVE_STOP`` of its command object)."""
    getattr(server, SERVE_STOP)()


def serve_app_factory() -> tuple[types.ModuleType, str]:
    """(the module, the name) of transformers serve's app factory, for wrapping it while a server is built."""
    module, name = SERVE_APP_FACTORY
    return importlib.import_module(module), name


def serve_continuous_batching(manager: Any) -> Any | None:
    """The ``ContinuousBatchingManager`` of one of transformers serve's generation managers: None for its sequential
    manager, and for a continuous-batching one before its first request."""
    cls = _class(SERVE_CB_MANAGER[0])
    if cls is None or not isinstance(manager, cls):
        return None
    return getattr(manager, SERVE_CB_MANAGER[1], None)


def serve_is_continuous_batching(manager: Any) -> bool:
    """Whether ``manager`` is transformers serve's continuous-batching generation manager."""
    cls = _class(SERVE_CB_MANAGER[0])
    return cls is not None and isinstance(manager, cls)


def serve_stop_continuous_batching(generation_state: Any, timeout: float = 5.0) -> None:
    """Stop the continuous-batching worker of transformers serve's ``GenerationState`` now (a hard stop: the requests
    it holds are dropped) and detach it from its generation manager, whose own ``stop`` (a flush, 2 s, after which
    the worker's non-daemon thread runs on) then has nothing left to do."""
    manager = getattr(generation_state, SERVE_CB_STATE_ATTRIBUTE, None)
    cb = serve_continuous_batching(manager)
    if cb is None:
        return
    cb.stop(block=True, timeout=timeout, hard_stop=True)
    setattr(manager, SERVE_CB_MANAGER[1], None)


def serve_worker_error(generation_state: Any) -> BaseException | None:
    """The error that ended the continuous-batching worker of transformers serve's ``GenerationState`` (None while it
    runs, or before it started)."""
    cb = serve_continuous_batching(getattr(generation_state, SERVE_CB_STATE_ATTRIBUTE, None))
    status = getattr(cb, "background_thread_status", None)
    return getattr(status, "fatal_error", None)


def serve_cache_tokens(cb: Any) -> int | None:
    """How many tokens the paged KV cache of a running ``ContinuousBatchingManager`` holds (its blocks times their
    page size), the most one request can occupy; None before its cache exists."""
    processor = getattr(cb, "batch_processor", None)
    cache = getattr(processor, "cache", None)
    blocks = getattr(cache, "num_blocks", None)
    page = getattr(getattr(cb, "continuous_batching_config", None), "page_size", None)
    return blocks * page if isinstance(blocks, int) and isinstance(page, int) else None


def serve_app_routes() -> list[tuple[str, tuple[str, ...], str]]:
    """(path, HTTP methods, endpoint function) of every route of transformers serve's app as the installed version
    builds it: its factory is called with no model (the routes only close over the objects it receives). Imports the
    server: call it only when ``serve_extra_installed()``."""
    module, name = serve_app_factory()
    factory = getattr(module, name)
    params = inspect.signature(factory).parameters.values()
    app = factory(**{p.name: None for p in params if p.default is p.empty})
    routes: dict[str, tuple[set[str], str]] = {}
    for route in app.routes:
        methods = getattr(route, "methods", None)
        if methods is None:
            continue
        found = routes.setdefault(route.path, (set(), getattr(route.endpoint, "__name__", "")))
        found[0].update(m for m in methods if m != "HEAD" or "GET" not in methods)
    return [(path, tuple(sorted(found[0])), found[1]) for path, found in routes.items()]


def serve_handler_fields(handler: Any) -> list[str]:
    """The request fields a transformers serve handler accepts (its typed dict's keys; [] when unknown)."""
    typed = getattr(handler, SERVE_HANDLER_FIELDS, None)
    keys = getattr(typed, "__required_keys__", frozenset()) | getattr(typed, "__optional_keys__", frozenset())
    return sorted(keys)


def continuous_batching_missing() -> list[str]:
    """The transformers names the continuous-batching integration relies on that the installed version lacks (each
    as ``path.name``; empty when every one is there)."""
    missing = [f"{path}.{name}" for path, name in (CONTINUOUS_BATCHING_ENTRY, CONTINUOUS_BATCHING_SWITCH,
                                                   CONTINUOUS_BATCHING_MASKS, PAGED_CACHE, PAGED_ARGUMENTS)
               if _resolve(path, name) is None]
    if not missing and not paged_arguments():
        missing.append(f"{'.'.join(PAGED_ARGUMENTS)} (keys)")
    method, params = PAGED_CACHE_UPDATE
    update = _resolve(f"{PAGED_CACHE[0]}.{PAGED_CACHE[1]}", method)
    if update is not None and not all(p in _parameters(update) for p in params):
        missing.append(f"{'.'.join(PAGED_CACHE)}.{method}({', '.join(params)})")
    return missing


#: what ``hook_continuous_batching`` read from the installed transformers, so that every call looks it up without
#: importing anything (also inside torch.compile's graphs): the paged cache's class, the keywords packed calls take
_PAGED_CACHE_CLASS: type | None = None
_PACKED_KEYWORDS: Mapping[str, str] = types.MappingProxyType({})


def paged_cache_in_call(args: tuple, kwargs: Mapping[str, Any]) -> bool:
    """Whether an attention module's call (as read by a forward pre-hook with kwargs) received continuous batching's
    paged cache, under one of ``CACHE_ARGUMENTS`` or positionally (False before ``hook_continuous_batching``)."""
    cls = _PAGED_CACHE_CLASS
    if cls is None:
        return False
    return any(isinstance(kwargs.get(n), cls) for n in CACHE_ARGUMENTS) or any(isinstance(a, cls) for a in args)


def packed_keywords() -> Mapping[str, str]:
    """``continuous_batching_keywords()`` as read when continuous batching was hooked (empty before)."""
    return _PACKED_KEYWORDS


def paged_arguments() -> frozenset[str]:
    """The keywords the manager passes to the model (``PagedAttentionArgs``' keys; empty when it is missing)."""
    td = _resolve(*PAGED_ARGUMENTS)
    return frozenset(getattr(td, "__required_keys__", frozenset()) | getattr(td, "__optional_keys__", frozenset()))


def continuous_batching_keywords() -> Mapping[str, str]:
    """``CONTINUOUS_BATCHING_KEYWORDS`` that the installed version's manager passes (a keyword it no longer passes
    is not accepted; one it adds is not in the table, so it stays refused until its meaning is known)."""
    passed = paged_arguments()
    return types.MappingProxyType({k: why for k, why in CONTINUOUS_BATCHING_KEYWORDS.items() if k in passed})


def hook_continuous_batching(prepare: Callable[[Any], bool], runs_packed: Callable[[Any], bool]) -> list[str]:
    """Let the continuous-batching manager run models of ours on its sdpa route under their own implementation name.
    Its name check calls ``prepare(model)`` whenever a manager is built or reused: True (the model runs ours, and
    ``prepare`` made it ready or raised) leaves the model unswitched (no flash attention, no refusal, nothing to
    restore); False runs transformers' own check. Its mask decision builds masks where ``runs_packed(config)``, so
    the attention function gets the packed call. Returns the names hooked (``switch_to_cb_friendly_attn``,
    ``attn_mask_is_needed``), or [] and hooks nothing when the installed transformers lacks a name relied on
    (``continuous_batching_missing``)."""
    global _PAGED_CACHE_CLASS, _PACKED_KEYWORDS
    if continuous_batching_missing():
        return []
    _PAGED_CACHE_CLASS, _PACKED_KEYWORDS = _resolve(*PAGED_CACHE), continuous_batching_keywords()
    manager_path, switch_name = CONTINUOUS_BATCHING_SWITCH
    module_name, _, cls_name = manager_path.rpartition(".")
    manager = _resolve(module_name, cls_name)

    def make_switch(orig: Callable[..., Any]) -> Callable[..., Any]:
        def switch_to_cb_friendly_attn(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
            if prepare(model):
                return None  # the model's own implementation takes the sdpa route: nothing to switch or restore
            return orig(self, model, *args, **kwargs)

        return switch_to_cb_friendly_attn

    hook(manager, switch_name, make_switch)
    masks_module, masks_name = CONTINUOUS_BATCHING_MASKS
    orig_masks = _resolve(masks_module, masks_name)

    @functools.wraps(orig_masks)
    def attn_mask_is_needed(config: Any, *args: Any, **kwargs: Any) -> bool:
        return runs_packed(config) or orig_masks(config, *args, **kwargs)

    # every module of the package that imported the function by name (input_outputs builds the batch)
    for name, module in list(sys.modules.items()):
        if (name == _CB or name.startswith(_CB + ".")) and getattr(module, masks_name, None) is orig_masks:
            setattr(module, masks_name, attn_mask_is_needed)
    return [switch_name, masks_name]


def hook_manager_thread_context(applies: Callable[[Any], bool]) -> bool:
    """Run the continuous-batching manager's thread (``CONTINUOUS_BATCHING_THREAD``) in a copy of the context of
    the thread that starts it, for managers whose model ``applies`` (``applies(model)``): context-local state of the
    caller (``record_paths``' records) then covers the calls the manager makes for it. False, hooking nothing, when
    the installed transformers lacks either method (the records then miss the manager's calls)."""
    path, start_name, loop_name = CONTINUOUS_BATCHING_THREAD
    module_name, _, cls_name = path.rpartition(".")
    manager = _resolve(module_name, cls_name)
    if manager is None or not callable(getattr(manager, loop_name, None)):
        return False

    def make_start(orig: Callable[..., Any]) -> Callable[..., Any]:
        def start(self: Any, *args: Any, **kwargs: Any) -> Any:
            if applies(getattr(self, "model", None)):
                # the thread's target is looked up on the instance: the class's method, run in this context's copy
                loop = getattr(type(self), loop_name).__get__(self)
                self.__dict__[loop_name] = functools.partial(contextvars.copy_context().run, loop)
            else:
                self.__dict__.pop(loop_name, None)
            return orig(self, *args, **kwargs)

        return start

    return hook(manager, start_name, make_start)
