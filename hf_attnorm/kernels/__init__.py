"""Kernel layer: one entry point, paths that declare what they accept, and an override so tests can force any path.

Three modules, each using only the ones below it: ``variants`` (``attend``: what learned memory, gated and
differential attention add around a call), ``dispatch`` (the registered paths and the rule that picks one) and the
paths (this folder's other modules and family folders, each registering itself with ``dispatch.register_path``).

Every path (``register_path``) states, without running anything:

* ``takes(normalizer)``: None if it implements that normalizer (read from the normalizer's declared
  ``kernel_family`` / ``fused_map``, never from its name), else the reason;
* ``supports``: the call features it applies (``dispatch.FEATURES``: softcap, bias, alibi, sinks, forget,
  selective_carry, dropout); a call carrying any other is declined before its ``accepts`` is asked, so a new
  feature is refused by every path until one declares it;
* ``accepts(call)``: None if it can run this call (device, dtype, mask kind, weights, head dims, the finer
  conditions of the features it supports ...), else the reason. It looks only at shapes, dtypes, devices and
  settings: no kernel runs, no value is read from a tensor, so it costs microseconds and traces under torch.compile;
* ``priority``: lower is tried first; ``auto_exclude``: device types on which the automatic rule skips it;
* ``prepare``: what the path needs done once before it can accept a call (building its family's C++ extension,
  kernels/native.py), run by the dispatcher the first time its rule considers the path for a normalizer and device, or
  when it is forced (``prepare_path``): never by ``accepts``, and never traced (under torch.compile it runs for real
  while Dynamo traces, so a model compiled before any eager call still gets the path);
* ``exportable``: the automatic rule considers it under ``torch.export`` (and so ``torch.onnx.export``): a pure
  PyTorch path whose traced graph holds no hf_attnorm custom op and no loop sized from the sequence length, so the
  exported program runs without the compiled extension, converts to ONNX, and keeps a dynamic sequence length.

============== ========= ============================================= =========================================
path           priority  normalizers (declared family)                 accepts
============== ========= ============================================= =========================================
triton_forget  8         "softmax" with forget gates (fox)             a call carrying a forget gate; auto: CUDA;
                                                                       forced: CPU under TRITON_INTERPRET=1
sdpa           10        "softmax" (softmax, cosine, softmax_n, sink)  CPU: any float dtype (fp16/bf16 in fp32);
                                                                       elsewhere no sink. Dropout: no sink only.
sdpa_sinkcol   20        "softmax" with a sink (softmax_n, sink)       any; auto: not on CPU (D+1 is slow there)
selective_step 24        query-coupled with a selecting head           one query (a decode step), no score
                         (selective)                                   modifiers, no dropout, no carry needing
                                                                       grad
triton         30        "fused" (symax, squared, stablemax, ...)      auto: CUDA; forced: CPU under
                                                                       TRITON_INTERPRET=1. No dropout, no fp64
selective_triton
               35        query-coupled with a selecting head           auto: CUDA; forced: CPU under
                         (selective), no q/k transform                 TRITON_INTERPRET=1. No score modifiers,
                                                                       no dropout, no fp64, not under compile;
                                                                       takes ``selective_carry``
fused_cpu      40        "fused"                                       CPU, no dropout, C++ built on first use
selective_cpu  44        query-coupled with a selecting head           CPU, no score modifiers, no dropout, a
                         (selective)                                   ``selective_carry`` only as [B | 1, Lk];
                                                                       C++ built on first use
linear_recurrent
               45        "linear" with query/key_features (linear)     one query with ``AttnCall.recurrent`` set
                                                                       (a cache's state, hf/recurrent.py); no
                                                                       dropout, no grad
linear_chunked 50        "linear" (linear)                             no dropout; a mask only as key padding x
                                                                       causal (MaskInfo.padding), or one query
selective      85        query-coupled with a selecting head           no score modifiers, no dropout; takes
                         (selective)                                   ``AttnCall.selective_carry`` (a cached
                                                                       step), as decode and reference do; every
                                                                       other path declines a call carrying it
chunked        90        every normalizer but query-coupled ones       any (pure PyTorch, O(n * chunk) memory)
reference      100       every normalizer                              any; the only path returning weights
============== ========= ============================================= =========================================

Score modifiers on the call (``AttnCall.softcap``/``bias``/``alibi_slopes``/``sinks``) are part of each
``accepts``: reference, chunked and decode apply all of them (ALiBi slopes through ``AttnCall.score_bias()``); sdpa
a bias (in its float mask; a bias that needs a gradient leaves the sink rewrite) and sinks, not a soft-cap;
sdpa_sinkcol sinks only; triton and fused_cpu a soft-cap, a bias (read through its broadcast strides, with its
gradient) and ALiBi slopes in the kernel, not sinks; linear_recurrent and linear_chunked none. ``make_call``
leaves ALiBi slopes unmaterialised only for the normalizers the fused kernels take (the softmax family gets the bias
tensor).

The rule: needs-weights (``output_attentions``) -> the reference; otherwise the first path by priority whose
``auto_exclude`` does not hold the call's device and whose ``takes`` and ``accepts`` say None, else the reference
(a call carrying a feature that even the reference does not declare raises instead); while
``torch.compiler.is_exporting()``, only the ``exportable`` paths (sdpa, sdpa_sinkcol: any device) and the reference
(docs/export.md); while ``torch.compile`` traces, a path registered ``traceable=False`` (triton_stickbreaking,
triton_selective) declines,
and one registered ``compiled_backward=False`` (chunked, selective) declines calls that need gradients;
a call carrying a forget gate (``AttnCall.forget``, forgetting attention) only goes to the paths supporting
``forget`` (reference, chunked, decode, sdpa, triton_forget). A differential call (differential attention) is
decided and run as its two halves (``variants.halves``), which ``attend`` combines; with attention dropout it runs on
the reference (kernels/variants.py).
``explain(call)`` lists every candidate with its reason, running nothing.

Plans (``Route``, used by the transformers integration, hf/forward.py): what the rule decided for one call is kept
and reused for every call with the same plan facts (device, dtypes, head counts and dims, one query or several, the
kind of mask, which score modifiers and cache states the call carries, no autograd, no forced path). A path
registered ``plan_stable`` (True, or a function of the call) declares that its ``accepts`` reads nothing beyond
those facts, so a reused route asks it nothing again; every other path is asked again on each call. A path may
offer a ``direct`` entry: given a resolved call, a function of the raw (q, k, v) and the call's per-head values
computing the same output for every call with the same plan facts, or None (hf/forward.py uses it only for calls
without a mask tensor, score modifiers, output gate, forget gates, learned memory or cache state).

Override: ``path=`` on ``attention()``/``attend()``, or the environment variable ``HF_ATTNORM_PATH`` (a path name or
``auto``; read when this package is imported and by ``set_forced_path()``), so ``attend`` reads no environment. A
forced path that cannot take a call raises, naming the reason, instead of silently falling back.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import AttnCall
from .dispatch import (
    ENV_VAR,
    FEATURES,
    PATHS,
    Direct,
    Path,
    Route,
    available_paths,
    choose_routed,
    declared_normalizers,
    forced_path,
    paths_for,
    plan_epoch,
    prepare_path,
    register_path,
    run_path,
    set_forced_path,
)
from .variants import attend, candidate_paths, choose, explain, route, run_on, run_routed

__all__ = ["AttnCall", "ENV_VAR", "FEATURES", "PATHS", "Direct", "Path", "Route", "attend", "available_paths",
           "candidate_paths", "choose", "choose_routed", "declared_normalizers", "explain",
           "forced_path", "paths_for", "plan_epoch", "prepare_path", "register_path", "route", "run_on", "run_path",
           "run_routed", "set_forced_path"]


def _register_paths() -> None:
    """Import this folder's path modules and family folders: each registers its path(s) with ``register_path``."""
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name not in ("base", "reference", "memory", "dispatch", "variants"):
            importlib.import_module(f"{__name__}.{info.name}")


_register_paths()
set_forced_path()
