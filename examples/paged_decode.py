"""Serving-style attention with flashgen: packed prefill, then decode from a paged KV cache.

Prompts of different lengths are packed into one [total_tokens, heads, head_dim] batch and
prefilled with flash_attention_varlen (causal per prompt); their keys and values go into a
paged cache (blocks of 16 rows, handed out in shuffled order as an allocator would); then
every sequence decodes a few tokens with flash_attention_paged (one query per sequence,
causal bottom-right: the new token sees its whole prefix). Every step is checked against
float64 attention over each sequence's contiguous keys (flashgen.reference). Random projections stand in for a
model: this is about the attention calls and the cache bookkeeping.

    python3 examples/paged_decode.py [--lengths 37,5,120] [--steps 4] [--json out.json]
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from flashgen import reference
from flashgen.jax import flash_attention_paged, flash_attention_varlen

BLOCK = 16


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="37,5,120", help="prompt lengths, comma-separated")
    p.add_argument("--steps", type=int, default=4, help="decode steps per sequence")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--json", help="write the errors as JSON here")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    b, hq, hkv, d = len(lengths), args.heads, args.kv_heads, args.head_dim
    rng = np.random.default_rng(0)
    max_len = max(lengths) + args.steps
    max_blocks = -(-max_len // BLOCK)
    num_blocks = b * max_blocks + 4
    table = rng.permutation(num_blocks)[:b * max_blocks].reshape(b, max_blocks).astype(np.int32)
    k_cache = np.zeros((num_blocks, BLOCK, hkv, d), np.float32)
    v_cache = np.zeros_like(k_cache)
    history = [{"k": [], "v": [], "q": []} for _ in range(b)]  # contiguous copies, for checking

    def put(seq, pos, k, v):  # one token's K/V into its cache block
        blk, row = table[seq, pos // BLOCK], pos % BLOCK
        k_cache[blk, row], v_cache[blk, row] = k, v
        history[seq]["k"].append(k)
        history[seq]["v"].append(v)

    def dense(seq, q):  # float64 attention over the sequence's contiguous keys, last len(q) queries
        k, v = (np.stack(history[seq][n])[None] for n in "kv")
        return reference.attention(np.asarray(q)[None], k, v, causal=True, bottom_right=True)[0][0]

    errors = {"prefill": 0.0, "decode": 0.0}
    # ---- prefill: packed prompts, causal per prompt
    total = sum(lengths)
    q, k, v = (rng.standard_normal((total, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    o = flash_attention_varlen(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), cu, cu,
                               max(lengths), max(lengths), causal=True)
    for s in range(b):
        for t in range(lengths[s]):
            put(s, t, k[cu[s] + t], v[cu[s] + t])
        want = dense(s, q[cu[s]:cu[s + 1]])
        errors["prefill"] = max(errors["prefill"], float(np.max(np.abs(o[cu[s]:cu[s + 1]] - want))))
    print(f"prefill: {b} prompts, {total} tokens packed; max |err| vs float64 per-sequence attention "
          f"{errors['prefill']:.2e}")

    # ---- decode: one new token per sequence per step, against the paged cache
    step = jax.jit(lambda q, kc, vc, used: flash_attention_paged(
        q, kc, vc, jnp.asarray(table), used, causal=True, bottom_right=True))
    used = np.array(lengths, np.int32)
    for i in range(args.steps):
        q = rng.standard_normal((b, 1, hq, d)).astype(np.float32)
        k = rng.standard_normal((b, hkv, d)).astype(np.float32)
        v = rng.standard_normal((b, hkv, d)).astype(np.float32)
        for s in range(b):
            put(s, int(used[s]), k[s], v[s])
        used += 1
        o = step(jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache), jnp.asarray(used))
        for s in range(b):
            err = float(np.max(np.abs(np.asarray(o[s]) - dense(s, q[s]))))
            errors["decode"] = max(errors["decode"], err)
    print(f"decode: {args.steps} steps x {b} sequences from a paged cache ({num_blocks} blocks of "
          f"{BLOCK}, shuffled); max |err| vs float64 contiguous attention {errors['decode']:.2e}")
    ok = max(errors.values()) < 1e-4
    print("PASS" if ok else "FAIL")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**errors, "ok": ok}, f)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
