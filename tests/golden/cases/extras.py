"""Biases, masks and segment ids that become extra operands of the call (README "Variants"),
from jax.nn and by hand.
"""

import numpy as np

from .common import B, T, H, D, export_fn, jax_modules, qkv, softmax_attention, spec, tname
from .registry import golden


@golden(rewritten=1, targets=[tname(32, "f32", False)], causal=False, extras=["bias"])
def jnn_bias_runtime():
    # jax.nn.dot_product_attention with a bias argument [B, H, T, T]
    jax, _, _ = jax_modules()
    return export_fn(lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, bias=b),
                     *qkv(), spec((B, H, T, T)))


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, extras=["segment_ids"])
def jnn_key_padding_causal():
    # a key padding mask [B, 1, 1, T] ANDed with is_causal: causal stays an attribute
    jax, _, _ = jax_modules()
    return export_fn(lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m,
                                                                     is_causal=True),
                     *qkv(), spec((B, 1, 1, T), "bool"))


@golden(rewritten=1, targets=[tname(32, "f32", False)], causal=False, extras=["mask"])
def jnn_mask_full():
    jax, _, _ = jax_modules()
    return export_fn(lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m),
                     *qkv(), spec((B, 1, T, T), "bool"))


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, extras=["bias", "segment_ids"])
def jnn_bias_mask_causal():
    jax, _, _ = jax_modules()
    return export_fn(lambda q, k, v, b, m: jax.nn.dot_product_attention(
        q, k, v, bias=b, mask=m, is_causal=True), *qkv(), spec((B, 1, 1, T)),
        spec((B, 1, 1, T), "bool"))


@golden(rewritten=1, targets=[tname(32, "bf16", False)], extras=["bias"])
def jnn_bias_bf16():
    # a bf16 padding bias [B, 1, 1, T] stays bf16 (the q dtype)
    jax, _, _ = jax_modules()
    return export_fn(lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, bias=b),
                     *qkv("bfloat16"), spec((B, 1, 1, T), "bfloat16"))


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, kv_heads=2, extras=["mask"])
def jnn_gqa_mask():
    # a per-head mask with GQA: the mask's heads must follow the kernel's head order
    jax, _, _ = jax_modules()
    return export_fn(lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m,
                                                                     is_causal=True),
                     *qkv(hkv=2), spec((B, H, T, T), "bool"))


@golden(rewritten=1, targets=[tname(32, "f32", False)], extras=["segment_ids"])
def jnn_decode_padding():
    # one query row against a padded KV cache
    jax, _, _ = jax_modules()
    return export_fn(lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m),
                     *qkv(t=1, s=8), spec((B, 1, 1, 8), "bool"))


@golden(rewritten=1, targets=[tname(32, "f32", False)], extras=["bias"])
def const_position_bias():
    # a constant relative-position bias 0.1·(j - i): no ALiBi without a causal mask
    _, jnp, _ = jax_modules()
    rel = (np.arange(T)[None, :] - np.arange(T)[:, None]).astype(np.float32) * 0.1

    def scores(q, k):
        return jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125 + rel
    return softmax_attention(scores)


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, extras=["segment_ids"])
def segment_ids_causal():
    # packed sequences: q_seg[:, None, :, None] == kv_seg[:, None, None, :], ANDed with causal
    _, jnp, _ = jax_modules()

    def scores(q, k, seg):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        visible = (seg[:, None, :, None] == seg[:, None, None, :]) & (j <= i)
        return jnp.where(visible, s, -1e9)
    return softmax_attention(scores, spec((B, T), "int32"))


@golden(rewritten=1, targets=[tname(32, "f32", False)], extras=["mask"])
def segment_ids_per_head():
    # near miss: ids that differ per head are no segment ids [B, S]: a plain mask
    _, jnp, _ = jax_modules()

    def scores(q, k, ids):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        return jnp.where(ids[:, :, :, None] == ids[:, :, None, :], s, -1e9)
    return softmax_attention(scores, spec((B, H, T), "int32"))


@golden(rewritten=1, targets=[tname(32, "f32", False)], causal=False, extras=["mask"])
def prefix_lm_mask():
    # prefix LM: causal OR key inside the per-example prefix (an OR: one run-time mask)
    _, jnp, _ = jax_modules()

    def scores(q, k, prefix):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        visible = (j <= i)[None, None] | (j < prefix[:, None, None, None])
        return jnp.where(visible, s, -1e9)
    return softmax_attention(scores, spec((B,), "int32"))


@golden(rewritten=1, targets=[tname(32, "f32", False)], causal=False, extras=["mask"])
def const_strided_mask():
    # a constant mask that is no band on the diagonal (every other key): a constant operand
    _, jnp, _ = jax_modules()

    def scores(q, k):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        return jnp.where((j <= i) & ((i - j) % 2 == 0), s, -1e9)
    return softmax_attention(scores)


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, extras=["segment_ids"])
def scan_layers_padding_mask():
    # lax.scan over layers with one key padding mask: the mask enters the while body as a
    # loop-carried value and is passed from there
    jax, jnp, _ = jax_modules()
    C = H * D

    def f(x, wq, wk, wv, mask):
        def body(x, w):
            q = (x @ w[0]).reshape(B, T, H, D)
            k = (x @ w[1]).reshape(B, T, H, D)
            v = (x @ w[2]).reshape(B, T, H, D)
            a = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)
            return x + a.reshape(B, T, C), None
        return jax.lax.scan(body, x, jnp.stack([wq, wk, wv], 1))[0]
    return export_fn(f, spec((B, T, C)), spec((3, C, C)), spec((3, C, C)), spec((3, C, C)),
                     spec((B, 1, 1, T), "bool"))


@golden(rewritten=1, targets=[tname(32, "f32", False)], causal=False, extras=["mask"])
def const_mask_empty_row():
    # strictly-below-diagonal: the first query sees nothing. The program gives the mean of V
    # there (a finite fill: equal scores), the kernel 0: a constant mask operand and, the
    # empty rows being known statically, select(constant row flags, mean of V, o)
    _, jnp, _ = jax_modules()

    def scores(q, k):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        return jnp.where(j < i, s, -1e9)
    return softmax_attention(scores)
