"""Mutation suite of the Hopper forward and backward (csrc/flashgen/cuda/hopper/): one-line bugs planted in a
copy of csrc/ must make the emulated kernel fail, by an EmulationError (a misuse of wgmma,
mbarrier or the async proxy) or by wrong numbers against float64. The unmutated headers,
compiled the same way, must pass: so a caught mutant is caught by its bug."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from conftest import needs_nvcc
from flashgen import reference, resources
from flashgen.emulate import EmulationError, PtxModule
from flashgen.emulate.nvcc import compile_ptx

pytestmark = [needs_nvcc, pytest.mark.slow]

KERNEL = """
#include "flashgen/cuda/hopper/fwd.cuh"
void* flashgen_emulated_kernels[] = {
    (void*)&flashgen::cuda::hopper_fwd_kernel<__nv_bfloat16, 64, true>,
};
"""
SMEM = 5 * 64 * 64 * 2 + 1024   # HopperFwdConfig::smem_bytes(64): Q, 2 stages of K and V, alignment
# The correct launch takes 0.4-0.5M warp instructions (most of them the producer spinning on its
# empty barrier while the consumer computes): a deadlocked mutant (a wait on a phase that never
# completes) spins into this budget in under a minute instead of the default's hours.
WARP_INSTRUCTION_BUDGET = 3_000_000

# (name, header under cuda/hopper/, old, new): the first occurrence of `old` becomes `new`.
MUTATIONS = [
    ("missing_wgmma_wait_after_qk", "fwd.cuh",
     "    sm90::wgmma_commit();\n    sm90::wgmma_wait_all();\n    sm90::fence_operands(acc_s);",
     "    sm90::wgmma_commit();\n    sm90::fence_operands(acc_s);"),
    ("full_barrier_wrong_parity", "fwd.cuh",
     "sm90::mbar_wait(smem_addr(&full[s]), (it / kStages) & 1);",
     "sm90::mbar_wait(smem_addr(&full[s]), ((it / kStages) & 1) ^ 1);"),
    ("producer_stage_off_by_one", "fwd.cuh",
     "const int it = n - n_first, s = it % kStages;\n      sm90::mbar_wait(smem_addr(&empty[s])",
     "const int it = n - n_first, s = (it + 1) % kStages;\n      sm90::mbar_wait(smem_addr(&empty[s])"),
    ("stage_released_before_pv_wait", "fwd.cuh",
     "    sm90::wgmma_commit();\n    sm90::wgmma_wait_all();\n#pragma unroll\n    for (int pn = 0; pn < kPanels; ++pn) "
     "sm90::fence_operands(acc_o[pn]);\n    // The wgmmas that read stage s retired: hand it back to the producer.\n"
     "    if (tid == 0) sm90::mbar_arrive(smem_addr(&empty[s]));",
     "    sm90::wgmma_commit();\n    if (tid == 0) sm90::mbar_arrive(smem_addr(&empty[s]));\n    sm90::wgmma_wait_all();\n"
     "#pragma unroll\n    for (int pn = 0; pn < kPanels; ++pn) sm90::fence_operands(acc_o[pn]);"),
    ("missing_producer_proxy_fence", "fwd.cuh",
     "      sm90::fence_proxy_async();\n      sm90::mbar_arrive(smem_addr(&full[s]));",
     "      sm90::mbar_arrive(smem_addr(&full[s]));"),
    ("tile_stored_unswizzled", "sm90.cuh",
     "r * 128 + (((c % 8) ^ (r % 8)) << 4)", "r * 128 + ((c % 8) << 4)"),
]


def _module(csrc) -> PtxModule:
    return PtxModule.parse(compile_ptx(KERNEL, "sm90a", include_first=str(csrc) if csrc else None,
                                       name="hopper_fwd.cu"))


def _errors(module, rng):
    """Max errors of o and lse against float64 (NaN counts as infinitely wrong)."""
    from emulated_dense import NP_DTYPES, run_forward_kernel
    bf16 = NP_DTYPES["bf16"]
    # causal, 150 rows and keys: the last CTA walks 3 key blocks, so the 2-stage ring wraps
    q, k, v = (rng.standard_normal((1, 150, 1, 64)).astype(bf16) for _ in range(3))
    (name,) = module.kernels
    o, lse, _ = run_forward_kernel(module, name, 64, 256, SMEM, q, k, v, causal=True, dtype="bf16", arch="sm90a",
                                   max_warp_instructions=WARP_INSTRUCTION_BUDGET)
    ro, rlse = reference.attention(q, k, v, causal=True)[:2]
    return [float(np.nan_to_num(np.abs(g - w) / (1 + np.abs(w)), nan=np.inf).max()) for g, w in ((o, ro), (lse, rlse))]


TOLERANCE = 2e-2   # the correct kernel stays below ~5e-3


def test_unmutated_kernel_passes(rng):
    assert max(_errors(_module(None), rng)) < TOLERANCE


@pytest.mark.parametrize("name,header,old,new", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_mutation_is_caught(tmp_path, rng, name, header, old, new):
    _assert_caught(tmp_path, name, header, old, new, lambda csrc: _errors(_module(csrc), rng))


def _assert_caught(tmp_path, name, header, old, new, errors_of):
    """Plants the mutation in a copy of csrc/; errors_of(that copy) -> the max errors of the outputs
    must raise an EmulationError or exceed TOLERANCE."""
    csrc = tmp_path / "csrc"
    shutil.copytree(resources.csrc_dir(), csrc)
    path = csrc / "flashgen" / "cuda" / "hopper" / header
    text = path.read_text()
    assert old in text, f"mutation {name}: the line to mutate is gone from {header}; update its list"
    path.write_text(text.replace(old, new, 1))
    try:
        errors = errors_of(csrc)
    except EmulationError as e:
        print(f"{name}: caught by the emulator: {e}")
        return
    print(f"{name}: max errors {errors}")
    assert max(errors) > TOLERANCE, f"mutation {name} survived: errors {errors}"


# ---- the Hopper backward's main kernel (hopper/bwd.cuh), between bwd.cuh's pre / convert kernels
BWD_KERNEL = """
#include "flashgen/cuda/hopper/bwd.cuh"
void* flashgen_emulated_kernels[] = {
    (void*)&flashgen::cuda::flash_bwd_pre_kernel<__nv_bfloat16, 64>,
    (void*)&flashgen::cuda::hopper_bwd_kernel<__nv_bfloat16, 64, false>,
    (void*)&flashgen::cuda::flash_bwd_convert_kernel<__nv_bfloat16>,
};
"""
BWD_SMEM = 8 * 64 * 64 * 2 + 1024   # HopperBwdConfig::smem_bytes(64): K, V, 2 stages of Q and dO, K^T, dS, alignment

BWD_MUTATIONS = [
    ("missing_wgmma_wait_before_ds", "bwd.cuh",
     "    sm90::wgmma_commit();\n    sm90::wgmma_wait_all();\n    sm90::fence_operands(acc_s);",
     "    sm90::wgmma_commit();\n    sm90::fence_operands(acc_s);"),
    ("lse_not_in_log2_units", "bwd.cuh",
     "l == -INFINITY ? INFINITY : l * kLog2e;", "l == -INFINITY ? INFINITY : l;"),
    ("missing_proxy_fence_after_ds_store", "bwd.cuh",
     "static_cast<uint16_t>(j % 2 ? pair >> 16 : pair & 0xFFFF);\n    }\n    sm90::fence_proxy_async();",
     "static_cast<uint16_t>(j % 2 ? pair >> 16 : pair & 0xFFFF);\n    }"),
    ("ds_stored_unswizzled", "bwd.cuh",
     "sdS + c * 128 + (((r / 8) ^ (c % 8)) << 4)", "sdS + c * 128 + ((r / 8) << 4)"),
    # the Q / dO ring (producer warpgroup, full / empty mbarriers)
    ("bwd_consumer_stage_off_by_one", "bwd.cuh",
     "s = it % kStages, q0 = m * BR;\n    sm90::mbar_wait(smem_addr(&full[s])",
     "s = (it + 1) % kStages, q0 = m * BR;\n    sm90::mbar_wait(smem_addr(&full[s])"),
    ("bwd_producer_stage_off_by_one", "bwd.cuh",
     "s = it % kStages, q0 = m * BR;\n      sm90::mbar_wait(smem_addr(&empty[s])",
     "s = (it + 1) % kStages, q0 = m * BR;\n      sm90::mbar_wait(smem_addr(&empty[s])"),
    ("bwd_full_barrier_wrong_parity", "bwd.cuh",
     "sm90::mbar_wait(smem_addr(&full[s]), (it / kStages) & 1);",
     "sm90::mbar_wait(smem_addr(&full[s]), ((it / kStages) & 1) ^ 1);"),
    ("bwd_empty_barrier_wrong_parity", "bwd.cuh",
     "sm90::mbar_wait(smem_addr(&empty[s]), ((it / kStages) & 1) ^ 1);",
     "sm90::mbar_wait(smem_addr(&empty[s]), (it / kStages) & 1);"),
    ("bwd_missing_producer_proxy_fence", "bwd.cuh",
     "      sm90::fence_proxy_async();\n      sm90::mbar_arrive(smem_addr(&full[s]));",
     "      sm90::mbar_arrive(smem_addr(&full[s]));"),
]
# The correct main kernel takes about 0.25M warp instructions here (the producer spinning on its
# empty barrier included); a deadlocked mutant spins into this budget.
BWD_WARP_INSTRUCTION_BUDGET = 3_000_000


def _bwd_errors(csrc, rng):
    """Max errors of dq, dk, dv against float64 (NaN counts as infinitely wrong)."""
    from emulated_dense import NP_DTYPES, run_dense_backward
    module = PtxModule.parse(compile_ptx(BWD_KERNEL, "sm90a", include_first=str(csrc) if csrc else None,
                                         name="hopper_bwd.cu"))
    bf16 = NP_DTYPES["bf16"]
    # causal, 150 rows and keys: key block 0 walks 3 query blocks (masked diagonal, full, tail)
    q, k, v, do = (rng.standard_normal((1, 150, 1, 64)).astype(bf16) for _ in range(4))
    (main,) = (n for n in module.kernels if "hopper_bwd_kernel" in n)
    grads, _ = run_dense_backward(module, q, k, v, do, causal=True, dtype="bf16", arch="sm90a",
                                  main=(main, 256, 64, 1, BWD_SMEM), max_warp_instructions=BWD_WARP_INSTRUCTION_BUDGET)
    refs = reference.attention(q, k, v, causal=True, do=do)[2]
    return [float(np.nan_to_num(np.abs(g - w) / (1 + np.abs(w)), nan=np.inf).max()) for g, w in zip(grads, refs)]


def test_unmutated_backward_passes(rng):
    assert max(_bwd_errors(None, rng)) < TOLERANCE


@pytest.mark.parametrize("name,header,old,new", BWD_MUTATIONS, ids=[m[0] for m in BWD_MUTATIONS])
def test_backward_mutation_is_caught(tmp_path, rng, name, header, old, new):
    _assert_caught(tmp_path, name, header, old, new, lambda csrc: _bwd_errors(csrc, rng))
