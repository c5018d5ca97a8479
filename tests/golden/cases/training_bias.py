"""Training graphs with learned biases. The bias is differentiated: the backward call returns
dbias, mapped back onto the bias's source (summed over the dims the forward broadcast it
along).
"""

from flashgen.bench_train import layer

from .common import export_fn, spec
from .registry import training_golden
from .train_model import (
    B, T, H, D, attention_grad, scanned_step, target, torch_block, torch_grad, weights)


def biased_step(bias_shape, dtype="float32", *, remat=False, bias_of=None, padding=False):
    """grad over (weights, bias params, x) of the 2-layer model, both layers adding the same
    learned bias (each layer's dbias is summed into one gradient); ``bias_of(param)`` makes
    the [.., H, T, T] bias from the parameter (default: the parameter itself); with
    ``padding`` the loss takes a [B, T] key mask as its last argument."""
    import jax
    import jax.numpy as jnp

    def loss(ws, b, x, y, *pad):
        bias = bias_of(b) if bias_of else b
        mask = pad[0][:, None, None, :] if padding else None
        for w in ws:
            def one(x_, w_, bias_):
                return layer(x_, w_, heads=H, kv_heads=H, head_dim=D, causal=True, mask=mask,
                             attention=lambda q, k, v, m, causal: jax.nn.dot_product_attention(
                                 q, k, v, bias=bias_.astype(q.dtype), mask=m,
                                 is_causal=causal))
            x = (jax.checkpoint(one) if remat else one)(x, w, bias)
        return jnp.mean((x.astype(jnp.float32) - y) ** 2)
    return export_fn(jax.grad(loss, argnums=(0, 1, 2)), weights(dtype), spec(bias_shape),
                     spec((B, T, H * D), dtype), spec((B, T, H * D)),
                     *([spec((B, T), "bool")] if padding else []))


@training_golden(sites=2, fwd=[target("fwd")], bwd=[target("bwd")])
def train_bias_param():
    return biased_step((1, H, T, T))


@training_golden(sites=2, fwd=[target("fwd")], bwd=[target("bwd")])
def train_bias_remat():
    return biased_step((1, H, T, T), remat=True)


@training_golden(sites=2, fwd=[target("fwd")], bwd=[target("bwd")])
def train_bias_padding():
    # with a key padding mask (rows that see no key: the finite fill's mean of V and its
    # gradient, none for the bias: the mask replaces those scores)
    return biased_step((1, H, T, T), padding=True)


@training_golden(sites=1, fwd=[target("fwd", causal=False)], bwd=[target("bwd", causal=False)])
def train_bias_scan_remat():
    return scanned_step(remat=True, bias_shape=(1, H, T, T))


@training_golden(sites=2, fwd=[target("fwd", dt="bf16")], bwd=[target("bwd", dt="bf16")])
def train_bias_bf16():
    return biased_step((1, H, T, T), "bfloat16")


@training_golden(sites=2, fwd=[target("fwd")], bwd=[target("bwd")])
def train_bias_t5():
    # T5's relative position bias: a learned [buckets, H] table gathered by a constant
    # bucket of j - i; its gradient is dbias scattered back into the table
    import jax.numpy as jnp
    rel = jnp.arange(T)[None, :] - jnp.arange(T)[:, None]
    buckets = jnp.clip(rel, -4, 4) + 4
    return biased_step((9, H), bias_of=lambda table: jnp.transpose(table[buckets], (2, 0, 1))[None])


def einsum_biased(q, k, v, bias):
    """Hand-written attention adding a run-time bias (subtracting one of rank 3: a key bias)."""
    import jax
    import jax.numpy as jnp
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
    s = s - bias[None] if bias.ndim == 3 else s + bias
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


@training_golden(sites=1, fwd=[target("fwd", causal=False)], bwd=[target("bwd", causal=False)])
def train_bias_batch():
    # a per-example [B, H, T, T] bias, differentiated as an input
    return attention_grad(einsum_biased, spec((B, H, T, T)), argnums=(0, 1, 2, 3))


@training_golden(sites=1, fwd=[target("fwd", causal=False)], bwd=[target("bwd", causal=False)])
def train_bias_key():
    # a learned [H, 1, T] key bias, broadcast over the batch and the queries
    return attention_grad(einsum_biased, spec((H, 1, T)), argnums=(0, 1, 2, 3))


@training_golden(sites=1, fwd=[target("fwd", causal=False)], bwd=[target("bwd", causal=False)])
def train_bias_two():
    # two learned biases, [1, H, T, T] and a per-example [B, T, T] one added twice over: one
    # [B, H, T, T] operand; each gradient is dbias summed over what the other added
    import jax
    import jax.numpy as jnp

    def attention(q, k, v, b1, b2):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125 + b1 + 2.0 * b2[:, None]
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return attention_grad(attention, spec((1, H, T, T)), spec((B, T, T)),
                          argnums=(0, 1, 2, 3, 4))


@training_golden(sites=1, fwd=[target("fwd", causal=False)], bwd=[target("bwd", causal=False)])
def train_bias_torchax():
    # a learned float attn_mask of torch's scaled_dot_product_attention (a torch Parameter)
    return torch_grad(torch_block(learned_mask=True))


@training_golden(sites=1, fwd=[target("fwd", causal=False)], bwd=[target("bwd", causal=False)])
def train_bias_undifferentiated():
    # a run-time bias that is an input but not differentiated: no dbias
    return attention_grad(einsum_biased, spec((1, H, T, T)))


@training_golden(rejected=["additive bias before the softcap's tanh"])
def train_neg_bias_softcap():
    # the learned bias inside the softcap: the kernel caps the scores before adding its bias
    import jax
    import jax.numpy as jnp

    def attention(q, k, v, bias):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(30.0 * jnp.tanh((s + bias) / 30.0)), v)
    return attention_grad(attention, spec((1, H, T, T)), argnums=(0, 1, 2, 3))


@training_golden(rejected=["the bias or mask depends on the scores"])
def train_neg_bias_of_scores():
    # a "bias" computed from the scores themselves is no bias operand
    import jax
    import jax.numpy as jnp

    def attention(q, k, v, w):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s + w * jnp.sin(s)), v)
    return attention_grad(attention, spec((1, H, 1, 1)), argnums=(0, 1, 2, 3))
