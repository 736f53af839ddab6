"""Full state dicts from DeepSpeed ZeRO-3 without ``stage3_gather_16bit_weights_on_model_save``.

accelerate's ``get_state_dict`` refuses a ZeRO-3 model unless that DeepSpeed option is set (and DeepSpeed's own
``_zero3_consolidated_16bit_state_dict`` is private); ``gathered_state_dict`` uses the public
``deepspeed.zero.GatheredParameters``, one module at a time, so the final save of the training script works with
any ZeRO-3 config.
"""

from __future__ import annotations

import torch
from torch import nn


def is_zero3_partitioned(model: nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 manages (partitions) the parameters of ``model``."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def gathered_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of ``model`` as CPU copies (the model's dtype).

    Collective under ZeRO-3: every rank must call it, and every rank gets the whole dict (parameters are gathered
    one module at a time, so at most one module's full parameters are resident beyond the partitions). Without
    ZeRO-3: ``model.state_dict()`` copied to the CPU. Tied parameters appear under every name, as in
    ``state_dict()``; non-persistent buffers are left out, as there.
    """
    if not is_zero3_partitioned(model):
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    import deepspeed

    out: dict[str, torch.Tensor] = {}
    copies: dict[int, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        own = [(n, p) for n, p in module._parameters.items() if p is not None]
        with deepspeed.zero.GatheredParameters([p for _, p in own], modifier_rank=None):
            for name, p in own:
                if id(p) not in copies:  # a tied parameter is copied once and listed under each name
                    copies[id(p)] = p.detach().cpu().clone()
                out[f"{prefix}.{name}" if prefix else name] = copies[id(p)]
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = b.detach().cpu().clone()
    return out
