"""Instruction semantics, one module per family. Each family registers compile functions:
`compile(ins, operands) -> run(warp, mask)`, where mask is None when all 32 lanes execute.
An opcode or form without a handler is an EmulationError when the kernel is compiled, before any
instruction runs. Control flow (bra, ret, bar.sync) is the machine's own (machine.py)."""
from __future__ import annotations

from flashgen.emulate.semantics.registry import (HANDLERS, PER_WARP, compile_instruction, handles,
                                                 require_full_warp, unsupported)
# the families; importing them fills HANDLERS through @handles
from flashgen.emulate.semantics import arith, data, memops, warpops  # noqa: F401
from flashgen.emulate.semantics import hopper_sync, hopper_warp, tma, wgmma  # noqa: F401  (Hopper; tma after memops)

__all__ = ["HANDLERS", "PER_WARP", "compile_instruction", "handles", "require_full_warp", "unsupported",
           "arith", "data", "memops", "warpops"]
