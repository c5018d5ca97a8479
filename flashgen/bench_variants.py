"""`flashgen bench --variants`: packed variable-length batches and paged-KV decode, in tokens/s.

Rows, each timed in one process on the same inputs (bench_common.time_call; medians):

varlen (forward, and forward+backward): B sequences of random lengths
(mean --varlen-mean, total about --batch-tokens real tokens), packed:
  flashgen_varlen  flashgen.jax.flash_attention_varlen on the packed tokens
  flashgen_padded  flash_attention on the batch padded to the longest sequence, key padding
                   as segment ids (what a dense kernel does with ragged data)
  xla_padded       jax.nn.dot_product_attention(implementation="xla") padded, with
                   query_seq_lengths / key_value_seq_lengths
  cudnn_padded     the same with implementation="cudnn" (GPU only)
tokens/s counts real (unpadded) query tokens.

decode (Sq = 1, causal, bottom-right): B sequences of --decode-context keys in a paged cache
(block 16, blocks shuffled):
  flashgen_paged   flashgen.jax.flash_attention_paged (split-KV when B·H is small)
  xla_gather       gather the cache through the block table, then jax.nn.dot_product_attention
                   with key_value_seq_lengths (what XLA users write)
  xla_dense        the same on an already contiguous cache (no gather: a lower bound)
  cudnn_dense      contiguous cache through cuDNN (GPU only)
tokens/s = B / time per step.
"""
from __future__ import annotations

import sys

import numpy as np

from flashgen.bench_common import environment, time_call


def _jnp_dtype(name):
    import jax.numpy as jnp
    return {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}[name]


