"""Data movement inside registers: mov (incl. vector pack/unpack and symbol addresses), cvt, cvta."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from flashgen.emulate import native, numerics
from flashgen.emulate.operands import UNSIGNED, dtype_of
from flashgen.emulate.ptx import TYPE_SIZES, Sym, Vec
from flashgen.emulate.semantics.registry import handles, unsupported

INTS = ("u8", "s8", "u16", "s16", "u32", "s32", "u64", "s64", "b8", "b16", "b32", "b64")


@handles("mov")
def mov(ins, ops):
    ty = ins.type()
    d, s = ins.operands
    if isinstance(d, Vec) or isinstance(s, Vec):
        # mov.b32 {lo, hi}, r / mov.b32 r, {lo, hi}: little-endian halves (lo = element 0).
        whole, parts = (s, d.items) if isinstance(d, Vec) else (d, s.items)
        part_ty = {2: "b8", 4: "b16", 8: "b32"}[TYPE_SIZES[ty]] if len(parts) == 2 else \
            {4: "b8", 8: "b16"}[TYPE_SIZES[ty]]
        pdt, wdt = dtype_of(part_ty), dtype_of(ty)
        n = len(parts)
        if isinstance(d, Vec):
            rs = ops.read(whole, ty)
            writers = [ops.write(p, part_ty) for p in parts]

            def unpack(w, m):
                v = np.ascontiguousarray(rs(w)).view(pdt).reshape(-1, n)
                for i, wr in enumerate(writers):
                    wr(w, v[:, i], m)
            return unpack
        readers = [ops.read(p, part_ty) for p in parts]
        wd = ops.write(whole, ty)

        def pack(w, m):
            v = np.stack([r(w) for r in readers], axis=1)
            wd(w, v.view(wdt).reshape(-1), m)
        return pack
    rs = ops.read(s, ty) if not isinstance(s, Sym) else ops.symbol_value(s, ty)
    wd = ops.write(d, ty)
    return lambda w, m: wd(w, rs(w), m)


@handles("prmt")
def prmt(ins, ops):
    """prmt.b32 d, a, b, c (default mode): byte i of d is byte (c >> 4i) & 7 of the 8 bytes
    {b, a} (a's bytes 0-3, b's 4-7); with bit 3 of that nibble set, the byte's sign bit
    replicated instead (PTX ISA, prmt)."""
    if ins.mods != ("b32",):
        raise unsupported(ins, "only the default mode of prmt.b32")
    d, a, b, c = ins.operands
    ra, rb, rc, wd = ops.read(a, "b32"), ops.read(b, "b32"), ops.read(c, "b32"), ops.write(d, "b32")

    def run(w, m):
        src = np.stack([ra(w), rb(w)], axis=1).astype(np.uint32).view(np.uint8).reshape(-1, 8)
        sel = np.asarray(rc(w), np.uint32)
        out = np.zeros(src.shape[0], np.uint32)
        for i in range(4):
            nib = (sel >> np.uint32(4 * i)) & np.uint32(0xF)
            byte = src[np.arange(src.shape[0]), nib & np.uint32(7)].astype(np.uint32)
            byte = np.where(nib & np.uint32(8), np.where(byte & np.uint32(0x80), np.uint32(0xFF), np.uint32(0)), byte)
            out |= byte << np.uint32(8 * i)
        wd(w, out, m)
    return run


@handles("cvta")
def cvta(ins, ops):
    # Only global<->generic and param->generic: our global and parameter-window addresses are the
    # generic ones (identity; a __grid_constant__ tensor map is read through its generic address).
    # Shared/local generic addressing is not modelled, so those forms fail here.
    if "global" not in ins.mods and ins.mods[:1] != ("param",):
        raise unsupported(ins, "generic addressing of non-global spaces")
    ty = ins.type()
    d, s = ins.operands
    rs, wd = ops.read(s, ty), ops.write(d, ty)
    return lambda w, m: wd(w, rs(w), m)


def _float_to_int(x, dt, mode):
    """cvt.{rni,rzi,rmi,rpi}.int.float: round, saturate to the type's range, NaN -> 0."""
    r = {"rni": np.rint, "rzi": np.trunc, "rmi": np.floor, "rpi": np.ceil}[mode](x.astype(np.float64))
    info = np.iinfo(dt)
    r = np.nan_to_num(r, nan=0.0)
    # clip in float64, then pin the ends: float64 cannot hold 2^63 - 1 or 2^64 - 1 exactly
    out = np.clip(r, float(info.min), float(info.max)).astype(dt)
    out[r >= float(info.max)] = info.max
    out[r <= float(info.min)] = info.min
    return out


