"""The rewriter on head dims that no kernel has (issue 23, 2a): Q, K, V padded with zero
columns to the next kernel head dim around the call, the output (and a training site's
dQ, dK, dV) sliced back; every output equal to the original's on fresh inputs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashgen.rewrite as fr
from conftest import verified_rewrite


def _export(fn, *shapes):
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    return jax.export.export(jax.jit(fn), platforms=["cpu"])(*args).mlir_module()


def _body(result) -> str:
    return "\n".join(ln for ln in result.text().splitlines() if not ln.startswith("#loc"))


@pytest.mark.parametrize("d, kernel_d", [(48, 64), (80, 96)])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_site_with_a_non_kernel_head_dim_is_padded(rng, d, kernel_d, causal):
    fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    result = verified_rewrite(_export(fn, (2, 8, 4, d), (2, 8, 2, d), (2, 8, 2, d)), rng)
    site, = result.rewritten
    assert site.head_dim == d and site.spec["head_dim"] == kernel_d
    assert abs(site.scale - 1 / np.sqrt(d)) < 1e-6       # the site's own scale, not the padded dim's
    body = _body(result)
    assert f"flashgen_fwd_d{kernel_d}_f32" in body
    assert "stablehlo.pad" in body and "stablehlo.slice" in body
    assert any(f"head dim {d} runs at the kernel's {kernel_d}" in n for n in site.notes)


def test_training_site_with_a_non_kernel_head_dim_slices_the_gradients(rng):
    def loss(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.2
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
        return jnp.sum(o * jnp.sin(o))
    x = (1, 8, 2, 80)
    result = verified_rewrite(_export(jax.grad(loss, argnums=(0, 1, 2)), x, x, x), rng)
    assert [s.backward_target for s in result.rewritten] == ["flashgen_bwd_d96_f32"]
    assert "stablehlo.exponential" not in _body(result)


def test_head_dim_over_256_is_still_refused():
    x = (1, 8, 2, 300)
    result = fr.rewrite(_export(lambda q, k, v: jax.nn.dot_product_attention(q, k, v), x, x, x))
    assert not result.rewritten
    assert any("unsupported head_dim 300" in s.reason for s in result.rejected)


def test_padded_site_keeps_its_bias_and_mask(rng):
    d = 48
    bias = jnp.asarray(rng.standard_normal((1, 4, 8, 8)), jnp.float32)
    mask = jnp.asarray(rng.random((2, 1, 8, 8)) < 0.7)
    fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, bias, mask)
    result = verified_rewrite(_export(fn, (2, 8, 4, d), (2, 8, 4, d), (2, 8, 4, d)), rng)
    site, = result.rewritten
    assert site.spec["head_dim"] == 64 and site.extras


def test_polymorphic_site_with_a_non_kernel_head_dim_is_left_alone():
    b = jax.export.symbolic_shape("b")[0]
    x = jax.ShapeDtypeStruct((b, 8, 2, 48), jnp.float32)
    text = jax.export.export(jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v)),
                             platforms=["cpu"])(x, x, x).mlir_module()
    result = fr.rewrite(text)
    assert not result.rewritten
    assert any("head dim 48 is not a kernel's" in s.reason for s in result.rejected), \
        [s.reason for s in result.rejected]


def test_padded_training_site_with_rows_that_see_no_key(rng):
    """A -1e9 fill gives rows that see no key the mean of V (empty_rows 'mean'): the fix-up and
    its gradient run on the padded kernel operands, before the slice."""
    def attend(q, k, v, m):
        s = jnp.where(m, jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.1, -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    x = jax.ShapeDtypeStruct((2, 8, 4, 48), jnp.bfloat16)
    m = jax.ShapeDtypeStruct((2, 1, 8, 8), jnp.bool_)
    grad = jax.grad(lambda q, k, v, m: jnp.sum(jnp.sin(attend(q, k, v, m))), argnums=(0, 1, 2))
    text = jax.export.export(jax.jit(grad), platforms=["cpu"])(x, x, x, m).mlir_module()
    site, = verified_rewrite(text, rng).rewritten
    assert site.empty_rows == "mean" and site.backward_target == "flashgen_bwd_d64_bf16"
