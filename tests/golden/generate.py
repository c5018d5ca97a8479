"""Produce the golden rewrite inputs from the real frontends.

    python tests/golden/generate.py            # needs jax, flax, torch 2.13.0 (CPU), torchax

Writes tests/golden/inputs/<case>.<fmt> and tests/golden/cases.json (what each case
must rewrite or reject, and why). The outputs are committed so that CI needs
neither torch nor flax. FileCheck directives live in tests/golden/checks/<case>.check
(written here for new cases; edit by hand if a case needs more specific checks).

torchax 0.0.13 names ATen overloads that torch 2.13 removed (named-tensor
variants such as ``aten.prod.dim_Dimname``) in module-level tables, so it
does not import as shipped; torchax is imported through
``flashgen.frontends.torchax_compat`` (its module doc says what it does and why).
"""
from __future__ import annotations

import json
import math
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
INPUTS = HERE / "inputs"
CHECKS = HERE / "checks"

CASES: dict = {}

B, T, H, D = 2, 8, 4, 32


def case(name, *, fmt="mlir", rewritten=0, rejected=(), targets=(), causal=None,
         bottom_right=None, scale=None, kv_heads=None, layout=None, numerics=True, window=None,
         softcap=None, extras=None):
    """Register a builder; ``rejected`` lists substrings of the expected reasons. ``window``,
    ``softcap`` and ``extras`` (the extra operands' names, when given) are checked on every
    rewritten site."""
    def deco(fn):
        extra = {k: v for k, v in (("window", window), ("softcap", softcap), ("extras", extras))
                 if v is not None}
        CASES[name] = dict(fn=fn, fmt=fmt, expect=dict(
            rewritten=rewritten, rejected=list(rejected), targets=list(targets),
            causal=causal, bottom_right=bottom_right, scale=scale, kv_heads=kv_heads,
            layout=layout, numerics=numerics and rewritten > 0, **extra))
        return fn
    return deco


# ----------------------------------------------------------------------------- helpers
def _jax():
    import jax
    import jax.numpy as jnp
    from jax import export
    return jax, jnp, export


def spec(shape, dtype="float32"):
    jax, jnp, _ = _jax()
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def export_fn(fn, *args):
    jax, _, export = _jax()
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


def tname(d, dt, causal):
    return f"flashgen_fwd_d{d}_{dt}{'_causal' if causal else ''}"


# ----------------------------------------------------------------------------- jax.nn
@case("jnn_f32", rewritten=1, targets=[tname(32, "f32", False)], causal=False,
      scale=1 / math.sqrt(32), layout="BSHD")
def _():
    jax, _, _ = _jax()
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v), *qkv())


@case("jnn_causal_bf16", rewritten=1, targets=[tname(32, "bf16", True)], causal=True)
def _():
    jax, _, _ = _jax()
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                     *qkv("bfloat16"))


@case("jnn_gqa_causal", rewritten=1, targets=[tname(32, "f32", True)], causal=True, kv_heads=2)
def _():
    jax, _, _ = _jax()
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                     *qkv(hkv=2))


@case("jnn_gqa_bf16", rewritten=1, targets=[tname(32, "bf16", False)], kv_heads=1)
def _():
    jax, _, _ = _jax()
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v),
                     *qkv("bfloat16", hkv=1))


@case("jnn_scale_cross", rewritten=1, targets=[tname(32, "f32", False)], scale=0.5)
def _():
    jax, _, _ = _jax()
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=0.5),
                     *qkv(s=16))


@case("einsum_f16_d64", rewritten=1, targets=[tname(64, "f16", False)])
def _():
    jax, jnp, _ = _jax()

    def f(q, k, v):  # jax.nn.dot_product_attention has no f16 lowering on CPU
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * 0.125
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s).astype(jnp.float16), v)
    return export_fn(f, *qkv("float16", d=64))


@case("jnn_decode_step", rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def _():
    jax, _, _ = _jax()
    q, k, v = qkv(t=1, s=8)  # one query row against 8 keys: the causal mask is j <= 0
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                     q, k, v)


@case("jnn_f32_portable", fmt="mlirbc", rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def _():
    jax, _, _ = _jax()
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), *qkv())


@case("jnn_causal_exported", fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", True)],
      causal=True)
def _():
    jax, _, _ = _jax()
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), *qkv())


# ----------------------------------------------------------------------------- hand-written
@case("einsum_bshd", rewritten=1, targets=[tname(32, "f32", False)], scale=0.125, layout="BSHD")
def _():
    jax, jnp, _ = _jax()

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
    return export_fn(f, *qkv())


@case("einsum_bhsd_sqrt", rewritten=1, targets=[tname(64, "f32", False)], scale=1 / 8,
      layout="BHSD")
def _():
    jax, jnp, _ = _jax()

    def f(q, k, v):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
        return jnp.einsum("bhqk,bhkd->bhqd", softmax_manual(jnp, s), v)
    return export_fn(f, *qkv(d=64, layout="BHSD"))


@case("matmul_causal_where", rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def _():
    jax, jnp, _ = _jax()

    def f(q, k, v):
        s = q @ jnp.swapaxes(k, -1, -2) * (1 / math.sqrt(32))
        n = s.shape[-1]
        mask = jnp.tril(jnp.ones((n, n), bool))
        s = jnp.where(mask, s, -1e9)
        return softmax_manual(jnp, s) @ v
    return export_fn(f, *qkv(layout="BHSD"))


@case("matmul_scale_in_q", rewritten=1, targets=[tname(32, "f32", False)], scale=0.2)
def _():
    jax, jnp, _ = _jax()

    def f(q, k, v):
        s = (q * 0.2) @ jnp.swapaxes(k, -1, -2)
        return jax.nn.softmax(s) @ v
    return export_fn(f, *qkv(layout="BHSD"))


@case("einsum_bf16_softmax", rewritten=1, targets=[tname(32, "bf16", True)], causal=True)
def _():
    jax, jnp, _ = _jax()

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.bfloat16(1 / math.sqrt(32))
        t = s.shape[-1]
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.finfo(jnp.bfloat16).min)
        m = jnp.max(s, axis=-1, keepdims=True)
        e = jnp.exp(s - m)
        den = jnp.sum(e.astype(jnp.float32), axis=-1, keepdims=True).astype(jnp.bfloat16)
        return jnp.einsum("bhqk,bkhd->bqhd", e / den, v)
    return export_fn(f, *qkv("bfloat16"))


