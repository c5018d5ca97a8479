"""Warp-collective instructions: mma.sync, ldmatrix, shfl.sync, bar.warp.sync.

The fragment tables below say which (row, col) of a matrix each lane's register half holds. They
are the PTX ISA's figures for mma.m16n8k16 / m16n8k8 and ldmatrix; tests/test_emulator.py checks
them against CuTe's independently validated layouts.
"""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

from flashgen.emulate import native
from flashgen.emulate.errors import EmulationError
from flashgen.emulate.ptx import TYPE_SIZES, Reg
from flashgen.emulate.semantics.registry import executing_warps, handles, require_full_warp, unsupported

LANE = np.arange(32)
GROUP = LANE >> 2          # "groupID" in the PTX ISA figures
THREAD = LANE & 3          # "threadID_in_group"


# ---- fragment tables: arrays indexed [lane, register, half] -> row / col ------------------------
def mma_a_table(k: int, atype: str):
    """A (16 x k) fragment of mma.m16n8k{k}: (row, col) per [lane, reg, element]."""
    if atype in ("f16", "bf16") and k == 16:
        reg, half = np.arange(4)[None, :, None], np.arange(2)[None, None, :]
        row = GROUP[:, None, None] + 8 * (reg & 1)
        col = 2 * THREAD[:, None, None] + half + 8 * (reg >> 1)
    elif atype == "tf32" and k == 8:
        reg, half = np.arange(4)[None, :, None], np.zeros((1, 1, 1), int)
        row = GROUP[:, None, None] + 8 * (reg & 1)
        col = THREAD[:, None, None] + 4 * (reg >> 1) + half
    else:
        raise EmulationError(f"no A fragment table for m16n8k{k}.{atype}")
    return np.broadcast_arrays(row, col)


def mma_b_table(k: int, btype: str):
    """B (k x 8) fragment: (k index, n index) per [lane, reg, element]."""
    if btype in ("f16", "bf16") and k == 16:
        reg, half = np.arange(2)[None, :, None], np.arange(2)[None, None, :]
        kk = 2 * THREAD[:, None, None] + half + 8 * reg
    elif btype == "tf32" and k == 8:
        reg, half = np.arange(2)[None, :, None], np.zeros((1, 1, 1), int)
        kk = THREAD[:, None, None] + 4 * reg + half
    else:
        raise EmulationError(f"no B fragment table for m16n8k{k}.{btype}")
    n = GROUP[:, None, None] + 0 * kk
    return np.broadcast_arrays(kk, n)


def mma_c_table():
    """C/D (16 x 8, f32) fragment: (row, col) per [lane, reg]."""
    reg = np.arange(4)[None, :]
    return np.broadcast_arrays(GROUP[:, None] + 8 * (reg >> 1), 2 * THREAD[:, None] + (reg & 1))


def ldmatrix_table(trans: bool):
    """ldmatrix .m8n8 .b16: element h of register j of a lane comes from (row, col) of matrix j."""
    half = np.arange(2)[None, :]
    if trans:
        return np.broadcast_arrays(2 * THREAD[:, None] + half, GROUP[:, None] + 0 * half)
    return np.broadcast_arrays(GROUP[:, None] + 0 * half, 2 * THREAD[:, None] + half)


