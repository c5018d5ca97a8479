"""ALiBi spellings (a bias linear in the query-key distance, an extra operand of the call as
in README "Variants") and a near miss.
"""

import math

import numpy as np

from .common import T, H, jax_modules, qkv, softmax_attention, tname
from .registry import golden


def alibi_slopes(h):
    """The ALiBi paper's slopes for h heads (a power of two): 2^(-8/h), 2^(-16/h), ..."""
    return np.array([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], np.float32)


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, scale=1 / math.sqrt(32),
        extras=["alibi"])
def alibi_bloom():
    # BLOOM's spelling: slopes·j (equal to -slopes·(i - j) up to a per-row constant) + causal
    _, jnp, _ = jax_modules()
    slopes = alibi_slopes(H)

    def scores(q, k):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (1 / math.sqrt(32))
        s = s + slopes[None, :, None, None] * jnp.arange(T, dtype=jnp.float32)
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        return jnp.where(j <= i, s, jnp.finfo(jnp.float32).min)
    return softmax_attention(scores)


@golden(rewritten=1, targets=[tname(32, "f32", False)], causal=False, bottom_right=False,
        extras=["alibi"])
def alibi_symmetric():
    # -slope·|i - j| without a mask (encoder-style ALiBi)
    _, jnp, _ = jax_modules()
    slopes = alibi_slopes(H)

    def scores(q, k):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        dist = jnp.abs(jnp.arange(T)[:, None] - jnp.arange(T)[None, :]).astype(jnp.float32)
        return s - slopes[:, None, None] * dist
    return softmax_attention(scores)


@golden(rewritten=1, targets=[tname(32, "f32", False)], causal=False, bottom_right=True,
        extras=["alibi"])
def alibi_bottom_right():
    # 4 new queries against 8 keys, distances measured from the last key (offset Sk - Sq)
    _, jnp, _ = jax_modules()
    slopes = alibi_slopes(H)

    def scores(q, k):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        i, j = jnp.arange(4)[:, None] + (T - 4), jnp.arange(T)[None, :]
        return s + (-slopes)[:, None, None] * jnp.abs(i - j).astype(jnp.float32)
    return softmax_attention(scores, inputs=qkv(t=4, s=T))


@golden(rewritten=1, targets=[tname(32, "f32", False)], causal=False, extras=["bias"])
def alibi_like_sqrt():
    # near miss: -slope·sqrt|i - j| is no ALiBi (not linear in |i - j|): a constant bias
    _, jnp, _ = jax_modules()
    slopes = alibi_slopes(H)

    def scores(q, k):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        dist = jnp.abs(jnp.arange(T)[:, None] - jnp.arange(T)[None, :]).astype(jnp.float32)
        return s - slopes[:, None, None] * jnp.sqrt(dist)
    return softmax_attention(scores)
