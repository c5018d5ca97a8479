"""The handler registry: PTX opcode -> compile function, filled by the family modules' @handles."""
from __future__ import annotations

import numpy as np

from flashgen.emulate.errors import EmulationError

HANDLERS: dict = {}
# Opcodes whose handlers are warp-collective or act on the warp's own state (cp.async groups,
# __syncwarp counts). The machine runs every other handler over any lanes of a gang of warps --
# of several CTAs, standing at different pcs -- with a mask of the executing lanes; these it runs
# warp by warp, each with its own executing lanes, whenever not every lane of the gang executes.
PER_WARP: set = set()


def handles(*opcodes, per_warp=False):
    def register(fn):
        for op in opcodes:
            HANDLERS[op] = fn
            if per_warp:
                PER_WARP.add(op)
        return fn
    return register


def unsupported(ins, why: str = "") -> EmulationError:
    return EmulationError(f"unimplemented PTX form {ins.form}{': ' + why if why else ''}")


def require_full_warp(w, m, ins) -> None:
    """.sync.aligned ops must be executed by all 32 lanes of a converged warp (`m`: the executing
    lanes of a warp or gang, each of its warps in full or not at all, or None)."""
    if w.lane_pc is not None or (m is not None and splits_a_warp(m)):
        raise EmulationError(f"{ins.form} executed by a diverged or partial warp "
                             f"(.sync.aligned requires all 32 lanes to execute it together)")


def executing_warps(w, m) -> list:
    """The warps of `w` (a warp or a gang) with a lane in `m`."""
    return list(w.members) if m is None else [x for x, bits in zip(w.members, warp_bits(m)) if bits]


def warp_bits(lanes) -> np.ndarray:
    """One uint32 per warp of a lane mask, its lanes' bits (in some fixed order): the per-warp
    tests of the machine's hot paths are then one compare each, not a reshape and two reductions."""
    return np.packbits(lanes).view(np.uint32)


def splits_a_warp(lanes, within=None) -> bool:
    """Whether some warp has lanes both in and out of `lanes` (among its lanes `within`; None: all 32)."""
    bits = warp_bits(lanes)
    full = _ALL_LANES if within is None else warp_bits(within)
    return bool(np.count_nonzero((bits != 0) & (bits != full)))


_ALL_LANES = np.uint32(0xFFFFFFFF)


def compile_instruction(ins, operands):
    fn = HANDLERS.get(ins.opcode)
    if fn is None:
        raise unsupported(ins, "no handler for this opcode")
    return fn(ins, operands)
