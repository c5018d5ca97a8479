"""flashgen.jax: transformations, export, and errors on bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashgen import KernelSpec, reference, runtime
from flashgen.jax import export, flash_attention

D = 32


def _qkv(rng, b=2, sq=16, sk=16, hq=4, hkv=2, d=D, dtype=jnp.float32):
    return [jnp.asarray(rng.standard_normal(s), dtype) for s in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d))]


def test_vmap_folds_into_batch_and_matches(rng):
    q, k, v = _qkv(rng)
    qs = jnp.stack([q, 2 * q, -q])
    out = jax.vmap(lambda q: flash_attention(q, k, v, causal=True))(qs)
    for i in range(3):
        np.testing.assert_allclose(out[i], flash_attention(qs[i], k, v, causal=True), rtol=1e-6, atol=1e-6)
    # vmap of grad, with every argument mapped.
    ks = jnp.stack([k, k * 0.5, k])
    g = jax.vmap(jax.grad(lambda q, k: flash_attention(q, k, v).sum(), (0, 1)))(qs, ks)
    for i in range(3):
        gi = jax.grad(lambda q, k: flash_attention(q, k, v).sum(), (0, 1))(qs[i], ks[i])
        np.testing.assert_allclose(g[0][i], gi[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g[1][i], gi[1], rtol=1e-5, atol=1e-5)


def test_grad_inside_a_larger_jit_program(rng):
    q, k, v = _qkv(rng)
    w = jnp.asarray(rng.standard_normal((D, D)), jnp.float32)

    def loss(w, q, k, v):
        return jnp.sum(jnp.tanh(flash_attention(q @ w, k, v, causal=True)) ** 2)

    def ref_loss(w, q, k, v):
        o = jax.nn.dot_product_attention(q @ w, k, v, is_causal=True)
        return jnp.sum(jnp.tanh(o) ** 2)

    g = jax.jit(jax.grad(loss))(w, q, k, v)
    np.testing.assert_allclose(g, jax.grad(ref_loss)(w, q, k, v), rtol=1e-4, atol=1e-4)


def test_export_roundtrip_keeps_typed_attributes(rng):
    q, k, v = _qkv(rng)
    fn = lambda q, k, v: flash_attention(q, k, v, causal=True, scale=0.3)
    exp = export(fn, q, k, v)
    text = exp.mlir_module()
    assert "flashgen_fwd_d32_f32_causal" in text and "scale = 3.000000e-01 : f32" in text
    restored = jax.export.deserialize(exp.serialize())
    np.testing.assert_allclose(restored.call(q, k, v), reference.attention(q, k, v, causal=True, scale=0.3)[0],
                               rtol=1e-5, atol=1e-5)
    # The VJP exports too: the backward custom call keeps its attributes.
    exp_grad = export(jax.grad(lambda q, k, v: fn(q, k, v).sum()), q, k, v)
    assert "flashgen_bwd_d32_f32_causal" in exp_grad.mlir_module()
    g = jax.export.deserialize(exp_grad.serialize()).call(q, k, v)
    np.testing.assert_allclose(g, jax.grad(lambda q: fn(q, k, v).sum())(q), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("make, exc, words", [
    (lambda r: (jnp.ones((2, 8, 32)), jnp.ones((2, 8, 2, 32)), jnp.ones((2, 8, 2, 32))), ValueError, "rank 4"),
    (lambda r: (jnp.ones((2, 8, 3, 32)), jnp.ones((2, 8, 2, 32)), jnp.ones((2, 8, 2, 32))), ValueError,
     "must divide q heads"),
    (lambda r: (jnp.ones((2, 8, 2, 300)), jnp.ones((2, 8, 2, 300)), jnp.ones((2, 8, 2, 300))), ValueError,
     "unsupported head_dim 300"),
    (lambda r: (jnp.ones((2, 8, 2, 32)), jnp.ones((2, 8, 2, 32), jnp.bfloat16), jnp.ones((2, 8, 2, 32))), TypeError,
     "share one dtype"),
    (lambda r: (jnp.ones((2, 8, 2, 32), jnp.int32),) * 3, ValueError, "unsupported dtype"),
    (lambda r: (jnp.ones((2, 8, 2, 32)), jnp.ones((2, 8, 2, 32)), jnp.ones((2, 9, 2, 32))), ValueError,
     "k and v shapes differ"),
])
def test_bad_input_is_a_python_error(rng, make, exc, words):
    with pytest.raises(exc, match=words):
        flash_attention(*make(rng))


def test_traced_scale_is_rejected(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match="scale must be a Python number"):
        jax.jit(lambda s: flash_attention(q, k, v, scale=s))(0.5)


def _call_target(name, outs, *args, **attrs):
    return jax.jit(lambda *a: jax.ffi.ffi_call(name, outs)(*a, **attrs))(*args)


def test_handler_rejects_mismatched_calls_without_crashing(rng):
    """A hand-written call with wrong shapes/attributes gets the handler's error, not a crash."""
    runtime.ensure([KernelSpec(D, "f32", False, "cpu")])
    q, k, v = _qkv(rng)
    name = "flashgen_fwd_d32_f32"
    good = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((2, 4, 16), jnp.float32))
    rest = dict(window_left=np.int32(-1), window_right=np.int32(-1), softcap=np.float32(0), extras="")
    ok = _call_target(name, good, q, k, v, causal=False, scale=np.float32(0.2), bottom_right=False, **rest)
    np.testing.assert_allclose(ok[0], reference.attention(q, k, v, scale=0.2)[0], rtol=1e-5, atol=1e-5)
    cases = [
        ((q, k[:, :, :1], v), good, {}, "k and v shapes differ"),
        ((q, k[:, :8], v[:, :8]), (good[0], jax.ShapeDtypeStruct((2, 4, 15), jnp.float32)), {}, "lse has shape"),
        ((q, k, v), good, {"causal": True}, "does not match this kernel"),
        ((q[:, :, :3], k, v), (jax.ShapeDtypeStruct((2, 16, 3, D), q.dtype), good[1]), {}, "must divide q heads"),
        ((q, k, v), good, {"scale": np.float32(-1.0)}, "scale must be a finite positive"),
        ((q, k, v), good, {"window_left": np.int32(-2)}, "window_left / window_right must be >= -1"),
        ((q, k, v), good, {"softcap": np.float32(np.nan)}, "softcap must be a finite f32 >= 0"),
        ((q, k, v), good, {"bottom_right": True}, "bottom_right=true needs causal=true, a sliding window"),
        ((q, k, v), good, {"extras": "bias"}, "names 1 extra operand"),
        ((q, k, v), good, {"extras": "mask,bias"}, "out of order"),
        ((q, k, v, np.ones((1, 1, 16, 15), np.float32)), good, {"extras": "bias"}, "bias has shape"),
        ((q, k, v, np.ones((2, 4, 16, 16), np.int32)), good, {"extras": "mask"}, "mask must be i1"),
        ((q, k, v), good, {"window_left": None}, "Wrong number of attributes"),
    ]
    for args, outs, over, words in cases:
        attrs = dict(causal=False, scale=np.float32(0.2), bottom_right=False, **rest)
        attrs.update(over)
        attrs = {a: x for a, x in attrs.items() if x is not None}
        with pytest.raises(Exception, match=words):
            jax.block_until_ready(_call_target(name, outs, *args, **attrs))


