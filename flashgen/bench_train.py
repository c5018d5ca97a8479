"""A training step, original vs rewritten: compiled temporary memory and CPU time.

    python3 -m flashgen.bench_train --seq 2048 --json bench/results/train-cpu-$(date +%F).json

The step is ``jax.grad`` of a mean-squared loss of a small pre-norm transformer (RMS norm,
causal attention through ``jax.nn.dot_product_attention``, GELU MLP) with respect to every
weight and the input, exported with ``jax.export``. The rewriter replaces each layer's
attention forward and its backward by flashgen_fwd / flashgen_bwd calls
(flashgen.rewrite.backward); both modules run in this process on the same inputs. The
model (``layer``, ``weight_shapes``, ``grad_step``) is also what the golden training cases
are built from (tests/golden/generate_train.py).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def layer(x, w, *, attention, heads, kv_heads, head_dim, mask=None, causal=True):
    """One pre-norm block; ``attention(q, k, v, mask, causal)`` takes [B, T, H, D] tensors."""
    import jax
    import jax.numpy as jnp
    b, t, c = x.shape
    h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    q = (h @ w["q"]).reshape(b, t, heads, head_dim)
    k = (h @ w["k"]).reshape(b, t, kv_heads, head_dim)
    v = (h @ w["v"]).reshape(b, t, kv_heads, head_dim)
    x = x + attention(q, k, v, mask, causal).reshape(b, t, c) @ w["o"]
    return x + jax.nn.gelu(x @ w["up"]) @ w["down"]


def weight_shapes(heads, kv_heads, head_dim) -> dict:
    c = heads * head_dim
    return dict(q=(c, c), k=(c, kv_heads * head_dim), v=(c, kv_heads * head_dim), o=(c, c),
                up=(c, 2 * c), down=(2 * c, c))


def jnn_attention(q, k, v, mask=None, causal=True):
    import jax
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal)


def grad_step(*, layers=2, heads=4, kv_heads=None, head_dim=32, attention=jnn_attention,
              remat=False, padding=False):
    """grad over (weights, x) of mean((model(x) - y)²); with ``padding`` the loss takes a
    [B, T] key mask as its last argument."""
    import jax
    import jax.numpy as jnp
    kv_heads = kv_heads or heads

    def loss(ws, x, y, *mask):
        m = mask[0][:, None, None, :] if padding else None
        for w in ws[:layers]:
            def one(x_, w_):
                return layer(x_, w_, attention=attention, heads=heads, kv_heads=kv_heads,
                             head_dim=head_dim, mask=m)
            x = (jax.checkpoint(one) if remat else one)(x, w)
        return jnp.mean((x.astype(jnp.float32) - y) ** 2)
    return jax.grad(loss, argnums=(0, 1))


def _inputs(rng, layers, batch, seq, heads, kv_heads, head_dim, dtype):
    """Weights scaled by 1/sqrt(fan-in) so that activations stay O(1) through the layers."""
    import jax.numpy as jnp
    dt = jnp.dtype(dtype)
    ws = [{n: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), dt)
           for n, s in weight_shapes(heads, kv_heads, head_dim).items()} for _ in range(layers)]
    c = heads * head_dim
    return (ws, jnp.asarray(rng.standard_normal((batch, seq, c)), dt),
            jnp.asarray(rng.standard_normal((batch, seq, c)), jnp.float32))


def measure(dtype, *, layers, batch, seq, heads, kv_heads, head_dim, min_time, repeats) -> dict:
    import os
    import statistics
    import jax
    from flashgen.bench_cpu import _cpu_count, _exported_call, _interleaved_times, \
        kernel_scratch_bytes
    rng = np.random.default_rng(0)
    args = _inputs(rng, layers, batch, seq, heads, kv_heads, head_dim, dtype)
    fn = grad_step(layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    rec = dict(dtype=dtype, layers=layers, batch=batch, seq=seq, heads=heads,
               kv_heads=kv_heads, head_dim=head_dim, causal=True,
               loadavg=list(os.getloadavg()) if hasattr(os, "getloadavg") else None)
    fns, outs = {}, {}
    for name, rewrite in (("original", False), ("rewritten", True)):
        f, info = _exported_call(fn, args, rewrite=rewrite)
        rec.update({f"{name}_{k}": v for k, v in info.items()})
        mem = f.lower(*args).compile().memory_analysis()
        rec[f"{name}_temp_bytes"] = int(mem.temp_size_in_bytes) if mem is not None else None
        outs[name] = [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(f(*args))]
        fns[name] = f
    # the kernels' own workspace, which XLA does not see (bench_cpu.kernel_scratch_bytes)
    dt = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    rec["rewritten_kernel_scratch_bytes"] = max(
        kernel_scratch_bytes(d, head_dim, dt, batch, heads, kv_heads, seq, seq, _cpu_count())
        for d in ("fwd", "bwd"))
    samples = _interleaved_times(fns, args, latency=False, min_time=min_time, repeats=repeats)
    for name, xs in samples.items():
        rec[f"{name}_ms"] = statistics.median(xs) * 1e3
    rec["max_grad_error"] = max(float(np.max(np.abs(a - b)) / np.max(np.abs(a)))
                                for a, b in zip(outs["original"], outs["rewritten"]))
    return rec


def markdown(rec: dict) -> str:
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    return (f"| {rec['dtype']} S={rec['seq']} B={rec['batch']} H={rec['heads']} D={rec['head_dim']}"
            f" {rec['layers']} layers | {mib(rec['original_temp_bytes'])} → "
            f"{mib(rec['rewritten_temp_bytes'])} (+ {mib(rec['rewritten_kernel_scratch_bytes'])} "
            f"kernel scratch) | {rec['original_ms']:.0f} → "
            f"{rec['rewritten_ms']:.0f} ms ({rec['original_ms'] / rec['rewritten_ms']:.2f}×) | "
            f"{rec['max_grad_error']:.1e} |")


def main(argv=None) -> int:
    from flashgen.bench_common import environment, json_output, write_json
    p = argparse.ArgumentParser(prog="python3 -m flashgen.bench_train", description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dtype", default="float32,bfloat16")
    p.add_argument("--min-time", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="write the records (and the environment) here")
    a = p.parse_args(argv)
    json_output(a.json)  # a bad --json path fails now, not after the measurements
    records = []
    for dtype in a.dtype.split(","):
        rec = measure(dtype, layers=a.layers, batch=a.batch, seq=a.seq, heads=a.heads,
                      kv_heads=a.kv_heads or a.heads, head_dim=a.head_dim,
                      min_time=a.min_time, repeats=a.repeats)
        records.append(rec)
        print(markdown(rec), flush=True)
    write_json(a.json, dict(environment=environment("cpu"), records=records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
