"""Device memory for the emulator.

GlobalMemory: device memory *is* this process's memory. The host registers each range a kernel
may touch (numpy arrays, the stub runtime's cudaMalloc); every global access must fall inside one
registered range and be aligned to its width.

Within one launch GlobalMemory can also track which CTA wrote and which read each byte
(start_launch): a plain write of a byte another CTA wrote, read or read-modified atomically, an
atomic update of a byte another CTA read, and a read of a byte another CTA wrote, are races
(CTAs of a grid have no order: the verdict must not depend on which ran first); atomics may mix
freely.

SharedMemory: the shared memory of CTAs (one region each), with the checks the hardware does
not do for us:
 - cp.async tracking: bytes an issued cp.async has not delivered (no wait_group yet) cannot be
   read or written;
 - a race detector: within one barrier epoch (between two bar.sync), a byte written by one warp
   must not be read or written by another warp, and a byte read by one warp must not be written
   by another. The verdict does not depend on the warp schedule. In Hopper kernels, mbarriers
   and named barriers of fewer threads order accesses too (hopper_state's ordering.py);
 - within a warp, a lane must not read a byte another lane of the warp wrote since the warp's last
   __syncwarp (bar.warp.sync) or barrier: lanes of a warp are not ordered either (sm_70+).
"""
from __future__ import annotations

import bisect
import ctypes

import numpy as np

from flashgen.emulate import native
from flashgen.emulate.errors import EmulationError

# Masks are tested with np.count_nonzero, not ndarray.any(): a third of the cost per call
# (~0.8 us against ~2.5 us), and the checks run on every access.


