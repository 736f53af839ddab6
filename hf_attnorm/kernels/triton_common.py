"""What every Triton kernel module of hf_attnorm shares (the fused maps', stick-breaking's, selective's and the row
kernels'): triton imported on first use, the interpreter's mode, jitting a module's device functions into one
namespace per mode, and a launch whose failures say what failed (``TritonKernelError``: never a silent fallback).

Importing this module needs no triton: ``load()`` imports it on first use (triton fixes compiled vs interpreted mode
for its own library functions when it is imported, so ``TRITON_INTERPRET`` must be set before that).
"""

from __future__ import annotations

import importlib.util
import math
import os
import types
from typing import Any

import torch

# bound by ``load()``
triton: Any = None
tl: Any = None

#: NVIDIA GPUs below this compute capability are refused with ``TritonKernelError``: Triton's supported range
#: (compute capability 8.0 and newer), and the kernels were compiled and checked for sm_80 and newer only
MIN_CAPABILITY = (8, 0)
#: how to run another path, named in every ``TritonKernelError``
ESCAPE = ("set HF_ATTNORM_PATH=chunked in the environment (or pass path='chunked' to attention()) to run the "
          "pure-PyTorch path instead")


class TritonKernelError(RuntimeError):
    """A Triton kernel of hf_attnorm failed to compile or launch, or the device is one the kernels do not support.
    The message names the kernel, the device and how to force another path (``ESCAPE``); never a silent fallback."""


def describe_device(device: torch.device | None) -> str:
    """'cuda:0 (NVIDIA H100 80GB HBM3, compute capability 9.0)', or 'cpu (Triton interpreter)'."""
    if device is None:
        return "an unknown device"
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda:{index} ({torch.cuda.get_device_name(index)}, compute capability {major}.{minor})"
    if device.type == "cpu":
        return "cpu (Triton interpreter)"
    return str(device)


def device_problem(device: torch.device | None) -> str | None:
    """None, or why the Triton kernels cannot run on ``device`` (an NVIDIA GPU below ``MIN_CAPABILITY``)."""
    if device is None or device.type != "cuda" or torch.version.hip is not None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    capability = torch.cuda.get_device_capability(index)
    if tuple(capability) < MIN_CAPABILITY:
        return (f"compute capability {capability[0]}.{capability[1]} is below "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}, the lowest the hf_attnorm Triton kernels support")
    return None


def kernel_name(kernel: Any) -> str:
    """'hf_attnorm.kernels.fused.triton_device._fwd_kernel' for a jitted (or autotuned) kernel of
    ``jit_namespace``."""
    fn = kernel
    while hasattr(fn, "fn"):
        fn = fn.fn
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def launch(kernel: Any, grid: Any) -> Any:
    """``kernel[grid]`` (grid: a tuple, or a function of the launch's meta-parameters for autotuned kernels) whose
    failures say what failed: a device below ``MIN_CAPABILITY`` or any error while Triton compiles or launches the
    kernel (compile errors, shared memory or registers out of resources, ...) raises ``TritonKernelError`` naming the
    kernel, the device, the cause and ``ESCAPE``. CUDA out-of-memory passes as is."""
    def run(*args: Any, **kwargs: Any) -> Any:
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        problem = device_problem(device)
        if problem is not None:
            raise TritonKernelError(f"Triton kernel {kernel_name(kernel)} cannot run on {describe_device(device)}: "
                                    f"{problem}; {ESCAPE}")
        try:
            return kernel[grid](*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001  (any compile/launch error is re-raised with the facts a user needs)
            cause = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            raise TritonKernelError(f"Triton kernel {kernel_name(kernel)} failed to compile or launch on "
                                    f"{describe_device(device)} (triton {getattr(triton, '__version__', '?')}): "
                                    f"{cause}; {ESCAPE}") from exc
    return run


#: looked up once at import (without importing triton): the paths' accepts ask on every call, also while Dynamo
#: traces, and Dynamo refuses to trace importlib's find_spec
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_installed() -> bool:
    return _TRITON_INSTALLED


def interpreter_requested() -> bool:
    """True when ``TRITON_INTERPRET`` asks for Triton's interpreter (kernels then run on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")


def load() -> None:
    """Import triton (once) and bind ``triton`` and ``tl`` here."""
    global triton, tl
    if triton is None:
        import triton as _triton
        import triton.language as _tl

        triton, tl = _triton, _tl


def jit_interprets() -> bool:
    """Whether ``triton.jit`` now makes interpreted functions (triton loaded): ``triton.knobs`` since triton 3.4;
    before it, jit read the variable itself, interpreting only for exactly "1"."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@torch.compiler.assume_constant_result  # Dynamo cannot trace isinstance on a Triton function nor triton's knobs
def interpreter_consistent() -> bool:
    """Triton's library functions (tl.sum ...) were jitted in the mode now requested. False when
    ``TRITON_INTERPRET=1`` was set after triton had been imported (or unset after): interpreted kernels calling
    compiled library functions cannot run."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction) == jit_interprets()


def jit_namespace(functions: dict[str, Any], names: tuple[str, ...], helpers: tuple[str, ...], mode: bool,
                  extra: dict[str, Any] | None = None) -> types.SimpleNamespace:
    """Jitted copies of the functions ``names`` (looked up in ``functions``: a kernel module's ``globals()`` or a
    merge of several modules'), in one namespace of their own for ``mode`` (True: interpreted), where they resolve
    each other by name, with ``tl`` bound; ``extra`` adds globals (constexprs). The copies keep their code objects,
    so tracebacks and Triton's source reads point at the lines of the file that defines them."""
    ns: dict[str, Any] = dict(functions)
    ns.update(extra or {})
    ns["tl"] = tl
    for name in names:
        raw = functions[name]
        fn = types.FunctionType(raw.__code__, ns, name, raw.__defaults__)
        fn.__module__, fn.__qualname__, fn.__doc__ = raw.__module__, raw.__qualname__, raw.__doc__
        # the compiled launcher reads which parameters are tl.constexpr from the annotations (the interpreter does
        # not): a FunctionType built from the code object has none until they are copied
        fn.__annotations__ = dict(raw.__annotations__)
        fn.__kwdefaults__ = raw.__kwdefaults__
        ns[name] = triton.jit(fn)
        if mode and name in helpers:
            # interpreted: call device helpers as their rewritten Python functions; going through
            # InterpretedFunction.__call__ re-patches triton.language on every call (~2 ms each)
            ns[name] = ns[name].rewrite()
    return types.SimpleNamespace(**{name: ns[name] for name in names})


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2(x: int) -> int:
    """The block size covering ``x``: the next power of two, at least 16 (a dot's smallest side)."""
    return max(16, 1 << max(0, math.ceil(math.log2(max(x, 1)))))
