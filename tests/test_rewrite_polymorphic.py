"""Shape-polymorphic jax.export modules (flashgen.rewrite.polymorphic).

The golden cases poly_* (tests/golden) are rewritten with a dynamic custom call; here the
rewritten artifacts are deserialized and called at two different concrete shapes, so JAX's
shape refinement resolves the call's result shapes from its shape operands and the FFI
handlers run, against the original artifact and a float64 reference on fresh inputs.
"""
from __future__ import annotations

import json
import pathlib
import re
import zlib

import jax
import numpy as np
import pytest

import flashgen.rewrite as fr
from flashgen import reference

GOLDEN = pathlib.Path(__file__).parent / "golden"
CASES = json.loads((GOLDEN / "cases.json").read_text())
POLY = sorted(n for n, c in CASES.items() if n.startswith("poly_"))
SHAPES = [(2, 17), (3, 64)]   # (batch, sequence): a ragged last block and a full one
CONSTRAINED = {"poly_constrained": [(2, 128), (5, 157)]}   # t >= 128, b <= 8


@pytest.fixture(scope="module")
def rewritten():
    """{case: (original Exported, rewritten Exported, site)} with the kernels registered."""
    from jax import export
    from flashgen import runtime
    out, specs = {}, set()
    for name in POLY:
        path = GOLDEN / CASES[name]["file"]
        result = fr.rewrite(path)
        (site,) = result.rewritten
        specs |= set(result.specs)
        out[name] = (export.deserialize(bytearray(path.read_bytes())),
                     export.deserialize(bytearray(result.to_bytes())), site)
    runtime.ensure(sorted(specs))
    return out


def test_poly_cases_exist():
    assert len(POLY) >= 10


def _inputs(exported, rng, b: int, t: int) -> list:
    """Random inputs for the symbolic dims b, t set to ``b``, ``t``; weights (and scalars)
    scaled by 1/6."""
    out = []
    for aval in exported.in_avals:
        shape = [{"b": b, "t": t}[str(d)] if not isinstance(d, int) else d for d in aval.shape]
        x = rng.standard_normal(shape).astype(np.float32)
        x = x if aval.shape and not isinstance(aval.shape[0], int) else x / 6
        out.append(x.astype(aval.dtype))
    return out


@pytest.mark.parametrize("name", POLY)
def test_poly_numerics_at_two_shapes(name, rewritten):
    original, new, site = rewritten[name]
    assert "flashgen_fwd" in new.mlir_module() and "stablehlo.exponential" not in new.mlir_module()
    rng = np.random.default_rng(zlib.crc32(name.encode()))  # the same per name in every process
    for b, t in CONSTRAINED.get(name, SHAPES):
        flat = _inputs(original, rng, b, t)
        args, kwargs = jax.tree_util.tree_unflatten(original.in_tree, flat)
        got = np.asarray(new.call(*args, **kwargs))
        ref = np.asarray(original.call(*args, **kwargs))
        assert got.shape == ref.shape and got.shape[:2] == (b, t)
        # f32 calls agree to rounding; a bf16 call (bf16 sources read through their upcast)
        # to bf16 precision
        tol = 2e-5 if site.dtype == "f32" else 2e-2
        got = got.astype(np.float32)
        np.testing.assert_allclose(got, ref.astype(np.float32), atol=tol, rtol=tol)
        if len(flat) == 3 and not site.extras:   # q, k, v themselves: against float64 too
            exact, _ = reference.attention(*(x.astype(np.float64) for x in flat),
                                           causal=site.causal, scale=site.scale,
                                           window=tuple(site.window))
            np.testing.assert_allclose(got, exact, atol=tol, rtol=tol)


def test_poly_shape_assertions_kept(rewritten):
    """The rewrite keeps jax.export's checks: k with another sequence length than q fails."""
    _, new, _ = rewritten["poly_einsum"]
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 17, 4, 32)).astype(np.float32)
    k = rng.standard_normal((2, 9, 4, 32)).astype(np.float32)
    with pytest.raises(Exception, match="polymorphic shapes specification"):
        new.call(q, k, k)


def test_poly_constrained_sizes_obey_assertions():
    """The instances of a module with symbolic constraints are refined at sizes within them."""
    result = fr.rewrite(GOLDEN / CASES["poly_constrained"]["file"])
    (site,) = result.rewritten
    (note,) = [n for n in site.notes if "shape-polymorphic" in n]
    sizes = [int(x) for x in re.findall(r"[bt]=(\d+)", note)]
    assert len(sizes) == 4 and sizes[0] <= 8 and sizes[2] <= 8 and min(sizes[1], sizes[3]) >= 128


