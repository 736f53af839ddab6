"""Each fused map declared in hf_attnorm/kernels/fused/maps.py against what the kernels compute: the declaration's own
slope is its weight's derivative; the C++ build answers the declared facts per id (``map_facts``); the C++ and
Triton kernels compute the declared weights (out = W V) and their gradients (q, k, v and the row value) on tiny
float64 / fp32 inputs with a single-key row, a fully masked row and keys across block edges; an undeclared id
raises in both kernels and their launchers. Generic over ``maps.MAPS``: a new map needs no edit here.

The Triton tests run under Triton's interpreter in a child process (``TRITON_INTERPRET=1`` must be set before
triton is imported), as tests/test_triton.py does; run them directly with
``TRITON_INTERPRET=1 python -m pytest tests/test_fused_maps.py -k triton``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from hf_attnorm.kernels.fused import cpu as fused_cpu
from hf_attnorm.kernels.fused import maps

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")
IDS = [m.name for m in maps.MAPS]
#: the maps the C++ kernels implement (``FusedMap.cpu``; the others run on the Triton kernels only)
CPP_IDS = [m.name for m in maps.cpu_maps()]
UNKNOWN_ID = max(maps.BY_ID) + 5

#: A fused map declared here and nowhere else (no normalizer uses it): 1 + softsign(s) = 1 + s / (1 + |s|),
#: positive, normalised. Both kernels run it from this declaration alone: a new fused map is its declaration
#: (docs/extending.md walks through it).
NEW_MAP = maps.FusedMap(
    "softsign", max(maps.BY_ID) + 1,
    weight=lambda s, r: 1 + s / (1 + s.abs()), slope=lambda s, r: 1 / (1 + s.abs()) ** 2, form="pointwise",
    normalised=True, single_key="n == 1",
    row_value="n, the keys the query sees (the map reads no row value; n == 1 marks single-key rows)",
    row_value_for=lambda n: n.to(torch.float64), row_value_has_gradient=False,
    code=maps.EntryCode(cpp_weight="T(1) + s / (T(1) + std::abs(s))",
                        cpp_slope="T(1) / ((T(1) + std::abs(s)) * (T(1) + std::abs(s)))",
                        triton_weight="1.0 + s / (1.0 + tl.abs(s))",
                        triton_slope="1.0 / ((1.0 + tl.abs(s)) * (1.0 + tl.abs(s)))"))
#: the declared maps and the new one: the kernels are built for this table in tests below (a separate build)
TABLE = (*maps.MAPS, NEW_MAP)


def _inputs(dtype: torch.dtype, seed: int = 0):
    """q [1, 2, 6, 3], k [1, 2, 9, 3], v [1, 2, 9, 4] and keep [1, 2, 6, 9]: row 0 sees one key, row 1 none, the
    others a random subset (at least two keys)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, 6, 3, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 9, 3, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 9, 4, generator=g, dtype=torch.float64)
    keep = torch.rand(1, 2, 6, 9, generator=g) < 0.7
    keep[..., 2:, :2] = True
    keep[..., 0, :] = False
    keep[..., 0, 3] = True
    keep[..., 1, :] = False
    return q.to(dtype), k.to(dtype), v.to(dtype), keep


