"""The standalone C++ tests under tests/cpp, compiled with the host's C++ compiler and run:
test_flash_cpu.cc (the CPU kernels, every variant, against a double reference, with NaN-poisoned
outputs; once as built for this host, once on the fp32 path for every type, once for AVX2 CPUs) and
test_cuda_index.cc (the host-compilable index arithmetic of the CUDA variants)."""
import pathlib
import subprocess

import pytest

from flashgen import toolchain

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("source,flags", [
    ("test_flash_cpu.cc", ["-O3", "-march=native", "-pthread"]),
    # The fp32 path for every type (bf16 too, with the forward's per-call K / V packing).
    ("test_flash_cpu.cc", ["-O3", "-march=native", "-pthread", "-DFLASHGEN_CPU_NO_BF16_DOT"]),
    # AVX2 + FMA + F16C (x86-64-v3): the 8-lane vectors, 4 x 2 micro-tiles and exp2 / transposes
    # without AVX-512 that a user's -march=native build gets on such a CPU (this host has AVX-512).
    ("test_flash_cpu.cc", ["-O3", "-march=x86-64-v3", "-pthread"]),
    ("test_cuda_index.cc", ["-O2"]),
])
def test_cpp(tmp_path, source, flags):
    if "-march=x86-64-v3" in flags and not {"avx2", "fma", "f16c"} <= set(toolchain.cpu_isa()):
        pytest.skip("this CPU cannot run x86-64-v3 code (no AVX2 / FMA / F16C)")
    exe = tmp_path / "t"
    cxx = toolchain.cxx()
    build = subprocess.run([cxx, "-std=c++17", *flags, f"-I{ROOT / 'csrc'}", str(ROOT / "tests" / "cpp" / source),
                            "-o", str(exe)], capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, (run.stdout[-4000:], run.stderr[-4000:])
