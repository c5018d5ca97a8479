"""TMA: cp.async.bulk.tensor.{1-5}d tile loads (global -> shared, counted on an mbarrier with
mbarrier::complete_tx::bytes), stores and f32 reduce-adds (shared -> global, in bulk groups:
cp.async.bulk.tensor ... .bulk_group, cp.reduce.async.bulk.tensor ... .add, and the untiled
cp.reduce.async.bulk ... .add.f32), untiled cp.async.bulk loads and stores,
cp.async.bulk.commit_group, cp.async.bulk.wait_group{.read} N, prefetch.tensormap.

A load reads global memory at issue; its bytes count toward its mbarrier, and its data lands in
shared memory, when a thread next waits on that mbarrier, once the phase completes
(hopper_state.AsyncState.tma_write): a read before that is an error. The box is
laid out row-major (dimension 0 innermost) from the destination, each element's address passed
through the map's swizzle (the same Swizzle<B,4,3> of the address as wgmma's descriptors, so a
128B-swizzled tile is what a 128B-swizzled descriptor reads). Elements outside the tensor are
filled with zeros (NaN bytes with the NaN OOB fill) and still count toward the transaction
bytes; a store skips them. A store reads shared memory through the async proxy (fenced generic
writes only) and keeps those bytes busy until a wait_group.read retires its group.
"""
from __future__ import annotations

import numpy as np

from flashgen.emulate import tensormap
from flashgen.emulate.errors import EmulationError
from flashgen.emulate.operands import PARAM_WINDOW
from flashgen.emulate.ptx import Addr, TensorAddr
from flashgen.emulate.semantics.hopper_sync import warp_lanes
from flashgen.emulate.semantics.registry import HANDLERS, handles, unsupported

_plain_cp = HANDLERS["cp"]                       # cp.async (memops.py): everything but the bulk forms
_HINTS = {"tile", "L2::cache_hint"}
F32_TYPES = {7, 10}                              # CU_TENSOR_MAP_DATA_TYPE_FLOAT32(_FTZ)


@handles("cp", per_warp=True)
def cp(ins, ops):
    if ins.mods[:3] == ("reduce", "async", "bulk"):
        return _reduce(ins, ops)
    if ins.mods[:2] != ("async", "bulk"):
        return _plain_cp(ins, ops)
    mods = ins.mods[2:]
    if mods == ("commit_group",):
        def commit(w, m):
            for warp, _, _ in warp_lanes(w, m):
                st = _bulk(warp)
                st["groups"].append(st["open"])
                st["open"] = []
        return commit
    if mods in (("wait_group",), ("wait_group", "read")):
        keep = int(ins.operands[0].text, 0)

        def wait(w, m):
            for warp, _, _ in warp_lanes(w, m):
                st = _bulk(warp)
                while len(st["groups"]) > keep:
                    warp.smem.hopper.async_read_done(st["groups"].pop(0))
        return wait
    if mods[:1] == ("tensor",) and len(mods) > 1 and mods[1] in ("1d", "2d", "3d", "4d", "5d"):
        rank, rest = int(mods[1][0]), set(mods[2:]) - _HINTS
        if rest == {"shared::cluster", "global", "mbarrier::complete_tx::bytes"} or \
                rest == {"shared::cta", "global", "mbarrier::complete_tx::bytes"}:
            return _load(ins, ops, rank)
        if rest == {"global", "shared::cta", "bulk_group"}:
            return _store(ins, ops, rank, reduce=False)
    rest = set(mods) - {"L2::cache_hint"}
    if rest in ({"shared::cluster", "global", "mbarrier::complete_tx::bytes"},
                {"shared::cta", "global", "mbarrier::complete_tx::bytes"}):
        return _untiled(ins, ops, "load")
    if rest == {"global", "shared::cta", "bulk_group"}:
        return _untiled(ins, ops, "store")
    raise unsupported(ins, "only tile-mode cp.async.bulk.tensor and untiled cp.async.bulk loads "
                           "(mbarrier::complete_tx::bytes) and stores (bulk_group) are modelled")


def _bulk(warp) -> dict:
    st = warp.smem.hopper.of_warp(warp)
    if "bulk" not in st:
        st["bulk"] = {"open": [], "groups": []}        # shared bytes each store reads, by group
    return st["bulk"]