@case("einsum_dense_mask", rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def _():
    jax, jnp, _ = _jax()
    mask = np.tril(np.ones((T, T), bool))

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(32)
        s = jnp.where(mask, s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv())


@case("einsum_additive_bias", rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def _():
    jax, jnp, _ = _jax()
    bias = np.where(np.tril(np.ones((T, T), bool)), 0.0, -np.inf).astype(np.float32)

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25 + bias
        return jnp.einsum("bhqk,bkhd->bqhd", softmax_manual(jnp, s), v)
    return export_fn(f, *qkv())


@case("einsum_keys_first", rewritten=1, targets=[tname(32, "f32", False)])
def _():
    jax, jnp, _ = _jax()

    def f(q, k, v):  # scores laid out [b, h, keys, queries]; softmax over axis -2
        s = jnp.einsum("bkhd,bqhd->bhkq", k, q) * 0.125
        p = jax.nn.softmax(s, axis=-2)
        return jnp.einsum("bhkq,bkhd->bqhd", p, v)
    return export_fn(f, *qkv())


@case("einsum_v_left", rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def _():
    jax, jnp, _ = _jax()

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        t = s.shape[-1]
        s = jnp.where(jnp.arange(t)[None, :] <= jnp.arange(t)[:, None], s, -1e30)
        return jnp.einsum("bkhd,bhqk->bhdq", v, jax.nn.softmax(s)).transpose(0, 3, 1, 2)
    return export_fn(f, *qkv())


@case("bottom_right_causal", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
      bottom_right=True)
def _():
    jax, jnp, _ = _jax()

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        sq, sk = s.shape[-2:]
        visible = jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + (sk - sq)
        s = jnp.where(visible, s, -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv(t=4, s=8))


@case("heads_folded", rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def _():
    jax, jnp, _ = _jax()

    def f(q, k, v):  # [B*H, S, D]
        s = jnp.matmul(q, jnp.swapaxes(k, 1, 2)) * 0.125
        t = s.shape[-1]
        s = s + jnp.where(jnp.tril(jnp.ones((t, t), bool)), 0.0, -jnp.inf)
        return jnp.matmul(jax.nn.softmax(s, axis=-1), v)
    x = spec((B * H, T, D))
    return export_fn(f, x, x, x)


@case("two_sites_shared_q", rewritten=2, targets=[tname(32, "f32", False), tname(32, "f32", True)])
def _():
    jax, _, _ = _jax()

    def f(q, k, v, k2, v2):
        a = jax.nn.dot_product_attention(q, k, v)
        b = jax.nn.dot_product_attention(q, k2, v2, is_causal=True)
        return a + b, a
    q, k, v = qkv()
    return export_fn(f, q, k, v, k, v)


@case("transformer_2layer", rewritten=2, targets=[tname(32, "f32", True)], causal=True)
def _():
    jax, jnp, _ = _jax()
    C = H * D

    def layer(x, w):
        h = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
        q = (h @ w["q"]).reshape(B, T, H, D)
        k = (h @ w["k"]).reshape(B, T, H, D)
        v = (h @ w["v"]).reshape(B, T, H, D)
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(B, T, C)
        x = x + a @ w["o"]
        return x + jax.nn.gelu(x @ w["up"]) @ w["down"]

    def f(x, ws):
        for w in ws:
            x = layer(x, w)
        return x
    w = {n: spec((C, C)) for n in ("q", "k", "v", "o")} | {"up": spec((C, 2 * C)),
                                                          "down": spec((2 * C, C))}
    return export_fn(f, spec((B, T, C)), [w, w])


@case("scan_layers", rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def _():
    jax, jnp, _ = _jax()
    C = H * D

    def f(x, wq, wk, wv):
        def body(x, w):
            q = (x @ w[0]).reshape(B, T, H, D)
            k = (x @ w[1]).reshape(B, T, H, D)
            v = (x @ w[2]).reshape(B, T, H, D)
            return x + jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(B, T, C), None
        return jax.lax.scan(body, x, jnp.stack([wq, wk, wv], 1))[0]
    return export_fn(f, spec((B, T, C)), spec((3, C, C)), spec((3, C, C)), spec((3, C, C)))


# ----------------------------------------------------------------------------- flax
def flax_causal_mha(x):
    """flax linen MultiHeadDotProductAttention with make_causal_mask, exported for the input
    ``x`` (a ShapeDtypeStruct; its dims may be symbolic)."""
    jax, jnp, _ = _jax()
    import flax.linen as nn

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
            return nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=H * D)(x, mask=mask)
    m = M()
    params = m.init(jax.random.key(0), jnp.ones((B, T, H * D)))
    return export_fn(m.apply, jax.tree.map(lambda a: spec(a.shape, a.dtype), params), x)


@case("flax_linen_causal", rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def _():
    return flax_causal_mha(spec((B, T, H * D)))


@case("flax_linen_bf16", rewritten=1, targets=[tname(32, "bf16", False)])
def _():
    jax, jnp, _ = _jax()
    import flax.linen as nn
    m = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=H * D, dtype=jnp.bfloat16)
    x = jnp.ones((B, T, H * D), jnp.bfloat16)
    params = m.init(jax.random.key(0), x)
    return export_fn(m.apply, jax.tree.map(lambda a: spec(a.shape, a.dtype), params),
                     spec((B, T, H * D), "bfloat16"))


@case("flax_nnx_causal", rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def _():
    jax, jnp, _ = _jax()
    from flax import nnx
    m = nnx.MultiHeadAttention(num_heads=H, in_features=H * D, qkv_features=H * D, decode=False,
                               rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(m)
    mask = nnx.make_causal_mask(jnp.ones((B, T)))  # a closed-over constant: a dense mask

    def f(state, x):
        return nnx.merge(graphdef, state)(x, mask=mask)
    return export_fn(f, jax.tree.map(lambda a: spec(a.shape, a.dtype), state),
                     spec((B, T, H * D)))


# ----------------------------------------------------------------------------- torch
def _import_torchax():
    import torch

    if str(HERE.parents[1]) not in sys.path:  # run as a script from a checkout
        sys.path.insert(0, str(HERE.parents[1]))
    from flashgen.frontends.torchax_compat import import_torchax
    return torch, import_torchax()


def torch_export(module, *args):
    torch, torchax = _import_torchax()
    ep = torch.export.export(module, tuple(args))
    _, exported = torchax.export.exported_program_to_stablehlo(ep)
    return exported


def _torch_qkv(dtype=None, hkv=H, d=D, t=T):
    import torch
    g = torch.Generator().manual_seed(0)
    dtype = dtype or torch.float32
    return (torch.randn(B, H, t, d, generator=g, dtype=dtype),
            torch.randn(B, hkv, t, d, generator=g, dtype=dtype),
            torch.randn(B, hkv, t, d, generator=g, dtype=dtype))


@case("torch_sdpa_causal", rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def _():
    import torch
    import torch.nn.functional as F

    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return torch_export(M(), *_torch_qkv())


@case("torch_sdpa_scale", rewritten=1, targets=[tname(32, "f32", False)], scale=0.3)
def _():
    import torch
    import torch.nn.functional as F

    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, scale=0.3)
    return torch_export(M(), *_torch_qkv())


@case("torch_sdpa_gqa", rewritten=1, targets=[tname(32, "f32", True)], causal=True, kv_heads=2)
def _():
    import torch
    import torch.nn.functional as F

    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return torch_export(M(), *_torch_qkv(hkv=2))


@case("torch_sdpa_bf16", rewritten=1, targets=[tname(32, "bf16", False)])
def _():
    import torch
    import torch.nn.functional as F

    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)
    return torch_export(M(), *_torch_qkv(torch.bfloat16))


@case("torch_mha", rewritten=1, targets=[tname(32, "f32", False)])
def _():
    import torch
    torch.manual_seed(0)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = torch.nn.MultiheadAttention(H * D, H, batch_first=True)

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]
    return torch_export(M().eval(), torch.randn(B, T, H * D))


@case("torch_mha_causal", rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def _():
    import torch
    torch.manual_seed(0)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = torch.nn.MultiheadAttention(H * D, H, batch_first=True)

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False, is_causal=True,
                            attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(T))[0]
    return torch_export(M().eval(), torch.randn(B, T, H * D))


# ----------------------------------------------------------------------------- EXLA-style
# Hand-written the way EXLA (Elixir Nx) emits modules: a public @main, sub-computations
# outlined into private functions reached by func.call, reducers as regions, and the
# native api_version = 4 custom-call form. The second module also carries an unrelated
# native custom call that the rewrite must leave exactly as it is.
EXLA_ATTENTION = """\
module @EXLA.attention {
  func.func public @main(%arg0: tensor<2x4x8x32xf32>, %arg1: tensor<2x4x8x32xf32>, %arg2: tensor<2x4x8x32xf32>, %arg3: tensor<2x4x8x32xf32>) -> (tensor<2x4x8x32xf32>, tensor<2x4x8x32xf32>) {
    %0 = func.call @attention_11(%arg0, %arg1, %arg2) : (tensor<2x4x8x32xf32>, tensor<2x4x8x32xf32>, tensor<2x4x8x32xf32>) -> tensor<2x4x8x32xf32>
    %1 = func.call @attention_11(%arg3, %arg1, %arg2) : (tensor<2x4x8x32xf32>, tensor<2x4x8x32xf32>, tensor<2x4x8x32xf32>) -> tensor<2x4x8x32xf32>
    return %0, %1 : tensor<2x4x8x32xf32>, tensor<2x4x8x32xf32>
  }
  func.func private @causal_mask_7() -> tensor<8x8xi1> {
    %0 = stablehlo.iota dim = 0 : tensor<8x8xi64>
    %1 = stablehlo.iota dim = 1 : tensor<8x8xi64>
    %2 = stablehlo.compare  GE, %0, %1,  SIGNED : (tensor<8x8xi64>, tensor<8x8xi64>) -> tensor<8x8xi1>
    return %2 : tensor<8x8xi1>
  }
  func.func private @softmax_9(%arg0: tensor<2x4x8x8xf32>) -> tensor<2x4x8x8xf32> {
    %cst = stablehlo.constant dense<0xFF800000> : tensor<f32>
    %0 = stablehlo.reduce(%arg0 init: %cst) across dimensions = [3] : (tensor<2x4x8x8xf32>, tensor<f32>) -> tensor<2x4x8xf32>
     reducer(%a: tensor<f32>, %b: tensor<f32>)  {
      %m = stablehlo.maximum %a, %b : tensor<f32>
      stablehlo.return %m : tensor<f32>
    }
    %1 = stablehlo.reshape %0 : (tensor<2x4x8xf32>) -> tensor<2x4x8x1xf32>
    %2 = stablehlo.broadcast_in_dim %1, dims = [0, 1, 2, 3] : (tensor<2x4x8x1xf32>) -> tensor<2x4x8x8xf32>
    %3 = stablehlo.subtract %arg0, %2 : tensor<2x4x8x8xf32>
    %4 = stablehlo.exponential %3 : tensor<2x4x8x8xf32>
    %cst_0 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %5 = stablehlo.reduce(%4 init: %cst_0) across dimensions = [3] : (tensor<2x4x8x8xf32>, tensor<f32>) -> tensor<2x4x8xf32>
     reducer(%a: tensor<f32>, %b: tensor<f32>)  {
      %s = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }
    %6 = stablehlo.reshape %5 : (tensor<2x4x8xf32>) -> tensor<2x4x8x1xf32>
    %7 = stablehlo.broadcast_in_dim %6, dims = [0, 1, 2, 3] : (tensor<2x4x8x1xf32>) -> tensor<2x4x8x8xf32>
    %8 = stablehlo.divide %4, %7 : tensor<2x4x8x8xf32>
    return %8 : tensor<2x4x8x8xf32>
  }
  func.func private @attention_11(%arg0: tensor<2x4x8x32xf32>, %arg1: tensor<2x4x8x32xf32>, %arg2: tensor<2x4x8x32xf32>) -> tensor<2x4x8x32xf32> {
    %0 = stablehlo.dot_general %arg0, %arg1, batching_dims = [0, 1] x [0, 1], contracting_dims = [3] x [3], precision = [DEFAULT, DEFAULT] : (tensor<2x4x8x32xf32>, tensor<2x4x8x32xf32>) -> tensor<2x4x8x8xf32>
    %cst = stablehlo.constant dense<3.200000e+01> : tensor<f32>
    %1 = stablehlo.sqrt %cst : tensor<f32>
    %2 = stablehlo.broadcast_in_dim %1, dims = [] : (tensor<f32>) -> tensor<2x4x8x8xf32>
    %3 = stablehlo.divide %0, %2 : tensor<2x4x8x8xf32>
    %4 = func.call @causal_mask_7() : () -> tensor<8x8xi1>
    %5 = stablehlo.broadcast_in_dim %4, dims = [2, 3] : (tensor<8x8xi1>) -> tensor<2x4x8x8xi1>
    %cst_0 = stablehlo.constant dense<0xFF800000> : tensor<f32>
    %6 = stablehlo.broadcast_in_dim %cst_0, dims = [] : (tensor<f32>) -> tensor<2x4x8x8xf32>
    %7 = stablehlo.select %5, %3, %6 : tensor<2x4x8x8xi1>, tensor<2x4x8x8xf32>
    %8 = func.call @softmax_9(%7) : (tensor<2x4x8x8xf32>) -> tensor<2x4x8x8xf32>
    %9 = stablehlo.dot_general %8, %arg2, batching_dims = [0, 1] x [0, 1], contracting_dims = [3] x [2], precision = [DEFAULT, DEFAULT] : (tensor<2x4x8x8xf32>, tensor<2x4x8x32xf32>) -> tensor<2x4x8x32xf32>
    return %9 : tensor<2x4x8x32xf32>
  }
}
"""

EXLA_NATIVE_CALL = """\
module @EXLA.native {
  func.func public @main(%arg0: tensor<1x8x2x64xbf16>, %arg1: tensor<1x8x2x64xbf16>, %arg2: tensor<1x8x2x64xbf16>, %arg3: tensor<4x4xf32>) -> (tensor<1x8x2x64xbf16>, tensor<4x4xf32>) {
    %0 = stablehlo.custom_call @exla_native_qr(%arg3) {api_version = 4 : i32, backend_config = {full_matrices = false, rank = 2 : i64}} : (tensor<4x4xf32>) -> tensor<4x4xf32>
    %1 = stablehlo.convert %arg0 : (tensor<1x8x2x64xbf16>) -> tensor<1x8x2x64xf32>
    %2 = stablehlo.convert %arg1 : (tensor<1x8x2x64xbf16>) -> tensor<1x8x2x64xf32>
    %3 = stablehlo.convert %arg2 : (tensor<1x8x2x64xbf16>) -> tensor<1x8x2x64xf32>
    %4 = stablehlo.dot_general %1, %2, batching_dims = [0, 2] x [0, 2], contracting_dims = [3] x [3] : (tensor<1x8x2x64xf32>, tensor<1x8x2x64xf32>) -> tensor<1x2x8x8xf32>
    %cst = stablehlo.constant dense<1.250000e-01> : tensor<f32>
    %5 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<1x2x8x8xf32>
    %6 = stablehlo.multiply %4, %5 : tensor<1x2x8x8xf32>
    %7 = func.call @softmax_3(%6) : (tensor<1x2x8x8xf32>) -> tensor<1x2x8x8xf32>
    %8 = stablehlo.dot_general %3, %7, batching_dims = [0, 2] x [0, 1], contracting_dims = [1] x [3] : (tensor<1x8x2x64xf32>, tensor<1x2x8x8xf32>) -> tensor<1x2x64x8xf32>
    %9 = stablehlo.transpose %8, dims = [0, 3, 1, 2] : (tensor<1x2x64x8xf32>) -> tensor<1x8x2x64xf32>
    %10 = stablehlo.convert %9 : (tensor<1x8x2x64xf32>) -> tensor<1x8x2x64xbf16>
    return %10, %0 : tensor<1x8x2x64xbf16>, tensor<4x4xf32>
  }
  func.func private @softmax_3(%arg0: tensor<1x2x8x8xf32>) -> tensor<1x2x8x8xf32> {
    %cst = stablehlo.constant dense<0xFF800000> : tensor<f32>
    %0 = stablehlo.reduce(%arg0 init: %cst) applies stablehlo.maximum across dimensions = [3] : (tensor<1x2x8x8xf32>, tensor<f32>) -> tensor<1x2x8xf32>
    %1 = stablehlo.broadcast_in_dim %0, dims = [0, 1, 2] : (tensor<1x2x8xf32>) -> tensor<1x2x8x8xf32>
    %2 = stablehlo.subtract %arg0, %1 : tensor<1x2x8x8xf32>
    %3 = stablehlo.exponential %2 : tensor<1x2x8x8xf32>
    %cst_0 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %4 = stablehlo.reduce(%3 init: %cst_0) applies stablehlo.add across dimensions = [3] : (tensor<1x2x8x8xf32>, tensor<f32>) -> tensor<1x2x8xf32>
    %cst_1 = stablehlo.constant dense<1.000000e+00> : tensor<f32>
    %5 = stablehlo.broadcast_in_dim %cst_1, dims = [] : (tensor<f32>) -> tensor<1x2x8xf32>
    %6 = stablehlo.divide %5, %4 : tensor<1x2x8xf32>
    %7 = stablehlo.broadcast_in_dim %6, dims = [0, 1, 2] : (tensor<1x2x8xf32>) -> tensor<1x2x8x8xf32>
    %8 = stablehlo.multiply %3, %7 : tensor<1x2x8x8xf32>
    return %8 : tensor<1x2x8x8xf32>
  }
}
"""


class _Text:
    """A hand-written module, written out as it is."""

    def __init__(self, text):
        self.text = text

    def mlir_module(self):
        return self.text


@case("exla_attention", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
      scale=1 / math.sqrt(32))
def _():
    return _Text(EXLA_ATTENTION)


@case("exla_native_call", rewritten=1, targets=[tname(64, "bf16", False)], scale=0.125,
      numerics=False)
def _():
    return _Text(EXLA_NATIVE_CALL)


# ----------------------------------------------------------------------------- negatives
@case("neg_softmax_query_axis", rejected=["query axis"])
def _():
    jax, jnp, _ = _jax()

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-2), v)
    return export_fn(f, *qkv())


@case("neg_probs_returned", rejected=["returned as output 1"])
def _():
    jax, jnp, _ = _jax()

    def f(q, k, v):
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v), p
    return export_fn(f, *qkv())


@case("neg_entropy_term", rejected=["another user"])
def _():
    jax, jnp, _ = _jax()

    def f(q, k, v):
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125)
        ent = -jnp.sum(p * jnp.log(p + 1e-9))
        return jnp.einsum("bhqk,bkhd->bqhd", p, v) + ent
    return export_fn(f, *qkv())


