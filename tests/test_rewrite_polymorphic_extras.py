"""Shape-polymorphic sites with extra operands (issue 23, item 4): run-time masks, key padding,
biases, segment ids and a run-time scale under symbolic batch and sequence, rewritten into a
dynamic call whose extra operands and empty-row fix-up are built at run-time sizes
(flashgen.rewrite.polymorphic, polymorphic_rows).

Each module is exported from plain JAX / flax with symbolic dims, rewritten, and the
rewritten artifact is called through jax.export at two concrete shapes against the original,
on every row -- the masks leave some query rows with no visible key, which the original
fills with the mean of V (a finite fill) and the rewrite fixes up after the call.
"""
from __future__ import annotations

import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import flashgen.rewrite as fr

H, D = 4, 32
GOLDEN = pathlib.Path(__file__).parent / "golden" / "inputs"
SHAPES = [(2, 17), (3, 40)]   # (batch, sequence)


def _sym():
    """The symbolic batch and sequence, and Q, K, V specs [b, t, H, D] over them."""
    b, t = export.symbolic_shape("b, t")
    return b, t, [jax.ShapeDtypeStruct((b, t, H, D), jnp.float32)] * 3


def _einsum(q, k, v, mask=None, bias=None, fill=-1e9, scale=1 / math.sqrt(D)):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if bias is not None:
        s = s + bias
    if mask is not None:
        s = jnp.where(mask, s, fill)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _padding(rng, b, t):
    """[b, t] bool key padding: sequence 0 has no real key at all (every row empty), the
    others a random length >= 1, right-padded."""
    lengths = [0] + list(rng.integers(1, t + 1, size=b - 1))
    return np.arange(t)[None, :] < np.array(lengths)[:, None]


def _rewrite(exported, extras):
    from flashgen import runtime
    result = fr.rewrite(exported.serialize())
    assert [s.status for s in result.sites] == ["rewritten"], \
        [(s.status, s.reason) for s in result.sites]
    (site,) = result.rewritten
    assert site.extras == extras and any("shape-polymorphic" in n for n in site.notes)
    runtime.ensure(sorted(result.specs))
    new = export.deserialize(bytearray(result.to_bytes()))
    text = new.mlir_module()
    assert "flashgen_fwd" in text and "stablehlo.exponential" not in text
    return new, site


def _check(exported, extras, make_inputs, empty_rows="mean"):
    """The rewritten module equals the original at SHAPES on every row (``make_inputs``
    leaves some rows without a visible key); the site's extras and empty-row behaviour."""
    new, site = _rewrite(exported, extras)
    assert site.empty_rows == empty_rows
    rng = np.random.default_rng(3)
    for b, t in SHAPES:
        args = make_inputs(rng, b, t)
        ref = np.asarray(exported.call(*args))
        got = np.asarray(new.call(*args))
        assert got.shape == ref.shape == (b, t, H, D)
        np.testing.assert_allclose(got, ref, atol=2e-5, rtol=2e-5)
    return new, site


def _qkv(rng, b, t):
    return [rng.standard_normal((b, t, H, D)).astype(np.float32) for _ in range(3)]


def _assert_mean_rows(out, v, rows):
    """Rows ``rows`` ([b] bool: the sequence has no real key) are the mean of V over keys."""
    mean = v.mean(axis=1, keepdims=True)
    np.testing.assert_allclose(out[rows], np.broadcast_to(mean, out.shape)[rows],
                               atol=2e-5, rtol=2e-5)


def test_key_padding_mask_argument():
    """A [b, t] key-padding argument, select with a finite fill: segment ids with q id 1,
    and the fix-up for the fully padded sequence (every one of its rows)."""
    b, t, qkv = _sym()
    m = jax.ShapeDtypeStruct((b, t), jnp.bool_)
    ex = export.export(jax.jit(lambda q, k, v, m: _einsum(q, k, v, m[:, None, None, :])))(
        *qkv, m)

    def inputs(rng, b, t):
        return _qkv(rng, b, t) + [_padding(rng, b, t)]
    new, _ = _check(ex, ["segment_ids"], inputs)
    rng = np.random.default_rng(5)
    q, k, v, pad = inputs(rng, 3, 23)
    _assert_mean_rows(np.asarray(new.call(q, k, v, pad)), v, ~pad.any(axis=1))


