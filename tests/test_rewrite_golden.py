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
from flashgen.rewrite import modules, verify
from flashgen.rewrite.report import AttentionSite

GOLDEN = pathlib.Path(__file__).parent / "golden"
CASES = json.loads((GOLDEN / "cases.json").read_text())
POSITIVE = sorted(n for n, c in CASES.items() if c["rewritten"])
NEGATIVE = sorted(n for n, c in CASES.items() if not c["rewritten"])
NUMERIC = sorted(n for n, c in CASES.items() if c.get("numerics"))

import sys  # noqa: E402

sys.path.insert(0, str(GOLDEN))
import pins  # noqa: E402


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
    pins.check(result.text(), GOLDEN / "checks" / f"{name}.check")


def _call_line(text):
    return next(line for line in text.splitlines() if "custom_call @flashgen_" in line)


# Single edits of a rewritten call that numerics at bf16 tolerance may let through
_WRONG_CALLS = {
    "scale 2% off": lambda t: t.replace("scale = 0.176776692", "scale = 0.180312226"),
    "window": lambda t: t.replace("window_left = -1", "window_left = 7"),
    "softcap": lambda t: t.replace("softcap = 0.000000e+00", "softcap = 5.000000e+01"),
    "causal alignment": lambda t: t.replace("bottom_right = false", "bottom_right = true"),
    "operands swapped": lambda t: t.replace("(%arg0, %arg1, %arg2)", "(%arg0, %arg2, %arg1)"),
    "exponential before the call": lambda t: t.replace(
        _call_line(t), "    %e = stablehlo.exponential %arg0 : tensor<2x8x4x32xbf16>\n"
        + _call_line(t)),
    "a second call": lambda t: t.replace(_call_line(t), _call_line(t) + "\n"
                                         + _call_line(t).replace("%0:2", "%9:2")),
}


@pytest.mark.parametrize("edit", sorted(_WRONG_CALLS))
def test_pins_refuse_a_wrong_call(edit):
    """Every attribute and operand of a flashgen call is pinned: one edit fails the check."""
    path = GOLDEN / "checks" / "jnn_causal_bf16.check"
    text = _rewrite("jnn_causal_bf16").text()
    pins.check(text, path)
    wrong = _WRONG_CALLS[edit](text)
    assert wrong != text
    with pytest.raises(AssertionError):
        pins.check(wrong, path)


def test_every_positive_case_is_pinned():
    for name in pins.positive_cases():
        assert pins.MARKER in (GOLDEN / "checks" / f"{name}.check").read_text(), name


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
    """`rewrite --verify`'s judgement: masks get rows of every kind, fully masked ones
    included; a bf16/f16 module is judged against the original run in f32."""
    rows = verify.verify(_rewrite(name), seed=1)["outputs"]
    assert all(r["ok"] for r in rows), [verify.describe(r) for r in rows]


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
