"""The torch APIs and behaviours that appeared after the lowest supported torch (``supported.MIN_TORCH``), in one
place. Plain API differences get a fallback with the same result (``is_exporting``, ``register_export_ops``). A
feature of hf_attnorm that needs a newer torch is declared once in ``TORCH_FEATURES`` (a ``TorchFeature``: the
version it needs, measured, and what an older torch did): below that version it is either refused with an error
naming the feature and both versions, or replaced by a slower exact path with one warning per process. The README's
"Supported" line and docs/internals.md are generated from these declarations (``python -m hf_attnorm --markdown
torch-features``)."""

from __future__ import annotations

import dataclasses
import importlib
import warnings

import torch

from .supported import release


def torch_at_least(version: str) -> bool:
    """Whether the installed torch is ``version`` or newer; pre-releases and local tags count as their release
    (``"2.9.0.dev20250801+cpu"`` -> 2.9.0). For the facts no attribute reveals (a kernel's behaviour)."""
    return release(torch.__version__) >= release(version)


@dataclasses.dataclass(frozen=True)
class TorchFeature:
    """A feature of hf_attnorm that needs a newer torch than ``supported.MIN_TORCH``. ``since``: the first torch on
    which it works (measured); ``older``: what an older torch does (measured); ``fallback``: what runs instead on an
    older torch (exact; one warning per process), or "" when the feature is refused there; ``remedy``: what the user
    can do on an older torch (refused features)."""

    name: str
    since: str
    older: str
    fallback: str = ""
    remedy: str = ""

    @property
    def available(self) -> bool:
        """Whether the installed torch has it."""
        return torch_at_least(self.since)

    def message(self, version: str | None = None) -> str:
        """What a user of torch ``version`` (default: the installed one) is told: the feature, the version it needs,
        this version and what it does, then the remedy or the fallback."""
        v = torch.__version__ if version is None else version
        said = f"{self.name} needs torch >= {self.since}; this is torch {v}, where {self.older}"
        return f"hf_attnorm: {said}: {self.fallback}" if self.fallback else f"{said}. {self.remedy}"

    def problem(self) -> str | None:
        """None where the installed torch has the feature, else ``message()``."""
        return None if self.available else self.message()


_WARNED: set[str] = set()


def warn_fallback(feature: TorchFeature) -> None:
    """Says once per process that ``feature``'s fallback runs (nothing while Dynamo traces or torch.export runs:
    a warning there would break a full graph)."""
    if feature.name in _WARNED or torch.compiler.is_compiling() or is_exporting():
        return
    _WARNED.add(feature.name)
    warnings.warn(feature.message(), stacklevel=3)


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


#: torch.export with a dynamic sequence length (measured: 2.13.0 and 2.14.1 pass; 2.6.0 and 2.11.0 fail, also on the
#: newest transformers; 2.12 was not measured): refused below
DYNAMIC_EXPORT_FEATURE = TorchFeature(
    "torch.export with dynamic shapes of hf_attnorm attention", "2.13.0",
    older='the export fails ("Constraints violated (seq)")',
    remedy="Export with fixed shapes (no dynamic_shapes), or upgrade torch")
DYNAMIC_EXPORT_TORCH = DYNAMIC_EXPORT_FEATURE.since
DYNAMIC_EXPORT = DYNAMIC_EXPORT_FEATURE.available


# ------------------------------------------------------------------------------------------------ kernels

#: SDPA's CPU flash kernel with fewer key/value heads than query heads (GQA), which the CPU path ``sdpa`` runs for
#: the softmax family with a mask or a sink: older kernels accept them and corrupt memory in the backward pass, so
#: k/v are repeated there (the same result, more memory)
FLASH_CPU_GQA_FEATURE = TorchFeature(
    "grouped-query attention (fewer key/value heads than query heads) in the CPU flash-attention kernel of path "
    "`sdpa`", "2.9.0",
    older='that kernel accepts them and corrupts memory in its backward pass ("double free or corruption")',
    fallback="the key/value heads are repeated to the number of query heads before the kernel (exact, more memory)")
FLASH_CPU_GQA_TORCH = FLASH_CPU_GQA_FEATURE.since
FLASH_CPU_GQA = FLASH_CPU_GQA_FEATURE.available


# ------------------------------------------------------------------------------------------------ torch.compile

#: torch.compile of a model with hf_attnorm attention. hf_attnorm cannot refuse it itself: an error raised while
#: Dynamo traces is swallowed (fullgraph=False falls back to eager) or buried in Dynamo's own message, so the version
#: is stated here and in the docs, and the compile tests skip with ``compile_problem()``. Measured: 2.7.1 and newer
#: pass the suite's aot_eager compile tests; on 2.6.0 Dynamo fails in transformers' model code before any attention
#: runs (a plain sdpa model too)
COMPILE_FEATURE = TorchFeature(
    "torch.compile of models with hf_attnorm attention", "2.7.0",
    older="Dynamo cannot trace transformers' own model code, with or without hf_attnorm (\"Unsupported: call_method "
          "... co_varnames __contains__\")",
    remedy="Run the model uncompiled, or upgrade torch")
#: inductor (torch.compile's default backend) on the CPU. Measured: 2.7.1 and 2.8.0 generate C++ that does not compile
#: for a training step of each kernel family tested (softmax, fused, linear); 2.9 is where the suite's compile tests
#: passed when the range was first measured, and CI's main environment (2.13) runs the inductor cases
INDUCTOR_CPU_FEATURE = TorchFeature(
    "torch.compile with inductor (the default backend) on the CPU of models with hf_attnorm attention", "2.9.0",
    older="inductor generates C++ that does not compile for their training step (\"conflicting declaration 'auto "
          "bool_tmp_acc0_vec'\")",
    remedy='Compile with backend="aot_eager" on the CPU, or upgrade torch')
COMPILE_TORCH = COMPILE_FEATURE.since


def compile_problem(backend: str = "aot_eager") -> str | None:
    """None when torch.compile of models with hf_attnorm attention works on the CPU with ``backend`` on this torch,
    else why not (inductor: the default backend)."""
    problem = COMPILE_FEATURE.problem()
    if problem is None and backend == "inductor":
        problem = INDUCTOR_CPU_FEATURE.problem()
    return problem


#: every feature that needs a newer torch than supported.MIN_TORCH
TORCH_FEATURES: tuple[TorchFeature, ...] = (COMPILE_FEATURE, INDUCTOR_CPU_FEATURE, FLASH_CPU_GQA_FEATURE,
                                            DYNAMIC_EXPORT_FEATURE)
