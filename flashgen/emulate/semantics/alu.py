"""Runs of plain integer, f32 and predicate instructions as one native call (alu_emu.cc).

A kernel's straight runs (machine.py: unguarded instructions that every lane at the run's start
executes, one after the other) are mostly register arithmetic: index math, the softmax's f32
scalars, predicates. Run through the numpy handlers each is a Python call, a few numpy calls and
their ~1-5 µs; a Segment makes each stretch of forms that alu_emu.cc computes one call over all of
a gang's lanes. A form is taken only where alu_emu.cc computes what the numpy
handler (arith.py, data.py) does, bit for bit; anything else (other types or modifiers, special
registers, symbols, a register read or written at another width, a setp writing one of its own
sources) stays with its handler, which the machine still calls for a part of a run.
"""
from __future__ import annotations

import functools

import numpy as np

from flashgen.emulate import native
from flashgen.emulate.operands import UNSIGNED, immediate
from flashgen.emulate.ptx import TYPE_SIZES, Imm, Reg, RegPair

_FIELDS = 16                          # FlashgenEmuAluInstruction: 6 codes, 5 operands, 5 sizes
_INTEGER = {"u32", "s32", "b32", "u64", "s64", "b64"}
_ARITH = {"add": "kAluAdd", "sub": "kAluSub", "min": "kAluMin", "max": "kAluMax", "and": "kAluAnd", "or": "kAluOr",
          "xor": "kAluXor", "not": "kAluNot", "neg": "kAluNeg", "shl": "kAluShl", "shr": "kAluShr",
          "mul": "kAluMul", "mad": "kAluMad", "fma": "kAluMad"}
_FLOAT_CMP = ("eq", "ne", "lt", "le", "gt", "ge", "equ", "neu", "ltu", "leu", "gtu", "geu", "num", "nan")
_INT_CMP = {"eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge",
            "lo": "lt", "ls": "le", "hi": "gt", "hs": "ge"}      # by the type's signedness, as numpy's compare


@functools.cache
def _codes() -> dict:
    return native.module().alu_codes()


