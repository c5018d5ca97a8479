"""Mutation suite of the Hopper kernels (csrc/flashgen/cuda/hopper/): one-line bugs planted in a
copy of csrc/ must make the emulated kernel fail, by an EmulationError (a misuse of wgmma,
mbarrier or the async proxy) or by wrong numbers against float64. The unmutated headers,
compiled the same way, must pass: so a caught mutant is caught by its bug."""
from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

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
ROWS, THREADS = 128, 384                 # HopperFwdConfig::BR, kThreads
SMEM = 6 * 64 * 64 * 2 + 1024            # HopperFwdConfig::smem_bytes(64): Q x 2, 2 stages of K and V, alignment
BF16, SWIZZLE_128B = 9, 3                # CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, CU_TENSOR_MAP_SWIZZLE_128B
# The correct launch takes well under 1M warp instructions (many of them warps spinning on
# mbarriers): a deadlocked mutant (a wait on a phase that never completes) spins into this budget
# in about a minute instead of the default's hours.
WARP_INSTRUCTION_BUDGET = 3_000_000

# (name, header under cuda/hopper/, old, new): the first occurrence of `old` becomes `new`.
MUTATIONS = [
    ("missing_wgmma_wait_before_softmax", "fwd.cuh",
     "      if (has_pv) sm90::wgmma_wait<1>();  // QK^T(it) done, PV(it - 1) may still run\n"
     "      else sm90::wgmma_wait<0>();\n",
     "      if (!has_pv) sm90::wgmma_wait<0>();\n"),
    ("full_barrier_wrong_parity", "fwd.cuh",
     "sm90::mbar_wait(smem_addr(&full[s]), (it / kStages) & 1);",
     "sm90::mbar_wait(smem_addr(&full[s]), ((it / kStages) & 1) ^ 1);"),
    ("producer_stage_off_by_one", "fwd.cuh",
     "const int s = it % kStages, row = seq.k_start + (n_first + it) * BC;",
     "const int s = (it + 1) % kStages, row = seq.k_start + (n_first + it) * BC;"),
    ("consumer_stage_off_by_one", "fwd.cuh",
     "const int s = it % kStages, prev = (it + kStages - 1) % kStages;",
     "const int s = it % kStages, prev = it % kStages;"),
    ("stage_released_before_pv_wait", "fwd.cuh",
     "      sm90::wgmma_wait<0>();\n#pragma unroll\n      for (int pn = 0; pn < kPanels; ++pn) "
     "sm90::fence_operands(acc_o[pn]);\n      // The wgmmas that read stage prev retired: hand it back to the producer.\n"
     "      if (tid == 0) sm90::mbar_arrive(smem_addr(&empty[prev]));",
     "      if (tid == 0) sm90::mbar_arrive(smem_addr(&empty[prev]));\n      sm90::wgmma_wait<0>();\n"
     "#pragma unroll\n      for (int pn = 0; pn < kPanels; ++pn) sm90::fence_operands(acc_o[pn]);"),
    ("expect_tx_bytes_short", "fwd.cuh",
     "sm90::mbar_arrive_expect_tx(fb, 2 * kTile);", "sm90::mbar_arrive_expect_tx(fb, kTile);"),
    ("expect_tx_bytes_long", "fwd.cuh",
     "sm90::mbar_arrive_expect_tx(qb, kConsumers * kTile);", "sm90::mbar_arrive_expect_tx(qb, kConsumers * kTile + 16);"),
    ("pingpong_barrier_ids_swapped", "fwd.cuh",
     "my_turn = Cfg::kPingPongBar + w, their_turn = Cfg::kPingPongBar + 1 - w;",
     "my_turn = Cfg::kPingPongBar + 1 - w, their_turn = Cfg::kPingPongBar + w;"),
    ("setmaxnreg_consumer_inc_below_entry", "fwd.cuh",
     "kProducerRegs = 24, kConsumerRegs = 240;", "kProducerRegs = 24, kConsumerRegs = 160;"),
    ("missing_proxy_fence_before_o_store", "fwd.cuh",
     "  sm90::fence_proxy_async();  // the tile's generic writes, before the TMA store reads them\n", ""),
    ("descriptor_swizzle_64b", "sm90.cuh",
     "return (uint64_t{1} << 62) | (uint64_t{kSwizzleAtom >> 4} << 32)",
     "return (uint64_t{2} << 62) | (uint64_t{kSwizzleAtom >> 4} << 32)"),
]
# The launcher's side (ffi_cuda.cuh's encode_rows_map) is not in the compiled kernel: its swizzle
# mode is mutated in the maps this harness encodes the same way.
MAP_SWIZZLE_MUTATIONS = {"tensor_map_swizzle_none": 0, "tensor_map_swizzle_64b": 2}


