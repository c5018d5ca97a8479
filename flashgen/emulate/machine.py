"""The SIMT machine: the CTAs of a launch run in waves (up to WAVE_LANES threads and WAVE_SMEM
bytes of shared memory), the warps of a wave interleaved by a seeded random scheduler.

Per-lane program counters: lanes at the lowest pc execute together until all live lanes meet
again (which is where structured control flow reconverges); a converged warp keeps one pc.

Gangs: mostly, the scheduler runs all live warps of a wave as one gang, SIMT across warps and
CTAs: each step executes one instruction, as one numpy operation, over the gang's lanes that
stand at its lowest pc (the registers of a wave are one array per register, so a gang's are
views). Warps at different pcs meet where the laggards catch up; lanes of warps that are done or
wait at a barrier stand aside. This changes no result -- each lane runs the same instructions in
some order anyway -- but divides the interpreter's per-instruction cost by the lanes it covers.
Warp-collective handlers (semantics.PER_WARP) take the gang whole when each of its warps executes
in full or not at all, and run warp by warp otherwise (so a diverged warp fails them as before).
A gang is a contiguous range of the register file; once done warps fill a quarter of it, the live
warps' registers move to the front of a smaller file (_Wave.compact), so that steps stop computing
over lanes that will never run again.
One time in four, and for up to 256 instructions, the scheduler runs a random warp alone instead,
so any interleaving between barriers can occur; the race detectors (memory.py) flag conflicting
accesses whatever the interleaving was. A CTA's barrier is released once no warp of the wave can
run.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import re
import secrets
import time

import numpy as np

from flashgen import targets
from flashgen.emulate import hopper_state
from flashgen.emulate import counters
from flashgen.emulate.errors import EmulationError
from flashgen.emulate.heap import collector_paused
from flashgen.emulate.memory import GlobalMemory, SharedMemory
from flashgen.emulate.operands import Operands, dtype_of
from flashgen.emulate.ptx import TYPE_SIZES, Imm, Kernel, Label, PtxModule, shared_layout
from flashgen.emulate.semantics import PER_WARP, compile_instruction, unsupported
from flashgen.emulate.semantics.registry import splits_a_warp, warp_bits
from flashgen.emulate.semantics.wgmma import compile_blocking, guard_wgmma_registers

MAX_THREADS_PER_BLOCK = 1024
# A wave: the CTAs that run together, up to this many threads (the register file's length) and
# bytes of shared memory (its race bookkeeping takes up to 27 more bytes per byte).
WAVE_LANES, WAVE_SMEM = 16384, 4 << 20
MAX_WARP_INSTRUCTIONS = 200_000_000     # a launch's default budget: past it, an infinite loop is assumed
_DEAD = np.iinfo(np.int64).max        # pc of an exited lane
_ALU, _BRA, _RET, _BAR, _NAMED = range(5)     # _NAMED: may make a warp wait (hopper_state.blocking)
_WAIT = 5       # an _ALU after which its warp may park (hopper_state.parks): hopper's park hook decides
_DIVERGED_BARRIER = "bar.sync executed by a diverged warp (.aligned requires the whole warp to reach it together)"


@dataclasses.dataclass
class LaunchStats:
    warp_instructions: int = 0
    seconds: float = 0.0
    blocks: int = 0
    seed: int = 0
    opcode_counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    counters: counters.Counters | None = None     # stats only, never speed; None unless counters.enabled()


class _Registers(dict):
    """The register file of a wave: register name -> one array over all its lanes, created on first
    use (the file is its own view of all lanes: what a gang of the whole wave reads and writes).
    Registers start as 0xFF bytes (NaN floats, all-ones integers) so that a value read before it
    is written shows up instead of passing as zero; predicates start false. Registers of one dtype
    are rows of blocks of _BLOCK, allocated together: a kernel's first steps in a wave create
    hundreds of registers, and one allocation each took ~9 % of the dense pace case's profile.
    `dtypes`: each register's numpy dtype (_Compiled's, built once per kernel).
    `moved`: registers of an earlier file (_Wave.compact) copied here when first used, each as
    (its array there, the warp rows kept): many are never used again, and copying every register
    at each compaction took ~7 % of the paged pace case's profile."""

    def __init__(self, dtypes, nlanes, moved=None):
        super().__init__()
        self.dtypes, self.nlanes = dtypes, nlanes
        self.blocks = {}         # dtype -> (the block being filled, its next free row)
        self.moved = moved or {}

    def view(self, lo, hi):
        """The registers of lanes [lo, hi)."""
        return self if lo == 0 and hi == self.nlanes else _RegisterView(self, lo, hi)

    def __missing__(self, name):
        moved = self.moved.pop(name, None)
        if moved is not None:
            src, rows = moved
            a = self[name] = src.reshape(-1, 32)[rows].reshape(-1)
            return a
        dt = self.dtypes[name]
        block, row = self.blocks.get(dt, (None, _BLOCK))
        if row == _BLOCK:
            block, row = (np.zeros((_BLOCK, self.nlanes), dt) if dt == np.bool_ else
                          np.full((_BLOCK, self.nlanes * dt.itemsize), 0xFF, np.uint8).view(dt)), 0
        self.blocks[dt] = (block, row + 1)
        a = self[name] = block[row]
        return a


