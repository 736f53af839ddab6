"""Registration with transformers and the few hooks that make settings and parameters follow the model.

Importing ``hf_attnorm`` calls ``register()`` once:

* every preset name goes into ``AttentionInterface`` (our function) AND ``AttentionMaskInterface`` (``sdpa_mask``):
  without a mask function a custom name receives ``attention_mask=None`` always and silently loses padding;
* ``PreTrainedModel.post_init`` / ``set_attn_implementation`` are wrapped so the attention modules of a model whose
  implementation is ours get an ``AttnormState`` child (settings + learnable per-head parameters) right away, so an
  optimizer built after ``from_pretrained`` trains them;
* ``PreTrainedModel._initialize_weights`` initialises those parameters from the settings when a checkpoint lacks
  them (a plain checkpoint), ``from_pretrained`` accepts ``attnorm={...}``, and an attention implementation left
  unset comes from a saved ``config.attnorm`` (see ``persistence.py`` for saving and verification).

Model families differ in a few facts only; they are read from attributes every supported attention module has
(``config``, ``is_causal``, ``scaling``, the head count) — see ``MODULE_FACTS``.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

from .attention import AttnormState, forward_for
from .config import AttnormSettings, resolve_settings
from .registry import PRESETS, AttnormError

logger = logging.getLogger("hf_attnorm")

#: prefix under which the implementation name is written into config.json, so that loading without
#: ``import hf_attnorm`` fails with an error that names the package instead of silently running sdpa
CONFIG_PREFIX = "hf_attnorm:"

#: how each family's attention module exposes its head count (the other facts are common attributes)
MODULE_FACTS: dict[str, str] = {
    "GPT2Attention": "num_heads",
    "BertSelfAttention": "num_attention_heads",
    "BertCrossAttention": "num_attention_heads",
    "LlamaAttention": "config.num_attention_heads",
}

#: settings passed as ``from_pretrained(..., attnorm={...})`` while that call builds the model
_PENDING: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar("hf_attnorm_pending", default=None)

_REGISTERED = False


def canonical(name: object) -> object:
    """Strip the config.json prefix: ``"hf_attnorm:symax"`` -> ``"symax"``."""
    if isinstance(name, str) and name.startswith(CONFIG_PREFIX):
        return name[len(CONFIG_PREFIX):]
    return name


def is_ours(name: object) -> bool:
    return isinstance(name, str) and canonical(name) in PRESETS


def attention_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Modules that call the attention interface: they carry ``config``, ``is_causal`` and ``scaling``."""
    for name, mod in model.named_modules():
        if isinstance(mod, AttnormState):
            continue
        if hasattr(mod, "config") and hasattr(mod, "is_causal") and hasattr(mod, "scaling") and not hasattr(
            mod, "post_init"
        ):
            yield name, mod


def num_heads_of(module: nn.Module) -> int:
    attr = MODULE_FACTS.get(type(module).__name__)
    if attr is not None:
        obj: Any = module
        for part in attr.split("."):
            obj = getattr(obj, part)
        return int(obj)
    for attr in ("num_heads", "num_attention_heads"):
        if isinstance(getattr(module, attr, None), int):
            return int(getattr(module, attr))
    return int(module.config.num_attention_heads)


def module_info(module: nn.Module) -> dict[str, Any]:
    cfg = module.config
    max_pos = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    return {"max_positions": max_pos, "family": type(module).__name__,
            "layer_idx": getattr(module, "layer_idx", None), "num_heads": num_heads_of(module),
            "head_dim": getattr(module, "head_dim", None) or getattr(module, "attention_head_size", None)}


def settings_for(config: Any, implementation: str) -> AttnormSettings:
    """Resolve the settings of ``config`` for ``implementation`` and store them back (full dict) in
    ``config.attnorm``. Saved settings of the same implementation and user overrides (no ``implementation`` key)
    apply; settings saved for another implementation are replaced by that implementation's preset."""
    pending = _PENDING.get()
    if pending is not None:
        config.attnorm = dict(pending)
    raw = getattr(config, "attnorm", None)
    if isinstance(raw, AttnormSettings):
        raw = raw.to_dict()
    if raw is None:
        overrides: dict[str, Any] = {}
    elif not isinstance(raw, Mapping):
        raise AttnormError(f"config.attnorm must be a dict of settings, got {type(raw).__name__}")
    elif raw.get("implementation", implementation) == implementation:
        overrides = {k: v for k, v in raw.items() if k != "implementation"}
    else:
        logger.info("hf_attnorm: config.attnorm was saved for %r; using the %r preset", raw["implementation"],
                    implementation)
        overrides = {}
    settings = resolve_settings(implementation, overrides)
    config.attnorm = settings.to_dict()
    return settings


