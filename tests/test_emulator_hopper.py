"""The emulator's Hopper instructions: micro-kernels (tests/emulator/hopper.cu, compiled by nvcc
for sm_90a) against numpy models of the PTX ISA's semantics, layout tables against numbers
transcribed from CuTe's headers, and every misuse triggered by a tiny kernel."""
from __future__ import annotations

import pathlib
import re

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
@pytest.mark.parametrize("asm_loops", [0, 1])
def test_mbarrier_producer_consumer_handoff(hopper, rng, asm_loops):
    rounds = 6
    for seed in range(4):
        a = rng.standard_normal((rounds, 32)).astype(np.float32)
        buf, out = np.full(32, np.nan, np.float32), np.full((rounds, 32), np.nan, np.float32)
        run(hopper, "mbarrier_handoff", [a, buf, out, rounds, asm_loops], block=(64, 1, 1), seed=seed)
        assert (out == 2 * a).all()


@needs_nvcc
def test_mbarrier_wait_on_the_wrong_parity_hangs_with_a_clear_message(hopper):
    out = np.zeros(32, np.int32)
    run(hopper, "mbarrier_wait_parity", [out, 1])           # the phase before the first is complete
    assert (out == 1).all()
    # the waiting warp parks: with no warp left to run, the deadlock is seen at once (the default
    # budget of 2e8 instructions would take hours to spin through)
    with pytest.raises(EmulationError, match=r"PTX line \d+: mbarrier\.try_wait\.parity.*deadlock: no warp can run; "
                                             r"warp 0 of block \(0, 0, 0\) spins on mbarrier\.try_wait\.parity 0; "
                                             r"the mbarrier at shared offset \d+ in phase 0 \(parity 0\): 1 of 1 "
                                             r"arrivals"):
        run(hopper, "mbarrier_wait_parity", [np.zeros(32, np.int32), 0])


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


@needs_nvcc
@pytest.mark.parametrize("in_register", [0, 1], ids=["immediate-offset", "register"])
def test_mbarrier_address_wraps_at_32_bits_and_is_refused(hopper, in_register):
    # before: a negative address from the immediate offset counted as an inactive lane, and the
    # init silently did nothing
    with pytest.raises(EmulationError, match=r"mbarrier at shared offset 42949672\d\d: not an aligned 8-byte "
                                             r"object inside the CTA's \d+ bytes"):
        run(hopper, "mbarrier_below", [in_register])


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


def _ring(hopper, rng, tma, misuse, seed):
    rounds = 6
    a = rng.standard_normal((rounds, 64)).astype(np.float32)
    out = np.full((rounds, 64), np.nan, np.float32)
    run(hopper, "mbarrier_ring", [a, out, rounds, tma, misuse], block=(96, 1, 1), seed=seed)
    return a, out


@needs_nvcc
@pytest.mark.parametrize("tma", [0, 1], ids=["st.shared", "tma"])
def test_mbarrier_and_named_barrier_order_shared_memory(hopper, rng, tma):
    """A producer/consumer ring in generic loads and stores, ordered by its mbarriers (and, with
    `tma`, a TMA load's complete_tx) and a 64-thread named barrier: no race reported (before
    ordering.py, the race detector saw only bar.sync 0 and flagged the consumer's first read)."""
    for seed in range(3):
        a, out = _ring(hopper, rng, tma, 0, seed)
        assert (out == a + 2 * np.roll(a, 32, axis=1)).all()


@needs_nvcc
@pytest.mark.parametrize("tma", [0, 1], ids=["st.shared", "tma"])
@pytest.mark.parametrize("misuse,message", [
    # consumer warp 2 reads the stage without waiting on its full barrier: the producer's write
    # (or, with tma, the TMA load warp 1's wait landed) is unordered with its read -- or, in a
    # schedule where it reads first, the producer's next write of the stage is unordered with it
    (1, r"shared-memory race: warp \d (reads|writes) offset \d+|has not delivered yet"),
    # the producer refills a stage without waiting on its empty barrier: its write is unordered
    # with a consumer's read -- or, where it runs ahead of both consumers, their waits miss phases
    # (a deadlock), or its expect_tx arrivals overrun the full barrier's phase
    (2, r"shared-memory race: warp \d (reads|writes) offset \d+|TMA load: shared-memory race|"
        r"overlaps an asynchronous copy not yet delivered|has not delivered yet|deadlock: no warp can run|"
        r"more arrivals than the phase expects"),
    # the consumers swap halves without the named barrier
    (3, r"shared-memory race: warp [12] (reads|writes) offset \d+"),
], ids=["no-full-wait", "no-empty-wait", "no-named-barrier"])
def test_unordered_ring_accesses_are_races(hopper, rng, tma, misuse, message):
    for seed in range(3):
        with pytest.raises(EmulationError, match=message) as caught:
            _ring(hopper, rng, tma, misuse, seed)
        print(f"seed {seed}: {str(caught.value).split(']: ')[-1][:160]}")


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


