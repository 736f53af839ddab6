"""Synthetic probes where the attention normaliser matters, trained at length L and tested at 1x ... 16x L.

* **MQAR**, multi-query associative recall (Zoology, Arora et al. 2023), in the fused-pair form that learns on a
  CPU budget: each context token is one (key, value) pair, the sequence ends with ``num_queries`` query tokens, and
  the model must answer each query with the value its key was paired with. The queried keys are distinct and
  appear exactly once in the context; the other pairs are distractors whose keys come (with repeats) from the keys
  not queried. Longer tests keep the queries and add distractors, so a query has to pick one pair out of more.
* **Passkey** (needle retrieval): filler tokens with one needle token (one of ``num_values``) at a uniformly random
  depth; the last token is a query and the answer is the needle's value. Longer tests add filler.

Loss and accuracy are on the answer positions only. Token ids (MQAR, K keys, V values): pair (k, v) = k * V + v,
query k = K * V + k, answer v = K * V + K + v. Passkey (F fillers, V values): filler f = f, needle v = F + v,
query = F + V, answer v = F + V + 1 + v.

Train and test data come from disjoint random streams: training batches from ``torch.Generator`` seeded with
``train_seed(seed, step)``; each test set from a fixed seed of its own (``TEST_SEED_BASE`` + length), the same for
every run, so every normaliser and seed is scored on the same sequences.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

from ..tiny import ModelShape, TrainConfig, tiny_llama, train

#: test sets are drawn from seeds at or above this; training streams stay below it
TEST_SEED_BASE = 1_000_003
IGNORE = -100


def train_seed(seed: int, step: int) -> int:
    """The generator seed of training batch ``step`` of run ``seed`` (always < TEST_SEED_BASE)."""
    return (seed * 7919 + step) % TEST_SEED_BASE


@dataclasses.dataclass(frozen=True)
class MQAR:
    """Fused-pair multi-query associative recall. Needs ``num_queries`` <= ``num_keys`` - 1 (at least one key is
    left for the distractors) and sequences longer than the queries."""

    num_keys: int = 16
    num_values: int = 4
    num_queries: int = 8
    name: str = "mqar"

    def __post_init__(self) -> None:
        if self.num_keys < 2 or self.num_values < 2:
            raise ValueError(f"MQAR needs num_keys >= 2 and num_values >= 2, got {self.num_keys}, {self.num_values}")
        if not 1 <= self.num_queries < self.num_keys:
            raise ValueError(f"MQAR num_queries must be in [1, num_keys - 1] = [1, {self.num_keys - 1}], got "
                             f"{self.num_queries}")

    @property
    def vocab_size(self) -> int:
        return self.num_keys * self.num_values + self.num_keys + self.num_values

    @property
    def chance(self) -> float:
        return 1.0 / self.num_values

    def min_length(self) -> int:
        return 2 * self.num_queries

    def batch(self, length: int, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [B, length], targets [B, length]); targets are -100 except at the query positions."""
        K, V, Q = self.num_keys, self.num_values, self.num_queries
        if length < self.min_length():
            raise ValueError(f"MQAR length must be >= {self.min_length()} (2 x num_queries), got {length}")
        P = length - Q
        B = batch_size
        perm = torch.rand(B, K, generator=generator).argsort(-1)
        queried, others = perm[:, :Q], perm[:, Q:]  # [B, Q], [B, K - Q]
        values = torch.randint(0, V, (B, Q), generator=generator)
        # distractor keys from the keys not queried (repeats allowed), random values
        pick = torch.randint(0, K - Q, (B, P), generator=generator)
        keys = others.gather(1, pick)
        vals = torch.randint(0, V, (B, P), generator=generator)
        # the queried pairs go to Q distinct random context positions
        slots = torch.rand(B, P, generator=generator).argsort(-1)[:, :Q]
        keys.scatter_(1, slots, queried)
        vals.scatter_(1, slots, values)
        order = torch.rand(B, Q, generator=generator).argsort(-1)  # query order independent of context order
        q_keys, q_vals = queried.gather(1, order), values.gather(1, order)
        x = torch.cat([keys * V + vals, K * V + q_keys], 1)
        y = torch.full((B, length), IGNORE, dtype=torch.long)
        y[:, P:] = K * V + K + q_vals
        return x, y


