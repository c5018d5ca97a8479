"""Ring attention: sequence parallelism over one mesh axis with flashgen kernels.

Inside ``shard_map`` with the sequence of q, k, v split over ``axis_name``
(n devices, device i holding query block i and key/value block i), K/V
blocks travel around the ring with ``ppermute``; no device ever holds more
than two K/V blocks or any [S, S] matrix.

Forward: device i runs the forward kernel on its queries against every K/V
block as it passes and merges the partial (o, lse) pairs exactly by
log-sum-exp: lse = logaddexp(lse_a, lse_b), o = o_a·e^(lse_a−lse) +
o_b·e^(lse_b−lse) (accumulated in f32).

Backward (custom VJP): given the *global* o and lse, flashgen's backward
kernel on one K/V block returns that block's exact share of dq and its exact
dk, dv (P = exp(s − lse) is already the globally normalized probability, and
rowsum(dO·O) the global correction). So K/V go around the ring again with
their dk/dv accumulators; after n steps one more hop brings every block's
gradient home.

Causal (equal block sizes; global positions i·Sl + a vs j·Sl + b): block j < i
is fully visible (non-causal kernel), j == i is the block diagonal (causal
kernel), j > i is fully masked and skipped (``lax.cond``, no kernel call).

Causal sliding window of w <= Sl keys: only the previous block is in reach, so
there is no ring, one hop: device i runs one kernel call on [K_{i-1}; K_i]
(2·Sl keys) with bottom_right alignment (offset Sl) and the window, which is
exactly the global band (the kernel skips the previous block's keys outside
it); device 0 runs its own block alone. The backward's dK/dV of the previous
block travel one hop back.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flashgen.jax.attention import _check, attention_bwd, attention_with_lse
from flashgen.contract import normalize_window


def ring_attention(q, k, v, *, axis_name, causal: bool = False, scale: float | None = None,
                   window: tuple[int, int] = (-1, -1)):
    """softmax(scale · q kᵀ [+ causal mask]) v with the sequence split over `axis_name`.

    Call inside ``jax.shard_map`` where q [B, Sq/n, Hq, D] and k, v [B, Sk/n, Hkv, D]
    are this device's blocks of the sequence (block index = ``axis_index(axis_name)``);
    returns this device's block of the output. Differentiable (exact ring backward).
    Other mesh axes may split batch and heads at the same time. causal needs
    Sq == Sk (each device's query block and key block cover the same positions);
    masking is top-left, as ``flash_attention(causal=True)``. window=(w, -1 or 0) with causal is
    a sliding window over the global sequence (key j visible to query i iff i - w <= j <= i),
    for w up to the per-device block length.
    """
    _, scale = _check(q, k, v, scale)
    window = normalize_window(window)
    if window != (-1, -1):
        left, right = window
        if not causal or right not in (-1, 0) or left < 0 or left > k.shape[1]:
            raise ValueError(
                f"ring_attention supports a sliding window only with causal=True and "
                f"window=(w, -1 or 0) for 0 <= w <= the per-device block length ({k.shape[1]}); "
                f"got window={window}, causal={causal}")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal ring attention needs equal query and key blocks, got "
                         f"{q.shape[1]} queries and {k.shape[1]} keys per device")
    if not isinstance(axis_name, str) and not (isinstance(axis_name, tuple) and axis_name):
        raise TypeError(f"axis_name must be a mesh axis name (or a tuple of them), got {axis_name!r}")
    try:
        n = jax.lax.axis_size(axis_name)
    except NameError as e:
        raise NameError(f"ring_attention must run inside shard_map (or pmap) over mesh axis "
                        f"{axis_name!r}: {e}") from None
    if window != (-1, -1):
        return _neighbour(q, k, v, axis_name, int(n), float(scale), window[0])
    return _ring(q, k, v, axis_name, int(n), bool(causal), float(scale))


def _ppermute(xs, axis_name, n):
    perm = [(j, (j + 1) % n) for j in range(n)]
    return jax.tree_util.tree_map(lambda x: jax.lax.ppermute(x, axis_name, perm), xs)


def _merge(o, lse, o_b, lse_b):
    """Exact combination of two partial attentions over disjoint key sets."""
    new = jnp.logaddexp(lse, lse_b)
    safe = jnp.where(jnp.isfinite(new), new, 0.0)  # rows that saw no key yet stay 0 / -inf
    to_o = lambda w: jnp.transpose(jnp.exp(w - safe), (0, 2, 1))[..., None]  # [B,H,S] -> [B,S,H,1]
    return o * to_o(lse) + o_b.astype(jnp.float32) * to_o(lse_b), new


def _forward(q, k, v, axis_name, n, causal, scale):
    me = jax.lax.axis_index(axis_name)
    o, lse = attention_with_lse(q, k, v, causal=causal, scale=scale)  # own block: the diagonal
    o = o.astype(jnp.float32)

    def step(s, carry):
        o, lse, k, v = carry
        k, v = _ppermute((k, v), axis_name, n)
        src = (me - s) % n

        def visit(o, lse):
            return _merge(o, lse, *attention_with_lse(q, k, v, causal=False, scale=scale))

        if causal:
            o, lse = jax.lax.cond(src < me, visit, lambda o, lse: (o, lse), o, lse)
        else:
            o, lse = visit(o, lse)
        return o, lse, k, v

    o, lse, _, _ = jax.lax.fori_loop(1, n, step, (o, lse, k, v))
    return o.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _ring(q, k, v, axis_name, n, causal, scale):
    return _forward(q, k, v, axis_name, n, causal, scale)[0]


def _ring_fwd(q, k, v, axis_name, n, causal, scale):
    o, lse = _forward(q, k, v, axis_name, n, causal, scale)
    return o, (q, k, v, o, lse)


def _ring_bwd(axis_name, n, causal, scale, res, do):
    q, k, v, o, lse = res
    do = do.astype(q.dtype)
    me = jax.lax.axis_index(axis_name)
    f32 = lambda *xs: tuple(x.astype(jnp.float32) for x in xs)
    dq, dk, dv = f32(*attention_bwd(q, k, v, o, lse, do, causal=causal, scale=scale))

    def step(s, carry):
        dq, k, v, dk, dv = carry
        k, v, dk, dv = _ppermute((k, v, dk, dv), axis_name, n)  # dk, dv travel with their block
        src = (me - s) % n

        def visit(dq, dk, dv):
            a, b, c = f32(*attention_bwd(q, k, v, o, lse, do, causal=False, scale=scale))
            return dq + a, dk + b, dv + c

        if causal:
            dq, dk, dv = jax.lax.cond(src < me, visit, lambda *g: g, dq, dk, dv)
        else:
            dq, dk, dv = visit(dq, dk, dv)
        return dq, k, v, dk, dv

    dq, _, _, dk, dv = jax.lax.fori_loop(1, n, step, (dq, k, v, dk, dv))
    if n > 1:
        dk, dv = _ppermute((dk, dv), axis_name, n)  # block i+1's gradients, complete: send home
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_ring.defvjp(_ring_fwd, _ring_bwd)



# ---------------------------------------------------------------------------------------
# Causal sliding window (w <= block length): one hop, [K_{i-1}; K_i] in one kernel call.

def _window_call(fn, q, k, v, k_prev, v_prev, w, scale, *rest):
    """fn(q, keys, values, *rest, ...) on [prev; own] with the band shifted by one block,
    or on the own block alone on device 0 (which has no previous block)."""
    cat = lambda a, b: jnp.concatenate([a, b], axis=1)
    both = lambda: fn(q, cat(k_prev, k), cat(v_prev, v), *rest, causal=True, scale=scale,
                      bottom_right=True, window=(w, -1))
    own = lambda: fn(q, k, v, *rest, causal=True, scale=scale, window=(w, -1))
    return both, own


def _shift(xs, axis_name, n, step):
    perm = [(j, (j + step) % n) for j in range(n)]
    return jax.tree_util.tree_map(lambda x: jax.lax.ppermute(x, axis_name, perm), xs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _neighbour(q, k, v, axis_name, n, scale, w):
    return _neighbour_fwd(q, k, v, axis_name, n, scale, w)[0]


def _neighbour_fwd(q, k, v, axis_name, n, scale, w):
    me = jax.lax.axis_index(axis_name)
    k_prev, v_prev = _shift((k, v), axis_name, n, 1)
    both, own = _window_call(attention_with_lse, q, k, v, k_prev, v_prev, w, scale)
    o, lse = jax.lax.cond(me > 0, both, own)
    return o, (q, k, v, k_prev, v_prev, o, lse)


def _neighbour_bwd(axis_name, n, scale, w, res, do):
    q, k, v, k_prev, v_prev, o, lse = res
    me = jax.lax.axis_index(axis_name)
    do = do.astype(q.dtype)
    sl = k.shape[1]
    both, own = _window_call(attention_bwd, q, k, v, k_prev, v_prev, w, scale, o, lse, do)

    def with_prev():
        dq, dk, dv = both()
        return dq, dk[:, sl:], dv[:, sl:], dk[:, :sl], dv[:, :sl]

    def alone():
        dq, dk, dv = own()
        return dq, dk, dv, jnp.zeros_like(dk), jnp.zeros_like(dv)

    dq, dk, dv, dk_prev, dv_prev = jax.lax.cond(me > 0, with_prev, alone)
    dk_back, dv_back = _shift((dk_prev, dv_prev), axis_name, n, -1)  # to the block's owner
    return dq, dk + dk_back, dv + dv_back


_neighbour.defvjp(_neighbour_fwd, _neighbour_bwd)
