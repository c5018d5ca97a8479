"""The call contract: every flashgen custom call's attributes, operands and results, said once.

A flashgen call is `stablehlo.custom_call @flashgen_<direction>_d<D>_<dtype>[_causal]` (spec.target_name)
with the operands CALLS[direction] lists, then the operands its `extras` attribute names (EXTRAS), and a
typed attribute dictionary (ATTRIBUTES, each passed on every call: an XLA FFI handler rejects missing or
extra ones). Everything that builds, binds, checks, partitions or renders a call reads these tables:
emit (to MLIR), the JAX primitive, the sharding rules, the contract checker, the emulator's standard
cases and codegen (the C++ handlers' bindings and the NIF face's tables).

Window and softcap are runtime attributes, not KernelSpec fields: they change which blocks are visited
and one elementwise step, not the kernel's shape, so one compiled specialization serves every value.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Attribute:
    """One attribute of a call: its MLIR type, the C++ type its handler decodes, its default."""
    name: str
    mlir: str        # "i1" | "i32" | "f32" | "string"
    cxx: str         # the C++ type of the decoded value
    default: object  # None: no default, every caller gives it
    meaning: str


ATTRIBUTES = {a.name: a for a in (
    Attribute("causal", "i1", "bool", None, "must equal the spec's causal flag"),
    Attribute("scale", "f32", "float", None, "softmax scale; finite, positive, normal"),
    Attribute("bottom_right", "i1", "bool", False,
              "align the causal diagonal and window to the last key (off = Sk - Sq), not the first (off = 0)"),
    Attribute("window_left", "i32", "int32_t", -1,
              "key j visible to query i iff j >= i + off - left (-1 = unbounded)"),
    Attribute("window_right", "i32", "int32_t", -1,
              "key j visible to query i iff j <= i + off + right (-1 = unbounded; causal => 0)"),
    Attribute("softcap", "f32", "float", 0.0, "scaled scores x -> softcap * tanh(x / softcap); 0 = off"),
    Attribute("max_seqlen_q", "i32", "int32_t", None, "the longest query sequence of a varlen batch"),
    Attribute("max_seqlen_k", "i32", "int32_t", None, "the longest key sequence of a varlen batch"),
    Attribute("extras", "string", "std::string_view", "",
              "the optional operands after the fixed ones, by name, comma-separated, in EXTRAS order"),
)}


@dataclasses.dataclass(frozen=True)
class Operand:
    """One operand or result. `shape` names dims symbolically; `dtype` "T" is the spec's dtype,
    "T|f32" the spec's dtype or f32, otherwise a fixed MLIR element type."""
    name: str
    shape: tuple[str, ...]
    dtype: str = "T"


# The optional operands of a call, in the order they follow the fixed operands: extra -> its operands.
# Bias and mask broadcast over batch and heads (a dim of 1).
EXTRAS = {
    "alibi": (Operand("alibi_slopes", ("Hq",), "f32"),),   # or [B, Hq]
    "bias": (Operand("bias", ("1|B", "1|Hq", "Sq", "Sk"), "T|f32"),),
    "mask": (Operand("mask", ("1|B", "1|Hq", "Sq", "Sk"), "i1"),),
    "segment_ids": (Operand("q_segment_ids", ("B", "Sq"), "i32"), Operand("kv_segment_ids", ("B", "Sk"), "i32")),
}


@dataclasses.dataclass(frozen=True)
class Call:
    """One direction of a spec: its fixed operands, results, attributes and the extras it takes."""
    direction: str
    operands: tuple[Operand, ...]
    results: tuple[Operand, ...]
    attributes: tuple[str, ...]
    extras: tuple[str, ...]          # the EXTRAS this call accepts
    dbias: bool = False              # with a bias, one more result (optional): dbias, like the bias


_Q, _K, _V = Operand("q", ("B", "Sq", "Hq", "D")), Operand("k", ("B", "Sk", "Hkv", "D")), \
    Operand("v", ("B", "Sk", "Hkv", "D"))
_O, _LSE = Operand("o", ("B", "Sq", "Hq", "D")), Operand("lse", ("B", "Hq", "Sq"), "f32")
_DO = Operand("do", ("B", "Sq", "Hq", "D"))
_PQ, _PK, _PV = Operand("q", ("Tq", "Hq", "D")), Operand("k", ("Tk", "Hkv", "D")), Operand("v", ("Tk", "Hkv", "D"))
_PO, _PLSE, _PDO = Operand("o", ("Tq", "Hq", "D")), Operand("lse", ("Hq", "Tq"), "f32"), Operand("do", ("Tq", "Hq", "D"))
_CU = (Operand("cu_seqlens_q", ("B+1",), "i32"), Operand("cu_seqlens_k", ("B+1",), "i32"))
_BASE = ("causal", "scale", "bottom_right", "window_left", "window_right", "softcap")
_DENSE = _BASE + ("extras",)
_VARLEN = _DENSE + ("max_seqlen_q", "max_seqlen_k")
_PACKED_EXTRAS = ("alibi",)

