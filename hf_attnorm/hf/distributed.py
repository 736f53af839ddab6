"""Parameters as sharding engines leave them: ZeRO-3 partitions, meta placeholders.

* DeepSpeed ZeRO-3 replaces every parameter's data with an empty tensor (shape ``(0,)``) outside the forward of the
  module that owns it and keeps the real shape in ``ds_shape``: code that groups or counts parameters must read
  that (``logical_shape``/``logical_numel``); a full state dict has to be gathered (the lab's
  ``lab.distributed.gathered_state_dict``, which needs DeepSpeed, not a dependency of the plugin).
* transformers' low-memory loading for FSDP (``FSDP_CPU_RAM_EFFICIENT_LOADING``) leaves parameters that are not in
  the checkpoint on the ``meta`` device on every rank but the first: the per-head values a normalizer swap creates
  are such parameters. ``materialize_meta_states`` gives them real storage at their initial values, so FSDP's
  ``sync_module_states`` (or any ``.to(device)``) finds tensors, not placeholders.

The attention function itself needs no special case for either: it calls ``module.attnorm(...)`` (see
``AttnormState.forward``), and ZeRO-3 gathers a module's parameters around its call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .state import AttnormState


def logical_shape(p: torch.Tensor) -> torch.Size:
    """The parameter's real shape, also while ZeRO-3 has partitioned it away (then ``p.shape`` is ``(0,)``)."""
    shape = getattr(p, "ds_shape", None)
    return torch.Size(shape) if shape is not None else p.shape


def logical_numel(p: torch.Tensor) -> int:
    """The parameter's real element count, also while ZeRO-3 has partitioned it away."""
    n = getattr(p, "ds_numel", None)
    return int(n) if n is not None else p.numel()


@torch.no_grad()
def materialize_meta_states(model: nn.Module) -> list[str]:
    """Give every attnorm parameter left on ``meta`` real storage at its initial value, on the device of its
    attention module's other parameters (CPU if they are all on meta too). Returns the names materialised."""
    done: list[str] = []
    for mname, mod in model.named_modules():
        state = mod._modules.get("attnorm")
        if not isinstance(state, AttnormState) or hasattr(mod, "_hf_hook") or hasattr(state, "_hf_hook"):
            continue  # accelerate's offload hooks (device_map with offloading) keep meta on purpose and load at call
        metas = [n for n, p in state.named_parameters(recurse=False) if p.device.type == "meta"]
        if not metas:
            continue
        device: Any = next((p.device for p in mod.parameters() if p.device.type != "meta"), torch.device("cpu"))
        for n in metas:
            old = state._parameters[n]
            state._parameters[n] = nn.Parameter(state.initial(n, device).to(old.dtype),
                                                requires_grad=old.requires_grad)
            done.append(f"{mname}.attnorm.{n}")
    return done
