"""`flashgen bench`: flashgen against the attention users have, timed in one process on the same
inputs. One mode per module, chosen by the platform and flags:

  bench_gpu.py       GPU: flashgen.jax.flash_attention vs cuDNN and XLA attention
  bench_cpu.py       CPU: original vs flashgen-rewritten exported modules (the product path)
  bench_variants.py  --variants: packed varlen and paged-KV decode, tokens/s
  bench_common.py    what they share: FLOP convention, cases, environment, timing, JSON output

A training step (original vs rewritten, memory and CPU time) is not a mode of this command:
it is ``python -m flashgen.bench_train`` (bench_train.py).
"""
from __future__ import annotations

from flashgen import bench_cpu, bench_gpu, bench_variants
from flashgen.bench_common import json_output, write_json
from flashgen.cli_args import csv, csv_ints


def run(args) -> int:
    import jax
    json_output(args.json)  # a bad --json path fails now, not after the measurements
    if args.platform:
        jax.config.update("jax_platforms", args.platform)
    on_gpu = jax.default_backend() in ("gpu", "cuda")
    if args.variants:
        write_json(args.json, bench_variants.run_variants(args, on_gpu))
        return 0
    return bench_gpu.run_gpu(args) if on_gpu else bench_cpu.run_cpu(args)


def register(sub) -> None:
    p = sub.add_parser("bench", help="time flashgen against cuDNN and XLA attention (on CPU: exported "
                                     "modules, original vs rewritten)")
    p.add_argument("--platform", choices=["cpu", "cuda"], help="default: JAX's default backend")
    p.add_argument("--hdim", type=csv_ints, help="default: 64,128 (GPU), 64 (CPU)")
    p.add_argument("--dtype", type=csv, help="default: bf16 (GPU), f32,bf16 (CPU)")
    p.add_argument("--causal", choices=["both", "true", "false"], default="both")
    p.add_argument("--seqlens", type=csv_ints,
                   help="default: 512,...,16384 (GPU), 64,128,512,2048,4096 (CPU)")
    p.add_argument("--batch-tokens", type=int, default=16384, help="batch = batch_tokens // seqlen")
    p.add_argument("--heads-dim", type=int, default=2048, help="heads = heads_dim // hdim")
    p.add_argument("--batch", type=int, help="fixed batch (overrides --batch-tokens; CPU default 1)")
    p.add_argument("--heads", type=int, help="fixed heads (overrides --heads-dim; CPU default 8)")
    p.add_argument("--kv-heads", type=int, help="GQA: kv heads (default: heads)")
    p.add_argument("--bwd", action="store_true", help="GPU: also time forward+backward (always on CPU)")
    p.add_argument("--no-bwd", action="store_true", help="CPU: forward only")
    p.add_argument("--impls", type=csv, help="GPU: subset of flashgen,cudnn,xla,einsum, and flashgen@<target> (flashgen on that target's kernels, e.g. flashgen@sm80 on an H100); CPU: peers of xla,flashgen "
                                              "(always timed) among " + ",".join(bench_cpu.CPU_ALL_IMPLS))
    p.add_argument("--min-time", type=float, default=0.3, help="seconds of timed calls per measurement "
                                                               "(CPU: per impl and case)")
    p.add_argument("--repeats", type=int, default=7, help="CPU: interleaved rounds per case (median)")
    p.add_argument("--latency-max", type=int, default=256,
                   help="CPU: time each call synced (latency, us) up to this sequence length")
    p.add_argument("--no-peak", action="store_true", help="CPU: skip the FMA peak probe")
    p.add_argument("--cpu-time", action="store_true",
                   help="CPU: time with the process's CPU time instead of the wall clock (a loaded machine "
                        "then slows no impl by descheduling it; meant for runs pinned to one CPU, where "
                        "every impl computes on one thread and spinning idle threads cannot count; the FMA probe "
                        "is timed by its threads' CPU time too)")
    p.add_argument("--markdown", action="store_true", help="CPU: also print the table as Markdown")
    p.add_argument("--scaling", action="store_true",
                   help="CPU: also time S=2048 pinned to 1 CPU and to all CPUs (child processes)")
    p.add_argument("--variants", action="store_true",
                   help="time packed varlen and paged-KV decode instead (tokens/s; flashgen/bench_variants.py)")
    p.add_argument("--varlen-mean", type=int, default=512, help="--variants: mean sequence length")
    p.add_argument("--decode-batch", type=csv_ints, default=[1, 16],
                   help="--variants: decode batch sizes")
    p.add_argument("--decode-context", type=int, default=4096, help="--variants: keys per sequence")
    p.add_argument("--json", help="write the results as JSON here")
    p.set_defaults(func=run)
