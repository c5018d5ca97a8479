"""`flashgen run` and flashgen.execute."""
from __future__ import annotations

import pathlib

import ml_dtypes
import numpy as np
import pytest

from flashgen import cli, execute
from flashgen.errors import UsageError

GOLDEN = pathlib.Path(__file__).parent / "golden" / "inputs"

ADD = """\
func.func public @main(%a: tensor<2x3xf32>, %b: tensor<3xbf16>) -> (tensor<2x3xf32>, tensor<3xbf16>) {
  %0 = stablehlo.add %a, %a : tensor<2x3xf32>
  %1 = stablehlo.multiply %b, %b : tensor<3xbf16>
  return %0, %1 : tensor<2x3xf32>, tensor<3xbf16>
}
"""


@pytest.fixture
def add_module(tmp_path):
    p = tmp_path / "add.mlir"
    p.write_text(ADD)
    return p


def test_run_api_bf16(add_module):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([1.5, 2, 3], ml_dtypes.bfloat16)
    out = execute.run(add_module, [a, b])
    np.testing.assert_array_equal(out[0], a * 2)
    assert out[1].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out[1].astype(np.float32), [2.25, 4, 9])


@pytest.mark.parametrize("carrier", ["uint16", "void"])
def test_cli_run_npz_bf16_carriers(add_module, tmp_path, capsys, carrier):
    b = np.array([1.5, 2, 3], ml_dtypes.bfloat16)
    b = b.view(np.uint16) if carrier == "uint16" else b  # np.savez writes bfloat16 as |V2
    inp, outp = tmp_path / "in.npz", tmp_path / "out.npz"
    np.savez(inp, arg0=np.ones((2, 3), np.float32), arg1=b)
    assert cli.main(["run", str(add_module), "--inputs", str(inp), "--outputs", str(outp)]) == 0
    res = np.load(outp)
    assert sorted(res.files) == ["out0", "out1"]
    np.testing.assert_array_equal(res["out0"], np.full((2, 3), 2, np.float32))
    assert res["out1"].dtype == np.uint16
    np.testing.assert_array_equal(res["out1"].view(ml_dtypes.bfloat16).astype(np.float32),
                                  [2.25, 4, 9])
    assert "out0: [2, 3] f32" in capsys.readouterr().out


@pytest.mark.parametrize("arrays,needle", [
    (dict(arg0=np.ones((2, 3), np.float32)), "missing arg1"),
    (dict(arg0=np.ones((2, 3), np.float32), arg1=np.ones(3, np.uint16), arg2=np.ones(1)),
     "unexpected arg2"),
    (dict(arg0=np.ones((3, 2), np.float32), arg1=np.ones(3, np.uint16)), "arg0 has shape [3, 2]"),
    (dict(arg0=np.ones((2, 3), np.complex64), arg1=np.ones(3, np.uint16)), "dtype"),
])
def test_cli_run_bad_inputs(add_module, tmp_path, capsys, arrays, needle):
    inp = tmp_path / "in.npz"
    np.savez(inp, **arrays)
    rc = cli.main(["run", str(add_module), "--inputs", str(inp)])
    err = capsys.readouterr().err
    assert rc == 2
    assert needle in err and err.count("\n") == 1


def test_cli_run_missing_npz(add_module, tmp_path, capsys):
    assert cli.main(["run", str(add_module), "--inputs", str(tmp_path / "no.npz")]) == 2
    assert "no such inputs file" in capsys.readouterr().err


def test_run_jax_exported_and_random_inputs(capsys):
    rc = cli.main(["run", str(GOLDEN / "jnn_causal_exported.jax_exported")])
    assert rc == 0 and "out0: [2, 8, 4, 32] f32" in capsys.readouterr().out


def test_run_rewritten_module_registers_kernels(tmp_path):
    import flashgen.rewrite as fr
    src = GOLDEN / "jnn_gqa_causal.mlir"
    out = tmp_path / "o.mlir"
    out.write_bytes(fr.rewrite(src).to_bytes())
    params, _ = execute.signature(src)
    x = execute.random_inputs(params, 3)
    ref = execute.run(src, x, register=False)
    got = execute.run(out, x)
    assert execute.flashgen_targets(out) == ["flashgen_fwd_d32_f32_causal"]
    np.testing.assert_allclose(got[0], ref[0], atol=1e-4, rtol=1e-4)


