"""Memory instructions: ld, st, atom/red, cp.async (param, global and shared spaces).

Lanes that do not execute never touch memory, so their (often garbage) addresses are not checked.
Generic, local and const spaces are not modelled and fail at compile time.
"""
from __future__ import annotations

import numpy as np

from flashgen.emulate.errors import EmulationError
from flashgen.emulate.operands import PARAM_WINDOW, constant, dtype_of
from flashgen.emulate.ptx import TYPE_SIZES, Reg, Sym
from flashgen.emulate.semantics.registry import executing_warps, handles, unsupported

# Cache and eviction hints change no value; volatile and the memory-order qualifiers ask for no
# more than the emulator gives every access (each one completes, in program order, before the next).
_HINTS = {"ca", "cg", "cs", "lu", "cv", "nc", "wb", "wt", "weak", "volatile", "relaxed", "acquire", "release",
          "cta", "gpu", "sys"}
_SPACES = ("param", "global", "shared")


def _space(ins) -> str:
    sp = [m for m in ins.mods if m in _SPACES or m in ("local", "const", "generic")]
    if len(sp) != 1 or sp[0] not in _SPACES:
        raise unsupported(ins, "only the param, global and shared spaces are modelled")
    return sp[0]


def _check(ins, allowed):
    for m in ins.mods:
        if m in allowed or m in _HINTS or m.startswith(("L1::", "L2::")) or m in TYPE_SIZES:
            continue
        raise unsupported(ins, f"modifier .{m}")


def _lanes(m):
    return slice(None) if m is None else m


def _who(w, lanes):
    """The warp (within its CTA) of each executing lane, for the shared-memory race detector."""
    return w.lane_warp if isinstance(w.lane_warp, int) else w.lane_warp[lanes]


def _slot(w, lanes):
    """The shared-memory slot of each executing lane's CTA."""
    return w.smem_slot if isinstance(w.smem_slot, int) else w.smem_slot[lanes]


def _lane_ids(w, lanes):
    return w.special[("laneid", 0)][lanes]


def _cta_of(w, lanes):
    """The CTA of the executing lanes, for the global-memory race detector: one id for a warp or
    a gang of one CTA, one per lane for a gang over several."""
    return w.cta_index if isinstance(w.cta_index, int) else w.cta_index[lanes]


@handles("ld")
def load(ins, ops):
    space = _space(ins)
    _check(ins, set(_SPACES) | {"v2", "v4"})
    ty = ins.type()
    dsts = ops.vector(ins.operands[0])
    n = len(dsts)
    width = TYPE_SIZES[ty]
    nbytes = width * n
    dt = dtype_of(ty)
    addr = ops.address(ins.operands[1])
    writers = [ops.write(d, ty) for d in dsts]

    src = ins.operands[1]
    if space == "param" and isinstance(src.base, Sym) and src.base.name in ops.param_offset:
        # the usual case: a parameter by name (+ offset), the same value in every lane, read once
        off = ops.param_offset[src.base.name] + src.offset

        def run_uniform(w, m):
            params = w.params
            if off < 0 or off + nbytes > params.size:
                raise EmulationError(f"parameter access at offset {off} outside the {params.size}-byte "
                                     f"parameter buffer")
            for wr, v in zip(writers, params[off:off + nbytes].view(dt)):
                wr(w, v, m)
        return run_uniform
    if space == "param":
        def fetch(w, m):
            a = addr(w)[_lanes(m)] - PARAM_WINDOW
            params = w.params
            lo, hi = (int(a.min()), int(a.max())) if a.size else (0, -nbytes)
            if lo < 0 or hi + nbytes > params.size:
                raise EmulationError(f"parameter access at offset {lo if lo < 0 else hi} outside the "
                                     f"{params.size}-byte parameter buffer")
            if lo == hi:        # the usual case: every lane reads the same parameter, read once
                return np.broadcast_to(params[lo:lo + nbytes], (a.size, nbytes))
            return params[a[:, None] + np.arange(nbytes)]
    elif space == "global":
        def fetch(w, m):
            lanes = _lanes(m)
            return w.gmem.load(addr(w)[lanes], nbytes, cta=_cta_of(w, lanes))
    else:
        def fetch(w, m):
            lanes = _lanes(m)
            return w.smem.load(addr(w)[lanes], nbytes, _who(w, lanes), lanes=_lane_ids(w, lanes),
                               slot=_slot(w, lanes))

    def run(w, m):
        raw = fetch(w, m)
        if m is None:
            vals = raw.view(dt).reshape(-1, n)
        else:
            vals = np.zeros((w.nlanes, n), dt)
            vals[m] = raw.view(dt).reshape(-1, n)
        for i, wr in enumerate(writers):
            wr(w, vals[:, i], m)
    return run


