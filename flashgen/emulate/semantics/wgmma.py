"""Warpgroup MMA: wgmma.mma_async (A from registers or a shared-memory descriptor, B from a
descriptor), wgmma.fence, wgmma.commit_group, wgmma.wait_group N.

The instruction is a warpgroup rendezvous: a warp that issues it waits until the 4 warps of its
warpgroup have (with the same descriptors), and the last one runs it for all (warp w % 4 holds
rows 16 (w % 4) .. of the 64 x N result), from the registers and shared memory as they are
then; which warps know it completed (so may overwrite what it read) is hopper_state.WgmmaReads'
bookkeeping. The rendezvous is the emulator's, not the hardware's (a wgmma is no barrier): each
warp's shared-memory reads (all of B, its 16 rows of A) must be ordered after their writes by
what that warp knows (ordering.py), so a tile other warps stored needs a barrier before the
wgmma, while a warp's own rows of A need none (FA3 stores P that way, with only __syncwarp).
The asynchrony is modelled by forbidding every observation that could tell issue from
completion: until a wait_group retires its group, another instruction that reads or writes an
accumulator or A-fragment register of the warp is an error (the PTX ISA makes either access
undefined; guard_wgmma_registers wraps exactly the instructions that name such registers). A
wgmma.mma_async after another instruction touched the wgmma registers, with no wgmma.fence in
between (or before the first one), is an error too (the PTX ISA requires the fence).

The shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format"): start address >> 4 in
bits [0,14), leading-dimension byte offset >> 4 in [16,30), stride-dimension byte offset >> 4 in
[32,46), base offset in [49,52), swizzle mode in [62,64): 0 none, 1 128B, 2 64B, 3 32B; the other
bits are reserved (must be 0). Operands are tiled in core matrices of 8 rows x 16 bytes; with a
swizzle of W bytes, 8 rows of W bytes form an atom whose 16-byte chunks are permuted by
Swizzle<log2(W/16), 4, 3> of the byte address: bits [4, 4+B) ^= bits [7, 7+B).
tests/test_emulator_hopper.py checks these layouts against CuTe's canonical GMMA layouts.
"""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

from flashgen.emulate.errors import EmulationError
from flashgen.emulate.ptx import Reg, RegPair, Vec
from flashgen.emulate.semantics.hopper_sync import compile_named_barrier, warp_lanes
from flashgen.emulate.semantics.registry import handles, require_full_warp, unsupported
from flashgen.emulate.semantics.warpops import GROUP, THREAD, _to_float64, mma_a_table

SWIZZLE_BYTES = {0: 16, 1: 128, 2: 64, 3: 32}      # layout type -> atom row width (16: no swizzle)
# K per instruction and element bytes of each input type (the K extent is always 32 bytes)
INPUT_TYPES = {"f16": (16, 2), "bf16": (16, 2), "tf32": (8, 4), "e4m3": (32, 1), "e5m2": (32, 1)}


