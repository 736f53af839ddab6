"""Continuous batching (``model.generate_batch``): every implementation declared exact there gives greedy tokens equal
to ``model.generate``'s, on transformers' sdpa route (packed queries, keys gathered from the paged cache, one
block-diagonal mask), with more requests than batch slots, chunked prefill and prefix sharing; the others are refused
with their declared reason. Generic over the registry: a new normalizer or scale is tested through its declaration
(``continuous_batching``), with no edit here.
"""

from __future__ import annotations

import logging
import types
import warnings

import pytest
import torch
import transformers
from conftest import first_implementations, needs_compile, needs_compile_inductor
from transformers import GenerationConfig

from hf_attnorm.hf import continuous_batching, forward
from hf_attnorm.hf.cache_state import NOTE_ATTR, CallNote
from hf_attnorm.hf.continuous_batching import continuous_batching_support
from hf_attnorm.hf.families import attention_modules
from hf_attnorm.hf.forward import record_paths
from hf_attnorm.lab.observe import observing
from hf_attnorm.masks import additive_keep, build_mask_info
from hf_attnorm.registry import NORMALIZERS, PRESETS, AttnormError
from hf_attnorm.settings import resolve_settings

pytestmark = pytest.mark.skipif(
    bool(continuous_batching.CONTINUOUS_BATCHING_MISSING),
    reason=f"continuous batching is refused for hf_attnorm implementations on transformers {transformers.__version__}"
           f": it lacks {', '.join(continuous_batching.CONTINUOUS_BATCHING_MISSING)} "
           "(tests/test_transformers_contract.py)")

#: prompts of mixed lengths, one longer than a batch (chunked prefill), more of them than batch slots
PROMPTS = [[5, 6, 7, 8, 9], [3], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [7, 8, 9]]
#: small batches and pages: requests wait for a slot, long prompts are split, full pages are shared
CB = dict(max_batch_tokens=8, num_blocks=32, page_size=4, max_requests_per_batch=2)
NEW_TOKENS = 4


def support(impl: str) -> tuple[str, str]:
    return continuous_batching_support(resolve_settings(impl))


EXACT = [name for name in PRESETS if support(name)[0] != "refused"]
REFUSED = [name for name in PRESETS if support(name)[0] == "refused"]
#: the default run: the first implementation of each normalizer, scale declaration and memory use (the others run the
#: same code with another n-based scale or option values); every exact one runs with -m slow
SAMPLE = first_implementations(
    lambda s: (s.normalizer, support(s.implementation)[0], s.options.get("num_mem_kv", 0) > 0), EXACT)


def _config(family: str = "llama", **kw) -> transformers.PretrainedConfig:
    """A tiny random-init config (2 layers, GQA, vocabulary 61). Untied embeddings and a wide initialisation make
    the greedy tokens depend on attention (a narrow one repeats the prompt's last token whatever attention does)."""
    base = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.3,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen3": transformers.Qwen3Config}[family]
    return cls(**{**base, **kw})


def build(impl: str, family: str = "llama", attnorm: dict | None = None, **config_kw) -> transformers.PreTrainedModel:
    config = _config(family, **config_kw)
    if attnorm:
        config.attnorm = {"implementation": impl, **attnorm}
    config._attn_implementation = impl
    model_cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM}[family]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_cls(config).eval()


def _generation_config() -> GenerationConfig:
    return GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)


def generate_batch(model, prompts=PROMPTS, persistent_manager: bool = False, **cb) -> list[list[int]]:
    from transformers import ContinuousBatchingConfig

    out = model.generate_batch(prompts, generation_config=_generation_config(), persistent_manager=persistent_manager,
                               continuous_batching_config=ContinuousBatchingConfig(**{**CB, **cb}))
    assert len(out) == len(prompts), f"requests failed inside the manager's thread: {len(out)} of {len(prompts)}"
    return [r.generated_tokens for r in out.values()]