def install(module: nn.Module, settings: AttnormSettings) -> AttnormState:
    """Attach (or update) ``module.attnorm``. Learnable values whose settings did not change keep their values."""
    old = module._modules.get("attnorm")
    if isinstance(old, AttnormState) and old.settings == settings:
        return old
    ref = next((p for p in module.parameters(recurse=False)), None) or next(iter(module.parameters()), None)
    state = AttnormState(settings, num_heads_of(module), module_info(module))
    if ref is not None:
        state.to(device=ref.device)
    if isinstance(old, AttnormState):
        from .attention import param_specs

        old_specs = {s.name: s for s in param_specs(old.settings)}
        for spec in param_specs(settings):
            prev = old._parameters.get(spec.name)
            same = spec.name in old_specs and spec.init_value(old.settings) == spec.init_value(settings)
            if prev is not None and spec.name in state._parameters and same:
                state._parameters[spec.name] = prev  # keep the learned value (and the optimizer's reference)
    module.attnorm = state
    return state


def uninstall(module: nn.Module) -> None:
    if isinstance(module._modules.get("attnorm"), AttnormState):
        del module._modules["attnorm"]


def sync_model(model: nn.Module, explicit: bool = False) -> None:
    """Make the attention modules of ``model`` match ``model.config``'s implementation and settings.

    ``explicit``: the user switched implementations with ``set_attn_implementation``; leaving hf_attnorm then warns
    only when learned parameters are dropped (a checkpoint loaded with another implementation always warns)."""
    config = getattr(model, "config", None)
    if config is None:
        return
    impl = canonical(config._attn_implementation)
    if is_ours(impl):
        settings = settings_for(config, impl)
        for _, mod in attention_modules(model):
            if mod.config is config or canonical(mod.config._attn_implementation) == impl:
                install(mod, settings)
        return
    learned = [n for n, p in model.named_parameters() if ".attnorm." in n]
    if getattr(config, "attnorm", None) is not None and (learned or not explicit):
        raw = config.attnorm
        name = raw.get("implementation") if isinstance(raw, Mapping) else raw
        warnings.warn(
            f"hf_attnorm: this model's config holds hf_attnorm settings ({name!r}), but its attention "
            f"implementation is {impl!r}: it now computes {impl!r} attention, not {name!r}. The settings and any "
            "learned normalizer parameters are dropped.",
            stacklevel=3,
        )
    if getattr(config, "attnorm", None) is not None:
        del config.attnorm
    for _, mod in attention_modules(model):
        uninstall(mod)


_warned_lazy: set[str] = set()


def ensure_state(module: nn.Module, implementation: str) -> AttnormState:
    """The module's state for ``implementation``; built on first use if the model was never synced (e.g. its
    config._attn_implementation was assigned directly)."""
    state = module._modules.get("attnorm")
    if isinstance(state, AttnormState) and state.settings.implementation == implementation:
        return state
    settings = settings_for(module.config, implementation)
    state = install(module, settings)
    if state.learnable_names() and implementation not in _warned_lazy:
        _warned_lazy.add(implementation)
        warnings.warn(
            f"hf_attnorm: learnable parameters {state.learnable_names()} of {implementation!r} were created at the "
            "first forward pass because the model was not set up through from_pretrained/set_attn_implementation/"
            "hf_attnorm.apply; an optimizer built before this call does not train them.",
            stacklevel=3,
        )
    return state


def apply(model: nn.Module, implementation: str, **options: Any) -> nn.Module:
    """Switch ``model`` to ``implementation`` with the given attnorm options, e.g.
    ``hf_attnorm.apply(model, "softmax", scale="ssmax", ssmax_s=0.5)``. Returns the model."""
    if not is_ours(implementation):
        raise AttnormError(f"{implementation!r} is not an hf_attnorm implementation; registered: {', '.join(PRESETS)}")
    resolve_settings(implementation, options)  # validate before touching the model
    model.config.attnorm = {"implementation": implementation, **options}
    model.set_attn_implementation(implementation)
    sync_model(model, explicit=True)
    return model


