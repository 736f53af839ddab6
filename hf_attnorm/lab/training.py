"""Pretraining and fine-tuning with accelerate: the shared argument parser and training loop.

``run_pretraining(argv)`` trains a GPT-2, BERT (masked LM) or Llama model from scratch (a ``model_zoo`` size preset
or a config file); ``run_finetuning(argv)`` starts from any checkpoint folder (ours, SmolLM2, MiniLM), optionally
swapping the attention normalizer ("surgery"). Both take the flags of transformers' ``run_clm_no_trainer.py`` /
``run_mlm_no_trainer.py`` plus the attnorm ones, run under ``python`` or ``accelerate launch`` (any number of
processes), and return a summary dict (also written to ``<output_dir>/training_summary.json``).

Checkpoints ``<output_dir>/step_N`` are written by the main process into ``.tmp-step_N`` and renamed when complete:
``accelerator.load_state`` resumes them (optimizer, scheduler, RNG of every rank, accelerate's step counter) and
``from_pretrained`` loads them (config.json with the attnorm settings, safetensors, tokenizer). ``trainer_state.json``
holds the step, the data position (epoch, micro-batches consumed) and the loss history, so a resumed run continues
with the next batch of the same data order and the same random numbers: its losses equal an uninterrupted run's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..registry import NORMALIZERS, PRESETS, SCALES, AttnormError, canonical, is_ours
from ..settings import INFO_KEYS, OPTIONS, option_names, resolve_settings
from . import data as data_lib

logger = logging.getLogger(__name__)  # replaced by accelerate's multi-process adapter once the state exists

#: files in an output dir / checkpoint that mark it as ours
ARGS_FILE = "training_args.json"
STATE_FILE = "trainer_state.json"
SUMMARY_FILE = "training_summary.json"
CHECKPOINT_PREFIX = "step_"
TMP_PREFIX = ".tmp-"
#: schedulers that need nothing but the step count
SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt")
#: arguments that define the model and the data stream: a resumed run must use the values of the checkpoint
RESUME_MUST_MATCH = ("model_type", "model_size", "config_name", "model_name_or_path", "task", "tokenizer_name",
                     "block_size", "max_position_embeddings", "dataset_name", "dataset_config_name", "train_file",
                     "validation_file", "per_device_train_batch_size", "gradient_accumulation_steps", "seed",
                     "max_train_samples", "mlm_probability", "num_processes")


class TrainingError(ValueError):
    """Bad training input, detected before any training step."""


# ================================================================================================== arguments


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def _checkpointing_steps(text: str) -> str:
    if text == "epoch" or (text.isdigit() and int(text) > 0):
        return text
    raise argparse.ArgumentTypeError(f"must be a positive integer or 'epoch', got {text!r}")


def parse_attnorm_options(pairs: Sequence[str] | None) -> dict[str, Any]:
    """``["eta=0.5", "eta_learnable=true"]`` -> ``{"eta": 0.5, "eta_learnable": True}``, typed by the declared
    option (``hf_attnorm.settings.OPTIONS``); ``null``/``none`` for optional options."""
    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, raw = pair.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not key:
            raise TrainingError(f"--attnorm expects KEY=VALUE, got {pair!r}")
        if key in ("implementation", "normalizer", "scale"):
            raise TrainingError(f"--attnorm {key}=... : use --attn_implementation/--normalizer/--scale instead")
        if key not in OPTIONS:
            raise TrainingError(f"--attnorm: unknown option {key!r}; declared options: {', '.join(OPTIONS)}")
        if key in out:
            raise TrainingError(f"--attnorm {key} is given twice")
        opt = OPTIONS.get(key)
        value: Any
        if raw.lower() in ("null", "none"):
            value = None
        elif opt.kind is bool:
            low = raw.lower()
            if low in ("true", "1", "yes", "on"):
                value = True
            elif low in ("false", "0", "no", "off"):
                value = False
            else:
                raise TrainingError(f"--attnorm {key} must be true or false, got {raw!r}")
        elif opt.kind is int:
            try:
                value = int(raw)
            except ValueError:
                raise TrainingError(f"--attnorm {key} must be an integer, got {raw!r}") from None
        elif opt.kind is float:
            try:
                value = float(raw)
            except ValueError:
                raise TrainingError(f"--attnorm {key} must be a number, got {raw!r}") from None
        else:
            value = raw
        out[key] = value
    return out


class _HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` unless the help text explains its default or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" not in text and action.default not in (None, False, [], argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


def build_parser(kind: str) -> argparse.ArgumentParser:
    """The flags of ``scripts/pretrain.py`` (kind="pretrain") or ``scripts/finetune.py`` (kind="finetune")."""
    from .model_zoo import FAMILIES, SIZES

    if kind not in ("pretrain", "finetune"):
        raise ValueError(f"kind must be pretrain or finetune, got {kind!r}")
    pre = kind == "pretrain"
    parser = argparse.ArgumentParser(
        prog=f"{kind}.py",
        description=("Pretrain a GPT-2, BERT (masked LM) or Llama model from scratch" if pre else
                     "Fine-tune a checkpoint (ours, SmolLM2, MiniLM, any HF folder), optionally swapping its "
                     "attention normalizer,") + " with any hf_attnorm attention implementation, using accelerate. "
        "Runs with `python` or `accelerate launch`; see docs/training.md.",
        formatter_class=_HelpFormatter,
    )
    g = parser.add_argument_group("model")
    if pre:
        g.add_argument("--model_type", choices=list(FAMILIES), default="llama",
                       help="model family to build from scratch with --model_size (not used with --config_name)")
        g.add_argument("--model_size", choices=list(SIZES), default="tiny",
                       help="size preset of hf_attnorm.lab.model_zoo.SIZES (hidden, layers, heads, kv heads, mlp)")
        g.add_argument("--config_name", default=None,
                       help="a config.json file or model folder to build the model from instead of "
                            "--model_type/--model_size")
        g.add_argument("--max_position_embeddings", type=_positive_int, default=None,
                       help="position table size of a preset model (default: max(block_size, 1024), BERT 512)")
    else:
        g.add_argument("--model_name_or_path", required=True,
                       help="checkpoint folder to start from (a step_N or final output of these scripts, any HF "
                            "folder), or the embedded real models: 'smollm2' (SmolLM2-135M-Instruct) or 'minilm' "
                            "(all-MiniLM-L6-v2)")
    g.add_argument("--tokenizer_name", default=None,
                   help="tokenizer folder, or 'gpt2' / 'minilm' for the embedded real ones (default: "
                        + ("GPT-2 BPE for gpt2/llama, MiniLM WordPiece for bert)" if pre else
                           "the checkpoint's own tokenizer)"))
    g.add_argument("--task", choices=["auto", "causal_lm", "masked_lm"], default="auto",
                   help="training objective; auto = masked_lm for BERT models, causal_lm otherwise")

    g = parser.add_argument_group("attention (hf_attnorm)")
    g.add_argument("--attn_implementation", default=None,
                   help="hf_attnorm implementation (preset) name, e.g. softmax, softmax1, ssmax, symax "
                        "(see --list); " + ("default softmax, or the resumed checkpoint's" if pre else
                                           "default: the checkpoint's own attention (surgery when given)"))
    g.add_argument("--normalizer", default=None,
                   help="normalizer to use inside the implementation (overrides the preset's; alone it selects "
                        "the preset of the same name)")
    g.add_argument("--scale", default=None, help="length-aware scale (overrides the preset's), e.g. ssmax, log_n")
    g.add_argument("--attnorm", action="append", default=[], metavar="KEY=VALUE",
                   help="an attnorm option, typed by its declaration (repeatable), e.g. --attnorm eta=0.5 "
                        "--attnorm eta_learnable=true; see --list")
    g.add_argument("--list", action="store_true",
                   help="print the registered implementations, normalizers, scales and options, then exit")

    g = parser.add_argument_group("data")
    g.add_argument("--dataset_name", default=None,
                   help=f"a `datasets` hub name (needs network), or '{data_lib.EMBEDDED_DATASET}' = the embedded "
                        "corpus (the default when no --train_file is given)")
    g.add_argument("--dataset_config_name", default=None, help="configuration of --dataset_name")
    g.add_argument("--train_file", default=None, help="local training data: .txt (one row per line), .json/.jsonl "
                                                      "or .csv with a text column")
    g.add_argument("--validation_file", default=None, help="local validation data (same format as --train_file)")
    g.add_argument("--validation_split_percentage", type=int, default=5,
                   help="percentage of the training rows held out for validation when there is no validation "
                        "split")
    g.add_argument("--text_column_name", default=None,
                   help="column holding the text (default: 'text', or the only string column)")
    g.add_argument("--no_keep_linebreaks", action="store_true", help="drop line breaks when reading .txt files")
    g.add_argument("--block_size", type=_positive_int, default=128,
                   help="tokens per training sequence (texts are concatenated and cut into blocks)")
    g.add_argument("--max_train_samples", type=_positive_int, default=None,
                   help="use only the first N training blocks")
    g.add_argument("--max_eval_samples", type=_positive_int, default=None,
                   help="evaluate on N validation blocks spread evenly over the validation set (cheaper evals)")
    g.add_argument("--mlm_probability", type=float, default=0.15,
                   help="fraction of tokens predicted by the masked-LM objective")
    g.add_argument("--preprocessing_num_workers", type=_positive_int, default=None,
                   help="processes for tokenisation (datasets.map num_proc)")
    g.add_argument("--overwrite_cache", action="store_true", help="re-tokenise even if a cached result exists")
    g.add_argument("--data_cache_dir", default=None,
                   help="where tokenised datasets are cached (default: ~/.cache/hf_attnorm/datasets)")

    g = parser.add_argument_group("optimisation")
    g.add_argument("--per_device_train_batch_size", type=_positive_int, default=8,
                   help="blocks per process per micro-batch")
    g.add_argument("--per_device_eval_batch_size", type=_positive_int, default=8, help="blocks per process per eval "
                                                                                       "batch")
    g.add_argument("--learning_rate", type=float, default=1e-3 if pre else 5e-5, help="peak learning rate (AdamW)")
    g.add_argument("--weight_decay", type=float, default=0.1 if pre else 0.0,
                   help="AdamW weight decay (matrices only; biases, norms and attnorm per-head values get none)")
    g.add_argument("--adam_beta2", type=float, default=0.99 if pre else 0.999, help="AdamW beta2")
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="gradient clipping norm (0 = no clipping)")
    g.add_argument("--num_train_epochs", type=_positive_int, default=1, help="passes over the training data")
    g.add_argument("--max_train_steps", type=_positive_int, default=None,
                   help="optimizer steps in total; overrides --num_train_epochs")
    g.add_argument("--gradient_accumulation_steps", type=_positive_int, default=1,
                   help="micro-batches per optimizer step")
    g.add_argument("--lr_scheduler_type", choices=SCHEDULERS, default="linear" if not pre else "cosine",
                   help="learning-rate schedule")
    g.add_argument("--num_warmup_steps", type=_nonnegative_int, default=0, help="linear warm-up steps")
    g.add_argument("--seed", type=int, default=42, help="seed of model init, data order, dropout and masking")
    g.add_argument("--torch_threads", type=_positive_int, default=None,
                   help="torch.set_num_threads per process (default: torch's choice)")

    g = parser.add_argument_group("evaluation, checkpoints and output")
    g.add_argument("--output_dir", required=True, help="where checkpoints, the final model and its card go")
    g.add_argument("--overwrite_output_dir", action="store_true",
                   help="start over in an --output_dir that holds a previous run or other files (our step_N "
                        "checkpoints, logs and model files in it are deleted first)")
    g.add_argument("--eval_steps", type=_positive_int, default=None,
                   help="evaluate every N optimizer steps (default: at the end of each epoch); always at the end")
    g.add_argument("--checkpointing_steps", type=_checkpointing_steps, default=None,
                   help="save a resumable checkpoint step_N every N steps, or 'epoch' at each epoch end")
    g.add_argument("--checkpoints_total_limit", type=_positive_int, default=None,
                   help="keep only the newest N checkpoints")
    g.add_argument("--resume_from_checkpoint", default=None,
                   help="a step_N folder to resume, or 'latest' (the newest complete step_N in --output_dir; a "
                        "fresh start with a warning if there is none)")
    g.add_argument("--with_tracking", action="store_true", help="log metrics to experiment trackers")
    g.add_argument("--report_to", default="all",
                   help="trackers for --with_tracking, comma separated (tensorboard, wandb, ... or jsonl, our "
                        "file tracker); 'all' = every installed accelerate tracker, or jsonl if none is")
    g.add_argument("--logging_dir", default=None, help="tracker log folder (default: <output_dir>/runs)")
    g.add_argument("--model_card_dir", default="model_cards",
                   help="folder that also receives the model card as <name>.md ('none' to skip)")
    g.add_argument("--model_card_name", default=None, help="card name (default: the output folder's name)")
    return parser


def list_registered() -> str:
    lines = ["attention implementations (--attn_implementation):"]
    lines += [f"  {n:16s} {p.description.strip().splitlines()[0]}" for n, p in PRESETS.items()]
    lines.append("normalizers (--normalizer):  " + ", ".join(NORMALIZERS))
    lines.append("scales (--scale):            " + ", ".join(SCALES))
    lines.append("options (--attnorm KEY=VALUE):")
    lines += [f"  {n:28s} {o.kind.__name__:5s} default {o.default!r}: {o.help}" for n, o in OPTIONS.items()]
    return "\n".join(lines)


# ========================================================================================= output dir, checkpoints


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints ``step_N`` in ``output_dir``, oldest first (temporary ``.tmp-*`` folders are never
    listed: a checkpoint becomes visible only by the final rename)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and p.name[len(CHECKPOINT_PREFIX):].isdigit():
            if (p / STATE_FILE).is_file():
                found.append(p)
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(output_dir)
    return ckpts[-1] if ckpts else None


def _is_ours(output_dir: Path) -> bool:
    return (output_dir / ARGS_FILE).is_file() or bool(list_checkpoints(output_dir))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TrainingError(f"cannot read {path}: {exc}") from exc


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def _clear_run(output_dir: Path) -> list[str]:
    """Delete what a previous run of ours left (checkpoints, temporary folders, logs, model files)."""
    removed = []
    ours = {ARGS_FILE, SUMMARY_FILE, "README.md", "config.json", "generation_config.json", "model.safetensors",
            "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja", "added_tokens.json", "runs"}
    for p in sorted(output_dir.iterdir()):
        if (p.name in ours or p.name.startswith(TMP_PREFIX) or p.name.startswith(CHECKPOINT_PREFIX)
                or p.name.startswith("model.safetensors") or p.name.startswith("model-0")):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            removed.append(p.name)
    return removed


# ================================================================================================ JSONL tracker


def _jsonl_tracker_class():
    from accelerate.tracking import GeneralTracker

    class JSONLTracker(GeneralTracker):
        """An accelerate tracker that appends one JSON object per ``log`` call to
        ``<logging_dir>/<run>/metrics.jsonl`` (and the hyper-parameters to ``hparams.json``); used when no
        tracker package (tensorboard, wandb, ...) is installed. On resume at step S the records of later steps
        (written by the interrupted run) are dropped first, so the file matches an uninterrupted run."""

        name = "jsonl"
        requires_logging_directory = True
        main_process_only = True

        def __init__(self, run_name: str, logging_dir: str | os.PathLike, resume_step: int | None = None) -> None:
            super().__init__()
            self.run_dir = Path(logging_dir) / run_name
            self.path = self.run_dir / "metrics.jsonl"
            self.resume_step = resume_step
            self._file = None

        @property
        def tracker(self):
            return self._file

        def _open(self):
            if self._file is None:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                if self.path.exists():
                    keep = []
                    for line in self.path.read_text().splitlines():
                        try:
                            rec = json.loads(line)
                        except json.JSONDecodeError:  # a line cut by a kill
                            continue
                        if self.resume_step is not None and rec.get("step", -1) <= self.resume_step:
                            keep.append(line)
                    _write_text_atomic(self.path, "".join(f"{line}\n" for line in keep))
                self._file = self.path.open("a")
            return self._file

        def store_init_configuration(self, values: dict) -> None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            _write_json_atomic(self.run_dir / "hparams.json", values)
            self._open()

        def log(self, values: dict, step: int | None = None, **kwargs) -> None:
            f = self._open()
            rec = {"step": step, "time": round(time.time(), 3)}
            rec.update({k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in values.items()})
            f.write(json.dumps(rec) + "\n")
            f.flush()

        def finish(self) -> None:
            if self._file is not None:
                self._file.close()
                self._file = None

    return JSONLTracker


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _trackers(args: argparse.Namespace, run_name: str, logging_dir: Path, resume_step: int | None) -> list[Any]:
    from accelerate.tracking import get_available_trackers
    from accelerate.utils import LoggerType

    wanted = [w.strip() for w in args.report_to.split(",") if w.strip()]
    available = [str(t) for t in get_available_trackers()]
    out: list[Any] = []
    jsonl = _jsonl_tracker_class()
    for w in wanted:
        if w == "all":
            out += available or [jsonl(run_name, logging_dir, resume_step)]
        elif w == "jsonl":
            out.append(jsonl(run_name, logging_dir, resume_step))
        elif w in [str(t) for t in LoggerType]:
            if w not in available:
                raise TrainingError(f"--report_to {w}: the {w} package is not installed; installed trackers: "
                                    f"{', '.join(available) or 'none'} (jsonl always works)")
            out.append(w)
        else:
            raise TrainingError(f"--report_to: unknown tracker {w!r}; use all, jsonl or one of "
                                f"{', '.join(str(t) for t in LoggerType if str(t) != 'all')}")
    return out


# ============================================================================================ model construction


def _resolve_model_path(name: str) -> str:
    """'smollm2' / 'minilm' -> the embedded real models, unless a folder of that name exists."""
    from . import assets

    if Path(name).exists():
        return name
    if name.lower() == "smollm2":
        return str(assets.smollm2_path())
    if name.lower() == "minilm":
        return str(assets.minilm_path())
    raise TrainingError(f"--model_name_or_path {name!r} is not a folder (the embedded models are 'smollm2' and "
                        "'minilm'; hub names do not download at run time)")


def _load_tokenizer(name: str | None, family: str | None, fallback_path: str | None):
    from transformers import AutoTokenizer

    if name in ("gpt2", "minilm"):
        return data_lib.load_tokenizer("gpt2" if name == "gpt2" else "bert")
    if name is not None:
        if not Path(name).exists():
            raise TrainingError(f"--tokenizer_name {name!r} is not a folder (embedded: 'gpt2', 'minilm')")
        return AutoTokenizer.from_pretrained(name)
    if fallback_path is not None:
        try:
            return AutoTokenizer.from_pretrained(fallback_path)
        except (OSError, ValueError, TypeError) as exc:
            raise TrainingError(f"{fallback_path} holds no loadable tokenizer ({exc}); pass --tokenizer_name "
                                "(a folder, 'gpt2' or 'minilm')") from exc
    if family not in data_lib.TOKENIZER_FAMILIES:
        raise TrainingError(f"no default tokenizer for model type {family!r}; pass --tokenizer_name")
    return data_lib.load_tokenizer(family)


def _max_positions(config) -> int | None:
    for attr in ("max_position_embeddings", "n_positions"):
        v = getattr(config, attr, None)
        if isinstance(v, int):
            return v
    return None


def _task(args: argparse.Namespace, config) -> str:
    if args.task != "auto":
        return args.task
    return "masked_lm" if config.model_type in ("bert", "roberta", "distilbert", "modernbert") else "causal_lm"


def _requested_settings(args: argparse.Namespace, kind: str, saved: Mapping[str, Any] | None) -> dict | None:
    """The attnorm settings dict the flags ask for (validated), or None = keep the model's own attention.
    ``saved``: the settings of the checkpoint the model comes from (resume or fine-tune source)."""
    options = parse_attnorm_options(args.attnorm)
    overrides = dict(options)
    if args.normalizer is not None:
        overrides["normalizer"] = args.normalizer
    if args.scale is not None:
        overrides["scale"] = args.scale
    impl = args.attn_implementation
    if impl is None and args.normalizer is not None:
        # every normalizer registers a preset of its name; an unknown one fails below, naming the normalizers
        impl = args.normalizer if args.normalizer in PRESETS else "softmax"
    if impl is None:
        if saved is not None and is_ours(saved.get("implementation")):
            if not overrides:
                return dict(saved)
            impl = saved["implementation"]
            # the saved options that the (possibly changed) normalizer and scale still use, then the user's
            base = {k: v for k, v in saved.items() if k not in ("implementation", *INFO_KEYS)}
            merged = {**base, **overrides}
            try:
                keep = set(option_names(merged["normalizer"], merged["scale"]))
            except AttnormError as exc:
                raise TrainingError(str(exc)) from exc
            overrides = {k: v for k, v in merged.items()
                         if k in overrides or k in keep or k in ("normalizer", "scale")}
        elif overrides or kind == "pretrain":
            impl = "softmax"
        else:
            return None
    impl = canonical(impl)
    if impl not in PRESETS:
        raise TrainingError(f"unknown attention implementation {impl!r}; registered: {', '.join(PRESETS)}")
    try:
        return resolve_settings(impl, overrides).to_dict()
    except AttnormError as exc:
        raise TrainingError(str(exc)) from exc


def _settings_core(d: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return None if d is None else {k: v for k, v in d.items() if k != "hf_attnorm_version"}


# ======================================================================================================= loops


def evaluate_loss(model, dataloader, accelerator=None, *, masked_lm: bool) -> tuple[float, int]:
    """Token-weighted mean cross-entropy of ``model`` on ``dataloader`` (``input_ids`` blocks; masked LM: with
    ``labels``) and the number of predicted tokens. Causal LM: every next token of each block; masked LM: the
    masked positions. Deterministic (eval mode, fixed masks). Under accelerate, samples duplicated to even out the
    last batch across processes are dropped (``gather_for_metrics``)."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    with torch.no_grad():
        for batch in dataloader:
            ids = batch["input_ids"]
            out = model(input_ids=ids, use_cache=False) if not masked_lm else model(input_ids=ids)
            logits = out.logits.float()
            if masked_lm:
                labels = batch["labels"]
            else:
                logits, labels = logits[:, :-1], ids[:, 1:]
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none",
                                  ignore_index=-100).view(labels.shape)
            per_sample = torch.stack([nll.sum(dim=1).double(), (labels != -100).sum(dim=1).double()], dim=1)
            if accelerator is not None:
                per_sample = accelerator.gather_for_metrics(per_sample)
            total += per_sample[:, 0].sum().cpu()
            count += int(per_sample[:, 1].sum().item())
    if was_training:
        model.train()
    if count == 0:
        raise TrainingError("the validation data has no predicted tokens")
    return float(total / count), count