def test_python_float_attribute_is_the_documented_ffi_error(rng):
    runtime.ensure([KernelSpec(D, "f32", False, "cpu")])
    q, k, v = _qkv(rng)
    outs = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((2, 4, 16), jnp.float32))
    with pytest.raises(Exception, match="F32"):
        jax.block_until_ready(_call_target("flashgen_fwd_d32_f32", outs, q, k, v, causal=False, scale=0.2,
                                           bottom_right=False, window_left=np.int32(-1),
                                           window_right=np.int32(-1), softcap=np.float32(0),
                                           extras=""))


def test_drop_in_for_jax_nn_dot_product_attention(rng):
    q, k, v = _qkv(rng)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    got = flash_attention(query=q, key=k, value=v, is_causal=True, scale=0.3)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(flash_attention(q, k, v, causal=True, scale=0.3), want, rtol=2e-5, atol=2e-5)
    mask = jnp.asarray(rng.random((2, 4, 16, 16)) < 0.7) | jnp.eye(16, dtype=bool)
    bias = jnp.asarray(rng.standard_normal((1, 4, 16, 16)), jnp.float32)
    np.testing.assert_allclose(flash_attention(q, k, v, bias, mask, scale=0.3),
                               jax.nn.dot_product_attention(q, k, v, bias, mask, scale=0.3),
                               rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="contradicts"):
        flash_attention(q, k, v, causal=False, is_causal=True)
