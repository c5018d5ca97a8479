"""`flashgen bench`: flashgen vs cuDNN vs XLA attention, timed in one process on the same inputs.

FLOPs follow FlashAttention's benchmark convention: forward 4·B·H·Sq·Sk·D, halved when causal;
backward 2.5 × forward, so a forward+backward step counts 3.5 × forward.

GPU mode times flashgen.jax.flash_attention against cuDNN and XLA attention.

CPU mode (``--platform cpu``, or JAX's default backend being the CPU) benchmarks the product path:
each attention is exported with jax.export at the case's shape, the exported module is rewritten
with flashgen.rewrite, and the ORIGINAL and the REWRITTEN module run in one process on the same
inputs (impls ``xla`` = jax.nn.dot_product_attention(implementation="xla"), ``flashgen`` = that
module rewritten, ``einsum`` = a hand-written einsum attention, ``einsum_rewritten``). The
forward+backward direction is the gradient of the sum of the outputs with respect to q, k, v
(the rewriter rewrites forward graphs, so ``flashgen`` there is flashgen.jax.flash_attention's
gradient against jax.nn.dot_product_attention's and the einsum attention's). Impls are timed in
interleaved rounds (one sample of each per round; medians), per call with a sync each time
(latency, µs) for S <= --latency-max, else as the mean over a run of queued calls. Each record
also has the compiled module's temporary memory (memory_analysis().temp_size_in_bytes) and, for
flashgen, the kernel's own scratch that XLA does not see. A tiny C++ FMA loop measures the f32
peak of this machine (1 thread and all threads) so GFLOP/s can be read as a fraction of it;
--scaling reruns the S=2048 cases pinned to 1 CPU and to all CPUs.
"""
from __future__ import annotations

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
GPU_DEFAULTS = dict(hdim=[64, 128], dtype=["bf16"], seqlens=[512, 1024, 2048, 4096, 8192, 16384])


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


