"""The CPU kernels on a pairwise covering array of their features (flashgen/coverage.py).

Every case runs through flashgen.jax (dense with its extras, varlen, paged) and compares every
output (o, lse, dq, dk, dv, dbias) with flashgen.reference in float64. CI runs the array of
seed 0 with inputs derived from it: the same cases and draws every run, so a failure is a
change, never luck. FLASHGEN_COVERAGE_SEED=<n> draws another array and other inputs (a campaign).
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashgen import coverage, reference
from flashgen.emulate.check import LSE_TOLERANCE
from flashgen.emulate.check import relative_error as _rel
from flashgen.jax import flash_attention, flash_attention_paged, flash_attention_varlen
from test_window_softcap import JNP, TOL, specs  # noqa: F401 - specs: the d32/d64 CPU library

SEED = int(os.environ.get("FLASHGEN_COVERAGE_SEED", "0"))
CASES = coverage.kernel_cases((32, 64), SEED)


class Inputs:
    """Random operands of one case, and the keyword arguments that carry them."""

    def __init__(self, case, rng, deterministic=False):
        self.case, self.rng, self.deterministic = case, rng, deterministic
        self.dt = JNP[case.dtype]
        self.hq, self.hkv = case.heads

    def normal(self, *shape):
        return jnp.asarray(self.rng.standard_normal(shape), self.dt)

    def alibi(self, batch):
        alibi = self.case.alibi
        return {} if alibi is None else {"alibi_slopes": coverage.alibi_slopes(self.rng, alibi, batch, self.hq)}

    def dense_extras(self, b, sq, sk):
        c = self.case
        kw = coverage.extra_operands(self.rng, batch=b, seqlen_q=sq, seqlen_k=sk, heads_q=self.hq, alibi=c.alibi,
                                     bias=c.bias_dims(b), mask=c.mask_dims(b), segment_ids=c.segment_ids)
        if c.bias is not None:
            kw["bias"] = jnp.asarray(kw["bias"], jnp.float32 if c.bias_f32 else self.dt)
        return kw


def _check(errors, case, seed):
    fwd_tol, bwd_tol = TOL[case.dtype]
    limits = {"o": fwd_tol, "lse": LSE_TOLERANCE}
    bad = {k: e for k, e in errors.items() if not e <= limits.get(k, bwd_tol)}
    assert not bad, (f"{case} (FLASHGEN_COVERAGE_SEED={SEED}, input seed {seed}): "
                     f"errors {bad} of {errors}")


def _attrs(case):
    return dict(causal=case.causal, bottom_right=case.bottom_right, window=case.window_sizes,
                softcap=case.softcap)


def _dense(case, inputs):
    b, (sq, sk), d = 2, case.seqlens, case.head_dim
    q, do = inputs.normal(b, sq, inputs.hq, d), inputs.normal(b, sq, inputs.hq, d)
    k, v = inputs.normal(b, sk, inputs.hkv, d), inputs.normal(b, sk, inputs.hkv, d)
    extras = inputs.dense_extras(b, sq, sk)
    bias = extras.pop("bias", None)
    kw = {**_attrs(case), **extras}
    ref_bias = None if bias is None else np.broadcast_to(np.asarray(bias, np.float64),
                                                         (b, inputs.hq, sq, sk))
    f = jax.jit(lambda q, k, v, bias: flash_attention(q, k, v, bias, return_lse=True,
                                                      deterministic=inputs.deterministic, **kw))
    if case.direction == "fwd":
        o, lse = f(q, k, v, bias)
        ro, rlse = reference.attention(q, k, v, bias=ref_bias, **kw)
        return {"o": _rel(o, ro), "lse": _rel(lse, rlse)}
    differentiated = case.bias_differentiated
    args = (q, k, v, bias) if differentiated else (q, k, v)
    (o, lse), vjp = jax.vjp(lambda *a: f(*a, *([] if differentiated else [bias])), *args)
    grads = vjp((do, jnp.zeros_like(lse)))
    ro, rlse, rg = reference.attention(q, k, v, bias=ref_bias, do=do, **kw)
    errors = {"o": _rel(o, ro), "lse": _rel(lse, rlse),
              **{n: _rel(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, rg)}}
    if differentiated:  # summed over the bias's broadcast dims
        want = rg[3].sum(axis=tuple(i for i in range(3) if bias.shape[i] == 1), keepdims=True)
        errors["dbias"] = _rel(grads[3], want)
        assert grads[3].dtype == bias.dtype
    return errors


def _varlen(case, inputs):
    sq, sk = case.seqlens
    lens_q, lens_k = [sq, 0, -(-sq // 3)], [sk, 5, -(-sk // 2)]  # an empty sequence
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    pad_q, pad_k = 3, 2  # rows outside every sequence
    q, do = (inputs.normal(cu_q[-1] + pad_q, inputs.hq, case.head_dim) for _ in range(2))
    k, v = (inputs.normal(cu_k[-1] + pad_k, inputs.hkv, case.head_dim) for _ in range(2))
    kw = {**_attrs(case), **inputs.alibi(len(lens_q))}
    f = jax.jit(lambda q, k, v: flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                       return_lse=True, deterministic=inputs.deterministic,
                                                       **kw))
    if case.direction == "fwd":
        o, lse = f(q, k, v)
        ro, rlse = reference.attention_varlen(q, k, v, cu_q, cu_k, **kw)
        return {"o": _rel(o, ro), "lse": _rel(lse, rlse)}
    (o, lse), vjp = jax.vjp(f, q, k, v)
    grads = vjp((do, jnp.zeros_like(lse)))
    ro, rlse, rg = reference.attention_varlen(q, k, v, cu_q, cu_k, do=do, **kw)
    return {"o": _rel(o, ro), "lse": _rel(lse, rlse),
            **{n: _rel(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, rg)}}


def _paged(case, inputs):
    b, (sq, sk), bs = 2, case.seqlens, 16
    used = np.array([sk, sk // 2 + 1], np.int32)
    max_blocks = -(-sk // bs) + 1
    num_blocks = b * max_blocks + 3
    table = inputs.rng.permutation(num_blocks)[:b * max_blocks].reshape(b, max_blocks).astype(np.int32)
    kc, vc = (inputs.normal(num_blocks, bs, inputs.hkv, case.head_dim) for _ in range(2))
    q = inputs.normal(b, sq, inputs.hq, case.head_dim)
    kw = {**_attrs(case), **inputs.alibi(b)}
    o, lse = jax.jit(lambda *a: flash_attention_paged(*a, return_lse=True, **kw))(q, kc, vc, table, used)
    ro, rlse = reference.attention_paged(q, np.asarray(kc, np.float64), np.asarray(vc, np.float64),
                                         table, used, **kw)
    return {"o": _rel(o, ro), "lse": _rel(lse, rlse)}


RUN = {"dense": _dense, "varlen": _varlen, "paged": _paged}


# Every run CI makes of the array: each case as drawn; the forwards (not varlen's) once more with
# their keys split into 3 ranges merged by lse (on few cores the automatic choice never splits
# these small shapes); the backwards once more with dq summed over chunks of key blocks, as a
# machine of 16 threads runs them (on 2 cores only shared dbias groups chunk) and deterministic
# (chunked as for 16 threads whatever the machine). tests/test_cpu_mutations.py runs the same list.
ENV = {"": {}, "split-KV": {"FLASHGEN_CPU_KV_SPLITS": "3"}, "16 threads": {"FLASHGEN_CPU_THREADS": "16"},
       "deterministic": {}}
RUNS = ([(i, "") for i in range(len(CASES))]
        + [(i, "split-KV") for i, c in enumerate(CASES) if c.layout != "varlen"]
        + [(i, how) for how in ("16 threads", "deterministic") for i, c in enumerate(CASES) if c.direction == "bwd"])


def run_case(index, how, setenv, case=None):
    """Run `how` of case `index` (or of `case`, its projection onto other kernels), checked;
    setenv(name, value) sets the run's environment."""
    for name, value in ENV[how].items():
        setenv(name, value)
    case, seed = case or CASES[index], SEED * 1000 + index
    _check(RUN[case.layout](case, Inputs(case, np.random.default_rng(seed), how == "deterministic")), case, seed)