_BLOCK = 32


class _RegisterView(dict):
    """The registers of lanes [lo, hi) of a wave: cached views into its register file."""

    def __init__(self, file, lo, hi):
        super().__init__()
        self.file, self.lo, self.hi = file, lo, hi

    def __missing__(self, name):
        v = self[name] = self.file[name][self.lo:self.hi]
        return v


class Warp:
    nlanes = 32

    def __init__(self, wid, gid, cta, nthreads, block, registers):
        self.wid = self.lane_warp = wid      # within its CTA (the race detectors' warp id)
        self.gid = gid                       # within its wave (its place in the register file)
        self.label = f"warp {wid}"
        self.cta = cta
        self.regs = _RegisterView(registers, 32 * gid, 32 * gid + 32)
        self.gmem, self.params, self.cta_index = cta.gmem, cta.params, cta.index
        self.smem, self.smem_slot = cta.smem, cta.slot
        linear = wid * 32 + np.arange(32)
        self.alive = linear < nthreads
        self.alive_mask = None if self.alive.all() else self.alive.copy()
        self.pc = 0
        self.lane_pc = None                  # per-lane pcs while diverged
        self.at_barrier = False
        self.done = not self.alive.any()
        self.cp_open = []                    # issued, uncommitted cp.async copies
        self.cp_groups = []                  # committed groups, oldest first
        self.special = {("laneid", 0): _LANE, ("warpid", 0): _same(wid), ("nwarpid", 0): _same(64)}
        for ax, t in enumerate(_tid(wid, block)):
            self.special[("tid", ax)] = t
            self.special[("ntid", ax)] = _same(block[ax])
            self.special[("ctaid", ax)] = _same(cta.ctaid[ax])
            self.special[("nctaid", ax)] = _same(cta.grid[ax])

    @property
    def members(self):
        return (self,)


# The special registers' lanes are shared by every warp that has the same values (read-only: no
# instruction writes a special register), so that a launch of many CTAs builds them once.
def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


_LANE = _frozen(np.arange(32, dtype=np.uint32))


@functools.lru_cache(maxsize=None)
def _same(value: int) -> np.ndarray:
    return _frozen(np.full(32, value, np.uint32))