def _declared(fmap: maps.FusedMap, q, k, v, keep, r):
    """out [B, H, Lq, Dv] in float64 from the declaration (autograd-connected to q, k, v, r; query head h uses
    kv head h // (H / Hkv))."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = q.double() @ k.double().transpose(-1, -2)
    return maps.declared_weights(fmap, s, r.double(), keep) @ v.double()


def _compare(fmap, got: dict[str, torch.Tensor], q, k, v, keep, r, atol: float) -> None:
    """got: out and the gradients of sum(out * w) for q, k, v, r; checked against the declaration in float64."""
    leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v, r)]
    out = _declared(fmap, *leaves[:3], keep, leaves[3])
    w = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)
    grads = torch.autograd.grad((out * w).sum(), leaves, allow_unused=True)
    want = {"out": out.detach(), "dq": grads[0], "dk": grads[1], "dv": grads[2], "dr": grads[3]}
    for key, value in got.items():
        if value is None:
            continue
        ref = want[key] if want[key] is not None else torch.zeros_like(value, dtype=torch.float64)
        err = (value.double() - ref).abs().max().item()
        assert err <= atol * max(1.0, ref.abs().max().item()), f"{fmap.name}: {key} differs by {err:.3g}"


@pytest.mark.parametrize("name", [*IDS, NEW_MAP.name])
def test_declared_slope_is_the_derivative_of_the_declared_weight(name):
    fmap = maps.BY_NAME.get(name, NEW_MAP)
    s = torch.linspace(-3.1, 2.9, 61, dtype=torch.float64).requires_grad_(True)  # no grid point at a kink (0)
    r = fmap.row_value_for(torch.full((61,), 7))
    for value, slope in ((fmap.weight, fmap.slope), (fmap.den_term, fmap.den_slope)):
        if value is None:
            assert slope is None, name
            continue
        (auto,) = torch.autograd.grad(value(s, r).sum(), s)
        torch.testing.assert_close(slope(s.detach(), r), auto, rtol=1e-12, atol=1e-12)


def test_map_tables_are_derived_from_the_declarations():
    assert maps.MAP_IDS == {m.name: m.kernel_id for m in maps.MAPS}
    assert maps.NORMALISED == {m.name for m in maps.MAPS if m.normalised}
    assert maps.THRESHOLD == {m.name for m in maps.MAPS if m.form == "threshold"}


@pytest.mark.parametrize("name", IDS)
def test_how_the_row_value_enters_is_what_the_weight_says(name):
    """The kernels take a map whose ``row_value_use`` is "weight_factor" as weight(s, 1) scaled by r per row, and
    "score_offset" as weight(s + r, 0): its declared weight must be exactly that."""
    fmap = maps.BY_NAME[name]
    s = torch.linspace(-3.1, 2.9, 61, dtype=torch.float64)
    r = torch.linspace(0.1, 2.0, 61, dtype=torch.float64)
    if fmap.row_value_use == "weight_factor":
        torch.testing.assert_close(fmap.weight(s, r), r * fmap.weight(s, torch.ones_like(r)), rtol=1e-14, atol=0)
    if fmap.row_value_use == "score_offset":
        torch.testing.assert_close(fmap.weight(s, r), fmap.weight(s + r, torch.zeros_like(r)), rtol=1e-14, atol=0)


def test_a_declaration_the_kernels_cannot_obey_is_refused():
    base = maps.BY_NAME["symax"]
    refused = {
        "must be one of": dict(name="formless", form="tiled"),
        "adds r to the denominator of a normalised pointwise map": dict(name="offset", normalised=False),
        "is implemented for pointwise maps that are not normalised": dict(name="factor",
                                                                         row_value_use="weight_factor"),
        "declares its per-entry code": dict(name="uncoded", code=None),
        "only shift 'max_score'|only running_shift 'max_score'": dict(name="den_term", den_term=lambda s, r: s * s,
                                                                     den_slope=lambda s, r: 2 * s),
    }
    for pattern, change in refused.items():
        with pytest.raises(ValueError, match=pattern):
            dataclasses.replace(base, **change)
    with pytest.raises(ValueError, match="the kernels compute running_shift 'max_score' for the weight"):
        dataclasses.replace(maps.BY_NAME["squared"], name="shifted", form="shifted", running_shift="max_score",
                            code=None)
    with pytest.raises(ValueError, match="a running shift cancels only"):
        dataclasses.replace(maps.BY_NAME["softpick"], name="unnormalised", normalised=False)
    with pytest.raises(ValueError, match="the shifted form, and only it"):
        dataclasses.replace(maps.BY_NAME["softpick"], name="unshifted", running_shift="none")
    with pytest.raises(ValueError, match="'exponent'"):
        dataclasses.replace(maps.BY_NAME["power"], name="exponent", row_value_use="n")
    with pytest.raises(ValueError, match="score_offset' needs"):
        dataclasses.replace(maps.BY_NAME["relu_len"], name="in_score", row_value_use="score_offset")
    with pytest.raises(ValueError, match="threshold_exponent 2 means"):
        dataclasses.replace(maps.BY_NAME["sparsemax"], name="squared_threshold", threshold_exponent=2)
    with pytest.raises(ValueError, match="the threshold form, and only it"):
        dataclasses.replace(maps.BY_NAME["sparsemax"], name="no_exponent", threshold_exponent=0)
    with pytest.raises(ValueError, match="row value alpha"):
        dataclasses.replace(maps.BY_NAME["entmax_alpha"], name="alpha_n", row_value_use="n")
    with pytest.raises(ValueError, match="is computed by the kernels' code for its numbers"):
        dataclasses.replace(maps.BY_NAME["softpick"], name="coded", code=base.code)
    with pytest.raises(ValueError, match="'n == 1' reads n"):
        dataclasses.replace(maps.BY_NAME["sigmoid"], name="marked", single_key="n == 1")


def test_the_triton_kernels_name_each_fact_value_they_compare_with():
    """One vocabulary: the Triton device code compares the facts (``maps.FACTS``) with their numbers; each
    comparison with a named value carries that value's name in its comment (or the comment line above), so a
    renumbered value fails here instead of silently selecting another form's code."""
    import inspect
    import re

    from hf_attnorm.kernels.fused import triton_device

    names = {"RUNNING_SHIFT": maps.SHIFT_IDS, "ROW_VALUE_USE": maps.ROW_VALUE_USE_IDS, "FORM": maps.FORM_IDS,
             "SINGLE_KEY": maps.SINGLE_KEY_IDS}
    seen = 0
    for fn in triton_device.JIT_FUNCTIONS:
        lines = inspect.getsource(getattr(triton_device, fn)).splitlines()
        for i, line in enumerate(lines):
            for fact, ids in names.items():
                for number in re.findall(rf"\b{fact}\s*==\s*(\d+)", line.split("#")[0]):
                    value = {v: k for k, v in ids.items()}[int(number)]
                    comment = (line.split("#", 1)[1] if "#" in line else "") + " " + lines[i - 1]
                    assert value in comment, f"{fn}: `{line.strip()}` does not name {fact} {value!r}"
                    seen += 1
    assert seen >= 10, seen  # (the check found the comparisons it is meant to read)


