"""The handler registry: PTX opcode -> compile function, filled by the family modules' @handles."""
from __future__ import annotations

from flashgen.emulate.errors import EmulationError

HANDLERS: dict = {}


def handles(*opcodes):
    def register(fn):
        for op in opcodes:
            HANDLERS[op] = fn
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
