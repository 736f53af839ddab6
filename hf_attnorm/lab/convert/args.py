"""The command line of ``scripts/convert.py``: its flags, their checks, and the options derived from the chosen
implementation (its softmax-equivalent start, what its calibration needs, its continuation from softmax)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...registry import PRESETS, AttnormError, canonical, is_ours
from ...settings import AttnormSettings, resolve_settings
from .. import data as data_lib
from ..cli import comma_names, int_at_least, non_negative_float, positive_float, token_counts
from ..training.args import TrainingError, parse_attnorm_options
from . import calibration as calibration_lib
from .continuation import ContinuationError, plan_continuation
from .recipes import normalizer_recipe, scale_recipe

ARGS_FILE = "conversion_args.json"
STAGES = ("transfer", "finetune")
#: stage 1's peak learning rate where neither the normalizer nor the scale declares a measured one
TRANSFER_LR = 2e-2
#: the default stage-2 learning rate per --finetune_mode (LoRA adapters start at zero and take a larger one)
FINETUNE_LR = {"lora": 2e-3, "full": 5e-5}
#: where evaluation can happen: before any training, after calibration, after each stage
EVAL_POINTS = ("swapped", "calibrated", *STAGES)
#: flags that may differ between a run and its resumption
RESUME_MAY_DIFFER = ("output_dir", "resume_from_checkpoint", "torch_threads", "overwrite_output_dir")


class ConvertError(ValueError):
    """Bad conversion input, detected before any training step."""


#: kept under its former name (the conversion study's flags use it)
parse_token_counts = token_counts


def _eval_texts(text: str) -> list[str]:
    """comma-separated held-out texts: names of ``data.HELD_OUT_TEXTS`` or text files (checked when read)."""
    return [] if text.strip() in ("", "none") else comma_names(text)


def _stage_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in EVAL_POINTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose among {', '.join(EVAL_POINTS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="convert.py", description=__doc__.split("\n\n")[0],
        epilog="Stage 2 alone (the control of the conversion study): --transfer_steps 0. Swap only and evaluate: "
               "--transfer_steps 0 --finetune_steps 0. Every option: docs/convert.md.")
    g = p.add_argument_group("model")
    g.add_argument("--model_name_or_path", default="smollm2",
                   help="causal-LM folder to convert, or 'smollm2' (the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--attn_implementation", required=True,
                   help="the hf_attnorm implementation to convert to (`python -m hf_attnorm` lists them)")
    g.add_argument("--attnorm", action="append", default=[], metavar="KEY=VALUE",
                   help="an attnorm option of the new implementation (repeatable), e.g. --attnorm eta_learnable=true")
    g = p.add_argument_group("data")
    g.add_argument("--train_file", default=None,
                   help="training text (.txt, .json/.jsonl, .csv); default: the embedded Shakespeare training plays")
    g.add_argument("--validation_file", default=None,
                   help="held-out text for perplexity and transfer errors (with --train_file); default: the embedded "
                        "Shakespeare validation plays (or 5%% of --train_file)")
    g.add_argument("--eval_texts", type=_eval_texts, default=[],
                   help="held-out texts scored beside the validation text at every evaluation, comma-separated: "
                        f"{', '.join(data_lib.HELD_OUT_TEXTS)} (a text of another kind than the training text: "
                        "what the conversion gives back of the model, apart from adapting to the training text) or "
                        "plain-text files; default none")
    g.add_argument("--block_size", type=int_at_least(2), default=512, help="tokens per training sequence")
    g.add_argument("--per_device_train_batch_size", type=int_at_least(1), default=1,
                   help="sequences per process per optimizer step")
    g = p.add_argument_group("calibrated start")
    g.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                   help="before training, set the new normalizer's per-head values from one pass of the original "
                        "model over --calibration_blocks training blocks, where its file declares a formula (sigmoid "
                        "bias, sink logit, ssmax factor; docs/convert.md); --no-calibrate starts from the options' "
                        "values")
    g.add_argument("--calibration_blocks", type=int_at_least(1), default=4,
                   help="training blocks of --block_size tokens the calibration pass reads (spread over the text)")
    g = p.add_argument_group("stage 1: attention transfer")
    g.add_argument("--transfer_steps", type=int_at_least(0), default=20,
                   help="optimizer steps of attention transfer (0 = skip the stage)")
    g.add_argument("--transfer_learning_rate", type=positive_float, default=None,
                   help="peak AdamW learning rate of stage 1 (cosine decay to 10%%); default: the rate measured for "
                        f"the normalizer or its scale (docs/convert.md), else {TRANSFER_LR}")
    g.add_argument("--transfer_lora_r", type=int_at_least(0), default=8,
                   help="LoRA rank on --transfer_lora_targets in stage 1 (0 = train only the normalizer's learnable "
                        "values)")
    g.add_argument("--transfer_lora_targets", type=comma_names, default=["q_proj", "k_proj"],
                   help="comma-separated module names that get LoRA in stage 1")
    g.add_argument("--continuation", action=argparse.BooleanOptionalAction, default=None,
                   help="where the normalizer or scale declares a path from softmax along one option (entmax15: "
                        "alpha-entmax with alpha from 1.001 to 1.5; a constant sink logit from -30; softmax_n's "
                        "n_extra from 0; ssmax's anchor from 1 to 0), stage 1 walks it: it starts at the teacher and "
                        "ends at the asked normalizer. Default: the paths declared on by default (ssmax's is off: "
                        "measured worse than its calibrated start); --continuation: any declared path")
    g.add_argument("--continuation_fraction", type=positive_float, default=0.75,
                   help="share of stage 1's steps over which the continuation's option moves (at most 1; the rest "
                        "train the asked normalizer itself)")
    g.add_argument("--transfer_keep_best", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the held-out per-layer error (the --error_blocks) every --transfer_eval_steps "
                        "steps and at the end of stage 1, and end the stage at the best state seen, its start "
                        "included: stage 1 cannot leave the model worse on that measure than it found it")
    g.add_argument("--transfer_eval_steps", type=int_at_least(1), default=5,
                   help="steps between two held-out error measurements of --transfer_keep_best")
    g.add_argument("--transfer_skip_error", type=non_negative_float, default=0.002,
                   help="skip stage 1 when the mean held-out per-layer error of the start (swapped or calibrated) "
                        "is at most this (0 = never skip; softmax1 starts at about 0.0014 on SmolLM2)")
    g = p.add_argument_group("stage 2: fine-tuning")
    g.add_argument("--finetune_steps", type=int_at_least(0), default=20,
                   help="optimizer steps of next-token fine-tuning (0 = skip the stage)")
    g.add_argument("--finetune_mode", choices=["lora", "full"], default="lora",
                   help="stage 2 trains LoRA adapters (merged at the end) or every weight")
    g.add_argument("--finetune_learning_rate", type=positive_float, default=None,
                   help="peak AdamW learning rate of stage 2 (cosine decay to 10%%); default "
                        f"{FINETUNE_LR['lora']} with LoRA, {FINETUNE_LR['full']} for --finetune_mode full")
    g.add_argument("--lora_r", type=int_at_least(1), default=8, help="LoRA rank of stage 2 (--finetune_mode lora)")
    g.add_argument("--finetune_lora_targets", type=comma_names, default=["q_proj", "k_proj", "v_proj", "o_proj"],
                   help="comma-separated module names that get LoRA in stage 2")
    g.add_argument("--distill", action=argparse.BooleanOptionalAction, default=False,
                   help="stage 2 trains on the KL divergence to the original model's next-token distributions "
                        "(its top --distill_top_k tokens and the rest, per position; computed once before any "
                        "training, no second copy of the model) instead of the next-token loss alone")
    g.add_argument("--distill_top_k", type=int_at_least(1), default=64,
                   help="teacher tokens kept per position for --distill (the rest of the vocabulary is one outcome)")
    g.add_argument("--distill_weight", type=positive_float, default=1.0,
                   help="with --distill, the loss is this times the KL plus (1 - this) times the next-token loss "
                        "(at most 1)")
    g.add_argument("--weight_decay", type=non_negative_float, default=0.0, help="AdamW weight decay (both stages)")
    g.add_argument("--max_grad_norm", type=non_negative_float, default=1.0, help="gradient clipping norm (0 = none)")
    g.add_argument("--seed", type=int, default=0, help="seed of the data order and of the LoRA initialisation")
    g = p.add_argument_group("evaluation and output")
    g.add_argument("--eval_lengths", type=token_counts, default=[512],
                   help="comma-separated contexts at which perplexity is measured, e.g. 512,2048")
    g.add_argument("--eval_stages", type=_stage_names, default=list(EVAL_POINTS),
                   help="after which points perplexity and layer errors are measured, comma-separated among "
                        f"{', '.join(EVAL_POINTS)} (swapped = before any training, calibrated = after --calibrate)")
    g.add_argument("--eval_tokens", type=int_at_least(2), default=8192,
                   help="held-out tokens scored per context (chunks spread evenly over the validation text)")
    g.add_argument("--error_blocks", type=int_at_least(1), default=2,
                   help="held-out blocks of --block_size tokens on which the per-layer transfer error is measured")
    g.add_argument("--output_dir", required=True, help="where checkpoints, the final model and conversion.json go")
    g.add_argument("--overwrite_output_dir", action="store_true",
                   help="delete a previous conversion in --output_dir first")
    g.add_argument("--checkpointing_steps", type=int_at_least(0), default=10,
                   help="save a resumable checkpoint every N optimizer steps and at the end of each stage (0 = only "
                        "at the end of each stage); only the newest is kept")
    g.add_argument("--resume_from_checkpoint", default=None,
                   help="'latest' (the newest checkpoint in --output_dir) or a checkpoint folder")
    g.add_argument("--no_save_model", action="store_true",
                   help="do not write <output_dir>/final (sweeps that keep only conversion.json)")
    g.add_argument("--torch_threads", type=int_at_least(1), default=None,
                   help="torch.set_num_threads per process (default: torch's choice)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    impl = canonical(args.attn_implementation)
    if impl not in PRESETS or not is_ours(impl):
        raise ConvertError(f"--attn_implementation {args.attn_implementation!r} is not an hf_attnorm implementation; "
                           f"registered: {', '.join(PRESETS)}")
    args.attn_implementation = impl
    if args.finetune_learning_rate is None:
        args.finetune_learning_rate = FINETUNE_LR[args.finetune_mode]
    try:
        args.options = parse_attnorm_options(args.attnorm)
        # start at the pretrained model's softmax outputs where the normalizer has such a setting (forget gates
        # open, output gates open); options given on the command line win
        start = normalizer_recipe(resolve_settings(impl, args.options).normalizer).conversion_start
        for key, value in start.items():
            if key not in args.options:
                args.options[key] = value
                print(f"[convert] {impl}: --attnorm {key}={value} (starts at the model's softmax attention; give "
                      "--attnorm to choose another start)", file=sys.stderr)
        if args.calibrate:  # per-head values the calibration needs (e.g. a learnable bias); given options win
            needed = calibration_lib.calibration_options(resolve_settings(impl, args.options))
            for key, value in needed.items():
                if key not in args.options:
                    args.options[key] = value
                    print(f"[convert] {impl}: --attnorm {key}={value} (calibration sets it per head; give --attnorm "
                          "or --no-calibrate to choose otherwise)", file=sys.stderr)
        settings = resolve_settings(impl, args.options)
        args.settings = settings.to_dict()
        if args.transfer_learning_rate is None:
            args.transfer_learning_rate, source = transfer_learning_rate(settings)
            if source:
                print(f"[convert] {impl}: stage-1 learning rate {args.transfer_learning_rate:g} ({source}; give "
                      "--transfer_learning_rate to choose another)", file=sys.stderr)
        args.continuation_plan, args.continuation_note = (None, "--no-continuation") \
            if args.continuation is False else \
            plan_continuation(impl, args.options, args.continuation_fraction, asked=bool(args.continuation))
    except (TrainingError, AttnormError, ContinuationError) as exc:
        raise ConvertError(str(exc)) from exc
    if args.continuation_fraction > 1:
        raise ConvertError(f"--continuation_fraction must be in (0, 1], got {args.continuation_fraction}")
    for text in args.eval_texts:
        if text not in data_lib.HELD_OUT_TEXTS and not Path(text).is_file():
            raise ConvertError(f"--eval_texts: {text!r} is neither a named held-out text "
                               f"({', '.join(data_lib.HELD_OUT_TEXTS)}) nor a file")
    if args.validation_file and not args.train_file:
        raise ConvertError("--validation_file needs --train_file")
    if args.distill_weight > 1:
        raise ConvertError(f"--distill_weight must be in (0, 1], got {args.distill_weight}")
    if args.resume_from_checkpoint is not None and args.overwrite_output_dir:
        raise ConvertError("--resume_from_checkpoint and --overwrite_output_dir contradict each other")
    return args


def transfer_learning_rate(settings: AttnormSettings) -> tuple[float, str]:
    """Stage 1's default peak learning rate for ``settings`` and where it comes from ("" for ``TRANSFER_LR``): the
    recipe's measured ``transfer_learning_rate`` for the normalizer, else the scale's, else ``TRANSFER_LR``."""
    for kind, name, recipe in (("normalizer", settings.normalizer, normalizer_recipe(settings.normalizer)),
                               ("scale", settings.scale, scale_recipe(settings.scale))):
        if recipe.transfer_learning_rate is not None:
            return float(recipe.transfer_learning_rate), f"measured for {kind} {name}"
    return TRANSFER_LR, ""


def recorded_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as run (what ``conversion_args.json`` keeps and a resume compares)."""
    derived = ("options", "continuation_plan", "continuation_note")  # (from the flags recorded)
    return {k: v for k, v in sorted(vars(args).items()) if k not in derived}
