"""The C++ CPU kernels' builds: one extension per family (the fused maps, stick-breaking, selective), each compiled on
first use with ``torch.utils.cpp_extension.load``, cached by torch under ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``), and failing on its own: a family whose build fails (or that finds no BLAS) warns once,
naming the family and the compiler's first error lines, and its path declines; the other families keep their kernels.
Without a C++ compiler, or with ``HF_ATTNORM_NO_NATIVE=1``, every family declines after that one-time warning.

When a build runs: the dispatcher calls a path's ``prepare`` (``NativeExtension.build``) the first time its automatic
rule considers the path for a normalizer and device (``kernels.prepare_path``), outside any traced graph (under
``torch.compile`` that first consideration runs for real while Dynamo traces, so a model compiled before any eager
call still gets its C++ kernels). A path's ``accepts`` only reads ``NativeExtension.reason()``: it builds nothing.

The ops that traced and exported graphs hold are ``torch.ops.hf_attnorm_fused.*``, whichever family they belong to:
their schemas, shape functions and CPU implementations are registered from Python when hf_attnorm is imported
(``NativeExtension.define_op``), so a saved ``torch.export`` program resolves them after ``import hf_attnorm`` with
nothing built; the CPU implementation builds its family's extension on its first call and runs the C++ op of the same
name in the family's own namespace (``NativeExtension.namespace``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import platform
import shutil
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..torch_compat import register_export_ops
from .base import AttnCall

logger = logging.getLogger("hf_attnorm")

#: set to disable every native build (forces the pure-PyTorch fallbacks, e.g. to test them)
NO_NATIVE_ENV = "HF_ATTNORM_NO_NATIVE"
#: the kernels folder: the header every C++ source includes (cpu_common.h) and the family folders
KERNELS = Path(__file__).parent
#: the namespace of the Python-declared ops that traced graphs hold (one for every family: saved programs name it)
OPS_NAMESPACE = "hf_attnorm_fused"
_LIB = torch.library.Library(OPS_NAMESPACE, "DEF")
#: ``torch.ops.hf_attnorm_fused``: what the kernels call (declared ops, which trace; each runs its family's C++ op)
OPS = getattr(torch.ops, OPS_NAMESPACE)
register_export_ops()  # (and torch's own op that such programs hold, on a torch that defines it late)

#: family -> its extension (each family's cpu.py declares one)
EXTENSIONS: dict[str, NativeExtension] = {}


def compiler() -> str | None:
    """The C++ compiler torch's build would use (``CXX``, else g++ or clang++), or None."""
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")


def base_cflags() -> list[str]:
    """The compiler flags every family is built with."""
    # -fno-trapping-math lets GCC vectorise floor() (in the exponential). On x86 the loops GCC vectorises itself use
    # 256-bit vectors even where the CPU has AVX-512 (the explicit AVX-512 intrinsics still run there): 512-bit
    # ones were 5-10% faster at n = 4096 on an AVX-512 Xeon, but on another AVX-512 Xeon they put alpha-entmax's
    # fp32 d alpha beyond 5x the fp32 reference's error (3.3e-4 against 5.9e-5 at alpha = 1.15, L = 300), which
    # 256-bit vectors keep within it (2.2e-4)
    flags = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-fno-math-errno", "-DNDEBUG"]
    if platform.machine().lower() in ("x86_64", "amd64", "x86", "i686"):
        flags.insert(-1, "-mprefer-vector-width=256")
    return flags


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def build_error_summary(exc: BaseException, max_lines: int = 12) -> str:
    """The compiler's error lines of a failed build (``error:`` / ``fatal error:`` / undefined references, at most
    ``max_lines``), not just the last line (which only says that ninja failed); the message's last line otherwise."""
    text = str(exc).strip()
    if not text:
        return repr(exc)
    lines = text.splitlines()
    errors = [ln.strip() for ln in lines if "error:" in ln or "undefined reference" in ln or "Error " in ln]
    if errors:
        more = f" (+{len(errors) - max_lines} more)" if len(errors) > max_lines else ""
        return "; ".join(dict.fromkeys(errors[:max_lines])) + more
    return lines[-1]


