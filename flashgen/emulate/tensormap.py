"""A stand-in for the driver's cuTensorMapEncodeTiled: the real CUtensorMap is 128 opaque bytes,
so the emulator's map records the arguments themselves (checked as the driver documents them in
cuda.h) in a layout of its own, which the TMA instructions (semantics/tma.py) decode. A C++ stand-in
of the driver call can write the same bytes.

Layout (little-endian): magic u64 | data type u8, rank u8, interleave u8, swizzle u8, L2 promotion
u8, OOB fill u8, 2 pad | global address u64 | global dims u64 x 5 | global strides (bytes, of
dims 1..rank-1) u64 x 4 | box dims u32 x 5 | element strides u8 x 5 | pad to 128.
"""
from __future__ import annotations

import dataclasses
import struct

from flashgen.emulate.errors import EmulationError

MAGIC = int.from_bytes(b"FGTMAP01", "little")
_FORMAT = struct.Struct("<Q6B2xQ5Q4Q5I5B7x")
assert _FORMAT.size == 128
# CUtensorMapDataType (cuda.h): enum value -> element bytes; the floating-point ones may fill NaN
ELEMENT_BYTES = {0: 1, 1: 2, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2, 10: 4, 11: 4, 12: 4}
FLOAT_TYPES = {6, 7, 8, 9, 10, 11, 12}
SWIZZLE_BYTES = {0: 0, 1: 32, 2: 64, 3: 128}          # CU_TENSOR_MAP_SWIZZLE_NONE/32B/64B/128B
OOB_NAN = 1                                           # CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA


@dataclasses.dataclass(frozen=True)
class TensorMap:
    dtype: int
    rank: int
    address: int
    dims: tuple            # elements, innermost first
    strides: tuple         # bytes of dims 1..rank-1
    box: tuple
    element_strides: tuple
    interleave: int = 0
    swizzle: int = 0
    l2_promotion: int = 0
    oob_fill: int = 0

    @property
    def elem(self) -> int:
        return ELEMENT_BYTES[self.dtype]

    @property
    def swizzle_bytes(self) -> int:
        return SWIZZLE_BYTES[self.swizzle]

    def box_shape(self) -> tuple:
        """Elements the box holds per dimension, innermost first (ceil(box / element stride))."""
        return tuple(-(-b // s) for b, s in zip(self.box, self.element_strides))

    def box_bytes(self) -> int:
        n = self.elem
        for x in self.box_shape():
            n *= x
        return n


def encode_tiled(dtype: int, rank: int, address: int, dims, strides, box, element_strides, interleave: int = 0,
                 swizzle: int = 0, l2_promotion: int = 0, oob_fill: int = 0) -> bytes:
    """cuTensorMapEncodeTiled's arguments, checked as cuda.h documents them -> the 128-byte map."""
    m = TensorMap(dtype, rank, address, tuple(int(x) for x in dims), tuple(int(x) for x in strides),
                  tuple(int(x) for x in box), tuple(int(x) for x in element_strides), interleave, swizzle,
                  l2_promotion, oob_fill)
    _check(m)
    pad = lambda xs, n: list(xs) + [0] * (n - len(xs))            # noqa: E731
    return _FORMAT.pack(MAGIC, dtype, rank, interleave, swizzle, l2_promotion, oob_fill, address,
                        *pad(m.dims, 5), *pad(m.strides, 4), *pad(m.box, 5), *pad(m.element_strides, 5))


def decode(raw: bytes) -> TensorMap:
    f = _FORMAT.unpack(bytes(raw))
    if f[0] != MAGIC:
        raise EmulationError("the tensor map operand is not a map made by cuTensorMapEncodeTiled's stand-in "
                             "(flashgen.emulate.tensormap.encode_tiled): wrong address or uninitialized map")
    dtype, rank, interleave, swizzle, l2, oob, address = f[1:8]
    dims, strides, box, es = f[8:13], f[13:17], f[17:22], f[22:27]
    return TensorMap(dtype, rank, address, dims[:rank], strides[:rank - 1], box[:rank], es[:rank], interleave,
                     swizzle, l2, oob)


def _check(m: TensorMap) -> None:
    def bad(why):
        raise EmulationError(f"cuTensorMapEncodeTiled: {why}")
    if m.dtype not in ELEMENT_BYTES:
        bad(f"data type {m.dtype} is not modelled (only the byte-sized types 0-12)")
    if not 1 <= m.rank <= 5:
        bad(f"rank {m.rank} (must be 1 to 5)")
    if m.interleave != 0:
        bad("interleaved layouts are not modelled (CU_TENSOR_MAP_INTERLEAVE_NONE only)")
    if m.swizzle not in SWIZZLE_BYTES:
        bad(f"swizzle mode {m.swizzle} is not modelled (NONE, 32B, 64B, 128B)")
    if m.oob_fill not in (0, OOB_NAN) or (m.oob_fill == OOB_NAN and m.dtype not in FLOAT_TYPES):
        bad(f"OOB fill {m.oob_fill} for data type {m.dtype} (NaN fill needs a floating-point type)")
    if not 0 <= m.l2_promotion <= 3:
        bad(f"L2 promotion {m.l2_promotion}")
    lengths = {"global dims": m.dims, "box dims": m.box, "element strides": m.element_strides}
    for name, xs in lengths.items():
        if len(xs) != m.rank:
            bad(f"{len(xs)} {name} for rank {m.rank}")
    if len(m.strides) != m.rank - 1:
        bad(f"{len(m.strides)} global strides for rank {m.rank} (rank - 1 expected)")
    if m.address % 16:
        bad(f"global address {m.address:#x} is not 16-byte aligned")
    if any(not 0 < d <= 1 << 32 for d in m.dims):
        bad(f"global dims {m.dims} (each must be in (0, 2^32])")
    if any(s % 16 or not 0 < s < 1 << 40 for s in m.strides):
        bad(f"global strides {m.strides} (each a positive multiple of 16 below 2^40)")
    if m.strides and m.strides[0] < m.dims[0] * m.elem:
        bad(f"global stride {m.strides[0]} is less than a row of {m.dims[0]} elements")
    if any(not 0 < b <= 256 for b in m.box):
        bad(f"box dims {m.box} (each must be in (0, 256])")
    if m.box[0] * m.elem % 16:
        bad(f"box inner dimension of {m.box[0] * m.elem} bytes is not a multiple of 16")
    if any(not 0 < s <= 8 for s in m.element_strides):
        bad(f"element strides {m.element_strides} (each must be in (0, 8])")
    if m.element_strides[0] != 1:
        bad("element stride of dimension 0 must be 1 (TMA ignores it; say so explicitly)")
    if m.swizzle and m.box[0] * m.elem != m.swizzle_bytes:
        bad(f"box inner dimension of {m.box[0] * m.elem} bytes with a {m.swizzle_bytes}-byte swizzle: only a "
            f"box row of exactly the swizzle span is modelled (the driver allows narrower)")