def test_poly_report_names_symbols():
    result = fr.rewrite(GOLDEN / CASES["poly_jnn_causal"]["file"])
    (site,) = result.rewritten
    assert (site.batch, site.seq_q, site.seq_k, site.heads) == ("b", "t", "t", 4)
    assert site.q_shape[:2] == ("b", "t")
    assert any("shape-polymorphic" in n for n in site.notes)
    json.dumps(site.to_json())


def test_emit_dynamic_call_checks_extras_rejects_legacy():
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import func
    from flashgen.emit import emit_custom_call
    from flashgen.mlir_context import new_context
    from flashgen.spec import KernelSpec
    spec = KernelSpec(32, "f32", False, "cpu")
    with new_context(), ir.Location.unknown():
        module = ir.Module.create()
        dyn = ir.ShapedType.get_dynamic_size()
        t = ir.RankedTensorType.get([dyn, dyn, 4, 32], ir.F32Type.get())
        heads = ir.RankedTensorType.get([2, 8, dyn, 32], ir.F32Type.get())
        i1 = ir.IntegerType.get_signless(1)
        mask = ir.RankedTensorType.get([1, 1, 8, 8], i1)     # static sizes for dynamic B, S
        dyn_mask = ir.RankedTensorType.get([dyn, 1, dyn, dyn], i1)
        shapes = [ir.RankedTensorType.get([n], ir.IntegerType.get_signless(32)) for n in (4, 3)]
        with ir.InsertionPoint(module.body):
            fn = func.FuncOp("main", ir.FunctionType.get(
                [t, t, t, heads, mask, dyn_mask, *shapes], []))
            block = fn.add_entry_block()
            with ir.InsertionPoint(block):
                q, k, v, h, m, dm, so, sl = block.arguments
                with pytest.raises(ValueError, match=r"mask has type tensor<1x1x8x8xi1>, "
                                   r"expected .*tensor<1x1x\?x\?xi1>"):
                    emit_custom_call(spec, "fwd", [q, k, v, m], scale=1.0, extras=("mask",),
                                     result_shapes=[so, sl])
                o, _ = emit_custom_call(spec, "fwd", [q, k, v, dm], scale=1.0,
                                        extras=("mask",), result_shapes=[so, sl])
                assert str(o.type) == "tensor<?x?x4x32xf32>"
                with pytest.raises(ValueError, match="native attribute form"):
                    emit_custom_call(spec, "fwd", [q, k, v], scale=1.0, legacy_attrs=True,
                                     result_shapes=[so, sl])
                with pytest.raises(ValueError, match="except batch and sequence"):
                    emit_custom_call(spec, "fwd", [h, h, h], scale=1.0, result_shapes=[so, sl])
                with pytest.raises(ValueError, match="static shape"):  # not without shapes
                    emit_custom_call(spec, "fwd", [q, k, v], scale=1.0)
                o, lse = emit_custom_call(spec, "fwd", [q, k, v], scale=1.0,
                                          result_shapes=[so, sl])
                assert str(o.type) == "tensor<?x?x4x32xf32>"
                assert str(lse.type) == "tensor<?x4x?xf32>"
                func.ReturnOp([])


def test_poly_flashgen_run_at_input_shapes(rewritten):
    """execute.run (flashgen run) takes any size for a symbolic dim; the module's own
    assertions reject inconsistent sizes; random inputs need concrete shapes."""
    from flashgen import execute
    from flashgen.errors import FlashgenError, UsageError
    original, _, _ = rewritten["poly_jnn_causal"]
    data = fr.rewrite(GOLDEN / CASES["poly_jnn_causal"]["file"]).to_bytes()
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((3, 29, 4, 32)).astype(np.float32) for _ in range(3))
    (got,) = execute.run(data, [q, k, v])
    np.testing.assert_allclose(got, np.asarray(original.call(q, k, v)), atol=2e-5, rtol=2e-5)
    with pytest.raises(FlashgenError, match="polymorphic shapes specification"):
        execute.run(data, [q, k[:, :9], v])
    with pytest.raises(UsageError, match="expects"):
        execute.run(data, [q[0], k, v])
    params, _ = execute.signature(data)
    with pytest.raises(UsageError, match="random inputs need concrete shapes"):
        execute.random_inputs(params)


@pytest.mark.parametrize("name", ["poly_constrained", "poly_einsum_gqa_upcast"])
def test_poly_verify_runs_at_instance_sizes(name, rewritten):
    """--verify picks the first instance's sizes (within the module's constraints)."""
    from flashgen.rewrite import modules, verify
    result = fr.rewrite(GOLDEN / CASES[name]["file"])
    inputs = verify.inputs_for(modules.load(result.loaded.data), seed=0)
    b, t = inputs[0].shape[:2]
    assert b != t and min(b, t) >= 3 and (name != "poly_constrained" or (b <= 8 and t >= 128))
    report = verify.verify(result, seed=0)
    assert report["outputs"] and all(r["ok"] for r in report["outputs"]), report
