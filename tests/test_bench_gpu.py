"""`flashgen bench` (GPU): flashgen@<target> times flashgen on another target's kernels in a child
process (FLASHGEN_TARGET, which picks among GPU targets; on the CPU backend the host's kernels run
whatever it says, so the protocol runs here)."""
from flashgen import bench_gpu

JOB = dict(direction="fwd", hdim=32, dtype="f32", causal=True, batch=1, heads=2, kv_heads=1, sq=64, sk=64)


def test_measure_elsewhere_runs_the_jobs_in_a_child_with_the_target_forced():
    (rec,) = bench_gpu._measure_elsewhere("flashgen@cpu", [JOB], min_time=0.01)
    assert rec["impl"] == "flashgen@cpu" and rec.get("error") is None, rec
    assert rec["ms"] > 0 and rec["seqlen_q"] == 64 and rec["causal"] is True


def test_measure_elsewhere_reports_a_child_that_fails(monkeypatch):
    monkeypatch.setattr(bench_gpu.sys, "executable", "false")
    (rec,) = bench_gpu._measure_elsewhere("flashgen@sm80", [JOB], min_time=0.01)
    assert rec["ms"] is None and rec["impl"] == "flashgen@sm80" and rec["error"] == "exit 1", rec
