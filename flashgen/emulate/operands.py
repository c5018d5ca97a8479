"""Compile PTX operands into fast per-warp accessors.

A reader is `f(lanes) -> ndarray[lanes.nlanes]` holding the operand as the instruction's type; a
writer is `f(lanes, value, mask)` storing a value of that type into a register (mask None = every
lane). `lanes` is one warp (32 lanes) or a gang of converged warps executing together (machine.py).
Registers live in `warp.regs` as numpy arrays of their declared type; a read or write with a type
of the same width reinterprets the bits (as PTX does), a narrower access truncates, and a write
of a narrower type into a wider register extends by the type's signedness.
"""
from __future__ import annotations

import collections

import numpy as np

from flashgen.emulate.errors import EmulationError
from flashgen.emulate.ptx import TYPE_SIZES, Addr, Imm, Kernel, Reg, RegPair, Special, Sym, TensorAddr, Vec, shared_layout

DTYPES = {
    "pred": np.bool_, "b8": np.uint8, "u8": np.uint8, "s8": np.int8,
    "b16": np.uint16, "u16": np.uint16, "s16": np.int16, "f16": np.uint16, "bf16": np.uint16,
    "b32": np.uint32, "u32": np.uint32, "s32": np.int32, "f32": np.float32,
    "f16x2": np.uint32, "bf16x2": np.uint32, "tf32": np.uint32, "e4m3x2": np.uint16,
    "b64": np.uint64, "u64": np.uint64, "s64": np.int64, "f64": np.float64,
}
UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def dtype_of(ty: str):
    try:
        return DTYPES[ty]
    except KeyError:
        raise EmulationError(f"unsupported PTX type .{ty}") from None


def immediate(text: str, ty: str):
    """The numpy scalar an immediate operand denotes for an instruction of type `ty`."""
    dt = dtype_of(ty)
    t = text.rstrip("U")
    neg = t.startswith("-")
    body = t[1:] if neg or t.startswith("+") else t
    if body[:2] in ("0f", "0F"):
        bits = np.array([int(body[2:], 16)], np.uint32)
        val = bits.view(np.float32)[0]
        if ty == "f32":
            return np.float32(-val if neg else val)
        if ty == "f64":
            return np.float64(-val if neg else val)
        if TYPE_SIZES[ty] == 4:
            return bits.view(dt)[0]
        raise EmulationError(f"f32 immediate {text} used as .{ty}")
    if body[:2] in ("0d", "0D"):
        bits = np.array([int(body[2:], 16)], np.uint64)
        val = bits.view(np.float64)[0]
        if ty == "f64":
            return np.float64(-val if neg else val)
        if ty == "f32":
            return np.float32(-val if neg else val)
        return bits.view(dt)[0]
    v = int(body, 0) * (-1 if neg else 1)
    if ty in ("f32", "f64"):
        return dt(v)
    if ty == "pred":
        return np.bool_(v)
    bits = 8 * TYPE_SIZES[ty]
    return np.array([v & ((1 << bits) - 1)], UNSIGNED[TYPE_SIZES[ty]]).view(dt)[0]


def constant(value, dt):
    """A reader of a value the same in every lane (read-only arrays, one per lane count, shared by
    every reader of the same bits: a kernel's first launch filled ~1,200 of them, most repeats)."""
    # the value's type and bits: -0.0 is not 0.0, and uint32 0x3F800000 is not float32 1.0
    key = (dt, type(value), value.tobytes() if isinstance(value, np.generic) else value)
    by_width = {}

    def read(w):
        c = by_width.get(w.nlanes)
        if c is None:
            c = by_width[w.nlanes] = _filled(key, value, w.nlanes)
        return c
    return read


_FILLED: dict = {}          # (dtype, value's type and bits, lanes) -> read-only array


def _filled(key, value, nlanes):
    c = _FILLED.get((key, nlanes))
    if c is None:
        c = _FILLED[(key, nlanes)] = np.full(nlanes, value, key[0])
        c.flags.writeable = False
    return c


