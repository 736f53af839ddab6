"""Evaluation: perplexity against hand loops, the evaluate module, length extrapolation, diagnostics, plots."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import pytest
import torch
from conftest import tiny

from hf_attnorm.lab.diagnostics import (
    attention_curves,
    diagnose,
    hidden_state_kurtosis,
    log2_bins,
    row_statistics,
)
from hf_attnorm.lab.evaluation.perplexity import (
    EvaluationError,
    causal_lm_perplexity,
    extrapolation_contexts,
    length_extrapolation,
    masked_lm_perplexity,
    sliding_windows,
)

VOCAB = 97


def token_streams(lengths=(45, 7, 70, 2), seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


@torch.no_grad()
def guide_loop(model, ids: torch.Tensor, max_length: int, stride: int) -> tuple[float, int]:
    """transformers' perplexity guide, literally (model loss with -100 labels), with the scored tokens counted from
    the labels that enter the shifted loss."""
    seq_len = ids.size(0)
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    for begin in range(0, seq_len, stride):
        end = min(begin + max_length, seq_len)
        trg_len = end - prev_end
        input_ids = ids[begin:end][None]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        n = int((target_ids[:, 1:] != -100).sum())
        if n:
            nll_sum += model(input_ids, labels=target_ids).loss.item() * n
            n_tokens += n
        prev_end = end
        if end == seq_len:
            break
    return nll_sum, n_tokens


def expected_count(length: int, max_length: int, stride: int) -> int:
    """Tokens scored: every token but the first with overlapping windows; without overlap, also not the first token
    of each window."""
    if stride < max_length:
        return length - 1
    return length - math.ceil(length / max_length)


# ------------------------------------------------------------------------------------------------ causal LM


@pytest.mark.parametrize("family,implementation,max_length,stride", [
    ("llama", "symax", 16, 16), ("llama", "symax", 16, 5), ("llama", "symax", 32, 1), ("llama", "symax", 64, 24),
    ("gpt2", "softmax", 16, 16), ("gpt2", "softmax", 24, 7), ("llama", "sigmoid", 20, 6),
])
def test_causal_perplexity_equals_guide_loop(family, implementation, max_length, stride):
    model = tiny(family, "causal_lm", implementation)
    seqs = token_streams()
    hand = [guide_loop(model, s, max_length, stride) for s in seqs]
    for batch_size in (1, 3):
        res = causal_lm_perplexity(model, input_ids=seqs, max_length=max_length, stride=stride, batch_size=batch_size)
        assert res.text_tokens == [expected_count(len(s), max_length, stride) for s in seqs]
        assert res.text_tokens == [n for _, n in hand]
        assert res.total_tokens == sum(n for _, n in hand)
        total = sum(s for s, _ in hand)
        assert res.perplexity == pytest.approx(math.exp(total / res.total_tokens), rel=1e-5)
        for (s, n), ppl in zip(hand, res.perplexities):
            assert ppl == pytest.approx(math.exp(s / n), rel=1e-5)


def test_sliding_windows_score_each_target_once():
    for length in (2, 3, 17, 64, 100):
        for max_length, stride in ((8, 8), (8, 3), (8, 1), (5, 4)):
            targets = []
            for begin, end, first in sliding_windows(length, max_length, stride):
                assert end - begin <= max_length and begin < first < end
                targets.extend(range(first, end))
            assert len(targets) == len(set(targets)) == expected_count(length, max_length, stride)


def test_text_input_and_bos():
    from transformers import AutoTokenizer

    from hf_attnorm.lab.assets import gpt2_tokenizer_path

    tok = AutoTokenizer.from_pretrained(str(gpt2_tokenizer_path()))
    model = tiny("llama", "causal_lm", "softmax1")
    model.resize_token_embeddings(len(tok))
    texts = ["To be, or not to be, that is the question:", "Whether 'tis nobler in the mind to suffer"]
    plain = causal_lm_perplexity(model, tok, texts, max_length=8, stride=4)
    bos = causal_lm_perplexity(model, tok, texts, max_length=8, stride=4, add_bos=True)
    ids = [torch.tensor(tok(t)["input_ids"]) for t in texts]
    assert plain.text_tokens == [len(x) - 1 for x in ids]
    assert bos.text_tokens == [len(x) for x in ids]  # the first real token is scored after the BOS
    same = causal_lm_perplexity(model, input_ids=[torch.cat([torch.tensor([tok.bos_token_id]), x]) for x in ids],
                                max_length=8, stride=4)
    assert bos.perplexity == pytest.approx(same.perplexity, rel=1e-6)


def test_dropout_is_off_and_training_mode_restored():
    model = tiny("gpt2", "causal_lm").train()  # GPT-2 has dropout 0.1
    seqs = token_streams((40,))
    a = causal_lm_perplexity(model, input_ids=seqs, max_length=16, stride=8)
    b = causal_lm_perplexity(model, input_ids=seqs, max_length=16, stride=8)
    assert model.training and a.perplexity == b.perplexity
    assert a.perplexity == pytest.approx(causal_lm_perplexity(model.eval(), input_ids=seqs, max_length=16,
                                                              stride=8).perplexity, rel=1e-6)


def test_bad_inputs_raise_clear_errors():
    model = tiny("llama", "causal_lm")
    seqs = token_streams((20,))
    with pytest.raises(EvaluationError, match="stride"):
        causal_lm_perplexity(model, input_ids=seqs, max_length=8, stride=9)
    with pytest.raises(EvaluationError, match="nothing to predict"):
        causal_lm_perplexity(model, input_ids=[torch.tensor([3])], max_length=8)
    with pytest.raises(EvaluationError, match="batch_size"):
        causal_lm_perplexity(model, input_ids=seqs, max_length=8, batch_size=0)
    with pytest.raises(EvaluationError, match="single string"):
        from hf_attnorm.lab.evaluation.perplexity import tokenize_texts

        tokenize_texts(None, "a string")
    gpt2 = tiny("gpt2", "causal_lm")  # 64 learned positions
    with pytest.raises(EvaluationError, match="learned absolute positions"):
        causal_lm_perplexity(gpt2, input_ids=seqs, max_length=128)
    bert = tiny("bert", "masked_lm")
    with pytest.raises(EvaluationError, match="masked LM"):
        causal_lm_perplexity(bert, input_ids=seqs, max_length=8)


# ------------------------------------------------------------------------------------------------ masked LM


@pytest.fixture(scope="module")
def bert_setup():
    from transformers import AutoTokenizer

    from hf_attnorm.lab.assets import minilm_path

    tok = AutoTokenizer.from_pretrained(str(minilm_path()))
    model = tiny("bert", "masked_lm", "sigmoid")
    model.resize_token_embeddings(len(tok))
    texts = ["Now is the winter of our discontent made glorious summer by this sun of York",
             "Friends, Romans, countrymen, lend me your ears", "Out, damned spot!"]
    return model, tok, texts


def test_masked_lm_perplexity_equals_hand_loop(bert_setup):
    model, tok, texts = bert_setup
    max_length, p, seed = 10, 0.3, 7
    res = masked_lm_perplexity(model, tok, texts, max_length=max_length, mlm_probability=p, seed=seed, batch_size=4)
    # hand loop: same draw order (chunk by chunk, text order), loss from the model's own -100 labels
    gen = torch.Generator().manual_seed(seed)
    total, count = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            for start in range(0, len(ids), max_length - 2):
                chunk = torch.tensor([tok.cls_token_id, *ids[start:start + max_length - 2], tok.sep_token_id])
                pick = torch.rand(len(chunk) - 2, generator=gen) < p
                if not pick.any():
                    pick[torch.randint(len(chunk) - 2, (1,), generator=gen)] = True
                labels = torch.full_like(chunk, -100)
                inputs = chunk.clone()
                pos = torch.nonzero(pick).flatten() + 1
                labels[pos] = chunk[pos]
                inputs[pos] = tok.mask_token_id
                n = len(pos)
                total += model(inputs[None], labels=labels[None]).loss.item() * n
                count += n
    assert res.total_tokens == count
    assert res.perplexity == pytest.approx(math.exp(total / count), rel=1e-5)
    again = masked_lm_perplexity(model, tok, texts, max_length=max_length, mlm_probability=p, seed=seed, batch_size=1)
    assert again.perplexity == pytest.approx(res.perplexity, rel=1e-6)  # masks do not depend on the batch size
    other = masked_lm_perplexity(model, tok, texts, max_length=max_length, mlm_probability=p, seed=seed + 1)
    assert other.total_tokens != res.total_tokens or other.perplexity != pytest.approx(res.perplexity, rel=1e-9)


def test_pseudo_perplexity_equals_hand_loop(bert_setup):
    model, tok, texts = bert_setup
    res = masked_lm_perplexity(model, tok, texts[1:], max_length=64, pseudo=True, batch_size=5)
    total, count = 0.0, 0
    with torch.no_grad():
        for text in texts[1:]:
            chunk = torch.tensor(tok(text)["input_ids"])  # [CLS] ... [SEP]
            for i in range(1, len(chunk) - 1):
                x = chunk.clone()
                x[i] = tok.mask_token_id
                labels = torch.full_like(chunk, -100)
                labels[i] = chunk[i]
                total += model(x[None], labels=labels[None]).loss.item()
                count += 1
    assert res.total_tokens == count and res.mode == "pseudo"
    assert res.perplexity == pytest.approx(math.exp(total / count), rel=1e-5)


# ------------------------------------------------------------------------------------------- evaluate module


def test_evaluate_module_object_and_checkpoint(tmp_path, monkeypatch):
    import evaluate

    from hf_attnorm.lab.evaluation.metrics import perplexity_module_path

    monkeypatch.setattr(evaluate.config, "HF_MODULES_CACHE", tmp_path / "modules")  # nothing in ~/.cache
    from transformers import AutoTokenizer

    from hf_attnorm.lab.assets import gpt2_tokenizer_path

    tok = AutoTokenizer.from_pretrained(str(gpt2_tokenizer_path()))
    model = tiny("llama", "causal_lm", "symax")
    model.resize_token_embeddings(len(tok))
    texts = ["Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace from day to day",
             "If music be the food of love, play on"]
    metric = evaluate.load(perplexity_module_path(), cache_dir=str(tmp_path / "cache"))
    out = metric.compute(predictions=texts, model=model, tokenizer=tok, max_length=8, stride=3, batch_size=2)
    direct = causal_lm_perplexity(model, tok, texts, max_length=8, stride=3)
    assert out["perplexity"] == pytest.approx(direct.perplexity, rel=1e-6)
    assert out["total_tokens"] == direct.total_tokens == sum(len(tok(t)["input_ids"]) - 1 for t in texts)
    assert out["mean_perplexity"] == pytest.approx(sum(direct.perplexities) / 2, rel=1e-6)
    # a checkpoint path keeps its attention (symax) on reload, and attnorm= overrides its settings
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    reloaded = metric.compute(predictions=texts, model_id=str(tmp_path / "ckpt"), max_length=8, stride=3)
    assert reloaded["perplexity"] == pytest.approx(out["perplexity"], rel=1e-6)
    changed = metric.compute(predictions=texts, model_id=str(tmp_path / "ckpt"), attnorm={"eta": 0.01},
                             max_length=8, stride=3)
    assert changed["perplexity"] != pytest.approx(out["perplexity"], rel=1e-4)
    as_softmax = metric.compute(predictions=texts, model_id=str(tmp_path / "ckpt"), attn_implementation="softmax",
                                max_length=8, stride=3)
    assert as_softmax["perplexity"] != pytest.approx(out["perplexity"], rel=1e-4)
    with pytest.raises(EvaluationError, match="masked LMs only"):
        metric.compute(predictions=texts, model=model, tokenizer=tok, pseudo_perplexity=True)


# ------------------------------------------------------------------------------------------ extrapolation


def test_extrapolation_report_shape_and_consistency():
    model = tiny("llama", "causal_lm", "softmax")
    stream = token_streams((330,), seed=3)[0]
    L = 8
    rep = length_extrapolation(model, stream, L, (8, 1, 4, 2), batch_size=8)
    contexts = [c.context for c in rep.contexts]
    assert contexts == [8, 16, 32, 64] and contexts == sorted(set(contexts))
    assert rep.tokens_used == 320 and rep.position_encoding == "rope"
    for c in rep.contexts:
        assert c.status == "ok" and c.windows == 320 // c.context
        assert [(b["start"], b["end"]) for b in c.buckets] == [(s, s + L) for s in range(0, c.context, L)]
        assert sum(b["tokens"] for b in c.buckets) == c.tokens == (c.context - 1) * c.windows
        weighted = sum(b["mean_nll"] * b["tokens"] for b in c.buckets) / c.tokens
        assert weighted == pytest.approx(c.mean_nll, rel=1e-9)
        # the same number as the sliding-window evaluation without overlap on the same tokens
        same = causal_lm_perplexity(model, input_ids=list(stream[:320].view(-1, c.context)), max_length=c.context,
                                    batch_size=8)
        assert same.perplexity == pytest.approx(c.perplexity, rel=1e-5)


def test_extrapolation_learned_positions_are_skipped():
    model = tiny("gpt2", "causal_lm")  # 64 learned positions
    rep = length_extrapolation(model, token_streams((300,))[0], 16, (1, 2, 4, 8))
    status = {c.context: (c.status, c.untrained_positions) for c in rep.contexts}
    assert status == {16: ("ok", False), 32: ("ok", True), 64: ("ok", True), 128: ("skipped", False)}
    assert "64 positions" in rep.contexts[-1].reason and rep.contexts[-1].perplexity is None
    assert rep.position_encoding == "absolute" and rep.position_limit == 64 and rep.tokens_used == 256


def test_spread_chunks_cover_the_stream():
    from hf_attnorm.lab.evaluation.perplexity import spread_chunks

    ids = torch.arange(1000)
    out = spread_chunks(ids, 64, 256)
    chunks = out.view(-1, 64)
    assert len(chunks) == 4 and chunks[0, 0] == 0 and chunks[-1, -1] == 999  # first and last token included
    assert all(bool((c == torch.arange(c[0], c[0] + 64)).all()) for c in chunks)  # each chunk contiguous
    assert len(spread_chunks(ids, 64, 10_000)) == 15 * 64  # capped by the stream
    with pytest.raises(EvaluationError, match="at least one chunk"):
        spread_chunks(ids, 64, 63)


def test_extrapolation_contexts_validation():
    assert extrapolation_contexts(10, [4, 1, 2, 2]) == [(10, 1.0), (20, 2.0), (40, 4.0)]
    with pytest.raises(EvaluationError, match="train_length"):
        extrapolation_contexts(1, [1])
    with pytest.raises(EvaluationError, match="factors"):
        extrapolation_contexts(8, [])
    with pytest.raises(EvaluationError, match="contexts >= 2"):
        extrapolation_contexts(8, [-1])
    with pytest.raises(EvaluationError, match="at least 64 tokens"):
        length_extrapolation(tiny("llama", "causal_lm"), torch.zeros(40, dtype=torch.long), 8)


# --------------------------------------------------------------------------------------------- diagnostics


def hand_pattern(L: int = 8, B: int = 2) -> torch.Tensor:
    """Head 0: uniform over the visible keys; head 1: all mass on the newest key; head 2: uniform with half the
    mass; head 3: nothing (zero rows) except the first key of rows with an even index."""
    keep = torch.ones(L, L).tril()
    w = torch.zeros(B, 4, L, L)
    w[:, 0] = keep / keep.sum(-1, keepdim=True)
    w[:, 1] = torch.eye(L)
    w[:, 2] = 0.5 * w[:, 0]
    w[:, 3, ::2, 0] = 1.0
    return w


def test_diagnostics_on_hand_built_pattern():
    L = 8
    w = hand_pattern(L)
    keep = torch.ones(L, L, dtype=torch.bool).tril()[None]
    curves = attention_curves(w, keep)
    ln = [math.log(n) for n in range(1, L + 1)]
    assert curves.n == list(range(1, L + 1)) and curves.rows == [2] * L
    assert curves.entropy[0] == pytest.approx(ln, abs=1e-6)  # uniform: ln n
    assert curves.max_weight[0] == pytest.approx([1 / n for n in range(1, L + 1)], abs=1e-6)
    assert curves.first_mass[0] == pytest.approx([1 / n for n in range(1, L + 1)], abs=1e-6)
    assert curves.entropy[1] == pytest.approx([0.0] * L, abs=1e-9)  # a delta has no entropy
    assert curves.first_mass[1] == pytest.approx([1.0] + [0.0] * (L - 1))
    assert curves.entropy[2] == pytest.approx(ln, abs=1e-6)  # entropy of the renormalised row
    assert curves.mass[2] == pytest.approx([0.5] * L, abs=1e-6)
    assert curves.entropy[3][::2] == pytest.approx([0.0] * (L // 2))  # rows 0, 2, 4, 6 hold a delta
    assert all(math.isnan(v) for v in curves.entropy[3][1::2])  # rows with no mass have no entropy
    assert curves.zero_mass_rows == [0, 0, 0, 2 * L // 2]
    summary = curves.summary()
    assert summary[0]["entropy_over_log_n"] == pytest.approx(1.0)
    assert summary[1]["sink_share"] == pytest.approx(1 / L)  # only the n = 1 row's delta sits on key 0
    binned = curves.binned(log2_bins(L))
    assert binned["n_lo"] == [1, 2, 3, 5] and binned["n_hi"] == [1, 2, 4, 8]
    # signed weights (Cog, differential attention) are read by magnitude: negating every weight changes nothing
    signed, plain = row_statistics(-w, keep), row_statistics(w, keep)
    for name in ("entropy", "max_weight", "first_mass", "mass"):
        torch.testing.assert_close(signed[name], plain[name], equal_nan=True)


def test_entropy_curve_log_binning():
    from hf_attnorm.lab.diagnostics import Diagnostics, log_bins

    L = 40
    keep = torch.ones(L, L, dtype=torch.bool).tril()[None]
    uniform = (keep / keep.sum(-1, keepdim=True))[:, None].expand(1, 2, L, L).float()
    diag = Diagnostics("hand", [attention_curves(uniform, keep)] * 2, [])
    n, ent = diag.entropy_curve()
    assert n == list(range(1, L + 1)) and ent == pytest.approx([math.log(v) for v in n], abs=1e-6)
    edges = log_bins(L, 4)
    assert edges[0] == 1 and edges[-1] > L and all(b > a for a, b in zip(edges, edges[1:]))
    xs, ys = diag.entropy_curve(per_octave=4)
    assert len(xs) == len(edges) - 1 and xs == sorted(xs) and xs[0] == 1.0
    for x, y, lo, hi in zip(xs, ys, edges, edges[1:]):  # a bin's mean of ln n lies between its ends
        assert lo <= x < hi and math.log(lo) - 1e-9 <= y <= math.log(min(hi - 1, L)) + 1e-9


def test_kurtosis_known_values():
    D = 64
    spike = torch.zeros(1, 3, D)
    spike[..., 5] = 7.0
    k = hidden_state_kurtosis(spike)
    assert k["kurtosis"] == pytest.approx(((D - 1) ** 3 + 1) / (D * (D - 1)))  # one outlier feature
    assert k["max_abs"] == 7.0
    pm = torch.tensor([1.0, -1.0] * (D // 2)).view(1, 1, D)
    assert hidden_state_kurtosis(pm)["kurtosis"] == pytest.approx(1.0)


@pytest.mark.parametrize("family,task,implementation", [("llama", "causal_lm", "softmax"),
                                                        ("llama", "causal_lm", "sigmoid"),
                                                        ("gpt2", "causal_lm", "sdpa"),
                                                        ("bert", "encoder", "symax")])
def test_diagnose_real_tiny_models(family, task, implementation):
    model = tiny(family, task, implementation)
    L = 12
    ids = torch.randint(0, VOCAB, (2, L))
    mask = torch.ones(2, L, dtype=torch.long)
    mask[1, 9:] = 0
    d = diagnose(model, ids, attention_mask=mask)
    assert model.config._attn_implementation == implementation  # sdpa was switched to eager and back
    assert len(d.layers) == model.config.num_hidden_layers and len(d.hidden) == len(d.layers) + 1
    causal = family != "bert"
    for layer in d.layers:
        assert layer.num_heads == model.config.num_attention_heads
        if causal:
            assert layer.n == list(range(1, L + 1)) and layer.rows == [2] * 9 + [1] * 3
        else:
            assert layer.n == [9, L] and layer.rows == [9, L]
        for h in range(layer.num_heads):
            for n, e in zip(layer.n, layer.entropy[h]):
                assert -1e-9 <= e <= math.log(n) + 1e-6
            if implementation in ("softmax", "sdpa"):
                assert layer.mass[h] == pytest.approx([1.0] * len(layer.n), abs=1e-5)
    n, ent = d.entropy_curve()
    assert len(n) == len(ent) and json_ok(d.summary())


def json_ok(obj) -> bool:
    import json

    json.dumps(obj, allow_nan=True)
    return True


# ------------------------------------------------------------------------------------------------- plots


def png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG file"
    return struct.unpack(">II", head[16:24])


def test_plots_are_png_with_expected_series(tmp_path):
    import matplotlib.image

    from hf_attnorm.lab import plots

    runs = ["softmax", "symax", "ssmax"]
    infos = [
        plots.plot_validation_loss({r: [[10, 5.0 - i], [20, 4.0 - i], [30, 3.5 - i]] for i, r in enumerate(runs)},
                                   tmp_path / "val.png"),
        plots.plot_perplexity_vs_context({r: [(64, 30.0 + i), (256, 40.0), (512, None)] for i, r in enumerate(runs)},
                                         tmp_path / "ctx.png", train_length=64),
        plots.plot_position_buckets({r: [{"start": 0, "end": 64, "mean_nll": 3.0},
                                         {"start": 64, "end": 128, "mean_nll": 3.5 + i}] for i, r in enumerate(runs)},
                                    tmp_path / "buckets.png", train_length=64),
        plots.plot_entropy_vs_n({r: ([1.0, 2.5, 10.3, 99.5], [0.0, 0.5, 1.2, 2.0]) for r in runs},
                                tmp_path / "entropy.png", train_length=64),
    ]
    for info in infos:
        w, h = png_size(info.path)
        assert w > 100 and h > 100
        assert matplotlib.image.imread(info.path).shape[:2] == (h, w)
    assert [i.series for i in infos[:3]] == [runs] * 3
    assert infos[3].series == [*runs, "uniform: ln n"]
    with pytest.raises(ValueError, match="no runs"):
        plots.plot_validation_loss({}, tmp_path / "x.png")


def test_load_model_is_the_one_loader(tmp_path):
    """LM head from the config (hf.families.lm_task), or the base model for attention analyses."""
    from hf_attnorm.lab.evaluation.perplexity import EvaluationError, load_model
    from hf_attnorm.lab.model_zoo import build_model

    fixture = Path(__file__).resolve().parent / "fixtures" / "written_by_e546e6f" / "gpt2_ssmax"
    lm = load_model(fixture)
    base = load_model(fixture, head=False, dtype=torch.float32)
    assert type(lm).__name__ == "GPT2LMHeadModel" and type(base).__name__ == "GPT2Model"
    assert not lm.training and base.config._attn_implementation == lm.config._attn_implementation
    assert base.config.attnorm["implementation"] == "ssmax"
    encoder = build_model("bert", task="encoder", vocab_size=64, max_positions=32)
    encoder.save_pretrained(tmp_path / "bert")  # architectures ["BertModel"]: no head, an encoder family
    assert type(load_model(tmp_path / "bert")).__name__ == "BertForMaskedLM"
    assert type(load_model(tmp_path / "bert", head=False)).__name__ == "BertModel"
    with pytest.raises(EvaluationError, match="no config.json"):
        load_model(tmp_path / "nothing")
