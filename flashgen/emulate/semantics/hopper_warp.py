"""Hopper warp-level instructions: stmatrix (ldmatrix's inverse) and setmaxnreg.

setmaxnreg is checked as a budget: a kernel that uses it must fix its register count at launch
(`__launch_bounds__(N, 1)`: .maxntid, one CTA per SM assumed), which starts every warp at
floor(65536 / N / 8) * 8 registers per thread; each setmaxnreg moves its warp to the new count
(.inc up, .dec down, 24..256 in steps of 8, the same for the 4 warps of a warpgroup), and once
every warp of the CTA has set its count the CTA must fit the SM's 65536 registers (else the
hardware's .inc waits forever). Which registers a thread then uses is ptxas's allocation, which
the emulator does not see (the PTX's virtual registers are unlimited): `ptxas -v` checks that.
"""
from __future__ import annotations

import functools

import numpy as np

from flashgen.emulate.errors import EmulationError
from flashgen.emulate.semantics.hopper_sync import warp_lanes
from flashgen.emulate.semantics.registry import handles, require_full_warp, unsupported
from flashgen.emulate.semantics.warpops import ldmatrix_table

REGISTER_FILE = 65536


@functools.lru_cache(maxsize=None)
def _stmatrix_scatter(nmat: int, trans: bool) -> np.ndarray:
    """Flat indices into one warp's stored rows ([matrix, row, col] b16) of element h of register
    j of each lane, ordered [register, lane, half] (the ldmatrix table, read the other way)."""
    rows, cols = ldmatrix_table(trans)
    return (np.arange(nmat)[:, None, None] * 64 + rows[None] * 8 + cols[None]).reshape(-1)


@handles("stmatrix", per_warp=True)
def stmatrix(ins, ops):
    mods = ins.mods
    nmat = next((int(m[1:]) for m in mods if m in ("x1", "x2", "x4")), None)
    known = {"sync", "aligned", "m8n8", "x1", "x2", "x4", "trans", "shared", "shared::cta", "b16"}
    if nmat is None or set(mods) - known or "m8n8" not in mods or "b16" not in mods:
        raise unsupported(ins)
    srcs = [ops.read(r, "b32") for r in ops.vector(ins.operands[1])]
    if len(srcs) != nmat:
        raise unsupported(ins, "register count does not match .x")
    addr = ops.address(ins.operands[0])
    scatter = _stmatrix_scatter(nmat, "trans" in mods)

    def run(w, m):
        require_full_warp(w, m, ins)
        for warp, sl, _ in warp_lanes(w, m):
            # lane i supplies the address of row i % 8 of matrix i // 8
            halves = np.stack([r(warp) for r in srcs]).view(np.uint16).reshape(-1)     # [reg, lane, half]
            rows = np.empty(nmat * 64, np.uint16)
            rows[scatter] = halves
            data = rows.view(np.uint8).reshape(nmat * 8, 16)
            warp.smem.store(addr(w)[sl][:nmat * 8], data, warp.wid, "stmatrix", slot=warp.smem_slot)
    return run


@handles("setmaxnreg", per_warp=True)
def setmaxnreg(ins, ops):
    if ins.mods not in (("inc", "sync", "aligned", "u32"), ("dec", "sync", "aligned", "u32")):
        raise unsupported(ins)
    up = ins.mods[0] == "inc"
    count = int(ins.operands[0].text, 0)
    if not 24 <= count <= 256 or count % 8:
        raise EmulationError(f"{ins.form} {count}: the count must be a multiple of 8 in [24, 256]")
    bounds = ops.kernel.max_threads
    if bounds is None:
        raise EmulationError("setmaxnreg in a kernel without __launch_bounds__ (.maxntid): its register count "
                             "is not fixed at launch, which setmaxnreg requires")
    start = min(255, REGISTER_FILE // int(np.prod(bounds))) // 8 * 8

    def run(w, m):
        require_full_warp(w, m, ins)
        for warp, _, _ in warp_lanes(w, m):
            h = warp.smem.hopper
            cta = warp.cta
            counts = h.register_counts.get(cta.slot)      # warp -> (per-thread count, set by setmaxnreg)
            if counts is None:
                counts = h.register_counts[cta.slot] = {x.wid: (start, False) for x in cta.warps}
            now = counts[warp.wid]
            if (count < now[0]) if up else (count > now[0]):
                raise EmulationError(f"{ins.form} {count} in warp {warp.wid}, which holds {now[0]} registers per "
                                     f"thread ({'.inc cannot lower' if up else '.dec cannot raise'} the count)")
            counts[warp.wid] = (count, True)
            group = [counts[x] for x in range(4 * (warp.wid // 4), 4 * (warp.wid // 4) + 4) if counts[x][1]]
            if len({c for c, _ in group}) > 1:
                raise EmulationError(f"the warps of warpgroup {warp.wid // 4} set different register counts "
                                     f"{sorted({c for c, _ in group})} (setmaxnreg is per warpgroup)")
            total = 32 * sum(c for c, _ in counts.values())
            if all(done for _, done in counts.values()) and total > REGISTER_FILE:
                raise EmulationError(f"after setmaxnreg the CTA's warps hold {total} registers, more than the "
                                     f"SM's {REGISTER_FILE} (per-thread counts by warp: "
                                     f"{[c for c, _ in counts.values()]}): the .inc would wait forever")
    return run
