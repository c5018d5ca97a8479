"""Integer, float and predicate arithmetic: add ... shr, setp, selp, and the approximate math.

Floats follow IEEE with the instruction's rounding mode: f32 add/sub/mul round once (numpy's f32
arithmetic), fma/mad are computed with an exact f64 product and rounded to f32 (the sum is
rounded twice only when its exact value needs more than 53 bits, far below the kernels'
tolerances). Integer ops wrap at the type's width; integer division by zero is an error (the
hardware result is unspecified).
"""
from __future__ import annotations

import numpy as np

from flashgen.emulate import native, numerics
from flashgen.emulate.errors import EmulationError
from flashgen.emulate.operands import UNSIGNED, dtype_of, immediate
from flashgen.emulate.ptx import TYPE_SIZES, Imm
from flashgen.emulate.semantics.registry import handles, unsupported

ROUNDING = ("rn", "rz", "rm", "rp")
FLOATS = ("f32", "f64")


def _check_mods(ins, allowed):
    extra = [m for m in ins.mods if m not in allowed and m != ins.type()]
    if extra:
        raise unsupported(ins, f"modifier(s) {', '.join('.' + m for m in extra)}")


def _rounding(ins) -> str:
    r = [m for m in ins.mods if m in ROUNDING]
    return r[0] if r else "rn"


def _float_finish(ins, ty):
    """Post-processing of a float result: ftz and sat."""
    ftz = "ftz" in ins.mods and ty == "f32"
    sat = "sat" in ins.mods

    def finish(r):
        if ftz:
            r = numerics.ftz(r)
        if sat:
            r = np.where(np.isnan(r), r.dtype.type(0), np.clip(r, 0, 1)).astype(r.dtype)
        return r
    return finish if (ftz or sat) else None


def _float_inputs(ins, ty, readers):
    if "ftz" in ins.mods and ty == "f32":
        return [lambda w, r=r: numerics.ftz(r(w)) for r in readers]
    return readers


