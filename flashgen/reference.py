"""Float64 NumPy reference attention (forward and gradients) with flashgen's semantics.

Used by the demo, the tests and the benchmarks' correctness checks; an S×S
matrix is fine here, it is the reference.
"""
from __future__ import annotations

import numpy as np


def mask(sq: int, sk: int, causal: bool = False, bottom_right: bool = False,
         window=(-1, -1)) -> np.ndarray:
    """[Sq, Sk] bool, True where key j is visible to query i (flashgen/attention.h)."""
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    offset = sk - sq if bottom_right else 0
    i = np.arange(sq)[:, None] + offset
    j = np.arange(sk)[None, :]
    m = np.ones((sq, sk), bool)
    if causal:
        m &= j <= i
    if left >= 0:
        m &= j >= i - left
    if right >= 0:
        m &= j <= i + right
    return m


_mask = mask


def attention(q, k, v, *, causal=False, scale=None, bottom_right=False, window=(-1, -1),
              softcap=0.0, alibi_slopes=None, bias=None, mask=None, q_segment_ids=None,
              kv_segment_ids=None, do=None, dlse=None):
    """Returns o, lse and, when `do` is given, (dq, dk, dv) — plus dbias when `bias` is
    given — all float64.

    q [B,Sq,Hq,D], k [B,Sk,Hkv,D], v [B,Sk,Hkv,Dv] (o: [B,Sq,Hq,Dv]; Dv may differ from D);
    rows that see no key give o = 0, lse = -inf.
    window=(left, right), -1 = unbounded; softcap=c > 0 maps scaled scores x to
    c·tanh(x/c) before masking. Then (README "Variants"): alibi_slopes [Hq] | [B,Hq] adds
    -slope·|i + off - j|, bias [1|B,1|Hq,1|Sq,Sk] is added, mask ([1|B,1|Hq,Sq,Sk] bool) and
    segment ids (equal ids) restrict visibility. `dlse` (with `do`) adds a cotangent of lse.

    NaN and overflow follow IEEE arithmetic over the keys a row sees (README "NaN and
    overflow"): a NaN or infinite score makes its row NaN, and a row whose visible scores are
    all -inf is NaN (o and lse). Masks — causal, window, `mask`, segment ids and a bias of
    -inf — select: a key a row does not see contributes nothing to it, not even a NaN of its
    score, of its V row or of the gradient terms it would meet.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    kr = np.repeat(k, group, axis=2)  # [B,Sk,Hq,D]
    vr = np.repeat(v, group, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    softcap = float(softcap)
    if softcap > 0:
        tanh = np.tanh(s / softcap)
        s = softcap * tanh
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, np.float64)
        slopes = np.broadcast_to(slopes if slopes.ndim == 2 else slopes[None], (b, hq))
        off = sk - sq if bottom_right else 0
        dist = np.abs(np.arange(sq)[:, None] + off - np.arange(sk)[None, :])
        s = s - slopes[:, :, None, None] * dist
    if bias is not None:
        s = s + np.asarray(bias, np.float64)
    visible = _mask(sq, sk, causal, bottom_right, window)[None, None]
    if bias is not None:  # a -inf bias is a mask too (the usual spelling of one)
        visible = visible & (np.asarray(bias, np.float64) != -np.inf)
    if mask is not None:
        visible = visible & np.asarray(mask, bool)
    if q_segment_ids is not None:
        visible = visible & (np.asarray(q_segment_ids)[:, None, :, None]
                             == np.asarray(kv_segment_ids)[:, None, None, :])
    visible = np.broadcast_to(visible, s.shape)
    seen = visible.any(axis=-1, keepdims=True)  # rows with a visible key
    s = np.where(visible, s, -np.inf)
    with np.errstate(invalid="ignore", over="ignore"):
        m = s.max(axis=-1, keepdims=True) if sk else np.full((b, hq, sq, 1), -np.inf)
        # -inf - -inf is NaN: a row whose visible scores are all -inf is NaN, as IEEE has it.
        m_sub = np.where(seen, m, 0.0)
        p = np.where(visible, np.exp(s - m_sub), 0.0)
        l = p.sum(axis=-1, keepdims=True)
        p = np.where(visible, p / np.where(seen, l, 1.0), 0.0)  # a NaN l must not reach masked pairs
        lse = np.where(seen[..., 0], np.log(np.where(seen, l, 1.0)[..., 0]) + m_sub[..., 0], -np.inf)
    o = _masked_product("bhqk,bkhd->bqhd", p, vr, visible)
    if do is None:
        return o, lse
    do = np.asarray(do, np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        dv = _masked_product("bhqk,bqhd->bkhd", p, do, visible)
        dp = np.einsum("bqhd,bkhd->bhqk", do, vr)
        drow = np.einsum("bqhd,bqhd->bhq", do, o)[..., None]
        ds = np.where(visible, p * (dp - drow), 0.0)
        if dlse is not None:
            ds = ds + np.where(visible, p * np.asarray(dlse, np.float64)[..., None], 0.0)  # d lse / d s = p
        grads = ()
        if bias is not None:  # d score / d bias = 1, summed over the dims bias broadcasts
            shape = np.shape(bias)
            grads = (ds.sum(axis=tuple(i for i in (0, 1, 2) if shape[i] == 1), keepdims=True),)
        if softcap > 0:
            ds = np.where(visible, ds * (1.0 - tanh ** 2), 0.0)
        dq = _masked_product("bhqk,bkhd->bqhd", ds, kr, visible) * scale
        dk = _masked_product("bhqk,bqhd->bkhd", ds, q, visible) * scale
    fold = lambda x: x.reshape(b, sk, hkv, group, x.shape[-1]).sum(axis=3)  # dk: D, dv: Dv
    return o, lse, (dq, fold(dk), fold(dv)) + grads


def _masked_product(spec, w, x, visible):
    """einsum(spec, w, x) over the (query, key) pairs in `visible` only: a masked pair adds
    nothing even where x is NaN or infinite (0 · NaN would). Exact, O(B·H·Sq·Sk·D), only when
    x has such values."""
    with np.errstate(invalid="ignore", over="ignore"):
        out = np.einsum(spec, w, np.where(np.isfinite(x), x, 0.0))
        if np.all(np.isfinite(x)):
            return out
        # Per-pair terms with the masked ones dropped, summed over the contracted axis.
        lhs, rest = spec.split(",")
        rhs, res = rest.split("->")
        full = lhs + "".join(c for c in rhs if c not in lhs)  # bhqk + d
        terms = np.einsum(f"{lhs},{rhs}->{full}", w, x)
        terms = np.where(visible[..., None], terms, 0.0)
        return np.einsum(f"{full}->{res}", terms)


def _per_sequence(kw, b):
    """kw for sequence b: [B, H] ALiBi slopes become that sequence's [H]."""
    slopes = kw.get("alibi_slopes")
    if slopes is not None and np.ndim(slopes) == 2:
        return {**kw, "alibi_slopes": np.asarray(slopes)[b]}
    return kw


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, do=None, **kw):
    """Packed reference: q [Tq,Hq,D], k/v [Tk,Hkv,D]; each sequence through attention().
    Returns o [Tq,Hq,D], lse [Hq,Tq] (and (dq, dk, dv) with `do`); rows outside every
    sequence get o = 0, lse = -inf, zero gradients."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    o = np.zeros_like(q)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(len(cu_seqlens_q) - 1):
        qs = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
        ks = slice(int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1]))
        args = [x[None, s] for x, s in ((q, qs), (k, ks), (v, ks))]
        kb = _per_sequence(kw, b)
        if do is None:
            ob, lb = attention(*args, **kb)
        else:
            ob, lb, (dqb, dkb, dvb) = attention(*args, do=np.asarray(do, np.float64)[None, qs], **kb)
            dq[qs], dk[ks], dv[ks] = dqb[0], dkb[0], dvb[0]
        o[qs], lse[:, qs] = ob[0], lb[0]
    return (o, lse) if do is None else (o, lse, (dq, dk, dv))


def attention_paged(q, k_cache, v_cache, block_table, seqused_k, **kw):
    """Paged-KV reference: gathers each batch's keys through block_table, then attention()."""
    q = np.asarray(q, np.float64)
    bs = k_cache.shape[1]
    o = np.zeros_like(q)
    lse = np.zeros((q.shape[0], q.shape[2], q.shape[1]))
    for b in range(q.shape[0]):
        n = int(seqused_k[b])
        rows = [int(block_table[b, j // bs]) for j in range(n)]
        k = np.stack([k_cache[r, j % bs] for j, r in enumerate(rows)]) if n else k_cache[:0, 0]
        v = np.stack([v_cache[r, j % bs] for j, r in enumerate(rows)]) if n else v_cache[:0, 0]
        ob, lb = attention(q[b:b + 1], k[None], v[None], **_per_sequence(kw, b))
        o[b], lse[b] = ob[0], lb[0]
    return o, lse


def attention_fp8(q, k, v, q_descale, k_descale, v_descale, **kwargs):
    """The FP8 forward's reference: attention (forward only) of the dequantized inputs, each
    e4m3 tensor times its descale factor in float64 (contract.FP8_CALLS)."""
    dequantized = (np.asarray(x, np.float64) * float(np.asarray(s, np.float64).reshape(()))
                   for x, s in ((q, q_descale), (k, k_descale), (v, v_descale)))
    return attention(*dequantized, **kwargs)
