"""What we publish is generated and checked: the README's and docs' generated blocks equal what the code and the
measured JSON say (scripts/render_readme.py), the user documents carry no process notes, every method names its
paper, and LICENSE / CITATION.cff are there and well-formed."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hf_attnorm
from hf_attnorm.attention import param_specs
from hf_attnorm.registry import NORMALIZERS, SCALES
from hf_attnorm.settings import resolve_settings

ROOT = Path(__file__).resolve().parents[1]

#: blocks the README must carry (removing one would silently un-generate a table)
README_BLOCKS = {"versions", "implementations", "families", "learned", "main-job", "performance"}

#: what does not belong in a user document: notes about how the project was worked on
PROCESS_PATTERNS = [
    r"\bissues? #?\d+", r"\bissue's\b", r"\bthe helper\b", r"\bhelper's\b", r"\bsessions?\b",
    r"\bI (?:checked|measured|ran|found|tried)\b", r"\bengineers?\b", r"\bfinal report\b", r"\bthis task\b",
    r"\blent to\b", r"\bthe lead\b", r"\bthis branch\b", r"\bissue-\d+", r"\bof branch\b",
]


def _renderer():
    name = "render_readme_script"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "render_readme.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def user_documents() -> list[Path]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "bench").rglob("README.md")),
            *sorted((ROOT / "model_cards").glob("*.md"))]
    return [d for d in docs if d.is_file()]


def test_generated_blocks_equal_their_generators():
    render = _renderer()
    documents = [ROOT / d for d in render.DOCUMENTS]
    blocks = {m.group("name") for d in documents for m in render.BLOCK.finditer(d.read_text())}
    assert blocks == set(render.GENERATORS), "every generator is used in a document, and only known blocks exist"
    diffs = render.check(documents)
    assert not diffs, ("a generated block differs from its generator; run `python scripts/render_readme.py`:\n"
                       + "\n".join(diffs))


def test_readme_carries_every_generated_block():
    text = (ROOT / "README.md").read_text()
    names = {m.group("name") for m in _renderer().BLOCK.finditer(text)}
    assert README_BLOCKS <= names, f"README.md lacks generated blocks {sorted(README_BLOCKS - names)}"


def test_every_readme_table_is_generated():
    text = (ROOT / "README.md").read_text()
    outside = _renderer().BLOCK.sub("", text)
    tables = [line for line in outside.splitlines() if line.startswith("|")]
    assert not tables, f"README table rows outside generated blocks: {tables[:3]}"


def test_check_catches_a_pasted_row(tmp_path):
    """A benchmark row pasted over an implementation row (how the README was once corrupted) fails the check."""
    render = _renderer()
    text = (ROOT / "README.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `symax` |"))
    corrupted = tmp_path / "README.md"
    corrupted.write_text(text.replace(row, "| `symax` | fused_cpu | 0.76 | 0.81 | 7.2 | 1.9e-06 (3.9e-06) |", 1))
    diffs = render.check([corrupted])
    assert len(diffs) == 1 and "-| `symax` | fused_cpu | 0.76" in diffs[0] and "+" + row in diffs[0]
    assert render.check([ROOT / "README.md"]) == []


def test_unclosed_or_unknown_block_is_an_error(tmp_path):
    render = _renderer()
    with pytest.raises(SystemExit, match="unknown generated block 'nonsense'"):
        render.render("<!-- generated:nonsense -->\n<!-- /generated:nonsense -->\n")
    with pytest.raises(SystemExit, match="markers"):
        render.render("<!-- generated:options -->\nno closing marker\n")


def test_readme_is_short_and_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    blocks = re.findall(r"```bash\n(.*?)\n```", text, re.S)
    assert blocks[0].endswith("python scripts/compare.py")
    assert blocks[1].endswith('python -m pytest -m "not slow" -n auto')
    ci = (ROOT / ".ci" / "run").read_text()
    assert blocks[1] in ci.splitlines(), ".ci/run must run the README's test command verbatim"


def test_learned_values_list_is_complete():
    """Every per-head value any normalizer, scale or the memory option creates is in the README's list."""
    from hf_attnorm.__main__ import learned_list

    names = {p.name for obj in (*NORMALIZERS._items.values(), *SCALES._items.values()) for p in obj.params}
    names |= {p.name for p in param_specs(resolve_settings("softmax", {"num_mem_kv": 1}))}
    listed = learned_list()
    readme = (ROOT / "README.md").read_text()
    for name in names:
        assert f"`{name}`: " in listed and f"`{name}`: " in readme, name