def _tensor_operand(ins, ops, op, rank):
    if not isinstance(op, TensorAddr) or len(ops.vector(op.coords)) != rank:
        raise unsupported(ins, f"expected [tensorMap, {{{rank} coordinates}}]")
    return ops.address(Addr(op.base, 0)), [ops.read(c, "s32") for c in ops.vector(op.coords)]


def _lanes(w, m):
    """(warp, gang lane) of each executing lane: each lane issues its own copy."""
    for warp, sl, lanes in warp_lanes(w, m):
        for lane in range(32) if lanes is None else np.flatnonzero(lanes):
            yield warp, sl.start + int(lane)


def _map_at(warp, address: int) -> tensormap.TensorMap:
    if address % 64:
        raise EmulationError(f"tensor map at {address:#x} is not 64-byte aligned")
    if address >= PARAM_WINDOW:                        # a __grid_constant__ kernel parameter
        off = address - PARAM_WINDOW
        if off + 128 > warp.params.size:
            raise EmulationError(f"tensor map at parameter offset {off} runs past the parameter buffer")
        raw = warp.params[off:off + 128]
    else:
        raw = warp.gmem.load(np.array([address], np.int64), 128, "tensor map read", cta=warp.cta_index, data=False)[0]
    return tensormap.decode(raw)


def _box(tmap: tensormap.TensorMap, coords: list, smem_base: int, what: str):
    """(shared offsets [elements], global addresses [elements], in-bounds mask) of a box at `coords`."""
    if smem_base % 128:
        raise EmulationError(f"{what} shared address {smem_base} is not 128-byte aligned")
    shape = tmap.box_shape()                       # innermost first
    grids = np.meshgrid(*[c + s * np.arange(n) for c, s, n in zip(coords, tmap.element_strides, shape)],
                        indexing="ij")             # [n0, n1, ...]
    idx = [g.transpose().reshape(-1) for g in grids]   # row-major with dimension 0 innermost
    inside = np.ones(idx[0].size, bool)
    for i, d in zip(idx, tmap.dims):
        inside &= (i >= 0) & (i < d)
    gaddr = tmap.address + idx[0] * tmap.elem
    for i, stride in zip(idx[1:], tmap.strides):
        gaddr = gaddr + i * stride
    addr = smem_base + np.arange(idx[0].size) * tmap.elem
    width = tmap.swizzle_bytes
    if width:
        bits = {32: 1, 64: 2, 128: 3}[width]
        addr = addr ^ ((addr >> 3) & (((1 << bits) - 1) << 4))
    return addr, gaddr, inside


def _boxes(rank, rmap, rcoords, rsmem, what):
    """-> run(w, m) -> (warp, lane, map, shared offsets, global addresses, in-bounds) per
    executing lane's copy (each lane issues its own)."""
    def each(w, m):
        a, sm = rmap(w), rsmem(w)
        coords = [r(w) for r in rcoords]
        for warp, lane in _lanes(w, m):
            tmap = _map_at(warp, int(a[lane]))
            if tmap.rank != rank:
                raise EmulationError(f"{rank}d {what} with a rank-{tmap.rank} tensor map")
            yield (warp, lane, tmap, *_box(tmap, [int(c[lane]) for c in coords], int(sm[lane]), what))
    return each


def _load(ins, ops, rank):
    dst, src, bar = ins.operands[:3]
    if len(ins.operands) > 4 or not isinstance(dst, Addr) or not isinstance(bar, Addr):
        raise unsupported(ins)
    rbar = ops.address(bar)
    boxes = _boxes(rank, *_tensor_operand(ins, ops, src, rank), ops.address(dst), "TMA load")

    def run(w, m):
        b = rbar(w)
        for warp, lane, tmap, saddr, gaddr, inside in boxes(w, m):
            data = np.full((saddr.size, tmap.elem), 0xFF if tmap.oob_fill else 0, np.uint8)
            if inside.any():
                data[inside] = warp.gmem.load(gaddr[inside], tmap.elem, "TMA load source", cta=warp.cta_index)
            h = warp.smem.hopper
            h.tma_write(warp, saddr, data, h.mbarrier(warp, int(b[lane])), tmap.box_bytes())
    return run


