"""Mutation suite for the CPU kernels' variants: single-line bugs planted in a copy of csrc/
(ALiBi offsets and slopes, bias/mask/segment strides, dbias, GQA mapping, varlen offsets,
paged block table, lse units, softcap's backward, the split-KV merge and its plan, the backward's
key spans, dbias groups and dq chunks, the exp2 / tanh / ALiBi-distance lane math, the causal tile
spans and epilogues, segment-id ranges, the backward's row terms and the varlen fills). Each
mutant's d32 f32 kernels are built in a child process (its FFI targets would clash with this
process's) and run on the covering array of tests/test_coverage.py projected onto d32 f32, every
run of its RUNS (the reruns with keys split, on 16 threads and deterministic included), which must
fail; the unmutated copy must pass.

Slow (a CPU build per mutant): FLASHGEN_SLOW=1 python3 -m pytest tests/test_cpu_mutations.py
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import mutated_csrc

pytestmark = pytest.mark.slow

# (name, header under csrc/flashgen/cpu, old, new): the first occurrence of `old` becomes `new`.
MUTATIONS = [
    ("alibi_per_batch_slopes_ignored", "problems.h",
     "e.slope = x.alibi[b * x.alibi_stride_b + h];", "e.slope = x.alibi[h];"),
    ("bias_head_stride_dropped", "problems.h",
     "const int64_t off = b * x.bias_stride_b + h * x.bias_stride_h;", "const int64_t off = b * x.bias_stride_b;"),
    ("mask_batch_stride_dropped", "problems.h",
     "e.mask = x.mask + b * x.mask_stride_b + h * x.mask_stride_h;", "e.mask = x.mask + h * x.mask_stride_h;"),
    ("kv_segment_ids_batch_offset_dropped", "problems.h",
     "e.kseg = x.kv_segment_ids + b * Sk;", "e.kseg = x.kv_segment_ids;"),
    ("dbias_slab_offset_dropped", "problems.h",
     "if (dbacc != nullptr) e.dbias = dbacc + off;", "if (dbacc != nullptr) e.dbias = dbacc;"),
    ("fwd_alibi_offset_negated", "forward.h",
     "const int32_t d0 = static_cast<int32_t>(q0 + aoff - (k0 + j));",
     "const int32_t d0 = static_cast<int32_t>(q0 - aoff - (k0 + j));"),
    ("bwd_alibi_offset_negated", "backward.h",
     "const int32_t d0 = static_cast<int32_t>(i + aoff - k0);", "const int32_t d0 = static_cast<int32_t>(i - aoff - k0);"),
    ("gqa_kv_head_mapping", "forward.h", "const int64_t hk = h / G;", "const int64_t hk = h % Hkv;"),
    ("lse_in_log2_units", "forward.h",
     "*lrow_out = mrow[i] * kLn2 + std::log(l);", "*lrow_out = mrow[i] + std::log(l);"),
    ("varlen_keys_at_query_offsets", "forward.h",
     "const DenseRows<T> kr{k + (int64_t(ck[b]) * Hkv + hk) * D, Hkv * D};",
     "const DenseRows<T> kr{k + (int64_t(cq[b]) * Hkv + hk) * D, Hkv * D};"),
    ("paged_table_row_of_batch", "forward.h",
     "const PagedRows<T> kr{k_cache + hk * D, pa.block_table + b * MB,",
     "const PagedRows<T> kr{k_cache + hk * D, pa.block_table + b,"),
    ("bwd_softcap_factor", "backward.h", "storev(du + t, one - u * u);", "storev(du + t, one - u);"),
    ("mask_head_stride_dropped", "problems.h",
     "e.mask = x.mask + b * x.mask_stride_b + h * x.mask_stride_h;", "e.mask = x.mask + b * x.mask_stride_b;"),
    ("neg_inf_bias_seen_as_a_key", "problems.h",
     "if (b == -std::numeric_limits<float>::infinity()) continue;", "if (b != b) continue;"),
    ("plain_bwd_softcap_factor_dropped", "backward.h",
     "storev(dr + t, vis ? pv * (loadv(dr + t) - Dv) * scv * loadv(du + t) : zero);",
     "storev(dr + t, vis ? pv * (loadv(dr + t) - Dv) * scv : zero);"),
    ("plain_bwd_ds_unscaled", "bwd_tiles.h",
     "return loadv(p + r * ldp + v * W) * (acc - splat(drow[r])) * scv;",
     "return loadv(p + r * ldp + v * W) * (acc - splat(drow[r]));"),
    ("split_merge_reads_first_partial", "forward.h",
     "const float* src = opart + c * o_elems + oi;", "const float* src = opart + oi;"),
    ('bwd_dkv_span_off_by_one', 'bwd_tiles.h',
     'return {0, nv, std::max<int64_t>(0, r - hi), std::min<int64_t>(nq, r + rows - lo)};',
     'return {0, nv, std::max<int64_t>(0, r - hi), std::min<int64_t>(nq, r + rows - 1 - lo)};'),
    ('bwd_kv_segments_batch_stride_sq', 'backward.h',
     'const int32_t* ks = x->kv_segment_ids + b * Sk + k0;',
     'const int32_t* ks = x->kv_segment_ids + b * Sq + k0;'),
    ('bwd_alibi_offset_only_when_causal', 'backward.h',
     'const int64_t aoff = causal_offset(s, a);',
     'const int64_t aoff = a.causal ? causal_offset(s, a) : 0;'),
    ('dbias_zero_first_head_of_group', 'backward.h',
     'if (dbacc != nullptr) zero_db(b, hk * G, sh ? (hk + 1) * G : hk * G + 1, k0, nk);',
     'if (dbacc != nullptr) zero_db(b, hk * G, hk * G + 1, k0, nk);'),
    ('dbias_shared_groups_split_by_batch', 'backward.h',
     'const int64_t gB = db_shared && sb != 0 ? B : 1,',
     'const int64_t gB = db_shared ? B : 1,'),
    ('varlen_dq_zero_at_kv_head_index', 'backward.h',
     'std::memset(p.dqacc + (i * Hq + hk * G) * D, 0, sizeof(float) * size_t(G * D));',
     'std::memset(p.dqacc + (i * Hq + hk) * D, 0, sizeof(float) * size_t(G * D));'),
    ('varlen_drow_at_key_offset', 'backward.h',
     'p.Drow = Drow.p + cq[b];',
     'p.Drow = Drow.p + ck[b];'),
    ('varlen_bwd_skips_keys_without_queries', 'backward.h',
     'const int64_t nkb_b = (p.Sk + kBwdBk - 1) / kBwdBk;',
     'const int64_t nkb_b = p.Sq > 0 ? (p.Sk + kBwdBk - 1) / kBwdBk : 0;'),
    ('reduce_dq_drops_last_chunk', 'backward.h',
     'for (int64_t c = 1; c < nchunks; ++c) {',
     'for (int64_t c = 1; c + 1 < nchunks; ++c) {'),
    ('fwd_all_ninf_on_empty_range', 'forward.h',
     'all_ninf = lo < hi && (x == nullptr || extras_see_a_key(*x, r, lo, hi));',
     'all_ninf = lo <= hi && (x == nullptr || extras_see_a_key(*x, r, lo, hi));'),
    ('merge_max_starts_at_all_neg_inf_partial', 'forward.h',
     'float m = -std::numeric_limits<float>::infinity();\n          bool nan = false;',
     'float m = kAllNegInfPartial;\n          bool nan = false;'),
    ('split_plan_keys_of_last_entry', 'forward.h',
     'for (int64_t b = 0; b < B; ++b) max_keys = std::max<int64_t>(max_keys, Sk_of(b));',
     'for (int64_t b = 0; b < B; ++b) max_keys = Sk_of(b);'),
    ('fwd_seed_rows_off_by_one', 'fwd_tiles.h',
     'if (row >= kSeedRows) return e.scaled(v, y);',
     'if (row > kSeedRows) return e.scaled(v, y);'),
    ('exp2_poly_ln2_coeff', 'numerics.h',
     'p = vfma(p, f, splat(6.931472028550421e-1f));',
     'p = vfma(p, f, splat(6.93e-1f));'),
    ('tanh_large_sign_dropped', 'numerics.h',
     'const vf large = x < zero ? -big : big;',
     'const vf large = big;'),
    ('absdist_sign', 'numerics.h',
     'return __builtin_convertvector(d < 0 ? -d : d, vf);',
     'return __builtin_convertvector(d, vf);'),
    ('score_tiles_vbegin_plus_one', 'fwd_tiles.h',
     'return r + c <= 0 ? 0 : (r + c) / W; }',
     'return r + c <= 0 ? 0 : (r + c + 1) / W; }'),
    ('exp_causal_lo_plus_one', 'fwd_tiles.h',
     'std::max<int64_t>(row + c - v * W, -1), W);',
     'std::max<int64_t>(row + c + 1 - v * W, -1), W);'),
    ('band_scores_last_vector_dropped', 'bwd_tiles.h',
     'return {first / W, last / W + 1, 0, dim};',
     'return {first / W, last / W, 0, dim};'),
    ('band_dq_one_key_short', 'bwd_tiles.h',
     'std::min<int64_t>(nk, r + rows + hi)};',
     'std::min<int64_t>(nk, r + rows - 1 + hi)};'),
    ('probs_epilogue_first_row_lse', 'bwd_tiles.h',
     'return exp2v(vfma(acc, cv, splat(-lse2[r])));',
     'return exp2v(vfma(acc, cv, splat(-lse2[0])));'),
    ('extras_see_key_ignores_segments', 'problems.h',
     '    if (e.qseg != nullptr && e.qseg[i] != e.kseg[j]) continue;\n',
     ''),
    ('id_range_hi_first', 'problems.h',
     'a = std::min(a, ids[i]), b = std::max(b, ids[i]);',
     'a = std::min(a, ids[i]), b = std::max(b, ids[0]);'),
    ('alibi_only_batch_stride_dropped', 'problems.h',
     '  keep->alibi_stride_b = x.alibi_stride_b;\n',
     ''),
    ('row_terms_drow_last_lane', 'backward.h',
     'for (int t = 0; t < W; ++t) sum += acc[t];\n            Drow[r] = sum;',
     'for (int t = 0; t + 1 < W; ++t) sum += acc[t];\n            Drow[r] = sum;'),
    ('varlen_bwd_dv_outside_unzeroed', 'backward.h',
     '    std::memset(static_cast<void*>(dv + used_k * Hkv * D), 0, sizeof(T) * size_t((Tk - used_k) * Hkv * D));\n',
     ''),
    ('varlen_bwd_dq_outside_one_short', 'backward.h',
     'std::memset(dqacc + c * dq_elems + used_q * Hq * D, 0, sizeof(float) * size_t((Tq - used_q) * Hq * D));',
     'std::memset(dqacc + c * dq_elems + used_q * Hq * D, 0, sizeof(float) * size_t((Tq - used_q - 1) * Hq * D));'),
]

# Child: build the d32 f32 kernels from the csrc copy argv[1], run every projected case,
# print the failing ones as JSON. tests/ is on its path for test_coverage's runners.
_CHILD = """
import json, os, pathlib, sys
from flashgen import KernelSpec, build, coverage, resources, runtime
resources.csrc_dir = lambda: pathlib.Path(sys.argv[1])
runtime.load(build([KernelSpec(32, "f32", c, "cpu") for c in (False, True)]).path)
import test_coverage as tc
failures = []
for index, how in tc.RUNS:
    case = coverage.Case(tuple((k, {"head_dim": 32, "dtype": "f32"}.get(k, v)) for k, v in tc.CASES[index].values))
    for env in tc.ENV.values():    # the previous run's settings
        for name in env:
            os.environ.pop(name, None)
    try:
        tc.run_case(index, how, os.environ.__setitem__, case)
    except Exception as e:
        failures.append(f"{how} {str(e).splitlines()[0][:300]}".strip())
print(json.dumps(failures))
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")  # mutants stay out of the user's cache


def _failures(tmp_path, cache, mutation=None) -> list[str]:
    csrc = mutated_csrc(tmp_path / "csrc", "cpu", mutation)
    tests = pathlib.Path(__file__).parent
    env = {**os.environ, "FLASHGEN_CACHE_DIR": str(cache),
           "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", _CHILD, str(csrc)], capture_output=True, text=True, env=env,
                       timeout=1800)
    if r.returncode != 0:  # a crash is a catch too, but say so
        return [f"child rc {r.returncode}: {r.stderr.strip().splitlines()[-1:]}"]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_unmutated_copy_passes(tmp_path, cache):
    assert _failures(tmp_path, cache) == []


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_mutation_is_caught(tmp_path, cache, mutation):
    failures = _failures(tmp_path, cache, mutation)
    assert failures, f"mutation {mutation[0]} survived the covering cases"
    print(f"{mutation[0]}: caught by {failures[0]} ({len(failures)} cases)")
