"""flash_attention: the forward and backward custom calls, wired for jit, grad and vmap.

Side by side, each small: argument checks, the two kernel calls (flashgen.jax.primitive, with
its batching rule), and the custom VJP that hands the forward's log-sum-exp to the backward
kernel.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from flashgen import runtime, targets
from flashgen.contract import EXTRAS, FP8_DTYPES, CallAttributes, extra_operand_index, normalize_scale, normalize_window
from flashgen.jax import primitive, sharding
from flashgen.spec import KernelSpec, kernel_head_dims, normalize_dtype, numpy_name


def local_target() -> str:
    """The KernelSpec target for JAX's default backend."""
    backend = jax.default_backend()
    cc = getattr(jax.devices()[0], "compute_capability", None)
    row = targets.local(backend, cc)
    if row is None:
        raise ValueError(f"flashgen has no kernels for the {backend!r} backend"
                         f"{f' (compute capability {cc})' if cc else ''}; its targets are "
                         f"{', '.join(targets.TARGETS)}")
    return row.name


def _check(q, k, v, scale) -> tuple[str, float]:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if np.ndim(x) != 4:
            raise ValueError(f"{name} must be rank 4 [batch, seq, heads, head_dim] (BSHD), "
                             f"got shape {np.shape(x)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    dtype = normalize_dtype(q.dtype)
    b, _, hq, d = q.shape
    kernel_head_dims(d, v.shape[3], "cpu")  # raises for a head dim no kernel serves, even padded
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v shapes differ in batch, sequence or heads: {k.shape} vs {v.shape}")
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k shape {k.shape} does not match q {q.shape} in batch or head_dim")
    if k.shape[2] == 0 or hq % k.shape[2]:
        raise ValueError(f"kv heads ({k.shape[2]}) must divide q heads ({hq})")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if isinstance(scale, jax.core.Tracer):
        raise TypeError("scale must be a Python number (it is a compile-time attribute), not a traced value")
    return dtype, normalize_scale(scale)


def _call_attributes(spec: KernelSpec, scale: float, mask, max_seqlen=None) -> CallAttributes:
    bottom_right, window, softcap, extras, deterministic = mask
    return CallAttributes(spec.causal, scale, bottom_right, window, softcap, extras, max_seqlen, deterministic)


@functools.cache
def _kernel_calls(spec: KernelSpec, scale: float, mask, dbias: bool = True):
    # The kernel calls (flashgen.jax.primitive). Extra operands (bias, masks, ...) follow the
    # fixed ones; they may broadcast over the batch, so a vmap maps the call instead of folding
    # it into the batch. With a bias, the backward returns dbias unless `dbias` is False.
    attrs = _call_attributes(spec, scale, mask)
    extras = attrs.extras

    def fwd(q, k, v, *extra):
        return primitive.kernel_call(spec, "fwd", (q, k, v, *extra), attrs)

    def bwd(q, k, v, o, lse, do, *extra):
        return primitive.kernel_call(spec, "bwd", (q, k, v, o, lse, do, *extra), attrs, dbias=dbias)

    # (an FP8 call's [1] descale operands do not fold into the batch: map)
    fold = not extras and spec.dtype not in FP8_DTYPES
    return primitive.fold_vmap(fwd, fold), primitive.fold_vmap(bwd, fold)


# `mask` = (bottom_right, window, softcap, extras, deterministic): the runtime attributes besides scale;
# `ex` = the extra operands that `extras` names (README "Variants"). Only a bias has a
# gradient (None: a symbolic zero); ALiBi slopes, masks and segment ids get none.
def _extra_cotangents(mask, dbias):
    cts = []
    for name in mask[3]:
        cts += [dbias[0] if dbias else None] if name == "bias" else [None] * len(EXTRAS[name])
    return tuple(cts)


# (o, lse), differentiable in both, with symbolic zeros: a bias that is not being
# differentiated (not perturbed) costs no dbias work in the backward, and an lse nobody
# uses costs nothing. d lse_i / d s_ij = p_ij, so an lse cotangent adds p_ij * dlse_i to
# dS. The backward kernel computes dS = p * (dP - Dsum) with dP = dO v^T and Dsum =
# rowsum(dO * o); one more call of it with v' = e_0 (every key's value is the first unit
# vector), o' = 0 and dO'_i = dlse_i * e_0 gives dP - Dsum = dlse_i, i.e. exactly the lse
# term of dq, dk (and dbias; its dv is dropped). That second call runs only when the lse
# cotangent is not a symbolic zero.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q, k, v, ex, spec, scale, mask):
    return _kernel_calls(spec, scale, mask)[0](q, k, v, *ex)


def _attention_fwd(q, k, v, ex, spec, scale, mask):
    with_dbias = "bias" in mask[3] and ex[extra_operand_index(mask[3], "bias")].perturbed
    q, k, v = (x.value for x in (q, k, v))  # symbolic_zeros wraps the primals
    ex = tuple(x.value for x in ex)
    o, lse = _kernel_calls(spec, scale, mask)[0](q, k, v, *ex)
    # The flag travels as pytree structure (residual leaves must be arrays): () or None.
    return (o, lse), (q, k, v, ex, o, lse, () if with_dbias else None)


def _attention_bwd(spec, scale, mask, res, cts):
    q, k, v, ex, o, lse, flag = res
    with_dbias = flag is not None
    do, dlse = cts
    zero = jax.custom_derivatives.SymbolicZero
    bwd = _kernel_calls(spec, scale, mask, dbias=with_dbias)[1]
    if isinstance(do, zero):
        dq, dk, dv = jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
        dbias = [jnp.zeros_like(ex[extra_operand_index(mask[3], "bias")])] if with_dbias else []
    else:
        dq, dk, dv, *dbias = bwd(q, k, v, o, lse, do, *ex)
    if not isinstance(dlse, zero):
        e0 = jnp.zeros(v.shape[3], q.dtype).at[0].set(1)
        v1 = jnp.broadcast_to(e0, v.shape)
        do1 = jnp.swapaxes(dlse, 1, 2)[..., None].astype(q.dtype) * e0  # [B,Sq,Hq,Dv]
        dq1, dk1, _, *dbias1 = bwd(q, k, v1, jnp.zeros_like(o), lse, do1, *ex)
        dq, dk = dq + dq1, dk + dk1
        dbias = [a + b for a, b in zip(dbias, dbias1)]
    return dq, dk, dv, _extra_cotangents(mask, dbias)


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def _forward_only(nondiff_argnums: tuple[int, ...], why: str):
    """Decorator: a custom_vjp whose backward raises NotImplementedError(why) (calls without a
    backward kernel), so differentiating it fails with that reason instead of tracing into the call."""
    def wrap(fn):
        f = jax.custom_vjp(fn, nondiff_argnums=nondiff_argnums)

        def bwd(*_):
            raise NotImplementedError(why)
        f.defvjp(lambda *args: (f(*args), None), bwd)
        return f
    return wrap


# The FP8 forward (q, k, v float8_e4m3fn with per-tensor descales; o bf16).
@_forward_only((4, 5, 6), "flash_attention with float8_e4m3fn inputs is forward-only (no FP8 backward); "
                          "differentiate it with bf16 / f16 inputs")
def _attention_fp8(q, k, v, descales, spec, scale, mask):
    return _kernel_calls(spec, scale, mask)[0](q, k, v, *descales)


def _fp8_descales(dtype: str, descales: dict, extras, softcap):
    """The descale operands of an FP8 call (f32 [1] each; None: 1), or () for other inputs;
    ValueError / TypeError for what the FP8 forward does not take."""
    given = [n for n, x in descales.items() if x is not None]
    if dtype not in FP8_DTYPES:
        if given:
            raise ValueError(f"descale factors ({', '.join(given)}) apply to float8_e4m3fn inputs only, "
                             f"got {numpy_name(dtype)} q, k, v")
        return ()
    if extras or softcap:
        raise ValueError("flash_attention with float8_e4m3fn inputs takes no bias, mask, ALiBi, segment ids "
                         f"or softcap (the FP8 forward has none), got {', '.join(extras) or 'softcap'}")
    out = []
    for name, x in descales.items():
        x = jnp.asarray(1.0 if x is None else x)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a float (scalar or shape [1]), got {x.dtype}")
        if x.ndim > 1 or x.size != 1:
            raise ValueError(f"{name} must be a scalar or shape [1] (one factor per tensor), got shape {x.shape}")
        out.append(x.astype(jnp.float32).reshape(1))
    return tuple(out)


def flash_attention(query, key, value, bias=None, mask=None, *, scale: float | None = None,
                    is_causal: bool = False, causal: bool | None = None, bottom_right: bool = False,
                    window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes=None, q_segment_ids=None, kv_segment_ids=None,
                    return_lse: bool = False, deterministic: bool = False,
                    q_descale=None, k_descale=None, v_descale=None):
    """softmax(scale · q kᵀ [+ bias] [+ ALiBi] [masked]) v with FlashAttention kernels.

    A drop-in for jax.nn.dot_product_attention where the two overlap (query, key,
    value, bias, mask, scale, is_causal; `causal` is flashgen's own spelling of is_causal).
    query, key: [batch, seq_q|seq_k, heads|kv_heads, head_dim]; value: [batch, seq_k, kv_heads,
    head_dim_v] (kv_heads divides heads: GQA/MQA); the result is [batch, seq_q, heads,
    head_dim_v]. head_dim_v may differ from head_dim (DeepSeek's MLA: 192 and 128). scale
    defaults to 1/sqrt(head_dim). A head dim up to 256 that no kernel has runs at the next one
    with zero columns (flashgen.spec.kernel_head_dims).
    Causal masks key j for query i unless j <= i (top-left, as jnp.tril and
    jax.nn.dot_product_attention), or j <= i + seq_k - seq_q with bottom_right=True
    (FlashAttention-2's alignment).

    window=(left, right) is a sliding window (-1 = unbounded on that side): key j is
    visible to query i iff i + off - left <= j <= i + off + right, with the same offset
    off as causal (0, or seq_k - seq_q with bottom_right=True, which a window alone also
    accepts); combined with causal, right is effectively 0. softcap=c > 0 replaces the
    scaled scores x by c·tanh(x/c) before masking and softmax (Gemma-2).

    bias (float, broadcastable to [batch, heads, seq_q, seq_k]) is added to the scores
    (after scale and softcap) and gets a gradient; mask (bool, same broadcasting; True =
    attend) and q_segment_ids [batch, seq_q] / kv_segment_ids [batch, seq_k] (int; attend
    only within equal ids: packed sequences) restrict visibility; alibi_slopes ([heads] or
    [batch, heads], f32) subtracts slope·|i + off - j| (ALiBi; bottom_right chooses off).
    A key-padding mask ([batch|1, 1, 1, seq_k]) travels as segment ids, O(seq) memory.
    All combine with causal, window and softcap. A row that sees no key gives 0.

    return_lse=True returns (o, lse) with lse [batch, heads, seq_q] f32 (natural log,
    -inf for a row that sees no key); both are differentiable (an lse cotangent costs
    one more backward kernel call).

    FP8: query, key, value of dtype float8_e4m3fn hold values whose real values are stored ·
    q_descale / k_descale / v_descale (f32 scalars or shape [1], may be traced; None = 1). The
    result is bf16; forward only (differentiating it raises), no bias, masks, ALiBi, segment ids
    or softcap; kernels on sm90a only (elsewhere a ValueError says so).

    deterministic=True makes the gradients the same bits on every run: the backward kernel
    accumulates dq (and, under GQA, dk/dv, and dbias) in a fixed order instead of as its
    blocks finish (slower; the forward is unchanged).
    """
    if causal is not None and bool(causal) != bool(is_causal) and is_causal:
        raise ValueError(f"causal={causal} contradicts is_causal={is_causal}")
    causal = bool(is_causal if causal is None else causal)
    q, k, v = query, key, value
    dtype, _ = _check(q, k, v, scale)
    extras, ex = _extra_operands(q, k, bias, mask, alibi_slopes, q_segment_ids, kv_segment_ids)
    descales = _fp8_descales(dtype, dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale),
                             extras, softcap)
    if descales:
        spec, scale, attrs = _prepare(q, k, v, causal, scale, bottom_right, window)
        q, k, v, *descales = primitive.match_varying(q, k, v, *descales)
        o, lse = _attention_fp8(*_pad_qkv(spec, q, k, v), tuple(descales), spec, scale, attrs)
        o = o[..., :value.shape[3]]
        return (o, lse) if return_lse else o
    fold = not extras and _foldable_decode(q, k.shape[2], causal, bottom_right, window)
    if fold:
        q, causal, bottom_right = _fold_group(q, k.shape[2]), False, False
    spec, scale, attrs = _prepare(q, k, v, causal, scale, bottom_right, window, softcap, extras,
                                  deterministic=deterministic)
    q, k, v, *ex = primitive.match_varying(q, k, v, *ex)  # in shard_map: before the VJP, so grads psum
    o, lse = _attention(*_pad_qkv(spec, q, k, v), tuple(ex), spec, scale, attrs)
    o = o[..., :value.shape[3]]
    if fold:
        o, lse = _unfold_group(o, query.shape[2]), lse.reshape(lse.shape[0], -1, 1)
    return (o, lse) if return_lse else o


