"""JAX/flax end to end: export a flax transformer, rewrite its attention, run it.

    python examples/jax_export_rewrite.py                 # a small GPT on CPU
    python examples/jax_export_rewrite.py --seq 128 --head-dim 64 --out /tmp/fg

Part 1 -- a shipped artifact (what a user who only has the exported model does):

  1. a flax.linen GPT (pre-LayerNorm blocks, causal self-attention, GELU MLP) is
     exported with ``jax.export`` and serialized to ``model.jax_exported``;
  2. ``flashgen rewrite model.jax_exported -o model.flashgen.jax_exported
     --verify --build DIR --report report.json`` replaces every attention with a
     flashgen custom call, checks the rewritten module against the original on
     random inputs, builds the CPU kernels it needs into DIR and names their
     manifest in the report;
  3. ``flashgen.jax.load(manifest)`` registers the kernels with JAX, and the
     rewritten artifact deserializes and runs like the original: same calling
     convention (the flax params pytree and the tokens' embeddings), same outputs
     up to float rounding.

Part 2 -- in the model's source (what a user who owns the model does): flax's
``attention_fn=`` hook, answered by ``flashgen.frontends.flax`` (an adapter from
flax's ``(query, key, value, bias, mask, ...)`` to
``flashgen.jax.flash_attention``). Outputs *and gradients* match flax's own
attention; biases and masks (also computed at run time) go to the kernels as operands.

Exits non-zero if any comparison fails; ``--json FILE`` writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import flax.linen as nn
from flax import nnx

import flashgen.jax as fj
from flashgen.frontends.flax import attention_fn, make_attention_fn

TOL = 2e-3  # max |a - b| / max(1, max |b|) for f32 outputs (flashgen's --verify tolerance)


# ------------------------------------------------------------------------------ the model
class Block(nn.Module):
    heads: int
    head_dim: int
    attention_fn: object = nn.dot_product_attention

    @nn.compact
    def __call__(self, x):
        width = self.heads * self.head_dim
        h = nn.LayerNorm()(x)
        if self.attention_fn is nn.dot_product_attention:
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))   # flax's usual causal mask
        else:
            mask = None                                          # causality is in attention_fn
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=width,
                                                attention_fn=self.attention_fn)(h, mask=mask)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(width)(nn.gelu(nn.Dense(4 * width)(h)))


class GPT(nn.Module):
    layers: int
    heads: int
    head_dim: int
    attention_fn: object = nn.dot_product_attention

    @nn.compact
    def __call__(self, x):
        for _ in range(self.layers):
            x = Block(self.heads, self.head_dim, self.attention_fn)(x)
        return nn.LayerNorm()(x)


# ------------------------------------------------------------------------------ helpers
def rel_error(got, want, floor: float = 1.0) -> float:
    """max |got - want| / max(floor, max |want|): flashgen's --verify measure (floor 1)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(floor, float(np.max(np.abs(want), initial=0.0)))
    return float(np.max(np.abs(got - want), initial=0.0) / scale)


def flashgen_cli(*args: str) -> subprocess.CompletedProcess:
    """Run the flashgen CLI (the same as typing ``flashgen ARGS`` in a shell)."""
    print("$ flashgen " + " ".join(shlex.quote(a) for a in args), flush=True)
    proc = subprocess.run([sys.executable, "-m", "flashgen", *args], capture_output=True, text=True)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"flashgen {args[0]} failed with exit code {proc.returncode}")
    return proc


def check(results: dict, name: str, err: float, tol: float = TOL) -> None:
    ok = bool(err <= tol)
    results[name] = {"max_rel_error": err, "tolerance": tol, "ok": ok}
    print(f"  {name:<34} max rel error {err:.2e}  (tol {tol:.0e})  {'ok' if ok else 'FAILED'}")


# ------------------------------------------------------------------------------ part 1
def export_rewrite_run(args, out: pathlib.Path, results: dict) -> None:
    print("== Part 1: jax.export -> flashgen rewrite --verify --build -> flashgen.jax.load ==")
    width = args.heads * args.head_dim
    model = GPT(args.layers, args.heads, args.head_dim)
    x = jax.random.normal(jax.random.key(1), (args.batch, args.seq, width), jnp.float32)
    params = model.init(jax.random.key(0), x)

    # 1. export and serialize: the artifact a user ships
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    exported = jax.export.export(jax.jit(model.apply), platforms=["cpu"])(
        jax.tree.map(spec, params), spec(x))
    src = out / "model.jax_exported"
    src.write_bytes(bytes(exported.serialize()))

    # 2. rewrite, verify numerically, build the kernels, write a report
    dst, report_path, lib_dir = out / "model.flashgen.jax_exported", out / "report.json", out / "lib"
    lib_dir.mkdir(exist_ok=True)
    flashgen_cli("rewrite", str(src), "-o", str(dst), "--verify", "--build", str(lib_dir),
                 "--report", str(report_path))
    report = json.loads(report_path.read_text())
    print(f"  report: {report['summary']['rewritten']} site(s) rewritten -> "
          f"{', '.join(report['targets'])}; manifest {report['manifest']}")
    results["sites_rewritten"] = report["summary"]["rewritten"]
    results["sites_expected"] = args.layers
    results["verified"] = report["verified"]

    # 3. register the kernels, deserialize the rewritten artifact, run it
    fj.load(report["manifest"])
    rewritten = jax.export.deserialize(bytearray(dst.read_bytes()))
    results["flashgen_calls_in_module"] = rewritten.mlir_module().count(
        "stablehlo.custom_call @flashgen_fwd_")
    y_flashgen = rewritten.call(params, x)
    y_exported = exported.call(params, x)
    y_flax = model.apply(params, x)
    check(results, "rewritten vs original export", rel_error(y_flashgen, y_exported))
    check(results, "rewritten vs flax model.apply", rel_error(y_flashgen, y_flax))
    if results["sites_rewritten"] != args.layers or results["flashgen_calls_in_module"] != args.layers:
        results["ok_sites"] = False
        print(f"  expected {args.layers} rewritten attention site(s)  FAILED")