def test_coerce_inputs_errors():
    params = [execute.TensorType((2,), np.dtype(np.float32), "f32")]
    with pytest.raises(UsageError, match="takes 1 inputs, got 0"):
        execute.coerce_inputs([], params)
    out = execute.coerce_inputs([np.ones(2, np.float64)], params)
    assert out[0].dtype == np.float32


def test_compare_tolerances():
    ref = [np.ones(4, np.float32)]
    assert execute.compare(ref, [ref[0] + 1e-4])[0]["ok"]
    assert not execute.compare(ref, [ref[0] + 1e-2])[0]["ok"]
    assert execute.compare(ref, [ref[0] + 1e-2], "bf16")[0]["ok"]
    assert not execute.compare([np.arange(3)], [np.arange(3) + 1])[0]["ok"]


def test_ctrl_c_stops_a_long_run_between_work_items(tmp_path):
    """SIGINT used to have no effect on a long `flashgen run` (only SIGTERM stopped it): the
    kernels now stop at their next work item and the run ends with rc 130 and one line."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from flashgen import KernelSpec, build
    build([KernelSpec(64, "f32", False, "cpu")])  # the child finds it in the cache
    module = tmp_path / "long.mlir"  # about 4 TFLOP: minutes on a laptop
    emitted = subprocess.run([sys.executable, "-m", "flashgen", "emit", "--hdim", "64", "--dtype",
                              "f32", "--seq-q", "131072", "--heads", "1", "--module"],
                             capture_output=True, text=True, check=True)
    module.write_text(emitted.stdout)
    # Python's own Ctrl-C handler even where this test runs with SIGINT ignored (a background job)
    start = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "sys.argv[0] = 'flashgen'; runpy.run_module('flashgen', run_name='__main__')")
    child = subprocess.Popen([sys.executable, "-c", start, "run", str(module)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(5)  # imports, random inputs, compile: the kernel is running by now
    assert child.poll() is None, child.communicate()
    child.send_signal(signal.SIGINT)
    sent = time.monotonic()
    try:
        out, err = child.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        pytest.fail("flashgen run ignored SIGINT for 10 s")
    assert time.monotonic() - sent < 5
    assert child.returncode == 130 and "out0" not in out, (out, err)
    assert err.strip().splitlines()[-1] == "flashgen: interrupted", err
    assert os.path.exists(module)


def test_ctrl_c_in_python_stops_the_kernels_and_the_next_run_works(tmp_path):
    """execute.run (the Python API under flashgen run) raises KeyboardInterrupt with the
    kernels stopped -- its computation ends, it is not left running -- and clears the flag."""
    import os
    import signal
    import threading
    import time
    from flashgen import emit, KernelSpec
    spec = KernelSpec(64, "f32", False, "cpu")
    long = str(emit.attention_module(spec, batch=1, seq_q=131072, seq_k=131072, heads=1))
    short = str(emit.attention_module(spec, batch=1, seq_q=64, seq_k=64, heads=1))
    params, _ = execute.signature(long)
    inputs = execute.random_inputs(params)
    execute.run(short, execute.random_inputs(execute.signature(short)[0]))  # build, warm up
    # Python takes SIGINT as KeyboardInterrupt only if its parent did not ignore it (a
    # background job's does): this test is about what follows a Ctrl-C, so it installs that.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            execute.run(long, inputs)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - t0 < 2.0 + execute.CANCEL_WAIT_SECONDS
    assert not any(t.name == execute.RUN_THREAD and t.is_alive() for t in threading.enumerate())
    o, lse = execute.run(short, execute.random_inputs(execute.signature(short)[0]))
    assert np.isfinite(o).all() and np.isfinite(lse).all()


def test_out_of_memory_is_one_line_naming_what_ran_out(tmp_path):
    """An original attention too large for the memory given (here: RLIMIT_AS 3 GiB, its 8192^2
    x 4 heads f32 scores) used to end in a raw XLA traceback when the failure came as the
    results were fetched (YNNPACK); now one line, and the rewritten module alone still runs."""
    import subprocess
    import sys
    import jax
    import jax.numpy as jnp
    x = jax.ShapeDtypeStruct((1, 8192, 4, 64), jnp.float32)
    exported = jax.export.export(jax.jit(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla")))(x, x, x)
    original, rewritten = tmp_path / "attention.mlir", tmp_path / "attention.flash.mlir"
    original.write_text(exported.mlir_module())
    limited = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, "
               "3 << 30)); sys.argv[0] = 'flashgen'; runpy.run_module('flashgen', run_name='__main__')")

    def flashgen(*argv):
        return subprocess.run([sys.executable, "-c", limited, *map(str, argv)],
                              capture_output=True, text=True, timeout=300)
    r = flashgen("rewrite", original, "--verify", "-o", rewritten)
    assert r.returncode == 1 and not rewritten.exists()
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("flashgen: error: --verify: the original module ran out of memory")
    assert "the rewritten module alone may still run" in line
    r = flashgen("run", original)
    (line,) = r.stderr.strip().splitlines()
    assert r.returncode == 1 and "ran out of memory" in line and "flashgen rewrite it" in line
    assert flashgen("rewrite", original, "-o", rewritten).returncode == 0
    r = flashgen("run", rewritten)
    assert r.returncode == 0 and r.stdout.startswith("out0: [1, 8192, 4, 64] f32"), r.stderr


def test_an_error_raised_when_results_are_fetched_is_one_line(monkeypatch, add_module):
    """XLA may fail only as a result is read (YNNPACK's kernels): caught like any other."""
    import jax

    class Failing:
        def __array__(self, *a, **k):
            raise RuntimeError("INTERNAL: YNNPACK operation failed")
    monkeypatch.setattr(jax.export.Exported, "call", lambda self, *a, **k: [Failing()])
    with pytest.raises(execute.OutOfMemory, match="ran out of memory running the module "
                                                  r"\(INTERNAL: YNNPACK operation failed\)"):
        execute.run(add_module, execute.random_inputs(execute.signature(add_module)[0]))


@pytest.mark.parametrize("edit, words", [
    (lambda t: t.replace(" : f32, softcap", " : f64, softcap", 1), "attribute scale is f64, expected f32"),
    (lambda t: t.replace("window_left = -1 : i32", "window_left = -1 : i64"),
     "attribute window_left is i64, expected i32"),
    (lambda t: t.replace(", window_left = -1 : i32", ""), "attribute window_left is missing (expected i32)"),
    (lambda t: t.replace("(%arg0, %arg1, %arg2)", "(%arg0, %arg1, %arg3)").replace(
        "%arg2: tensor<1x8x1x32xf32>", "%arg2: tensor<1x8x1x32xf32>, %arg3: tensor<1x8x1x32xf16>").replace(
        "tensor<1x8x1x32xf32>) -> (tensor<1x8x1x32xf32>, tensor<1x1x8xf32>)",
        "tensor<1x8x1x32xf16>) -> (tensor<1x8x1x32xf32>, tensor<1x1x8xf32>)", 1),
     "operand 2 (v) is f16, expected f32"),
])
def test_a_call_against_the_contract_is_named_before_xla(tmp_path, capsys, edit, words):
    """XLA's decoder said only "Failed to decode all FFI handler operands (bad operands at: 8)"."""
    from flashgen import emit, KernelSpec
    text = str(emit.attention_module(KernelSpec(32, "f32", False, "cpu"), batch=1, seq_q=8, seq_k=8,
                                     heads=1))
    bad = edit(text)
    assert bad != text
    path = tmp_path / "bad.mlir"
    path.write_text(bad)
    rc = cli.main(["run", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and f"the call of flashgen_fwd_d32_f32 at " in err and words in err, err
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")):
        import flashgen.jax
        flashgen.jax.check_calls(bad)


def test_check_calls_reads_an_exported_the_jax_path_calls():
    import jax
    import jax.numpy as jnp
    import flashgen.jax
    from flashgen import KernelSpec, runtime
    runtime.ensure([KernelSpec(32, "f32", False, "cpu")])
    q = jax.ShapeDtypeStruct((1, 8, 2, 32), jnp.float32)
    outs = (q, jax.ShapeDtypeStruct((1, 2, 8), jnp.float32))
    call = jax.ffi.ffi_call("flashgen_fwd_d32_f32", outs)
    exported = flashgen.jax.export(lambda a, b, c: call(
        a, b, c, causal=False, scale=np.float32(0.2), bottom_right=False, window_left=np.int32(-1),
        window_right=np.int32(-1), softcap=np.float32(0), extras=""), q, q, q)
    flashgen.jax.check_calls(exported)  # well-formed
    exported = flashgen.jax.export(lambda a, b, c: call(
        a, b, c, causal=False, scale=0.2, bottom_right=False, window_left=np.int32(-1),
        window_right=np.int32(-1), softcap=np.float32(0), extras=""), q, q, q)
    with pytest.raises(UsageError, match="attribute scale is f64, expected f32"):
        flashgen.jax.check_calls(exported)