# ---------------------------------------------------------------------------------------------
# wgmma: layouts transcribed from CuTe (CUTLASS 4.2.0, nvidia-cutlass wheel):
#  cute/atom/mma_traits_sm90_gmma.hpp lines 432-461: CLayout_64xN, ALayout_64x16 / 64x8 / 64x32
#  (thread, value) -> m + 64 k (or m + 64 n) of the 64 x K (64 x N) tile;
#  same file lines 158-193 (make_gmma_desc's comment): the canonical shared-memory layouts, in
#  elements, T = 16 bytes / element size, w = swizzle bytes / 16:
#    K-major  INTERLEAVE ((8,m),(T,2)):((T,SBO),(1,LBO));  swizzled ((8,m),(T,2)):((wT,SBO),(1,T))
#    MN-major INTERLEAVE ((T,1,m),(8,k)):((1,T,SBO),(T,LBO)); swizzled ((T,w,m),(8,k)):((1,T,LBO),(wT,SBO))
#  composed with Swizzle<B,4,3> (B = log2 w) of the byte address: addr ^ ((addr & (2^B-1) << 7) >> 3);
#  cute/arch/mma_sm90_desc.hpp lines 107-126: the descriptor bit fields; layout type
#  INTERLEAVE 0, B128 1, B64 2, B32 3 (lines 48-53).
# ---------------------------------------------------------------------------------------------
from test_emulator import cute_layout  # noqa: E402