class Operands:
    """Per-kernel operand compiler: knows the registers, shared symbols and parameters."""

    def __init__(self, kernel: Kernel):
        self.kernel = kernel
        self.reg_types = kernel.registers
        self.shared_addr = shared_layout(kernel.shared)[0]
        self.param_offset = {p.name: off for p, off in zip(kernel.params, kernel.param_offsets)}
        self._occurrences = None         # register name -> occurrences in the kernel (is_read)

    def reg_type(self, r: Reg) -> str:
        try:
            return self.reg_types[r.name]
        except KeyError:
            raise EmulationError(f"register {r.name} is not declared") from None

    # -- reads ---------------------------------------------------------------------------------
    def read(self, op, ty: str):
        dt = dtype_of(ty)
        if isinstance(op, Reg):
            name, rty = op.name, self.reg_type(op)
            rdt = dtype_of(rty)
            if rty == "pred" or ty == "pred":
                if rty != ty:
                    raise EmulationError(f"predicate {name} read as .{ty}")
                return lambda w: w.regs[name]
            rs, ts = TYPE_SIZES[rty], TYPE_SIZES[ty]     # (the dtypes' itemsizes, without np.dtype calls)
            if rdt == dt:
                return lambda w: w.regs[name]
            if rs == ts:
                return lambda w: w.regs[name].view(dt)
            if ts < rs:
                ru, tu = UNSIGNED[rs], UNSIGNED[ts]
                return lambda w: w.regs[name].view(ru).astype(tu).view(dt)
            raise EmulationError(f"register {name} (.{rty}) read as the wider .{ty}")
        if isinstance(op, Imm):
            return constant(immediate(op.text, ty), dt)
        if isinstance(op, Special):
            key = (op.name, op.axis)
            if TYPE_SIZES[ty] == 4:
                return lambda w: w.special[key].view(dt)
            return lambda w: w.special[key].astype(dt)
        if isinstance(op, Sym):
            return self.symbol_value(op, ty)
        raise EmulationError(f"operand {op} cannot be read as a value")

    def symbol_value(self, op: Sym, ty: str):
        """A symbol used as a value is its address: a shared-window offset or a parameter slot."""
        dt = dtype_of(ty)
        if op.name in self.shared_addr:
            return constant(self.shared_addr[op.name], dt)
        if op.name in self.param_offset:
            return constant(PARAM_WINDOW + self.param_offset[op.name], dt)
        raise EmulationError(f"unknown symbol {op.name}")

    # -- writes --------------------------------------------------------------------------------
    def write(self, op, ty: str):
        if op is None:                       # the `_` sink
            return lambda w, v, m: None
        if not isinstance(op, Reg):
            raise EmulationError(f"cannot write to operand {op}")
        name, rty = op.name, self.reg_type(op)
        dt, rdt = dtype_of(ty), dtype_of(rty)
        if (rty == "pred") != (ty == "pred"):
            raise EmulationError(f"register {name} (.{rty}) written as .{ty}")
        rs, ts = TYPE_SIZES[rty], TYPE_SIZES[ty]
        if rdt == dt:
            conv = None
        elif rs == ts:
            def conv(v):
                return v.view(rdt)
        elif ts < rs:
            if ty.startswith("s"):
                def conv(v):
                    return v.astype(rdt)         # sign-extends (signed source)
            else:
                tu, ru = UNSIGNED[ts], UNSIGNED[rs]

                def conv(v):
                    return v.view(tu).astype(ru).view(rdt)
        else:
            raise EmulationError(f"register {name} (.{rty}) written as the wider .{ty}")

        if conv is None:
            # Same type: numpy's assignment does the (wrapping / rounding) cast to the register.
            def write_same(w, v, m):
                r = w.regs[name]
                if m is None:
                    r[...] = v
                elif getattr(v, "dtype", None) == r.dtype:
                    np.putmask(r, m, v)         # half of copyto(where=)'s cost; it casts only safely
                else:
                    np.copyto(r, v, where=m, casting="unsafe")
            return write_same

        def write(w, v, m, _conv=conv, _dt=dt):
            v = np.asarray(v)
            if v.dtype != _dt:
                v = v.astype(_dt)
            if _conv is not None:
                v = _conv(v)
            r = w.regs[name]
            if m is None:
                r[...] = v
            else:
                np.putmask(r, m, v)             # v is the register's dtype here
        return write

    def has_width(self, d, ty: str) -> bool:
        """Whether `d` is a register whose declared type is as wide as .`ty` (so that a value of
        `ty` can go into it as bits, without a conversion)."""
        return isinstance(d, Reg) and TYPE_SIZES.get(self.reg_type(d)) == TYPE_SIZES.get(ty)

    def ufunc_of(self, f, d, ty: str, ra, rb, wd):
        """run(w, m) writing ufunc `f` of two readers' values to register `d` as .`ty`, when the
        register is `ty`'s width: straight into it (`out=`, its bits as `ty`) when every lane
        executes, else by np.putmask; through `wd`, write(d, ty), where it is not."""
        if not self.has_width(d, ty):
            return lambda w, m: wd(w, f(ra(w), rb(w)), m)
        name, dt = d.name, dtype_of(ty)
        same = dtype_of(self.reg_type(d)) == dt

        def run(w, m):
            r = w.regs[name] if same else w.regs[name].view(dt)
            if m is None:
                f(ra(w), rb(w), out=r)
            else:       # f of two readers' arrays is a `ty` array (a comparison's: pred)
                np.putmask(r, m, f(ra(w), rb(w)))
        return run

    def filled_by(self, fill, d, ty: str, wd):
        """run(w, m) storing in register `d` what `fill(w, out)` (a native helper) writes into `out`,
        an array of .`ty` over the lanes: straight into the register when every lane executes and
        the register is `ty`'s width (the helper writes bits), else into a new array stored through
        `wd`, write(d, ty)."""
        dt = dtype_of(ty)
        direct = self.has_width(d, ty)
        name = d.name if direct else None

        def run(w, m):
            if m is None and direct:
                fill(w, w.regs[name])
            else:
                out = np.empty(w.nlanes, dt)
                fill(w, out)
                wd(w, out, m)
        return run

    # -- addresses -----------------------------------------------------------------------------
    def address(self, op: Addr):
        """-> f(warp) giving int64 addresses per lane (global: virtual; shared: window offset)."""
        if not isinstance(op, Addr):
            raise EmulationError(f"expected an address operand, got {op}")
        off, base = op.offset, op.base
        if isinstance(base, Reg):
            name = base.name
            if self.reg_type(base) == "pred":
                raise EmulationError(f"predicate {name} used as an address")
            return lambda w: w.regs[name].astype(np.int64) + off
        if isinstance(base, Sym):
            if base.name in self.shared_addr:
                return constant(self.shared_addr[base.name] + off, np.int64)
            if base.name in self.param_offset:
                return constant(PARAM_WINDOW + self.param_offset[base.name] + off, np.int64)
            raise EmulationError(f"unknown symbol {base.name}")
        return constant(int(immediate(base.text, "s64")) + off, np.int64)

    def is_read(self, op) -> bool:
        """Whether register `op` may be read: it occurs in the kernel more than once (its write
        is one occurrence) or as a guard. None (the `_` sink) is never read."""
        if op is None:
            return False
        if self._occurrences is None:
            self._occurrences = collections.Counter(name for ins in self.kernel.instructions
                                                    for name in _register_names(ins.operands, ins.pred))
        return self._occurrences[op.name] > 1

    def vector(self, op) -> list:
        """The element operands of `{a, b, ...}` (or a single operand as a 1-list)."""
        return list(op.items) if isinstance(op, Vec) else [op]

    def pair(self, op) -> tuple:
        """`d|p` -> (d, p); plain d -> (d, None)."""
        return (op.first, op.second) if isinstance(op, RegPair) else (op, None)


def _register_names(operands, guard=None) -> list:
    """The registers an instruction names (its guard twice: a guard is always read)."""
    names = [guard, guard] if guard else []
    for op in operands:
        kind = type(op)
        if kind is Reg:
            names.append(op.name)
        elif kind is Vec:
            names += _register_names(op.items)
        elif kind is RegPair:
            names += (op.first.name, op.second.name)
        elif kind is Addr:
            names += _register_names((op.base,))
        elif kind is TensorAddr:
            names += _register_names((op.base, op.coords))
    return names


# Parameters live in their own window so that `mov %rd, param` + `ld.param [%rd]` is decodable.
PARAM_WINDOW = 1 << 48
