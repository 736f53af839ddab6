"""Shared fixtures: tiny random models of each family, and helpers."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import hf_attnorm  # noqa: E402,F401  (registers everything)
from hf_attnorm.hf.forward import PathRecord, record_paths  # noqa: E402
from hf_attnorm.lab.model_zoo import build_model  # noqa: E402
from hf_attnorm.torch_compat import compile_problem  # noqa: E402


def _threads_per_worker() -> int:
    """Intra-op threads per test process: the cores shared among pytest-xdist's workers (at most 2). Oversubscribed,
    torch's thread pools spin against each other: on 2 busy cores, slices of the slow tests ran 8-15% faster with one
    thread per worker than with two."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, min(2, (os.cpu_count() or 1) // max(1, workers)))


THREADS = _threads_per_worker()
torch.set_num_threads(THREADS)
# the child processes tests start (torchrun, scripts) likewise, unless the user chose (xdist's workers inherit the
# value their controller set for itself: replaced)
if "OMP_NUM_THREADS" not in os.environ or os.environ.get("HF_ATTNORM_TESTS_SET_THREADS") == "1":
    os.environ.update(OMP_NUM_THREADS=str(THREADS), HF_ATTNORM_TESTS_SET_THREADS="1")

#: marks the torch.compile tests: skipped, with the reason, on a torch whose compiler cannot compile the models
needs_compile = pytest.mark.skipif(compile_problem() is not None, reason=compile_problem() or "")
#: and those compiling with inductor (the default backend) on the CPU, which needs a newer torch still
needs_compile_inductor = pytest.mark.skipif(compile_problem("inductor") is not None,
                                            reason=compile_problem("inductor") or "")

#: (family, task) of every tiny model the generic tests run on
MODEL_KINDS = [("gpt2", "causal_lm"), ("bert", "encoder"), ("bert", "masked_lm"), ("llama", "causal_lm")]
MODEL_IDS = [f"{f}-{t}" for f, t in MODEL_KINDS]


#: the path (and mask kind) of the most recent attention call of the running test (tests reset ``.path`` to "" before
#: a check); written for every test by the autouse fixture below
LAST_CALL = PathRecord()


@pytest.fixture(autouse=True)
def _record_attention_paths():
    LAST_CALL.path, LAST_CALL.mask, LAST_CALL.paths = "", "", []
    with record_paths(LAST_CALL):
        yield


def model_output(out) -> torch.Tensor:
    """logits, or last_hidden_state for encoders."""
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def mask_of_kind(kind: str, B: int, H: int, Lq: int, Lk: int, causal: bool) -> torch.Tensor | None:
    """A keep mask for kernel tests: "none", "padding" (left padding in batch row 0 with fully masked query rows,
    right padding in row 1; causal on top when asked) or per-head random masks (any other kind)."""
    if kind == "none":
        return None
    if kind == "padding":  # left padding in row 0 (with fully masked query rows), right padding in row 1
        keep = torch.ones(B, 1, Lq, Lk, dtype=torch.bool)
        keep[0, :, :, :4] = False
        keep[0, :, :4] = False
        keep[1, :, :, Lk - 3:] = False
        if causal:
            keep &= torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq)
        return keep
    keep = torch.rand(B, H, Lq, Lk, generator=torch.Generator().manual_seed(3)) > 0.4  # per-head masks
    keep[:, 0, 0] = False
    return keep


def first_implementations(key, names=None) -> list[str]:
    """The first implementation (registry order, from ``names``, default every one) of each value of
    ``key(settings)``: a sample for the slow tests whose other implementations repeat the same code."""
    from hf_attnorm.registry import PRESETS
    from hf_attnorm.settings import resolve_settings

    first: dict[object, str] = {}
    for impl in PRESETS if names is None else names:
        first.setdefault(key(resolve_settings(impl)), impl)
    return list(first.values())


def has_memory(settings) -> bool:
    """Learned memory key/values (``num_mem_kv``) in these settings."""
    return settings.options.get("num_mem_kv", 0) > 0


def tiny(family: str, task: str, implementation: str = "softmax", **kw) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_model(family, "micro", task=task, vocab_size=97, max_positions=64,
                            attn_implementation=implementation, **kw)
    return model.eval()


def pytest_collection_modifyitems(config, items):
    """``long``-marked tests run first (a stable sort): pytest-xdist hands out tests in collection order, so a
    minutes-long test collected last would leave one core idle at the end while it runs. ``gpu``-marked tests skip,
    with the reason, where torch sees no CUDA device (CI, CPU-only torch)."""
    items.sort(key=lambda item: "long" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: torch {torch.__version__} (CUDA build: {torch.version.cuda}) "
                                   "sees none; run scripts/gpu_check.sh on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=MODEL_KINDS, ids=MODEL_IDS)
def model_kind(request):
    return request.param
