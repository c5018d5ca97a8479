"""KernelSpec: the few properties that change a kernel's shape.

Everything else (scale, causal alignment, sliding window, softcap, batch,
sequence lengths, head counts) is a runtime argument of the custom call, so one
compiled specialization serves every model with the same head dim, dtype and
causal flag. A field is added here only for what changes a kernel's shape.
"""
from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from flashgen import targets

HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
DTYPES = ("f16", "bf16", "f32")
# Kernel entry points of one spec: dense BSHD forward/backward, packed variable-length
# forward/backward, and the paged-KV forward (decode). README "Variants" has their operands.
DIRECTIONS = ("fwd", "bwd", "fwd_varlen", "bwd_varlen", "fwd_paged")

# numpy / jax dtype names that map onto flashgen dtypes.
_DTYPE_ALIASES = {
    "f16": "f16", "float16": "f16", "half": "f16",
    "bf16": "bf16", "bfloat16": "bf16",
    "f32": "f32", "float32": "f32", "float": "f32",
}

FFI_DTYPES = {"f16": "F16", "bf16": "BF16", "f32": "F32"}


def normalize_dtype(dtype) -> str:
    """Map a dtype (a string, numpy or jax dtype) to 'f16' | 'bf16' | 'f32'."""
    name = getattr(dtype, "name", None) or str(dtype)
    try:
        return _DTYPE_ALIASES[name.lower()]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {name!r}: flashgen supports {', '.join(DTYPES)}") from None


def target_name(direction: str, head_dim: int, dtype: str, causal: bool) -> str:
    """The stable custom-call target (and C symbol) of one direction of one spec.

    The name carries no architecture: a rewritten module calls the same
    target on CPU and CUDA, and whichever library is loaded serves it.
    """
    return f"flashgen_{direction}_d{head_dim}_{dtype}{'_causal' if causal else ''}"


_TARGET_NAME = re.compile(r"^flashgen_(fwd|bwd|fwd_varlen|bwd_varlen|fwd_paged)_d(\d+)_(f16|bf16|f32)(_causal)?$")


def parse_target_name(name: str):
    """(direction, head_dim, dtype, causal) of a flashgen target name, or None."""
    m = _TARGET_NAME.match(name)
    if not m or int(m.group(2)) not in HEAD_DIMS:
        return None
    return m.group(1), int(m.group(2)), m.group(3), bool(m.group(4))


@dataclasses.dataclass(frozen=True, order=True)
class KernelSpec:
    head_dim: int
    dtype: str = "bf16"
    causal: bool = False
    target: str = "cpu"

    def __post_init__(self):
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int):
            raise ValueError(f"head_dim must be an int, got {self.head_dim!r}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(
                f"unsupported head_dim {self.head_dim}: supported head dims are "
                f"{', '.join(map(str, HEAD_DIMS))}")
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal must be a bool, got {self.causal!r}")
        targets.lookup(self.target)

    @property
    def platform(self) -> str:
        """The JAX/XLA platform that runs this spec's handlers."""
        return targets.lookup(self.target).platform

    def target_name(self, direction: str) -> str:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        return target_name(direction, self.head_dim, self.dtype, self.causal)

    @property
    def stem(self) -> str:
        """A file-name-safe id built only from validated fields."""
        return f"d{self.head_dim}_{self.dtype}_{'causal' if self.causal else 'full'}_{self.target}"

    def to_json(self) -> dict:
        return {
            "head_dim": self.head_dim, "dtype": self.dtype, "causal": self.causal,
            "target": self.target,
            "targets": {d: self.target_name(d) for d in DIRECTIONS},
        }