def _maps(swizzle):
    """more_params for run_forward_kernel: encode_rows_map's maps of q, k, v, o (box 64 x 64)."""
    from flashgen.emulate.tensormap import encode_tiled

    def encode(*arrays):
        maps = []
        for a in arrays:
            b, s, h, d = a.shape
            maps.append(encode_tiled(BF16, 4, a.ctypes.data, [d, h, s, b], [2 * d, 2 * h * d, 2 * s * h * d],
                                     [64, 1, 64, 1], [1, 1, 1, 1], swizzle=swizzle, l2_promotion=2))
        return maps
    return encode


def _module(csrc) -> PtxModule:
    return PtxModule.parse(compile_ptx(KERNEL, "sm90a", include_first=str(csrc) if csrc else None,
                                       name="hopper_fwd.cu"))


def _errors(module, rng, swizzle=SWIZZLE_128B):
    """Max errors of o and lse against float64 (NaN counts as infinitely wrong)."""
    from emulated_dense import NP_DTYPES, run_forward_kernel
    bf16 = NP_DTYPES["bf16"]
    # causal, 150 rows and keys: the last CTA walks 3 key blocks, so the 2-stage ring wraps
    q, k, v = (rng.standard_normal((1, 150, 1, 64)).astype(bf16) for _ in range(3))
    (name,) = module.kernels
    o, lse, _ = run_forward_kernel(module, name, ROWS, THREADS, SMEM, q, k, v, causal=True, dtype="bf16",
                                   arch="sm90a", max_warp_instructions=WARP_INSTRUCTION_BUDGET,
                                   more_params=_maps(swizzle))
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


@pytest.mark.parametrize("name", MAP_SWIZZLE_MUTATIONS)
def test_tensor_map_swizzle_mutation_is_caught(rng, name):
    try:
        errors = _errors(_module(None), rng, MAP_SWIZZLE_MUTATIONS[name])
    except EmulationError as e:
        print(f"{name}: caught by the emulator: {e}")
        return
    print(f"{name}: max errors {errors}")
    assert max(errors) > TOLERANCE, f"mutation {name} survived: errors {errors}"


# ---- static budget (ptxas): the emulator does not see ptxas's register allocation, so a consumer
# budget above the entry count (168) but below what the code needs shows as spills here.
STATIC_KERNELS = """
#include "flashgen/cuda/hopper/fwd.cuh"
void* flashgen_emulated_kernels[] = {
    (void*)&flashgen::cuda::hopper_fwd_kernel<__nv_bfloat16, 64, true>,
    (void*)&flashgen::cuda::hopper_fwd_kernel<__half, 128, false>,
    (void*)&flashgen::cuda::hopper_fwd_kernel<__nv_bfloat16, 256, true>,
};
"""


def _ptxas_report(csrc, tmp_path) -> str:
    from flashgen import toolchain
    ptx = tmp_path / "hopper_fwd.ptx"
    ptx.write_text(compile_ptx(STATIC_KERNELS, "sm90a", include_first=str(csrc) if csrc else None,
                               name="hopper_fwd_static.cu"))
    ptxas = pathlib.Path(toolchain.nvcc()).parent / "ptxas"
    out = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o", str(tmp_path / "h.cubin")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stderr