@case("neg_dropout", rejected=["dropout"])
def _():
    jax, jnp, _ = _jax()

    def f(q, k, v, key):
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125)
        keep = jax.random.bernoulli(jax.random.wrap_key_data(key), 0.9, p.shape)
        p = jnp.where(keep, p / 0.9, 0.0)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return export_fn(f, *qkv(), spec((2,), "uint32"))


@case("neg_sigmoid_attention", rejected=["sigmoid"])
def _():
    jax, jnp, _ = _jax()

    def f(q, k, v):
        p = jax.nn.sigmoid(jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return export_fn(f, *qkv())


@case("neg_linear_attention", rejected=["linear attention"])
def _():
    jax, jnp, _ = _jax()

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        return jnp.einsum("bhqk,bkhd->bqhd", s, v)
    return export_fn(f, *qkv())


@case("neg_softmax_classifier", rejected=["softmax classifier"])
def _():
    jax, jnp, _ = _jax()
    return export_fn(lambda x, w: jax.nn.softmax(x @ w), spec((B, 64)), spec((64, 10)))


@case("sliding_window_causal", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
      bottom_right=False, window=[2, -1], softcap=0.0)
def _():
    # causal sliding window of 3 keys (left = 2): two iota compares combined with `and`
    jax, jnp, _ = _jax()

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        s = jnp.where((j <= i) & (j > i - 3), s, -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv())


@case("sliding_window_symmetric", rewritten=1, targets=[tname(32, "f32", False)], causal=False,
      bottom_right=False, window=[2, 2])
def _():
    # non-causal local attention |i - j| <= 2 (window (2, 2)) on the query-key distance
    jax, jnp, _ = _jax()

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(32.0)
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        s = jnp.where(jnp.abs(i - j) <= 2, s, jnp.finfo(jnp.float32).min)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv())


