"""deterministic=True: the backward's accumulations in a fixed order, the same bits on every run.

sm80 CUDA under the emulator: its scheduler is seeded (the `seed` of EmulatedLibrary.call picks
the order in which CTAs run, warps interleave and atomics land), so two seeds are two schedules.
The default backward's dQ is summed with f32 atomics as key blocks finish and differs between
two schedules; the deterministic kernels (bwd.cuh, kBwdDeterministic) give the same bits under
both and match float64. CPU: the same bits on every run and for every thread count. JAX: the
attribute reaches the call, and the gradients equal the default's within rounding.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

from conftest import needs_nvcc
from flashgen import reference
from flashgen.contract import CallAttributes
from flashgen.emulate.check import relative_error, tolerance
from flashgen.spec import KernelSpec

# Two schedules under which the default backward's dQ sums land in different orders.
SEEDS = (3, 4)
# Warp-instructions per backward launch: a turn that never comes spins until this runs out. The
# cases below take at most 0.84 M (their spins included, under these seeds); the emulator's default
# budget, 200 M, took over 15 minutes to run out on a deadlocked turn, 10 M about 3 minutes.
BUDGET = 4_000_000


@functools.cache
def _library(spec: KernelSpec):
    from flashgen.build import build
    from flashgen.emulate.host import EmulatedLibrary
    return EmulatedLibrary(build(spec, host="emulate"))


def _inputs(rng, spec, *, sq, sk, hq, hkv, b=1, bias=None, window=(-1, -1)):
    import ml_dtypes
    dt = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}[spec.dtype]
    d = spec.head_dim
    q, k, v, do = (rng.standard_normal(s).astype(dt) for s in
                   ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d)))
    extras = {} if bias is None else {"bias": rng.standard_normal((*bias, sk)).astype(np.float32)}
    return q, k, v, do, extras, window


def _backward(spec, inputs, *, seed, deterministic):
    """(dq, dk, dv[, dbias]) and the backward's CallRecord, on the emulated forward's o, lse."""
    q, k, v, do, extras, window = inputs
    lib = _library(spec)
    names = tuple(extras)
    ops = list(extras.values())
    attrs = CallAttributes(spec.causal, 1 / np.sqrt(spec.head_dim), window=window, extras=names,
                           deterministic=deterministic)
    b, sq, hq, d = q.shape
    (o, lse), _ = lib.call(spec.target_name("fwd"), [q, k, v, *ops], [((b, sq, hq, d), q.dtype),
                                                                     ((b, hq, sq), np.float32)],
                           seed=0, **attrs.values("fwd"))
    results = [(q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype)] + [(x.shape, x.dtype) for x in ops]
    outs, record = lib.call(spec.target_name("bwd"), [q, k, v, o, lse, do, *ops], results, seed=seed,
                            max_warp_instructions=BUDGET, **attrs.values("bwd"))
    return outs, record


def _reference(spec, inputs):
    q, k, v, do, extras, window = inputs
    return reference.attention(q, k, v, causal=spec.causal, scale=float(np.float32(1 / np.sqrt(spec.head_dim))),
                               window=window, do=do, **extras)[2]


# (spec, shape): dense MHA (dQ summed over 3 key blocks), GQA (dK/dV over a group of 3; both),
# causal, a bias broadcast over the heads and a key-only bias (dbias summed over heads and
# queries); ragged blocks. Three addends at least: with two, 0 + a + b == 0 + b + a in any
# rounding. The specs are the ones tests/test_cuda_emulated.py builds: f32 (its outputs are the
# f32 accumulators, so the order of the sums shows in every bit) and bf16 causal.
F32, BF16_CAUSAL = KernelSpec(64, "f32", False, "sm80"), KernelSpec(64, "bf16", True, "sm80")
CASES = {
    "mha": (F32, dict(sq=24, sk=150, hq=1, hkv=1)),
    "gqa": (F32, dict(sq=24, sk=60, hq=3, hkv=1)),
    "gqa_3_key_blocks": (F32, dict(sq=40, sk=150, hq=3, hkv=1)),
    "gqa_causal": (BF16_CAUSAL, dict(sq=150, sk=150, hq=3, hkv=1)),
    "dbias_over_heads": (F32, dict(sq=40, sk=100, hq=2, hkv=2, bias=(1, 1, 40))),
    "dbias_key_only": (BF16_CAUSAL, dict(sq=70, sk=70, hq=2, hkv=2, bias=(1, 1, 1))),
    # over batch and heads at once: each (batch, head) takes its own turn (b * Hq + h)
    "dbias_over_batch_and_heads": (F32, dict(b=2, sq=24, sk=60, hq=2, hkv=1, bias=(1, 1, 24))),
    # dQ turns past the first query block (f32: 32 rows), with a left window that keeps the first
    # key block from the last query blocks (bwd_dq_turn's band edge): the cases above have one
    # query block, where every key block's turn is its index whatever the band
    "window_several_q_blocks": (F32, dict(sq=150, sk=150, hq=1, hkv=1, window=(40, 20))),
}
# In CI: the three smallest (3-4 CTAs each) and the windowed one (3 key blocks). A CTA's wait spins, which
# costs the emulator (its warps at the lowest pc run first) far more than a GPU: the rest are `slow`.
SLOW = set(CASES) - {"mha", "gqa", "dbias_over_batch_and_heads", "window_several_q_blocks"}


def _kernel_modes(record) -> list[str]:
    """The BwdMode of each flash_bwd_kernel launch: its last template argument (Li<mode>E)."""
    import re
    return [re.search(r"Li(\d+)EEEv", l.entry).group(1) for l in record.launches if "flash_bwd_kernel" in l.entry]


@needs_nvcc
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES])
def test_emulated_deterministic_backward_is_the_same_bits_under_two_schedules(case, rng):
    spec, shape = CASES[case]
    inputs = _inputs(rng, spec, **shape)
    runs, records = zip(*(_backward(spec, inputs, seed=s, deterministic=True) for s in SEEDS))
    assert all(int(m) & 4 for r in records for m in _kernel_modes(r))  # kBwdDeterministic
    names = ("dq", "dk", "dv", "dbias")
    for name, a, b in zip(names, *runs):
        assert a.tobytes() == b.tobytes(), f"{case}: {name} differs between schedules {SEEDS}"
    for name, got, ref in zip(names, runs[0], _reference(spec, inputs)):
        assert np.isfinite(got).all(), f"{case}: {name} has unwritten (poisoned) elements"
        assert relative_error(got, ref) <= tolerance(spec.dtype, name), (case, name, relative_error(got, ref))


@needs_nvcc
def test_emulated_default_backward_dq_depends_on_the_schedule(rng):
    """What deterministic=True fixes: the default kernels' atomically summed dQ (and, under GQA,
    dK/dV) under the two schedules of the test above are different bits (each correct)."""
    spec, shape = CASES["gqa_3_key_blocks"]
    inputs = _inputs(rng, spec, **shape)
    runs, records = zip(*(_backward(spec, inputs, seed=s, deterministic=False) for s in SEEDS))
    assert [_kernel_modes(r) for r in records] == [["0"], ["0"]]  # today's kBwdDense kernel
    ref = _reference(spec, inputs)
    for name, a, b, r in zip(("dq", "dk"), *runs, ref):
        assert a.tobytes() != b.tobytes(), f"{name}: the same bits under schedules {SEEDS}"
        assert max(relative_error(a, r), relative_error(b, r)) <= tolerance(spec.dtype, name)


@needs_nvcc
@pytest.mark.slow
def test_emulated_deterministic_varlen_backward(rng):
    """bwd_varlen: per-sequence turns (an empty sequence, a sequence of 3 key blocks, GQA)."""
    spec = F32
    seq_q, seq_k, hq, hkv, d = (24, 0, 30), (40, 0, 150), 3, 1, spec.head_dim
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (seq_q, seq_k))
    tq, tk = int(cu_q[-1]) + 2, int(cu_k[-1]) + 2
    q, k, v, do = (rng.standard_normal(s).astype(np.float32) for s in ((tq, hq, d), (tk, hkv, d), (tk, hkv, d),
                                                                       (tq, hq, d)))
    lib, scale = _library(spec), 1 / np.sqrt(d)
    attrs = CallAttributes(False, scale, max_seqlen=(max(seq_q), max(seq_k)), deterministic=True)
    (o, lse), _ = lib.call(spec.target_name("fwd_varlen"), [q, k, v, cu_q, cu_k],
                           [((tq, hq, d), np.float32), ((hq, tq), np.float32)], seed=0, **attrs.values("fwd_varlen"))
    runs = [lib.call(spec.target_name("bwd_varlen"), [q, k, v, o, lse, do, cu_q, cu_k],
                     [(q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype)], seed=s,
                     **attrs.values("bwd_varlen"))[0] for s in SEEDS]
    ref = reference.attention_varlen(q, k, v, cu_q, cu_k, scale=float(np.float32(scale)), do=do)[2]
    for name, a, b, r in zip(("dq", "dk", "dv"), *runs, ref):
        assert a.tobytes() == b.tobytes(), name
        assert relative_error(a, r) <= tolerance(spec.dtype, name), (name, relative_error(a, r))


# ---- CPU -------------------------------------------------------------------------------------
def test_cpu_deterministic_backward_is_the_same_bits_for_any_thread_count(rng, monkeypatch):
    """One (batch, head) pair, 8 key blocks: the default CPU backward splits its key blocks into
    dq chunks by its thread count (FLASHGEN_CPU_THREADS, read at each call) and sums them at the
    end, so dq's bits follow the thread count; deterministic=True fixes the chunking. Each run
    at one count is the same bits already (one item owns each chunk)."""
    import jax
    import jax.numpy as jnp
    from flashgen.jax import flash_attention
    q, k, v = (jnp.asarray(rng.standard_normal((1, 512, 1, 64)), jnp.float32) for _ in range(3))

    def grads(deterministic):
        f = jax.jit(jax.grad(lambda q, k, v: (flash_attention(q, k, v, deterministic=deterministic) ** 2).sum(),
                             (0, 1, 2)))

        def run(threads):
            monkeypatch.setenv("FLASHGEN_CPU_THREADS", str(threads))
            return b"".join(np.asarray(g).tobytes() for g in f(q, k, v))
        return run
    default, det = grads(False), grads(True)
    assert default(1) != default(4)
    assert det(1) == det(4) == det(4)


# ---- JAX -------------------------------------------------------------------------------------
def test_jax_deterministic_attribute_is_emitted_and_grads_match(rng):
    import jax
    import jax.numpy as jnp
    from flashgen.jax import flash_attention, flash_attention_varlen
    q = jnp.asarray(rng.standard_normal((1, 40, 4, 32)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, 40, 2, 32)), jnp.float32) for _ in range(2))
    bias = jnp.asarray(rng.standard_normal((1, 1, 40, 40)), jnp.float32)

    def grads(deterministic):
        return jax.grad(lambda q, k, v, b: (flash_attention(q, k, v, b, causal=True, deterministic=deterministic)
                                            ** 2).sum(), (0, 1, 2, 3))
    text = jax.jit(grads(True)).lower(q, k, v, bias).as_text()
    assert "deterministic = true" in text and "deterministic = false" not in text
    assert "deterministic = false" in jax.jit(grads(False)).lower(q, k, v, bias).as_text()
    for a, b in zip(grads(True)(q, k, v, bias), grads(False)(q, k, v, bias)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    cu = jnp.asarray([0, 15, 40], jnp.int32)
    varlen = jax.jit(jax.grad(lambda q: flash_attention_varlen(q, k[0], v[0], cu, cu, 25, 25,
                                                               deterministic=True).sum()))
    assert "deterministic = true" in varlen.lower(q[0]).as_text()


_BWD_CONFIG = ('{bottom_right = false, causal = false, %s extras = "", scale = 5.0e-01 : f32, softcap = 0.0 : f32, '
               'window_left = -1 : i32, window_right = -1 : i32}')


def test_deterministic_attribute_is_checked():
    """A bool on the backward calls only; a module that lacks it or mistypes it is refused by
    name (contract.CallAttributes.parse, what flashgen.jax.check_calls and the partitioners read),
    and by the CPU handler (the FFI's struct decoding) as an error, not a crash."""
    import jax
    import jax.numpy as jnp
    from flashgen import runtime
    with pytest.raises(ValueError, match="deterministic must be a bool, got 1"):
        CallAttributes(False, 0.5, deterministic=1)
    attrs = CallAttributes(False, 0.5, deterministic=True)
    assert attrs.values("bwd")["deterministic"] is True and "deterministic" not in attrs.values("fwd")
    assert CallAttributes.parse(_BWD_CONFIG % "deterministic = true,", "bwd") == attrs
    with pytest.raises(ValueError, match="attribute deterministic is i32, expected i1"):
        CallAttributes.parse(_BWD_CONFIG % "deterministic = 1 : i32,", "bwd")
    with pytest.raises(ValueError, match="attribute deterministic is missing"):
        CallAttributes.parse(_BWD_CONFIG % "", "bwd")
    with pytest.raises(ValueError, match="unexpected attribute deterministic"):
        CallAttributes.parse(_BWD_CONFIG % "deterministic = true,", "fwd")

    spec = KernelSpec(32, "f32", False, "cpu")
    runtime.ensure([spec])
    q, lse = jnp.ones((1, 8, 2, 32), jnp.float32), jnp.zeros((1, 2, 8), jnp.float32)
    call = jax.ffi.ffi_call(spec.target_name("bwd"), [jax.ShapeDtypeStruct(q.shape, q.dtype)] * 3)
    base = CallAttributes(False, 0.5).ffi_kwargs("fwd")
    for bad in ({}, {"deterministic": np.int32(1)}):
        with pytest.raises(Exception, match="INVALID_ARGUMENT"):
            jax.block_until_ready(jax.jit(lambda *a: call(*a, **base, **bad))(q, q, q, q, lse, q))
    jax.block_until_ready(jax.jit(lambda *a: call(*a, **base, deterministic=True))(q, q, q, q, lse, q))