@handles("cvt")
def cvt(ins, ops):
    mods = [m for m in ins.mods if m in TYPE_SIZES]
    if len(mods) != 2:
        raise unsupported(ins)
    dty, sty = mods
    quals = [m for m in ins.mods if m not in TYPE_SIZES]
    rounding = next((q for q in quals if q in ("rn", "rna", "rz", "rm", "rp", "rni", "rzi", "rmi", "rpi")), None)
    sat = "sat" in quals
    ftz = "ftz" in quals
    unknown = [q for q in quals if q not in ("rn", "rna", "rz", "rm", "rp", "rni", "rzi", "rmi", "rpi", "sat", "ftz", "relu",
                                             "satfinite")]
    if unknown or "relu" in quals or ("satfinite" in quals) != (dty == "e4m3x2"):
        raise unsupported(ins)
    ops_ = ins.operands
    wd = ops.write(ops_[0], dty)

    # two f32 -> packed e4m3 pair, the first source in the upper byte; .satfinite (required)
    # clamps finite results beyond e4m3's largest, 448, to it; NaN stays NaN.
    if dty == "e4m3x2" and sty == "f32":
        if quals != ["rn", "satfinite"]:
            raise unsupported(ins)
        ra, rb = ops.read(ops_[1], "f32"), ops.read(ops_[2], "f32")

        def e4m3(x):
            return np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).astype(np.uint16)

        def pack_e4m3(w, m):
            wd(w, (e4m3(ra(w)) << np.uint16(8)) | e4m3(rb(w)), m)
        return pack_e4m3

    # two f32 -> packed pair: the first source goes to the upper half (PTX ISA, cvt).
    if dty in ("bf16x2", "f16x2") and sty == "f32":
        if rounding != "rn" or sat:
            raise unsupported(ins)
        ra, rb = ops.read(ops_[1], "f32"), ops.read(ops_[2], "f32")
        if dty == "bf16x2":     # numerics_emu.cc: both halves rounded and packed in one pass
            pack_bf16x2 = native.module().pack_bf16x2
            return ops.filled_by(lambda w, out: pack_bf16x2(ra(w), rb(w), out), ops_[0], dty, wd)
        conv = numerics.f32_to_f16_rn

        def pack(w, m):
            hi = conv(ra(w)).astype(np.uint32)
            lo = conv(rb(w)).astype(np.uint32)
            wd(w, (hi << np.uint32(16)) | lo, m)
        return pack
    rs = ops.read(ops_[1], sty)
    if dty in ("bf16", "f16") and sty == "f32":
        if rounding != "rn" or sat:
            raise unsupported(ins)
        conv = numerics.f32_to_bf16_rn if dty == "bf16" else numerics.f32_to_f16_rn
        return lambda w, m: wd(w, conv(rs(w)), m)
    if dty == "f32" and sty in ("bf16", "f16"):
        if rounding or sat:
            raise unsupported(ins)
        conv = numerics.bf16_to_f32 if sty == "bf16" else numerics.f16_to_f32
        return lambda w, m: wd(w, conv(rs(w)), m)
    if dty == "tf32" and sty == "f32":
        if rounding not in ("rna", "rn", "rz") or sat:
            raise unsupported(ins)
        return lambda w, m: wd(w, numerics.f32_to_tf32(rs(w), rounding), m)
    if dty in ("f32", "f64") and sty in ("f32", "f64"):
        fin = (lambda r: numerics.ftz(r)) if ftz and dty == "f32" else (lambda r: r)
        if sty == dty:                    # cvt.sat / cvt.rni etc. within f32
            if rounding in ("rni", "rzi", "rmi", "rpi"):
                f = {"rni": np.rint, "rzi": np.trunc, "rmi": np.floor, "rpi": np.ceil}[rounding]
            elif rounding is None:
                f = lambda x: x
            else:
                raise unsupported(ins)
        elif dty == "f32":
            mode = rounding or "rn"
            if mode not in ("rn", "rz", "rm", "rp"):
                raise unsupported(ins)
            f = lambda x: numerics.round_directed(x, mode)
        else:
            f = lambda x: x.astype(np.float64)
        if sat:
            g = f
            f = lambda x: np.where(np.isnan(x), x.dtype.type(0), np.clip(g(x), 0, 1)).astype(x.dtype)
        return lambda w, m: wd(w, fin(f(rs(w))), m)
    if dty in ("f32", "f64") and sty in INTS:
        mode = rounding or "rn"
        fdt = dtype_of(dty)
        if mode == "rn":
            return lambda w, m: wd(w, rs(w).astype(fdt), m)
        if dty == "f32" and mode in ("rz", "rm", "rp") and TYPE_SIZES[sty] <= 4:
            return lambda w, m: wd(w, numerics.round_directed(rs(w).astype(np.float64), mode), m)
        raise unsupported(ins)
    if dty in INTS and sty in ("f32", "f64"):
        if rounding not in ("rni", "rzi", "rmi", "rpi"):
            raise unsupported(ins)
        idt = dtype_of(dty)
        return lambda w, m: wd(w, _float_to_int(rs(w), idt, rounding), m)
    if dty in INTS and sty in INTS:
        if sat:
            raise unsupported(ins, "integer saturation")
        idt = dtype_of(dty)
        ds, ss = TYPE_SIZES[dty], TYPE_SIZES[sty]
        if ds <= ss:      # truncate
            return lambda w, m: wd(w, rs(w).view(UNSIGNED[ss]).astype(UNSIGNED[ds]).view(idt), m)
        # extend by the source's signedness
        return lambda w, m: wd(w, rs(w).astype(np.int64 if sty.startswith("s") else np.uint64).astype(idt), m)
    raise unsupported(ins)
