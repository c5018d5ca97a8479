"""Query rows whose keys are all masked, at run time or by a constant mask
(flashgen.rewrite.empty_rows): the rewritten program computes what the original computes on
every row — the mean of V with a finite fill, 0 where the probabilities are zeroed again —
and keeps 0 where the original gives NaN (-inf fill), which --verify then does not count as
a difference.

The golden cases (GPT-2 eager left-padded, flax linen / nnx with padding masks, keras_hub
GPT-2 / Gemma, a constant strictly-below-diagonal mask) run the same checks on real exports;
these cover the corners: GQA, bands with padding, bottom-right, constant masks that empty
rows, fills that cannot be reproduced, and the verify inputs themselves.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashgen.rewrite as fr
from flashgen import execute
from flashgen.rewrite import empty_rows, modules, verify

B, T, H, D = 2, 8, 4, 32


def _export(fn, *shapes):
    args = [jax.ShapeDtypeStruct(s, jnp.dtype(d)) for s, d in shapes]
    return jax.export.export(jax.jit(fn), platforms=["cpu"])(*args).mlir_module()


def _qkv(t=T, s=T, hkv=H, dtype="float32"):
    return [((B, t, H, D), dtype), ((B, s, hkv, D), dtype), ((B, s, hkv, D), dtype)]


def _scores(q, k):
    if k.shape[2] != q.shape[2]:
        k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
    return jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125


def _attend(s, v, q_heads=H):
    if v.shape[2] != q_heads:
        v = jnp.repeat(v, q_heads // v.shape[2], axis=2)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


@pytest.fixture(scope="module")
def kernels():
    from flashgen import runtime
    from flashgen.spec import KernelSpec
    runtime.ensure([KernelSpec(D, dt, c, "cpu") for c in (False, True) for dt in ("f32", "bf16")])


def _run_all_rows(text, expect_kind, seed=0):
    """Rewrite; run both on inputs with fully masked rows; return (site, ref, got, inputs)."""
    result = fr.rewrite(text)
    assert len(result.rewritten) == 1, [s.reason for s in result.rejected]
    site = result.rewritten[0]
    assert site.empty_rows == expect_kind, site.notes
    original = modules.load(text)
    inputs = verify.inputs_for(original, seed)
    ref = execute.run(original, inputs, register=False)
    got = execute.run(modules.load(result.to_bytes()), inputs)
    rows = verify.compare(ref, got, result.rewritten)
    assert all(r["ok"] for r in rows), rows
    return site, np.asarray(ref[0], np.float64), np.asarray(got[0], np.float64), inputs


def _empty(visible):
    """[B, H|1, Sq] rows of a [B, H|1, Sq, Sk] visibility without any visible key."""
    return ~np.asarray(visible).any(-1)


def _mean_v(v, q_heads=H):
    m = np.asarray(v, np.float64).mean(1)                      # [B, Hkv, D]
    return np.repeat(m, q_heads // m.shape[1], axis=1)         # [B, H, D]


def test_select_fill_padding_and_causal_mean_of_v(kernels):
    # jax.nn-like: one select with a finite fill over (causal AND key padding)
    def f(q, k, v, pad):
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        vis = (j <= i)[None, None] & pad[:, None, None, :]
        return _attend(jnp.where(vis, _scores(q, k), -0.7 * jnp.finfo(jnp.float32).max), v)
    site, ref, got, inputs = _run_all_rows(_export(f, *_qkv(), ((B, T), "bool")), "mean")
    assert site.causal
    pad = inputs[3]
    vis = np.tril(np.ones((T, T), bool))[None] & pad[:, None, :]
    empty = _empty(vis)                                         # [B, Sq]
    # the inputs reach both kinds of empty row: a fully padded batch and a left-padded query
    assert empty[0].all() and empty[1].any() and not empty[1].all()
    want = _mean_v(inputs[2])                                   # [B, H, D]
    for b, i in zip(*np.nonzero(empty)):
        np.testing.assert_allclose(got[b, i], want[b], rtol=1e-5, atol=1e-5)
        assert np.abs(got[b, i]).max() > 1e-3                   # not the kernel's 0


def test_gqa_mean_reads_each_kv_head(kernels):
    def f(q, k, v, pad):
        s = jnp.where(pad[:, None, None, :], _scores(q, k), jnp.finfo(jnp.float32).min)
        return _attend(s, v)
    site, ref, got, inputs = _run_all_rows(_export(f, *_qkv(hkv=2), ((B, T), "bool")), "mean")
    assert site.kv_heads == 2
    want = _mean_v(inputs[2])
    np.testing.assert_allclose(got[0], np.broadcast_to(want[0], got[0].shape), rtol=1e-5,
                               atol=1e-5)


def test_runtime_mask_with_window_and_bottom_right(kernels):
    # a [B,1,Sq,Sk] run-time mask AND a bottom-right causal window, Sq < Sk
    sq, sk = 4, T

    def f(q, k, v, m):
        i, j = jnp.arange(sq)[:, None] + (sk - sq), jnp.arange(sk)[None, :]
        vis = ((j <= i) & (j > i - 3))[None, None] & m
        return _attend(jnp.where(vis, _scores(q, k), -1e9), v)
    text = _export(f, *_qkv(t=sq, s=sk), ((B, 1, sq, sk), "bool"))
    site, ref, got, inputs = _run_all_rows(text, "mean")
    assert site.causal and site.bottom_right and list(site.window) == [2, -1]
    i, j = np.arange(sq)[:, None] + (sk - sq), np.arange(sk)[None, :]
    empty = _empty(((j <= i) & (j > i - 3))[None, None] & inputs[3])[:, 0]
    assert empty.any() and not empty.all()


def test_minus_inf_fill_keeps_zero_and_verify_accepts_nan_rows(kernels):
    def f(q, k, v, pad):
        return _attend(jnp.where(pad[:, None, None, :], _scores(q, k), -jnp.inf), v)
    site, ref, got, _ = _run_all_rows(_export(f, *_qkv(), ((B, T), "bool")), "nan")
    assert np.isnan(ref[0]).all() and np.all(got[0] == 0)     # batch 0 is fully padded
    assert np.isfinite(ref[1]).all()
    rows = verify.compare([ref], [got], [site])
    assert rows[0]["ok"] and rows[0]["nan_rows_not_compared"] == ref[0].size
    # a site without the -inf fill gets no such allowance
    site.empty_rows = "mean"
    assert not verify.compare([ref], [got], [site])[0]["ok"]


def test_probabilities_zeroed_after_softmax_need_no_fixup(kernels):
    # torch's decomposed SDPA guard: rows without a visible key are 0 in the original too
    def f(q, k, v, pad):
        s = jnp.where(pad[:, None, None, :], _scores(q, k), -jnp.inf)
        p = jax.nn.softmax(s)
        p = jnp.where(jnp.all(s == -jnp.inf, -1, keepdims=True), 0.0, p)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)
    _, ref, got, _ = _run_all_rows(_export(f, *_qkv(), ((B, T), "bool")), "zero")
    assert np.all(ref[0] == 0) and np.all(got[0] == 0)


def test_runtime_bias_of_finfo_min_is_mean_of_v(kernels):
    # transformers' legacy extended mask (1 - m) * finfo.min added as a run-time bias: the
    # kernel's log2 units would overflow it to -inf; the floor keeps it finite
    def f(q, k, v, m):
        ext = (1.0 - m[:, None, None, :].astype(jnp.float32)) * jnp.finfo(jnp.float32).min
        return _attend(_scores(q, k) + ext, v)
    result = fr.rewrite(_export(f, *_qkv(), ((B, T), "bool")))
    assert result.rewritten[0].extras == ["bias"]
    assert "stablehlo.maximum" in result.text()
    site, ref, got, inputs = _run_all_rows(_export(f, *_qkv(), ((B, T), "bool")), "none")
    np.testing.assert_allclose(got[0], np.broadcast_to(_mean_v(inputs[2])[0], got[0].shape),
                               rtol=1e-5, atol=1e-5)


def test_same_segment_ids_on_both_sides_need_no_fixup():
    def f(q, k, v, seg):
        s = jnp.where(seg[:, None, :, None] == seg[:, None, None, :], _scores(q, k), -1e9)
        return _attend(s, v)
    result = fr.rewrite(_export(f, *_qkv(), ((B, T), "int32")))
    site = result.rewritten[0]
    assert site.extras == ["segment_ids"] and site.empty_rows == "none"
    assert "stablehlo.reduce" not in result.text()


@pytest.mark.parametrize("fills, reason", [
    # the window's -1e9 and the mask's -inf: a row would average only the window's outside
    ([(-1e9, "select"), (-np.inf, "select")], "different fill values"),
    # -1e4 added in f32 does not absorb the scores: the row is softmax(s - 1e4), not a mean
    ([(-1e4, "add")], "too small to absorb"),
])
def test_fills_that_cannot_be_reproduced_are_rejected(fills, reason):
    def f(q, k, v, m1, m2):
        s = _scores(q, k)
        for (fill, how), m in zip(fills, (m1, m2)):
            vis = m[:, None, None, :]
            s = jnp.where(vis, s, fill) if how == "select" else s + jnp.where(vis, 0.0, fill)
        return _attend(s, v)
    result = fr.rewrite(_export(f, *_qkv(), ((B, T), "bool"), ((B, T), "bool")))
    assert not result.rewritten
    assert any(reason in s.reason for s in result.rejected), [s.reason for s in result.rejected]


def test_absorbing_fills():
    f32min = float(np.finfo(np.float32).min)
    assert empty_rows.absorbs(f32min, "f32") and empty_rows.absorbs(-0.7 * 3.4e38, "f32")
    assert empty_rows.absorbs(-1e9, "bf16")           # ulp(1e9) in bf16 is 2^23
    assert not empty_rows.absorbs(-1e9, "f32")         # ulp(1e9) in f32 is 64
    assert not empty_rows.absorbs(-65504.0, "f16")
    assert not empty_rows.absorbs(-np.inf, "f32")


def test_verify_inputs_have_every_kind_of_mask_row():
    rows = verify.mask_rows([np.ones((3, 2, 5), bool), np.full((2, 6), 3, np.int32),
                             np.ones((2, 4), np.float32)])
    m = rows[0].reshape(-1, 5)
    assert not m[0].any() and m[2].all()
    assert all(not r[0] and r[-1] for i, r in enumerate(m) if i not in (0, 2))
    assert not rows[1][0].any() and rows[1][1, 0] == 0 and (rows[1][1, 1:] == 3).all()
    assert (rows[2] == 1).all()


def test_vmapped_equinox_report_reads_batch_and_heads_from_the_product():
    # equinox MultiheadAttention under jax.vmap, batch 2, 4 heads (golden equinox_vmap_mha)
    import pathlib
    golden = pathlib.Path(__file__).parent / "golden" / "inputs" / "equinox_vmap_mha.mlir"
    site = fr.rewrite(golden).rewritten[0]
    assert (site.batch, site.heads, site.kv_heads, site.seq_q) == (2, 4, 4, 8)


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, 2)])
def test_key_padding_rows_found_in_linear_memory(kernels, causal, window):
    # a key-padding mask (segment ids q 1 / kv mask) under no band, causal, or a window bounded
    # on the right: the empty rows come from each sequence's first real key, O(B*S) ops
    def f(q, k, v, pad):
        s = jnp.where(pad[:, None, None, :], _scores(q, k), jnp.finfo(jnp.float32).min)
        if causal:
            i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
            band = (j <= i) if window is None else (j <= i) & (j >= i - window)
            s = jnp.where(band, s, jnp.finfo(jnp.float32).min)
        return _attend(s, v)
    text = _export(f, *_qkv(), ((B, T), "bool"))
    kind = "mean"
    site, ref, got, inputs = _run_all_rows(text, kind)
    assert site.extras == ["segment_ids"] and site.causal == causal
    body = fr.rewrite(text).text()
    linear = "applies stablehlo.minimum across dimensions = [1]" in body
    assert linear == (window is None), body
    assert (f"tensor<{B}x1x{T}x{T}xi1>" in body) == (window is not None)


def test_verify_catches_a_rewrite_without_the_fixup(kernels, monkeypatch):
    # the inputs --verify draws reach the fully padded queries of flax's padding mask: the
    # kernel's 0 there (no fix-up) is reported as a difference
    import pathlib
    golden = pathlib.Path(__file__).parent / "golden" / "inputs" / "flax_linen_padding_mask.mlir"
    assert all(r["ok"] for r in verify.verify(fr.rewrite(golden), seed=0)["outputs"])
    monkeypatch.setattr(empty_rows, "emit_mean_fixup", lambda o, *a, **k: o)
    rows = verify.verify(fr.rewrite(golden), seed=0)["outputs"]
    assert not rows[0]["ok"] and rows[0]["max_error"] > 0.1


@pytest.mark.parametrize("spelling", ["gt", "lt_reversed", "ne", "le_negated", "float_gt"])
def test_merged_padding_and_causal_compared_with_zero(kernels, spelling):
    # keras_hub merges causal and padding as minimum(int(padding), int(causal)) and tests it
    # with != 0 (Llama) or, in keras' masked Softmax (GPT-2, Gemma), > 0: both are the
    # conjunction of 0/1 numbers, so causal + O(S) key padding, rows without a key exact
    def f(q, k, v, pad):
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        dt = jnp.float32 if spelling == "float_gt" else jnp.int32
        merged = jnp.minimum(pad[:, None, :].astype(dt), (j <= i)[None].astype(dt))[:, None]
        fill = jnp.finfo(jnp.float32).min
        s = _scores(q, k)
        if spelling in ("gt", "float_gt"):
            s = jnp.where(merged > 0, s, fill)
        elif spelling == "lt_reversed":
            s = jnp.where(0 < merged, s, fill)
        elif spelling == "ne":
            s = jnp.where(merged != 0, s, fill)
        else:
            s = jnp.where(merged <= 0, fill, s)
        return _attend(s, v)
    text = _export(f, *_qkv(), ((B, T), "bool"))
    site, ref, got, inputs = _run_all_rows(text, "mean")
    assert site.causal and site.extras == ["segment_ids"], site.notes
    assert f"tensor<{B}x1x{T}x{T}x" not in fr.rewrite(text).text()


def test_merged_mask_tested_with_ge_zero_is_no_conjunction():
    # minimum(...) >= 0 holds everywhere: no predicate on the booleans, left as it is
    def f(q, k, v, pad):
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        merged = jnp.minimum(pad[:, None, :].astype(jnp.int32), (j <= i)[None].astype(jnp.int32))
        s = jnp.where(merged[:, None] >= 0, _scores(q, k), -1e9)
        return _attend(s, v)
    result = fr.rewrite(_export(f, *_qkv(), ((B, T), "bool")))
    for site in result.rewritten:
        assert not site.causal and site.extras == ["mask"], site.notes


# ----------------------------------------------------------------------------- constant masks
def _strict_below(t=T, s=T):
    i, j = jnp.arange(t)[:, None], jnp.arange(s)[None, :]
    return j < i


def test_constant_mask_empty_row_fixed_up_from_a_constant(kernels):
    # no band expresses j < i: a constant mask operand whose row 0 is empty, known when the
    # site is resolved: the fix-up reads a constant [1, 1, Sq] flag, no OR over the keys
    def f(q, k, v):
        return _attend(jnp.where(_strict_below(), _scores(q, k), -1e9), v)
    text = _export(f, *_qkv())
    site, ref, got, inputs = _run_all_rows(text, "mean")
    assert site.extras == ["mask"] and not site.causal
    np.testing.assert_allclose(got[:, 0], _mean_v(inputs[2]), rtol=1e-5, atol=1e-5)
    body = fr.rewrite(text).text()
    assert f"tensor<1x1x{T}xi1>" in body and "applies stablehlo.or" not in body


def test_bottom_right_causal_with_more_queries_than_keys(kernels):
    # a constant bottom-right causal band with Sq > Sk: its first Sq - Sk rows see no key;
    # the band stays the causal attribute and those rows get the mean of V
    sq, sk = T, 4

    def f(q, k, v):
        i, j = jnp.arange(sq)[:, None] - (sq - sk), jnp.arange(sk)[None, :]
        return _attend(jnp.where(j <= i, _scores(q, k), jnp.finfo(jnp.float32).min), v)
    site, ref, got, inputs = _run_all_rows(_export(f, *_qkv(t=sq, s=sk)), "mean")
    assert site.causal and site.bottom_right and site.extras == []
    np.testing.assert_allclose(got[:, :sq - sk], np.broadcast_to(
        _mean_v(inputs[2])[:, None], (B, sq - sk, H, D)), rtol=1e-5, atol=1e-5)


def test_constant_empty_row_and_runtime_padding(kernels):
    # a constant mask with an empty row AND a run-time key padding: the rows come from the
    # operands at run time (the constant's and the padding's)
    def f(q, k, v, pad):
        vis = _strict_below()[None, None] & pad[:, None, None, :]
        return _attend(jnp.where(vis, _scores(q, k), -1e9), v)
    site, ref, got, inputs = _run_all_rows(_export(f, *_qkv(), ((B, T), "bool")), "mean")
    empty = _empty(np.asarray(_strict_below())[None] & inputs[3][:, None, :])
    assert empty[:, 0].all() and empty[0].all()
    want = _mean_v(inputs[2])
    for b, i in zip(*np.nonzero(empty)):
        np.testing.assert_allclose(got[b, i], want[b], rtol=1e-5, atol=1e-5)


def test_constant_minus_inf_bias_empty_row_is_nan_in_the_original(kernels):
    # a 0 / -inf constant bias: the original's empty row is NaN (0/0); the rewrite keeps 0
    def f(q, k, v):
        return _attend(_scores(q, k) + jnp.where(_strict_below(), 0.0, -jnp.inf), v)
    site, ref, got, inputs = _run_all_rows(_export(f, *_qkv()), "nan")
    assert np.isnan(ref[:, 0]).all() and (got[:, 0] == 0).all()
    assert np.isfinite(ref[:, 1:]).all()


def test_constant_empty_row_with_a_small_added_fill_is_refused():
    # -1e5 added in f32 absorbs no score: row 0 is the softmax of its rounded scores
    def f(q, k, v):
        return _attend(_scores(q, k) + jnp.where(_strict_below(), 0.0, -1e5), v)
    result = fr.rewrite(_export(f, *_qkv()))
    assert not result.rewritten
    assert "too small to absorb" in result.rejected[0].reason


def test_constant_empty_row_training_gradients(kernels):
    # jax.grad through the strictly-below-diagonal attention: row 0 is the mean of V, so dV
    # gains dO_0 / Sk on every key (emit_mean_fixup_grad from the constant row flags)
    def loss(q, k, v):
        o = _attend(jnp.where(_strict_below(), _scores(q, k), -1e9), v)
        return jnp.sum(o * jnp.sin(o))
    args = [jax.ShapeDtypeStruct(s, jnp.dtype(d)) for s, d in _qkv()]
    text = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
                             platforms=["cpu"])(*args).mlir_module()
    result = fr.rewrite(text)
    assert [s.backward_target for s in result.rewritten] and not result.rejected, \
        [s.reason for s in result.rejected]
    assert result.rewritten[0].empty_rows == "mean"
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal(s).astype(np.float32) for s, _ in _qkv()]
    ref = execute.run(modules.load(text), inputs, register=False)
    got = execute.run(modules.load(result.to_bytes()), inputs)
    for r, g in zip(ref, got):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-4, atol=2e-4)