# ---- layouts --------------------------------------------------------------------------------
def accumulator_table(n: int):
    """D of m64nNk*: (row within the warp's 16, col) per [lane, register] (PTX ISA figure
    "WGMMA .m64nNk16 register fragment layout for accumulator matrix D")."""
    reg = np.arange(n // 2)[None, :]
    row = GROUP[:, None] + 8 * ((reg >> 1) & 1)
    col = 8 * (reg >> 2) + 2 * THREAD[:, None] + (reg & 1)
    return np.broadcast_arrays(row, col)


def a_register_table(atype: str):
    """A from registers (rows within the warp's 16, k) per [lane, register, element]: per warp
    the layout of mma.m16n8k{16,8}'s A fragment; e4m3 packs 4 consecutive k per register."""
    if atype in ("f16", "bf16"):
        return mma_a_table(16, atype)
    if atype == "tf32":
        return mma_a_table(8, atype)
    reg, byte = np.arange(4)[None, :, None], np.arange(4)[None, None, :]
    row = GROUP[:, None, None] + 8 * (reg & 1)
    col = 4 * THREAD[:, None, None] + byte + 16 * (reg >> 1)
    return np.broadcast_arrays(row, col)


def decode_descriptor(desc: int, what: str) -> tuple:
    """-> (start, leading byte offset, stride byte offset, swizzle width in bytes)."""
    start, lbo, sbo = (desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4
    base, layout = (desc >> 49) & 7, desc >> 62
    reserved = desc & ~((0x3FFF) | (0x3FFF << 16) | (0x3FFF << 32) | (7 << 49) | (3 << 62))
    if reserved:
        raise EmulationError(f"{what} descriptor {desc:#018x} sets reserved bits {reserved:#x}")
    if base:
        raise EmulationError(f"{what} descriptor {desc:#018x} has base offset {base}: only 0 is modelled "
                             f"(the swizzle pattern is taken from the absolute address, as CuTe's descriptors assume)")
    return start, lbo, sbo, SWIZZLE_BYTES[layout]


def operand_addresses(rows: int, k: int, elem: int, mn_major: bool, desc: tuple) -> np.ndarray:
    """Byte addresses [rows, k] of the operand elements (row: the M or N index) a descriptor names."""
    start, lbo, sbo, width = desc
    mn, kk = np.arange(rows)[:, None], np.arange(k)[None, :]
    if not mn_major:                      # K-major: core matrices of 8 rows x 16 bytes of K
        kb = kk * elem
        if width == 16:
            off = (mn // 8) * sbo + (kb // 16) * lbo + (mn % 8) * 16 + kb % 16
        else:
            off = (mn // 8) * sbo + (mn % 8) * width + kb
    else:                                 # MN-major: 16 bytes of M/N x 8 rows of K
        mb = mn * elem
        if width == 16:
            off = (mb // 16) * sbo + (kk // 8) * lbo + (kk % 8) * 16 + mb % 16
        else:
            off = (mb // width) * lbo + (kk // 8) * sbo + (kk % 8) * width + mb % width
    addr = start + off
    bits = {16: 0, 32: 1, 64: 2, 128: 3}[width]
    return addr ^ ((addr >> 3) & (((1 << bits) - 1) << 4))


# ---- the guard on in-flight registers ---------------------------------------------------------
def _reg_names(op) -> set:
    if isinstance(op, Reg):
        return {op.name}
    if isinstance(op, Vec):
        return {x.name for x in op.items if isinstance(x, Reg)}
    if isinstance(op, RegPair):
        return {op.first.name, op.second.name}
    base = getattr(op, "base", None)
    return {base.name} if isinstance(base, Reg) else set()


def guard_wgmma_registers(kernel, code: list) -> list:
    """Wrap the compiled instructions (machine.py's code tuples) that name a register some
    wgmma.mma_async uses as accumulator or A fragment, so that they check the warp's in-flight
    groups first (and mark that the warpgroup needs a wgmma.fence before the next wgmma)."""
    acc, afrag = set(), set()
    for ins in kernel.instructions:
        if ins.opcode == "wgmma" and ins.mods[0] == "mma_async":
            acc |= _reg_names(ins.operands[0])
            if isinstance(ins.operands[1], Vec):
                afrag |= _reg_names(ins.operands[1])
    if not acc:
        return code
    out = list(code)
    for pc, ins in enumerate(kernel.instructions):
        if ins.opcode == "wgmma" or out[pc][0] != 0:          # only _ALU instructions access registers
            continue
        names = set().union(*(_reg_names(op) for op in ins.operands)) if ins.operands else set()
        if names & (acc | afrag):
            kind, fn, guard, negated, target = out[pc]
            out[pc] = (kind, _guarded(fn, ins, names & acc, names & afrag), guard, negated, target)
    return out


def _guarded(fn, ins, acc_named, afrag_named):
    def run(w, m):
        for warp, _, _ in warp_lanes(w, m):
            st = warp.smem.hopper.of_warp(warp)
            for group in st.get("groups", []) + ([st["open"]] if "open" in st else []):
                busy = (acc_named & group["acc"]) | (afrag_named & group["a"])
                if busy:
                    raise EmulationError(f"{ins.form} accesses register {sorted(busy)[0]} of a wgmma.mma_async that "
                                         f"has not completed (missing wgmma.wait_group before this access?)")
            st["fenced"] = False
        fn(w, m)
    return run


# ---- the instructions -----------------------------------------------------------------------
def _state(warp) -> dict:
    st = warp.smem.hopper.of_warp(warp)
    if "open" not in st:
        st.update(open={"acc": set(), "a": set(), "ops": []}, groups=[], fenced=False)
    return st


@handles("wgmma", per_warp=True)
def wgmma(ins, ops):
    mods = ins.mods
    if mods == ("fence", "sync", "aligned"):
        def fence(w, m):
            require_full_warp(w, m, ins)
            for warp, _, _ in warp_lanes(w, m):
                _state(warp)["fenced"] = True
        return fence
    if mods == ("commit_group", "sync", "aligned"):
        def commit(w, m):
            require_full_warp(w, m, ins)
            for warp, _, _ in warp_lanes(w, m):
                st = _state(warp)
                st["groups"].append(st["open"])
                st["open"] = {"acc": set(), "a": set(), "ops": []}
        return commit
    if mods == ("wait_group", "sync", "aligned"):
        keep = int(ins.operands[0].text, 0)

        def wait(w, m):
            require_full_warp(w, m, ins)
            for warp, _, _ in warp_lanes(w, m):
                st = _state(warp)
                while len(st["groups"]) > keep:
                    for g, seq in st["groups"].pop(0)["ops"]:
                        warp.smem.hopper.reads_of(warp).retire(warp.wid, g, seq)
        return wait
    raise unsupported(ins)


def compile_blocking(ins, ops):
    """The instructions machine.py runs warp by warp and that may make a warp wait
    (hopper_state.blocking): a named barrier, or wgmma.mma_async (a warpgroup rendezvous)."""
    if ins.opcode == "wgmma":
        return _mma_async(ins, ops)
    return compile_named_barrier(ins, ops)


def _mma_async(ins, ops):
    mods = ins.mods
    # wgmma.mma_async.sync.aligned.m64nNkK.f32.atype.btype
    if mods[1:3] != ("sync", "aligned") or len(mods) != 7 or not mods[3].startswith("m64n") or mods[4] != "f32":
        raise unsupported(ins, "only m64nNkK with f32 accumulators is modelled")
    atype, btype = mods[5], mods[6]
    if atype not in INPUT_TYPES or btype != atype:
        raise unsupported(ins, "A and B of one input type (mixed e4m3 / e5m2 is not modelled)")
    n, k = (int(x) for x in mods[3][4:].split("k"))
    kk, elem = INPUT_TYPES[atype]
    if k != kk or n % 8 or not 8 <= n <= 256:
        raise unsupported(ins, f"shape m64n{n}k{k} for .{atype}")
    d_ops = ops.vector(ins.operands[0])
    if len(d_ops) != n // 2:
        raise unsupported(ins, f"{len(d_ops)} accumulator registers (m64n{n} needs {n // 2})")
    a_regs = isinstance(ins.operands[1], Vec)
    rest = ins.operands[2:]
    # imm-scale-a, imm-scale-b, then (16-bit types only: the others are K-major) imm-trans-a
    # (descriptor A only) and imm-trans-b
    imms = [int(x.text, 0) for x in rest[2:]]
    n_trans = 0 if elem != 2 else 1 if a_regs else 2
    if len(imms) != 2 + n_trans or {imms[0], imms[1]} - {1, -1} or set(imms[2:]) - {0, 1}:
        raise unsupported(ins, "immediate scale / transpose operands")
    scale_a, scale_b = imms[:2]
    trans_a, trans_b = ([0] * (2 - n_trans) + imms[2:])
    rd = [ops.read(x, "f32") for x in d_ops]
    wd = [ops.write(x, "f32") for x in d_ops]
    rdesc_b = ops.read(rest[0], "u64")
    rscale_d = ops.read(rest[1], "pred")
    if a_regs:
        ra = [ops.read(x, "b32") for x in ops.vector(ins.operands[1])]
        if len(ra) != 4:
            raise unsupported(ins, "A from registers takes 4 registers")
        a_rows, a_cols = (x.reshape(32, -1) for x in a_register_table(atype))
    else:
        rdesc_a = ops.read(ins.operands[1], "u64")
    c_rows, c_cols = accumulator_table(n)
    acc_names = {x.name for x in d_ops}
    a_names = {x.name for x in ops.vector(ins.operands[1])} if a_regs else set()
    decode = _decoder(atype)

    def uniform(warp, vals, what):
        if (vals != vals[0]).any():
            raise EmulationError(f"{what} differs between the lanes of warp {warp.wid}")
        return int(vals[0])

    def arrive(warp):
        """One warp issues; the 4th warp of its warpgroup to issue runs the instruction for all."""
        require_full_warp(warp, None, ins)
        if not _state(warp)["fenced"]:
            raise EmulationError("wgmma.mma_async without a wgmma.fence since the warpgroup's wgmma registers "
                                 "were last accessed (or before its first wgmma)")
        if 4 * (warp.wid // 4 + 1) > len(warp.cta.warps):
            raise EmulationError(f"warp {warp.wid} is not in a full warpgroup of 4 warps")
        desc_b = uniform(warp, rdesc_b(warp), "the B descriptor")
        desc_a = None if a_regs else uniform(warp, rdesc_a(warp), "the A descriptor")
        h = warp.smem.hopper
        group = h.warpgroup_rendezvous(warp, (ins.line, desc_a, desc_b))
        if group is None:
            return
        b_addr = operand_addresses(n, k, elem, bool(trans_b), decode_descriptor(desc_b, "B"))
        wids = [x.wid for x in group]
        b = decode(_elements(h.async_bytes(warp, b_addr, elem, "wgmma.mma_async (B)", wids), elem))  # [n, k]
        reads = [b_addr]
        if not a_regs:
            a_addr = operand_addresses(64, k, elem, bool(trans_a), decode_descriptor(desc_a, "A"))
            a_all = decode(_elements(h.async_bytes(warp, a_addr, elem, "wgmma.mma_async (A)", wids, 16), elem))
            reads.append(a_addr)
        local = np.unique(np.concatenate([(x[..., None] + np.arange(elem)).reshape(-1) for x in reads]))
        op = (warp.wid // 4, h.reads_of(warp).read(warp.wid // 4, local))          # (warpgroup, its number)
        for x in group:
            if a_regs:
                a = np.empty((16, k), np.float64)
                a[a_rows, a_cols] = decode(np.stack([r(x) for r in ra], 1).view(_RAW[elem]).reshape(32, -1))
            else:
                a = a_all[16 * (x.wid % 4):16 * (x.wid % 4) + 16]
            # products of f16/bf16/tf32/fp8 are exact in f64; the sum is rounded once to f32
            prod = (scale_a * a) @ (scale_b * b).T                                              # [16, n]
            c = np.stack([r(x) for r in rd], 1).astype(np.float64)                              # [lane, reg]
            out = (prod[c_rows, c_cols] + np.where(rscale_d(x)[:, None], c, 0.0)).astype(np.float32)
            for i, wr in enumerate(wd):
                wr(x, out[:, i], None)
            st = _state(x)
            st["open"]["acc"] |= acc_names
            st["open"]["a"] |= a_names
            st["open"]["ops"].append(op)
    return arrive


_RAW = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _elements(raw: np.ndarray, elem: int) -> np.ndarray:
    """Bytes [..., elem] -> raw elements [...]."""
    return raw.view(_RAW[elem])[..., 0]


@functools.lru_cache(maxsize=None)
def _decoder(atype):
    """Raw elements -> float64 (f16 / bf16 / tf32 as mma.sync reads them; fp8 by ml_dtypes)."""
    if atype in ("e4m3", "e5m2"):
        dt = ml_dtypes.float8_e4m3fn if atype == "e4m3" else ml_dtypes.float8_e5m2
        return lambda e: e.view(dt).astype(np.float64)
    return _to_float64(atype)