@pytest.mark.parametrize("index,how", RUNS, ids=[f"{CASES[i]}{'-' + how if how else ''}" for i, how in RUNS])
def test_covering_case(index, how, monkeypatch):
    run_case(index, how, monkeypatch.setenv)


def test_covering_array_covers_every_possible_pair():
    dims = coverage.space((32, 64))
    covered, possible = coverage.coverage(dims, CASES)
    assert covered == possible and possible > 700
    assert all(coverage.refusal(dict(c.values)) is None for c in CASES)


@pytest.mark.parametrize("call,match", [
    (lambda q, k, v: flash_attention(q, k, v, bottom_right=True), "bottom_right only applies"),
    (lambda q, k, v: jax.grad(lambda q: flash_attention_paged(
        q, k[:, :16].reshape(2, 16, 2, 32), v[:, :16].reshape(2, 16, 2, 32),
        np.array([[0], [1]], np.int32), np.array([16, 3], np.int32)).sum())(q),
     "forward-only"),
    (lambda q, k, v: flash_attention_varlen(q[0], k[0], v[0], np.array([0, 9], np.int32),
                                            np.array([0, 9], np.int32), 9, 9, bias=k), "bias"),
    (lambda q, k, v: flash_attention_paged(q, k, v, np.zeros((2, 1), np.int32), np.zeros(2, np.int32),
                                           mask=k), "mask"),
])
def test_refused_combinations_are_refused(rng, call, match):
    """What the covering array leaves out (coverage.CONSTRAINTS) the API refuses, by name."""
    q, k, v = (jnp.asarray(rng.standard_normal((2, 16, 2, 32)), jnp.float32) for _ in range(3))
    with pytest.raises((ValueError, TypeError, NotImplementedError), match=match):
        call(q, k, v)