# One-token decode with GQA: the G query heads of a kv head sit at the same (last) position and
# see the same keys, so they run as G query rows of that kv head — K/V are read once per kv
# head instead of G times. Non-causal: with one query, a bottom-right causal mask hides nothing.
def _foldable_decode(q, kv_heads, causal, bottom_right, window) -> bool:
    hq = q.shape[2]
    return (q.shape[1] == 1 and kv_heads > 0 and hq % kv_heads == 0 and hq > kv_heads
            and normalize_window(window) == (-1, -1) and (not causal or bottom_right))


def _fold_group(q, kv_heads):
    """[B, 1, Hkv·G, D] -> [B, G, Hkv, D] (row i of kv head g is q head g·G + i)."""
    b, _, hq, d = q.shape
    return q.reshape(b, kv_heads, hq // kv_heads, d).swapaxes(1, 2)


def _unfold_group(o, heads):
    """[B, G, Hkv, D] -> [B, 1, Hkv·G, D]; the lse [B, Hkv, G] is [B, Hq, 1] by reshape."""
    return o.swapaxes(1, 2).reshape(o.shape[0], 1, heads, o.shape[3])


def _broadcast_4d(x, name: str, b: int, h: int, sq: int, sk: int, dtypes, keep_q=False):
    """x broadcast to [1|b, 1|h, sq, sk] (keeping size-1 batch/head dims, and with
    ``keep_q`` a size-1 query dim: the bias's key-only form)."""
    x = jnp.asarray(x)
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {x.dtype}")
    if x.ndim > 4:
        raise ValueError(f"{name} must be broadcastable to [batch, heads, seq_q, seq_k] = "
                         f"{[b, h, sq, sk]}, got shape {x.shape}")
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    target = (x.shape[0] if x.shape[0] == 1 else b, x.shape[1] if x.shape[1] == 1 else h,
              1 if keep_q and x.shape[2] == 1 else sq, sk)
    try:
        np.broadcast_shapes(x.shape, (b, h, sq, sk))
    except ValueError:
        raise ValueError(f"{name} must be broadcastable to [batch, heads, seq_q, seq_k] = "
                         f"{[b, h, sq, sk]}, got shape {x.shape}") from None
    return jnp.broadcast_to(x, target)


def _extra_operands(q, k, bias, mask, alibi_slopes, q_segment_ids, kv_segment_ids):
    """The `extras` names and their operands, checked and in the kernels' layout."""
    b, sq, hq = q.shape[0], q.shape[1], q.shape[2]
    sk = k.shape[1]
    out = {}
    if alibi_slopes is not None:
        out["alibi"] = (_alibi_operand(alibi_slopes, b, hq),)
    if bias is not None:
        bias_dtypes = {jnp.dtype(jnp.float32), jnp.dtype(q.dtype)}
        out["bias"] = (_broadcast_4d(bias, "bias", b, hq, sq, sk, bias_dtypes, keep_q=True),)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither")
    if mask is not None:
        m = jnp.asarray(mask)
        if m.dtype != jnp.bool_:
            raise TypeError(f"mask must be boolean (True = attend), got {m.dtype}")
        m = m.reshape((1,) * (4 - m.ndim) + m.shape) if m.ndim <= 4 else m
        if (q_segment_ids is None and m.ndim == 4 and m.shape[1:3] == (1, 1) and m.shape[3] == sk
                and m.shape[0] in (1, b)):
            # Key padding: "attend iff key j is real" == segment ids 1 vs kv ids mask.
            q_segment_ids = jnp.ones((b, sq), jnp.int32)
            kv_segment_ids = jnp.broadcast_to(m[:, 0, 0, :], (b, sk)).astype(jnp.int32)
        else:
            out["mask"] = (_broadcast_4d(m, "mask", b, hq, sq, sk, {jnp.dtype(jnp.bool_)}),)
    if q_segment_ids is not None:
        qs, ks = jnp.asarray(q_segment_ids), jnp.asarray(kv_segment_ids)
        if qs.shape != (b, sq) or ks.shape != (b, sk):
            raise ValueError(f"q_segment_ids must be [batch, seq_q]={[b, sq]} and kv_segment_ids "
                             f"[batch, seq_k]={[b, sk]}, got {qs.shape} and {ks.shape}")
        for name, x in (("q_segment_ids", qs), ("kv_segment_ids", ks)):
            if not jnp.issubdtype(x.dtype, jnp.integer):
                raise TypeError(f"{name} must be integers, got {x.dtype}")
        out["segment_ids"] = (qs.astype(jnp.int32), ks.astype(jnp.int32))
    extras = tuple(n for n in EXTRAS if n in out)
    return extras, [x for n in extras for x in out[n]]


def _alibi_operand(alibi_slopes, batch: int, heads: int):
    """ALiBi slopes as the kernels take them: f32 [heads] or [batch, heads]."""
    a = jnp.asarray(alibi_slopes)
    if a.shape not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must be [heads]={[heads]} or [batch, heads]={[batch, heads]}, "
                         f"got shape {a.shape}")
    if not jnp.issubdtype(a.dtype, jnp.floating):
        raise TypeError(f"alibi_slopes must be floating point, got {a.dtype}")
    return a.astype(jnp.float32)


