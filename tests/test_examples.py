"""The examples not covered by test_frontends.py run and check their own results."""
import json
import os
import subprocess
import sys
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_training_curves_match(tmp_path):
    out = tmp_path / "train.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, str(ROOT / "examples" / "train_transformer.py"), "--steps", "12", "--seq", "64",
                    "--dim", "64", "--heads", "2", "--layers", "2", "--batch", "2", "--dtype", "f32",
                    "--json", str(out)], check=True, env=env, capture_output=True, text=True)
    runs = json.loads(out.read_text())["runs"]
    f, x = runs["flashgen"]["losses"], runs["xla"]["losses"]
    assert len(f) == len(x) == 12
    # Identical data and init: any gradient error in flashgen's backward would make the curves drift.
    assert max(abs(a - b) for a, b in zip(f, x)) < 1e-3
    assert len(set(round(v, 4) for v in f)) > 1  # the parameters really moved


def test_rewrite_python_api_example():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "rewrite_python_api.py")], check=True, env=env,
                         capture_output=True, text=True).stdout
    err = float(out.strip().splitlines()[-1].split("=")[-1])
    assert "flashgen_fwd_d64_f32_causal" in out and err < 1e-5


def test_paged_decode_example(tmp_path):
    out = tmp_path / "decode.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, str(ROOT / "examples" / "paged_decode.py"), "--lengths", "37,5,70",
                    "--steps", "3", "--json", str(out)], check=True, env=env, capture_output=True, text=True)
    r = json.loads(out.read_text())
    assert r["ok"] and r["prefill"] < 1e-4 and r["decode"] < 1e-4
