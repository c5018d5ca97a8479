"""The emulation runtime (libflashgen_emu, csrc/flashgen/emulate), loaded once per process with
the prototypes of the emulator's C helpers: shared-memory word indices and the race detector's
bookkeeping (shared_memory_emu.cc, for memory.py) and mma.sync's arithmetic (mma_emu.cc, for
semantics/warpops.py). It is built on first use and cached by content like any object
(flashgen.build.emulation_runtime)."""
from __future__ import annotations

import ctypes
import functools

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def runtime() -> ctypes.CDLL:
    from flashgen.build import emulation_runtime     # deferred: flashgen.build imports much more
    rt = ctypes.CDLL(str(emulation_runtime()), mode=ctypes.RTLD_GLOBAL)
    for fn in (rt.flashgen_emu_race_read, rt.flashgen_emu_race_write):
        fn.restype = _I64
        fn.argtypes = [_PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR] + [_I64] * (fn is rt.flashgen_emu_race_write)
    rt.flashgen_emu_shared_words.restype = _I64
    rt.flashgen_emu_shared_words.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR]
    rt.flashgen_emu_mma.restype = None
    rt.flashgen_emu_mma.argtypes = [_I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR]
    return rt
