"""Golden training graphs: gradients of small transformers (forward + backward attention).

    python tests/golden/generate_train.py [case ...]   # needs jax; the torch case torchax

Writes tests/golden/inputs/train_*.mlir and tests/golden/train_cases.json (what each
case must rewrite or reject, and why); FileCheck directives live in
tests/golden/checks/train_*.check. Each module is ``jax.grad`` of a mean-squared loss of
a 2-layer transformer (RMS norm, attention, MLP) with respect to every weight and the
input, exported for CPU; tests/test_rewrite_backward.py rewrites and runs them.
"""
from __future__ import annotations

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))   # flashgen from this checkout
from generate import _import_torchax, export_fn, spec, write_cases  # noqa: E402

from flashgen.bench_train import grad_step, jnn_attention, layer, weight_shapes  # noqa: E402

CASES: dict = {}
B, T, H, D, LAYERS = 2, 16, 4, 32, 2   # the golden size; bench_train runs S=2048


def case(name, *, sites=0, rejected=(), fwd=(), bwd=(), kv_heads=None):
    """``sites``: training sites rewritten as a forward/backward pair; ``fwd``/``bwd``: the
    custom-call targets expected; ``rejected``: substrings of expected rejection reasons."""
    def deco(fn):
        CASES[name] = dict(fn=fn, fmt="mlir", expect=dict(sites=sites, rejected=list(rejected),
                                              fwd=list(fwd), bwd=list(bwd), kv_heads=kv_heads))
        return fn
    return deco


def target(direction, d=D, dt="f32", causal=True):
    return f"flashgen_{direction}_d{d}_{dt}{'_causal' if causal else ''}"


# ----------------------------------------------------------------------------- the model
# the model is flashgen.bench_train's (the training-step benchmark measures the same one)
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


def weights(dtype, hkv=H, stacked=False):
    shapes = weight_shapes(H, hkv, D)
    if stacked:
        return {n: spec((LAYERS,) + s, dtype) for n, s in shapes.items()}
    return [{n: spec(s, dtype) for n, s in shapes.items()} for _ in range(LAYERS)]


def training_step(dtype="float32", *, attention=jnn_attention, hkv=H, remat=False,
                  padding=False):
    """Export grad(loss) over (weights, x) for a 2-layer model."""
    args = [weights(dtype, hkv), spec((B, T, H * D), dtype), spec((B, T, H * D))]
    if padding:
        args.append(spec((B, T), "bool"))
    return export_fn(grad_step(layers=LAYERS, heads=H, kv_heads=hkv, head_dim=D,
                               attention=attention, remat=remat, padding=padding), *args)


def scanned_step(*, remat: bool, bias_shape=None):
    """The layers as a lax.scan over stacked weights (remat: jax.checkpoint'ed body); with
    ``bias_shape`` every layer adds one learned bias, carried through the loop (its
    gradient accumulates in the backward loop's carry)."""
    import jax
    import jax.numpy as jnp

    def body(carry, w):
        # no mask: scan hoists the causal fill into a loop-carried value, which the
        # forward matcher does not fold yet (a separate gap); the loop is the point here
        x, b = carry
        return (layer(x, w, attention=jnn_attention if b is None else
                      lambda q, k, v, mask, causal: jax.nn.dot_product_attention(q, k, v, bias=b),
                      heads=H, kv_heads=H, head_dim=D, causal=False), b), None

    def loss(ws, *a):
        b, x, y = a if bias_shape else (None, *a)
        (x, _), _ = jax.lax.scan(jax.checkpoint(body) if remat else body, (x, b), ws)
        return jnp.mean((x - y) ** 2)

    bias = [spec(bias_shape)] if bias_shape else []
    return export_fn(jax.grad(loss, argnums=tuple(range(2 + len(bias)))),
                     weights("float32", stacked=True), *bias, spec((B, T, H * D)),
                     spec((B, T, H * D)))


# ----------------------------------------------------------------------------- cases
@case("train_jnn_f32", sites=2, fwd=[target("fwd")], bwd=[target("bwd")])
def _():
    return training_step("float32")


@case("train_einsum_f32", sites=2, fwd=[target("fwd")], bwd=[target("bwd")])
def _():
    return training_step("float32", attention=attention_einsum)


@case("train_jnn_bf16", sites=2, fwd=[target("fwd", dt="bf16")], bwd=[target("bwd", dt="bf16")])
def _():
    return training_step("bfloat16")


@case("train_remat", sites=2, fwd=[target("fwd")], bwd=[target("bwd")])
def _():
    # the forward runs twice: once plain (a forward-only site), once recomputed in the
    # backward region next to its VJP (a training site)
    return training_step("float32", remat=True)


@case("train_gqa", sites=2, fwd=[target("fwd")], bwd=[target("bwd")], kv_heads=2)
def _():
    return training_step("float32", hkv=2)


