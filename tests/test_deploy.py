"""Shipping a built library: it runs on a host without any compiler (flashgen run --library,
flashgen.jax.load), and a cached hit needs no compiler either."""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from flashgen import KernelSpec, build, reference

SPEC = KernelSpec(32, "f32", False, "cpu")
REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """SPEC built (through the default cache) and copied out, as a user ships it."""
    out = tmp_path_factory.mktemp("shipped")
    build([SPEC], out=out)
    return out


@pytest.fixture
def no_compiler(tmp_path):
    """The environment of a serving host: no compiler on PATH, no CXX/NVCC, an empty cache."""
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "NVCC")}
    env.update(PATH=str(empty_bin), PYTHONPATH=str(REPO),
               FLASHGEN_CACHE_DIR=str(tmp_path / "empty-cache"))
    return env


def test_the_environment_really_has_no_compiler(no_compiler):
    code = "from flashgen import toolchain; toolchain.cxx()"
    r = subprocess.run([sys.executable, "-c", code], env=no_compiler, capture_output=True, text=True)
    assert r.returncode != 0 and "no C++ compiler found" in r.stderr


def _inputs(rng):
    q, k, v = (rng.standard_normal((1, 16, 2, 32)).astype(np.float32) for _ in range(3))
    return q, k, v


def test_run_library_without_a_compiler(shipped, no_compiler, tmp_path, rng):
    mlir = tmp_path / "attn.mlir"
    r = subprocess.run([sys.executable, "-m", "flashgen", "emit", "--hdim", "32", "--dtype", "f32",
                        "--seq-q", "16", "--heads", "2", "--module"], env=no_compiler,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    mlir.write_text(r.stdout)
    q, k, v = _inputs(rng)
    np.savez(tmp_path / "in.npz", arg0=q, arg1=k, arg2=v)
    outputs = tmp_path / "out.npz"
    np.savez(outputs, out0=np.full(1, np.nan))  # poison: a run that writes nothing fails below
    r = subprocess.run([sys.executable, "-m", "flashgen", "run", str(mlir), "--library", str(shipped),
                        "--inputs", str(tmp_path / "in.npz"), "--outputs", str(outputs)],
                       env=no_compiler, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = np.load(outputs)
    o, lse = reference.attention(q, k, v)[:2]
    assert np.max(np.abs(got["out0"] - o)) < 1e-4
    assert np.max(np.abs(got["out1"] - lse)) < 1e-4
    assert not list(pathlib.Path(no_compiler["FLASHGEN_CACHE_DIR"]).glob("libs/*"))  # nothing built

    # A library that lacks a target the module calls is named, not built.
    mlir64 = tmp_path / "attn64.mlir"
    mlir64.write_text(r"""
func.func @main(%q: tensor<1x8x1x64xf32>) -> tensor<1x8x1x64xf32> {
  %o:2 = stablehlo.custom_call @flashgen_fwd_d64_f32(%q, %q, %q) {api_version = 4 : i32,
    backend_config = {bottom_right = false, causal = false, extras = "", scale = 0.125 : f32,
    softcap = 0.0 : f32, window_left = -1 : i32, window_right = -1 : i32}}
    : (tensor<1x8x1x64xf32>, tensor<1x8x1x64xf32>, tensor<1x8x1x64xf32>)
    -> (tensor<1x8x1x64xf32>, tensor<1x1x8xf32>)
  return %o#0 : tensor<1x8x1x64xf32>
}""")
    r = subprocess.run([sys.executable, "-m", "flashgen", "run", str(mlir64), "--library", str(shipped)],
                       env=no_compiler, capture_output=True, text=True)
    assert r.returncode == 1 and "does not provide flashgen_fwd_d64_f32" in r.stderr, r.stderr


JAX_LOAD = """
import sys, numpy as np, jax, jax.numpy as jnp
import flashgen.jax as fj
from flashgen import reference
fj.load(sys.argv[1])
rng = np.random.default_rng()
q, k, v = (rng.standard_normal((1, 16, 2, 32)).astype(np.float32) for _ in range(3))
do = rng.standard_normal(q.shape).astype(np.float32)
o, vjp = jax.vjp(lambda q, k, v: fj.flash_attention(q, k, v), q, k, v)
grads = vjp(jnp.asarray(do))
ref = reference.attention(q, k, v, do=do)
assert np.max(np.abs(np.asarray(o) - ref[0])) < 1e-4
for got, want in zip(grads, ref[2]):
    assert np.max(np.abs(np.asarray(got) - want)) < 1e-3, np.max(np.abs(np.asarray(got) - want))
print("ok")
"""


def test_jax_load_without_a_compiler(shipped, no_compiler):
    r = subprocess.run([sys.executable, "-c", JAX_LOAD, str(shipped)], env=no_compiler,
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_a_library_for_a_richer_cpu_is_refused_not_run(shipped, tmp_path):
    """-march=native code on a CPU without the build host's extensions would die of SIGILL."""
    from flashgen import cache
    copy = tmp_path / "copy"
    shutil.copytree(shipped, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["manifest_sha256"]
    manifest["cpu_isa"] = sorted((manifest.get("cpu_isa") or []) + ["avx9000_imaginary"])
    (copy / "manifest.json").write_text(cache.seal(manifest))
    r = subprocess.run([sys.executable, "-c", f"import flashgen.jax as fj; fj.load({str(copy)!r})"],
                       env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "built for a CPU with avx9000_imaginary, which this CPU lacks" in r.stderr


def test_cached_hit_needs_no_compiler(no_compiler):
    """The lookup runs no compiler: a cache filled on a build host serves a host without one."""
    build([SPEC])  # the default cache holds SPEC
    env = dict(no_compiler, FLASHGEN_CACHE_DIR=os.environ.get("FLASHGEN_CACHE_DIR", ""))
    if not env["FLASHGEN_CACHE_DIR"]:
        del env["FLASHGEN_CACHE_DIR"]
    code = ("import flashgen; lib = flashgen.build([flashgen.KernelSpec(32, 'f32', False, 'cpu')]); "
            "print(lib.cache_hit)")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-3000:]


def test_a_manifest_of_another_name_is_refused_not_swapped(shipped, tmp_path):
    """dir/bf16_manifest.json used to load dir/manifest.json, a different library, silently."""
    from flashgen import runtime
    from flashgen.errors import LoadError
    copy = tmp_path / "copy"
    shutil.copytree(shipped, copy)
    (copy / "bf16_manifest.json").write_text((copy / "manifest.json").read_text())
    with pytest.raises(LoadError, match="bf16_manifest.json is not a flashgen manifest"):
        runtime.load(copy / "bf16_manifest.json")
    assert runtime.library_platform(copy / "manifest.json") == "cpu"
