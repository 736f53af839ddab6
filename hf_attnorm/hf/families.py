"""Facts about transformers' attention modules, in one table: which modules call the attention interface, their
head count, and what a model family is (causal LM or encoder). Model families differ only in these few facts.

Read by the state on modules (``state.py``) and by the lab (training, evaluation, diagnostics).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn

#: how each family's attention module exposes its head count (the other facts are common attributes)
MODULE_FACTS: dict[str, str] = {
    "GPT2Attention": "num_heads",
    "BertSelfAttention": "num_attention_heads",
    "BertCrossAttention": "num_attention_heads",
    "LlamaAttention": "config.num_attention_heads",
}


def attention_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Modules that call the attention interface: they carry ``config``, ``is_causal`` and ``scaling``."""
    for name, mod in model.named_modules():
        if type(mod).__name__ == "AttnormState":  # our own child module (state.py imports this one)
            continue
        if hasattr(mod, "config") and hasattr(mod, "is_causal") and hasattr(mod, "scaling") and not hasattr(
            mod, "post_init"
        ):
            yield name, mod


def num_heads_of(module: nn.Module) -> int:
    attr = MODULE_FACTS.get(type(module).__name__)
    if attr is not None:
        obj: Any = module
        for part in attr.split("."):
            obj = getattr(obj, part)
        return int(obj)
    for attr in ("num_heads", "num_attention_heads"):
        if isinstance(getattr(module, attr, None), int):
            return int(getattr(module, attr))
    return int(module.config.num_attention_heads)


def module_info(module: nn.Module) -> dict[str, Any]:
    cfg = module.config
    max_pos = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    return {"max_positions": max_pos, "family": type(module).__name__,
            "layer_idx": getattr(module, "layer_idx", None), "num_heads": num_heads_of(module),
            "head_dim": getattr(module, "head_dim", None) or getattr(module, "attention_head_size", None)}


