"""Where the emulator must order no more than the hardware does (issue 21's strictness gaps):
micro-kernels of tests/emulator/hopper.cu whose only sync is one the hardware does not give
must fail, and their correctly synchronized variants pass."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import needs_nvcc
from flashgen.emulate import EmulationError
from test_emulator_hopper import _accumulators, _wgmma_case, hopper, run, smem_image  # noqa: F401 (fixture)

pytestmark = needs_nvcc


# ---- a wgmma is no barrier among its warpgroup's warps ------------------------------------------
def _owners(da, db, words, a_rows_of, b_phase):
    """owner[word] for wgmma_peer_stores: warp + 4 * phase. A row r is stored in phase 1 by warp
    a_rows_of(r // 16); B round-robin over the warps, in phase `b_phase` (A, B: 64 x 16 bf16)."""
    from flashgen.emulate.semantics.wgmma import decode_descriptor, operand_addresses
    owner = np.full(words, -1, np.int32)
    b_words = operand_addresses(64, 16, 2, False, decode_descriptor(db, "B")) // 4
    owner[b_words] = b_words % 4 + 4 * b_phase
    a_words = operand_addresses(64, 16, 2, False, decode_descriptor(da, "A")) // 4
    owner[a_words] = np.array([a_rows_of(r // 16) for r in range(64)])[:, None] + 4
    return owner


def _peer_stores(module, rng, a_rows_of, b_phase, sync, seed=0):
    a, b, _, img, da, db = _wgmma_case(rng, "bf16", (False, False), 128)
    out = np.full((128, 32), np.nan, np.float32)
    run(module, "wgmma_peer_stores", [img, _owners(da, db, img.size, a_rows_of, b_phase), img.size, da, db, out, sync],
        block=(160, 1, 1), smem=img.nbytes, seed=seed)
    want = a.astype(np.float64) @ b.astype(np.float64).T
    assert np.abs(_accumulators(out) - want).max() <= 1e-5 * np.abs(want).max()


NONE, SYNCWARP, NAMED = 0, 1, 2
OWN_ROWS, NEXT_WARPS_ROWS = (lambda w: w), (lambda w: (w + 1) % 4)


@pytest.mark.parametrize("a_rows_of,b_phase,sync", [
    (OWN_ROWS, 0, SYNCWARP),          # FA3's P in shared memory: each warp stores its own rows of A
    (NEXT_WARPS_ROWS, 0, NAMED),
    (OWN_ROWS, 1, NAMED),
], ids=["own-A-rows-syncwarp", "peer-A-rows-named-barrier", "peer-B-named-barrier"])
def test_wgmma_after_ordered_stores_passes(hopper, rng, a_rows_of, b_phase, sync):  # noqa: F811
    _peer_stores(hopper, rng, a_rows_of, b_phase, sync)


@pytest.mark.parametrize("a_rows_of,b_phase,sync,reader", [
    (NEXT_WARPS_ROWS, 0, SYNCWARP, "A"),
    (NEXT_WARPS_ROWS, 0, NONE, "A"),
    (OWN_ROWS, 1, SYNCWARP, "B"),
], ids=["peer-A-rows-syncwarp", "peer-A-rows-nothing", "peer-B-syncwarp"])
def test_wgmma_after_unordered_peer_stores_fails(hopper, rng, a_rows_of, b_phase, sync, reader):  # noqa: F811
    """Before: the warpgroup's rendezvous counted as a barrier (the readers knew together what
    any of them knew), and these passed."""
    for seed in range(3):
        with pytest.raises(EmulationError, match=rf"wgmma\.mma_async \({reader}\) by warp [0-3] reads shared offset "
                                                 rf"\d+, written by warp [0-3] with nothing ordering the write"):
            _peer_stores(hopper, rng, a_rows_of, b_phase, sync, seed)


@pytest.mark.slow
def test_backward_without_the_barrier_before_the_dq_wgmma_is_caught(tmp_path, rng):
    """hopper/bwd.cuh's consumer warps each store dS^T rows that every warp's dQ wgmma reads as A:
    without the named barrier between (the one that also precedes the stage's release), the
    mutant passed before (its numbers are right under any emulated schedule)."""
    from test_hopper_mutations import _assert_caught, _bwd_errors
    barrier = "    sm90::named_sync(1, NT);\n    if (tid == 0) sm90::mbar_arrive(smem_addr(&empty[s]));"
    _assert_caught(tmp_path, "bwd_missing_barrier_before_dq_wgmma", "bwd.cuh", barrier, barrier.split("\n")[1],
                   lambda csrc: _bwd_errors(csrc, rng))


# ---- a diverged mbarrier wait parks ---------------------------------------------------------------
def test_diverged_wait_on_a_barrier_nobody_completes_is_a_deadlock(hopper):  # noqa: F811
    """Before: only a converged warp parked; lane 0 waiting alone spun until the instruction
    budget ("an infinite loop?"), hours at the default budget."""
    with pytest.raises(EmulationError, match=r"deadlock: no warp can run; warp 0 of block \(0, 0, 0\) spins on "
                                             r"mbarrier\.try_wait\.parity 0"):
        run(hopper, "diverged_wait", [np.zeros(2, np.int32), 7, -1 & 0xFFFFFFFF], block=(64, 1, 1),
            max_warp_instructions=100_000)


def test_diverged_wait_parks_until_the_phase_completes(hopper):  # noqa: F811
    """Warp 1 loops 3000 times before it stores the value and completes the phase; lane 0 of
    warp 0 tries once, parks, and tries again once woken by the phase's completion (before: it
    spun, some 100-200 tries here)."""
    for seed in range(3):
        out = np.full(2, -1, np.int32)
        stats = run(hopper, "diverged_wait", [out, 7, 3000], block=(64, 1, 1), seed=seed)
        assert out[0] == 7
        assert stats.opcode_counts["mbarrier.try_wait.parity.shared::cta.b64"] == 2


# ---- what orders through an mbarrier: a (non-relaxed) arrival, not complete_tx -------------------
@pytest.mark.parametrize("how", [0, 2], ids=["arrive-after-store", "complete_tx-then-arrive"])
def test_phase_completed_by_an_arrival_after_the_store_orders_it(hopper, how):  # noqa: F811
    out = np.full(1, -1, np.int32)
    run(hopper, "complete_tx_handoff", [out, 7, how], block=(64, 1, 1))
    assert out[0] == 7


@pytest.mark.parametrize("how", [1, 3, 4], ids=["complete_tx-after-store", "arrive.relaxed", "try_wait.relaxed"])
def test_handoff_through_a_relaxed_mbarrier_operation_is_a_race(hopper, how):  # noqa: F811
    """PTX ISA: mbarrier.complete_tx has only .relaxed semantics (`.sem = { .relaxed }`, "mbarrier.
    complete_tx"), an arrival is a release and a try_wait an acquire unless .relaxed: a phase
    completed at a complete_tx, or a .relaxed arrival or wait, orders nothing of the handoff.
    Before: complete_tx already published nothing (case 1 raised then too); a .relaxed arrival
    or wait ordered the handoff (cases 3 and 4 passed silently)."""
    for seed in range(3):
        with pytest.raises(EmulationError, match=r"shared-memory race: warp 1 reads offset \d+"):
            run(hopper, "complete_tx_handoff", [np.zeros(1, np.int32), 7, how], block=(64, 1, 1), seed=seed)


# ---- an in-flight wgmma's A-fragment registers may not even be read --------------------------------
@pytest.mark.parametrize("early", [0, 1], ids=["after-wait", "in-flight"])
def test_reading_an_in_flight_wgmmas_a_registers(hopper, rng, early):  # noqa: F811
    """Before: only writes of the A fragment in flight were refused; the PTX ISA (wgmma.mma_async:
    "accessing the accumulator register or the input register containing the fragments of matrix
    A ... without first performing a wgmma.wait_group ... is undefined behavior") refuses reads."""
    a, b, _, _, _, _ = _wgmma_case(rng, "bf16", (False, False), 16)
    img, (db,) = smem_image([b.view(np.uint16)], (False,), 64)
    regs = rng.integers(0, 1 << 32, 512, dtype=np.uint32)
    args = [img, img.size, regs, db, np.zeros((128, 32), np.float32), np.zeros(128, np.uint32), early]
    if early:
        with pytest.raises(EmulationError, match=r"mov\.b32 accesses register %r\d+ of a wgmma\.mma_async that has "
                                                 r"not completed"):
            run(hopper, "wgmma_rs_a_read", args, block=(128, 1, 1), smem=img.nbytes)
    else:
        run(hopper, "wgmma_rs_a_read", args, block=(128, 1, 1), smem=img.nbytes)
        assert (args[5] == regs[::4]).all()


# ---- mbarrier.init is a write another thread's use must be ordered after ---------------------------
@pytest.mark.parametrize("sync", [1, 0], ids=["fence-and-syncthreads", "no-sync"])
def test_mbarrier_use_must_be_ordered_after_its_init(hopper, sync):  # noqa: F811
    """Before: only a use that came before the init in the schedule failed ("used before
    mbarrier.init"); warp 1, late by 1000 loop trips, used it unordered and passed."""
    for seed in range(3):
        if sync:
            run(hopper, "mbarrier_init_then_use", [1000, 1], block=(64, 1, 1), seed=seed)
            continue
        with pytest.raises(EmulationError, match=r"mbarrier at shared offset \d+ used by warp 1 with nothing ordering "
                                                 r"its mbarrier\.init by warp 0 before the use"):
            run(hopper, "mbarrier_init_then_use", [1000, 0], block=(64, 1, 1), seed=seed)
