"""Helpers shared by the sections: export through jax and torchax and the kernels' custom-call
target names (all sections); for the forward ones, the golden size, Q/K/V specs, hand-written
attention around a score function, a softmax by hand and flax's causal attention.
"""

B, T, H, D = 2, 8, 4, 32


def jax_modules():
    import jax
    import jax.numpy as jnp
    from jax import export
    return jax, jnp, export


def spec(shape, dtype="float32"):
    jax, jnp, _ = jax_modules()
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def export_fn(fn, *args):
    jax, _, export = jax_modules()
    return export.export(jax.jit(fn), platforms=["cpu"])(*args)


def qkv(dtype="float32", b=B, t=T, s=None, h=H, hkv=None, d=D, layout="BSHD"):
    s = t if s is None else s
    hkv = h if hkv is None else hkv
    if layout == "BSHD":
        return spec((b, t, h, d), dtype), spec((b, s, hkv, d), dtype), spec((b, s, hkv, d), dtype)
    return spec((b, h, t, d), dtype), spec((b, hkv, s, d), dtype), spec((b, hkv, s, d), dtype)


def softmax_manual(jnp, s, axis=-1):
    m = jnp.max(s, axis=axis, keepdims=True)
    e = jnp.exp(s - m)
    return e / jnp.sum(e, axis=axis, keepdims=True)


def softmax_attention(scores, *extra, inputs=None, axis=-1):
    """Export attention in [B, S, H, D] spelled by hand around ``scores(q, k, *extra)``, the
    logits [B, H, Sq, Sk]: jax.nn.softmax over ``axis`` (the keys' by default), then the einsum
    with V. ``extra``: the specs of scores' further arguments; ``inputs``: those of q, k, v
    (default qkv())."""
    jax, jnp, _ = jax_modules()

    def f(q, k, v, *e):
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores(q, k, *e), axis=axis), v)
    return export_fn(f, *(inputs or qkv()), *extra)


def kernel_target(direction, d, dt, causal):
    """The custom-call target of a flashgen kernel (direction: fwd or bwd)."""
    return f"flashgen_{direction}_d{d}_{dt}{'_causal' if causal else ''}"


def tname(d, dt, causal):
    return kernel_target("fwd", d, dt, causal)


def flax_causal_mha(x):
    """flax linen MultiHeadDotProductAttention with make_causal_mask, exported for the input
    ``x`` (a ShapeDtypeStruct; its dims may be symbolic)."""
    jax, jnp, _ = jax_modules()
    import flax.linen as nn

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
            return nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=H * D)(x, mask=mask)
    m = M()
    params = m.init(jax.random.key(0), jnp.ones((B, T, H * D)))
    return export_fn(m.apply, jax.tree.map(lambda a: spec(a.shape, a.dtype), params), x)


def torch_modules():
    """torch and torchax. torchax 0.0.13 names ATen overloads that torch 2.13 removed
    (named-tensor variants such as ``aten.prod.dim_Dimname``) in module-level tables, so it
    does not import as shipped: it is imported through ``flashgen.frontends.torchax_compat``
    (its module doc says what it does and why)."""
    import torch

    from flashgen.frontends.torchax_compat import import_torchax
    return torch, import_torchax()


def torch_export(module, *args):
    torch, torchax = torch_modules()
    ep = torch.export.export(module, tuple(args))
    _, exported = torchax.export.exported_program_to_stablehlo(ep)
    return exported
