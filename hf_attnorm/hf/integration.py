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

import difflib
import logging
import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn

from ..registry import CONFIG_PREFIX, PRESETS, AttnormError, UnknownNameError, canonical, is_ours
from ..settings import resolve_settings
from . import compat, continuous_batching
from .distributed import materialize_meta_states
from .families import attention_modules, family_of, refusal_reason
from .forward import forward_for
from .persistence import MARKER_PATTERN, finalize_saved, verify_before_load, verify_loaded
from .state import _PENDING, AttnormState, check_config_unchanged, install, settings_for, uninstall

logger = logging.getLogger("hf_attnorm")

_REGISTERED = False
#: the PreTrainedModel methods hooked by ``register()`` (all six on a supported transformers), and continuous
#: batching's entry point and the manager's checks (``continuous_batching.install``)
HOOKED: set[str] = set()


def sync_model(model: nn.Module, explicit: bool = False) -> None:
    """Make the attention modules of ``model`` match ``model.config``'s implementation and settings.

    ``explicit``: the user switched implementations with ``set_attn_implementation``; leaving hf_attnorm then warns
    only when learned parameters are dropped (a checkpoint loaded with another implementation always warns)."""
    config = getattr(model, "config", None)
    if config is None:
        return
    impl = canonical(config._attn_implementation)
    if is_ours(impl):
        refuse_family(model, impl)
        settings = settings_for(config, impl)
        modules = list(attention_modules(model))
        if not modules and getattr(model, "base_model", model) is model and refusal_reason(model) is not None:
            raise AttnormError(f"hf_attnorm cannot run {family_of(model)!r}: {refusal_reason(model)}")
        for _, mod in modules:
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


def refuse_family(model_or_cls: Any, implementation: str) -> None:
    """A clear error, at load and set time, for a family that computes attention itself (it would keep
    computing its own attention, or fail deep inside transformers with a bare KeyError)."""
    reason = refusal_reason(model_or_cls)
    if reason is not None:
        raise AttnormError(f"attn_implementation={implementation!r} is not available for model family "
                           f"{family_of(model_or_cls)!r}: {reason}. Use 'eager' or 'sdpa' with this family.")


def apply(model: nn.Module, implementation: str, **options: Any) -> nn.Module:
    """Switch ``model`` to ``implementation`` with the given attnorm options, e.g.
    ``hf_attnorm.apply(model, "softmax", scale="ssmax", ssmax_s=0.5)``. Returns the model."""
    if not is_ours(implementation):
        raise AttnormError(f"{implementation!r} is not an hf_attnorm implementation; registered: {', '.join(PRESETS)}")
    resolve_settings(implementation, options)  # validate before touching the model
    refuse_family(model, implementation)
    model.config.attnorm = {"implementation": implementation, **options}
    model.set_attn_implementation(implementation)
    sync_model(model, explicit=True)
    return model


# ------------------------------------------------------------------------------------------------ transformers hooks


def register() -> None:
    """Register every preset with transformers and install the hooks (idempotent).

    On a transformers older than ``compat.MIN_TRANSFORMERS`` only a refusal is installed (see ``compat``): our names
    raise an error saying which versions work, every other model is untouched. Every hook passes through whatever
    arguments the hooked version takes, so a changed signature of a private method cannot break models that do not
    use our names (docs/internals.md lists each internal and its guard)."""
    global _REGISTERED
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    reason = compat.unsupported_reason()
    if reason is not None:
        for name in PRESETS:
            AttentionInterface.register(name, compat.refusing_forward(name, reason))
        if not _REGISTERED:
            _REGISTERED = True
            compat.hook(PreTrainedModel, "post_init", lambda orig: _refusing_post_init(orig, reason))
        return
    for name in PRESETS:
        AttentionInterface.register(name, forward_for(name))
        AttentionMaskInterface.register(name, sdpa_mask)
    if _REGISTERED:
        return
    _REGISTERED = True
    hooks = {  # method -> (hook, what is lost without it)
        "_check_and_adjust_attn_implementation": (_check_hook, "a saved config.json naming 'hf_attnorm:<name>' does "
                                                  "not load"),
        "post_init": (_post_init_hook, "models built with our names get no per-head values"),
        "set_attn_implementation": (_set_hook, "set_attn_implementation installs no per-head values"),
        "_initialize_weights": (_initialize_weights_hook, "per-head values missing from a checkpoint are not "
                                "initialised"),
        "from_pretrained": (_from_pretrained_hook, "from_pretrained(attnorm=...) and checkpoint verification"),
        "save_pretrained": (_save_hook, "saved checkpoints lack the hf_attnorm settings"),
    }
    for attr, (make, lost) in hooks.items():
        if compat.hook(PreTrainedModel, attr, make, classmethod_=attr == "from_pretrained"):
            HOOKED.add(attr)
        else:
            warnings.warn(f"hf_attnorm: this transformers ({compat.transformers_version_string()}) has no "
                          f"PreTrainedModel.{attr}: {lost}. Supported: transformers >= {compat.MIN_TRANSFORMERS}, "
                          f"tested up to {compat.TESTED_NEWEST}.", stacklevel=2)
    HOOKED.update(continuous_batching.install())


def _refusing_post_init(orig, reason: str):
    def post_init(self, *args, **kwargs):
        impl = canonical(getattr(getattr(self, "config", None), "_attn_implementation", None))
        if is_ours(impl):
            raise AttnormError(f"attention implementation {impl!r}: {reason}")
        return orig(self, *args, **kwargs)

    return post_init


