"""Mutation suite for the CPU kernels' variants: single-line bugs planted in a copy of csrc/
(ALiBi offsets and slopes, bias/mask/segment strides, dbias, GQA mapping, varlen offsets,
paged block table, lse units, softcap's backward, the split-KV merge). Each mutant's d32 f32
kernels are built in a child process (its FFI targets would clash with this process's) and
run on the covering array of tests/test_coverage.py projected onto d32 f32 (the dense and
paged cases once more with their keys split, as test_covering_case_with_split_kv runs them),
which must fail; the unmutated copy must pass.

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
]

# Child: build the d32 f32 kernels from the csrc copy argv[1], run every projected case,
# print the failing ones as JSON. tests/ is on its path for test_coverage's runners.
_CHILD = """
import json, os, pathlib, sys
import numpy as np
from flashgen import KernelSpec, build, coverage, resources, runtime
resources.csrc_dir = lambda: pathlib.Path(sys.argv[1])
runtime.load(build([KernelSpec(32, "f32", c, "cpu") for c in (False, True)]).path)
import test_coverage as tc
failures = []
runs = [(i, None) for i in range(len(tc.CASES))] + [(i, "3") for i in tc.SPLIT_KV]
for index, splits in runs:
    case = coverage.Case(tuple((k, {"head_dim": 32, "dtype": "f32"}.get(k, v)) for k, v in tc.CASES[index].values))
    seed = tc.SEED * 1000 + index
    os.environ.pop("FLASHGEN_CPU_KV_SPLITS", None)
    if splits:
        os.environ["FLASHGEN_CPU_KV_SPLITS"] = splits
    try:
        tc._check(tc.RUN[case.layout](case, tc.Inputs(case, np.random.default_rng(seed))), case, seed)
    except Exception as e:
        failures.append(("split-KV " if splits else "") + str(e).splitlines()[0][:300])
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
