"""A value head dim other than the query/key one (issue 23, 2b; DeepSeek's MLA: 192 and 128) as a
kernel variant of its own: the CPU kernels' forward and backward against the float64 reference
on fresh random inputs (outputs poisoned by conftest's FLASHGEN_POISON), through
flash_attention and the kernel entry points; clear errors where it has no kernels."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import needs_nvcc
from flashgen import reference, runtime, targets
from flashgen.jax import flash_attention, flash_attention_varlen
from flashgen.jax.attention import attention_bwd, attention_with_lse
from flashgen.spec import KernelSpec, kernel_head_dims, parse_target_name

TOL = {"float32": (2e-5, 1e-4), "bfloat16": (2e-2, 3e-2)}  # (forward, gradients), relative to the max


def _inputs(rng, d, dv, dtype="float32", b=2, sq=12, sk=16, hq=4, hkv=2):
    shapes = ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, dv), (b, sq, hq, dv))
    return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]  # q, k, v, do


@pytest.fixture
def sm80_without_split_kernels(monkeypatch):
    """sm80 as a target whose kernel family has no split-head-dim kernels (every family has them
    today; a new one, as a first Hopper family, may not): its specs refuse a differing value
    head dim and flash_attention / the rewriter pad V to the larger dim."""
    row = targets.TARGETS["sm80"]
    family = dataclasses.replace(row.family, split_head_dims=False)
    monkeypatch.setitem(targets.TARGETS, "sm80", dataclasses.replace(row, family=family))


def _close(got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("d, dv, dtype, causal, sizes", [
    (192, 128, "float32", True, {}),
    (192, 128, "bfloat16", False, {}),
    (64, 128, "float32", False, dict(hq=4, hkv=1)),         # dv > d, MQA
    (64, 128, "bfloat16", True, dict(sq=70, sk=90)),         # dv > d on the bf16-pair products
    (192, 128, "float32", False, dict(sq=130, sk=160)),     # several q / key blocks: packed q, dO rows
    (192, 128, "float32", True, dict(sq=200, sk=520)),      # forward packs K and V once per call
    (192, 128, "float32", True, dict(b=1, sq=4, sk=300, hq=1, hkv=1)),  # one row block: split-KV
])
def test_split_head_dims_forward_and_grads_match_float64(rng, d, dv, dtype, causal, sizes):
    q, k, v, do = _inputs(rng, d, dv, dtype, **sizes)
    (o, lse), vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, causal=causal, bottom_right=causal,
                                                            return_lse=True), q, k, v)
    want_o, want_lse, want_g = reference.attention(q, k, v, causal=causal, bottom_right=causal, do=do)
    fwd_tol, grad_tol = TOL[dtype]
    _close(o, want_o, fwd_tol)
    _close(lse, want_lse, fwd_tol)
    for got, want in zip(vjp((do, jnp.zeros_like(lse))), want_g):
        _close(got, want, grad_tol)


def test_split_head_dims_with_extras_and_an_lse_cotangent(rng):
    q, k, v, do = _inputs(rng, 192, 128)
    bias = jnp.asarray(rng.standard_normal((1, 4, 12, 16)), jnp.float32)
    mask = jnp.asarray(rng.random((2, 4, 12, 16)) < 0.7) | jnp.eye(12, 16, dtype=bool)
    dlse = jnp.asarray(rng.standard_normal((2, 4, 12)), jnp.float32)
    fn = lambda q, k, v, bias: flash_attention(q, k, v, bias, mask, scale=0.3, window=(5, 3), return_lse=True)
    (o, lse), vjp = jax.vjp(fn, q, k, v, bias)
    want_o, want_lse, want_g = reference.attention(q, k, v, bias=bias, mask=mask, scale=0.3, window=(5, 3),
                                                   do=do, dlse=dlse)
    _close(o, want_o, 2e-5)
    _close(lse, want_lse, 2e-5)
    for got, want in zip(vjp((do, dlse)), want_g):  # dq, dk, dv, dbias
        _close(got, want, 1e-4)


def test_split_head_dims_kernel_entry_points_and_padding(rng):
    """attention_with_lse / attention_bwd; d = 48, dv = 100 pad independently to 64 and 128."""
    assert kernel_head_dims(48, 100, "cpu") == (64, 128)
    q, k, v, do = _inputs(rng, 48, 100)
    want_o, want_lse, want_g = reference.attention(q, k, v, do=do)
    o, lse = attention_with_lse(q, k, v)
    _close(o, want_o, 2e-5)
    _close(lse, want_lse, 2e-5)
    for got, want in zip(attention_bwd(q, k, v, o, lse, do), want_g):
        _close(got, want, 1e-4)


def test_split_head_dim_names_and_where_they_have_no_kernels(rng, sm80_without_split_kernels):
    spec = KernelSpec(192, "bf16", True, "cpu", 128)
    assert spec.target_name("fwd") == "flashgen_fwd_d192v128_bf16_causal"
    assert spec.stem == "d192v128_bf16_causal_cpu" and spec.to_json()["head_dim_v"] == 128
    assert KernelSpec.from_json(spec.to_json()) == spec
    assert parse_target_name("flashgen_bwd_d192v128_bf16_causal").head_dim_v == 128
    assert parse_target_name("flashgen_bwd_d64v64_f32") is None  # equal dims have one name only
    # equal dims: the names, stems and manifests of before
    assert KernelSpec(64, "f32", False, "cpu", 64).to_json() == KernelSpec(64, "f32").to_json()
    assert KernelSpec(64, "f32").target_name("fwd") == "flashgen_fwd_d64_f32"
    with pytest.raises(ValueError, match="target sm80 has no kernels for a value head dim other than"):
        KernelSpec(192, "bf16", True, "sm80", 128)
    # ... where flash_attention runs both at the larger, exact too
    assert kernel_head_dims(192, 128, "sm80") == (192, 192)
    with pytest.raises(ValueError, match="unsupported head_dim 300"):
        flash_attention(jnp.ones((1, 4, 2, 64)), jnp.ones((1, 4, 2, 64)), jnp.ones((1, 4, 2, 300)))
    with pytest.raises(ValueError, match="flash_attention_varlen needs v's head dim \\(128\\) to equal"):
        flash_attention_varlen(jnp.ones((8, 2, 192)), jnp.ones((8, 2, 192)), jnp.ones((8, 2, 128)),
                               np.array([0, 8]), np.array([0, 8]), 8, 8)


def _call(name, outs, *args):
    attrs = dict(causal=False, scale=np.float32(0.1), bottom_right=False, window_left=np.int32(-1),
                 window_right=np.int32(-1), softcap=np.float32(0), extras="")
    return jax.jit(lambda *a: jax.ffi.ffi_call(name, outs)(*a, **attrs))(*args)


def test_split_head_dim_handlers_check_every_shape(rng):
    """Hand-written calls: each wrong last dim is the handler's error, never a wrong kernel; the
    varlen call of a split spec is refused."""
    runtime.ensure([KernelSpec(192, "f32", False, "cpu", 128)])
    q, k, v, _ = _inputs(rng, 192, 128)
    lse_t = jax.ShapeDtypeStruct((2, 4, 12), jnp.float32)
    o_t = jax.ShapeDtypeStruct((2, 12, 4, 128), jnp.float32)
    o, _ = _call("flashgen_fwd_d192v128_f32", (o_t, lse_t), q, k, v)
    _close(o, reference.attention(q, k, v, scale=0.1)[0], 2e-5)
    with pytest.raises(Exception, match="v head_dim is 192 but this kernel is specialized for 128"):
        _call("flashgen_fwd_d192v128_f32", (o_t, lse_t), q, k, k)
    with pytest.raises(Exception, match=r"o has shape \[2, 12, 4, 192\], expected \[2, 12, 4, 128\]"):
        _call("flashgen_fwd_d192v128_f32", (jax.ShapeDtypeStruct(q.shape, q.dtype), lse_t), q, k, v)
    flat = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
    cu = jnp.array([0, 24], jnp.int32), jnp.array([0, 32], jnp.int32)
    with pytest.raises(Exception, match="the varlen and paged calls need the value head dim"):
        jax.jit(lambda *a: jax.ffi.ffi_call("flashgen_fwd_varlen_d192v128_f32", (
            jax.ShapeDtypeStruct((24, 4, 128), jnp.float32), jax.ShapeDtypeStruct((4, 24), jnp.float32)))(
            *a, causal=False, scale=np.float32(0.1), bottom_right=False, window_left=np.int32(-1),
            window_right=np.int32(-1), softcap=np.float32(0), extras="", max_seqlen_q=np.int32(24),
            max_seqlen_k=np.int32(32)))(*flat, *cu)


def test_rewrite_for_a_target_without_split_kernels_pads_v_to_the_query_head_dim(sm80_without_split_kernels):
    """The MLA golden rewritten for sm80 (no d192v128 kernels there): V zero-padded to 192, O
    sliced back to 128, the d192 kernel; exact (run here on the CPU library, which serves the
    same target names)."""
    import pathlib

    import flashgen.rewrite as fr
    from flashgen.rewrite import verify
    golden = pathlib.Path(__file__).parent / "golden" / "inputs"
    for name, fwd, bwd in (("mla_head_dims_192_128", "flashgen_fwd_d192_f32_causal", None),
                           ("train_mla_head_dims_192_128", "flashgen_fwd_d192_f32_causal",
                            "flashgen_bwd_d192_f32_causal")):
        result = fr.rewrite(golden / f"{name}.mlir", target="sm80")
        (site,) = result.rewritten
        assert (site.target, site.backward_target or None) == (fwd, bwd)
        assert any("target sm80 has no kernels for a value head dim" in n for n in site.notes), site.notes
        text = result.text()
        assert "tensor<2x8x4x128xf32>, tensor<f32>) -> tensor<2x8x4x192xf32>" in text  # V (and dO) padded
        assert "(tensor<2x8x4x192xf32>) -> tensor<2x8x4x128xf32>" in text              # O (and dV) sliced
        rows = verify.verify(result, seed=3)["outputs"]
        assert rows and all(r["ok"] for r in rows), [verify.describe(r) for r in rows]


def test_shape_polymorphic_split_head_dim_site(rng):
    """Symbolic batch and sequence, static head dims 192 / 128: rewritten, and the result runs."""
    import math

    from jax import export

    import flashgen.rewrite as fr

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(192)
        return jnp.einsum("bhqk,bkhe->bqhe", jax.nn.softmax(s), v)
    b, t = export.symbolic_shape("b, t")
    qk = jax.ShapeDtypeStruct((b, t, 4, 192), jnp.float32)
    exported = export.export(jax.jit(f), platforms=["cpu"])(qk, qk, jax.ShapeDtypeStruct((b, t, 4, 128), jnp.float32))
    result = fr.rewrite(bytes(exported.serialize()))
    assert [s.target for s in result.rewritten] == ["flashgen_fwd_d192v128_f32"], [s.reason for s in result.rejected]
    runtime.ensure([KernelSpec(192, "f32", False, "cpu", 128)])
    rewritten = export.deserialize(bytearray(result.to_bytes()))
    q, k, v, _ = _inputs(rng, 192, 128, sq=5, sk=5, hkv=4)
    _close(rewritten.call(q, k, v), reference.attention(q, k, v)[0], 2e-5)


def test_emit_and_the_cli_take_a_value_head_dim(capsys, sm80_without_split_kernels):
    from flashgen.cli import main
    from flashgen.emit import attention_module, result_types
    from flashgen.mlir_context import new_context
    from jaxlib.mlir import ir
    spec = KernelSpec(192, "bf16", True, "cpu", 128)
    text = str(attention_module(spec, batch=1, seq_q=16, seq_k=16, heads=4))
    assert ("(tensor<1x16x4x192xbf16>, tensor<1x16x4x192xbf16>, tensor<1x16x4x128xbf16>) -> "
            "(tensor<1x16x4x128xbf16>, tensor<1x4x16xf32>)") in text
    with new_context(), ir.Location.unknown():
        module = ir.Module.parse("func.func @f(%a: tensor<24x4x192xbf16>, %b: tensor<24x4x192xbf16>, "
                                 "%c: tensor<24x4x128xbf16>, %d: tensor<2xi32>) { return }")
        args = list(module.body.operations[0].regions[0].blocks[0].arguments)
        with pytest.raises(ValueError, match="only the dense fwd and bwd calls take a value head dim"):
            result_types(spec, "fwd_varlen", args[:3] + [args[3], args[3]])
    assert main(["emit", "--hdim", "192", "--hdim-v", "128", "--causal", "--seq-q", "8", "--heads", "2"]) == 0
    assert "@flashgen_fwd_d192v128_bf16_causal" in capsys.readouterr().out
    assert main(["build", "--hdim", "192", "--hdim-v", "128", "--target", "sm80"]) != 0
    assert "target sm80 has no kernels for a value head dim" in capsys.readouterr().err


# ---- the sm80 CUDA kernels, emulated (tests/test_cuda_emulated.py's harness) ---------------------
# One library per spec (an nvcc build each, ~40 s): CI builds d192v128 causal and d64v128
# non-causal; the other two of the four are slow.
@functools.cache
def _emulated(head_dim, head_dim_v, causal, dtype="bf16"):
    from flashgen.build import build
    from flashgen.emulate.host import EmulatedLibrary
    spec = KernelSpec(head_dim, dtype, causal, "sm80", head_dim_v)
    return EmulatedLibrary(build(spec, host="emulate")), spec


def _emulated_checker(rng, head_dim, head_dim_v, causal, dtype="bf16"):
    from flashgen.emulate.check import Checker
    return Checker(*_emulated(head_dim, head_dim_v, causal, dtype), rng)


def _assert_matches(result):
    bad = [f"{r.family} [{r.case}] {r.output}: {r.error:.3g} > {r.tolerance:g}" for r in result.rows if not r.ok]
    assert not bad, "\n".join(bad)
    assert {r.output for r in result.rows} >= {"o", "lse", "dq", "dk", "dv"}


@needs_nvcc
@pytest.mark.parametrize("d, dv, causal, dtype", [
    (192, 128, True, "bf16"),
    (64, 128, False, "bf16"),  # dv > d
    pytest.param(192, 128, False, "bf16", marks=pytest.mark.slow),
    pytest.param(64, 128, True, "bf16", marks=pytest.mark.slow),
    pytest.param(192, 128, False, "f32", marks=pytest.mark.slow),  # f32's tiles (4 warps, BC 32)
])
def test_sm80_split_head_dim_kernels_match_float64(rng, d, dv, causal, dtype):
    """Dense fwd (o, lse) and bwd (dq, dk, dv) of the split-head-dim sm80 kernels against float64:
    ragged Sq != Sk both ways, GQA (dK/dV through the f32 accumulators) and one kv head per q
    head (dK/dV stored directly), several key and query blocks."""
    assert kernel_head_dims(d, dv, "sm80") == (d, dv)
    c = _emulated_checker(rng, d, dv, causal, dtype)
    _assert_matches(c.dense(seqlen_q=77, seqlen_k=129, heads_q=4, heads_kv=2, bottom_right=causal))
    _assert_matches(c.dense(seqlen_q=130, seqlen_k=33, heads_q=2, heads_kv=2))


@needs_nvcc
def test_sm80_split_head_dim_kernels_with_extras_and_varlen_refused(rng):
    """The extras variant (bias with its gradient, a mask with a row that sees no key, softcap)
    takes the value head dim too; a varlen call of a split spec is the handler's error."""
    from flashgen.emulate.host import HandlerError
    c = _emulated_checker(rng, 64, 128, False)
    _assert_matches(c.dense(seqlen_q=40, seqlen_k=70, heads_q=2, heads_kv=1, bias=(1, 2), mask=(1, 1),
                            softcap=5.0))
    with pytest.raises(HandlerError, match="the varlen and paged calls need the value head dim"):
        c.varlen(backward=False)