def generate_each(model, prompts=PROMPTS) -> list[list[int]]:
    """The reference: ``model.generate`` per prompt (no padding), the model's own cached decoding."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (transformers' note on the unset eos token)
        return [model.generate(torch.tensor([p]), generation_config=_generation_config())[0, len(p):].tolist()
                for p in prompts]


def check_exact(model, prompts=PROMPTS, **cb) -> forward.PathRecord:
    """generate_batch equals generate token for token, and every attention call of ours came packed (one path per
    call, or one per sequence when split). Returns the record of the calls."""
    mode, note = continuous_batching_support(next(m.attnorm.settings for _, m in attention_modules(model)))
    name = model.config._attn_implementation
    with record_paths() as rec, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = generate_batch(model, prompts, **cb)
    assert rec.packed > 0 and rec.paths, "hf_attnorm's attention function did not run on the packed route"
    if mode == "packed":
        assert len(rec.paths) == rec.packed
    elif {**CB, **cb}["max_requests_per_batch"] > 1:
        assert len(rec.paths) > rec.packed  # (the packed calls held several sequences, each run on its own)
    said = [str(w.message) for w in caught if "under continuous batching" in str(w.message)]
    assert (note in said[0]) if note else not said, said
    assert got == generate_each(model, prompts)
    assert model.config._attn_implementation == name  # never switched (to flash attention, or at all)
    return rec


@pytest.fixture(autouse=True)
def _fast_quiet_manager(monkeypatch):
    """The manager's stop collects garbage twice (half a second in a test process holding many models): skipped; its
    thread logs failures instead of raising them (``generate_batch`` below checks every request came back)."""
    from transformers.generation.continuous_batching import continuous_api

    monkeypatch.setattr(continuous_api, "gc", types.SimpleNamespace(collect=lambda: 0))
    logger = logging.getLogger("ContinuousBatchingLogger")
    monkeypatch.setattr(logger, "level", logging.CRITICAL)


@pytest.mark.parametrize("impl", SAMPLE)
def test_generate_batch_equals_generate(impl):
    check_exact(build(impl))


@pytest.mark.slow
@pytest.mark.parametrize("impl", [n for n in EXACT if n not in SAMPLE])
def test_generate_batch_equals_generate_for_every_exact_implementation(impl):
    check_exact(build(impl))


#: families beside llama on which every exact implementation runs with -m slow (Qwen3: q/k norms before attention;
#: Mistral: a sliding window in its config, wider than these prompts); the default run: the sample on the first
OTHER_FAMILIES = ("qwen3", "mistral")


@pytest.mark.parametrize("impl", SAMPLE)
def test_generate_batch_equals_generate_on_another_family(impl):
    check_exact(build(impl, OTHER_FAMILIES[0]))


@pytest.mark.slow
@pytest.mark.parametrize("impl, family", [(n, f) for f in OTHER_FAMILIES for n in EXACT
                                          if not (n in SAMPLE and f == OTHER_FAMILIES[0])])
def test_generate_batch_equals_generate_on_other_families_for_every_exact_implementation(impl, family):
    check_exact(build(impl, family))


def test_the_sample_covers_each_declaration():
    assert {support(n)[0] for n in SAMPLE} == {support(n)[0] for n in EXACT} == {"packed", "per_sequence"}
    assert "softmax" in SAMPLE and "memkv" in SAMPLE and "linear" in SAMPLE


@pytest.mark.parametrize("impl", REFUSED)
def test_refused_implementations_say_why_and_keep_thebuild(impl):
    model = build(impl)
    _, note = support(impl)
    with pytest.raises(AttnormError, match=rf"^continuous batching .* cannot run hf_attnorm's '{impl}': ") as err:
        generate_batch(model)
    assert note in str(err.value) and "model.generate" in str(err.value)
    assert model.config._attn_implementation == impl


def test_selective_is_refused_because_earlier_queries_are_not_kept():
    assert "selective" in REFUSED
    with pytest.raises(AttnormError, match="every earlier query of its sequence .* prefix sharing"):
        generate_batch(build("selective"))


def test_linear_runs_exactly_without_its_recurrent_state_and_says_so():
    assert support("linear")[0] == "packed"
    with pytest.warns(UserWarning, match="'linear' runs without its recurrent decode state"):
        generate_batch(build("linear"))


@pytest.mark.parametrize("impl, attnorm, values", [
    ("ssmax", None, {"ssmax_s": [0.3, 1.7, 0.6, 2.5]}),
    ("sigmoid", {"sigmoid_bias_learnable": True}, {"sigmoid_bias": [-3.0, 1.0, -0.5, 2.0]}),
])
def test_learned_per_head_values_are_used(impl, attnorm, values):
    model = build(impl, attnorm=attnorm)
    before = generate_each(model)
    with torch.no_grad():
        for _, mod in attention_modules(model):
            for name, v in values.items():
                getattr(mod.attnorm, name).copy_(torch.tensor(v))
    assert generate_each(model) != before  # (the values change the tokens, so the check below sees them)
    check_exact(model)


@pytest.mark.parametrize("impl, attnorm", [("memkv", None), ("symax", {"num_mem_kv": 2})])
def test_memory_key_values(impl, attnorm):
    check_exact(build(impl, attnorm=attnorm))


@pytest.mark.parametrize("impl", ["softmax", "symax"])
def test_sliding_window(impl):
    """Mistral with a window of 4 (sequences reach 16): the paged cache keeps the window's keys in a ring, the mask
    adds the window."""
    check_exact(build(impl, family="mistral", sliding_window=4))


@pytest.mark.parametrize("impl, attnorm", [("ssmax", None), ("llama4_pos", {"train_length": 2}),
                                           ("fox", None), ("stickbreaking", None)])
def test_prefix_sharing_and_chunked_prefill(impl, attnorm):
    """Requests whose prompts share two full pages: a later one starts with its queries after the shared prefix
    (fewer queries than keys), as a chunked prefill does; the length- and position-aware scales, the decay and the
    key order see the same keys as in ``generate``."""
    shared = [4, 9, 13, 2, 40, 33, 21, 8, 5]
    prompts = [shared + [11, 12], shared + [30, 31, 32], shared + [50]]
    model = build(impl, attnorm=attnorm)
    runs = []

    def observe(module, query, key, value, mask, scaling, kwargs, student):
        if module.layer_idx == 0 and "cu_seq_lens_q" in kwargs:
            cu_q, cu_k = kwargs["cu_seq_lens_q"].tolist(), kwargs["cu_seq_lens_k"].tolist()
            runs.extend((q1 - q0, k1 - k0) for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]))
        return student()

    with observing(model, observe):
        check_exact(model, prompts, max_batch_tokens=16, max_requests_per_batch=1)
    # a prompt of 12 tokens whose first 8 are shared: 4 queries over 12 keys
    assert (len(prompts[1]) - 8, len(prompts[1])) in runs, runs


def test_the_packed_call_carries_the_managers_keywords_and_they_are_refused_elsewhere():
    model = build("symax")
    seen: list[set[str]] = []

    def observe(module, query, key, value, mask, scaling, kwargs, student):
        seen.append(set(kwargs))
        assert query.shape[0] == 1 and isinstance(mask, torch.Tensor) and mask.shape[:2] == (1, 1)
        return student()

    with observing(model, observe):
        generate_batch(model)
    assert {"read_index", "write_index", "logits_indices", "cu_seq_lens_q", "cu_seq_lens_k"} <= set.union(*seen)
    with torch.no_grad(), pytest.raises(AttnormError, match=r"passed 'read_index' \(transformers .* declares no"):
        model(torch.tensor([[1, 2, 3]]), read_index=[torch.zeros(3, dtype=torch.long)])


def test_a_block_table_is_refused():
    """Paged decoding (flash's block table) leaves the keys in the cache; hf_attnorm needs them gathered."""
    model = build("symax")
    _, mod = next(iter(attention_modules(model)))
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    mask = torch.zeros(1, 1, 3, 3)
    mod.__dict__[NOTE_ATTR] = CallNote(packed=True)  # (what the pre-hook notes for a call given the paged cache)
    with pytest.raises(AttnormError, match="^LlamaAttention: continuous batching's packed call carries a block table"):
        forward.forward_for("symax")(mod, q, k, k, mask, scaling=0.35, block_table=torch.zeros(1, 2))


def test_n_per_row_of_the_block_diagonal_mask():
    """The packed layout's n: each row counts the keys of its own sequence up to itself (within its window)."""
    runs = [(3, 5), (1, 4), (2, 2)]  # (queries, keys) per sequence: a chunk after a prefix, a decode, a prefill
    lq, lk = sum(q for q, _ in runs), sum(k for _, k in runs)
    mask = torch.full((1, 1, lq, lk), torch.finfo(torch.float32).min)
    expected, r0, c0 = [], 0, 0
    for q, k in runs:
        for i in range(q):
            visible = k - q + i + 1
            mask[0, 0, r0 + i, c0:c0 + visible] = 0
            expected.append(visible)
        r0, c0 = r0 + q, c0 + k
    keep = additive_keep(mask)
    assert keep.dtype == torch.bool and additive_keep(mask) is keep  # (one keep-mask for every layer)
    info = build_mask_info(keep, 1, 4, lq, lk, False, torch.device("cpu"))
    assert info.n.flatten().tolist() == expected


def test_declarations_are_read_from_the_normalizer_and_the_scale(monkeypatch):
    assert support("llama4_pos")[0] == "per_sequence" and support("fox")[0] == "per_sequence"
    assert support("selective")[0] == "refused" and NORMALIZERS.get("selective").continuous_batching == "refused"
    sigmoid = type(NORMALIZERS.get("sigmoid"))
    monkeypatch.setattr(sigmoid, "continuous_batching", None)
    monkeypatch.setattr(sigmoid, "query_coupled", True)  # the default follows the declared coupling of queries
    assert support("sigmoid")[0] == "refused"
    monkeypatch.setattr(sigmoid, "continuous_batching", "sometimes")
    with pytest.raises(AttnormError, match="^Sigmoid.continuous_batching is 'sometimes'; allowed: packed, "):
        support("sigmoid")


def test_without_the_names_relied_on_it_is_refused_as_before(monkeypatch):
    monkeypatch.setattr(continuous_batching, "CONTINUOUS_BATCHING_MISSING",
                        ["transformers.generation.continuous_batching.utils.attn_mask_is_needed"])
    model = build("symax")
    with pytest.raises(AttnormError, match=r"^continuous batching .* cannot run hf_attnorm's 'symax': transformers "
                                           r"\S+ lacks transformers.generation.continuous_batching.utils."
                                           "attn_mask_is_needed, .* compute softmax instead"):
        generate_batch(model)
    assert model.config._attn_implementation == "symax"


def test_other_implementations_keep_transformers_behaviour():
    model = build("sdpa")
    with record_paths() as rec:
        got = generate_batch(model)
    assert rec.packed == 0 and not rec.paths and got == generate_each(model)
    assert model.config._attn_implementation == "sdpa"


def test_no_switch_to_flash_attention_and_a_reused_manager(monkeypatch):
    """Where flash attention is installed the manager switches sdpa models to it (softmax): ours keep their name. A
    persistent manager is reused by the next call, which checks the model again."""
    from transformers.generation.continuous_batching import continuous_api

    monkeypatch.setattr(continuous_api, "is_flash_attn_3_available", lambda *a, **k: True)
    model = build("sigmoid")
    assert model._supports_flash_attn
    first = generate_batch(model, persistent_manager=True)
    assert model._cached_continuous_batching_manager is not None
    with record_paths() as rec:
        again = model.generate_batch(PROMPTS, generation_config=_generation_config(), persistent_manager=True)
    assert rec.packed > 0 and [r.generated_tokens for r in again.values()] == first == generate_each(model)
    assert model.config._attn_implementation == "sigmoid"
    model.destroy_cached_continuous_batching_manager()


@pytest.mark.slow
@needs_compile
@needs_compile_inductor
def test_the_compiled_varlen_path():
    """``default_compile_level=1`` compiles the manager's forward (torch.compile, not fullgraph): the pre-hook and the
    packed route trace, and the tokens stay equal."""
    model = build("symax")
    assert generate_batch(model, default_compile_level=1) == generate_each(model)
