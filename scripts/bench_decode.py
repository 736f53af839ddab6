#!/usr/bin/env python
"""Prefill and generation time per attention implementation relative to transformers' sdpa, in one process.

A tiny random Llama (4 layers, hidden 256, GQA 8/2 heads by default), one sequence, greedy ``model.generate`` with a
dynamic cache. For each prompt length and repeat, every implementation runs in turn on the same model (switched with
``hf_attnorm.apply``), interleaved with sdpa, so machine noise hits every row alike; the table gives the median
seconds and the median of the per-repeat ratios to the sdpa run next to it (1.00 = sdpa speed).

    python scripts/bench_decode.py --out bench/decode            # prompts 1024 and 4096, 48 new tokens
    python scripts/bench_decode.py --prompts 1024 --repeats 3 --implementations softmax linear

prefill: one forward pass over the prompt (no cache). generate: ``generate(max_new_tokens=N)`` including its own
prefill. decode per token: (generate(N) - generate(1)) / (N - 1), the cost of one cached step. A benchmark, not a
test.

    python scripts/bench_decode.py --curve 512 1024 2048 4096 8192 --out bench/decode

``--curve``: instead, the time of one decode step (a forward of one token on a dynamic cache holding L keys) against
the context length L, for sdpa and each of ``--curve_implementations`` (``linear_exact``: linear forced onto its
exact O(Lk) one-query path, i.e. without the recurrent state): each implementation prefills its own cache, and so
does a twin of the model with the same weights on transformers' sdpa; then ``--steps`` single-token forwards of the
two are timed one by one, alternating (twin, implementation, twin, ...), so that the ratio of their medians is
paired step by step; implementations are interleaved by repeat and the ratio is the median over repeats. Writes
curve.json, curve.md and curve.png (when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import sys
import time
import warnings
from pathlib import Path

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap.py"))  # offline; checkout

import torch  # noqa: E402

import hf_attnorm  # noqa: E402
from hf_attnorm.hf import compat  # noqa: E402

DEFAULT_IMPLS = ["softmax", "softmax1", "ssmax", "sigmoid", "symax", "entmax15", "linear"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--implementations", nargs="+", default=DEFAULT_IMPLS,
                   help="hf_attnorm implementations to measure against sdpa (default: %(default)s)")
    p.add_argument("--prompts", nargs="+", type=int, default=[1024, 4096], help="prompt lengths in tokens")
    p.add_argument("--new_tokens", type=int, default=48, help="tokens generated per generate() call")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats per prompt length (median taken)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--hidden", type=int, default=256, help="model width")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv_heads", type=int, default=2, help="key/value heads (GQA)")
    p.add_argument("--curve", nargs="+", type=int, default=None,
                   help="context lengths for the decode-step curve (replaces the prefill/generate table)")
    p.add_argument("--curve_implementations", nargs="+", default=["softmax", "linear", "linear_exact"],
                   help="implementations on the curve besides sdpa (default: %(default)s); 'all': every registered "
                        "attn_implementation (hf_attnorm.available())")
    p.add_argument("--steps", type=int, default=16, help="curve: timed decode steps per length and repeat")
    p.add_argument("--out", type=Path, default=Path("bench/decode"),
                   help="output directory: decode.json and decode.md are written there")
    return p.parse_args(argv)


def build(args: argparse.Namespace, max_len: int) -> torch.nn.Module:
    from hf_attnorm.lab.model_zoo import Size, build_model

    size = Size(args.hidden, args.layers, args.heads, args.kv_heads, 2 * args.hidden)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_model("llama", size, vocab_size=1000, max_positions=max_len, attn_implementation="sdpa")
    model.generation_config.pad_token_id = 0
    return model.eval()


#: pseudo-implementation: ``linear`` forced onto its exact O(Lk) path (no recurrent state), for before/after rows
EXACT = {"linear_exact": ("linear", "linear_chunked")}


def switch(model: torch.nn.Module, impl: str) -> None:
    """Switch the model to ``impl`` (and force a path for the pseudo-implementations of ``EXACT``)."""
    from hf_attnorm.kernels import set_forced_path

    name, forced = EXACT.get(impl, (impl, "auto"))
    set_forced_path(forced)
    if name == "sdpa":
        model.set_attn_implementation("sdpa")
    else:
        hf_attnorm.apply(model, name)


def timed(fn) -> float:
    t0 = time.perf_counter()
    with torch.no_grad():
        fn()
    return time.perf_counter() - t0


def measure(model, impl: str, ids: torch.Tensor, new_tokens: int) -> dict[str, float]:
    from hf_attnorm.hf.forward import record_paths

    switch(model, impl)
    with record_paths() as prefill_rec:
        prefill = timed(lambda: model(ids, use_cache=False))
    with record_paths() as gen_rec:
        gen = timed(lambda: model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                           do_sample=False))
    first = timed(lambda: model.generate(ids, max_new_tokens=1, do_sample=False))  # generate's own prefill
    return {"prefill": prefill, "generate": gen, "decode_per_token": max(gen - first, 0.0) / max(new_tokens - 1, 1),
            "path": prefill_rec.path or "sdpa", "decode_path": gen_rec.path or "sdpa"}


def _prefilled(model, ids: torch.Tensor):
    """A dynamic cache holding ``ids`` [1, L] and the greedy next token [1, 1]."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(ids, **compat.cache_kwargs(model, cache), use_cache=True)
    return cache, out.logits[:, -1:].argmax(-1)


