"""The handler registry: PTX opcode -> compile function, filled by the family modules' @handles."""
from __future__ import annotations

from flashgen.emulate.errors import EmulationError

HANDLERS: dict = {}
# How far an opcode's handler reaches beyond its lanes' registers (bits of SCOPES[opcode]). The
# machine runs a handler over the warps of several CTAs in one step unless it touches CTA_STATE
# (shared and global memory, parameters, cp.async groups: then one CTA after the other), and over
# warps whose lanes stand at different pcs unless it is PER_WARP (a warp-collective op, or one on
# the warp's own state: then warp by warp, each with its own executing lanes).
CTA_STATE, PER_WARP = 1, 2
SCOPES: dict = {}       # opcode -> bits, or a function of the instruction giving them


def scope(ins) -> int:
    s = SCOPES[ins.opcode]
    return s(ins) if callable(s) else s


def handles(*opcodes, scope=0):
    def register(fn):
        for op in opcodes:
            HANDLERS[op] = fn
            SCOPES[op] = scope
        return fn
    return register


def unsupported(ins, why: str = "") -> EmulationError:
    return EmulationError(f"unimplemented PTX form {ins.form}{': ' + why if why else ''}")


def require_full_warp(w, m, ins) -> None:
    """.sync.aligned ops must be executed by all 32 lanes of a converged warp."""
    if m is not None or w.lane_pc is not None:
        raise EmulationError(f"{ins.form} executed by a diverged or partial warp "
                             f"(.sync.aligned requires all 32 lanes to execute it together)")


def compile_instruction(ins, operands):
    fn = HANDLERS.get(ins.opcode)
    if fn is None:
        raise unsupported(ins, "no handler for this opcode")
    return fn(ins, operands)
