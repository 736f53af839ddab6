"""Model, tokenizer and data of a run: which attention settings the flags ask for (validated against a resumed
checkpoint), the model built from scratch (pretrain) or loaded (finetune, with optional surgery), and the tokenised
training and validation blocks."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer, PretrainedConfig

from ...hf.families import MASKED_LM, lm_task
from ...registry import PRESETS, AttnormError, canonical, is_ours
from ...settings import INFO_KEYS, option_names, resolve_settings, settings_core
from .. import assets
from .. import data as data_lib
from ..model_zoo import make_config
from .args import TrainingArguments, TrainingError, parse_attnorm_options


@dataclasses.dataclass
class ModelSetup:
    """What ``build_model`` made: the model, its tokenizer, the attnorm settings it carries (None = the model's own
    attention), the objective and where it came from."""

    model: torch.nn.Module
    tokenizer: Any
    settings: dict[str, Any] | None
    task: str
    model_type: str
    source: str


@dataclasses.dataclass
class DataSetup:
    """Tokenised blocks; ``masker`` draws the masked-LM masks of a training batch (None for causal LM)."""

    train: Any
    eval: Any
    masker: data_lib.MaskedLMMasker | None
    description: str


def resolve_model_path(name: str) -> str:
    """'smollm2' / 'minilm' -> the embedded real models, unless a folder of that name exists."""
    if Path(name).exists():
        return name
    if name.lower() == "smollm2":
        return str(assets.smollm2_path())
    if name.lower() == "minilm":
        return str(assets.minilm_path())
    raise TrainingError(f"--model_name_or_path {name!r} is not a folder (the embedded models are 'smollm2' and "
                        "'minilm'; hub names do not download at run time)")


def load_tokenizer(name: str | None, family: str | None, fallback_path: str | None) -> Any:
    """``--tokenizer_name`` (a folder, or 'gpt2'/'minilm'), else the checkpoint's own, else the family default."""
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


def _max_positions(config: PretrainedConfig) -> int | None:
    for attr in ("max_position_embeddings", "n_positions"):
        v = getattr(config, attr, None)
        if isinstance(v, int):
            return v
    return None


def requested_settings(args: TrainingArguments, saved: Mapping[str, Any] | None) -> dict | None:
    """The attnorm settings dict the flags ask for (validated), or None = keep the model's own attention.
    ``saved``: the settings of the checkpoint the model comes from (resume or fine-tune source)."""
    overrides = parse_attnorm_options(args.attnorm)
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
        elif overrides or args.pretrain:
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


def build_model(args: TrainingArguments, saved_settings: Mapping[str, Any] | None,
                resume_dir: Path | None) -> ModelSetup:
    """The model of the run and its tokenizer. ``saved_settings``: those of the checkpoint being resumed (the
    flags must not ask for others)."""
    if args.pretrain:
        if args.config_name and not Path(args.config_name).exists():
            raise TrainingError(f"--config_name {args.config_name}: no such file or folder")
        config = AutoConfig.from_pretrained(args.config_name) if args.config_name else None
        family = config.model_type if config is not None else args.model_type
        source_path, source = None, args.config_name or f"model_zoo {args.model_size}"
        source_settings = saved_settings
    else:
        source_path = source = resolve_model_path(args.model_name_or_path)
        config = AutoConfig.from_pretrained(source_path)
        family = config.model_type
        source_settings = saved_settings if saved_settings is not None else getattr(config, "attnorm", None)
    settings = requested_settings(args, source_settings)
    if saved_settings is not None and settings is not None and settings_core(settings) != settings_core(
            saved_settings):
        raise TrainingError(
            f"--resume_from_checkpoint {resume_dir} was trained with attention settings "
            f"{settings_core(saved_settings)}, but {settings_core(settings)} is asked for; resume with the "
            "checkpoint's settings (omit the attention flags) or fine-tune from it with finetune.py")

    tokenizer = load_tokenizer(args.tokenizer_name, family, source_path)
    if config is None:
        positions = args.max_position_embeddings or max(args.block_size, 512 if family == "bert" else 1024)
        config = make_config(family, args.model_size, vocab_size=len(tokenizer), max_positions=positions)
    task = args.task if args.task != "auto" else (lm_task(config) or "causal_lm")
    positions = _max_positions(config)
    if positions is not None and args.block_size > positions:
        raise TrainingError(f"--block_size {args.block_size} is larger than the model's {positions} positions")
    if len(tokenizer) > config.vocab_size:
        raise TrainingError(f"the tokenizer has {len(tokenizer)} tokens but the model only {config.vocab_size} "
                            "embeddings; use a matching --tokenizer_name")
    model = _instantiate(args, config, task, settings, source_path)
    settings = dict(model.config.attnorm) if getattr(model.config, "attnorm", None) else None
    return ModelSetup(model, tokenizer, settings, task, model.config.model_type, source)


def _instantiate(args: TrainingArguments, config: PretrainedConfig, task: str, settings: dict | None,
                 source_path: str | None) -> torch.nn.Module:
    auto = AutoModelForMaskedLM if task == MASKED_LM else AutoModelForCausalLM
    kwargs: dict[str, Any] = {}
    if settings is not None:
        kwargs["attn_implementation"] = settings["implementation"]
    try:
        if source_path is None:
            if settings is not None:
                config.attnorm = dict(settings)
            torch.manual_seed(args.seed)  # identical initial weights on every rank and in every resumed process
            return auto.from_config(config, **kwargs)
        if settings is not None:
            kwargs["attnorm"] = dict(settings)
        return auto.from_pretrained(source_path, dtype=torch.float32, **kwargs)
    except AttnormError as exc:
        raise TrainingError(str(exc)) from exc
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise TrainingError(f"a {config.model_type} model cannot be trained as {task} ({exc})") from exc
        raise


def build_data(args: TrainingArguments, tokenizer: Any, task: str, accelerator: Accelerator) -> DataSetup:
    """Training and validation blocks (the main process tokenises first, the others read its cache)."""
    masked = task == MASKED_LM
    with accelerator.main_process_first():
        train, val, column, description = data_lib.load_text_datasets(
            dataset_name=args.dataset_name, dataset_config_name=args.dataset_config_name,
            train_file=args.train_file, validation_file=args.validation_file,
            validation_split_percentage=args.validation_split_percentage, text_column_name=args.text_column_name,
            keep_linebreaks=not args.no_keep_linebreaks)
        train_ds, val_ds = data_lib.build_lm_datasets(
            train, val, column, tokenizer, block_size=args.block_size, masked_lm=masked,
            cache_dir=args.data_cache_dir, num_proc=args.preprocessing_num_workers,
            overwrite_cache=args.overwrite_cache)
    if args.max_train_samples is not None:
        train_ds = train_ds.select(range(min(args.max_train_samples, len(train_ds))))
    val_ds = data_lib.evenly_spaced(val_ds, args.max_eval_samples)
    masker = None
    if masked:
        # fixed masks, independent of --seed: validation losses compare across runs and seeds
        val_ds = data_lib.mask_dataset(val_ds, tokenizer, args.mlm_probability, seed=data_lib.VALIDATION_MASK_SEED)
        masker = data_lib.MaskedLMMasker(tokenizer, args.mlm_probability)
    return DataSetup(train_ds, val_ds, masker, description)
