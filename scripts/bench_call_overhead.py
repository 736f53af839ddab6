"""What one attention call costs beyond its kernel, on a decode-sized call (one query, few keys) where the Python
around the kernel matters most: microseconds per call of transformers' attention function (the module's state, the
mask, ``make_call``, dispatch, the kernel), of the same call with its plan's direct entry set aside (the planned
route: ``make_call``, the routed path; only where the plan has a direct entry), of ``make_call`` alone, of ``attend``
alone, of transformers' own sdpa attention function (what ``attn_implementation="sdpa"`` calls: the goal's
reference) and of SDPA alone. The functions are timed interleaved (one sample of each in turn), so a change in the
machine's load hits all of them alike.

    python scripts/bench_call_overhead.py --implementations softmax symax ssmax --output_dir bench/call_overhead
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap.py"))  # offline; checkout

from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from hf_attnorm.attention import make_call  # noqa: E402
from hf_attnorm.hf.forward import hf_attention_forward, plans_of  # noqa: E402
from hf_attnorm.kernels import attend  # noqa: E402
from hf_attnorm.lab.model_zoo import build_model  # noqa: E402
from hf_attnorm.lab.speed.timing import per_call_us  # noqa: E402


def measure(implementation: str, keys: int, calls: int, repeats: int) -> dict[str, float]:
    model = build_model("llama", "micro", task="causal_lm", vocab_size=97, max_positions=max(64, keys + 1),
                        attn_implementation=implementation).eval()
    module = model.model.layers[0].self_attn
    state = module.attnorm
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    dim = model.config.hidden_size // heads
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, 1, dim, generator=g)
    k, v = (torch.randn(1, kv_heads, keys, dim, generator=g) for _ in range(2))
    scaling = dim ** -0.5
    # the keywords transformers' Llama passes its attention function at a cached decode step (both functions get them)
    kw = {"position_ids": torch.tensor([[keys]]), "use_cache": True}
    call = make_call(q, k, v, state.settings, state(q.device), None, True, scaling, module_info=state.module_info)
    kr, vr = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    with torch.no_grad(), warnings.catch_warnings():  # the call's plan (made by its first call)
        warnings.simplefilter("ignore")
        hf_attention_forward(module, q, k, v, None, scaling, implementation=implementation, **kw)
    plans = list(plans_of(module).values())
    direct = plans[0].direct if len(plans) == 1 else None

    def routed():  # the same call with the plan's direct entry set aside: its route, make_call and the path
        plans[0].direct = None
        try:
            return hf_attention_forward(module, q, k, v, None, scaling, implementation=implementation, **kw)
        finally:
            plans[0].direct = direct

    # (linear attention warns once that a call without a cache cannot keep its recurrent state: expected here)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = per_call_us({
            "attention_function_us":
                lambda: hf_attention_forward(module, q, k, v, None, scaling, implementation=implementation, **kw),
            **({"planned_route_us": routed} if direct is not None else {}),
            "make_call_us": lambda: make_call(q, k, v, state.settings, state(q.device), None, True, scaling,
                                              module_info=state.module_info),
            "attend_us": lambda: attend(call),
            "transformers_sdpa_function_us":
                lambda: sdpa_attention_forward(module, q, k, v, None, scaling=scaling, **kw),
            "sdpa_us": lambda: F.scaled_dot_product_attention(q, kr, vr, scale=scaling),
        }, calls, repeats)
    row["above_transformers_sdpa_us"] = row["attention_function_us"] - row["transformers_sdpa_function_us"]
    row["path"], row["direct"] = (plans[0].path or "", direct is not None) if plans else ("", False)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--implementations", nargs="+", default=["softmax", "symax", "ssmax", "linear"],
                        help="attention implementations to measure (default: softmax symax ssmax linear)")
    parser.add_argument("--keys", type=int, default=32, help="cached keys of the call (default 32)")
    parser.add_argument("--calls", type=int, default=2000, help="calls per timing sample (default 2000)")
    parser.add_argument("--repeats", type=int, default=7, help="timing samples; the median is kept (default 7)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--output_dir", type=Path, default=None,
                        help="where to write call_overhead.json (default: print only)")
    args = parser.parse_args(argv)
    for name, value in (("--keys", args.keys), ("--calls", args.calls), ("--repeats", args.repeats),
                        ("--threads", args.threads)):
        if value < 1:
            parser.error(f"{name} must be at least 1, got {value}")
    torch.set_num_threads(args.threads)
    rows = {}
    for implementation in args.implementations:
        rows[implementation] = measure(implementation, args.keys, args.calls, args.repeats)
        print(implementation, " ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                        for k, v in rows[implementation].items()), flush=True)
    result = {"rows": rows, "keys": args.keys, "calls": args.calls, "repeats": args.repeats,
              "threads": args.threads, "torch": torch.__version__, "load_average": os.getloadavg()}
    if args.output_dir is not None:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        (args.output_dir / "call_overhead.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
