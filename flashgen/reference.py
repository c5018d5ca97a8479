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
              softcap=0.0, do=None, dlse=None):
    """Returns o, lse and, when `do` is given, (dq, dk, dv), all float64.

    q [B,Sq,Hq,D], k/v [B,Sk,Hkv,D]; rows that see no key give o = 0, lse = -inf.
    window=(left, right), -1 = unbounded; softcap=c > 0 maps scaled scores x to
    c·tanh(x/c) before masking. `dlse` (with `do`) adds a cotangent of lse.
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
    visible = mask(sq, sk, causal, bottom_right, window)
    s = np.where(visible, s, -np.inf)
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
    if dlse is not None:
        ds = ds + p * np.asarray(dlse, np.float64)[..., None]  # d lse / d s = p
    if softcap > 0:
        ds = ds * (1.0 - tanh ** 2)
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kr) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    fold = lambda x: x.reshape(b, sk, hkv, group, d).sum(axis=3)
    return o, lse, (dq, fold(dk), fold(dv))
