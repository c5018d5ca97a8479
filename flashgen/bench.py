"""`flashgen bench`: flashgen vs cuDNN vs XLA attention, timed in one process on the same inputs.

FLOPs follow FlashAttention's benchmark convention: forward 4·B·H·Sq·Sk·D, halved when causal;
backward 2.5 × forward, so a forward+backward step counts 3.5 × forward.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

IMPLS = ("flashgen", "cudnn", "xla")


def flops(batch, heads, sq, sk, d, causal, direction) -> float:
    f = 4.0 * batch * heads * sq * sk * d / (2 if causal else 1)
    return f * (3.5 if direction == "fwd_bwd" else 1.0)


def _git_commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _nvidia_smi() -> dict:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {}
    fields = ["name", "driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem",
              "power.limit", "memory.total", "compute_cap"]
    try:
        out = subprocess.run([smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.splitlines()
        cuda = subprocess.run([smi], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    info = dict(zip(fields, (x.strip() for x in out[0].split(",")))) if out else {}
    for line in cuda.splitlines():
        if "CUDA Version" in line:
            info["cuda_version"] = line.split("CUDA Version:")[1].split()[0]
    return info


def environment(platform_name: str) -> dict:
    import jax
    import jaxlib
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform_name,
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "python": platform.python_version(), "host": platform.node(), "cpu_count": os.cpu_count(),
        "flashgen_commit": _git_commit(),
    }
    if platform_name != "cpu":
        env["gpu"] = _nvidia_smi()
    else:
        try:
            env["cpu_model"] = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                                    if l.startswith("model name"))
        except (OSError, StopIteration):
            pass
        env["flashgen_cpu_threads"] = os.environ.get("FLASHGEN_CPU_THREADS")
    return env


def _attention_fn(impl: str, causal: bool):
    import jax
    from flashgen.jax import flash_attention
    if impl == "flashgen":
        return lambda q, k, v: flash_attention(q, k, v, causal=causal)
    if impl == "einsum":  # a hand-written attention, as users write it
        def einsum_attention(q, k, v):
            import jax.numpy as jnp
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(q.shape[-1])
            if causal:
                mask = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
                s = jnp.where(mask, s, -jnp.inf)
            p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
            return jnp.einsum("bhqk,bkhd->bqhd", p, v)
        return einsum_attention
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


def time_call(f, args, *, min_time=0.2, repeats=7) -> float:
    """Median milliseconds per call: warm-up excluded, each sample a batch of calls."""
    import jax
    jax.block_until_ready(f(*args))  # compile + warm-up
    jax.block_until_ready(f(*args))
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    once = max(time.perf_counter() - t, 1e-6)
    n = max(1, int(min_time / repeats / once))
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = None
        for _ in range(n):
            out = f(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t) / n)
    return statistics.median(samples) * 1e3


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


def max_seqlen(results: list[dict]) -> dict:
    """Largest sequence length each impl ran, per (direction, hdim, dtype, causal)."""
    out: dict = {}
    for r in results:
        if r["ms"] is not None:
            key = f"{r['impl']}/{r['direction']}/d{r['hdim']}/{r['dtype']}/{'causal' if r['causal'] else 'full'}"
            out[key] = max(out.get(key, 0), r["seqlen_q"])
    return out


def run(args) -> int:
    import jax
    if args.platform:
        jax.config.update("jax_platforms", args.platform)
    plat = jax.default_backend()
    on_gpu = plat in ("gpu", "cuda")
    impls = tuple(args.impls) if args.impls else (IMPLS if on_gpu else ("flashgen", "xla", "einsum"))
    baselines = tuple(i for i in impls if i != "flashgen")
    causals = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    directions = ("fwd", "fwd_bwd") if args.bwd else ("fwd",)
    rng = np.random.default_rng(0)
    results = []
    for d in args.hdim:
        for dtype in args.dtype:
            for causal in causals:
                for s in args.seqlens:
                    heads = args.heads or max(1, args.heads_dim // d)
                    batch = args.batch or max(1, args.batch_tokens // s)
                    kv = args.kv_heads or heads
                    for direction in directions:
                        for impl in impls:
                            rec = measure(impl, direction, d, dtype, causal, batch, heads, kv, s, s, rng,
                                          args.min_time)
                            results.append(rec)
                            status = (f"{rec['ms']:.3f} ms  {rec['tflops'] * 1e3:.1f} GFLOP/s"
                                      if rec["ms"] is not None else f"failed: {rec.get('error')}")
                            print(f"{impl:8} {direction:7} d{d} {dtype} causal={causal} B={batch} H={heads} "
                                  f"S={s}: {status}", file=sys.stderr, flush=True)
    table = summarize(results, impls, baselines)
    print("\n".join(table))
    doc = {"environment": environment("cpu" if not on_gpu else "cuda"),
           "convention": "fwd flops 4*B*H*Sq*Sk*D (halved if causal); fwd_bwd = 3.5 x fwd",
           "args": {k: v for k, v in vars(args).items() if k != "func"},
           "max_seqlen": max_seqlen(results), "results": results, "table": table}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def register(sub) -> None:
    from flashgen.cli import _csv, _csv_ints
    p = sub.add_parser("bench", help="time flashgen against cuDNN and XLA attention (or XLA on CPU)")
    p.add_argument("--platform", choices=["cpu", "cuda"], help="default: JAX's default backend")
    p.add_argument("--hdim", type=_csv_ints, default=[64, 128])
    p.add_argument("--dtype", type=_csv, default=["bf16"])
    p.add_argument("--causal", choices=["both", "true", "false"], default="both")
    p.add_argument("--seqlens", type=_csv_ints, default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--batch-tokens", type=int, default=16384, help="batch = batch_tokens // seqlen")
    p.add_argument("--heads-dim", type=int, default=2048, help="heads = heads_dim // hdim")
    p.add_argument("--batch", type=int, help="fixed batch (overrides --batch-tokens)")
    p.add_argument("--heads", type=int, help="fixed heads (overrides --heads-dim)")
    p.add_argument("--kv-heads", type=int, help="GQA: kv heads (default: heads)")
    p.add_argument("--bwd", action="store_true", help="also time forward+backward")
    p.add_argument("--impls", type=_csv, help="subset of flashgen,cudnn,xla,einsum")
    p.add_argument("--min-time", type=float, default=0.3, help="seconds of timed calls per measurement")
    p.add_argument("--json", help="write the results as JSON here")
    p.set_defaults(func=run)