def test_the_checklist_names_everything_a_new_map_changes(monkeypatch):
    """docs/extending.md's list of the places a new map touches, against what actually changes when ``NEW_MAP``
    joins a temporary table: each generated file or table that then differs (or fails its test) must be named in
    the checklist with the command that regenerates it."""
    import importlib.util
    import sys
    from pathlib import Path

    import hf_attnorm

    root = Path(__file__).resolve().parents[1]
    checklist = (root / "docs" / "extending.md").read_text()
    checklist = checklist[checklist.index("4. **A new fused map**"):checklist.index("The kernels can also be built")]
    changed: dict[str, list[str]] = {}
    if maps.triton_source(TABLE) != maps.TRITON_MAPS_FILE.read_text():
        changed["hf_attnorm/kernels/fused/triton_maps.py"] = ["python -m hf_attnorm.kernels.fused.maps"]
    if maps.cpp_facts_header(TABLE) != maps.cpp_facts_header() or maps.cpp_header(TABLE) != maps.cpp_header():
        changed["C++ headers"] = ["generated at build time", "rebuilds the C++ extension"]
    # a normalizer on the new map is a new implementation: the speed-goal table has no measurement for it
    spec = importlib.util.spec_from_file_location("render_readme_checklist", root / "scripts" / "render_readme.py")
    render = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "render_readme_checklist", render)
    spec.loader.exec_module(render)
    available = hf_attnorm.available()
    monkeypatch.setattr(hf_attnorm, "available", lambda: [*available, NEW_MAP.name])
    if f"| `{NEW_MAP.name}` | not measured in this run" in render.speed_goals():
        changed["the speed-goal table"] = ["tests/test_readme.py", "scripts/bench_kernels.py --only",
                                           "--curve_implementations", "python scripts/render_readme.py"]
    assert set(changed) == {"hf_attnorm/kernels/fused/triton_maps.py", "C++ headers", "the speed-goal table"}, (
        "what a new map changes moved: update this test and docs/extending.md together")
    for what, words in changed.items():
        missing = [w for w in words if w not in checklist]
        assert not missing, f"docs/extending.md's checklist does not say {missing} for {what}"


def test_a_normalizer_naming_its_map_by_the_former_attribute_still_gets_it():
    """``fused_kind`` was the attribute's name: a subclass that sets it runs on that map, with a DeprecationWarning."""
    from hf_attnorm.normalizers.base import Normalizer

    with pytest.warns(DeprecationWarning, match="fused_map"):
        class Old(Normalizer):
            fused_kind = "sigmoid"

    assert Old.fused_map == "sigmoid"


def test_an_undeclared_id_is_refused_by_name():
    with pytest.raises(ValueError, match=f"unknown fused map id {UNKNOWN_ID}: the declared ids are 0 \\(symax\\)"):
        maps.lookup_id(UNKNOWN_ID)


# --------------------------------------------------------------------------------------------------------- C++


