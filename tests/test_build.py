"""Build, cache and CLI behaviour of `flashgen build` on the CPU target."""
import json
import os
import stat
import subprocess
import sys
import time


import pytest

import flashgen
from flashgen import KernelSpec, build

SPEC = KernelSpec(32, "f32", False, "cpu")


def _cli(*args, env=None, check=False):
    return subprocess.run([sys.executable, "-m", "flashgen", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, check=check)


def test_build_writes_library_and_manifest(fresh_cache, tmp_path):
    lib = build([SPEC], out=tmp_path / "out")
    assert lib.path.exists() and lib.path.parent == tmp_path / "out"
    m = json.loads(lib.manifest_path.read_text())
    assert m["target"] == "cpu" and m["platform"] == "cpu"
    assert m["specs"][0]["targets"] == {
        "fwd": "flashgen_fwd_d32_f32", "bwd": "flashgen_bwd_d32_f32",
        "fwd_varlen": "flashgen_fwd_varlen_d32_f32", "bwd_varlen": "flashgen_bwd_varlen_d32_f32",
        "fwd_paged": "flashgen_fwd_paged_d32_f32"}
    base = {"causal": "i1", "scale": "f32", "bottom_right": "i1",
            "window_left": "i32", "window_right": "i32", "softcap": "f32"}
    assert m["attributes"]["fwd"] == m["attributes"]["fwd_paged"] == {**base, "extras": "string"}
    assert m["attributes"]["bwd"] == {**base, "extras": "string", "deterministic": "i1"}
    assert m["attributes"]["fwd_varlen"] == {**base, "extras": "string", "max_seqlen_q": "i32",
                                             "max_seqlen_k": "i32"}
    assert m["ffi_headers"]["api_version"] and m["ffi_headers"]["jaxlib"]
    assert any("c++" in k or "g++" in k or "clang" in k for k in m["compilers"])
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib.path)], capture_output=True, text=True).stdout
    for name in m["specs"][0]["targets"].values():
        assert f" T {name}\n" in out


def test_second_build_is_a_cache_hit_under_a_second(fresh_cache):
    first = build([SPEC])
    t = time.perf_counter()
    second = build([SPEC])
    assert time.perf_counter() - t < 1.0
    assert second.cache_hit and not first.cache_hit and second.path == first.path


