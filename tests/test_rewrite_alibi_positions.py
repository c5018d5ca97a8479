"""ALiBi built from a padded batch's positions (issue 23, item 3): BLOOM's and Falcon's
``slope_h · ((cumsum(mask) - 1) · mask)[b, j]`` under a causal and a padding mask.

The bias depends on the key only (per batch entry and head), so the rewrite keeps it as a
[B, H, 1, Sk] bias operand (O(S); the kernels broadcast it over the queries), the causal
mask as the attribute and the padding as key-padding segment ids. The kernel's own ALiBi
(-slope·|i - j|) would be exact only for contiguous real tokens, which a run-time mask does
not promise (a hole makes cumsum's positions differ from j by more than a per-row constant),
and Falcon rounds its slopes·positions to bf16. Plain JAX spellings of both libraries'
graphs; the goldens (tests/golden/cases/alibi.py) run the libraries themselves.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashgen.rewrite as fr
from flashgen import execute
from flashgen.rewrite import modules, verify

B, S, H, D = 3, 40, 4, 32
SLOPES = np.array([2.0 ** (-8.0 * (i + 1) / H) for i in range(H)], np.float32)
MIN = float(jnp.finfo(jnp.float32).min)


@pytest.fixture(scope="module")
def kernels():
    from flashgen import runtime
    from flashgen.spec import KernelSpec
    runtime.ensure([KernelSpec(D, "f32", c, "cpu") for c in (False, True)])


def _positions(mask):
    return ((jnp.cumsum(mask, -1) - 1) * mask).astype(jnp.float32)          # [B, S]


def _causal_and_padding(mask):
    i, j = jnp.arange(S)[:, None], jnp.arange(S)[None, :]
    return (j <= i)[None, None] & (mask[:, None, None, :] != 0)              # [B, 1, S, S]


def bloom(q, k, v, mask):
    # baddbmm(alibi [B·H, 1, S], q, kᵀ, alpha=1/sqrt(d)) + the causal/padding float mask
    alibi = (SLOPES[None, :, None] * _positions(mask)[:, None, :])[:, :, None, :]
    s = alibi + jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
    s = s + jnp.where(_causal_and_padding(mask), 0.0, MIN)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


def falcon(q, k, v, mask, guard=False):
    # (scores + alibi) · inv_norm + masked_fill(alibi · inv_norm, float mask < -1, min): the
    # ALiBi (rounded to bf16 as Falcon does) reaches the scores twice, once through the mask
    alibi = (SLOPES.astype(jnp.bfloat16)[None, :, None] * _positions(mask)[:, None, :])
    alibi = alibi.astype(jnp.float32)[:, :, None, :]
    float_mask = jnp.where(_causal_and_padding(mask), 0.0, MIN)
    attn_mask = jnp.where(float_mask < -1, MIN, alibi / math.sqrt(D))
    s = (jnp.einsum("bqhd,bkhd->bhqk", q, k) + alibi) * (1 / math.sqrt(D)) + attn_mask
    p = jax.nn.softmax(s, -1)
    if guard:   # torch's _safe_softmax (SDPA through torchax): rows of -inf scores give 0
        p = jnp.where(jnp.all(s == -jnp.inf, -1, keepdims=True), 0.0, p)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def falcon_sdpa(q, k, v, mask):
    # with a finite fill the guard never fires: a row without a visible key is the mean of V
    return falcon(q, k, v, mask, guard=True)


def _export(fn):
    x = jax.ShapeDtypeStruct((B, S, H, D), jnp.float32)
    m = jax.ShapeDtypeStruct((B, S), jnp.int32)
    return jax.export.export(jax.jit(fn), platforms=["cpu"])(x, x, x, m).mlir_module()


def _masks():
    """Left padding, a hole in the middle (cumsum's positions are no longer j - const) and
    right padding."""
    m = np.ones((B, S), np.int32)
    m[0, :13] = 0                        # also rows without a visible key
    m[1, 7:11] = 0
    m[2, 30:] = 0
    return m


@pytest.mark.parametrize("fn", [bloom, falcon, falcon_sdpa], ids=["bloom", "falcon", "falcon_sdpa"])
def test_alibi_of_padded_positions_is_a_key_bias_causal_and_key_padding(kernels, fn):
    text = _export(fn)
    result = fr.rewrite(text)
    (site,) = result.rewritten
    assert site.causal and site.extras == ["bias", "segment_ids"], site.extras_detail
    assert site.extras_detail[0].startswith(f"bias [{B},{H},1,{S}]"), site.extras_detail
    assert f"{S}x{S}x" not in result.text()          # no S x S value is left
    original, rewritten = modules.load(text), modules.load(result.to_bytes())
    inputs = verify.fan_in_scaled(execute.random_inputs(execute.signature(original)[0], 4))
    inputs[3] = _masks()
    ref = execute.run(original, inputs, register=False)
    got = execute.run(rewritten, inputs)
    rows = verify.compare(ref, got, result.rewritten)
    assert all(r["ok"] for r in rows), rows
    # the hole changes the answer (positions from cumsum are not j): the test can fail
    assert not np.allclose(np.asarray(ref[0])[1], np.asarray(_kernel_alibi(inputs))[1], atol=1e-3)


def _kernel_alibi(inputs):
    """BLOOM's attention with -slope·|i - j| in place of the positions' ALiBi (what the
    kernel's own ALiBi computes): equal on contiguous rows only."""
    q, k, v, mask = (jnp.asarray(x) for x in inputs)
    i, j = jnp.arange(S)[:, None], jnp.arange(S)[None, :]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D) - \
        SLOPES[:, None, None] * jnp.abs(i - j).astype(jnp.float32)
    s = jnp.where(_causal_and_padding(mask), s, MIN)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


def test_masked_fill_of_a_runtime_bias_splits_mask_and_bias(kernels):
    """where(p, -inf, x) added to the scores: the mask p (here a run-time [B, 1, S, S] one,
    no band) and the bias x on what it leaves visible."""
    def f(q, k, v, m, x):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        s = s + jnp.where(m, MIN, x)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
    x = jax.ShapeDtypeStruct((B, S, H, D), jnp.float32)
    text = jax.export.export(jax.jit(f), platforms=["cpu"])(
        x, x, x, jax.ShapeDtypeStruct((B, 1, S, S), jnp.bool_),
        jax.ShapeDtypeStruct((1, H, 1, S), jnp.float32)).mlir_module()
    result = fr.rewrite(text)
    (site,) = result.rewritten
    assert site.extras == ["bias", "mask"], site.extras_detail
    assert site.extras_detail[0].startswith(f"bias [1,{H},1,{S}]"), site.extras_detail
    original, rewritten = modules.load(text), modules.load(result.to_bytes())
    inputs = verify.inputs_for(original, 5)
    rows = verify.compare(execute.run(original, inputs, register=False),
                          execute.run(rewritten, inputs), result.rewritten)
    assert all(r["ok"] for r in rows), rows
