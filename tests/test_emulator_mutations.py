"""Mutation suite: single-line bugs planted in the real kernel headers (a copy of csrc/) must
make the emulated kernel fail -- wrong numbers against float64, or an EmulationError. The
unmutated headers, compiled the same way, must pass: so a caught mutant is caught by the bug."""
from __future__ import annotations

import pathlib
import shutil

import numpy as np
import pytest

from conftest import needs_nvcc
from flashgen import reference, resources
from flashgen.emulate import EmulationError, PtxModule
from flashgen.emulate.nvcc import compile_ptx

pytestmark = needs_nvcc

# Only the dense kernels of one spec (bf16, d64, causal): a few seconds of nvcc per mutant.
DENSE_KERNELS = """
#include "flashgen/cuda/fwd.cuh"
#include "flashgen/cuda/bwd.cuh"
namespace fc = flashgen::cuda;
void* flashgen_emulated_kernels[] = {
    (void*)&fc::flash_fwd_kernel<__nv_bfloat16, 64, 64, true, fc::kFwdDense>,
    (void*)&fc::flash_bwd_pre_kernel<__nv_bfloat16, 64>,
    (void*)&fc::flash_bwd_kernel<__nv_bfloat16, 64, 64, true, fc::kBwdDense>,
    (void*)&fc::flash_bwd_convert_kernel<__nv_bfloat16>,
};
"""

# (name, header, old, new, direction): `old` must occur in the header; its first occurrence
# becomes `new` (one source line changed or deleted).
MUTATIONS = [
    ("swapped_p_fragment_registers", "common.cuh",
     "a.r[1] = pack(acc[2 * ks][2], acc[2 * ks][3]);", "a.r[1] = pack(acc[2 * ks + 1][0], acc[2 * ks + 1][1]);",
     "fwd"),
    ("missing_prologue_cp_async_wait", "fwd.cuh",
     "    cp_async_commit();\n    cp_async_wait<0>();\n", "    cp_async_commit();\n", "fwd"),
    ("missing_loop_end_syncthreads", "fwd.cuh",
     "      cp_async_wait<0>();\n      __syncthreads();\n    }\n  }\n", "      cp_async_wait<0>();\n    }\n  }\n", "fwd"),
    ("missing_v_cp_async_commit", "fwd.cuh",
     "        load_tile_async<T, BC, DV, NT>(sV, LDV, vg, v_stride, k0, Sk);\n      cp_async_commit();\n",
     "        load_tile_async<T, BC, DV, NT>(sV, LDV, vg, v_stride, k0, Sk);\n", "fwd"),
    ("wrong_a_load_matrix_order", "common.cuh",
     "const T* p = s + (m0 + (lane & 15)) * ld + k0 + (lane >> 4) * 8;",
     "const T* p = s + (m0 + (lane & 7) + (lane >> 4) * 8) * ld + k0 + ((lane >> 3) & 1) * 8;", "fwd"),
    ("quad_sum_wrong_lane", "common.cuh",
     "x += __shfl_xor_sync(0xffffffffu, x, 1);", "x += __shfl_xor_sync(0xffffffffu, x, 4);", "fwd"),
    ("causal_mask_off_by_one", "fwd.cuh",
     "bool masked = col >= Sk || dist < band_lo || dist > band_hi;",
     "bool masked = col >= Sk || dist < band_lo || dist >= band_hi;", "fwd"),
    ("missing_epilogue_syncwarp", "fwd.cuh",
     "  }\n  __syncwarp();\n  constexpr int kEpc", "  }\n  constexpr int kEpc", "fwd"),
    ("dsum_reduction_one_step_short", "bwd.cuh",
     "for (int off = kLanes / 2; off > 0; off >>= 1)", "for (int off = kLanes / 2; off > 1; off >>= 1)", "bwd"),
]


def _module(csrc: pathlib.Path | None) -> PtxModule:
    return PtxModule.parse(compile_ptx(DENSE_KERNELS, "sm80", include_first=str(csrc) if csrc else None,
                                       name="dense_kernels.cu"))


def _errors(module, direction, rng):
    """Max errors of the emulated kernels against float64 (NaN counts as infinitely wrong)."""
    from emulated_dense import NP_DTYPES, run_dense_backward, run_dense_forward
    bf16 = NP_DTYPES["bf16"]
    b, s, h, d = 1, 130, 2, 64            # 3 key tiles: the prefetch / double-buffer path runs
    q, k, v, do = (rng.standard_normal((b, s, h, d)).astype(bf16) for _ in range(4))
    if direction == "fwd":
        o, lse, _ = run_dense_forward(module, q, k, v, causal=True, dtype="bf16")
        ro, rlse = reference.attention(q, k, v, causal=True)[:2]
        got, want = (o, lse), (ro, rlse)
    else:
        grads, _ = run_dense_backward(module, q, k, v, do, causal=True, dtype="bf16")
        got, want = grads, reference.attention(q, k, v, causal=True, do=do)[2]
    # |error| relative to 1 + |reference|: bf16 rounding alone gives up to 2^-9 of that
    return [float(np.nan_to_num(np.abs(g - w) / (1 + np.abs(w)), nan=np.inf).max()) for g, w in zip(got, want)]


TOLERANCE = 2e-2   # the correct kernels stay below ~5e-3; the mutants reach 0.3 and more


@pytest.fixture(scope="module")
def unmutated():
    return _module(None)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_unmutated_kernels_pass(unmutated, rng, direction):
    assert max(_errors(unmutated, direction, rng)) < TOLERANCE


@pytest.mark.parametrize("name,header,old,new,direction", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_mutation_is_caught(tmp_path, rng, name, header, old, new, direction):
    csrc = tmp_path / "csrc"
    shutil.copytree(resources.csrc_dir(), csrc)
    path = csrc / "flashgen" / "cuda" / header
    text = path.read_text()
    assert old in text, f"mutation {name}: the line to mutate is gone from {header}; update MUTATIONS"
    path.write_text(text.replace(old, new, 1))
    try:
        errors = _errors(_module(csrc), direction, rng)
    except EmulationError as e:
        print(f"{name}: caught by the emulator: {e}")
        return
    print(f"{name}: max errors {errors}")
    assert max(errors) > TOLERANCE, f"mutation {name} survived: errors {errors}"