# ------------------------------------------------------------------------------ part 2
def attention_hook(args, results: dict) -> None:
    print("== Part 2: flax attention_fn= hook -> flashgen.jax.flash_attention ==")
    width = args.heads * args.head_dim
    x = jax.random.normal(jax.random.key(2), (args.batch, args.seq, width), jnp.float32)

    # linen: the same parameters under flax's attention and under flashgen's
    flax_gpt = GPT(args.layers, args.heads, args.head_dim)
    flashgen_gpt = GPT(args.layers, args.heads, args.head_dim, make_attention_fn(causal=True))
    params = flax_gpt.init(jax.random.key(0), x)
    check(results, "linen GPT output", rel_error(jax.jit(flashgen_gpt.apply)(params, x),
                                                 flax_gpt.apply(params, x)))

    def loss(model):
        return lambda p, x: jnp.sum(model.apply(p, x) ** 2)
    g_flashgen = jax.jit(jax.grad(loss(flashgen_gpt), argnums=(0, 1)))(params, x)
    g_flax = jax.grad(loss(flax_gpt), argnums=(0, 1))(params, x)
    # relative to the largest gradient entry (some, like the key bias's, are ~0 by symmetry)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(g_flax))
    check(results, "linen GPT grad (params, input)",
          max(rel_error(a, b, floor=scale)
              for a, b in zip(jax.tree.leaves(g_flashgen), jax.tree.leaves(g_flax))))

    # nnx: MultiHeadAttention hands its is_causal= argument to attention_fn
    make = lambda fn: nnx.MultiHeadAttention(  # noqa: E731
        num_heads=args.heads, in_features=width, qkv_features=width, decode=False,
        attention_fn=fn, rngs=nnx.Rngs(0))
    mha_flax, mha_flashgen = make(nnx.dot_product_attention), make(attention_fn)
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
    check(results, "nnx MultiHeadAttention is_causal", rel_error(
        mha_flashgen(x, is_causal=True), mha_flax(x, mask=mask)))
    gx_flashgen = jax.grad(lambda x: jnp.sum(mha_flashgen(x, is_causal=True) ** 2))(x)
    gx_flax = jax.grad(lambda x: jnp.sum(mha_flax(x, mask=mask) ** 2))(x)
    check(results, "nnx MultiHeadAttention grad", rel_error(gx_flashgen, gx_flax, floor=1e-30))

    # bias and masks reach the kernels as operands (a key-padding mask as segment ids),
    # traced or concrete; the bias gets its gradient
    shape = (2, 8, 2, args.head_dim)
    qb, kb, vb = (jax.random.normal(jax.random.key(i), shape) for i in (3, 4, 5))
    bias = jax.random.normal(jax.random.key(6), (2, 2, 8, 8))
    padding = jnp.arange(8)[None, None, None, :] < jnp.array([8, 5])[:, None, None, None]
    sparse = np.random.default_rng(0).random((8, 8)) < 0.5
    sparse |= np.eye(8, dtype=bool)  # no row without a key (flax would average those)
    for name, extra in {"bias": dict(bias=bias), "run-time padding mask": dict(mask=padding),
                        "arbitrary mask": dict(mask=sparse)}.items():
        ours = jax.jit(lambda q, k, v, e: attention_fn(q, k, v, **e))(qb, kb, vb, extra)
        check(results, f"attention_fn {name}", rel_error(
            ours, nn.dot_product_attention(qb, kb, vb, **extra)))
    g_ours = jax.grad(lambda b: jnp.sum(attention_fn(qb, kb, vb, bias=b) ** 2))(bias)
    g_flax = jax.grad(lambda b: jnp.sum(nn.dot_product_attention(qb, kb, vb, bias=b) ** 2))(bias)
    check(results, "attention_fn bias grad", rel_error(g_ours, g_flax))

    # what the adapter refuses, and says why
    refused = {}
    q = jnp.zeros((1, 8, 2, args.head_dim))
    for what, call in {
            "dropout": lambda: attention_fn(q, q, q, dropout_rate=0.1, deterministic=False),
            "sow_weights": lambda: attention_fn(q, q, q, module=object()),
    }.items():
        try:
            call()
            refused[what] = None
        except (ValueError, NotImplementedError) as e:
            refused[what] = str(e)
            print(f"  refused {what}: {str(e)[:110]}...")
    results["refused"] = refused


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--out", help="working directory (default: a new temporary one)")
    p.add_argument("--json", help="write the comparisons as JSON here")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="flashgen-jax-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"jax {jax.__version__}, flax {_version('flax')}; working in {out}")

    results = {"export_rewrite": {}, "attention_hook": {}}
    export_rewrite_run(args, out, results["export_rewrite"])
    attention_hook(args, results["attention_hook"])

    ok = all(v.get("ok", True) for part in results.values() for v in part.values()
             if isinstance(v, dict)) and results["export_rewrite"].get("ok_sites", True) \
        and all(results["attention_hook"]["refused"].values())
    results["ok"] = ok
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print("all comparisons passed" if ok else "SOME COMPARISONS FAILED")
    return 0 if ok else 1


def _version(dist: str) -> str:
    from importlib.metadata import version
    return version(dist)


if __name__ == "__main__":
    sys.exit(main())
