"""A transformer block sharded data × model over 8 devices, and ring attention over 4.

Runs on a CPU-only machine (the 8 devices are forced host devices):

    python3 examples/sharded_transformer.py

Part 1 — tensor + data parallelism, no shard_map: a pre-norm block (GQA attention
through flashgen.jax.flash_attention, then a GELU MLP) whose weights are sharded
Megatron-style over the "model" axis (q/k/v and the MLP's first layer split by
columns = by heads, the output projections by rows) and whose batch is split over
"data". jit's partitioner (Shardy) places the flashgen custom calls per device on
[B/2, S, H/4, D] shards; the compiled step moves no activations for attention —
only the all-reduces Megatron needs after the row-parallel projections (and the
data-parallel gradient sums).

Part 2 — sequence parallelism: the same attention over a sequence 4× longer, split
over 4 devices with flashgen.jax.ring_attention inside shard_map; K/V blocks rotate
with ppermute, forward and backward exact.
"""
from __future__ import annotations

import os
import re
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run from a checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

from flashgen.jax import flash_attention, ring_attention  # noqa: E402

B, S, E = 4, 256, 512          # batch, sequence, model width
HQ, HKV, D = 8, 4, 64          # q heads, kv heads (GQA groups of 2), head dim
F = 4 * E                      # MLP width


def init(key):
    ks = jax.random.split(key, 6)
    w = lambda k, shape: jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[0])
    return {"wq": w(ks[0], (E, HQ * D)), "wk": w(ks[1], (E, HKV * D)), "wv": w(ks[2], (E, HKV * D)),
            "wo": w(ks[3], (HQ * D, E)), "w1": w(ks[4], (E, F)), "w2": w(ks[5], (F, E))}


def param_specs():
    col, row = P(None, "model"), P("model", None)  # column split = head split for wq/wk/wv
    return {"wq": col, "wk": col, "wv": col, "wo": row, "w1": col, "w2": row}


def layer_norm(x):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)


def block(p, x, attention):
    b, s, _ = x.shape
    h = layer_norm(x)
    q = (h @ p["wq"]).reshape(b, s, HQ, D)
    k = (h @ p["wk"]).reshape(b, s, HKV, D)
    v = (h @ p["wv"]).reshape(b, s, HKV, D)
    x = x + attention(q, k, v).reshape(b, s, HQ * D) @ p["wo"]
    return x + jax.nn.gelu(layer_norm(x) @ p["w1"]) @ p["w2"]


def loss_fn(p, x, attention):
    return jnp.mean(block(p, x, attention) ** 2)


def collectives(hlo: str) -> dict:
    found = re.findall(r"= (\([^()]*\)|\S+) (all-gather|all-to-all|collective-permute|all-reduce|"
                       r"reduce-scatter)(?:-start)?\(", hlo)
    out: dict = {}
    for shape, op in found:
        parts = re.findall(r"\w+\[[\d,]*\]", shape)
        out.setdefault(op, []).append(parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")")
    return out


def part1_tensor_and_data_parallel():
    print("== Part 1: transformer block, mesh data=2 × model=4 ==")
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    params = init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (B, S, E), jnp.float32)
    attention = lambda q, k, v: flash_attention(q, k, v, causal=True)

    p_sh = {n: jax.device_put(w, NamedSharding(mesh, s)) for (n, w), s in
            zip(params.items(), param_specs().values())}
    x_sh = jax.device_put(x, NamedSharding(mesh, P("data")))
    step = jax.jit(jax.value_and_grad(lambda p, x: loss_fn(p, x, attention)))
    compiled = step.lower(p_sh, x_sh).compile()
    hlo = compiled.as_text()
    calls = [re.search(r"custom_call_target=\"(\w+)\"", l).group(1) + " -> " +
             " ".join(re.findall(r"f32\[[\d,]+\]", l.split("custom-call(")[0]))
             for l in hlo.splitlines() if 'custom_call_target="flashgen_' in l]
    print("per-device flashgen calls (result shapes):", *calls, sep="\n  ")
    print("collectives in the compiled train step:")
    for op, shapes in collectives(hlo).items():
        print(f"  {op:>18} × {len(shapes)}: {'; '.join(sorted(set(shapes)))}")

    loss, grads = step(p_sh, x_sh)
    loss0, grads0 = jax.jit(jax.value_and_grad(lambda p, x: loss_fn(p, x, attention)))(params, x)
    err = max(float(jnp.max(jnp.abs(grads[n] - grads0[n]))) for n in grads)
    print(f"loss sharded {float(loss):.6f} vs unsharded {float(loss0):.6f}; max grad diff {err:.2e}")
    ref_loss = loss_fn(params, x, lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
    print(f"loss with jax.nn.dot_product_attention: {float(ref_loss):.6f}")


def part2_ring_attention():
    print("\n== Part 2: ring attention, sequence split over 4 devices ==")
    n, s_total = 4, 4 * S
    mesh = jax.make_mesh((n,), ("seq",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
    keys = jax.random.split(jax.random.key(2), 3)
    q = jax.random.normal(keys[0], (B, s_total, HQ, D), jnp.float32)
    k = jax.random.normal(keys[1], (B, s_total, HKV, D), jnp.float32)
    v = jax.random.normal(keys[2], (B, s_total, HKV, D), jnp.float32)
    spec = P(None, "seq")
    ring = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="seq", causal=True),
                         mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    loss = lambda attn: (lambda q, k, v: jnp.sum(attn(q, k, v) ** 2))
    ring_step = jax.jit(jax.value_and_grad(loss(ring), (0, 1, 2)))
    single_step = jax.jit(jax.value_and_grad(loss(lambda q, k, v: flash_attention(q, k, v, causal=True)),
                                             (0, 1, 2)))
    hlo = ring_step.lower(q, k, v).compile().as_text()
    for op, shapes in collectives(hlo).items():
        print(f"  {op:>18} × {len(shapes)}: {'; '.join(sorted(set(shapes)))}")
    (val, g), (val0, g0) = ring_step(q, k, v), single_step(q, k, v)
    err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(g, g0))
    print(f"S={s_total} over {n} devices: loss {float(val):.4f} vs single device {float(val0):.4f}; "
          f"max grad diff {err:.2e}")
    for name, fn in (("ring (4 devices)", ring_step), ("single device", single_step)):
        jax.block_until_ready(fn(q, k, v))
        t0 = time.perf_counter()
        jax.block_until_ready(fn(q, k, v))
        print(f"  {name:>16}: {1e3 * (time.perf_counter() - t0):.1f} ms per forward+backward")


if __name__ == "__main__":
    part1_tensor_and_data_parallel()
    part2_ring_attention()
