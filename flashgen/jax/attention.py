"""flash_attention: the forward and backward custom calls, wired for jit, grad and vmap.

Side by side, each small: argument checks, the two ffi_calls, their batching
rule (vmap folds the mapped axis into the batch), and the custom VJP that
hands the forward's log-sum-exp to the backward kernel.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from flashgen import runtime
from flashgen.jax import sharding
from flashgen.spec import HEAD_DIMS, KernelSpec, normalize_dtype, normalize_softcap, normalize_window


def _local_target() -> str:
    """The KernelSpec target for JAX's default backend."""
    backend = jax.default_backend()
    if backend == "cpu":
        return "cpu"
    if backend in ("gpu", "cuda"):
        cc = getattr(jax.devices()[0], "compute_capability", "8.0")
        return "sm90a" if str(cc).startswith("9") else "sm80"
    raise ValueError(f"flashgen has no kernels for the {backend!r} backend (cpu and CUDA only)")


def _check(q, k, v, scale) -> tuple[str, float]:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if np.ndim(x) != 4:
            raise ValueError(f"{name} must be rank 4 [batch, seq, heads, head_dim] (BSHD), "
                             f"got shape {np.shape(x)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    dtype = normalize_dtype(q.dtype)
    b, _, hq, d = q.shape
    if d not in HEAD_DIMS:
        raise ValueError(f"unsupported head_dim {d}: supported head dims are "
                         f"{', '.join(map(str, HEAD_DIMS))}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k/v shape {k.shape} does not match q {q.shape} in batch or head_dim")
    if k.shape[2] == 0 or hq % k.shape[2]:
        raise ValueError(f"kv heads ({k.shape[2]}) must divide q heads ({hq})")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if isinstance(scale, jax.core.Tracer):
        raise TypeError("scale must be a Python number (it is a compile-time attribute), not a traced value")
    scale = float(scale)
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be finite and positive, got {scale}")
    return dtype, scale


def _fold_vmap(call):
    """Batching rule for a kernel call: fold the vmapped axis into the batch axis."""
    call = jax.custom_batching.custom_vmap(call)

    @call.def_vmap
    def rule(axis_size, in_batched, *args):
        args = [x if b else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, b in zip(args, in_batched)]
        outs = call(*(x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in args))
        outs = tuple(y.reshape(axis_size, y.shape[0] // axis_size, *y.shape[1:]) for y in outs)
        return outs, (True,) * len(outs)

    return call


@functools.cache
def _kernel_calls(spec: KernelSpec, scale: float, bottom_right: bool, window=(-1, -1), softcap=0.0):
    # The FFI calls, carrying the batch/head sharding rule (flashgen/jax/sharding.py).
    attrs = dict(scale=scale, bottom_right=bottom_right, window=window, softcap=softcap)

    def fwd(q, k, v):
        return sharding.kernel_call(spec, "fwd", (q, k, v), **attrs)

    def bwd(q, k, v, o, lse, do):
        return sharding.kernel_call(spec, "bwd", (q, k, v, o, lse, do), **attrs)

    return _fold_vmap(fwd), _fold_vmap(bwd)


# `mask` = (bottom_right, window, softcap): the runtime attributes besides scale.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q, k, v, spec, scale, mask):
    return _kernel_calls(spec, scale, *mask)[0](q, k, v)[0]


def _attention_fwd(q, k, v, spec, scale, mask):
    o, lse = _kernel_calls(spec, scale, *mask)[0](q, k, v)
    return o, (q, k, v, o, lse)


def _attention_bwd(spec, scale, mask, res, do):
    q, k, v, o, lse = res
    return _kernel_calls(spec, scale, *mask)[1](q, k, v, o, lse, do)


_attention.defvjp(_attention_fwd, _attention_bwd)


# return_lse=True: (o, lse), differentiable in both. d lse_i / d s_ij = p_ij, so an lse
# cotangent adds p_ij * dlse_i to dS. The backward kernel computes dS = p * (dP - Dsum)
# with dP = dO v^T and Dsum = rowsum(dO * o); one more call of it with v' = e_0 (every
# key's value is the first unit vector), o' = 0 and dO'_i = dlse_i * e_0 gives
# dP - Dsum = dlse_i, i.e. exactly the lse term of dq and dk (its dv is dropped).
# That second call runs only when the lse cotangent is not a symbolic zero.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention_lse(q, k, v, spec, scale, mask):
    return _kernel_calls(spec, scale, *mask)[0](q, k, v)


def _attention_lse_fwd(q, k, v, spec, scale, mask):
    q, k, v = (x.value for x in (q, k, v))  # symbolic_zeros wraps the primals
    o, lse = _kernel_calls(spec, scale, *mask)[0](q, k, v)
    return (o, lse), (q, k, v, o, lse)


def _attention_lse_bwd(spec, scale, mask, res, cts):
    q, k, v, o, lse = res
    do, dlse = cts
    zero = jax.custom_derivatives.SymbolicZero
    bwd = _kernel_calls(spec, scale, *mask)[1]
    if isinstance(do, zero):
        dq, dk, dv = jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
    else:
        dq, dk, dv = bwd(q, k, v, o, lse, do)
    if not isinstance(dlse, zero):
        e0 = jnp.zeros(q.shape[3], q.dtype).at[0].set(1)
        v1 = jnp.broadcast_to(e0, v.shape)
        do1 = jnp.swapaxes(dlse, 1, 2)[..., None].astype(q.dtype) * e0  # [B,Sq,Hq,D]
        dq1, dk1, _ = bwd(q, k, v1, jnp.zeros_like(o), lse, do1)
        dq, dk = dq + dq1, dk + dk1
    return dq, dk, dv


_attention_lse.defvjp(_attention_lse_fwd, _attention_lse_bwd, symbolic_zeros=True)


def flash_attention(query, key, value, bias=None, mask=None, *, scale: float | None = None,
                    is_causal: bool = False, causal: bool | None = None, bottom_right: bool = False,
                    window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    return_lse: bool = False):
    """softmax(scale · q kᵀ [+ causal mask]) v with FlashAttention kernels.

    A drop-in for jax.nn.dot_product_attention where the two overlap (query, key,
    value, scale, is_causal; `causal` is flashgen's own spelling of is_causal).
    query: [batch, seq_q, heads, head_dim]; key, value: [batch, seq_k, kv_heads, head_dim]
    (kv_heads divides heads: GQA/MQA). scale defaults to 1/sqrt(head_dim).
    Causal masks key j for query i unless j <= i (top-left, as jnp.tril and
    jax.nn.dot_product_attention), or j <= i + seq_k - seq_q with bottom_right=True
    (FlashAttention-2's alignment). The kernels take no bias or mask tensor: passing
    one raises instead of silently ignoring it.

    window=(left, right) is a sliding window (-1 = unbounded on that side): key j is
    visible to query i iff i + off - left <= j <= i + off + right, with the same offset
    off as causal (0, or seq_k - seq_q with bottom_right=True, which a window alone also
    accepts); combined with causal, right is effectively 0. softcap=c > 0 replaces the
    scaled scores x by c·tanh(x/c) before masking and softmax (Gemma-2). Both are runtime
    attributes: they compile no new kernel.
    return_lse=True returns (o, lse) with lse [batch, heads, seq_q] f32 (natural log,
    -inf for a row that sees no key); both are differentiable (an lse cotangent costs
    one more backward kernel call).
    """
    if bias is not None or mask is not None:
        raise NotImplementedError(
            "flashgen.jax.flash_attention supports no bias or mask tensor yet; for causal masking "
            "pass is_causal=True (or causal=True), or use jax.nn.dot_product_attention")
    if causal is not None and bool(causal) != bool(is_causal) and is_causal:
        raise ValueError(f"causal={causal} contradicts is_causal={is_causal}")
    causal = bool(is_causal if causal is None else causal)
    q, k, v = query, key, value
    spec, scale, mask = _prepare(q, k, v, causal, scale, bottom_right, window, softcap)
    q, k, v = sharding.match_varying(q, k, v)  # in shard_map: before the VJP, so grads psum
    if return_lse:
        return _attention_lse(q, k, v, spec, scale, mask)
    return _attention(q, k, v, spec, scale, mask)


def _prepare(q, k, v, causal, scale, bottom_right, window=(-1, -1), softcap=0.0):
    dtype, scale = _check(q, k, v, scale)
    window = normalize_window(window)
    softcap = normalize_softcap(softcap)
    if bottom_right and not causal and window == (-1, -1):
        raise ValueError("bottom_right only applies to causal attention or a sliding window")
    sharding.check_operand_shardings(q, k, v)
    spec = KernelSpec(q.shape[3], dtype, bool(causal), _local_target())
    runtime.ensure([spec])
    return spec, scale, (bool(bottom_right), window, softcap)


def attention_with_lse(q, k, v, *, causal: bool = False, scale: float | None = None,
                       bottom_right: bool = False, window=(-1, -1), softcap: float = 0.0):
    """The forward kernel alone: (o, lse [B, Hq, Sq] f32). Not differentiable (internal:
    ring attention combines these and brings its own VJP; users want
    flash_attention(..., return_lse=True))."""
    spec, scale, mask = _prepare(q, k, v, causal, scale, bottom_right, window, softcap)
    return _kernel_calls(spec, scale, *mask)[0](q, k, v)


def attention_bwd(q, k, v, o, lse, do, *, causal: bool = False, scale: float | None = None,
                  bottom_right: bool = False, window=(-1, -1), softcap: float = 0.0):
    """The backward kernel alone: (dq, dk, dv) from the saved o and lse. Given the global o
    and lse of a longer key sequence and one block of it as k, v, it returns that block's
    exact share of dq and its exact dk, dv."""
    spec, scale, mask = _prepare(q, k, v, causal, scale, bottom_right, window, softcap)
    return _kernel_calls(spec, scale, *mask)[1](q, k, v, o, lse, do)
