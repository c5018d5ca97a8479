"""Golden rewrite cases produced from real frontends (tests/golden/generate.py).

Each case: rewrite the committed input, compare the sites with cases.json, check the
output text with FileCheck directives, and (positive cases) run original and
rewritten module on the same random inputs on CPU.
"""
from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pytest

import flashgen.rewrite as fr
from flashgen import execute
from flashgen.rewrite import modules, verify
from flashgen.rewrite.report import AttentionSite

GOLDEN = pathlib.Path(__file__).parent / "golden"
CASES = json.loads((GOLDEN / "cases.json").read_text())
POSITIVE = sorted(n for n, c in CASES.items() if c["rewritten"])
NEGATIVE = sorted(n for n, c in CASES.items() if not c["rewritten"])
NUMERIC = sorted(n for n, c in CASES.items() if c.get("numerics"))

import sys  # noqa: E402

sys.path.insert(0, str(GOLDEN))
import filecheck  # noqa: E402


def _rewrite(name):
    return fr.rewrite(GOLDEN / CASES[name]["file"])


def test_case_counts():
    assert len(POSITIVE) >= 60 and len(NEGATIVE) >= 18


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_sites(name):
    case = CASES[name]
    result = _rewrite(name)
    assert result.format == case["format"] or (case["format"] == "mlirbc" and
                                                result.format == "portable")
    rewritten, rejected = result.rewritten, result.rejected
    assert len(rewritten) == case["rewritten"], [s.reason for s in rejected]
    for expected in case["rejected"]:
        assert any(expected in s.reason for s in rejected), \
            f"no rejection mentions {expected!r}: {[s.reason for s in rejected]}"
    if not case["rejected"]:
        assert not rejected, [s.reason for s in rejected]
    assert sorted({s.target for s in rewritten}) == sorted(set(case["targets"]))
    for s in rewritten:
        assert isinstance(s, AttentionSite) and s.status == "rewritten"
        if case["causal"] is not None:
            assert s.causal == case["causal"]
        if case["bottom_right"] is not None:
            assert s.bottom_right == case["bottom_right"]
        if case["scale"] is not None:
            assert math.isclose(s.scale, case["scale"], rel_tol=1e-6)
        if case["kv_heads"] is not None:
            assert s.kv_heads == case["kv_heads"]
        if case["layout"] is not None:
            assert s.layout == case["layout"]
        if case.get("window") is not None:
            assert list(s.window) == case["window"]
        if case.get("softcap") is not None:
            assert math.isclose(s.softcap, case["softcap"], rel_tol=1e-6)
        if case.get("extras") is not None:
            assert s.extras == case["extras"], s.extras_detail
        json.dumps(s.to_json())  # the report is JSON-serializable
    filecheck.check(result.text(), (GOLDEN / "checks" / f"{name}.check").read_text())


@pytest.mark.parametrize("name", POSITIVE)
def test_golden_idempotent_and_same_format(name):
    result = _rewrite(name)
    data = result.to_bytes()
    assert modules.detect_format(data) == modules.detect_format(
        (GOLDEN / CASES[name]["file"]).read_bytes())
    again = fr.rewrite(data)
    assert not again.rewritten
    # what is left is what the case expects to be left (e.g. a rotary-embedding matmul)
    for s in again.rejected:
        assert any(expected in s.reason for expected in CASES[name]["rejected"]), s.reason
    assert again.to_bytes() == data


@pytest.mark.parametrize("name", NEGATIVE)
def test_golden_negative_unchanged(name):
    result = _rewrite(name)
    assert result.to_bytes() == (GOLDEN / CASES[name]["file"]).read_bytes()


@pytest.fixture(scope="session")
def kernels():
    """Build every spec the golden cases need once (cached under $FLASHGEN_CACHE_DIR)."""
    from flashgen import runtime
    specs = set()
    for name in NUMERIC:
        specs |= set(_rewrite(name).specs)
    runtime.ensure(sorted(specs))
    return specs


@pytest.mark.parametrize("name", NUMERIC)
def test_golden_numerics(name, kernels):
    original = modules.load(GOLDEN / CASES[name]["file"])
    result = _rewrite(name)
    rewritten = modules.load(result.to_bytes())
    # masks get rows of every kind, fully masked ones included (flashgen.rewrite.verify)
    inputs = verify.inputs_for(original, seed=1)
    ref = execute.run(original, inputs, register=False)
    got = execute.run(rewritten, inputs)
    rows = verify.compare(ref, got, result.rewritten)
    assert all(r["ok"] for r in rows), rows


def test_rewritten_jax_exported_calls_in_jax(kernels, tmp_path):
    """A rewritten .jax_exported deserializes and runs once the targets are registered."""
    import jax
    from flashgen import runtime
    from flashgen.build import build
    name = "jnn_causal_exported"
    result = _rewrite(name)
    lib = build(result.specs, "cpu", out=tmp_path)
    runtime.load(lib.manifest_path)
    exp = jax.export.deserialize(bytearray(result.to_bytes()))
    assert "flashgen_fwd_d32_f32_causal" in exp.mlir_module()
    original = jax.export.deserialize(bytearray((GOLDEN / CASES[name]["file"]).read_bytes()))
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(a.shape).astype(a.dtype) for a in exp.in_avals]
    got = np.asarray(jax.jit(exp.call)(*args))
    ref = np.asarray(original.call(*args))
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=2e-5)
