"""Scale analysis (hf_attnorm.lab.analysis, scripts/scale_analysis.py) and the empirical_max_gradient scale.

Covers: the worked irrelevant-mass numbers; alpha*(n) optimality, reference values and fitted constants; the
Monte-Carlo check of the sum p^2 approximation; the exact-objective and plug-in solvers on cases with known answers;
q/k capture on real tiny models; the empirical_max_gradient scale (fallback, interpolation, per-layer/per-head
tables, validation, save/load round trip); the script end to end on a tiny checkpoint (SmolLM2: slow).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny

import hf_attnorm
from hf_attnorm.attention import attention
from hf_attnorm.lab.analysis import scale_analysis as sa
from hf_attnorm.registry import AttnormError
from hf_attnorm.scales import max_gradient_alpha, max_gradient_condition, max_gradient_objective
from hf_attnorm.scales.empirical_max_gradient import empirical_alpha

ROOT = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # the Monte-Carlo loops are many small ops: 2 threads on a busy 2-core machine are 10-50x slower than 1
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------ irrelevant-key mass


def test_worked_numbers():
    w = sa.worked_examples()
    np.testing.assert_allclose(w["l3_scale1"], [0.107, 0.787, 0.107], atol=5e-4)
    np.testing.assert_allclose(w["l3_scale2"], [0.018, 0.965, 0.018], atol=5e-4)
    assert abs(w["l200_m10_scale1_mass"] - 0.7200) < 1e-4  # "72%"
    assert abs(w["l200_m10_scale2_mass"] - 0.2582) < 1e-4  # "25%"


@pytest.mark.parametrize("l,m,scale", [(3, 1, 1.0), (3, 1, 2.0), (200, 10, 1.0), (200, 10, 2.0), (1000, 31, 2.7)])
def test_closed_form_mass_equals_explicit_softmax(l, m, scale):  # noqa: E741
    explicit = float(sa.softmax_row(l, m, scale)[: l - m].sum())
    assert float(sa.irrelevant_mass(l, m, scale)) == pytest.approx(explicit, rel=1e-12)


def test_mass_table_k_holds_eps_and_fixed_scales_grow():
    lengths = [3, 10, 20, 200, 10000]
    rows = sa.mass_table(lengths, m_const=10, eps=0.05)
    for r in rows:
        assert r["mass_k_sqrt"] == pytest.approx(0.05, rel=1e-9)
        if r["l"] > 10:
            assert r["mass_k_const"] == pytest.approx(0.05, rel=1e-9)
        else:  # l <= m: no irrelevant key, undefined
            assert math.isnan(r["mass_k_const"]) and math.isnan(r["mass_scale1_const"])
    for key in ("mass_scale1_sqrt", "mass_scale2_sqrt"):
        values = [r[key] for r in rows]
        assert values == sorted(values) and values[-1] > values[0] + 0.5


# ------------------------------------------------------------------------------------------- analytic alpha*(n)


@pytest.mark.parametrize("dist,d", [("normal", None), ("cosine", 64), ("cosine", 128)])
@pytest.mark.parametrize("n", [40, 1000, 20000])
def test_alpha_star_first_order_condition(dist, d, n):
    a = max_gradient_alpha(float(n), dist, d, cache=False)
    assert abs(float(max_gradient_condition(a, n, dist, d)[0])) < 1e-9
    h = 1e-5 * a  # central difference of the objective itself, independent of the closed-form condition
    slope = (max_gradient_objective(a + h, n, dist, d)[0] - max_gradient_objective(a - h, n, dist, d)[0]) / (2 * h)
    assert abs(slope) < 1e-6
    f = max_gradient_objective(np.array([0.9 * a, a, 1.1 * a]), n, dist, d)
    assert f[1] > f[0] and f[1] > f[2], "alpha* is a maximum, not a minimum"


def test_alpha_star_reference_values():
    assert max_gradient_alpha(1000, "normal") == pytest.approx(2.14, abs=0.01)
    assert 25.0 <= max_gradient_alpha(1000, "cosine", head_dim=128) <= 27.0


def test_fitted_constants():
    res = sa.analytic_alpha(40, 20000, dims=(128,))
    normal, cos = res.fit("normal"), res.fit("cosine_d128")
    assert normal.constant == pytest.approx(0.84, abs=0.005)
    assert cos.constant == pytest.approx(3.5, abs=0.05)
    # the reported relative errors are those of the fitted curves
    rel = cos.constant * np.log(res.n) / res.curves["cosine_d128"] - 1
    assert cos.max_rel_error == pytest.approx(np.abs(rel).max())
    assert 0.05 < normal.max_rel_error < 0.2 and 0.1 < cos.max_rel_error < 0.35
    # weighting matters: log-spaced n give larger constants for the cosine model
    assert res.fit("cosine_d128", "log").constant > cos.constant + 0.1


# ------------------------------------------------------------------------------------------- Monte-Carlo checks


@pytest.mark.parametrize("dist,d,alpha", [("normal", None, 1.0), ("cosine", 128, math.sqrt(128))])
def test_mc_check_converges_at_fixed_alpha(dist, d, alpha):
    rows = sa.mc_check([10, 100, 1000], dist, d, alphas=[alpha], budget=1 << 20, min_rows=256, seed=1)
    err = [abs(r.rel_error) for r in rows]
    assert err[0] > 0.3 and err[0] > err[1] > err[2], err
    assert err[2] < 0.02 and err[2] < 3 * rows[2].rel_stderr + 0.005


def test_mc_check_at_alpha_star_does_not_converge():
    """The approximation overestimates sum p^2 at alpha*(n) itself, and more so as n grows (documented)."""
    rows = sa.mc_check([10, 100, 1000], "normal", alphas=["star"], budget=1 << 20, seed=2)
    err = [r.rel_error for r in rows]
    assert err[0] > 0.4 and err[0] < err[1] < err[2], err


def test_mc_optimal_alpha_two_keys_known_answer():
    """Rows [0, g]: alpha (1 - sum p^2) = 2 alpha sigma(alpha g) sigma(-alpha g), maximal at alpha g = u with
    u tanh(u / 2) = 1."""
    lo, hi = 1.0, 2.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if mid * math.tanh(mid / 2) < 1 else (lo, mid)
    u = 0.5 * (lo + hi)
    scores = torch.tensor([[[0.0, 1.0]] * 4, [[0.0, 2.5]] * 4], dtype=torch.float64)  # [G=2, R=4, n=2]
    expect = torch.tensor([u, u / 2.5], dtype=torch.float64)
    alpha, ratio = sa.mc_optimal_alpha(scores)
    torch.testing.assert_close(alpha, expect, rtol=1e-6, atol=0)
    assert (ratio > 10).all()
    # in float32 the flat top of the objective limits the resolution to ~sqrt(float32 eps)
    torch.testing.assert_close(sa.mc_optimal_alpha(scores.float())[0], expect, rtol=2e-3, atol=0)


def test_mc_optimal_alpha_flags_objective_without_interior_maximum():
    """n = 2 i.i.d. normal scores: the exact objective increases towards 1/sqrt(pi) for all alpha."""
    s = torch.randn(1, 20000, 2, generator=torch.Generator().manual_seed(0))
    alpha, _ = sa.mc_optimal_alpha(s)
    assert torch.isnan(alpha).all(), "a noisy bump on the plateau must not count as a maximum"
    assert float(sa.mc_objective(s, 50.0)[0]) == pytest.approx(1 / math.sqrt(math.pi), rel=0.03)


def test_mgf_estimator_reproduces_the_analytic_normal_optimum():
    """8 independent pools of 2^16 N(0,1) scores: the plug-in optimum scatters around the analytic alpha*(10)
    (measured: ~1.3% per pool of 2^17 scores)."""
    x = torch.randn(1 << 16, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    alpha, ess = sa.mgf_optimal_alpha(x, 10.0)
    rel = alpha / max_gradient_alpha(10.0) - 1
    assert rel.abs().max() < 0.08 and abs(float(rel.mean())) < 0.025, rel
    assert (ess > 100).all()
    # scaling the scores by c divides alpha* by c
    alpha2, _ = sa.mgf_optimal_alpha(3.0 * x, 10.0)
    torch.testing.assert_close(alpha2, alpha / 3.0, rtol=1e-4, atol=0)
    with pytest.raises(ValueError, match="more pooled scores than n"):
        sa.mgf_optimal_alpha(x[:10], 10.0)


# --------------------------------------------------------------------------------------- capture and empirical


def test_captured_scores_are_the_model_attention_scores():
    """softmax of a captured row over its visible keys equals transformers' eager attention weights (Llama GQA,
    RoPE applied), and capturing changes no output."""
    model = tiny("llama", "causal_lm", implementation="eager")
    x = torch.randint(1, 97, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(x, output_attentions=True)
    rows = sa.collect_score_rows(model.model, x, queries_per_seq=5)
    with torch.no_grad():
        after = model(x).logits
    torch.testing.assert_close(after, ref.logits, atol=0, rtol=0)
    assert [r.layer for r in rows] == [0, 1]
    for r in rows:
        assert r.scores.shape == (10, 4, 21) and r.head_dim == 8
        seq = torch.arange(10) // 5
        for i in range(10):
            pos = int(r.position[i])
            assert r.counts()[i] == pos + 1  # causal
            w = torch.softmax(torch.where(r.valid[i], r.scores[i], -torch.inf), dim=-1)
            torch.testing.assert_close(w, ref.attentions[r.layer][seq[i], :, pos], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", [("gpt2", "causal_lm"), ("bert", "encoder")])
def test_collect_score_rows_other_families(kind):
    model = tiny(*kind, implementation="softmax")
    x = torch.randint(1, 97, (1, 17), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    mask[0, :3] = 0  # left padding
    rows = sa.collect_score_rows(model, x, attention_mask=mask, queries_per_seq=4)
    assert len(rows) == 2
    counts = rows[0].counts()
    assert not rows[0].valid[:, :3].any(), "padded keys are never visible"
    if kind[0] == "bert":
        assert (counts == 14).all()
    else:
        assert int(counts.max()) == 14


def test_empirical_alpha_on_a_tiny_model_feeds_the_scale():
    model = tiny("llama", "causal_lm", implementation="sdpa")
    x = torch.randint(1, 97, (2, 48), generator=torch.Generator().manual_seed(2))
    rows = sa.collect_score_rows(model, x, queries_per_seq=16)
    mgf = sa.empirical_alpha(rows, [8, 16, 32], "mgf")
    mc = sa.empirical_alpha(rows, [8, 16, 32, 64], "mc", budget=1 << 12, min_rows=32)
    assert mgf.alpha.shape == (2, 4, 3) and np.isfinite(mgf.alpha).all() and (mgf.alpha > 0).all()
    assert np.isnan(mc.alpha[:, :, 3]).all() and (mc.sources[:, 3] == 0).all(), "no row has 64 keys"
    for per, depth in (("global", 1), ("layer", 2), ("head", 3)):
        table = mgf.table(per, source="test")
        settings = hf_attnorm.resolve_settings("empirical_max_gradient", {"empirical_alpha_table": table})
        assert settings.empirical_alpha_table == table
        assert np.ndim(table["alpha"]) == depth
    model.set_attn_implementation("sdpa")
    hf_attnorm.apply(model, "empirical_max_gradient", empirical_alpha_table=mgf.table("head"))
    with torch.no_grad():
        out = model(x).logits
    assert torch.isfinite(out).all()


# --------------------------------------------------------------------------------------- empirical_max_gradient


def _qkv(seed=0, b=2, h=4, hkv=2, lq=37, d=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, lq, d, generator=g), torch.randn(b, hkv, lq, d, generator=g),
            torch.randn(b, hkv, lq, d, generator=g))


def test_without_table_equals_analytic_normal_max_gradient():
    q, k, v = _qkv()
    ours, _ = attention(q, k, v, "empirical_max_gradient", causal=True)
    ref, _ = attention(q, k, v, "max_gradient", causal=True)
    torch.testing.assert_close(ours, ref, atol=0, rtol=0)


def test_table_interpolation_and_extrapolation():
    n = torch.tensor([[[1.0, 5.0, 10.0, math.sqrt(1000.0), 100.0, 400.0]]])
    table = {"n": [10, 100], "alpha": [1.0, 2.0]}
    normal = empirical_alpha(n, table, "normal")[0, 0]
    clamp = empirical_alpha(n, table, "clamp")[0, 0]
    a = lambda x: max_gradient_alpha(x, cache=False)  # noqa: E731
    expect_normal = [0.0, a(5) / a(10), 1.0, 1.5, 2.0, 2.0 * a(400) / a(100)]
    torch.testing.assert_close(normal, torch.tensor(expect_normal), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(clamp, torch.tensor([1.0, 1.0, 1.0, 1.5, 2.0, 2.0]), atol=1e-6, rtol=1e-6)
    counts = torch.tensor([[[2.0, 5.0, 31.0, 100.0, 400.0]]])  # key counts are integers
    single = empirical_alpha(counts, {"n": [100], "alpha": [3.0]}, "normal")[0, 0]  # a scaled normal curve
    torch.testing.assert_close(single, torch.tensor([3 * a(x) / a(100) for x in counts[0, 0].tolist()]),
                               atol=1e-5, rtol=1e-5)


def test_per_layer_and_per_head_tables_in_attention():
    q, k, v = _qkv(1)
    base = q.shape[-1] ** -0.5
    layers = {"n": [4], "alpha": [[1.0], [2.0]]}
    for layer, c in ((0, 1.0), (1, 2.0)):
        ours, _ = attention(q, k, v, "empirical_max_gradient", causal=True, empirical_alpha_table=layers,
                            empirical_extrapolation="clamp", module_info={"layer_idx": layer})
        ref, _ = attention(q, k, v, "softmax", causal=True, scaling=c * base)
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)
    heads = {"n": [4], "alpha": [[[1.0], [2.0], [1.0], [2.0]]]}
    ours, _ = attention(q, k, v, "empirical_max_gradient", causal=True, empirical_alpha_table=heads,
                        empirical_extrapolation="clamp", module_info={"layer_idx": 0, "num_heads": 4})
    for h, c in enumerate((1.0, 2.0, 1.0, 2.0)):
        ref, _ = attention(q[:, h:h + 1], k[:, h // 2:h // 2 + 1], v[:, h // 2:h // 2 + 1], "softmax", causal=True,
                           scaling=c * base)
        torch.testing.assert_close(ours[:, h:h + 1], ref, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="no layer index"):
        attention(q, k, v, "empirical_max_gradient", empirical_alpha_table=layers)
    with pytest.raises(ValueError, match="curves for 2 layers but this attention module is layer 5"):
        attention(q, k, v, "empirical_max_gradient", empirical_alpha_table=layers, module_info={"layer_idx": 5})
    with pytest.raises(ValueError, match="per-head curves for 4 heads but this attention has 6"):
        attention(q, k, v, "empirical_max_gradient", empirical_alpha_table=heads,
                  module_info={"layer_idx": 0, "num_heads": 6})


@pytest.mark.parametrize("table,message", [
    ([1, 2], "must be a JSON object"),
    ({"n": [10, 100]}, "needs keys 'n'"),
    ({"n": [10, 100], "alpha": [1.0, 2.0], "extra": 1}, "unknown key"),
    ({"n": [1, 100], "alpha": [1.0, 2.0]}, "strictly increasing with every entry > 1"),
    ({"n": [100, 10], "alpha": [1.0, 2.0]}, "strictly increasing"),
    ({"n": [10, 100], "alpha": [1.0]}, "list of 2 numbers"),
    ({"n": [10, 100], "alpha": [1.0, -2.0]}, "alpha values >= 0"),
    ({"n": [10, 100], "alpha": [1.0, float("nan")]}, "finite JSON"),
    ({"n": [10, 100], "alpha": [[1.0, 2.0], [3.0]]}, r"alpha\[1\]"),
    ({"n": [10, 100], "alpha": [[[1.0, 2.0]], [[1.0, 2.0], [1.0, 2.0]]]}, "same number of heads"),
    ({"n": [10], "alpha": [[[[1.0]]]]}, "at most 3 deep"),
    ({"n": [10], "alpha": [1.0], "source": 3}, "'source' to be a string"),
    ("{n: [10]}", "text does not parse"),
    ("[10, 20]", "must be a JSON object"),
])
def test_malformed_tables_are_rejected(table, message):
    with pytest.raises(AttnormError, match=message):
        hf_attnorm.resolve_settings("empirical_max_gradient", {"empirical_alpha_table": table})


def test_settings_copy_the_table_and_accept_json_text():
    table = {"n": [10, 100], "alpha": [1.0, 2.0]}
    settings = hf_attnorm.resolve_settings("empirical_max_gradient", {"empirical_alpha_table": table})
    from_text = hf_attnorm.resolve_settings("empirical_max_gradient", {"empirical_alpha_table": json.dumps(table)})
    assert from_text == settings  # e.g. --attnorm empirical_alpha_table='{"n": ...}' on a command line
    table["alpha"][0] = 99.0
    assert settings.empirical_alpha_table["alpha"][0] == 1.0, "the settings must not alias the caller's dict"


def test_table_round_trips_through_save_and_load(tmp_path):
    from transformers import AutoModelForCausalLM

    table = {"n": [8, 32], "alpha": [[0.5, 0.75], [1.25, 1.5]], "source": "test"}
    model = tiny("llama", "causal_lm", implementation="empirical_max_gradient",
                 attnorm={"empirical_alpha_table": table})
    x = torch.randint(1, 97, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(x).logits
        plain = tiny("llama", "causal_lm", implementation="max_gradient")(x).logits
    assert not torch.allclose(ref, plain), "the table changes the model"
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["attnorm"]
    assert saved["empirical_alpha_table"] == table
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config._attn_implementation == "empirical_max_gradient"
    assert loaded.config.attnorm["empirical_alpha_table"] == table
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, ref, atol=1e-6, rtol=0)


# --------------------------------------------------------------------------------------------------- the script


def _run_script(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "scale_analysis.py"), *args], capture_output=True,
                          text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == PNG_SIGNATURE, path


def test_script_end_to_end_on_a_tiny_checkpoint(tmp_path):
    from hf_attnorm.lab.assets import load_gpt2_tokenizer
    from hf_attnorm.lab.model_zoo import build_model

    ckpt = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_model("llama", "micro", vocab_size=50257, max_positions=256, attn_implementation="symax")
    model.save_pretrained(ckpt)
    load_gpt2_tokenizer().save_pretrained(ckpt)
    out = tmp_path / "out"
    proc = _run_script(
        "--out-dir", str(out), "--n-min", "40", "--n-max", "400", "--dims", "64,128", "--lengths", "3,200,1000",
        "--mc-ns", "10,100", "--mc-budget", "65536", "--mc-exact-ns", "100", "--model", str(ckpt),
        "--seq-len", "96", "--num-seqs", "2", "--queries-per-seq", "8", "--ns", "16,32,64,500",
        "--mc-rows-budget", "4096", "--table-per", "layer", "--save-model", str(tmp_path / "emg"))
    assert "0.7200 at scale 1, 0.2582 at scale 2" in proc.stdout
    for name in ("irrelevant_mass", "alpha_star", "mc_check", "empirical_alpha"):
        _assert_png(out / f"{name}.png")
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) >= {"mass", "alpha", "mc", "empirical"}
    assert summary["alpha"]["fits"]["cosine_d128"]["integer"]["constant"] > 0
    table = json.loads((out / "empirical_table.json").read_text())
    assert table["n"] == [16, 32, 64, 500] and len(table["alpha"]) == 2  # mgf measures any n < pooled scores
    hf_attnorm.resolve_settings("empirical_max_gradient", {"empirical_alpha_table": table})
    saved = json.loads((tmp_path / "emg" / "config.json").read_text())["attnorm"]
    assert saved["implementation"] == "empirical_max_gradient" and saved["empirical_alpha_table"] == table


def test_script_rejects_bad_arguments(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("scale_analysis_script", ROOT / "scripts" / "scale_analysis.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for args, message in ((["--parts", "mass,nope"], "unknown part"), (["--parts", "empirical"], "needs --model"),
                          (["--eps", "1.5"], "--eps must lie in"), (["--ns", "4,x"], "comma-separated integers"),
                          (["--estimators", "mc", "--model", "m"], "--table-estimator mgf is not among")):
        with pytest.raises(SystemExit) as exc:
            script.parse_args(["--out-dir", str(tmp_path), *args])
        assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_script_on_smollm2_shakespeare(tmp_path):
    out = tmp_path / "out"
    _run_script("--out-dir", str(out), "--parts", "empirical", "--model", "smollm2", "--seq-len", "256",
                "--num-seqs", "2", "--queries-per-seq", "8", "--ns", "40,100,200", "--mc-rows-budget", "8192",
                timeout=1800)
    _assert_png(out / "empirical_alpha.png")
    res = json.loads((out / "empirical_alpha.json").read_text())
    assert res["layers"] == 30 and res["heads"] == 9 and res["head_dim"] == 64
    alpha = np.array(res["results"]["mgf"]["alpha"], dtype=float)
    assert alpha.shape == (30, 9, 3) and np.isfinite(alpha).all() and (alpha > 0).all()