def _perplexity(loss: float | None) -> float | None:
    if loss is None:
        return None
    return math.exp(loss) if loss < 700 else float("inf")


def _unique_params(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _param_groups(model, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only (nanoGPT's rule): biases, norm weights and attnorm per-head values get none."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _load_weights(model, folder: Path) -> None:
    """Load ``folder``'s safetensors into ``model`` in place (tied weights stay tied); every key must match."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise TrainingError(f"checkpoint {folder} has no model.safetensors")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(folder / f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = model.state_dict(keep_vars=True)
    loaded_ptrs = {params[k].data_ptr() for k in state if k in params}
    really_missing = [k for k in missing if params[k].data_ptr() not in loaded_ptrs]
    if really_missing or unexpected:
        raise TrainingError(f"checkpoint {folder} does not match the model: missing {really_missing[:5]}, "
                            f"unexpected {list(unexpected)[:5]}")


class _Run:
    """One training run: everything ``run_pretraining``/``run_finetuning`` share."""

    def __init__(self, args: argparse.Namespace, kind: str) -> None:
        self.args = args
        self.kind = kind

    # ------------------------------------------------------------------------------------------------ setup
    def check_inputs(self) -> None:
        """Everything that can be checked without the model or the data: fails before any training."""
        a = self.args
        if a.learning_rate <= 0:
            raise TrainingError(f"--learning_rate must be > 0, got {a.learning_rate}")
        if a.weight_decay < 0 or a.max_grad_norm < 0:
            raise TrainingError("--weight_decay and --max_grad_norm must be >= 0")
        if not 0 < a.adam_beta2 < 1:
            raise TrainingError(f"--adam_beta2 must lie in (0, 1), got {a.adam_beta2}")
        self.output_dir = Path(a.output_dir)
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise TrainingError(f"--output_dir {self.output_dir} exists and is not a folder")
        self.resume_dir: Path | None = None
        if a.resume_from_checkpoint is not None and a.overwrite_output_dir:
            raise TrainingError("--resume_from_checkpoint and --overwrite_output_dir contradict each other")
        if a.resume_from_checkpoint == "latest":
            self.resume_dir = latest_checkpoint(self.output_dir)
        elif a.resume_from_checkpoint is not None:
            path = Path(a.resume_from_checkpoint)
            if not path.is_dir():
                raise TrainingError(f"--resume_from_checkpoint {path}: no such folder (or pass 'latest')")
            if not (path / STATE_FILE).is_file():
                raise TrainingError(f"--resume_from_checkpoint {path} is not a checkpoint of these scripts (no "
                                    f"{STATE_FILE}); to start from its weights use finetune.py "
                                    "--model_name_or_path")
            self.resume_dir = path
        self.clear_output = False
        if self.output_dir.is_dir() and any(self.output_dir.iterdir()):
            if a.overwrite_output_dir:
                self.clear_output = True
            elif a.resume_from_checkpoint is None:
                what = ("holds a previous run of these scripts" if _is_ours(self.output_dir)
                        else "exists, is not empty and is not a run of these scripts")
                raise TrainingError(f"--output_dir {self.output_dir} {what}: pass --resume_from_checkpoint latest "
                                    "to continue it, --overwrite_output_dir to start over there, or another "
                                    "--output_dir")
            elif not _is_ours(self.output_dir):
                raise TrainingError(f"--output_dir {self.output_dir} is not empty and is not a run of these "
                                    "scripts; pass --overwrite_output_dir or another --output_dir")
        self.resume_state: dict[str, Any] | None = None
        if self.resume_dir is not None:
            self.resume_state = _read_json(self.resume_dir / STATE_FILE)
            saved_args = self.resume_state.get("args", {})
            problems = [f"--{k} {getattr(a, k)!r} (checkpoint: {saved_args[k]!r})" for k in RESUME_MUST_MATCH
                        if k in saved_args and k in vars(a) and getattr(a, k) != saved_args[k]]
            if problems:
                raise TrainingError(f"cannot resume {self.resume_dir} exactly with different settings: "
                                    f"{'; '.join(problems)}. Use the checkpoint's values, or start a new run from "
                                    "its weights with finetune.py --model_name_or_path")
        if a.model_card_dir and a.model_card_dir.lower() == "none":
            a.model_card_dir = None

    def build_model_and_tokenizer(self) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

        from .model_zoo import make_config

        a = self.args
        saved_settings = None
        if self.resume_dir is not None:
            cfg = _read_json(self.resume_dir / "config.json") if (self.resume_dir / "config.json").is_file() else {}
            saved_settings = cfg.get("attnorm")
        if self.kind == "pretrain":
            if a.config_name:
                if not Path(a.config_name).exists():
                    raise TrainingError(f"--config_name {a.config_name}: no such file or folder")
                config = AutoConfig.from_pretrained(a.config_name)
                family = config.model_type
            else:
                family = a.model_type
                config = None
            source_settings = saved_settings
        else:
            self.model_path = _resolve_model_path(a.model_name_or_path)
            config = AutoConfig.from_pretrained(self.model_path)
            family = config.model_type
            source_settings = saved_settings if saved_settings is not None else getattr(config, "attnorm", None)
        requested = _requested_settings(a, self.kind, source_settings)
        if saved_settings is not None and requested is not None and \
                _settings_core(requested) != _settings_core(saved_settings):
            raise TrainingError(
                f"--resume_from_checkpoint {self.resume_dir} was trained with attention settings "
                f"{_settings_core(saved_settings)}, but {_settings_core(requested)} is asked for; resume with the "
                "checkpoint's settings (omit the attention flags) or fine-tune from it with finetune.py")
        self.settings = requested

        self.tokenizer = _load_tokenizer(a.tokenizer_name, family,
                                         self.model_path if self.kind == "finetune" else None)
        if self.kind == "pretrain" and config is None:
            positions = a.max_position_embeddings or max(a.block_size, 512 if family == "bert" else 1024)
            config = make_config(family, a.model_size, vocab_size=len(self.tokenizer), max_positions=positions)
        if self.kind == "pretrain" and a.max_position_embeddings and a.config_name:
            raise TrainingError("--max_position_embeddings applies to preset models; edit the --config_name file")
        self.task = _task(a, config)
        positions = _max_positions(config)
        if positions is not None and a.block_size > positions:
            raise TrainingError(f"--block_size {a.block_size} is larger than the model's {positions} positions")
        if len(self.tokenizer) > config.vocab_size:
            raise TrainingError(f"the tokenizer has {len(self.tokenizer)} tokens but the model only "
                                f"{config.vocab_size} embeddings; use a matching --tokenizer_name")
        auto = AutoModelForMaskedLM if self.task == "masked_lm" else AutoModelForCausalLM
        kwargs: dict[str, Any] = {}
        if self.settings is not None:
            kwargs["attn_implementation"] = self.settings["implementation"]
        try:
            if self.kind == "pretrain":
                if self.settings is not None:
                    config.attnorm = dict(self.settings)
                torch.manual_seed(a.seed)  # identical initial weights on every rank and in every resumed process
                self.model = auto.from_config(config, **kwargs)
            else:
                if self.settings is not None:
                    kwargs["attnorm"] = dict(self.settings)
                self.model = auto.from_pretrained(self.model_path, dtype=torch.float32, **kwargs)
        except AttnormError as exc:
            raise TrainingError(str(exc)) from exc
        except ValueError as exc:
            if "Unrecognized configuration class" in str(exc):
                raise TrainingError(f"a {config.model_type} model cannot be trained as {self.task} ({exc})") from exc
            raise
        self.settings = dict(self.model.config.attnorm) if getattr(self.model.config, "attnorm", None) else None
        self.model_type = self.model.config.model_type

    def build_data(self, accelerator) -> None:
        a = self.args
        with accelerator.main_process_first():
            train, val, column, self.dataset_description = data_lib.load_text_datasets(
                dataset_name=a.dataset_name, dataset_config_name=a.dataset_config_name, train_file=a.train_file,
                validation_file=a.validation_file, validation_split_percentage=a.validation_split_percentage,
                text_column_name=a.text_column_name, keep_linebreaks=not a.no_keep_linebreaks)
            masked = self.task == "masked_lm"
            self.train_ds, val_ds = data_lib.build_lm_datasets(
                train, val, column, self.tokenizer, block_size=a.block_size, masked_lm=masked,
                cache_dir=a.data_cache_dir, num_proc=a.preprocessing_num_workers, overwrite_cache=a.overwrite_cache)
        if a.max_train_samples is not None:
            self.train_ds = self.train_ds.select(range(min(a.max_train_samples, len(self.train_ds))))
        val_ds = data_lib.evenly_spaced(val_ds, a.max_eval_samples)
        if masked:
            # fixed masks, independent of --seed: validation losses compare across runs and seeds
            val_ds = data_lib.mask_dataset(val_ds, self.tokenizer, a.mlm_probability,
                                           seed=data_lib.VALIDATION_MASK_SEED)
            self.masker = data_lib.MaskedLMMasker(self.tokenizer, a.mlm_probability)
        else:
            self.masker = None
        self.eval_ds = val_ds

    # ------------------------------------------------------------------------------------------------ run
    def run(self) -> dict[str, Any]:
        from accelerate import Accelerator, DataLoaderConfiguration
        from accelerate.logging import get_logger
        from accelerate.utils import ProjectConfiguration, set_seed
        from tqdm.auto import tqdm
        from transformers import get_scheduler

        global logger
        a = self.args
        t_setup = time.time()
        if a.torch_threads:
            torch.set_num_threads(a.torch_threads)
        self.check_inputs()
        run_name = a.model_card_name or self.output_dir.resolve().name
        logging_dir = Path(a.logging_dir) if a.logging_dir else self.output_dir / "runs"
        resume_step = int(self.resume_state["step"]) if self.resume_state else None
        trackers = _trackers(a, run_name, logging_dir, resume_step) if a.with_tracking else None
        accelerator = Accelerator(
            gradient_accumulation_steps=a.gradient_accumulation_steps,
            log_with=trackers,
            project_config=ProjectConfiguration(project_dir=str(self.output_dir), logging_dir=str(logging_dir)),
            dataloader_config=DataLoaderConfiguration(even_batches=True),
        )
        self.accelerator = accelerator
        logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%H:%M:%S",
                            level=logging.INFO)
        logger = get_logger(__name__)
        _quiet_libraries(accelerator.is_local_main_process)
        if self.resume_state is not None:
            saved_procs = self.resume_state.get("args", {}).get("num_processes")
            if saved_procs is not None and saved_procs != accelerator.num_processes:
                raise TrainingError(f"{self.resume_dir} was written by {saved_procs} process(es), this run has "
                                    f"{accelerator.num_processes}: the data position would not match")
        elif a.resume_from_checkpoint == "latest":
            logger.warning(f"--resume_from_checkpoint latest: no checkpoint in {self.output_dir}; starting fresh")

        self.build_model_and_tokenizer()
        if self.clear_output and accelerator.is_main_process:
            removed = _clear_run(self.output_dir)
            other = [p.name for p in self.output_dir.iterdir()]
            logger.info(f"--overwrite_output_dir: removed {removed or 'nothing'} from {self.output_dir}"
                        + (f"; left other files {other}" if other else ""))
        accelerator.wait_for_everyone()
        self.build_data(accelerator)

        # ------------------------------------------------------------------ data loaders, optimizer, schedule
        train_sampler = data_lib.EpochShuffleSampler(len(self.train_ds), a.seed)
        train_dl = torch.utils.data.DataLoader(
            self.train_ds, sampler=train_sampler, batch_size=a.per_device_train_batch_size, drop_last=True,
            collate_fn=data_lib.collate_blocks, generator=torch.Generator().manual_seed(a.seed))
        eval_dl = torch.utils.data.DataLoader(self.eval_ds, batch_size=a.per_device_eval_batch_size,
                                              collate_fn=data_lib.collate_blocks)
        if len(train_dl) // accelerator.num_processes == 0:
            raise TrainingError(f"{len(self.train_ds)} training blocks make no full batch of "
                                f"{a.per_device_train_batch_size} x {accelerator.num_processes} process(es)")
        model = self.model
        # fused AdamW: one kernel per step on CPU and CUDA (deterministic, like the default loop)
        fused = accelerator.device.type in ("cpu", "cuda") and all(
            p.dtype == torch.float32 for p in model.parameters())
        optimizer = torch.optim.AdamW(_param_groups(model, a.weight_decay), lr=a.learning_rate,
                                      betas=(0.9, a.adam_beta2), fused=fused or None)
        model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
        steps_per_epoch = math.ceil(len(train_dl) / a.gradient_accumulation_steps)
        max_steps = a.max_train_steps or a.num_train_epochs * steps_per_epoch
        num_epochs = math.ceil(max_steps / steps_per_epoch)
        # accelerate steps a prepared scheduler once per process per optimizer step (run_clm_no_trainer does this)
        scheduler = get_scheduler(a.lr_scheduler_type, optimizer,
                                  num_warmup_steps=a.num_warmup_steps * accelerator.num_processes,
                                  num_training_steps=max_steps * accelerator.num_processes)
        scheduler = accelerator.prepare(scheduler)
        self._register_checkpoint_hooks(accelerator)

        # ------------------------------------------------------------------------------- resume
        step, epoch, batches_done = 0, 0, 0
        history: dict[str, Any] = {"train_losses": [], "val_losses": [], "tokens": 0, "train_seconds": 0.0,
                                   "seconds": 0.0}
        if self.resume_state is not None:
            accelerator.load_state(str(self.resume_dir))  # weights (our hook), optimizer, scheduler, RNG states
            st = self.resume_state
            step, epoch, batches_done = int(st["step"]), int(st["epoch"]), int(st["batches_in_epoch"])
            history = {k: st[k] for k in history}
            if batches_done >= len(train_dl):
                epoch, batches_done = epoch + 1, 0
            logger.info(f"resumed from {self.resume_dir}: step {step}, epoch {epoch}, {batches_done} micro-batches "
                        "of it done")
        else:
            set_seed(a.seed, device_specific=True)  # dropout / masking streams differ per rank

        hparams = self._hparams(accelerator, max_steps)
        if accelerator.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            _write_json_atomic(self.output_dir / ARGS_FILE, hparams)
        if a.with_tracking:
            accelerator.init_trackers(run_name, config={k: v for k, v in hparams.items()
                                                        if isinstance(v, int | float | str | bool)})

        n_params = _unique_params(accelerator.unwrap_model(model))
        total_batch = a.per_device_train_batch_size * accelerator.num_processes * a.gradient_accumulation_steps
        logger.info(f"{self.model_type} ({self.task}), {n_params / 1e6:.2f}M parameters, attention "
                    f"{self.settings or 'the model default (' + str(model.config._attn_implementation) + ')'}; "
                    f"{len(self.train_ds)} training blocks of {a.block_size} ({self.dataset_description}); "
                    f"{max_steps} steps of {total_batch} blocks ({accelerator.num_processes} process(es)); "
                    f"setup {time.time() - t_setup:.1f} s")

        # ------------------------------------------------------------------------------- loop
        eval_every = a.eval_steps
        ckpt_every = int(a.checkpointing_steps) if a.checkpointing_steps not in (None, "epoch") else None
        bar = tqdm(total=max_steps, initial=step, desc=f"{self.kind} {run_name}", unit="step",
                   disable=not accelerator.is_local_main_process or _env_flag("TQDM_DISABLE"), mininterval=0.5,
                   dynamic_ncols=True)
        loop_start = time.time()
        seconds_before = history["seconds"]
        micro_losses: list[torch.Tensor] = []
        micro_tokens = 0
        t_step = time.perf_counter()
        interrupted = False

        def evaluate_now() -> float:
            val_loss, _ = evaluate_loss(model, eval_dl, accelerator, masked_lm=self.task == "masked_lm")
            history["val_losses"].append([step, val_loss])
            if a.with_tracking:
                accelerator.log({"val_loss": val_loss, "val_perplexity": _perplexity(val_loss)}, step=step)
            bar.write(f"step {step}: validation loss {val_loss:.4f}, perplexity {_perplexity(val_loss):.2f}")
            return val_loss

        try:
            model.train()
            while step < max_steps and epoch < num_epochs:
                train_dl.set_epoch(epoch)
                loader = accelerator.skip_first_batches(train_dl, batches_done) if batches_done else train_dl
                if batches_done:
                    loader.set_epoch(epoch)
                for batch in loader:
                    with accelerator.accumulate(model):
                        if self.masker is not None:
                            batch = self.masker(batch)
                        else:
                            batch = {"input_ids": batch["input_ids"], "labels": batch["input_ids"]}
                        extra = {"use_cache": False} if self.task == "causal_lm" else {}
                        loss = model(**batch, **extra).loss
                        accelerator.backward(loss)
                        if accelerator.sync_gradients and a.max_grad_norm > 0:
                            accelerator.clip_grad_norm_(model.parameters(), a.max_grad_norm)
                        optimizer.step()
                        scheduler.step()
                        optimizer.zero_grad()
                    batches_done += 1
                    micro_losses.append(loss.detach())
                    micro_tokens += batch["input_ids"].numel()
                    if not accelerator.sync_gradients:
                        continue
                    # ---------------------------------------------------------- an optimizer step is complete
                    stats = torch.stack([torch.stack(micro_losses).float().mean(),
                                         torch.tensor(float(micro_tokens))]).unsqueeze(0)
                    stats = accelerator.gather(stats)
                    step_loss = float(stats[:, 0].mean())
                    step_tokens = int(stats[:, 1].sum())
                    micro_losses, micro_tokens = [], 0
                    step += 1
                    if not math.isfinite(step_loss):
                        last_ckpt = latest_checkpoint(self.output_dir)
                        raise TrainingError(
                            f"training diverged: the loss is {step_loss} at step {step} (attention "
                            f"{self.settings}); lower --learning_rate or raise --num_warmup_steps. Nothing more is "
                            f"written; last complete checkpoint: {last_ckpt or 'none'}")
                    dt = time.perf_counter() - t_step
                    history["train_seconds"] += dt
                    history["tokens"] += step_tokens
                    history["train_losses"].append([step, step_loss])
                    tps = history["tokens"] / max(history["train_seconds"], 1e-9)
                    bar.update(1)
                    bar.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{tps:,.0f}", refresh=False)
                    if a.with_tracking:
                        accelerator.log({"train_loss": step_loss, "learning_rate": scheduler.get_last_lr()[0],
                                         "tokens_per_second": step_tokens / max(dt, 1e-9)}, step=step)
                    epoch_end = batches_done >= len(train_dl)  # counts the skipped batches of a resume too
                    last = step >= max_steps
                    if (eval_every and step % eval_every == 0) or last or (epoch_end and not eval_every):
                        evaluate_now()
                    if (ckpt_every and step % ckpt_every == 0) or (a.checkpointing_steps == "epoch" and epoch_end):
                        history["seconds"] = seconds_before + time.time() - loop_start
                        self._save_checkpoint(accelerator, step, epoch, batches_done, history, hparams)
                    t_step = time.perf_counter()
                    if last:
                        break
                epoch, batches_done = epoch + 1, 0
        except KeyboardInterrupt:
            interrupted = True
        finally:
            bar.close()
        history["seconds"] = seconds_before + time.time() - loop_start
        if interrupted:
            last_ckpt = latest_checkpoint(self.output_dir)
            logger.warning(f"interrupted at step {step}; nothing more is written. Last complete checkpoint: "
                           f"{last_ckpt or 'none'}" + (" (resume with --resume_from_checkpoint latest)"
                                                       if last_ckpt else ""))
            if a.with_tracking:
                accelerator.end_training()
            raise KeyboardInterrupt

        # ------------------------------------------------------------------------------- final model, summary
        summary = self._summary(accelerator, model, step, history, hparams, n_params)
        self._save_final(accelerator, model, summary)
        if a.with_tracking:
            accelerator.end_training()
        if accelerator.is_main_process:
            print(format_summary(summary), flush=True)
        accelerator.wait_for_everyone()
        return summary

    # ------------------------------------------------------------------------------------------------ pieces
    def _hparams(self, accelerator, max_steps: int) -> dict[str, Any]:
        a = self.args
        d = {k: v for k, v in vars(a).items() if k not in ("list",)}
        d.update(num_processes=accelerator.num_processes, max_train_steps_resolved=max_steps, kind=self.kind,
                 model_type_resolved=self.model_type, task_resolved=self.task,
                 attnorm=json.dumps(self.settings) if self.settings else None,
                 distributed_type=str(accelerator.distributed_type), mixed_precision=accelerator.mixed_precision)
        return d

    def _register_checkpoint_hooks(self, accelerator) -> None:
        """Make ``save_state``/``load_state`` write and read the model with ``save_pretrained`` (config with the
        attnorm settings, safetensors with metadata): the same folder then also loads with ``from_pretrained``."""
        from accelerate.utils import DistributedType

        plain = accelerator.distributed_type not in (DistributedType.FSDP, DistributedType.DEEPSPEED)

        def save_hook(models: list, weights: list, output_dir: str) -> None:
            for model in models:
                unwrapped = accelerator.unwrap_model(model)
                if plain:
                    if accelerator.is_main_process:
                        unwrapped.save_pretrained(output_dir, safe_serialization=True)
                else:  # sharded engines: gather a full state dict (collective) for the HF copy
                    state = accelerator.get_state_dict(model)
                    if accelerator.is_main_process:
                        unwrapped.save_pretrained(output_dir, state_dict=state, safe_serialization=True)
            if plain:
                weights.clear()  # accelerate must not write its own model.safetensors over ours

        def load_hook(models: list, input_dir: str) -> None:
            if not plain:
                return
            while models:
                _load_weights(accelerator.unwrap_model(models.pop()), Path(input_dir))

        accelerator.register_save_state_pre_hook(save_hook)
        accelerator.register_load_state_pre_hook(load_hook)

    def _save_checkpoint(self, accelerator, step: int, epoch: int, batches_done: int, history: dict,
                         hparams: dict) -> Path:
        """``step_N``: written into ``.tmp-step_N`` by every rank (each saves its RNG state) and renamed by the main
        process once complete. A kill at any moment leaves either the previous checkpoints or the new one."""
        final = self.output_dir / f"{CHECKPOINT_PREFIX}{step}"
        tmp = self.output_dir / f"{TMP_PREFIX}{final.name}"
        main = accelerator.is_main_process
        if main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        try:
            accelerator.save_state(str(tmp))
            if main:
                self.tokenizer.save_pretrained(tmp)
                state = {"step": step, "epoch": epoch, "batches_in_epoch": batches_done,
                         "args": {**vars(self.args), "num_processes": accelerator.num_processes},
                         "attnorm": self.settings, **history}
                _write_json_atomic(tmp / STATE_FILE, state)
            accelerator.wait_for_everyone()
            if main:
                old = None
                if final.exists():  # re-running a step after resuming from an older checkpoint
                    old = final.with_name(f"{TMP_PREFIX}old-{final.name}")
                    os.replace(final, old)
                os.replace(tmp, final)
                _fsync_dir(self.output_dir)
                if old is not None:
                    shutil.rmtree(old, ignore_errors=True)
                self._rotate_checkpoints()
        except BaseException:
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        accelerator.wait_for_everyone()
        logger.info(f"checkpoint {final}")
        return final

    def _rotate_checkpoints(self) -> None:
        limit = self.args.checkpoints_total_limit
        if limit is None:
            return
        for old in list_checkpoints(self.output_dir)[:-limit]:
            shutil.rmtree(old, ignore_errors=True)

    def _summary(self, accelerator, model, step: int, history: dict, hparams: dict, n_params: int) -> dict:
        a = self.args
        val = history["val_losses"][-1][1] if history["val_losses"] else None
        recent = [loss for _, loss in history["train_losses"][-10:]]
        return {
            "kind": self.kind,
            "output_dir": str(self.output_dir.resolve()),
            "model_type": self.model_type,
            "task": self.task,
            "parameters": n_params,
            "attnorm": self.settings,
            "attn_implementation": canonical(accelerator.unwrap_model(model).config._attn_implementation),
            "block_size": a.block_size,
            "dataset": self.dataset_description,
            "train_blocks": len(self.train_ds),
            "eval_blocks": len(self.eval_ds),
            "steps": step,
            "num_processes": accelerator.num_processes,
            "total_batch_size": a.per_device_train_batch_size * accelerator.num_processes
            * a.gradient_accumulation_steps,
            "seconds": round(history["seconds"], 3),
            "train_seconds": round(history["train_seconds"], 3),
            "tokens": history["tokens"],
            "tokens_per_second": history["tokens"] / max(history["train_seconds"], 1e-9),
            "train_losses": history["train_losses"],
            "val_losses": history["val_losses"],
            "final_train_loss": sum(recent) / len(recent) if recent else None,
            "final_val_loss": val,
            "final_val_perplexity": _perplexity(val),
            "hyperparameters": {k: getattr(a, k) for k in (
                "learning_rate", "weight_decay", "adam_beta2", "max_grad_norm", "per_device_train_batch_size",
                "gradient_accumulation_steps", "lr_scheduler_type", "num_warmup_steps", "seed",
                "mlm_probability")},
            "source": getattr(self, "model_path", None) or (a.config_name or f"model_zoo {a.model_size}"),
            "model_card": None,
        }

    def _save_final(self, accelerator, model, summary: dict) -> None:
        """Final model into ``output_dir``: written into a temporary folder, moved in file by file, the summary
        (the completion marker) last."""
        from .cards import write_model_card

        a = self.args
        unwrapped = accelerator.unwrap_model(model)
        from accelerate.utils import DistributedType

        sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
        state = accelerator.get_state_dict(model) if sharded else None
        if accelerator.is_main_process:
            tmp = self.output_dir / f"{TMP_PREFIX}final"
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
            try:
                unwrapped.save_pretrained(tmp, safe_serialization=True, state_dict=state)
                self.tokenizer.save_pretrained(tmp)
                for p in sorted(tmp.iterdir()):
                    os.replace(p, self.output_dir / p.name)
                shutil.rmtree(tmp)
                card = write_model_card(self.output_dir, summary, card_dir=a.model_card_dir,
                                        name=a.model_card_name)
                summary["model_card"] = str(card)
                _write_json_atomic(self.output_dir / SUMMARY_FILE, summary)
                _fsync_dir(self.output_dir)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        accelerator.wait_for_everyone()


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _quiet_libraries(main: bool) -> None:
    import datasets
    import transformers

    if main:
        datasets.utils.logging.set_verbosity_warning()
        transformers.utils.logging.set_verbosity_warning()
    else:
        datasets.utils.logging.set_verbosity_error()
        datasets.disable_progress_bars()
        transformers.utils.logging.set_verbosity_error()


def format_summary(summary: Mapping[str, Any]) -> str:
    """The one-screen report printed at the end of a run."""
    att = summary.get("attnorm")
    att_text = ", ".join(f"{k}={v}" for k, v in att.items()) if att else str(summary.get("attn_implementation"))
    val, ppl = summary.get("final_val_loss"), summary.get("final_val_perplexity")
    rows = [
        ("model", f"{summary['model_type']} ({summary['task']}), {summary['parameters'] / 1e6:.2f}M parameters"),
        ("attention", att_text),
        ("data", f"{summary['dataset']}; blocks of {summary['block_size']} tokens"),
        ("steps", f"{summary['steps']} x {summary['total_batch_size']} blocks on {summary['num_processes']} "
                  f"process(es)"),
        ("time", f"{summary['seconds']:.1f} s ({summary['train_seconds']:.1f} s training, "
                 f"{summary['tokens_per_second']:,.0f} tokens/s)"),
        ("train loss", f"{summary['final_train_loss']:.4f} (mean of the last "
                       f"{min(10, len(summary['train_losses']))} steps)"
         if summary.get("final_train_loss") is not None else "-"),
        ("val loss", f"{val:.4f}, perplexity {ppl:.2f}" if val is not None else "-"),
        ("model", summary["output_dir"]),
        ("card", str(summary.get("model_card") or "-")),
    ]
    width = max(len(k) for k, _ in rows)
    line = "=" * 78
    body = "\n".join(f"{k:>{width}} : {v}" for k, v in rows)
    return f"{line}\n{body}\n{line}"


# ================================================================================================ entry points


def _run(kind: str, argv: list[str] | None) -> dict[str, Any]:
    parser = build_parser(kind)
    args = parser.parse_args(argv)
    if args.list:
        print(list_registered())
        return {}
    return _Run(args, kind).run()


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


def main(kind: str, argv: list[str] | None = None) -> int:
    """Script entry point: bad input -> ``<script>: error: ...`` and exit code 2; Ctrl-C -> 130."""
    try:
        _run(kind, argv)
    except (TrainingError, data_lib.DataError, AttnormError) as exc:
        print(f"{kind}.py: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{kind}.py: interrupted", file=sys.stderr)
        return 130
    return 0


__all__ = ["TrainingError", "build_parser", "evaluate_loss", "format_summary", "latest_checkpoint",
           "list_checkpoints", "main", "parse_attnorm_options", "run_finetuning", "run_pretraining"]
