"""One cached decode step's attention on a CPU: ``one_query_softmax`` (kernels/base.py: two matrix products with a
kv head's query heads as one matrix) against SDPA's CPU flash kernel on the same call, microseconds per call, with
and without an additive float mask (forgetting attention's decay, of a real gate's size: -|c_L - c_j| with
c the cumulative sum of log sigmoid(2), so most weights underflow as they do in a long decode) and with the sink's
log-sum-exp. The functions are timed interleaved (one sample of each in turn), so a change in the machine's load
hits all of them alike; the ratio is flash over one_query (above 1: one_query is faster).

With ``--model_implementations``, also whole cached decode steps of the decode benchmark's tiny Llama (4 layers,
hidden 256, 8/2 heads, as scripts/bench_decode.py) holding each of ``--model_keys`` keys: steps where every
one-query call that can take the one-query form does (``ONE_QUERY_KEYS`` set to 1) alternating one by one with
steps of a second cache where none does (set beyond any length), ratio on over off
(below 1: the form is faster in the whole step). This is what the thresholds are chosen from.

    python scripts/bench_one_query.py --keys 256 512 1024 2048 8192 --threads 2 --output_dir bench/one_query
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap.py"))  # offline; checkout

import hf_attnorm  # noqa: E402
from hf_attnorm.hf import compat  # noqa: E402
from hf_attnorm.kernels import base  # noqa: E402
from hf_attnorm.kernels.base import ONE_QUERY_KEYS, one_query_softmax  # noqa: E402
from hf_attnorm.lab.speed.timing import per_call_us  # noqa: E402

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def measure(keys: int, heads: int, kv_heads: int, dim: int, calls: int, repeats: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, 1, dim, generator=g)
    k, v = (torch.randn(1, kv_heads, keys, dim, generator=g) for _ in range(2))
    c = torch.nn.functional.logsigmoid(torch.full((1, heads, keys), 2.0, dtype=torch.float64)).cumsum(-1)
    decay = (c[..., -1:] - c).unsqueeze(2).float()  # [1, H, 1, Lk], <= 0
    scale = dim ** -0.5
    with torch.no_grad():
        row = per_call_us({
            "flash_us": lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True),
            "one_query_us": lambda: one_query_softmax(q, k, v, scale),
            "flash_mask_us": lambda: _FLASH(q, k, v, 0.0, False, attn_mask=decay, scale=scale),
            "one_query_mask_us": lambda: one_query_softmax(q, k, v, scale, decay),
            "flash_lse_us": lambda: _FLASH(q, k, v, 0.0, False, scale=scale),
            "one_query_lse_us": lambda: one_query_softmax(q, k, v, scale, None, True),
        }, calls, repeats)
    for kind in ("", "_mask", "_lse"):
        row[f"ratio{kind}"] = row[f"flash{kind}_us"] / row[f"one_query{kind}_us"]
    return row


def in_model(implementation: str, keys: int, steps: int) -> dict[str, float]:
    """Median ms of a cached decode step of the tiny Llama holding ``keys`` keys with the one-query form on at
    every length and off, their steps alternating one by one on two caches of the same prompt."""
    import warnings

    from transformers import DynamicCache

    from hf_attnorm.lab.model_zoo import Size, build_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_model("llama", Size(256, 4, 8, 2, 512), vocab_size=1000, max_positions=keys + steps + 8,
                            attn_implementation="sdpa").eval()
        hf_attnorm.apply(model, implementation)
    ids = torch.randint(1, 1000, (1, keys), generator=torch.Generator().manual_seed(keys))
    threshold = base.ONE_QUERY_KEYS
    never = 1 << 62
    times: dict[bool, list[float]] = {True: [], False: []}
    with torch.no_grad():
        state = {}
        for on in (True, False):
            cache = DynamicCache(config=model.config)
            out = model(ids, **compat.cache_kwargs(model, cache), use_cache=True)
            state[on] = [cache, out.logits[:, -1:].argmax(-1)]
        try:
            for step in range(steps + 2):
                for on in (True, False):
                    base.ONE_QUERY_KEYS = 1 if on else never
                    cache, tok = state[on]
                    t0 = time.perf_counter()
                    out = model(tok, **compat.cache_kwargs(model, cache), use_cache=True)
                    if step >= 2:  # (two warm-up steps)
                        times[on].append(time.perf_counter() - t0)
                    state[on][1] = out.logits[:, -1:].argmax(-1)
        finally:
            base.ONE_QUERY_KEYS = threshold
    on_ms, off_ms = (1000 * statistics.median(times[x]) for x in (True, False))
    return {"on_ms": on_ms, "off_ms": off_ms, "ratio_on_over_off": on_ms / off_ms}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", nargs="+", type=int, default=[256, 512, 1024, 2048, 8192],
                        help="cached keys of the call (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    parser.add_argument("--kv_heads", type=int, default=2, help="key/value heads (default 2)")
    parser.add_argument("--dim", type=int, default=32, help="head dim (default 32, the decode benchmark's model)")
    parser.add_argument("--calls", type=int, default=200, help="calls per timing sample (default 200)")
    parser.add_argument("--repeats", type=int, default=9, help="timing samples; the median is kept (default 9)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--model_implementations", nargs="+", default=[],
                        help="also time whole decode steps of a tiny Llama with these implementations (default: none)")
    parser.add_argument("--model_keys", nargs="+", type=int, default=[2048, 4096, 8192],
                        help="cached keys of those decode steps (default: %(default)s)")
    parser.add_argument("--model_steps", type=int, default=64,
                        help="timed decode steps per cache (default 64)")
    parser.add_argument("--output_dir", type=Path, default=None,
                        help="where to write one_query.json (default: print only)")
    args = parser.parse_args(argv)
    for name, value in (("--calls", args.calls), ("--repeats", args.repeats), ("--threads", args.threads),
                        ("--heads", args.heads), ("--kv_heads", args.kv_heads), ("--dim", args.dim),
                        ("--model_steps", args.model_steps), *(("--keys", n) for n in args.keys),
                        *(("--model_keys", n) for n in args.model_keys)):
        if value < 1:
            parser.error(f"{name} must be at least 1, got {value}")
    if args.heads % args.kv_heads:
        parser.error(f"--heads ({args.heads}) must be a multiple of --kv_heads ({args.kv_heads})")
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    rows = {}
    for keys in args.keys:
        rows[str(keys)] = measure(keys, args.heads, args.kv_heads, args.dim, args.calls, args.repeats)
        print(f"Lk={keys} " + " ".join(f"{k} {v:.2f}" if k.startswith("ratio") else f"{k} {v:.1f}"
                                       for k, v in rows[str(keys)].items()), flush=True)
    model_rows = {}
    for implementation in args.model_implementations:
        for keys in args.model_keys:
            row = in_model(implementation, keys, args.model_steps)
            model_rows[f"{implementation} {keys}"] = row
            print(f"{implementation} Lk={keys} on {row['on_ms']:.2f} ms off {row['off_ms']:.2f} ms "
                  f"ratio {row['ratio_on_over_off']:.3f}", flush=True)
    result = {"rows": rows, "model_rows": model_rows, "model_steps": args.model_steps,
              "heads": args.heads, "kv_heads": args.kv_heads, "dim": args.dim, "calls": args.calls,
              "repeats": args.repeats, "threads": args.threads, "one_query_keys": ONE_QUERY_KEYS,
              "torch": torch.__version__, "load_average_start": load, "load_average_end": os.getloadavg()}
    if args.output_dir is not None:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        (args.output_dir / "one_query.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