@case("jnn_local_window", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
      window=[3, -1])
def _():
    # jax.nn.dot_product_attention's own sliding window spelling
    jax, _, _ = _jax()
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=(3, 0)), *qkv())


@case("softcap_gemma", rewritten=1, targets=[tname(32, "f32", True)], causal=True, scale=0.125,
      window=[-1, -1], softcap=5.0)
def _():
    # Gemma-2 logit softcapping: cap * tanh(scores / cap) between the scale and the causal mask
    jax, jnp, _ = _jax()

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        s = jnp.tanh(s / 5.0) * 5.0
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        s = jnp.where(j <= i, s, -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv())


@case("softcap_window_bf16", rewritten=1, targets=[tname(32, "bf16", False)], causal=False,
      bottom_right=True, scale=0.2, window=[2, 1], softcap=30.0)
def _():
    # softcap and a bottom-right aligned window (2 left, 1 right) in bf16, Sq < Sk
    jax, jnp, _ = _jax()

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * 0.2
        s = 30.0 * jnp.tanh(s * (1 / 30.0))
        i, j = jnp.arange(4)[:, None] + (T - 4), jnp.arange(T)[None, :]
        s = jnp.where((j >= i - 2) & (j <= i + 1), s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s).astype(jnp.bfloat16), v)
    return export_fn(f, *qkv("bfloat16", t=4, s=T))


@case("neg_softcap_masked_first", rejected=["masked before the softcap"])
def _():
    # tanh after the mask turns the -1e9 fill into -cap: not a mask the kernel can apply
    jax, jnp, _ = _jax()

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        s = jnp.where(j <= i, s, -1e9)
        s = jnp.tanh(s / 5.0) * 5.0
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv())


@case("runtime_scale", rewritten=1, targets=[tname(32, "f32", False)], scale=1.0)
def _():
    # a scale argument: multiplied into Q before the call, the kernel's scale is 1
    jax, jnp, _ = _jax()

    def f(q, k, v, scale):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv(), spec(()))


@case("runtime_scale_divide_bf16", rewritten=1, targets=[tname(32, "bf16", True)], causal=True,
      scale=0.5)
def _():
    # a constant and a run-time divisor; bf16 inputs: the division runs in f32
    jax, jnp, _ = _jax()

    def f(q, k, v, temp):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.5 / temp
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        s = jnp.where(j <= i, s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s.astype(jnp.float32)).astype(q.dtype), v)
    return export_fn(f, *qkv("bfloat16"), spec((1,)))


@case("neg_runtime_scale_after_mask", rejected=["run time after a mask"])
def _():
    # a negative run-time scale would turn the fill into +large: refused
    jax, jnp, _ = _jax()

    def f(q, k, v, m, scale):
        s = jnp.where(m, jnp.einsum("bqhd,bkhd->bhqk", q, k), -1e9) * scale
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv(), spec((B, 1, T, T), "bool"), spec(()))


@case("neg_runtime_scale_tensor", rejected=["not a scalar"])
def _():
    jax, jnp, _ = _jax()

    def f(q, k, v, scale):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv(), spec((B, H, T, T)))


@case("neg_head_dim_48", rejected=["head dim 48"])
def _():
    jax, _, _ = _jax()
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v), *qkv(d=48))


@case("neg_value_head_dim", rejected=["value head dim"])
def _():
    jax, jnp, _ = _jax()

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        return jnp.einsum("bhqk,bkhe->bqhe", jax.nn.softmax(s), v)
    q, k, _ = qkv()
    return export_fn(f, q, k, spec((B, T, H, 64)))


@case("jnn_value_and_grad", rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def _():
    # a training graph: the forward and its backward become flashgen_fwd + flashgen_bwd
    # (tests/test_rewrite_backward.py has the full training cases)
    jax, jnp, _ = _jax()

    def loss(q, k, v):
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True) ** 2)
    return export_fn(jax.value_and_grad(loss, argnums=(0, 1, 2)), *qkv())


@case("neg_torch_mha_weights", rejected=["probabilities"])
def _():
    import torch
    torch.manual_seed(0)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = torch.nn.MultiheadAttention(H * D, H, batch_first=True)

        def forward(self, x):
            return self.mha(x, x, x, need_weights=True)
    return torch_export(M().eval(), torch.randn(B, T, H * D))


# ----------------------------------------------------------------------------- extras
# README "Variants": biases, masks, ALiBi and segment ids become extra operands of the call.
def alibi_slopes(h):
    """The ALiBi paper's slopes for h heads (a power of two): 2^(-8/h), 2^(-16/h), ..."""
    return np.array([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], np.float32)


@case("jnn_bias_runtime", rewritten=1, targets=[tname(32, "f32", False)], causal=False,
      extras=["bias"])
def _():
    # jax.nn.dot_product_attention with a bias argument [B, H, T, T]
    jax, _, _ = _jax()
    return export_fn(lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, bias=b),
                     *qkv(), spec((B, H, T, T)))


@case("jnn_key_padding_causal", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
      extras=["segment_ids"])
def _():
    # a key padding mask [B, 1, 1, T] ANDed with is_causal: causal stays an attribute
    jax, _, _ = _jax()
    return export_fn(lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m,
                                                                     is_causal=True),
                     *qkv(), spec((B, 1, 1, T), "bool"))


@case("jnn_mask_full", rewritten=1, targets=[tname(32, "f32", False)], causal=False,
      extras=["mask"])
def _():
    jax, _, _ = _jax()
    return export_fn(lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m),
                     *qkv(), spec((B, 1, T, T), "bool"))


@case("jnn_bias_mask_causal", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
      extras=["bias", "segment_ids"])
def _():
    jax, _, _ = _jax()
    return export_fn(lambda q, k, v, b, m: jax.nn.dot_product_attention(
        q, k, v, bias=b, mask=m, is_causal=True), *qkv(), spec((B, 1, 1, T)),
        spec((B, 1, 1, T), "bool"))


@case("jnn_bias_bf16", rewritten=1, targets=[tname(32, "bf16", False)], extras=["bias"])
def _():
    # a bf16 padding bias [B, 1, 1, T] stays bf16 (the q dtype)
    jax, _, _ = _jax()
    return export_fn(lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, bias=b),
                     *qkv("bfloat16"), spec((B, 1, 1, T), "bfloat16"))


@case("jnn_gqa_mask", rewritten=1, targets=[tname(32, "f32", True)], causal=True, kv_heads=2,
      extras=["mask"])
def _():
    # a per-head mask with GQA: the mask's heads must follow the kernel's head order
    jax, _, _ = _jax()
    return export_fn(lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m,
                                                                     is_causal=True),
                     *qkv(hkv=2), spec((B, H, T, T), "bool"))


@case("jnn_decode_padding", rewritten=1, targets=[tname(32, "f32", False)], extras=["segment_ids"])
def _():
    # one query row against a padded KV cache
    jax, _, _ = _jax()
    return export_fn(lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m),
                     *qkv(t=1, s=8), spec((B, 1, 1, 8), "bool"))


@case("alibi_bloom", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
      scale=1 / math.sqrt(32), extras=["alibi"])
def _():
    # BLOOM's spelling: slopes·j (equal to -slopes·(i - j) up to a per-row constant) + causal
    jax, jnp, _ = _jax()
    slopes = alibi_slopes(H)

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (1 / math.sqrt(32))
        s = s + slopes[None, :, None, None] * jnp.arange(T, dtype=jnp.float32)
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        s = jnp.where(j <= i, s, jnp.finfo(jnp.float32).min)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv())


@case("alibi_symmetric", rewritten=1, targets=[tname(32, "f32", False)], causal=False,
      bottom_right=False, extras=["alibi"])
def _():
    # -slope·|i - j| without a mask (encoder-style ALiBi)
    jax, jnp, _ = _jax()
    slopes = alibi_slopes(H)

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        dist = jnp.abs(jnp.arange(T)[:, None] - jnp.arange(T)[None, :]).astype(jnp.float32)
        s = s - slopes[:, None, None] * dist
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv())


@case("alibi_bottom_right", rewritten=1, targets=[tname(32, "f32", False)], causal=False,
      bottom_right=True, extras=["alibi"])
def _():
    # 4 new queries against 8 keys, distances measured from the last key (offset Sk - Sq)
    jax, jnp, _ = _jax()
    slopes = alibi_slopes(H)

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        i, j = jnp.arange(4)[:, None] + (T - 4), jnp.arange(T)[None, :]
        s = s + (-slopes)[:, None, None] * jnp.abs(i - j).astype(jnp.float32)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv(t=4, s=T))


@case("alibi_like_sqrt", rewritten=1, targets=[tname(32, "f32", False)], causal=False,
      extras=["bias"])
