"""Attention written by hand with einsum / matmul: scale, mask and softmax spellings, layouts,
several sites, layers (unrolled and under lax.scan).
"""

import math

import numpy as np

from .common import (
    B, T, H, D, export_fn, jax_modules, qkv, softmax_attention, softmax_manual, spec, tname)
from .registry import golden


@golden(rewritten=1, targets=[tname(32, "f32", False)], scale=0.125, layout="BSHD")
def einsum_bshd():
    _, jnp, _ = jax_modules()
    return softmax_attention(lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125)


@golden(rewritten=1, targets=[tname(64, "f32", False)], scale=1 / 8, layout="BHSD")
def einsum_bhsd_sqrt():
    jax, jnp, _ = jax_modules()

    def f(q, k, v):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
        return jnp.einsum("bhqk,bhkd->bhqd", softmax_manual(jnp, s), v)
    return export_fn(f, *qkv(d=64, layout="BHSD"))


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def matmul_causal_where():
    jax, jnp, _ = jax_modules()

    def f(q, k, v):
        s = q @ jnp.swapaxes(k, -1, -2) * (1 / math.sqrt(32))
        n = s.shape[-1]
        mask = jnp.tril(jnp.ones((n, n), bool))
        s = jnp.where(mask, s, -1e9)
        return softmax_manual(jnp, s) @ v
    return export_fn(f, *qkv(layout="BHSD"))


@golden(rewritten=1, targets=[tname(32, "f32", False)], scale=0.2)
def matmul_scale_in_q():
    jax, jnp, _ = jax_modules()

    def f(q, k, v):
        s = (q * 0.2) @ jnp.swapaxes(k, -1, -2)
        return jax.nn.softmax(s) @ v
    return export_fn(f, *qkv(layout="BHSD"))


@golden(rewritten=1, targets=[tname(32, "bf16", True)], causal=True)
def einsum_bf16_softmax():
    jax, jnp, _ = jax_modules()

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.bfloat16(1 / math.sqrt(32))
        t = s.shape[-1]
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.finfo(jnp.bfloat16).min)
        m = jnp.max(s, axis=-1, keepdims=True)
        e = jnp.exp(s - m)
        den = jnp.sum(e.astype(jnp.float32), axis=-1, keepdims=True).astype(jnp.bfloat16)
        return jnp.einsum("bhqk,bkhd->bqhd", e / den, v)
    return export_fn(f, *qkv("bfloat16"))


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def einsum_dense_mask():
    _, jnp, _ = jax_modules()
    mask = np.tril(np.ones((T, T), bool))

    def scores(q, k):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(32)
        return jnp.where(mask, s, -jnp.inf)
    return softmax_attention(scores)


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def einsum_additive_bias():
    jax, jnp, _ = jax_modules()
    bias = np.where(np.tril(np.ones((T, T), bool)), 0.0, -np.inf).astype(np.float32)

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25 + bias
        return jnp.einsum("bhqk,bkhd->bqhd", softmax_manual(jnp, s), v)
    return export_fn(f, *qkv())


@golden(rewritten=1, targets=[tname(32, "f32", False)])
def einsum_keys_first():
    jax, jnp, _ = jax_modules()

    def f(q, k, v):  # scores laid out [b, h, keys, queries]; softmax over axis -2
        s = jnp.einsum("bkhd,bqhd->bhkq", k, q) * 0.125
        p = jax.nn.softmax(s, axis=-2)
        return jnp.einsum("bhkq,bkhd->bqhd", p, v)
    return export_fn(f, *qkv())


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def einsum_v_left():
    jax, jnp, _ = jax_modules()

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        t = s.shape[-1]
        s = jnp.where(jnp.arange(t)[None, :] <= jnp.arange(t)[:, None], s, -1e30)
        return jnp.einsum("bkhd,bhqk->bhdq", v, jax.nn.softmax(s)).transpose(0, 3, 1, 2)
    return export_fn(f, *qkv())


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, bottom_right=True)
def bottom_right_causal():
    _, jnp, _ = jax_modules()

    def scores(q, k):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        sq, sk = s.shape[-2:]
        visible = jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + (sk - sq)
        return jnp.where(visible, s, -1e9)
    return softmax_attention(scores, inputs=qkv(t=4, s=8))


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def heads_folded():
    jax, jnp, _ = jax_modules()

    def f(q, k, v):  # [B*H, S, D]
        s = jnp.matmul(q, jnp.swapaxes(k, 1, 2)) * 0.125
        t = s.shape[-1]
        s = s + jnp.where(jnp.tril(jnp.ones((t, t), bool)), 0.0, -jnp.inf)
        return jnp.matmul(jax.nn.softmax(s, axis=-1), v)
    x = spec((B * H, T, D))
    return export_fn(f, x, x, x)


@golden(rewritten=2, targets=[tname(32, "f32", False), tname(32, "f32", True)])
def two_sites_shared_q():
    jax, _, _ = jax_modules()

    def f(q, k, v, k2, v2):
        a = jax.nn.dot_product_attention(q, k, v)
        b = jax.nn.dot_product_attention(q, k2, v2, is_causal=True)
        return a + b, a
    q, k, v = qkv()
    return export_fn(f, q, k, v, k, v)


@golden(rewritten=2, targets=[tname(32, "f32", True)], causal=True)
def transformer_2layer():
    jax, jnp, _ = jax_modules()
    C = H * D

    def layer(x, w):
        h = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
        q = (h @ w["q"]).reshape(B, T, H, D)
        k = (h @ w["k"]).reshape(B, T, H, D)
        v = (h @ w["v"]).reshape(B, T, H, D)
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(B, T, C)
        x = x + a @ w["o"]
        return x + jax.nn.gelu(x @ w["up"]) @ w["down"]

    def f(x, ws):
        for w in ws:
            x = layer(x, w)
        return x
    w = {n: spec((C, C)) for n in ("q", "k", "v", "o")} | {"up": spec((C, 2 * C)),
                                                          "down": spec((2 * C, C))}
    return export_fn(f, spec((B, T, C)), [w, w])


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def scan_layers():
    jax, jnp, _ = jax_modules()
    C = H * D

    def f(x, wq, wk, wv):
        def body(x, w):
            q = (x @ w[0]).reshape(B, T, H, D)
            k = (x @ w[1]).reshape(B, T, H, D)
            v = (x @ w[2]).reshape(B, T, H, D)
            return x + jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(B, T, C), None
        return jax.lax.scan(body, x, jnp.stack([wq, wk, wv], 1))[0]
    return export_fn(f, spec((B, T, C)), spec((3, C, C)), spec((3, C, C)), spec((3, C, C)))


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def exp_log_softmax():
    # probabilities spelled exp(log_softmax(s)): exp(s - max - log(sum(exp(s - max))))
    jax, jnp, _ = jax_modules()

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        p = jnp.exp(jax.nn.log_softmax(jnp.where(j <= i, s, -jnp.inf)))
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return export_fn(f, *qkv())
