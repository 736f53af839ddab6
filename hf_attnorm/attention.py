"""The attention function transformers calls, and the same computation as a plain function on tensors.

``attention(q, k, v, ...)`` works on raw tensors (benchmarks, tests, custom models). ``hf_attention_forward`` is
what ``AttentionInterface`` calls for every registered name: it reads the module's ``AttnormState`` (settings and
per-head parameters), builds the keep-mask and n, handles GQA, and dispatches to a kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import reprlib
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .config import AttnormSettings, resolve_settings
from .kernels import attend
from .kernels.base import AttnCall
from .masks import build_mask_info
from .normalizers.base import ParamSpec
from .registry import NORMALIZERS, SCALES


def param_specs(settings: AttnormSettings) -> tuple[ParamSpec, ...]:
    """Per-head values of the settings' normalizer and scale."""
    return (*NORMALIZERS.get(settings.normalizer).params, *SCALES.get(settings.scale).params)


def constant_heads(settings: AttnormSettings, num_heads: int, device=None) -> dict[str, torch.Tensor]:
    """Per-head values [H] at their initial values (fp32), for calls without a module."""
    return {
        spec.name: torch.full((num_heads,), spec.init_value(settings), dtype=torch.float32, device=device)
        for spec in param_specs(settings)
    }


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
        for spec in param_specs(settings):
            if spec.is_learnable(settings):
                self.register_parameter(spec.name, nn.Parameter(torch.full((num_heads,), spec.init_value(settings))))

    def learnable_names(self) -> list[str]:
        return [name for name, _ in self.named_parameters(recurse=False)]

    @torch.no_grad()
    def reset_parameters(self, only_uninitialised: bool = False) -> None:
        """Set every learnable value to its initial value from the settings."""
        for spec in param_specs(self.settings):
            p = getattr(self, spec.name, None)
            if isinstance(p, nn.Parameter) and not (only_uninitialised and getattr(p, "_is_hf_initialized", False)):
                p.fill_(spec.init_value(self.settings))

    def heads(self, device: torch.device) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for spec in param_specs(self.settings):
            p = self._parameters.get(spec.name)
            if p is not None:
                out[spec.name] = p.float() if p.dtype != torch.float32 else p
            else:
                out[spec.name] = torch.full((self.num_heads,), spec.init_value(self.settings), device=device)
        return out

    def extra_repr(self) -> str:
        s = self.settings
        opts = "".join(f", {k}={reprlib.repr(v)}" for k, v in s.options.items())  # tables stay short
        return f"{s.implementation}: normalizer={s.normalizer}, scale={s.scale}{opts}"