def test_static_budget_no_spills_no_injected_waits(tmp_path):
    report = _ptxas_report(None, tmp_path)
    print(report)
    assert report.count("Compiling entry function") == 3
    assert re.findall(r"(\d+) bytes spill stores", report) == ["0"] * 3
    assert "is injected" not in report      # ptxas added no warpgroup.arrive / wait: the fences are ours


def test_setmaxnreg_budget_too_small_spills(tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(resources.csrc_dir(), csrc)
    path = csrc / "flashgen" / "cuda" / "hopper" / "fwd.cuh"
    old = "kProducerRegs = 24, kConsumerRegs = 240;"
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, "kProducerRegs = 24, kConsumerRegs = 184;", 1))
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", _ptxas_report(csrc, tmp_path))]
    print(f"spill stores per kernel with 184 registers per consumer thread: {spills}")
    assert max(spills) > 0


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


# ---- the varlen forward (hopper/fwd.cuh, VARLEN): built through the FFI handler as it ships, from
# a mutated copy of csrc/ (a cache entry of its own: csrc's digest is in the key), run on packed
# sequences whose boxes run into the next sequence and into the padding rows.
VARLEN_MUTATIONS = [
    ("varlen_key_offset_off_by_one", "fwd.cuh",
     "bd.masked, rq.start, rk.start, 0,", "bd.masked, rq.start, rk.start + 1, 0,"),
    ("varlen_o_store_not_clipped_at_sequence_end", "fwd.cuh",
     "const bool clip_rows = VARLEN && qw + BM > Sq;", "const bool clip_rows = false;"),
]


def _varlen_errors(csrc, rng, monkeypatch):
    """Max errors of the varlen forward's o and lse (sm90a d64 bf16 causal) against float64."""
    from flashgen.build import build
    from flashgen.emulate.check import Checker
    from flashgen.emulate.host import EmulatedLibrary
    from flashgen.spec import KernelSpec
    spec = KernelSpec(64, "bf16", True, "sm90a")
    # The emulation runtime of the unmutated csrc/ (its key has csrc's path): loaded first, with the
    # Python callbacks, its symbols are the ones a mutant's library binds to.
    EmulatedLibrary(build(spec, host="emulate"))
    if csrc is not None:
        monkeypatch.setattr(resources, "csrc_dir", lambda: csrc)
    result = Checker(EmulatedLibrary(build(spec, host="emulate")), spec, rng).varlen(
        seqlens_q=(70, 0, 23), seqlens_k=(90, 0, 17), pad_q=5, pad_k=3, bottom_right=True, backward=False)
    assert any("17hopper_fwd_kernelI" in k for k in result.kernels), result.kernels
    return [r.error if np.isfinite(r.error) else np.inf for r in result.rows]


@pytest.mark.parametrize("name,header,old,new", VARLEN_MUTATIONS, ids=[m[0] for m in VARLEN_MUTATIONS])
def test_varlen_mutation_is_caught(tmp_path, rng, monkeypatch, name, header, old, new):
    _assert_caught(tmp_path, name, header, old, new, lambda csrc: _varlen_errors(csrc, rng, monkeypatch))