def decode_steps(model, impl: str, ids: torch.Tensor, steps: int, twin=None) -> tuple[float, str, float | None]:
    """Median seconds of one cached decode step after a prefill of ``ids`` [1, L] and the path it took; with
    ``twin`` (the same weights on transformers' sdpa), the twin's steps alternate with these one by one on a cache
    of its own, and its median comes third (so machine drift hits both alike: the ratio is paired step by step)."""
    from hf_attnorm.hf.forward import record_paths
    from hf_attnorm.kernels import set_forced_path

    switch(model, impl)
    try:
        with torch.no_grad():
            cache, tok = _prefilled(model, ids)
            if twin is not None:
                twin_cache, twin_tok = _prefilled(twin, ids)
            times, twin_times = [], []
            with record_paths() as rec:
                for _ in range(steps):
                    if twin is not None:
                        t0 = time.perf_counter()
                        out = twin(twin_tok, **compat.cache_kwargs(twin, twin_cache), use_cache=True)
                        twin_times.append(time.perf_counter() - t0)
                        twin_tok = out.logits[:, -1:].argmax(-1)
                    t0 = time.perf_counter()
                    out = model(tok, **compat.cache_kwargs(model, cache), use_cache=True)
                    times.append(time.perf_counter() - t0)
                    tok = out.logits[:, -1:].argmax(-1)
    finally:
        set_forced_path("auto")
    return statistics.median(times), rec.path or "sdpa", statistics.median(twin_times) if twin_times else None


def curve_implementations(names: list[str]) -> list[str]:
    """The curve's implementations besides sdpa: ``names`` with ``all`` expanded to every registered one."""
    out = []
    for name in names:
        out += list(hf_attnorm.available()) if name == "all" else [name]
    return [n for n in dict.fromkeys(out) if n != "sdpa"]