def _pad_head_dim(head_dim: int, *xs):
    """``xs`` with zero columns appended to their last (head) axis up to ``head_dim``, the
    spec's (flashgen.spec.kernel_head_dims): exact, the caller slices the extra output
    columns off and jnp.pad's transpose slices the gradients."""
    return tuple(x if x.shape[-1] == head_dim else
                 jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, head_dim - x.shape[-1])]) for x in xs)


def _pad_qkv(spec: KernelSpec, q, k, v, *value_rows):
    """q, k padded to the spec's head dim; v and `value_rows` (o, do) to its value head dim."""
    return _pad_head_dim(spec.head_dim, q, k) + _pad_head_dim(spec.head_dim_v, v, *value_rows)


def _prepare(q, k, v, causal, scale, bottom_right, window=(-1, -1), softcap=0.0, extras=(),
             check_shardings=True, deterministic=False):
    dtype, scale = _check(q, k, v, scale)
    attrs = CallAttributes(causal, scale, bottom_right, window, softcap, extras, deterministic=deterministic)
    if attrs.bottom_right and not attrs.causal and attrs.window == (-1, -1) and "alibi" not in attrs.extras:
        raise ValueError("bottom_right only applies to causal attention, a sliding window or ALiBi")
    if check_shardings:
        sharding.check_operand_shardings(q, k, v)
    target = local_target()
    head_dim, head_dim_v = kernel_head_dims(q.shape[3], v.shape[3], target)
    spec = KernelSpec(head_dim, dtype, attrs.causal, target, head_dim_v)
    runtime.ensure([spec])
    return spec, scale, (attrs.bottom_right, attrs.window, attrs.softcap, attrs.extras, attrs.deterministic)


