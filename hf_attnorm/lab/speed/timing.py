"""Timing for the CPU micro-benchmarks (scripts/bench_call_overhead.py, scripts/bench_one_query.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def per_call_us(fns: dict[str, Callable[[], object]], calls: int, repeats: int) -> dict[str, float]:
    """Median over ``repeats`` of the mean microseconds of ``calls`` calls of each function, the samples of the
    functions taken in turn (interleaved, so a change in the machine's load hits all of them alike); each function
    is called once first, untimed."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}
