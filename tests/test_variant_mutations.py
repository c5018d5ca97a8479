"""Mutation suite for the variants' CUDA code: single-line bugs planted in a copy of csrc/ in
ALiBi, softcap, bias/dbias, mask, segment ids, GQA, varlen offsets, paged block indexing,
split-KV combine and lse units. Each mutant spec is built through the real build and run
under the emulator through its FFI handlers on `flashgen check --emulate`'s standard cases
(flashgen.emulate.check.standard_cases), which must fail; the unmutated copy must pass.

Slow (a full emulated build per mutant): FLASHGEN_SLOW=1 python3 -m pytest tests/test_variant_mutations.py
"""
from __future__ import annotations


import numpy as np
import pytest

from conftest import mutated_csrc, needs_nvcc
from flashgen import KernelSpec, resources
from flashgen.emulate import EmulationError

pytestmark = [needs_nvcc, pytest.mark.slow]

# (name, header under csrc/flashgen/cuda, old, new): the first occurrence of `old` becomes `new`.
MUTATIONS = [
    ("dense_alibi_offset_negated", "ffi_cuda.cuh",
     "e.alibi_off = bottom_right ? static_cast<int>(s.seqlen_k - s.seqlen_q) : 0;",
     "e.alibi_off = bottom_right ? static_cast<int>(s.seqlen_q - s.seqlen_k) : 0;"),
    ("varlen_paged_alibi_offset_negated", "extras.cuh",
     "return bottom_right ? seqlen_k - seqlen_q : 0;", "return bottom_right ? seqlen_q - seqlen_k : 0;"),
    ("varlen_bwd_softcap_u_without_alibi", "bwd.cuh",
     "const float u = (__log2f(s[j][e]) + sLse[qi] - a) * p.cap_out;",
     "const float u = (__log2f(s[j][e]) + sLse[qi]) * p.cap_out;"),
    ("extras_bwd_softcap_u_without_bias", "bwd.cuh",
     "const float u = (__log2f(s[j][e]) + sLse[qi] - xv.add_only(row, kj) * kLog2e) * p.cap_out;",
     "const float u = (__log2f(s[j][e]) + sLse[qi]) * p.cap_out;"),
    ("bias_head_stride_dropped", "extras.cuh",
     "(b * x.bias_stride_b + h * x.bias_stride_h)", "(b * x.bias_stride_b)"),
    ("mask_batch_stride_dropped", "extras.cuh",
     "x.mask + b * x.mask_stride_b + h * x.mask_stride_h", "x.mask + h * x.mask_stride_h"),
    ("kv_segment_ids_batch_offset_dropped", "extras.cuh",
     "kv_seg = x.kv_seg == nullptr ? nullptr : x.kv_seg + static_cast<int64_t>(b) * Sk;",
     "kv_seg = x.kv_seg == nullptr ? nullptr : x.kv_seg;"),
    ("dbias_head_stride_zero", "ffi_cuda.cuh",
     "e.dbias_stride_h = x.bias_stride_h;", "e.dbias_stride_h = 0;"),
    ("varlen_paged_alibi_per_batch_slopes_ignored", "extras.cuh",
     "return AlibiRow{-x.alibi[b * x.alibi_stride_b + h] * kLog2e,",
     "return AlibiRow{-x.alibi[h] * kLog2e,"),
    ("gqa_kv_head_mapping", "fwd.cuh",
     "const int h = blockIdx.y, hk = h / p.group;", "const int h = blockIdx.y, hk = h % p.heads_kv;"),
    ("varlen_bwd_key_offsets_of_queries", "bwd.cuh",
     "rk = seq_range(p.cu_k[b], p.cu_k[b + 1],", "rk = seq_range(p.cu_q[b], p.cu_k[b + 1],"),
    ("paged_block_index_off_by_one", "fwd.cuh",
     "const int blk = table_row[j / block_size];", "const int blk = table_row[(j + 1) / block_size];"),
    ("split_kv_combine_weight_in_log2", "extras.cuh",
     "expf(lse_s - mg.m) * mg.inv_total", "exp2f(lse_s - mg.m) * mg.inv_total"),
    ("extras_neg_inf_bias_counted_as_seen", "fwd.cuh",
     "seen[e >> 1] |= vis && add != -INFINITY;", "seen[e >> 1] |= vis;"),
    ("bwd_gqa_kv_head_mapping", "bwd.cuh",
     "const int h = item_y, b = item_z, hk = h / p.group;", "const int h = item_y, b = item_z, hk = h % p.heads_kv;"),
    ("softcap_input_without_scale", "ffi_cuda.cuh",
     "p.cap_in = a.softcap > 0.f ? a.scale / a.softcap : 0.f;", "p.cap_in = a.softcap > 0.f ? 1.f / a.softcap : 0.f;"),
    ("split_kv_partial_rows_without_batch", "fwd.cuh",
     "((static_cast<int64_t>(split) * p.batch + b) * p.heads_q + h) * Sq;",
     "((static_cast<int64_t>(split) * p.batch) * p.heads_q + h) * Sq;"),
    ("lse_units_of_extras_kernels", "fwd.cuh",
     "const float lse_mul = kLog2Units ? 0.6931471805599453f", "const float lse_mul = kLog2Units ? 1.f"),
    ('mask_head_stride_dropped', 'extras.cuh',
     'x.mask + b * x.mask_stride_b + h * x.mask_stride_h;',
     'x.mask + b * x.mask_stride_b;'),
    ('q_seg_batch_stride_sk', 'extras.cuh',
     'x.q_seg + static_cast<int64_t>(b) * Sq;',
     'x.q_seg + static_cast<int64_t>(b) * Sk;'),
    ('bias_f32_offset_in_input_elements', 'extras.cuh',
     '* (x.bias_f32 ? 4 : sizeof(T));',
     '* sizeof(T);'),
    ('bwd_varlen_dsum_at_key_offset', 'bwd.cuh',
     'const float* dsumg = p.dsum + (kVarlen ? static_cast<int64_t>(h) * p.seqlen_q + rq.start',
     'const float* dsumg = p.dsum + (kVarlen ? static_cast<int64_t>(h) * p.seqlen_q + rk.start'),
    ('plain_row_without_keys_nan', 'fwd.cuh',
     'all_ninf = l == 0.f && max(0LL, row + band_lo) < min(static_cast<long long>(Sk), row + band_hi + 1);',
     'all_ninf = l == 0.f && max(0LL, row + band_lo) <= min(static_cast<long long>(Sk), row + band_hi + 1);'),
    ('atomic_kv_only_above_two', 'ffi_cuda.cuh',
     'const bool atomic_kv = group > 1;',
     'const bool atomic_kv = group > 2;'),
    ('paged_split_last_chunk_dropped', 'extras.cuh',
     '  if (hi > n_end) hi = n_end;',
     '  if (hi >= n_end) hi = n_end - 1;'),
    ('term_mask_index_by_bias_ld', 'extras.cuh',
     'const int64_t idx = static_cast<int64_t>(row) * sk + col;\n    if (mask',
     'const int64_t idx = static_cast<int64_t>(row) * bias_ld + col;\n    if (mask'),
]
SPEC = KernelSpec(64, "bf16", True, "sm80")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cache for the module: the emulation runtime is built once, mutants stay out of the
    user's cache."""
    return tmp_path_factory.mktemp("cache")


