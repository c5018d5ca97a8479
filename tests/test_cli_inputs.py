"""`flashgen run` / `emit` input handling (issue 15, item 6): dtype mismatches refused, .npy for
one-input modules, 64-bit modules run in 64 bits, sizes checked before MLIR, --debug anywhere."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from flashgen import cli, execute
from flashgen.errors import UsageError

F32 = """\
func.func public @main(%a: tensor<3xf32>) -> tensor<3xf32> {
  %0 = stablehlo.add %a, %a : tensor<3xf32>
  return %0 : tensor<3xf32>
}
"""
F64_I64 = """\
func.func public @main(%a: tensor<2xf64>, %n: tensor<2xi64>) -> (tensor<2xf64>, tensor<2xi64>) {
  %0 = stablehlo.add %a, %a : tensor<2xf64>
  %1 = stablehlo.add %n, %n : tensor<2xi64>
  return %0, %1 : tensor<2xf64>, tensor<2xi64>
}
"""
I32 = """\
func.func public @main(%n: tensor<2xi32>) -> tensor<2xi32> {
  return %n : tensor<2xi32>
}
"""


def _module(tmp_path, text, name="m.mlir"):
    p = tmp_path / name
    p.write_text(text)
    return p


def _run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    return rc, capsys.readouterr()


@pytest.mark.parametrize("array", [
    np.array([1, 2, 3], np.uint16),                                           # bf16 bits to f32
    np.array([1.5, 2, 3], ml_dtypes.bfloat16).view(np.uint16),
    np.array([1, 2, 3], np.int32),
    np.array([True, False, True]),
    np.array([1, 2, 3], np.complex64),
])
def test_run_refuses_kind_mismatch(tmp_path, capsys, array):
    inp = tmp_path / "in.npz"
    np.savez(inp, arg0=array)
    rc, io_ = _run(capsys, "run", _module(tmp_path, F32), "--inputs", inp)
    assert rc == 2, io_.out
    assert "arg0 has dtype" in io_.err and "refusing to convert" in io_.err
    assert io_.err.count("\n") == 1 and not io_.out


def test_run_accepts_float_widths_and_fitting_ints(tmp_path):
    out = execute.run(_module(tmp_path, F32), [np.array([0.5, 1, 2], np.float64)])
    np.testing.assert_array_equal(out[0], np.array([1, 2, 4], np.float32))
    i32 = _module(tmp_path, I32, "i.mlir")
    assert execute.run(i32, [np.array([5, -7], np.int64)])[0].tolist() == [5, -7]
    with pytest.raises(UsageError, match="outside i32's range"):
        execute.run(i32, [np.array([2**40, 0], np.int64)])


def test_run_npy_for_one_input_module(tmp_path, capsys):
    npy = tmp_path / "x.npy"
    np.save(npy, np.array([1, 2, 3], np.float32))
    rc, io_ = _run(capsys, "run", _module(tmp_path, F32), "--inputs", npy)
    assert rc == 0 and "out0: [3] f32 [2, 4, 6]" in io_.out
    rc, io_ = _run(capsys, "run", _module(tmp_path, F64_I64, "w.mlir"), "--inputs", npy)
    assert rc == 2 and ".npy (one array); @main takes 2 inputs" in io_.err


def test_run_unreadable_inputs_one_line_error(tmp_path, capsys):
    # found by the cli_run fuzz target: an empty file ended in numpy's EOFError traceback
    module = _module(tmp_path, F32)
    empty, truncated, junk = tmp_path / "e.npz", tmp_path / "t.npz", tmp_path / "j.npz"
    empty.write_bytes(b"")
    np.savez(truncated, arg0=np.arange(64, dtype=np.float32))
    truncated.write_bytes(truncated.read_bytes()[:100])
    junk.write_bytes(b"PK\x03\x04" + bytes(40))
    for path in (empty, truncated, junk):
        rc, io_ = _run(capsys, "run", module, "--inputs", path)
        assert rc == 2 and f"cannot read {path}" in io_.err and "Traceback" not in io_.err


def test_run_64_bit_module_in_64_bits(tmp_path, capsys):
    import jax
    assert not jax.config.jax_enable_x64
    a = np.array([1 + 2.0**-40, 3.0])      # not representable in f32
    n = np.array([2**40, -3], np.int64)    # not representable in i32
    out = execute.run(_module(tmp_path, F64_I64), [a, n])
    assert out[0].dtype == np.float64 and out[0][0] == 2 * a[0]
    assert out[1].dtype == np.int64 and out[1].tolist() == [2**41, -6]
    assert not jax.config.jax_enable_x64, "the caller's JAX setting must be restored"
    inp = tmp_path / "in.npz"
    np.savez(inp, arg0=a, arg1=n)
    rc, io_ = _run(capsys, "run", tmp_path / "m.mlir", "--inputs", inp)
    assert rc == 0 and "out0: [2] f64" in io_.out and "out1: [2] i64" in io_.out


@pytest.mark.parametrize("flags,needle", [
    (["--seq-q", "-1"], "seq_q must be a positive integer below 2**31, got -1"),
    (["--seq-q", "8", "--seq-k", "0"], "seq_k must be a positive integer"),
    (["--seq-q", "8", "--batch", "-2"], "batch must be a positive integer"),
    (["--seq-q", str(10**30)], "seq_q must be a positive integer below 2**31"),  # found by fuzz
    (["--seq-q", "8", "--kv-heads", "3"], "heads (2) must be a multiple of kv_heads (3)"),
])
def test_emit_bad_sizes_one_line_error(capsys, flags, needle):
    rc, io_ = _run(capsys, "emit", "--hdim", "64", "--heads", "2", *flags)
    assert rc == 2 and needle in io_.err
    assert "Traceback" not in io_.err and "MLIR" not in io_.err and io_.err.count("\n") == 1


def test_debug_after_the_subcommand(capsys):
    rc, io_ = _run(capsys, "emit", "--hdim", "64", "--heads", "2", "--seq-q", "4", "--debug")
    assert rc == 0 and "flashgen_fwd_d64_bf16" in io_.out
    with pytest.raises(UsageError):  # --debug lets the exception through, wherever it stands
        cli.main(["emit", "--hdim", "64", "--heads", "2", "--seq-q", "-1", "--debug"])