# ---- the backward's varlen and deterministic forms (hopper/bwd.cuh VARLEN, DET), built through the
# FFI handler from a mutated copy of csrc/ as the varlen forward's above.
HOPPER_BWD_FORM_MUTATIONS = [
    ("bwd_varlen_query_offset_off_by_one", "bwd.cuh",
     "bd.masked, rq.start, rk.start, p.lse + stats", "bd.masked, rq.start + 1, rk.start, p.lse + stats"),
    # a turn nobody passes: the CTA spins into the instruction budget
    ("bwd_deterministic_dq_turn_off_by_one", "bwd.cuh",
     "bwd_wait_turn(dq_turn, bwd_dq_turn(nblk, m, BR, BC, seq.band_lo));",
     "bwd_wait_turn(dq_turn, bwd_dq_turn(nblk, m, BR, BC, seq.band_lo) + 1);"),
    # the group's q heads add their dK / dV in reverse order: on inputs whose shares cancel
    # (A, -A, C) the sum is no longer exactly C
    ("bwd_deterministic_kv_turn_heads_reversed", "bwd.cuh",
     "bwd_wait_turn(kv_turn, static_cast<unsigned>(h % p.group));",
     "bwd_wait_turn(kv_turn, static_cast<unsigned>(p.group - 1 - h % p.group));"),
]
# The correct deterministic backward takes about 0.9M warp instructions (spin polls included).
FORM_WARP_INSTRUCTION_BUDGET = 10_000_000


def _bwd_form_errors(csrc, rng, monkeypatch):
    """Max errors against float64 of the sm90a d64 bf16 causal backward, varlen (an empty sequence,
    padding, GQA) and deterministic (test_hopper_bwd_emulated's cancelling GQA inputs)."""
    from flashgen.build import build
    from flashgen.contract import CallAttributes
    from flashgen.emulate import host, machine
    from flashgen.emulate.check import Checker
    from flashgen.emulate.host import EmulatedLibrary
    from test_deterministic import _reference
    from test_hopper_bwd_emulated import DET_SPEC, _cancelling_inputs, _det_flags
    spec = DET_SPEC
    EmulatedLibrary(build(spec, host="emulate"))   # the unmutated runtime first (see _varlen_errors)
    if csrc is not None:
        monkeypatch.setattr(resources, "csrc_dir", lambda: csrc)
    # every launch of the calls below, the Checker's included (the host passes its own budget: overridden)
    monkeypatch.setattr(host, "launch", lambda *args, **kw: machine.launch(
        *args, **{**kw, "max_warp_instructions": FORM_WARP_INSTRUCTION_BUDGET}))
    lib = EmulatedLibrary(build(spec, host="emulate"))
    varlen = Checker(lib, spec, rng).varlen(seqlens_q=(70, 0, 23), seqlens_k=(90, 0, 17), pad_q=5, pad_k=3,
                                            bottom_right=True, heads_q=4, heads_kv=2)
    assert _det_flags(varlen.kernels) == ["0"], varlen.kernels
    errors = [r.error if np.isfinite(r.error) else np.inf for r in varlen.rows]
    q, k, v, do, _, _ = inputs = _cancelling_inputs(rng)
    attrs = CallAttributes(True, 1 / np.sqrt(spec.head_dim), deterministic=True)
    (o, lse), _ = lib.call(spec.target_name("fwd"), [q, k, v], [(q.shape, q.dtype), ((1, q.shape[2], q.shape[1]),
                                                                                      np.float32)],
                           **attrs.values("fwd"))
    grads, record = lib.call(spec.target_name("bwd"), [q, k, v, o, lse, do],
                             [(q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype)], **attrs.values("bwd"))
    assert _det_flags(l.entry for l in record.launches) == ["1"]
    for g, w in zip(grads, _reference(spec, inputs)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        errors.append(float(np.nan_to_num(np.abs(g - w).max() / max(1.0, np.abs(w).max()), nan=np.inf)))
    return errors


def test_unmutated_backward_forms_pass(rng, monkeypatch):
    assert max(_bwd_form_errors(None, rng, monkeypatch)) < TOLERANCE


@pytest.mark.parametrize("name,header,old,new", HOPPER_BWD_FORM_MUTATIONS,
                         ids=[m[0] for m in HOPPER_BWD_FORM_MUTATIONS])
def test_backward_form_mutation_is_caught(tmp_path, rng, monkeypatch, name, header, old, new):
    _assert_caught(tmp_path, name, header, old, new, lambda csrc: _bwd_form_errors(csrc, rng, monkeypatch))
