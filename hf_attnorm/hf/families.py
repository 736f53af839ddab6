"""Facts about transformers' attention modules, in one table: which modules call the attention interface, their
head count, which keywords they pass to it, which model families do not use the interface at all, and what a model
family is (causal LM or encoder: ``lm_task``, ``model_task``, ``is_causal``). Model families differ only in these
few facts.

Read by the state on modules (``state.py``) and by the lab (training, evaluation, diagnostics, scale analysis).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import sys
import textwrap
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.auto import modeling_auto

from ..masks import selected_keys
from ..registry import AttnormError
from . import compat

#: the language-modelling objectives, named as training's ``--task``
CAUSAL_LM, MASKED_LM = "causal_lm", "masked_lm"

#: how each family's attention module exposes its head count, where the generic rule (``num_heads``,
#: ``num_attention_heads``, ``n_heads`` on the module, then the config) would not find it
MODULE_FACTS: dict[str, str] = {
    "GPT2Attention": "num_heads",
    "BertSelfAttention": "num_attention_heads",
    "BertCrossAttention": "num_attention_heads",
    "LlamaAttention": "config.num_attention_heads",
}

#: head-count attributes tried on the module, then on its config, in this order
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "num_q_heads")

#: keywords of the attention interface that hf_attnorm implements (``forward.py`` reads each of them)
IMPLEMENTED_KEYWORDS: frozenset[str] = frozenset({
    "query", "key", "value", "attention_mask", "scaling", "dropout", "is_causal",
    "sliding_window",  # the mask transformers builds with sdpa_mask already holds the window
    "softcap",  # s = c tanh(s / c) before the normalizer
    "position_bias",  # s = s + b before the normalizer (T5, MPT-style ALiBi)
    "s_aux",  # learned attention sinks: an always-visible extra key with logit s_aux[h] and value 0
    "output_attentions",  # weights come from the reference path
    "indices", "block_indices",  # a sparse indexer's choice of keys: SELECTION_KEYWORDS
})

@dataclasses.dataclass(frozen=True)
class KeySelection:
    """A keyword by which an attention module hands the attention function the keys a sparse-attention indexer chose
    per query. transformers' own eager and sdpa paths never receive it: the module folds it into their mask instead,
    so hf_attnorm does the same (``masks.selected_keys`` then ``masks.select_keys``), and every path then runs the
    normalizer over exactly the keys the mask keeps and the indexer selected."""

    #: what the keyword carries, as the modules that pass it compute it
    meaning: str
    #: dotted attribute of the attention module holding the block size when the indices name blocks of keys (read
    #: when the implementation is set); None: they name keys
    block_attr: str | None
    #: source fragments of the module's forward, any one of which shows it folding the keyword into the eager/sdpa
    #: mask in the way ``selected_keys`` reads it; a module passing the keyword with none of them is refused at load
    #: (its keyword may mean something else)
    markers: tuple[str, ...]


#: the key selections hf_attnorm reads (tests/test_transformers_contract.py checks each family that passes one)
SELECTION_KEYWORDS: dict[str, KeySelection] = {
    "indices": KeySelection(
        "per query, the top-k key positions [B, Lq, k] of a DeepSeek-V3.2-style indexer (DSA: deepseek_v32, "
        "glm_moe_dsa, hy_v4, axk2, dots3_note, mistral_large4); eager/sdpa scatter them into a keep-mask over the "
        "call's keys",
        None, (".scatter(-1, topk_indices.long(), False)",  # a keep-mask (current releases)
               ".scatter_(-1, topk_indices, 0.0)")),  # an additive mask, in every path's mask too (5.4)
    "block_indices": KeySelection(
        "per query and key/value head, the selected key blocks [B, Hkv, Lq, k], -1 in unused slots (MiniMax M3); "
        "eager/sdpa expand them with the indexer's build_block_mask, block b covering keys b * block_size ...",
        "indexer.block_size", ("build_block_mask(",)),
}


#: keywords of transformers' attention functions (or of a module's own call) that carry nothing for a non-flash
#: attention function, each with the reason; keywords transformers declares elsewhere (``TransformersKwargs``, loss
#: functions, the cache argument) pass through by ``compat.keyword_roles``, as they do through transformers' own
#: attention functions
IGNORED_KEYWORDS: dict[str, str] = {
    **{k: "flash-attention varlen metadata: like sdpa and eager, the boolean mask (sdpa_mask) is what counts"
       for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")},
    "position_ids": "positions are already applied to q/k (rotary) and to the mask",
    "deterministic": "a flash-attention kernel flag",
    "use_cache": "a model flag; the cache is updated before the attention function",
    "cache_position": "positions are already in the mask",
    "position_embeddings": "already applied to q/k",
    "return_dict": "a model output flag",
    "encoder_hidden_states": "cross-attention: already projected into the key/value the function receives",
    "encoder_attention_mask": "cross-attention: already in the attention_mask the function receives",
    "tokenizer": "generate(tokenizer=...)'s tokenizer (for stop strings; transformers serve passes it), which "
                 "generate's sampling loop leaves among the model's keywords: text, not attention",
}


#: keywords of modules' own calls whose meaning is known but which no path of hf_attnorm applies, each with why:
#: refused at load with that reason (rather than as an unknown keyword)
UNIMPLEMENTED_KEYWORDS: dict[str, str] = {
    "sinks": "per-query attention-sink logits [B, H, Lq, 1] projected from the hidden states (Inkling2); hf_attnorm's "
             "sinks (s_aux) are one learned logit per head [H], and no path takes a sink per query",
}


#: ``compat.keyword_roles`` for this process's transformers, built at the first lookup (module load time of the first
#: model: it reads transformers' signatures)
_ROLES: dict[str, compat.KeywordRole] = {}


def keyword_role(name: str) -> compat.KeywordRole:
    """What a keyword reaching the attention function means (implemented, ignored with a reason, passed through as
    transformers declares it, or refused: see ``compat.keyword_roles``)."""
    if not _ROLES:
        _ROLES.update(compat.keyword_roles(IMPLEMENTED_KEYWORDS, IGNORED_KEYWORDS, UNIMPLEMENTED_KEYWORDS))
    role = _ROLES.get(name)
    return role if role is not None else compat.unknown_keyword(name)


#: the keywords found accepted so far (a role depends on the name alone): a call passing only these is checked by
#: one set comparison
_ACCEPTED: set[str] = set()


def refused_keywords(names: object) -> list[str]:
    """The keywords among ``names`` that hf_attnorm must refuse, each with why (sorted; checked per attention call,
    so a call passing only keywords accepted before costs one set comparison)."""
    if _ACCEPTED.issuperset(names):  # type: ignore[arg-type]
        return []
    refused = []
    for k in names:  # type: ignore[attr-defined]
        if keyword_role(k).accepted:
            _ACCEPTED.add(k)
        else:
            refused.append(k)
    return [f"{k!r} ({keyword_role(k).why})" for k in sorted(refused)]


#: model families that compute attention themselves (no ``ALL_ATTENTION_FUNCTIONS`` call): refused at load/set time
REFUSED_FAMILIES: dict[str, str] = {
    "falcon": "Falcon picks its attention class from a fixed table (eager/sdpa/flash) and never calls the attention "
              "interface",
    "gptj": "GPT-J picks its attention class from a fixed table (eager/flash) and never calls the attention interface",
    "bloom": "BLOOM computes ALiBi attention inline (alibi.baddbmm) and never calls the attention interface",
    "mpt": "MPT computes its attention inline and never calls the attention interface",
    "longt5": "LongT5's encoder attention (local and transient-global) is computed inline; only its decoder calls the "
              "attention interface, so the encoder would silently keep its own softmax",
}

_INTERFACE_MARKERS = ("ALL_ATTENTION_FUNCTIONS", "attention_interface(")


@functools.cache
def _forward_source(cls: type) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


def calls_interface(module: nn.Module) -> bool:
    """The module's own forward calls transformers' attention interface (so the module is passed as ``module``)."""
    if type(module).__name__ == "AttnormState" or not hasattr(module, "config"):
        return False
    src = _forward_source(type(module))
    return any(m in src for m in _INTERFACE_MARKERS)


def attention_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Modules whose forward calls the attention interface (with or without a ``scaling`` attribute)."""
    for name, mod in model.named_modules():
        if calls_interface(mod):
            yield name, mod


