"""Hopper's asynchronous state of a wave: mbarriers, named barriers, and the generic -> async
proxy fence bookkeeping, kept beside the wave's SharedMemory (as `smem.hopper`).

The machine attaches it (attach) only to launches of kernels that use a Hopper instruction, so
that the bookkeeping costs nothing elsewhere. What each piece models:

 - MBarrier: the PTX ISA's mbarrier object (pending arrival count, expected arrival count,
   transaction count, phase). A phase completes when the pending arrivals and the transaction
   count both reach zero; then the next phase starts with the expected count. TMA loads count
   their bytes (and land their data) when a thread next waits on the barrier.
   Parking: a warp whose try_wait fails on one barrier stops (machine.py's _WAIT kind:
   park()) until that barrier's phase completes or a TMA load is issued to it (which may
   complete it when a thread next waits), instead of spinning in its wait loop; it then goes on
   from the instruction after the failed try_wait, as if it had been slow. When no warp of the
   wave can run, retry_parked() wakes every parked warp once; if they all park again where they
   were, with no barrier changed, no warp will ever complete them: a deadlock, which
   hang_note() describes (which warp waits on what). A diverged warp (one lane of a producer
   warp waiting alone) parks the same way, its other lanes' pcs kept.
 - NamedBarrier: `bar.sync id, n` / `bar.arrive id, n`: each arriving warp counts 32 threads
   (the PTX ISA counts whole warps); the waiting warps are released once n have arrived. A
   barrier that every warp of the CTA joins starts a new epoch of the shared-memory race
   detector; a partial one (and an mbarrier) orders the warps it releases after the arrivals
   (ordering.py: the happens-before the detector consults).
 - The proxy fence: shared-memory bytes written through the generic proxy (st.shared, cp.async,
   stmatrix) are marked with their writer warp until that warp executes fence.proxy.async; an
   async-proxy read (wgmma from a descriptor, a TMA store) of a marked byte is an error.
 - WgmmaReads: the wgmma that read a shared byte, against what each warp knows has completed.
   A warpgroup's wgmmas complete in order, so that knowledge is one number per warpgroup (the
   latest completed wgmma) per warp: a warp learns it from its own wait_group, and passes on
   what it knows with an mbarrier arrival (to the warps whose wait sees that phase complete)
   or a barrier (named: to its waiting warps; the CTA's: to all). A write (st.shared, stmatrix,
   a TMA load) to a byte that a wgmma read is an error unless the writing warp knows that wgmma
   completed: releasing a stage before wgmma.wait_group is caught whatever the schedule.
   (TMA stores' reads end, more simply, at the issuing warp's cp.async.bulk.wait_group.read.)
"""
from __future__ import annotations

import numpy as np

from flashgen.emulate import ordering
from flashgen.emulate.errors import EmulationError
from flashgen.emulate.ptx import Imm

# Opcodes whose presence makes a launch carry this state (the async proxy, mbarriers, named
# barriers and the warpgroup instructions all need it).
HOPPER_OPCODES = frozenset({"mbarrier", "wgmma", "fence", "elect", "setmaxnreg", "stmatrix"})


def uses_hopper(kernel) -> bool:
    return any(ins.opcode in HOPPER_OPCODES or (ins.opcode == "cp" and "bulk" in ins.mods) or
               (ins.opcode in ("bar", "barrier") and named_barrier(ins)) for ins in kernel.instructions)


def blocking(ins) -> bool:
    """An instruction that may make its warp wait, other than the CTA barrier (machine.py's
    _NAMED kind): wgmma.mma_async, or a named barrier."""
    return (ins.opcode == "wgmma" and ins.mods[:1] == ("mma_async",)) or \
        (ins.opcode in ("bar", "barrier") and named_barrier(ins))


def parks(ins) -> bool:
    """An instruction after which its warp may park (machine.py's _WAIT kind: AsyncState.park)."""
    return ins.opcode == "mbarrier" and ins.mods[:1] in (("try_wait",), ("test_wait",))


def named_barrier(ins) -> bool:
    """A barrier instruction the machine's CTA barrier does not cover: an arrive, or a sync on
    an id other than the literal 0 (or an id in a register)."""
    if "arrive" in ins.mods:
        return True
    if "sync" not in ins.mods or "warp" in ins.mods or not ins.operands:
        return False
    first = ins.operands[0]
    return not (isinstance(first, Imm) and int(first.text, 0) == 0)


