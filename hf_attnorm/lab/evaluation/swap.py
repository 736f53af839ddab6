"""Swap attention normalizers / scales into a pretrained model without training and measure perplexity.

Default: the real SmolLM2-135M-Instruct (Llama, RoPE, GQA 9/3; trained with an 8k context) on the embedded
Shakespeare validation text at 512 and 2048 tokens — the "swap in after pretraining" experiment of the SSMax paper.
The same tokens are cut into non-overlapping windows of each context; the loss is also reported per position
bucket (targets at [0, 512), [512, 1024), ... of their window).

A variant is an attn_implementation name with optional attnorm settings, ``name:key=value,key=value``
(``qwen_logn:train_length=512``); ``sdpa``/``eager`` are transformers' own. Default variants and why:

* ``sdpa`` (the original model) and ``softmax`` (hf_attnorm's softmax: must give the same numbers);
* ``log_n``: scaling * ln n (no free parameter);
* ``qwen_logn:train_length=512``: max(1, log_512 n). With SmolLM2's true training length (8192, its
  max_position_embeddings) the scale is exactly 1 below 8192 tokens, i.e. plain softmax at 512 and 2048. L = 512
  (the short evaluation context) makes it act on the positions past 512 of the 2048 windows;
* ``llama4:llama4_floor_scale=512``: 1 + 0.1 ln(1 + floor(n / 512)); Llama 4's floor_scale 8192 is likewise 1 below
  8192, so the floor is moved to 512 for the same reason;
* ``ssmax:ssmax_s=1``: s * ln n with s = 1 (SSMax without any training);
* ``softmax1``: exp(s_i) / (1 + sum exp(s_j)).

Example: ``python scripts/evaluate.py --max_tokens 4096`` (writes results.json and results.md to --output_dir).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from ... import AttnormError, apply
from ..assets import smollm2_path
from ..cli import offline_by_default
from ..data import shakespeare_text
from .perplexity import (
    NATIVE_IMPLEMENTATIONS,
    EvaluationError,
    length_extrapolation,
    load_model,
    parse_variant,
    spread_chunks,
)

DEFAULT_VARIANTS = ["sdpa", "softmax", "log_n", "qwen_logn:train_length=512", "llama4:llama4_floor_scale=512",
                    "ssmax:ssmax_s=1", "softmax1"]


def parse_variant_or_exit(spec: str) -> tuple[str, dict[str, Any]]:
    """``evaluation.parse_variant``: (implementation name, options) of a variant; ``SystemExit`` with the message
    when it is not one."""
    try:
        return parse_variant(spec)
    except (EvaluationError, AttnormError) as e:
        raise SystemExit(f"evaluate.py: error: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model_name_or_path", default=None,
                   help="local causal-LM checkpoint folder (with tokenizer); default: the SmolLM2-135M asset")
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS,
                   help="attention variants: name or name:key=value,... (attnorm options)")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048],
                   help="evaluation contexts in tokens; the smallest is also the position-bucket width")
    p.add_argument("--max_tokens", type=int, default=4096,
                   help="token budget: chunks of the largest context spread evenly over the text, N tokens in all "
                        "(rounded down to a multiple of it); the same tokens at every context")
    p.add_argument("--text_file", default=None,
                   help="evaluate on this UTF-8 text file instead of the embedded Shakespeare validation split")
    p.add_argument("--batch_size", type=int, default=1, help="windows per forward pass")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--output_dir", default="runs/evaluate_smollm2", help="where results.json and results.md go")
    p.add_argument("--no_progress", action="store_true", help="hide progress bars")
    return p


def load_text(path: str | None) -> str:
    """The UTF-8 text of ``path``, or the embedded Shakespeare validation split when None."""
    if path is not None:
        return Path(path).read_text(encoding="utf-8")
    return shakespeare_text("validation")


def markdown_table(rows: list[dict[str, Any]], contexts: list[int]) -> str:
    """One row per variant: perplexity at each context, the change from softmax (else the first row) at the longest,
    and the perplexity of each position bucket of the longest context."""
    ref = next((r for r in rows if r["variant"] == "softmax"), rows[0])
    head = ["variant"] + [f"ppl @ {c}" for c in contexts] + [f"Δ vs {ref['variant']} @ {contexts[-1]}"]
    bucket_w = contexts[0]
    n_b = contexts[-1] // bucket_w
    head += [f"ppl pos {i * bucket_w}–{(i + 1) * bucket_w} @ {contexts[-1]}" for i in range(n_b)] if n_b > 1 else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"`{r['variant']}`"] + [f"{r['perplexity'][str(c)]:.3f}" for c in contexts]
        delta = r["perplexity"][str(contexts[-1])] - ref["perplexity"][str(contexts[-1])]
        cells.append(f"{delta:+.3f}")
        if n_b > 1:
            cells += [f"{b['perplexity']:.3f}" for b in r["buckets"][str(contexts[-1])]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """The evaluation with these flags (``sys.argv[1:]`` when None): writes results.json and results.md and returns
    what results.json holds. Bad input raises ``SystemExit`` with the message."""
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    contexts = sorted(set(args.contexts))
    if contexts[0] < 2 or any(c % contexts[0] for c in contexts):
        raise SystemExit(f"evaluate.py: error: --contexts must be >= 2 and multiples of the smallest one, got "
                         f"{contexts}")
    variants = [(spec, *parse_variant_or_exit(spec)) for spec in args.variants]
    path = args.model_name_or_path
    if path is None:
        path = str(smollm2_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    stream = torch.tensor(tokenizer(load_text(args.text_file), add_special_tokens=False, verbose=False)["input_ids"])
    try:  # chunks of the longest context spread over the whole text: the same tokens at every context
        ids = spread_chunks(stream, contexts[-1], args.max_tokens)
    except EvaluationError as e:
        raise SystemExit(f"evaluate.py: error: --max_tokens: {e}") from None
    model = load_model(path, attn_implementation="sdpa")
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    start = time.time()
    for spec, name, options in variants:
        t0 = time.time()
        if name in NATIVE_IMPLEMENTATIONS:
            model.set_attn_implementation(name)
        else:
            apply(model, name, **options)
        rep = length_extrapolation(model, ids, contexts[0], [c / contexts[0] for c in contexts],
                                   batch_size=args.batch_size, progress=not args.no_progress)
        row = {
            "variant": spec, "implementation": name, "attnorm": getattr(model.config, "attnorm", None),
            "perplexity": {str(c.context): c.perplexity for c in rep.contexts},
            "mean_nll": {str(c.context): c.mean_nll for c in rep.contexts},
            "buckets": {str(c.context): c.buckets for c in rep.contexts},
            "tokens_used": rep.tokens_used, "seconds": round(time.time() - t0, 1),
        }
        rows.append(row)
        ppl = ", ".join(f"{k}: {v:.3f}" for k, v in row["perplexity"].items())
        print(f"{spec:32s} perplexity {ppl}  ({row['seconds']:.0f} s)", flush=True)
    table = markdown_table(rows, contexts)
    result = {"model": path, "contexts": contexts, "max_tokens": args.max_tokens,
              "tokens_used": rows[0]["tokens_used"], "text_tokens": len(stream),
              "text": args.text_file or "shakespeare validation",
              "seconds": round(time.time() - start, 1), "torch_threads": args.threads, "variants": rows,
              "table": table}
    (out_dir / "results.json").write_text(json.dumps(result, indent=2, allow_nan=True))
    (out_dir / "results.md").write_text(
        f"Model: {path}\nTokens: {result['tokens_used']} of {len(stream)} ({len(ids) // contexts[-1]} chunks of "
        f"{contexts[-1]} spread over the text; the same tokens at every context)\n\n{table}\n")
    print()
    print(table)
    print(f"\nwrote {out_dir / 'results.json'} and {out_dir / 'results.md'} in {result['seconds']:.0f} s")
    if any(not math.isfinite(v) for r in rows for v in r["perplexity"].values()):
        print("note: some perplexities are not finite (see results.json)")
    return result


@offline_by_default()
def main(argv: list[str] | None = None) -> int:
    """``scripts/evaluate.py`` and the console command ``hf-attnorm-evaluate``, offline by default; exit code 0."""
    run(argv)
    return 0
