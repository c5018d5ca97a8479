"""Shape-polymorphic exports: jax.export with symbolic batch and sequence dims
(flashgen.rewrite.polymorphic). The call gets dynamic result shapes;
tests/test_rewrite_polymorphic.py runs them at two concrete shapes.
"""

import math

from .common import H, D, export_fn, flax_causal_mha, jax_modules, softmax_manual, tname
from .registry import golden


def poly_qkv(dims="b, t", h=H, d=D):
    jax, jnp, export = jax_modules()
    b, t, *rest = export.symbolic_shape(dims)
    h = rest[0] if rest else h
    return [jax.ShapeDtypeStruct((b, t, h, d), jnp.float32)] * 3


def einsum_attention(jnp, q, k, v, mask=None, fill=-1e9):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (1 / math.sqrt(D))
    if mask is not None:
        s = jnp.where(mask, s, fill)
    return jnp.einsum("bhqk,bkhd->bqhd", softmax_manual(jnp, s), v)


@golden(fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
        numerics=False)
def poly_jnn_causal():
    jax, _, _ = jax_modules()
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                     *poly_qkv())


@golden(fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", False)], causal=False,
        scale=1 / math.sqrt(32), numerics=False)
def poly_jnn():
    jax, _, _ = jax_modules()
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v), *poly_qkv())


@golden(fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", False)], causal=False,
        layout="BSHD", numerics=False)
def poly_einsum():
    _, jnp, _ = jax_modules()
    return export_fn(lambda q, k, v: einsum_attention(jnp, q, k, v), *poly_qkv())


@golden(fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
        numerics=False)
def poly_einsum_tril():
    # the causal mask of a symbolic length: tril(ones((s, s))) becomes dynamic_iota compares
    _, jnp, _ = jax_modules()
    return export_fn(lambda q, k, v: einsum_attention(
        jnp, q, k, v, jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool))), *poly_qkv())


@golden(fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
        window=[3, -1], numerics=False)
def poly_einsum_window():
    # a sliding window from two iota compares (jax.nn's local_window_size does not export with
    # a symbolic length: it builds the mask with range(T))
    _, jnp, _ = jax_modules()

    def f(q, k, v):
        i, j = jnp.arange(q.shape[1])[:, None], jnp.arange(q.shape[1])[None, :]
        return einsum_attention(jnp, q, k, v, (i >= j) & (i - j <= 3))
    return export_fn(f, *poly_qkv())


@golden(fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", True)], causal=True, kv_heads=2,
        numerics=False)
def poly_jnn_gqa():
    jax, jnp, export = jax_modules()
    b, t = export.symbolic_shape("b, t")
    q = jax.ShapeDtypeStruct((b, t, H, D), jnp.float32)
    kv = jax.ShapeDtypeStruct((b, t, 2, D), jnp.float32)
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                     q, kv, kv)


@golden(fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
        numerics=False, rejected=["the scores have"])
def poly_layers_shared_fn():
    # two layers calling one jitted attention: one private function, rewritten once; the
    # projections reach the softmax too and are rejected as candidates of their own
    jax, jnp, export = jax_modules()
    attn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))

    def f(x, w):
        for i in range(2):
            q = jnp.einsum("bshd,hde->bshe", x, w[i])
            x = attn(q, q * 0.5, q + 1) + x
        return x
    b, t = export.symbolic_shape("b, t")
    return export_fn(f, jax.ShapeDtypeStruct((b, t, H, D), jnp.float32),
                     jax.ShapeDtypeStruct((2, H, D, D), jnp.float32))


@golden(fmt="jax_exported",
        rejected=["training site (forward and backward) in a shape-polymorphic module"])
def neg_poly_training():
    jax, jnp, _ = jax_modules()

    def loss(q, k, v):
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True) ** 2)
    return export_fn(jax.grad(loss, argnums=(0, 1, 2)), *poly_qkv())


@golden(fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
        numerics=False)
def poly_flax_linen_causal():
    # flax's MultiHeadDotProductAttention with make_causal_mask of a symbolic length; its
    # 1/sqrt(d) on the query goes into the call's scale
    jax, jnp, export = jax_modules()
    b, t = export.symbolic_shape("b, t")
    return flax_causal_mha(jax.ShapeDtypeStruct((b, t, H * D), jnp.float32))


@golden(fmt="jax_exported", rewritten=1, targets=[tname(32, "bf16", False)], kv_heads=2,
        scale=0.17, numerics=False)