def _failures(tmp_path, monkeypatch, cache, mutation=None) -> list[str]:
    """Build SPEC from a (mutated) copy of csrc/ and run the standard cases; the rows that
    fail, or the emulator's own error."""
    from flashgen.build import build
    from flashgen.emulate.check import Checker, standard_cases
    from flashgen.emulate.host import EmulatedLibrary
    csrc = mutated_csrc(tmp_path / "csrc", "cuda", mutation)
    monkeypatch.setattr(resources, "csrc_dir", lambda: csrc)
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(cache))
    lib = EmulatedLibrary(build(SPEC, host="emulate"))
    try:
        cases = standard_cases(Checker(lib, SPEC, np.random.default_rng(20261127)))
    except EmulationError as e:
        return [f"emulator: {e}"]
    return [f"{r.family} [{r.case}] {r.output}: {r.error:.3g}" for c in cases for r in c.rows if not r.ok]


def test_unmutated_copy_passes(tmp_path, monkeypatch, cache):
    assert _failures(tmp_path, monkeypatch, cache) == []


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_mutation_is_caught(tmp_path, monkeypatch, cache, mutation):
    failures = _failures(tmp_path, monkeypatch, cache, mutation)
    assert failures, f"mutation {mutation[0]} survived the standard cases"
    print(f"{mutation[0]}: caught by {failures[0]} ({len(failures)} rows)")
