"""The emulator engine's own bookkeeping, which changes no result but must not lose one: the
compaction of a wave's register file as its CTAs finish, the order its CTAs stand in, and the
cyclic garbage collector it pauses during a launch (flashgen/emulate/heap.py)."""
from __future__ import annotations

import gc
import struct

import numpy as np
import pytest

from conftest import needs_nvcc
from flashgen.emulate import GlobalMemory, PtxModule, launch, machine
from flashgen.emulate.nvcc import compile_ptx

# Each CTA loops its own number of times, with a barrier in the loop, and keeps values loaded
# before the loop in registers across it: CTAs finish far apart, so the wave compacts its register
# file while the others still hold live values.
UNEVEN = r"""
extern "C" __global__ void uneven(const int* trips, const float* x, float* out) {
  __shared__ float s[64];
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const float a = x[i], b = x[i] * 0.5f + 1.f;
  float acc = 0.f;
  for (int j = 0; j < trips[blockIdx.x]; ++j) {
    s[threadIdx.x] = a + static_cast<float>(j);
    __syncthreads();
    acc += s[63 - threadIdx.x] * b;
    __syncthreads();
  }
  out[i] = acc + a;
}
"""
BLOCKS, THREADS = 48, 64
pytestmark = needs_nvcc


@pytest.fixture(scope="module")
def uneven():
    return PtxModule.parse(compile_ptx(UNEVEN, "sm80"))


def _launch(module, trips, x, out, seed):
    mem = GlobalMemory()
    for i, a in enumerate((trips, x, out)):
        mem.add(a.ctypes.data, a.nbytes, f"arg{i}")
    params = [struct.pack("<Q", a.ctypes.data) for a in (trips, x, out)]
    return launch(module, "uneven", (BLOCKS, 1, 1), (THREADS, 1, 1), 0, params, mem, arch="sm80", seed=seed)


def _want(trips, x):
    a = x.reshape(BLOCKS, THREADS).astype(np.float32)
    b = a * np.float32(0.5) + np.float32(1)
    acc = np.zeros_like(a)
    for blk in range(BLOCKS):
        for j in range(trips[blk]):
            acc[blk] += (a[blk, ::-1] + np.float32(j)) * b[blk]
    return (acc + a).reshape(-1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ctas_finishing_far_apart_keep_their_registers_through_compaction(uneven, rng, seed, monkeypatch):
    shrunk = []
    compact = machine._Wave.compact

    def spy(wave, live):
        before = wave.registers.nlanes
        compact(wave, live)
        if wave.registers.nlanes < before:
            shrunk.append((before, wave.registers.nlanes))
    monkeypatch.setattr(machine._Wave, "compact", spy)
    trips = rng.permutation(np.arange(BLOCKS) % 24).astype(np.int32)
    x = rng.standard_normal(BLOCKS * THREADS).astype(np.float32)
    out = np.full(BLOCKS * THREADS, np.nan, np.float32)
    _launch(uneven, trips, x, out, seed)
    assert shrunk, "the wave never compacted: the test no longer exercises what it is for"
    np.testing.assert_allclose(out, _want(trips, x), rtol=1e-5, atol=1e-5)


def test_a_launch_leaves_no_cycles_and_the_collector_as_it_was(uneven, rng):
    trips = np.arange(BLOCKS, dtype=np.int32) % 3
    x = rng.standard_normal(BLOCKS * THREADS).astype(np.float32)
    out = np.full(BLOCKS * THREADS, np.nan, np.float32)
    gc.collect()
    gc.disable()
    try:
        _launch(uneven, trips, x, out, 0)
        assert not gc.isenabled()
        # with the collector off, a warp or wave left in a cycle would still be here (and with it
        # the wave's register file and shared memory, until some later collection)
        left = [o for o in gc.get_objects() if isinstance(o, (machine.Warp, machine._Wave, machine._Cta))]
        assert not left, f"{len(left)} warps/waves/CTAs of a finished launch are held in reference cycles"
    finally:
        gc.enable()
    _launch(uneven, trips, x, out, 0)
    assert gc.isenabled()


def test_registers_moved_through_several_compactions_unused_keep_their_warps_values():
    """A compaction moves a register when it is first used again (_Registers.moved): one unused
    through two compactions must come from its first file's rows of the warps still live."""
    wave = machine._Wave([(c, 0, 0) for c in range(4)], (4, 1, 1), GlobalMemory(), np.zeros(1, np.uint8),
                         {"%r1": np.dtype(np.uint32)}, 64, (64, 1, 1), 16, False, 4)
    wave.registers["%r1"][:] = np.arange(wave.registers.nlanes)      # lane l holds l
    for gone in ([1, 2, 3], [0, 3]):             # gids in the file of the time
        live = [w for w in wave.warps if w.gid not in gone]
        for w in wave.warps:
            w.done = w.gid in gone
        wave.compact(live)
    # warps 0, 4, 5, 6, 7 of the first file survived the first compaction; then 0 and 3 of those
    # (first-file warps 0 and 6) went: left are first-file warps 4, 5 and 7
    want = np.concatenate([np.arange(32 * w, 32 * w + 32) for w in (4, 5, 7)])
    assert wave.registers.nlanes == want.size
    np.testing.assert_array_equal(wave.registers["%r1"], want)


def test_splits_a_warp_agrees_with_per_warp_any_and_all(rng):
    """registry.splits_a_warp tests packed lane bits: the same verdict as per-warp any/all."""
    from flashgen.emulate.semantics.registry import splits_a_warp
    for _ in range(200):
        warps = int(rng.integers(1, 6))
        within = rng.random(32 * warps) < rng.choice([0.0, 0.5, 1.0])
        lanes = within & (rng.random(32 * warps) < rng.choice([0.0, 0.5, 1.0]))
        per, w = lanes.reshape(-1, 32), within.reshape(-1, 32)
        assert splits_a_warp(lanes) == bool((per.any(1) & ~per.all(1)).any())
        assert splits_a_warp(lanes, within) == bool((per.any(1) & (per != w).any(1)).any())


def test_ctas_of_a_wave_stand_in_index_order_and_the_seed_still_picks_the_waves(uneven, rng, monkeypatch):
    """Which CTAs share a wave stays the seeded schedule's; within a wave they stand in linear
    index order (adjacent CTAs do alike work and keep stepping together), and the result holds."""
    monkeypatch.setattr(machine, "WAVE_LANES", 16 * THREADS)          # 3 waves of 16 CTAs
    waves = []
    init = machine._Wave.__init__

    def spy(wave, blocks, *args):
        waves.append([x for x, _, _ in blocks])
        init(wave, blocks, *args)
    monkeypatch.setattr(machine._Wave, "__init__", spy)
    trips = (np.arange(BLOCKS, dtype=np.int32) % 5)
    x = rng.standard_normal(BLOCKS * THREADS).astype(np.float32)
    members = []
    for seed in (0, 1):
        waves.clear()
        out = np.full(BLOCKS * THREADS, np.nan, np.float32)
        _launch(uneven, trips, x, out, seed)
        np.testing.assert_allclose(out, _want(trips, x), rtol=1e-5, atol=1e-5)
        assert [len(w) for w in waves] == [16, 16, 16]
        assert all(w == sorted(w) for w in waves), waves
        members.append([frozenset(w) for w in waves])
    assert members[0] != members[1], "the schedule seed no longer decides which CTAs share a wave"
