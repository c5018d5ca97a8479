"""NaN and overflow (README "NaN and overflow"): IEEE over the keys a row sees, masks select.

Each case puts a NaN or an overflow where a user's model can: a NaN in one query row, in one
key, in a V row that some rows do not see (a drawn row, and the last rows of the CPU forward's
packed chunks), in one dO row, an inf in a V row, in a key hidden by a mask or a -inf bias, scores
that overflow f32 (scale 1e38), a tiny softcap, and checks
o, lse and the gradients against flashgen.reference (float64, the same rules) — NaN where the
reference is NaN, finite and within tolerance elsewhere. The kernels run in a subprocess with
FLASHGEN_POISON=finite (outputs pre-filled with a large finite value), so a NaN the test
expects cannot come from an element the kernel never wrote.
"""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from conftest import assert_nan_where_the_reference_is, needs_nvcc
from flashgen import execute, reference
from flashgen.contract import normalize_softcap

HERE = pathlib.Path(__file__).resolve().parent
GOLDEN = HERE / "golden" / "inputs"
TOL = {"f32": (2e-5, 1e-4), "bf16": (2e-2, 5e-2)}

# name: (dtype, causal, Sq, Sk, what to poison); B=1, Hq=2, Hkv=1, D=32.
CASES = {
    "q_row": ("f32", False, 33, 33, "q"),
    "q_row_causal": ("f32", True, 70, 70, "q"),
    "k_key_causal": ("f32", True, 70, 70, "k"),
    "v_row_causal": ("f32", True, 70, 70, "v"),
    # Several q blocks and key blocks: the forward packs K / V once per call.
    "v_row_causal_long": ("f32", True, 2100, 2100, "v"),
    # NaN at V rows 63 and Sk - 1: the last rows of the packed chunks, pinned (nan_worker.py).
    "v_chunk_ends_causal_packed": ("f32", True, 130, 130, "v_chunk_ends"),
    # NaN at V row 130 under a left window of 50: key blocks straddle the packed chunks (nan_worker.py).
    "v_window_straddle_causal_packed": ("f32", True, 256, 256, "v_window_straddle"),
    "k_key_bf16": ("bf16", True, 70, 70, "k"),
    "v_row_causal_bf16": ("bf16", True, 70, 70, "v_odd_bf16"),
    # Unmasked, several key blocks: a NaN key after the first block meets the forward's
    # exponentials in the product's epilogue (csrc/flashgen/cpu/fwd_tiles.h ExpAgainst).
    "k_key_full_long": ("f32", False, 400, 400, "k"),
    "overflow": ("f32", False, 33, 33, "scale"),
    "overflow_causal": ("f32", True, 33, 33, "scale"),
    "softcap_tiny": ("f32", True, 33, 33, "softcap"),
    "masked_by_mask": ("f32", False, 40, 40, "mask"),
    "masked_by_bias": ("f32", False, 40, 40, "bias"),
    # Sk > 64: the backward packs q / dO, and a NaN dO row must not reach the keys it does not see.
    "do_row_causal_packed": ("f32", True, 130, 130, "do"),
    # +inf in a V row: inf for the rows that see it (NaN where 0 · inf meets it), nothing for the others.
    "v_inf_row_causal_packed": ("f32", True, 130, 130, "v_inf"),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Runs tests/nan_worker.py once (every case) and loads what it saved."""
    out = tmp_path_factory.mktemp("nan")
    env = {**os.environ, "FLASHGEN_POISON": "finite", "PYTHONPATH": str(HERE.parent)}
    run = subprocess.run([sys.executable, str(HERE / "nan_worker.py"), str(out), json.dumps(CASES)],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {name: dict(np.load(out / f"{name}.npz")) for name in CASES}


def _check(res, name, rows_nan=None, outputs=("o", "lse", "dq", "dk", "dv")):
    dtype = CASES[name][0]
    fwd_tol, bwd_tol = TOL[dtype]
    for out in outputs:
        assert_nan_where_the_reference_is(res[out], res["ref_" + out], fwd_tol if out in ("o", "lse") else bwd_tol,
                                          f"{name} {out}")
    if rows_nan is not None:  # the reproduction, stated directly: these rows, and only these, are NaN
        nan_rows = np.isnan(res["o"][0, :, 1]).any(axis=-1)
        np.testing.assert_array_equal(np.flatnonzero(nan_rows), rows_nan)


def test_nan_in_a_query_row_makes_that_row_nan(results):
    r = results["q_row"]
    _check(r, "q_row", rows_nan=[int(r["at"])])
    assert np.isnan(r["lse"][0, 1, int(r["at"])])
    # The row sees every key: every key's dk, dv (of the head's group) are NaN, other dq rows are not.
    assert np.isnan(r["dk"]).all() and np.isfinite(np.delete(r["dq"], int(r["at"]), axis=1)).all()


def test_nan_in_a_query_row_causal(results):
    _check(results["q_row_causal"], "q_row_causal")


def test_nan_in_a_key_reaches_exactly_the_rows_that_see_it(results):
    r = results["k_key_causal"]
    j = int(r["at"])
    _check(r, "k_key_causal", rows_nan=list(range(j, 70)))


def test_nan_in_a_key_non_causal_reaches_every_row(results):
    _check(results["k_key_full_long"], "k_key_full_long", rows_nan=list(range(400)))


def test_nan_in_a_key_bf16(results):
    r = results["k_key_bf16"]
    _check(r, "k_key_bf16", rows_nan=list(range(int(r["at"]), 70)))


@pytest.mark.parametrize("name", ["v_row_causal", "v_row_causal_long", "v_chunk_ends_causal_packed",
                                  "v_row_causal_bf16"])
def test_nan_in_a_v_row_skips_rows_that_do_not_see_it(results, name):
    """Masked keys contribute nothing, not even 0 · NaN (where jax's dense P·V would leak)."""
    r = results[name]
    _check(r, name, rows_nan=list(range(int(r["at"]), CASES[name][2])))


def test_nan_in_a_v_row_under_a_window_reaches_the_rows_whose_window_holds_it(results):
    """Rows 130-180 see key 130 (causal, 50 keys back), the others do not."""
    name = "v_window_straddle_causal_packed"
    _check(results[name], name, rows_nan=list(range(130, 181)))


def test_nan_in_a_do_row_reaches_the_gradients_of_what_that_row_sees(results):
    """dq of that row, dk / dv of the keys it sees (causal: up to its own), nothing else."""
    _check(results["do_row_causal_packed"], "do_row_causal_packed")


def test_inf_in_a_v_row_skips_rows_that_do_not_see_it(results):
    r = results["v_inf_row_causal_packed"]
    _check(r, "v_inf_row_causal_packed")
    assert np.isfinite(r["o"][0, :int(r["at"])]).all()


def test_a_key_masked_by_the_user_stays_masked_even_if_nan(results):
    """A boolean mask or a -inf bias hides a NaN key and V row from even rows: those stay finite
    (o and gradients; dbias is not returned here), odd rows that see it are NaN."""
    for name in ("masked_by_mask", "masked_by_bias"):
        r = results[name]
        _check(r, name, rows_nan=list(range(1, 40, 2)) if name == "masked_by_bias" else None)
        assert np.isfinite(r["o"][0, ::2]).all()


def test_overflowed_scores_are_not_masked(results):
    """scale = 1e38: inf scores make their rows NaN (as IEEE softmax), never o = 0 / lse = -inf."""
    for name in ("overflow", "overflow_causal"):
        r = results[name]
        # Gradients of the rows that stay finite are ~1e38 · O(1): beyond f32 (the float64
        # reference holds them), so only the forward is compared; a NaN row's dq is NaN.
        _check(r, name, outputs=("o", "lse"))
        assert np.isnan(r["o"]).any() and not (np.asarray(r["lse"]) == -np.inf).any()
        nan_rows = np.isnan(r["lse"][0].T)  # [Sq, Hq]
        assert np.isnan(r["dq"][0][nan_rows]).all()


def test_softcap_tiny_is_computed(results):
    """The smallest normal softcaps work: c·tanh(s/c) with s/c overflowing f32."""
    _check(results["softcap_tiny"], "softcap_tiny")


def test_subnormal_softcap_is_refused():
    """A subnormal softcap would be flushed to 0 (off) on XLA's CPU threads: refused."""
    with pytest.raises(ValueError, match="smallest normal f32"):
        normalize_softcap(1e-38)
    assert normalize_softcap(np.finfo(np.float32).tiny) > 0


@pytest.mark.parametrize("flag, value", [("--scale", "1e-40"), ("--softcap", "1e-39")])
def test_emit_refuses_a_subnormal_scale_or_softcap(capsys, flag, value):
    """`emit --scale 1e-40` used to emit a scale the handler refuses later."""
    from flashgen import cli
    rc = cli.main(["emit", "--hdim", "32", "--dtype", "f32", "--seq-q", "8", "--heads", "1",
                   flag, value])
    err = capsys.readouterr().err
    assert rc == 2 and f"{flag[2:]} {value} is below the smallest normal f32" in err, err


def test_handler_refuses_subnormal_softcap_and_scale(rng):
    import jax
    import jax.numpy as jnp
    from flashgen import KernelSpec, runtime
    runtime.ensure([KernelSpec(32, "f32", False, "cpu")])
    q = jnp.asarray(rng.standard_normal((1, 8, 2, 32)), jnp.float32)
    outs = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((1, 2, 8), jnp.float32))
    attrs = dict(causal=False, scale=np.float32(0.2), bottom_right=False, window_left=np.int32(-1),
                 window_right=np.int32(-1), softcap=np.float32(0), extras="")
    call = lambda **kw: jax.jit(lambda *a: jax.ffi.ffi_call("flashgen_fwd_d32_f32", outs)(
        *a, **{**attrs, **kw}))(q, q, q)
    call()  # the well-formed call runs
    for kw, what in (({"softcap": np.float32(1e-38)}, "softcap is a subnormal"),
                     ({"scale": np.float32(1e-40)}, "scale is a subnormal")):
        with pytest.raises(Exception, match=what):
            call(**kw)


def test_verify_compares_nan_patterns_and_says_where_they_differ():
    ref = [np.array([[1.0, np.nan], [np.inf, 2.0]], np.float32)]
    assert execute.compare(ref, [ref[0].copy()])[0]["ok"]
    got = [np.array([[1.0, 0.0], [np.inf, 2.0]], np.float32)]
    row = execute.compare(ref, got)[0]
    assert not row["ok"] and row["nonfinite_mismatch"] == 1 and row["max_error"] == 0.0
    text = execute.describe(row)
    assert "1 element(s) NaN or infinite" in text and "[0, 1]" in text and "nan" in text
    got = [np.array([[1.0, np.nan], [-np.inf, 2.0]], np.float32)]  # -inf for +inf
    assert execute.compare(ref, got)[0]["nonfinite_mismatch"] == 1


def test_rewritten_diverging_model_matches_the_original_nan_for_nan():
    """A model whose scores overflow (huge keys) and with a NaN query row: the rewritten
    program is NaN exactly where the original is, and equal elsewhere (--verify's check)."""
    from flashgen import rewrite
    from flashgen.rewrite import modules
    result = rewrite(GOLDEN / "jnn_f32.mlir")
    assert result.changed
    original = modules.load(result.loaded.data)
    params, _ = execute.signature(original)
    q, k, v = (np.array(x) for x in execute.random_inputs(params, 7))
    q[0, 3, 1] = np.nan
    # Batch 1, head 2: every score is +inf in any summation order (positive terms >= 5e37).
    q[1, :, 2] = np.abs(q[1, :, 2]) + 0.5
    k[1, :, 2] = np.float32(1e38)
    want = execute.run(original, [q, k, v], register=False)
    got = execute.run(modules.load(result.to_bytes()), [q, k, v])
    row = execute.compare(want, got, "f32")[0]
    assert row["ok"], execute.describe(row)
    assert np.isnan(want[0][0, 3, 1]).all() and np.isnan(want[0][1, :, 2]).all()
    assert np.isfinite(np.delete(want[0][0], 3, axis=0)).all()


# ---------------------------------------------------------------------------------------------
# The CUDA kernels' PTX under the emulator (flashgen/emulate): the same rules, bf16 d64 causal.
# ---------------------------------------------------------------------------------------------
@needs_nvcc
def test_cuda_forward_nan_and_overflow_emulated(rng):
    from emulated_dense import NP_DTYPES, run_dense_forward, spec_module
    module = spec_module(64, "bf16", True)
    b, s, h, d = 1, 77, 1, 64
    q, k, v = (rng.standard_normal((b, s, h, d)).astype(NP_DTYPES["bf16"]) for _ in range(3))
    i0, j = int(rng.integers(2, 20)), int(rng.integers(30, 70))  # a NaN query row, a NaN key
    q[0, i0, 0, 5] = np.nan
    k[0, j, 0, 7] = np.nan
    o, lse, _ = run_dense_forward(module, q, k, v, causal=True, dtype="bf16")
    ro, rlse = reference.attention(q, k, v, causal=True)[:2]
    nan_rows = np.flatnonzero(np.isnan(o[0, :, 0]).any(-1))
    np.testing.assert_array_equal(nan_rows, [i0] + list(range(j, s)))
    assert_nan_where_the_reference_is(o, ro, 2e-2, "o")
    assert_nan_where_the_reference_is(lse, rlse, 1e-4, "lse")
    # Overflowing scores (|q·k| ~ 1e41 in f32): rows NaN, never o = 0 / lse = -inf.
    q, k = (x * NP_DTYPES["bf16"](1e20) for x in (q, k))
    q[0, i0, 0, 5] = k[0, j, 0, 7] = 1.0
    o, lse, _ = run_dense_forward(module, q, k, v, causal=True, dtype="bf16")
    assert not (lse == -np.inf).any() and np.isnan(o).any()
    assert np.array_equal(np.isnan(lse[0, 0]), np.isnan(o[0, :, 0]).any(-1))


@needs_nvcc
def test_cuda_backward_masked_pairs_stay_finite_emulated(rng):
    """A NaN V row: dS = 0 for the pairs that do not see it, so dq of the rows before it stays
    finite (before the fix 0 · NaN reached every row of the tile)."""
    from emulated_dense import NP_DTYPES, run_dense_backward, spec_module
    module = spec_module(64, "bf16", True)
    b, s, h, d = 1, 77, 1, 64
    q, k, v, do = (rng.standard_normal((b, s, h, d)).astype(NP_DTYPES["bf16"]) for _ in range(4))
    j = int(rng.integers(30, 70))
    v[0, j, 0, 3] = np.nan
    (dq, dk, dv), _ = run_dense_backward(module, q, k, v, do, causal=True, dtype="bf16")
    _, _, (rdq, rdk, rdv) = reference.attention(q, k, v, causal=True, do=do)
    np.testing.assert_array_equal(np.flatnonzero(np.isnan(dq[0, :, 0]).any(-1)), list(range(j, s)))
    for got, want, what in ((dq, rdq, "dq"), (dk, rdk, "dk"), (dv, rdv, "dv")):
        assert_nan_where_the_reference_is(got, want, 5e-2, what)