# The attribute schema every flashgen handler decodes (name -> MLIR type). Every
# attribute is passed on every call (an XLA FFI handler rejects missing or extra ones).
# Sliding window and softcap are runtime attributes, not KernelSpec fields: they change
# which blocks are visited and one elementwise step, not the kernel's shape, so one
# compiled specialization serves every window and cap.
#   window_left / window_right: -1 = unbounded; key j visible to query i iff
#     j >= i + off - left and j <= i + off + right (off as for causal; causal => right = 0)
#   softcap: 0 = off; scaled scores x -> softcap * tanh(x / softcap)
BASE_ATTRIBUTES = {"causal": "i1", "scale": "f32", "bottom_right": "i1",
                   "window_left": "i32", "window_right": "i32", "softcap": "f32"}
# Every target also takes `extras`: the optional operands after the fixed ones, by name
# (varlen and paged targets: only "alibi").
ATTRIBUTE_SCHEMA = {**BASE_ATTRIBUTES, "extras": "string"}
# Per direction: varlen adds the length bounds.
ATTRIBUTES = {
    "fwd": ATTRIBUTE_SCHEMA, "bwd": ATTRIBUTE_SCHEMA,
    "fwd_varlen": {**ATTRIBUTE_SCHEMA, "max_seqlen_q": "i32", "max_seqlen_k": "i32"},
    "bwd_varlen": {**ATTRIBUTE_SCHEMA, "max_seqlen_q": "i32", "max_seqlen_k": "i32"},
    "fwd_paged": ATTRIBUTE_SCHEMA,
}
# The extras a varlen or paged target takes.
PACKED_EXTRAS = ("alibi",)

# The optional operands of the dense targets, in the order they follow the fixed operands
# (README "Variants"): name -> the operands it adds.
EXTRAS = {
    "alibi": ("alibi_slopes",),
    "bias": ("bias",),
    "mask": ("mask",),
    "segment_ids": ("q_segment_ids", "kv_segment_ids"),
}


def extra_operand_index(extras, name: str) -> int:
    """Where extra `name`'s first operand sits among the extra operands of a call whose
    (normalized) extras are `extras`."""
    return sum(len(EXTRAS[e]) for e in extras[:extras.index(name)])


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

# Defaults of the runtime attributes that KernelSpec does not fix.
DEFAULT_WINDOW = (-1, -1)
DEFAULT_SOFTCAP = 0.0


def normalize_window(window) -> tuple[int, int]:
    """(left, right) as Python ints >= -1 (-1 = unbounded); None means (-1, -1)."""
    if window is None:
        return DEFAULT_WINDOW
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
        return DEFAULT_SOFTCAP
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


# Operands and results, per direction, in call order ("*extras": the operands `extras` names).
SIGNATURES = {
    "fwd": {
        "operands": ["q[B,Sq,Hq,D]", "k[B,Sk,Hkv,D]", "v[B,Sk,Hkv,D]", "*extras"],
        "results": ["o[B,Sq,Hq,D]", "lse[B,Hq,Sq]:f32"],
    },
    "bwd": {
        "operands": ["q", "k", "v", "o", "lse:f32", "do", "*extras"],
        "results": ["dq", "dk", "dv", "dbias (optional, only with extras bias)"],
    },
    "fwd_varlen": {
        "operands": ["q[Tq,Hq,D]", "k[Tk,Hkv,D]", "v[Tk,Hkv,D]", "cu_seqlens_q[B+1]:i32",
                     "cu_seqlens_k[B+1]:i32", "*extras"],
        "results": ["o[Tq,Hq,D]", "lse[Hq,Tq]:f32"],
    },
    "bwd_varlen": {
        "operands": ["q", "k", "v", "o", "lse:f32", "do", "cu_seqlens_q:i32", "cu_seqlens_k:i32",
                     "*extras"],
        "results": ["dq", "dk", "dv"],
    },
    "fwd_paged": {
        "operands": ["q[B,Sq,Hq,D]", "k_cache[NB,BS,Hkv,D]", "v_cache[NB,BS,Hkv,D]",
                     "block_table[B,MB]:i32", "seqused_k[B]:i32", "*extras"],
        "results": ["o[B,Sq,Hq,D]", "lse[B,Hq,Sq]:f32"],
    },
}
