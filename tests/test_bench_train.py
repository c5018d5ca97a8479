"""flashgen.bench_train runs end to end at a small size: both training sites rewritten, the
gradients of the rewritten step equal the original's, every figure recorded."""
from __future__ import annotations

import json


def test_bench_train_small(tmp_path):
    from flashgen import bench_train
    out = tmp_path / "train.json"
    assert bench_train.main(["--seq", "64", "--dtype", "float32", "--min-time", "0.05",
                             "--repeats", "1", "--json", str(out)]) == 0
    (rec,) = json.loads(out.read_text())["records"]
    assert rec["rewritten_training_sites"] == 2 and rec["rewritten_rejected_sites"] == 0
    assert rec["max_grad_error"] < 1e-4
    for key in ("original_temp_bytes", "rewritten_temp_bytes", "original_ms", "rewritten_ms",
                "rewritten_kernel_scratch_bytes"):
        assert rec[key] > 0
