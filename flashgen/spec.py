"""KernelSpec: the few properties that change a kernel's shape.

Everything else (the call's attributes, flashgen.contract.ATTRIBUTES; batch,
sequence lengths, head counts) is a runtime argument of the custom call, so one
compiled specialization serves every model with the same head dim, dtype and
causal flag. A field is added here only for what changes a kernel's shape.
"""
from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple

from flashgen import targets

HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)


def kernel_head_dim(head_dim: int) -> int:
    """The smallest kernel head dim >= head_dim: a model's head dim between the kernels' runs
    at it with zero columns added to Q, K, V (they change no score and add output columns
    that are sliced off)."""
    for d in HEAD_DIMS:
        if d >= head_dim >= 1:
            return d
    raise ValueError(f"unsupported head_dim {head_dim}: supported head dims are "
                     f"{', '.join(map(str, HEAD_DIMS))} (a smaller one is zero-padded to the next)")


def kernel_head_dims(head_dim: int, head_dim_v: int, target: str) -> tuple[int, int]:
    """The (head_dim, head_dim_v) of the kernel a model's query/key and value head dims run at:
    each its kernel_head_dim; where `target` has no kernels for differing ones, both the larger
    (exact too: zero columns of q and k change no score, those of v add output columns)."""
    d, dv = kernel_head_dim(head_dim), kernel_head_dim(head_dim_v)
    if d != dv and not targets.lookup(target).family.split_head_dims:
        d = dv = max(d, dv)
    return d, dv


DTYPES = ("f16", "bf16", "f32")
# Kernel entry points of one spec: dense BSHD forward/backward, packed variable-length
# forward/backward, and the paged-KV forward (decode). README "Variants" has their operands.
# FP8_DTYPES: element types with the FP8 forward alone (contract.FP8_CALLS), on the targets
# whose family has it (targets.fp8_targets).
from flashgen.contract import DIRECTIONS, FP8_DTYPES, calls  # noqa: E402

# numpy / jax dtype names that map onto flashgen dtypes.
_DTYPE_ALIASES = {
    "f16": "f16", "float16": "f16", "half": "f16",
    "bf16": "bf16", "bfloat16": "bf16",
    "f32": "f32", "float32": "f32", "float": "f32",
    "e4m3": "e4m3", "float8_e4m3fn": "e4m3", "f8e4m3fn": "e4m3",
}

# The FP8 kernel's head dims: whole 64-byte swizzle panels of e4m3 (cuda/hopper/fwd.cuh).
FP8_HEAD_DIMS = (64, 128, 192, 256)

FFI_DTYPES = {"f16": "F16", "bf16": "BF16", "f32": "F32", "e4m3": "F8E4M3FN"}


# flashgen dtype -> numpy's (ml_dtypes') name of it.
_NUMPY_NAMES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "e4m3": "float8_e4m3fn"}


def numpy_name(dtype: str) -> str:
    """numpy's name ("bfloat16") of a flashgen dtype ("bf16")."""
    return _NUMPY_NAMES[normalize_dtype(dtype)]


def normalize_dtype(dtype) -> str:
    """Map a dtype (a string, numpy or jax dtype) to 'f16' | 'bf16' | 'f32' | 'e4m3'."""
    name = getattr(dtype, "name", None) or str(dtype)
    try:
        return _DTYPE_ALIASES[name.lower()]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {name!r}: flashgen supports {', '.join(DTYPES + FP8_DTYPES)}") from None


def _dims_name(head_dim: int, head_dim_v: int | None) -> str:
    """`d<D>`, or `d<D>v<Dv>` when the value head dim differs (names of equal dims unchanged)."""
    return f"d{head_dim}" + ("" if head_dim_v in (None, head_dim) else f"v{head_dim_v}")


def target_name(direction: str, head_dim: int, dtype: str, causal: bool, head_dim_v: int | None = None) -> str:
    """The stable custom-call target (and C symbol) of one direction of one spec.

    The name carries no architecture: a rewritten module calls the same
    target on CPU and CUDA, and whichever library is loaded serves it.
    """
    return f"flashgen_{direction}_{_dims_name(head_dim, head_dim_v)}_{dtype}{'_causal' if causal else ''}"


_TARGET_NAME = re.compile(
    r"^flashgen_(fwd|bwd|fwd_varlen|bwd_varlen|fwd_paged)_d(\d+)(?:v(\d+))?_(f16|bf16|f32|e4m3)(_causal)?$")