@dataclasses.dataclass(frozen=True)
class Passkey:
    """One needle among filler tokens; the final query asks for its value."""

    num_fillers: int = 64
    num_values: int = 16
    name: str = "passkey"

    def __post_init__(self) -> None:
        if self.num_fillers < 1 or self.num_values < 2:
            raise ValueError(f"Passkey needs num_fillers >= 1 and num_values >= 2, got {self.num_fillers}, "
                             f"{self.num_values}")

    @property
    def vocab_size(self) -> int:
        return self.num_fillers + 2 * self.num_values + 1

    @property
    def chance(self) -> float:
        return 1.0 / self.num_values

    def min_length(self) -> int:
        return 2

    def batch(self, length: int, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [B, length], targets [B, length]); targets are -100 except at the last (query) position."""
        F, V = self.num_fillers, self.num_values
        if length < 2:
            raise ValueError(f"Passkey length must be >= 2, got {length}")
        B = batch_size
        x = torch.randint(0, F, (B, length), generator=generator)
        depth = torch.randint(0, length - 1, (B,), generator=generator)
        value = torch.randint(0, V, (B,), generator=generator)
        x[torch.arange(B), depth] = F + value
        x[:, -1] = F + V
        y = torch.full((B, length), IGNORE, dtype=torch.long)
        y[:, -1] = F + V + 1 + value
        return x, y


PROBES: dict[str, type] = {"mqar": MQAR, "passkey": Passkey}


def make_probe(name: str, **options: Any):
    if name not in PROBES:
        raise ValueError(f"unknown probe {name!r}; available: {', '.join(PROBES)}")
    return PROBES[name](**options)


def make_test_set(probe, length: int, num: int, batch_size: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed test set of ``probe`` at ``length``: ``num`` sequences in batches, from seed TEST_SEED_BASE +
    length (independent of any training seed)."""
    g = torch.Generator().manual_seed(TEST_SEED_BASE + length)
    out = []
    for start in range(0, num, batch_size):
        out.append(probe.batch(length, min(batch_size, num - start), g))
    return out


#: at most this many tokens per forward pass when scoring (long test sequences go through in smaller groups: the
#: attention maps of 64 sequences at 16x L are memory-bound, 16 at a time were about 20% faster)
EVAL_TOKENS = 16384


def accuracy(model, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Fraction of answer positions (targets != -100) where the argmax of the logits is the target."""
    hit = total = 0
    with torch.inference_mode():
        for xs, ys in batches:
            group = max(1, EVAL_TOKENS // xs.shape[1])
            for x, y in zip(xs.split(group), ys.split(group)):
                logits = model(input_ids=x, use_cache=False).logits
                sel = y != IGNORE
                hit += int((logits[sel].argmax(-1) == y[sel]).sum())
                total += int(sel.sum())
    return hit / total


def run_probe(task: str, implementation: str, options: dict[str, Any], seed: int, settings: dict[str, Any],
              run_dir: Path | None = None) -> dict[str, Any]:
    """Train one probe model at ``settings["length"]`` and test it at each of ``settings["factors"]`` x length.

    settings: length, factors, steps, batch_size, lr, warmup, test_sequences, shape (ModelShape fields),
    probe (the probe's own options). Returns accuracies per test length (and the training curve)."""
    probe = make_probe(task, **settings.get("probe", {}))
    L = int(settings["length"])
    shape = ModelShape(**settings.get("shape", {}))
    cfg = TrainConfig(steps=settings["steps"], batch_size=settings["batch_size"], lr=settings["lr"],
                      warmup=settings["warmup"])
    lengths = [int(round(f * L)) for f in settings["factors"]]
    if max(lengths) > shape.max_positions:
        raise ValueError(f"test length {max(lengths)} exceeds max_positions {shape.max_positions}")
    model = tiny_llama(implementation, options, probe.vocab_size, shape, seed, train_length=L)

    def batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return probe.batch(L, cfg.batch_size, torch.Generator().manual_seed(train_seed(seed, step)))

    train_acc_set = make_test_set(probe, L, min(256, settings["test_sequences"]))
    log = train(model, batches, cfg, on_eval=lambda s: {"accuracy": accuracy(model, train_acc_set)},
                eval_every=settings.get("eval_every") or max(1, cfg.steps // 4))
    t0 = time.perf_counter()
    acc = {str(n): accuracy(model, make_test_set(probe, n, settings["test_sequences"])) for n in lengths}
    eval_seconds = time.perf_counter() - t0
    if run_dir is not None:
        model.save_pretrained(run_dir / "model")
    losses = log["losses"]
    return {"accuracy": acc, "lengths": lengths, "train_length": L, "chance": probe.chance,
            "final_train_loss": sum(losses[-20:]) / len(losses[-20:]), "curve": log["evals"],
            "train_seconds": log["train_seconds"], "eval_seconds": eval_seconds,
            "tokens_per_second": log["tokens_per_second"], "parameters": sum(p.numel() for p in model.parameters()),
            "learned": learned_values(model)}


def learned_values(model) -> dict[str, list[float]]:
    """The normaliser's own learned parameters (e.g. ssmax s_h, sink logits), by name."""
    return {n: [round(float(v), 5) for v in p.detach().reshape(-1)]
            for n, p in model.named_parameters() if ".attnorm." in n}


