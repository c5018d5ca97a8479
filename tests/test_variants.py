"""ALiBi, bias (with its gradient), boolean masks, segment ids, packed varlen and the paged KV
cache (issue 8): the CPU kernels through flashgen.jax against the float64 reference
(flashgen/reference.py), forward and gradients, on fresh random inputs with NaN-poisoned
outputs (conftest). Semantics: README "Variants". Only d32/d64 specs are built (compile time);
tolerances as in test_cpu_numerics.py, relative to max(max |ref|, 1).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashgen import reference
from flashgen.jax import flash_attention, flash_attention_paged, flash_attention_varlen
from test_window_softcap import JNP, TOL, specs  # noqa: F401 - specs: the d32/d64 CPU library


def _rel(got, want):
    want = np.asarray(want, np.float64)
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got - want), initial=0.0) / max(np.max(np.abs(want), initial=0.0), 1.0))


def _qkv(rng, dtype, b, sq, sk, hq, hkv, d):
    shapes = [(b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d)]
    return [jnp.asarray(rng.standard_normal(s), JNP[dtype]) for s in shapes]


def check(rng, *, dtype="f32", d=32, b=2, sq=19, sk=23, hq=4, hkv=2, causal=False,
          bottom_right=False, window=(-1, -1), softcap=0.0, alibi=None, bias=None, mask=None,
          segments=None, grads=True, tol=None):
    """flash_attention with the given extras vs reference.attention; returns the errors.
    alibi / bias / mask / segments: shapes (or 'kv' / 'q') of the extras to draw."""
    q, k, v, do = _qkv(rng, dtype, b, sq, sk, hq, hkv, d)
    extra, ref_extra = {}, {}
    if alibi is not None:
        slopes = jnp.asarray(rng.uniform(0.05, 0.5, alibi), jnp.float32)
        extra["alibi_slopes"] = ref_extra["alibi_slopes"] = slopes
    if bias is not None:
        shape, bias_dtype = bias
        extra["bias"] = jnp.asarray(rng.standard_normal(shape), JNP[bias_dtype])
        ref_extra["bias"] = np.broadcast_to(np.asarray(extra["bias"], np.float64),
                                            np.broadcast_shapes(shape, (1, 1, sq, sk)))
    if mask is not None:
        m = rng.random(mask) > 0.3
        extra["mask"] = jnp.asarray(m)
        ref_extra["mask"] = np.broadcast_to(m, np.broadcast_shapes(mask, (b, hq, sq, sk)))
    if segments is not None:
        qs = np.sort(rng.integers(0, segments, (b, sq)), axis=1).astype(np.int32)
        ks = np.sort(rng.integers(0, segments, (b, sk)), axis=1).astype(np.int32)
        extra.update(q_segment_ids=jnp.asarray(qs), kv_segment_ids=jnp.asarray(ks))
        ref_extra.update(q_segment_ids=qs, kv_segment_ids=ks)
    kw = dict(causal=causal, bottom_right=bottom_right, window=window, softcap=softcap)
    bias_arg = extra.pop("bias", None)

    def f(q, k, v, bias_arg):
        return flash_attention(q, k, v, bias_arg, **extra, **kw)

    ref = reference.attention(q, k, v, do=do if grads else None, **kw, **ref_extra)
    fwd_tol, bwd_tol = (tol or TOL)[dtype]
    if not grads:
        o = jax.jit(f)(q, k, v, bias_arg)
        err = _rel(o, ref[0])
        assert err <= fwd_tol, err
        return {"o": err}
    o, vjp = jax.vjp(jax.jit(f), q, k, v, bias_arg)
    got = vjp(do)
    errs = {"o": _rel(o, ref[0])}
    for name, g, r in zip(("dq", "dk", "dv"), got[:3], ref[2][:3]):
        errs[name] = _rel(g, r)
    if bias_arg is not None:
        want = ref[2][3]  # summed over the broadcast dims of the [1|B, 1|H, Sq, Sk] bias
        padded = (1,) * (4 - bias_arg.ndim) + bias_arg.shape
        want = want.sum(axis=tuple(i for i in range(4) if padded[i] == 1 and want.shape[i] != 1),
                        keepdims=True)
        errs["dbias"] = _rel(got[3], want.reshape(bias_arg.shape))
        assert got[3].dtype == bias_arg.dtype
    assert errs["o"] <= fwd_tol, errs
    assert max(v for n, v in errs.items() if n != "o") <= bwd_tol, errs
    for g in got[:3]:
        assert np.all(np.isfinite(np.asarray(g, np.float32)))
    return errs


# ----------------------------------------------------------------------------- reference
def test_reference_extras_match_autodiff(rng):
    """The float64 reference's ALiBi/bias/mask/segment semantics and dbias agree with a direct
    jnp formulation differentiated by JAX."""
    jax.config.update("jax_enable_x64", True)
    try:
        b, sq, sk, h, d = 2, 5, 7, 2, 4
        q, do = rng.standard_normal((b, sq, h, d)), rng.standard_normal((b, sq, h, d))
        k, v = rng.standard_normal((b, sk, h, d)), rng.standard_normal((b, sk, h, d))
        slopes, bias = rng.uniform(0.1, 1, (h,)), rng.standard_normal((1, h, sq, sk))
        m = rng.random((b, 1, sq, sk)) > 0.2
        qs, ks = rng.integers(0, 2, (b, sq)), rng.integers(0, 2, (b, sk))
        m[..., 0], m[..., 1] = True, True  # every row sees key 0 or key 1
        ks[:, 0], ks[:, 1] = 0, 1
        dist = np.abs(np.arange(sq)[:, None] + (sk - sq) - np.arange(sk)[None])

        def f(q, k, v, bias):
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.3 - slopes[:, None, None] * dist + bias
            vis = m & (qs[:, None, :, None] == ks[:, None, None, :])
            s = jnp.where(vis, s, -jnp.inf)
            p = jax.nn.softmax(s, axis=-1)
            return jnp.einsum("bhqk,bkhd->bqhd", p, v)
        o, vjp = jax.vjp(f, q, k, v, bias)
        want = vjp(do)
        ro, _, rg = reference.attention(q, k, v, scale=0.3, bottom_right=True, alibi_slopes=slopes,
                                        bias=bias, mask=m, q_segment_ids=qs, kv_segment_ids=ks, do=do)
        np.testing.assert_allclose(ro, o, atol=1e-12)
        for g, w in zip(rg, want):
            np.testing.assert_allclose(g, w, atol=1e-10)
    finally:
        jax.config.update("jax_enable_x64", False)


# ----------------------------------------------------------------------------- ALiBi
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True),
                                                 (False, True)])
def test_alibi(rng, causal, bottom_right):
    check(rng, alibi=(4,), causal=causal, bottom_right=bottom_right)


def test_alibi_per_batch_bf16_gqa(rng):
    check(rng, dtype="bf16", d=64, alibi=(2, 4), causal=True, sq=130, sk=130)


def test_alibi_with_window_and_softcap(rng):
    check(rng, alibi=(4,), window=(5, 3), softcap=4.0, sq=70, sk=70)


# ----------------------------------------------------------------------------- bias
@pytest.mark.parametrize("shape", [(2, 4), (1, 4), (2, 1), (1, 1)])
def test_bias_broadcasts_and_dbias(rng, shape):
    check(rng, bias=((*shape, 19, 23), "f32"))


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_bias_in_input_dtype(rng, dtype):
    check(rng, dtype=dtype, d=64, bias=((2, 1, 19, 23), dtype), causal=True)


def test_bias_lower_rank_broadcasts_like_dot_product_attention(rng):
    """A [Sk] or [1, Sq, Sk] bias broadcasts as in jax.nn.dot_product_attention."""
    check(rng, bias=((23,), "f32"))
    check(rng, bias=((19, 23), "f32"), softcap=3.0)


def test_bias_with_neg_inf_masks_rows(rng):
    q, k, v, _ = _qkv(rng, "f32", 1, 6, 6, 2, 2, 32)
    bias = np.zeros((1, 2, 6, 6), np.float32)
    bias[0, 1, 3, :] = -np.inf  # one row sees nothing
    o, lse = flash_attention(q, k, v, jnp.asarray(bias), return_lse=True)
    assert np.all(np.asarray(o)[0, 3, 1] == 0) and np.isneginf(np.asarray(lse)[0, 1, 3])
    ref = reference.attention(q, k, v, bias=bias)
    assert _rel(o, ref[0]) < 2e-5


def test_bias_long_sequence_multiblock(rng):
    check(rng, d=64, b=1, sq=300, sk=260, hq=2, hkv=1, bias=((1, 2, 300, 260), "f32"), causal=True,
          bottom_right=True)


def test_key_only_bias_reaches_the_kernel_as_one_row_and_dbias_sums_the_queries(rng):
    """A [B|1, H|1, 1, Sk] bias (BLOOM's ALiBi from a padded batch's positions) is passed as
    it is, O(Sk) (kernel row stride 0), not broadcast to [.., Sq, Sk]; its dbias is summed over
    the queries, across key blocks and with the bias shared by batch entries."""
    q, k, v, _ = _qkv(rng, "f32", 2, 19, 23, 4, 2, 32)
    bias = jnp.asarray(rng.standard_normal((2, 4, 1, 23)), jnp.float32)
    text = jax.jit(lambda q, b: flash_attention(q, k, v, b, causal=True)).lower(q, bias).as_text()
    (line,) = [l for l in text.splitlines() if "flashgen_fwd_d32_f32_causal" in l]
    assert "tensor<2x4x1x23xf32>" in line and "x19x23x" not in line, line
    check(rng, bias=((2, 4, 1, 23), "f32"), causal=True)
    check(rng, d=64, b=2, sq=150, sk=150, hq=2, hkv=1, bias=((1, 2, 1, 150), "f32"), causal=True)
    check(rng, dtype="bf16", d=64, bias=((2, 1, 1, 23), "bf16"))


# ----------------------------------------------------------------------------- mask
def test_mask_full_shape_with_masked_rows(rng):
    q, k, v, do = _qkv(rng, "f32", 2, 9, 11, 2, 2, 32)
    m = rng.random((2, 2, 9, 11)) > 0.5
    m[1, 0, 4] = False  # a row that sees no key
    o, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, mask=jnp.asarray(m)), q, k, v)
    ref = reference.attention(q, k, v, mask=m, do=do)
    assert _rel(o, ref[0]) < 2e-5
    assert np.all(np.asarray(o)[1, 4, 0] == 0)
    for g, r in zip(vjp(do), ref[2]):
        assert _rel(g, r) < 1e-4


@pytest.mark.parametrize("shape", [(1, 1, 19, 23), (2, 1, 19, 23), (2, 4, 19, 23)])
def test_mask_broadcasts(rng, shape):
    check(rng, mask=shape, causal=True, window=(-1, -1))


def test_key_padding_mask_becomes_segment_ids(rng):
    """A [B, 1, 1, Sk] key-padding mask travels as segment ids (no [Sq, Sk] operand)."""
    q, k, v, do = _qkv(rng, "f32", 2, 13, 17, 2, 2, 32)
    m = np.ones((2, 1, 1, 17), bool)
    m[0, ..., 11:] = False
    m[1, ..., :3] = False
    text = jax.jit(lambda q, k, v: flash_attention(q, k, v, mask=jnp.asarray(m))).lower(q, k, v).as_text()
    assert 'extras = "segment_ids"' in text and "tensor<2x1x13x17xi1>" not in text
    check(rng, mask=(2, 1, 1, 23))


def test_mask_combined_with_everything(rng):
    check(rng, dtype="bf16", d=64, mask=(2, 4, 19, 23), alibi=(4,), bias=((1, 4, 19, 23), "f32"),
          softcap=5.0, window=(6, 2))


# ----------------------------------------------------------------------------- segment ids
@pytest.mark.parametrize("causal", [False, True])
def test_segment_ids_packed(rng, causal):
    check(rng, segments=3, causal=causal, sq=40, sk=40)


def test_segment_ids_query_without_keys(rng):
    q, k, v, do = _qkv(rng, "f32", 1, 8, 8, 2, 2, 32)
    qs = np.array([[0, 0, 1, 1, 2, 2, 5, 5]], np.int32)  # segment 5 has no keys
    ks = np.array([[0, 0, 1, 1, 2, 2, 3, 3]], np.int32)
    o, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, q_segment_ids=qs, kv_segment_ids=ks),
                     q, k, v)
    ref = reference.attention(q, k, v, q_segment_ids=qs, kv_segment_ids=ks, do=do)
    assert np.all(np.asarray(o)[0, 6:] == 0)
    assert _rel(o, ref[0]) < 2e-5
    for g, r in zip(vjp(do), ref[2]):
        assert _rel(g, r) < 1e-4


def test_segment_ids_f16_long(rng):
    check(rng, dtype="f16", d=64, b=1, sq=257, sk=257, segments=4, causal=True, hq=2, hkv=2)


def test_extras_under_vmap_and_lse(rng):
    q, k, v, _ = _qkv(rng, "f32", 2, 9, 9, 2, 2, 32)
    bias = jnp.asarray(rng.standard_normal((3, 1, 2, 9, 9)), jnp.float32)
    o = jax.vmap(lambda b: flash_attention(q, k, v, b))(bias)
    for i in range(3):
        assert _rel(o[i], reference.attention(q, k, v, bias=bias[i])[0]) < 2e-5
    # gradient through lse with a bias: the lse cotangent reaches dbias too
    def f(bias):
        o, lse = flash_attention(q, k, v, bias, return_lse=True)
        return jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)) + jnp.sum(o)
    g = jax.grad(f)(bias[0])

    def f_ref(bias):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(32) + bias
        lse = jax.nn.logsumexp(s, axis=-1)
        return jnp.sum(lse) + jnp.sum(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v))
    assert _rel(g, jax.grad(f_ref)(bias[0])) < 1e-4


@pytest.mark.parametrize("bad,match", [
    (dict(alibi_slopes=np.ones(3, np.float32)), "alibi_slopes must be"),
    (dict(bias=np.ones((3, 9, 9), np.float32)), "broadcastable"),
    (dict(bias=np.ones((1, 1, 9, 9), np.int32)), "bias must have dtype"),
    (dict(mask=np.ones((1, 1, 9, 9), np.float32)), "mask must be boolean"),
    (dict(q_segment_ids=np.ones((2, 9), np.int32)), "both q_segment_ids and kv_segment_ids"),
    (dict(q_segment_ids=np.ones((2, 8), np.int32), kv_segment_ids=np.ones((2, 9), np.int32)),
     "q_segment_ids must be"),
])
def test_bad_extras_raise_before_the_kernel(rng, bad, match):
    q, k, v, _ = _qkv(rng, "f32", 2, 9, 9, 2, 2, 32)
    with pytest.raises((ValueError, TypeError), match=match):
        flash_attention(q, k, v, **bad)


# ----------------------------------------------------------------------------- varlen
def _packed(rng, lens_q, lens_k, hq, hkv, d, dtype, pad_q=0, pad_k=0):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    tq, tk = cu_q[-1] + pad_q, cu_k[-1] + pad_k
    q, do = (jnp.asarray(rng.standard_normal((tq, hq, d)), JNP[dtype]) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((tk, hkv, d)), JNP[dtype]) for _ in range(2))
    return q, k, v, do, cu_q, cu_k


@pytest.mark.parametrize("dtype,causal,bottom_right", [("f32", False, False), ("f32", True, False),
                                                       ("f32", True, True), ("bf16", True, True)])
def test_varlen_forward_and_gradients(rng, dtype, causal, bottom_right):
    lens_q, lens_k = [5, 0, 130, 1, 64], [7, 3, 130, 0, 70]  # empty sequences, Sq != Sk
    q, k, v, do, cu_q, cu_k = _packed(rng, lens_q, lens_k, 4, 2, 32, dtype, pad_q=3, pad_k=2)
    kw = dict(causal=causal, bottom_right=bottom_right)
    f = jax.jit(lambda q, k, v: flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                       **kw))
    o, vjp = jax.vjp(f, q, k, v)
    ro, _, rg = reference.attention_varlen(q, k, v, cu_q, cu_k, do=do, **kw)
    fwd_tol, bwd_tol = TOL[dtype]
    assert _rel(o, ro) <= fwd_tol
    assert np.all(np.asarray(o, np.float32)[-3:] == 0)  # padding rows
    got = vjp(do)
    for g, r in zip(got, rg):
        assert _rel(g, r) <= bwd_tol
    assert np.all(np.asarray(got[1], np.float32)[-2:] == 0)  # keys outside every sequence


def test_varlen_lse_window_softcap_gqa(rng):
    lens = [33, 17, 90]
    q, k, v, do, cu_q, cu_k = _packed(rng, lens, lens, 8, 2, 64, "f32")
    kw = dict(causal=True, window=(8, 0), softcap=6.0)
    o, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, 90, 90, return_lse=True, **kw)
    ro, rlse = reference.attention_varlen(q, k, v, cu_q, cu_k, **kw)
    assert _rel(o, ro) < 2e-5
    np.testing.assert_allclose(np.asarray(lse), rlse, rtol=1e-5, atol=1e-5)


def test_varlen_matches_dense_per_sequence(rng):
    """Packing two sequences equals running them separately with flash_attention."""
    q, k, v, _, cu_q, cu_k = _packed(rng, [40, 24], [40, 24], 2, 2, 32, "f32")
    o = flash_attention_varlen(q, k, v, cu_q, cu_k, 40, 40, causal=True)
    for s, e in ((0, 40), (40, 64)):
        dense = flash_attention(q[None, s:e], k[None, s:e], v[None, s:e], causal=True)[0]
        assert _rel(o[s:e], dense) < 1e-6


def test_varlen_bad_inputs(rng):
    q, k, v, _, cu_q, cu_k = _packed(rng, [4, 4], [4, 4], 2, 2, 32, "f32")
    with pytest.raises(TypeError, match="max_seqlen"):
        flash_attention_varlen(q, k, v, cu_q, cu_k, 4.0, 4)
    with pytest.raises(ValueError, match="rank 3"):
        flash_attention_varlen(q[None], k, v, cu_q, cu_k, 4, 4)
    with pytest.raises(ValueError, match="same length"):
        flash_attention_varlen(q, k, v, cu_q, cu_k[:2], 4, 4)
    # Values are checked by the CPU handler: a length above max_seqlen is an error, not a crash.
    with pytest.raises(Exception, match="max_seqlen"):
        np.asarray(flash_attention_varlen(q, k, v, cu_q, cu_k, 3, 4))
    with pytest.raises(Exception, match="exceeds"):
        np.asarray(flash_attention_varlen(q, k, v, np.array([0, 4, 9], np.int32), cu_k, 5, 4))


# ----------------------------------------------------------------------------- paged
def _paged(rng, b, sq, hq, hkv, d, dtype, block_size, lens, num_blocks=None):
    max_blocks = max(-(-n // block_size) for n in lens) + 1
    num_blocks = num_blocks or b * max_blocks + 3
    k_cache = jnp.asarray(rng.standard_normal((num_blocks, block_size, hkv, d)), JNP[dtype])
    v_cache = jnp.asarray(rng.standard_normal((num_blocks, block_size, hkv, d)), JNP[dtype])
    perm = rng.permutation(num_blocks)[:b * max_blocks].reshape(b, max_blocks)  # shuffled blocks
    q = jnp.asarray(rng.standard_normal((b, sq, hq, d)), JNP[dtype])
    return q, k_cache, v_cache, perm.astype(np.int32), np.asarray(lens, np.int32)


@pytest.mark.parametrize("block_size,lens,sq", [(16, [37, 0, 16, 100], 1), (256, [300, 5], 1),
                                                (16, [70, 33], 7), (48, [97, 1], 3)])
def test_paged_decode(rng, block_size, lens, sq):
    b = len(lens)
    q, kc, vc, table, used = _paged(rng, b, sq, 8, 2, 64, "f32", block_size, lens)
    kw = dict(causal=True, bottom_right=True)
    o, lse = jax.jit(lambda *a: flash_attention_paged(*a, return_lse=True, **kw))(q, kc, vc, table, used)
    ro, rlse = reference.attention_paged(q, np.asarray(kc), np.asarray(vc), table, used, **kw)
    assert _rel(o, ro) < 2e-5
    np.testing.assert_allclose(np.asarray(lse), rlse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_paged_half_precision_window_softcap(rng, dtype):
    q, kc, vc, table, used = _paged(rng, 2, 1, 4, 4, 32, dtype, 32, [200, 77])
    kw = dict(causal=True, bottom_right=True, window=(64, 0), softcap=10.0)
    o = flash_attention_paged(q, kc, vc, table, used, **kw)
    ro, _ = reference.attention_paged(q, np.asarray(kc, np.float64), np.asarray(vc, np.float64),
                                      table, used, **kw)
    assert _rel(o, ro) < TOL[dtype][0]


def test_paged_single_long_sequence_split_kv(rng):
    """B=1, Sq=1: one query row, long context (the split-KV path where the kernel splits)."""
    q, kc, vc, table, used = _paged(rng, 1, 1, 2, 1, 64, "f32", 16, [4000])
    o, lse = flash_attention_paged(q, kc, vc, table, used, causal=True, bottom_right=True,
                                   return_lse=True)
    ro, rlse = reference.attention_paged(q, np.asarray(kc), np.asarray(vc), table, used,
                                         causal=True, bottom_right=True)
    assert _rel(o, ro) < 2e-5
    np.testing.assert_allclose(np.asarray(lse), rlse, rtol=1e-5, atol=1e-5)


def test_paged_bad_inputs(rng):
    q, kc, vc, table, used = _paged(rng, 2, 1, 4, 4, 32, "f32", 16, [20, 5])
    with pytest.raises(ValueError, match="block_table must be"):
        flash_attention_paged(q, kc, vc, table[:1], used)
    with pytest.raises(ValueError, match="k_cache and v_cache"):
        flash_attention_paged(q, kc, vc[:, :8], table, used)
    with pytest.raises(NotImplementedError, match="forward-only"):
        jax.grad(lambda q: flash_attention_paged(q, kc, vc, table, used).sum())(q)
    too_long = np.array([table.shape[1] * 16 + 1, 5], np.int32)
    with pytest.raises(Exception, match="seqused_k"):
        np.asarray(flash_attention_paged(q, kc, vc, table, too_long))
    bad_table = table.copy()
    bad_table[0, 0] = kc.shape[0]
    with pytest.raises(Exception, match="block"):
        np.asarray(flash_attention_paged(q, kc, vc, bad_table, used))


@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, True), (True, False)])
def test_one_token_gqa_decode_folds_heads_exactly(rng, causal, bottom_right):
    """Sq = 1 with GQA runs the group's heads as rows of one kv head (flash_attention and
    flash_attention_paged); values, lse and gradients are those of the unfolded problem."""
    q, k, v, do = _qkv(rng, "f32", 2, 1, 300, 8, 2, 64)
    kw = dict(causal=causal, bottom_right=bottom_right)
    (o, lse), vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, return_lse=True, **kw), q, k, v)
    ro, rlse, rg = reference.attention(q, k, v, do=do, **kw)
    assert _rel(o, ro) < 2e-5
    np.testing.assert_allclose(np.asarray(lse), rlse, rtol=1e-5, atol=1e-5)
    for g, r in zip(vjp((do, jnp.zeros_like(lse))), rg):
        assert _rel(g, r) < 1e-4


def test_fixed_bias_costs_no_dbias(rng):
    """A bias that is not differentiated: the backward call has no dbias result (no dbias
    work); differentiating the bias brings it back. Gradients are the same either way."""
    q, k, v, do = _qkv(rng, "f32", 2, 33, 33, 2, 2, 32)
    bias = jnp.asarray(rng.standard_normal((1, 2, 33, 33)), jnp.float32)
    f = lambda q, b: jnp.sum(flash_attention(q, k, v, b, causal=True) * do)

    def bwd_results(argnums):
        text = jax.jit(jax.grad(f, argnums)).lower(q, bias).as_text()
        (line,) = [l for l in text.splitlines() if "flashgen_bwd_d32_f32_causal" in l]
        return line.split("->")[-1].count("tensor<")
    assert bwd_results(0) == 3 and bwd_results(1) == 4 and bwd_results((0, 1)) == 4
    dq_fixed = jax.grad(f, 0)(q, bias)
    dq, dbias = jax.grad(f, (0, 1))(q, bias)
    np.testing.assert_array_equal(dq_fixed, dq)
    ref = reference.attention(q, k, v, causal=True, bias=bias, do=do)[2]
    assert _rel(dq, ref[0]) < 1e-4 and _rel(dbias, ref[3]) < 1e-4


@pytest.mark.parametrize("causal,bottom_right,per_batch", [(True, False, False), (True, True, True),
                                                          (False, True, False)])
def test_varlen_alibi(rng, causal, bottom_right, per_batch):
    lens_q, lens_k = [5, 0, 70, 33], [9, 3, 70, 40]
    q, k, v, do, cu_q, cu_k = _packed(rng, lens_q, lens_k, 4, 2, 32, "f32", pad_q=2)
    slopes = rng.uniform(0.05, 0.5, (4, 4) if per_batch else (4,)).astype(np.float32)
    kw = dict(causal=causal, bottom_right=bottom_right, alibi_slopes=slopes)
    f = jax.jit(lambda q, k, v: flash_attention_varlen(q, k, v, cu_q, cu_k, 70, 70, **kw))
    o, vjp = jax.vjp(f, q, k, v)
    ro, _, rg = reference.attention_varlen(q, k, v, cu_q, cu_k, do=do, **kw)
    assert _rel(o, ro) < 2e-5
    for g, r in zip(vjp(do), rg):
        assert _rel(g, r) < 1e-4


@pytest.mark.parametrize("sq,per_batch", [(1, False), (1, True), (5, False)])
def test_paged_alibi(rng, sq, per_batch):
    q, kc, vc, table, used = _paged(rng, 2, sq, 8, 2, 64, "f32", 16, [300, 41])
    slopes = rng.uniform(0.05, 0.5, (2, 8) if per_batch else (8,)).astype(np.float32)
    kw = dict(causal=True, bottom_right=True, alibi_slopes=slopes)
    o, lse = flash_attention_paged(q, kc, vc, table, used, return_lse=True, **kw)
    ro, rlse = reference.attention_paged(q, np.asarray(kc), np.asarray(vc), table, used, **kw)
    assert _rel(o, ro) < 2e-5
    np.testing.assert_allclose(np.asarray(lse), rlse, rtol=1e-5, atol=1e-5)