class ParsedTarget(NamedTuple):
    direction: str
    head_dim: int
    dtype: str
    causal: bool
    head_dim_v: int


def parse_target_name(name: str) -> ParsedTarget | None:
    """The fields of a flashgen target name, or None (also for a head-dim pair no kernel has)."""
    m = _TARGET_NAME.match(name)
    if not m:
        return None
    d, dv = int(m.group(2)), int(m.group(3) or m.group(2))
    if d not in HEAD_DIMS or dv not in HEAD_DIMS or (m.group(3) and dv == d):
        return None
    if m.group(1) not in calls(m.group(4)):
        return None
    return ParsedTarget(m.group(1), d, m.group(4), bool(m.group(5)), dv)


@dataclasses.dataclass(frozen=True, order=True)
class KernelSpec:
    head_dim: int
    dtype: str = "bf16"
    causal: bool = False
    target: str = "cpu"
    # The last dim of V, O, dO and dV (None: head_dim). A different one is a kernel variant of
    # its own (DeepSeek's MLA: 192 for Q/K, 128 for V), on the families whose split_head_dims is set.
    head_dim_v: int | None = None

    def __post_init__(self):
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int):
            raise ValueError(f"head_dim must be an int, got {self.head_dim!r}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(
                f"unsupported head_dim {self.head_dim}: supported head dims are "
                f"{', '.join(map(str, HEAD_DIMS))}")
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        if isinstance(self.head_dim_v, bool) or not isinstance(self.head_dim_v, int):
            raise ValueError(f"head_dim_v must be an int, got {self.head_dim_v!r}")
        if self.head_dim_v not in HEAD_DIMS:
            raise ValueError(f"unsupported head_dim_v {self.head_dim_v}: supported head dims are "
                             f"{', '.join(map(str, HEAD_DIMS))}")
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal must be a bool, got {self.causal!r}")
        family = targets.lookup(self.target).family
        if self.head_dim_v != self.head_dim and not family.split_head_dims:
            raise ValueError(f"head_dim_v {self.head_dim_v} != head_dim {self.head_dim}: target {self.target} "
                             f"has no kernels for a value head dim other than the query/key one "
                             f"(targets with them: {', '.join(targets.split_head_dim_targets())})")
        if self.dtype in FP8_DTYPES and not family.fp8_forward:
            raise ValueError(f"dtype {self.dtype} (FP8) has kernels only for target(s) "
                             f"{', '.join(targets.fp8_targets())}, not {self.target}: upcast the inputs "
                             f"(q.astype(f32) * q_descale, ...) to run them on {self.target}")
        if self.dtype in FP8_DTYPES and (self.head_dim_v != self.head_dim or self.head_dim not in FP8_HEAD_DIMS):
            raise ValueError(f"dtype {self.dtype} (FP8) has kernels for head dims {', '.join(map(str, FP8_HEAD_DIMS))} "
                             f"with head_dim_v == head_dim, got {self.head_dim} / {self.head_dim_v}")

    @property
    def directions(self) -> tuple[str, ...]:
        """The calls this spec has (contract.calls): every direction, or the FP8 forward alone."""
        return tuple(calls(self.dtype))

    @property
    def platform(self) -> str:
        """The JAX/XLA platform that runs this spec's handlers."""
        return targets.lookup(self.target).platform

    def target_name(self, direction: str) -> str:
        if direction not in self.directions:
            raise ValueError(f"direction must be one of {self.directions} for dtype {self.dtype}, got {direction!r}")
        return target_name(direction, self.head_dim, self.dtype, self.causal, self.head_dim_v)

    @property
    def stem(self) -> str:
        """A file-name-safe id built only from validated fields."""
        return f"{_dims_name(self.head_dim, self.head_dim_v)}_{self.dtype}_{'causal' if self.causal else 'full'}_{self.target}"

    def to_json(self) -> dict:
        out = {"head_dim": self.head_dim, "dtype": self.dtype, "causal": self.causal, "target": self.target,
               "targets": {d: self.target_name(d) for d in self.directions}}
        if self.head_dim_v != self.head_dim:  # equal dims: the manifest of before, byte for byte
            out["head_dim_v"] = self.head_dim_v
        return out

    @classmethod
    def from_json(cls, s: dict) -> "KernelSpec":
        return cls(s["head_dim"], s["dtype"], s["causal"], s["target"], s.get("head_dim_v"))