def test_concurrent_builds_compile_once(fresh_cache):
    code = ("import flashgen; from flashgen import KernelSpec; "
            "print(flashgen.build([KernelSpec(32, 'f32', False, 'cpu')]).path)")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    paths = {p.communicate()[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(paths) == 1
    libs = [d for d in (fresh_cache / "libs").iterdir()]
    assert len(libs) == 1 and not libs[0].name.startswith(".tmp")  # no half-written entries left
    objs = sorted(p.name for p in (fresh_cache / "objects").iterdir())
    assert all(n.endswith((".o", ".json")) and not n.startswith(".") for n in objs)  # no temporaries
    assert len(objs) == 6  # spec, library table, python face: each compiled exactly once (+ record)


def test_missing_compiler_is_one_clear_error(fresh_cache, monkeypatch):
    r = _cli("build", "--hdim", "32", "--dtype", "f32", "--target", "cpu",
             env={"CXX": "/nonexistent/c++", "FLASHGEN_CACHE_DIR": str(fresh_cache)})
    assert r.returncode == 1
    assert "CXX='/nonexistent/c++' is not an executable" in r.stderr
    assert "Traceback" not in r.stderr


def test_failing_compiler_reports_its_own_message(fresh_cache, tmp_path):
    fake = tmp_path / "fakecxx"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'fakecxx 1.0'; exit 0; fi\n"
                    "echo 'fatal: out of cheese' >&2; exit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    r = _cli("build", "--hdim", "32", "--dtype", "f32", "--target", "cpu",
             env={"CXX": str(fake), "FLASHGEN_CACHE_DIR": str(fresh_cache)})
    assert r.returncode == 1
    assert "failed (exit 3)" in r.stderr and "out of cheese" in r.stderr
    assert not list((fresh_cache / "libs").glob("*/manifest.json"))  # no entry from a failed build


def test_cli_usage_errors_exit_2_without_traceback():
    for args in (["build", "--hdim", "48", "--target", "cpu"], ["build"], ["emit", "--hdim", "64"],
                 ["build", "--hdim", "64", "--dtype", "int8", "--target", "cpu"]):
        r = _cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr and r.stderr.strip().startswith("flashgen")
    r = _cli("build", "--hdim", "48", "--target", "cpu")
    assert "unsupported head_dim 48" in r.stderr


def test_jobs_must_be_positive():
    for jobs in ("0", "-3", "x"):
        r = _cli("build", "--hdim", "32", "--dtype", "f32", "--target", "cpu", "-j", jobs)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert "-j/--jobs" in r.stderr


def test_version():
    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.startswith(f"flashgen {flashgen.__version__} (jax ")


def test_xla_info_lines_are_quiet(tmp_path):
    mlir = tmp_path / "add.mlir"
    mlir.write_text("func.func @main(%a: tensor<4xf32>) -> tensor<4xf32> {\n"
                    "  %0 = stablehlo.add %a, %a : tensor<4xf32>\n  return %0 : tensor<4xf32>\n}\n")
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    r = subprocess.run([sys.executable, "-m", "flashgen", "run", str(mlir)], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("out0: [4] f32"), r.stderr
    assert not [l for l in r.stderr.splitlines() if l[:1] == "I" and l[1:5].isdigit()], r.stderr


def test_every_subcommand_has_help():
    for sub in ("build", "emit", "demo", "cache"):
        r = _cli(sub, "--help")
        assert r.returncode == 0 and "usage:" in r.stdout


def test_cli_build_prints_library_path(fresh_cache, tmp_path):
    r = _cli("build", "--hdim", "32", "--dtype", "f32", "--both", "--target", "auto", "--out", str(tmp_path),
             env={"FLASHGEN_CACHE_DIR": str(fresh_cache)})
    assert r.returncode == 0, r.stderr
    assert "target: cpu (auto:" in r.stderr or "target: sm" in r.stderr
    # A cold build says what it compiles, each source as it finishes, and where it put the result.
    assert "flashgen: compiling d32_f32_" in r.stderr
    assert "d32_f32_causal_" in r.stderr and "d32_f32_full_" in r.stderr
    assert "library.cc: compiled in" in r.stderr and "flashgen: built " in r.stderr
    path = r.stdout.strip().splitlines()[-1]
    assert os.path.exists(path)
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert sorted(s["causal"] for s in m["specs"]) == [False, True]


def test_compiler_whose_version_probe_hangs_is_one_clear_error(fresh_cache, tmp_path, monkeypatch):
    hung = tmp_path / "hungcxx"
    hung.write_text("#!/bin/sh\nsleep 300\n")
    hung.chmod(hung.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(hung))
    monkeypatch.setattr(flashgen.toolchain, "VERSION_PROBE_SECONDS", 1.0)
    flashgen.toolchain.compiler.cache_clear()
    t = time.perf_counter()
    try:
        with pytest.raises(flashgen.BuildError, match=f"the compiler {hung} did not answer "
                                                      r"`hungcxx --version` within 1 s"):
            build([SPEC])
    finally:
        flashgen.toolchain.compiler.cache_clear()
    assert time.perf_counter() - t < 30


def test_erl_whose_header_probe_hangs_is_one_clear_error(tmp_path, monkeypatch):
    """The NIF face asks `erl` where its headers are; a hung erl (or a wrapper whose child
    holds the pipes) is killed with its process group, not waited on."""
    erl = tmp_path / "erl"
    erl.write_text("#!/bin/sh\nsleep 300 &\nwait\n")
    erl.chmod(erl.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(flashgen.toolchain, "VERSION_PROBE_SECONDS", 1.0)
    t = time.perf_counter()
    with pytest.raises(flashgen.BuildError, match=f"{erl} did not answer where its headers are within 1 s"):
        flashgen.toolchain.erts_include()
    assert time.perf_counter() - t < 30
