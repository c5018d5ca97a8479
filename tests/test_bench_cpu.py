"""`flashgen bench --platform cpu` on tiny shapes: exported modules, original vs rewritten."""
import hashlib
import json
import threading
import time

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
        assert r["mode"] == "latency" and r["source"]
        assert impl == "torch" or r["temp_bytes"] is not None  # torch's temporaries are not XLA's to report
    # The rewritten modules really call flashgen and agree with the originals.
    for impl, ref in (("flashgen", "xla"), ("einsum_rewritten", "einsum")):
        r = got[(impl, "fwd")]
        assert r["rewritten_sites"] == 1 and r["kernel_scratch_bytes"] > 0
        assert r["max_err_vs_" + ref] < 1e-4
    assert got[("flashgen", "fwd_bwd")]["max_err_vs_xla"] < 1e-4
    # torch's SDPA computes the same attention (forward, and the gradients of the sum).
    assert got[("torch", "fwd")]["max_err_vs_xla"] < 1e-4 and got[("torch", "fwd_bwd")]["max_err_vs_xla"] < 1e-4


def test_environment_and_table(doc):
    env = doc["environment"]
    assert env["platform"] == "cpu" and env["threads"] >= 1 and "loadavg_before" in env
    assert any("flashgen" in line and "t/fg" in line for line in doc["table"][:1])
    assert len([l for l in doc["table"] if l.startswith(("fwd ", "fwd+bwd "))]) == 2


def test_tables_give_torch_ratio_and_peak_share():
    rec = dict(direction="fwd", hdim=64, dtype="f32", causal=False, batch=1, heads=8, kv_heads=2, seqlen_q=512,
               seqlen_k=512, mode="throughput")
    results = [dict(rec, impl="xla", ms=6.0), dict(rec, impl="torch", ms=3.0),
               dict(rec, impl="flashgen", ms=2.0, us=2000.0, gflops=100.0, peak_fraction=0.87)]
    row = [l for l in bench_cpu.summarize_cpu(results) if l.startswith("fwd ")][0]
    assert "GQA 8/2" in row and "3.00" in row and "1.50" in row and "87%" in row
    doc = {"environment": {"fma_peak": {"2": {"gflops": 115.0}}, "threads": 2}, "results": results}
    md = [l for l in bench_cpu.markdown_cpu(doc) if l.startswith("| fwd ")][0]
    assert md == "| fwd f32 D=64 GQA 8/2 full S=512 | 3.00× | 1.50× | 87% | - |"


TINY = ["bench", "--platform", "cpu", "--hdim", "32", "--dtype", "f32", "--causal", "false", "--seqlens", "16",
        "--batch", "1", "--heads", "2", "--min-time", "0.01", "--repeats", "2"]


