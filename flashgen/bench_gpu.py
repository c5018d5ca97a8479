"""`flashgen bench` on a GPU: flashgen.jax.flash_attention against cuDNN and XLA attention
(jax.nn.dot_product_attention), timed in one process on the same inputs (bench_common.time_call).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from flashgen.bench_common import (cases, einsum_attention, environment, flops, max_seqlen,
                                   time_call, write_json)


IMPLS = ("flashgen", "cudnn", "xla")
# flashgen@<target>: flashgen on another target's kernels that run on this GPU (flashgen@sm80 on an
# H100: the mma.sync family next to sm90a's), timed in a child process with FLASHGEN_TARGET set,
# since one process serves each call name from one library.
ELSEWHERE = "flashgen@"

GPU_DEFAULTS = dict(hdim=[64, 128], dtype=["bf16"], seqlens=[512, 1024, 2048, 4096, 8192, 16384])


def _attention_fn(impl: str, causal: bool):
    import jax
    from flashgen.jax import flash_attention
    if impl == "flashgen":
        return lambda q, k, v: flash_attention(q, k, v, causal=causal)
    if impl == "einsum":
        return einsum_attention(causal)
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)


def _step(impl, causal, direction):
    import jax
    fn = _attention_fn(impl, causal)
    if direction == "fwd":
        return jax.jit(fn)

    def fwd_bwd(q, k, v, do):
        o, vjp = jax.vjp(fn, q, k, v)
        return o, vjp(do)
    return jax.jit(fwd_bwd)


def measure(impl, direction, hdim, dtype, causal, batch, heads, kv_heads, sq, sk, rng, min_time) -> dict:
    import jax.numpy as jnp
    jdt = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}[dtype]
    rec = dict(impl=impl, direction=direction, hdim=hdim, dtype=dtype, causal=causal, batch=batch,
               heads=heads, kv_heads=kv_heads, seqlen_q=sq, seqlen_k=sk, ms=None, tflops=None)
    try:
        q = jnp.asarray(rng.standard_normal((batch, sq, heads, hdim), np.float32), jdt)
        k = jnp.asarray(rng.standard_normal((batch, sk, kv_heads, hdim), np.float32), jdt)
        v = jnp.asarray(rng.standard_normal((batch, sk, kv_heads, hdim), np.float32), jdt)
        args = (q, k, v) if direction == "fwd" else (q, k, v, jnp.asarray(
            rng.standard_normal(q.shape, np.float32), jdt))
        f = _step(impl, causal, direction)
        ms = time_call(f, args, min_time=min_time)
        rec["ms"] = ms
        rec["tflops"] = flops(batch, heads, sq, sk, hdim, causal, direction) / (ms * 1e-3) / 1e12
        try:
            mem = f.lower(*args).compile().memory_analysis()
            rec["temp_bytes"] = int(mem.temp_size_in_bytes) if mem is not None else None
        except Exception:  # memory analysis is optional on some backends
            rec["temp_bytes"] = None
    except Exception as e:  # out of memory or unsupported by this implementation
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        rec["error"] = msg[:300]
    return rec


def _measure_elsewhere(impl: str, jobs: list[dict], min_time: float) -> list[dict]:
    from flashgen import targets
    env = {**os.environ, targets.OVERRIDE: impl[len(ELSEWHERE):]}
    out = subprocess.run([sys.executable, "-m", "flashgen.bench_gpu"], input=json.dumps(
        {"jobs": jobs, "min_time": min_time}), capture_output=True, text=True, env=env)
    if out.returncode != 0:
        why = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1][:300]
        return [dict(job, impl=impl, ms=None, tflops=None, error=why) for job in jobs]
    return [dict(r, impl=impl) for r in json.loads(out.stdout)]


def summarize(results: list[dict], impls: tuple[str, ...], baseline_impls: tuple[str, ...]) -> list[str]:
    """A text table: one row per case, TFLOP/s (or ms) per impl and flashgen's ratios."""
    rows = []
    keyf = lambda r: (r["direction"], r["hdim"], r["dtype"], r["causal"], r["batch"], r["heads"],
                      r["kv_heads"], r["seqlen_q"], r["seqlen_k"])
    cases: dict = {}
    for r in results:
        cases.setdefault(keyf(r), {})[r["impl"]] = r
    head = f"{'dir':8} {'d':>4} {'dtype':5} {'causal':6} {'B':>4} {'H':>3} {'S':>6} | " + " ".join(
        f"{i:>10}" for i in impls) + " | " + " ".join(f"{'fg/' + b:>10}" for b in baseline_impls)
    rows.append(head)
    for key, by in cases.items():
        d, h, t, c, b, hh, hkv, sq, sk = key
        cells = []
        for i in impls:
            r = by.get(i)
            cells.append(f"{'OOM/err' if r is None or r['ms'] is None else format(r['tflops'] * 1e3 if r['tflops'] < 1 else r['tflops'], '.1f') + ('G' if r['tflops'] < 1 else 'T'):>10}")
        ratios = []
        fg = by.get("flashgen")
        for base in baseline_impls:
            r = by.get(base)
            if fg and r and fg["ms"] and r["ms"]:
                ratios.append(f"{r['ms'] / fg['ms']:>10.2f}")
            else:
                ratios.append(f"{'-':>10}")
        rows.append(f"{d:8} {h:>4} {t:5} {str(c):6} {b:>4} {hh:>3} {sq:>6} | " + " ".join(cells) + " | " + " ".join(ratios))
    rows.append("cells: TFLOP/s (T) or GFLOP/s (G); fg/X = X time / flashgen time (> 1: flashgen faster)")
    return rows


