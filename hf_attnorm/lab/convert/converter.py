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
import json
import math
import os
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from ...fileio import atomic_write
from ...hf.integration import apply as apply_implementation
from ...registry import AttnormError
from .. import data as data_lib
from ..cli import offline_by_default
from ..evaluation.perplexity import EvaluationError, causal_lm_perplexity, spread_chunks
from . import calibration as calibration_lib
from . import distill as distill_lib
from . import loading
from .args import (  # noqa: F401  (build_parser, parse_token_counts: the study's flags read them here)
    EVAL_POINTS,
    FINETUNE_LR,
    STAGES,
    ConvertError,
    build_parser,
    parse_args,
    parse_token_counts,
    recorded_args,
)
from .checkpoints import (
    CHECKPOINTS,
    SUMMARY_FILE,
    TRANSFER_BEST,
    TRANSFER_DONE,
    History,
    load_trainable,
    peak_rss_mb,
    reset_peak_rss,
    resume_point,
    save_checkpoint,
    save_trainable,
)
from .continuation import ContinuationPlan
from .transfer import (  # noqa: F401  (Transfer, install_observer: part of this module's interface)
    Transfer,
    TransferError,
    decoder_of,
    install_observer,
    observing,
    transfer_errors,
)


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
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available())
        self.main = self.accelerator.is_main_process
        self.history = History()
        self.out = loading.prepare_output(args, self.accelerator)
        self.model, self.tokenizer = loading.load_model(args, self.accelerator.device)
        self.train_blocks, self.validation_stream = loading.load_data(args, self.tokenizer, self.accelerator)
        #: --eval_texts: name -> (description, token ids [N])
        self.eval_texts = loading.load_eval_texts(args, self.tokenizer)
        self.error_ids = loading.error_blocks(args, self.validation_stream)
        #: the original model's attention outputs on the error blocks, recorded before anything is trained
        self._reference = self._record_reference()
        self._teacher: list[distill_lib.TeacherTopK] | None = None  # (--distill: set by run)
        #: (implementation, options) a continuation last set (None: the asked ones, as loaded)
        self._continuation_at: tuple[str, dict[str, Any]] | None = None

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
            reset_peak_rss()
            ppl = self._perplexities(model, self.validation_stream)
            for text, (_, ids) in self.eval_texts.items():
                self.history.perplexity_texts.setdefault(text, {})[name] = self._perplexities(model, ids)
            self.history.perplexity[name] = ppl
            self.history.layer_errors[name] = self.layer_errors()
            self.history.peak_rss_mb[f"evaluation {name}"] = peak_rss_mb()
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
            save_trainable(self.out / CHECKPOINTS / TRANSFER_BEST, params)
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
        load_trainable(folder, self._trainable())
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
            load_trainable(resume, params)
            optimizer.load_state_dict(torch.load(resume / "optimizer.pt", map_location=acc.device))
        keep_best = stage == "transfer" and a.transfer_keep_best
        plan: ContinuationPlan | None = a.continuation_plan if stage == "transfer" else None
        if keep_best and resume is None:  # the start is the first candidate (LoRA at zero: the start's model)
            h.transfer_check.update(measured=[], best=h.transfer_check["start"], best_step=0)
            self._save_best(params)
        self.model.train()
        reset_peak_rss()
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
            load_trainable(self.out / CHECKPOINTS / TRANSFER_BEST, params)
            if self.main:
                print(f"[convert] stage 1 ends at its best held-out state, step {h.transfer_check['best_step']} "
                      f"(mean layer error {h.transfer_check['best']:.4g}; the last step's "
                      f"{h.transfer_check['measured'][-1][1]:.4g})", file=sys.stderr)
        h.seconds[stage] += time.perf_counter() - start
        h.cpu_seconds[stage] += time.process_time() - cpu
        h.peak_rss_mb[stage] = max(h.peak_rss_mb.get(stage, 0.0), peak_rss_mb())
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
        """The newest resumable state of the run (``checkpoints.save_checkpoint``)."""
        save_checkpoint(self.out, self.history, params, optimizer, self.accelerator, self._cpu_total(), stage_done)

    def _cpu_total(self) -> float:
        """CPU seconds of the whole run so far: this process's since it started, plus earlier processes' (resumed)."""
        return self.history.cpu_before + time.process_time() - self._cpu_started

    # ---------------------------------------------------------------- the whole run
    def run(self) -> dict[str, Any]:
        a = self.args
        resume = resume_point(self.args, self.out)
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
        h.peak_rss_mb.setdefault("load", peak_rss_mb())
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
            "cpu_seconds": {**{k: round(v, 3) for k, v in h.cpu_seconds.items()}, "run": round(self._cpu_total(), 3)},
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

