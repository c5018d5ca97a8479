"""jax.nn.dot_product_attention as exported: dtypes, GQA, scale, decoding, the three input
formats (.mlir, .mlirbc, .jax_exported), a value-and-grad graph.
"""

import math

from .common import B, H, T, export_fn, jax_modules, qkv, spec, tname
from .registry import golden, training_golden


@golden(rewritten=1, targets=[tname(32, "f32", False)], causal=False, scale=1 / math.sqrt(32),
        layout="BSHD")
def jnn_f32():
    jax, _, _ = jax_modules()
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v), *qkv())


@golden(rewritten=1, targets=[tname(32, "bf16", True)], causal=True)
def jnn_causal_bf16():
    jax, _, _ = jax_modules()
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                     *qkv("bfloat16"))


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, kv_heads=2)
def jnn_gqa_causal():
    jax, _, _ = jax_modules()
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                     *qkv(hkv=2))


@golden(rewritten=1, targets=[tname(32, "bf16", False)], kv_heads=1)
def jnn_gqa_bf16():
    jax, _, _ = jax_modules()
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v),
                     *qkv("bfloat16", hkv=1))


# a head dim no kernel has: Q, K, V zero-padded to 64 around the call, the scale 48's own
@golden(rewritten=1, targets=[tname(64, "f32", True)], causal=True, scale=1 / math.sqrt(48),
        kv_heads=2)
def jnn_head_dim_48_padded():
    jax, _, _ = jax_modules()
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                     *qkv(d=48, hkv=2))


def _mla_attention(q, k, v):
    """DeepSeek's MLA shapes: query/key head dim 192 (128 + 64 rotary), value head dim 128."""
    jax, jnp, _ = jax_modules()
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(192)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhe->bqhe", jax.nn.softmax(s), v)


def _mla_inputs():
    q, k, _ = qkv(d=192)
    return q, k, spec((B, T, H, 128))


# the value head dim is a kernel's own (d192v128), not a padding
@golden(rewritten=1, targets=["flashgen_fwd_d192v128_f32_causal"], causal=True, scale=1 / math.sqrt(192),
        kv_heads=4)
def mla_head_dims_192_128():
    return export_fn(_mla_attention, *_mla_inputs())


@training_golden(sites=1, fwd=["flashgen_fwd_d192v128_f32_causal"], bwd=["flashgen_bwd_d192v128_f32_causal"])
def train_mla_head_dims_192_128():
    jax, jnp, _ = jax_modules()
    loss = lambda q, k, v: jnp.sum(jnp.sin(_mla_attention(q, k, v)))
    return export_fn(jax.grad(loss, argnums=(0, 1, 2)), *_mla_inputs())


@golden(rewritten=1, targets=[tname(32, "f32", False)], scale=0.5)
def jnn_scale_cross():
    jax, _, _ = jax_modules()
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=0.5),
                     *qkv(s=16))


@golden(rewritten=1, targets=[tname(64, "f16", False)])
def einsum_f16_d64():
    jax, jnp, _ = jax_modules()

    def f(q, k, v):  # jax.nn.dot_product_attention has no f16 lowering on CPU
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * 0.125
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s).astype(jnp.float16), v)
    return export_fn(f, *qkv("float16", d=64))


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def jnn_decode_step():
    jax, _, _ = jax_modules()
    q, k, v = qkv(t=1, s=8)  # one query row against 8 keys: the causal mask is j <= 0
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                     q, k, v)


@golden(fmt="mlirbc", rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def jnn_f32_portable():
    jax, _, _ = jax_modules()
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), *qkv())


@golden(fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def jnn_causal_exported():
    jax, _, _ = jax_modules()
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), *qkv())


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def jnn_value_and_grad():
    # a training graph: the forward and its backward become flashgen_fwd + flashgen_bwd
    # (tests/test_rewrite_backward.py has the full training cases)
    jax, jnp, _ = jax_modules()

    def loss(q, k, v):
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True) ** 2)
    return export_fn(jax.value_and_grad(loss, argnums=(0, 1, 2)), *qkv())


@golden(rewritten=1, targets=[tname(32, "f32", False)], extras=["mask"])
def jnn_softmax_where():
    # jax.nn.softmax(s, where=mask): masked max and sum, the exponent of a second select, and a
    # final select to 0
    jax, jnp, _ = jax_modules()

    def f(q, k, v, m):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, where=m), v)
    return export_fn(f, *qkv(), spec((B, 1, T, T), "bool"))