@case("train_padding_mask", sites=2, fwd=[target("fwd")], bwd=[target("bwd")])
def _():
    return training_step("float32", padding=True)


@case("train_scan_remat", sites=1, fwd=[target("fwd", causal=False)],
      bwd=[target("bwd", causal=False)])
def _():
    return scanned_step(remat=True)


def torch_block(*, learned_mask=False):
    """A torch attention block (fused QKV projection, scaled_dot_product_attention): causal,
    or with a learned float ``attn_mask`` [1, H, T, T] parameter."""
    torch, _ = _import_torchax()
    import torch.nn.functional as F

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(H * D, 3 * H * D, bias=False)
            self.o = torch.nn.Linear(H * D, H * D, bias=False)
            self.rel = torch.nn.Parameter(torch.zeros(1, H, T, T)) if learned_mask else None

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, H, D).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=self.rel,
                                               is_causal=not learned_mask)
            return x + self.o(a.transpose(1, 2).reshape(b, t, c))
    return Block()


def torch_grad(model):
    """grad over (parameters, x) of mean(model(x)²), the model traced by torchax."""
    _, torchax = _import_torchax()
    import jax
    import jax.numpy as jnp
    params, fn = torchax.extract_jax(model)

    def loss(p, x):  # loss.backward() as torchax runs it: jax.grad of the traced model
        return jnp.mean(fn(p, (x,)) ** 2)
    return export_fn(jax.grad(loss, argnums=(0, 1)),
                     jax.tree.map(lambda a: spec(a.shape, a.dtype), params),
                     spec((B, T, H * D)))


@case("train_torchax", sites=2, fwd=[target("fwd")], bwd=[target("bwd")])
def _():
    torch, _ = _import_torchax()
    return torch_grad(torch.nn.Sequential(*[torch_block() for _ in range(LAYERS)]))


def attention_grad(attention, *extra, argnums=(0, 1, 2)):
    """grad over (q, k, v) (or ``argnums``) of sum(sin(attention(q, k, v, *extra))): one
    site, any spelling."""
    import jax
    import jax.numpy as jnp

    def loss(q, k, v, *e):
        return jnp.sum(jnp.sin(attention(q, k, v, *e)))
    return export_fn(jax.grad(loss, argnums=argnums), *[spec((B, T, H, D))] * 3, *extra)


@case("train_window", sites=1, fwd=[target("fwd")], bwd=[target("bwd")])
def _():
    import jax
    return attention_grad(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=(4, 0)))


@case("train_softcap", sites=1, fwd=[target("fwd", causal=False)],
      bwd=[target("bwd", causal=False)])
def _():
    # the backward reads tanh's output again (1 - t²): the scores have three users
    import jax
    import jax.numpy as jnp

    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(30.0 * jnp.tanh(s / 30.0)), v)
    return attention_grad(attention)


@case("train_alibi", sites=1, fwd=[target("fwd", causal=False)],
      bwd=[target("bwd", causal=False)])
def _():
    import jax
    import jax.numpy as jnp

    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        s = s - (0.5 ** jnp.arange(1, H + 1))[:, None, None] * jnp.abs(i - j)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return attention_grad(attention)


@case("train_flax_nnx", sites=1, fwd=[target("fwd", causal=False)],
      bwd=[target("bwd", causal=False)])
def _():
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


@case("train_neg_scan_residual", rejected=["a residual kept for a backward elsewhere"])
def _():
    # without remat, scan saves the probabilities of every layer as a loop output for the
    # backward loop: the O(S²) residual is the program's own choice, left alone
    return scanned_step(remat=False)


@case("train_neg_entropy", rejected=["passes through stablehlo.log"])
def _():
    # an attention-entropy regularizer reads the probabilities: not an attention backward
    import jax
    import jax.numpy as jnp

    def loss(w, q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q @ w, k) * 0.125
        p = jax.nn.softmax(s)
        o = jnp.einsum("bhqk,bkhd->bqhd", p, v)
        return jnp.mean(o ** 2) - 0.1 * jnp.mean(jnp.sum(p * jnp.log(p + 1e-9), -1))
    return export_fn(jax.grad(loss), spec((D, D)), *[spec((B, T, H, D))] * 3)


# ----------------------------------------------------------------------------- learned biases
# the bias is differentiated: the backward call returns dbias, mapped back onto the bias's
# source (summed over the dims the forward broadcast it along)
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


@case("train_bias_param", sites=2, fwd=[target("fwd")], bwd=[target("bwd")])
def _():
    return biased_step((1, H, T, T))


@case("train_bias_remat", sites=2, fwd=[target("fwd")], bwd=[target("bwd")])
def _():
    return biased_step((1, H, T, T), remat=True)


@case("train_bias_padding", sites=2, fwd=[target("fwd")], bwd=[target("bwd")])
def _():
    # with a key padding mask (rows that see no key: the finite fill's mean of V and its
    # gradient, none for the bias: the mask replaces those scores)
    return biased_step((1, H, T, T), padding=True)


