#!/usr/bin/env bash
# The GPU work of a session with a lent H100/H200, in few full device calls (each <= 10 min):
#
#   bash bench/gpu_session.sh all      # ONE call of <= 8 min, the first thing a session with a GPU
#                                      # runs: d64/d128 bf16/f16 specs only, pytest -m gpu -x on
#                                      # them (no sanitizer), then the dense bench below
#   bash bench/gpu_session.sh build    # kernels for every spec of this GPU, timed (48 specs)
#   bash bench/gpu_session.sh test     # pytest -m gpu: every spec and variant vs float64, and
#                                      # compute-sanitizer (builds what it needs; ~1 call)
#   bash bench/gpu_session.sh check    # only the compute-sanitizer tests
#   bash bench/gpu_session.sh bench    # flashgen vs cuDNN vs XLA (and flashgen@sm80), dense and variants (1 call)
#
# Run from the repository root on the device machine (`run` with this as the command). Logs
# and JSON go to $OUT (what the device tool brings back; at most 8 files): commit the JSON
# under bench/results/ and summarize it in BENCHMARKS.md. The kernel cache lives in /tmp and
# survives only while the machine stays warm (30 s after a call): chain stages with `&&` in
# one call when they fit in its 10 minutes. The machine's Python has jax, jinja2, pybind11,
# pytest and numpy; the project runs from the tree.
set -uo pipefail
stage=${1:?usage: bench/gpu_session.sh all|build|test|check|bench}
OUT=${OUT:-/tmp/flashgen-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD FLASHGEN_POISON=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export FLASHGEN_CACHE_DIR=${FLASHGEN_CACHE_DIR:-/tmp/flashgen-cache}
date=$(date +%F)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-' | tr -cd 'A-Za-z0-9_.-')

case "$stage" in
  all)
    nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
    FLASHGEN_GPU_HEAD_DIMS=64,128 FLASHGEN_GPU_DTYPES=bf16,f16 python3 -m pytest -m gpu -x -q -p no:cacheprovider \
      -rs -k "not compute_sanitizer" tests/test_gpu.py > "$OUT/pytest-gpu.txt" 2>&1
    tail -15 "$OUT/pytest-gpu.txt"
    python3 -m flashgen bench --hdim 64,128 --dtype bf16 --causal both --bwd --seqlens 1024,2048,4096,8192,16384 \
      --json "$OUT/$gpu-$date.json" > "$OUT/bench-dense.txt" 2>&1
    tail -30 "$OUT/bench-dense.txt" ;;
  build)
    nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
    python3 - > "$OUT/build.txt" 2>&1 <<'EOF'
import time
from flashgen import KernelSpec, build
from flashgen.jax.attention import _local_target
from flashgen.spec import DTYPES, HEAD_DIMS
t = time.perf_counter()
lib = build([KernelSpec(d, dt, c, _local_target()) for d in HEAD_DIMS for dt in DTYPES for c in (False, True)],
            progress=print)
print(f"built {lib.path} in {time.perf_counter() - t:.0f} s")
EOF
    tail -3 "$OUT/build.txt" ;;
  test)
    python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_gpu.py > "$OUT/pytest-gpu.txt" 2>&1
    tail -15 "$OUT/pytest-gpu.txt" ;;
  check)
    python3 -m pytest -m gpu -q -p no:cacheprovider -k compute_sanitizer -s tests/test_gpu.py \
      > "$OUT/sanitizer.txt" 2>&1
    grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitizer.txt" ;;
  bench)
    # on sm90a, flashgen@sm80 (the mma.sync family, in a child process) next to the wgmma kernels
    python3 -m flashgen bench --hdim 64,128 --dtype bf16 --causal both --bwd --impls flashgen,cudnn,xla,flashgen@sm80 \
      --json "$OUT/$gpu-$date.json" > "$OUT/bench-dense.txt" 2>&1
    python3 -m flashgen bench --variants --json "$OUT/$gpu-variants-$date.json" \
      > "$OUT/bench-variants.txt" 2>&1
    tail -30 "$OUT/bench-dense.txt"; tail -12 "$OUT/bench-variants.txt" ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