def test_impls_torch_is_timed_next_to_flashgen_and_xla(tmp_path, monkeypatch, capsys):
    # `--impls torch` is the one-command comparison: flashgen and XLA are timed with it, forward and
    # forward+backward, and every row has both ratios and flashgen's share of the probe's peak.
    monkeypatch.setattr(bench_cpu, "fma_peak", lambda threads, cpu_time=False: {
        str(t): {"gflops": 1.0, "vector_bits": 512} for t in threads})
    out = tmp_path / "cpu.json"
    assert main(TINY + ["--impls", "torch", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    got = {(r["impl"], r["direction"]): r for r in doc["results"]}
    assert sorted(got) == sorted((i, d) for i in ("xla", "flashgen", "torch") for d in ("fwd", "fwd_bwd"))
    assert all(r.get("error") is None and r["ms"] > 0 for r in got.values())
    assert got[("flashgen", "fwd")]["peak_fraction"] > 0 and got[("flashgen", "fwd_bwd")]["peak_fraction"] > 0
    rows = [l.split("|")[1].split() for l in capsys.readouterr().out.splitlines() if l.startswith(("fwd ", "fwd+bwd "))]
    assert len(rows) == 2
    for cols in rows:  # xla, flashgen, torch times (value + unit each), x/fg, t/fg, GFLOP/s, %peak
        assert float(cols[6]) > 0 and float(cols[7]) > 0 and cols[9].endswith("%")


def test_torch_asked_for_but_missing(monkeypatch, capsys):
    monkeypatch.setattr(bench_cpu, "_torch_available", lambda: False)
    assert main(TINY + ["--impls", "torch"]) == 2
    assert capsys.readouterr().err.strip() == ("flashgen: error: --impls torch: torch is not installed "
                                               "(pip install torch)")


@pytest.mark.parametrize("cpu_time", [False, True])
def test_fma_peak_probe(cpu_time):
    # --cpu-time benches give GFLOP/s of CPU time: their peak is timed the same way.
    peak = bench_cpu.fma_peak([1], cpu_time)
    assert "error" not in peak, peak
    assert peak["1"]["gflops"] > 1.0 and peak["1"]["vector_bits"] in (128, 256, 512)
    assert peak["1"]["clock"] == ("thread CPU time" if cpu_time else "wall")


def test_kernel_scratch_is_small():
    # S=4096, H=8, D=64: the kernels' own memory is a few per-thread blocks plus O(S·D): f32 packs
    # K / V (forward) and q / dout (backward) once per call, at most the inputs' size in fp32 (16 MiB
    # here), 1/32 of the 512 MiB of scores an S² attention materializes.
    fwd = bench_cpu.kernel_scratch_bytes("fwd", 64, "f32", 1, 8, 8, 4096, 4096, 2)
    fwd_bf16 = bench_cpu.kernel_scratch_bytes("fwd", 64, "bf16", 1, 8, 8, 4096, 4096, 2)
    bwd = bench_cpu.kernel_scratch_bytes("fwd_bwd", 64, "bf16", 1, 8, 8, 4096, 4096, 2)
    bwd_f32 = bench_cpu.kernel_scratch_bytes("fwd_bwd", 64, "f32", 1, 8, 8, 4096, 4096, 2)
    kv_f32 = 2 * 4096 * 8 * 64 * 4
    assert fwd_bf16 < 1 << 20 and bwd < 16 << 20
    assert kv_f32 < fwd < kv_f32 + (1 << 20) and bwd_f32 < 2 * kv_f32


def test_cpu_time_clock(tmp_path):
    out = tmp_path / "cpu.json"
    rc = main(["bench", "--platform", "cpu", "--hdim", "32", "--dtype", "f32", "--causal", "true",
               "--seqlens", "16", "--batch", "1", "--heads", "2", "--impls", "flashgen", "--no-bwd",
               "--min-time", "0.01", "--repeats", "2", "--no-peak", "--cpu-time", "--json", str(out)])
    assert rc == 0
    recs = json.loads(out.read_text())["results"]
    assert [r["impl"] for r in recs] == ["xla", "flashgen"]
    assert all(r["clock"] == "process CPU time" and r["ms"] > 0 for r in recs)


def test_cpu_time_charges_each_impl_its_own_deferred_work():
    # XLA frees a large module's temporaries on a pool thread after its result is ready (~15 ms
    # after the S=2048 f32 forward): with the process's CPU time as the clock that work belongs to
    # the impl that left it, not to the next one in the round.
    def burn(seconds):  # CPU time on another thread, without holding the GIL (hashing releases it)
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            hashlib.sha256(bytes(1 << 20)).digest()

    def leaves_work():
        threading.Thread(target=burn, args=(0.04,)).start()
        return 0.0

    def waits():  # long enough to see another thread's leftover work, costing no CPU time itself
        time.sleep(0.06)
        return 0.0

    samples = bench_cpu._interleaved_times({"leaves_work": leaves_work, "waits": waits}, (), latency=False,
                                           min_time=0.0, repeats=2, clock=time.process_time)
    assert min(samples["leaves_work"]) > 0.03, samples
    assert max(samples["waits"]) < 0.015, samples