def poly_einsum_gqa_upcast():
    # bf16 inputs upcast to f32, K/V repeated over the query heads, Q scaled by a constant:
    # walked back to their sources as for a static module (a bf16 call on the unrepeated K/V)
    jax, jnp, export = jax_modules()
    b, t = export.symbolic_shape("b, t")
    q = jax.ShapeDtypeStruct((b, t, H, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, t, 2, D), jnp.bfloat16)

    def f(q, k, v):
        k, v = (jnp.repeat(x, 2, axis=2).astype(jnp.float32) for x in (k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32) * 0.17, k)
        return jnp.einsum("bhqk,bkhd->bqhd", softmax_manual(jnp, s), v)
    return export_fn(f, q, kv, kv)


@golden(fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
        numerics=False)
def poly_constrained():
    # symbolic constraints: the instantiation sizes must satisfy jax.export's shape assertions
    jax, jnp, export = jax_modules()
    b, t = export.symbolic_shape("b, t", constraints=["t >= 128", "b <= 8"])
    x = jax.ShapeDtypeStruct((b, t, H, D), jnp.float32)
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                     x, x, x)


@golden(fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", False)], causal=False,
        extras=["segment_ids"])
def poly_padding_mask_from_k():
    # a run-time key padding mask computed from K: segment ids (q id 1), and the fix-up of
    # the rows that see no key (finite fill: the mean of V) built at run-time sizes
    _, jnp, _ = jax_modules()
    return export_fn(lambda q, k, v: einsum_attention(
        jnp, q, k, v, (k[:, :, 0, 0] > 0)[:, None, None, :]), *poly_qkv())


QKV = (("b", "t", H, D), "float32")


def poly_specs(*shapes):
    """ShapeDtypeStructs of (shape, dtype) pairs whose dims "b" and "t" are the symbolic
    batch and sequence (of one scope, as jax.export needs)."""
    jax, jnp, export = jax_modules()
    dims = dict(zip("bt", export.symbolic_shape("b, t")))
    return [jax.ShapeDtypeStruct(tuple(dims.get(n, n) for n in shape), jnp.dtype(dtype))
            for shape, dtype in shapes]


@golden(fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", False)], causal=False,
        extras=["segment_ids"])
def poly_key_padding():
    # a [b, t] key-padding argument
    _, jnp, _ = jax_modules()
    return export_fn(lambda q, k, v, m: einsum_attention(jnp, q, k, v, m[:, None, None, :]),
                     *poly_specs(QKV, QKV, QKV, (("b", "t"), "bool")))


@golden(fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
        extras=["segment_ids"])
def poly_key_padding_causal():
    # key padding AND a causal mask of the symbolic length: the fix-up's band from
    # dynamic_iota (left padding leaves a sequence's first rows without a key)
    _, jnp, _ = jax_modules()

    def f(q, k, v, m):
        n = q.shape[1]
        causal = jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]
        return einsum_attention(jnp, q, k, v, m[:, None, None, :] & causal[None, None])
    return export_fn(f, *poly_specs(QKV, QKV, QKV, (("b", "t"), "bool")))


@golden(fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", False)], causal=False,
        extras=["segment_ids"])
def poly_flax_key_padding():
    # flax linen MultiHeadDotProductAttention with make_attention_mask(query ones, key
    # padding), symbolic batch and sequence
    jax, jnp, _ = jax_modules()
    import flax.linen as nn

    class M(nn.Module):
        @nn.compact
        def __call__(self, x, pad):
            mask = nn.make_attention_mask(jnp.ones(x.shape[:2], bool), pad)
            return nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=H * D)(x, mask=mask)
    m = M()
    params = m.init(jax.random.key(0), jnp.ones((2, 8, H * D)), jnp.ones((2, 8), bool))
    return export_fn(m.apply, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                           params),
                     *poly_specs((("b", "t", H * D), "float32"), (("b", "t"), "bool")))


@golden(fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", False)], causal=False,
        layout="(HD)BS", extras=["segment_ids"])
def poly_equinox_vmap_key_padding():
    # equinox MultiheadAttention under jax.vmap over a symbolic batch, a key-padding mask
    # broadcast over the queries; the weights are passed as leaves (a .jax_exported keeps
    # no equinox tree)
    jax, jnp, _ = jax_modules()
    import equinox as eqx
    m = eqx.nn.MultiheadAttention(num_heads=H, query_size=H * D, key=jax.random.PRNGKey(0))
    params, static = eqx.partition(m, eqx.is_array)
    leaves, tree = jax.tree_util.tree_flatten(params)

    def f(leaves, x, pad):
        mm = eqx.combine(jax.tree_util.tree_unflatten(tree, leaves), static)
        return jax.vmap(lambda xx, p: mm(xx, xx, xx, mask=jnp.broadcast_to(
            p[None, :], (xx.shape[0], xx.shape[0]))))(x, pad)
    return export_fn(f, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in leaves],
                     *poly_specs((("b", "t", H * D), "float32"), (("b", "t"), "bool")))


