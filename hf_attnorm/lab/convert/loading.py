"""What a conversion run loads before its first step: the output folder (checked against a resumed run's flags),
the model (on an hf_attnorm implementation, every attention module run by it), the training and validation text,
the held-out texts of ``--eval_texts`` and the held-out blocks the per-layer transfer error is measured on."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ...fileio import atomic_write
from ...hf.families import CAUSAL_LM, attention_modules, lm_task
from ...registry import AttnormError
from .. import data as data_lib
from ..evaluation.perplexity import spread_chunks
from ..training.args import TrainingError
from ..training.setup import resolve_model_path
from .args import ARGS_FILE, RESUME_MAY_DIFFER, ConvertError, recorded_args
from .checkpoints import SUMMARY_FILE
from .transfer import install_observer


def prepare_output(args: argparse.Namespace, accelerator: Accelerator) -> Path:
    """``--output_dir``, emptied (``--overwrite_output_dir``, only over an earlier conversion) or checked against
    the flags of the run it resumes; the run's flags recorded in it. Returns the folder."""
    out = Path(args.output_dir)
    main = accelerator.is_main_process
    args_file = out / ARGS_FILE
    if args.resume_from_checkpoint is None and out.exists() and any(out.iterdir()):
        if not args.overwrite_output_dir:
            raise ConvertError(f"--output_dir {out} is not empty; pass --overwrite_output_dir to replace it "
                               "or --resume_from_checkpoint latest to continue it")
        if not (args_file.is_file() or (out / SUMMARY_FILE).is_file()):
            raise ConvertError(f"--output_dir {out} holds files that are not a conversion; "
                               "--overwrite_output_dir only replaces a previous conversion")
        if main:
            shutil.rmtree(out)
    accelerator.wait_for_everyone()
    if args.resume_from_checkpoint is not None and args_file.is_file():
        before = json.loads(args_file.read_text())
        now = recorded_args(args)
        changed = sorted(k for k in set(before) | set(now)
                         if k not in RESUME_MAY_DIFFER and before.get(k) != now.get(k))
        if changed:
            raise ConvertError(f"--resume_from_checkpoint: the run in {out} was started with other values "
                               f"of {', '.join('--' + k for k in changed)}; resume with the same flags")
    if main:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(args_file, json.dumps(recorded_args(args), indent=1))
    return out


def load_model(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, Any]:
    """The causal LM of ``--model_name_or_path`` on ``--attn_implementation`` (float32, on ``device``) and its
    tokenizer; refused when it is not a causal LM, when hf_attnorm does not run every attention module, or when
    the blocks asked for are longer than its positions."""
    try:
        path = resolve_model_path(args.model_name_or_path)
    except TrainingError as exc:
        raise ConvertError(str(exc)) from exc
    config = AutoConfig.from_pretrained(path)
    if lm_task(config) != CAUSAL_LM:
        raise ConvertError(f"{path} is a {config.model_type} model without a causal-LM head; convert.py converts "
                           "causal LMs (the teacher is the model's own causal softmax attention)")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=args.attn_implementation,
                                                     attnorm=dict(args.options), dtype=torch.float32)
    except AttnormError as exc:
        raise ConvertError(str(exc)) from exc
    n_layers = sum(1 for _ in attention_modules(model))
    if install_observer(model, None) != n_layers or n_layers == 0:
        raise ConvertError(f"{config.model_type}: {n_layers} attention modules, not all run by hf_attnorm")
    positions = getattr(config, "max_position_embeddings", None)
    longest = max([args.block_size, *args.eval_lengths])
    if isinstance(positions, int) and longest > positions:
        raise ConvertError(f"--block_size/--eval_lengths up to {longest} tokens, but the model has "
                           f"{positions} positions")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if len(tokenizer) > config.vocab_size:
        raise ConvertError(f"{path}: the tokenizer has {len(tokenizer)} tokens but the model only "
                           f"{config.vocab_size} embeddings")
    return model.to(device), tokenizer


def load_data(args: argparse.Namespace, tokenizer: Any, accelerator: Accelerator) -> tuple[torch.Tensor, torch.Tensor]:
    """The training blocks [N, block_size] and the validation text as one stream of ids [M]."""
    with accelerator.main_process_first():
        try:
            train, val, column, _ = data_lib.load_text_datasets(
                train_file=args.train_file, validation_file=args.validation_file)
            train_ds, val_ds = data_lib.build_lm_datasets(train, val, column, tokenizer,
                                                          block_size=args.block_size, masked_lm=False)
        except data_lib.DataError as exc:
            raise ConvertError(str(exc)) from exc
    blocks = train_ds.with_format("torch")["input_ids"][:].long()  # [N, block_size]
    stream = val_ds.with_format("torch")["input_ids"][:].long().reshape(-1)
    if len(blocks) == 0:
        raise ConvertError(f"the training text has fewer than --block_size {args.block_size} tokens")
    for length in args.eval_lengths:
        if len(stream) < length:
            raise ConvertError(f"the validation text has {len(stream)} tokens, fewer than --eval_lengths {length}")
    return blocks, stream


def load_eval_texts(args: argparse.Namespace, tokenizer: Any) -> dict[str, tuple[str, torch.Tensor]]:
    """``--eval_texts``: name -> (description, token ids [N]), each at least as long as every --eval_lengths."""
    out = {}
    for name in args.eval_texts:
        try:
            description, text = data_lib.held_out_text(name)
        except data_lib.DataError as exc:
            raise ConvertError(f"--eval_texts: {exc}") from exc
        ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
        short = [n for n in args.eval_lengths if len(ids) < n]
        if short:
            raise ConvertError(f"--eval_texts {name}: {len(ids)} tokens, fewer than --eval_lengths {short[0]}")
        out[name] = (description, ids)
    return out


def error_blocks(args: argparse.Namespace, stream: torch.Tensor) -> torch.Tensor:
    """The held-out blocks [n, block_size] of the per-layer transfer error: --error_blocks blocks spread evenly over
    the validation stream."""
    n = min(args.error_blocks, len(stream) // args.block_size)
    if n < 1:
        raise ConvertError(f"the validation text has fewer than --block_size {args.block_size} tokens")
    return spread_chunks(stream, args.block_size, n * args.block_size).view(n, -1)
