"""The rewriter on softmaxes over several key axes (issue 23, item 5): scores over a 2-D
grid of keys flatten into one kernel key axis (and the query axes into one query axis)
through the layout adapters, in both spellings a library writes: jax.nn.softmax over a
tuple of axes, and exp(x - logsumexp(x)) (keras' Softmax over several axes); every output
equal to the original's on fresh inputs."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest
from jax.scipy.special import logsumexp

import flashgen.rewrite as fr
from conftest import verified_rewrite

SCALE = 0.125


def _export(fn, dtype, *shapes):
    args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    return jax.export.export(jax.jit(fn), platforms=["cpu"])(*args).mlir_module()


def _verified(text, rng):
    result = verified_rewrite(text, rng)
    assert "stablehlo.exponential" not in result.text()
    return result


def _softmax(s, axes):
    return jax.nn.softmax(s, axis=axes)


def _exp_minus_logsumexp(s, axes):
    return jnp.exp(s - logsumexp(s, axis=axes, keepdims=True))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("normalize", [_softmax, _exp_minus_logsumexp])
def test_two_query_axes_two_key_axes(rng, dtype, normalize):
    def fn(q, k, v):
        s = jnp.einsum("bxyhd,buvhd->bhxyuv", q, k) * SCALE
        p = normalize(s, (-2, -1)).astype(v.dtype)
        return jnp.einsum("bhxyuv,buvhd->bxyhd", p, v)
    x = (2, 4, 3, 2, 64)
    site, = _verified(_export(fn, dtype, x, x, x), rng).rewritten
    assert site.spec["dtype"] == ("f32" if dtype == jnp.float32 else "bf16")


@pytest.mark.parametrize("normalize", [_softmax, _exp_minus_logsumexp])
def test_one_query_axis_two_key_axes(rng, normalize):
    def fn(q, k, v):
        s = jnp.einsum("bxhd,buvhd->bhxuv", q, k) * SCALE
        return jnp.einsum("bhxuv,buvhd->bxhd", normalize(s, (-2, -1)), v)
    _verified(_export(fn, jnp.float32, (2, 5, 2, 64), (2, 4, 3, 2, 64), (2, 4, 3, 2, 64)), rng)


def test_exp_minus_logsumexp_over_one_key_axis(rng):
    def fn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * SCALE
        return jnp.einsum("bhqk,bkhd->bqhd", _exp_minus_logsumexp(s, -1), v)
    x = (2, 12, 2, 64)
    _verified(_export(fn, jnp.float32, x, x, x), rng)


def _another_row_constant(s):
    c = jnp.max(s, axis=-1, keepdims=True)
    return jnp.log(jnp.sum(jnp.exp(s - c), axis=-1, keepdims=True)) + 0.5 * c


def _abs_after_the_log(s):
    c = jnp.max(s, axis=-1, keepdims=True) + 5.0
    return jnp.abs(jnp.log(jnp.sum(jnp.exp(s - c), axis=-1, keepdims=True))) + c


@pytest.mark.parametrize("not_logsumexp", [_another_row_constant, _abs_after_the_log])
def test_a_near_logsumexp_is_refused(not_logsumexp):
    """exp(x - (log(rowsum(exp(x - c))) + c')) with c' != c is softmax(x) * exp(c - c'); an
    abs after the log flips the negative log that a c above the row max gives."""
    def fn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * SCALE
        return jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - not_logsumexp(s)), v)
    x = (2, 12, 2, 64)
    result = fr.rewrite(_export(fn, jnp.float32, x, x, x))
    assert not result.rewritten
    assert [s.reason for s in result.rejected] == [
        "the exponentials are not divided by their row sum (not a softmax)"]


def test_softmax_over_a_key_axis_and_the_head_axis_is_refused():
    def fn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * SCALE
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=(1, 3)), v)
    x = (2, 12, 2, 64)
    result = fr.rewrite(_export(fn, jnp.float32, x, x, x))
    assert not result.rewritten
    assert [s.reason for s in result.rejected] == [
        "the softmax reduces over a batch or head axis"]


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_keras_multi_head_attention_over_two_axes(rng, masked):
    os.environ.setdefault("KERAS_BACKEND", "jax")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.skip("keras runs another backend")
    layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=64, attention_axes=(1, 2))
    x = jnp.asarray(rng.standard_normal((2, 4, 3, 8)), jnp.float32)
    if not masked:
        layer(x, x)
        _verified(_export(lambda q, v: layer(q, v), jnp.float32, x.shape, x.shape), rng)
        return
    mask = rng.random((2, 4, 3, 4, 3)) < 0.7
    mask[0, 1, 2] = False       # a query that sees no key: keras' finite fill, a uniform row
    layer(x, x, attention_mask=jnp.asarray(mask))
    args = [jax.ShapeDtypeStruct(x.shape, jnp.float32)] * 2 + [
        jax.ShapeDtypeStruct(mask.shape, jnp.bool_)]
    text = jax.export.export(jax.jit(lambda q, v, m: layer(q, v, attention_mask=m)),
                             platforms=["cpu"])(*args).mlir_module()
    _verified(text, rng)