def make_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    settings: AttnormSettings,
    heads: Mapping[str, torch.Tensor],
    attention_mask: object = None,
    causal: bool = False,
    scaling: float | None = None,
    dropout: float = 0.0,
    need_weights: bool = False,
    module_info: Mapping[str, Any] | None = None,
) -> AttnCall:
    """Resolve one call: mask -> keep/n, scale -> multiplier, per-head factors. Shapes as ``attention``."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B, H, L, D]; got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    if H % Hkv != 0 or v.shape[1] != Hkv or v.shape[2] != Lk or k.shape[-1] != D:
        raise ValueError(f"incompatible shapes q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    norm, sc = NORMALIZERS.get(settings.normalizer), SCALES.get(settings.scale)
    mask = build_mask_info(attention_mask, B, H, Lq, Lk, causal, q.device)
    if mask.keep is not None:
        # keys no query can see (padding) are zeroed, so garbage there (1e10, NaN) cannot leak through 0 * x
        dead = ~mask.keep.any(dim=2).any(dim=1)  # [B or 1, Lk]
        if bool(dead.any()):
            dead = dead.view(dead.shape[0], 1, Lk, 1)
            k = torch.where(dead, torch.zeros((), dtype=k.dtype, device=k.device), k)
            v = torch.where(dead, torch.zeros((), dtype=v.dtype, device=v.device), v)
    heads = dict(heads)
    info = dict(module_info or {})
    from .normalizers.base import Ctx

    ctx = Ctx(settings, heads, D, mask.n, info, Lk)
    mult = sc.multiplier(mask.n, ctx)
    head_factor = norm.head_multiplier(ctx)
    if head_factor is not None:
        hf = head_factor.view(1, -1, 1)
        mult = hf if mult is None else mult * hf
    if scaling is None:
        scaling = D**-0.5
    base = float(scaling) if norm.uses_base_scaling else 1.0
    return AttnCall(q, k, v, mask, settings, heads, base, mult, dropout, need_weights, info)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    implementation: str | AttnormSettings = "softmax",
    *,
    attention_mask: object = None,
    causal: bool = False,
    scaling: float | None = None,
    heads: Mapping[str, torch.Tensor] | None = None,
    dropout: float = 0.0,
    need_weights: bool = False,
    path: str | None = None,
    module_info: Mapping[str, Any] | None = None,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention with any registered normalizer and scale on plain tensors.

    q: [B, H, Lq, D]; k: [B, Hkv, Lk, D]; v: [B, Hkv, Lk, Dv] (H a multiple of Hkv); attention_mask: None, or a
    bool/0-1/additive mask [B|1, 1|H, Lq, Lk], [B, Lq, Lk] or [B, Lk]; causal: with no mask, query i sees keys
    j <= i (upper-left, as SDPA); scaling: the base scale (default 1/sqrt(D)); heads: per-head values [H]
    (e.g. ``{"ssmax_s": s}``; default: initial values from the settings); options: attnorm options
    (``eta=0.5``...). Returns (out [B, H, Lq, Dv], weights [B, H, Lq, Lk] if need_weights else None).
    """
    settings = implementation if isinstance(implementation, AttnormSettings) else resolve_settings(
        implementation, options)
    if isinstance(implementation, AttnormSettings) and options:
        settings = settings.replace(**options)
    all_heads = constant_heads(settings, q.shape[1], q.device)
    all_heads.update(heads or {})
    call = make_call(q, k, v, settings, all_heads, attention_mask, causal, scaling, dropout, need_weights,
                     module_info)
    out, w, _ = attend(call, path)
    return out, w


# --------------------------------------------------------------------------------------------------- transformers


def _weights_requested(kwargs: Mapping[str, Any]) -> bool:
    if kwargs.get("output_attentions"):
        return True
    if torch.compiler.is_compiling():
        return False  # transformers' output collector is a ContextVar, which dynamo cannot trace
    try:
        from transformers.utils.output_capturing import _active_collector

        collected = _active_collector.get()
    except Exception:  # pragma: no cover - older transformers
        return False
    return isinstance(collected, dict) and ("attentions" in collected or "cross_attentions" in collected)


@dataclasses.dataclass
class _LastCall:
    path: str = ""


#: the path the most recent call took (for tests and benchmarks)
LAST_CALL = _LastCall()


def hf_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: object,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    implementation: str,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The AttentionInterface function. query [B, H, Lq, D], key/value [B, Hkv, Lk, D] -> (out [B, Lq, H, Dv],
    weights [B, H, Lq, Lk] when output_attentions is requested, else None)."""
    from .integration import ensure_state

    state = ensure_state(module, implementation)
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = bool(getattr(module, "is_causal", True))
    if kwargs.get("position_bias") is not None:
        raise ValueError("hf_attnorm does not support additive position biases (position_bias)")
    if kwargs.get("softcap") is not None:
        raise ValueError("hf_attnorm does not support logit soft-capping (softcap)")
    if kwargs.get("sliding_window") is not None and attention_mask is None:
        warnings.warn("hf_attnorm: sliding_window given without a mask; full causal attention is used", stacklevel=2)
    call = make_call(
        query, key, value, state.settings, state.heads(query.device), attention_mask, causal, scaling,
        dropout if module.training else 0.0, _weights_requested(kwargs), state.module_info,
    )
    out, weights, path = attend(call)
    LAST_CALL.path = path
    return out.transpose(1, 2).contiguous(), weights


@functools.cache
def forward_for(implementation: str):
    """The function registered under ``implementation`` (a named partial, so tracebacks say which)."""
    fn = functools.partial(hf_attention_forward, implementation=implementation)
    functools.update_wrapper(fn, hf_attention_forward)
    fn.__name__ = f"hf_attnorm_{implementation}"
    return fn