def _():
    # near miss: -slope·sqrt|i - j| is no ALiBi (not linear in |i - j|): a constant bias
    jax, jnp, _ = _jax()
    slopes = alibi_slopes(H)

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        dist = jnp.abs(jnp.arange(T)[:, None] - jnp.arange(T)[None, :]).astype(jnp.float32)
        s = s - slopes[:, None, None] * jnp.sqrt(dist)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv())


@case("const_position_bias", rewritten=1, targets=[tname(32, "f32", False)], extras=["bias"])
def _():
    # a constant relative-position bias 0.1·(j - i): no ALiBi without a causal mask
    jax, jnp, _ = _jax()
    rel = (np.arange(T)[None, :] - np.arange(T)[:, None]).astype(np.float32) * 0.1

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125 + rel
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv())


def _relpos_buckets():
    rel = np.arange(T)[None, :] - np.arange(T)[:, None]
    return np.clip(rel, -3, 3) + 3          # 7 buckets of the key-query distance


@case("flax_relpos_bias_const", rewritten=1, targets=[tname(32, "f32", False)],
      extras=["bias"])
def _():
    # flax.linen.dot_product_attention with a relative-position bias table known at export
    # time (a closed-over constant [1, H, T, T])
    jax, jnp, _ = _jax()
    import flax.linen as nn
    table = np.random.default_rng(0).standard_normal((7, H)).astype(np.float32)
    bias = table[_relpos_buckets()].transpose(2, 0, 1)[None]

    def f(q, k, v):
        return nn.dot_product_attention(q, k, v, bias=bias)
    return export_fn(f, *qkv())


@case("flax_relpos_bias_table", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
      extras=["bias"])
def _():
    # the same with a trainable table (a gather at run time) and a causal mask
    jax, jnp, _ = _jax()
    import flax.linen as nn
    buckets = _relpos_buckets()

    def f(q, k, v, table):
        bias = jnp.transpose(table[buckets], (2, 0, 1))[None]
        return nn.dot_product_attention(q, k, v, bias=bias, mask=nn.make_causal_mask(q[..., 0, 0]))
    return export_fn(f, *qkv(), spec((7, H)))


@case("segment_ids_causal", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
      extras=["segment_ids"])
def _():
    # packed sequences: q_seg[:, None, :, None] == kv_seg[:, None, None, :], ANDed with causal
    jax, jnp, _ = _jax()

    def f(q, k, v, seg):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        visible = (seg[:, None, :, None] == seg[:, None, None, :]) & (j <= i)
        s = jnp.where(visible, s, -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv(), spec((B, T), "int32"))


@case("flax_segment_mask", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
      extras=["segment_ids"])
def _():
    # flax's spelling: make_attention_mask(seg, seg, jnp.equal) combined with a causal mask
    jax, jnp, _ = _jax()
    import flax.linen as nn

    def f(q, k, v, seg):
        mask = nn.combine_masks(nn.make_attention_mask(seg, seg, jnp.equal),
                                nn.make_causal_mask(seg))
        return nn.dot_product_attention(q, k, v, mask=mask)
    return export_fn(f, *qkv(), spec((B, T), "int32"))


@case("segment_ids_per_head", rewritten=1, targets=[tname(32, "f32", False)], extras=["mask"])
def _():
    # near miss: ids that differ per head are no segment ids [B, S]: a plain mask
    jax, jnp, _ = _jax()

    def f(q, k, v, ids):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        s = jnp.where(ids[:, :, :, None] == ids[:, :, None, :], s, -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv(), spec((B, H, T), "int32"))


@case("prefix_lm_mask", rewritten=1, targets=[tname(32, "f32", False)], causal=False,
      extras=["mask"])
def _():
    # prefix LM: causal OR key inside the per-example prefix (an OR: one run-time mask)
    jax, jnp, _ = _jax()

    def f(q, k, v, prefix):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        visible = (j <= i)[None, None] | (j < prefix[:, None, None, None])
        s = jnp.where(visible, s, -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv(), spec((B,), "int32"))


@case("const_strided_mask", rewritten=1, targets=[tname(32, "f32", False)], causal=False,
      extras=["mask"])
def _():
    # a constant mask that is no band on the diagonal (every other key): a constant operand
    jax, jnp, _ = _jax()

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        s = jnp.where((j <= i) & ((i - j) % 2 == 0), s, -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv())


@case("torch_sdpa_bool_mask", rewritten=1, targets=[tname(32, "f32", False)], extras=["mask"])
def _():
    # SDPA turns a bool attn_mask into a 0 / -inf bias: read back as a mask
    import torch
    import torch.nn.functional as F

    class M(torch.nn.Module):
        def forward(self, q, k, v, m):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    m = torch.ones(B, 1, T, T, dtype=torch.bool)
    return torch_export(M(), *_torch_qkv(), m)


@case("torch_sdpa_float_mask", rewritten=1, targets=[tname(32, "f32", False)], extras=["bias"])
def _():
    import torch
    import torch.nn.functional as F

    class M(torch.nn.Module):
        def forward(self, q, k, v, m):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    return torch_export(M(), *_torch_qkv(), torch.zeros(B, 1, 1, T))


@case("torch_mha_key_padding", rewritten=1, targets=[tname(32, "f32", False)], extras=["mask"])
def _():
    import torch
    torch.manual_seed(0)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = torch.nn.MultiheadAttention(H * D, H, batch_first=True)

        def forward(self, x, pad):
            return self.mha(x, x, x, key_padding_mask=pad, need_weights=False)[0]
    return torch_export(M().eval(), torch.randn(B, T, H * D), torch.zeros(B, T, dtype=torch.bool))


@case("scan_layers_padding_mask", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
      extras=["segment_ids"])
def _():
    # lax.scan over layers with one key padding mask: the mask enters the while body as a
    # loop-carried value and is passed from there
    jax, jnp, _ = _jax()
    C = H * D

    def f(x, wq, wk, wv, mask):
        def body(x, w):
            q = (x @ w[0]).reshape(B, T, H, D)
            k = (x @ w[1]).reshape(B, T, H, D)
            v = (x @ w[2]).reshape(B, T, H, D)
            a = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)
            return x + a.reshape(B, T, C), None
        return jax.lax.scan(body, x, jnp.stack([wq, wk, wv], 1))[0]
    return export_fn(f, spec((B, T, C)), spec((3, C, C)), spec((3, C, C)), spec((3, C, C)),
                     spec((B, 1, 1, T), "bool"))


EXLA_PADDING = """\
module @EXLA.padding {
  func.func public @main(%arg0: tensor<2x4x8x32xf32>, %arg1: tensor<2x4x8x32xf32>, %arg2: tensor<2x4x8x32xf32>, %arg3: tensor<2x8xi1>) -> tensor<2x4x8x32xf32> {
    %0 = func.call @attention_5(%arg0, %arg1, %arg2, %arg3) : (tensor<2x4x8x32xf32>, tensor<2x4x8x32xf32>, tensor<2x4x8x32xf32>, tensor<2x8xi1>) -> tensor<2x4x8x32xf32>
    return %0 : tensor<2x4x8x32xf32>
  }
  func.func private @attention_5(%arg0: tensor<2x4x8x32xf32>, %arg1: tensor<2x4x8x32xf32>, %arg2: tensor<2x4x8x32xf32>, %arg3: tensor<2x8xi1>) -> tensor<2x4x8x32xf32> {
    %0 = stablehlo.dot_general %arg0, %arg1, batching_dims = [0, 1] x [0, 1], contracting_dims = [3] x [3] : (tensor<2x4x8x32xf32>, tensor<2x4x8x32xf32>) -> tensor<2x4x8x8xf32>
    %cst = stablehlo.constant dense<1.250000e-01> : tensor<2x4x8x8xf32>
    %1 = stablehlo.multiply %0, %cst : tensor<2x4x8x8xf32>
    %2 = stablehlo.broadcast_in_dim %arg3, dims = [0, 3] : (tensor<2x8xi1>) -> tensor<2x4x8x8xi1>
    %cst_0 = stablehlo.constant dense<-1.000000e+09> : tensor<2x4x8x8xf32>
    %3 = stablehlo.select %2, %1, %cst_0 : tensor<2x4x8x8xi1>, tensor<2x4x8x8xf32>
    %cst_1 = stablehlo.constant dense<0xFF800000> : tensor<f32>
    %4 = stablehlo.reduce(%3 init: %cst_1) applies stablehlo.maximum across dimensions = [3] : (tensor<2x4x8x8xf32>, tensor<f32>) -> tensor<2x4x8xf32>
    %5 = stablehlo.broadcast_in_dim %4, dims = [0, 1, 2] : (tensor<2x4x8xf32>) -> tensor<2x4x8x8xf32>
    %6 = stablehlo.subtract %3, %5 : tensor<2x4x8x8xf32>
    %7 = stablehlo.exponential %6 : tensor<2x4x8x8xf32>
    %cst_2 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %8 = stablehlo.reduce(%7 init: %cst_2) applies stablehlo.add across dimensions = [3] : (tensor<2x4x8x8xf32>, tensor<f32>) -> tensor<2x4x8xf32>
    %9 = stablehlo.broadcast_in_dim %8, dims = [0, 1, 2] : (tensor<2x4x8xf32>) -> tensor<2x4x8x8xf32>
    %10 = stablehlo.divide %7, %9 : tensor<2x4x8x8xf32>
    %11 = stablehlo.dot_general %10, %arg2, batching_dims = [0, 1] x [0, 1], contracting_dims = [3] x [2] : (tensor<2x4x8x8xf32>, tensor<2x4x8x32xf32>) -> tensor<2x4x8x32xf32>
    return %11 : tensor<2x4x8x32xf32>
  }
}
"""