CALLS = {c.direction: c for c in (
    Call("fwd", (_Q, _K, _V), (_O, _LSE), _DENSE, tuple(EXTRAS)),
    Call("bwd", (_Q, _K, _V, _O, _LSE, _DO),
         (Operand("dq", _Q.shape), Operand("dk", _K.shape), Operand("dv", _V.shape)), _DENSE, tuple(EXTRAS),
         dbias=True),
    Call("fwd_varlen", (_PQ, _PK, _PV, *_CU), (_PO, _PLSE), _VARLEN, _PACKED_EXTRAS),
    Call("bwd_varlen", (_PQ, _PK, _PV, _PO, _PLSE, _PDO, *_CU),
         (Operand("dq", _PQ.shape), Operand("dk", _PK.shape), Operand("dv", _PV.shape)), _VARLEN, _PACKED_EXTRAS),
    Call("fwd_paged", (_Q, Operand("k_cache", ("NB", "BS", "Hkv", "D")), Operand("v_cache", ("NB", "BS", "Hkv", "D")),
                       Operand("block_table", ("B", "MB"), "i32"), Operand("seqused_k", ("B",), "i32")),
         (_O, _LSE), _DENSE, _PACKED_EXTRAS),
)}
DIRECTIONS = tuple(CALLS)


# ----------------------------------------------------------------------------------------
# Validation of attribute values (Python side; csrc validates the same on the C++ side).

def normalize_extras(extras) -> tuple[str, ...]:
    """The extras as a tuple in canonical order; ValueError for unknown or repeated names."""
    if extras is None or extras == "":
        return ()
    names = extras.split(",") if isinstance(extras, str) else list(extras)
    unknown = [n for n in names if n not in EXTRAS]
    if unknown:
        raise ValueError(f"unknown extras {unknown}: supported are {', '.join(EXTRAS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"extras repeat a name: {names}")
    return tuple(n for n in EXTRAS if n in names)


def extra_operand_index(extras, name: str) -> int:
    """Where extra `name`'s first operand sits among the extra operands of a call whose
    (normalized) extras are `extras`."""
    return sum(len(EXTRAS[e]) for e in extras[:extras.index(name)])


def normalize_window(window) -> tuple[int, int]:
    """(left, right) as Python ints >= -1 (-1 = unbounded); None means unbounded on both sides."""
    if window is None:
        return ATTRIBUTES["window_left"].default, ATTRIBUTES["window_right"].default
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be a pair (left, right), got {window!r}") from None
    out = []
    for name, x in (("left", left), ("right", right)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise ValueError(f"window {name} must be a Python int (-1 = unbounded), got {x!r}")
        x = int(x)
        if not -1 <= x < 2**31:
            raise ValueError(f"window {name} must be in [-1, 2^31), got {x}")
        out.append(x)
    return out[0], out[1]


def normalize_scale(scale) -> float:
    """scale as a Python float that is exact in f32, finite, positive and normal."""
    s = float(np.float32(scale))
    if not (s > 0 and math.isfinite(s)):
        raise ValueError(f"scale must be a finite positive f32, got {scale}")
    if s < np.finfo(np.float32).tiny:  # flushed to zero by XLA's CPU threads, as softcap below
        raise ValueError(f"scale {scale} is below the smallest normal f32 "
                         f"({np.finfo(np.float32).tiny:.8g})")
    return s


def normalize_softcap(softcap) -> float:
    """softcap as a Python float that is exact in f32, finite and >= 0 (0 = off)."""
    if softcap is None:
        return ATTRIBUTES["softcap"].default
    if hasattr(softcap, "aval"):
        raise TypeError("softcap must be a Python number (a compile-time attribute), not a traced value")
    c = float(np.float32(softcap))
    if not (c >= 0 and math.isfinite(c)):
        raise ValueError(f"softcap must be finite and >= 0 (0 = off), got {softcap}")
    if 0 < c < np.finfo(np.float32).tiny:
        # XLA's CPU threads flush subnormals to zero: the kernels would see softcap = 0 (off).
        raise ValueError(f"softcap {softcap} is below the smallest normal f32 "
                         f"({np.finfo(np.float32).tiny:.8g}); use 0 for no softcap")
    return c