@handles("st")
def store(ins, ops):
    space = _space(ins)
    if space == "param":
        raise unsupported(ins)
    _check(ins, set(_SPACES) | {"v2", "v4"})
    ty = ins.type()
    srcs = [ops.read(s, ty) for s in ops.vector(ins.operands[1])]
    dt = dtype_of(ty)
    addr = ops.address(ins.operands[0])

    def run(w, m):
        lanes = _lanes(m)
        data = np.stack([np.asarray(r(w), dt)[lanes] for r in srcs], axis=1)
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(data.shape[0], -1)
        a = addr(w)[lanes]
        if space == "global":
            w.gmem.store(a, raw, cta=_cta_of(w, lanes))
        else:
            w.smem.store(a, raw, _who(w, lanes), lanes=_lane_ids(w, lanes), slot=_slot(w, lanes))
    return run


@handles("atom", "red")
def atomic(ins, ops):
    space = _space(ins)
    if space != "global" or "add" not in ins.mods:
        raise unsupported(ins, "only global atom/red.add is modelled")
    _check(ins, {"global", "add", "v2", "v4"})
    ty = ins.type()
    if ty not in ("f32", "u32", "s32", "u64", "f64"):
        raise unsupported(ins)
    dt = dtype_of(ty)
    if ins.opcode == "atom":
        dsts, target, val = ops.vector(ins.operands[0]), ins.operands[1], ins.operands[2]
    else:
        dsts, (target, val) = None, ins.operands
    srcs = [ops.read(s, ty) for s in ops.vector(val)]
    # the old values are gathered only when the kernel reads one (nvcc gives atom a result
    # register even where nothing reads it)
    writers = [ops.write(d, ty) for d in dsts] if dsts and any(map(ops.is_read, dsts)) else None
    width = TYPE_SIZES[ty]
    nvec = len(srcs)
    addr = ops.address(target)

    def run(w, m):
        lanes = _lanes(m)
        a = addr(w)[lanes]
        if nvec > 1 and a.size and (a % (width * nvec)).any():
            raise EmulationError(f"misaligned vector atomic at {int(a[(a % (width * nvec)) != 0][0]):#x}")
        cta = _cta_of(w, lanes)
        if nvec == 1:
            addrs, vals = a, np.asarray(srcs[0](w), dt)[lanes]
        else:       # a vector atomic is one atomic per element (PTX ISA: .v2/.v4 add element-wise)
            addrs = (a[:, None] + width * np.arange(nvec)).reshape(-1)
            vals = np.stack([np.asarray(r(w), dt)[lanes] for r in srcs], axis=1).reshape(-1)
            cta = cta if isinstance(cta, int) else np.repeat(cta, nvec)
        old = w.gmem.atomic_add(addrs, vals, cta=cta, returns=writers is not None)
        if writers:
            full = np.zeros((w.nlanes, nvec), dt)
            full[lanes] = old.reshape(-1, nvec)
            for i, wr in enumerate(writers):
                wr(w, full[:, i], m)
    return run


