"""Shape-polymorphic sites that once crashed the rewriter, and the driver's containment of a
failing rewrite: a site that cannot be rewritten is left alone with its reason, never a
traceback (issue 23, item 4)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import flashgen.rewrite as fr

HEADS, HEAD_DIM = 4, 64


def _per_head_attention(q, k, v):
    """One example, one head: [S, D] each (equinox's MultiheadAttention vmaps this over
    heads; here the batch is vmapped too, so the products' batch dims are heads x batch)."""
    s = q @ k.T / np.sqrt(q.shape[-1]).astype(q.dtype)
    return jax.nn.softmax(s, axis=-1) @ v


def _mha(x):
    """Self-attention of [b, S, H*D] written as equinox's MultiheadAttention under vmap:
    per token ``W @ x`` projections (dot_general products [H*D, b, S], heads major), heads
    split, attended per head, merged back and projected."""
    rng = np.random.default_rng(0)
    wq, wk, wv, wo = (rng.standard_normal((HEADS * HEAD_DIM,) * 2).astype(np.float32) / 16
                      for _ in range(4))
    per_head = jax.vmap(_per_head_attention, in_axes=1, out_axes=1)   # [S, H, D]

    def per_example(t):
        q, k, v = (jax.vmap(lambda row, w=w: w @ row)(t).reshape(t.shape[0], HEADS, HEAD_DIM)
                   for w in (wq, wk, wv))
        o = per_head(q, k, v).reshape(t.shape[0], -1)
        return jax.vmap(lambda row: wo @ row)(o)
    return jax.vmap(per_example)(x)


def _export(fn, spec: str, n_inputs: int, features: tuple):
    b, *rest = export.symbolic_shape(spec)
    seq = rest[0] if rest else 32
    arg = jax.ShapeDtypeStruct((b, seq, *features), jnp.float32)
    return export.export(jax.jit(fn))(*[arg] * n_inputs)


def _check_two_shapes(exported, shapes, features):
    """Rewrite ``exported``; the rewritten artifact agrees with the original at ``shapes``."""
    from flashgen import runtime
    result = fr.rewrite(exported.serialize())
    assert [s.status for s in result.sites] == ["rewritten"], \
        [(s.status, s.reason) for s in result.sites]
    runtime.ensure(sorted(result.specs))
    new = export.deserialize(bytearray(result.to_bytes()))
    assert "flashgen_fwd" in new.mlir_module()
    rng = np.random.default_rng(7)
    n = len(exported.in_avals)
    for b, s in shapes:
        args = [rng.standard_normal((b, s, *features)).astype(np.float32) for _ in range(n)]
        got, want = np.asarray(new.call(*args)), np.asarray(exported.call(*args))
        assert got.shape == want.shape and want.shape[:2] == (b, s)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("spec", ["b", "b, s"])
def test_poly_heads_merged_with_symbolic_batch(spec):
    """Batch dims (heads, b) in one kernel dim: its run-time size is a symbolic size times a
    static one. Before the fix the scalar static factor was built as tensor<1xi32> and
    `flashgen rewrite` ended in MLIRError 'Mismatched ranks of types0 vs 1'."""
    exported = _export(_mha, spec, 1, (HEADS * HEAD_DIM,))
    _check_two_shapes(exported, [(2, 32), (3, 32)] if spec == "b" else [(2, 17), (3, 64)],
                      (HEADS * HEAD_DIM,))


@pytest.mark.parametrize("spec", ["b", "b, s"])
def test_poly_equinox_mha_under_vmap(spec):
    """The issue's own case: equinox MultiheadAttention under jax.vmap, symbolic batch."""
    eqx = pytest.importorskip("equinox")
    mha = eqx.nn.MultiheadAttention(num_heads=HEADS, query_size=HEADS * HEAD_DIM,
                                    key=jax.random.PRNGKey(0))
    exported = _export(jax.vmap(lambda x: mha(x, x, x)), spec, 1, (HEADS * HEAD_DIM,))
    _check_two_shapes(exported, [(2, 32), (3, 32)] if spec == "b" else [(2, 17), (3, 64)],
                      (HEADS * HEAD_DIM,))


def _raise_mlir_error(spec, kind, operands, **kwargs):
    """An emit that fails as MLIR does: an op whose operand ranks do not match."""
    from flashgen.rewrite import adapters
    created: list = []
    try:
        one = adapters.constant(np.ones(1, np.float32), operands[0].type.element_type, created)
        adapters.binary("add", operands[0], one, created)
    finally:
        for op in reversed(created):
            op.operation.erase()
    raise AssertionError("the mismatched ranks were accepted")


@pytest.mark.parametrize("spec", [None, "b, s"])
def test_mlir_error_of_one_site_is_its_rejection(spec, monkeypatch):
    """A rewrite that raises MLIRError leaves its site alone with the reason, static or
    shape-polymorphic; nothing escapes and the module is the original (it still runs)."""
    import flashgen.emit
    b, s = export.symbolic_shape(spec) if spec else (2, 32)
    arg = jax.ShapeDtypeStruct((b, s, HEADS, HEAD_DIM), jnp.float32)
    exported = export.export(jax.jit(jax.nn.dot_product_attention))(arg, arg, arg)
    monkeypatch.setattr(flashgen.emit, "emit_custom_call", _raise_mlir_error)
    result = fr.rewrite(exported.serialize())
    (site,) = result.sites
    assert site.status == "rejected" and site.reason.startswith("the rewrite failed: ") and \
        "Mismatched ranks" in site.reason, site.reason
    new = export.deserialize(bytearray(result.to_bytes()))
    assert "flashgen" not in new.mlir_module()
    x = np.random.default_rng(3).standard_normal((2, 32, HEADS, HEAD_DIM)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(new.call(x, x, x)), np.asarray(exported.call(x, x, x)),
                               atol=1e-6, rtol=1e-6)


def test_matching_error_of_one_site_is_its_rejection(monkeypatch):
    """An error raised while matching one site is that site's rejection, not a traceback."""
    from flashgen.rewrite.patterns import AttentionPattern

    def broken(self, op, **kwargs):
        raise IndexError("list index out of range")
    arg = jax.ShapeDtypeStruct((2, 32, HEADS, HEAD_DIM), jnp.float32)
    exported = export.export(jax.jit(jax.nn.dot_product_attention))(arg, arg, arg)
    monkeypatch.setattr(AttentionPattern, "match", broken)
    result = fr.rewrite(exported.serialize())
    assert result.sites and all(
        s.status == "rejected" and s.reason == "matching the site failed: IndexError: list "
        "index out of range (a flashgen bug)" for s in result.sites), result.sites