def _report(rec: dict) -> dict:
    status = (f"{rec['ms']:.3f} ms  {rec['tflops'] * 1e3:.1f} GFLOP/s"
              if rec["ms"] is not None else f"failed: {rec.get('error')}")
    print(f"{rec['impl']:8} {rec['direction']:7} d{rec['hdim']} {rec['dtype']} causal={rec['causal']} "
          f"B={rec['batch']} H={rec['heads']} S={rec['seqlen_q']}: {status}", file=sys.stderr, flush=True)
    return rec


def run_gpu(args) -> int:
    for name, value in GPU_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    impls = tuple(args.impls) if args.impls else IMPLS
    baselines = tuple(i for i in impls if i != "flashgen")
    directions = ("fwd", "fwd_bwd") if args.bwd else ("fwd",)
    rng = np.random.default_rng(0)
    results, jobs = [], []
    for d, dtype, causal, s, batch, heads, kv in cases(args):
        for direction in directions:
            job = dict(direction=direction, hdim=d, dtype=dtype, causal=causal, batch=batch, heads=heads,
                       kv_heads=kv, sq=s, sk=s)
            jobs.append(job)
            for impl in impls:
                if not impl.startswith(ELSEWHERE):
                    results.append(_report(measure(impl, rng=rng, min_time=args.min_time, **job)))
    for impl in impls:
        if impl.startswith(ELSEWHERE):
            results += [_report(r) for r in _measure_elsewhere(impl, jobs, args.min_time)]
    table = summarize(results, impls, baselines)
    print("\n".join(table))
    doc = {"environment": environment("cuda"),
           "convention": "fwd flops 4*B*H*Sq*Sk*D (halved if causal); fwd_bwd = 3.5 x fwd",
           "args": {k: v for k, v in vars(args).items() if k != "func"},
           "max_seqlen": max_seqlen(results), "results": results, "table": table}
    write_json(args.json, doc)
    return 0


if __name__ == "__main__":  # the child of _measure_elsewhere: jobs on stdin, records on stdout
    request = json.load(sys.stdin)
    child_rng = np.random.default_rng(0)
    print(json.dumps([measure("flashgen", rng=child_rng, min_time=request["min_time"], **job)
                      for job in request["jobs"]]))
