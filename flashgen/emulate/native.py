"""The emulator's native module (csrc/flashgen/emulate/native, built on first use and cached by
content like any object: flashgen.build.emulation_native): shared-memory word indices and the
race detector's bookkeeping (shared_memory_emu.cc, for memory.py), mma.sync's arithmetic
(mma_emu.cc, for semantics/warpops.py), and ex2.approx and the bf16 pair packing (numerics_emu.cc,
for semantics/arith.py and data.py), as functions taking numpy arrays."""
from __future__ import annotations

import functools
import importlib.machinery
import importlib.util


@functools.cache
def module():
    from flashgen.build import emulation_native     # deferred: flashgen.build imports much more
    name, path = "flashgen_emu_native", str(emulation_native())
    spec = importlib.util.spec_from_file_location(name, path, loader=importlib.machinery.ExtensionFileLoader(name, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
