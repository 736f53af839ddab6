"""Convert a pretrained causal LM to another attention normalizer: attention transfer, then fine-tuning.

``python scripts/convert.py --attn_implementation symax --output_dir runs/smollm2-symax`` takes the embedded
SmolLM2-135M (or any causal-LM folder), swaps its attention to an hf_attnorm implementation and trains it back:

* **stage 1, attention transfer** (the first stage of LoLCATs, Zhang et al., arXiv 2410.10254; Hedgehog, Zhang et al.,
  arXiv 2402.04347): the model's own softmax attention (computed on the same layer inputs with the same weights,
  its mask, scaling, softcap, sinks and position bias included) is the teacher. In every attention call the new
  normalizer's output is trained to match the teacher's output (relative mean squared error, averaged over
  layers), while the teacher's output goes on to the next layer, so every layer sees the original model's inputs.
  Trained: the normalizer's learnable per-head values and, by default, LoRA (peft) on q/k, merged at the end of
  the stage. With LoRA, the teacher outputs of a batch are recorded in a first pass with the adapters off (the
  original q, k, v), then the student pass reads them: one model, no second copy. The LM head does not run.
* **stage 2, fine-tuning**: next-token loss on text, or with ``--distill`` the KL divergence to the original
  model's distributions (``distill.py``), LoRA (merged at the end) or the full model.

Output: ``<output_dir>/final`` (an ordinary hf_attnorm checkpoint: ``from_pretrained`` reloads it exactly, settings
and learned values included) and ``<output_dir>/conversion.json`` (losses, per-layer transfer errors, perplexities
after each stage, seconds, peak memory). ``<output_dir>/checkpoints`` holds the newest resumable checkpoint
(``--resume_from_checkpoint latest``). Runs under ``python`` or ``accelerate launch`` (gradients of the trained
tensors are averaged over processes; evaluation runs on the main process).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import resource
import shlex
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..fileio import atomic_write
from ..hf.families import CAUSAL_LM, attention_modules, lm_task
from ..hf.integration import apply as apply_implementation
from ..registry import AttnormError
from . import calibration as calibration_lib
from . import data as data_lib
from . import distill as distill_lib
from .cli import offline_by_default
from .continuation import ContinuationPlan
from .convert_args import (  # noqa: F401  (build_parser, parse_token_counts: the study's flags read them here)
    ARGS_FILE,
    EVAL_POINTS,
    FINETUNE_LR,
    RESUME_MAY_DIFFER,
    STAGES,
    ConvertError,
    build_parser,
    parse_args,
    parse_token_counts,
    recorded_args,
)
from .evaluation import EvaluationError, causal_lm_perplexity, spread_chunks
from .training.args import TrainingError
from .training.checkpoints import TMP_PREFIX, publish_folder, write_json
from .training.setup import resolve_model_path
from .transfer import (  # noqa: F401  (Transfer, install_observer: part of this module's interface)
    Transfer,
    TransferError,
    decoder_of,
    install_observer,
    observing,
    transfer_errors,
)

SUMMARY_FILE = "conversion.json"
CHECKPOINTS = "checkpoints"
#: the stage-1 result kept for a resume inside stage 2 (never rotated)
TRANSFER_DONE = "transfer_done"
#: stage 1's trained tensors at its best held-out point so far (never rotated; --transfer_keep_best)
TRANSFER_BEST = "transfer_best"

# ---------------------------------------------------------------------------------------------------- the run


@dataclasses.dataclass
class History:
    """What conversion.json records; saved in every checkpoint, so a resumed run continues it."""

    stage: str = "transfer"
    step: int = 0
    losses: dict[str, list[list[float]]] = dataclasses.field(default_factory=lambda: {s: [] for s in STAGES})
    seconds: dict[str, float] = dataclasses.field(default_factory=lambda: {s: 0.0 for s in STAGES})
    perplexity: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    layer_errors: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    #: the process's peak resident memory (MB) during each phase: loading, each evaluation, each stage
    peak_rss_mb: dict[str, float] = dataclasses.field(default_factory=dict)
    trained: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    #: what the calibrated start set (``hf_attnorm.lab.calibration.calibrate``'s report), or why nothing
    calibration: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: stage 1's held-out mean layer error: at its start ("start"), at each measured step ("measured": [[step,
    #: error]]), the best ("best_step", "best"), and why the stage was skipped ("skipped"), when it was
    transfer_check: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: --distill: top-k, weight, the teacher's cache size (MB) and the seconds its pass took
    distill: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: --eval_texts: text -> evaluation point -> context -> perplexity
    perplexity_texts: dict[str, dict[str, dict[str, float]]] = dataclasses.field(default_factory=dict)
    #: CPU seconds (every thread of the process) of each stage, as ``seconds`` holds their wall seconds
    cpu_seconds: dict[str, float] = dataclasses.field(default_factory=lambda: {s: 0.0 for s in STAGES})
    #: CPU seconds of the whole run spent by earlier processes (a resumed run: up to the checkpoint it resumed)
    cpu_before: float = 0.0
    #: the machine's 1-minute load average read at every training step: [samples, sum, max]
    load_steps: list[float] = dataclasses.field(default_factory=lambda: [0, 0.0, 0.0])


def _reset_peak_rss() -> None:
    """Start a new peak-memory window (Linux: writing 5 to clear_refs resets VmHWM; elsewhere the peak stays the
    process's since its start)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_rss_mb() -> float:
    """The process's peak resident memory since the last ``_reset_peak_rss`` (MB)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024.0, 1)
    except (OSError, ValueError, IndexError):
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)  # Linux: KiB


def _lr(peak: float, step: int, total: int) -> float:
    """Cosine decay from ``peak`` to 10% of it over ``total`` steps."""
    return peak * (0.1 + 0.45 * (1.0 + math.cos(math.pi * step / max(1, total))))


class Converter:
    """One conversion: model, data, the two stages, evaluation and checkpoints (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, command: str | None = None) -> None:
        self._started, self._load_start = time.perf_counter(), round(os.getloadavg()[0], 2)
        self._cpu_started = time.process_time()
        self.command = command
        self.args = args
        self.out = Path(args.output_dir)
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available())
        self.main = self.accelerator.is_main_process
        self.history = History()
        self._prepare_output()
        self.model, self.tokenizer = self._load_model()
        self.train_blocks, self.validation_stream = self._load_data()
        #: --eval_texts: name -> (description, token ids [N])
        self.eval_texts = self._load_eval_texts()
        self.error_ids = self._error_blocks()
        #: the original model's attention outputs on the error blocks, recorded before anything is trained
        self._reference = self._record_reference()
        self._teacher: list[distill_lib.TeacherTopK] | None = None  # (--distill: set by run)
        #: (implementation, options) a continuation last set (None: the asked ones, as loaded)
        self._continuation_at: tuple[str, dict[str, Any]] | None = None

    # ---------------------------------------------------------------- setup
    def _prepare_output(self) -> None:
        a = self.args
        args_file = self.out / ARGS_FILE
        if a.resume_from_checkpoint is None and self.out.exists() and any(self.out.iterdir()):
            if not a.overwrite_output_dir:
                raise ConvertError(f"--output_dir {self.out} is not empty; pass --overwrite_output_dir to replace it "
                                   "or --resume_from_checkpoint latest to continue it")
            if not (args_file.is_file() or (self.out / SUMMARY_FILE).is_file()):
                raise ConvertError(f"--output_dir {self.out} holds files that are not a conversion; "
                                   "--overwrite_output_dir only replaces a previous conversion")
            if self.main:
                shutil.rmtree(self.out)
        self.accelerator.wait_for_everyone()
        if a.resume_from_checkpoint is not None and args_file.is_file():
            before = json.loads(args_file.read_text())
            now = recorded_args(a)
            changed = sorted(k for k in set(before) | set(now)
                             if k not in RESUME_MAY_DIFFER and before.get(k) != now.get(k))
            if changed:
                raise ConvertError(f"--resume_from_checkpoint: the run in {self.out} was started with other values "
                                   f"of {', '.join('--' + k for k in changed)}; resume with the same flags")
        if self.main:
            self.out.mkdir(parents=True, exist_ok=True)
            atomic_write(args_file, json.dumps(recorded_args(a), indent=1))

    def _load_model(self) -> tuple[nn.Module, Any]:
        a = self.args
        try:
            path = resolve_model_path(a.model_name_or_path)
        except TrainingError as exc:
            raise ConvertError(str(exc)) from exc
        config = AutoConfig.from_pretrained(path)
        if lm_task(config) != CAUSAL_LM:
            raise ConvertError(f"{path} is a {config.model_type} model without a causal-LM head; convert.py converts "
                               "causal LMs (the teacher is the model's own causal softmax attention)")
        try:
            model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=a.attn_implementation,
                                                         attnorm=dict(a.options), dtype=torch.float32)
        except AttnormError as exc:
            raise ConvertError(str(exc)) from exc
        n_layers = sum(1 for _ in attention_modules(model))
        if install_observer(model, None) != n_layers or n_layers == 0:
            raise ConvertError(f"{config.model_type}: {n_layers} attention modules, not all run by hf_attnorm")
        positions = getattr(config, "max_position_embeddings", None)
        longest = max([a.block_size, *a.eval_lengths])
        if isinstance(positions, int) and longest > positions:
            raise ConvertError(f"--block_size/--eval_lengths up to {longest} tokens, but the model has "
                               f"{positions} positions")
        tokenizer = AutoTokenizer.from_pretrained(path)
        if len(tokenizer) > config.vocab_size:
            raise ConvertError(f"{path}: the tokenizer has {len(tokenizer)} tokens but the model only "
                               f"{config.vocab_size} embeddings")
        return model.to(self.accelerator.device), tokenizer

    def _load_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.args
        with self.accelerator.main_process_first():
            try:
                train, val, column, _ = data_lib.load_text_datasets(
                    train_file=a.train_file, validation_file=a.validation_file)
                train_ds, val_ds = data_lib.build_lm_datasets(train, val, column, self.tokenizer,
                                                              block_size=a.block_size, masked_lm=False)
            except data_lib.DataError as exc:
                raise ConvertError(str(exc)) from exc
        blocks = train_ds.with_format("torch")["input_ids"][:].long()  # [N, block_size]
        stream = val_ds.with_format("torch")["input_ids"][:].long().reshape(-1)
        if len(blocks) == 0:
            raise ConvertError(f"the training text has fewer than --block_size {a.block_size} tokens")
        for length in a.eval_lengths:
            if len(stream) < length:
                raise ConvertError(f"the validation text has {len(stream)} tokens, fewer than --eval_lengths {length}")
        return blocks, stream

    def _load_eval_texts(self) -> dict[str, tuple[str, torch.Tensor]]:
        out = {}
        for name in self.args.eval_texts:
            try:
                description, text = data_lib.held_out_text(name)
            except data_lib.DataError as exc:
                raise ConvertError(f"--eval_texts: {exc}") from exc
            ids = torch.tensor(self.tokenizer(text)["input_ids"], dtype=torch.long)
            short = [n for n in self.args.eval_lengths if len(ids) < n]
            if short:
                raise ConvertError(f"--eval_texts {name}: {len(ids)} tokens, fewer than --eval_lengths {short[0]}")
            out[name] = (description, ids)
        return out

    def _error_blocks(self) -> torch.Tensor:
        n = min(self.args.error_blocks, len(self.validation_stream) // self.args.block_size)
        if n < 1:
            raise ConvertError(f"the validation text has fewer than --block_size {self.args.block_size} tokens")
        return spread_chunks(self.validation_stream, self.args.block_size, n * self.args.block_size).view(n, -1)

    # ---------------------------------------------------------------- data order
    def batch(self, stage: str, step: int) -> torch.Tensor:
        """The ids [b, block_size] this process trains on at ``step`` of ``stage``: a permutation of the training
        blocks per (seed, stage, epoch), cut into consecutive per-process slices (a resume continues it exactly)."""
        a, acc = self.args, self.accelerator
        per_step = a.per_device_train_batch_size * acc.num_processes
        n = len(self.train_blocks)
        start = step * per_step + acc.process_index * a.per_device_train_batch_size
        rows = []
        for i in range(start, start + a.per_device_train_batch_size):
            epoch, j = divmod(i, n)
            g = torch.Generator().manual_seed(a.seed * 1_000_003 + STAGES.index(stage) * 10_007 + epoch)
            rows.append(int(torch.randperm(n, generator=g)[j]))
        return self.train_blocks[rows].to(acc.device)

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, name: str) -> None:
        """Perplexity at each --eval_lengths and the per-layer transfer error, recorded under ``name``."""
        if name in self.history.perplexity or name not in self.args.eval_stages:
            return  # done before a resume, or not asked for
        model = self.model
        if self.main:
            _reset_peak_rss()
            ppl = self._perplexities(model, self.validation_stream)
            for text, (_, ids) in self.eval_texts.items():
                self.history.perplexity_texts.setdefault(text, {})[name] = self._perplexities(model, ids)
            self.history.perplexity[name] = ppl
            self.history.layer_errors[name] = self.layer_errors()
            self.history.peak_rss_mb[f"evaluation {name}"] = _peak_rss_mb()
            mean_error = {k: statistics.fmean(v) for k, v in self.history.layer_errors.items()}
            start = next((k for k in ("calibrated", "swapped") if k in mean_error), None)  # where stage 1 began
            if name == "transfer" and start is not None and mean_error["transfer"] > mean_error[start]:
                warnings.warn(f"stage 1 raised the held-out per-layer error of {self.args.attn_implementation} from "
                              f"{mean_error[start]:.4g} ({start}) to {mean_error['transfer']:.4g}: the learning rate "
                              "overshoots a normalizer this close to softmax; lower --transfer_learning_rate or skip "
                              "the stage (--transfer_steps 0)", stacklevel=2)
            shown = ", ".join(f"{k} tokens {v:.2f}" for k, v in ppl.items())
            print(f"[convert] {name}: perplexity {shown}; mean layer error {mean_error[name]:.4f}", file=sys.stderr)
        self.accelerator.wait_for_everyone()

    def _perplexities(self, model: nn.Module, stream: torch.Tensor) -> dict[str, float]:
        """Perplexity at each --eval_lengths on --eval_tokens of ``stream`` (chunks spread evenly over it)."""
        ppl = {}
        for length in self.args.eval_lengths:
            ids = spread_chunks(stream, length, max(length, self.args.eval_tokens))
            try:
                ppl[str(length)] = causal_lm_perplexity(model, input_ids=[ids], max_length=length).perplexity
            except EvaluationError as exc:
                raise ConvertError(str(exc)) from exc
        return ppl

    def layer_errors(self, installed: Transfer | None = None) -> list[float]:
        """Relative error of each layer's attention output against the original model's, on the held-out error
        blocks, every layer fed the original model's inputs: mean over blocks, one value per layer. ``installed``:
        the observer already on the model (stage 1's), used as it is; else one is put on for the measurement."""
        was_training = self.model.training
        self.model.eval()
        try:
            with (contextlib.nullcontext(installed) if installed is not None
                  else observing(self.model, Transfer())) as transfer, torch.no_grad():
                per_block = [transfer_errors(self.model, transfer, ids[None].to(self.accelerator.device), False,
                                             teacher=self._reference[i]) for i, ids in enumerate(self.error_ids)]
        finally:
            self.model.train(was_training)
        return [round(float(v), 6) for v in torch.stack(per_block).mean(0)]

    def _held_out_error(self, installed: Transfer | None = None) -> float:
        """The mean of ``layer_errors`` (computed on every process alike: each holds the error blocks and their
        recorded teacher outputs, so all take the same keep-best decisions without a broadcast)."""
        return round(statistics.fmean(self.layer_errors(installed)), 6)

    def _save_best(self, params: dict[str, nn.Parameter]) -> None:
        if self.main:
            folder = self.out / CHECKPOINTS / TRANSFER_BEST
            folder.mkdir(parents=True, exist_ok=True)
            save_file({n: p.detach().cpu().contiguous() for n, p in params.items()}, str(folder / ".tmp"))
            os.replace(folder / ".tmp", folder / "trainable.safetensors")
        self.accelerator.wait_for_everyone()

    def _check_transfer(self, params: dict[str, nn.Parameter], transfer: Transfer) -> None:
        """--transfer_keep_best at this step: measure, and keep the trained tensors when they are the best yet."""
        check = self.history.transfer_check
        error = self._held_out_error(transfer)
        check["measured"].append([self.history.step, error])
        if error < check["best"]:
            check["best"], check["best_step"] = error, self.history.step
            self._save_best(params)

    def _record_reference(self) -> list[list[torch.Tensor]]:
        """The original model's attention outputs on the error blocks (recorded before any training)."""
        out = []
        with observing(self.model, Transfer()) as transfer, torch.no_grad():
            for ids in self.error_ids:
                transfer.reset("record")
                decoder_of(self.model)(input_ids=ids[None].to(self.accelerator.device), use_cache=False)
                out.append(list(transfer.teacher))
        return out

    def _record_teacher(self) -> list[distill_lib.TeacherTopK] | None:
        """--distill: the original model's distributions over this process's stage-2 batches (one per step), from
        a pass with every attention call computing the model's own softmax (the observer's "record" mode), run while
        the weights are still the original ones (before stage 1, or before a resume rebuilds the finished stages)."""
        a = self.args
        if not (a.distill and a.finetune_steps):
            return None
        start, cache = time.perf_counter(), []
        was_training = self.model.training
        self.model.eval()
        try:
            with observing(self.model, Transfer()) as transfer, torch.no_grad():
                for step in range(a.finetune_steps):
                    transfer.reset("record")
                    logits = self.model(input_ids=self.batch("finetune", step), use_cache=False).logits
                    cache.append(distill_lib.teacher_top_k(logits, a.distill_top_k))
        finally:
            self.model.train(was_training)
        self.history.distill = {"top_k": a.distill_top_k, "weight": a.distill_weight,
                                "cache_mb": round(sum(t.nbytes() for t in cache) / 2**20, 2),
                                "seconds": round(time.perf_counter() - start, 2)}
        return cache

    def calibrate(self) -> None:
        """The calibrated start (``--calibrate``): per-head values from one pass of the original model over
        --calibration_blocks training blocks spread over the text; recorded in the history."""
        a = self.args
        if not a.calibrate:
            self.history.calibration = {"calibrated": False, "notes": {"--no-calibrate": "calibration off"}}
            return
        rows = torch.linspace(0, len(self.train_blocks) - 1, min(a.calibration_blocks, len(self.train_blocks)))
        try:
            report = calibration_lib.calibrate(self.model, self.train_blocks[rows.round().long()])
        except (AttnormError, ValueError) as exc:
            raise ConvertError(f"calibration: {exc}") from exc
        self.history.calibration = report
        if self.main:
            print(f"[convert] {a.attn_implementation}: {calibration_lib.describe(report)}", file=sys.stderr)

    # ---------------------------------------------------------------- stages
    def _wrap(self, stage: str) -> bool:
        """Make the model trainable for ``stage``: LoRA where asked (seeded, so a resume rebuilds the same adapters
        before loading their values), the normalizer's learnable values always. Returns whether LoRA is on."""
        a = self.args
        lora_r = a.transfer_lora_r if stage == "transfer" else (a.lora_r if a.finetune_mode == "lora" else 0)
        targets = a.transfer_lora_targets if stage == "transfer" else a.finetune_lora_targets
        torch.manual_seed(a.seed * 1_000_003 + STAGES.index(stage))
        if lora_r:
            try:
                import peft
            except ImportError as exc:
                raise ConvertError("LoRA needs peft (pip install peft, or pip install 'hf_attnorm[train]'); or pass "
                                   "--transfer_lora_r 0 / --finetune_mode full") from exc
            present = {n.rsplit(".", 1)[-1] for n, m in self.model.named_modules() if isinstance(m, nn.Linear)}
            missing = [t for t in targets if t not in present]
            if missing:
                raise ConvertError(f"LoRA targets {missing} are not linear modules of this model; its linear "
                                   f"modules: {', '.join(sorted(present))}")
            config = peft.LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, target_modules=targets,
                                     bias="none")
            self.model = peft.get_peft_model(self.model, config)
        full = stage == "finetune" and a.finetune_mode == "full"
        for name, p in self.model.named_parameters():
            p.requires_grad_(full or ".attnorm." in name or (lora_r > 0 and "lora_" in name))
        return lora_r > 0

    def _unwrap(self) -> None:
        """Merge LoRA into the weights (the model is an ordinary hf_attnorm model again)."""
        if hasattr(self.model, "merge_and_unload"):
            self.model = self.model.merge_and_unload()
        for p in self.model.parameters():
            p.requires_grad_(False)

    def _rebuild(self, stage: str, folder: Path | None) -> None:
        if folder is None or not (folder / "trainable.safetensors").is_file():
            raise ConvertError(f"cannot resume: the trained tensors of the finished {stage} stage are missing "
                               f"({folder})")
        self._wrap(stage)
        self._load_trainable(folder, self._trainable())
        self._unwrap()

    def _trainable(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def run_stage(self, stage: str, resume: Path | None) -> None:
        a, acc, h = self.args, self.accelerator, self.history
        total = a.transfer_steps if stage == "transfer" else a.finetune_steps
        lora = self._wrap(stage)
        params = self._trainable()
        if not params:
            raise ConvertError(f"stage 1 has nothing to train: {a.attn_implementation} has no learnable values and "
                               "--transfer_lora_r is 0; give LoRA a rank, make a value learnable (--attnorm "
                               "<name>_learnable=true) or skip the stage with --transfer_steps 0")
        h.trained[stage] = {"tensors": len(params), "parameters": sum(p.numel() for p in params.values()),
                            "lora": lora}
        optimizer = torch.optim.AdamW(list(params.values()), lr=a.transfer_learning_rate if stage == "transfer"
                                      else a.finetune_learning_rate, weight_decay=a.weight_decay)
        peak = optimizer.param_groups[0]["lr"]
        if resume is not None:
            self._load_trainable(resume, params)
            optimizer.load_state_dict(torch.load(resume / "optimizer.pt", map_location=acc.device))
        keep_best = stage == "transfer" and a.transfer_keep_best
        plan: ContinuationPlan | None = a.continuation_plan if stage == "transfer" else None
        if keep_best and resume is None:  # the start is the first candidate (LoRA at zero: the start's model)
            h.transfer_check.update(measured=[], best=h.transfer_check["start"], best_step=0)
            self._save_best(params)
        self.model.train()
        _reset_peak_rss()
        start, cpu = time.perf_counter(), time.process_time()
        with observing(self.model, Transfer() if stage == "transfer" else None) as transfer, \
                _progress(total, h.step, f"{stage} ({a.attn_implementation})", acc.is_local_main_process) as bar:
            while h.step < total:
                for group in optimizer.param_groups:
                    group["lr"] = _lr(peak, h.step, total)
                if plan is not None:
                    self._continue(plan.options_at(h.step, total), transfer)
                ids = self.batch(stage, h.step)
                if transfer is not None:
                    loss = transfer_errors(self.model, transfer, ids, lora).mean()
                elif self._teacher is not None:  # --distill
                    mixed = a.distill_weight < 1
                    out = self.model(input_ids=ids, labels=ids if mixed else None, use_cache=False)
                    loss = a.distill_weight * distill_lib.top_k_kl(out.logits, self._teacher[h.step])
                    if mixed:
                        loss = loss + (1 - a.distill_weight) * out.loss
                else:
                    loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                if acc.num_processes > 1:  # the model is not wrapped in DDP: average the trained tensors' gradients
                    for p in params.values():
                        if p.grad is not None:
                            p.grad = acc.reduce(p.grad, reduction="mean")
                if a.max_grad_norm > 0:
                    torch.nn.utils.clip_grad_norm_(list(params.values()), a.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                value = float(acc.reduce(loss.detach(), reduction="mean"))
                if not math.isfinite(value):
                    raise ConvertError(f"{stage} step {h.step + 1}: the loss is {value}; lower "
                                       f"--{stage}_learning_rate")
                h.step += 1
                h.losses[stage].append([h.step, round(value, 6)])
                load = os.getloadavg()[0]  # (a shared machine: what the run competed with, step by step)
                h.load_steps = [h.load_steps[0] + 1, h.load_steps[1] + load, max(h.load_steps[2], load)]
                bar.update(1)
                bar.set_postfix(loss=f"{value:.4f}")
                # (a continuation's model is the asked normalizer only once its option reached the end)
                if keep_best and (h.step % a.transfer_eval_steps == 0 or h.step == total) and \
                        (plan is None or plan.at_end(h.step, total)):
                    if plan is not None:
                        self._continue(plan.options_at(h.step, total), transfer)
                    self._check_transfer(params, transfer)
                if a.checkpointing_steps and h.step % a.checkpointing_steps == 0 and h.step < total:
                    h.seconds[stage] += time.perf_counter() - start
                    h.cpu_seconds[stage] += time.process_time() - cpu
                    start, cpu = time.perf_counter(), time.process_time()
                    self.checkpoint(params, optimizer)
        if plan is not None:  # the asked implementation again (the continuation's end computes it)
            self._continue(None, None)
        if keep_best and h.transfer_check["best_step"] != h.step:  # end at the best state seen
            self._load_trainable(self.out / CHECKPOINTS / TRANSFER_BEST, params)
            if self.main:
                print(f"[convert] stage 1 ends at its best held-out state, step {h.transfer_check['best_step']} "
                      f"(mean layer error {h.transfer_check['best']:.4g}; the last step's "
                      f"{h.transfer_check['measured'][-1][1]:.4g})", file=sys.stderr)
        h.seconds[stage] += time.perf_counter() - start
        h.cpu_seconds[stage] += time.process_time() - cpu
        h.peak_rss_mb[stage] = max(h.peak_rss_mb.get(stage, 0.0), _peak_rss_mb())
        self.checkpoint(params, optimizer, stage_done=True)
        self._unwrap()

    def _continue(self, options: dict[str, Any] | None, transfer: Transfer | None) -> None:
        """Stage 1's continuation: the model's attention on the continuation's implementation with ``options`` (None:
        back on the asked implementation and options), ``transfer`` put back on the new attention states. Learned
        values carry over (the plan admits only continuations that learn the same values)."""
        a = self.args
        impl, opts = (a.attn_implementation, a.options) if options is None else \
            (a.continuation_plan.implementation, options)
        if self._continuation_at == (impl, opts):
            return
        hf_model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        apply_implementation(hf_model, impl, **opts)
        install_observer(self.model, transfer)
        self._continuation_at = (impl, dict(opts))

    # ---------------------------------------------------------------- checkpoints
    def checkpoint(self, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer,
                   stage_done: bool = False) -> None:
        """The newest resumable state (trained tensors, optimizer, history) in checkpoints/step_<stage>_<N>; the
        end of stage 1 also in checkpoints/transfer_done (what a resume inside stage 2 rebuilds from)."""
        acc, h = self.accelerator, self.history
        acc.wait_for_everyone()
        if self.main:
            root = self.out / CHECKPOINTS
            name = TRANSFER_DONE if stage_done and h.stage == "transfer" else f"{h.stage}_{h.step:06d}"
            tmp = root / f"{TMP_PREFIX}{name}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            tensors = {n: p.detach().cpu().contiguous() for n, p in params.items()}
            save_file(tensors, str(tmp / "trainable.safetensors"))
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
            state = dataclasses.asdict(h)
            state["cpu_before"] = self._cpu_total()  # (a resume from here adds its own process's)
            if stage_done:  # what a resume does next: the following stage, from its first step
                state["stage_done"] = h.stage
            write_json(tmp / "state.json", state)
            publish_folder(tmp, root / name)  # the training scripts' checkpoints: complete, or not there
            for old in root.iterdir():  # only the newest is kept (and the stage-1 result)
                if old.name not in (name, TRANSFER_DONE, TRANSFER_BEST):
                    shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()

    def _cpu_total(self) -> float:
        """CPU seconds of the whole run so far: this process's since it started, plus earlier processes' (resumed)."""
        return self.history.cpu_before + time.process_time() - self._cpu_started

    def _load_trainable(self, folder: Path, params: dict[str, nn.Parameter]) -> None:
        saved = load_file(str(folder / "trainable.safetensors"))
        if set(saved) != set(params):
            raise ConvertError(f"checkpoint {folder} holds other trained tensors than this run trains "
                               f"({len(saved)} vs {len(params)}); resume with the flags it was made with")
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved[n].to(p.device, p.dtype))

    def _resume_point(self) -> Path | None:
        a = self.args
        if a.resume_from_checkpoint is None:
            return None
        root = self.out / CHECKPOINTS
        if a.resume_from_checkpoint == "latest":
            found = [p for p in root.iterdir() if not p.name.startswith(".")] if root.is_dir() else []
            if not found:
                print(f"[convert] no checkpoint in {root}: starting from the beginning", file=sys.stderr)
                return None
            return max(found, key=lambda p: p.stat().st_mtime_ns)
        folder = Path(a.resume_from_checkpoint)
        if not (folder / "state.json").is_file():
            raise ConvertError(f"--resume_from_checkpoint {folder}: not a conversion checkpoint (no state.json)")
        return folder

    # ---------------------------------------------------------------- the whole run
    def run(self) -> dict[str, Any]:
        a = self.args
        resume = self._resume_point()
        resume_stage = None  # the stage whose steps the checkpoint is inside
        if resume is not None:
            state = json.loads((resume / "state.json").read_text())
            done = state.pop("stage_done", None)
            self.history = History(**state)
            if done is not None:
                self.history.stage, self.history.step = {"transfer": "finetune", "finetune": "done"}[done], 0
            else:
                resume_stage = self.history.stage
            print(f"[convert] resuming from {resume} ({self.history.stage}, step {self.history.step})",
                  file=sys.stderr)
        h = self.history
        h.peak_rss_mb.setdefault("load", _peak_rss_mb())
        self.evaluate("swapped")
        # a resume repeats the calibration (deterministic); the trained values loaded below then replace it
        self.calibrate()
        if h.calibration.get("calibrated"):
            self.evaluate("calibrated")
        self._teacher = self._record_teacher() if h.stage != "done" else None
        # rebuild what finished stages made (their trained tensors, merged again)
        if h.stage in ("finetune", "done") and a.transfer_steps and "skipped" not in h.transfer_check:
            self._rebuild("transfer", self.out / CHECKPOINTS / TRANSFER_DONE)
        if h.stage == "done" and a.finetune_steps:
            self._rebuild("finetune", resume)
        if h.stage == "transfer":
            if a.transfer_steps and resume_stage != "transfer" and (a.transfer_keep_best or a.transfer_skip_error):
                h.transfer_check = {"start": self._held_out_error()}
                if a.transfer_skip_error > 0 and h.transfer_check["start"] <= a.transfer_skip_error:
                    h.transfer_check["skipped"] = (f"the start's mean held-out layer error {h.transfer_check['start']}"
                                                   f" is within --transfer_skip_error {a.transfer_skip_error}")
                    if self.main:
                        print(f"[convert] stage 1 skipped: {h.transfer_check['skipped']}", file=sys.stderr)
            if a.transfer_steps and "skipped" not in h.transfer_check:
                self.run_stage("transfer", resume if resume_stage == "transfer" else None)
                self.evaluate("transfer")
            h.stage, h.step = "finetune", 0
        if h.stage == "finetune":
            if a.finetune_steps:
                self.run_stage("finetune", resume if resume_stage == "finetune" else None)
                self.evaluate("finetune")
            h.stage, h.step = "done", 0
        summary = self.summary()
        if self.main:
            if not a.no_save_model:
                final = self.out / "final"
                self.model.save_pretrained(final)
                self.tokenizer.save_pretrained(final)
            atomic_write(self.out / SUMMARY_FILE, json.dumps(summary, indent=1))
        self.accelerator.wait_for_everyone()
        return summary

    def summary(self) -> dict[str, Any]:
        a, h = self.args, self.history
        stages = [s for s, n in (("transfer", a.transfer_steps and "skipped" not in h.transfer_check),
                                 ("finetune", a.finetune_steps)) if n]
        tokens = a.block_size * a.per_device_train_batch_size * self.accelerator.num_processes
        return {
            "implementation": a.attn_implementation, "settings": a.settings, "model": a.model_name_or_path,
            "seed": a.seed, "stages": stages, "steps": {"transfer": a.transfer_steps, "finetune": a.finetune_steps},
            "tokens_per_step": tokens, "finetune_mode": a.finetune_mode, "perplexity": h.perplexity,
            "layer_errors": h.layer_errors, "losses": h.losses, "transfer_check": h.transfer_check,
            "distill": h.distill,
            "continuation": ({"ran": False, "why": a.continuation_note} if a.continuation_plan is None else
                             {"ran": "transfer" in stages, **a.continuation_plan.describe(),
                              "ramp_steps": a.continuation_plan.ramp_steps(a.transfer_steps)}),
            "eval_texts": {name: {"description": desc, "tokens": len(ids),
                                  "perplexity": h.perplexity_texts.get(name, {})}
                           for name, (desc, ids) in self.eval_texts.items()},
            "calibration": {**h.calibration, "perplexity": {k: h.perplexity[k] for k in ("swapped", "calibrated")
                                                            if k in h.perplexity}},
            "seconds": {k: round(v, 2) for k, v in h.seconds.items()},
            "peak_rss_mb": h.peak_rss_mb, "trained": h.trained, "processes": self.accelerator.num_processes,
            "torch_threads": torch.get_num_threads(), "args": recorded_args(a),
            "wall_seconds": round(time.perf_counter() - self._started, 1), "load_average_start": self._load_start,
            "load_average_end": round(os.getloadavg()[0], 2), "command": self.command,
            # CPU seconds of every thread: wall seconds on a shared machine say little alone
            "cpu_seconds": {**{k: round(v, 1) for k, v in h.cpu_seconds.items()}, "run": round(self._cpu_total(), 1)},
            "load_average_steps": ({"mean": round(h.load_steps[1] / h.load_steps[0], 2),
                                    "max": round(h.load_steps[2], 2), "steps": int(h.load_steps[0])}
                                   if h.load_steps[0] else None),
        }


def _progress(total: int, done: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, desc=desc, unit="step", disable=not enabled or total == 0,
                dynamic_ncols=True)


def run(argv: Sequence[str] | None = None, shown: Sequence[str] | None = None) -> dict[str, Any]:
    """Convert with the flags of ``scripts/convert.py`` (``--help``); returns the summary (conversion.json).
    ``shown``: the flags its recorded command names (default: ``argv``; the study records its runs' folders
    relative to its own). Raises ``ConvertError`` (a ValueError) on bad input, before training."""
    args = parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    shown = list(shown if shown is not None else sys.argv[1:] if argv is None else argv)
    return Converter(args, command="python scripts/convert.py " + shlex.join(shown)).run()


@offline_by_default()
def main(argv: Sequence[str] | None = None) -> int:
    """``scripts/convert.py`` and the console command ``hf-attnorm-convert``, offline by default: bad input ->
    ``convert.py: error: ...`` and exit code 2; Ctrl-C -> 130; else 0."""
    try:
        run(argv)
    except (ConvertError, TransferError, data_lib.DataError, AttnormError) as exc:
        print(f"convert.py: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("convert.py: interrupted", file=sys.stderr)
        return 130
    return 0