@case("exla_padding_mask", rewritten=1, targets=[tname(32, "f32", False)], scale=0.125,
      extras=["segment_ids"])
def _():
    # EXLA-style: the attention outlined into a private function that takes the padding mask
    return _Text(EXLA_PADDING)


# ----------------------------------------------------------------------------- rows without keys
# Padding leaves query rows whose keys are all masked; with a finite fill the original gives
# the mean of V there (flashgen.rewrite.empty_rows). The numerics test feeds masks with such
# rows (flashgen.rewrite.verify.mask_rows), so these compare every row.
@case("hf_gpt2_eager_left_padded", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
      extras=["segment_ids"])
def _():
    # transformers 5 GPT-2, eager attention, an attention_mask argument (left padding):
    # where(causal & padding, 0, finfo.min) added to the scores
    import torch
    from transformers import GPT2Config, GPT2Model
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_head=H, n_embd=H * D, vocab_size=64, n_positions=32,
                     bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    model = GPT2Model(cfg).eval()

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids, mask):
            return self.model(input_ids=ids, attention_mask=mask).last_hidden_state
    ids = torch.randint(0, 64, (B, T))
    mask = torch.ones(B, T, dtype=torch.int64)
    mask[0, :3] = 0
    return torch_export(M(), ids, mask)


@case("flax_linen_padding_mask", rewritten=1, targets=[tname(32, "f32", False)], causal=False,
      extras=["mask"])
def _():
    # nn.SelfAttention(mask=make_attention_mask(pad, pad)): padded queries see no key
    jax, jnp, _ = _jax()
    import flax.linen as nn
    m = nn.SelfAttention(num_heads=H, qkv_features=H * D, deterministic=True)
    params = m.init(jax.random.PRNGKey(0), jnp.ones((B, T, H * D)))

    def f(params, x, pad):
        return m.apply(params, x, mask=nn.make_attention_mask(pad, pad))
    shapes = jax.tree.map(lambda a: spec(a.shape, a.dtype), params)
    return export_fn(f, shapes, spec((B, T, H * D)), spec((B, T), "bool"))


@case("flax_nnx_padding_mask", rewritten=1, targets=[tname(32, "f32", False)], causal=False,
      extras=["mask"])
def _():
    jax, jnp, _ = _jax()
    from flax import nnx
    m = nnx.MultiHeadAttention(num_heads=H, in_features=H * D, qkv_features=H * D,
                               decode=False, deterministic=True, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(m)

    def f(state, x, pad):
        return nnx.merge(graphdef, state)(x, mask=nnx.make_attention_mask(pad, pad))
    shapes = jax.tree.map(lambda a: spec(a.shape, a.dtype), state)
    return export_fn(f, shapes, spec((B, T, H * D)), spec((B, T), "bool"))


# ----------------------------------------------------------------------------- more spellings
def _keras():
    import os
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras
    if keras.backend.backend() != "jax":
        raise RuntimeError("the keras goldens need KERAS_BACKEND=jax")
    return keras


def keras_export(layer_call, weights, *arg_specs):
    """Export a keras layer call with its weights as arguments (StatelessScope)."""
    keras = _keras()

    def f(ws, *args):
        with keras.StatelessScope(state_mapping=list(zip(weights, ws))):
            return layer_call(*args)
    return export_fn(f, [spec(w.shape, w.dtype) for w in weights], *arg_specs)


@case("keras_mha_dropout_inference", rewritten=1, targets=[tname(32, "f32", False)],
      extras=["mask"])
def _():
    # keras 3 MultiHeadAttention(dropout > 0) at inference: the masked Softmax applies the mask
    # again after the softmax (where(mask, probs, 0)); rows without a visible key are 0 in both
    keras = _keras()
    layer = keras.layers.MultiHeadAttention(num_heads=H, key_dim=D, dropout=0.1, seed=0)
    layer(np.ones((B, T, H * D), np.float32), np.ones((B, T, H * D), np.float32),
          attention_mask=np.ones((B, T, T), bool))
    return keras_export(lambda x, m: layer(x, x, attention_mask=m, training=False),
                        layer.weights, spec((B, T, H * D)), spec((B, T, T), "bool"))


@case("neg_keras_mha_dropout_training", rejected=["dropout"])
def _():
    # the same layer in training: the probabilities meet a random dropout mask
    keras = _keras()
    layer = keras.layers.MultiHeadAttention(num_heads=H, key_dim=D, dropout=0.1, seed=0)
    layer(np.ones((B, T, H * D), np.float32), np.ones((B, T, H * D), np.float32),
          attention_mask=np.ones((B, T, T), bool))
    return keras_export(lambda x, m: layer(x, x, attention_mask=m, training=True),
                        layer.weights, spec((B, T, H * D)), spec((B, T, T), "bool"))


@case("keras_hub_gpt2_padding", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
      window=[-1, -1], extras=["segment_ids"])
def _():
    # keras_hub GPT2Backbone(dropout > 0) with a padding mask: causal AND padding merged as
    # minimum(int(padding), int(causal)) > 0, applied again after the softmax: causal
    # attribute + O(S) key padding
    _keras()
    import keras_hub
    model = keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=1, num_heads=H,
                                          hidden_dim=H * D, intermediate_dim=2 * H * D,
                                          max_sequence_length=16, dropout=0.1)
    return keras_export(
        lambda ids, pad: model({"token_ids": ids, "padding_mask": pad}, training=False),
        model.weights, spec((B, T), "int32"), spec((B, T), "bool"))


@case("keras_hub_gemma_mqa_padding", rewritten=1, targets=[tname(32, "f32", True)],
      causal=True, kv_heads=1, window=[-1, -1], extras=["segment_ids"])
def _():
    # keras_hub GemmaBackbone (one kv head) with a padding mask: the 5-D einsum
    # btkgh,bskh->bkgts, the masked Softmax applying its mask (minimum(int(padding),
    # int(causal)) > 0) again after the softmax: causal attribute + O(S) key padding
    _keras()
    import keras_hub
    model = keras_hub.models.GemmaBackbone(vocabulary_size=64, num_layers=1, num_query_heads=H,
                                           num_key_value_heads=1, hidden_dim=H * D,
                                           intermediate_dim=2 * H * D, head_dim=D)
    return keras_export(
        lambda ids, pad: model({"token_ids": ids, "padding_mask": pad}, training=False),
        model.weights, spec((B, T), "int32"), spec((B, T), "bool"))


# ----------------------------------------------------------------------------- shape-polymorphic
# jax.export with symbolic batch and sequence dims (flashgen.rewrite.polymorphic): the call gets
# dynamic result shapes; tests/test_rewrite_polymorphic.py runs them at two concrete shapes.
def poly_qkv(dims="b, t", h=H, d=D):
    jax, jnp, export = _jax()
    b, t, *rest = export.symbolic_shape(dims)
    h = rest[0] if rest else h
    return [jax.ShapeDtypeStruct((b, t, h, d), jnp.float32)] * 3


def einsum_attention(jnp, q, k, v, mask=None, fill=-1e9):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (1 / math.sqrt(D))
    if mask is not None:
        s = jnp.where(mask, s, fill)
    return jnp.einsum("bhqk,bkhd->bqhd", softmax_manual(jnp, s), v)


@case("poly_jnn_causal", fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", True)],
      causal=True, numerics=False)
def _():
    jax, _, _ = _jax()
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                     *poly_qkv())


@case("poly_jnn", fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", False)],
      causal=False, scale=1 / math.sqrt(32), numerics=False)
def _():
    jax, _, _ = _jax()
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v), *poly_qkv())


@case("poly_einsum", fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", False)],
      causal=False, layout="BSHD", numerics=False)
def _():
    _, jnp, _ = _jax()
    return export_fn(lambda q, k, v: einsum_attention(jnp, q, k, v), *poly_qkv())


@case("poly_einsum_tril", fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", True)],
      causal=True, numerics=False)
def _():
    # the causal mask of a symbolic length: tril(ones((s, s))) becomes dynamic_iota compares
    _, jnp, _ = _jax()
    return export_fn(lambda q, k, v: einsum_attention(
        jnp, q, k, v, jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool))), *poly_qkv())


@case("poly_einsum_window", fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", True)],
      causal=True, window=[3, -1], numerics=False)
