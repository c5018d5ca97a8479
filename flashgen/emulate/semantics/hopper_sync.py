"""Hopper synchronization: mbarrier, named barriers (bar.sync id, n / bar.arrive), elect.sync,
and the fences (fence.proxy.async and the memory fences, which change nothing here: each access
of the emulator completes in program order). The state they act on is hopper_state's."""
from __future__ import annotations

import numpy as np

from flashgen.emulate.errors import EmulationError
from flashgen.emulate.ptx import TYPE_SIZES, Addr, Reg, Sym
from flashgen.emulate.semantics.registry import executing_warps, handles, require_full_warp, unsupported
from flashgen.emulate.semantics.warpops import _member_lanes

_SPACES = {"shared", "shared::cta"}
# memory-order and scope qualifiers: the emulator's accesses are already ordered (memops.py)
_ORDER = {"release", "acquire", "relaxed", "cta", "gpu", "sys"}


def _sink(ops, op, ty):
    return (lambda w, v, m: None) if isinstance(op, Sym) and op.name == "_" else ops.write(op, ty)


def warp_lanes(w, m):
    """(warp, its 32-lane slice of the gang, its executing lanes or None) per executing warp."""
    for j, warp in enumerate(w.members):
        lanes = None if m is None else m[32 * j:32 * j + 32]
        if lanes is None or lanes.any():
            yield warp, slice(32 * j, 32 * j + 32), lanes


@handles("mbarrier", per_warp=True)
def mbarrier(ins, ops):
    mods = ins.mods
    if "shared::cluster" in mods:
        raise unsupported(ins, "cluster-scope mbarriers are not modelled")
    if not set(mods) & _SPACES or mods[-1] != "b64":
        raise unsupported(ins)
    action = mods[0]
    rest = set(mods[1:-1]) - _SPACES - _ORDER
    addr_op = next(x for x in ins.operands if isinstance(x, Addr))
    addr = ops.address(addr_op)
    pos = ins.operands.index(addr_op)
    # a 32-bit register's shared address plus an offset wraps at 2^32, as the hardware's does
    wrap = 0xFFFFFFFF if isinstance(addr_op.base, Reg) and TYPE_SIZES.get(ops.reg_type(addr_op.base)) == 4 else -1

    def barriers(w, m):
        """(warp, lanes slice, [(shared offset, its executing lanes of the warp)]) per executing
        warp. Every offset counts, a wrapped or negative one too: the AsyncState refuses it."""
        for warp, sl, lanes in warp_lanes(w, m):
            offs = addr(w)[sl] & wrap
            live = np.ones(32, bool) if lanes is None else lanes
            yield warp, sl, [(off, live & (offs == off)) for off in np.unique(offs[live])]

    if action == "init" and not rest:
        rcount = ops.read(ins.operands[1], "u32")

        def init(w, m):
            counts = rcount(w)
            for warp, sl, groups in barriers(w, m):
                for off, mine in groups:
                    c = np.unique(counts[sl][mine])
                    if c.size != 1:
                        raise EmulationError(f"mbarrier.init at offset {off} with different counts {c.tolist()}")
                    warp.smem.hopper.mbarrier(warp, int(off), int(c[0]))
        return init

    # What orders memory (PTX ISA, "mbarrier.arrive", "mbarrier.test_wait/try_wait",
    # "mbarrier.complete_tx"): an arrival is a release unless .relaxed, a wait that sees its phase
    # complete an acquire unless .relaxed; expect_tx and complete_tx have only .relaxed
    # (`.sem = { .relaxed }`), so a phase that completes at a complete_tx publishes nothing of
    # what its thread wrote (a TMA load's complete_tx does publish the bytes it landed).
    relaxed = "relaxed" in mods
    if action in ("arrive", "expect_tx", "complete_tx") and rest <= {"expect_tx"}:
        tx_arrive = action == "arrive" and "expect_tx" in rest
        has_state = action == "arrive"
        state = _sink(ops, ins.operands[0], "b64") if has_state else None
        extra = ins.operands[pos + 1] if len(ins.operands) > pos + 1 else None
        rextra = ops.read(extra, "u32") if extra is not None else None

        def act(w, m):
            n = rextra(w) if rextra is not None else None
            tokens = np.zeros(w.nlanes, np.uint64)
            for warp, sl, groups in barriers(w, m):
                h = warp.smem.hopper
                for off, mine in groups:
                    b = h.mbarrier(warp, int(off))
                    amounts = n[sl][mine].astype(np.int64) if n is not None else None
                    if action == "expect_tx" or tx_arrive:
                        b.expect_tx(int(amounts.sum()))
                    if action == "complete_tx":
                        b.complete_tx(int(amounts.sum()))
                    if action == "arrive":
                        count = int(mine.sum()) if tx_arrive or amounts is None else int(amounts.sum())
                        if not relaxed:
                            b.carry = h.release(warp, b.carry)
                        tokens[sl][mine] = b.arrive(count)
            if state is not None:
                state(w, tokens, m)
        return act

    if action in ("try_wait", "test_wait") and rest <= {"parity"}:
        parity = "parity" in rest
        done_w = ops.write(ins.operands[0], "pred")
        rarg = ops.read(ins.operands[2], "u32" if parity else "b64")

        def wait(w, m):
            arg = rarg(w).astype(np.int64)
            done = np.zeros(w.nlanes, bool)
            for warp, sl, groups in barriers(w, m):
                h = warp.smem.hopper
                for off, mine in groups:
                    b = h.mbarrier(warp, int(off))
                    b.land()
                    want = np.unique(arg[sl][mine])
                    ok = [b.completed(int(x)) if parity else b.phase != int(x) for x in want]
                    done[sl][mine] = np.array(ok)[np.searchsorted(want, arg[sl][mine])]
                    if not all(ok):
                        what = (f"mbarrier.{action}.parity {int(want[0]) & 1}" if parity else
                                f"mbarrier.{action} for the phase of state token {int(want[0])}")
                        h.spin(warp, what, b, park=len(groups) == 1 and not any(ok))
                    else:
                        h.stop_spinning(warp)
                    if any(ok) and not relaxed:
                        h.acquire(warp, b.published)
            done_w(w, done, m)
        return wait

    if action == "inval" and not rest:
        def inval(w, m):
            for warp, sl, groups in barriers(w, m):
                for off, _ in groups:
                    warp.smem.hopper.invalidate(warp, int(off))
        return inval
    raise unsupported(ins)