def _store(ins, ops, rank, reduce):
    """A TMA store, or (reduce) an f32 reduce-add, of the box at the shared source."""
    dst, src = ins.operands[:2]
    if len(ins.operands) > 3 or not isinstance(src, Addr):
        raise unsupported(ins)
    what = "TMA reduce-add" if reduce else "TMA store"
    boxes = _boxes(rank, *_tensor_operand(ins, ops, dst, rank), ops.address(src), what)

    def run(w, m):
        for warp, _, tmap, saddr, gaddr, inside in boxes(w, m):
            if reduce and tmap.dtype not in F32_TYPES:
                raise EmulationError(f"{what} into a tensor map of data type {tmap.dtype}: only f32 adds are modelled")
            h = warp.smem.hopper
            data = h.async_bytes(warp, saddr, tmap.elem, what)
            if inside.any():
                _write(warp, gaddr[inside], data[inside], reduce, what)
            _bulk(warp)["open"].append(h.async_read_start(warp, saddr, tmap.elem))
    return run


def _write(warp, gaddr, data, reduce, what):
    if reduce:
        warp.gmem.atomic_add(gaddr, np.ascontiguousarray(data).view(np.float32)[:, 0], what, cta=warp.cta_index,
                             returns=False)
    else:
        warp.gmem.store(gaddr, data, what, cta=warp.cta_index)


def _reduce(ins, ops):
    mods = ins.mods[3:]
    if mods[:1] == ("tensor",) and len(mods) > 1 and mods[1] in ("1d", "2d", "3d", "4d", "5d"):
        if set(mods[2:]) - _HINTS == {"global", "shared::cta", "add", "bulk_group"}:
            return _store(ins, ops, int(mods[1][0]), reduce=True)
    elif set(mods) - {"L2::cache_hint"} == {"global", "shared::cta", "bulk_group", "add", "f32"}:
        return _untiled(ins, ops, "reduce")
    raise unsupported(ins, "only the f32 add of cp.reduce.async.bulk(.tensor) is modelled")


def _untiled(ins, ops, kind):
    """The untiled bulk copies, [dst], [src], size (multiples of 16): a load (global -> shared,
    `, [mbar]`, landing as a TMA load does), a store, or an f32 reduce-add (shared -> global)."""
    dst, src, size = ins.operands[:3]
    rdst, rsrc, rsize = ops.address(dst), ops.address(src), ops.read(size, "u32")
    rbar = ops.address(ins.operands[3]) if kind == "load" else None
    what = {"load": "cp.async.bulk load", "store": "cp.async.bulk store", "reduce": "cp.reduce.async.bulk"}[kind]
    elem = 4 if kind == "reduce" else 16

    def run(w, m):
        d, s, n = rdst(w), rsrc(w), rsize(w)
        for warp, lane in _lanes(w, m):
            nbytes = int(n[lane])
            if nbytes % 16 or d[lane] % 16 or s[lane] % 16:
                raise EmulationError(f"{what} of {nbytes} bytes from {int(s[lane]):#x} to {int(d[lane]):#x}: the "
                                     f"size and both addresses must be multiples of 16")
            h, step = warp.smem.hopper, elem * np.arange(nbytes // elem)
            if kind == "load":
                data = warp.gmem.load(int(s[lane]) + step, 16, f"{what} source", cta=warp.cta_index)
                h.tma_write(warp, int(d[lane]) + step, data, h.mbarrier(warp, int(rbar(w)[lane])), nbytes)
                continue
            saddr = int(s[lane]) + step
            _write(warp, int(d[lane]) + step, h.async_bytes(warp, saddr, elem, what), kind == "reduce", what)
            _bulk(warp)["open"].append(h.async_read_start(warp, saddr, elem))
    return run


@handles("prefetch", per_warp=True)
def prefetch(ins, ops):
    if ins.mods not in (("tensormap",), ("param", "tensormap"), ("const", "tensormap")):
        raise unsupported(ins)
    raddr = ops.address(ins.operands[0])

    def run(w, m):            # changes no value; the map must be one, though
        a = raddr(w)
        for warp, lane in _lanes(w, m):
            _map_at(warp, int(a[lane]))
    return run
