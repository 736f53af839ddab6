"""Facts about transformers' attention modules, in one table: which modules call the attention interface, their
head count, and what a model family is (causal LM or encoder: ``lm_task``, ``model_task``, ``is_causal``). Model
families differ only in these few facts.

Read by the state on modules (``state.py``) and by the lab (training, evaluation, diagnostics, scale analysis).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn
from transformers import PretrainedConfig
from transformers.models.auto import modeling_auto

#: the language-modelling objectives, named as training's ``--task``
CAUSAL_LM, MASKED_LM = "causal_lm", "masked_lm"

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




def _head_classes(task: str) -> set[str]:
    table = (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if task == CAUSAL_LM
             else modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
    return set(table.values())


def model_task(model: nn.Module) -> str | None:
    """``"causal_lm"`` or ``"masked_lm"`` when ``model`` is a language-modelling head class of transformers'
    auto tables (``LlamaForCausalLM``, ``BertForMaskedLM``), None for anything else (e.g. ``BertModel``)."""
    name = type(model).__name__
    for task in (CAUSAL_LM, MASKED_LM):
        if name in _head_classes(task):
            return task
    return None


def lm_task(config: PretrainedConfig) -> str | None:
    """The objective a checkpoint's config was built for: its ``architectures`` (an LM head class) first, else the
    family: an encoder-only family with a masked-LM head (BERT, RoBERTa, ...) is masked, a family with a causal-LM
    head causal; None when it has neither."""
    for arch in getattr(config, "architectures", None) or ():
        for task in (MASKED_LM, CAUSAL_LM):
            if arch in _head_classes(task):
                return task
    mt = config.model_type
    encoder = not getattr(config, "is_decoder", False) and not getattr(config, "is_encoder_decoder", False)
    if encoder and mt in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return MASKED_LM
    if mt in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return CAUSAL_LM
    return None


def is_causal(model: nn.Module) -> bool:
    """Whether ``model``'s tokens see only earlier tokens: a causal-LM head, a decoder config, or a base model
    (``LlamaModel``) of a causal family."""
    task = model_task(model)
    if task is not None:
        return task == CAUSAL_LM
    return bool(getattr(model.config, "is_decoder", False)) or lm_task(model.config) == CAUSAL_LM
