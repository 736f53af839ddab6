#!/usr/bin/env python
"""Throughput of transformers' continuous batching (``model.generate_batch``) per attention implementation.

A tiny random Llama (4 layers, hidden 256, GQA 8/2 heads, fixed seed) on the CPU serves a fixed set of requests
(mixed prompt lengths, a fixed number of greedy new tokens each). Every implementation runs ``generate_batch`` on
the same model (switched with ``hf_attnorm.apply``), side by side in one process: each repeat runs every row once,
in an order rotated from repeat to repeat, so machine drift hits every row alike. Rows: transformers' ``sdpa``
under continuous batching (the reference row), each hf_attnorm implementation under continuous batching, and
``sdpa`` through sequential ``model.generate``, one request at a time (the baseline of serving without batching).
Reported per row: the median requests/s and generated tokens/s, and the median over repeats of the row's time
divided by the ``sdpa`` continuous-batching time of the same repeat (1.00 = sdpa's speed; the goal is <= 1.2).

The attention paths each implementation ran (``hf_attnorm.hf.forward.record_paths``) are recorded, and, once per
implementation and outside the timing, its ``generate_batch`` tokens are compared with greedy ``model.generate``
run per request. A benchmark, not a test: a mismatch is recorded, not raised.

    python scripts/bench_serving.py                      # the published run (bench/serving), a few minutes
    python scripts/bench_serving.py --quick --out-dir /tmp/serving   # smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import runpy
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # this checkout's package, also where another copy is installed
    sys.path.insert(0, str(ROOT))
runpy.run_path(str(ROOT / "scripts" / "_bootstrap.py"))  # offline by default

import torch  # noqa: E402
import transformers  # noqa: E402

import hf_attnorm  # noqa: E402
from hf_attnorm.hf.continuous_batching import continuous_batching_support  # noqa: E402
from hf_attnorm.hf.forward import record_paths  # noqa: E402
from hf_attnorm.settings import resolve_settings  # noqa: E402

DEFAULT_IMPLEMENTATIONS = ["symax", "sigmoid", "ssmax", "entmax15", "stickbreaking"]
#: the row every ratio is taken against, and the row of sequential generate
CB_SDPA, SEQUENTIAL = "sdpa", "sdpa (sequential generate)"
#: the slowdown against sdpa's continuous-batching time that the table checks each row against
GOAL = 1.2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--implementations", nargs="+", default=DEFAULT_IMPLEMENTATIONS,
                   help="hf_attnorm implementations measured beside transformers' sdpa (registry names)")
    p.add_argument("--requests", type=int, default=24, help="number of requests served per run")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[32, 96, 192, 384],
                   help="prompt lengths in tokens, cycled over the requests")
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens generated per request")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timed runs per row (the median is reported)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--hidden", type=int, default=256, help="model width")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    p.add_argument("--mlp", type=int, default=512, help="MLP width")
    p.add_argument("--vocab", type=int, default=1000, help="vocabulary size")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts")
    p.add_argument("--page-size", type=int, default=64, help="continuous batching: tokens per cache page")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="continuous batching: cache blocks (default: enough for every request at once)")
    p.add_argument("--max-batch-tokens", type=int, default=512,
                   help="continuous batching: most tokens in one forward (longer prompts are prefilled in chunks)")
    p.add_argument("--max-requests-per-batch", type=int, default=16,
                   help="continuous batching: most requests in one forward (the others wait for a slot)")
    p.add_argument("--check-requests", type=int, default=None,
                   help="requests whose tokens are compared with per-request generate (default: all; 0: none)")
    p.add_argument("--render-only", action="store_true",
                   help="measure nothing: rewrite results.md in --out-dir from its results.json")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 6 requests of 8-40 tokens, 4 new tokens, one repeat, 2 layers")
    p.add_argument("--out-dir", type=Path, default=Path("bench/serving"),
                   help="where results.json and results.md are written (nothing is written elsewhere)")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.prompt_lengths, args.new_tokens, args.repeats, args.layers = 6, [8, 24, 40], 4, 1, 2
        args.max_batch_tokens = 64
    for name in ("requests", "new_tokens", "repeats", "threads", "hidden", "layers", "heads", "kv_heads", "mlp",
                 "page_size", "max_batch_tokens", "max_requests_per_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(n < 1 for n in args.prompt_lengths):
        p.error(f"--prompt-lengths must be >= 1, got {args.prompt_lengths}")
    if args.heads % args.kv_heads:
        p.error(f"--kv-heads must divide --heads ({args.heads}), got {args.kv_heads}")
    args.implementations = [i for i in dict.fromkeys(args.implementations) if i != "sdpa"]
    for impl in args.implementations:
        mode, note = continuous_batching_support(resolve_settings(impl))  # (raises on an unknown name)
        if mode == "refused":
            p.error(f"--implementations: continuous batching refuses {impl!r}: {note}")
    return args


# ------------------------------------------------------------------------------------------------ model and requests


def build(args: argparse.Namespace) -> transformers.PreTrainedModel:
    """A random-init Llama. Untied embeddings and a wide initialisation make the greedy tokens depend on attention
    (a narrow one repeats a token whatever attention does), so the token comparison means something."""
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, intermediate_size=args.mlp,
        max_position_embeddings=max(args.prompt_lengths) + args.new_tokens + 8, tie_word_embeddings=False,
        initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.LlamaForCausalLM(config).eval()


def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed + 1)
    lengths = [args.prompt_lengths[i % len(args.prompt_lengths)] for i in range(args.requests)]
    return [torch.randint(1, args.vocab, (n,), generator=g).tolist() for n in lengths]


def generation_config(args: argparse.Namespace) -> transformers.GenerationConfig:
    # no end-of-sequence token: every request generates exactly --new-tokens
    return transformers.GenerationConfig(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                         do_sample=False, eos_token_id=None, pad_token_id=0)


def cb_config(args: argparse.Namespace, prompts: list[list[int]]) -> transformers.ContinuousBatchingConfig:
    pages = sum(-(-(len(p) + args.new_tokens) // args.page_size) for p in prompts)
    return transformers.ContinuousBatchingConfig(
        page_size=args.page_size, num_blocks=args.num_blocks or pages + 8, max_batch_tokens=args.max_batch_tokens,
        max_requests_per_batch=args.max_requests_per_batch)


def switch(model: transformers.PreTrainedModel, impl: str) -> None:
    if impl == "sdpa":
        model.set_attn_implementation("sdpa")
    else:
        hf_attnorm.apply(model, impl)


# ------------------------------------------------------------------------------------------------ runs


def run_batch(model, args, prompts) -> tuple[float, list[list[int]], Counter, int]:
    """One ``generate_batch`` over every prompt: (seconds, tokens per request, attention paths run, packed calls)."""
    with record_paths() as rec:
        t0 = time.perf_counter()
        out = model.generate_batch(prompts, generation_config=generation_config(args),
                                   continuous_batching_config=cb_config(args, prompts))
        seconds = time.perf_counter() - t0
    if len(out) != len(prompts):
        raise RuntimeError(f"generate_batch returned {len(out)} of {len(prompts)} requests (see its log)")
    # the manager names requests req_0, req_1, ... in submission order
    tokens = [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.rsplit("_", 1)[-1]))]
    return seconds, tokens, Counter(rec.paths), rec.packed


def run_sequential(model, args, prompts) -> tuple[float, list[list[int]], Counter]:
    """``model.generate`` per prompt, one after the other (no padding): (seconds, tokens per request, paths run)."""
    config = generation_config(args)
    tokens = []
    with record_paths() as rec, torch.no_grad():
        t0 = time.perf_counter()
        for p in prompts:
            tokens.append(model.generate(torch.tensor([p]), generation_config=config)[0, len(p):].tolist())
        seconds = time.perf_counter() - t0
    return seconds, tokens, Counter(rec.paths)


def paths_text(paths: Counter) -> str:
    """The attention paths run, most calls first ("path a / path b"); "sdpa (transformers)" when none was ours."""
    return " / ".join(p for p, _ in paths.most_common()) or "sdpa (transformers)"


def check_tokens(model, args, impl: str, prompts, batch_tokens: list[list[int]], reference=None) -> dict[str, Any]:
    """Whether generate_batch's tokens equal greedy ``generate`` per request, on the first --check-requests."""
    k = len(prompts) if args.check_requests is None else min(args.check_requests, len(prompts))
    if k == 0:
        return {"requests_checked": 0}
    if reference is None:
        switch(model, impl)
        _, reference, paths = run_sequential(model, args, prompts[:k])
    else:
        paths = Counter()
    differ = [i for i in range(k) if batch_tokens[i] != reference[i]]
    return {"requests_checked": k, "equal": not differ, "requests_differing": differ,
            "generate_path": paths_text(paths)}