@golden(fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", False)], causal=False,
        extras=["bias", "mask"])
def poly_jnn_mask_bias():
    # jax.nn.dot_product_attention(mask=[b, 1, t, t], bias=[b, H, t, t]): both operands at
    # run-time sizes
    jax, _, _ = jax_modules()
    return export_fn(lambda q, k, v, m, c: jax.nn.dot_product_attention(q, k, v, mask=m, bias=c),
                     *poly_specs(QKV, QKV, QKV, (("b", 1, "t", "t"), "bool"),
                                 (("b", H, "t", "t"), "float32")))


@golden(fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
        extras=["segment_ids"])
def poly_jnn_kv_seq_lengths_causal():
    # jax.nn.dot_product_attention(key_value_seq_lengths=[b], is_causal=True): the mask jax.nn
    # builds after the Q·K product is key padding, read before the P·V product
    jax, _, _ = jax_modules()
    return export_fn(lambda q, k, v, n: jax.nn.dot_product_attention(
        q, k, v, key_value_seq_lengths=n, is_causal=True),
        *poly_specs(QKV, QKV, QKV, (("b",), "int32")))


@golden(fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", False)], causal=False,
        extras=["segment_ids"])
def poly_segment_ids():
    # packed sequences: q and kv segment ids of symbolic batch and length
    _, jnp, _ = jax_modules()
    ids = (("b", "t"), "int32")
    return export_fn(lambda q, k, v, qs, ks: einsum_attention(
        jnp, q, k, v, qs[:, None, :, None] == ks[:, None, None, :]),
        *poly_specs(QKV, QKV, QKV, ids, ids))


@golden(fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", False)], causal=False,
        extras=[])
def poly_runtime_scale():
    # the scores times a run-time scalar: multiplied into Q before the call
    _, jnp, _ = jax_modules()

    def f(q, k, v, c):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * c
        return jnp.einsum("bhqk,bkhd->bqhd", softmax_manual(jnp, s), v)
    return export_fn(f,
                     *poly_specs(QKV, QKV, QKV, ((), "float32")))


@golden(fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
        extras=["alibi"])
def poly_alibi_causal():
    # an ALiBi bias from iotas of the symbolic length: constant [Hq] slopes in both instances
    _, jnp, _ = jax_modules()
    slopes = [2.0 ** (-8 * (h + 1) / H) for h in range(H)]

    def f(q, k, v):
        n = q.shape[1]
        i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
        bias = -jnp.array(slopes)[:, None, None] * jnp.abs(i - j)[None].astype(jnp.float32)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (1 / math.sqrt(D)) + bias[None]
        s = jnp.where((i >= j)[None, None], s, -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", softmax_manual(jnp, s), v)
    return export_fn(f, *poly_qkv())


@golden(fmt="jax_exported", rejected=["a constant mask operand (computed from the sizes"])
def neg_poly_constant_mask():
    # a constant mask that is no causal/window band, from iotas of the symbolic length: an
    # operand of the instance's sizes
    _, jnp, _ = jax_modules()

    def f(q, k, v):
        n = q.shape[1]
        return einsum_attention(jnp, q, k, v, ((jnp.arange(n)[:, None] +
                                                jnp.arange(n)[None, :]) % 3 != 0)[None, None])
    return export_fn(f, *poly_qkv())


@golden(fmt="jax_exported", rejected=["heads of q is symbolic"])
def neg_poly_symbolic_heads():
    # the head count selects nothing in the kernel but the call's static result type
    _, jnp, _ = jax_modules()
    return export_fn(lambda q, k, v: einsum_attention(jnp, q, k, v), *poly_qkv("b, t, h"))


@golden(fmt="jax_exported", rejected=["head dim is symbolic"])
def neg_poly_symbolic_head_dim():
    jax, jnp, export = jax_modules()
    b, t, d = export.symbolic_shape("b, t, d")
    x = jax.ShapeDtypeStruct((b, t, H, d), jnp.float32)
    return export_fn(lambda q, k, v: einsum_attention(jnp, q, k, v), x, x, x)
