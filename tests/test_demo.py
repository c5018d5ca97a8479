"""`flashgen demo`: a PASS is only ever printed for the target that was built and run."""
import os
import pathlib
import subprocess
import sys

import pytest

from flashgen import targets

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.skipif(targets.local("cuda") is not None, reason="a GPU could run sm80")
def test_a_gpu_target_on_a_cpu_only_host_is_an_error_not_a_cpu_pass():
    """It used to build and run the CPU kernels and print PASS for --target sm80."""
    r = subprocess.run([sys.executable, "-m", "flashgen", "demo", "--target", "sm80"],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "PASS" not in r.stdout
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("flashgen: error: demo --target sm80 cannot run here: JAX runs on cpu")
    assert "flashgen check --target sm80 --emulate" in line