def _check_hook(orig):
    """``_check_and_adjust_attn_implementation`` (private; called by ``__init__`` and ``set_attn_implementation``):
    reads ``"hf_attnorm:<name>"`` from a saved config.json, and an unset implementation from ``config.attnorm``."""

    def check(self, attn_implementation, *args, **kwargs):
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
        if isinstance(attn_implementation, str) and is_ours(attn_implementation):
            refuse_family(self, attn_implementation)
        elif isinstance(attn_implementation, str):
            refuse_unknown_name(attn_implementation)
        return orig(self, attn_implementation, *args, **kwargs)

    return check


def refuse_unknown_name(name: str) -> None:
    """A name neither hf_attnorm nor transformers knows (``"symx"``) raises with the closest registered names in the
    first line; transformers' own list names none of ours. Names transformers resolves itself (its registered
    functions, flash/flex/paged variants, hub kernels ``org/repo``) pass through to its check."""
    from transformers import AttentionInterface

    known = ["eager", *AttentionInterface().valid_keys()]
    if name in known or "/" in name or name.startswith("paged|") or "flash" in name or "flex" in name:
        return
    ours = list(PRESETS)
    close = difflib.get_close_matches(name, ours + [k for k in known if k not in ours], n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
    raise UnknownNameError(
        f"attn_implementation={name!r} is not registered; {hint}hf_attnorm implementations: {', '.join(ours)}; "
        f"transformers' own: {', '.join(k for k in known if k not in ours)} (hf_attnorm.available() describes ours)"
    )


def _post_init_hook(orig):
    def post_init(self, *args, **kwargs):
        sync_model(self)
        result = orig(self, *args, **kwargs)
        # a plain checkpoint lacks our parameters: they are initialised from the settings, not "missing"; the marker
        # tensor of our checkpoints is there for transformers without hf_attnorm only (persistence.marker_key)
        self._keys_to_ignore_on_load_missing = set(self._keys_to_ignore_on_load_missing or ()) | {r"\.attnorm\."}
        unexpected = _KeyPatterns(self._keys_to_ignore_on_load_unexpected or ())
        if MARKER_PATTERN not in unexpected:
            unexpected.append(MARKER_PATTERN)
        self._keys_to_ignore_on_load_unexpected = unexpected
        return result

    return post_init


class _KeyPatterns(list):
    """Key patterns transformers joins with its own: with ``+`` and a list (5.4), with ``|`` and a set (5.24)."""

    def __or__(self, other: object) -> set:
        return set(self) | set(other)  # type: ignore[call-overload]

    __ror__ = __or__


def _set_hook(orig):
    def set_attn_implementation(self, attn_implementation, *args, **kwargs):
        if isinstance(attn_implementation, str):
            attn_implementation = canonical(attn_implementation)
            if is_ours(attn_implementation):
                refuse_family(self, attn_implementation)  # transformers only logs a warning for these families
        result = orig(self, attn_implementation, *args, **kwargs)
        sync_model(self, explicit=True)
        return result

    return set_attn_implementation


def _initialize_weights_hook(orig):
    """``_initialize_weights`` (private): per-head values a checkpoint lacks get their initial values from the
    settings (transformers' own ``_init_weights`` does not know the module)."""

    def _initialize_weights(self, module, *args, **kwargs):
        if isinstance(module, AttnormState):
            if not getattr(module, "_is_hf_initialized", False):
                module.reset_parameters(only_uninitialised=True)
                module._is_hf_initialized = True
            return None
        return orig(self, module, *args, **kwargs)

    return _initialize_weights


def _from_pretrained_hook(orig):
    def from_pretrained(cls, *args, attnorm: Mapping[str, Any] | None = None, **kwargs):
        if attnorm is not None and not isinstance(attnorm, Mapping):
            raise AttnormError(f"attnorm= must be a dict of settings, got {type(attnorm).__name__}")
        path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        verify_before_load(path, kwargs, attnorm)
        token = _PENDING.set(dict(attnorm) if attnorm is not None else None)
        try:
            model = orig(cls, *args, **kwargs)
        finally:
            _PENDING.reset(token)
        model_ = model[0] if isinstance(model, tuple) else model
        if attnorm is not None and not is_ours(model_.config._attn_implementation):
            raise AttnormError(
                f"attnorm settings were given but the attention implementation is "
                f"{model_.config._attn_implementation!r}; pass attn_implementation= one of {', '.join(PRESETS)}"
            )
        # FSDP low-memory loading leaves values the checkpoint lacks on meta on ranks > 0 (a normalizer swap)
        materialize_meta_states(model_)
        verify_loaded(model_, path, kwargs)
        return model

    return from_pretrained


def _save_hook(orig):
    def save_pretrained(self, save_directory, *args, **kwargs):
        # before anything is written: a replaced config.attnorm would save settings the model does not run with
        config = getattr(self, "config", None)
        for mod in self.modules():
            if isinstance(mod, AttnormState) and mod.settings.implementation == canonical(
                    getattr(config, "_attn_implementation", None)):
                check_config_unchanged(config, mod.settings)
        result = orig(self, save_directory, *args, **kwargs)
        finalize_saved(self, save_directory, kwargs)
        return result

    return save_pretrained