def attention_with_lse(q, k, v, *, causal: bool = False, scale: float | None = None,
                       bottom_right: bool = False, window=(-1, -1), softcap: float = 0.0):
    """The forward kernel alone: (o, lse [B, Hq, Sq] f32). Not differentiable (internal:
    ring attention combines these and brings its own VJP; users want
    flash_attention(..., return_lse=True))."""
    spec, scale, mask = _prepare(q, k, v, causal, scale, bottom_right, window, softcap)
    o, lse = _kernel_calls(spec, scale, mask)[0](*_pad_qkv(spec, q, k, v))
    return o[..., :v.shape[3]], lse


def attention_bwd(q, k, v, o, lse, do, *, causal: bool = False, scale: float | None = None,
                  bottom_right: bool = False, window=(-1, -1), softcap: float = 0.0,
                  deterministic: bool = False):
    """The backward kernel alone: (dq, dk, dv) from the saved o and lse. Given the global o
    and lse of a longer key sequence and one block of it as k, v, it returns that block's
    exact share of dq and its exact dk, dv."""
    spec, scale, mask = _prepare(q, k, v, causal, scale, bottom_right, window, softcap,
                                 deterministic=deterministic)
    dims = q.shape[3], k.shape[3], v.shape[3]
    q, k, v, o, do = _pad_qkv(spec, q, k, v, o, do)
    grads = _kernel_calls(spec, scale, mask)[1](q, k, v, o, lse, do)
    return tuple(g[..., :d] for g, d in zip(grads, dims))


