"""The arguments of ``scripts/pretrain.py`` and ``scripts/finetune.py``: one frozen dataclass, one field per flag
with its help text, group and type in ``metadata`` (PEFT's style), turned into the argparse parser of each script.

Fields marked ``kinds=("pretrain",)`` or ``("finetune",)`` exist as flags in that script only; ``pretrain``/
``finetune`` in the metadata override the default or help text per script. ``TrainingArguments.as_dict()`` is what
``training_args.json`` and ``trainer_state.json`` record (the flags of the script that ran, as before the split).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...registry import NORMALIZERS, PRESETS, SCALES
from ...settings import OPTIONS, OptionError, parse_option_pairs
from .. import data as data_lib
from ..cli import nonnegative_int, positive_int
from ..model_zoo import FAMILIES, SIZES

KINDS = ("pretrain", "finetune")
#: schedulers that need nothing but the step count
SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt")
#: the folder inside --output_dir that receives the model card unless --model_card_dir says otherwise
MODEL_CARD_SUBDIR = "model_card"


class TrainingError(ValueError):
    """Bad training input, detected before any training step."""


def _checkpointing_steps(text: str) -> str:
    if text == "epoch" or (text.isdigit() and int(text) > 0):
        return text
    raise argparse.ArgumentTypeError(f"must be a positive integer or 'epoch', got {text!r}")


def parse_attnorm_options(pairs: Sequence[str] | None) -> dict[str, Any]:
    """``["eta=0.5", "eta_learnable=true"]`` -> ``{"eta": 0.5, "eta_learnable": True}``, typed by the declared
    option (the one grammar: ``hf_attnorm.settings.parse_option_pairs``). ``implementation``/``normalizer``/
    ``scale`` have their own flags."""
    for pair in pairs or ():
        key, sep, _ = pair.partition("=")
        if not sep or not key.strip():
            raise TrainingError(f"--attnorm expects KEY=VALUE, got {pair!r}")
        if key.strip() in ("implementation", "normalizer", "scale"):
            raise TrainingError(f"--attnorm {key.strip()}=... : use --attn_implementation/--normalizer/--scale "
                                "instead")
        if key.strip() not in OPTIONS:
            raise TrainingError(f"--attnorm: unknown option {key.strip()!r}; declared options: {', '.join(OPTIONS)}")
    try:
        return parse_option_pairs(pairs or ())
    except OptionError as exc:
        raise TrainingError(f"--attnorm: {exc}") from exc


_GROUPS = ("model", "attention (hf_attnorm)", "data", "optimisation", "evaluation, checkpoints and output")


def _arg(default: Any = None, help: str = "", group: str = "model", *, kinds: tuple[str, ...] = KINDS,
         **flag: Any) -> Any:
    """A field that is a flag: ``flag`` holds argparse keywords (type, choices, action, required, metavar) and
    per-script ``pretrain``/``finetune`` dicts overriding ``default``/``help``."""
    assert group in _GROUPS, group
    meta = {"help": help, "group": group, "kinds": kinds, **flag}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class TrainingArguments:
    """Every flag of the two scripts (see ``build_parser``); values as parsed, never changed afterwards."""

    kind: str = dataclasses.field(default="pretrain", metadata={"flag": False})

    # ---------------------------------------------------------------------------------------------------- model
    model_type: str = _arg("llama", "model family to build from scratch with --model_size (not used with "
                           "--config_name)", kinds=("pretrain",), choices=list(FAMILIES))
    model_size: str = _arg("tiny", "size preset of hf_attnorm.lab.model_zoo.SIZES (hidden, layers, heads, kv heads, "
                           "mlp)", kinds=("pretrain",), choices=list(SIZES))
    config_name: str | None = _arg(None, "a config.json file or model folder to build the model from instead of "
                                   "--model_type/--model_size", kinds=("pretrain",))
    max_position_embeddings: int | None = _arg(
        None, "position table size of a preset model (default: max(block_size, 1024), BERT 512)",
        kinds=("pretrain",), type=positive_int)
    model_name_or_path: str | None = _arg(
        None, "checkpoint folder to start from (a step_N or final output of these scripts, any HF folder), or the "
        "embedded real models: 'smollm2' (SmolLM2-135M-Instruct) or 'minilm' (all-MiniLM-L6-v2)",
        kinds=("finetune",), required=True)
    tokenizer_name: str | None = _arg(
        None, "", pretrain={"help": "tokenizer folder, or 'gpt2' / 'minilm' for the embedded real ones (default: "
                                    "GPT-2 BPE for gpt2/llama, MiniLM WordPiece for bert)"},
        finetune={"help": "tokenizer folder, or 'gpt2' / 'minilm' for the embedded real ones (default: the "
                          "checkpoint's own tokenizer)"})
    task: str = _arg("auto", "training objective; auto = masked_lm for BERT models, causal_lm otherwise",
                     choices=["auto", "causal_lm", "masked_lm"])

    # ------------------------------------------------------------------------------------------------ attention
    attn_implementation: str | None = _arg(
        None, "", "attention (hf_attnorm)",
        pretrain={"help": "hf_attnorm implementation (preset) name, e.g. softmax, softmax1, ssmax, symax (see "
                          "--list); default softmax, or the resumed checkpoint's"},
        finetune={"help": "hf_attnorm implementation (preset) name, e.g. softmax, softmax1, ssmax, symax (see "
                          "--list); default: the checkpoint's own attention (surgery when given)"})
    normalizer: str | None = _arg(None, "normalizer to use inside the implementation (overrides the preset's; alone "
                                  "it selects the preset of the same name)", "attention (hf_attnorm)")
    scale: str | None = _arg(None, "length-aware scale (overrides the preset's), e.g. ssmax, log_n",
                             "attention (hf_attnorm)")
    attnorm: list[str] = _arg([], "an attnorm option, typed by its declaration (repeatable), e.g. --attnorm eta=0.5 "
                              "--attnorm eta_learnable=true; see --list", "attention (hf_attnorm)", action="append",
                              metavar="KEY=VALUE")
    list: bool = _arg(False, "print the registered implementations, normalizers, scales and options, then exit",
                      "attention (hf_attnorm)", action="store_true")

    # ----------------------------------------------------------------------------------------------------- data
    dataset_name: str | None = _arg(None, f"a `datasets` hub name (needs network), or '{data_lib.EMBEDDED_DATASET}'"
                                    " = the embedded corpus (the default when no --train_file is given)", "data")
    dataset_config_name: str | None = _arg(None, "configuration of --dataset_name", "data")
    train_file: str | None = _arg(None, "local training data: .txt (one row per line), .json/.jsonl or .csv with a "
                                  "text column", "data")
    validation_file: str | None = _arg(None, "local validation data (same format as --train_file)", "data")
    validation_split_percentage: int = _arg(5, "percentage of the training rows held out for validation when there "
                                            "is no validation split", "data", type=int)
    text_column_name: str | None = _arg(None, "column holding the text (default: 'text', or the only string column)",
                                        "data")
    no_keep_linebreaks: bool = _arg(False, "drop line breaks when reading .txt files", "data", action="store_true")
    block_size: int = _arg(128, "tokens per training sequence (texts are concatenated and cut into blocks)", "data",
                           type=positive_int)
    max_train_samples: int | None = _arg(None, "use only the first N training blocks", "data", type=positive_int)
    max_eval_samples: int | None = _arg(None, "evaluate on N validation blocks spread evenly over the validation set "
                                        "(cheaper evals)", "data", type=positive_int)
    mlm_probability: float = _arg(0.15, "fraction of tokens predicted by the masked-LM objective", "data",
                                  type=float)
    preprocessing_num_workers: int | None = _arg(None, "processes for tokenisation (datasets.map num_proc)", "data",
                                                 type=positive_int)
    overwrite_cache: bool = _arg(False, "re-tokenise even if a cached result exists", "data", action="store_true")
    data_cache_dir: str | None = _arg(None, "where tokenised datasets are cached (default: "
                                      "~/.cache/hf_attnorm/datasets)", "data")

    # --------------------------------------------------------------------------------------------- optimisation
    per_device_train_batch_size: int = _arg(8, "blocks per process per micro-batch", "optimisation",
                                            type=positive_int)
    per_device_eval_batch_size: int = _arg(8, "blocks per process per eval batch", "optimisation",
                                           type=positive_int)
    learning_rate: float = _arg(1e-3, "peak learning rate (AdamW)", "optimisation", type=float,
                                finetune={"default": 5e-5})
    weight_decay: float = _arg(0.1, "AdamW weight decay (matrices only; biases, norms and attnorm per-head values "
                               "get none)", "optimisation", type=float, finetune={"default": 0.0})
    adam_beta2: float = _arg(0.99, "AdamW beta2", "optimisation", type=float, finetune={"default": 0.999})
    max_grad_norm: float = _arg(1.0, "gradient clipping norm (0 = no clipping)", "optimisation", type=float)
    num_train_epochs: int = _arg(1, "passes over the training data", "optimisation", type=positive_int)
    max_train_steps: int | None = _arg(None, "optimizer steps in total; overrides --num_train_epochs",
                                       "optimisation", type=positive_int)
    gradient_accumulation_steps: int = _arg(1, "micro-batches per optimizer step", "optimisation",
                                            type=positive_int)
    lr_scheduler_type: str = _arg("cosine", "learning-rate schedule", "optimisation", choices=SCHEDULERS,
                                  finetune={"default": "linear"})
    num_warmup_steps: int = _arg(0, "linear warm-up steps", "optimisation", type=nonnegative_int)
    seed: int = _arg(42, "seed of model init, data order, dropout and masking", "optimisation", type=int)
    torch_threads: int | None = _arg(None, "torch.set_num_threads per process (default: torch's choice)",
                                     "optimisation", type=positive_int)

    # --------------------------------------------------------------------------- evaluation, checkpoints, output
    output_dir: str = _arg(None, "where checkpoints, the final model and its card go",
                           "evaluation, checkpoints and output", required=True)
    overwrite_output_dir: bool = _arg(
        False, "start over in an --output_dir that holds a previous run or other files (our step_N checkpoints, "
        "logs and model files in it are deleted first)", "evaluation, checkpoints and output", action="store_true")
    eval_steps: int | None = _arg(None, "evaluate every N optimizer steps (default: at the end of each epoch); "
                                  "always at the end", "evaluation, checkpoints and output", type=positive_int)
    checkpointing_steps: str | None = _arg(None, "save a resumable checkpoint step_N every N steps, or 'epoch' at "
                                           "each epoch end", "evaluation, checkpoints and output",
                                           type=_checkpointing_steps)
    checkpoints_total_limit: int | None = _arg(None, "keep only the newest N checkpoints",
                                               "evaluation, checkpoints and output", type=positive_int)
    resume_from_checkpoint: str | None = _arg(
        None, "a step_N folder to resume, or 'latest' (the newest complete step_N in --output_dir; a fresh start "
        "with a warning if there is none)", "evaluation, checkpoints and output")
    with_tracking: bool = _arg(False, "log metrics to experiment trackers", "evaluation, checkpoints and output",
                               action="store_true")
    report_to: str = _arg("all", "trackers for --with_tracking, comma separated (tensorboard, wandb, ... or jsonl, "
                          "our file tracker); 'all' = every installed accelerate tracker, or jsonl if none is",
                          "evaluation, checkpoints and output")
    logging_dir: str | None = _arg(None, "tracker log folder (default: <output_dir>/runs)",
                                   "evaluation, checkpoints and output")
    model_card_dir: str | None = _arg(
        None, f"folder that also receives the model card as <name>.md (default: <output_dir>/{MODEL_CARD_SUBDIR}; "
        "'none' to skip; the repository's model_cards/ only when you name it)", "evaluation, checkpoints and output")
    model_card_name: str | None = _arg(None, "card name (default: the output folder's name)",
                                       "evaluation, checkpoints and output")

    # ------------------------------------------------------------------------------------------------- derived
    @property
    def pretrain(self) -> bool:
        return self.kind == "pretrain"

    @property
    def card_dir(self) -> Path | None:
        """Where the card's copy goes: None for 'none', else the flag's folder or ``<output_dir>/model_card``."""
        if self.model_card_dir is None:
            return Path(self.output_dir) / MODEL_CARD_SUBDIR
        return None if self.model_card_dir.lower() == "none" else Path(self.model_card_dir)

    @property
    def checkpoint_every(self) -> int | None:
        return int(self.checkpointing_steps) if self.checkpointing_steps not in (None, "epoch") else None

    def as_dict(self) -> dict[str, Any]:
        """The flags of this script and their values (what the run records; ``kind`` is recorded separately)."""
        return {f.name: getattr(self, f.name) for f in flags_of(self.kind)}

    def validate(self) -> None:
        """Range checks argparse's types cannot express; raise ``TrainingError`` before anything is built."""
        if self.learning_rate <= 0:
            raise TrainingError(f"--learning_rate must be > 0, got {self.learning_rate}")
        if self.weight_decay < 0 or self.max_grad_norm < 0:
            raise TrainingError("--weight_decay and --max_grad_norm must be >= 0")
        if not 0 < self.adam_beta2 < 1:
            raise TrainingError(f"--adam_beta2 must lie in (0, 1), got {self.adam_beta2}")
        if self.resume_from_checkpoint is not None and self.overwrite_output_dir:
            raise TrainingError("--resume_from_checkpoint and --overwrite_output_dir contradict each other")
        if self.pretrain and self.max_position_embeddings and self.config_name:
            raise TrainingError("--max_position_embeddings applies to preset models; edit the --config_name file")
        out = Path(self.output_dir)
        if out.exists() and not out.is_dir():
            raise TrainingError(f"--output_dir {out} exists and is not a folder")
        parse_attnorm_options(self.attnorm)