@case("train_bias_scan_remat", sites=1, fwd=[target("fwd", causal=False)],
      bwd=[target("bwd", causal=False)])
def _():
    return scanned_step(remat=True, bias_shape=(1, H, T, T))


@case("train_bias_bf16", sites=2, fwd=[target("fwd", dt="bf16")], bwd=[target("bwd", dt="bf16")])
def _():
    return biased_step((1, H, T, T), "bfloat16")


@case("train_bias_t5", sites=2, fwd=[target("fwd")], bwd=[target("bwd")])
def _():
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


@case("train_bias_batch", sites=1, fwd=[target("fwd", causal=False)],
      bwd=[target("bwd", causal=False)])
def _():
    # a per-example [B, H, T, T] bias, differentiated as an input
    return attention_grad(einsum_biased, spec((B, H, T, T)), argnums=(0, 1, 2, 3))


@case("train_bias_key", sites=1, fwd=[target("fwd", causal=False)],
      bwd=[target("bwd", causal=False)])
def _():
    # a learned [H, 1, T] key bias, broadcast over the batch and the queries
    return attention_grad(einsum_biased, spec((H, 1, T)), argnums=(0, 1, 2, 3))


@case("train_bias_two", sites=1, fwd=[target("fwd", causal=False)],
      bwd=[target("bwd", causal=False)])
def _():
    # two learned biases, [1, H, T, T] and a per-example [B, T, T] one added twice over: one
    # [B, H, T, T] operand; each gradient is dbias summed over what the other added
    import jax
    import jax.numpy as jnp

    def attention(q, k, v, b1, b2):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125 + b1 + 2.0 * b2[:, None]
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return attention_grad(attention, spec((1, H, T, T)), spec((B, T, T)),
                          argnums=(0, 1, 2, 3, 4))


@case("train_bias_torchax", sites=1, fwd=[target("fwd", causal=False)],
      bwd=[target("bwd", causal=False)])
def _():
    # a learned float attn_mask of torch's scaled_dot_product_attention (a torch Parameter)
    return torch_grad(torch_block(learned_mask=True))


@case("train_bias_undifferentiated", sites=1, fwd=[target("fwd", causal=False)],
      bwd=[target("bwd", causal=False)])
def _():
    # a run-time bias that is an input but not differentiated: no dbias
    return attention_grad(einsum_biased, spec((1, H, T, T)))


@case("train_neg_bias_softcap", rejected=["additive bias before the softcap's tanh"])
def _():
    # the learned bias inside the softcap: the kernel caps the scores before adding its bias
    import jax
    import jax.numpy as jnp

    def attention(q, k, v, bias):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(30.0 * jnp.tanh((s + bias) / 30.0)), v)
    return attention_grad(attention, spec((1, H, T, T)), argnums=(0, 1, 2, 3))


@case("train_neg_bias_of_scores", rejected=["the bias or mask depends on the scores"])
def _():
    # a "bias" computed from the scores themselves is no bias operand
    import jax
    import jax.numpy as jnp

    def attention(q, k, v, w):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s + w * jnp.sin(s)), v)
    return attention_grad(attention, spec((1, H, 1, 1)), argnums=(0, 1, 2, 3))


# ----------------------------------------------------------------------------- shared inputs
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


@case("train_self_attention", sites=1, fwd=[target("fwd")], bwd=[target("bwd")])
def _():
    import jax
    return self_attention_grad(lambda q, k, v: jax.nn.dot_product_attention(q, k, v,
                                                                           is_causal=True))


@case("train_shared_kv", sites=1, fwd=[target("fwd", causal=False)],
      bwd=[target("bwd", causal=False)])
def _():
    # K and V are one value, Q another (the hand-written spelling scales Q)
    import jax
    import jax.numpy as jnp

    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q * 0.125, k)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return self_attention_grad(attention, kv_only=True)


@case("train_self_scores", sites=1, fwd=[target("fwd", causal=False)],
      bwd=[target("bwd", causal=False)])
def _():
    # x·xᵀ: the product's two operands are one value; only the proof tells dQ from dK
    import jax
    import jax.numpy as jnp

    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return self_attention_grad(attention)


# ----------------------------------------------------------------------------- writing
def default_checks(expect: dict) -> str:
    lines = ["// CHECK-LABEL: func.func public @main"]
    if expect["sites"]:
        # the backward call reads the forward call's o and lse
        lines += [f"// CHECK: {{{{%[0-9]+}}}}:2 = stablehlo.custom_call @{expect['fwd'][-1]}(",
                  f"// CHECK: stablehlo.custom_call @{expect['bwd'][0]}("
                  "{{[^)]*}}#0, %{{[0-9]+}}#1, ",
                  "// CHECK-NOT: stablehlo.exponential"]
    else:
        lines.append("// CHECK-NOT: @flashgen_bwd")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    return write_cases(CASES, HERE / "train_cases.json", default_checks, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
