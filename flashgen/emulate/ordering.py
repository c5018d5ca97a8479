"""Happens-before between the agents of a CTA, for the shared-memory race detector of Hopper
kernels (memory.py's SharedMemory asks it through its `hopper` state).

memory.py's detector orders accesses by the CTA's barrier only (bar.sync 0: epochs). Hopper
pipelines also order them with mbarriers (an arrival, then a try_wait that sees its phase
complete; a TMA load's complete_tx) and with named barriers of fewer threads than the CTA.
Vector clocks model those: each CTA slot has one clock; each access of a shared-memory granule
is stamped with it (per granule: the last writer and its time, and each agent's last read time);
a release (an mbarrier arrival, a warp's arrival at a named barrier) passes on, in a vector the
barrier carries, the releaser's time and all it knew; an acquire (a try_wait that sees the phase
complete, a warp a named barrier releases) takes the barrier's vector in. An access that
memory.py finds conflicting with an earlier one (same epoch, another agent) is a race unless the
accessing warp knows a time of that agent no earlier than the earlier access. An async-proxy
read (a wgmma's shared-memory operands, a TMA store's source) must likewise be ordered after
each byte's last write, by what the warp on whose behalf it reads knows (a wgmma reads B for
each warp of its warpgroup, and A's rows 16 (w % 4) .. for warp w).

Agents: the warps of the CTA, and the async proxy (ASYNC: a TMA load's write, stamped when it
lands and released by its complete_tx to the warps that wait on the phase).
"""
from __future__ import annotations

import numpy as np

MAX_WARPS = 32                  # 1024 threads
ASYNC = MAX_WARPS               # the async proxy's agent id


class Ordering:
    def __init__(self, total: int, stride: int, granule: int, ctas: int):
        self.stride, self.granule = stride, granule
        self.clock = np.ones(ctas, np.int64)
        self.known = np.zeros((ctas, ASYNC + 1, ASYNC + 1), np.int64)   # [slot, agent, of agent]
        n = -(-total // granule)
        # int32 times (a launch releases fewer than 2^31 times): a reading agent's array costs 4
        # bytes per granule of the wave
        self.w_time = np.zeros(n, np.int32)
        self.w_agent = np.full(n, -1, np.int8)
        self.r_time: dict = {}          # agent -> its last read time of each granule

    def _where(self, g, agent):
        """(slot [rows, 1], agent [rows, 1]) of granules g [rows, k]."""
        return g[:, :1] * self.granule // self.stride, np.asarray(agent).reshape(-1, 1)

    def stamp(self, g: np.ndarray, agent, write: bool) -> None:
        slots, agents = self._where(g, agent)
        times = np.broadcast_to(self.clock[slots], g.shape)
        if write:
            self.w_time[g] = times
            self.w_agent[g] = np.broadcast_to(agents, g.shape)
            return
        for a in np.unique(agents):
            rows = (agents == a).reshape(-1) if agents.size > 1 else slice(None)
            r = self.r_time.get(int(a))
            if r is None:
                r = self.r_time[int(a)] = np.zeros(self.w_time.size, np.int32)
            r[g[rows]] = times[rows]

    def unordered_write(self, g: np.ndarray, agent) -> np.ndarray:
        """Whether the last write of each granule is not known to `agent` (a race if another's)."""
        slots, agents = self._where(g, agent)
        writer = self.w_agent[g]
        known = self.known[slots, agents, np.maximum(writer, 0)]
        return (writer < 0) | ((writer != agents) & (self.w_time[g] > known))

    def unordered_reads(self, g: np.ndarray, agent) -> np.ndarray:
        """Whether another agent read a granule at a time `agent` does not know."""
        slots, agents = self._where(g, agent)
        bad = np.zeros(g.shape, bool)
        for a, r in self.r_time.items():
            bad |= (agents != a) & (r[g] > self.known[slots, agents, a])
        return bad

    def unordered_async_read(self, g: np.ndarray, readers: list, slot: int):
        """An async-proxy read of granules g (flat) on behalf of each of warps `readers`, each
        ordered by what it knows itself: -> (granule, writer, reader) of a write a reader does not
        know of, or None. (A wgmma is no barrier among the warps of its warpgroup: their issues
        meeting orders nothing, so no warp lends another its knowledge.)"""
        writer = self.w_agent[g]
        who = np.asarray(readers)[:, None]
        known = self.known[slot, who, np.maximum(writer, 0)]                        # [reader, granule]
        bad = (writer >= 0) & (writer != who) & (self.w_time[g] > known)
        if not bad.any():
            return None
        r, i = np.unravel_index(int(np.argmax(bad)), bad.shape)
        return int(g[i]), int(writer[i]), int(readers[r])

    def now(self, slot: int) -> int:
        """The time an access now gets (stamp)."""
        return int(self.clock[slot])

    def knows(self, slot: int, agent: int, of: int, time: int) -> bool:
        """Whether `agent` knows the access agent `of` made at `time`."""
        return agent == of or self.known[slot, agent, of] >= time

    def release(self, slot: int, agent: int) -> np.ndarray:
        """`agent` releases: -> the vector it passes on (what it knows, and its time now)."""
        v = self.known[slot, agent].copy()
        v[agent] = self.clock[slot]
        self.clock[slot] += 1
        return v

    def acquire(self, slot: int, agent: int, v: np.ndarray) -> None:
        np.maximum(self.known[slot, agent], v, out=self.known[slot, agent])

    def cta_barrier(self, slot: int) -> None:
        """bar.sync 0: every warp knows every warp's accesses so far, and what any knew of the
        async proxy's."""
        k = self.known[slot]
        merged = k.max(0)
        merged[:ASYNC] = self.clock[slot]
        k[:] = merged
        self.clock[slot] += 1
