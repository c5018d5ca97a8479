"""A scale known only at run time: multiplied into Q before the call, or refused."""

from .common import B, T, H, export_fn, jax_modules, qkv, softmax_attention, spec, tname
from .registry import golden


@golden(rewritten=1, targets=[tname(32, "f32", False)], scale=1.0)
def runtime_scale():
    # a scale argument: multiplied into Q before the call, the kernel's scale is 1
    _, jnp, _ = jax_modules()

    def scores(q, k, scale):
        return jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    return softmax_attention(scores, spec(()))


@golden(rewritten=1, targets=[tname(32, "bf16", True)], causal=True, scale=0.5)
def runtime_scale_divide_bf16():
    # a constant and a run-time divisor; bf16 inputs: the division runs in f32
    jax, jnp, _ = jax_modules()

    def f(q, k, v, temp):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.5 / temp
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        s = jnp.where(j <= i, s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s.astype(jnp.float32)).astype(q.dtype), v)
    return export_fn(f, *qkv("bfloat16"), spec((1,)))


@golden(rejected=["run time after a mask"])
def neg_runtime_scale_after_mask():
    # a negative run-time scale would turn the fill into +large: refused
    _, jnp, _ = jax_modules()

    def scores(q, k, m, scale):
        return jnp.where(m, jnp.einsum("bqhd,bkhd->bhqk", q, k), -1e9) * scale
    return softmax_attention(scores, spec((B, 1, T, T), "bool"), spec(()))


@golden(rejected=["not a scalar"])
def neg_runtime_scale_tensor():
    _, jnp, _ = jax_modules()

    def scores(q, k, scale):
        return jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    return softmax_attention(scores, spec((B, H, T, T)))


@golden(rejected=["run time"])
def neg_bias_runtime_scale():
    _, jnp, _ = jax_modules()

    def scores(q, k, b, scale):
        return (jnp.einsum("bqhd,bkhd->bhqk", q, k) + b) * scale
    return softmax_attention(scores, spec((B, H, T, T)), spec(()))