@handles("cp", per_warp=True)
def cp_async(ins, ops):
    if ins.mods[:1] != ("async",):
        raise unsupported(ins)
    kind = ins.mods[1]
    # The copies in flight belong to each warp (a gang issues for all of its warps).
    if kind == "commit_group":
        def commit(w, m):
            for warp in executing_warps(w, m):
                warp.cp_groups.append(warp.cp_open)
                warp.cp_open = []
        return commit
    if kind in ("wait_group", "wait_all"):
        keep = 0 if kind == "wait_all" else int(ins.operands[0].text)

        def wait(w, m):
            landing = {}                  # id of an issue's copies -> (its copies, the rows landing)
            for warp in executing_warps(w, m):
                if kind == "wait_all":
                    warp.cp_groups.append(warp.cp_open)
                    warp.cp_open = []
                while len(warp.cp_groups) > keep:
                    for copies, rows in warp.cp_groups.pop(0):
                        landing.setdefault(id(copies), (copies, []))[1].append(rows)
            if landing:
                w.smem.async_deliver([_rows_of(copies, rows) for copies, rows in landing.values()])
        return wait
    # cp.async.{ca,cg}.shared.global [dst], [src], cp-size{, src-size | ignore-src}
    if set(ins.mods[1:]) - {"ca", "cg", "shared", "global"} - {m for m in ins.mods if m.startswith("L2::")}:
        raise unsupported(ins)
    dst, src, size = ins.operands[:3]
    n = int(size.text)
    if n not in (4, 8, 16):
        raise unsupported(ins, f"cp-size {n} (4, 8 or 16)")
    extra = ins.operands[3] if len(ins.operands) > 3 else None
    if isinstance(extra, Reg) and ops.reg_type(extra) == "pred":
        ignore = ops.read(extra, "pred")
        src_size = lambda w: np.where(ignore(w), 0, n).astype(np.int64)
    elif extra is not None:
        rs = ops.read(extra, "u32")
        src_size = lambda w: rs(w).astype(np.int64)
    else:
        src_size = constant(n, np.int64)
    daddr, saddr = ops.address(dst), ops.address(src)

    def issue(w, m):
        lanes = _lanes(m)
        d, s, k = daddr(w)[lanes], saddr(w)[lanes], src_size(w)[lanes]
        if (k > n).any() or (k < 0).any():
            raise EmulationError(f"cp.async src-size {int(k.max())} exceeds the copy size {n}")
        data = np.zeros((d.size, n), np.uint8)
        # the source is read now (nothing writes it during a kernel); bytes past src-size are zero
        full = k == n
        cta = _cta_of(w, lanes)
        if full.any():
            data[full] = w.gmem.load(s[full], n, "cp.async source", cta=cta if isinstance(cta, int) else cta[full])
        part = (k > 0) & ~full
        for i in np.nonzero(part)[0]:
            data[i, :k[i]] = _load_bytes(w, int(s[i]), int(k[i]), cta if isinstance(cta, int) else int(cta[i]))
        who, lane_ids = _who(w, lanes), _lane_ids(w, lanes)
        copies = (w.smem.async_issue(d, n, who, lane_ids, slot=_slot(w, lanes)), data, who, lane_ids)
        if len(w.members) == 1:
            w.cp_open.append((copies, slice(None)))
        else:     # rows are in lane order: each warp's are one slice of the issue's copies
            bounds = np.searchsorted(np.arange(w.nlanes)[lanes] // 32, np.arange(len(w.members) + 1))
            for warp, a, b in zip(w.members, bounds[:-1].tolist(), bounds[1:].tolist()):
                if b > a:
                    warp.cp_open.append((copies, slice(a, b)))
    return issue


def _rows_of(copies, rows):
    """The landing rows (slices, one per warp) of one issue's copies (indices, data, warp or warp
    per row, lane per row): all of them at once where every warp of the issue waits together."""
    n = len(copies[1])
    spans = sorted((r.start or 0, n if r.stop is None else r.stop) for r in rows)
    if spans[0][0] == 0 and spans[-1][1] == n and all(b == a for (_, b), (a, _) in zip(spans, spans[1:])):
        return copies
    take = np.concatenate([np.arange(a, b) for a, b in spans])
    return tuple(x if np.ndim(x) == 0 else x[take] for x in copies)


def _load_bytes(w, address: int, k: int, cta: int) -> np.ndarray:
    return w.gmem.load(np.arange(address, address + k, dtype=np.int64), 1, "cp.async source", cta=cta)[:, 0]