def _to_float64(atype):
    """Gathered fragment elements (u16 halves, or u32 for tf32) -> float64 values."""
    if atype == "bf16":       # exact widening (ml_dtypes' cast: one pass, not a shift, a view and a cast)
        return lambda e: e.view(ml_dtypes.bfloat16).astype(np.float64)
    if atype == "f16":
        return lambda e: e.view(np.float16).astype(np.float64)
    # tf32: the tensor core reads the top 19 bits of the f32 pattern
    return lambda e: (e & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


@functools.lru_cache(maxsize=None)
def _mma_layout(k: int, atype: str):
    """(a_perm, b_perm, c_perm, c_flat) of mma.m16n8k{k}.{atype}: matrix element p of A (row-major
    16 x k) comes from fragment element a_perm[p] (fragments flattened [reg, lane, half]); the same
    for B (k x 8) and C (16 x 8); c_flat[reg, lane] is the C/D element a lane's register holds."""
    # the tables are [lane, reg, half]: transposed to the order the registers are read in
    ar, ac = (x.transpose(1, 0, 2) for x in mma_a_table(k, atype))
    br, bc = (x.transpose(1, 0, 2) for x in mma_b_table(k, atype))
    cr, cc = (x.T for x in mma_c_table())
    a_flat, b_flat, c_flat = (ar * k + ac).reshape(-1), (br * 8 + bc).reshape(-1), (cr * 8 + cc).reshape(-1)
    if np.unique(a_flat).size != 16 * k or np.unique(b_flat).size != 8 * k:
        raise EmulationError("fragment table does not cover the matrix")
    return np.argsort(a_flat), np.argsort(b_flat), np.argsort(c_flat), c_flat


_ELEMENT_TYPES = {"bf16": 0, "f16": 1, "tf32": 2}      # mma_emu.cc's


@functools.lru_cache(maxsize=None)
def _mma_tables(k: int, atype: str) -> tuple:
    """mma_emu.cc's index tables for mma.m16n8k{k}.{atype} (int32 arrays)."""
    return tuple(np.ascontiguousarray(t, np.int32) for t in _mma_layout(k, atype))


@handles("mma", per_warp=True)
def mma(ins, ops):
    mods = ins.mods
    # mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
    shape = next((m for m in mods if m.startswith("m")), None)
    if (mods[:2] != ("sync", "aligned") or shape not in ("m16n8k16", "m16n8k8") or
            mods[3:5] != ("row", "col") or len(mods) != 9 or mods[5] != "f32" or mods[8] != "f32"):
        raise unsupported(ins)
    atype, btype = mods[6], mods[7]
    if atype != btype or atype not in ("f16", "bf16", "tf32"):
        raise unsupported(ins)
    k = int(shape.split("k")[1])
    D, A, B, C = (ops.vector(x) for x in ins.operands)
    if len(A) != 4 or len(B) != 2 or len(C) != 4 or len(D) != 4:
        raise unsupported(ins, "operand counts (4 A, 2 B, 4 C, 4 D registers)")
    # mma_emu.cc reads and writes the registers themselves, each as a raw 4-byte pattern: what
    # reading A and B as .b32, C as .f32 and writing D as .f32 means for a 4-byte register
    if any(not isinstance(x, Reg) or TYPE_SIZES[ops.reg_type(x)] != 4 for x in A + B + C + D):
        raise unsupported(ins, "operands in registers other than 4-byte ones")
    registers = [x.name for x in A + B + C + D]
    # (_mma_tables refuses a fragment table that does not cover the matrix, at compile time)
    code, tables = _ELEMENT_TYPES[atype], _mma_tables(k, atype)
    compute = native.module().mma

    def run(w, m):
        require_full_warp(w, m, ins)
        regs = w.regs
        compute(w.nlanes // 32, k, code, m, *[regs[r] for r in registers], *tables)
    return run


@functools.lru_cache(maxsize=None)
def _ldmatrix_gather(nmat: int, trans: bool, g: int) -> np.ndarray:
    """For g warps' loaded rows (b16 elements [warp, row, col], row i of matrix i // 8), where
    element h of register j of each lane is: flat indices ordered [register, warp, lane, half]."""
    rows, cols = ldmatrix_table(trans)
    per_warp = np.arange(nmat)[:, None, None] * 64 + rows[None] * 8 + cols[None]
    return (np.arange(g)[None, :, None] * (nmat * 64) + per_warp.reshape(nmat, 1, 64)).reshape(-1)


@handles("ldmatrix", per_warp=True)
def ldmatrix(ins, ops):
    mods = ins.mods
    nmat = next((int(m[1:]) for m in mods if m in ("x1", "x2", "x4")), None)
    known = {"sync", "aligned", "m8n8", "x1", "x2", "x4", "trans", "shared", "b16"}
    if nmat is None or set(mods) - known or "m8n8" not in mods or "b16" not in mods:
        raise unsupported(ins)
    trans = "trans" in mods
    dsts = [ops.write(d, "b32") for d in ops.vector(ins.operands[0])]
    if len(dsts) != nmat:
        raise unsupported(ins, "register count does not match .x")
    addr = ops.address(ins.operands[1])
    nrows = 8 * nmat
    gather = _ldmatrix_gather(nmat, trans, 1)      # one warp's, for a step only some warps execute
    # one native call (SharedMemory.ldmatrix) where the address is a register and the destinations
    # 4-byte registers; else, and where it declines, the numpy path below
    base, dregs = ins.operands[1].base, [d for d in ops.vector(ins.operands[0]) if isinstance(d, Reg)]
    direct = (isinstance(base, Reg) and TYPE_SIZES[ops.reg_type(base)] in (4, 8) and len(dregs) == nmat and
              all(TYPE_SIZES[ops.reg_type(d)] == 4 for d in dregs))
    names = [d.name for d in dregs]
    table, offset = np.ascontiguousarray(gather, np.int32), ins.operands[1].offset

    def run(w, m):
        require_full_warp(w, m, ins)
        if direct:
            regs = w.regs
            if w.smem.ldmatrix(regs[base.name], offset, nmat, m, w.smem_slot, w.lane_warp, table,
                               [regs[n] for n in names]):
                return
        g = w.nlanes // 32
        # the executing warps; lane i of each supplies the address of row i % 8 of matrix i // 8
        on = slice(None) if m is None else m.reshape(g, 32)[:, 0]
        if m is None and nrows == 32:       # every lane supplies a row address
            rows_addr, who, slot = addr(w), w.lane_warp, w.smem_slot
        else:
            rows_addr = addr(w).reshape(g, 32)[on, :nrows].reshape(-1)
            who, slot = (x if isinstance(x, int) else x.reshape(g, 32)[on, :nrows].reshape(-1)
                         for x in (w.lane_warp, w.smem_slot))
        raw = w.smem.load(rows_addr, 16, who, "ldmatrix", slot=slot).view(np.uint16)
        if m is None:           # every warp: one gather straight into the [register, warp, lane] rows
            regs = raw.reshape(-1)[_ldmatrix_gather(nmat, trans, g)].view(np.uint32).reshape(nmat, -1)
        else:
            regs = np.zeros((g, nmat, 32), np.uint32)
            regs[on] = np.ascontiguousarray(raw.reshape(-1, nrows * 8)[:, gather]).view(np.uint32).reshape(-1, nmat, 32)
            regs = regs.transpose(1, 0, 2).reshape(nmat, -1)
        for j, wr in enumerate(dsts):
            wr(w, regs[j], m)
    return run


def _member_lanes(w, mask_reader, m, ins):
    """The lanes named by membermask must be exactly the executing lanes of each warp with an
    executing lane (the other warps of a gang are not there: no lane of theirs is a member)."""
    mask = mask_reader(w).astype(np.int64)
    lane = w.special[("laneid", 0)].astype(np.int64)
    members = ((mask >> lane) & 1).astype(bool)
    executing = np.ones(w.nlanes, bool) if m is None else m
    if m is not None:
        members &= m.reshape(-1, 32).any(1).repeat(32)
    if (members != executing).any():
        i = int(np.argmax(members != executing))
        raise EmulationError(f"{ins.form} with membermask {int(mask[i]) & 0xFFFFFFFF:#x}: lane {int(lane[i])} "
                             f"{'does not execute it' if members[i] else 'executes it but is not a member'}")
    return members


@handles("shfl", per_warp=True)
def shfl(ins, ops):
    mods = ins.mods
    if mods[:1] != ("sync",) or len(mods) != 3 or mods[2] != "b32" or mods[1] not in ("up", "down", "bfly", "idx"):
        raise unsupported(ins)
    mode = mods[1]
    dst, a, b, c, mask = ins.operands
    d, p = ops.pair(dst)
    wd, wp = ops.write(d, "b32"), (ops.write(p, "pred") if p is not None else None)
    ra, rb, rc, rmask = ops.read(a, "b32"), ops.read(b, "u32"), ops.read(c, "u32"), ops.read(mask, "u32")

    def run(w, m):
        members = _member_lanes(w, rmask, m, ins)
        lane = w.special[("laneid", 0)].astype(np.int64)
        base = np.arange(w.nlanes) - lane                 # first lane of each lane's warp
        bval = (rb(w) & 0x1F).astype(np.int64)
        cval = rc(w).astype(np.int64)
        seg = (cval >> 8) & 0x1F
        clamp = cval & 0x1F
        max_lane = (lane & seg) | (clamp & ~seg)
        min_lane = lane & seg
        if mode == "up":
            j = lane - bval
            ok = j >= max_lane
        elif mode == "down":
            j = lane + bval
            ok = j <= max_lane
        elif mode == "bfly":
            j = lane ^ bval
            ok = j <= max_lane
        else:
            j = min_lane | (bval & ~seg)
            ok = j <= max_lane
        src = base + np.where(ok, j, lane)
        if (~members[src] & members).any():
            raise EmulationError(f"{ins.form} reads a lane outside membermask (undefined result)")
        wd(w, ra(w)[src], m)
        if wp is not None:
            wp(w, ok, m)
    return run


@handles("bar", per_warp=True)
def bar_warp(ins, ops):
    # bar.sync (the CTA barrier) is the machine's; here only bar.warp.sync membermask.
    if ins.mods != ("warp", "sync"):
        raise unsupported(ins)
    rmask = ops.read(ins.operands[0], "u32")

    def run(w, m):
        _member_lanes(w, rmask, m, ins)
        w.smem.warp_sync(executing_warps(w, m))
    return run