# --------------------------------------------------------------------------------------
# Packed variable-length batches (flash_attn_varlen_func's layout) and the paged KV cache.

def _check_lengths(name: str, cu, max_seqlen) -> int:
    if np.ndim(cu) != 1 or np.shape(cu)[0] < 1:
        raise ValueError(f"{name} must be rank 1 [batch + 1], got shape {np.shape(cu)}")
    if not jnp.issubdtype(jnp.asarray(cu).dtype, jnp.integer):
        raise TypeError(f"{name} must be integers, got {jnp.asarray(cu).dtype}")
    if isinstance(max_seqlen, jax.core.Tracer) or isinstance(max_seqlen, bool) or \
            not isinstance(max_seqlen, (int, np.integer)):
        raise TypeError(f"max_seqlen for {name} must be a Python int (it sizes the launch), "
                        f"got {max_seqlen!r}")
    if not 0 <= int(max_seqlen) < 2**31:
        raise ValueError(f"max_seqlen for {name} must be in [0, 2^31), got {max_seqlen}")
    return int(max_seqlen)


def _varlen_spec(q, k, v, causal, scale, bottom_right, window, softcap, extras, deterministic):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if np.ndim(x) != 3:
            raise ValueError(f"{name} must be rank 3 [total_tokens, heads, head_dim] (packed), "
                             f"got shape {np.shape(x)}")
    if v.shape[2] != q.shape[2]:
        raise ValueError(f"flash_attention_varlen needs v's head dim ({v.shape[2]}) to equal q's and k's "
                         f"({q.shape[2]}); flash_attention takes a different one")
    # Reuse the dense checks on [1, T, H, D] views (dtype, head dim, kv heads, scale).
    return _prepare(*(jax.ShapeDtypeStruct((1, *x.shape), x.dtype) for x in (q, k, v)),
                    causal, scale, bottom_right, window, softcap, extras, check_shardings=False,
                    deterministic=deterministic)


