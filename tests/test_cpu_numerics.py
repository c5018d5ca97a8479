"""CPU backend numerics: forward and gradients against the float64 reference.

Tolerances (relative to max(max |reference|, 1) of each output), stated once:
  f32: 2e-5 forward, 1e-4 gradients   (fp32 compute, different summation order)
  f16: 3e-3 forward, 1e-2 gradients   (inputs/outputs rounded to 11-bit mantissas)
  bf16: 2e-2 forward, 5e-2 gradients  (8-bit mantissas)
"""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashgen import KernelSpec, build, reference, runtime
from flashgen.jax import flash_attention
from flashgen.spec import DTYPES, HEAD_DIMS

TOL = {"f32": (2e-5, 1e-4), "f16": (3e-3, 1e-2), "bf16": (2e-2, 5e-2)}
JNP = {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16}


@pytest.fixture(scope="module", autouse=True)
def all_cpu_specs():
    """One library with every CPU spec, compiled in parallel (cached across runs)."""
    specs = [KernelSpec(h, t, c, "cpu") for h in HEAD_DIMS for t in DTYPES for c in (False, True)]
    runtime.load(build(specs).path)


def _inputs(rng, dtype, b, sq, sk, hq, hkv, d):
    shapes = [(b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d)]
    return [jnp.asarray(rng.standard_normal(s), JNP[dtype]) for s in shapes]


def _rel(got, want):
    # Relative to the output's magnitude, floored at 1 (inputs are standard normal): with one
    # visible key the exact dq/dk are 0, a sum of terms that cancel, and rounding in those terms
    # is not a relative error of the result.
    want = np.asarray(want, np.float64)
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / max(np.max(np.abs(want)), 1.0))


def check(rng, dtype, d, causal, b=1, sq=17, sk=17, hq=2, hkv=2, bottom_right=False, scale=None):
    q, k, v, do = _inputs(rng, dtype, b, sq, sk, hq, hkv, d)
    fn = lambda q, k, v: flash_attention(q, k, v, causal=causal, scale=scale, bottom_right=bottom_right)
    o, vjp = jax.vjp(jax.jit(fn), q, k, v)
    grads = vjp(do)
    ref_o, _, ref_g = reference.attention(q, k, v, causal=causal, scale=scale, bottom_right=bottom_right,
                                          do=do)
    fwd_tol, bwd_tol = TOL[dtype]
    errs = {"o": _rel(o, ref_o), **{n: _rel(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_g)}}
    assert errs["o"] <= fwd_tol, errs
    assert max(errs["dq"], errs["dk"], errs["dv"]) <= bwd_tol, errs
    return errs


@pytest.mark.parametrize("d, dtype, causal", list(itertools.product(HEAD_DIMS, DTYPES, (False, True))))
def test_every_spec(rng, d, dtype, causal):
    check(rng, dtype, d, causal, b=2, sq=33, sk=33, hq=2, hkv=1)


@pytest.mark.parametrize("sq, sk", [(1, 1), (17, 17), (129, 129), (17, 129), (129, 17), (1, 129), (129, 1)])
@pytest.mark.parametrize("causal, bottom_right", [(False, False), (True, False), (True, True)])
def test_lengths_and_alignment(rng, sq, sk, causal, bottom_right):
    check(rng, "f32", 64, causal, sq=sq, sk=sk, bottom_right=bottom_right)


@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_mqa(rng, hq, hkv, dtype):
    check(rng, dtype, 64, True, b=2, sq=65, sk=65, hq=hq, hkv=hkv)


def test_bottom_right_fully_masked_rows_are_zero(rng):
    # Sq > Sk with bottom-right alignment: the first Sq - Sk queries see no key.
    q, k, v, _ = _inputs(rng, "f32", 1, 9, 4, 2, 2, 32)
    o = flash_attention(q, k, v, causal=True, bottom_right=True)
    assert np.all(np.asarray(o)[:, :5] == 0)
    g = jax.grad(lambda q, k, v: flash_attention(q, k, v, causal=True, bottom_right=True).sum(), (0, 1, 2))(q, k, v)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in g)
    assert np.all(np.asarray(g[0])[:, :5] == 0)


def test_alignment_is_an_explicit_attribute(rng):
    """top-left (jnp.tril) and bottom-right differ for Sq != Sk and each matches its reference."""
    q, k, v, _ = _inputs(rng, "f32", 1, 8, 16, 2, 2, 32)
    tl = flash_attention(q, k, v, causal=True)
    br = flash_attention(q, k, v, causal=True, bottom_right=True)
    assert _rel(tl, reference.attention(q, k, v, causal=True)[0]) < 2e-5
    assert _rel(br, reference.attention(q, k, v, causal=True, bottom_right=True)[0]) < 2e-5
    assert _rel(tl, br) > 1e-2
    # top-left causal equals jax.nn.dot_product_attention's causal (which builds jnp.tril).
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    assert _rel(tl, ref) < 2e-5


def test_custom_scale(rng):
    check(rng, "f32", 32, False, scale=0.37)
