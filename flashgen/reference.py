"""Float64 NumPy reference attention (forward and gradients) with flashgen's semantics.

Used by the demo, the tests and the benchmarks' correctness checks; an S×S
matrix is fine here, it is the reference.
"""
from __future__ import annotations

import numpy as np


def _mask(sq: int, sk: int, causal: bool, bottom_right: bool) -> np.ndarray:
    if not causal:
        return np.ones((sq, sk), bool)
    offset = sk - sq if bottom_right else 0
    return np.arange(sk)[None, :] <= np.arange(sq)[:, None] + offset


def attention(q, k, v, *, causal=False, scale=None, bottom_right=False, do=None):
    """Returns o, lse and, when `do` is given, (dq, dk, dv), all float64.

    q [B,Sq,Hq,D], k/v [B,Sk,Hkv,D]; rows that see no key give o = 0, lse = -inf.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    kr = np.repeat(k, group, axis=2)  # [B,Sk,Hq,D]
    vr = np.repeat(v, group, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    mask = _mask(sq, sk, causal, bottom_right)
    s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True) if sk else np.full((b, hq, sq, 1), -np.inf)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe)
    l = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(l > 0, p / np.where(l > 0, l, 1), 0.0)
        lse = np.where(l[..., 0] > 0, np.log(np.where(l[..., 0] > 0, l[..., 0], 1)) + m_safe[..., 0], -np.inf)
    o = np.einsum("bhqk,bkhd->bqhd", p, vr)
    if do is None:
        return o, lse
    do = np.asarray(do, np.float64)
    dv = np.einsum("bhqk,bqhd->bkhd", p, do)
    dp = np.einsum("bqhd,bkhd->bhqk", do, vr)
    ds = p * (dp - np.einsum("bqhd,bqhd->bhq", do, o)[..., None])
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kr) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    fold = lambda x: x.reshape(b, sk, hkv, group, d).sum(axis=3)
    return o, lse, (dq, fold(dk), fold(dv))