def cpu_call_reason(call: AttnCall) -> str | None:
    """Why the C++ kernels cannot take the call's tensors (device, dtype), or None."""
    if call.q.device.type != "cpu":
        return f"device {call.q.device} (CPU only)"
    if call.q.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        return f"dtype {call.q.dtype}"
    return None


@dataclasses.dataclass(eq=False)
class NativeExtension:
    """One family's C++ extension: its sources, the namespace of its C++ ops and what it is built with."""

    #: the family's name in messages ("fused", "stick-breaking", "selective")
    family: str
    #: the C++ sources (each family's beside its Python); they include ``cpu_common.h`` from ``KERNELS``
    sources: list[Path]
    #: the namespace of the C++ ops (``-DHF_ATTNORM_NATIVE_NS``; the sources register their ops there)
    namespace: str
    #: the path that runs this family's calls without the extension (named in the warning)
    fallback: str
    #: further compiler flags (the fused maps' facts as preprocessor definitions)
    cflags: Callable[[], list[str]] = list
    #: generated headers, file name -> text, written into the build directory's ``generated/`` folder
    generated: Callable[[], dict[str, str]] = dict
    #: a folder to build in instead of torch's extensions folder (None: ``TORCH_EXTENSIONS_DIR`` or its default)
    build_root: Path | None = None
    #: ``torch.ops.<namespace>`` once built
    ops: Any = dataclasses.field(default=None, repr=False)
    #: why it cannot run (set by the first failed build, or when the build is disabled)
    error: str | None = None
    warned: bool = dataclasses.field(default=False, repr=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def flags(self) -> list[str]:
        return [*base_cflags(), *self.cflags(), f"-DHF_ATTNORM_NATIVE_NS={self.namespace}"]

    def name(self) -> str:
        """The extension's name: the family and a fingerprint of what the binary depends on (the CPU's instruction
        set, as -march=native compiles for it; torch; the flags; the sources, the shared headers and the generated
        ones), so that a cache shared between machines, checkouts or map tables never hands one build to another.
        (torch's JIT rebuilds when a source changes but does not read the headers the sources include.)"""
        parts = [_cpu_flags(), torch.__version__, " ".join(self.flags())]
        parts += [h.read_text() for h in sorted(KERNELS.glob("*.h"))]
        parts += [Path(s).read_text() for s in self.sources]
        parts += [f"{k}\n{v}" for k, v in sorted(self.generated().items())]
        tag = hashlib.sha1("|".join(parts).encode()).hexdigest()[:10]
        return f"hf_attnorm_{self.family.replace('-', '')}_{tag}"

    def reason(self) -> str | None:
        """Why this family's kernels cannot run now (None when built), without building anything."""
        if self.ops is not None:
            return None
        if self.error is not None:
            return self.error
        return (f"the {self.family} C++ kernels are not built yet (they are built the first time the dispatcher "
                "considers their path, or by hf_attnorm.kernels.native.build_all())")

    def unavailable_reason(self, warn: bool = False) -> str | None:
        """Why this family's kernels cannot run (None when they can), building them if needed."""
        self.build(warn=warn)
        return self.reason()

    def build(self, warn: bool = True) -> Any | None:
        """The compiled ops (``torch.ops.<namespace>``), building them on first call; None when unavailable (no
        compiler, build error, no BLAS, or ``HF_ATTNORM_NO_NATIVE=1``), with a one-time warning (``warn``) naming
        the family and why. Never call it from traced code (it runs a compiler): see ``kernels.prepare_path``."""
        if self.ops is not None:
            return self.ops
        if os.environ.get(NO_NATIVE_ENV, "0") not in ("", "0"):
            self._fail(f"{NO_NATIVE_ENV} is set", warn)
            return None
        if self.error is not None:
            self._fail(self.error, warn)  # (warns if the first failure was recorded silently)
            return None
        with self._lock:
            if self.ops is not None:
                return self.ops
            if compiler() is None:
                self._fail("no C++ compiler found (set CXX or install g++)", warn)
                return None
            name = self.name()
            try:
                self._load(name)
            except Exception as exc:  # a failed build must not break attention: the fallback path takes over
                self._fail(f"building the C++ extension {name} failed: {build_error_summary(exc)}", warn)
                return None
            ops = getattr(torch.ops, self.namespace)
            if not ops.blas_available():
                self._fail("this torch build exports no BLAS sgemm_/dgemm_ for extensions", warn)
                return None
            self.ops = ops
        return self.ops

    def _load(self, name: str) -> None:
        """Compile (or load from torch's cache) the extension ``name``, with the generated headers written into its
        build directory first."""
        from torch.utils.cpp_extension import _get_build_directory, load

        if self.build_root is not None:
            build_dir = self.build_root / name
            build_dir.mkdir(parents=True, exist_ok=True)
        else:
            build_dir = Path(_get_build_directory(name, verbose=False))
        if not (build_dir / f"{name}.so").exists():  # a first build takes about a minute: say so
            logger.warning("hf_attnorm: compiling the %s CPU attention kernels (first use only, about a minute; "
                           "cached in %s)", self.family, build_dir)
        generated = build_dir / "generated"
        generated.mkdir(parents=True, exist_ok=True)
        for file, text in self.generated().items():
            header = generated / file
            if not header.exists() or header.read_text() != text:
                header.write_text(text)
        load(
            name=name,
            sources=[str(s) for s in self.sources],
            extra_cflags=self.flags(),
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(KERNELS), str(generated)],
            build_directory=None if self.build_root is None else str(build_dir),
            is_python_module=False,
            verbose=os.environ.get("HF_ATTNORM_VERBOSE_BUILD", "0") not in ("", "0"),
        )

    def _fail(self, reason: str, warn: bool) -> None:
        self.error = reason
        if warn and not self.warned:
            self.warned = True
            warnings.warn(f"hf_attnorm: {self.family} CPU kernels unavailable ({reason}); using the slower "
                          f"pure-PyTorch {self.fallback!r} path instead", stacklevel=3)

    def define_op(self, schema: str, fake: Callable[..., Any]) -> None:
        """Declare ``hf_attnorm_fused::<schema>`` (the C++ op of the same name and schema in this family's
        namespace) with its shape function ``fake``; its CPU implementation builds the extension on first call."""
        name = schema.split("(", 1)[0]
        _LIB.define(schema)

        def cpu_kernel(*args: Any, **kwargs: Any) -> Any:
            if self.build() is None:
                raise RuntimeError(f"{OPS_NAMESPACE}::{name} runs the {self.family} CPU kernels, which are "
                                   f"unavailable here: {self.error}; export without them (the automatic rule does: "
                                   "docs/export.md)")
            return getattr(self.ops, name)(*args, **kwargs)

        _LIB.impl(name, cpu_kernel, "CPU")
        torch.library.register_fake(f"{OPS_NAMESPACE}::{name}", lib=_LIB)(fake)


def extension(family: str, sources: list[Path], namespace: str, fallback: str, **kwargs: Any) -> NativeExtension:
    """Declare family ``family``'s extension (once, from its cpu.py) and list it in ``EXTENSIONS``."""
    if family in EXTENSIONS:
        raise ValueError(f"a C++ extension of family {family!r} is already declared")
    ext = NativeExtension(family, list(sources), namespace, fallback, **kwargs)
    EXTENSIONS[family] = ext
    return ext


def build_all(warn: bool = True) -> dict[str, str | None]:
    """Build every family's extension (e.g. before timing, or to pre-build a cache); family -> why it is unavailable
    (None: built). One family's failure does not stop the others."""
    return {family: (None if ext.build(warn=warn) is not None else ext.error) for family, ext in EXTENSIONS.items()}