@functools.cache
def interface_keywords(cls: type) -> frozenset[str]:
    """Keywords the module's forward passes by name to the attention interface: the keyword arguments of every call
    of a local named ``attention_interface`` in its source (``**kwargs`` passthrough is checked per call in
    ``forward.py``)."""
    try:
        tree = ast.parse(textwrap.dedent(_forward_source(cls)))
    except SyntaxError:
        return frozenset()
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "attention_interface":
            out.update(kw.arg for kw in node.keywords if kw.arg is not None)
    return frozenset(out)


def _dotted(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def unread_selections(module: nn.Module) -> list[str]:
    """The key-selection keywords this module passes by name but whose meaning its forward does not show (the
    ``KeySelection.markers`` are missing), each with what hf_attnorm reads it as: refused at load."""
    src = _forward_source(type(module))
    return [f"{k!r} (hf_attnorm reads it as {SELECTION_KEYWORDS[k].meaning}, but {type(module).__name__}.forward "
            f"does not fold it into its eager/sdpa mask that way: none of {list(SELECTION_KEYWORDS[k].markers)})"
            for k in sorted(interface_keywords(type(module)) & SELECTION_KEYWORDS.keys())
            if not any(m in src for m in SELECTION_KEYWORDS[k].markers)]


def module_selections(module: nn.Module) -> dict[str, int | None]:
    """{selection keyword the module passes by name: its block size (1 for key indices; None where the module has
    no block size, e.g. a dense layer of a family whose sparse layers have an indexer)}."""
    out: dict[str, int | None] = {}
    for k in sorted(interface_keywords(type(module)) & SELECTION_KEYWORDS.keys()):
        attr = SELECTION_KEYWORDS[k].block_attr
        if attr is None:
            out[k] = 1
        else:
            size = _dotted(module, attr)
            out[k] = size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None
    return out


def key_selection(module: nn.Module, info: Mapping[str, Any], kwargs: Mapping[str, Any],
                  lk: int) -> torch.Tensor | None:
    """The keys a call selects (``SELECTION_KEYWORDS``) as bool [B, 1 or Hs, Lq, Lk], or None when it passes no
    selection (or passes None). ``info``: the module's ``module_info`` (its ``selections``, read at load), so a
    keyword is honoured only from a module that passes it by name in the way hf_attnorm reads it; one arriving
    otherwise (through ``**kwargs``) is refused."""
    given = [k for k in SELECTION_KEYWORDS if kwargs.get(k) is not None]
    if not given:
        return None
    name = type(module).__name__
    if len(given) > 1:
        raise AttnormError(f"{name} passed {' and '.join(map(repr, given))} to the attention function; one key "
                           "selection per call is allowed")
    key = given[0]
    taken = info.get("selections", {})
    if key not in taken:
        raise AttnormError(
            f"{name} passed {key!r} to the attention function, but its forward does not pass it by name (it came "
            f"through **kwargs), so its meaning is not known; hf_attnorm reads {key!r} only from modules whose "
            f"forward passes it as {SELECTION_KEYWORDS[key].meaning}. Use attn_implementation='sdpa' or 'eager' "
            "for this call.")
    block = taken[key]
    if block is None:
        raise AttnormError(f"{name} passed {key!r}, which names blocks of keys, but has no block size at "
                           f"{SELECTION_KEYWORDS[key].block_attr!r} (a positive integer is needed)")
    return selected_keys(kwargs[key], lk, block)


def unsupported_keywords(module: nn.Module) -> list[str]:
    """Keywords this module passes by name that hf_attnorm must refuse, each with why."""
    return refused_keywords(interface_keywords(type(module)))


def num_heads_of(module: nn.Module) -> int:
    """The number of query heads of an attention module, from the module (or its config); AttnormError if none."""
    attr = MODULE_FACTS.get(type(module).__name__)
    if attr is not None:
        obj: Any = module
        for part in attr.split("."):
            obj = getattr(obj, part)
        return int(obj)
    cfg = getattr(module, "config", None)
    for owner in (module, cfg):
        for attr in _HEAD_ATTRS:
            value = getattr(owner, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    raise AttnormError(
        f"hf_attnorm cannot determine the number of heads of {type(module).__name__} (none of "
        f"{', '.join(_HEAD_ATTRS)} on the module or its config); add it to hf_attnorm.hf.families.MODULE_FACTS"
    )


#: key/value head-count attributes tried on the config when the module has no ``num_key_value_groups``
_KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")


def kv_heads_of(module: nn.Module, num_heads: int) -> int:
    """The number of key/value heads (GQA) of an attention module: num_heads // ``num_key_value_groups`` on the
    module (transformers' GQA modules), else a key/value head count on the module or its config, else num_heads."""
    groups = getattr(module, "num_key_value_groups", None)
    if isinstance(groups, int) and not isinstance(groups, bool) and groups > 0 and num_heads % groups == 0:
        return num_heads // groups
    for owner in (module, getattr(module, "config", None)):
        for attr in _KV_HEAD_ATTRS:
            value = getattr(owner, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0 and num_heads % value == 0:
                return value
    return num_heads


def family_of(model_or_cls: Any) -> str:
    cls = model_or_cls if isinstance(model_or_cls, type) else type(model_or_cls)
    return getattr(getattr(cls, "config_class", None), "model_type", None) or cls.__name__


@functools.cache
def _module_calls_interface(module_name: str) -> bool | None:
    mod = sys.modules.get(module_name)
    try:
        src = inspect.getsource(mod) if mod is not None else None
    except (OSError, TypeError):
        src = None
    return None if src is None else ("ALL_ATTENTION_FUNCTIONS" in src or "AttentionInterface" in src)


def refusal_reason(model_or_cls: Any) -> str | None:
    """Why hf_attnorm cannot run this model class (its family computes attention itself), or None."""
    cls = model_or_cls if isinstance(model_or_cls, type) else type(model_or_cls)
    family = family_of(cls)
    if family in REFUSED_FAMILIES:
        return REFUSED_FAMILIES[family]
    # composite models (sub-configs) delegate attention to sub-models defined elsewhere: checked after building
    sub = getattr(getattr(cls, "config_class", None), "sub_configs", None)
    if not sub and cls.__module__.startswith("transformers.models.") and \
            _module_calls_interface(cls.__module__) is False:
        return f"{family} computes attention itself and never calls transformers' attention interface"
    return None


def rope_parameters(cfg: Any) -> list[dict[str, Any]]:
    """The rotary settings of a config as a list of dicts (transformers 5 ``rope_parameters``, possibly one per layer
    type, or the older ``rope_scaling``); empty without any. Scales read them to refuse what the model already
    applies (YaRN's temperature, Ministral 3's llama_4_scaling_beta)."""
    out = []
    for attr in ("rope_parameters", "rope_scaling"):
        value = getattr(cfg, attr, None)
        if isinstance(value, dict):
            nested = [v for v in value.values() if isinstance(v, dict)]
            out.extend(nested if nested else [value])
    return out


def module_info(module: nn.Module) -> dict[str, Any]:
    cfg = module.config
    max_pos = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    heads = num_heads_of(module)
    return {"max_positions": max_pos, "family": type(module).__name__,
            "layer_idx": getattr(module, "layer_idx", None), "num_heads": heads,
            "num_kv_heads": kv_heads_of(module, heads),
            "head_dim": next((getattr(module, a) for a in HEAD_DIM_ATTRS if getattr(module, a, None)), None),
            "value_dim": next((getattr(module, a) for a in VALUE_DIM_ATTRS if getattr(module, a, None)), None),
            "rope": rope_parameters(cfg), "selections": module_selections(module)}


#: attributes naming an attention module's q/k head dimension (T5's key_value_proj_dim, wav2vec2-conformer's head_size,
#: multi-head latent attention's qk_head_dim: DeepSeek V3.2 and the other DSA families)
HEAD_DIM_ATTRS = ("head_dim", "attention_head_size", "key_value_proj_dim", "head_size", "qk_head_dim")
#: attributes naming a value head dimension that differs from the q/k one (multi-head latent attention: DeepSeek V2/V3)
VALUE_DIM_ATTRS = ("v_head_dim", "value_head_dim")




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