def test_key_padding_with_causal():
    """Key padding AND a causal mask of the symbolic length: the fix-up's band from dynamic
    iotas (left padding: the first rows of a sequence see no key)."""
    b, t, qkv = _sym()
    m = jax.ShapeDtypeStruct((b, t), jnp.bool_)

    def f(q, k, v, m):
        n = q.shape[1]
        causal = jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]
        return _einsum(q, k, v, m[:, None, None, :] & causal[None, None])
    ex = export.export(jax.jit(f))(*qkv, m)

    def inputs(rng, b, t):
        return _qkv(rng, b, t) + [~_padding(rng, b, t)]    # left padding: keys at the end
    _, site = _check(ex, ["segment_ids"], inputs)
    assert site.causal


def test_flax_key_padding():
    """flax linen MultiHeadDotProductAttention with make_attention_mask(query ones, key
    padding), symbolic batch and sequence (the golden poly_flax_key_padding's export)."""
    ex = export.deserialize(bytearray((GOLDEN / "poly_flax_key_padding.jax_exported")
                                      .read_bytes()))
    new, site = _rewrite(ex, ["segment_ids"])
    assert site.empty_rows == "mean"
    rng = np.random.default_rng(4)
    *weights, _, _ = ex.in_avals
    params = [rng.standard_normal(a.shape).astype(np.float32) / 8 for a in weights]
    for b, t in SHAPES:
        x = rng.standard_normal((b, t, H * D)).astype(np.float32)
        pad = _padding(rng, b, t)
        args, _ = jax.tree_util.tree_unflatten(ex.in_tree, params + [x, pad])
        ref = np.asarray(ex.call(*args))
        np.testing.assert_allclose(np.asarray(new.call(*args)), ref, atol=2e-5, rtol=2e-5)


def test_jnn_mask_and_bias():
    """jax.nn.dot_product_attention(mask=[b, 1, t, t], bias=[b, H, t, t]): a mask operand
    (a random pattern, some rows all False) and a run-time bias operand."""
    b, t, qkv = _sym()
    mask = jax.ShapeDtypeStruct((b, 1, t, t), jnp.bool_)
    bias = jax.ShapeDtypeStruct((b, H, t, t), jnp.float32)
    ex = export.export(jax.jit(lambda q, k, v, m, c: jax.nn.dot_product_attention(
        q, k, v, mask=m, bias=c)))(*qkv, mask, bias)

    def inputs(rng, b, t):
        m = rng.random((b, 1, t, t)) < 0.6
        m[:, :, ::5] = False                  # rows with no visible key
        return _qkv(rng, b, t) + [m, rng.standard_normal((b, H, t, t)).astype(np.float32)]
    _check(ex, ["bias", "mask"], inputs)


def test_jnn_bias_only():
    """A run-time bias broadcast over heads and queries ([b, 1, 1, t]): no empty rows."""
    b, t, qkv = _sym()
    bias = jax.ShapeDtypeStruct((b, 1, 1, t), jnp.float32)
    ex = export.export(jax.jit(lambda q, k, v, c: jax.nn.dot_product_attention(
        q, k, v, bias=c)))(*qkv, bias)

    def inputs(rng, b, t):
        return _qkv(rng, b, t) + [rng.standard_normal((b, 1, 1, t)).astype(np.float32)]
    _check(ex, ["bias"], inputs, empty_rows="none")


def test_segment_ids():
    """Packed sequences: q and kv segment ids compared (ids that occur on one side only
    leave rows without a visible key)."""
    b, t, qkv = _sym()
    ids = jax.ShapeDtypeStruct((b, t), jnp.int32)
    ex = export.export(jax.jit(lambda q, k, v, qs, ks: _einsum(
        q, k, v, qs[:, None, :, None] == ks[:, None, None, :])))(*qkv, ids, ids)

    def inputs(rng, b, t):
        return _qkv(rng, b, t) + [rng.integers(0, 4, (b, t)).astype(np.int32),
                                  rng.integers(1, 4, (b, t)).astype(np.int32)]
    _check(ex, ["segment_ids"], inputs)


