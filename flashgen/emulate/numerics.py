"""Bit-exact conversions and the approximate-math instructions, on numpy lane arrays.

Rounding facts from the PTX ISA (cvt, ex2, rcp): .rn is round-to-nearest-even, .rna rounds ties
away from zero (tf32), f16/bf16 results of a NaN are the canonical NaN 0x7fff, .ftz flushes
subnormal inputs and results to sign-preserving zero. Approximate instructions (ex2.approx,
rcp.approx, lg2.approx) are computed in float64 and rounded once: within the hardware's
documented error bounds, and exact at the special values (0, ±inf, NaN) the kernels rely on.
ex2.approx and cvt.rn.bf16x2.f32, the two the attention kernels run most, are the native module's
(csrc/flashgen/emulate/native/numerics_emu.cc), by the same rules.

These run inside a launch only, under its np.errstate(all="ignore") (machine.py): entering an
errstate of their own cost three times the conversion it guarded (~5 µs a call).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

_F32_MIN_NORMAL = np.float32(1.17549435e-38)
CANONICAL_NAN16 = np.uint16(0x7FFF)


def ftz(x: np.ndarray) -> np.ndarray:
    """Flush f32 subnormals to zero, keeping the sign."""
    return np.where(np.abs(x) < _F32_MIN_NORMAL, x * np.float32(0), x).astype(np.float32, copy=False)


def f32_to_bf16_rn(x: np.ndarray) -> np.ndarray:
    """f32 -> bf16 bits, round to nearest even (ml_dtypes' cast is RNE: one pass, not five); NaN ->
    canonical NaN."""
    r = np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    return np.where(np.isnan(x), CANONICAL_NAN16, r)


def f32_to_f16_rn(x: np.ndarray) -> np.ndarray:
    """f32 -> f16 bits, round to nearest even (numpy's cast is IEEE RNE); NaN -> canonical NaN."""
    r = np.asarray(x, np.float32).astype(np.float16).view(np.uint16)
    return np.where(np.isnan(x), CANONICAL_NAN16, r)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def f16_to_f32(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits).astype(np.uint16).view(np.float16).astype(np.float32)


def f32_to_tf32(x: np.ndarray, mode: str) -> np.ndarray:
    """f32 -> tf32 (an f32 bit pattern with the low 13 mantissa bits zero).

    rna: ties away from zero (cvt.rna.tf32.f32, sm80); rn: ties to even; rz: truncate.
    Inf stays inf, NaN becomes the canonical f32 NaN 0x7fffffff.
    """
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    if mode == "rna":
        r = u + np.uint64(0x1000)
    elif mode == "rn":
        r = u + np.uint64(0xFFF) + ((u >> np.uint64(13)) & np.uint64(1))
    elif mode == "rz":
        r = u
    else:
        raise ValueError(mode)
    r = (r & np.uint64(0xFFFFE000)).astype(np.uint32)
    finite = np.isfinite(x)
    r = np.where(finite, r, np.asarray(x, np.float32).view(np.uint32))
    return np.where(np.isnan(x), np.uint32(0x7FFFFFFF), r)


def lg2_approx(x: np.ndarray) -> np.ndarray:
    return np.log2(x, dtype=np.float64).astype(np.float32)


def rcp(x: np.ndarray) -> np.ndarray:
    """1/x correctly rounded (IEEE f32 division): exact for rcp.rn, within rcp.approx's 1 ulp."""
    return np.float32(1) / x


def round_directed(exact: np.ndarray, mode: str, dtype=np.float32) -> np.ndarray:
    """Round float64 values to `dtype` with PTX rounding mode rn/rz/rm/rp."""
    r = exact.astype(dtype)
    if mode == "rn":
        return r
    back = r.astype(np.float64)
    if mode == "rm":
        fix = back > exact
        return np.where(fix, np.nextafter(r, dtype(-np.inf)), r)
    if mode == "rp":
        fix = back < exact
        return np.where(fix, np.nextafter(r, dtype(np.inf)), r)
    if mode == "rz":
        fix = np.abs(back) > np.abs(exact)
        return np.where(fix, np.nextafter(r, dtype(0)), r)
    raise ValueError(mode)