@handles("add", "sub", "mul", "div", "min", "max", "rem")
def binary(ins, ops):
    ty = ins.type()
    d, a, b = ins.operands
    ra, rb = ops.read(a, ty), ops.read(b, ty)
    wd = ops.write(d, ty)
    op = ins.opcode
    if ty in FLOATS:
        _check_mods(ins, {"rn", "rz", "rm", "rp", "ftz", "sat", "approx", "full"})
        ra, rb = _float_inputs(ins, ty, [ra, rb])
        finish = _float_finish(ins, ty)
        mode = _rounding(ins)
        if op == "rem":
            raise unsupported(ins)
        if op in ("min", "max"):
            f = np.fmin if op == "min" else np.fmax      # PTX min/max return the non-NaN operand
        elif op == "div" and "approx" in ins.mods:
            # div.approx.f32: a * (1/b), the documented approximation.
            f = lambda x, y: x * numerics.rcp(y)
        elif mode == "rn":
            f = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}[op]
        elif ty == "f32":
            g = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}[op]
            f = lambda x, y: numerics.round_directed(g(x, y, dtype=np.float64), mode)
        else:
            raise unsupported(ins, "directed rounding of f64")

        if finish is None and isinstance(f, np.ufunc):
            return ops.ufunc_of(f, d, ty, ra, rb, wd)

        def run(w, m):
            r = f(ra(w), rb(w))
            wd(w, finish(r) if finish else r, m)
        return run
    if ty == "pred" or ty in ("f16", "bf16", "f16x2", "bf16x2"):
        raise unsupported(ins)
    dt = dtype_of(ty)
    if op == "mul":
        if "wide" in ins.mods:
            _check_mods(ins, {"wide"})
            wide_ty = {"s16": "s32", "u16": "u32", "s32": "s64", "u32": "u64"}[ty]
            wd = ops.write(d, wide_ty)
            wdt = dtype_of(wide_ty)
            return lambda w, m: wd(w, ra(w).astype(wdt) * rb(w).astype(wdt), m)
        if "hi" in ins.mods:
            _check_mods(ins, {"hi"})
            bits = 8 * np.dtype(dt).itemsize
            if bits == 64:
                raise unsupported(ins, "64-bit mul.hi")
            big = np.int64 if ty.startswith("s") else np.uint64
            return lambda w, m: wd(w, ((ra(w).astype(big) * rb(w).astype(big)) >> bits).astype(dt), m)
        _check_mods(ins, {"lo"})
        return _on_bits(ops, np.multiply, ins) or ops.ufunc_of(np.multiply, d, ty, ra, rb, wd)
    _check_mods(ins, set())
    if op in ("add", "sub"):
        f = np.add if op == "add" else np.subtract
        return _on_bits(ops, f, ins) or ops.ufunc_of(f, d, ty, ra, rb, wd)
    if op in ("min", "max"):
        return ops.ufunc_of(np.minimum if op == "min" else np.maximum, d, ty, ra, rb, wd)

    def run(w, m):          # div / rem: truncating (C semantics); divide by zero is unspecified
        x, y = ra(w), rb(w)
        live = slice(None) if m is None else m
        if (y[live] == 0).any():
            raise EmulationError(f"integer division by zero in {ins.form}")
        ys = np.where(y == 0, 1, y)
        if ty.startswith("s"):
            q = (np.abs(x.astype(np.int64)) // np.abs(ys.astype(np.int64))) * np.where((x < 0) ^ (ys < 0), -1, 1)
            q = q.astype(dt)
        else:
            q = x // ys
        wd(w, q if op == "div" else (x - q * ys).astype(dt), m)
    return run


def _on_bits(ops, f, ins):
    """run(w, m) of ufunc `f` on the registers' own .bN arrays (nvcc declares %r and %rd as .b32
    and .b64), with no view of each operand per call; None where the destination is not a register
    of the type's width. For the forms whose result bits do not depend on signedness: add, sub,
    mul.lo, shl, and shr of unsigned types."""
    d, a, b = ins.operands
    ty = ins.type()
    if not ops.has_width(d, ty):
        return None
    raw = f"b{8 * TYPE_SIZES[ty]}"
    return ops.ufunc_of(f, d, raw, ops.read(a, raw), ops.read(b, raw), ops.write(d, raw))


@handles("mad", "fma")
def fused(ins, ops):
    ty = ins.type()
    d, a, b, c = ins.operands
    if ty in FLOATS:
        _check_mods(ins, {"rn", "rz", "rm", "rp", "ftz", "sat"})
        ra, rb, rc = _float_inputs(ins, ty, [ops.read(x, ty) for x in (a, b, c)])
        wd = ops.write(d, ty)
        finish = _float_finish(ins, ty)
        mode = _rounding(ins)
        if ty == "f64":
            if mode != "rn":
                raise unsupported(ins, "directed rounding of f64")
            f = lambda x, y, z: x * y + z
        else:
            # the f64 product of two f32 is exact (np.multiply casts its inputs itself)
            f = lambda x, y, z: numerics.round_directed(np.multiply(x, y, dtype=np.float64) + z, mode)

        def run(w, m):
            r = f(ra(w), rb(w), rc(w))
            wd(w, finish(r) if finish else r, m)
        return run
    if "wide" in ins.mods:
        _check_mods(ins, {"wide"})
        wide_ty = {"s16": "s32", "u16": "u32", "s32": "s64", "u32": "u64"}[ty]
        wdt = dtype_of(wide_ty)
        ra, rb, rc = ops.read(a, ty), ops.read(b, ty), ops.read(c, wide_ty)
        wd = ops.write(d, wide_ty)
        return lambda w, m: wd(w, ra(w).astype(wdt) * rb(w).astype(wdt) + rc(w), m)
    if "hi" in ins.mods:
        raise unsupported(ins)
    _check_mods(ins, {"lo"})
    ra, rb, rc = (ops.read(x, ty) for x in (a, b, c))
    wd = ops.write(d, ty)
    return lambda w, m: wd(w, ra(w) * rb(w) + rc(w), m)


@handles("abs", "neg", "not", "cnot")
def unary(ins, ops):
    ty = ins.type()
    d, a = ins.operands
    ra, wd = ops.read(a, ty), ops.write(d, ty)
    op = ins.opcode
    if ty in FLOATS:
        _check_mods(ins, {"ftz"})
        (ra,) = _float_inputs(ins, ty, [ra])
        f = {"abs": np.abs, "neg": np.negative}.get(op)
        if f is None:
            raise unsupported(ins)
        return lambda w, m: wd(w, f(ra(w)), m)
    _check_mods(ins, set())
    if op == "not":
        f = np.logical_not if ty == "pred" else np.invert
    elif op == "neg":
        f = np.negative
    elif op == "abs":
        f = np.abs
    else:
        f = lambda x: (x == 0).astype(x.dtype)
    return lambda w, m: wd(w, f(ra(w)), m)


@handles("and", "or", "xor")
def bitwise(ins, ops):
    ty = ins.type()
    if ty not in ("pred", "b16", "b32", "b64"):
        raise unsupported(ins)
    d, a, b = ins.operands
    f = {"and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}[ins.opcode]
    return ops.ufunc_of(f, d, ty, ops.read(a, ty), ops.read(b, ty), ops.write(d, ty))


@handles("shl", "shr")
def shift(ins, ops):
    ty = ins.type()
    d, a, b = ins.operands
    ra, rb, wd = ops.read(a, ty), ops.read(b, "u32"), ops.write(d, ty)
    dt = dtype_of(ty)
    bits = 8 * np.dtype(dt).itemsize
    u = UNSIGNED[bits // 8]
    # Shift amounts above the width are clamped to the width (PTX ISA, shl/shr).
    s = u(immediate(b.text, "u32")) if isinstance(b, Imm) else None
    if s is not None and s < bits:                # most shifts: by an immediate, no clamping to do
        if ins.opcode == "shl" or not ty.startswith("s"):
            run = _on_bits(ops, np.left_shift if ins.opcode == "shl" else np.right_shift, ins)
            if run:
                return run
        if ins.opcode == "shl":
            return lambda w, m: wd(w, (ra(w).view(u) << s).view(dt), m)
        if ty.startswith("s"):
            return lambda w, m: wd(w, ra(w) >> dt(s), m)
        return lambda w, m: wd(w, (ra(w).view(u) >> s).view(dt), m)
    if ins.opcode == "shl":
        def run(w, m):
            s = np.minimum(rb(w), bits).astype(u)
            x = ra(w).view(u)
            wd(w, np.where(s >= bits, u(0), x << np.minimum(s, bits - 1).astype(u)).view(dt), m)
    elif ty.startswith("s"):
        def run(w, m):
            s = np.minimum(rb(w), bits - 1).astype(dt)
            wd(w, ra(w) >> s, m)
    else:
        def run(w, m):
            s = np.minimum(rb(w), bits).astype(u)
            x = ra(w).view(u)
            wd(w, np.where(s >= bits, u(0), x >> np.minimum(s, bits - 1).astype(u)).view(dt), m)
    return run


@handles("bfi")
def bit_insert(ins, ops):
    ty = ins.type()
    d, a, b, c, l = ins.operands
    ra, rb, rc, rl = ops.read(a, ty), ops.read(b, ty), ops.read(c, "u32"), ops.read(l, "u32")
    wd = ops.write(d, ty)
    bits = 8 * np.dtype(dtype_of(ty)).itemsize

    def run(w, m):
        pos = (rc(w) & 0xFF).astype(np.uint64)
        ln = (rl(w) & 0xFF).astype(np.uint64)
        ones = np.where(ln >= 64, np.uint64(0xFFFFFFFFFFFFFFFF), (np.uint64(1) << np.minimum(ln, 63)) - np.uint64(1))
        mask = np.where(pos >= bits, np.uint64(0), ones << np.minimum(pos, 63))
        mask &= np.uint64((1 << bits) - 1) if bits < 64 else np.uint64(0xFFFFFFFFFFFFFFFF)
        x = (ra(w).astype(np.uint64) << np.minimum(pos, 63)) & mask
        r = (rb(w).astype(np.uint64) & ~mask) | x
        wd(w, r.astype(dtype_of(ty)), m)
    return run


_CMP = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
        "ge": np.greater_equal, "lo": np.less, "ls": np.less_equal, "hi": np.greater, "hs": np.greater_equal}
_BOOL = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}


@handles("setp")
def setp(ins, ops):
    ty = ins.type()
    cmp = ins.mods[0]
    boolop = next((m for m in ins.mods[1:] if m in _BOOL), None)
    _check_mods(ins, {cmp, "ftz"} | ({boolop} if boolop else set()))
    p, q = ops.pair(ins.operands[0])
    ra, rb = ops.read(ins.operands[1], ty), ops.read(ins.operands[2], ty)
    if ty in FLOATS:
        (ra, rb) = _float_inputs(ins, ty, [ra, rb])
    rc = ops.read(ins.operands[3], "pred") if boolop else None
    wp = ops.write(p, "pred")
    wq = ops.write(q, "pred") if q is not None else None
    if ty in FLOATS:
        if cmp == "num":
            f = lambda x, y: ~(np.isnan(x) | np.isnan(y))
        elif cmp == "nan":
            f = lambda x, y: np.isnan(x) | np.isnan(y)
        elif cmp.endswith("u") and cmp[:-1] in _CMP:
            g = _CMP[cmp[:-1]]
            f = lambda x, y: g(x, y) | np.isnan(x) | np.isnan(y)
        elif cmp in ("eq", "ne", "lt", "le", "gt", "ge"):
            g = _CMP[cmp]
            # ordered comparisons are false on NaN (numpy's != would be true)
            f = (lambda x, y: g(x, y) & ~(np.isnan(x) | np.isnan(y))) if cmp == "ne" else g
        else:
            raise unsupported(ins)
    else:
        if cmp not in _CMP:
            raise unsupported(ins)
        f = _CMP[cmp]
    bf = _BOOL[boolop] if boolop else None
    if bf is None and q is None and isinstance(f, np.ufunc):    # the usual setp: one ufunc into %p
        return ops.ufunc_of(f, p, "pred", ra, rb, wp)

    def run(w, m):
        t = f(ra(w), rb(w))
        if bf is not None:
            c = rc(w)
            wp(w, bf(t, c), m)
            if wq is not None:
                wq(w, bf(~t, c), m)
        else:
            wp(w, t, m)
            if wq is not None:
                wq(w, ~t, m)
    return run


@handles("selp")
def selp(ins, ops):
    ty = ins.type()
    d, a, b, c = ins.operands
    ra, rb, rc, wd = ops.read(a, ty), ops.read(b, ty), ops.read(c, "pred"), ops.write(d, ty)
    return lambda w, m: wd(w, np.where(rc(w), ra(w), rb(w)), m)


@handles("copysign")
def copysign(ins, ops):
    ty = ins.type()
    d, a, b = ins.operands
    ra, rb, wd = ops.read(a, ty), ops.read(b, ty), ops.write(d, ty)
    # PTX: "copy the sign bit of a into b": d = |b| with a's sign (the operand order is the trap).
    return lambda w, m: wd(w, np.copysign(rb(w), ra(w)), m)


_APPROX = {"lg2": numerics.lg2_approx, "rcp": numerics.rcp,
           "sqrt": lambda x: np.sqrt(x.astype(np.float64)).astype(np.float32),
           "rsqrt": lambda x: (1.0 / np.sqrt(x.astype(np.float64))).astype(np.float32)}


@handles("ex2", "lg2", "rcp", "sqrt", "rsqrt")
def approx_math(ins, ops):
    ty = ins.type()
    if ty != "f32":
        raise unsupported(ins)
    exact = ins.opcode in ("rcp", "sqrt") and "rn" in ins.mods
    if not exact and "approx" not in ins.mods:
        raise unsupported(ins, "only .approx (or .rn for rcp/sqrt) forms")
    _check_mods(ins, {"approx", "rn", "ftz"})
    d, a = ins.operands
    wd = ops.write(d, ty)
    if ins.opcode == "ex2":     # numerics_emu.cc: f64 exp2 rounded once to f32, .ftz on both sides
        ex2, read, ftz = native.module().ex2, ops.read(a, ty), int("ftz" in ins.mods)
        return ops.filled_by(lambda w, out: ex2(read(w), ftz, out), d, ty, wd)
    (ra,) = _float_inputs(ins, ty, [ops.read(a, ty)])
    f = _APPROX[ins.opcode]
    finish = _float_finish(ins, ty)
    return lambda w, m: wd(w, finish(f(ra(w))) if finish else f(ra(w)), m)