# attrs = _prepare's mask; `ex` = the extra operands (ALiBi slopes),
# constants of the backward.
def _varlen_call(direction, operands, spec, scale, attrs, max_seqlen):
    return primitive.kernel_call(spec, direction, operands, _call_attributes(spec, scale, attrs, max_seqlen))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _attention_varlen(q, k, v, cu_q, cu_k, ex, spec, scale, attrs, max_seqlen):
    return _varlen_call("fwd_varlen", (q, k, v, cu_q, cu_k, *ex), spec, scale, attrs, max_seqlen)


def _attention_varlen_fwd(q, k, v, cu_q, cu_k, ex, spec, scale, attrs, max_seqlen):
    o, lse = _attention_varlen(q, k, v, cu_q, cu_k, ex, spec, scale, attrs, max_seqlen)
    return (o, lse), (q, k, v, cu_q, cu_k, ex, o, lse)


def _attention_varlen_bwd(spec, scale, attrs, max_seqlen, res, cts):
    q, k, v, cu_q, cu_k, ex, o, lse = res
    do, dlse = cts
    bwd = lambda v, o, do: _varlen_call("bwd_varlen", (q, k, v, o, lse, do, cu_q, cu_k, *ex),
                                        spec, scale, attrs, max_seqlen)
    dq, dk, dv = bwd(v, o, do)
    # An lse cotangent (return_lse=True) is folded in as in _attention_bwd: the backward
    # with v' = e_0, o' = 0, dO' = dlse · e_0 yields exactly its dq, dk share.
    e0 = jnp.zeros(q.shape[2], q.dtype).at[0].set(1)
    do1 = jnp.swapaxes(dlse, 0, 1)[..., None].astype(q.dtype) * e0
    dq1, dk1, _ = bwd(jnp.broadcast_to(e0, v.shape), jnp.zeros_like(o), do1)
    return dq + dq1, dk + dk1, dv, None, None, (None,) * len(ex)


