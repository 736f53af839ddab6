"""Pretraining and fine-tuning with accelerate.

``run_pretraining(argv)`` trains a GPT-2, BERT (masked LM) or Llama model from scratch (a ``model_zoo`` size preset
or a config file); ``run_finetuning(argv)`` starts from any checkpoint folder (ours, SmolLM2, MiniLM), optionally
swapping the attention normalizer ("surgery"). Both take the flags of transformers' ``run_clm_no_trainer.py`` /
``run_mlm_no_trainer.py`` plus the attnorm ones, run under ``python`` or ``accelerate launch`` (any number of
processes), and return a summary dict (also written to ``<output_dir>/training_summary.json``).

One module per concern:

* ``args``: ``TrainingArguments``, the dataclass whose fields (with help metadata) are the flags of both scripts;
* ``setup``: attention settings, model and tokenizer, tokenised data;
* ``checkpoints``: the output folder, ``step_N`` checkpoints (save, rotate, resume) and the final model;
* ``trackers``: ``--with_tracking`` (accelerate's trackers or the JSONL file tracker);
* ``loop``: ``run`` (setup in order) and ``Loop.train`` (the optimizer-step loop), the summary.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from ...registry import AttnormError
from ..cli import offline_by_default
from ..data import DataError
from .args import (
    MODEL_CARD_SUBDIR,
    TrainingArguments,
    TrainingError,
    build_parser,
    list_registered,
    parse_args,
    parse_attnorm_options,
)
from .checkpoints import ARGS_FILE, STATE_FILE, SUMMARY_FILE, latest_checkpoint, list_checkpoints
from .loop import evaluate_loss, format_summary, run


def _run(kind: str, argv: Sequence[str] | None) -> dict[str, Any]:
    args = parse_args(kind, argv)
    if args.list:
        print(list_registered())
        return {}
    return run(args)


def run_pretraining(argv: list[str] | None = None) -> dict[str, Any]:
    """Pretrain from scratch with the flags of ``scripts/pretrain.py`` (``--help``); returns the summary dict:
    output_dir, steps, seconds, tokens_per_second, train_losses [[step, loss]], val_losses [[step, loss]],
    final_val_loss, final_val_perplexity, attnorm (settings dict), block_size, model_type, and more.
    Raises ``TrainingError`` (a ValueError) on bad input, before training."""
    return _run("pretrain", argv)


def run_finetuning(argv: list[str] | None = None) -> dict[str, Any]:
    """Fine-tune a checkpoint with the flags of ``scripts/finetune.py`` (``--help``); same summary as
    ``run_pretraining``."""
    return _run("finetune", argv)


@offline_by_default()
def main(kind: str, argv: list[str] | None = None) -> int:
    """The command line of ``kind`` ("pretrain" or "finetune"), offline by default: bad input ->
    ``<kind>.py: error: ...`` and exit code 2; Ctrl-C -> 130; else 0."""
    try:
        _run(kind, argv)
    except (TrainingError, DataError, AttnormError) as exc:
        print(f"{kind}.py: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{kind}.py: interrupted", file=sys.stderr)
        return 130
    return 0


def pretrain_main(argv: list[str] | None = None) -> int:
    """``scripts/pretrain.py`` and the console command ``hf-attnorm-pretrain``: ``main("pretrain", argv)``."""
    return main("pretrain", argv)


def finetune_main(argv: list[str] | None = None) -> int:
    """``scripts/finetune.py`` and the console command ``hf-attnorm-finetune``: ``main("finetune", argv)``."""
    return main("finetune", argv)


__all__ = ["ARGS_FILE", "MODEL_CARD_SUBDIR", "STATE_FILE", "SUMMARY_FILE", "TrainingArguments", "TrainingError",
           "build_parser", "evaluate_loss", "finetune_main", "format_summary", "latest_checkpoint", "list_checkpoints",
           "main", "parse_attnorm_options", "pretrain_main", "run_finetuning", "run_pretraining"]