CUTE_C_64xN = lambda n: (((4, 8, 4), (2, 2, n // 8)), ((128, 1, 16), (64, 8, 512)))     # noqa: E731
CUTE_A_64x16 = (((4, 8, 4), (2, 2, 2)), ((128, 1, 16), (64, 8, 512)))
CUTE_A_64x8 = (((4, 8, 4), (2, 2)), ((64, 1, 16), (8, 256)))
CUTE_A_64x32 = (((4, 8, 4), (4, 2, 2)), ((256, 1, 16), (64, 8, 1024)))
LAYOUT_TYPE = {16: 0, 128: 1, 64: 2, 32: 3}      # swizzle bytes (16: none) -> descriptor code


def cute_swizzle(addr, width):
    b = {16: 0, 32: 1, 64: 2, 128: 3}[width]
    return addr ^ ((addr & (((1 << b) - 1) << 7)) >> 3)


def cute_canonical(mn_major, width, rows, elem, lbo, sbo):
    """Byte offset (before the swizzle) of element (mn, k) of a rows x (32 / elem) operand."""
    t, w = 16 // elem, width // 16
    if not mn_major:
        shape = ((8, rows // 8), (t, 2))
        stride = ((t, sbo // elem), (1, lbo // elem)) if width == 16 else ((w * t, sbo // elem), (1, t))
    elif width == 16:
        shape, stride = ((t, 1, rows // t), (8, 2)), ((1, t, sbo // elem), (t, lbo // elem))
    else:
        shape, stride = ((t, w, rows // (t * w)), (8, 2)), ((1, t, lbo // elem), (w * t, sbo // elem))
    f = cute_layout(shape, stride)
    return np.array([[f(i, j) * elem for j in range(32 // elem)] for i in range(rows)])


def canonical_strides(mn_major, width, rows, elem):
    """A dense choice of (LBO, SBO) for a rows x 32-byte operand (the one the unused field takes
    is arbitrary but nonzero, to show it is ignored)."""
    if not mn_major:
        return (128, 256) if width == 16 else (4096, 8 * width)
    if width == 16:
        return 8 * 128 * (rows * elem // 128), 128
    return 16 * width, 8 * width


def smem_image(mats, mn_major, width, k_offset=0):
    """Lay out matrices [rows, K] (raw elements) each in its own 2 KiB-aligned region by CuTe's
    canonical layout; -> (uint32 image, descriptors relative to the image)."""
    elem = mats[0].dtype.itemsize
    image, descs, base = np.zeros(0, np.uint8), [], 0
    for mat, major in zip(mats, mn_major):
        rows = mat.shape[0]
        lbo, sbo = canonical_strides(major, width, rows, elem)
        off = cute_canonical(major, width, rows, elem, lbo, sbo) + k_offset
        addr = cute_swizzle(base + off, width)
        size = -(-(int(addr.max()) + elem) // 2048) * 2048
        image = np.concatenate([image, np.zeros(size - image.size, np.uint8)])
        image.view(mat.dtype)[addr // elem] = mat
        start = base + k_offset
        descs.append((start >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (LAYOUT_TYPE[width] << 62))
        base = image.size
    return image.view(np.uint32), descs


def test_wgmma_register_layouts_equal_cute():
    from flashgen.emulate.semantics import wgmma
    for n in (8, 64, 256):
        rows, cols = wgmma.accumulator_table(n)                      # [lane, reg], rows within the warp
        f = cute_layout(*CUTE_C_64xN(n))
        for t in range(128):
            for v in range(n // 2):
                idx = f(t, v)
                assert (16 * (t // 32) + rows[t % 32, v], cols[t % 32, v]) == (idx % 64, idx // 64)
    for atype, cute, per_reg in (("bf16", CUTE_A_64x16, 2), ("tf32", CUTE_A_64x8, 1), ("e4m3", CUTE_A_64x32, 4)):
        rows, cols = (x.reshape(32, -1) for x in wgmma.a_register_table(atype))
        f = cute_layout(*cute)
        for t in range(128):
            for v in range(rows.shape[1]):
                idx = f(t, v)
                assert (16 * (t // 32) + rows[t % 32, v], cols[t % 32, v]) == (idx % 64, idx // 64), (atype, t, v)
        assert rows.shape[1] == 4 * per_reg


@pytest.mark.parametrize("width", [16, 32, 64, 128])
@pytest.mark.parametrize("mn_major", [False, True])
@pytest.mark.parametrize("elem", [1, 2, 4])
def test_descriptor_addresses_equal_cute_canonical_layouts(width, mn_major, elem):
    from flashgen.emulate.semantics import wgmma
    if mn_major and elem != 2:
        return                                  # MN-major is for 16-bit types only
    rows = 64
    if mn_major and rows * elem < width:
        return
    lbo, sbo = canonical_strides(mn_major, width, rows, elem)
    start = 3072 + (32 if width >= 64 and not mn_major else 0)        # an advance along K inside the atom
    desc = (start >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (LAYOUT_TYPE[width] << 62)
    got = wgmma.operand_addresses(rows, 32 // elem, elem, mn_major, wgmma.decode_descriptor(desc, "A"))
    want = cute_swizzle(start + cute_canonical(mn_major, width, rows, elem, lbo, sbo), width)
    assert (got == want).all()


def test_bad_descriptors_fail():
    from flashgen.emulate.semantics.wgmma import decode_descriptor
    with pytest.raises(EmulationError, match=r"B descriptor 0x0000400000000000 sets reserved bits 0x400000000000"):
        decode_descriptor(1 << 46, "B")
    with pytest.raises(EmulationError, match=r"base offset 3: only 0 is modelled"):
        decode_descriptor(3 << 49 | 1 << 62, "A")


def _accumulators(d_out, n=64):
    """Emulated registers [thread, reg] -> the 64 x n matrix, by CuTe's CLayout_64xN."""
    f = cute_layout(*CUTE_C_64xN(n))
    out = np.full((64, n), np.nan, np.float32)
    for t in range(128):
        for v in range(n // 2):
            out[f(t, v) % 64, f(t, v) // 64] = d_out[t, v]
    return out


def _as_registers(mat, n=64):
    f = cute_layout(*CUTE_C_64xN(n))
    return np.array([[mat[f(t, v) % 64, f(t, v) // 64] for v in range(n // 2)] for t in range(128)], np.float32)


def _wgmma_case(rng, dtype, kernel_major, width, k_offset=0):
    import ml_dtypes
    npt = {"bf16": ml_dtypes.bfloat16, "f16": np.float16}[dtype]
    a = rng.standard_normal((64, 16)).astype(npt)
    b = rng.standard_normal((64, 16)).astype(npt)
    c = rng.standard_normal((64, 64)).astype(np.float32)
    img, (da, db) = smem_image([a.view(np.uint16), b.view(np.uint16)], kernel_major, width, k_offset)
    return a, b, c, img, da, db


@needs_nvcc
@pytest.mark.parametrize("kernel,dtype,majors", [
    ("wgmma_ss_bf16_kk", "bf16", (False, False)), ("wgmma_ss_bf16_km", "bf16", (False, True)),
    ("wgmma_ss_bf16_mk", "bf16", (True, False)), ("wgmma_ss_bf16_mm", "bf16", (True, True)),
    ("wgmma_ss_f16_kk", "f16", (False, False))])
@pytest.mark.parametrize("width", [16, 32, 64, 128])
def test_wgmma_ss_matches_float64(hopper, rng, kernel, dtype, majors, width):
    k_offset = 32 if width >= 64 and not any(majors) else 0
    a, b, c, img, da, db = _wgmma_case(rng, dtype, majors, width, k_offset)
    for accumulate in (0, 1):
        out = np.full((128, 32), np.nan, np.float32)
        run(hopper, kernel, [img, img.size, da, db, _as_registers(c), out, accumulate], block=(128, 1, 1),
            smem=img.nbytes)
        want = a.astype(np.float64) @ b.astype(np.float64).T + (c if accumulate else 0)
        assert np.abs(_accumulators(out) - want).max() <= 1e-5 * np.abs(want).max()


@needs_nvcc
@pytest.mark.parametrize("kernel,dtype,b_major", [("wgmma_rs_bf16_k", "bf16", False), ("wgmma_rs_f16_m", "f16", True)])
def test_wgmma_rs_matches_float64(hopper, rng, kernel, dtype, b_major):
    a, b, c, _, _, _ = _wgmma_case(rng, dtype, (False, False), 16)
    img, (db,) = smem_image([b.view(np.uint16)], (b_major,), 128 if b_major else 64)
    f = cute_layout(*CUTE_A_64x16)
    halves = np.array([[a.view(np.uint16)[f(t, v) % 64, f(t, v) // 64] for v in range(8)] for t in range(128)],
                      np.uint16)
    out = np.full((128, 32), np.nan, np.float32)
    run(hopper, kernel, [img, img.size, halves.view(np.uint32), db, _as_registers(c), out, 1], block=(128, 1, 1),
        smem=img.nbytes)
    want = a.astype(np.float64) @ b.astype(np.float64).T + c
    assert np.abs(_accumulators(out) - want).max() <= 1e-5 * np.abs(want).max()


@needs_nvcc
@pytest.mark.parametrize("flag,message", [
    (8, r"accesses register %f\d+ of a wgmma\.mma_async that has not completed \(missing wgmma\.wait_group"),
    (4, r"wgmma\.mma_async without a wgmma\.fence"),
    (2, r"wgmma\.mma_async \([AB]\) reads shared offset \d+, written by warp \d through the generic proxy with no "
        r"fence\.proxy\.async"),
    (16, r"shared write by warp \d at shared offset \d+: an in-flight wgmma of warpgroup 0 still reads it"),
])
def test_wgmma_misuse_fails(hopper, rng, flag, message):
    a, b, c, img, da, db = _wgmma_case(rng, "bf16", (False, False), 128)
    with pytest.raises(EmulationError, match=message):
        run(hopper, "wgmma_ss_bf16_kk", [img, img.size, da, db, _as_registers(c), np.zeros((128, 32), np.float32),
                                         1 | flag], block=(128, 1, 1), smem=img.nbytes)


@needs_nvcc
def test_wgmma_reading_another_warpgroups_stores_without_a_barrier_fails(hopper, rng):
    """Two warpgroups store the image (each thread its words) and each issues the wgmma with no
    barrier in between: a wgmma reads words the other warpgroup stored, unordered (ordering.py),
    or, where it reads first, the other warpgroup's store lands on bytes it read."""
    a, b, c, img, da, db = _wgmma_case(rng, "bf16", (False, False), 64)
    c2 = np.concatenate([_as_registers(c)] * 2)
    for seed in range(3):
        run(hopper, "wgmma_ss_bf16_kk", [img, img.size, da, db, c2, np.zeros((256, 32), np.float32), 0],
            block=(256, 1, 1), smem=img.nbytes, seed=seed)
        with pytest.raises(EmulationError, match=r"wgmma\.mma_async \([AB]\) by warp \d reads shared offset \d+, "
                                                 r"written by warp \d with nothing ordering the write|shared write "
                                                 r"by warp \d at shared offset \d+: it was read by a wgmma") as caught:
            run(hopper, "wgmma_ss_bf16_kk", [img, img.size, da, db, c2, np.zeros((256, 32), np.float32), 128],
                block=(256, 1, 1), smem=img.nbytes, seed=seed)
        print(f"seed {seed}: {str(caught.value).split(']: ')[-1][:150]}")


@needs_nvcc
def test_wgmma_a_registers_written_after_the_fence_fail(hopper, rng):
    """nvcc places the loads of the asm's A inputs after the wgmma.fence: the PTX ISA leaves that
    undefined (CUTLASS pins them with warpgroup_fence_operand), and so does the emulator."""
    a, b, c, _, _, _ = _wgmma_case(rng, "bf16", (False, False), 16)
    img, (db,) = smem_image([b.view(np.uint16)], (False,), 64)
    with pytest.raises(EmulationError, match=r"wgmma\.mma_async without a wgmma\.fence since the warpgroup's "
                                             r"wgmma registers were last accessed"):
        run(hopper, "wgmma_rs_late_a", [img, img.size, np.zeros(512, np.uint32), db, _as_registers(c),
                                        np.zeros((128, 32), np.float32), 1], block=(128, 1, 1), smem=img.nbytes)


@needs_nvcc
def test_wgmma_wrong_swizzle_gives_a_wrong_product(hopper, rng):
    """The descriptor's swizzle mode matters: the image laid out for 128B read as 64B is wrong."""
    a, b, c, img, da, db = _wgmma_case(rng, "bf16", (False, False), 128)
    out = np.full((128, 32), np.nan, np.float32)
    wrong = lambda d: (d & ~(3 << 62)) | (2 << 62)          # noqa: E731
    run(hopper, "wgmma_ss_bf16_kk", [img, img.size, wrong(da), wrong(db), _as_registers(c), out, 0],
        block=(128, 1, 1), smem=img.nbytes)
    want = a.astype(np.float64) @ b.astype(np.float64).T
    assert np.abs(_accumulators(out) - want).max() > 0.1


# ---------------------------------------------------------------------------------------------
# TMA. The swizzle of a tile is CuTe's Swizzle<B,4,3> of the shared address (cute_swizzle above;
# cute/arch/copy_sm90_desc.hpp lines 187-205 map Swizzle<1|2|3,4,3> to TMA's 32B / 64B / 128B
# modes). Map arguments as cuda.h documents cuTensorMapEncodeTiled (data types: FLOAT32 7,
# BFLOAT16 9, UINT8 0; swizzle NONE 0, 32B 1, 64B 2, 128B 3; OOB fill NAN_REQUEST_ZERO_FMA 1).
# ---------------------------------------------------------------------------------------------
F32, BF16, U8 = 7, 9, 0


def device_tensor(rng, dims, dtype, pad=16):
    """A random tensor of `dims` (innermost first), rows padded to `pad` extra bytes, 64-byte
    aligned in its own buffer -> (buffer, element view [outermost..innermost], byte strides)."""
    elem = np.dtype(dtype).itemsize
    row = -(-(dims[0] * elem + pad) // 16) * 16
    strides = [row]
    for d in dims[1:-1]:
        strides.append(strides[-1] * d)
    total = (strides[-1] * dims[-1]) if len(dims) > 1 else row
    buf = np.zeros(total + 64, np.uint8)
    start = -buf.ctypes.data % 64
    raw = buf[start:start + total]
    raw[:] = rng.integers(0, 256, total, dtype=np.uint8)
    if dtype != np.uint8:                       # finite values (no NaN bit patterns)
        vals = rng.standard_normal(total // elem).astype(dtype)
        raw.view(dtype)[:] = vals
    return buf, raw, strides[:len(dims) - 1]


def element(raw, strides, elem, idx):
    off = idx[0] * elem + sum(i * s for i, s in zip(idx[1:], strides))
    return raw[off:off + elem]


def expected_tile(raw, dims, strides, elem, box, coords, swizzle_bytes, fill):
    """The tile a TMA load writes: the box row-major (dimension 0 innermost), element by element,
    at swizzled offsets; elements outside the tensor are `fill` bytes."""
    shape = box[::-1]
    tile = np.zeros(int(np.prod(box)) * elem, np.uint8)
    for lin, j in enumerate(np.ndindex(*shape)):
        c = [coords[i] + j[len(box) - 1 - i] for i in range(len(box))]
        off = lin * elem
        if swizzle_bytes:
            off = cute_swizzle(off, swizzle_bytes)
        inside = all(0 <= x < d for x, d in zip(c, dims))
        tile[off:off + elem] = element(raw, strides, elem, c) if inside else fill
    return tile


def tma_map(raw, dims, strides, dtype_code, box, swizzle=0, oob=0):
    from flashgen.emulate.tensormap import encode_tiled
    return encode_tiled(dtype_code, len(dims), raw.ctypes.data, dims, strides, box, [1] * len(dims),
                        swizzle=swizzle, oob_fill=oob)


def _tma_load(hopper, rng, rank, dims, box, dtype, code, coords, swizzle=0, oob=0, expect=None, flags=0, **kw):
    buf, raw, strides = device_tensor(rng, dims, dtype)
    elem = np.dtype(dtype).itemsize
    nbytes = int(np.prod(box)) * elem
    out = np.full(nbytes, 0xAB, np.uint8)
    m = tma_map(raw, dims, strides, code, box, swizzle, oob)
    c = [x & 0xFFFFFFFF for x in coords] + [0] * (5 - rank)        # int parameters are .u32 in the PTX
    run(hopper, f"tma_load_{rank}d", [m, out, nbytes, nbytes if expect is None else expect, *c, flags],
        block=(128, 1, 1), smem=max(nbytes, 1024), device=[buf], **kw)
    sw = {0: 0, 1: 32, 2: 64, 3: 128}[swizzle]
    return out, expected_tile(raw, dims, strides, elem, box, coords, sw, 0xFF if oob else 0)


@needs_nvcc
@pytest.mark.parametrize("rank,dims,box,coords", [
    (1, [40], [16], [30]),
    (2, [20, 13], [8, 4], [-3, 11]),
    (3, [9, 5, 4], [4, 2, 3], [6, -1, 2]),
    (4, [8, 3, 3, 2], [4, 2, 2, 2], [5, 2, -1, 1]),
    (5, [5, 2, 3, 2, 2], [4, 2, 2, 2, 2], [3, 1, 2, 1, -1]),
])
def test_tma_load_ranks_with_out_of_bounds_fill(hopper, rng, rank, dims, box, coords):
    out, want = _tma_load(hopper, rng, rank, dims, box, np.float32, F32, coords)
    assert (out == want).all()
    inside, _ = _tma_load(hopper, rng, rank, dims, box, np.float32, F32, [0] * rank)
    assert (inside != 0).mean() > 0.5           # a box inside the tensor is data, not fill


@needs_nvcc
@pytest.mark.parametrize("dtype,code,inner,swizzle", [
    (np.uint16, BF16, 64, 3), (np.uint16, BF16, 32, 2), (np.uint16, BF16, 16, 1), (np.float32, F32, 32, 3),
    (np.uint8, U8, 128, 3)])
def test_tma_load_swizzle(hopper, rng, dtype, code, inner, swizzle):
    out, want = _tma_load(hopper, rng, 2, [inner + 8, 19], [inner, 16], dtype, code, [4, 6], swizzle)
    assert (out == want).all()
    plain, _ = _tma_load(hopper, rng, 2, [inner + 8, 19], [inner, 16], dtype, code, [4, 6], 0)
    assert not (plain == want).all()


@needs_nvcc
def test_tma_load_nan_fill(hopper, rng):
    out, want = _tma_load(hopper, rng, 2, [20, 13], [8, 4], np.float32, F32, [16, 11], oob=1)
    tile = out.view(np.float32).reshape(4, 8)
    assert np.isnan(tile[:, 4:]).all() and np.isnan(tile[2:]).all() and not np.isnan(tile[:2, :4]).any()
    assert (out == want).all()


@needs_nvcc
def test_tma_load_misuse(hopper, rng):
    args = (hopper, rng, 2, [20, 13], [8, 4], np.float32, F32, [0, 0])
    with pytest.raises(EmulationError, match=r"complete_tx of 128 bytes .*more transaction bytes arrived than "
                                             r"expect_tx announced"):
        _tma_load(*args, expect=64)
    with pytest.raises(EmulationError, match=r"spins on mbarrier\.try_wait\.parity 0; .*0 of 1 arrivals and 128 "
                                             r"transaction bytes pending"):
        _tma_load(*args, expect=256, max_warp_instructions=20000)
    # a read that skips the wait: undelivered bytes, or (the TMA landed first) a race with its write
    with pytest.raises(EmulationError, match=r"shared load at offset \d+ touches bytes a TMA load has not "
                                             r"delivered yet|shared-memory race"):
        _tma_load(*args, flags=1)
    buf, raw, strides = device_tensor(rng, [20, 13, 2], np.float32)
    with pytest.raises(EmulationError, match=r"2d TMA load with a rank-3 tensor map"):
        run(hopper, "tma_load_2d", [tma_map(raw, [20, 13, 2], strides, F32, [8, 4, 1]), np.zeros(128, np.uint8),
                                    128, 128, 0, 0, 0, 0, 0, 0], block=(32, 1, 1), smem=1024, device=[buf])
    with pytest.raises(EmulationError, match=r"not a map made by cuTensorMapEncodeTiled's stand-in"):
        run(hopper, "tma_load_2d", [bytes(128), np.zeros(128, np.uint8), 128, 128, 0, 0, 0, 0, 0, 0],
            block=(32, 1, 1), smem=1024)


@needs_nvcc
def test_tma_load_over_generic_writes_ordered_by_mbarriers(hopper, rng):
    """The race detector sees no mbarrier: the TMA load's bytes drop the generic accesses before
    it, so the reader after the full barrier is not reported against the earlier writer."""
    buf, raw, strides = device_tensor(rng, [8, 4], np.float32)
    out = np.full(32, np.nan, np.float32)
    run(hopper, "tma_reuses_a_stage", [tma_map(raw, [8, 4], strides, F32, [8, 4]), out], block=(96, 1, 1),
        smem=1024, device=[buf])
    assert (out.view(np.uint8) == raw.reshape(4, -1)[:, :32].reshape(-1)).all()


@needs_nvcc                      # the stand-in is the emulation runtime's (C++, built by nvcc)
def test_tensor_map_stand_in_checks_the_driver_rules():
    from flashgen.emulate.tensormap import decode, encode_tiled
    m = decode(encode_tiled(BF16, 3, 0x1000, [64, 10, 3], [256, 2560], [64, 8, 1], [1, 1, 1], swizzle=3))
    assert (m.dims, m.strides, m.box, m.box_bytes(), m.swizzle_bytes) == ((64, 10, 3), (256, 2560), (64, 8, 1),
                                                                           1024, 128)
    for kw, why in [
        (dict(address=0x1008), "not 16-byte aligned"),
        (dict(strides=[136, 1360]), "positive multiple of 16"),
        (dict(box=[64, 300, 1]), r"each must be in \(0, 256\]"),
        (dict(box=[4, 8, 1], swizzle=0), "not a multiple of 16"),
        (dict(box=[32, 8, 1]), "box inner dimension of 64 bytes with a 128-byte swizzle"),
        (dict(rank=6), "rank 6"),
        (dict(dtype=U8, oob_fill=1, box=[128, 8, 1]), "NaN fill needs a floating-point type"),
    ]:
        args = dict(dtype=BF16, rank=3, address=0x1000, dims=[64, 10, 3], strides=[256, 2560], box=[64, 8, 1],
                    element_strides=[1, 1, 1], swizzle=3)
        args.update(kw)
        with pytest.raises(EmulationError, match=why):
            encode_tiled(**args)


def box_inside(dims, box, coords):
    """(tile index, tensor coordinates) of the elements of a 2D box inside the tensor."""
    for r in range(box[1]):
        for c in range(box[0]):
            x, y = coords[0] + c, coords[1] + r
            if x < dims[0] and y < dims[1]:
                yield r * box[0] + c, [x, y]


@needs_nvcc
def test_tma_store_writes_the_box_inside_the_tensor(hopper, rng):
    dims, box, coords = [20, 13], [8, 4], [15, 11]
    buf, raw, strides = device_tensor(rng, dims, np.float32)
    before = raw.copy()
    tile = rng.standard_normal(32).astype(np.float32)
    run(hopper, "tma_store_2d", [tma_map(raw, dims, strides, F32, box), tile.view(np.uint8), 128, *coords, 0],
        block=(64, 1, 1), smem=1024, device=[buf])
    want = before.copy()
    for i, xy in box_inside(dims, box, coords):
        element(want, strides, 4, xy)[:] = tile[i:i + 1].view(np.uint8)
    assert (raw == want).all() and not (raw == before).all()
    for flag, why in [(2, r"TMA store reads shared offset \d+, written by warp \d through the generic proxy with no "
                          r"fence\.proxy\.async"),
                      (4, r"shared write at offset 0, which an in-flight TMA store still reads")]:
        with pytest.raises(EmulationError, match=why):
            run(hopper, "tma_store_2d", [tma_map(raw, dims, strides, F32, box), tile.view(np.uint8), 128, *coords,
                                         flag], block=(64, 1, 1), smem=1024, device=[buf])


# ---------------------------------------------------------------------------------------------
# wgmma tf32 (k8) and e4m3 (k32): K-major only, same descriptors and accumulators
# ---------------------------------------------------------------------------------------------
def _k_major_case(rng, atype):
    import ml_dtypes
    c = rng.standard_normal((64, 64)).astype(np.float32)
    if atype == "tf32":                    # random low mantissa bits: the tensor core ignores them
        a, b = (rng.standard_normal((64, 8)).astype(np.float32) for _ in range(2))
        value = lambda x: (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)  # noqa: E731
        return a.view(np.uint32), b.view(np.uint32), value(a), value(b), c
    fp8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[atype]
    a, b = (rng.standard_normal((64, 32)).astype(fp8) for _ in range(2))
    return a.view(np.uint8), b.view(np.uint8), a.astype(np.float64), b.astype(np.float64), c


@needs_nvcc
@pytest.mark.parametrize("atype", ["tf32", "e4m3", "e5m2"])
@pytest.mark.parametrize("width", [16, 32, 128])
def test_wgmma_tf32_e4m3_ss_matches_float64(hopper, rng, atype, width):
    a_raw, b_raw, a, b, c = _k_major_case(rng, atype)
    img, (da, db) = smem_image([a_raw, b_raw], (False, False), width)
    out = np.full((128, 32), np.nan, np.float32)
    run(hopper, f"wgmma_ss_{atype}", [img, img.size, da, db, _as_registers(c), out, 1], block=(128, 1, 1),
        smem=img.nbytes)
    want = a @ b.T + c
    assert np.abs(_accumulators(out) - want).max() <= 1e-5 * np.abs(want).max()


@needs_nvcc
@pytest.mark.parametrize("atype,cute,per_reg", [("tf32", CUTE_A_64x8, 1), ("e4m3", CUTE_A_64x32, 4)])
def test_wgmma_tf32_e4m3_rs_matches_float64(hopper, rng, atype, cute, per_reg):
    a_raw, b_raw, a, b, c = _k_major_case(rng, atype)
    img, (db,) = smem_image([b_raw], (False,), 64)
    f = cute_layout(*cute)
    vals = np.array([[a_raw[f(t, v) % 64, f(t, v) // 64] for v in range(4 * per_reg)] for t in range(128)],
                    a_raw.dtype)
    out = np.full((128, 32), np.nan, np.float32)
    run(hopper, f"wgmma_rs_{atype}", [img, img.size, vals.view(np.uint32), db, _as_registers(c), out, 1],
        block=(128, 1, 1), smem=img.nbytes)
    want = a @ b.T + c
    assert np.abs(_accumulators(out) - want).max() <= 1e-5 * np.abs(want).max()


# ---------------------------------------------------------------------------------------------
# stmatrix: CuTe's SM90_U32x4_STSM_N / SM90_U16x8_STSM_T take as their register (source) layout
# the DstLayout of SM75_U32x4_LDSM_N / SM75_U16x8_LDSM_T (cute/atom/copy_traits_sm90.hpp lines
# 73-85, 118-130), whose numbers test_emulator.py transcribes.
# ---------------------------------------------------------------------------------------------
@needs_nvcc
@pytest.mark.parametrize("kernel,trans", [("stmatrix_x4", False), ("stmatrix_x4_trans", True)])
def test_stmatrix_equals_cute(hopper, rng, kernel, trans):
    from test_emulator import LDSM_DST_LAYOUTS
    cute = next(c for t, n, c in LDSM_DST_LAYOUTS if t == trans and n == 4)
    dst = cute_layout(*cute)
    mats = rng.integers(0, 1 << 16, (4, 8, 8), dtype=np.uint16)          # [matrix, row, col]
    regs = np.zeros((32, 4, 2), np.uint16)
    for lane in range(32):
        for j in range(4):
            for h in range(2):
                bit = dst(lane, 32 * j + 16 * h)
                regs[lane, j, h] = mats[bit // 1024, bit % 1024 // 128, bit % 128 // 16]
    perm = rng.permutation(8).astype(np.int32)
    out = np.zeros(512, np.uint8)
    run(hopper, kernel, [regs.view(np.uint32).reshape(-1), perm, out])
    stored = out.view(np.uint16).reshape(4, 8, 8)
    assert (stored[:, perm] == mats).all()


# ---------------------------------------------------------------------------------------------
# setmaxnreg
# ---------------------------------------------------------------------------------------------
@needs_nvcc
def test_setmaxnreg_budget(hopper):
    out = np.full(384, -1, np.int32)
    run(hopper, "setmaxnreg_240", [out], block=(384, 1, 1))          # 128 x 24 + 256 x 240 <= 65536
    assert (out == np.arange(384)).all()
    with pytest.raises(EmulationError, match=r"the CTA's warps hold 68608 registers, more than the SM's 65536"):
        run(hopper, "setmaxnreg_256", [out], block=(384, 1, 1))
    with pytest.raises(EmulationError, match=r"setmaxnreg in a kernel without __launch_bounds__"):
        run(hopper, "setmaxnreg_unbounded", [out], block=(384, 1, 1))


# ---------------------------------------------------------------------------------------------
# Everything together: a warp-specialized TMA -> mbarrier ring -> wgmma GEMM
# ---------------------------------------------------------------------------------------------
def _gemm_inputs(rng, k):
    import ml_dtypes
    a, b = (rng.standard_normal((64, k)).astype(ml_dtypes.bfloat16) for _ in range(2))
    maps = [tma_map(x.view(np.uint16), [k, 64], [k * 2], BF16, [64, 64], swizzle=3) for x in (a, b)]
    return a, b, maps


@needs_nvcc
def test_pipelined_gemm_matches_float64(hopper, rng):
    k = 256
    for seed in range(2):
        a, b, maps = _gemm_inputs(rng, k)
        out = np.full((128, 32), np.nan, np.float32)
        run(hopper, "pipelined_gemm", [*maps, out, k // 64, 0], block=(256, 1, 1), smem=4 * 64 * 64 * 2,
            device=[a, b], seed=seed)
        want = a.astype(np.float64) @ b.astype(np.float64).T
        assert np.abs(_accumulators(out) - want).max() <= 1e-5 * np.abs(want).max()


@needs_nvcc
@pytest.mark.parametrize("misuse,message", [
    # the consumer frees the stage before its wgmma.wait_group: whatever the schedule, the
    # producer's next TMA load into it has not observed that wgmma's completion
    (1, r"TMA load by warp 0 at shared offset \d+: (an in-flight wgmma of warpgroup 1 still reads it|it was read by "
        r"a wgmma of warpgroup 1 whose completion warp 0 has not observed)"),
    # the consumer's first wait passes at once (the phase before the first): its wgmma reads the
    # stage before the TMA landed, or, in other schedules, a later wait hangs
    (2, r"wgmma\.mma_async \([AB]\) reads shared offset \d+, which an asynchronous copy has not delivered|"
        r"spins on mbarrier\.try_wait\.parity"),
    # the phase completes with A's bytes: B's count toward the next phase, its data is not there
    (4, r"more transaction bytes arrived than expect_tx announced|wgmma\.mma_async \(B\) reads shared offset \d+, "
        r"which an asynchronous copy has not delivered"),
])
def test_pipelined_gemm_misuse_fails(hopper, rng, misuse, message):
    a, b, maps = _gemm_inputs(rng, 256)
    with pytest.raises(EmulationError, match=message):
        run(hopper, "pipelined_gemm", [*maps, np.zeros((128, 32), np.float32), 4, misuse], block=(256, 1, 1),
            smem=4 * 64 * 64 * 2, device=[a, b], max_warp_instructions=60_000)


@needs_nvcc
def test_wgmma_wait_group_keeps_the_newest_groups_in_flight(hopper, rng):
    a, b, _, img, da, db = _wgmma_case(rng, "bf16", (False, False), 128)
    out = np.full((128, 8), np.nan, np.float32)
    run(hopper, "wgmma_wait_one", [img, img.size, da, db, out, 0], block=(128, 1, 1), smem=img.nbytes)
    want = a.astype(np.float64) @ b.astype(np.float64)[:8].T
    for half in (out[:, :4], out[:, 4:]):          # both groups computed D = A B[:8]^T
        assert np.abs(_accumulators(half, 8) - want).max() <= 1e-5 * np.abs(want).max()
    with pytest.raises(EmulationError, match=r"accesses register %f\d+ of a wgmma\.mma_async that has not completed"):
        run(hopper, "wgmma_wait_one", [img, img.size, da, db, out, 1], block=(128, 1, 1), smem=img.nbytes)


@needs_nvcc
def test_wgmma_needs_its_whole_warpgroup(hopper, rng):
    a, b, c, img, da, db = _wgmma_case(rng, "bf16", (False, False), 128)
    args = [img, img.size, da, db, _as_registers(c), np.zeros((128, 32), np.float32)]
    with pytest.raises(EmulationError, match=r"deadlock: no warp can run; wgmma\.mma_async at PTX line \d+: warps "
                                             r"\[[012], [012], [012]\] of warpgroup 0 .*wait for the rest"):
        run(hopper, "wgmma_ss_bf16_kk", args + [1 | 32], block=(128, 1, 1), smem=img.nbytes)
    with pytest.raises(EmulationError, match=r"issues wgmma\.mma_async \(PTX line \d+, descriptors .*\) while its "
                                             r"warpgroup's warps \[.*\] issued PTX line \d+, descriptors .*: wgmma is "
                                             r"warpgroup-collective"):
        run(hopper, "wgmma_ss_bf16_kk", args + [1 | 64], block=(128, 1, 1), smem=img.nbytes)
    with pytest.raises(EmulationError, match=r"warp [01] is not in a full warpgroup of 4 warps"):
        run(hopper, "wgmma_ss_bf16_kk", args + [1], block=(64, 1, 1), smem=img.nbytes)


@needs_nvcc
def test_micro_kernels_assemble_and_ptxas_agrees_on_the_fences(tmp_path):
    """ptxas (sm_90a) accepts every inline-PTX form used here, and needs to inject no
    warpgroup.arrive / wait (a missing wgmma.fence / wait_group) into the kernels that have no
    misuse switch, which the emulator runs cleanly (the others inject them on the misuse paths)."""
    import subprocess
    from flashgen import toolchain
    out = subprocess.run([toolchain.nvcc(), "-arch=sm_90a", "-cubin", str(HOPPER), "-o", str(tmp_path / "h.cubin")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    injected = set(re.findall(r"warpgroup\.(?:arrive|wait) is injected .* in function '(\w+)'", out.stderr))
    assert "wgmma_rs_late_a" in injected and not injected & {"wgmma_wait_one", "pipelined_gemm"}


@needs_nvcc
def test_tma_reduce_add(hopper, rng):
    dims, box, coords = [20, 13], [8, 4], [15, 11]
    buf, raw, strides = device_tensor(rng, dims, np.float32)
    raw.view(np.float32)[:] = rng.integers(-8, 8, raw.size // 4)   # small integers: sums exact in any order
    before = raw.copy()
    tile = rng.integers(-8, 8, 32).astype(np.float32)
    run(hopper, "tma_reduce_add", [tma_map(raw, dims, strides, F32, box), tile, np.zeros(4, np.float32), 1, *coords],
        grid=(3, 1, 1), smem=1024, device=[buf])
    want = before.copy()
    for i, xy in box_inside(dims, box, coords):
        element(want, strides, 4, xy).view(np.float32)[:] += 3 * tile[i]
    assert (raw == want).all() and not (raw == before).all()
    dst = rng.integers(-8, 8, 32).astype(np.float32)
    start = dst.copy()
    run(hopper, "tma_reduce_add", [tma_map(raw, dims, strides, F32, box), tile, dst, 0, 0, 0], grid=(2, 1, 1),
        smem=1024, device=[buf])
    assert (dst == start + 2 * tile).all()


@needs_nvcc
def test_untiled_bulk_copies(hopper, rng):
    src = rng.standard_normal(64).astype(np.float32)
    out = np.full(64, np.nan, np.float32)
    run(hopper, "bulk_copy_roundtrip", [src, out, 192, 192], block=(64, 1, 1), smem=256)
    assert (out[:48] == src[:48]).all() and np.isnan(out[48:]).all()
    with pytest.raises(EmulationError, match=r"complete_tx of 192 bytes .*more transaction bytes arrived"):
        run(hopper, "bulk_copy_roundtrip", [src, out, 192, 128], block=(64, 1, 1), smem=256)
    with pytest.raises(EmulationError, match=r"cp\.async\.bulk load of 100 bytes .*must be multiples of 16"):
        run(hopper, "bulk_copy_roundtrip", [src, out, 100, 100], block=(64, 1, 1), smem=256)
