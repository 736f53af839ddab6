"""The torch APIs that appeared after the lowest supported torch (``supported.MIN_TORCH``), in one place: each is
feature-detected here, with the fallback older torch gets or the version a feature needs (one named constant each,
compared with ``torch_at_least`` only where no attribute reveals the fact)."""

from __future__ import annotations

import importlib

import torch

from .supported import release


def torch_at_least(version: str) -> bool:
    """Whether the installed torch is ``version`` or newer; pre-releases and local tags count as their release
    (``"2.9.0.dev20250801+cpu"`` -> 2.9.0). For the facts no attribute reveals (a kernel's behaviour)."""
    return release(torch.__version__) >= release(version)


# ------------------------------------------------------------------------------------------------ torch.export

_HAS_IS_EXPORTING = hasattr(torch.compiler, "is_exporting")  # torch >= 2.7


def is_exporting() -> bool:
    """Whether torch.export is tracing this call (``torch.compiler.is_exporting``). Torch < 2.7 has no such flag;
    there its export's non-strict tracing is the only thing that sets ``torch.compiler._is_compiling_flag`` (torch.
    compile answers ``is_compiling()`` through Dynamo instead), so that flag stands in for it."""
    if hasattr(torch.compiler, "_is_exporting_flag"):
        # the flag itself, not the function: Dynamo of torch 2.11 (not 2.13) folds is_exporting() to True while
        # torch.compile traces, which would send compiled calls down the export-only paths
        return bool(torch.compiler._is_exporting_flag)
    if _HAS_IS_EXPORTING:
        return torch.compiler.is_exporting()
    return bool(getattr(torch.compiler, "_is_compiling_flag", False))


def register_export_ops() -> None:
    """Registers the higher-order op that programs exported from transformers models hold (``wrap_with_set_grad_
    enabled``: their rotary embeddings run under no_grad), so that ``torch.export.load`` resolves it in a fresh
    process. Torch >= 2.8 registers it at import; torch 2.6 only once torch.export has run, failing the load before
    ("SerializeError: Unsupported target type for node ... wrap_with_set_grad_enabled")."""
    if not hasattr(torch.ops.higher_order, "wrap_with_set_grad_enabled"):
        importlib.import_module("torch._higher_order_ops.wrap")  # (defines it)


#: the first torch on which torch.export with a dynamic sequence length works with hf_attnorm attention (measured:
#: 2.13.0 and 2.14.1 pass, 2.11.0 fails with "Constraints violated (seq)", also on the newest transformers; 2.12 was
#: not measured)
DYNAMIC_EXPORT_TORCH = "2.13.0"
DYNAMIC_EXPORT = torch_at_least(DYNAMIC_EXPORT_TORCH)


# ------------------------------------------------------------------------------------------------ kernels

#: the first torch whose CPU flash-attention kernel takes fewer key/value heads than query heads (GQA); older ones
#: accept them and corrupt memory in the backward pass ("double free or corruption"), so k/v are repeated there
FLASH_CPU_GQA_TORCH = "2.9.0"
FLASH_CPU_GQA = torch_at_least(FLASH_CPU_GQA_TORCH)


# ------------------------------------------------------------------------------------------------ torch.compile

#: the first torch on which torch.compile of a model with hf_attnorm attention works on the CPU (the suite's compile
#: tests pass). Older: 2.6's Dynamo cannot trace transformers' own model wrappers, with or without hf_attnorm
#: ("Unsupported: call_method ... co_varnames __contains__", "NameError: name 'torch' is not defined"); 2.7 and 2.8's
#: Inductor emits C++ that does not compile for some masked normalizers ("conflicting declaration 'auto
#: bool_tmp_acc0_vec'"). hf_attnorm cannot refuse it itself: an error raised while Dynamo traces is swallowed
#: (fullgraph=False falls back to eager) or buried in Dynamo's own message, so the version is stated here and in
#: the docs, and the compile tests skip with ``compile_problem()``.
COMPILE_TORCH = "2.9.0"


def compile_problem() -> str | None:
    """None when torch.compile of models with hf_attnorm attention is supported on this torch, else why not."""
    if torch_at_least(COMPILE_TORCH):
        return None
    return (f"torch.compile of models with hf_attnorm attention needs torch >= {COMPILE_TORCH}; this is torch "
            f"{torch.__version__} (its compiler fails on transformers' models or on the generated CPU code)")