@functools.lru_cache(maxsize=None)
def _tid(wid: int, block) -> tuple:
    linear = wid * 32 + np.arange(32)
    bx, by, _ = block
    return tuple(_frozen(t.astype(np.uint32)) for t in (linear % bx, (linear // bx) % by, linear // (bx * by)))


class _Gang:
    """Adjacent warps of a wave whose lanes run_gang steps together; what the handlers see of
    them (a gang over several CTAs has no `cta`: its lanes say theirs)."""
    lane_pc = None                       # run_gang keeps the lanes' pcs

    def __init__(self, wave, warps):
        self.members = tuple(warps)
        first, last = warps[0], warps[-1]
        self.nlanes = 32 * len(warps)
        self.regs = wave.registers.view(32 * first.gid, 32 * last.gid + 32)
        self.special = _GangSpecial(warps)
        self.gmem, self.params, self.smem = first.gmem, first.params, first.smem   # one per wave
        self.lane_warp = np.repeat([w.wid for w in warps], 32)
        if first.cta is last.cta:
            self.cta, self.cta_index, self.smem_slot = first.cta, first.cta_index, first.smem_slot
            self.label = f"warps {first.wid}-{last.wid}"
        else:
            self.cta = None
            self.cta_index = np.repeat([w.cta_index for w in warps], 32)
            self.smem_slot = np.repeat([w.smem_slot for w in warps], 32)
            self.label = f"warps {first.wid}-{last.wid} of blocks {first.cta.ctaid}-{last.cta.ctaid}"


class _GangSpecial(dict):
    """A gang's special registers, its warps' lanes joined on first use (a kernel reads a few of
    them, mostly once, and a launch makes a gang for each span of live warps)."""

    def __init__(self, warps):
        super().__init__()
        self.warps = warps

    def __missing__(self, key):
        if key not in self.warps[0].special:
            raise KeyError(key)
        v = self[key] = np.concatenate([w.special[key] for w in self.warps])
        return v


class _Cta:
    def __init__(self, ctaid, grid, smem, slot, gmem, params):
        self.ctaid, self.grid, self.smem, self.slot, self.gmem, self.params = ctaid, grid, smem, slot, gmem, params
        self.index = ctaid[0] + grid[0] * (ctaid[1] + grid[1] * ctaid[2])   # linear CTA id
        self.warps = []


class _Wave:
    """CTAs that run together: their warps in one list, their registers in one file, their
    shared memory in one SharedMemory."""

    def __init__(self, blocks, grid, gmem, params, dtypes, nthreads, block, smem_bytes, race_check, granule):
        per_cta = -(-nthreads // 32)
        self.registers = _Registers(dtypes, 32 * per_cta * len(blocks))
        smem = SharedMemory(smem_bytes, race_check, len(blocks), granule, gmem.counters)
        self.warps, self.ctas = [], []
        for slot, ctaid in enumerate(blocks):
            cta = _Cta(ctaid, grid, smem, slot, gmem, params)
            cta.warps = [Warp(i, len(self.warps) + i, cta, nthreads, block, self.registers) for i in range(per_cta)]
            self.warps += cta.warps
            self.ctas.append(cta)
        self.gangs = {}                                                    # (first, last) gid -> _Gang

    def compact(self, live):
        """Once done warps fill a quarter of the span of the live ones, move the live warps'
        registers to the front of a smaller register file and forget the done ones: a gang is a
        contiguous range of the file, and each of its steps computes over all of its lanes, a done
        warp's too (the paged case, whose CTAs finish at very different times, spent three quarters
        of its lanes on done warps)."""
        if 4 * len(live) > 3 * (live[-1].gid - live[0].gid + 1):
            return
        old = self.registers
        keep = np.array([w.gid for w in live])
        moved = {name: (a, keep) for name, a in old.items()}
        moved.update((name, (src, rows[keep])) for name, (src, rows) in old.moved.items())
        self.registers = _Registers(old.dtypes, 32 * keep.size, moved)
        for gid, w in enumerate(live):
            w.gid, w.regs = gid, _RegisterView(self.registers, 32 * gid, 32 * gid + 32)
        self.warps, self.gangs = live, {}

    def close(self):
        """Break the wave's reference cycles (a CTA and its warps), so that its register file and
        shared memory go as soon as it is done, with the cyclic collector paused (heap.py)."""
        for cta in self.ctas:
            for w in cta.warps:
                w.cta = None
        self.warps, self.ctas, self.gangs = [], [], {}

    def gang(self, lo, hi):
        g = self.gangs.get((lo, hi))
        if g is None:
            g = self.gangs[(lo, hi)] = _Gang(self, self.warps[lo:hi + 1])
        return g


def short_name(kernel_name: str) -> str:
    """A readable kernel name: the last `<len><identifier>` of an Itanium-mangled name that ends in
    "kernel" (else the last), plus the start of its template arguments."""
    names, pos, digits = [], 0, re.compile(r"\d+")
    while pos < len(kernel_name):
        m = digits.match(kernel_name, pos)
        if m is None:
            pos += 1
            continue
        n, start = int(m.group()), m.end()
        ident = kernel_name[start:start + n]
        if n and len(ident) == n and re.fullmatch(r"[A-Za-z_]\w*", ident):
            names.append((ident, start + n))
            pos = start + n
        else:
            pos = m.end()
    if not names:
        return kernel_name
    ident, end = next((x for x in reversed(names) if x[0].endswith("kernel")), names[-1])
    args = kernel_name[end:end + 40]
    return f"{ident}[{args}]" if args.startswith("I") else ident


class _Compiled:
    """A kernel's instructions as (kind, run, guard, negated, target) tuples (an _ALU's target:
    whether its handler runs warp by warp when a gang's lanes execute it in part)."""

    def __init__(self, kernel: Kernel):
        ops = Operands(kernel)
        self.code = []
        for ins in kernel.instructions:
            self.code.append(self._compile(ins, ops, kernel))
        self.code.append((_RET, None, None, False, None))    # falling off the end exits
        self.forms = [ins.form for ins in kernel.instructions] + ["exit"]
        by_type = {t: np.dtype(dtype_of(t)) for t in set(kernel.registers.values())}
        self.reg_dtypes = {name: by_type[t] for name, t in kernel.registers.items()}
        # the shared-memory race detector's granule: a word unless some access is narrower
        self.smem_granule = 1 if any(_narrow_shared(ins) for ins in kernel.instructions) else 4
        self.hopper = hopper_state.uses_hopper(kernel)
        if self.hopper:
            self.code = guard_wgmma_registers(kernel, self.code)
        # straight[pc]: the end of the run of plain instructions (unguarded, not warp-collective
        # _ALUs) from pc, 0 where pc is not one. Every lane at the start of such a run executes
        # each instruction of it: the machine calls them back to back, without a step each.
        self.fns = [c[1] for c in self.code]
        self.straight = [0] * len(self.code)
        for pc in range(len(self.code) - 2, -1, -1):
            kind, _, guard, _, per_warp = self.code[pc]
            if kind == _ALU and guard is None and not per_warp:
                self.straight[pc] = self.straight[pc + 1] or pc + 1

    @staticmethod
    def _compile(ins, ops, kernel):
        if ins.pred is not None and kernel.registers.get(ins.pred) != "pred":
            raise EmulationError(f"guard {ins.pred} is not a predicate register: {ins.text}")
        guard = (ins.pred, ins.pred_negated)
        if ins.opcode == "bra":
            if set(ins.mods) - {"uni"} or len(ins.operands) != 1 or not isinstance(ins.operands[0], Label):
                raise unsupported(ins)
            target = kernel.labels.get(ins.operands[0].name)
            if target is None:
                raise EmulationError(f"branch to unknown label {ins.operands[0].name}")
            return (_BRA, "uni" in ins.mods, *guard, target)
        if ins.opcode in ("ret", "exit"):
            return (_RET, None, *guard, None)
        if hopper_state.blocking(ins):
            return (_NAMED, compile_blocking(ins, ops), *guard, None)
        if hopper_state.parks(ins):
            return (_WAIT, compile_instruction(ins, ops), *guard, None)
        if ins.opcode in ("bar", "barrier") and ins.mods in (("sync",), ("cta", "sync"), ("sync", "aligned"),
                                                              ("cta", "sync", "aligned")):
            if ins.pred is not None:
                raise unsupported(ins, "predicated barrier")
            if not ins.operands or not isinstance(ins.operands[0], Imm) or int(ins.operands[0].text, 0) != 0:
                raise unsupported(ins, "only barrier 0 (named barriers are not modelled)")
            count = None
            if len(ins.operands) > 1:
                if not isinstance(ins.operands[1], Imm):
                    raise unsupported(ins, "a thread count in a register")
                count = int(ins.operands[1].text, 0)
            return (_BAR, count, *guard, None)
        return (_ALU, compile_instruction(ins, ops), *guard, ins.opcode in PER_WARP)


def _narrow_shared(ins) -> bool:
    """A shared ld/st of fewer than 4 bytes per lane (cp.async and ldmatrix copy 4 and more)."""
    if ins.opcode not in ("ld", "st") or "shared" not in ins.mods:
        return False
    return TYPE_SIZES[ins.type()] * (4 if "v4" in ins.mods else 2 if "v2" in ins.mods else 1) < 4


def compiled(kernel: Kernel) -> _Compiled:
    if kernel.compiled is None:
        kernel.compiled = _Compiled(kernel)
    return kernel.compiled


class _Located(EmulationError):
    """An error already prefixed with where it happened (in one CTA of a wide gang)."""


class _Launch:
    def __init__(self, kernel, program, rng, budget, seed):
        self.kernel, self.rng, self.budget, self.seed = kernel, rng, budget, seed
        self.code, self.fns, self.straight = program.code, program.fns, program.straight
        self.counts = [0] * len(program.code)
        self.executed = 0

    def context(self, w, pc) -> str:
        ins = self.kernel.instructions[pc] if pc < len(self.kernel.instructions) else None
        where = f"PTX line {ins.line}: {ins.text}" if ins else "end of kernel"
        block = "" if w.cta is None else f" block {w.cta.ctaid}"
        return (f"{short_name(self.kernel.name)}{block} {w.label} pc {pc} ({where}) "
                f"[schedule seed {self.seed}]")

    def run_wave(self, wave, nthreads):
        warps = wave.warps
        rng = self.rng
        while True:
            live = [w for w in warps if not w.done]
            runnable = [w for w in live if not w.at_barrier]
            if not runnable:
                if not live:
                    return
                self._release_barriers(live, nthreads)
                continue
            quantum = int(rng.integers(1, 257))
            if len(runnable) == 1 or not rng.integers(4):
                # one time in four a random warp runs alone: varied interleavings
                self.run_warp(runnable[int(rng.integers(len(runnable)))], quantum, nthreads)
            else:
                wave.compact(live)
                warps = wave.warps
                self.run_gang(wave.gang(live[0].gid, live[-1].gid), quantum, nthreads)
            if self.executed > self.budget:
                hopper = getattr(warps[0].smem, "hopper", None)
                note = f": {hopper.hang_note()}" if hopper and hopper.spinning else ""
                raise EmulationError(f"{short_name(self.kernel.name)}: more than {self.budget} warp-instructions "
                                     f"in one launch (an infinite loop?) [schedule seed {self.seed}]{note}")

    def _release_barriers(self, waiting, nthreads):
        """No warp can run: every live warp waits at a barrier. Release each CTA's."""
        stuck = [w for w in waiting if getattr(w, "named_wait", None) is not None]
        parked = [w for w in stuck if w.named_wait == "mbarrier"]
        if parked and parked[0].smem.hopper.retry_parked(parked):
            return
        if stuck:
            raise EmulationError(f"{self.context(stuck[0], stuck[0].pc - 1)}: deadlock: no warp can run; "
                                 f"{stuck[0].smem.hopper.deadlock()}")
        for cta in dict.fromkeys(w.cta for w in waiting):
            exited = sum(int((~w.alive).sum()) for w in cta.warps) - (32 * len(cta.warps) - nthreads)
            if exited:
                w = next(x for x in waiting if x.cta is cta)
                raise EmulationError(f"{self.context(w, w.pc - 1)}: bar.sync reached after {exited} "
                                     f"threads of the block exited (the barrier would wait for them)")
            cta.smem.barrier(cta.slot)
        for w in waiting:
            w.at_barrier = False

    def _per_warp(self, g, fn, exe, pc):
        """A PER_WARP instruction some warps of a gang execute in part: warp by warp."""
        for j, m in enumerate(g.members):
            part = exe[32 * j:32 * j + 32]
            if not part.any():
                continue
            try:
                fn(m, None if part.all() else part)
            except EmulationError as e:
                raise _Located(f"{self.context(m, pc)}: {e}") from None

    def run_gang(self, g, quantum, nthreads):
        """Run the lanes of a gang of adjacent warps for up to `quantum` steps, each step the lanes
        at the lowest pc: warps at different pcs meet where the laggards catch up. Lanes of warps
        that are done or wait at a barrier, and exited lanes, stand at _DEAD. While the lanes at
        the lowest pc run on below every other lane's pc (`rest`), the step needs no lane array:
        their pc is `pc` (lp holds it for them again when they stop: `fresh`)."""
        code, counts, fns, straight = self.code, self.counts, self.fns, self.straight
        members = g.members
        # the gang holds its warps' pcs until it hands them back
        lp = np.repeat(np.array([_DEAD if m.done or m.at_barrier else m.pc for m in members], np.int64), 32)
        rows = lp.reshape(-1, 32)
        for j, m in enumerate(members):
            if m.done or m.at_barrier:
                continue
            if m.lane_pc is not None:
                rows[j] = m.lane_pc
                m.lane_pc = None
            elif m.alive_mask is not None:
                rows[j, ~m.alive] = _DEAD
        pc, active, n, rest, fresh = 0, None, 0, -1, True
        steps = executed = 0
        try:
            while steps < quantum:
                if pc >= rest:
                    if not fresh:
                        lp[slice(None) if active is None else active] = pc
                    fresh = True
                    pc, active, n, rest = _lowest(lp)
                    if pc == _DEAD:
                        break
                    fresh = False
                end = straight[pc]
                if end:
                    end, first = min(end, rest, pc + quantum - steps), pc
                    for pc in range(first, end):
                        counts[pc] += n
                        fns[pc](g, active)
                    steps += end - first
                    executed += n * (end - first)
                    pc = end
                    continue
                steps += 1
                counts[pc] += n
                executed += n
                kind, fn, guard, negated, target = code[pc]
                exe = active if guard is None else _guarded(g.regs[guard], negated, active)
                if kind == _ALU:
                    if exe is None or np.count_nonzero(exe):
                        if target and exe is not None and splits_a_warp(exe):
                            self._per_warp(g, fn, exe, pc)
                        else:
                            fn(g, exe)
                    pc += 1
                    continue
                # every lane at pc branches (exe is within active: equal counts, equal lanes)
                if kind == _BRA and (guard is None or exe is None or
                                     (active is not None and np.count_nonzero(exe) == np.count_nonzero(active))):
                    pc = target
                    continue
                act = np.ones(g.nlanes, bool) if active is None else active
                if exe is None:
                    exe = act
                if kind == _BRA:
                    if not np.count_nonzero(exe):
                        pc += 1
                        continue
                    if fn and splits_a_warp(exe, act):
                        raise EmulationError("bra.uni taken by only some lanes")
                    lp[act & ~exe] = pc + 1
                    lp[exe] = target
                elif kind == _RET:
                    for j in np.flatnonzero(exe.reshape(-1, 32).any(1)):
                        m = members[j]
                        m.alive = m.alive & ~exe[32 * j:32 * j + 32]
                        m.done = not m.alive.any()
                        m.alive_mask = None if m.alive.all() else m.alive.copy()
                    lp[act & ~exe] = pc + 1
                    lp[exe] = _DEAD
                elif kind == _WAIT:                      # run per warp (PER_WARP); converged warps may park
                    self._per_warp(g, fn, exe, pc)
                    lp[act] = pc + 1
                    for j in np.flatnonzero(act.reshape(-1, 32).any(1)):
                        m = members[j]
                        if m.smem.hopper.park(m):                # keeps its lanes' pcs, diverged or not
                            m.pc, m.lane_pc = pc + 1, rows[j].copy()
                            _reconverge(m)
                            lp[32 * j:32 * j + 32] = _DEAD
                elif kind == _NAMED:
                    waiting = [m.at_barrier for m in members]
                    arriving = act.reshape(-1, 32).any(1)
                    for j in np.flatnonzero(arriving):
                        m = members[j]
                        if not (exe[32 * j:32 * j + 32] == m.alive).all():
                            raise _Located(f"{self.context(m, pc)}: {_DIVERGED_BARRIER}")
                        m.pc = pc + 1
                        fn(m)
                    for j, m in enumerate(members):       # arrivals wait or go on; released warps go on
                        if arriving[j] or (waiting[j] and not m.at_barrier):
                            lp[32 * j:32 * j + 32] = _DEAD if m.at_barrier else np.where(m.alive, m.pc, _DEAD)
                else:   # _BAR: a warp whose live lanes all stand here waits; a warp split by it is an error
                    self._check_barrier_count(pc, nthreads)
                    for j in np.flatnonzero(act.reshape(-1, 32).any(1)):
                        m = members[j]
                        if not (act[32 * j:32 * j + 32] == m.alive).all():
                            raise _Located(f"{self.context(m, pc)}: {_DIVERGED_BARRIER}")
                        m.at_barrier, m.pc = True, pc + 1
                    lp[act] = _DEAD
                fresh, rest = True, -1                     # lp is up to date: find the lowest pc again
        except _Located:
            raise
        except EmulationError as e:
            raise EmulationError(f"{self.context(g, pc)}: {e}") from None
        finally:
            self.executed += executed
        if not fresh:
            lp[slice(None) if active is None else active] = pc
        low = rows.min(1)
        converged = ((rows == low[:, None]) | (rows == _DEAD)).all(1)
        for j, (m, first, together) in enumerate(zip(members, low.tolist(), converged.tolist())):
            if not (m.done or m.at_barrier or first == _DEAD):      # _DEAD: parked, maybe woken since
                m.pc, m.lane_pc = first, None if together else rows[j].copy()

    def run_warp(self, w, quantum, nthreads):
        """Run one warp for up to `quantum` instructions (its lanes at their lowest pc)."""
        code, counts, fns, straight = self.code, self.counts, self.fns, self.straight
        pc = w.pc
        steps = 0
        try:
            while steps < quantum:
                if w.lane_pc is None and straight[pc]:        # plain instructions, as in run_gang
                    end, first = min(straight[pc], pc + quantum - steps), pc
                    for pc in range(first, end):
                        counts[pc] += 1
                        fns[pc](w, w.alive_mask)
                    steps += end - first
                    pc = end
                    continue
                steps += 1
                lp = w.lane_pc
                if lp is None:
                    active = w.alive_mask
                else:
                    pc = int(lp.min())
                    active = lp == pc
                kind, fn, guard, negated, target = code[pc]
                counts[pc] += 1
                exe = active if guard is None else _guarded(w.regs[guard], negated, active)
                if kind == _ALU:
                    if exe is None or np.count_nonzero(exe):
                        fn(w, exe)
                    if lp is None:
                        pc += 1
                    else:
                        lp[active] = pc + 1
                        _reconverge(w)
                        pc = w.pc
                    continue
                w.pc = pc
                if kind == _BRA:
                    self._branch(w, pc, active, exe, target, fn)
                    pc = w.pc
                elif kind == _RET:
                    self._exit(w, pc, active, exe)
                    if w.done:
                        return
                    pc = w.pc
                elif kind == _WAIT:
                    if exe is None or exe.any():
                        fn(w, exe)
                    if w.lane_pc is None:
                        w.pc = pc + 1
                    else:
                        w.lane_pc[active] = pc + 1
                        _reconverge(w)
                    if w.smem.hopper.park(w):
                        return
                    pc = w.pc
                elif kind == _NAMED:
                    if w.lane_pc is not None or (exe is not None and not (exe == w.alive).all()):
                        raise EmulationError(_DIVERGED_BARRIER)
                    w.pc = pc + 1
                    fn(w)
                    if w.at_barrier:
                        return
                    pc = w.pc
                else:   # _BAR
                    if w.lane_pc is not None:
                        raise EmulationError(_DIVERGED_BARRIER)
                    self._check_barrier_count(pc, nthreads)
                    w.pc, w.at_barrier = pc + 1, True
                    return
        except EmulationError as e:
            raise EmulationError(f"{self.context(w, pc)}: {e}") from None
        finally:
            self.executed += steps
        if w.lane_pc is None:
            w.pc = pc

    def _check_barrier_count(self, pc, nthreads):
        count = self.code[pc][1]
        if count is not None and count != -(-nthreads // 32) * 32:
            raise unsupported(self.kernel.instructions[pc], f"barrier count {count} is not the "
                              f"block's {nthreads} threads")

    def _branch(self, w, pc, active, exe, target, uniform):
        if exe is None:
            taken_all, taken_none = True, False
        else:
            act = w.alive if active is None else active
            taken_none = not exe.any()
            taken_all = not taken_none and bool((exe == act).all())
        if taken_all or taken_none:
            dest = target if taken_all else pc + 1
            if w.lane_pc is None:
                w.pc = dest
            else:
                w.lane_pc[active] = dest
                _reconverge(w)
            return
        if uniform:
            raise EmulationError("bra.uni taken by only some lanes")
        if w.lane_pc is None:
            w.lane_pc = np.where(w.alive, pc, _DEAD)
            act = w.alive
        else:
            act = active
        w.lane_pc[act & ~exe] = pc + 1
        w.lane_pc[exe] = target
        _reconverge(w)

    @staticmethod
    def _exit(w, pc, active, exe):
        leaving = (w.alive if active is None else active) if exe is None else exe
        w.alive = w.alive & ~leaving
        w.done = not w.alive.any()
        w.alive_mask = None if w.alive.all() else w.alive.copy()
        if w.done:
            return
        if w.lane_pc is None:
            w.pc = pc + 1
        else:
            w.lane_pc[leaving] = _DEAD
            w.lane_pc[(active & ~leaving)] = pc + 1
            _reconverge(w)


def _lowest(lp):
    """(lowest pc, its lanes -- None when every lane stands there --, how many warps they span,
    the lowest pc of the other lanes)."""
    pc = int(lp.min())
    active = lp == pc
    if pc == _DEAD or np.count_nonzero(active) == active.size:
        return pc, None, lp.size // 32, _DEAD
    return pc, active, int(np.count_nonzero(warp_bits(active))), int(np.where(active, _DEAD, lp).min())


def _guarded(pv, negated, active):
    """The lanes that execute a guarded instruction (None: all of them)."""
    exe = ~pv if negated else pv.copy()
    if active is not None:
        exe &= active
    elif np.count_nonzero(exe) == exe.size:
        exe = None
    return exe


def _reconverge(w):
    lp = w.lane_pc
    lo = lp.min()
    if ((lp == lo) | (lp == _DEAD)).all():
        w.pc = int(lo)
        w.lane_pc = None


def _param_buffer(kernel: Kernel, params) -> np.ndarray:
    if len(params) != len(kernel.params):
        raise EmulationError(f"{short_name(kernel.name)} takes {len(kernel.params)} parameters, got {len(params)}")
    offs = kernel.param_offsets
    total = (offs[-1] + kernel.params[-1].size) if kernel.params else 0
    buf = np.zeros(max(total, 1), np.uint8)
    for p, off, b in zip(kernel.params, offs, params):
        if len(b) != p.size:
            raise EmulationError(f"parameter {p.name} of {short_name(kernel.name)} is {p.size} bytes, got {len(b)}")
        buf[off:off + p.size] = np.frombuffer(bytes(b), np.uint8)
    return buf


def launch(module: PtxModule, kernel_name: str, grid, block, dynamic_smem: int, params, memory: GlobalMemory,
           *, arch: str, seed: int | None = None, race_check: bool = True,
           max_warp_instructions: int = MAX_WARP_INSTRUCTIONS) -> LaunchStats:
    """Run one kernel launch to completion; raise EmulationError on anything unsupported or unsafe."""
    with collector_paused():
        return _launch(module, kernel_name, grid, block, dynamic_smem, params, memory, arch, seed, race_check,
                       max_warp_instructions)


def _launch(module, kernel_name, grid, block, dynamic_smem, params, memory, arch, seed, race_check,
            max_warp_instructions) -> LaunchStats:
    if arch not in targets.emulated():
        raise EmulationError(f"unknown arch {arch!r} (expected one of {', '.join(targets.emulated())})")
    kernel = module.kernel(kernel_name)
    grid, block = tuple(int(x) for x in grid), tuple(int(x) for x in block)
    if len(grid) != 3 or len(block) != 3 or min(grid) < 1 or min(block) < 1:
        raise EmulationError(f"invalid launch configuration grid={grid} block={block}")
    nthreads = block[0] * block[1] * block[2]
    if nthreads > MAX_THREADS_PER_BLOCK:
        raise EmulationError(f"{nthreads} threads per block exceed {MAX_THREADS_PER_BLOCK}")
    if kernel.max_threads and nthreads > int(np.prod(kernel.max_threads)):
        raise EmulationError(f"{nthreads} threads per block exceed the kernel's .maxntid {kernel.max_threads}")
    _, static, dyn_base = shared_layout(kernel.shared)
    limit = targets.lookup(arch).gpu.smem_limit
    if dynamic_smem < 0 or static + dynamic_smem > limit:
        raise EmulationError(f"{short_name(kernel.name)}: {dynamic_smem} bytes of dynamic shared memory "
                             f"(+{static} static) exceed the {arch} limit of {limit} bytes per block")
    program = compiled(kernel)
    pbuf = _param_buffer(kernel, params)
    if seed is None:
        seed = secrets.randbits(32)
    run = _Launch(kernel, program, np.random.default_rng(seed), max_warp_instructions, seed)
    blocks = [(x, y, z) for z in range(grid[2]) for y in range(grid[1]) for x in range(grid[0])]
    order = run.rng.permutation(len(blocks))      # blocks of a grid run in no defined order
    smem_bytes = dyn_base + dynamic_smem if dynamic_smem else max(static, dyn_base)
    per_wave = max(1, min(WAVE_LANES // (32 * -(-nthreads // 32)), WAVE_SMEM // max(smem_bytes, 1)))
    t0 = time.perf_counter()
    counts = counters.Counters() if counters.enabled() else None
    memory.start_launch(track_writers=race_check, counters=counts, atomic_order=np.random.default_rng((seed, 1)))
    try:
        with np.errstate(all="ignore"):           # inactive lanes compute on garbage
            for first in range(0, len(order), per_wave):
                # which CTAs share a wave is the seeded order's; within it they stand in the order of
                # their linear index, so that CTAs that do the same work (a batch's, a head's: adjacent
                # indices) are adjacent warps and keep stepping together (the seeded atomic_order keeps
                # the order of their atomics varied)
                wave = _Wave([blocks[i] for i in sorted(order[first:first + per_wave])], grid, memory, pbuf,
                             program.reg_dtypes, nthreads, block, smem_bytes, race_check, program.smem_granule)
                if program.hopper:
                    hopper_state.attach(wave.warps[0].smem)
                try:
                    run.run_wave(wave, nthreads)
                finally:
                    wave.close()
    finally:
        memory.end_launch()
    stats = LaunchStats(seconds=time.perf_counter() - t0, blocks=len(blocks), seed=seed, counters=counts)
    executed = np.array(run.counts, np.int64)
    stats.warp_instructions = int(executed.sum())
    forms = program.forms
    for pc, n in zip(np.flatnonzero(executed).tolist(), executed[executed > 0].tolist()):
        stats.opcode_counts[forms[pc]] += n
    return stats
