"""The emulator's Hopper instructions: micro-kernels (tests/emulator/hopper.cu, compiled by nvcc
for sm_90a) against numpy models of the PTX ISA's semantics, layout tables against numbers
transcribed from CuTe's headers, and every misuse triggered by a tiny kernel."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

from conftest import needs_nvcc
from flashgen.emulate import EmulationError, PtxModule
from test_emulator import run as run_sm80

HOPPER = pathlib.Path(__file__).parent / "emulator" / "hopper.cu"


@pytest.fixture(scope="module")
def hopper():
    from flashgen.emulate.nvcc import compile_ptx
    return PtxModule.parse(compile_ptx(HOPPER, "sm90a"))


def run(module, name, args, **kw):
    return run_sm80(module, name, args, arch="sm90a", **kw)


# ---------------------------------------------------------------------------------------------
# mbarrier
# ---------------------------------------------------------------------------------------------
@needs_nvcc
def test_mbarrier_producer_consumer_handoff(hopper, rng):
    rounds = 6
    for seed in range(4):
        a = rng.standard_normal((rounds, 32)).astype(np.float32)
        buf, out = np.full(32, np.nan, np.float32), np.full((rounds, 32), np.nan, np.float32)
        run(hopper, "mbarrier_handoff", [a, buf, out, rounds], block=(64, 1, 1), seed=seed)
        assert (out == 2 * a).all()


@needs_nvcc
def test_mbarrier_wait_on_the_wrong_parity_hangs_with_a_clear_message(hopper):
    out = np.zeros(32, np.int32)
    run(hopper, "mbarrier_wait_parity", [out, 1])           # the phase before the first is complete
    assert (out == 1).all()
    with pytest.raises(EmulationError, match=r"more than 20000 warp-instructions.*warp 0 of block \(0, 0, 0\) "
                                             r"spins on mbarrier\.try_wait\.parity 0; the mbarrier at shared "
                                             r"offset \d+ in phase 0 \(parity 0\): 1 of 1 arrivals"):
        run(hopper, "mbarrier_wait_parity", [np.zeros(32, np.int32), 0], max_warp_instructions=20000)


@needs_nvcc
def test_mbarrier_phase_needs_arrivals_and_transaction_bytes(hopper):
    out = np.full(3, -1, np.int32)
    run(hopper, "mbarrier_tx", [out, 256, 256])
    assert out.tolist() == [0, 0, 0]        # not before the arrival, not before the bytes, next phase open
    with pytest.raises(EmulationError, match=r"spins on mbarrier\.try_wait\.parity 0; .*0 of 1 arrivals and 128 "
                                             r"transaction bytes pending"):
        run(hopper, "mbarrier_tx", [np.zeros(3, np.int32), 256, 128], max_warp_instructions=20000)
    with pytest.raises(EmulationError, match=r"complete_tx of 384 bytes .*more transaction bytes arrived than "
                                             r"expect_tx announced"):
        run(hopper, "mbarrier_tx", [np.zeros(3, np.int32), 256, 384])


def test_mbarrier_state_machine():
    """The PTX ISA's rules, unit by unit: the phase flips only when both counts reach 0; the
    transaction count may go below 0 while arrivals are pending (complete_tx before expect_tx)."""
    from flashgen.emulate.hopper_state import MBarrier
    b = MBarrier(0, 2)
    assert b.completed(1) and not b.completed(0)
    b.complete_tx(64)                       # the bytes land before they are announced
    assert b.arrive(1) == 0 and not b.completed(0)
    b.expect_tx(64)
    assert not b.completed(0)
    b.arrive(1)
    assert b.completed(0) and not b.completed(1) and (b.phase, b.pending, b.tx) == (1, 2, 0)
    with pytest.raises(EmulationError, match="more arrivals than the phase expects"):
        b.arrive(3)
    with pytest.raises(EmulationError, match=r"count 0 \(must be in \[1, 2\^20\)\)"):
        MBarrier(0, 0)


# ---------------------------------------------------------------------------------------------
# named barriers
# ---------------------------------------------------------------------------------------------
@needs_nvcc
def test_named_barrier_arrive_then_sync(hopper, rng):
    for seed in range(4):
        a = rng.standard_normal(64).astype(np.float32)
        out = np.full(128, np.nan, np.float32)
        run(hopper, "named_barrier_arrive", [a, out, 128], block=(128, 1, 1), seed=seed)
        assert (out[:64] == a + 1).all() and (out[64:] == (a + 1) * 3).all()


@needs_nvcc
def test_named_barrier_misuse(hopper):
    a, out = np.zeros(64, np.float32), np.zeros(128, np.float32)
    with pytest.raises(EmulationError, match=r"barrier 1 reached with thread count 96 while \d+ threads wait "
                                             r"with count 128|barrier 1 reached with thread count 128 while"):
        run(hopper, "named_barrier_arrive", [a, out, 96], block=(128, 1, 1))
    with pytest.raises(EmulationError, match=r"thread count 100 \(must be a positive multiple of 32"):
        run(hopper, "named_barrier_arrive", [a, out, 100], block=(128, 1, 1))


@needs_nvcc
def test_named_barrier_ping_pong_alternates(hopper):
    for seed in range(3):
        out = np.full(10, -1, np.int32)
        run(hopper, "named_barrier_pingpong", [out, 5, 0], block=(256, 1, 1), seed=seed)
        assert out.tolist() == list(range(10))


@needs_nvcc
def test_named_barrier_deadlock_is_reported(hopper):
    with pytest.raises(EmulationError, match=r"deadlock: no warp can run; barrier [23] of block slot 0: 128 of 256 "
                                             r"threads arrived \(waiting: warps [0-7], [0-7], [0-7], [0-7]\); barrier"):
        run(hopper, "named_barrier_pingpong", [np.full(4, -1, np.int32), 2, 1], block=(256, 1, 1))


# ---------------------------------------------------------------------------------------------
# elect.sync
# ---------------------------------------------------------------------------------------------
@needs_nvcc
@pytest.mark.parametrize("mask", [0xFFFFFFFF, 0xF0F0F000, 0x80000000])
def test_elect_sync_elects_the_lowest_member(hopper, mask):
    leader, flag = np.zeros(64, np.int32), np.zeros(64, np.int32)
    run(hopper, "elect_one", [leader, flag, mask], block=(64, 1, 1))
    lanes = np.arange(64) % 32
    member = ((mask >> lanes) & 1).astype(bool)
    first = (mask & -mask).bit_length() - 1
    assert (leader[member] == first).all() and (leader[~member] == -1).all()
    assert (flag == np.where(member, (lanes == first).astype(int), -1)).all()