def test_runtime_scale():
    """The scores times a run-time scalar: multiplied into Q before the call."""
    b, t, qkv = _sym()
    ex = export.export(jax.jit(lambda q, k, v, c: _einsum(q, k, v, scale=c)))(
        *qkv, jax.ShapeDtypeStruct((), jnp.float32))

    def inputs(rng, b, t):
        return _qkv(rng, b, t) + [np.float32(rng.uniform(0.5, 2.0))]
    _check(ex, [], inputs, empty_rows="none")


def test_constant_mask_over_symbolic_axes_left_alone():
    """A constant mask that is no band (from iotas of the symbolic length) has the
    instance's sizes: refused with its reason, never a traceback."""
    b, t, qkv = _sym()

    def f(q, k, v):
        n = q.shape[1]
        mask = (jnp.arange(n)[:, None] + jnp.arange(n)[None, :]) % 3 != 0
        return _einsum(q, k, v, mask[None, None])
    ex = export.export(jax.jit(f))(*qkv)
    result = fr.rewrite(ex.serialize())
    assert not result.rewritten
    (site,) = result.sites
    assert "shape-polymorphic" in site.reason and "constant" in site.reason, site.reason


def _alibi_causal(q, k, v):
    """Causal attention with an ALiBi bias built from iotas of the (symbolic) length."""
    n = q.shape[1]
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    slopes = np.array([2.0 ** (-8 * (h + 1) / H) for h in range(H)], np.float32)
    bias = -slopes[:, None, None] * jnp.abs(i - j)[None].astype(jnp.float32)
    return _einsum(q, k, v, (i >= j)[None, None], bias[None])


def test_alibi_from_iotas():
    """An ALiBi bias of the symbolic length folds, in each instance, to the same constant
    [Hq] slopes: the call carries them as a constant operand."""
    b, t, qkv = _sym()
    ex = export.export(jax.jit(_alibi_causal))(*qkv)
    _, site = _check(ex, ["alibi"], _qkv, empty_rows="none")
    assert site.causal


@pytest.mark.parametrize("causal", [False, True])
def test_jnn_key_value_seq_lengths(causal):
    """jax.nn.dot_product_attention(key_value_seq_lengths=[b]): the mask jax.nn builds after
    the Q·K product (read before the P·V product, where the call goes) as key padding."""
    b, t, qkv = _sym()
    lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
    ex = export.export(jax.jit(lambda q, k, v, n: jax.nn.dot_product_attention(
        q, k, v, key_value_seq_lengths=n, is_causal=causal)))(*qkv, lengths)

    def inputs(rng, b, t):
        return _qkv(rng, b, t) + [np.array([0, *rng.integers(1, t + 1, b - 1)], np.int32)]
    _check(ex, ["segment_ids"], inputs)


def test_additive_finfo_min_padding():
    """transformers' spelling: (1 - mask) * finfo(f32).min added to the scores, a run-time
    bias floored at run-time sizes (the fully padded sequence averages V, as the original)."""
    b, t, qkv = _sym()
    m = jax.ShapeDtypeStruct((b, t), jnp.bool_)

    def f(q, k, v, m):
        bias = (1.0 - m[:, None, None, :].astype(jnp.float32)) * jnp.finfo(jnp.float32).min
        return _einsum(q, k, v, bias=bias)
    ex = export.export(jax.jit(f))(*qkv, m)

    def inputs(rng, b, t):
        return _qkv(rng, b, t) + [_padding(rng, b, t)]
    new, _ = _check(ex, ["bias"], inputs, empty_rows="none")
    q, k, v, pad = inputs(np.random.default_rng(6), 3, 23)
    _assert_mean_rows(np.asarray(new.call(q, k, v, pad)), v, ~pad.any(axis=1))


