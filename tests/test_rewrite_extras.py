"""Extra operands of rewritten sites (README "Variants"): ALiBi, bias, mask, segment ids.

The golden cases (tests/golden) cover the frontends' spellings; these cover the corners of
the matcher: biases scaled after they are added, subtracted biases, sums of a constant and
a run-time bias, masks in the false branch, shared mask arguments, legacy attributes,
cross-attention segment ids, and the ALiBi fit itself.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashgen.rewrite as fr
from flashgen import execute
from flashgen.rewrite import extras as X
from flashgen.rewrite import modules, verify

B, T, H, D = 2, 8, 4, 32
SLOPES = np.array([2.0 ** (-8.0 * (i + 1) / H) for i in range(H)], np.float32)


def _export(fn, *shapes):
    args = [jax.ShapeDtypeStruct(s, jnp.dtype(d)) for s, d in shapes]
    return jax.export.export(jax.jit(fn), platforms=["cpu"])(*args).mlir_module()


def _qkv(t=T, s=T):
    return [((B, t, H, D), "float32"), ((B, s, H, D), "float32"), ((B, s, H, D), "float32")]


def _attend(s, v):
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


def _scores(q, k):
    return jnp.einsum("bqhd,bkhd->bhqk", q, k)


@pytest.fixture(scope="module")
def kernels():
    from flashgen import runtime
    from flashgen.spec import KernelSpec
    runtime.ensure([KernelSpec(D, "f32", c, "cpu") for c in (False, True)])


def _same(text, inputs=None, seed=3):
    """Rewrite ``text``; run original and rewritten on the same inputs; return the site."""
    result = fr.rewrite(text)
    assert len(result.rewritten) == 1, [s.reason for s in result.rejected]
    original, rewritten = modules.load(text), modules.load(result.to_bytes())
    if inputs is None:   # masks with fully masked rows among the others
        inputs = verify.inputs_for(original, seed)
    ref = execute.run(original, inputs, register=False)
    got = execute.run(rewritten, inputs)
    rows = verify.compare(ref, got, result.rewritten)
    assert all(r["ok"] for r in rows), rows
    return result.rewritten[0], result


# ----------------------------------------------------------------------------- ALiBi fit
def test_alibi_fit_exact_up_to_row_constants():
    sq, sk = 4, 8
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    f = -SLOPES[None, :, None, None] * np.abs(i + (sk - sq) - j) + np.arange(sq)[:, None] * 3.0
    vis = np.ones_like(f, bool)
    assert X.alibi_fit(f.astype(np.float64), vis, [0]) is None
    slopes, off = X.alibi_fit(f.astype(np.float64), vis, [0, sk - sq])
    assert off == sk - sq
    np.testing.assert_allclose(slopes[0], SLOPES, rtol=1e-7)


def test_alibi_fit_causal_linear_and_near_misses():
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    causal = np.broadcast_to(j <= i, (1, H, T, T))
    bloom = (SLOPES[None, :, None, None] * j).astype(np.float64)
    slopes, _ = X.alibi_fit(np.broadcast_to(bloom, (1, H, T, T)), causal, [0])
    np.testing.assert_allclose(slopes[0], SLOPES, rtol=1e-6)
    # without the causal mask slopes·j is no ALiBi
    assert X.alibi_fit(np.broadcast_to(bloom, (1, H, T, T)), np.ones((1, H, T, T), bool),
                       [0]) is None
    # a per-entry perturbation above the tolerance breaks the fit
    noisy = bloom + 1e-3 * (np.arange(T * T).reshape(T, T) % 3)
    assert X.alibi_fit(np.broadcast_to(noisy, (1, H, T, T)), causal, [0]) is None
    # per-batch slopes
    per_b = -np.stack([SLOPES, 2 * SLOPES])[:, :, None, None] * np.abs(i - j)
    slopes, _ = X.alibi_fit(per_b, np.ones(per_b.shape, bool), [0])
    assert slopes.shape == (2, H)


# ----------------------------------------------------------------------------- programs
def test_bias_added_before_the_scale(kernels):
    # (qk + b) * c: the kernel adds c·b after scaling qk by c
    def f(q, k, v, b):
        return _attend((_scores(q, k) + b) * 0.125, v)
    site, result = _same(_export(f, *_qkv(), ((B, 1, T, T), "float32")))
    assert site.extras == ["bias"] and math.isclose(site.scale, 0.125)
    assert "stablehlo.multiply" in result.text()


def test_subtracted_bias(kernels):
    def f(q, k, v, b):
        return _attend(_scores(q, k) * 0.125 - b, v)
    site, _ = _same(_export(f, *_qkv(), ((B, H, T, T), "float32")))
    assert site.extras == ["bias"]


def test_huggingface_extended_mask(kernels):
    # (1 - mask) * finfo.min as a bias: kept as a bias (no cancellation-prone rewrite)
    def f(q, k, v, m):
        ext = (1.0 - m[:, None, None, :].astype(jnp.float32)) * jnp.finfo(jnp.float32).min
        return _attend(_scores(q, k) * 0.125 + ext, v)
    site, _ = _same(_export(f, *_qkv(), ((B, T), "bool")))
    assert site.extras == ["bias"]


def test_alibi_plus_runtime_padding_bias(kernels):
    # one added tensor that sums a constant ALiBi and a run-time padding bias: two operands
    dist = np.abs(np.arange(T)[:, None] - np.arange(T)[None, :]).astype(np.float32)
    alibi = -SLOPES[:, None, None] * dist

    def f(q, k, v, pad):
        return _attend(_scores(q, k) * 0.125 + (alibi + pad), v)
    site, _ = _same(_export(f, *_qkv(), ((B, 1, 1, T), "float32")))
    assert site.extras == ["alibi", "bias"]


def test_mask_in_the_false_branch_and_window(kernels):
    # where(m, fill, s) masks where m is true; ANDed with a sliding window
    def f(q, k, v, m):
        s = _scores(q, k) * 0.125
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        s = jnp.where((j <= i) & (j > i - 4), s, -jnp.inf)
        return _attend(jnp.where(m, -jnp.inf, s), v)
    text = _export(f, *_qkv(), ((B, 1, 1, T), "bool"))
    params, _ = execute.signature(modules.load(text))
    inputs = execute.random_inputs(params, seed=5)
    inputs[3][..., :] = False
    inputs[3][0, ..., 5] = True   # one masked key in the first example
    site, result = _same(text, inputs)
    # a key-padding mask travels as segment ids (q id 1, kv id = not m)
    assert site.extras == ["segment_ids"] and site.causal and list(site.window) == [3, -1]
    assert "stablehlo.not" in result.text()


def test_two_sites_share_a_mask_argument(kernels):
    def f(q, k, v, m):
        a = jax.nn.dot_product_attention(q, k, v, mask=m)
        b = jax.nn.dot_product_attention(q, v, k, mask=m, is_causal=True)
        return a + b
    text = _export(f, *_qkv(), ((B, 1, 1, T), "bool"))
    result = fr.rewrite(text)
    assert len(result.rewritten) == 2 and not result.rejected
    assert all(s.extras == ["segment_ids"] for s in result.rewritten)  # key padding
    original, rewritten = modules.load(text), modules.load(result.to_bytes())
    params, _ = execute.signature(original)
    inputs = execute.random_inputs(params, seed=2)
    inputs[3][..., 0] = True
    rows = execute.compare(execute.run(original, inputs, register=False),
                           execute.run(rewritten, inputs), "f32")
    assert all(r["ok"] for r in rows), rows


def test_cross_attention_segment_ids(kernels):
    # q ids [B, 4] against kv ids [B, 8]: two different id arrays
    def f(q, k, v, qs, ks):
        s = _scores(q, k) * 0.125
        return _attend(jnp.where(qs[:, None, :, None] == ks[:, None, None, :], s, -1e9), v)
    text = _export(f, *_qkv(t=4), ((B, 4), "int32"), ((B, T), "int32"))
    params, _ = execute.signature(modules.load(text))
    inputs = execute.random_inputs(params, seed=4)
    inputs[3][:] = [[0, 0, 1, 2], [3, 3, 3, 1]]
    inputs[4][:] = [[0, 0, 1, 1, 1, 2, 2, 2], [1, 1, 3, 3, 3, 3, 0, 0]]
    site, result = _same(text, inputs)
    assert site.extras == ["segment_ids"] and not site.causal
    assert "tensor<2x4xi32>, tensor<2x8xi32>" in result.text()


def test_legacy_attrs_carry_extras():
    def f(q, k, v, b):
        return jax.nn.dot_product_attention(q, k, v, bias=b)
    result = fr.rewrite(_export(f, *_qkv(), ((B, H, T, T), "float32")), legacy_attrs=True)
    assert result.rewritten[0].extras == ["bias"]
    assert 'mhlo.backend_config = {bottom_right = false, causal = false, extras = "bias"' in \
        result.text()


def test_explain_names_the_extras():
    def f(q, k, v, m):
        return jax.nn.dot_product_attention(q, k, v, mask=m, is_causal=True)
    result = fr.rewrite(_export(f, *_qkv(), ((B, 1, T, T), "bool")))
    text = result.report().explain()
    assert "extras: mask [2,1,8,8] (runtime)" in text
    assert result.report().to_json()["sites"][0]["extras"] == ["mask"]
    padding = fr.rewrite(_export(f, *_qkv(), ((B, 1, 1, T), "bool")))
    assert "key padding as segment ids [2,8] / [2,8] i32 (runtime)" in padding.report().explain()


CALLEE_MASK = """\
module @m {
  func.func public @main(%q: tensor<2x4x8x32xf32>, %k: tensor<2x4x8x32xf32>, %v: tensor<2x4x8x32xf32>, %m: tensor<2x4x8x8xf32>) -> tensor<2x4x8x32xf32> {
    %0 = stablehlo.dot_general %q, %k, batching_dims = [0, 1] x [0, 1], contracting_dims = [3] x [3] : (tensor<2x4x8x32xf32>, tensor<2x4x8x32xf32>) -> tensor<2x4x8x8xf32>
    %1 = func.call @masked_softmax(%0, %m) : (tensor<2x4x8x8xf32>, tensor<2x4x8x8xf32>) -> tensor<2x4x8x8xf32>
    %2 = stablehlo.dot_general %1, %v, batching_dims = [0, 1] x [0, 1], contracting_dims = [3] x [2] : (tensor<2x4x8x8xf32>, tensor<2x4x8x32xf32>) -> tensor<2x4x8x32xf32>
    return %2 : tensor<2x4x8x32xf32>
  }
  func.func private @masked_softmax(%s: tensor<2x4x8x8xf32>, %m: tensor<2x4x8x8xf32>) -> tensor<2x4x8x8xf32> {
    %zero = stablehlo.constant dense<0.000000e+00> : tensor<2x4x8x8xf32>
    %keep = stablehlo.compare GT, %m, %zero : (tensor<2x4x8x8xf32>, tensor<2x4x8x8xf32>) -> tensor<2x4x8x8xi1>
    %fill = stablehlo.constant dense<-1.000000e+09> : tensor<2x4x8x8xf32>
    %0 = stablehlo.select %keep, %s, %fill : tensor<2x4x8x8xi1>, tensor<2x4x8x8xf32>
    %ninf = stablehlo.constant dense<0xFF800000> : tensor<f32>
    %1 = stablehlo.reduce(%0 init: %ninf) applies stablehlo.maximum across dimensions = [3] : (tensor<2x4x8x8xf32>, tensor<f32>) -> tensor<2x4x8xf32>
    %2 = stablehlo.broadcast_in_dim %1, dims = [0, 1, 2] : (tensor<2x4x8xf32>) -> tensor<2x4x8x8xf32>
    %3 = stablehlo.subtract %0, %2 : tensor<2x4x8x8xf32>
    %4 = stablehlo.exponential %3 : tensor<2x4x8x8xf32>
    %c0 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %5 = stablehlo.reduce(%4 init: %c0) applies stablehlo.add across dimensions = [3] : (tensor<2x4x8x8xf32>, tensor<f32>) -> tensor<2x4x8xf32>
    %6 = stablehlo.broadcast_in_dim %5, dims = [0, 1, 2] : (tensor<2x4x8xf32>) -> tensor<2x4x8x8xf32>
    %7 = stablehlo.divide %4, %6 : tensor<2x4x8x8xf32>
    return %7 : tensor<2x4x8x8xf32>
  }
}
"""


def test_mask_computed_inside_a_callee_is_rejected():
    # the mask exists only inside @masked_softmax: nothing to pass to a call in @main
    result = fr.rewrite(CALLEE_MASK)
    assert not result.rewritten
    assert "inside a called function" in result.rejected[0].reason
    assert result.to_bytes() == CALLEE_MASK.encode()


def test_gqa_bias_per_kv_head(kernels):
    # scores [B, Hkv, G, T, S] and a bias per kv head [B, Hkv, 1, T, S]: broadcast over the
    # group to the kernel's [B, Hq, Sq, Sk] (q heads kv-head major)
    hkv, g = 2, H // 2

    def f(q, k, v, b):
        q5 = q.reshape(B, T, hkv, g, D)
        s = jnp.einsum("bqhgd,bkhd->bhgqk", q5, k) * 0.125 + b
        o = jnp.einsum("bhgqk,bkhd->bqhgd", jax.nn.softmax(s), v)
        return o.reshape(B, T, H, D)
    kv = ((B, T, hkv, D), "float32")
    site, result = _same(_export(f, ((B, T, H, D), "float32"), kv, kv,
                                 ((B, hkv, 1, T, T), "float32")))
    assert site.extras == ["bias"] and site.kv_heads == hkv
    assert "tensor<2x4x8x8xf32>" in result.text()