def cases(args):
    """(hdim, dtype, causal, seqlen, batch, heads, kv_heads) for every case the flags ask for."""
    causals = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    for d in args.hdim:
        for dtype in args.dtype:
            for causal in causals:
                for s in args.seqlens:
                    heads = args.heads or max(1, args.heads_dim // d)
                    yield (d, dtype, causal, s, args.batch or max(1, args.batch_tokens // s), heads,
                           args.kv_heads or heads)


def run(args) -> int:
    import jax
    _json_output(args.json)  # a bad --json path fails now, not after the measurements
    if args.platform:
        jax.config.update("jax_platforms", args.platform)
    plat = jax.default_backend()
    on_gpu = plat in ("gpu", "cuda")
    if args.variants:
        from flashgen.bench_variants import run_variants
        _write_json(args.json, run_variants(args, on_gpu))
        return 0
    if not on_gpu:
        return run_cpu(args)
    for name, value in GPU_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    impls = tuple(args.impls) if args.impls else (IMPLS if on_gpu else ("flashgen", "xla", "einsum"))
    baselines = tuple(i for i in impls if i != "flashgen")
    directions = ("fwd", "fwd_bwd") if args.bwd else ("fwd",)
    rng = np.random.default_rng(0)
    results = []
    for d, dtype, causal, s, batch, heads, kv in cases(args):
        for direction in directions:
            for impl in impls:
                rec = measure(impl, direction, d, dtype, causal, batch, heads, kv, s, s, rng, args.min_time)
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
    _write_json(args.json, doc)
    return 0


def _json_output(path):
    from flashgen import output_files
    (out,) = output_files.check([("--json", path)], make_dirs=True)
    return out


def _write_json(path, doc) -> None:
    out = _json_output(path)
    if out:
        out.write(json.dumps(doc, indent=1).encode())
        print(f"wrote {path}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# CPU mode: original vs rewritten exported modules.
# ---------------------------------------------------------------------------------------------

CPU_FWD_IMPLS = ("xla", "flashgen", "einsum", "einsum_rewritten")
CPU_BWD_IMPLS = ("xla", "flashgen", "einsum")
CPU_ALL_IMPLS = CPU_FWD_IMPLS + ("flashgen_jax",)
CPU_DEFAULTS = dict(hdim=[64], dtype=["f32", "bf16"], seqlens=[64, 128, 512, 2048, 4096], batch=1, heads=8)
# Where each impl comes from (the record's "source").
CPU_SOURCES = {
    ("fwd", "xla"): "jax.export(jax.nn.dot_product_attention(implementation='xla'))",
    ("fwd", "flashgen"): "flashgen.rewrite(jax.export(jax.nn.dot_product_attention(implementation='xla')))",
    ("fwd", "einsum"): "jax.export(einsum attention)",
    ("fwd", "einsum_rewritten"): "flashgen.rewrite(jax.export(einsum attention))",
    ("fwd", "flashgen_jax"): "flashgen.jax.flash_attention",
    ("fwd_bwd", "xla"): "jax.grad(sum(jax.nn.dot_product_attention(implementation='xla')))",
    ("fwd_bwd", "flashgen"): "jax.grad(sum(flashgen.jax.flash_attention))",
    ("fwd_bwd", "einsum"): "jax.grad(sum(einsum attention))",
}


def einsum_attention(causal: bool):
    """A hand-written attention, as users write it (BSHD, softmax in f32)."""
    import jax
    import jax.numpy as jnp

    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(q.shape[-1])
        if causal:
            mask = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
            s = jnp.where(mask, s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return attention


def _plain_fn(impl: str, causal: bool):
    import jax
    from flashgen.jax import flash_attention
    if impl == "xla":
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
    if impl in ("flashgen", "flashgen_jax"):
        return lambda q, k, v: flash_attention(q, k, v, causal=causal)
    if impl == "einsum":
        return einsum_attention(causal)
    raise ValueError(f"unknown impl {impl}")


def _exported_call(fn, args, rewrite: bool):
    """jit(Exported.call) of fn exported at args' shapes, rewritten by flashgen when asked."""
    import jax
    from jax import export
    exp = export.export(jax.jit(fn), platforms=["cpu"])(*args)
    if not rewrite:
        return jax.jit(exp.call), {}
    import flashgen.rewrite as fr
    from flashgen import execute
    res = fr.rewrite(exp.serialize())
    info = {"rewritten_sites": len(res.rewritten), "rejected_sites": len(res.rejected)}
    if not res.rewritten:
        reasons = "; ".join(str(getattr(s, "reason", s))[:120] for s in res.rejected) or "no attention found"
        raise RuntimeError(f"the rewriter replaced nothing ({reasons})")
    data = res.to_bytes()
    execute.register_targets(data, "cpu")
    return jax.jit(export.deserialize(data).call), info


def cpu_callable(impl: str, direction: str, causal: bool, args):
    """(jitted callable, extra record fields) for one CPU impl."""
    import jax
    import jax.numpy as jnp
    if direction == "fwd":
        if impl == "flashgen_jax":
            return jax.jit(_plain_fn("flashgen", causal)), {}
        base = "einsum" if impl.startswith("einsum") else "xla"
        return _exported_call(_plain_fn(base, causal), args, rewrite=impl in ("flashgen", "einsum_rewritten"))
    if impl not in CPU_BWD_IMPLS:
        raise ValueError(f"{impl} has no forward+backward variant")
    fn = _plain_fn(impl, causal)
    loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), {}


def kernel_scratch_bytes(direction, hdim, dtype, batch, heads, kv_heads, sq, sk, threads) -> int:
    """Memory flashgen's CPU kernels allocate besides XLA's buffers (not in temp_size_in_bytes).

    Mirrors csrc/flashgen/cpu/flash_cpu.h (fwd 128x64 blocks, bwd 64x64): a per-thread workspace
    (fwd_ws_floats / bwd_ws_floats, kept between calls), and in the backward lse2 and Drow
    [B, Hq, Sq] plus, unless dq accumulates in place (f32, one chunk), an f32 dq buffer per chunk.
    """
    D, bq, bk = hdim, 128, 64
    fwd_ws = D * bq + bk * bq + bq * D + 2 * bk * D + (bk // 2) * bq + 3 * bq
    if direction == "fwd":
        items = batch * heads * -(-sq // bq)
        return 4 * fwd_ws * max(1, min(threads, items))
    bq = bk = 64
    bwd_ws = 2 * D * bk + 3 * bk * D + 2 * bq * D + 2 * bq * bk + bq * D + bk * D + 2 * bq * bk
    nbh, nkb = batch * kv_heads, -(-sk // bk)
    chunks = 1
    if threads > 1 and nkb > 1:  # pick_chunks
        best, best_eff = 1, 0.0
        for c in range(1, min(nkb, 4 * threads) + 1):
            items = nbh * c
            eff = items / (-(-items // threads) * threads)
            if eff > best_eff + 0.02:
                best, best_eff = c, eff
            if eff >= 0.95:
                break
        chunks = best
    dq = 0 if (dtype == "f32" and chunks == 1) else 4 * chunks * batch * sq * heads * D
    # The forward also runs in the same step (its workspace is the same per-thread buffer grown).
    return 4 * max(bwd_ws, fwd_ws) * max(1, min(threads, nbh * chunks)) + 8 * batch * heads * sq + dq


def _fma_peak_binary() -> str | None:
    from flashgen import resources, toolchain
    from flashgen.build import cache_root
    src = resources.csrc_dir() / "flashgen" / "cpu" / "fma_peak.cc"
    if not src.is_file():
        return None
    import hashlib
    key = hashlib.sha256(src.read_bytes() + toolchain.host_isa().encode()
                         + toolchain.compiler_version(toolchain.cxx()).encode()).hexdigest()[:16]
    out = cache_root() / "tools" / f"fma_peak-{key}"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        toolchain.run([toolchain.cxx(), "-std=c++17", "-O2", "-march=native", "-pthread", str(src),
                       "-o", str(tmp)], "compiling the FMA peak probe")
        os.replace(tmp, out)
    return str(out)


def fma_peak(threads: list[int]) -> dict:
    """f32 FMA peak GFLOP/s of this machine per thread count ({} when it cannot be measured)."""
    try:
        exe = _fma_peak_binary()
        if exe is None:
            return {}
        out = subprocess.run([exe, *map(str, threads)], capture_output=True, text=True, timeout=120)
        peaks = {}
        for line in out.stdout.splitlines():
            rec = json.loads(line)
            peaks[str(rec["threads"])] = {"gflops": rec["gflops"], "vector_bits": rec["vector_bits"]}
        return peaks
    except Exception as e:  # noqa: BLE001 - the peak is informative, never fatal
        return {"error": str(e).splitlines()[0][:200] if str(e) else type(e).__name__}


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _interleaved_times(fns: dict, args, *, latency: bool, min_time: float, repeats: int) -> dict:
    """Per impl: samples of seconds per call, taken in rounds (one sample of each impl per round)."""
    import jax
    once = {}
    for name, f in fns.items():
        jax.block_until_ready(f(*args))  # warm-up (compiled already)
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        once[name] = max(time.perf_counter() - t, 1e-7)
    per_sample = min_time / repeats
    counts = {n: max(1, int(per_sample / o)) for n, o in once.items()}
    samples: dict = {n: [] for n in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            n = counts[name]
            if latency:
                ts = []
                for _ in range(n):
                    t = time.perf_counter()
                    jax.block_until_ready(f(*args))
                    ts.append(time.perf_counter() - t)
                samples[name].extend(ts)
            else:
                t = time.perf_counter()
                out = None
                for _ in range(n):
                    out = f(*args)
                jax.block_until_ready(out)
                samples[name].append((time.perf_counter() - t) / n)
    return samples


def measure_cpu_case(impls, direction, hdim, dtype, causal, batch, heads, kv_heads, sq, sk, rng, *,
                     min_time, repeats, latency_max, threads, peak) -> list[dict]:
    import jax
    import jax.numpy as jnp
    jdt = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}[dtype]
    q = jnp.asarray(rng.standard_normal((batch, sq, heads, hdim), np.float32), jdt)
    k = jnp.asarray(rng.standard_normal((batch, sk, kv_heads, hdim), np.float32), jdt)
    v = jnp.asarray(rng.standard_normal((batch, sk, kv_heads, hdim), np.float32), jdt)
    args = (q, k, v)
    latency = max(sq, sk) <= latency_max
    fl = flops(batch, heads, sq, sk, hdim, causal, direction)
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    recs, fns = {}, {}
    for impl in impls:
        rec = dict(impl=impl, direction=direction, hdim=hdim, dtype=dtype, causal=causal, batch=batch,
                   heads=heads, kv_heads=kv_heads, seqlen_q=sq, seqlen_k=sk, ms=None, tflops=None,
                   source=CPU_SOURCES.get((direction, impl), impl),
                   mode="latency" if latency else "throughput", loadavg=load)
        recs[impl] = rec
        try:
            f, extra = cpu_callable(impl, direction, causal, args)
            rec.update(extra)
            compiled = f.lower(*args).compile()
            mem = compiled.memory_analysis()
            rec["temp_bytes"] = int(mem.temp_size_in_bytes) if mem is not None else None
            if impl in ("flashgen", "einsum_rewritten", "flashgen_jax"):
                rec["kernel_scratch_bytes"] = kernel_scratch_bytes(direction, hdim, dtype, batch, heads, kv_heads,
                                                                   sq, sk, threads)
            fns[impl] = f
        except Exception as e:  # noqa: BLE001 - out of memory, not rewritable, unsupported
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            rec["error"] = msg[:300]
    # Rewritten vs original on these inputs: max |difference| / max(1, max |original|).
    for impl, ref in (("flashgen", "xla"), ("einsum_rewritten", "einsum"), ("flashgen_jax", "xla")):
        if impl in fns and ref in fns:
            try:
                got = [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(fns[impl](*args))]
                want = [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(fns[ref](*args))]
                recs[impl]["max_err_vs_" + ref] = max(
                    float(np.max(np.abs(g - w)) / max(1.0, float(np.max(np.abs(w))))) for g, w in zip(got, want))
            except Exception as e:  # noqa: BLE001
                recs[impl]["max_err_vs_" + ref] = None
                recs[impl].setdefault("error", f"comparison failed: {str(e)[:200]}")
    if fns:
        try:
            samples = _interleaved_times(fns, args, latency=latency, min_time=min_time, repeats=repeats)
        except Exception as e:  # noqa: BLE001
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            for impl in fns:
                recs[impl]["error"] = msg[:300]
            samples = {}
        for impl, ts in samples.items():
            rec = recs[impl]
            med = statistics.median(ts)
            rec["ms"] = med * 1e3
            rec["us"] = med * 1e6
            rec["ms_min"] = min(ts) * 1e3
            qs = statistics.quantiles(ts, n=4) if len(ts) >= 2 else [med, med, med]
            rec["ms_iqr"] = [qs[0] * 1e3, qs[2] * 1e3]
            rec["samples"] = len(ts)
            rec["tflops"] = fl / med / 1e12
            rec["gflops"] = fl / med / 1e9
            p = peak.get(str(threads), {}).get("gflops") if isinstance(peak, dict) else None
            if p:
                rec["peak_fraction"] = rec["gflops"] / p
    return [recs[i] for i in impls]


def _fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def _fmt_time(rec) -> str:
    if rec is None:
        return "-"
    if rec.get("ms") is None:
        return "err"
    return f"{rec['us']:.0f} us" if rec.get("mode") == "latency" else f"{rec['ms']:.2f} ms"


def summarize_cpu(results: list[dict]) -> list[str]:
    """One row per case: XLA vs flashgen (time, ratio, GFLOP/s, % of peak, temp memory), and the
    einsum attention original vs rewritten."""
    cases: dict = {}
    for r in results:
        key = (r["direction"], r["hdim"], r["dtype"], r["causal"], r["batch"], r["heads"], r["kv_heads"],
               r["seqlen_q"], r["seqlen_k"])
        cases.setdefault(key, {})[r["impl"]] = r
    head = (f"{'dir':7} {'dtype':5} {'causal':6} {'S':>5} | {'xla':>10} {'flashgen':>10} {'ratio':>6} "
            f"{'GFLOP/s':>8} {'%peak':>6} | {'temp xla':>9} {'temp fg':>9} | {'einsum':>10} "
            f"{'einsum_rw':>10} {'ratio':>6}")
    rows = [head, "-" * len(head)]
    for key, by in cases.items():
        d, h, t, c, b, hh, hkv, sq, sk = key
        x, f = by.get("xla"), by.get("flashgen")
        e, er = by.get("einsum"), by.get("einsum_rewritten") or (by.get("flashgen") if d == "fwd_bwd" else None)
        ratio = (f"{x['ms'] / f['ms']:.2f}" if x and f and x.get("ms") and f.get("ms") else "-")
        eratio = (f"{e['ms'] / er['ms']:.2f}" if e and er and e.get("ms") and er.get("ms") else "-")
        gf = f"{f['gflops']:.1f}" if f and f.get("ms") else "-"
        pk = f"{100 * f['peak_fraction']:.0f}%" if f and f.get("peak_fraction") else "-"
        tx = _fmt_bytes(x.get("temp_bytes")) if x else "-"
        tf = (_fmt_bytes((f.get("temp_bytes") or 0) + (f.get("kernel_scratch_bytes") or 0)) if f else "-")
        rows.append(f"{d:7} {t:5} {str(c):6} {sq:>5} | {_fmt_time(x):>10} {_fmt_time(f):>10} {ratio:>6} "
                    f"{gf:>8} {pk:>6} | {tx:>9} {tf:>9} | {_fmt_time(e):>10} "
                    f"{_fmt_time(er) if d == 'fwd' else '(fg) ' + _fmt_time(er):>10} {eratio:>6}")
    rows.append("ratio = xla / flashgen time (> 1: flashgen faster); GFLOP/s and %peak of flashgen (peak: f32 FMA, "
                "all threads); temp fg = XLA temp + flashgen kernel scratch; einsum_rw = einsum module rewritten "
                "(fwd_bwd: flashgen's gradient)")
    return rows


def _scaling(args) -> dict:
    """flashgen and XLA at S=2048 (f32, non-causal and causal, fwd and fwd_bwd) pinned to 1 CPU
    and to all CPUs, each in a child process (XLA sizes its thread pool at startup)."""
    import tempfile
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2:
        return {"note": "one CPU only"}
    out = {}
    for n in (1, len(cpus)):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "scaling.json")
            cmd = [sys.executable, "-m", "flashgen", "bench", "--platform", "cpu", "--seqlens", "2048",
                   "--dtype", "f32", "--hdim", str(args.hdim[0]), "--impls", "xla,flashgen",
                   "--batch", "1", "--heads", "8", "--min-time", str(args.min_time), "--repeats",
                   str(args.repeats), "--no-peak", "--json", path]
            pin = cpus[:n]
            env = dict(os.environ)
            env.pop("FLASHGEN_CPU_THREADS", None)
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                  preexec_fn=lambda: os.sched_setaffinity(0, pin))
            if proc.returncode != 0:
                out[str(n)] = {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:300]}
                continue
            with open(path) as fh:
                doc = json.load(fh)
            out[str(n)] = {f"{r['impl']}/{r['direction']}/{'causal' if r['causal'] else 'full'}": r["ms"]
                           for r in doc["results"]}
    if all("error" not in v for v in out.values()) and len(out) == 2:
        one, many = out["1"], out[str(len(cpus))]
        out["speedup"] = {k: one[k] / many[k] for k in one if one.get(k) and many.get(k)}
    return out


def run_cpu(args) -> int:
    for name, value in CPU_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    fwd_impls = tuple(i for i in (args.impls or CPU_FWD_IMPLS) if i in CPU_ALL_IMPLS)
    bad = [i for i in (args.impls or ()) if i not in CPU_ALL_IMPLS]
    if bad:
        raise ValueError(f"unknown CPU impls {bad}: choose from {', '.join(CPU_ALL_IMPLS)}")
    bwd_impls = tuple(i for i in (args.impls or CPU_BWD_IMPLS) if i in CPU_BWD_IMPLS)
    directions = ("fwd",) if args.no_bwd else ("fwd", "fwd_bwd")
    threads = _cpu_count()
    peak = {} if args.no_peak else fma_peak(sorted({1, threads}))
    if peak and "error" not in peak:
        print("f32 FMA peak: " + ", ".join(f"{t} thread{'s' if t != '1' else ''} {p['gflops']:.0f} GFLOP/s"
                                           for t, p in peak.items()), file=sys.stderr)
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    rng = np.random.default_rng(0)
    results = []
    for d, dtype, causal, s, batch, heads, kv in cases(args):
        for direction in directions:
            impls = fwd_impls if direction == "fwd" else bwd_impls
            if not impls:
                continue
            recs = measure_cpu_case(impls, direction, d, dtype, causal, batch, heads, kv, s, s, rng,
                                    min_time=args.min_time, repeats=args.repeats,
                                    latency_max=args.latency_max, threads=threads, peak=peak)
            results.extend(recs)
            for rec in recs:
                status = (f"{_fmt_time(rec)}  {rec['gflops']:.1f} GFLOP/s  temp "
                          f"{_fmt_bytes(rec.get('temp_bytes'))}" if rec["ms"] is not None
                          else f"failed: {rec.get('error')}")
                print(f"{rec['impl']:16} {direction:7} d{d} {dtype} causal={causal} B={batch} "
                      f"H={heads} S={s}: {status}", file=sys.stderr, flush=True)
    table = summarize_cpu(results)
    print("\n".join(table))
    env = environment("cpu")
    env.update({"fma_peak": peak, "fma_peak_after": {} if args.no_peak else fma_peak(sorted({1, threads})),
                "threads": threads,
                "loadavg_before": load_before,
                "loadavg_after": os.getloadavg() if hasattr(os, "getloadavg") else None,
                "niceness": os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else None})
    doc = {"environment": env,
           "convention": "fwd flops 4*B*H*Sq*Sk*D (halved if causal); fwd_bwd = 3.5 x fwd; ms = median "
                         "per call (mode latency: each call synced; throughput: runs of queued calls)",
           "args": {k: v for k, v in vars(args).items() if k != "func"},
           "max_seqlen": max_seqlen(results), "results": results, "table": table}
    if args.scaling:
        print("thread scaling (S=2048, f32): child processes pinned to 1 and to all CPUs...", file=sys.stderr)
        doc["scaling"] = _scaling(args)
        print(json.dumps(doc["scaling"], indent=1))
    if args.markdown:
        print("\n".join(markdown_cpu(doc)))
    _write_json(args.json, doc)
    return 0


def markdown_cpu(doc: dict) -> list[str]:
    """The CPU results of a bench JSON document as a Markdown table (BENCHMARKS.md)."""
    peak = doc["environment"].get("fma_peak") or {}
    threads = str(doc["environment"].get("threads"))
    cases: dict = {}
    for r in doc["results"]:
        key = (r["direction"], r["dtype"], r["causal"], r["seqlen_q"])
        cases.setdefault(key, {})[r["impl"]] = r
    rows = ["| case | XLA | flashgen | ratio | flashgen GFLOP/s | % of f32 peak | temp XLA | temp flashgen "
            "(XLA temp + kernel scratch) | einsum | einsum rewritten | ratio |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (d, t, c, s), by in cases.items():
        x, f, e = by.get("xla"), by.get("flashgen"), by.get("einsum")
        er = by.get("einsum_rewritten") if d == "fwd" else None
        name = f"{'fwd' if d == 'fwd' else 'fwd+bwd'} {t} {'causal' if c else 'full'} S={s}"
        ok = lambda r: r is not None and r.get("ms") is not None
        ratio = f"{x['ms'] / f['ms']:.2f}×" if ok(x) and ok(f) else "-"
        eratio = f"{e['ms'] / er['ms']:.2f}×" if ok(e) and ok(er) else "-"
        gf = f"{f['gflops']:.0f}" if ok(f) else "-"
        pk = f"{100 * f['peak_fraction']:.0f}%" if ok(f) and f.get("peak_fraction") else "-"
        tf = _fmt_bytes((f.get("temp_bytes") or 0) + (f.get("kernel_scratch_bytes") or 0)) if f else "-"
        rows.append(f"| {name} | {_fmt_time(x)} | {_fmt_time(f)} | {ratio} | {gf} | {pk} | "
                    f"{_fmt_bytes(x.get('temp_bytes')) if x else '-'} | {tf} | {_fmt_time(e)} | "
                    f"{_fmt_time(er) if er else '-'} | {eratio} |")
    p = peak.get(threads, {}).get("gflops")
    rows.append("")
    rows.append(f"Peak: f32 FMA, {threads} threads, {p:.0f} GFLOP/s (measured by the bench's probe at the start "
                f"of the run); bf16 runs vdpbf16ps, whose peak is twice that." if p else "Peak: not measured.")
    return rows


def register(sub) -> None:
    from flashgen.cli import _csv, _csv_ints
    p = sub.add_parser("bench", help="time flashgen against cuDNN and XLA attention (on CPU: exported "
                                     "modules, original vs rewritten)")
    p.add_argument("--platform", choices=["cpu", "cuda"], help="default: JAX's default backend")
    p.add_argument("--hdim", type=_csv_ints, help="default: 64,128 (GPU), 64 (CPU)")
    p.add_argument("--dtype", type=_csv, help="default: bf16 (GPU), f32,bf16 (CPU)")
    p.add_argument("--causal", choices=["both", "true", "false"], default="both")
    p.add_argument("--seqlens", type=_csv_ints,
                   help="default: 512,...,16384 (GPU), 64,128,512,2048,4096 (CPU)")
    p.add_argument("--batch-tokens", type=int, default=16384, help="batch = batch_tokens // seqlen")
    p.add_argument("--heads-dim", type=int, default=2048, help="heads = heads_dim // hdim")
    p.add_argument("--batch", type=int, help="fixed batch (overrides --batch-tokens; CPU default 1)")
    p.add_argument("--heads", type=int, help="fixed heads (overrides --heads-dim; CPU default 8)")
    p.add_argument("--kv-heads", type=int, help="GQA: kv heads (default: heads)")
    p.add_argument("--bwd", action="store_true", help="GPU: also time forward+backward (always on CPU)")
    p.add_argument("--no-bwd", action="store_true", help="CPU: forward only")
    p.add_argument("--impls", type=_csv, help="GPU: subset of flashgen,cudnn,xla,einsum; CPU: subset of "
                                              + ",".join(CPU_ALL_IMPLS))
    p.add_argument("--min-time", type=float, default=0.3, help="seconds of timed calls per measurement "
                                                               "(CPU: per impl and case)")
    p.add_argument("--repeats", type=int, default=7, help="CPU: interleaved rounds per case (median)")
    p.add_argument("--latency-max", type=int, default=256,
                   help="CPU: time each call synced (latency, us) up to this sequence length")
    p.add_argument("--no-peak", action="store_true", help="CPU: skip the FMA peak probe")
    p.add_argument("--markdown", action="store_true", help="CPU: also print the table as Markdown")
    p.add_argument("--scaling", action="store_true",
                   help="CPU: also time S=2048 pinned to 1 CPU and to all CPUs (child processes)")
    p.add_argument("--variants", action="store_true",
                   help="time packed varlen and paged-KV decode instead (tokens/s; flashgen/bench_variants.py)")
    p.add_argument("--varlen-mean", type=int, default=512, help="--variants: mean sequence length")
    p.add_argument("--decode-batch", type=_csv_ints, default=[1, 16],
                   help="--variants: decode batch sizes")
    p.add_argument("--decode-context", type=int, default=4096, help="--variants: keys per sequence")
    p.add_argument("--json", help="write the results as JSON here")
    p.set_defaults(func=run)
