"""What is not flash attention, or not one the kernels run: each must be rejected, for the reason
given.
"""

from .common import B, T, H, export_fn, jax_modules, qkv, softmax_attention, spec
from .registry import golden


@golden(rejected=["query axis"])
def neg_softmax_query_axis():
    _, jnp, _ = jax_modules()
    return softmax_attention(lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125, axis=-2)


@golden(rejected=["returned as output 1"])
def neg_probs_returned():
    jax, jnp, _ = jax_modules()

    def f(q, k, v):
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v), p
    return export_fn(f, *qkv())


@golden(rejected=["another user"])
def neg_entropy_term():
    jax, jnp, _ = jax_modules()

    def f(q, k, v):
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125)
        ent = -jnp.sum(p * jnp.log(p + 1e-9))
        return jnp.einsum("bhqk,bkhd->bqhd", p, v) + ent
    return export_fn(f, *qkv())


@golden(rejected=["dropout"])
def neg_dropout():
    jax, jnp, _ = jax_modules()

    def f(q, k, v, key):
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125)
        keep = jax.random.bernoulli(jax.random.wrap_key_data(key), 0.9, p.shape)
        p = jnp.where(keep, p / 0.9, 0.0)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return export_fn(f, *qkv(), spec((2,), "uint32"))


@golden(rejected=["sigmoid"])
def neg_sigmoid_attention():
    jax, jnp, _ = jax_modules()

    def f(q, k, v):
        p = jax.nn.sigmoid(jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return export_fn(f, *qkv())


@golden(rejected=["linear attention"])
def neg_linear_attention():
    jax, jnp, _ = jax_modules()

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        return jnp.einsum("bhqk,bkhd->bqhd", s, v)
    return export_fn(f, *qkv())


@golden(rejected=["softmax classifier"])
def neg_softmax_classifier():
    jax, jnp, _ = jax_modules()
    return export_fn(lambda x, w: jax.nn.softmax(x @ w), spec((B, 64)), spec((64, 10)))


@golden(rejected=["before the softcap"])
def neg_bias_before_softcap():
    _, jnp, _ = jax_modules()

    def scores(q, k, b):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125 + b
        return jnp.tanh(s / 5.0) * 5.0
    return softmax_attention(scores, spec((B, H, T, T)))


@golden(rejected=["depends on the scores"])
def neg_bias_from_scores():
    # a "bias" computed from the scores themselves cannot be passed in ahead of the kernel
    _, jnp, _ = jax_modules()

    def scores(q, k):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        return s + jnp.flip(s, -1) * 0.1
    return softmax_attention(scores)


@golden(rejected=["not a large negative number"])
def neg_mask_fill_zero():
    # a run-time mask whose fill (0) does not remove the key from the softmax
    _, jnp, _ = jax_modules()

    def scores(q, k, m):
        return jnp.where(m, jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125, 0.0)
    return softmax_attention(scores, spec((B, 1, T, T), "bool"))


@golden(rejected=["fill value is not a constant"])
def neg_runtime_fill():
    _, jnp, _ = jax_modules()

    def scores(q, k, m, fill):
        return jnp.where(m, jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125, fill)
    return softmax_attention(scores, spec((B, 1, T, T), "bool"), spec(()))


@golden(rejected=["masked"])
def neg_mask_after_softmax():
    # the mask applies to the probabilities (no renormalization): not attention masking
    jax, jnp, _ = jax_modules()

    def f(q, k, v, m):
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125)
        return jnp.einsum("bhqk,bkhd->bqhd", jnp.where(m, p, 0.0), v)
    return export_fn(f, *qkv(), spec((B, 1, T, T), "bool"))


@golden(rejected=["too small to absorb"])
def neg_const_mask_empty_row_small_fill():
    # the same mask added as a constant 0 / -1e5 bias: -1e5 + s rounds to no single value in
    # f32, so the first query's row is the softmax of its (rounded) scores, not a mean of V,
    # and no kernel mode reproduces it
    _, jnp, _ = jax_modules()

    def scores(q, k):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        return s + jnp.where(j < i, 0.0, -1e5)
    return softmax_attention(scores)
