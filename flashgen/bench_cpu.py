"""`flashgen bench` on the CPU (``--platform cpu``, or JAX's default backend being the CPU):
the product path, original vs rewritten exported modules.

Each attention is exported with jax.export at the case's shape, the exported module is rewritten
with flashgen.rewrite, and the ORIGINAL and the REWRITTEN module run in one process on the same
inputs (impls ``xla`` = jax.nn.dot_product_attention(implementation="xla"), ``flashgen`` = that
module rewritten, ``einsum`` = a hand-written einsum attention, ``einsum_rewritten``; ``torch`` =
torch.nn.functional.scaled_dot_product_attention on the same values in torch's own BHSD layout,
with torch's intra-op threads set to the thread count the others use, when torch is installed). The
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

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from flashgen.bench_common import (cases, einsum_attention, environment, flops, max_seqlen,
                                   write_json)


CPU_FWD_IMPLS = ("xla", "flashgen", "einsum", "einsum_rewritten", "torch")

CPU_BWD_IMPLS = ("xla", "flashgen", "einsum", "torch")

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
    ("fwd", "torch"): "torch.nn.functional.scaled_dot_product_attention (BHSD, no_grad)",
    ("fwd_bwd", "torch"): "torch.autograd.grad(sum(torch.nn.functional.scaled_dot_product_attention))",
}


def _torch_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("torch") is not None


def torch_callable(direction: str, causal: bool, args, threads: int):
    """torch's SDPA on args (jax arrays, BSHD) as a callable returning numpy-comparable BSHD outputs
    through .outputs(), and a timing callable (torch runs synchronously: a call is done when it returns)."""
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[str(args[0].dtype)]
    q, k, v = (torch.from_numpy(np.array(a, np.float32)).to(tdt).transpose(1, 2).contiguous() for a in args)
    gqa = q.shape[1] != k.shape[1]

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    if direction == "fwd":
        def call(*_):
            with torch.inference_mode():
                return (sdpa(q, k, v),)
    else:
        for t in (q, k, v):
            t.requires_grad_(True)

        def call(*_):
            return torch.autograd.grad(sdpa(q, k, v).float().sum(), (q, k, v))

    def outputs():
        return [t.detach().float().transpose(1, 2).numpy() for t in call()]

    call.outputs = outputs
    return call


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
    info = {"rewritten_sites": len(res.rewritten), "rejected_sites": len(res.rejected),
            "training_sites": sum(1 for s in res.rewritten if s.backward_target)}
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

    Mirrors csrc/flashgen/cpu/forward.h and backward.h (block sizes in tiles.h: fwd 128x64, bwd
    64x64): a per-thread workspace (fwd_ws_floats / bwd_ws_floats, kept between calls); for fp32
    products (f32, or f16) the forward's K / V packed once per call (when a key block is read more
    than once, Sq > 128 or GQA; kept by the calling thread up to 16 MiB) and the backward's q / dout (when Sk > 64); in the backward lse2 and
    Drow [B, Hq, Sq] plus, unless dq accumulates in place (f32, one chunk), an f32 dq buffer per chunk.
    """
    D, bq, bk = hdim, 128, 64
    fp32_products = dtype != "bf16"  # bf16 runs vdpbf16ps on this project's CPUs (AVX512_BF16)
    fwd_ws = D * bq + bk * bq + bq * D + 2 * bk * D + (bk // 2) * bq + 3 * bq + 2 * bk * bq + bq
    fwd_pack = (4 * 2 * batch * kv_heads * sk * D + 4 * batch * kv_heads * -(-sk // bk)
                if fp32_products and (sq > bq or heads > kv_heads) else 0)
    fwd = 4 * fwd_ws * max(1, min(threads, batch * heads * -(-sq // bq))) + fwd_pack
    if direction == "fwd":
        return fwd
    bq = bk = 64
    bwd_ws = 2 * D * bk + 3 * bk * D + 2 * bq * D + 2 * bq * bk + bq * D + bk * D + 2 * bq * bk + 2 * bk
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
    bwd_pack = (4 * 2 * batch * heads * sq * D + 4 * batch * heads * -(-sq // bq)
                if fp32_products and sk > bk else 0)
    # The forward runs in the same step (its workspace is the same per-thread buffer grown; its
    # packed K / V is freed before the backward starts).
    ws = 4 * max(bwd_ws, fwd_ws) * max(1, min(threads, nbh * chunks))
    return ws + max(fwd_pack, bwd_pack + 8 * batch * heads * sq + dq)


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


def fma_peak(threads: list[int], cpu_time: bool = False) -> dict:
    """f32 FMA peak GFLOP/s of this machine per thread count ({} when it cannot be measured); with
    cpu_time, each probe thread is timed by its own CPU time (the clock of a --cpu-time bench)."""
    try:
        exe = _fma_peak_binary()
        if exe is None:
            return {}
        out = subprocess.run([exe, *(["--cpu-time"] if cpu_time else []), *map(str, threads)],
                             capture_output=True, text=True, timeout=120)
        peaks = {}
        for line in out.stdout.splitlines():
            rec = json.loads(line)
            peaks[str(rec["threads"])] = {"gflops": rec["gflops"], "vector_bits": rec["vector_bits"],
                                          "clock": "thread CPU time" if cpu_time else "wall"}
        return peaks
    except Exception as e:  # noqa: BLE001 - the peak is informative, never fatal
        return {"error": str(e).splitlines()[0][:200] if str(e) else type(e).__name__}


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _other_threads_running() -> bool | None:
    """Whether a thread of this process other than the caller is running or waiting for a CPU
    (Linux /proc; None where that cannot be read)."""
    import threading
    me = str(threading.get_native_id())
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                stat = fh.read()
        except OSError:  # the thread ended
            continue
        if stat[stat.rfind(")") + 2] in "RD":
            return True
    return False


def _settle(limit: float = 0.5, step: float = 0.002) -> None:
    """Waits (at most `limit` s) until the process's other threads have finished what a call left
    behind after its result was ready (XLA frees a large module's temporaries on a pool thread:
    ~15 ms of CPU time after the S=2048 f32 forward): until none of them is running or runnable
    (where /proc cannot tell, until a `step`-long sleep costs the process under a tenth of it in
    CPU time, which a descheduled thread can fool)."""
    end = time.perf_counter() + limit
    while time.perf_counter() < end:
        running = _other_threads_running()
        if running is False:
            return
        c = time.process_time()
        time.sleep(step)
        if running is None and time.process_time() - c < 0.1 * step:
            return


def _settled_cpu_time(clock) -> float:
    """_settle(), and what it took by `clock` when that is the process's CPU time (the work other
    threads finished meanwhile), else 0: a sleep is nobody's wall time."""
    t = clock()
    _settle()
    return clock() - t if clock is time.process_time else 0.0


def _interleaved_times(fns: dict, args, *, latency: bool, min_time: float, repeats: int,
                       clock=time.perf_counter) -> dict:
    """Per impl: samples of seconds per call (by `clock`), taken in rounds (one sample of each impl
    per round). Each sample ends when the process is quiet again (_settle): with the process's CPU
    time as the clock the work an impl leaves to other threads is its own (sleeping costs no CPU
    time), and no impl's sample starts while another's is still running."""
    import jax
    once = {}
    for name, f in fns.items():
        jax.block_until_ready(f(*args))  # warm-up (compiled already)
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        once[name] = max(time.perf_counter() - t, 1e-7)
    _settle()
    per_sample = min_time / repeats
    counts = {n: max(1, int(per_sample / o)) for n, o in once.items()}
    samples: dict = {n: [] for n in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            n = counts[name]
            if latency:
                ts = []
                for _ in range(n):
                    t = clock()
                    jax.block_until_ready(f(*args))
                    ts.append(clock() - t)
                tail = _settled_cpu_time(clock) / n
                samples[name].extend(x + tail for x in ts)
            else:
                t = clock()
                out = None
                for _ in range(n):
                    out = f(*args)
                jax.block_until_ready(out)
                took = clock() - t + _settled_cpu_time(clock)
                samples[name].append(took / n)
    return samples


def measure_cpu_case(impls, direction, hdim, dtype, causal, batch, heads, kv_heads, sq, sk, rng, *,
                     min_time, repeats, latency_max, threads, peak, cpu_time=False) -> list[dict]:
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
                   mode="latency" if latency else "throughput", loadavg=load,
                   clock="process CPU time" if cpu_time else "wall")
        recs[impl] = rec
        try:
            if impl == "torch":
                fns[impl] = torch_callable(direction, causal, args, threads)
                continue
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
    def leaves(impl):
        outs = fns[impl].outputs() if impl == "torch" else jax.tree_util.tree_leaves(fns[impl](*args))
        return [np.asarray(x, np.float64) for x in outs]

    for impl, ref in (("flashgen", "xla"), ("einsum_rewritten", "einsum"), ("flashgen_jax", "xla"),
                      ("torch", "xla")):
        if impl in fns and ref in fns:
            try:
                got, want = leaves(impl), leaves(ref)
                recs[impl]["max_err_vs_" + ref] = max(
                    float(np.max(np.abs(g - w)) / max(1.0, float(np.max(np.abs(w))))) for g, w in zip(got, want))
            except Exception as e:  # noqa: BLE001
                recs[impl]["max_err_vs_" + ref] = None
                recs[impl].setdefault("error", f"comparison failed: {str(e)[:200]}")
    if fns:
        try:
            samples = _interleaved_times(fns, args, latency=latency, min_time=min_time, repeats=repeats,
                                         clock=time.process_time if cpu_time else time.perf_counter)
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


def _ratio(num, den, suffix="") -> str:
    ok = num is not None and den is not None and num.get("ms") and den.get("ms")
    return f"{num['ms'] / den['ms']:.2f}{suffix}" if ok else "-"


def _by_case(results: list[dict]) -> dict:
    cases: dict = {}
    for r in results:
        key = (r["direction"], r["hdim"], r["dtype"], r["causal"], r["batch"], r["heads"], r["kv_heads"],
               r["seqlen_q"], r["seqlen_k"])
        cases.setdefault(key, {})[r["impl"]] = r
    return cases


def _case_name(key) -> str:
    d, h, t, c, b, hh, hkv, sq, sk = key
    gqa = f" GQA {hh}/{hkv}" if hkv != hh else ""
    return f"{'fwd' if d == 'fwd' else 'fwd+bwd'} {t} D={h}{gqa} {'causal' if c else 'full'} S={sq}"


def summarize_cpu(results: list[dict]) -> list[str]:
    """One row per case: XLA, flashgen and torch (time, XLA / flashgen and torch / flashgen, GFLOP/s,
    % of the FMA peak, temp memory), and the einsum attention original vs rewritten."""
    head = (f"{'case':34} | {'xla':>10} {'flashgen':>10} {'torch':>10} {'x/fg':>5} {'t/fg':>5} "
            f"{'GFLOP/s':>8} {'%peak':>6} | {'temp xla':>9} {'temp fg':>9} | {'einsum':>10} "
            f"{'einsum_rw':>10} {'ratio':>6}")
    rows = [head, "-" * len(head)]
    for key, by in _by_case(results).items():
        d = key[0]
        x, f, tc = by.get("xla"), by.get("flashgen"), by.get("torch")
        e, er = by.get("einsum"), by.get("einsum_rewritten") or (by.get("flashgen") if d == "fwd_bwd" else None)
        gf = f"{f['gflops']:.1f}" if f and f.get("ms") else "-"
        pk = f"{100 * f['peak_fraction']:.0f}%" if f and f.get("peak_fraction") else "-"
        tx = _fmt_bytes(x.get("temp_bytes")) if x else "-"
        tf = (_fmt_bytes((f.get("temp_bytes") or 0) + (f.get("kernel_scratch_bytes") or 0)) if f else "-")
        rows.append(f"{_case_name(key):34} | {_fmt_time(x):>10} {_fmt_time(f):>10} {_fmt_time(tc):>10} "
                    f"{_ratio(x, f):>5} {_ratio(tc, f):>5} {gf:>8} {pk:>6} | {tx:>9} {tf:>9} | {_fmt_time(e):>10} "
                    f"{_fmt_time(er) if d == 'fwd' else '(fg) ' + _fmt_time(er):>10} {_ratio(e, er):>6}")
    rows.append("x/fg, t/fg = xla, torch time / flashgen time (> 1: flashgen faster); GFLOP/s and %peak of "
                "flashgen (peak: f32 FMA, all threads, this run's probe); temp fg = XLA temp + flashgen kernel "
                "scratch; einsum_rw = einsum module rewritten (fwd_bwd: flashgen's gradient)")
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
    bad = [i for i in (args.impls or ()) if i not in CPU_ALL_IMPLS]
    if bad:
        raise ValueError(f"unknown CPU impls {bad}: choose from {', '.join(CPU_ALL_IMPLS)}")
    has_torch = _torch_available()
    if args.impls and "torch" in args.impls and not has_torch:
        raise ValueError("--impls torch: torch is not installed (pip install torch)")
    peers = lambda impls: tuple(i for i in impls if i != "torch" or has_torch)
    # flashgen is every ratio's denominator and XLA the reference every output is checked against:
    # both are timed whatever --impls names (`--impls torch` is torch next to them).
    asked = args.impls and tuple(dict.fromkeys(("xla", "flashgen", *args.impls)))
    fwd_impls = tuple(i for i in (asked or peers(CPU_FWD_IMPLS)) if i in CPU_ALL_IMPLS)
    bwd_impls = tuple(i for i in (asked or peers(CPU_BWD_IMPLS)) if i in CPU_BWD_IMPLS)
    directions = ("fwd",) if args.no_bwd else ("fwd", "fwd_bwd")
    threads = _cpu_count()
    cpu_time = getattr(args, "cpu_time", False)
    peak = {} if args.no_peak else fma_peak(sorted({1, threads}), cpu_time)
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
                                    latency_max=args.latency_max, threads=threads, peak=peak,
                                    cpu_time=cpu_time)
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
    env.update({"fma_peak": peak, "fma_peak_after": {} if args.no_peak else fma_peak(sorted({1, threads}), cpu_time),
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
    write_json(args.json, doc)
    return 0


def markdown_cpu(doc: dict) -> list[str]:
    """The CPU results of a bench JSON document as a Markdown table (BENCHMARKS.md): ratios and peak
    shares, which compare across runs on a shared machine; the times are in the JSON."""
    peak = doc["environment"].get("fma_peak") or {}
    threads = str(doc["environment"].get("threads"))
    rows = ["| case | XLA / flashgen | torch / flashgen | flashgen % of f32 peak | einsum / einsum rewritten |",
            "|---|---:|---:|---:|---:|"]
    for key, by in _by_case(doc["results"]).items():
        f = by.get("flashgen")
        er = by.get("einsum_rewritten") if key[0] == "fwd" else None
        pk = f"{100 * f['peak_fraction']:.0f}%" if f and f.get("ms") and f.get("peak_fraction") else "-"
        rows.append(f"| {_case_name(key)} | {_ratio(by.get('xla'), f, '×')} | {_ratio(by.get('torch'), f, '×')} | "
                    f"{pk} | {_ratio(by.get('einsum'), er, '×')} |")
    p = peak.get(threads, {}).get("gflops")
    rows.append("")
    rows.append(f"Peak: f32 FMA, {threads} thread{'s' if threads != '1' else ''}, measured by the bench's probe at the "
                f"start of the run ({peak.get(threads, {}).get('clock', 'wall')} clock); bf16 "
                f"runs vdpbf16ps, whose peak is twice that." if p else "Peak: not measured.")
    return rows