@pytest.mark.parametrize("kind", ["normalizer", "scale"])
def test_every_method_names_its_paper(kind):
    registry = NORMALIZERS if kind == "normalizer" else SCALES
    from hf_attnorm.__main__ import implementations_table

    table = implementations_table()
    for name, obj in registry.items():
        paper = obj.paper
        assert paper, f"{kind} {name!r} declares no paper (class attribute `paper`)"
        assert "http" in paper or paper.startswith("no paper") or "transformers" in paper, (kind, name, paper)
        assert paper.split(",")[0] in table, (kind, name)


def code_files() -> list[Path]:
    """The package, the scripts and the tests (this file excepted: it holds the patterns and their samples)."""
    here = Path(__file__).resolve()
    return [p for d in ("hf_attnorm", "scripts", "tests") for p in sorted((ROOT / d).rglob("*"))
            if p.is_file() and p.suffix in (".py", ".cpp", ".h", ".sh", ".md") and p.resolve() != here]


def test_user_documents_and_code_carry_no_process_notes():
    found = []
    for doc in [*user_documents(), *code_files()]:
        for lineno, line in enumerate(doc.read_text().splitlines(), 1):
            for pattern in PROCESS_PATTERNS:
                if re.search(pattern, line, re.I):
                    found.append(f"{doc.relative_to(ROOT)}:{lineno}: {line.strip()[:100]}")
    assert not found, "process notes in user documents or code:\n" + "\n".join(found)


def test_process_scan_catches_each_pattern():
    samples = ["issue 16's rows", "the issue's fix", "the helper measured", "the helper's run", "this session",
               "I checked it", "five other engineers", "the final report", "none was lent to this task",
               "the lead adjusts", "before this branch", "before the issue-13 restructure", "commits of branch hmkv"]
    for text in samples:
        assert any(re.search(p, text, re.I) for p in PROCESS_PATTERNS), text
    for text in ["three tasks", "task: causal_lm", "helpers as plain functions", "silently"]:
        assert not any(re.search(p, text, re.I) for p in PROCESS_PATTERNS), text


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file (lowercase, punctuation dropped, spaces to hyphens)."""
    heads = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_relative_links_in_user_documents_exist():
    missing = []
    for doc in user_documents():
        for m in re.finditer(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", doc.read_text()):
            target, anchor = m.group(1), m.group(2)
            if "://" in target or target.startswith("mailto:"):
                continue
            path = doc.parent / target if target else doc
            if not path.exists():
                missing.append(f"{doc.relative_to(ROOT)} -> {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                missing.append(f"{doc.relative_to(ROOT)} -> {target}#{anchor}")
    assert not missing, "broken links:\n" + "\n".join(missing)


def test_published_evidence_is_not_git_ignored():
    """Everything under bench/, docs/ and model_cards/ ships with a clone: a file there that .gitignore matches
    exists on the machine that measured it and is missing from every checkout, so the tables built from it break."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files", "--others", "--ignored", "--exclude-standard", "--",
                             "bench", "docs", "model_cards", "README.md"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    ignored = [p for p in listed if "__pycache__" not in p]
    assert not ignored, "published files that .gitignore hides from every clone:\n" + "\n".join(ignored[:20])


def test_docs_list_the_main_jobs_default_implementations():
    """docs/evaluation.md names the default implementations of scripts/compare.py by hand: they must agree."""
    from hf_attnorm.lab.compare.job import DEFAULT_IMPLEMENTATIONS

    text = (ROOT / "docs" / "evaluation.md").read_text()
    listed = re.search(r"\(default (`.*?); any", text, re.S)
    assert listed, "docs/evaluation.md no longer lists the default implementations as '(default `a`, ...; any'"
    assert re.findall(r"`([^`]+)`", listed.group(1)) == DEFAULT_IMPLEMENTATIONS


def test_versions_line_reads_supported(monkeypatch):
    """The README's Supported line is generated from hf_attnorm.supported, the data .ci/run installs."""
    from hf_attnorm import supported
    from hf_attnorm.__main__ import torch_features_sentence, versions_line
    from hf_attnorm.torch_compat import TORCH_FEATURES

    monkeypatch.setattr(supported, "CI_ENVIRONMENTS", {
        "floor": ({"torch": "2.1.0", "triton": "2.9.0", "transformers": "5.0.0"}, "lowest",
                  ("torch", "transformers"))})
    monkeypatch.setattr(supported, "MIN_TORCH", "2.1.0")
    line = versions_line()
    assert line.startswith("Supported: Python >= 3.10; torch >= 2.1.0, no upper cap;")
    assert (f"on torch 2.1.0 / triton 2.9.0 / transformers 5.0.0 (lowest): {supported.CI_GROUPS['torch']} and "
            f"{supported.CI_GROUPS['transformers']}. ") in line
    # then each feature that needs a newer torch, with that torch (hf_attnorm.torch_compat's declarations)
    assert line.endswith(torch_features_sentence())
    for feature in TORCH_FEATURES:
        assert f"{feature.name} needs torch >= {feature.since}" in line
    assert f"whole suite on torch {supported.MAIN_TORCH} (CPU build) with triton {supported.TESTED_TRITON}" in line