_attention_varlen.defvjp(_attention_varlen_fwd, _attention_varlen_bwd)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                           max_seqlen_k: int, *, causal: bool = False, scale: float | None = None,
                           bottom_right: bool = False, window: tuple[int, int] = (-1, -1),
                           softcap: float = 0.0, alibi_slopes=None, return_lse: bool = False,
                           deterministic: bool = False):
    """Attention over a packed batch of variable-length sequences (flash_attn_varlen_func).

    q [total_q, heads, head_dim], k, v [total_k, kv_heads, head_dim]; sequence b is q rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1] and keys cu_seqlens_k[b]:cu_seqlens_k[b+1]
    (int32 [batch + 1], starting at 0, non-decreasing; may be traced). max_seqlen_q/_k are
    Python ints bounding the lengths (they size the GPU launch). Each sequence is an
    independent attention with its own lengths: causal, bottom_right, window, softcap and
    ALiBi (alibi_slopes [heads] or [batch, heads], offset as causal per sequence) act per
    sequence. Rows past cu_seqlens_q[-1] and empty sequences give o = 0.
    Returns o [total_q, heads, head_dim] (and lse [heads, total_q] with return_lse=True);
    differentiable in q, k, v; deterministic as flash_attention's.
    """
    cu_q = jnp.asarray(cu_seqlens_q)
    cu_k = jnp.asarray(cu_seqlens_k)
    max_seqlen = (_check_lengths("cu_seqlens_q", cu_q, max_seqlen_q),
                  _check_lengths("cu_seqlens_k", cu_k, max_seqlen_k))
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), "
                         f"got {cu_q.shape} and {cu_k.shape}")
    ex = () if alibi_slopes is None else (_alibi_operand(alibi_slopes, cu_q.shape[0] - 1, q.shape[1]),)
    spec, scale, attrs = _varlen_spec(q, k, v, bool(causal), scale, bottom_right, window, softcap,
                                      ("alibi",) if ex else (), deterministic)
    o, lse = _attention_varlen(*_pad_head_dim(spec.head_dim, q, k, v), cu_q.astype(jnp.int32),
                               cu_k.astype(jnp.int32), ex, spec, scale, attrs, max_seqlen)
    o = o[..., :q.shape[2]]
    return (o, lse) if return_lse else o