def attach(smem) -> None:
    smem.hopper = AsyncState(smem)


class MBarrier:
    def __init__(self, offset: int, count: int):
        if not 1 <= count < 1 << 20:
            raise EmulationError(f"mbarrier.init at offset {offset} with count {count} (must be in [1, 2^20))")
        self.offset, self.expected, self.pending, self.tx, self.phase = offset, count, count, 0, 0
        self.on_complete = []           # callbacks of the current phase (TMA deliveries)
        self.carry = None               # knowledge the arrivals so far passed on (AsyncState.release)
        self.published = None           # ... as of the last phase completion
        self.in_flight = []             # (bytes, delivery) of TMA loads issued, not yet landed
        self.parked = []                # warps parked on a failed try_wait (AsyncState.park)
        self.init_by = None             # (warp, time) of the mbarrier.init, where ordering is tracked

    def describe(self) -> str:
        return (f"mbarrier at shared offset {self.offset} in phase {self.phase} (parity {self.phase & 1}): "
                f"{self.pending} of {self.expected} arrivals and {self.tx} transaction bytes pending")

    def arrive(self, n: int) -> int:
        """n arrivals; -> the phase they arrived in (the state token)."""
        if n > self.pending:
            raise EmulationError(f"{n} arrivals on an {self.describe()} (more arrivals than the phase expects)")
        phase = self.phase
        self.pending -= n
        self._maybe_complete()
        return phase

    def expect_tx(self, nbytes: int) -> None:
        self.tx += nbytes
        self._maybe_complete()

    def complete_tx(self, nbytes: int) -> None:
        self.tx -= nbytes
        if self.tx < 0 and self.pending == 0:
            raise EmulationError(f"complete_tx of {nbytes} bytes on an {self.describe()}: more transaction "
                                 f"bytes arrived than expect_tx announced (expect_tx byte count too small?)")
        self._maybe_complete()

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            done, self.on_complete = self.on_complete, []
            for fn in done:             # TMA deliveries: their release joins the phase's
                fn()
            self.published = self.carry             # (release makes new arrays: never changed in place)
            self.phase += 1
            self.pending = self.expected
            self.wake()

    def issue(self, nbytes: int, deliver) -> None:
        """A TMA load that counts `nbytes` toward this barrier, its data landed by `deliver`."""
        self.in_flight.append((nbytes, deliver))
        self.wake()                     # its waiters' next try_wait lands it

    def wake(self) -> None:
        for w in self.parked:
            w.at_barrier, w.named_wait = False, None
        self.parked = []

    def state(self) -> tuple:
        return self.phase, self.pending, self.tx, len(self.in_flight)

    def land(self) -> None:
        """The issued TMA loads complete their bytes. Done when a thread waits on the barrier
        (the earliest the program may rely on them), so that a read before any wait fails."""
        landing, self.in_flight = self.in_flight, []
        for nbytes, deliver in landing:
            self.on_complete.append(deliver)
            self.complete_tx(nbytes)

    def completed(self, parity: int) -> bool:
        """try_wait.parity: whether the phase of this parity (the current one or the one before)
        has completed, i.e. the current phase has the other parity."""
        return (self.phase & 1) != (parity & 1)


class NamedBarrier:
    def __init__(self, count: int):
        self.count, self.arrived, self.waiting = count, 0, []
        self.carry = None               # knowledge of the arriving warps (AsyncState.release)


