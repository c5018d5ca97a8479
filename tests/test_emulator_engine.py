"""The emulator engine's own bookkeeping, which changes no result but must not lose one: the
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
# before the loop in registers across it.
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
