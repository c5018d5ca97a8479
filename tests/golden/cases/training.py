"""Training graphs: gradients of small transformers (forward + backward attention), written to
tests/golden/train_cases.json; tests/test_rewrite_backward.py rewrites and runs them.
"""

from flashgen.bench_train import grad_step, jnn_attention

from .common import export_fn, spec, torch_modules
from .registry import training_golden
from .train_model import (
    B, T, H, D, LAYERS, attention_grad, scanned_step, target, torch_block, torch_grad, weights)


def attention_einsum(q, k, v, mask=None, causal=True):
    """Hand-written: scale as a divide by sqrt(d), -1e9 fill, softmax by hand."""
    import jax.numpy as jnp
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(q.shape[-1])).astype(q.dtype)
    if causal:
        i, j = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
        s = jnp.where(j <= i, s, -1e9)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - m)
    p = e / jnp.sum(e, axis=-1, keepdims=True)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def training_step(dtype="float32", *, attention=jnn_attention, hkv=H, remat=False,
                  padding=False):
    """Export grad(loss) over (weights, x) for a 2-layer model."""
    args = [weights(dtype, hkv), spec((B, T, H * D), dtype), spec((B, T, H * D))]
    if padding:
        args.append(spec((B, T), "bool"))
    return export_fn(grad_step(layers=LAYERS, heads=H, kv_heads=hkv, head_dim=D,
                               attention=attention, remat=remat, padding=padding), *args)


@training_golden(sites=2, fwd=[target("fwd")], bwd=[target("bwd")])
def train_jnn_f32():
    return training_step("float32")


@training_golden(sites=2, fwd=[target("fwd")], bwd=[target("bwd")])
def train_einsum_f32():
    return training_step("float32", attention=attention_einsum)


@training_golden(sites=2, fwd=[target("fwd", dt="bf16")], bwd=[target("bwd", dt="bf16")])
def train_jnn_bf16():
    return training_step("bfloat16")


@training_golden(sites=2, fwd=[target("fwd")], bwd=[target("bwd")])
def train_remat():
    # the forward runs twice: once plain (a forward-only site), once recomputed in the
    # backward region next to its VJP (a training site)
    return training_step("float32", remat=True)


@training_golden(sites=2, fwd=[target("fwd")], bwd=[target("bwd")], kv_heads=2)
def train_gqa():
    return training_step("float32", hkv=2)


@training_golden(sites=2, fwd=[target("fwd")], bwd=[target("bwd")])
def train_padding_mask():
    return training_step("float32", padding=True)


@training_golden(sites=1, fwd=[target("fwd", causal=False)], bwd=[target("bwd", causal=False)])
def train_scan_remat():
    return scanned_step(remat=True)


@training_golden(sites=2, fwd=[target("fwd")], bwd=[target("bwd")])
def train_torchax():
    torch, _ = torch_modules()
    return torch_grad(torch.nn.Sequential(*[torch_block() for _ in range(LAYERS)]))


@training_golden(sites=1, fwd=[target("fwd")], bwd=[target("bwd")])
def train_window():
    import jax
    return attention_grad(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=(4, 0)))


@training_golden(sites=1, fwd=[target("fwd", causal=False)], bwd=[target("bwd", causal=False)])
def train_softcap():
    # the backward reads tanh's output again (1 - t²): the scores have three users
    import jax
    import jax.numpy as jnp

    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(30.0 * jnp.tanh(s / 30.0)), v)
    return attention_grad(attention)


@training_golden(sites=1, fwd=[target("fwd", causal=False)], bwd=[target("bwd", causal=False)])
def train_alibi():
    import jax
    import jax.numpy as jnp

    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        s = s - (0.5 ** jnp.arange(1, H + 1))[:, None, None] * jnp.abs(i - j)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return attention_grad(attention)


@training_golden(sites=1, fwd=[target("fwd", causal=False)], bwd=[target("bwd", causal=False)])
def train_flax_nnx():
    import jax
    import jax.numpy as jnp
    from flax import nnx
    mha = nnx.MultiHeadAttention(num_heads=H, in_features=H * D, qkv_features=H * D,
                                 decode=False, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(mha)

    def loss(state, x):
        return jnp.mean(nnx.merge(graphdef, state)(x) ** 2)
    return export_fn(jax.grad(loss, argnums=(0, 1)),
                     jax.tree.map(lambda a: spec(a.shape, a.dtype), state), spec((B, T, H * D)))


@training_golden(rejected=["a residual kept for a backward elsewhere"])
def train_neg_scan_residual():
    # without remat, scan saves the probabilities of every layer as a loop output for the
    # backward loop: the O(S²) residual is the program's own choice, left alone
    return scanned_step(remat=False)


@training_golden(rejected=["passes through stablehlo.log"])
def train_neg_entropy():
    # an attention-entropy regularizer reads the probabilities: not an attention backward
    import jax
    import jax.numpy as jnp

    def loss(w, q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q @ w, k) * 0.125
        p = jax.nn.softmax(s)
        o = jnp.einsum("bhqk,bkhd->bqhd", p, v)
        return jnp.mean(o ** 2) - 0.1 * jnp.mean(jnp.sum(p * jnp.log(p + 1e-9), -1))
    return export_fn(jax.grad(loss), spec((D, D)), *[spec((B, T, H, D))] * 3)


# one value read as several of Q, K, V: its gradient is the sum of theirs, and each
# product of the backward is checked against its own role (moved alone where the forward
# reads it)
def self_attention_grad(attention, *, kv_only=False):
    """grad of sum(sin(attention(x, x, x))) over x (with ``kv_only``: attention(q, x, x)
    over q and x)."""
    import jax
    import jax.numpy as jnp

    def loss(*a):
        q, x = (a[0], a[1]) if kv_only else (a[0], a[0])
        return jnp.sum(jnp.sin(attention(q, x, x)))
    n = 2 if kv_only else 1
    return export_fn(jax.grad(loss, argnums=tuple(range(n))), *[spec((B, T, H, D))] * n)


@training_golden(sites=1, fwd=[target("fwd")], bwd=[target("bwd")])
def train_self_attention():
    import jax
    return self_attention_grad(lambda q, k, v: jax.nn.dot_product_attention(q, k, v,
                                                                           is_causal=True))


@training_golden(sites=1, fwd=[target("fwd", causal=False)], bwd=[target("bwd", causal=False)])
def train_shared_kv():
    # K and V are one value, Q another (the hand-written spelling scales Q)
    import jax
    import jax.numpy as jnp

    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q * 0.125, k)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return self_attention_grad(attention, kv_only=True)


@training_golden(sites=1, fwd=[target("fwd", causal=False)], bwd=[target("bwd", causal=False)])
def train_self_scores():
    # x·xᵀ: the product's two operands are one value; only the proof tells dQ from dK
    import jax
    import jax.numpy as jnp

    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return self_attention_grad(attention)
