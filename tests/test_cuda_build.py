"""nvcc builds of the CUDA templates for sm80 and sm90a (compile only: no GPU needed)."""
import json
import os
import shutil
import subprocess

import pytest

from flashgen import KernelSpec, build, toolchain

from conftest import needs_nvcc

pytestmark = needs_nvcc


@pytest.mark.parametrize("target", ["sm80", "sm90a"])
def test_cuda_library_builds_and_exports_handlers(target):
    specs = [KernelSpec(64, "bf16", True, target), KernelSpec(128, "f16", False, target)]
    lib = build(specs)
    m = json.loads(lib.manifest_path.read_text())
    assert m["platform"] == "CUDA" and m["target"] == target
    assert any("nvcc" in k for k in m["compilers"])
    assert any(("sm_90a" if target == "sm90a" else "sm_80") in " ".join(f) for f in m["flags"].values())
    syms = subprocess.run(["nm", "-D", "--defined-only", str(lib.path)], capture_output=True, text=True).stdout
    for s in specs:
        for d in ("fwd", "bwd"):
            assert f" T {s.target_name(d)}\n" in syms
    # The machine code is really there for the requested architecture.
    cuobjdump = shutil.which("cuobjdump") or os.path.join(os.path.dirname(toolchain.nvcc()), "cuobjdump")
    if os.access(cuobjdump, os.X_OK):
        sass = subprocess.run([cuobjdump, "--list-elf", str(lib.path)], capture_output=True, text=True)
        assert ("sm_90a" if target == "sm90a" else "sm_80") in sass.stdout, sass.stdout + sass.stderr
