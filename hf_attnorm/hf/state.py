"""The state on every attention module: ``<attention>.attnorm`` (an ``AttnormState``) holds the settings and the
learnable per-head values; ``install`` puts it there, ``settings_for`` resolves a config's settings.
"""

from __future__ import annotations

import contextvars
import logging
import reprlib
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..attention import param_specs
from ..registry import NORMALIZERS, SCALES, AttnormError, first_line
from ..settings import READ_ONLY_MESSAGE, AttnormSettings, ConfigSettings, resolve_settings
from . import cache_state, forget_cache, key_cache, recurrent, selective_cache  # noqa: F401  (kinds register on import)
from .families import interface_keywords, module_info, num_heads_of, unread_selections, unsupported_keywords

logger = logging.getLogger("hf_attnorm")

#: settings passed as ``from_pretrained(..., attnorm={...})`` while that call builds the model
_PENDING: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar("hf_attnorm_pending", default=None)


class AttnormState(nn.Module):
    """Lives on every attention module as ``<attention>.attnorm``: the settings and the learnable per-head values.

    Learnable values are ``nn.Parameter`` [H] named after what they are (``sink_logit``, ``ssmax_s``, ``symax_eta``,
    ``sigmoid_bias``, ``cosine_temperature``), so they appear in ``model.parameters()`` and in the state dict as
    ``...self_attn.attnorm.ssmax_s``. Non-learnable values are constants taken from the settings.
    """

    def __init__(self, settings: AttnormSettings, num_heads: int, module_info: dict[str, Any]) -> None:
        super().__init__()
        self.settings = settings
        self.num_heads = num_heads
        self.module_info = dict(module_info)
        SCALES.get(settings.scale).prepare(settings, self.module_info)
        NORMALIZERS.get(settings.normalizer).check_heads(settings, num_heads)  # refused at load/set time
        self._specs = param_specs(settings)
        #: device -> the non-learnable per-head values [H] (fp32), built once per device rather than every call
        self._constants: dict[torch.device, dict[str, torch.Tensor]] = {}
        try:
            initial = {spec.name: self.initial(spec.name) for spec in self._specs}
        except ValueError as e:  # a shape that needs an unknown fact: refused at load/set time
            raise AttnormError(f"{self.module_info.get('family', 'attention module')}: {e}") from None
        for spec in self._specs:
            if spec.is_learnable(settings):
                self.register_parameter(spec.name, nn.Parameter(initial[spec.name]))

    def learnable_names(self) -> list[str]:
        return [name for name, _ in self.named_parameters(recurse=False)]

    @torch.no_grad()
    def reset_parameters(self, only_uninitialised: bool = False) -> None:
        """Set every learnable value to its initial value from the settings."""
        for spec in param_specs(self.settings):
            p = getattr(self, spec.name, None)
            if isinstance(p, nn.Parameter) and not (only_uninitialised and getattr(p, "_is_hf_initialized", False)):
                p.copy_(self.initial(spec.name, p.device))

    def initial(self, name: str, device: torch.device | str | None = None) -> torch.Tensor:
        """The initial value of per-head value ``name`` (fp32, its full shape: [H, ...], or [Hkv, ...] for values per
        key/value head such as learned memory key/values)."""
        spec = next(s for s in self._specs if s.name == name)
        return spec.initial(self.num_heads, self.settings, self.module_info.get("head_dim"), device,
                            self.module_info.get("num_kv_heads"), self.module_info.get("value_dim"))

    def forward(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Every per-head value [H] or [H, ...] (fp32): learnable ones from the parameters, constants from the
        settings (built once per device, not per call).

        The attention function CALLS this module rather than reading its parameters, so whatever wraps or hooks a
        module's call sees it: PEFT's ``modules_to_save`` wrapper dispatches to the active adapter's copy, and
        DeepSpeed ZeRO-3 gathers the partitioned parameters for the call. Returning a parameter itself is fine
        there: ZeRO-3's post-forward hook registers a module output that is one of its parameters as an external
        parameter of the calling module (the attention module), so it stays gathered until that module is done.
        """
        const = self._constants.get(device)
        if const is None:
            const = {spec.name: self.initial(spec.name, device)
                     for spec in self._specs if spec.name not in self._parameters}
            # tensors made under inference_mode cannot be saved for backward later: cache only ordinary ones
            if not torch.is_inference_mode_enabled():
                self._constants[device] = const
        if not self._parameters:  # (constants only: a fresh dict of them, in the specs' order)
            return dict(const)
        out: dict[str, torch.Tensor] = {}
        for spec in self._specs:
            p = self._parameters.get(spec.name)
            if p is not None:
                out[spec.name] = p.float() if p.dtype != torch.float32 else p
            else:
                out[spec.name] = const[spec.name]
        return out

    def extra_repr(self) -> str:
        s = self.settings
        opts = "".join(f", {k}={reprlib.repr(v)}" for k, v in s.options.items())  # tables stay short
        return f"{s.implementation}: normalizer={s.normalizer}, scale={s.scale}{opts}"


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
    config.attnorm = settings.to_config()  # read-only: an edit raises, naming hf_attnorm.apply
    return settings


def install(module: nn.Module, settings: AttnormSettings) -> AttnormState:
    """Attach (or update) ``module.attnorm``. Learnable values whose settings did not change keep their values."""
    old = module._modules.get("attnorm")
    if old is not None and getattr(old, "settings", None) == settings:
        return old  # unchanged; may be a wrapper around the state (PEFT's modules_to_save), which must stay
    check_module(module, settings)
    # `is None`, not `or`: a module's own parameter (GPT-OSS sinks) is a tensor with no truth value
    ref = next(module.parameters(recurse=False), None)
    if ref is None:
        ref = next(module.parameters(), None)
    state = AttnormState(settings, num_heads_of(module), module_info(module))
    if ref is not None:
        state.to(device=ref.device)
    if isinstance(old, AttnormState):
        old_specs = {s.name: s for s in param_specs(old.settings)}
        for spec in param_specs(settings):
            prev = old._parameters.get(spec.name)
            same = (spec.name in old_specs and spec.init_value(old.settings) == spec.init_value(settings)
                    and prev is not None and prev.shape == state._parameters.get(spec.name, prev).shape)
            if prev is not None and spec.name in state._parameters and same:
                state._parameters[spec.name] = prev  # keep the learned value (and the optimizer's reference)
    module.attnorm = state
    cache_state.sync(module)  # the pre-hook of a state kept on the cache (linear, selective), or none
    return state


#: module classes already warned about a key-order normalizer on non-causal attention
_WARNED_ORDER: set[str] = set()

#: keywords that act on the score matrix, which a scoreless normalizer (linear attention) does not have
SCORE_KEYWORDS = ("softcap", "position_bias", "s_aux")


def check_module(module: nn.Module, settings: AttnormSettings) -> None:
    """Refuse, at load/set time, a module that passes the attention interface a keyword hf_attnorm does not
    implement, or a score keyword (soft-cap, bias, sinks) to a normalizer without scores."""
    name = type(module).__name__
    bad = unsupported_keywords(module)
    if bad:
        raise AttnormError(
            f"{name} passes {', '.join(bad)} to the attention function, which hf_attnorm does not implement; its "
            f"attention would be computed without it. Use attn_implementation='sdpa' or 'eager'."
        )
    unread = unread_selections(module)
    if unread:
        raise AttnormError(f"{name} passes {', '.join(unread)}; hf_attnorm cannot tell which keys it selects. Use "
                           "attn_implementation='sdpa' or 'eager'.")
    norm = NORMALIZERS.get(settings.normalizer)
    score_kw = [k for k in SCORE_KEYWORDS if k in interface_keywords(type(module))]
    if score_kw and norm.scoreless:
        raise AttnormError(
            f"{name} passes {', '.join(map(repr, score_kw))} to the attention function, which act on the score "
            f"matrix; normalizer {settings.normalizer!r} ({settings.implementation!r}) has no score matrix (its "
            "weights are products of positive features), so it cannot apply them. Choose a score-based normalizer."
        )
    if norm.key_order and getattr(module, "is_causal", True) is False and name not in _WARNED_ORDER:
        _WARNED_ORDER.add(name)  # once per module class: a model has many layers
        warnings.warn(
            f"{name} is not causal (a bidirectional encoder), but normalizer {settings.normalizer!r} weighs the keys "
            f"by their order: {norm.key_order_note}; the normalizer was designed for causal attention.",
            stacklevel=4,
        )
    if "s_aux" in score_kw and norm.row_sum == "free":
        raise AttnormError(
            f"{name} passes 's_aux' (learned attention sinks) to the attention function; normalizer "
            f"{settings.normalizer!r} weighs each key on its own (no sum over keys), so a sink would change nothing "
            "and the model's sink weights would be silently unused. Choose a normalizer that sums over keys."
        )


def check_config_unchanged(config: Any, settings: AttnormSettings) -> None:
    """Raise when ``config.attnorm`` was replaced by settings other than ``settings`` (those the model runs with).

    ``config.attnorm`` is a read-only ``ConfigSettings``, so an in-place edit already raised; this catches a whole
    new dict assigned to it (``config.attnorm = {...}``), which the model would otherwise ignore and save."""
    if config is None:
        return
    # (an assignment stores it in the instance's __dict__: read there it costs a tenth of PretrainedConfig's
    # attribute access, whose __getattribute__ is Python, and this runs once per attention call)
    try:
        own = object.__getattribute__(config, "__dict__")
    except AttributeError:  # (a config object without an instance dict)
        own = {}
    raw = own["attnorm"] if "attnorm" in own else getattr(config, "attnorm", None)
    if raw is None or isinstance(raw, ConfigSettings):
        return
    problem = ""
    if not isinstance(raw, Mapping):
        problem = f" (not a dict of settings but a {type(raw).__name__})"
    else:
        try:
            if AttnormSettings.from_dict(raw) == settings:
                config.attnorm = settings.to_config()  # an equal copy, nothing changed: read-only again
                return
        except AttnormError as e:
            problem = f" (which are invalid: {first_line(str(e))})"
    raise AttnormError(
        f"model.config.attnorm was replaced by {reprlib.repr(raw)}{problem}, but the model runs with "
        f"{settings.to_dict()}: the settings it would save are not the ones it computes. {READ_ONLY_MESSAGE}."
    )


def uninstall(module: nn.Module) -> None:
    if isinstance(module._modules.get("attnorm"), AttnormState):
        del module._modules["attnorm"]
    cache_state.detach(module)


def state_of(module: nn.Module, implementation: str) -> nn.Module:
    """The ``attnorm`` child of ``module`` for ``implementation``: an ``AttnormState``, or what wraps one and forwards
    its call and attributes (PEFT's ``modules_to_save`` wrapper). Never created here: a state created at the first
    forward would escape an optimizer built before it and would replace a wrapper (PEFT's) with a fresh copy, so a
    missing or stale one is an error that names the ways to set a model up."""
    state = module._modules.get("attnorm")
    settings = getattr(state, "settings", None) if state is not None else None
    if isinstance(settings, AttnormSettings) and settings.implementation == implementation:
        if not torch.compiler.is_compiling():  # (a compiled call is checked by its eager twin and at save)
            check_config_unchanged(getattr(module, "config", None), settings)
        return state
    found = "none" if settings is None else f"one for {settings.implementation!r}"
    raise AttnormError(
        f"{type(module).__name__} is called with attention implementation {implementation!r} but carries no "
        f"hf_attnorm state for it (found: {found}). Set the implementation through from_pretrained("
        "attn_implementation=...), model.set_attn_implementation(...) or hf_attnorm.apply(model, ...): assigning "
        "config._attn_implementation directly installs nothing. Attention modules are found by their forward's "
        "call of transformers' attention interface (ALL_ATTENTION_FUNCTIONS)."
    )
