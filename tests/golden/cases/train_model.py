"""The training goldens' model and shapes, shared by the training sections: gradients of a
2-layer transformer (RMS norm, attention, MLP), exported for CPU. The model is
flashgen.bench_train's (the training-step benchmark measures the same one).
"""

from flashgen.bench_train import jnn_attention, layer, weight_shapes

from .common import export_fn, kernel_target, spec, torch_modules


B, T, H, D, LAYERS = 2, 16, 4, 32, 2   # the golden size; bench_train runs S=2048


def target(direction, d=D, dt="f32", causal=True):
    return kernel_target(direction, d, dt, causal)


def weights(dtype, hkv=H, stacked=False):
    shapes = weight_shapes(H, hkv, D)
    if stacked:
        return {n: spec((LAYERS,) + s, dtype) for n, s in shapes.items()}
    return [{n: spec(s, dtype) for n, s in shapes.items()} for _ in range(LAYERS)]


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


def torch_block(*, learned_mask=False):
    """A torch attention block (fused QKV projection, scaled_dot_product_attention): causal,
    or with a learned float ``attn_mask`` [1, H, T, T] parameter."""
    torch, _ = torch_modules()
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
    _, torchax = torch_modules()
    import jax
    import jax.numpy as jnp
    params, fn = torchax.extract_jax(model)

    def loss(p, x):  # loss.backward() as torchax runs it: jax.grad of the traced model
        return jnp.mean(fn(p, (x,)) ** 2)
    return export_fn(jax.grad(loss, argnums=(0, 1)),
                     jax.tree.map(lambda a: spec(a.shape, a.dtype), params),
                     spec((B, T, H * D)))


def attention_grad(attention, *extra, argnums=(0, 1, 2)):
    """grad over (q, k, v) (or ``argnums``) of sum(sin(attention(q, k, v, *extra))): one
    site, any spelling."""
    import jax
    import jax.numpy as jnp

    def loss(q, k, v, *e):
        return jnp.sum(jnp.sin(attention(q, k, v, *e)))
    return export_fn(jax.grad(loss, argnums=argnums), *[spec((B, T, H, D))] * 3, *extra)