@handles("fence", per_warp=True)
def fence(ins, ops):
    mods = ins.mods
    if mods[:2] == ("proxy", "async"):
        if set(mods[2:]) - {"shared::cta", "shared::cluster", "global"}:
            raise unsupported(ins)
        if len(mods) > 2 and not set(mods[2:]) & {"shared::cta", "shared::cluster"}:
            return lambda w, m: None                  # only global memory: no shared bytes to fence

        def proxy_fence(w, m):
            for warp in executing_warps(w, m):
                warp.smem.hopper.fence_proxy_async(warp.smem_slot, warp.wid)
        return proxy_fence
    # the memory fences and the mbarrier-init fence: nothing is reordered here to begin with
    if mods in (("mbarrier_init", "release", "cluster"), ("acq_rel", "cta"), ("acq_rel", "gpu"), ("sc", "cta"),
                ("sc", "gpu")):
        return lambda w, m: None
    raise unsupported(ins)


@handles("elect", per_warp=True)
def elect(ins, ops):
    """elect.sync d|p, membermask: the lowest member lane is the leader (the hardware's choice;
    the PTX ISA only promises one leader, the same for the same mask)."""
    if ins.mods != ("sync",):
        raise unsupported(ins)
    d, p = ops.pair(ins.operands[0])
    wd, wp = _sink(ops, d, "u32"), ops.write(p, "pred")
    rmask = ops.read(ins.operands[1], "u32")

    def run(w, m):
        members = _member_lanes(w, rmask, m, ins).reshape(-1, 32)
        leader = np.where(members.any(1), members.argmax(1), 0)
        wd(w, np.repeat(leader, 32).astype(np.uint32), m)
        wp(w, (members & (np.arange(32) == leader[:, None])).reshape(-1), m)
    return run


def compile_named_barrier(ins, ops):
    """bar.sync / barrier.sync id{, n} and bar.arrive / barrier.arrive id, n -> run(warp), run by
    the machine for each warp that reaches it converged (hopper_state.AsyncState.named_arrive)."""
    known = {"sync", "arrive", "aligned", "cta"}
    if set(ins.mods) - known or ("sync" in ins.mods) == ("arrive" in ins.mods) or ins.pred is not None:
        raise unsupported(ins)
    wait = "sync" in ins.mods
    if not wait and len(ins.operands) != 2:
        raise unsupported(ins, "bar.arrive needs a thread count")
    rid = ops.read(ins.operands[0], "u32")
    rcount = ops.read(ins.operands[1], "u32") if len(ins.operands) > 1 else None

    def uniform(warp, reader, what):
        v = reader(warp)[warp.alive]
        if (v != v[0]).any():
            raise EmulationError(f"{ins.form} with a {what} that differs between the lanes of a warp")
        return int(v[0])

    def run(warp):
        require_full_warp(warp, None, ins)
        bid = uniform(warp, rid, "barrier id")
        count = uniform(warp, rcount, "thread count") if rcount is not None else 32 * len(warp.cta.warps)
        warp.smem.hopper.named_arrive(warp, bid, count, wait)
    return run
