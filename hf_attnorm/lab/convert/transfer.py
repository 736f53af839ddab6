"""Attention transfer (stage 1 of ``scripts/convert.py``; LoLCATs, Zhang et al., arXiv 2410.10254; Hedgehog, Zhang et
al., arXiv 2402.04347): an observer (``lab/observe.py``) put on every hf_attnorm attention module of a model that, in
each attention call, computes the module's own softmax attention on the same q, k, v (its mask, scaling, softcap, sinks
and position bias included) as the teacher, measures the new normalizer's output against it, and hands the teacher's
output to the next layer, so every layer sees the original model's inputs.

``transfer_errors`` runs one pass and returns the per-layer relative errors (with the graph, for training); with
LoRA on q/k the teacher outputs are first recorded with the adapters off (one model, no second copy).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ...hf.forward import softmax_attention
from .. import observe


class TransferError(ValueError):
    """A model whose attention calls do not go through hf_attnorm (nothing to transfer)."""


def _teacher(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: object,
             scaling: float | None, kwargs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return softmax_attention(module, query, key, value, attention_mask, scaling, kwargs)


class Transfer:
    """The observer put on every attention module for attention transfer.

    ``mode``: ``"record"`` keeps the teacher outputs of one pass (and gives them to the next layer); ``"student"``
    computes the new normalizer's output, records its error against the recorded teacher output (or, with none
    recorded, the teacher computed on the same q, k, v) and gives the teacher output to the next layer."""

    def __init__(self) -> None:
        self.mode = "student"
        self.teacher: list[torch.Tensor] = []
        #: per layer: mean squared error / mean squared teacher output, per sequence, averaged over the batch
        self.errors: list[torch.Tensor] = []
        self.calls = 0

    def reset(self, mode: str) -> None:
        self.mode, self.calls, self.errors = mode, 0, []
        if mode == "record":
            self.teacher = []

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: object, scaling: float | None, kwargs: dict[str, Any],
                 student: Callable[[], tuple[torch.Tensor, Any]]) -> tuple[torch.Tensor, None]:
        if self.mode == "record":
            target = _teacher(module, query, key, value, attention_mask, scaling, kwargs)
            self.teacher.append(target)
            return target, None
        if self.teacher:
            target = self.teacher[self.calls]
        else:
            target = _teacher(module, query, key, value, attention_mask, scaling, kwargs)
        self.calls += 1
        out = student()[0].float()
        reference = target.float()
        # per sequence, then the batch mean: B processes x 1 sequence give the loss of 1 process x B sequences
        per_sequence = (out - reference).pow(2).flatten(1).mean(1) / reference.pow(2).flatten(1).mean(1).clamp_min(
            1e-12)
        self.errors.append(per_sequence.mean())
        return target, None


def install_observer(model: nn.Module, observer: Transfer | None) -> int:
    """Put ``observer`` on (None: take it off) every hf_attnorm attention module of ``model`` (``lab/observe.py``);
    returns how many."""
    return observe.observe_model(model, observer)


@contextlib.contextmanager
def observing(model: nn.Module, observer: Transfer | None) -> Iterator[Transfer | None]:
    """``observer`` on every attention module of ``model`` for the block, taken off after it (also on an error)."""
    with observe.observing(model, observer):
        yield observer


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM (``model.model`` for Llama), under a peft wrapper too: the transfer stage
    does not run the LM head."""
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return hf_model.base_model


def transfer_errors(model: nn.Module, transfer: Transfer, ids: torch.Tensor, lora: bool,
                    teacher: list[torch.Tensor] | None = None) -> torch.Tensor:
    """One transfer pass on ids [B, L]: the per-layer relative errors [layers] (with the graph, for training).

    teacher: recorded outputs of the original model for these ids (then they are the targets); else, with
    ``lora`` the teacher is recorded now with the adapters off, without it computed inline from the same q, k, v."""
    decoder = decoder_of(model)
    transfer.teacher = teacher or []
    if teacher is None and lora:
        transfer.reset("record")
        with torch.no_grad(), model.disable_adapter():
            decoder(input_ids=ids, use_cache=False)
    transfer.reset("student")
    decoder(input_ids=ids, use_cache=False)
    if not transfer.errors:
        raise TransferError("no attention call went through hf_attnorm during attention transfer; the model's "
                           "attention modules do not call transformers' attention interface")
    return torch.stack(transfer.errors)
