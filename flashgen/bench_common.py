"""What every `flashgen bench` mode shares: the FLOP convention, the case generator, the
environment record, timing, the einsum baseline and the JSON output.

FLOPs follow FlashAttention's benchmark convention: forward 4·B·H·Sq·Sk·D, halved when causal;
backward 2.5 × forward, so a forward+backward step counts 3.5 × forward.
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

from flashgen import targets


def flops(batch, heads, sq, sk, d, causal, direction) -> float:
    f = 4.0 * batch * heads * sq * sk * d / (2 if causal else 1)
    return f * (3.5 if direction == "fwd_bwd" else 1.0)


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
    if not targets.is_host(platform_name):
        env["gpu"] = _nvidia_smi()
    else:
        try:
            env["cpu_model"] = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                                    if l.startswith("model name"))
        except (OSError, StopIteration):
            pass
        env["flashgen_cpu_threads"] = os.environ.get("FLASHGEN_CPU_THREADS")
    return env


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


def max_seqlen(results: list[dict]) -> dict:
    """Largest sequence length each impl ran, per (direction, hdim, dtype, causal)."""
    out: dict = {}
    for r in results:
        if r["ms"] is not None:
            key = f"{r['impl']}/{r['direction']}/d{r['hdim']}/{r['dtype']}/{'causal' if r['causal'] else 'full'}"
            out[key] = max(out.get(key, 0), r["seqlen_q"])
    return out


def json_output(path):
    from flashgen import output_files
    (out,) = output_files.check([("--json", path)], make_dirs=True)
    return out


def write_json(path, doc) -> None:
    out = json_output(path)
    if out:
        out.write(json.dumps(doc, indent=1).encode())
        print(f"wrote {path}", file=sys.stderr)
