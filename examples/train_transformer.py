"""Train a small causal transformer LM with flashgen attention and with XLA attention.

Same initialization, same data, same optimizer; prints both loss curves, the step time ratio
and peak device memory. On a GPU this is the end-to-end check of issue 4; on a CPU it runs
the CPU backend (use small sizes).

    python examples/train_transformer.py --steps 300 --seq 1024 --dim 512 --layers 4   # GPU
    python examples/train_transformer.py --steps 20 --seq 128 --dim 128 --layers 2     # CPU
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from flashgen.jax import flash_attention


def init_params(key, vocab, dim, heads, layers):
    def dense(k, n_in, n_out):
        return jax.random.normal(k, (n_in, n_out), jnp.float32) / np.sqrt(n_in)
    keys = iter(jax.random.split(key, 2 + 4 * layers))
    params = {"embed": jax.random.normal(next(keys), (vocab, dim), jnp.float32) * 0.02,
              "out": dense(next(keys), dim, vocab), "layers": []}
    for _ in range(layers):
        params["layers"].append({"qkv": dense(next(keys), dim, 3 * dim), "proj": dense(next(keys), dim, dim),
                                 "up": dense(next(keys), dim, 4 * dim), "down": dense(next(keys), 4 * dim, dim)})
    return params


def make_model(attention, heads, dtype):
    def layer_norm(x):
        return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)

    def forward(params, tokens):
        x = params["embed"][tokens]
        b, s, dim = x.shape
        for p in params["layers"]:
            h = layer_norm(x).astype(dtype)
            q, k, v = jnp.split(h @ p["qkv"].astype(dtype), 3, axis=-1)
            shape = (b, s, heads, dim // heads)
            a = attention(q.reshape(shape), k.reshape(shape), v.reshape(shape))
            x = x + (a.reshape(b, s, dim) @ p["proj"].astype(dtype)).astype(jnp.float32)
            h = layer_norm(x).astype(dtype)
            x = x + (jax.nn.gelu(h @ p["up"].astype(dtype)) @ p["down"].astype(dtype)).astype(jnp.float32)
        return layer_norm(x) @ params["out"]

    def loss(params, tokens):
        logits = forward(params, tokens[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
    return loss


def train(attention, args, tokens_fn, params):
    dtype = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}[args.dtype]
    loss = make_model(attention, args.heads, dtype)

    @jax.jit
    def step(params, tokens):
        l, g = jax.value_and_grad(loss)(params, tokens)
        return jax.tree.map(lambda p, g: p - args.lr * g, params, g), l

    losses, times = [], []
    for i in range(args.steps):
        t = time.perf_counter()
        params, l = step(params, tokens_fn(i))
        losses.append(float(l))  # a host read per step: both variants pay it equally
        times.append(time.perf_counter() - t)
    stats = jax.devices()[0].memory_stats() or {}
    return losses, float(np.median(times[2:] if len(times) > 4 else times)), stats.get("peak_bytes_in_use")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--lr", type=float, default=0.3)
    p.add_argument("--json", help="write curves and figures here")
    args = p.parse_args()

    rng = np.random.default_rng(0)
    # A learnable synthetic language: each token repeats the one `period` positions back, plus noise.
    period = 7
    def tokens_fn(i):
        base = rng.integers(0, args.vocab, (args.batch, period))
        seq = np.tile(base, (1, (args.seq + 1) // period + 1))[:, :args.seq + 1]
        noise = rng.random(seq.shape) < 0.1
        return jnp.asarray(np.where(noise, rng.integers(0, args.vocab, seq.shape), seq), jnp.int32)

    params = init_params(jax.random.key(0), args.vocab, args.dim, args.heads, args.layers)
    runs = {}
    for name, attention in (
            ("flashgen", lambda q, k, v: flash_attention(q, k, v, causal=True)),
            ("xla", lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"))):
        rng = np.random.default_rng(0)  # identical data for both
        losses, step_s, peak = train(attention, args, tokens_fn, params)
        runs[name] = {"losses": losses, "step_ms": step_s * 1e3, "peak_bytes": peak}
        print(f"{name:8}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, step {step_s * 1e3:.1f} ms, "
              f"peak memory {peak / 2**20 if peak else float('nan'):.0f} MiB")
    f, x = runs["flashgen"], runs["xla"]
    gap = max(abs(a - b) for a, b in zip(f["losses"], x["losses"]))
    print(f"device {jax.devices()[0].device_kind}; step time xla/flashgen = {x['step_ms'] / f['step_ms']:.2f}; "
          f"max loss difference {gap:.4f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "device": jax.devices()[0].device_kind, "runs": runs}, fh, indent=1)


if __name__ == "__main__":
    main()
