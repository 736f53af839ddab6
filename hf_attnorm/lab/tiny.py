"""A tiny Llama built from a config and a plain training loop (one process, a few threads): the unit of work of
the main job's sweep. Same seed = same initial weights and the same data stream for every normalizer, so runs
with the same seed are paired."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Dimensions of the tiny Llama (RoPE, no GQA)."""

    hidden: int = 64
    layers: int = 2
    heads: int = 2
    mlp: int = 128
    max_positions: int = 4096
    rope_theta: float = 10000.0
    tie_embeddings: bool = False


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """AdamW with linear warm-up then cosine decay to 10% of the peak; gradients clipped at ``clip``."""

    steps: int = 600
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.1
    clip: float = 1.0
    beta2: float = 0.999


def tiny_llama(implementation: str, options: dict[str, Any] | None, vocab_size: int, shape: ModelShape,
               seed: int, train_length: int | None = None):
    """A randomly initialised LlamaForCausalLM with hf_attnorm attention ``implementation`` (and attnorm
    ``options``); the base weights depend on ``seed`` only (the normalizer's own parameters, e.g. ssmax's s_h,
    are initialised to constants), so two implementations built with one seed start from the same weights.

    ``train_length``: the length the run trains at. Scales that need L_train (``log_train_n``, ``qwen_logn``, ...)
    get it as option ``train_length`` unless ``options`` set it: otherwise they would read the config's
    max_position_embeddings (``shape.max_positions``, sized for the longest test), not the length trained at."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_attnorm  # noqa: F401  (registers the implementations)
    from hf_attnorm.settings import option_names, resolve_settings

    options = dict(options or {})
    if train_length is not None and "train_length" not in options:
        settings = resolve_settings(implementation, options)
        if "train_length" in option_names(settings.normalizer, settings.scale):
            options["train_length"] = int(train_length)

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.heads,
                         intermediate_size=shape.mlp, max_position_embeddings=shape.max_positions,
                         rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
                         bos_token_id=None, eos_token_id=None, pad_token_id=None,
                         tie_word_embeddings=shape.tie_embeddings)
    if options:
        config.attnorm = {"implementation": implementation, **options}
    config._attn_implementation = implementation
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def masked_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits [B, L, V] against targets [B, L] (-100 = no loss at that position)."""
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             ignore_index=-100)


def train(model, batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]], cfg: TrainConfig,
          on_eval: Callable[[int], dict[str, float]] | None = None, eval_every: int = 0) -> dict[str, Any]:
    """Train ``model`` for ``cfg.steps`` steps; ``batches(step)`` returns (input_ids [B, L], targets [B, L]).
    ``on_eval(step)`` is called every ``eval_every`` steps and at the end; its results are collected.
    Returns the losses (every step), the evaluations, the wall time and the tokens seen. Raises on a non-finite
    loss (a diverged run is a failed run, not a number)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, cfg.beta2))
    losses: list[float] = []
    evals: list[dict[str, float]] = []
    tokens = 0
    started = time.perf_counter()
    eval_seconds = 0.0
    model.train()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = batches(step)
        loss = masked_loss(model(input_ids=x, use_cache=False).logits, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss became {float(loss)} at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        losses.append(float(loss.detach()))
        tokens += x.numel()
        done = step + 1
        if on_eval is not None and eval_every and (done % eval_every == 0 or done == cfg.steps):
            t0 = time.perf_counter()
            model.eval()
            with torch.inference_mode():
                evals.append({"step": done, **on_eval(done)})
            model.train()
            eval_seconds += time.perf_counter() - t0
    model.eval()
    seconds = time.perf_counter() - started - eval_seconds
    return {"losses": losses, "evals": evals, "train_seconds": seconds, "tokens": tokens,
            "tokens_per_second": tokens / seconds if seconds > 0 else math.nan}