def _ops():
    """The compiled ops; skips without a compiler or with the native build switched off, fails on a build error
    (a map declared in maps.py but not in the C++ fails to compile: that must not read as a skip)."""
    reason = fused_cpu.unavailable_reason()
    if reason is not None and ("no C++ compiler" in reason or fused_cpu.NO_NATIVE_ENV in reason):
        pytest.skip(f"fused C++ kernels unavailable: {reason}")
    assert reason is None, f"the fused C++ kernels did not build: {reason}"
    return fused_cpu.native_ops()


def _map_facts(map_id: int) -> list[int]:
    """What the C++ build believes about map ``map_id`` (a C++-only op: its namespace is the compiled one,
    ``hf_attnorm_native``; the ops hf_attnorm calls are declared from Python as ``hf_attnorm_fused``)."""
    _ops()  # builds the extension
    return torch.ops.hf_attnorm_native.map_facts(map_id)


def test_the_kernels_name_no_map_and_the_generated_code_covers_every_id():
    """Every per-map difference in the kernels comes from the declarations: the C++ source names no map (no id
    constant, no enum) and the hand-written Triton device code compares ``MAP`` with nothing; the generated C++
    header dispatches every declared id and holds the code of every map declaring some, as does the generated
    Triton source."""
    import inspect
    import re
    from pathlib import Path

    from hf_attnorm.kernels.fused import triton_device

    cpp = Path(fused_cpu.__file__).with_name("fused_cpu.cpp").read_text()
    code_lines = "\n".join(line.split("//")[0] for line in cpp.splitlines())  # comments may describe a form
    for m in maps.MAPS:
        assert not re.search(rf"\b{m.name.upper()}\b", code_lines), m.name
    assert "enum" not in code_lines
    device = "".join(inspect.getsource(getattr(triton_device, name)) for name in triton_device.JIT_FUNCTIONS)
    assert not re.search(r"\bMAP\s*(==|!=|>=|<=|<|>)", device)
    assert not re.search(r"\bMAP_[A-Z0-9_]+\b", device)
    header, source = maps.cpp_header(), maps.triton_source()
    ids = re.search(r"#define HF_MAPS_FOR_EACH\(X\) (.*)", header).group(1)
    assert ids == " ".join(f"X({m.kernel_id})" for m in sorted(maps.cpu_maps(), key=lambda m: m.kernel_id))
    for m in maps.MAPS:
        coded = m.code is not None
        assert (f"struct MapEntry<T, {m.kernel_id}> {{" in header) == (coded and m.cpu), m.name
        assert (f"MAP == {m.kernel_id}:  # {m.name}" in source) == coded, m.name


def test_the_triton_map_code_in_the_repository_is_generated_from_the_declarations():
    """The Triton kernels run the per-entry code of ``triton_maps.py``, a checked-in file (so a GPU traceback points
    at a line) that must equal what the declarations generate now."""
    assert maps.TRITON_MAPS_FILE.read_text() == maps.triton_source(maps.MAPS), (
        "hf_attnorm/kernels/fused/triton_maps.py is out of date with the map declarations: regenerate it with "
        "`python -m hf_attnorm.kernels.fused.maps`")


@pytest.mark.parametrize("name", CPP_IDS)
def test_cpp_build_answers_the_declared_facts(name):
    fmap = maps.BY_NAME[name]
    facts = list(_map_facts(fmap.kernel_id))
    assert facts == [*fmap.facts().values(), fmap.driver], name
    assert list(fmap.facts()) == list(maps.FACTS)


def test_cpp_refuses_an_undeclared_id_in_the_kernel_and_in_the_launcher():
    ops = _ops()
    with pytest.raises(RuntimeError, match=f"unknown fused map id {UNKNOWN_ID}"):
        _map_facts(UNKNOWN_ID)
    q, k, v, keep = _inputs(torch.float64)
    c = torch.ones(q.shape[:3], dtype=torch.float64)
    with pytest.raises(RuntimeError, match=f"unknown fused map id {UNKNOWN_ID}"):
        ops.forward(UNKNOWN_ID, q, k, v, keep, False, c, None, None, 0.0, 4, 4, True)
    with pytest.raises(ValueError, match=f"unknown fused map id {UNKNOWN_ID}"):
        fused_cpu._FusedAttention.apply(q, k, v, c, None, keep, None, 0.0, False, UNKNOWN_ID, (4, 4), False)