def _():
    # a sliding window from two iota compares (jax.nn's local_window_size does not export with
    # a symbolic length: it builds the mask with range(T))
    _, jnp, _ = _jax()

    def f(q, k, v):
        i, j = jnp.arange(q.shape[1])[:, None], jnp.arange(q.shape[1])[None, :]
        return einsum_attention(jnp, q, k, v, (i >= j) & (i - j <= 3))
    return export_fn(f, *poly_qkv())


@case("poly_jnn_gqa", fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", True)],
      causal=True, kv_heads=2, numerics=False)
def _():
    jax, jnp, export = _jax()
    b, t = export.symbolic_shape("b, t")
    q = jax.ShapeDtypeStruct((b, t, H, D), jnp.float32)
    kv = jax.ShapeDtypeStruct((b, t, 2, D), jnp.float32)
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                     q, kv, kv)


@case("poly_layers_shared_fn", fmt="jax_exported", rewritten=1,
      targets=[tname(32, "f32", True)], causal=True, numerics=False,
      rejected=["the scores have"])
def _():
    # two layers calling one jitted attention: one private function, rewritten once; the
    # projections reach the softmax too and are rejected as candidates of their own
    jax, jnp, export = _jax()
    attn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))

    def f(x, w):
        for i in range(2):
            q = jnp.einsum("bshd,hde->bshe", x, w[i])
            x = attn(q, q * 0.5, q + 1) + x
        return x
    b, t = export.symbolic_shape("b, t")
    return export_fn(f, jax.ShapeDtypeStruct((b, t, H, D), jnp.float32),
                     jax.ShapeDtypeStruct((2, H, D, D), jnp.float32))


@case("neg_poly_training", fmt="jax_exported",
      rejected=["training site (forward and backward) in a shape-polymorphic module"])
def _():
    jax, jnp, _ = _jax()

    def loss(q, k, v):
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True) ** 2)
    return export_fn(jax.grad(loss, argnums=(0, 1, 2)), *poly_qkv())


@case("poly_flax_linen_causal", fmt="jax_exported", rewritten=1,
      targets=[tname(32, "f32", True)], causal=True, numerics=False)
def _():
    # flax's MultiHeadDotProductAttention with make_causal_mask of a symbolic length; its
    # 1/sqrt(d) on the query goes into the call's scale
    jax, jnp, export = _jax()
    b, t = export.symbolic_shape("b, t")
    return flax_causal_mha(jax.ShapeDtypeStruct((b, t, H * D), jnp.float32))


@case("poly_einsum_gqa_upcast", fmt="jax_exported", rewritten=1,
      targets=[tname(32, "bf16", False)], kv_heads=2, scale=0.17, numerics=False)
def _():
    # bf16 inputs upcast to f32, K/V repeated over the query heads, Q scaled by a constant:
    # walked back to their sources as for a static module (a bf16 call on the unrepeated K/V)
    jax, jnp, export = _jax()
    b, t = export.symbolic_shape("b, t")
    q = jax.ShapeDtypeStruct((b, t, H, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, t, 2, D), jnp.bfloat16)

    def f(q, k, v):
        k, v = (jnp.repeat(x, 2, axis=2).astype(jnp.float32) for x in (k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32) * 0.17, k)
        return jnp.einsum("bhqk,bkhd->bqhd", softmax_manual(jnp, s), v)
    return export_fn(f, q, kv, kv)


@case("poly_constrained", fmt="jax_exported", rewritten=1, targets=[tname(32, "f32", True)],
      causal=True, numerics=False)
def _():
    # symbolic constraints: the instantiation sizes must satisfy jax.export's shape assertions
    jax, jnp, export = _jax()
    b, t = export.symbolic_shape("b, t", constraints=["t >= 128", "b <= 8"])
    x = jax.ShapeDtypeStruct((b, t, H, D), jnp.float32)
    return export_fn(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                     x, x, x)


@case("neg_poly_padding_mask", fmt="jax_exported",
      rejected=["shape-polymorphic site with extra operands"])
def _():
    # a run-time key padding mask would be an extra operand: not rewritten when polymorphic
    _, jnp, _ = _jax()
    return export_fn(lambda q, k, v: einsum_attention(
        jnp, q, k, v, (k[:, :, 0, 0] > 0)[:, None, None, :]), *poly_qkv())


@case("neg_poly_symbolic_heads", fmt="jax_exported", rejected=["heads of q is symbolic"])
def _():
    # the head count selects nothing in the kernel but the call's static result type
    _, jnp, _ = _jax()
    return export_fn(lambda q, k, v: einsum_attention(jnp, q, k, v), *poly_qkv("b, t, h"))


@case("neg_poly_symbolic_head_dim", fmt="jax_exported", rejected=["head dim is symbolic"])
def _():
    jax, jnp, export = _jax()
    b, t, d = export.symbolic_shape("b, t, d")
    x = jax.ShapeDtypeStruct((b, t, H, d), jnp.float32)
    return export_fn(lambda q, k, v: einsum_attention(jnp, q, k, v), x, x, x)


@case("jnn_softmax_where", rewritten=1, targets=[tname(32, "f32", False)], extras=["mask"])
def _():
    # jax.nn.softmax(s, where=mask): masked max and sum, the exponent of a second select, and a
    # final select to 0
    jax, jnp, _ = _jax()

    def f(q, k, v, m):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, where=m), v)
    return export_fn(f, *qkv(), spec((B, 1, T, T), "bool"))


@case("exp_log_softmax", rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def _():
    # probabilities spelled exp(log_softmax(s)): exp(s - max - log(sum(exp(s - max))))
    jax, jnp, _ = _jax()

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        p = jnp.exp(jax.nn.log_softmax(jnp.where(j <= i, s, -jnp.inf)))
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return export_fn(f, *qkv())


@case("equinox_vmap_mha", rewritten=1, targets=[tname(32, "f32", False)], layout="(HD)BS")
def _():
    # equinox MultiheadAttention under jax.vmap: the mapped batch sits in the middle of Q's
    # source; the report reads batch 2, heads 4 from the Q·K product's batching dims
    jax, jnp, _ = _jax()
    import equinox as eqx
    m = eqx.nn.MultiheadAttention(num_heads=H, query_size=H * D, key=jax.random.PRNGKey(0))
    params, static = eqx.partition(m, eqx.is_array)

    def f(params, x):
        mm = eqx.combine(params, static)
        return jax.vmap(lambda xx: mm(xx, xx, xx))(x)
    return export_fn(f, jax.tree.map(lambda a: spec(a.shape, a.dtype), params),
                     spec((B, T, H * D)))


# ----------------------------------------------------------------------------- extras: negatives
@case("neg_bias_before_softcap", rejected=["before the softcap"])
def _():
    jax, jnp, _ = _jax()

    def f(q, k, v, b):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125 + b
        s = jnp.tanh(s / 5.0) * 5.0
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv(), spec((B, H, T, T)))


@case("neg_bias_from_scores", rejected=["depends on the scores"])
def _():
    # a "bias" computed from the scores themselves cannot be passed in ahead of the kernel
    jax, jnp, _ = _jax()

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        s = s + jnp.flip(s, -1) * 0.1
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv())


@case("neg_mask_fill_zero", rejected=["not a large negative number"])
def _():
    # a run-time mask whose fill (0) does not remove the key from the softmax
    jax, jnp, _ = _jax()

    def f(q, k, v, m):
        s = jnp.where(m, jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125, 0.0)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv(), spec((B, 1, T, T), "bool"))


@case("neg_runtime_fill", rejected=["fill value is not a constant"])
def _():
    jax, jnp, _ = _jax()

    def f(q, k, v, m, fill):
        s = jnp.where(m, jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125, fill)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv(), spec((B, 1, T, T), "bool"), spec(()))


@case("neg_mask_after_softmax", rejected=["masked"])
def _():
    # the mask applies to the probabilities (no renormalization): not attention masking
    jax, jnp, _ = _jax()

    def f(q, k, v, m):
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125)
        return jnp.einsum("bhqk,bkhd->bqhd", jnp.where(m, p, 0.0), v)
    return export_fn(f, *qkv(), spec((B, 1, T, T), "bool"))


@case("const_mask_empty_row", rewritten=1, targets=[tname(32, "f32", False)], causal=False,
      extras=["mask"])
def _():
    # strictly-below-diagonal: the first query sees nothing. The program gives the mean of V
    # there (a finite fill: equal scores), the kernel 0: a constant mask operand and, the
    # empty rows being known statically, select(constant row flags, mean of V, o)
    jax, jnp, _ = _jax()

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        s = jnp.where(j < i, s, -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv())


@case("neg_const_mask_empty_row_small_fill", rejected=["too small to absorb"])
def _():
    # the same mask added as a constant 0 / -1e5 bias: -1e5 + s rounds to no single value in
    # f32, so the first query's row is the softmax of its (rounded) scores, not a mean of V,
    # and no kernel mode reproduces it
    jax, jnp, _ = _jax()

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        s = s + jnp.where(j < i, 0.0, -1e5)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv())


