"""The probes' data (answers computable from the context, no leakage between training and test data), the
char-level LM's tokenizer and data, and one probe run end to end on a micro budget."""

from __future__ import annotations

import json

import pytest
import torch

from hf_attnorm.lab.compare import charlm
from hf_attnorm.lab.evaluation import probes
from hf_attnorm.lab.evaluation.probes import IGNORE, MQAR, TEST_SEED_BASE, Passkey, make_test_set, train_seed


def brute_force_mqar_answers(spec: MQAR, x: torch.Tensor) -> list[list[int]]:
    """For each query token, scan the context for the pair with the queried key: the answer token of its value.
    Asserts that the key occurs exactly once."""
    K, V, Q = spec.num_keys, spec.num_values, spec.num_queries
    out = []
    for row in x.tolist():
        context, queries = row[:-Q], row[-Q:]
        assert all(t < K * V for t in context) and all(K * V <= t < K * V + K for t in queries)
        answers = []
        for q in queries:
            key = q - K * V
            hits = [t % V for t in context if t // V == key]
            assert len(hits) == 1, f"queried key {key} occurs {len(hits)} times in the context"
            answers.append(K * V + K + hits[0])
        out.append(answers)
    return out


@pytest.mark.parametrize("length", [16, 64, 300])
def test_mqar_answers_are_computable(length):
    spec = MQAR()
    x, y = spec.batch(length, 16, torch.Generator().manual_seed(length))
    assert x.shape == y.shape == (16, length) and int(x.max()) < spec.vocab_size
    Q = spec.num_queries
    assert bool((y[:, :-Q] == IGNORE).all()) and bool((y[:, -Q:] != IGNORE).all())
    assert y[:, -Q:].tolist() == brute_force_mqar_answers(spec, x)
    # queried keys are distinct within a sequence, and distractors never use them
    assert all(len(set(row[-Q:])) == Q for row in x.tolist())


def test_mqar_other_sizes_and_bad_settings():
    spec = MQAR(num_keys=8, num_values=3, num_queries=4)
    x, y = spec.batch(20, 8, torch.Generator().manual_seed(0))
    assert y[:, -4:].tolist() == brute_force_mqar_answers(spec, x)
    assert spec.vocab_size == 8 * 3 + 8 + 3 and spec.chance == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="num_queries must be in"):
        MQAR(num_keys=8, num_queries=8)
    with pytest.raises(ValueError, match="length must be >= 16"):
        MQAR().batch(15, 2, torch.Generator())
    with pytest.raises(ValueError, match="unknown probe 'nope'"):
        probes.make_probe("nope")


def test_passkey_answers_are_computable():
    spec = Passkey()
    F, V = spec.num_fillers, spec.num_values
    x, y = spec.batch(50, 32, torch.Generator().manual_seed(3))
    for row, target in zip(x.tolist(), y.tolist()):
        needles = [t for t in row[:-1] if F <= t < F + V]
        assert len(needles) == 1 and row[-1] == F + V
        assert target[-1] == F + V + 1 + (needles[0] - F) and set(target[:-1]) == {IGNORE}
    # the needle's depth covers the context (not always at one place)
    depths = [(row[:-1].index(next(t for t in row if F <= t < F + V))) for row in x.tolist()]
    assert len(set(depths)) > 10
    with pytest.raises(ValueError, match="num_values >= 2"):
        Passkey(num_values=1)


@pytest.mark.parametrize("probe", [MQAR(), Passkey()])
def test_no_leakage_between_training_and_test_data(probe):
    L = 32
    # training streams and test sets come from disjoint generator seeds
    assert all(train_seed(s, step) < TEST_SEED_BASE for s in range(5) for step in (0, 1, 10 ** 6))
    tests = {n: make_test_set(probe, n, 64) for n in (L, 2 * L, 4 * L)}
    for n, batches in tests.items():
        assert all(x.shape[1] == n for x, _ in batches) and sum(len(x) for x, _ in batches) == 64
    # the test set at L shares no sequence with the first training batches of seeds 0-2
    test_rows = {tuple(r) for x, _ in tests[L] for r in x.tolist()}
    train_rows = {tuple(r) for seed in range(3) for step in range(100)
                  for r in probe.batch(L, 32, torch.Generator().manual_seed(train_seed(seed, step)))[0].tolist()}
    assert not test_rows & train_rows
    # the test set is a fixed function of the length: every run is scored on the same sequences
    again = make_test_set(probe, L, 64)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(tests[L], again))
    # different seeds train on different data
    a = probe.batch(L, 4, torch.Generator().manual_seed(train_seed(0, 0)))[0]
    b = probe.batch(L, 4, torch.Generator().manual_seed(train_seed(1, 0)))[0]
    assert not torch.equal(a, b)


