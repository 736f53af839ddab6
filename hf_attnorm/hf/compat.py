"""Which transformers versions the integration runs on, how it stays out of the way of the others, and every
convention of transformers' call path that the integration reads (the ONE place that reads them):

* the argument that carries the KV cache into an attention module (``cache`` since 5.24, ``past_key_values``
  before) and the cache's layer API the cache-bound states use (``cache_of_call``, ``cache_layer``,
  ``plain_dynamic_layer``, ``layer_tensors``);
* what a keyword reaching the attention function means (``keyword_roles``): read from transformers' own
  declarations (its attention functions' parameters, the ``TransformersKwargs``/``FlashAttentionKwargs`` typed
  dicts, the loss functions' parameters) of the installed version, not from a list frozen at one release;
* the continuous-batching entry point (``CONTINUOUS_BATCHING_ENTRY``), which runs only transformers' own
  implementations.

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

import dataclasses
import functools
import inspect
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
    return next((a for a in args if isinstance(a, Cache)), None)


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


def keyword_roles(implemented: frozenset[str], ignored: Mapping[str, str]) -> dict[str, KeywordRole]:
    """The role of every keyword transformers declares, given what hf_attnorm implements and deliberately ignores
    (``families.IMPLEMENTED_KEYWORDS`` / ``IGNORED_KEYWORDS``): implemented > ignored (with its reason) > a
    parameter of transformers' attention functions (refused: it would change attention) > declared elsewhere
    (passed through, as transformers' own attention functions do). A keyword missing from the table is
    ``unknown_keyword``."""
    roles = {k: KeywordRole(PASSTHROUGH, why) for k, why in declared_passthrough_keywords().items()}
    roles.update({k: KeywordRole(ATTENTION, why) for k, why in attention_function_keywords().items()})
    roles.update({k: KeywordRole(IGNORED, why) for k, why in ignored.items()})
    roles.update({k: KeywordRole(IMPLEMENTED, "implemented by hf_attnorm") for k in implemented})
    return roles


def unknown_keyword(name: str) -> KeywordRole:
    """The role of a keyword transformers does not declare: refused, since it could change what attention computes."""
    return KeywordRole(UNKNOWN, f"transformers {transformers.__version__} declares no keyword {name!r} in its "
                                "attention functions, TransformersKwargs, FlashAttentionKwargs or loss functions")


# ------------------------------------------------------------------------------------------------ continuous batching

#: (class path, method) of continuous batching's one entry point (``generate_batch``, the context manager and
#: ``transformers serve`` all go through it); it runs only transformers' own implementations
CONTINUOUS_BATCHING_ENTRY = ("transformers.generation.continuous_batching.continuous_api.ContinuousMixin",
                             "init_continuous_batching")


def continuous_batching_owner() -> type | None:
    """The class defining continuous batching's entry point on the installed transformers, or None."""
    module_name, _, cls_name = CONTINUOUS_BATCHING_ENTRY[0].rpartition(".")
    try:
        module = __import__(module_name, fromlist=[cls_name])
    except ImportError:
        return None
    cls = getattr(module, cls_name, None)
    return cls if isinstance(cls, type) and hasattr(cls, CONTINUOUS_BATCHING_ENTRY[1]) else None
