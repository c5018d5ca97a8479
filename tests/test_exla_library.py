"""`flashgen build --for exla`: a library that registers its handlers when a host loads it."""
import json
import subprocess

import jax.ffi

from flashgen import KernelSpec, build, toolchain
from flashgen.spec import DIRECTIONS

SPECS = [KernelSpec(32, "f32", False, "cpu"), KernelSpec(32, "f32", True, "cpu")]


def test_exla_library_registers_statically_on_load(tmp_path):
    lib = build(SPECS, host="exla")
    m = json.loads(lib.manifest_path.read_text())
    assert m["host"] == "exla" and not m["python_face"] and m["undefined_symbols"] == ["XLA_FFI_GetApi"]

    syms = subprocess.run(["nm", "-D", str(lib.path)], capture_output=True, text=True).stdout
    assert " U XLA_FFI_GetApi" in syms  # resolved from the host's XLA at load time
    assert "PyInit" not in syms and "Py_" not in syms  # no Python: loads into a BEAM process
    names = [s.target_name(d) for s in SPECS for d in DIRECTIONS]
    for n in names:
        assert f" T {n}\n" in syms

    host = tmp_path / "host"
    subprocess.run([toolchain.cxx(), "-std=c++17", "-rdynamic", "-I", jax.ffi.include_dir(),
                    "tests/cpp/fake_xla_host.cc", "-o", str(host), "-ldl"], check=True)
    out = subprocess.run([str(host), str(lib.path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == sorted(f"{n} Host execute" for n in names)


def test_python_library_has_no_static_registration():
    syms = subprocess.run(["nm", "-D", str(build(SPECS[:1]).path)], capture_output=True, text=True).stdout
    assert "XLA_FFI_GetApi" not in syms