@pytest.mark.parametrize("name", CPP_IDS)
def test_cpp_kernel_computes_the_declared_map(name):
    """Forward and every gradient of the C++ kernel (float64, blocks of 4 x 4 so rows cross key blocks) equal the
    declaration's, including the row value's gradient where the kernels return one."""
    _ops()
    fmap = maps.BY_NAME[name]
    q, k, v, keep = _inputs(torch.float64)
    r = fmap.row_value_for(keep.sum(-1).clamp(min=1)).to(torch.float64)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, r)]
    out = fused_cpu._FusedAttention.apply(*leaves[:3], leaves[3], None, keep, None, 0.0, False, fmap.kernel_id,
                                          (4, 4), True)
    w = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)
    dq, dk, dv, dr = torch.autograd.grad((out * w).sum(), leaves)
    got = {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv, "dr": dr if fmap.row_value_has_gradient else None}
    _compare(fmap, got, q, k, v, keep, r, atol=1e-9)
    if not fmap.row_value_has_gradient:
        assert dr.abs().max().item() == 0.0, name


@pytest.mark.parametrize("name", CPP_IDS)
@pytest.mark.parametrize("lq", [1, 3])
def test_cpp_kernel_computes_the_declared_map_on_few_queries_with_gqa(name, lq):
    """Calls with few queries (a decode step) and several query heads per kv head (GQA 6/2, per-head masks and
    rows): one thread takes the grouped form (a kv head's query heads as one block of rows) and as many threads as
    kv heads plus one the per-head form; both equal the declaration, forward and every gradient."""
    _ops()
    fmap = maps.BY_NAME[name]
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 6, lq, 5, generator=g, dtype=torch.float64)
    k, v = torch.randn(1, 2, 41, 5, generator=g, dtype=torch.float64), torch.randn(1, 2, 41, 3, generator=g,
                                                                                   dtype=torch.float64)
    keep = torch.rand(1, 6, lq, 41, generator=g) < 0.8
    keep[0, 1, 0] = False  # a head whose row sees nothing
    keep[0, 2, 0] = False
    keep[0, 2, 0, 7] = True  # and one that sees one key
    r = fmap.row_value_for(keep.sum(-1).clamp(min=1)).to(torch.float64)
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v, r)]
            out = fused_cpu._FusedAttention.apply(*leaves[:3], leaves[3], None, keep, None, 0.0, False,
                                                  fmap.kernel_id, (128, 16), True)
            w = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)
            dq, dk, dv, dr = torch.autograd.grad((out * w).sum(), leaves)
            got = {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv,
                   "dr": dr if fmap.row_value_has_gradient else None}
            _compare(fmap, got, q, k, v, keep, r, atol=1e-9)
    finally:
        torch.set_num_threads(before)


def _run_new_map_cpp(ops, q, k, v, keep, r, w):
    """out and the gradients of sum(out * w) (q, k, v, r) from the ops of a build for TABLE (float64, 4 x 4
    blocks), called directly: nothing else could have computed them."""
    fid = NEW_MAP.kernel_id
    out, den, shift, hv_sum = ops.forward(fid, q, k, v, keep, False, r, None, None, 0.0, 4, 4, True)
    dq, dk, dv, dr, _ = ops.backward(fid, q, k, v, keep, False, r, None, None, 0.0, False, out, den, shift, hv_sum,
                                     w.contiguous(), 4, 4)
    return out, dq, dk, dv, dr


def test_cpp_kernel_computes_a_map_declared_only_in_a_test():
    """NEW_MAP, declared above and not in maps.MAPS: the C++ kernel built for TABLE (its own extension and op
    namespace, since the table differs) reports its facts and computes its weights and gradients; the build for
    maps.MAPS does not know its id."""
    _ops()
    ops = fused_cpu.build_ops(TABLE)
    assert ops is not torch.ops.hf_attnorm_native
    facts = list(ops.map_facts(NEW_MAP.kernel_id))
    assert facts == [*NEW_MAP.facts().values(), NEW_MAP.driver], facts
    q, k, v, keep = _inputs(torch.float64)
    r = NEW_MAP.row_value_for(keep.sum(-1).clamp(min=1)).to(torch.float64).contiguous()
    w = torch.linspace(-1, 1, q.shape[2] * 2 * v.shape[-1], dtype=torch.float64).view(1, 2, q.shape[2], v.shape[-1])
    out, dq, dk, dv, dr = _run_new_map_cpp(ops, q, k, v, keep, r, w)
    assert out[..., 2:, :].abs().max().item() > 0  # rows with keys got weights
    _compare(NEW_MAP, {"out": out, "dq": dq, "dk": dk, "dv": dv, "dr": None}, q, k, v, keep, r, atol=1e-9)
    assert dr.abs().max().item() == 0.0
    with pytest.raises(RuntimeError, match=f"unknown fused map id {NEW_MAP.kernel_id}"):
        torch.ops.hf_attnorm_native.forward(NEW_MAP.kernel_id, q, k, v, keep, False, r, None, None, 0.0, 4, 4, True)


