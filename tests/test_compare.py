"""The main job (scripts/compare.py: hf_attnorm.lab.compare.job) end to end on the micro budget: every artifact and
its content, the cache (a second call trains nothing; a lost result re-runs alone), a failing run reported without
stopping the others, sharding, and bad input. Plus scripts/evaluate.py (hf_attnorm.lab.evaluation.swap) on a saved
model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_attnorm.lab.compare import job as compare_job
from hf_attnorm.lab.compare import report
from hf_attnorm.lab.evaluation import swap as swap_evaluation

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compare():
    return compare_job


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


IMPLS = ["softmax", "symax:eta=0.5", "ssmax"]


@pytest.fixture(scope="module")
def micro_run(compare, tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    argv = ["--budget", "micro", "--implementations", *IMPLS, "--output_dir", str(out), "--jobs", "1"]
    return out, argv, compare.run(argv)


def test_micro_budget_writes_every_artifact(micro_run):
    out, _, result = micro_run
    saved = json.loads((out / "results.json").read_text())
    assert saved["budget"] == "micro" and saved["tasks"] == ["mqar", "passkey", "lm"]
    assert not saved["failed"] and not saved["missing"]
    assert saved["seed_sets"] == [[0, 1], [2, 3]] and saved["settings"]["seed_plan"] == "adaptive"
    runs = saved["runs"]
    assert all(r["status"] == "ok" and r["cpu_seconds"] > 0 for r in runs)
    first = [r for r in runs if r["seed"] < 2]
    assert len(first) == 3 * 3 * 2  # tasks x implementations x the first set's seeds
    # the second set ran exactly where a claim check could still end in a verdict after the first
    res = report.results_from_json(saved)
    first_only = report.Results(res.records, {t: {s: ids[:2] + [None, None] for s, ids in per.items()}
                                              for t, per in res.ids.items()}, "softmax", res.sets)
    needed = report.cells_for_set(first_only, 1)
    assert {(r["task"], r["implementation"]) for r in runs if r["seed"] >= 2} == needed
    assert len(runs) == len(first) + 2 * len(needed)
    for task, per in saved["run_ids"].items():
        for spec, ids in per.items():
            assert (ids[2] is not None) == ((task, spec) in needed), (task, spec)
    by_id = {r["id"]: r for r in runs}
    probe = by_id["mqar/symax-eta-0.5/seed1"]
    assert probe["lengths"] == [16, 32] and set(probe["accuracy"]) == {"16", "32"}
    lm = by_id["lm/ssmax/seed0"]
    assert lm["contexts"] == [16, 32] and lm["vocab_size"] == 77 and lm["learned"]  # ssmax's s_h
    assert lm["ngram_nats_per_char"]["bigram"] < lm["ngram_nats_per_char"]["unigram"]
    # the option reached the model, and the model reloads with its attention
    config = json.loads((out / "runs" / "passkey" / "symax-eta-0.5" / "seed0" / "model" / "config.json").read_text())
    assert config["attnorm"]["implementation"] == "symax" and config["attnorm"]["eta"] == 0.5
    assert (out / "runs" / "lm" / "softmax" / "seed0" / "model" / "tokenizer.json").is_file()
    # tables: one row per implementation; the difference tables one row per non-reference implementation
    for task in ("mqar", "passkey", "lm"):
        rows = [x for x in saved["tables"][task].splitlines() if x.startswith("| `")]
        assert [x.split("`")[1] for x in rows] == IMPLS
        assert "symax:eta=0.5` (2 seeds)" in saved["tables"][task]  # no claim: the first set only
        assert len([x for x in saved["tables"][f"{task}_diff"].splitlines() if x.startswith("| `")]) == 2
    assert "± " in saved["tables"]["lm"]  # two seeds give an interval
    md = (out / "results.md").read_text()
    assert "### Published claims" in md and "Nakanishi 2025" in md and "reruns drawn with replacement" in md
    assert {c["implementation"] for c in saved["claims"]} == {"ssmax"}  # only claims whose implementation ran
    assert all(len(c["sets"]) == 2 and "rerun" in c for c in saved["claims"])
    assert saved["claims_summary"]["rerun"]["draws"] == 2000
    assert report.claims_table(res)[0] in md  # the claims re-render from results.json as written
    # plots: valid PNGs with one band per implementation
    for name in ("mqar_accuracy", "passkey_accuracy", "lm_loss_vs_context", "lm_val_curve"):
        info = saved["plots"][name]
        assert is_png(Path(info["path"])) and Path(info["path"]).parent == out / "plots"
        assert info["series"] == IMPLS
    # model cards of the seed-0 LMs, with the model-index and the across-seed table
    cards = [Path(c) for c in saved["model_cards"]]
    assert [c.name for c in cards] == ["compare-charlm-softmax.md", "compare-charlm-symax-eta-0.5.md",
                                       "compare-charlm-ssmax.md"]
    text = cards[1].read_text()
    assert "model-index" in text and "## Across seeds (scripts/compare.py)" in text
    assert cards[0].parent == out / "model_cards"


def test_second_call_is_cached_and_a_lost_run_reruns_alone(compare, micro_run, capsys):
    out, argv, first = micro_run
    capsys.readouterr()
    again = compare.run(argv)
    second_set = sum(r["seed"] >= 2 for r in first["runs"])
    log = capsys.readouterr().out
    assert "sweep: 18 runs, 18 cached, 0 to run" in log
    assert f"sweep: {second_set} runs, {second_set} cached, 0 to run" in log
    assert again["tables"] == first["tables"] and again["claims"] == first["claims"]
    # a sweep killed before this run finished: its result is missing, only it runs again, with the same numbers
    lost = out / "runs" / "passkey" / "ssmax" / "seed1" / "result.json"
    before = json.loads(lost.read_text())
    lost.unlink()
    third = compare.run(argv)
    assert "sweep: 18 runs, 17 cached, 1 to run" in capsys.readouterr().out
    after = json.loads(lost.read_text())
    assert after["accuracy"] == before["accuracy"] and after["curve"] == before["curve"]  # bit-reproducible
    assert third["tables"] == first["tables"]
    # a changed setting is a different run
    compare.run(argv + ["--tasks", "passkey", "--passkey_steps", "3", "--only", "passkey/softmax/seed0"])
    assert "1 to run" in capsys.readouterr().out


def test_seed_plans_all_and_claims(compare, tmp_path, capsys):
    """``--seed_plan claims`` runs the later sets for the reference and the claimed implementations on their claim
    tasks, ``all`` for every configuration; later calls use every run the cache holds."""
    base = ["--budget", "micro", "--tasks", "passkey", "--implementations", "softmax", "symax", "ssmax", "--jobs", "1",
            "--output_dir", str(tmp_path)]
    claims = compare.run(base + ["--seed_plan", "claims"])
    assert claims["settings"]["seed_plan"] == "claims"
    assert {r["id"] for r in claims["runs"] if r["seed"] >= 2} == {
        f"passkey/{s}/seed{k}" for s in ("softmax", "ssmax") for k in (2, 3)}
    capsys.readouterr()
    every = compare.run(base + ["--seed_plan", "all"])
    assert "sweep: 6 runs, 4 cached, 2 to run" in capsys.readouterr().out  # symax's second set only
    assert len(every["runs"]) == 3 * 4 and every["run_ids"]["passkey"]["symax"][3] == "passkey/symax/seed3"
    again = compare.run(base)  # adaptive, with symax's second set in the cache: it is used
    assert len(again["runs"]) == 3 * 4 and again["tables"] == every["tables"]
    with pytest.raises(SystemExit, match="multiple of --seed_sets"):
        compare.run(base + ["--seeds", "5"])


def test_failed_run_is_reported_and_the_others_finish(compare, tmp_path, monkeypatch):
    from hf_attnorm.lab.evaluation import probes

    real = probes.run_probe

    def flaky(task, name, options, seed, settings, run_dir=None):
        if name == "symax" and seed == 1:
            raise RuntimeError("boom")
        return real(task, name, options, seed, settings, run_dir)

    monkeypatch.setattr(probes, "run_probe", flaky)
    result = compare.run(["--budget", "micro", "--tasks", "passkey", "--implementations", "softmax", "symax",
                          "--output_dir", str(tmp_path), "--jobs", "1"])
    assert result["failed"] == ["passkey/symax/seed1"]
    ok = [r for r in result["runs"] if r["status"] == "ok"]
    assert len(ok) == 3 and len(result["runs"]) == 4  # symax has no claim: no second seed set
    failed = json.loads((tmp_path / "runs" / "passkey" / "symax" / "seed1" / "failed.json").read_text())
    assert failed["error"] == "RuntimeError: boom" and "Traceback" in failed["traceback"]
    assert "(1 of 2 runs missing/failed)" in result["tables"]["passkey"]
    # the next sweep retries it (and, working now, clears the failure)
    monkeypatch.setattr(probes, "run_probe", real)
    result = compare.run(["--budget", "micro", "--tasks", "passkey", "--implementations", "softmax", "symax",
                          "--output_dir", str(tmp_path), "--jobs", "1"])
    assert not result["failed"] and not (tmp_path / "runs" / "passkey" / "symax" / "seed1" / "failed.json").exists()


def test_shards_split_the_sweep(compare, tmp_path, capsys):
    base = ["--budget", "micro", "--tasks", "passkey", "--implementations", "softmax", "ssmax",
            "--output_dir", str(tmp_path), "--jobs", "1"]
    first = compare.run(base + ["--shard", "0/2"])
    log = capsys.readouterr().out
    # the shard runs only its half of each seed set; the second set is planned as "claims" (softmax and ssmax)
    assert log.count("sweep: 2 runs, 0 cached, 2 to run") == 2
    assert len(first["missing"]) == 4 and first["settings"]["seed_plan"] == "claims"
    second = compare.run(base + ["--shard", "1/2"])
    assert not second["missing"]  # the other shard's results are picked up from the shared output directory
    merged = compare.run(base + ["--aggregate_only"])
    assert merged["tables"] == second["tables"] and not merged["missing"] and merged["claims"] == second["claims"]


def test_bad_input_fails_before_training(compare, tmp_path):
    out = tmp_path / "out"
    for argv, message in [(["--implementations", "nope"], "unknown attention implementation 'nope'"),
                          (["--implementations", "symax:bogus=1"], "bogus"),
                          (["--implementations", "softmax", "softmax"], "repeats"),
                          (["--implementations", "symax", "ssmax"], "--reference 'softmax' is not in"),
                          (["--probe_length", "8"], "--probe_length must be >= 16")]:
        with pytest.raises(SystemExit, match=message):
            compare.run(["--budget", "micro", "--output_dir", str(out), *argv])
    assert not out.exists()
    for bad in (["--shard", "2/2"], ["--seeds", "0"], ["--lm_vocab", "-1"]):
        with pytest.raises(SystemExit):
            compare.run(["--budget", "micro", "--output_dir", str(out), *bad])


def test_help_documents_every_flag():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare.py"), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "--shard" in proc.stdout
    parser = compare_job.build_parser()
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help text"


@pytest.mark.slow
def test_two_worker_processes(compare, tmp_path):
    """The spawned process pool (the default --jobs 2) gives the same numbers as one process."""
    base = ["--budget", "micro", "--tasks", "passkey", "--implementations", "softmax", "sigmoid"]
    two = compare.run(base + ["--output_dir", str(tmp_path / "two"), "--jobs", "2"])
    one = compare.run(base + ["--output_dir", str(tmp_path / "one"), "--jobs", "1"])
    assert two["tables"] == one["tables"] and not two["failed"]


def test_evaluate_script_swaps_on_a_saved_model(tmp_path):
    """scripts/evaluate.py (the SmolLM2 swap experiment) on a tiny saved Llama: sdpa and hf_attnorm softmax agree,
    a swap changes the numbers, options reach the model, and the table has one row per variant."""
    from hf_attnorm.lab.data import load_tokenizer, shakespeare_text
    from hf_attnorm.lab.model_zoo import build_model

    tok = load_tokenizer("llama")
    model = build_model("llama", "micro", vocab_size=len(tok), max_positions=64, attn_implementation="sdpa")
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    (tmp_path / "text.txt").write_text(shakespeare_text("validation")[:4000], encoding="utf-8")
    result = swap_evaluation.run(["--model_name_or_path", str(tmp_path / "model"), "--text_file",
                                  str(tmp_path / "text.txt"), "--contexts", "8", "32", "--max_tokens", "96",
                                  "--variants", "sdpa", "softmax", "qwen_logn:train_length=8", "symax",
                                  "--output_dir", str(tmp_path / "out"), "--no_progress", "--threads", "2"])
    rows = {r["variant"]: r for r in result["variants"]}
    assert result["tokens_used"] == 96 and list(rows) == ["sdpa", "softmax", "qwen_logn:train_length=8", "symax"]
    for ctx in ("8", "32"):
        assert rows["softmax"]["perplexity"][ctx] == pytest.approx(rows["sdpa"]["perplexity"][ctx], rel=1e-5)
        assert rows["symax"]["perplexity"][ctx] != pytest.approx(rows["softmax"]["perplexity"][ctx], rel=1e-4)
    # qwen_logn with L_train = 8 is the identity for n <= 8: the same as softmax at context 8 and on the first
    # position bucket of the 32-token windows, different beyond (a random model reacts weakly: exact comparison)
    qwen, soft = rows["qwen_logn:train_length=8"], rows["softmax"]
    assert qwen["perplexity"]["8"] == pytest.approx(soft["perplexity"]["8"], rel=1e-6)
    assert qwen["buckets"]["32"][0]["mean_nll"] == pytest.approx(soft["buckets"]["32"][0]["mean_nll"], rel=1e-6)
    assert all(abs(q["mean_nll"] - s["mean_nll"]) > 1e-7 for q, s in zip(qwen["buckets"]["32"][1:],
                                                                          soft["buckets"]["32"][1:]))
    assert rows["qwen_logn:train_length=8"]["attnorm"]["train_length"] == 8
    table = [line for line in (tmp_path / "out" / "results.md").read_text().splitlines() if line.startswith("|")]
    assert len(table) == 2 + 4
    with pytest.raises(SystemExit, match="unknown attention implementation"):
        swap_evaluation.run(["--model_name_or_path", str(tmp_path / "model"), "--variants", "nope"])


def test_every_claim_is_a_measurement_the_main_job_makes(compare):
    """Each published claim names a registered implementation and checks that the main job measures (a task it runs,
    a measurement of that task, a direction the verdict knows)."""
    from hf_attnorm.lab.compare.report import CLAIMS, PHENOMENA
    from hf_attnorm.registry import PRESETS

    measurements = {"mqar": {"first", "longest"}, "passkey": {"first", "longest"},
                    "lm": {"first", "longest", *PHENOMENA}}
    assert set(measurements) == set(compare.TASKS)
    for claim in CLAIMS:
        assert claim["implementation"] in PRESETS, claim["implementation"]
        assert claim["claim"] and claim["source"] and claim["checks"]
        for task, which, expect in claim["checks"]:
            assert which in measurements[task], (claim["implementation"], task, which)
            assert expect in ("higher", "lower", "equal"), (claim["implementation"], expect)
