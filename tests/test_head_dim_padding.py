"""Head dims that no kernel has (issue 23, 2a): zero-padded to the next kernel head dim, the
scale the original's; forward, gradients, extras and varlen against the float64 reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashgen import reference
from flashgen.jax import flash_attention, flash_attention_paged, flash_attention_varlen
from flashgen.jax.attention import attention_bwd, attention_with_lse


def _qkv(rng, d, b=2, sq=12, sk=16, hq=4, hkv=2):
    return [jnp.asarray(rng.standard_normal(s), jnp.float32)
            for s in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d))]


@pytest.mark.parametrize("d", [48, 80])
@pytest.mark.parametrize("causal", [False, True])
def test_padded_head_dim_forward_and_grads_match_float64(rng, d, causal):
    q, k, v = _qkv(rng, d)
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    o, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, causal=causal), q, k, v)
    assert o.shape == q.shape
    # the reference's scale defaults to 1/sqrt(d) of the unpadded d: a padded scale would differ
    want_o, _, want_g = reference.attention(q, k, v, causal=causal, do=do)
    np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)
    for got, want in zip(vjp(do), want_g):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_padded_head_dim_with_bias_mask_scale_and_lse(rng):
    d = 48
    q, k, v = _qkv(rng, d)
    bias = jnp.asarray(rng.standard_normal((1, 4, 12, 16)), jnp.float32)
    mask = jnp.asarray(rng.random((2, 4, 12, 16)) < 0.7) | jnp.eye(12, 16, dtype=bool)
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    fn = lambda q, k, v, bias: flash_attention(q, k, v, bias, mask, scale=0.3, return_lse=True)
    (o, lse), vjp = jax.vjp(fn, q, k, v, bias)
    want_o, want_lse, want_g = reference.attention(q, k, v, bias=bias, mask=mask,
                                                              scale=0.3, do=do)
    np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    for got, want in zip(vjp((do, jnp.zeros_like(lse))), want_g):  # dq, dk, dv, dbias
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_padded_head_dim_kernel_entry_points(rng):
    d = 80
    q, k, v = _qkv(rng, d)
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    want_o, want_lse, want_g = reference.attention(q, k, v, causal=True, do=do)
    o, lse = attention_with_lse(q, k, v, causal=True)
    np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    for got, want in zip(attention_bwd(q, k, v, o, lse, do, causal=True), want_g):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_padded_head_dim_varlen(rng):
    d = 48
    cu_q, cu_k = np.array([0, 5, 12]), np.array([0, 7, 16])
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((12, 4, d), (16, 2, d), (16, 2, d)))
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    o, vjp = jax.vjp(lambda q, k, v: flash_attention_varlen(q, k, v, cu_q, cu_k, 7, 9, causal=True), q, k, v)
    want_o, _, want_g = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True, do=do)
    np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)
    for got, want in zip(vjp(do), want_g):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_head_dims_no_kernel_serves_are_clear_errors():
    big = jnp.ones((1, 8, 2, 300))
    with pytest.raises(ValueError, match="unsupported head_dim 300: supported head dims are 32, 64"):
        flash_attention(big, big, big)
    q = jnp.ones((1, 1, 2, 48))
    cache = jnp.ones((2, 4, 2, 48))
    with pytest.raises(ValueError, match="flash_attention_paged needs a kernel head dim, got 48"):
        flash_attention_paged(q, cache, cache, jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32))