def flags_of(kind: str) -> list[dataclasses.Field]:
    """The fields that are flags of script ``kind``, in flag order."""
    if kind not in KINDS:
        raise ValueError(f"kind must be pretrain or finetune, got {kind!r}")
    return [f for f in dataclasses.fields(TrainingArguments)
            if f.metadata.get("flag", True) and kind in f.metadata["kinds"]]


class _HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` unless the help text explains its default or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" not in text and action.default not in (None, False, [], argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


def build_parser(kind: str) -> argparse.ArgumentParser:
    """The flags of ``scripts/pretrain.py`` (kind="pretrain") or ``scripts/finetune.py`` (kind="finetune"), one per
    field of ``TrainingArguments``."""
    fields = flags_of(kind)
    pre = kind == "pretrain"
    parser = argparse.ArgumentParser(
        prog=f"{kind}.py",
        description=("Pretrain a GPT-2, BERT (masked LM) or Llama model from scratch" if pre else
                     "Fine-tune a checkpoint (ours, SmolLM2, MiniLM, any HF folder), optionally swapping its "
                     "attention normalizer,") + " with any hf_attnorm attention implementation, using accelerate. "
        "Runs with `python` or `accelerate launch`; see docs/training.md.",
        formatter_class=_HelpFormatter,
    )
    groups = {title: parser.add_argument_group(title) for title in _GROUPS}
    for f in fields:
        meta = dict(f.metadata)
        per_kind = meta.pop(kind, {})
        for key in ("group", "kinds", "pretrain", "finetune"):
            meta.pop(key, None)
        meta.update(per_kind)
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        meta.setdefault("default", default)
        if meta.get("required"):
            meta.pop("default")
        groups[f.metadata["group"]].add_argument(f"--{f.name}", **meta)
    return parser


def parse_args(kind: str, argv: Sequence[str] | None = None) -> TrainingArguments:
    """Parse ``argv`` with the flags of script ``kind`` (argparse's errors and exit code 2 on bad flags)."""
    namespace = build_parser(kind).parse_args(argv)
    return TrainingArguments(kind=kind, **vars(namespace))


def list_registered() -> str:
    lines = ["attention implementations (--attn_implementation):"]
    lines += [f"  {n:16s} {p.description.strip().splitlines()[0]}" for n, p in PRESETS.items()]
    lines.append("normalizers (--normalizer):  " + ", ".join(NORMALIZERS))
    lines.append("scales (--scale):            " + ", ".join(SCALES))
    lines.append("options (--attnorm KEY=VALUE):")
    lines += [f"  {n:28s} {o.kind.__name__:5s} default {o.default!r}: {o.help}" for n, o in OPTIONS.items()]
    return "\n".join(lines)