def curve(args: argparse.Namespace) -> None:
    impls = ["sdpa", *curve_implementations(args.curve_implementations)]
    load_at_start, started = os.getloadavg()[0], time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    model = build(args, max(args.curve) + args.steps + 8)
    twin = build(args, max(args.curve) + args.steps + 8)  # transformers' sdpa, the same weights
    twin.load_state_dict(model.state_dict())
    rows = []
    for n in args.curve:
        ids = torch.randint(1, 1000, (1, n), generator=torch.Generator().manual_seed(n))
        for impl in impls:  # warm-up
            decode_steps(model, impl, ids[:, :64], 2, twin)
        runs: dict[str, list[float]] = {i: [] for i in impls}
        # each implementation's own sdpa baseline: the twin's steps, alternating with its steps
        base: dict[str, list[float]] = {i: [] for i in impls}
        paths = {}
        for _ in range(args.repeats):
            for impl in impls:
                t, paths[impl], b = decode_steps(model, impl, ids, args.steps, twin)
                runs[impl].append(t)
                base[impl].append(b)
        for impl in impls:
            ratio = statistics.median(t / b for t, b in zip(runs[impl], base[impl]))
            rows.append({"implementation": impl, "path": paths[impl], "context": n,
                         "step_ms": 1000 * statistics.median(runs[impl]),
                         "sdpa_step_ms": 1000 * statistics.median(base[impl]), "ratio_to_sdpa": ratio})
            print(f"L={n} {impl} [{paths[impl]}]: {rows[-1]['step_ms']:.2f} ms/step ({ratio:.2f}x sdpa)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"threads": args.threads, "repeats": args.repeats, "steps": args.steps, "torch": torch.__version__,
            "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads},
            "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg()[0],
            "date": started, "command": " ".join(["python scripts/bench_decode.py", *sys.argv[1:]])}
    (args.out / "curve.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    # one row per implementation (there may be dozens), one column per context
    lines = ["| implementation | path | " + " | ".join(f"L = {n}: ms/step (x sdpa)" for n in args.curve) + " |",
             "|---|---|" + "---|" * len(args.curve)]
    for impl in impls:
        cells = [next(r for r in rows if r["implementation"] == impl and r["context"] == n) for n in args.curve]
        lines.append(f"| {impl} | {cells[-1]['path']} | "
                     + " | ".join(f"{c['step_ms']:.2f} ({c['ratio_to_sdpa']:.2f}x)" for c in cells) + " |")
    (args.out / "curve.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for impl in impls:
        pts = [(r["context"], r["step_ms"]) for r in rows if r["implementation"] == impl]
        ax.plot(*zip(*pts), marker="o", label=impl)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cached keys L")
    ax.set_ylabel("ms per decode step (4 layers, 1 thread)")
    ax.set_title("one decode step vs context length")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out / "curve.png", dpi=100)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    if args.curve:
        curve(args)
        return
    impls = [i for i in args.implementations if i != "sdpa"]
    model = build(args, max(args.prompts) + args.new_tokens + 8)
    rows = []
    for n in args.prompts:
        ids = torch.randint(1, 1000, (1, n), generator=torch.Generator().manual_seed(n))
        for impl in ["sdpa", *impls]:  # warm-up: native build, allocator, first-call costs
            measure(model, impl, ids[:, :64], 2)
        runs: dict[str, list[dict[str, float]]] = {i: [] for i in ["sdpa", *impls]}
        for rep in range(args.repeats):
            for impl in impls:
                runs["sdpa"].append(measure(model, "sdpa", ids, args.new_tokens))
                runs[impl].append(measure(model, impl, ids, args.new_tokens))
                print(f"n={n} rep={rep} {impl}: prefill {runs[impl][-1]['prefill']:.3f}s "
                      f"(sdpa {runs['sdpa'][-1]['prefill']:.3f}s), generate {runs[impl][-1]['generate']:.3f}s "
                      f"(sdpa {runs['sdpa'][-1]['generate']:.3f}s) [{runs[impl][-1]['path']}]", flush=True)
        for impl in impls:
            mine = runs[impl]
            # the sdpa run measured just before each of this implementation's runs
            base = [runs["sdpa"][rep * len(impls) + impls.index(impl)] for rep in range(args.repeats)]
            row = {"implementation": impl, "prompt": n, "new_tokens": args.new_tokens, "path": mine[-1]["path"],
                   "decode_path": mine[-1]["decode_path"]}
            for key in ("prefill", "generate", "decode_per_token"):
                row[f"{key}_s"] = statistics.median(r[key] for r in mine)
                row[f"sdpa_{key}_s"] = statistics.median(r[key] for r in base)
                row[f"{key}_ratio"] = statistics.median(
                    r[key] / b[key] if b[key] > 0 else float("nan") for r, b in zip(mine, base))
            rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"threads": args.threads, "repeats": args.repeats, "torch": torch.__version__,
            "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads},
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "load_average_at_start": load}
    (args.out / "decode.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["| implementation | path (prefill / decode) | prompt | prefill s | prefill / sdpa | generate s | "
             "generate / sdpa | decode ms/token | decode / sdpa |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['implementation']} | {r['path']} / {r['decode_path']} | {r['prompt']} | "
                     f"{r['prefill_s']:.3f} | "
                     f"{r['prefill_ratio']:.2f}x | {r['generate_s']:.3f} | {r['generate_ratio']:.2f}x | "
                     f"{1000 * r['decode_per_token_s']:.2f} | {r['decode_per_token_ratio']:.2f}x |")
    (args.out / "decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
