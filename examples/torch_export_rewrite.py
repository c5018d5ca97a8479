"""PyTorch end to end: torch.export -> StableHLO (torchax) -> flashgen rewrite -> flashgen run.

    pip install "flashgen[torch]"           # torch + torchax, see pyproject.toml
    python examples/torch_export_rewrite.py [--seq 128 --head-dim 64] [--out DIR]

For three models --

  sdpa  ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``
  mha   ``nn.MultiheadAttention`` (batch_first, causal mask, need_weights=False)
  gpt   a small GPT-style block: LayerNorm, fused QKV projection, causal SDPA,
        output projection, GELU MLP, residuals

-- it does what a PyTorch user who wants flashgen's kernels under XLA does:

  1. ``torch.export.export(model, inputs)`` and torchax's
     ``exported_program_to_stablehlo`` turn the model into StableHLO; the module
     text is written to ``NAME.mlir`` (its parameters are the model's weights,
     then its inputs). torchax is imported through
     ``flashgen.frontends.torchax_compat.import_torchax`` (torchax 0.0.13 does not
     import under torch 2.13 as shipped; the module doc says why and what it does);
  2. ``flashgen rewrite NAME.mlir -o NAME.flashgen.mlir --verify --report
     NAME.report.json`` replaces the decomposed SDPA with a flashgen custom call
     and checks the result against the original module on random inputs;
  3. the weights and inputs are saved to ``NAME.inputs.npz`` (arg0..argN, @main's
     order) and ``flashgen run NAME.flashgen.mlir --inputs NAME.inputs.npz
     --outputs NAME.outputs.npz`` executes the rewritten module on XLA's CPU
     runtime with flashgen's kernels;
  4. the output is compared with what torch itself computes for the same model
     and inputs.

Exits non-zero if a comparison fails; ``--json FILE`` writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import subprocess
import sys
import tempfile
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from flashgen.frontends.torchax_compat import import_torchax, missing_overloads

# torch 2.13's own pytree code warns about its deprecated LeafSpec while exporting
warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)

TOL = 2e-3  # max |a - b| / max(1, max |b|) for f32 outputs (flashgen's --verify tolerance)


# ------------------------------------------------------------------------------ models
class SDPA(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class MHA(torch.nn.Module):
    def __init__(self, width, heads, seq):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(width, heads, batch_first=True)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, x):
        return self.mha(x, x, x, attn_mask=self.mask, is_causal=True, need_weights=False)[0]


class GPTBlock(torch.nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


def models(batch: int, seq: int, heads: int, head_dim: int) -> dict:
    """name -> (module, example inputs); seeded, so every run builds the same weights."""
    width = heads * head_dim
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    torch.manual_seed(0)
    return {
        "sdpa": (SDPA(), tuple(rand(batch, heads, seq, head_dim) for _ in range(3))),
        "mha": (MHA(width, heads, seq).eval(), (rand(batch, seq, width),)),
        "gpt": (GPTBlock(width, heads).eval(), (rand(batch, seq, width),)),
    }


# ------------------------------------------------------------------------------ steps
def export_stablehlo(module, inputs):
    """torch.export + torchax: (StableHLO text, @main's arguments as numpy arrays)."""
    torchax = import_torchax()
    ep = torch.export.export(module, inputs)
    weights, exported = torchax.export.exported_program_to_stablehlo(ep)
    flat = [np.asarray(w) for w in weights] + [t.detach().numpy() for t in inputs]
    if len(flat) != len(exported.in_avals):
        raise RuntimeError(f"expected {len(exported.in_avals)} flat arguments, have {len(flat)}")
    args = [flat[i] for i in exported.module_kept_var_idx]  # what @main actually takes
    return exported.mlir_module(), args


def flashgen_cli(*args: str) -> subprocess.CompletedProcess:
    """Run the flashgen CLI (the same as typing ``flashgen ARGS`` in a shell)."""
    print("$ flashgen " + " ".join(shlex.quote(a) for a in args), flush=True)
    proc = subprocess.run([sys.executable, "-m", "flashgen", *args], capture_output=True, text=True)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"flashgen {args[0]} failed with exit code {proc.returncode}")
    return proc


def rel_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want), initial=0.0) / max(1.0, np.max(np.abs(want), initial=0.0)))


def run_one(name: str, module, inputs, out: pathlib.Path) -> dict:
    print(f"== {name} ==")
    with torch.no_grad():
        want = module(*inputs).numpy()          # torch's own result (CPU, f32)

    text, args = export_stablehlo(module, inputs)
    src, dst = out / f"{name}.mlir", out / f"{name}.flashgen.mlir"
    report_path = out / f"{name}.report.json"
    src.write_text(text)
    flashgen_cli("rewrite", str(src), "-o", str(dst), "--verify", "--report", str(report_path))
    report = json.loads(report_path.read_text())

    npz_in, npz_out = out / f"{name}.inputs.npz", out / f"{name}.outputs.npz"
    np.savez(npz_in, **{f"arg{i}": a for i, a in enumerate(args)})
    flashgen_cli("run", str(dst), "--inputs", str(npz_in), "--outputs", str(npz_out))
    got = np.load(npz_out)["out0"]

    err = rel_error(got, want) if got.shape == want.shape else float("inf")
    row = {"sites_rewritten": report["summary"]["rewritten"], "targets": report["targets"],
           "flashgen_calls_in_module": dst.read_text().count("stablehlo.custom_call @flashgen_"),
           "verified": report["verified"], "shape": list(want.shape),
           "max_rel_error": err, "tolerance": TOL}
    row["ok"] = bool(err <= TOL and row["sites_rewritten"] == 1
                     and row["flashgen_calls_in_module"] == 1)
    for site in report["sites"]:
        if site["status"] == "rejected":  # near misses (e.g. an MLP matmul), left as they were
            print(f"  left untouched: {site['op']}: {site['reason']}")
    print(f"  {report['summary']['rewritten']} site(s) -> {', '.join(report['targets'])}; "
          f"flashgen run vs torch: max rel error {err:.2e} (tol {TOL:.0e})  "
          f"{'ok' if row['ok'] else 'FAILED'}")
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--only", action="append", choices=["sdpa", "mha", "gpt"],
                   help="run only this model (repeatable)")
    p.add_argument("--out", help="working directory (default: a new temporary one)")
    p.add_argument("--json", help="write the comparisons as JSON here")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="flashgen-torch-"))
    out.mkdir(parents=True, exist_ok=True)

    torchax = import_torchax()
    from importlib.metadata import version
    print(f"torch {torch.__version__}, torchax {version('torchax')}, jax {version('jax')}; "
          f"working in {out}")
    if missing_overloads():
        print(f"(torchax_compat stood in for {len(missing_overloads())} named-tensor overloads "
              f"this torch removed, e.g. {'.'.join(missing_overloads()[0])})")
    del torchax

    results = {}
    for name, (module, inputs) in models(args.batch, args.seq, args.heads, args.head_dim).items():
        if args.only and name not in args.only:
            continue
        results[name] = run_one(name, module, inputs, out)
    ok = all(r["ok"] for r in results.values())
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"ok": ok, "models": results}, indent=2) + "\n")
    print("all comparisons passed" if ok else "SOME COMPARISONS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