def checkout_commit() -> str | None:
    """The checkout's commit, "+changes" when files differ from it (None outside a git checkout)."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render_only:
        (args.out_dir / "results.md").write_text(markdown(json.loads((args.out_dir / "results.json").read_text())))
        print(f"wrote {args.out_dir}/results.md")
        return 0
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")  # (transformers' notes on generation settings, once per run)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    load_start = os.getloadavg()
    commit = checkout_commit()  # (at the start: the code that runs)
    started = time.perf_counter()
    model = build(args)
    prompts = make_prompts(args)
    rows = [CB_SDPA, *args.implementations, SEQUENTIAL]
    n_tokens = args.requests * args.new_tokens
    print(f"# {args.requests} requests, prompts {args.prompt_lengths} tokens, {args.new_tokens} new tokens; "
          f"Llama {args.layers}x{args.hidden} heads {args.heads}/{args.kv_heads}; {args.threads} thread(s); "
          f"load average {load_start}", flush=True)

    # untimed: native kernels built or loaded, first-call costs paid, for every row
    for row in rows:
        switch(model, "sdpa" if row == SEQUENTIAL else row)
        if row == SEQUENTIAL:
            run_sequential(model, args, prompts[:1])
        else:
            run_batch(model, args, prompts[:2])

    seconds: dict[str, list[float]] = {r: [] for r in rows}
    ratios: dict[str, list[float]] = {r: [] for r in rows}
    paths: dict[str, Counter] = {r: Counter() for r in rows}
    packed: dict[str, int] = {}
    tokens: dict[str, list[list[int]]] = {}
    for rep in range(args.repeats):
        order = rows[rep % len(rows):] + rows[:rep % len(rows)]  # rotated: no row always first or last
        for row in order:
            switch(model, "sdpa" if row == SEQUENTIAL else row)
            if row == SEQUENTIAL:
                t, out, ran = run_sequential(model, args, prompts)
            else:
                t, out, ran, packed[row] = run_batch(model, args, prompts)
            seconds[row].append(t)
            paths[row] = ran
            if rep == 0:
                tokens[row] = out
            print(f"repeat {rep} {row:28s} {t:7.2f} s  {args.requests / t:6.2f} req/s  {n_tokens / t:7.1f} tok/s  "
                  f"[{paths_text(ran)}]", flush=True)
        for row in rows:
            ratios[row].append(seconds[row][-1] / seconds[CB_SDPA][-1])

    # outside the timing: continuous batching's tokens against per-request greedy generate
    checks = {CB_SDPA: check_tokens(model, args, "sdpa", prompts, tokens[CB_SDPA], tokens[SEQUENTIAL])}
    for impl in args.implementations:
        checks[impl] = check_tokens(model, args, impl, prompts, tokens[impl])
        print(f"tokens {impl}: {checks[impl]}", flush=True)

    table = []
    for row in rows:
        t = statistics.median(seconds[row])
        impl = "sdpa" if row in (CB_SDPA, SEQUENTIAL) else row
        entry = {
            "row": row, "implementation": impl,
            "mode": "sequential generate" if row == SEQUENTIAL else "continuous batching",
            "cb_support": "" if impl == "sdpa" else continuous_batching_support(resolve_settings(impl))[0],
            "path": paths_text(paths[row]), "path_counts": dict(paths[row]), "packed_calls": packed.get(row, 0),
            "seconds": t, "seconds_each": seconds[row],
            "requests_per_s": args.requests / t, "tokens_per_s": n_tokens / t,
            "time_ratio_to_sdpa_cb": statistics.median(ratios[row]),
        }
        if row not in (CB_SDPA, SEQUENTIAL):  # (the goal is for hf_attnorm's implementations)
            entry["within_goal"] = entry["time_ratio_to_sdpa_cb"] <= GOAL
        if row in checks:
            entry["tokens_equal_generate"] = checks[row]
        table.append(entry)

    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["python scripts/bench_serving.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "system": platform.system()},
        "load_average_start": load_start, "load_average_end": os.getloadavg(),
        "wall_seconds": time.perf_counter() - started,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "hf_attnorm": hf_attnorm.__version__,
                     "commit": commit},
        "threads": args.threads, "repeats": args.repeats, "seed": args.seed, "goal_time_ratio": GOAL,
        "model": {"family": "llama", "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                  "kv_heads": args.kv_heads, "mlp": args.mlp, "vocab": args.vocab},
        "workload": {"requests": args.requests, "prompt_lengths": args.prompt_lengths,
                     "prompt_tokens": sum(len(p) for p in prompts), "new_tokens": args.new_tokens,
                     "greedy": True},
        "continuous_batching": {k: v for k, v in vars(cb_config(args, prompts)).items()
                                if k in ("page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch")},
    }
    result = {"meta": meta, "rows": table}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    md = markdown(result)
    (args.out_dir / "results.md").write_text(md)
    print(md)
    print(f"wrote {args.out_dir}/results.json, results.md ({meta['wall_seconds']:.0f} s)")
    return 0


# ------------------------------------------------------------------------------------------------ tables


def markdown(result: dict) -> str:
    """results.md: the summary and the table that docs/benchmarks.md shows (scripts/render_readme.py renders both)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_readme", ROOT / "scripts" / "render_readme.py")
    render = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(render)
    return render.serving_summary(result) + "\n\n" + render.serving_table(result) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