# ------------------------------------------------------------------------------------------------ transformers hooks


def register() -> None:
    """Register every preset with transformers and install the hooks (idempotent)."""
    global _REGISTERED
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for name in PRESETS:
        AttentionInterface.register(name, forward_for(name))
        AttentionMaskInterface.register(name, sdpa_mask)
    if _REGISTERED:
        return
    _REGISTERED = True

    orig_check = PreTrainedModel._check_and_adjust_attn_implementation

    @functools.wraps(orig_check)
    def check(self, attn_implementation, is_init_check: bool = False, allow_all_kernels: bool = False):
        if isinstance(attn_implementation, str) and attn_implementation.startswith(CONFIG_PREFIX):
            if not is_ours(attn_implementation):
                raise AttnormError(
                    f"the config names hf_attnorm implementation {canonical(attn_implementation)!r}, which this "
                    f"version of hf_attnorm does not know; registered: {', '.join(PRESETS)}"
                )
            attn_implementation = canonical(attn_implementation)
        if attn_implementation is None:
            saved = getattr(self.config, "attnorm", None)
            if isinstance(saved, Mapping) and is_ours(saved.get("implementation")):
                attn_implementation = saved["implementation"]
        return orig_check(self, attn_implementation, is_init_check=is_init_check,
                          allow_all_kernels=allow_all_kernels)

    PreTrainedModel._check_and_adjust_attn_implementation = check

    orig_post_init = PreTrainedModel.post_init

    @functools.wraps(orig_post_init)
    def post_init(self):
        sync_model(self)
        orig_post_init(self)
        # a plain checkpoint lacks our parameters: they are initialised from the settings, not "missing"
        self._keys_to_ignore_on_load_missing = set(self._keys_to_ignore_on_load_missing or ()) | {r"\.attnorm\."}

    PreTrainedModel.post_init = post_init

    orig_set = PreTrainedModel.set_attn_implementation

    @functools.wraps(orig_set)
    def set_attn_implementation(self, attn_implementation, *args, **kwargs):
        if isinstance(attn_implementation, str):
            attn_implementation = canonical(attn_implementation)
        orig_set(self, attn_implementation, *args, **kwargs)
        sync_model(self, explicit=True)

    PreTrainedModel.set_attn_implementation = set_attn_implementation

    orig_init_one = PreTrainedModel._initialize_weights

    @functools.wraps(orig_init_one)
    def _initialize_weights(self, module, *args, **kwargs):
        if isinstance(module, AttnormState):
            if not getattr(module, "_is_hf_initialized", False):
                module.reset_parameters(only_uninitialised=True)
                module._is_hf_initialized = True
            return
        return orig_init_one(self, module, *args, **kwargs)

    PreTrainedModel._initialize_weights = _initialize_weights

    orig_from_pretrained = PreTrainedModel.from_pretrained.__func__

    @functools.wraps(orig_from_pretrained)
    def from_pretrained(cls, *args, attnorm: Mapping[str, Any] | None = None, **kwargs):
        if attnorm is not None and not isinstance(attnorm, Mapping):
            raise AttnormError(f"attnorm= must be a dict of settings, got {type(attnorm).__name__}")
        from .persistence import verify_before_load, verify_loaded

        path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        verify_before_load(path, kwargs)
        token = _PENDING.set(dict(attnorm) if attnorm is not None else None)
        try:
            model = orig_from_pretrained(cls, *args, **kwargs)
        finally:
            _PENDING.reset(token)
        model_ = model[0] if isinstance(model, tuple) else model
        if attnorm is not None and not is_ours(model_.config._attn_implementation):
            raise AttnormError(
                f"attnorm settings were given but the attention implementation is "
                f"{model_.config._attn_implementation!r}; pass attn_implementation= one of {', '.join(PRESETS)}"
            )
        verify_loaded(model_, path, kwargs)
        return model

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)

    orig_save = PreTrainedModel.save_pretrained

    @functools.wraps(orig_save)
    def save_pretrained(self, save_directory, *args, **kwargs):
        result = orig_save(self, save_directory, *args, **kwargs)
        from .persistence import finalize_saved

        finalize_saved(self, save_directory, kwargs)
        return result

    PreTrainedModel.save_pretrained = save_pretrained
