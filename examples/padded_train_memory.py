"""Temporary memory of a padded fine-tuning step before and after `flashgen rewrite` (issue 23).

The gradient of mean(h²) through a transformers GPT-NeoX (eager attention) called with
``inputs_embeds`` and an int ``attention_mask`` (added to the scores as finfo.min), traced by
torchax and exported; the rewriter turns each layer's attention forward and backward into
flashgen_fwd + flashgen_bwd (causal attribute, key padding as O(S) segment ids, the empty rows'
fix-ups). Prints XLA's compiled temporary memory (`memory_analysis().temp_size_in_bytes`) of the
original and of the rewritten step (plus the CPU kernels' own scratch, which XLA does not see).

    python examples/padded_train_memory.py --seq 4096

Defaults: batch 1, one head of 64: the rewriter checks each backward in float64 at its real
size and leaves sites with more than 2^24 elements in one [B, H, S, S] intermediate alone (README
"Training graphs"), so B·H = 1 is the largest that is rewritten at S = 4096. Needs torch,
torchax and transformers; compiles on CPU, runs nothing but the compiler (and the rewriter's
check).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def export_step(seq: int, batch: int, layers: int, hidden: int, heads: int) -> str:
    """The golden builder's step (tests/golden/cases/training_padded.py) at this size."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                    "golden"))
    from cases.training_padded import hf_padded_step
    return hf_padded_step("GPTNeoXConfig", "GPTNeoXModel", batch=batch, seq=seq, hidden=hidden,
                          heads=heads, layers=layers, intermediate_size=2 * hidden).mlir_module()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=1)
    args = ap.parse_args(argv)
    import time

    import flashgen.rewrite as fr
    from flashgen.bench_cpu import kernel_scratch_bytes
    from library_mask_memory import mib, temp_bytes

    text = export_step(args.seq, args.batch, args.layers, args.hidden, args.heads)
    start = time.perf_counter()
    result = fr.rewrite(text)
    took = time.perf_counter() - start
    training = [s for s in result.rewritten if s.backward_target]
    for s in training:
        print(f"rewritten: {s.target} + {s.backward_target} extras={s.extras_detail or '-'}")
    for s in result.rejected:
        print(f"left alone: {s.reason}")
    assert len(training) == args.layers, "expected every layer's attention rewritten"
    hdim = args.hidden // args.heads
    original = temp_bytes(text)
    rewritten = temp_bytes(result.to_bytes())
    threads = os.cpu_count() or 1
    scratch = max(kernel_scratch_bytes(d, hdim, "f32", args.batch, args.heads, args.heads,
                                       args.seq, args.seq, threads) for d in ("fwd", "bwd"))
    print(f"GPT-NeoX padded training step S={args.seq} B={args.batch} layers={args.layers} "
          f"heads={args.heads} d={hdim} f32: temp original {mib(original)}, rewritten "
          f"{mib(rewritten)} (+ kernel scratch {mib(scratch)}), ratio "
          f"{original / max(rewritten + scratch, 1):.1f}x; rewrite (with its check) {took:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