@_forward_only((6, 7, 8), "flash_attention_paged is forward-only (inference/decode); "
                          "differentiate flash_attention or flash_attention_varlen instead")
def _attention_paged(q, k_cache, v_cache, block_table, seqused_k, ex, spec, scale, attrs):
    return primitive.kernel_call(spec, "fwd_paged", (q, k_cache, v_cache, block_table, seqused_k, *ex),
                                 _call_attributes(spec, scale, attrs))


def flash_attention_paged(q, k_cache, v_cache, block_table, seqused_k, *, causal: bool = False,
                          scale: float | None = None, bottom_right: bool = False,
                          window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                          alibi_slopes=None, return_lse: bool = False):
    """Attention of q against a paged KV cache (vLLM's layout); forward only.

    q [batch, seq_q, heads, head_dim]; k_cache, v_cache [num_blocks, block_size, kv_heads,
    head_dim]; block_table int32 [batch, max_blocks]; seqused_k int32 [batch]. Key j of
    batch b (j < seqused_k[b]) is row j % block_size of block block_table[b, j // block_size].
    For decoding, where q holds the last seq_q tokens, use causal=True, bottom_right=True.
    alibi_slopes ([heads] or [batch, heads]) adds ALiBi with the same per-batch alignment.
    Decode with few sequences splits the keys over workers (split-KV). Returns o (and lse
    [batch, heads, seq_q] with return_lse=True).
    """
    for name, x, r in (("q", q, 4), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4),
                       ("block_table", block_table, 2), ("seqused_k", seqused_k, 1)):
        if np.ndim(x) != r:
            raise ValueError(f"{name} must be rank {r}, got shape {np.shape(x)}")
    if np.shape(k_cache) != np.shape(v_cache):
        raise ValueError(f"k_cache and v_cache shapes differ: {np.shape(k_cache)} vs {np.shape(v_cache)}")
    b = q.shape[0]
    if np.shape(block_table)[0] != b or np.shape(seqused_k) != (b,):
        raise ValueError(f"block_table must be [batch={b}, max_blocks] and seqused_k [batch={b}], "
                         f"got {np.shape(block_table)} and {np.shape(seqused_k)}")
    for name, x in (("block_table", block_table), ("seqused_k", seqused_k)):
        if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.integer):
            raise TypeError(f"{name} must be integers, got {jnp.asarray(x).dtype}")
    # The dense checks (dtype, head dim, kv heads, scale) on a [B, block_size, Hkv, D] view.
    kv_view = jax.ShapeDtypeStruct((b, *k_cache.shape[1:]), k_cache.dtype)
    hq = q.shape[2]
    ex = () if alibi_slopes is None else (_alibi_operand(alibi_slopes, b, hq),)
    # (ALiBi slopes differ per q head: folded rows would share their kv head's slope.)
    fold = not ex and _foldable_decode(q, k_cache.shape[2], causal, bottom_right, window)
    if fold:
        q, causal, bottom_right = _fold_group(q, k_cache.shape[2]), False, False
    spec, scale, attrs = _prepare(q, kv_view, kv_view, bool(causal), scale, bottom_right, window,
                                  softcap, ("alibi",) if ex else (), check_shardings=False)
    if spec.head_dim != q.shape[3]:
        # padding would copy the whole cache on every decode step
        raise ValueError(f"flash_attention_paged needs a kernel head dim, got {q.shape[3]}: "
                         f"allocate the cache at head dim {spec.head_dim} (zero columns)")
    o, lse = _attention_paged(q, k_cache, v_cache, jnp.asarray(block_table, jnp.int32),
                              jnp.asarray(seqused_k, jnp.int32), ex, spec, scale, attrs)
    if fold:
        o, lse = _unfold_group(o, hq), lse.reshape(b, hq, 1)
    return (o, lse) if return_lse else o