@case("neg_bias_runtime_scale", rejected=["run time"])
def _():
    jax, jnp, _ = _jax()

    def f(q, k, v, b, scale):
        s = (jnp.einsum("bqhd,bkhd->bhqk", q, k) + b) * scale
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
    return export_fn(f, *qkv(), spec((B, H, T, T)), spec(()))


# ----------------------------------------------------------------------------- library mask builders
# Causal and sliding-window masks as libraries build them (issue 14 gap 2): from position ids
# gathered out of an iota, cumsum-based packed-sequence checks, keras' integer minimum, an
# iota carried through lax.scan. All must become causal/window attributes, with no S x S
# operand left in the rewritten module.
def _hf_config(config_cls, **extra):
    import transformers
    return getattr(transformers, config_cls)(
        vocab_size=64, hidden_size=H * D // 2, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=H // 2, max_position_embeddings=64, **extra)


def _hf_export(config, model_cls, **inputs):
    """A small transformers model (eager attention, no attention_mask) via torchax, called
    with ``inputs`` (default: input_ids [1, T]); returns its last hidden state."""
    import torch
    import transformers
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(config).eval()
    inputs = inputs or {"input_ids": torch.randint(0, 4, (1, T))}
    names = list(inputs)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, *args):
            return self.m(**dict(zip(names, args)), use_cache=False).last_hidden_state
    return torch_export(M(), *inputs.values())


# matmuls that are not attention, correctly left alone: transformers' rotary embedding
# (inv_freq x positions, then cos/sin), keras_hub's feed-forward gate
_ROTARY = "depends on the scores"
_FFN_GATE = "known only at run time"


@case("hf_llama_causal", rewritten=1, rejected=[_ROTARY], targets=[tname(32, "f32", True)],
      causal=True, window=[-1, -1], extras=[])
def _():
    return _hf_export(_hf_config("LlamaConfig", num_key_value_heads=H // 2), "LlamaModel")


@case("hf_mistral_sliding_window", rewritten=1, rejected=[_ROTARY],
      targets=[tname(32, "f32", True)], causal=True, window=[3, -1], extras=[])
def _():
    # sliding_window = 4: a query sees itself and the 3 keys before it
    return _hf_export(_hf_config("MistralConfig", num_key_value_heads=H // 2, sliding_window=4),
                      "MistralModel")


@case("hf_gpt2_causal", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
      window=[-1, -1], extras=[])
def _():
    import transformers
    return _hf_export(transformers.GPT2Config(vocab_size=64, n_embd=H * D // 2, n_layer=1,
                                              n_head=H // 2, n_positions=64, bos_token_id=0,
                                              eos_token_id=0), "GPT2Model")


@case("hf_qwen2_causal", rewritten=1, rejected=[_ROTARY], targets=[tname(32, "f32", True)],
      causal=True, window=[-1, -1], extras=[])
def _():
    return _hf_export(_hf_config("Qwen2Config", num_key_value_heads=H // 2), "Qwen2Model")


@case("hf_phi_causal", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
      window=[-1, -1], extras=[])
def _():
    return _hf_export(_hf_config("PhiConfig"), "PhiModel")


@case("hf_gemma2_window_softcap", rewritten=2, targets=[tname(32, "f32", True)], causal=True,
      softcap=50.0, extras=[])
def _():
    # two layers: the first with a sliding window of 4, the second global; logits softcapped
    config = _hf_config("Gemma2Config", num_key_value_heads=H // 2, head_dim=D,
                        sliding_window=4)
    config.num_hidden_layers = 2
    config.layer_types = ["sliding_attention", "full_attention"]
    return _hf_export(config, "Gemma2Model")


@case("hf_whisper", rewritten=3, rejected=["known only at run time"],
      targets=[tname(32, "f32", False), tname(32, "f32", True)], extras=[])
def _():
    # encoder self-attention (no mask), decoder causal self-attention, cross-attention; the
    # two feed-forward matmuls (fc1, then GELU) are candidates correctly left alone
    import torch
    import transformers
    config = transformers.WhisperConfig(
        vocab_size=64, d_model=H * D // 2, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=H // 2, decoder_attention_heads=H // 2, encoder_ffn_dim=128,
        decoder_ffn_dim=128, num_mel_bins=8, max_source_positions=T, max_target_positions=64,
        pad_token_id=1, decoder_start_token_id=2, bos_token_id=2, eos_token_id=3)
    g = torch.Generator().manual_seed(0)
    return _hf_export(config, "WhisperModel",
                      input_features=torch.randn(1, 8, 2 * T, generator=g),
                      decoder_input_ids=torch.randint(0, 4, (1, T), generator=g))


def _keras_hub_llama(padding_dtype):
    import os
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras
    import keras_hub
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=64, num_layers=1, num_query_heads=H // 2, num_key_value_heads=H // 2,
        hidden_dim=H * D // 2, intermediate_dim=128, max_sequence_length=64)
    return export_fn(lambda ids, pad: backbone({"token_ids": ids, "padding_mask": pad}),
                     spec((B, T), "int32"), spec((B, T), padding_dtype))


@case("keras_hub_llama_padding", rewritten=1, rejected=[_FFN_GATE],
      targets=[tname(32, "f32", True)], causal=True, window=[-1, -1], extras=["segment_ids"])
def _():
    # causal and a boolean padding mask merged as minimum(int(padding), int(causal)) != 0:
    # causal attribute + O(S) key padding
    return _keras_hub_llama("bool")


@case("keras_hub_llama_int_padding", rewritten=1, rejected=[_FFN_GATE],
      targets=[tname(32, "f32", False)], causal=False, extras=["mask"])
def _():
    # the same with an int32 padding mask: minimum(p, causal) != 0 is no conjunction when p
    # may be negative (a negative entry shows masked keys), so the merged mask stays an operand
    return _keras_hub_llama("int32")


@case("jnn_local_window_scan", rewritten=1, targets=[tname(32, "f32", True)], causal=True,
      window=[3, -1], extras=[])
def _():
    # inside lax.scan jax hoists the position iota out of the body into a carried constant
    jax, _, _ = _jax()

    def f(q, k, v):
        def body(c, _):
            return jax.nn.dot_product_attention(c, k, v, local_window_size=(3, 0),
                                                is_causal=True), None
        return jax.lax.scan(body, q, None, length=2)[0]
    return export_fn(f, *qkv())


# ----------------------------------------------------------------------------- writing
def write(name: str, meta: dict) -> pathlib.Path:
    exported = meta["fn"]()
    fmt = meta["fmt"]
    if fmt == "mlir":
        path = INPUTS / f"{name}.mlir"
        path.write_text(exported.mlir_module())
    elif fmt == "mlirbc":
        path = INPUTS / f"{name}.mlirbc"
        path.write_bytes(exported.mlir_module_serialized)  # a StableHLO portable artifact
    else:
        path = INPUTS / f"{name}.jax_exported"
        path.write_bytes(bytes(exported.serialize()))
    return path


def default_checks(expect: dict) -> str:
    lines = ["// CHECK-LABEL: func.func public @main"]
    if expect["rewritten"] and len(expect["targets"]) == 1:
        (t,) = expect["targets"]
        causal = "true" if t.endswith("_causal") else "false"
        br = "true" if expect["bottom_right"] else "false"
        lines += [f"// CHECK: stablehlo.custom_call @{t}(",
                  "// CHECK-SAME: api_version = 4 : i32",
                  f"// CHECK-SAME: backend_config = {{bottom_right = {br}, causal = {causal}, "
                  f"extras = \"{','.join(expect.get('extras') or [])}\", scale = "]
    elif expect["rewritten"]:
        lines += [f"// CHECK-DAG: stablehlo.custom_call @{t}(" for t in expect["targets"]]
    else:
        lines.append("// CHECK-NOT: @flashgen_")
    if expect["rewritten"] and not expect["rejected"]:
        lines.append("// CHECK-NOT: stablehlo.exponential")
    return "\n".join(lines) + "\n"


def write_cases(cases: dict, manifest_path: pathlib.Path, checks, argv: list[str]) -> int:
    """Write the inputs of ``cases`` (every one, or those named in ``argv``), their entries in
    the manifest and, for a case without one, a FileCheck file ``checks(expect)``."""
    INPUTS.mkdir(parents=True, exist_ok=True)
    CHECKS.mkdir(parents=True, exist_ok=True)
    only = set(argv)
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    for name, meta in cases.items():
        if only and name not in only:
            continue
        path = write(name, meta)
        manifest[name] = dict(file=f"inputs/{path.name}", format=meta["fmt"], **meta["expect"])
        check = CHECKS / f"{name}.check"
        if not check.exists():
            check.write_text(checks(meta["expect"]))
        print(f"{name}: {path.relative_to(HERE)}")
    manifest_path.write_text(json.dumps(dict(sorted(manifest.items())), indent=1) + "\n")
    return 0


def main(argv: list[str]) -> int:
    return write_cases(CASES, HERE / "cases.json", default_checks, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
