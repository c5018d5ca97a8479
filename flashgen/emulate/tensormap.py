"""The emulator's tensor maps. The real CUtensorMap that the driver's cuTensorMapEncodeTiled
makes is 128 opaque bytes; the emulation runtime's stand-in for that call
(csrc/flashgen/emulate/tensormap_emu.cc, where the driver's documented rules are checked)
records the arguments themselves, which decode() reads back for the TMA instructions
(semantics/tma.py). encode_tiled() calls the same stand-in from Python.

Layout (little-endian): magic u64 | data type u8, rank u8, interleave u8, swizzle u8, L2 promotion
u8, OOB fill u8, 2 pad | global address u64 | global dims u64 x 5 | global strides (bytes, of
dims 1..rank-1) u64 x 4 | box dims u32 x 5 | element strides u8 x 5 | pad to 128.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import struct

import numpy as np

from flashgen.emulate.errors import EmulationError

MAGIC = int.from_bytes(b"FGTMAP01", "little")
_FORMAT = struct.Struct("<Q6B2xQ5Q4Q5I5B7x")        # tensormap_emu.cc's Recorded
assert _FORMAT.size == 128
# CUtensorMapDataType (cuda.h): enum value -> element bytes
ELEMENT_BYTES = {0: 1, 1: 2, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2, 10: 4, 11: 4, 12: 4}
SWIZZLE_BYTES = {0: 0, 1: 32, 2: 64, 3: 128}          # CU_TENSOR_MAP_SWIZZLE_NONE/32B/64B/128B


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
    """cuTensorMapEncodeTiled (the emulation runtime's stand-in) -> the 128-byte map."""
    lengths = {"global dims": (dims, rank), "global strides": (strides, rank - 1), "box dims": (box, rank),
               "element strides": (element_strides, rank)}
    for name, (xs, n) in lengths.items():
        if len(xs) != max(n, 0):
            raise EmulationError(f"cuTensorMapEncodeTiled: {len(xs)} {name} for rank {rank}")
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    buf = np.zeros(128 + 64, np.uint8)
    at = buf.ctypes.data + (-buf.ctypes.data % 64)
    rt = _runtime()
    n = max(5, rank)
    err = rt.cuTensorMapEncodeTiled(at, dtype, rank, address, (u64 * n)(*dims), (u64 * n)(*strides), (u32 * n)(*box),
                                    (u32 * n)(*element_strides), interleave, swizzle, l2_promotion, oob_fill)
    if err:
        raise EmulationError(rt.flashgen_emu_tensormap_error().decode())
    return ctypes.string_at(at, 128)


@functools.cache
def _runtime() -> ctypes.CDLL:
    from flashgen.build import emulation_runtime     # builds it once (cached), as flashgen.emulate.host does
    rt = ctypes.CDLL(str(emulation_runtime()), mode=ctypes.RTLD_GLOBAL)
    rt.cuTensorMapEncodeTiled.restype = ctypes.c_int
    rt.cuTensorMapEncodeTiled.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p] + \
        [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    rt.flashgen_emu_tensormap_error.restype = ctypes.c_char_p
    return rt


def decode(raw: bytes) -> TensorMap:
    f = _FORMAT.unpack(bytes(raw))
    if f[0] != MAGIC:
        raise EmulationError("the tensor map operand is not a map made by cuTensorMapEncodeTiled's stand-in "
                             "(flashgen.emulate.tensormap.encode_tiled): wrong address or uninitialized map")
    dtype, rank, interleave, swizzle, l2, oob, address = f[1:8]
    dims, strides, box, es = f[8:13], f[13:17], f[17:22], f[22:27]
    return TensorMap(dtype, rank, address, dims[:rank], strides[:rank - 1], box[:rank], es[:rank], interleave,
                     swizzle, l2, oob)