class GlobalMemory:
    ATOMIC = -2        # owner mark of bytes updated by atomics in this launch
    SEVERAL = -3       # reader mark of bytes read by more than one CTA in this launch

    def __init__(self):
        self._owners: dict[int, np.ndarray] | None = None     # range start -> writer CTA per byte
        # range start -> reader CTA per aligned 4-byte word (reads of whole words) / per byte
        # (narrower reads); kept apart so that the common whole-word reads cost a quarter
        self._readers: dict[tuple[int, int], np.ndarray] = {}
        self._starts: list[int] = []
        self._ranges: list[tuple[int, int, str, np.ndarray]] = []   # (start, end, name, bytes view)
        self._starts_np = np.zeros(0, np.int64)
        self.counters = None            # counters.Counters of the running launch, if it counts
        self.atomic_order = None        # start_launch's

    def add(self, address: int, nbytes: int, name: str) -> None:
        if address <= 0 or nbytes < 0:
            raise EmulationError(f"cannot register global range {name!r} at {address:#x} ({nbytes} bytes)")
        end = address + nbytes
        i = bisect.bisect_right(self._starts, address)
        if (i > 0 and self._ranges[i - 1][1] > address) or (i < len(self._ranges) and self._ranges[i][0] < end):
            raise EmulationError(f"global range {name!r} [{address:#x}, {end:#x}) overlaps a registered one")
        view = np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(address))[:nbytes]
        self._starts.insert(i, address)
        self._ranges.insert(i, (address, end, name, view))
        self._starts_np = np.array(self._starts, np.int64)

    def remove(self, address: int) -> None:
        i = bisect.bisect_left(self._starts, address)
        if i == len(self._starts) or self._starts[i] != address:
            raise EmulationError(f"no global range registered at {address:#x}")
        del self._starts[i]
        del self._ranges[i]
        self._starts_np = np.array(self._starts, np.int64)

    def describe(self, address: int) -> str:
        """The nearest registered range, for error messages."""
        if not self._ranges:
            return "no global ranges are registered"
        i = max(bisect.bisect_right(self._starts, address) - 1, 0)
        cands = self._ranges[max(i - 1, 0):i + 2]
        s, e, n, _ = min(cands, key=lambda r: 0 if r[0] <= address < r[1] else min(abs(address - r[0]), abs(address - r[1])))
        where = (f"{address - s} bytes into" if s <= address < e else
                 f"{address - e} bytes past the end of" if address >= e else f"{s - address} bytes before")
        return f"{where} {n!r} [{s:#x}, {e:#x}, {e - s} bytes)"

    def _locate(self, addrs: np.ndarray, nbytes: int, what: str):
        """-> list of (view, byte offsets, lane selector or None, range start)."""
        if addrs.size == 0:
            return []
        a = addrs.astype(np.int64)
        if nbytes in (2, 4, 8, 16) and np.count_nonzero(a & (nbytes - 1)):
            x = int(a[(a & (nbytes - 1)) != 0][0])
            raise EmulationError(f"misaligned {what} of {nbytes} bytes at {x:#x} ({self.describe(x)})")
        # mostly every address lies in the range of the first: two reductions instead of a search
        r = bisect.bisect_right(self._starts, int(a[0])) - 1
        if r >= 0:
            s, e, _, view = self._ranges[r]
            if s <= a.min() and a.max() + nbytes <= e:
                return [(view, a - s, None, s)]
        idx = np.searchsorted(self._starts_np, a, side="right") - 1
        lo, hi = int(idx.min()), int(idx.max())
        parts = []
        for r in range(lo, hi + 1):
            sel = None if lo == hi else idx == r
            aa = a if sel is None else a[sel]
            if aa.size == 0:
                continue
            if r < 0:
                raise EmulationError(f"out-of-bounds {what} at {int(aa[0]):#x} ({self.describe(int(aa[0]))})")
            s, e, _, view = self._ranges[r]
            off = aa - s
            out = off + nbytes > e - s
            if np.count_nonzero(out):
                x = int(aa[out][0])
                raise EmulationError(f"out-of-bounds {what} of {nbytes} bytes at {x:#x} ({self.describe(x)})")
            parts.append((view, off, sel, s))
        return parts

    # -- CTA ownership of bytes within one launch ----------------------------------------------
    def start_launch(self, track_writers: bool, counters=None, atomic_order=None) -> None:
        """`atomic_order`: a seeded np.random.Generator that orders the updates of one element by
        one instruction (the hardware orders them in no defined way), else lane order."""
        self._owners = {} if track_writers else None
        self._readers = {}
        self.counters = counters
        self.atomic_order = atomic_order

    def end_launch(self) -> None:
        self._owners = None
        self._readers = {}
        self.counters = None
        self.atomic_order = None

    @staticmethod
    def _words(start, idx):
        """The absolute 4-byte words (numbered from the range's first) of byte offsets `idx`."""
        return (start + idx) // 4 - start // 4

    def _read_by_others(self, start, idx, cta, what):
        """Raise if another CTA read bytes `idx` of range `start` in this launch."""
        for granule in (4, 1):
            readers = self._readers.get((start, granule))
            if readers is None:
                continue
            prev = readers[self._words(start, idx) if granule == 4 else idx]
            bad = (prev != -1) & (prev != cta)
            if np.count_nonzero(bad):
                raise self._race(start, idx, bad, cta, what, prev, reads=True)

    def _reader_marks(self, start, view, off, nbytes):
        """(granule, reader marks) of a read of bytes [off, off + nbytes): per word for aligned whole
        words, else per byte."""
        granule = 4 if nbytes % 4 == 0 and (start + int(off[0])) % 4 == 0 else 1
        readers = self._readers.get((start, granule))
        if readers is None:
            readers = self._readers[(start, granule)] = np.full(view.size // granule + 2, -1, np.int32)
        return granule, readers

    def _owner_marks(self, start, view):
        owners = self._owners.get(start)
        if owners is None:
            owners = self._owners[start] = np.full(view.size, -1, np.int32)
        return owners

    def _mark_read(self, start, view, off, nbytes, cta):
        """Record the readers of bytes [off, off + nbytes)."""
        granule, readers = self._reader_marks(start, view, off, nbytes)
        at = (self._words(start, off) if granule == 4 else off)[:, None] + np.arange(nbytes // granule)
        prev = readers[at]
        mark = np.where((prev == -1) | (prev == cta), cta, self.SEVERAL)
        readers[at] = mark
        if not isinstance(cta, (int, np.integer)):
            again = readers[at] != mark             # rows of two CTAs read the granule in this access
            if np.count_nonzero(again):
                readers[at[again]] = self.SEVERAL

    @staticmethod
    def _rows(cta, sel):
        """The CTA of each row of an access to one range: `cta` is one id, or one per address."""
        if isinstance(cta, (int, np.integer)):
            return cta
        return (cta if sel is None else cta[sel])[:, None]

    def _race(self, start, idx, bad, cta, what, prev, reads=False):
        """The race at the first `bad` byte; `prev`: its writer marks (or reader marks: `reads`)."""
        pos = tuple(np.argwhere(bad)[0])
        other = int(prev[pos])
        if reads:
            how = "read by several CTAs" if other == self.SEVERAL else f"read by CTA {other}"
        else:
            how = "updated with atomics" if other == self.ATOMIC else f"written by CTA {other}"
        addr = start + int(idx[pos])
        me = int(np.broadcast_to(cta, idx.shape)[pos])
        return EmulationError(f"global-memory race: CTA {me} {what} {addr:#x} ({self.describe(addr)}), "
                              f"{how} in the same launch")

    def _conflict(self, start, idx, cta, what, allow_atomic):
        """Owner marks of `idx` in range `start`; raise if another CTA wrote them."""
        owners = self._owners.get(start)
        if owners is None:
            return None
        prev = owners[idx]
        # marks: -1 (none), ATOMIC (-2) or a CTA id (>= 0)
        other = prev >= 0 if allow_atomic else prev != -1
        if np.count_nonzero(other):
            bad = other & (prev != cta)
            if np.count_nonzero(bad):
                raise self._race(start, idx, bad, cta, what, prev)
        return owners

    def _mark(self, start, view, idx, owner, what):
        owners = self._owner_marks(start, view)
        owners[idx] = owner
        if not isinstance(owner, (int, np.integer)):     # rows of several CTAs: one byte, two writers?
            now = owners[idx]
            clash = now != owner
            if np.count_nonzero(clash):
                raise self._race(start, idx, clash, owner, what, now)

    def load(self, addrs: np.ndarray, nbytes: int, what: str = "global load", cta: int | None = None,
             data: bool = True) -> np.ndarray:
        """Bytes [len(addrs), nbytes] read at each address; `data`: counted as the kernel's data
        (counters.Counters), not a descriptor's."""
        if data and self.counters is not None:
            self.counters.global_bytes_loaded += addrs.size * nbytes
        out = np.empty((addrs.size, nbytes), np.uint8)
        for view, off, sel, start in self._locate(addrs, nbytes, what):
            if self._owners is not None and cta is not None:
                rows = self._rows(cta, sel)
                if self._native_load(view, start, off, nbytes, rows, out, sel):
                    continue
                if start in self._owners:      # (only a range written in this launch has owner marks)
                    self._conflict(start, off[:, None] + np.arange(nbytes), rows, "reads", allow_atomic=False)
                self._mark_read(start, view, off, nbytes, rows)
            if sel is None:
                out[:] = _gather(view, start, off, nbytes)
            else:
                out[sel] = _gather(view, start, off, nbytes)
        return out

    def _native_load(self, view, start, off, nbytes, rows, out, sel) -> bool:
        """A tracked load's checks, reader marks and copy in one native call, as load's numpy path
        does them; False, with nothing changed, where a check fails (that path names it)."""
        granule, readers = self._reader_marks(start, view, off, nbytes)
        dest = out if sel is None else np.empty((off.size, nbytes), np.uint8)
        if native.module().global_load(view, start, self._owners.get(start), readers, granule,
                                       np.ascontiguousarray(off, np.int64), nbytes, *_one_or_each(rows), dest):
            return False
        if sel is not None:
            out[sel] = dest
        return True

    def store(self, addrs: np.ndarray, data: np.ndarray, what: str = "global store", cta: int | None = None) -> None:
        nbytes = data.shape[1]
        cols = np.arange(nbytes)
        for view, off, sel, start in self._locate(addrs, nbytes, what):
            idx = off[:, None] + cols
            if self._owners is not None and cta is not None:
                rows = self._rows(cta, sel)
                self._conflict(start, idx, rows, "writes", allow_atomic=False)
                self._read_by_others(start, idx, rows, "writes")
                self._mark(start, view, idx, rows, "writes")
            view[idx] = data if sel is None else data[sel]

    def atomic_add(self, addrs: np.ndarray, values: np.ndarray, what: str = "global atomic",
                   cta: int | None = None, returns: bool = True) -> np.ndarray | None:
        """Apply `values` one lane after another (duplicates accumulate) and return the old values
        (None unless `returns`); the updates of one element go in the launch's seeded
        atomic_order, else in lane order."""
        dt = values.dtype
        n = dt.itemsize
        old = np.empty_like(values) if returns else None
        for view, off, sel, start in self._locate(addrs, n, what):
            if self._owners is not None and cta is not None and native.module().global_atomic(
                    self._owner_marks(start, view), start, self._readers.get((start, 4)), self._readers.get((start, 1)),
                    np.ascontiguousarray(off, np.int64), n, *_one_or_each(self._rows(cta, sel))):
                # a check failed (nothing changed): the numpy path names it
                idx = off[:, None] + np.arange(n)
                rows = self._rows(cta, sel)
                self._conflict(start, idx, rows, "updates atomically", allow_atomic=True)
                self._read_by_others(start, idx, rows, "updates atomically")
                self._mark(start, view, idx, self.ATOMIC, "updates atomically")
            typed = view[: view.size // n * n].view(dt)
            elems = off // n
            vals = values if sel is None else values[sel]
            if not returns:         # ufunc.at applies repeated elements' updates one after another, in order
                if self.atomic_order is not None:
                    order = self.atomic_order.permutation(elems.size)
                    elems, vals = elems[order], vals[order]
                np.add.at(typed, elems, vals)
                continue
            ordered = np.sort(elems)
            if not np.count_nonzero(ordered[1:] == ordered[:-1]):     # distinct elements (the common case): one update
                prev = typed[elems]
                typed[elems] = prev + vals
            else:
                prev = np.empty_like(vals)
                # round r applies each element's r-th update: the elements of one round are
                # distinct, so it is one vectorized read-modify-write
                rank = _occurrence(elems, None if self.atomic_order is None else
                                   self.atomic_order.permutation(elems.size))
                for r in range(int(rank.max()) + 1):    # (under the launch's errstate)
                    mine = rank == r
                    e = elems[mine]
                    prev[mine] = typed[e]
                    typed[e] = prev[mine] + vals[mine]
            if sel is None:
                old[:] = prev
            else:
                old[sel] = prev
        return old


def _one_or_each(x) -> tuple:
    """A value the same for every row (a CTA, a warp, a slot) as the native helpers take it: (it,
    None), or (0, one int64 per row)."""
    if isinstance(x, (int, np.integer)):
        return int(x), None
    return 0, np.ascontiguousarray(x, np.int64).reshape(-1)


def _gather(view, start, off, nbytes) -> np.ndarray:
    """Bytes [off, off + nbytes) of a range's bytes `view` (at address `start`) per offset: by
    aligned 4-byte words where all are (a quarter of the index arithmetic), else by bytes."""
    if nbytes % 4 == 0 and start % 4 == 0 and not np.bitwise_or.reduce(off) & 3:
        words = view[:view.size - view.size % 4].view(np.uint32)
        return words[(off >> 2)[:, None] + np.arange(nbytes >> 2)].view(np.uint8)
    return view[off[:, None] + np.arange(nbytes)]


def _occurrence(keys: np.ndarray, priority: np.ndarray | None = None) -> np.ndarray:
    """For each position, how many positions before it (or of lower `priority`) hold the same key."""
    order = np.argsort(keys, kind="stable") if priority is None else np.lexsort((priority, keys))
    ranked = keys[order]
    pos = np.arange(keys.size)
    first = np.maximum.accumulate(np.where(np.r_[True, ranked[1:] != ranked[:-1]], pos, 0))
    rank = np.empty_like(pos)
    rank[order] = pos - first
    return rank


class SharedMemory:
    """The shared memory of the CTAs of a wave, `size` bytes each, side by side: CTA slot s owns
    bytes [s * stride, s * stride + size). Accesses name the slot of each row and offsets within it.

    Race bookkeeping: per granule (a byte, or an aligned 4-byte word where no access is
    narrower: then each access covers whole words and the verdicts are the same), a stamp
    `epoch * 256 + warp` of its last writer and of its readers in the current epoch of its CTA
    (warp MANY when several warps read it; warps are numbered within their CTA). Stamps of older
    epochs are smaller than `epoch * 256`, so "accessed in this epoch by another warp" is two
    compares."""
    MANY = 255

    def __init__(self, nbytes: int, race_check: bool, ctas: int = 1, granule: int = 1, counters=None):
        # Shared memory starts as garbage on a GPU: 0xFF bytes (NaN floats) make reads of never
        # written bytes visible in the results instead of reading convenient zeros.
        self.stride = -(-nbytes // 16) * 16                 # no race granule spans two CTAs
        total = self.stride * ctas
        self.data = np.full(total, 0xFF, np.uint8)
        self.size = nbytes
        self.race_check = race_check
        self.words = self.data.view(np.uint32)
        self.pending = np.zeros(total, np.int16)            # undelivered cp.async bytes
        self.pending_words = self.pending.view(np.int64)     # nonzero: a word with such a byte
        self._pending_at = self.pending_words.ctypes.data     # (changed in place only)
        self.in_flight = 0                                   # their number
        self.epochs = np.ones(ctas, np.int64)
        self.granule = granule
        self.hopper = None                                   # hopper_state.AsyncState of a Hopper kernel
        self.counters = counters                             # counters.Counters of the launch, or None
        if race_check:
            n = -(-total // granule)
            self.w_stamp = np.zeros(n, np.int64)
            self.r_stamp = np.zeros(n, np.int64)
            self.w_lane = np.full(n, -1, np.int8)            # writer lane (-1: the whole warp)
            self.w_wsync = np.zeros(n, np.int64)             # the writer warp's __syncwarp count then
            self.warp_syncs = np.zeros((ctas, 32), np.int64)
            # the arrays change in place only, so the runtime's shared_memory_emu.cc keeps their addresses
            self._race_state = _RaceState(*(a.ctypes.data for a in (self.w_stamp, self.r_stamp, self.w_lane,
                                                                     self.w_wsync, self.warp_syncs, self.epochs)),
                                          granule, self.stride)
            self._race_at = ctypes.addressof(self._race_state)

    def barrier(self, slot: int = 0) -> None:
        self.epochs[slot] += 1
        if self.hopper is not None:
            self.hopper.cta_barrier(slot)

    # -- Hopper: the async proxy's writes, and the happens-before of hopper_state's ordering ------
    def claim(self, idx: np.ndarray, warp: int, what: str) -> None:
        """An asynchronous write (a TMA load) of flat byte indices `idx` [rows, nbytes] issued
        by `warp`: checked as its write when issued."""
        if self.race_check:
            try:
                self._race_write(self._granules(idx), warp, None)
            except EmulationError as e:
                raise EmulationError(f"{what}: {e}") from None

    def async_written(self, idx: np.ndarray, agent: int) -> None:
        """The async proxy (`agent`) wrote these bytes (a TMA load landed; checked by claim)."""
        if self.race_check:
            g = self._granules(idx)
            self.w_stamp[g] = (self.epochs[g * self.granule // self.stride] << 8) | agent
            self.r_stamp[g] = 0
            self.w_lane[g] = -1
            self.hopper.order.stamp(g, agent, write=True)

    def warp_sync(self, warps) -> None:
        """bar.warp.sync by these warps: their lanes' earlier writes are visible to each other."""
        if self.race_check:
            for w in warps:
                self.warp_syncs[w.cta.slot, w.wid] += 1

    def _bytes(self, offs: np.ndarray, nbytes: int, what: str, slot) -> np.ndarray:
        o = offs.astype(np.int64, copy=False)
        if o.size == 0:
            return o.reshape(0, nbytes)
        if nbytes in (1, 2, 4, 8, 16) and np.count_nonzero(o & (nbytes - 1)):
            x = int(o[o % nbytes != 0][0])
            raise EmulationError(f"misaligned shared {what} of {nbytes} bytes at offset {x}")
        if o.min() < 0 or o.max() + nbytes > self.size:
            x = int(o[(o < 0) | (o + nbytes > self.size)][0])
            raise EmulationError(f"out-of-bounds shared {what} of {nbytes} bytes at offset {x} "
                                 f"(the CTA has {self.size} bytes of shared memory)")
        return (o + slot * self.stride)[:, None] + np.arange(nbytes)

    def _check_pending(self, idx: np.ndarray, what: str) -> None:
        if not self.in_flight:
            return
        p = self.pending[idx]
        if np.count_nonzero(p):
            x = int(idx[p > 0][0]) % self.stride
            note = self.hopper.pending_note(int(idx[p > 0][0])) if self.hopper is not None else None
            raise EmulationError(f"shared {what} at offset {x} touches bytes " + (note or "a cp.async has not "
                                 "delivered yet (missing cp.async.wait_group before this access?)"))

    def _race(self, x: int, warp: int, stamp: int, verb: str, how: str) -> EmulationError:
        other = stamp & 255
        who = "several warps" if other == self.MANY else f"warp {other}"
        return EmulationError(f"shared-memory race: warp {warp} {verb} offset {x * self.granule % self.stride}, "
                              f"{how} by {who} with no barrier in between")

    def _granules(self, idx):
        """The race detector's granules of byte indices [rows, nbytes]."""
        g = self.granule
        return idx if g == 1 else idx[:, ::g] // g

    def _native(self, fn, idx, warp, lanes, *flags):
        """Run shared_memory_emu.cc's `fn` on access `idx` [rows, granules] (`flags`: its trailing
        arguments): (its return code, the verdicts per granule, idx as it ran, the warp of each
        row [rows, 1])."""
        idx = np.ascontiguousarray(idx, np.int64).reshape(len(idx), -1)
        rows = np.asarray(warp, np.int64).reshape(-1, 1)
        warps = None if rows.size == 1 else np.ascontiguousarray(rows[:, 0])
        lanes = None if lanes is None else np.ascontiguousarray(lanes, np.int64)
        verdict = np.empty(idx.shape, np.uint8)
        code = fn(self._race_at, idx, int(rows[0, 0]), warps, lanes, verdict, *flags)
        return code, verdict, idx, rows

    def _race_read(self, idx, warp, lanes):
        code, verdict, idx, rows = self._native(native.module().race_read, idx, warp, lanes)
        if code:        # verdicts on the stamps before this access (the readers' are updated)
            bad = verdict == 1         # written in this epoch by another warp
            if np.count_nonzero(bad) and self.hopper is not None:      # an mbarrier or a partial barrier may order it
                bad &= self.hopper.order.unordered_write(idx, rows)
            if np.count_nonzero(bad):
                pos = tuple(np.argwhere(bad)[0])
                raise self._race(int(idx[pos]), int(np.broadcast_to(rows, idx.shape)[pos]), int(self.w_stamp[idx[pos]]),
                                 "reads", "written")
            other = verdict == 2       # written by another lane of this warp since its last __syncwarp
            if np.count_nonzero(other):
                pos = tuple(np.argwhere(other)[0])
                reader = "the warp (ldmatrix)" if lanes is None else f"lane {int(lanes[pos[0]])}"
                writer = int(self.w_lane[idx[pos]])
                raise EmulationError(
                    f"shared-memory race in warp {int(np.broadcast_to(rows, idx.shape)[pos])}: {reader} reads "
                    f"offset {int(idx[pos]) * self.granule % self.stride}, written by "
                    f"{'the warp' if writer < 0 else f'lane {writer}'} with no __syncwarp in between")
        if self.hopper is not None:
            self.hopper.order.stamp(idx, rows, write=False)

    def _race_write(self, idx, warp, lanes):
        race_write = native.module().race_write
        code, verdict, idx, rows = self._native(race_write, idx, warp, lanes, 1)
        if code == 1:   # verdicts on the stamps before this access, none changed yet
            ww, rw = (verdict & 1).astype(bool), (verdict & 2).astype(bool)
            if self.hopper is not None:
                ww &= self.hopper.order.unordered_write(idx, rows)
                rw &= self.hopper.order.unordered_reads(idx, rows)
            if np.count_nonzero(ww) or np.count_nonzero(rw):
                pos = tuple(np.argwhere(ww | rw)[0])
                stamp, how = (self.w_stamp, "written") if ww[pos] else (self.r_stamp, "read")
                raise self._race(int(idx[pos]), int(np.broadcast_to(rows, idx.shape)[pos]), int(stamp[idx[pos]]),
                                 "writes", how)
            code = self._native(race_write, idx, warp, lanes, 0)[0]
        if code == 2:   # rows of two warps wrote one granule in this instruction
            pos = tuple(np.argwhere(verdict == 4)[0])
            raise self._race(int(idx[pos]), int(np.broadcast_to(rows, idx.shape)[pos]), int(self.w_stamp[idx[pos]]),
                             "writes", "written")
        if self.hopper is not None:
            self.hopper.order.stamp(idx, rows, write=True)

    # `warp`: the warp of the access (one per row for a gang); `lanes`: the lane of each row, or
    # None when the rows are read on behalf of the whole warp (ldmatrix); `slot`: the CTA's slot
    # (one per row for a gang over several CTAs).
    def _whole_words(self, offs, nbytes, slot):
        """The 4-byte words [rows, nbytes / 4] of an access of whole words where the detector
        keeps word granules and no Hopper state watches bytes, else None: also when an offset is
        misaligned or out of bounds or a byte is pending, which the byte path names. The same
        checks and verdicts as the byte path with a quarter of the index arithmetic (ldmatrix,
        16-byte cp.async and vector accesses)."""
        if nbytes not in (4, 8, 16) or self.granule != 4 or self.hopper is not None:
            return None
        o = np.ascontiguousarray(offs, np.int64)
        if o.size == 0:
            return None
        words = np.empty((o.size, nbytes >> 2), np.int64)
        if native.module().shared_words(o, nbytes, *_one_or_each(slot), self.size, self.stride,
                                        self._pending_at if self.in_flight else 0, words):
            return None
        return words

    def _count(self, offs, nbytes, warp, lanes, slot):
        """Bank-conflict counters of a generic-proxy access; `lanes` None: rows in lane order per warp."""
        if self.counters is None:
            return
        who = np.asarray(slot, np.int64) * 256 + warp
        if lanes is None:
            lanes = np.arange(offs.size) if who.ndim == 0 else _occurrence(who)
        self.counters.shared_access(offs, nbytes, who, lanes)

    def _load_words(self, offs, nbytes, warp, lanes, slot):
        """A load of whole words in one native call, checked as _whole_words and _race_read check
        it, or None where they would find something to name (they run again, and name it)."""
        o = np.ascontiguousarray(offs, np.int64)
        if o.size == 0:
            return None
        out = np.empty((o.size, nbytes >> 2), np.uint32)
        if native.module().shared_load(o, nbytes, *self._checked_load(slot, warp),
                                       None if lanes is None else np.ascontiguousarray(lanes, np.int64), self.words,
                                       out):
            return None
        return out.view(np.uint8)

    def _checked_load(self, slot, warp) -> tuple:
        """The native loads' common arguments (shared_load's and ldmatrix's): the CTA slot(s), this
        memory's size and stride, the cp.async and race state checked against, the warp(s)."""
        return (*_one_or_each(slot), self.size, self.stride, self._pending_at if self.in_flight else 0,
                self._race_at if self.race_check else 0, *_one_or_each(warp))

    def ldmatrix(self, addr, offset, nmat, executing, slot, warp, gather, dests) -> bool:
        """ldmatrix's rows loaded and its `dests` filled in one native call (shared_memory_emu.cc)
        from its address register `addr` (+ `offset`), as load() would load them; False, with
        nothing written, where load's own checks must run (counters, Hopper orderings, byte
        granules) or would find something to name."""
        if self.counters is not None or not self._word_mode():
            return False
        return not native.module().ldmatrix(addr, offset, nmat, executing, *self._checked_load(slot, warp),
                                            self.words, gather, *dests)

    def load(self, offs: np.ndarray, nbytes: int, warp, what: str = "load", lanes=None, slot=0) -> np.ndarray:
        self._count(offs, nbytes, warp, lanes, slot)
        if nbytes in (4, 8, 16) and self._word_mode():
            data = self._load_words(offs, nbytes, warp, lanes, slot)
            if data is not None:
                return data
        words = self._whole_words(offs, nbytes, slot)
        if words is not None:
            if self.race_check:
                self._race_read(words, warp, lanes)
            return self.words[words].view(np.uint8)
        idx = self._bytes(offs, nbytes, what, slot)
        self._check_pending(idx, what)
        if self.race_check:
            self._race_read(self._granules(idx), warp, lanes)
        return self.data[idx]

    def store(self, offs: np.ndarray, data: np.ndarray, warp, what: str = "store", lanes=None, slot=0) -> None:
        self._count(offs, data.shape[1] * data.dtype.itemsize, warp, lanes, slot)
        words = self._whole_words(offs, data.shape[1], slot) if data.dtype == np.uint8 else None
        if words is not None:
            if self.race_check:
                self._race_write(words, warp, lanes)
            self.words[words] = np.ascontiguousarray(data).view(np.uint32)
            return
        idx = self._bytes(offs, data.shape[1], what, slot)
        self._check_pending(idx, what)
        if self.race_check:
            self._race_write(self._granules(idx), warp, lanes)
        if self.hopper is not None:
            self.hopper.generic_write(idx, warp)
        self.data[idx] = data

    def _word_mode(self) -> bool:
        """cp.async copies are tracked by word (granule) indices, not byte indices."""
        return self.granule == 4 and self.hopper is None

    def async_issue(self, offs: np.ndarray, nbytes: int, warp, lanes=None, slot=0) -> np.ndarray:
        """A cp.async targets these bytes: check them like a write, then mark them in flight.
        Returns their indices for async_deliver: words in word mode, else bytes."""
        self._count(offs, nbytes, warp, lanes, slot)
        words = self._whole_words(offs, nbytes, slot)
        if words is not None:
            if self.race_check:
                self._race_write(words, warp, lanes)
            native.module().add_each(self.pending_words, words, _EACH_BYTE_OF_A_WORD)
            self.in_flight += 4 * words.size
            return words
        idx = self._bytes(offs, nbytes, "cp.async destination", slot)
        self._check_pending(idx, "cp.async destination")
        if self.race_check:
            self._race_write(self._granules(idx), warp, lanes)
        self.pending[idx] += 1
        self.in_flight += idx.size
        return self._granules(idx) if self._word_mode() else idx

    def async_deliver(self, copies) -> None:
        """Land issued copies, (indices from async_issue, data, warp or warp per row, lanes) each, in
        this order: a write of the current epoch by their warps."""
        idx = np.concatenate([c[0] for c in copies])
        data = np.concatenate([c[1] for c in copies])
        warps = np.concatenate([np.broadcast_to(c[2], len(c[0])) for c in copies])
        # no two copies in flight share a byte (async_issue refuses it), so none is counted twice
        if self._word_mode():
            native.module().add_each(self.pending_words, idx, -_EACH_BYTE_OF_A_WORD)
            self.in_flight -= 4 * idx.size
            if self.race_check:
                self._race_write(idx, warps, np.concatenate([c[3] for c in copies]))
            self.words[idx] = np.ascontiguousarray(data).view(np.uint32)
            return
        self.pending[idx] -= 1
        self.in_flight -= idx.size
        if self.race_check:
            self._race_write(self._granules(idx), warps, np.concatenate([c[3] for c in copies]))
        if self.hopper is not None:
            self.hopper.generic_write(idx, warps)
        self.data[idx] = data


class _RaceState(ctypes.Structure):
    """shared_memory_emu.cc's FlashgenEmuRaceState (passed by address)."""
    _fields_ = [(name, ctypes.c_void_p) for name in ("w_stamp", "r_stamp", "w_lane", "w_wsync", "warp_syncs",
                                                      "epochs")] + [("granule", ctypes.c_int64),
                                                                    ("stride", ctypes.c_int64)]


# added to a word of SharedMemory.pending_words: one more in flight for each of its 4 bytes' counters
_EACH_BYTE_OF_A_WORD = np.int64(0x0001_0001_0001_0001)