def test_neg_inf_padding_rows_are_zero():
    """A -inf fill: the original's rows without a key are NaN (0/0); the rewrite gives 0
    there (reported as such) and equals it on every other row."""
    b, t, qkv = _sym()
    m = jax.ShapeDtypeStruct((b, t), jnp.bool_)
    ex = export.export(jax.jit(lambda q, k, v, m: _einsum(
        q, k, v, m[:, None, None, :], fill=-jnp.inf)))(*qkv, m)
    new, site = _rewrite(ex, ["segment_ids"])
    assert site.empty_rows == "nan"
    rng = np.random.default_rng(8)
    for b, t in SHAPES:
        q, k, v, pad = _qkv(rng, b, t) + [_padding(rng, b, t)]
        ref, got = np.asarray(ex.call(q, k, v, pad)), np.asarray(new.call(q, k, v, pad))
        empty = ~pad.any(axis=1)
        assert np.isnan(ref[empty]).all() and (got[empty] == 0).all()
        np.testing.assert_allclose(got[~empty], ref[~empty], atol=2e-5, rtol=2e-5)


def test_gqa_causal_padding_and_bf16():
    """jax.nn with 2 kv heads for 4 query heads, causal, a left-padding mask: the fix-up's
    mean reads each query head's kv head; and a bf16 call (bf16 precision)."""
    b, t = export.symbolic_shape("b, t")
    q = jax.ShapeDtypeStruct((b, t, H, D), jnp.float32)
    kv = jax.ShapeDtypeStruct((b, t, 2, D), jnp.float32)
    m = jax.ShapeDtypeStruct((b, t), jnp.bool_)
    ex = export.export(jax.jit(lambda q, k, v, m: jax.nn.dot_product_attention(
        q, k, v, mask=m[:, None, None, :], is_causal=True)))(q, kv, kv, m)

    def inputs(rng, b, t):
        return [rng.standard_normal((b, t, h, D)).astype(np.float32) for h in (H, 2, 2)] + \
            [~_padding(rng, b, t)]
    _, site = _check(ex, ["segment_ids"], inputs)
    assert site.kv_heads == 2
    bf = [jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in (q, q, q)]
    ex = export.export(jax.jit(lambda q, k, v, m: jax.nn.dot_product_attention(
        q, k, v, mask=m[:, None, None, :])))(*bf, m)
    new, site = _rewrite(ex, ["segment_ids"])
    assert site.dtype == "bf16"
    rng = np.random.default_rng(9)
    for b, t in SHAPES:
        args = [x.astype(jnp.bfloat16) for x in _qkv(rng, b, t)] + [_padding(rng, b, t)]
        np.testing.assert_allclose(np.asarray(new.call(*args)).astype(np.float32),
                                   np.asarray(ex.call(*args)).astype(np.float32),
                                   atol=3e-2, rtol=3e-2)


def test_cross_attention_two_lengths():
    """Queries of length s, keys of length u (two dimension variables), a key-padding mask
    of length u."""
    b, s, u = export.symbolic_shape("b, s, u")
    q = jax.ShapeDtypeStruct((b, s, H, D), jnp.float32)
    kv = jax.ShapeDtypeStruct((b, u, H, D), jnp.float32)
    m = jax.ShapeDtypeStruct((b, u), jnp.bool_)
    ex = export.export(jax.jit(lambda q, k, v, m: jax.nn.dot_product_attention(
        q, k, v, mask=m[:, None, None, :])))(q, kv, kv, m)

    def inputs(rng, b, t):
        return [rng.standard_normal((b, n, H, D)).astype(np.float32) for n in (t, t + 7, t + 7)] \
            + [_padding(rng, b, t + 7)]
    new, site = _rewrite(ex, ["segment_ids"])
    assert (site.seq_q, site.seq_k) == ("s", "u")
    rng = np.random.default_rng(10)
    for b, t in SHAPES:
        args = inputs(rng, b, t)
        np.testing.assert_allclose(np.asarray(new.call(*args)), np.asarray(ex.call(*args)),
                                   atol=2e-5, rtol=2e-5)
