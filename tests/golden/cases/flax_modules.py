"""flax linen and nnx attention: causal, bf16, relative-position biases, segment and padding
masks.
"""

import numpy as np

from .common import B, T, H, D, export_fn, flax_causal_mha, jax_modules, qkv, spec, tname
from .registry import golden


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def flax_linen_causal():
    return flax_causal_mha(spec((B, T, H * D)))


@golden(rewritten=1, targets=[tname(32, "bf16", False)])
def flax_linen_bf16():
    jax, jnp, _ = jax_modules()
    import flax.linen as nn
    m = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=H * D, dtype=jnp.bfloat16)
    x = jnp.ones((B, T, H * D), jnp.bfloat16)
    params = m.init(jax.random.key(0), x)
    return export_fn(m.apply, jax.tree.map(lambda a: spec(a.shape, a.dtype), params),
                     spec((B, T, H * D), "bfloat16"))


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def flax_nnx_causal():
    jax, jnp, _ = jax_modules()
    from flax import nnx
    m = nnx.MultiHeadAttention(num_heads=H, in_features=H * D, qkv_features=H * D, decode=False,
                               rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(m)
    mask = nnx.make_causal_mask(jnp.ones((B, T)))  # a closed-over constant: a dense mask

    def f(state, x):
        return nnx.merge(graphdef, state)(x, mask=mask)
    return export_fn(f, jax.tree.map(lambda a: spec(a.shape, a.dtype), state),
                     spec((B, T, H * D)))


def _relpos_buckets():
    rel = np.arange(T)[None, :] - np.arange(T)[:, None]
    return np.clip(rel, -3, 3) + 3          # 7 buckets of the key-query distance


@golden(rewritten=1, targets=[tname(32, "f32", False)], extras=["bias"])
def flax_relpos_bias_const():
    # flax.linen.dot_product_attention with a relative-position bias table known at export
    # time (a closed-over constant [1, H, T, T])
    jax, jnp, _ = jax_modules()
    import flax.linen as nn
    table = np.random.default_rng(0).standard_normal((7, H)).astype(np.float32)
    bias = table[_relpos_buckets()].transpose(2, 0, 1)[None]

    def f(q, k, v):
        return nn.dot_product_attention(q, k, v, bias=bias)
    return export_fn(f, *qkv())


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, extras=["bias"])
def flax_relpos_bias_table():
    # the same with a trainable table (a gather at run time) and a causal mask
    jax, jnp, _ = jax_modules()
    import flax.linen as nn
    buckets = _relpos_buckets()

    def f(q, k, v, table):
        bias = jnp.transpose(table[buckets], (2, 0, 1))[None]
        return nn.dot_product_attention(q, k, v, bias=bias, mask=nn.make_causal_mask(q[..., 0, 0]))
    return export_fn(f, *qkv(), spec((7, H)))


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, extras=["segment_ids"])
def flax_segment_mask():
    # flax's spelling: make_attention_mask(seg, seg, jnp.equal) combined with a causal mask
    jax, jnp, _ = jax_modules()
    import flax.linen as nn

    def f(q, k, v, seg):
        mask = nn.combine_masks(nn.make_attention_mask(seg, seg, jnp.equal),
                                nn.make_causal_mask(seg))
        return nn.dot_product_attention(q, k, v, mask=mask)
    return export_fn(f, *qkv(), spec((B, T), "int32"))


@golden(rewritten=1, targets=[tname(32, "f32", False)], causal=False, extras=["mask"])
def flax_linen_padding_mask():
    # nn.SelfAttention(mask=make_attention_mask(pad, pad)): padded queries see no key
    jax, jnp, _ = jax_modules()
    import flax.linen as nn
    m = nn.SelfAttention(num_heads=H, qkv_features=H * D, deterministic=True)
    params = m.init(jax.random.PRNGKey(0), jnp.ones((B, T, H * D)))

    def f(params, x, pad):
        return m.apply(params, x, mask=nn.make_attention_mask(pad, pad))
    shapes = jax.tree.map(lambda a: spec(a.shape, a.dtype), params)
    return export_fn(f, shapes, spec((B, T, H * D)), spec((B, T), "bool"))


@golden(rewritten=1, targets=[tname(32, "f32", False)], causal=False, extras=["mask"])
def flax_nnx_padding_mask():
    jax, jnp, _ = jax_modules()
    from flax import nnx
    m = nnx.MultiHeadAttention(num_heads=H, in_features=H * D, qkv_features=H * D,
                               decode=False, deterministic=True, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(m)

    def f(state, x, pad):
        return nnx.merge(graphdef, state)(x, mask=nnx.make_attention_mask(pad, pad))
    shapes = jax.tree.map(lambda a: spec(a.shape, a.dtype), state)
    return export_fn(f, shapes, spec((B, T, H * D)), spec((B, T), "bool"))
