"""`flashgen bench --platform cpu` on tiny shapes: exported modules, original vs rewritten."""
import json

import pytest

from flashgen import bench_cpu
from flashgen.cli import main


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "cpu.json"
    rc = main(["bench", "--platform", "cpu", "--hdim", "32", "--dtype", "f32", "--causal", "true",
               "--seqlens", "16", "--batch", "1", "--heads", "2", "--min-time", "0.01", "--repeats", "2",
               "--no-peak", "--json", str(out)])
    assert rc == 0
    return json.loads(out.read_text())


def test_records_every_impl_and_direction(doc):
    got = {(r["impl"], r["direction"]): r for r in doc["results"]}
    want = [(i, "fwd") for i in bench_cpu.CPU_FWD_IMPLS] + [(i, "fwd_bwd") for i in bench_cpu.CPU_BWD_IMPLS]
    assert sorted(got) == sorted(want)
    for (impl, direction), r in got.items():
        assert r.get("error") is None, r
        for field in ("hdim", "dtype", "causal", "batch", "heads", "kv_heads", "seqlen_q", "seqlen_k", "tflops"):
            assert field in r
        assert r["ms"] > 0 and r["us"] == pytest.approx(r["ms"] * 1e3)
        assert r["mode"] == "latency" and r["temp_bytes"] is not None
        assert r["source"]
    # The rewritten modules really call flashgen and agree with the originals.
    for impl, ref in (("flashgen", "xla"), ("einsum_rewritten", "einsum")):
        r = got[(impl, "fwd")]
        assert r["rewritten_sites"] == 1 and r["kernel_scratch_bytes"] > 0
        assert r["max_err_vs_" + ref] < 1e-4
    assert got[("flashgen", "fwd_bwd")]["max_err_vs_xla"] < 1e-4


def test_environment_and_table(doc):
    env = doc["environment"]
    assert env["platform"] == "cpu" and env["threads"] >= 1 and "loadavg_before" in env
    assert any("flashgen" in line and "ratio" in line for line in doc["table"][:1])
    assert len([l for l in doc["table"] if l.startswith(("fwd ", "fwd_bwd"))]) == 2


def test_fma_peak_probe():
    peak = bench_cpu.fma_peak([1])
    assert "error" not in peak, peak
    assert peak["1"]["gflops"] > 1.0 and peak["1"]["vector_bits"] in (128, 256, 512)


def test_kernel_scratch_is_small():
    # S=4096, H=8, D=64: the kernels' own memory is a few per-thread blocks, O(S) in the backward.
    fwd = bench_cpu.kernel_scratch_bytes("fwd", 64, "f32", 1, 8, 8, 4096, 4096, 2)
    bwd = bench_cpu.kernel_scratch_bytes("fwd_bwd", 64, "bf16", 1, 8, 8, 4096, 4096, 2)
    assert fwd < 1 << 20 and bwd < 16 << 20
