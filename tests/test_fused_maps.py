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
import types

import pytest
import torch

from hf_attnorm.kernels.fused import cpu as fused_cpu
from hf_attnorm.kernels.fused import maps

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")
IDS = [m.name for m in maps.MAPS]
UNKNOWN_ID = max(maps.BY_ID) + 5


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
    """out [B, H, Lq, Dv] in float64 from the declaration (autograd-connected to q, k, v, r)."""
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


@pytest.mark.parametrize("name", IDS)
def test_declared_slope_is_the_derivative_of_the_declared_weight(name):
    fmap = maps.BY_NAME[name]
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
    assert maps.THRESHOLD == {m.name for m in maps.MAPS if m.threshold}
    assert maps.WIDE == {m.name for m in maps.MAPS if m.wide}
    assert maps.DEN_ADDS_ROW_VALUE == {m.name for m in maps.MAPS if m.den_offset is not None}
    assert maps.ROW_VALUE_FACTOR == {m.name for m in maps.MAPS if m.row_value_factor}


@pytest.mark.parametrize("name", IDS)
def test_a_row_value_factor_is_what_the_weight_says(name):
    """The kernels take a map declaring ``row_value_factor`` as weight(s, 1) scaled by r per row: its declared weight
    must be exactly that; and a declared ``den_offset`` must be the row value itself (what both kernels add)."""
    fmap = maps.BY_NAME[name]
    s = torch.linspace(-3.1, 2.9, 61, dtype=torch.float64)
    r = torch.linspace(0.1, 2.0, 61, dtype=torch.float64)
    if fmap.row_value_factor:
        torch.testing.assert_close(fmap.weight(s, r), r * fmap.weight(s, torch.ones_like(r)), rtol=1e-14, atol=0)
    if fmap.den_offset is not None:
        assert torch.equal(fmap.den_offset(r), r), name


def test_a_declaration_the_kernels_cannot_obey_is_refused():
    base = maps.BY_NAME["symax"]
    with pytest.raises(ValueError, match="no other offset"):
        dataclasses.replace(base, name="offset2", den_offset=lambda r: 2 * r)
    with pytest.raises(ValueError, match="row_value_factor scales"):
        dataclasses.replace(base, name="factor", row_value_factor=True)
    with pytest.raises(ValueError, match="the kernels compute shift 'max_score' for the weight"):
        dataclasses.replace(maps.BY_NAME["squared"], name="shifted", shift="max_score")
    with pytest.raises(ValueError, match="a running shift cancels only"):
        dataclasses.replace(maps.BY_NAME["sigmoid"], name="shifted", shift="max_score")
    with pytest.raises(ValueError, match="row_value_exponent"):
        dataclasses.replace(maps.BY_NAME["power"], name="exponent", row_value_exponent=False)
    with pytest.raises(ValueError, match="row_value_in_score needs"):
        dataclasses.replace(maps.BY_NAME["relu_len"], name="in_score", row_value_factor=False,
                            row_value_in_score=True)
    with pytest.raises(ValueError, match="threshold_exponent 2 means"):
        dataclasses.replace(maps.BY_NAME["sparsemax"], name="squared_threshold", threshold_exponent=2)
    with pytest.raises(ValueError, match="declare threshold_exponent 1 or 2"):
        dataclasses.replace(maps.BY_NAME["sparsemax"], name="no_exponent", threshold_exponent=0)


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


def test_cpp_enum_spells_the_declared_ids():
    import re
    from pathlib import Path

    src = Path(fused_cpu.__file__).with_name("fused_cpu.cpp").read_text()
    enum = re.search(r"enum MapId : int64_t \{(.*?)\};", src, re.S).group(1)
    cpp = {m.group(1): int(m.group(2)) for m in re.finditer(r"(\w+) = (\d+)", enum)}
    declared = {maps.constant_name(m.name): m.kernel_id for m in maps.MAPS}
    assert cpp == declared, ("enum MapId in fused/fused_cpu.cpp differs from fused/maps.py: only in the C++ "
                             f"{sorted(cpp.items() - declared.items())}, "
                             f"only declared {sorted(declared.items() - cpp.items())}")
    assert int(re.search(r"NUM_MAPS = (\d+);", src).group(1)) == max(maps.BY_ID) + 1


@pytest.mark.parametrize("name", IDS)
def test_cpp_build_answers_the_declared_facts(name):
    fmap = maps.BY_NAME[name]
    facts = list(_map_facts(fmap.kernel_id))
    assert facts == [fmap.normalised, fmap.threshold, fmap.constant_on_single_key,
                     fmap.single_key_mark == "negative", maps.DISPATCH_IDS[fmap.dispatch],
                     fmap.den_offset is not None, fmap.row_value_factor, fmap.threshold_exponent == 2,
                     maps.SHIFT_IDS[fmap.shift], fmap.row_value_in_score, fmap.row_value_exponent], name


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


@pytest.mark.parametrize("name", IDS)
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

    def _plan(name: str, q, k, v, keep):
        """A launch plan for map ``name`` (the call's fields _Plan reads; no normalizer needed)."""
        call = types.SimpleNamespace(q=q, k=k, v=v, normalizer=types.SimpleNamespace(fused_map=name),
                                     mask=types.SimpleNamespace(keep=keep, causal=False), softcap=None,
                                     alibi_slopes=None)
        return ta._Plan(call)

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

    def test_triton_refuses_an_undeclared_id_before_launching_and_in_the_device_code(monkeypatch):
        q, k, v, keep = _inputs(torch.float32)
        plan = _plan("symax", q, k, v, keep)
        plan.map_id = UNKNOWN_ID
        c = torch.ones(q.shape[:3])
        with pytest.raises(ValueError, match=f"unknown fused map id {UNKNOWN_ID}"):
            ta._TritonAttention.apply(q, k, v, c, c, None, plan)
        # past the launcher (as if a map were declared without device code): the per-map chain refuses to compile
        monkeypatch.setattr(ta, "check_map", lambda map_id: None)
        with pytest.raises(Exception, match="no forward branch for this fused map"):
            ta._TritonAttention.apply(q, k, v, c, c, None, plan)