def test_documented_example_value():
    """The one hand-written number in docs/scale_analysis.md's example is what the code returns."""
    from hf_attnorm.scales import max_gradient_alpha

    assert "max_gradient_alpha(1000, dist=\"cosine\", head_dim=128)        # 26.02" in (
        ROOT / "docs" / "scale_analysis.md").read_text()
    assert f"{max_gradient_alpha(1000, dist='cosine', head_dim=128):.2f}" == "26.02"


def test_license_and_citation():
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()
    text = (ROOT / "CITATION.cff").read_text()
    try:
        import yaml
    except ImportError:  # pyyaml is not a dependency: check the required keys by their lines
        data = dict(re.findall(r"^([a-z-]+):\s*\"?([^\"\n]*)\"?$", text, re.M))
        assert "authors" in re.findall(r"^([a-z-]+):", text, re.M)
    else:
        data = yaml.safe_load(text)
        assert data["authors"] and all("name" in a or "family-names" in a for a in data["authors"])
    assert str(data["cff-version"]) == "1.2.0"
    assert data["message"] and data["title"]
    assert str(data["version"]) == hf_attnorm.__version__
    assert data["license"] == "Apache-2.0"


def test_the_speed_goal_table_measures_every_implementation_and_explains_every_miss():
    """The published benchmark covers every registered implementation, and every row that misses its goal says why
    (``hf_attnorm.lab.speed.goals.why``): a new implementation, or a slower row, fails here until the benchmark is
    re-run and the miss explained."""
    table = _renderer().speed_goals()
    assert "not measured in this run" not in table, [ln for ln in table.splitlines() if "not measured" in ln]
    assert "NO REASON RECORDED" not in table, [ln.split("|")[1] for ln in table.splitlines()
                                               if "NO REASON RECORDED" in ln]
    rows = [ln for ln in table.splitlines() if ln.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == list(hf_attnorm.available())


def test_speed_goals_mark_misses_by_class():
    """The goal classes: the softmax family within 1.05x, other maps within 1.0x, decode within 1.10x, linear below 1
    from 2,048 keys only."""
    from hf_attnorm.lab.speed import goals as goals

    assert goals.prefill_goal("ssmax") == 1.05 and goals.prefill_goal("symax") == 1.0
    assert goals.misses("ssmax", {("fwd", 1024): 1.04}, {512: 1.09}) == []
    assert goals.misses("ssmax", {("fwd+bwd", 4096): 1.06}, {512: 1.11}) == ["fwd+bwd n=4096 1.06x",
                                                                            "decode L=512 1.11x"]
    assert goals.misses("symax", {("fwd", 1024): 1.01}, {}) == ["fwd n=1024 1.01x"]
    assert goals.misses("linear", {("fwd", 1024): 3.0, ("fwd", 4096): 0.5}, {512: 2.0, 8192: 0.4}) == []
    assert goals.misses("linear", {("fwd", 4096): 1.0}, {2048: 1.2}) == ["fwd n=4096 1.00x", "decode L=2048 1.20x"]


def test_the_goal_table_takes_a_recheck_of_its_own_run_only(tmp_path, monkeypatch):
    """Rows timed again right after the published kernel run (more pairs) replace that run's prefill ratios and are
    marked; a recheck of another shape, or older than the run, is ignored."""
    render = _renderer()
    kern = json.loads((ROOT / render.SPEED_RUNS["kernels"]).read_text())
    row = dict(next(r for r in kern["rows"] if r["row"] == "softmax" and r["path"] != "reference"))
    row["fwd_ratio"] = 9.99
    recheck = {"meta": {**kern["meta"], "date": "2999-01-01 00:00 UTC", "repeats": 9, "command": "recheck"},
               "rows": [row]}
    path = tmp_path / "recheck.json"
    monkeypatch.setitem(render.SPEED_RUNS, "kernels_recheck", str(path))
    monkeypatch.setattr(render, "ROOT", ROOT)
    for meta, used in [(recheck["meta"], True), ({**recheck["meta"], "date": "2000-01-01 00:00 UTC"}, False),
                       ({**recheck["meta"], "H": kern["meta"]["H"] + 1}, False)]:
        path.write_text(json.dumps({**recheck, "meta": meta}))
        table = render.speed_goals()
        softmax = next(ln for ln in table.splitlines() if ln.startswith("| `softmax`"))
        assert ("9.99" in softmax and "†" in softmax) == used, (meta, softmax)
        assert ("with 9 pairs" in table) == used


def test_the_goal_table_adds_implementations_timed_after_its_run_only(tmp_path, monkeypatch):
    """A kernel run of implementations registered after the published run (same command, restricted to them) adds
    their rows, marked; it never replaces a row the published run has, and one of another shape or older than the
    run is ignored. (The published run with one implementation taken out stands for a run made before it was
    registered.)"""
    render = _renderer()
    kern = json.loads((ROOT / render.SPEED_RUNS["kernels"]).read_text())
    name = next(r["row"] for r in reversed(kern["rows"]) if r["row"] != "softmax")
    published = tmp_path / "published.json"
    published.write_text(json.dumps({**kern, "rows": [r for r in kern["rows"] if r["row"] != name]}))
    softmax_rows = [dict(r, fwd_ratio=9.99) for r in kern["rows"] if r["row"] == "softmax"]
    later = {**kern["meta"], "date": "2999-01-01 00:00 UTC", "command": "added"}
    path = tmp_path / "added.json"
    monkeypatch.setitem(render.SPEED_RUNS, "kernels", str(published))
    monkeypatch.setitem(render.SPEED_RUNS, "kernels_added", str(path))
    monkeypatch.setattr(render, "ROOT", ROOT)
    for meta, used in [(later, True), ({**later, "date": "2000-01-01 00:00 UTC"}, False),
                       ({**later, "d": kern["meta"]["d"] * 2}, False)]:
        path.write_text(json.dumps({"meta": meta, "rows": [*(r for r in kern["rows"] if r["row"] == name),
                                                           *softmax_rows]}))
        table = render.speed_goals()
        row = next(ln for ln in table.splitlines() if ln.startswith(f"| `{name}`"))
        assert ("‡" in row and "not measured" not in row) == used, (meta, row)
        softmax = next(ln for ln in table.splitlines() if ln.startswith("| `softmax`"))
        assert "9.99" not in softmax and "‡" not in softmax


def test_the_gpu_goal_table_judges_a_run_with_anchors(monkeypatch):
    """The GPU goal table from a run with the anchors (here a made-up one): each implementation's ratios at the
    goal lengths, over its anchor where it has one, a miss without a recorded reason shown as such; without such a
    run, the goals alone and where the table will come from."""
    from hf_attnorm.lab.speed import goals as goals
    from hf_attnorm.lab.speed import gpu_anchors

    render = _renderer()
    monkeypatch.setattr(render, "_gpu_run", lambda: None)
    empty = render.gpu_goals()
    assert "No GPU check run with the anchors yet" in empty
    assert [ln.split("`")[1] for ln in empty.splitlines() if ln.startswith("| `")] == list(hf_attnorm.available())

    def rec(row, n, fwd, bwd):
        return {"row": row, "B": 8, "H": 32, "n": n, "d": 64, "causal": True, "dtype": "bf16", "status": "ok",
                "path": "triton", "fwd_ms": fwd, "fwd_bwd_ms": bwd, "fwd_vs_sdpa": fwd, "fwd_bwd_vs_sdpa": bwd}

    anchor = gpu_anchors.row_name(gpu_anchors.ANCHORS["adasplash_entmax15"])
    records = [rec(row, n, *times) for n in (1024, 2048) for row, times in (
        ("sdpa", (1.0, 1.0)), ("sigmoid", (0.9, 1.4)), ("symax", (1.5, 1.4)), (anchor, (2.0, 2.0)),
        ("entmax15", (1.8, 2.5)))]
    result = {"command": "scripts/gpu_check.sh", "started_utc": "2026-01-01", "device": {"name": "GPU"},
              "versions": {}, "bench": {"anchors": {}, "records": records}}
    monkeypatch.setattr(render, "_gpu_run", lambda: (ROOT / "bench" / "gpu" / "X" / "results.json", result))
    monkeypatch.setattr(goals, "GPU_REASONS", {"entmax15": "a made-up reason"})
    table = render.gpu_goals()
    line = {ln.split("`")[1]: ln for ln in table.splitlines() if ln.startswith("| `")}
    assert "| yes |" in line["sigmoid"] and "n=1024" not in line["sigmoid"].split("|")[-4]
    assert "no: fwd n=2048 1.50x" in line["symax"] and "NO REASON RECORDED" in line["symax"]
    assert "adasplash_entmax15: n=2048 0.90 / 1.25" in line["entmax15"]
    assert "fwd+bwd n=2048 1.25x adasplash_entmax15" in line["entmax15"] and "a made-up reason" in line["entmax15"]
    assert "| not measured |" in line["softmax"]
    assert "2 of 3 measured" not in table and "1 of 3 measured implementations at their GPU goal" in table


def test_the_published_gpu_goal_table_explains_every_miss():
    """Every implementation that misses its GPU goal in the newest GPU run with the anchors has its measured reason
    (``hf_attnorm.lab.speed.goals.GPU_REASONS``); the table lists every implementation."""
    table = _renderer().gpu_goals()
    assert "NO REASON RECORDED" not in table, [ln.split("|")[1] for ln in table.splitlines()
                                               if "NO REASON RECORDED" in ln]
    assert [ln.split("`")[1] for ln in table.splitlines() if ln.startswith("| `")] == list(hf_attnorm.available())


def test_the_curve_blocks_list_what_is_missing_and_keep_a_lever_only_where_it_always_helps(monkeypatch):
    """The budget curve's blocks: every planned run without a result is listed with the command that measures it and
    its estimated CPU hours; a lever is kept only when it moves the curve left for every implementation and
    context it ran on."""
    from hf_attnorm.lab.convert import study

    render = _renderer()

    def run(final: float, budget: int = 1, wall: float = 180.0) -> dict:
        return {"steps": {"transfer": 20 * budget, "finetune": 20 * budget}, "tokens_per_step": 512,
                "perplexity": {"finetune": {"512": 30.0}},
                "eval_texts": {study.OTHER_TEXT: {"perplexity": {"finetune": {"512": final}}}},
                "wall_seconds": wall, "cpu_seconds": {"run": 2 * wall}, "load_average_start": 1.0,
                "load_average_end": 1.0, "command": "python scripts/convert.py --output_dir runs/x"}

    def curve(full_seed1: float) -> dict:
        found = {"default": {impl: {1: {0: run(30.0), 1: run(32.0)}} for impl in study.CURVE_IMPLEMENTATIONS},
                 "full": {"entmax15": {1: {0: run(28.0), 1: run(full_seed1)}}}}
        found["default"]["entmax15"][4] = {0: run(25.0, 4)}
        return {"curves": study.curve_rows(found, {"512": 20.0}, ["512"]), "original": {"512": 20.0},
                "settings": {"eval_lengths": [512], "seeds": {str(b): study.curve_seeds(b)
                                                             for b in study.CURVE_BUDGETS}},
                "levers": {"full": {"description": "every weight", "flags": ["--finetune_mode", "full"]}},
                "text": "a text", "commands": {"default": "python scripts/convert_study.py --budgets 1 4 16 64"}}

    monkeypatch.setattr(render, "_curve_results", lambda: curve(31.0))
    missing = render._curve_not_measured(curve(31.0))
    # 6 implementations x (4x: 2 seeds, 16x, 64x) = 24 runs, less entmax15's 4x seed 0; full's: entmax15's 4x and
    # every planned run of stickbreaking (2 seeds at 1x and 4x): 6 more
    assert missing.startswith("**Not measured yet** (29 runs") and "`entmax15` 4x seed 1" in missing
    assert "`entmax15` 4x seed 0" not in missing.split("full:")[0] and "full: `entmax15` 4x seed 0" in missing
    assert "`stickbreaking` 1x seed 1" in missing.split("full:")[1]
    assert "`python scripts/convert_study.py --budgets 1 4 --lever full --implementations entmax15 stickbreaking`" \
        in missing
    # (180 s at 1x, on 2 threads: 4x 0.4 h a run; 16x 1.6 h; 64x 6.4 h)
    hours = (5 * (2 * 4 + 16 + 64) + (4 + 16 + 64) + 2 * 4 + 2 * 1 + 2 * 4) * 180 * 2 / 3600
    assert f"in about {hours:.0f} CPU hours" in missing
    assert "not measured" in render.conversion_curve()
    assert render.conversion_levers().endswith("`full` **kept**: it moves the curve left in 1 of 1 implementation "
                                               "and context pairs (measured at 1x).")
    monkeypatch.setattr(render, "_curve_results", lambda: curve(33.0))  # seed 1 worse than the default's 32
    assert "`full` not kept: it moves the curve left in 0 of 1" in render.conversion_levers()
