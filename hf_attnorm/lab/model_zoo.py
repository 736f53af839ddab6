"""Randomly initialised GPT-2, BERT and Llama models of a few sizes (tests, pretraining from scratch).

The facts that differ between families live in ``FAMILIES``: config class, model classes, and how the config
names its dimensions. Sizes are presets of (hidden, layers, heads, kv heads, mlp).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

from ..hf.families import CAUSAL_LM, lm_task


@dataclasses.dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int


SIZES: dict[str, Size] = {
    "micro": Size(32, 2, 4, 2, 64),  # unit tests: a forward pass in milliseconds
    "tiny": Size(128, 4, 4, 2, 384),  # trains in minutes on 2 CPU cores
    "small": Size(256, 6, 8, 4, 768),
    "base": Size(768, 12, 12, 4, 3072),
}


def _gpt2(s: Size, vocab: int, positions: int) -> GPT2Config:
    return GPT2Config(vocab_size=vocab, n_embd=s.hidden, n_layer=s.layers, n_head=s.heads, n_inner=s.mlp,
                      n_positions=positions, bos_token_id=None, eos_token_id=None)


def _bert(s: Size, vocab: int, positions: int) -> BertConfig:
    return BertConfig(vocab_size=vocab, hidden_size=s.hidden, num_hidden_layers=s.layers,
                      num_attention_heads=s.heads, intermediate_size=s.mlp, max_position_embeddings=positions)


def _llama(s: Size, vocab: int, positions: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=s.hidden, num_hidden_layers=s.layers,
                       num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, intermediate_size=s.mlp,
                       max_position_embeddings=positions, bos_token_id=None, eos_token_id=None,
                       pad_token_id=None, tie_word_embeddings=True)


#: family -> (config builder, {task: model class}); whether a family is causal is hf.families' answer
FAMILIES: dict[str, tuple[Any, dict[str, type[PreTrainedModel]]]] = {
    "gpt2": (_gpt2, {"causal_lm": GPT2LMHeadModel}),
    "bert": (_bert, {"masked_lm": BertForMaskedLM, "encoder": BertModel}),
    "llama": (_llama, {"causal_lm": LlamaForCausalLM}),
}


def make_config(family: str, size: str | Size = "micro", vocab_size: int = 128,
                max_positions: int = 128) -> PretrainedConfig:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; available: {', '.join(FAMILIES)}")
    if isinstance(size, str):
        if size not in SIZES:
            raise ValueError(f"unknown size preset {size!r}; available: {', '.join(SIZES)}")
        size = SIZES[size]
    return FAMILIES[family][0](size, vocab_size, max_positions)


def build_model(family: str, size: str | Size = "micro", *, task: str | None = None, vocab_size: int = 128,
                max_positions: int = 128, attn_implementation: str = "softmax",
                attnorm: dict[str, Any] | None = None, seed: int | None = 0) -> PreTrainedModel:
    """A randomly initialised model; ``task`` defaults to the family's LM head (causal_lm or masked_lm)."""
    config = make_config(family, size, vocab_size, max_positions)
    classes = FAMILIES[family][1]
    task = task or next(iter(classes))
    if task not in classes:
        raise ValueError(f"family {family!r} has tasks {list(classes)}, not {task!r}")
    if attnorm is not None:
        config.attnorm = {"implementation": attn_implementation, **attnorm}
    config._attn_implementation = attn_implementation
    if seed is not None:
        torch.manual_seed(seed)
    return classes[task](config)


def is_causal_family(family: str) -> bool:
    """Whether the preset family's models are causal (``hf_attnorm.hf.families.lm_task`` of its config)."""
    return lm_task(make_config(family)) == CAUSAL_LM
