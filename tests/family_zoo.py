"""Tiny random-init configs of every model family the family matrix (``test_families.py``) runs, in one table.

Each entry: the transformers config and model class names, the config's keyword arguments (tiny: hidden 32, 2
layers, 4 heads), the kind of inputs it takes and the facts the checks need. No hub access: configs only.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
import transformers

V = 99  # vocabulary of every text model
L = 12  # sequence length
IMG = 32  # image side of the vision models


@dataclasses.dataclass(frozen=True)
class Family:
    config: str
    model: str
    kwargs: dict[str, Any]
    #: "causal" (decoder LM), "encoder" (bidirectional text), "seq2seq", "speech" (Whisper), "audio" (wav2vec2
    #: encoders), "vision", "dual" (CLIP-like text + image)
    kind: str
    #: keywords of the attention interface this family passes with a value (s_aux, softcap, position_bias...)
    keywords: tuple[str, ...] = ()
    #: sliding-window length when the config has one (the sliding-window check runs past it)
    window: int | None = None
    #: a config attribute that fixes the sub-config used by generate (for dual models: none)
    eager_only: bool = False
    #: where ``inputs`` pads row 0 ("left" or "right"); None: by kind (left for causal models, as for generation)
    pad_side: str | None = None


_LM = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
           max_position_embeddings=64)
_LM_GQA = dict(_LM, num_key_value_heads=2)
_NOTOK = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
_BART = dict(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
#: multi-head latent attention with a DeepSeek-V3.2-style sparse indexer (DSA): top-4 of 12 keys, so the selection
#: bites; 4 indexer heads of 16 dims, so that random weights leave no ties among the index scores (with ties top-k
#: picks differently for cached and uncached calls, in eager too)
_DSA = dict(_LM, **_NOTOK, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
            num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=2, num_experts_per_tok=1, n_group=1,
            topk_group=1, index_topk=4, index_head_dim=16, index_n_heads=4)
#: the vision tower of a vision-language family run on text alone: no layers, so no attention module the inputs miss
_NO_VIT = dict(hidden_size=32, num_hidden_layers=0, num_attention_heads=4, intermediate_size=64)
_T5 = dict(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
           decoder_start_token_id=0, pad_token_id=0)
_VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=IMG,
            patch_size=8)

FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaConfig", "LlamaForCausalLM", dict(_LM_GQA, **_NOTOK), "causal"),
    "gpt2": Family("GPT2Config", "GPT2LMHeadModel",
                   dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_inner=64, n_positions=64, **_NOTOK),
                   "causal"),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", dict(_LM_GQA, **_NOTOK), "causal"),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", dict(_LM_GQA, head_dim=8, **_NOTOK), "causal"),
    "mistral": Family("MistralConfig", "MistralForCausalLM", dict(_LM_GQA, sliding_window=5, **_NOTOK), "causal",
                      window=5),
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM",
                      dict(_LM_GQA, num_local_experts=2, num_experts_per_tok=1, **_NOTOK), "causal"),
    "gemma": Family("GemmaConfig", "GemmaForCausalLM", dict(_LM_GQA, head_dim=8, **_NOTOK), "causal"),
    "gemma2": Family("Gemma2Config", "Gemma2ForCausalLM",
                     dict(_LM_GQA, head_dim=8, sliding_window=5, **_NOTOK), "causal", ("softcap",), window=5),
    "gemma3": Family("Gemma3TextConfig", "Gemma3ForCausalLM",
                     dict(_LM_GQA, head_dim=8, sliding_window=5, **_NOTOK), "causal", window=5),
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", dict(_LM_GQA, **_NOTOK), "causal"),
    "gpt_neox": Family("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(_LM, **_NOTOK), "causal"),
    "opt": Family("OPTConfig", "OPTForCausalLM",
                  dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                       word_embed_proj_dim=32, max_position_embeddings=64, **_NOTOK), "causal"),
    "stablelm": Family("StableLmConfig", "StableLmForCausalLM", dict(_LM_GQA, **_NOTOK), "causal"),
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM", dict(_LM_GQA, **_NOTOK), "causal"),
    "cohere": Family("CohereConfig", "CohereForCausalLM", dict(_LM_GQA, **_NOTOK), "causal"),
    "smollm3": Family("SmolLM3Config", "SmolLM3ForCausalLM", dict(_LM_GQA, **_NOTOK), "causal"),
    "gpt_oss": Family("GptOssConfig", "GptOssForCausalLM",
                      dict(_LM_GQA, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=5,
                           layer_types=["sliding_attention", "full_attention"], **_NOTOK),
                      "causal", ("s_aux",), window=5),
    # every other family that passes a keyword hf_attnorm implements (s_aux, softcap, position_bias)
    "vaultgemma": Family("VaultGemmaConfig", "VaultGemmaForCausalLM",
                         dict(_LM_GQA, head_dim=8, sliding_window=5, **_NOTOK), "causal", ("softcap",), window=5),
    "granite_swa": Family("GraniteSWAConfig", "GraniteSWAForCausalLM", dict(_LM_GQA, **_NOTOK), "causal",
                          ("s_aux",)),
    "granitemoe_swa": Family("GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM",
                             dict(_LM_GQA, num_local_experts=2, num_experts_per_tok=1, **_NOTOK), "causal",
                             ("s_aux",)),
    "mimo_v2_flash": Family("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM",
                            dict(_LM_GQA, head_dim=8, v_head_dim=8, moe_intermediate_size=16, n_routed_experts=2,
                                 num_experts_per_tok=1, sliding_window=5, **_NOTOK), "causal", ("s_aux",), window=5),
    "flint": Family("FlintConfig", "FlintForCausalLM", dict(_LM_GQA, head_dim=8, **_NOTOK), "causal", ("s_aux",)),
    "openai_privacy_filter": Family("OpenAIPrivacyFilterConfig", "OpenAIPrivacyFilterForTokenClassification",
                                    dict(_LM_GQA, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
                                         sliding_window=5, **_NOTOK), "encoder", ("s_aux",), window=5),
    # families passing a sparse indexer's choice of keys (indices, block_indices); the vision-language ones run text
    "deepseek_v32": Family("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(_DSA), "causal", ("indices",)),
    "glm_moe_dsa": Family("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(_DSA, indexer_types=["full", "shared"]),
                          "causal", ("indices",)),
    "hy_v4": Family("HYV4Config", "HYV4ForCausalLM", dict(_DSA, indexer_types=["full", "shared"]), "causal",
                    ("indices", "s_aux")),
    "hy_v4_vl": Family("HYV4VLConfig", "HYV4VLForConditionalGeneration",
                       dict(text_config=dict(_DSA, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                        mrope_section=[0, 1, 1])),
                            vision_config=dict(_NO_VIT, out_hidden_size=32, patch_size=8), image_token_id=97,
                            video_token_id=98), "causal", ("indices", "s_aux")),
    "axk2": Family("AXK2Config", "AXK2ForCausalLM", dict(_DSA), "causal", ("indices",)),
    # dense MLPs: with random weights its MoE router can sit on a near-tie that 1e-7 of cache noise flips; its sliding
    # layers take their own (swa_) sizes; 8 indexer heads, as 4 leave index-score ties with these weights
    "dots3_note": Family("Dots3NoteTextConfig", "Dots3NoteForCausalLM",
                         dict(_DSA, layer_types=["indexed_attention", "sliding_attention"], sliding_window=5,
                              mlp_layer_types=["dense", "dense"], swa_num_attention_heads=4, swa_num_key_value_heads=4,
                              swa_q_lora_rank=16, swa_kv_lora_rank=16, swa_head_dim=8, swa_qk_nope_head_dim=4,
                              swa_v_head_dim=8, index_n_heads=8),
                         "causal", ("indices",), window=5),
    "mistral_large4": Family("MistralLarge4Config", "MistralLarge4ForConditionalGeneration",
                             dict(text_config=dict(_DSA),
                                  vision_config=dict(_NO_VIT, head_dim=8, patch_size=8, image_size=32),
                                  image_token_index=98), "causal", ("indices",)),
    # MiniMax M3's indexer reads the padded positions' hidden states, which differ between eager (the mean of the
    # values on a row that sees no key) and hf_attnorm (0); its own docstring says only right padding is equivalent
    "minimax_m3_vl": Family("MiniMaxM3VLTextConfig", "MiniMaxM3VLForCausalLM",
                            dict(_LM, **_NOTOK, num_key_value_heads=2, head_dim=8, index_n_heads=2, index_head_dim=8,
                                 index_block_size=2, index_topk_blocks=2, index_local_blocks=1,
                                 layer_types=["minimax_m3_sparse", "full_attention"]),
                            "causal", ("block_indices",), pad_side="right"),
    "bert": Family("BertConfig", "BertModel", dict(_LM), "encoder"),
    "roberta": Family("RobertaConfig", "RobertaModel", dict(_LM, pad_token_id=1), "encoder"),
    "xlm_roberta": Family("XLMRobertaConfig", "XLMRobertaModel", dict(_LM, pad_token_id=1), "encoder"),
    "electra": Family("ElectraConfig", "ElectraModel", dict(_LM, embedding_size=32), "encoder"),
    "distilbert": Family("DistilBertConfig", "DistilBertModel",
                         dict(vocab_size=V, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                              max_position_embeddings=64), "encoder"),
    "modernbert": Family("ModernBertConfig", "ModernBertModel",
                         dict(_LM, global_attn_every_n_layers=2, local_attention=4, pad_token_id=0), "encoder"),
    "bart": Family("BartConfig", "BartForConditionalGeneration", dict(_BART), "seq2seq"),
    "marian": Family("MarianConfig", "MarianMTModel", dict(_BART, decoder_start_token_id=0, pad_token_id=0),
                     "seq2seq"),
    "t5": Family("T5Config", "T5ForConditionalGeneration", dict(_T5), "seq2seq", ("position_bias",)),
    "mt5": Family("MT5Config", "MT5ForConditionalGeneration", dict(_T5), "seq2seq", ("position_bias",)),
    "umt5": Family("UMT5Config", "UMT5ForConditionalGeneration", dict(_T5), "seq2seq", ("position_bias",)),
    "switch_transformers": Family("SwitchTransformersConfig", "SwitchTransformersForConditionalGeneration",
                                  dict(_T5, num_experts=2, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
                                       num_decoder_layers=2), "seq2seq", ("position_bias",)),
    "pop2piano": Family("Pop2PianoConfig", "Pop2PianoForConditionalGeneration", dict(_T5), "seq2seq",
                        ("position_bias",)),
    "wav2vec2_conformer": Family("Wav2Vec2ConformerConfig", "Wav2Vec2ConformerModel",
                                 dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, conv_dim=(16, 16), conv_stride=(4, 4),
                                      conv_kernel=(8, 8), position_embeddings_type="relative",
                                      num_conv_pos_embeddings=8, conv_depthwise_kernel_size=3, layerdrop=0.0,
                                      mask_time_prob=0.0), "audio",
                                 ("position_bias",)),
    "wav2vec2_bert": Family("Wav2Vec2BertConfig", "Wav2Vec2BertModel",
                            dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=64, feature_projection_input_dim=16,
                                 position_embeddings_type="relative_key", conv_depthwise_kernel_size=3,
                                 left_max_position_embeddings=8, right_max_position_embeddings=8, layerdrop=0.0,
                                 mask_time_prob=0.0), "audio",
                            ("position_bias",)),
    "whisper": Family("WhisperConfig", "WhisperForConditionalGeneration",
                      dict(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                           max_source_positions=16, max_target_positions=64, decoder_start_token_id=0,
                           pad_token_id=0, suppress_tokens=None, begin_suppress_tokens=None), "speech"),
    "vit": Family("ViTConfig", "ViTModel", dict(_VIT), "vision"),
    "dinov2": Family("Dinov2Config", "Dinov2Model", dict(_VIT), "vision"),
    "clip": Family("CLIPConfig", "CLIPModel",
                   # eos_token_id 2: CLIP's legacy pooling at the largest id (random ids hold no real eos token)
                   dict(text_config=dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64, max_position_embeddings=64, eos_token_id=2),
                        vision_config=dict(_VIT), projection_dim=16), "dual"),
    "siglip": Family("SiglipConfig", "SiglipModel",
                     dict(text_config=dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=64, max_position_embeddings=64),
                          vision_config=dict(_VIT)), "dual"),
}

#: families that compute attention themselves: refused at load and set time
REFUSED: dict[str, Family] = {
    "falcon": Family("FalconConfig", "FalconForCausalLM",
                     dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4), "causal"),
    "gptj": Family("GPTJConfig", "GPTJForCausalLM",
                   dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4), "causal"),
    "bloom": Family("BloomConfig", "BloomForCausalLM",
                    dict(vocab_size=V, hidden_size=32, n_layer=2, n_head=4), "causal"),
    "mpt": Family("MptConfig", "MptForCausalLM",
                  dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=64), "causal"),
}


def make_config(name: str) -> transformers.PretrainedConfig:
    fam = FAMILIES.get(name) or REFUSED[name]
    return getattr(transformers, fam.config)(**fam.kwargs)


def build(name: str, implementation: str, seed: int = 0, attnorm: dict[str, Any] | None = None,
          **kw: Any) -> transformers.PreTrainedModel:
    """A tiny random model of family ``name`` with ``implementation`` (weights fixed by ``seed``) and attnorm
    option overrides, in eval mode."""
    fam = FAMILIES.get(name) or REFUSED[name]
    torch.manual_seed(seed)
    config = make_config(name)
    if attnorm is not None:  # on the sub-configs too: composite models (CLIP) build their towers from them
        for cfg in (config, *(getattr(config, name, None) for name in getattr(config, "sub_configs", {}))):
            if cfg is not None:
                cfg.attnorm = dict(attnorm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, fam.model)._from_config(config, attn_implementation=implementation, **kw)
    return model.eval()


def inputs(name: str, seed: int = 0, pad: bool = True,
           length: int = L) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """(model inputs, live [B, L] of the output rows that padding leaves meaningful, or None: every row)."""
    fam = FAMILIES[name]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (2, length), generator=g)
    mask = torch.ones_like(ids)
    if pad:
        if (fam.pad_side or ("left" if fam.kind == "causal" else "right")) == "left":
            mask[0, :4] = 0  # left padding, as for generation
        else:
            mask[0, -4:] = 0
    if fam.kind == "causal":
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        return {"input_ids": ids, "attention_mask": mask, "position_ids": pos}, mask.bool()
    if fam.kind == "encoder":
        return {"input_ids": ids, "attention_mask": mask}, mask.bool()
    if fam.kind == "seq2seq":
        dec = torch.randint(3, V, (2, 7), generator=g)
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec}, None
    if fam.kind == "speech":
        feats = torch.randn(2, 8, 32, generator=g)
        dec = torch.randint(3, V, (2, 7), generator=g)
        return {"input_features": feats, "decoder_input_ids": dec}, None
    if fam.kind == "audio":
        if name == "wav2vec2_bert":
            mask = torch.ones(2, length, dtype=torch.long)
            if pad:
                mask[0, -4:] = 0
            return {"input_features": torch.randn(2, length, 16, generator=g), "attention_mask": mask}, mask.bool()
        return {"input_values": torch.randn(2, 16 * length, generator=g)}, None
    pixels = torch.randn(2, 3, IMG, IMG, generator=g)
    if fam.kind == "vision":
        return {"pixel_values": pixels}, None
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels}, None  # dual (CLIP, SigLIP)


def output(out: Any) -> torch.Tensor:
    """The tensor the checks compare: logits, last_hidden_state, or (dual models) the image-text logits."""
    for name in ("logits", "last_hidden_state", "logits_per_image"):
        t = getattr(out, name, None)
        if t is not None:
            return t
    raise TypeError(f"no comparable output in {type(out).__name__}")
