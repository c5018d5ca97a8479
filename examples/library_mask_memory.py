"""Temporary memory of a transformers decoder before and after `flashgen rewrite` (issue 14).

transformers builds its causal (and Mistral's sliding-window) mask from gathered position ids;
the rewriter folds that into causal/window attributes, so the rewritten model keeps no S x S
mask or score buffer. This script exports a small Llama or Mistral (eager attention, no
attention_mask) through torchax, rewrites it, and prints XLA's compiled temporary memory
(`memory_analysis().temp_size_in_bytes`) of the original, of the rewritten module (plus the
CPU kernel's own scratch, which XLA does not see), and of one `flashgen.jax.flash_attention`
call of the model's attention shape for scale.

    python examples/library_mask_memory.py --model mistral --seq 4096

`--model keras_hub_llama`: keras_hub's LlamaBackbone with a boolean padding mask instead
(causal attribute + O(S) key padding). `--model bloom|falcon`: a transformers BloomModel /
FalconModel (alibi=True) with a left-padded attention_mask: ALiBi from cumsum(mask), a
[B, H, 1, S] bias operand (O(S)) + causal + key padding. Needs torch, torchax and transformers (or keras_hub);
compiles on CPU, runs nothing but the compiler.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def export_model(kind: str, seq: int, layers: int, hidden: int, heads: int, kv_heads: int,
                 window: int):
    if kind == "keras_hub_llama":
        return export_keras_hub_llama(seq, layers, hidden, heads, kv_heads)
    import torch
    import transformers
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=heads)
    inputs = {"input_ids": torch.randint(0, 128, (1, seq))}
    if kind == "bloom":
        config = transformers.BloomConfig(vocab_size=128, hidden_size=hidden, n_layer=layers,
                                          n_head=heads)
        model = transformers.BloomModel
    elif kind == "falcon":
        config = transformers.FalconConfig(**common, alibi=True, new_decoder_architecture=False,
                                           multi_query=False, parallel_attn=False)
        model = transformers.FalconModel
    else:
        common.update(intermediate_size=2 * hidden, num_key_value_heads=kv_heads,
                      max_position_embeddings=seq)
        if kind == "llama":
            config = transformers.LlamaConfig(**common)
            model = transformers.LlamaModel
        else:
            config = transformers.MistralConfig(**common, sliding_window=window)
            model = transformers.MistralModel
    if kind in ("bloom", "falcon"):   # ALiBi from the positions of a left-padded batch
        mask = torch.ones(1, seq, dtype=torch.int64)
        mask[0, :100] = 0
        inputs["attention_mask"] = mask
    config._attn_implementation = "eager"
    return _torchax_export(model(config).eval(), inputs)


def _torchax_export(net, inputs: dict):
    """The StableHLO text of ``net(**inputs).last_hidden_state`` (no cache), via torchax."""
    import torch
    from flashgen.frontends.torchax_compat import import_torchax
    torchax = import_torchax()
    names = list(inputs)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = net

        def forward(self, *args):
            return self.m(**dict(zip(names, args)), use_cache=False).last_hidden_state
    ep = torch.export.export(M(), tuple(inputs.values()))
    _, exported = torchax.export.exported_program_to_stablehlo(ep)
    return exported.mlir_module()


def export_keras_hub_llama(seq, layers, hidden, heads, kv_heads):
    """keras_hub's LlamaBackbone with a boolean padding mask (merged with its causal mask by
    an integer minimum)."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import jax
    import jax.numpy as jnp
    import keras
    import keras_hub
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=128, num_layers=layers, num_query_heads=heads,
        num_key_value_heads=kv_heads, hidden_dim=hidden, intermediate_dim=2 * hidden,
        max_sequence_length=seq)
    fn = jax.jit(lambda ids, pad: backbone({"token_ids": ids, "padding_mask": pad}))
    exported = jax.export.export(fn, platforms=["cpu"])(
        jax.ShapeDtypeStruct((1, seq), jnp.int32), jax.ShapeDtypeStruct((1, seq), jnp.bool_))
    return exported.mlir_module()


def temp_bytes(source) -> int:
    """XLA's temporary memory for the module's @main, compiled for CPU (flashgen targets
    registered, nothing executed)."""
    import jax
    from flashgen import execute
    loaded = execute._as_loaded(source)
    params, results = execute.signature(loaded)
    execute.register_targets(loaded, "cpu")
    exp = execute._exported(loaded, params, results, "cpu")
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exp.in_avals]
    return jax.jit(exp.call).lower(*avals).compile().memory_analysis().temp_size_in_bytes


def flash_temp_bytes(seq, heads, kv_heads, hdim, causal, window) -> int:
    import jax
    import jax.numpy as jnp
    from flashgen.jax import flash_attention
    q = jax.ShapeDtypeStruct((1, seq, heads, hdim), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, seq, kv_heads, hdim), jnp.float32)
    fn = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=causal, window=window))
    return fn.lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("llama", "mistral", "keras_hub_llama", "bloom", "falcon"),
                    default="llama")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--window", type=int, default=1024, help="Mistral's sliding_window")
    args = ap.parse_args(argv)
    import flashgen.rewrite as fr
    from flashgen.bench_cpu import kernel_scratch_bytes

    text = export_model(args.model, args.seq, args.layers, args.hidden, args.heads,
                        args.kv_heads, args.window)
    result = fr.rewrite(text)
    for s in result.rewritten:
        print(f"rewritten: {s.target} causal={s.causal} window={list(s.window)} "
              f"extras={s.extras_detail or '-'}")
    square = f"{args.seq},{args.seq}]"
    assert result.rewritten and not any(square in d for s in result.rewritten
                                        for d in s.extras_detail), \
        "expected causal/window attributes and no [.., S, S] operand"
    site = result.rewritten[0]
    hdim = args.hidden // args.heads
    original = temp_bytes(text)
    rewritten = temp_bytes(result.to_bytes())
    scratch = kernel_scratch_bytes("fwd", hdim, "f32", 1, args.heads, args.kv_heads, args.seq,
                                   args.seq, os.cpu_count() or 1)
    flash = flash_temp_bytes(args.seq, args.heads, args.kv_heads, hdim, site.causal,
                             tuple(site.window))
    print(f"{args.model} S={args.seq} layers={args.layers} heads={args.heads}/{args.kv_heads} "
          f"d={hdim} f32: temp original {mib(original)}, rewritten {mib(rewritten)} "
          f"(+ kernel scratch {mib(scratch)}), ratio {original / max(rewritten + scratch, 1):.0f}x; "
          f"one flashgen.jax.flash_attention call {mib(flash)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