# ------------------------------------------------------------------------------------------------------ Triton

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

if not INTERPRETED:

    @pytest.mark.long
    @needs_triton
    def test_triton_map_tests_interpreted():
        """The Triton tests below, in a child process with TRITON_INTERPRET=1."""
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        cmd = [sys.executable, "-m", "pytest", HERE, "-q", "-k", "triton", "-p", "no:cacheprovider"]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500, cwd=ROOT)
        assert res.returncode == 0, f"interpreted Triton map tests failed:\n{res.stdout[-8000:]}\n{res.stderr[-3000:]}"
        assert " passed" in res.stdout and " skipped" not in res.stdout, res.stdout[-2000:]

else:
    from hf_attnorm.kernels.fused import triton as ta

    def _plan(name: str, q, k, v, keep, table=maps.MAPS):
        """A launch plan for map ``name`` (no normalizer needed)."""
        return ta._Plan(q, k, v, keep, False, name, table)

    @pytest.mark.parametrize("name", IDS)
    def test_triton_kernel_computes_the_declared_map(name, monkeypatch):
        monkeypatch.setattr(ta, "BLOCK_OVERRIDE", (16, 16))
        fmap = maps.BY_NAME[name]
        q, k, v, keep = _inputs(torch.float32)
        r = fmap.row_value_for(keep.sum(-1).clamp(min=1)).to(torch.float32)
        scale = torch.ones(q.shape[:3])
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v, r)]
        out = ta._TritonAttention.apply(*leaves[:3], scale, leaves[3], None, _plan(name, q, k, v, keep))
        w = torch.linspace(-1, 1, out.numel()).view_as(out)
        dq, dk, dv, dr = torch.autograd.grad((out * w).sum(), leaves)
        got = {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv, "dr": dr if fmap.row_value_has_gradient else None}
        _compare(fmap, got, q, k, v, keep, r, atol=2e-4)

    def test_triton_kernel_computes_a_map_declared_only_in_a_test(monkeypatch):
        """NEW_MAP through the Triton kernels built for TABLE (the per-entry code generated from its declaration),
        called directly; the kernels for maps.MAPS refuse its id."""
        monkeypatch.setattr(ta, "BLOCK_OVERRIDE", (16, 16))
        q, k, v, keep = _inputs(torch.float32)
        r = NEW_MAP.row_value_for(keep.sum(-1).clamp(min=1)).to(torch.float32)
        scale = torch.ones(q.shape[:3])
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        plan = _plan(NEW_MAP.name, q, k, v, keep, TABLE)
        assert plan.map_id == NEW_MAP.kernel_id
        out = ta._TritonAttention.apply(*leaves, scale, r, None, plan)
        assert out[..., 2:, :].abs().max().item() > 0
        w = torch.linspace(-1, 1, out.numel()).view_as(out)
        dq, dk, dv = torch.autograd.grad((out * w).sum(), leaves)
        _compare(NEW_MAP, {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}, q, k, v, keep, r, atol=2e-4)
        with pytest.raises(KeyError, match="no fused kernel map 'softsign'"):
            _plan(NEW_MAP.name, q, k, v, keep)
        with pytest.raises(ValueError, match=f"unknown fused map id {NEW_MAP.kernel_id}"):
            ta.check_map(NEW_MAP.kernel_id)

    def test_triton_refuses_an_undeclared_id_before_launching_and_in_the_device_code(monkeypatch):
        q, k, v, keep = _inputs(torch.float32)
        plan = _plan("symax", q, k, v, keep)
        plan.map_id = UNKNOWN_ID
        c = torch.ones(q.shape[:3])
        with pytest.raises(ValueError, match=f"unknown fused map id {UNKNOWN_ID}"):
            ta._TritonAttention.apply(q, k, v, c, c, None, plan)
        # past the launcher (as if a map were declared without device code): the per-map chain refuses to compile
        monkeypatch.setattr(ta, "check_map", lambda map_id, table: None)
        with pytest.raises(Exception, match="no per-entry code for this fused map"):
            ta._TritonAttention.apply(q, k, v, c, c, None, plan)
