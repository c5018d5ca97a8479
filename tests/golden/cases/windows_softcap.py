"""Sliding windows (iota compares, jax.nn's local_window_size, an iota carried through
lax.scan) and Gemma-style logit softcapping.
"""

from .common import T, export_fn, jax_modules, qkv, softmax_attention, tname
from .registry import golden


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, bottom_right=False,
        window=[2, -1], softcap=0.0)
def sliding_window_causal():
    # causal sliding window of 3 keys (left = 2): two iota compares combined with `and`
    _, jnp, _ = jax_modules()

    def scores(q, k):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        return jnp.where((j <= i) & (j > i - 3), s, -1e9)
    return softmax_attention(scores)


@golden(rewritten=1, targets=[tname(32, "f32", False)], causal=False, bottom_right=False,
        window=[2, 2])
def sliding_window_symmetric():
    # non-causal local attention |i - j| <= 2 (window (2, 2)) on the query-key distance
    _, jnp, _ = jax_modules()

    def scores(q, k):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(32.0)
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        return jnp.where(jnp.abs(i - j) <= 2, s, jnp.finfo(jnp.float32).min)
    return softmax_attention(scores)


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, window=[3, -1])
def jnn_local_window():
    # jax.nn.dot_product_attention's own sliding window spelling
    jax, _, _ = jax_modules()
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=(3, 0)), *qkv())


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, scale=0.125, window=[-1, -1],
        softcap=5.0)
def softcap_gemma():
    # Gemma-2 logit softcapping: cap * tanh(scores / cap) between the scale and the causal mask
    _, jnp, _ = jax_modules()

    def scores(q, k):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        s = jnp.tanh(s / 5.0) * 5.0
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        return jnp.where(j <= i, s, -1e9)
    return softmax_attention(scores)


@golden(rewritten=1, targets=[tname(32, "bf16", False)], causal=False, bottom_right=True,
        scale=0.2, window=[2, 1], softcap=30.0)
def softcap_window_bf16():
    # softcap and a bottom-right aligned window (2 left, 1 right) in bf16, Sq < Sk
    jax, jnp, _ = jax_modules()

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * 0.2
        s = 30.0 * jnp.tanh(s * (1 / 30.0))
        i, j = jnp.arange(4)[:, None] + (T - 4), jnp.arange(T)[None, :]
        s = jnp.where((j >= i - 2) & (j <= i + 1), s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s).astype(jnp.bfloat16), v)
    return export_fn(f, *qkv("bfloat16", t=4, s=T))


@golden(rejected=["masked before the softcap"])
def neg_softcap_masked_first():
    # tanh after the mask turns the -1e9 fill into -cap: not a mask the kernel can apply
    _, jnp, _ = jax_modules()

    def scores(q, k):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        s = jnp.where(j <= i, s, -1e9)
        return jnp.tanh(s / 5.0) * 5.0
    return softmax_attention(scores)


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, window=[3, -1], extras=[])
def jnn_local_window_scan():
    # inside lax.scan jax hoists the position iota out of the body into a carried constant
    jax, _, _ = jax_modules()

    def f(q, k, v):
        def body(c, _):
            return jax.nn.dot_product_attention(c, k, v, local_window_size=(3, 0),
                                                is_causal=True), None
        return jax.lax.scan(body, q, None, length=2)[0]
    return export_fn(f, *qkv())