class WgmmaReads:
    """Per CTA slot: seq[g, byte], the latest wgmma (numbered from 1 per warpgroup g) that read
    each shared byte; known[warp, g], the latest wgmma of warpgroup g each warp knows completed."""

    def __init__(self, nbytes: int, warps: int):
        self.groups = -(-warps // 4)
        self.seq = np.zeros((self.groups, nbytes), np.int32)
        self.issued = np.zeros(self.groups, np.int32)
        self.retired = np.zeros(self.groups, np.int32)
        self.known = np.zeros((warps, self.groups), np.int32)

    def read(self, g: int, local: np.ndarray) -> int:
        self.issued[g] += 1
        self.seq[g, local] = self.issued[g]
        return int(self.issued[g])

    def retire(self, wid: int, g: int, seq: int) -> None:
        self.retired[g] = max(self.retired[g], seq)
        self.known[wid, g] = max(self.known[wid, g], seq)

    def check_write(self, wid: int, local: np.ndarray, what: str) -> None:
        latest = self.seq[:, local.reshape(-1)].max(1) if local.size else self.retired
        unknown = latest > self.known[wid]
        if not unknown.any():
            return
        g = int(np.argmax(unknown))
        x = int(local.reshape(-1)[np.argmax(self.seq[g, local.reshape(-1)] > self.known[wid, g])])
        if latest[g] > self.retired[g]:
            why = "an in-flight wgmma of warpgroup {g} still reads it (missing wgmma.wait_group?)"
        else:
            why = ("it was read by a wgmma of warpgroup {g} whose completion warp {w} has not observed (no "
                   "wgmma.wait_group by it, nor an mbarrier wait or barrier after one: a stage released early?)")
        raise EmulationError(f"{what} by warp {wid} at shared offset {x}: " + why.format(g=g, w=wid))


class AsyncState:
    def __init__(self, smem):
        self.smem = smem
        # happens-before for the shared-memory race detector (memory.py asks it)
        self.order = ordering.Ordering(smem.data.size, smem.stride, smem.granule, smem.epochs.size) \
            if smem.race_check else None
        self.mbarriers: dict = {}       # (slot, offset) -> MBarrier
        self.named: dict = {}           # (slot, id) -> NamedBarrier
        self.spinning: dict = {}        # warp -> (what it waits for, the mbarrier)
        self.park_requests: dict = {}   # warp -> the mbarrier its failed try_wait may park it on
        self.last_stall = None          # what retry_parked saw last
        self.warp_state: dict = {}      # warp -> per-warp dict (wgmma groups, register locks, ...)
        # generic-proxy writer (warp + 1) of each shared byte not yet fenced; 0: none
        self.unfenced = np.zeros(smem.data.size, np.int16)
        # undelivered TMA-load bytes (also counted in smem.pending, as cp.async's are)
        self.tma_pending = np.zeros(smem.data.size, np.int16)
        # in-flight async-proxy reads (wgmma operands, TMA stores) of each shared byte
        self.reading = np.zeros(smem.data.size, np.int16)
        self.reading_any = 0
        self.rendezvous: dict = {}      # (slot, warpgroup) -> (wgmma issued, the warps waiting in it)
        self.wgmma_reads: dict = {}     # slot -> WgmmaReads
        self.register_counts: dict = {}  # slot -> setmaxnreg's bookkeeping (semantics/hopper_warp.py)

    # -- mbarriers -------------------------------------------------------------------------------
    def mbarrier(self, warp, offset: int, init_count: int | None = None) -> MBarrier:
        """The mbarrier at `offset` of `warp`'s CTA, which `warp` uses (or initializes with
        `init_count`). Another thread's mbarrier.init must be ordered before the use (the PTX
        ISA's fence.mbarrier_init, then a barrier): a use that only happens to come later in this
        schedule is an error."""
        if offset % 8 or not 0 <= offset <= self.smem.size - 8:
            raise EmulationError(f"mbarrier at shared offset {offset}: not an aligned 8-byte object inside "
                                 f"the CTA's {self.smem.size} bytes of shared memory")
        key = (warp.smem_slot, offset)
        if init_count is not None:
            b = self.mbarriers[key] = MBarrier(offset, init_count)
            b.init_by = (warp.wid, self.order.now(warp.smem_slot)) if self.order is not None else None
            return b
        b = self.mbarriers.get(key)
        if b is None:
            raise EmulationError(f"mbarrier at shared offset {offset} used before mbarrier.init")
        if b.init_by is not None and not self.order.knows(warp.smem_slot, warp.wid, *b.init_by):
            raise EmulationError(f"mbarrier at shared offset {offset} used by warp {warp.wid} with nothing ordering "
                                 f"its mbarrier.init by warp {b.init_by[0]} before the use (missing barrier after the "
                                 f"init?)")
        return b

    def invalidate(self, warp, offset: int) -> None:
        self.mbarrier(warp, offset)
        del self.mbarriers[(warp.smem_slot, offset)]

    def spin(self, warp, what: str, barrier: MBarrier | None, park: bool) -> None:
        """A failed wait; `park`: the warp may park until `barrier` changes (machine.py asks
        park() next, once the instruction is done)."""
        self.spinning[warp] = (what, barrier)
        if park:
            self.park_requests[warp] = barrier

    def stop_spinning(self, warp) -> None:
        self.spinning.pop(warp, None)

    def park(self, warp) -> bool:
        """machine.py's hook after a _WAIT instruction: whether `warp` parks (the machine keeps
        its lanes' pcs, the waiting ones past the wait, and resumes them once woken). A diverged
        warp parks too: its other lanes stand at higher pcs, which the machine runs only once
        the lowest (the waiting lanes) reach them, so parking delays nothing that could run."""
        b = self.park_requests.pop(warp, None)
        if b is None:
            return False
        warp.at_barrier, warp.named_wait = True, "mbarrier"
        b.parked.append(warp)
        return True

    def retry_parked(self, parked) -> bool:
        """No warp of the wave can run and `parked` (machine's warps) are parked: wake them all
        (True) unless they already parked at the same pcs with every barrier as it is now, the
        last time no warp could run (False: a deadlock)."""
        seen = (tuple((id(w), w.pc) for w in parked), tuple(b.state() for b in self.mbarriers.values()),
                tuple((k, b.arrived) for k, b in self.named.items()))
        if seen == self.last_stall:
            return False
        self.last_stall = seen
        for b in {id(w): self.spinning[w][1] for w in parked}.values():
            b.wake()
        return True

    def hang_note(self) -> str:
        """What the warps that last failed a wait are waiting for (for a hang's error)."""
        notes = []
        for warp, (what, b) in list(self.spinning.items())[:4]:
            notes.append(f"warp {warp.wid} of block {warp.cta.ctaid} spins on {what}" +
                         (f"; the {b.describe()}" if b is not None else ""))
        return "; ".join(notes)

    # -- named barriers --------------------------------------------------------------------------
    def named_arrive(self, warp, bid: int, count: int, wait: bool) -> None:
        """One warp arrives at named barrier `bid` expecting `count` threads; a bar.sync waits."""
        if not 0 <= bid < 16:
            raise EmulationError(f"named barrier id {bid} (must be in [0, 16))")
        cta_threads = 32 * len(warp.cta.warps)
        if count % 32 or not 0 < count <= cta_threads:
            raise EmulationError(f"barrier {bid} with thread count {count} (must be a positive multiple of 32, "
                                 f"at most the block's {cta_threads})")
        key = (warp.cta.slot, bid)
        b = self.named.get(key)
        if b is None:
            b = self.named[key] = NamedBarrier(count)
        elif b.count != count:
            raise EmulationError(f"barrier {bid} reached with thread count {count} while {b.arrived} threads "
                                 f"wait with count {b.count}")
        b.arrived += 32
        b.carry = self.release(warp, b.carry)
        if wait:
            b.waiting.append(warp)
            warp.at_barrier, warp.named_wait = True, bid
        if b.arrived < count:
            return
        del self.named[key]
        for x in b.waiting:
            x.at_barrier, x.named_wait = False, None
            self.acquire(x, b.carry)
        if count == cta_threads:           # every warp of the CTA took part: a barrier epoch
            self.smem.barrier(warp.cta.slot)

    def deadlock(self) -> str:
        parked = [self.hang_note()] if self.spinning else []
        return "; ".join(parked + [f"barrier {bid} of block slot {slot}: {b.arrived} of {b.count} threads arrived "
                          f"(waiting: warps {', '.join(str(w.wid) for w in b.waiting)})"
                          for (slot, bid), b in self.named.items()] +
                         [f"wgmma.mma_async at PTX line {key[0]}: warps {[w.wid for w in warps]} of warpgroup {wg} "
                          f"(block slot {slot}) wait for the rest of their warpgroup"
                          for (slot, wg), (key, warps) in self.rendezvous.items()])

    # -- the proxy fence -------------------------------------------------------------------------
    def generic_write(self, idx: np.ndarray, warp) -> None:
        if self.reading_any and self.reading[idx].any():
            x = int(idx[self.reading[idx] > 0][0]) % self.smem.stride
            raise EmulationError(f"shared write at offset {x}, which an in-flight TMA store still reads (missing "
                                 f"cp.async.bulk.wait_group.read?)")
        if self.wgmma_reads and idx.size:
            warps = np.broadcast_to(np.asarray(warp).reshape(-1), idx.shape[:1])
            slots = idx[:, 0] // self.smem.stride
            for slot, wid in set(zip(slots.tolist(), warps.tolist())):
                reads = self.wgmma_reads.get(slot)
                if reads is not None:
                    rows = (slots == slot) & (warps == wid)
                    reads.check_write(wid, idx[rows] - slot * self.smem.stride, "shared write")
        self.unfenced[idx] = np.asarray(warp).reshape(-1, 1) + 1

    # -- what each warp knows of the wgmmas that completed (WgmmaReads) ---------------------------
    def reads_of(self, warp) -> WgmmaReads:
        r = self.wgmma_reads.get(warp.smem_slot)
        if r is None:
            r = self.wgmma_reads[warp.smem_slot] = WgmmaReads(self.smem.size, len(warp.cta.warps))
        return r

    def release(self, warp, carry, agent=None):
        """A warp's arrival (or, `agent` ASYNC, a TMA load's complete_tx) passes on what it
        knows: -> the barrier's knowledge with it, (the wgmmas known completed, the happens-before
        vector), either None where not tracked."""
        wg, hb = carry or (None, None)
        r = self.wgmma_reads.get(warp.smem_slot) if agent is None else None
        if r is not None:
            wg = r.known[warp.wid].copy() if wg is None else np.maximum(wg, r.known[warp.wid])
        if self.order is not None:
            mine = self.order.release(warp.smem_slot, warp.wid if agent is None else agent)
            hb = mine if hb is None else np.maximum(hb, mine)
        return wg, hb

    def acquire(self, warp, carry) -> None:
        if carry is None:
            return
        wg, hb = carry
        if wg is not None:
            known = self.reads_of(warp).known
            np.maximum(known[warp.wid], wg, out=known[warp.wid])
        if hb is not None:
            self.order.acquire(warp.smem_slot, warp.wid, hb)

    def cta_barrier(self, slot: int) -> None:
        """bar.sync 0: every warp of the CTA learns what any knew."""
        r = self.wgmma_reads.get(slot)
        if r is not None:
            r.known[:] = r.known.max(0)
        if self.order is not None:
            self.order.cta_barrier(slot)

    def fence_proxy_async(self, slot: int, wid: int) -> None:
        lo, hi = slot * self.smem.stride, slot * self.smem.stride + self.smem.size
        part = self.unfenced[lo:hi]
        part[part == wid + 1] = 0

    def async_read(self, idx: np.ndarray, what: str) -> None:
        """An async-proxy read of byte indices `idx`: every byte must be fenced."""
        w = self.unfenced[idx]
        if w.any():
            x = int(idx[w > 0][0])
            raise EmulationError(f"{what} reads shared offset {x % self.smem.stride}, written by warp "
                                 f"{int(w[w > 0][0]) - 1} through the generic proxy with no fence.proxy.async "
                                 f"after the write")

    def _indices(self, warp, addrs: np.ndarray, elem: int, what: str) -> np.ndarray:
        a = addrs.astype(np.int64)
        if a.min() < 0 or a.max() + elem > self.smem.size:
            x = int(a[(a < 0) | (a + elem > self.smem.size)][0])
            raise EmulationError(f"{what} reads shared offset {x}, outside the CTA's {self.smem.size} bytes "
                                 f"(bad descriptor?)")
        return warp.smem_slot * self.smem.stride + a[..., None] + np.arange(elem)

    def async_bytes(self, warp, addrs: np.ndarray, elem: int, what: str, readers=None, rows_each=None) -> np.ndarray:
        """An async-proxy read of elements of `elem` bytes at shared offsets `addrs` (-> bytes
        [*addrs.shape, elem]): in bounds, delivered (no cp.async / TMA still writing them), fenced
        after generic writes, and ordered after the last write of each byte (ordering.py) by
        what the warp it reads for knows: each of warps `readers` (default: `warp`) reads all, or,
        with `rows_each`, reader i the rows [rows_each i, rows_each (i + 1)) of addrs."""
        idx = self._indices(warp, addrs, elem, what)
        if self.smem.in_flight and self.smem.pending[idx].any():
            x = int(idx[self.smem.pending[idx] > 0][0]) % self.smem.stride
            raise EmulationError(f"{what} reads shared offset {x}, which an asynchronous copy has not delivered yet "
                                 f"(missing wait before this access?)")
        self.async_read(idx, what)
        if self.order is not None:
            readers = [warp.wid] if readers is None else readers
            g = idx // self.smem.granule
            parts = [(g, readers)] if rows_each is None else \
                [(g[rows_each * i:rows_each * (i + 1)], [r]) for i, r in enumerate(readers)]
            for part, who in parts:
                bad = self.order.unordered_async_read(np.unique(part), who, warp.smem_slot)
                if bad is not None:
                    x, writer, reader = bad
                    src = "the async proxy (a TMA load)" if writer == ordering.ASYNC else f"warp {writer}"
                    x = x * self.smem.granule % self.smem.stride
                    raise EmulationError(f"{what} by warp {reader} reads shared offset {x}, written by {src} with "
                                         f"nothing ordering the write before the read (missing mbarrier wait or "
                                         f"barrier?)")
        return self.smem.data[idx]

    def async_read_start(self, warp, addrs: np.ndarray, elem: int) -> np.ndarray:
        """Mark the bytes an issued async operation reads until it completes; -> their indices."""
        idx = np.unique(self._indices(warp, addrs, elem, "async read"))
        self.reading[idx] += 1
        self.reading_any += idx.size
        return idx

    def async_read_done(self, reads: list) -> None:
        for idx in reads:
            self.reading[idx] -= 1
            self.reading_any -= idx.size

    def warpgroup_rendezvous(self, warp, key) -> list | None:
        """A warp issues a warpgroup-collective instruction `key` (PTX line, operands): it waits
        (None) until the 4 warps of its warpgroup have issued the same; -> the 4 warps then."""
        where = (warp.smem_slot, warp.wid // 4)
        pending = self.rendezvous.get(where)
        if pending is None:
            pending = self.rendezvous[where] = (key, [])
        elif pending[0] != key:
            raise EmulationError(f"warp {warp.wid} issues wgmma.mma_async (PTX line {key[0]}, descriptors {key[1:]}) "
                                 f"while its warpgroup's warps {[x.wid for x in pending[1]]} issued PTX line "
                                 f"{pending[0][0]}, descriptors {pending[0][1:]}: wgmma is warpgroup-collective")
        pending[1].append(warp)
        if len(pending[1]) < 4:
            warp.at_barrier, warp.named_wait = True, "wgmma"
            return None
        del self.rendezvous[where]
        for x in pending[1]:
            x.at_barrier, x.named_wait = False, None
        return sorted(pending[1], key=lambda x: x.wid)

    def tma_write(self, warp, addrs: np.ndarray, data: np.ndarray, barrier: MBarrier, nbytes: int) -> None:
        """A TMA load of `data` (bytes [elements, elem]) to shared offsets `addrs`: the bytes are
        undelivered until the mbarrier's phase completes, which the load's `nbytes` count toward."""
        idx = self._indices(warp, addrs, data.shape[1], "TMA load destination")
        if self.smem.pending[idx].any():
            raise EmulationError(f"TMA load to shared offset {int(addrs.min())}: its destination overlaps an "
                                 f"asynchronous copy not yet delivered")
        if self.reading_any and self.reading[idx].any():
            raise EmulationError(f"TMA load to shared offset {int(addrs.min())}: its destination is still read by "
                                 f"an in-flight TMA store")
        if warp.smem_slot in self.wgmma_reads:
            self.wgmma_reads[warp.smem_slot].check_write(warp.wid, idx - warp.smem_slot * self.smem.stride,
                                                         "TMA load")
        self.smem.claim(idx, warp.wid, "TMA load")    # a write by the issuing warp, as far as it knows
        self.smem.pending[idx] += 1
        self.tma_pending[idx] += 1
        self.smem.in_flight += idx.size

        def deliver():
            self.smem.pending[idx] -= 1
            self.tma_pending[idx] -= 1
            self.smem.in_flight -= idx.size
            self.unfenced[idx] = 0              # written by the async proxy: nothing to fence
            self.smem.async_written(idx, ordering.ASYNC)
            self.smem.data[idx] = data
            barrier.carry = self.release(warp, barrier.carry, ordering.ASYNC)
        barrier.issue(nbytes, deliver)

    def pending_note(self, byte: int) -> str | None:
        """Why an undelivered byte is undelivered, if a TMA load holds it (for memory.py's error)."""
        if self.tma_pending[byte]:
            return "a TMA load has not delivered yet (missing mbarrier wait, or its phase has not completed?)"
        return None

    def of_warp(self, warp) -> dict:
        s = self.warp_state.get(warp)
        if s is None:
            s = self.warp_state[warp] = {}
        return s