class _Encoder:
    """One segment's rows, registers and immediates, filled instruction by instruction."""

    def __init__(self, ops):
        self.ops, self.rows, self.registers, self.immediates = ops, [], {}, []

    def operand(self, op, ty: str):
        """(index, size) of a source or destination read or written as .`ty`; None if not native."""
        size = TYPE_SIZES[ty]
        if isinstance(op, Reg):
            rty = self.ops.reg_types.get(op.name)
            if rty is None or TYPE_SIZES[rty] != size or (rty == "pred") != (ty == "pred"):
                return None
            return self.registers.setdefault(op.name, len(self.registers)), size
        if isinstance(op, Imm):
            value = immediate(op.text, ty)
            bits = int(value) if ty == "pred" else int(np.array(value).view(UNSIGNED[size]))
            self.immediates.append(bits)
            return -len(self.immediates), size
        return None

    def add(self, ins) -> bool:
        """Encode `ins`; False (and nothing added) if alu_emu.cc does not take its form."""
        registers, immediates = len(self.registers), len(self.immediates)
        row = self._encode(ins)
        if row is None:         # forget the registers and immediates it added (a dict keeps their order)
            for name in list(self.registers)[registers:]:
                del self.registers[name]
            del self.immediates[immediates:]
            return False
        self.rows.append(row)
        return True

    def _row(self, op, kind, slots, *, aux="kCmpEq", signed=False, ftz=False, boolop="kBoolNone"):
        """slots: (operand, type) for d, a, b, c, q (None where the form has none)."""
        where, sizes = [], []
        for s in slots:
            e = (0, 0) if s is None else self.operand(*s)
            if e is None:
                return None
            where.append(e[0])
            sizes.append(e[1])
        c = _codes()
        return [c[op], c[kind], c[aux], int(signed), int(ftz), c[boolop], *where, *sizes]

    def _encode(self, ins):
        op, ty, mods, x = ins.opcode, ins.type(), ins.mods, ins.operands
        plain = mods == (ty,)
        if op == "mov" and plain and TYPE_SIZES[ty] in (1, 4, 8):
            return self._row("kAluMov", "kKindMove", [(x[0], ty), (x[1], ty), None, None, None])
        if op == "selp" and plain and TYPE_SIZES[ty] in (4, 8):
            return self._row("kAluSelp", "kKindMove", [(x[0], ty), (x[1], ty), (x[2], ty), (x[3], "pred"), None])
        if op == "cvta" and mods in (("to", "global", ty), ("global", ty)) and TYPE_SIZES[ty] == 8:
            return self._row("kAluMov", "kKindMove", [(x[0], ty), (x[1], ty), None, None, None])  # identity (data.py)
        if op == "cvt":
            return self._cvt(ins)
        if op == "setp":
            return self._setp(ins)
        if op not in _ARITH:
            return None
        if ty == "pred" and op in ("and", "or", "xor", "not") and plain:
            srcs = [(s, "pred") for s in x[1:]]
            return self._row(_ARITH[op], "kKindPred", [(x[0], "pred"), *srcs, *[None] * (5 - len(x))])
        if ty == "f32":
            return self._f32(ins)
        if ty not in _INTEGER:
            return None
        signed = ty.startswith("s")
        kind = "kKindInt32" if TYPE_SIZES[ty] == 4 else "kKindInt64"
        if op == "mul" and mods == ("wide", ty) and ty in ("s32", "u32"):
            wide = "s64" if signed else "u64"
            return self._row("kAluMulWide", "kKindWiden", [(x[0], wide), (x[1], ty), (x[2], ty), None, None],
                             signed=signed)
        if op in ("mul", "mad"):
            if mods != ("lo", ty):
                return None
        elif not plain or op == "fma" or (op in ("and", "or", "xor", "not") and ty[0] != "b") or \
                (op == "neg" and not signed):
            return None
        srcs = [(s, "u32" if (op in ("shl", "shr") and i == 1) else ty) for i, s in enumerate(x[1:])]
        return self._row(_ARITH[op], kind, [(x[0], ty), *srcs, *[None] * (5 - len(x))], signed=signed)

    def _f32(self, ins):
        op, mods, x = ins.opcode, set(ins.mods) - {"f32"}, ins.operands
        ftz = "ftz" in mods
        mods.discard("ftz")
        if op in ("add", "sub", "mul", "fma", "mad"):
            if not mods <= {"rn"} or (op == "fma" and mods != {"rn"}):
                return None
        elif op not in ("min", "max", "neg") or mods:
            return None
        srcs = [(s, "f32") for s in x[1:]]
        return self._row(_ARITH[op], "kKindF32", [(x[0], "f32"), *srcs, *[None] * (5 - len(x))], ftz=ftz)

    def _setp(self, ins):
        ty, mods, x = ins.type(), ins.mods, ins.operands
        cmp, rest = mods[0], set(mods[1:]) - {ty}
        boolop = next((m for m in rest if m in ("and", "or", "xor")), None)
        ftz = "ftz" in rest and ty == "f32"
        if rest - {boolop, "ftz"} or ("ftz" in rest and not ftz):
            return None
        p, q = (x[0].first, x[0].second) if isinstance(x[0], RegPair) else (x[0], None)
        sources = {s.name for s in x[1:] if isinstance(s, Reg)}
        if not isinstance(p, Reg) or p.name in sources or (q is not None and (q.name in sources or q.name == p.name)):
            return None
        if ty == "f32":
            if cmp not in _FLOAT_CMP:
                return None
            code, kind = cmp, "kKindSetpF32"
        elif ty in _INTEGER:
            if cmp not in _INT_CMP:
                return None
            code, kind = _INT_CMP[cmp], "kKindSetp32" if TYPE_SIZES[ty] == 4 else "kKindSetp64"
        else:
            return None
        c = (x[3], "pred") if boolop else None
        return self._row("kAluSetp", kind, [(p, "pred"), (x[1], ty), (x[2], ty), c, q and (q, "pred")],
                         aux="kCmp" + code.capitalize(), signed=ty.startswith("s"), ftz=ftz,
                         boolop="kBool" + (boolop or "none").capitalize())

    def _cvt(self, ins):
        types = [m for m in ins.mods if m in TYPE_SIZES]
        if len(types) != 2 or len(ins.mods) != 2 or not set(types) <= _INTEGER:
            return None
        dty, sty = types
        return self._row("kAluCvt", "kKindWiden", [(ins.operands[0], dty), (ins.operands[1], sty), None, None, None],
                         signed=sty.startswith("s"))



class Segment:
    """Instructions [start, end) of a straight run as rows of alu_emu.cc, run in whole or in part."""

    def __init__(self, start: int, enc: _Encoder):
        self.start, self.end = start, start + len(enc.rows)
        self.rows = np.array(enc.rows, np.int64).reshape(-1, _FIELDS)
        self.immediates = np.array(enc.immediates, np.uint64)
        self.names = tuple(enc.registers)
        self.alu = native.module().alu

    def run(self, w, m, first: int, stop: int):
        """Instructions [first, stop) of the segment over lanes `w` (a warp or a gang), mask `m`."""
        view = w.regs
        file = view.file
        registers = file.segments.get(self)      # the whole file's arrays: one list for every view
        if registers is None:
            registers = file.segments[self] = [file.array(r) for r in self.names]
        self.alu(self.rows[first - self.start:stop - self.start], self.immediates, m, view.lo, w.nlanes, *registers)


def segment(kernel, ops, first: int, end: int):
    """The Segment of the longest stretch from `first` (within a straight run that ends at `end`)
    that alu_emu.cc takes, or None if it does not take the instruction at `first`."""
    enc, pc = _Encoder(ops), first
    while pc < end and enc.add(kernel.instructions[pc]):
        pc += 1
    return Segment(first, enc) if pc > first else None
