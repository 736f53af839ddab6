"""A training run: setup (``run``), the loop over optimizer steps (``Loop.train``), and the summary.

A resumed run continues with the next batch of the same data order and the same random numbers: its losses equal
an uninterrupted run's (tests/test_training.py kills a run and checks this).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import datasets
import torch
import torch.nn.functional as F
import transformers
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.logging import get_logger
from accelerate.utils import ProjectConfiguration, set_seed
from tqdm.auto import tqdm
from transformers import get_scheduler

from ...hf.distributed import logical_numel, logical_shape
from ...registry import canonical
from .. import data as data_lib
from ..cards import write_model_card
from . import checkpoints as ckpt
from .args import TrainingArguments, TrainingError
from .setup import DataSetup, ModelSetup, build_data, build_model
from .trackers import build_trackers

logger = get_logger(__name__)


# ------------------------------------------------------------------------------------------------ evaluation


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


def perplexity(loss: float | None) -> float | None:
    if loss is None:
        return None
    return math.exp(loss) if loss < 700 else float("inf")


# ------------------------------------------------------------------------------------------------------ loop


@dataclasses.dataclass
class Progress:
    """Where the run is: optimizer steps done, epoch, micro-batches of it consumed, and the history that
    ``trainer_state.json`` keeps (losses, tokens, seconds)."""

    step: int = 0
    epoch: int = 0
    batches_done: int = 0
    history: dict[str, Any] = dataclasses.field(default_factory=lambda: {
        "train_losses": [], "val_losses": [], "tokens": 0, "train_seconds": 0.0, "seconds": 0.0})

    @classmethod
    def from_state(cls, state: Mapping[str, Any], batches_per_epoch: int) -> Progress:
        p = cls(int(state["step"]), int(state["epoch"]), int(state["batches_in_epoch"]))
        p.history = {k: state[k] for k in p.history}
        if p.batches_done >= batches_per_epoch:
            p.epoch, p.batches_done = p.epoch + 1, 0
        return p


@dataclasses.dataclass
class Loop:
    """The prepared objects of a run and the loop over them."""

    args: TrainingArguments
    accelerator: Accelerator
    setup: ModelSetup
    data: DataSetup
    model: torch.nn.Module  # prepared (wrapped) by accelerate
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_dl: Any
    eval_dl: Any
    max_steps: int
    num_epochs: int
    output_dir: Path
    progress: Progress
    bar: Any = None

    def train(self) -> None:
        """Optimizer steps until ``max_steps`` (or the epochs) are done; evaluates and checkpoints on schedule."""
        p, acc = self.progress, self.accelerator
        seconds_before, loop_start = p.history["seconds"], time.time()
        losses: list[torch.Tensor] = []
        tokens = 0
        self.model.train()
        t_step = time.perf_counter()
        while p.step < self.max_steps and p.epoch < self.num_epochs:
            for batch in self._batches_of_epoch():
                loss, n = self._micro_step(batch)
                p.batches_done += 1
                losses.append(loss)
                tokens += n
                if not acc.sync_gradients:
                    continue  # accumulating: the optimizer step is not complete yet
                self._record_step(losses, tokens, time.perf_counter() - t_step)
                losses, tokens = [], 0
                epoch_end = p.batches_done >= len(self.train_dl)  # counts the skipped batches of a resume too
                last = p.step >= self.max_steps
                if (self.args.eval_steps and p.step % self.args.eval_steps == 0) or last or (
                        epoch_end and not self.args.eval_steps):
                    self.evaluate()
                every = self.args.checkpoint_every
                if (every and p.step % every == 0) or (self.args.checkpointing_steps == "epoch" and epoch_end):
                    p.history["seconds"] = seconds_before + time.time() - loop_start
                    self.checkpoint()
                t_step = time.perf_counter()
                if last:
                    break
            p.epoch, p.batches_done = p.epoch + 1, 0
        p.history["seconds"] = seconds_before + time.time() - loop_start

    def _batches_of_epoch(self):
        p = self.progress
        self.train_dl.set_epoch(p.epoch)
        if not p.batches_done:
            return self.train_dl
        loader = self.accelerator.skip_first_batches(self.train_dl, p.batches_done)  # resuming mid-epoch
        loader.set_epoch(p.epoch)
        return loader

    def _micro_step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """Forward and backward of one micro-batch; the optimizer steps when accelerate syncs the gradients."""
        acc, a = self.accelerator, self.args
        with acc.accumulate(self.model):
            if self.data.masker is not None:
                batch = self.data.masker(batch)
            else:
                batch = {"input_ids": batch["input_ids"], "labels": batch["input_ids"]}
            extra = {"use_cache": False} if self.data.masker is None else {}
            loss = self.model(**batch, **extra).loss
            acc.backward(loss)
            if acc.sync_gradients and a.max_grad_norm > 0:
                acc.clip_grad_norm_(self.model.parameters(), a.max_grad_norm)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()
        return loss.detach(), batch["input_ids"].numel()

    def _record_step(self, losses: list[torch.Tensor], tokens: int, seconds: float) -> None:
        """A complete optimizer step: its loss (mean over micro-batches and ranks) into the history and trackers;
        a non-finite loss stops the run."""
        p, acc = self.progress, self.accelerator
        stats = torch.stack([torch.stack(losses).float().mean(), torch.tensor(float(tokens))]).unsqueeze(0)
        stats = acc.gather(stats)
        step_loss, step_tokens = float(stats[:, 0].mean()), int(stats[:, 1].sum())
        p.step += 1
        if not math.isfinite(step_loss):
            raise TrainingError(
                f"training diverged: the loss is {step_loss} at step {p.step} (attention {self.setup.settings}); "
                "lower --learning_rate or raise --num_warmup_steps. Nothing more is written; last complete "
                f"checkpoint: {ckpt.latest_checkpoint(self.output_dir) or 'none'}")
        h = p.history
        h["train_seconds"] += seconds
        h["tokens"] += step_tokens
        h["train_losses"].append([p.step, step_loss])
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{h['tokens'] / max(h['train_seconds'], 1e-9):,.0f}",
                             refresh=False)
        if self.args.with_tracking:
            acc.log({"train_loss": step_loss, "learning_rate": self.scheduler.get_last_lr()[0],
                     "tokens_per_second": step_tokens / max(seconds, 1e-9)}, step=p.step)

    def evaluate(self) -> float:
        step = self.progress.step
        val_loss, _ = evaluate_loss(self.model, self.eval_dl, self.accelerator,
                                    masked_lm=self.data.masker is not None)
        self.progress.history["val_losses"].append([step, val_loss])
        if self.args.with_tracking:
            self.accelerator.log({"val_loss": val_loss, "val_perplexity": perplexity(val_loss)}, step=step)
        self.bar.write(f"step {step}: validation loss {val_loss:.4f}, perplexity {perplexity(val_loss):.2f}")
        return val_loss

    def checkpoint(self) -> Path:
        p = self.progress
        state = {"step": p.step, "epoch": p.epoch, "batches_in_epoch": p.batches_done,
                 "args": {**self.args.as_dict(), "num_processes": self.accelerator.num_processes},
                 "attnorm": self.setup.settings, **p.history}
        return ckpt.save_checkpoint(self.accelerator, self.output_dir, self.setup.tokenizer, state,
                                    self.args.checkpoints_total_limit)


# ------------------------------------------------------------------------------------------------------- run


def _configure_logging(main: bool) -> None:
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%H:%M:%S",
                        level=logging.INFO)
    if main:
        datasets.utils.logging.set_verbosity_warning()
        transformers.utils.logging.set_verbosity_warning()
    else:
        datasets.utils.logging.set_verbosity_error()
        datasets.disable_progress_bars()
        transformers.utils.logging.set_verbosity_error()


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only (nanoGPT's rule): biases, norm weights and attnorm per-head values get none.
    Decided on the real shape, also under DeepSpeed ZeRO-3 (partitioned parameters have shape (0,))."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if len(logical_shape(p)) >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _unique_params(model: torch.nn.Module) -> int:
    """Parameter count; real sizes also under DeepSpeed ZeRO-3, whose partitioned parameters have shape (0,)."""
    return sum(logical_numel(p) for p in {id(p): p for p in model.parameters()}.values())


def _prepare(args: TrainingArguments, accelerator: Accelerator, setup: ModelSetup, data: DataSetup,
             plan: ckpt.OutputPlan) -> Loop:
    """Data loaders, AdamW and the schedule, prepared by accelerate; the resumed state or a fresh seed."""
    train_dl = torch.utils.data.DataLoader(
        data.train, sampler=data_lib.EpochShuffleSampler(len(data.train), args.seed),
        batch_size=args.per_device_train_batch_size, drop_last=True, collate_fn=data_lib.collate_blocks,
        generator=torch.Generator().manual_seed(args.seed))
    eval_dl = torch.utils.data.DataLoader(data.eval, batch_size=args.per_device_eval_batch_size,
                                          collate_fn=data_lib.collate_blocks)
    if len(train_dl) // accelerator.num_processes == 0:
        raise TrainingError(f"{len(data.train)} training blocks make no full batch of "
                            f"{args.per_device_train_batch_size} x {accelerator.num_processes} process(es)")
    model = setup.model
    # fused AdamW: one kernel per step on CPU and CUDA (deterministic, like the default loop)
    fused = accelerator.device.type in ("cpu", "cuda") and all(p.dtype == torch.float32 for p in model.parameters())
    optimizer = torch.optim.AdamW(_param_groups(model, args.weight_decay), lr=args.learning_rate,
                                  betas=(0.9, args.adam_beta2), fused=fused or None)
    model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
    steps_per_epoch = math.ceil(len(train_dl) / args.gradient_accumulation_steps)
    max_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    # accelerate steps a prepared scheduler once per process per optimizer step (run_clm_no_trainer does this)
    scheduler = accelerator.prepare(get_scheduler(
        args.lr_scheduler_type, optimizer, num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=max_steps * accelerator.num_processes))
    ckpt.register_checkpoint_hooks(accelerator)
    if plan.resume_state is not None:
        accelerator.load_state(str(plan.resume_dir))  # weights (our hook), optimizer, scheduler, RNG states
        progress = Progress.from_state(plan.resume_state, len(train_dl))
        logger.info(f"resumed from {plan.resume_dir}: step {progress.step}, epoch {progress.epoch}, "
                    f"{progress.batches_done} micro-batches of it done")
    else:
        set_seed(args.seed, device_specific=True)  # dropout / masking streams differ per rank
        progress = Progress()
    return Loop(args, accelerator, setup, data, model, optimizer, scheduler, train_dl, eval_dl, max_steps,
                math.ceil(max_steps / steps_per_epoch), plan.output_dir, progress)


def _hparams(args: TrainingArguments, loop: Loop) -> dict[str, Any]:
    acc, s = loop.accelerator, loop.setup
    d = {k: v for k, v in args.as_dict().items() if k != "list"}
    d.update(num_processes=acc.num_processes, max_train_steps_resolved=loop.max_steps, kind=args.kind,
             model_type_resolved=s.model_type, task_resolved=s.task,
             attnorm=json.dumps(s.settings) if s.settings else None,
             distributed_type=str(acc.distributed_type), mixed_precision=acc.mixed_precision)
    return d


def run(args: TrainingArguments) -> dict[str, Any]:
    """One training run of ``scripts/pretrain.py`` / ``scripts/finetune.py``; returns the summary."""
    t_setup = time.time()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    args.validate()
    plan = ckpt.plan_output(args)  # may we write there, what do we resume: decided before anything is built
    run_name = args.model_card_name or plan.output_dir.resolve().name
    accelerator = _start_accelerator(args, plan, run_name)
    setup = build_model(args, plan.saved_settings, plan.resume_dir)
    if plan.clear and accelerator.is_main_process:
        removed = ckpt.clear_run(plan.output_dir)
        other = [p.name for p in plan.output_dir.iterdir()]
        logger.info(f"--overwrite_output_dir: removed {removed or 'nothing'} from {plan.output_dir}"
                    + (f"; left other files {other}" if other else ""))
    accelerator.wait_for_everyone()
    data = build_data(args, setup.tokenizer, setup.task, accelerator)
    loop = _prepare(args, accelerator, setup, data, plan)
    n_params = _record_start(args, loop, run_name, time.time() - t_setup)
    _train(args, loop, run_name)
    summary = make_summary(args, loop, n_params)

    def write_card_and_summary() -> None:  # main process, after the model files: the summary marks completion
        card = write_model_card(plan.output_dir, summary, card_dir=args.card_dir, name=args.model_card_name)
        summary["model_card"] = str(card)
        ckpt.write_json(plan.output_dir / ckpt.SUMMARY_FILE, summary)

    ckpt.save_final(accelerator, loop.model, setup.tokenizer, plan.output_dir, write_card_and_summary)
    if args.with_tracking:
        accelerator.end_training()
    if accelerator.is_main_process:
        print(format_summary(summary), flush=True)
    accelerator.wait_for_everyone()
    return summary


def _start_accelerator(args: TrainingArguments, plan: ckpt.OutputPlan, run_name: str) -> Accelerator:
    """The accelerator (with the trackers of ``--with_tracking``) and logging; a resume must have the process
    count of its checkpoint."""
    logging_dir = Path(args.logging_dir) if args.logging_dir else plan.output_dir / "runs"
    trackers = build_trackers(args.report_to, run_name, logging_dir, plan.resume_step) if args.with_tracking else None
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps, log_with=trackers,
        project_config=ProjectConfiguration(project_dir=str(plan.output_dir), logging_dir=str(logging_dir)),
        dataloader_config=DataLoaderConfiguration(even_batches=True))
    _configure_logging(accelerator.is_local_main_process)
    if plan.resume_state is not None:
        saved_procs = plan.resume_state.get("args", {}).get("num_processes")
        if saved_procs is not None and saved_procs != accelerator.num_processes:
            raise TrainingError(f"{plan.resume_dir} was written by {saved_procs} process(es), this run has "
                                f"{accelerator.num_processes}: the data position would not match")
    elif args.resume_from_checkpoint == "latest":
        logger.warning(f"--resume_from_checkpoint latest: no checkpoint in {plan.output_dir}; starting fresh")
    return accelerator


def _record_start(args: TrainingArguments, loop: Loop, run_name: str, setup_seconds: float) -> int:
    """Write ``training_args.json``, start the trackers, log what is trained; returns the parameter count."""
    acc, setup, data = loop.accelerator, loop.setup, loop.data
    hparams = _hparams(args, loop)
    if acc.is_main_process:
        loop.output_dir.mkdir(parents=True, exist_ok=True)
        ckpt.write_json(loop.output_dir / ckpt.ARGS_FILE, hparams)
    if args.with_tracking:
        scalars = {k: v for k, v in hparams.items() if isinstance(v, int | float | str | bool)}
        acc.init_trackers(run_name, config=scalars)
    n_params = _unique_params(setup.model)
    total_batch = args.per_device_train_batch_size * acc.num_processes * args.gradient_accumulation_steps
    logger.info(f"{setup.model_type} ({setup.task}), {n_params / 1e6:.2f}M parameters, attention "
                f"{setup.settings or 'the model default (' + str(setup.model.config._attn_implementation) + ')'}; "
                f"{len(data.train)} training blocks of {args.block_size} ({data.description}); "
                f"{loop.max_steps} steps of {total_batch} blocks ({acc.num_processes} process(es)); "
                f"setup {setup_seconds:.1f} s")
    return n_params


def _train(args: TrainingArguments, loop: Loop, run_name: str) -> None:
    """``loop.train()`` under a progress bar; Ctrl-C names the last complete checkpoint and re-raises."""
    loop.bar = tqdm(total=loop.max_steps, initial=loop.progress.step, desc=f"{args.kind} {run_name}", unit="step",
                    disable=not loop.accelerator.is_local_main_process or _env_flag("TQDM_DISABLE"),
                    mininterval=0.5, dynamic_ncols=True)
    try:
        loop.train()
    except KeyboardInterrupt:
        last = ckpt.latest_checkpoint(loop.output_dir)
        logger.warning(f"interrupted at step {loop.progress.step}; nothing more is written. Last complete "
                       f"checkpoint: {last or 'none'}" + (" (resume with --resume_from_checkpoint latest)"
                                                          if last else ""))
        if args.with_tracking:
            loop.accelerator.end_training()
        raise
    finally:
        loop.bar.close()


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


# --------------------------------------------------------------------------------------------------- summary


def make_summary(args: TrainingArguments, loop: Loop, n_params: int) -> dict[str, Any]:
    acc, s, h = loop.accelerator, loop.setup, loop.progress.history
    val = h["val_losses"][-1][1] if h["val_losses"] else None
    recent = [loss for _, loss in h["train_losses"][-10:]]
    return {
        "kind": args.kind,
        "output_dir": str(loop.output_dir.resolve()),
        "model_type": s.model_type,
        "task": s.task,
        "parameters": n_params,
        "attnorm": s.settings,
        "attn_implementation": canonical(acc.unwrap_model(loop.model).config._attn_implementation),
        "block_size": args.block_size,
        "dataset": loop.data.description,
        "train_blocks": len(loop.data.train),
        "eval_blocks": len(loop.data.eval),
        "steps": loop.progress.step,
        "num_processes": acc.num_processes,
        "total_batch_size": args.per_device_train_batch_size * acc.num_processes * args.gradient_accumulation_steps,
        "seconds": round(h["seconds"], 3),
        "train_seconds": round(h["train_seconds"], 3),
        "tokens": h["tokens"],
        "tokens_per_second": h["tokens"] / max(h["train_seconds"], 1e-9),
        "train_losses": h["train_losses"],
        "val_losses": h["val_losses"],
        "final_train_loss": sum(recent) / len(recent) if recent else None,
        "final_val_loss": val,
        "final_val_perplexity": perplexity(val),
        "hyperparameters": {k: getattr(args, k) for k in (
            "learning_rate", "weight_decay", "adam_beta2", "max_grad_norm", "per_device_train_batch_size",
            "gradient_accumulation_steps", "lr_scheduler_type", "num_warmup_steps", "seed", "mlm_probability")},
        "source": s.source,
        "model_card": None,
    }


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