def varlen_case(rng, hdim, dtype, causal, total_tokens, mean_len, heads, kv_heads, on_gpu, min_time):
    import jax
    import jax.numpy as jnp
    from flashgen.jax import flash_attention, flash_attention_varlen
    lens = []
    while sum(lens) < total_tokens:
        lens.append(int(rng.integers(max(1, mean_len // 4), mean_len * 7 // 4 + 1)))
    lens[-1] -= sum(lens) - total_tokens
    lens = [n for n in lens if n > 0]
    b, smax, t = len(lens), max(lens), sum(lens)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    dt = _jnp_dtype(dtype)
    q, k, v = (jnp.asarray(rng.standard_normal((t, h, hdim)), dt) for h in (heads, kv_heads, kv_heads))
    lengths = jnp.asarray(lens, jnp.int32)
    # the padded batch [B, Smax, H, D]
    idx = np.full((b, smax), t, np.int64)
    for i, n in enumerate(lens):
        idx[i, :n] = np.arange(int(cu[i]), int(cu[i]) + n)
    pad = lambda x: jnp.concatenate([x, jnp.zeros((1, *x.shape[1:]), x.dtype)])[jnp.asarray(idx)]
    qp, kp, vp = pad(q), pad(k), pad(v)
    real = jnp.arange(smax)[None, :] < lengths[:, None]
    impls = {
        "flashgen_varlen": (lambda q, k, v: flash_attention_varlen(q, k, v, cu, cu, smax, smax,
                                                                   causal=causal), (q, k, v)),
        "flashgen_padded": (lambda q, k, v: flash_attention(
            q, k, v, causal=causal, q_segment_ids=real.astype(jnp.int32),
            kv_segment_ids=real.astype(jnp.int32)), (qp, kp, vp)),
        "xla_padded": (lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
            implementation="xla"), (qp, kp, vp)),
    }
    if on_gpu:
        impls["cudnn_padded"] = (lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
            implementation="cudnn"), (qp, kp, vp))
    rows = []
    for direction in ("fwd", "fwd_bwd"):
        for name, (fn, args) in impls.items():
            rows.append(_timed("varlen", name, direction, fn, args, t, min_time,
                               dict(hdim=hdim, dtype=dtype, causal=causal, batch=b, max_len=smax,
                                    tokens=t, heads=heads, kv_heads=kv_heads)))
    return rows


def decode_case(rng, hdim, dtype, batch, context, heads, kv_heads, on_gpu, min_time, block=16):
    import jax
    import jax.numpy as jnp
    from flashgen.jax import flash_attention_paged
    dt = _jnp_dtype(dtype)
    nblk = -(-context // block)
    table = rng.permutation(batch * nblk).reshape(batch, nblk).astype(np.int32)
    kc, vc = (jnp.asarray(rng.standard_normal((batch * nblk, block, kv_heads, hdim)), dt) for _ in "kv")
    q = jnp.asarray(rng.standard_normal((batch, 1, heads, hdim)), dt)
    used = jnp.full((batch,), context, jnp.int32)
    table_j = jnp.asarray(table)
    gather = lambda c: c[table_j].reshape(batch, nblk * block, kv_heads, hdim)
    kd, vd = gather(kc), gather(vc)
    lengths = used

    def dense(impl):
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=lengths, implementation=impl)
    impls = {
        "flashgen_paged": (lambda q, kc, vc: flash_attention_paged(q, kc, vc, table_j, used, causal=True,
                                                                  bottom_right=True), (q, kc, vc)),
        "xla_gather": (lambda q, kc, vc: dense("xla")(q, gather(kc), gather(vc)), (q, kc, vc)),
        "xla_dense": (dense("xla"), (q, kd, vd)),
    }
    if on_gpu:
        impls["cudnn_dense"] = (dense("cudnn"), (q, kd, vd))
    return [_timed("decode", name, "fwd", fn, args, batch, min_time,
                   dict(hdim=hdim, dtype=dtype, batch=batch, context=context, heads=heads,
                        kv_heads=kv_heads, block_size=block))
            for name, (fn, args) in impls.items()]


def _timed(kind, impl, direction, fn, args, tokens, min_time, case) -> dict:
    import jax
    rec = {"kind": kind, "impl": impl, "direction": direction, **case}
    if direction == "fwd":
        f = jax.jit(fn)
    else:
        def step(*a):
            o, vjp = jax.vjp(fn, *a)
            return vjp(jax.numpy.ones_like(o))
        f = jax.jit(step)
    try:
        ms = time_call(f, args, min_time=min_time)
        rec.update(ms=ms, tokens_per_s=tokens / (ms * 1e-3))
    except Exception as e:  # noqa: BLE001 - an impl that cannot run this case is a result too
        rec.update(ms=None, tokens_per_s=None, error=str(e).splitlines()[0][:300])
    status = f"{rec['ms']:.3f} ms  {rec['tokens_per_s']:.0f} tok/s" if rec["ms"] else rec["error"]
    print(f"{kind:6} {impl:16} {direction:7} {case}: {status}", file=sys.stderr, flush=True)
    return rec


def table(rows: list[dict]) -> list[str]:
    """One line per case: tokens/s of every impl and flashgen's ratio to the best peer."""
    out = []
    keys = []
    for r in rows:
        key = (r["kind"], r["direction"], tuple(sorted((k, v) for k, v in r.items()
                                                     if k in ("hdim", "dtype", "causal", "batch",
                                                              "context", "tokens", "max_len"))))
        if key not in keys:
            keys.append(key)
    for kind, direction, case in keys:
        group = [r for r in rows if r["kind"] == kind and r["direction"] == direction
                 and all(r.get(k) == v for k, v in case)]
        ours = [r for r in group if r["impl"].startswith("flashgen") and r["ms"]]
        peers = [r for r in group if not r["impl"].startswith("flashgen") and r["ms"]]
        cells = "  ".join(f"{r['impl']}={r['tokens_per_s']:.3g}" if r["ms"] else f"{r['impl']}=n/a"
                          for r in group)
        ratio = ""
        if ours and peers:
            best_ours = max(ours, key=lambda r: r["tokens_per_s"])
            best_peer = max(peers, key=lambda r: r["tokens_per_s"])
            ratio = (f"  {best_ours['impl']} / {best_peer['impl']} = "
                     f"{best_ours['tokens_per_s'] / best_peer['tokens_per_s']:.2f}x")
        out.append(f"{kind} {direction} {dict(case)}: {cells} tok/s{ratio}")
    return out


def run_variants(args, on_gpu: bool) -> dict:
    rng = np.random.default_rng(0)
    hdims = args.hdim or ([128] if on_gpu else [64])
    dtypes = args.dtype or (["bf16"] if on_gpu else ["f32"])
    heads = args.heads or (16 if on_gpu else 8)
    kv = args.kv_heads or max(1, heads // 4)
    tokens = args.batch_tokens if on_gpu else min(args.batch_tokens, 4096)
    rows = []
    for d in hdims:
        for dtype in dtypes:
            for causal in (True,):
                rows += varlen_case(rng, d, dtype, causal, tokens, args.varlen_mean, heads, kv, on_gpu,
                                    args.min_time)
            for batch in args.decode_batch:
                rows += decode_case(rng, d, dtype, batch, args.decode_context, heads, kv, on_gpu,
                                    args.min_time)
    lines = table(rows)
    print("\n".join(lines))
    return {"environment": environment("cuda" if on_gpu else "cpu"),
            "args": {k: v for k, v in vars(args).items() if k != "func"},
            "rows": rows, "table": lines}
