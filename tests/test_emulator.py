"""The PTX emulator's self-checks: real kernels against float64, fragment tables against CuTe,
one-instruction micro-kernels against numpy, and every failure mode triggered by a tiny kernel."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import needs_nvcc
from flashgen import reference


@needs_nvcc
def test_dense_forward_bf16_causal_matches_float64(rng):
    from emulated_dense import NP_DTYPES, run_dense_forward, spec_module
    module = spec_module(64, "bf16", True)
    b, sq, sk, hq, hkv, d = 1, 77, 77, 2, 1, 64       # not a tile multiple; GQA
    q = rng.standard_normal((b, sq, hq, d)).astype(NP_DTYPES["bf16"])
    k = rng.standard_normal((b, sk, hkv, d)).astype(NP_DTYPES["bf16"])
    v = rng.standard_normal((b, sk, hkv, d)).astype(NP_DTYPES["bf16"])
    o, lse, stats = run_dense_forward(module, q, k, v, causal=True, dtype="bf16")
    ro, rlse = reference.attention(q, k, v, causal=True)[:2]
    assert np.abs(o - ro).max() < 2e-2
    assert np.abs(lse - rlse).max() < 1e-4
    assert stats.warp_instructions > 1000 and stats.opcode_counts["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"]