def test_run_probe_micro(tmp_path):
    settings = {"length": 16, "factors": [1, 2, 4], "steps": 4, "batch_size": 4, "lr": 3e-3, "warmup": 1,
                "test_sequences": 8, "shape": {"hidden": 16, "layers": 1, "heads": 2, "mlp": 32}}
    r = probes.run_probe("mqar", "ssmax", {}, 0, settings, tmp_path)
    assert r["lengths"] == [16, 32, 64] and set(r["accuracy"]) == {"16", "32", "64"}
    assert all(0.0 <= a <= 1.0 for a in r["accuracy"].values()) and r["chance"] == 0.25
    assert len(r["curve"]) == 4 and r["learned"]  # ssmax's s_h is reported
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["attnorm"]["implementation"] == "ssmax"
    # the same seed reproduces the run exactly
    assert probes.run_probe("mqar", "ssmax", {}, 0, settings)["curve"] == r["curve"]
    with pytest.raises(ValueError, match="exceeds max_positions"):
        probes.run_probe("passkey", "softmax", {}, 0, {**settings, "factors": [1, 1000]})


def test_passkey_is_learned():
    """A micro model learns the passkey task well above chance in about a second (the probe is learnable)."""
    torch.set_num_threads(1)
    settings = {"length": 16, "factors": [1], "steps": 150, "batch_size": 32, "lr": 3e-3, "warmup": 20,
                "test_sequences": 128, "shape": {"hidden": 32, "layers": 1, "heads": 2, "mlp": 64}}
    r = probes.run_probe("passkey", "softmax", {}, 0, settings)
    assert r["accuracy"]["16"] > 0.5  # chance is 1/16


def test_char_tokenizer_round_trip_and_bpe():
    text = "To be, or not to be: that is the question.\n\nHAMLET:\nAy, there's the rub.\n" * 20
    tok = charlm.train_tokenizer(text)
    alphabet = sorted(set(text))
    assert tok.get_vocab_size() == len(alphabet) + 1  # characters plus <unk>
    enc = tok.encode(text[:200])
    assert len(enc.ids) == 200 and tok.decode(enc.ids) == text[:200]
    bpe = charlm.train_tokenizer(text, vocab_size=60)
    enc = bpe.encode(text[:200])
    assert len(alphabet) + 1 < bpe.get_vocab_size() <= 60 and len(enc.ids) < 200
    assert bpe.decode(enc.ids) == text[:200]
    with pytest.raises(ValueError, match="vocab_size must be 0"):
        charlm.train_tokenizer(text, vocab_size=5)


def test_ngram_baselines_by_hand():
    train = torch.tensor([0, 1, 0, 1])
    val = torch.tensor([0, 1])
    ent = charlm.ngram_entropies(train, val, 2)
    # add-one unigram: p(0) = p(1) = 3/6 -> ln 2; bigram p(1|0) = (2 + 1) / (2 + 2) = 3/4
    assert ent["unigram"] == pytest.approx(0.6931472) and ent["bigram"] == pytest.approx(-torch.tensor(0.75).log())


def test_eval_windows_spread_and_bad_input():
    ids = torch.arange(1000)
    w = charlm.eval_windows(ids, 100, 400)
    assert w.shape == (4, 100) and w[0, 0] == 0 and w[-1, -1] == 999
    with pytest.raises(ValueError, match="fewer than"):
        charlm.eval_windows(ids[:150], 100, 400)


def test_tiny_llama_gives_length_scales_the_training_length():
    """A scale that needs L_train reads the run's training length, not max_position_embeddings (sized for the
    longest test); an explicit option wins, and implementations without the option get none."""
    from hf_attnorm.lab.tiny import ModelShape, tiny_llama

    shape = ModelShape(hidden=16, layers=1, heads=2, mlp=32, max_positions=1024)
    x = torch.randint(0, 11, (1, 40), generator=torch.Generator().manual_seed(0))

    def logits(options, train_length):
        model = tiny_llama("lssa", options, 11, shape, 0, train_length=train_length)
        return model.config.attnorm.get("train_length"), model(x).logits

    got, injected = logits(None, 64)
    assert got == 64
    assert torch.equal(injected, logits({"train_length": 64}, None)[1])
    got, explicit = logits({"train_length": 32}, 64)
    assert got == 32 and not torch.allclose(explicit, injected)
    assert not torch.allclose(logits(None, None)[1], injected)  # without it: max_position_embeddings = 1024
    plain = tiny_llama("softmax", None, 11, shape, 0, train_length=64)
    assert "train_length" not in (getattr(plain.config, "attnorm", None) or {})
