"""Every frontend end to end: the examples run, and match their frontend's own results.

* JAX/flax: examples/jax_export_rewrite.py (needs flax; skipped without it).
* PyTorch: examples/torch_export_rewrite.py and the torchax compat shim, marked
  ``torch`` and skipped without torch + torchax (``pip install ".[torch]"``).
* Elixir EXLA: the attribute form in examples/exla matches ``flashgen emit``; the
  custom calls it documents run on XLA with flashgen's kernels; an EXLA-style
  module rewrites. Running the Elixir code itself needs ``elixir`` (Debian's
  package is enough: FlashGen.Attention.Target has no deps); skipped without it.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
EXLA = EXAMPLES / "exla"
GOLDEN = ROOT / "tests" / "golden" / "inputs"


def _installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


needs_flax = pytest.mark.skipif(not _installed("flax"),
                                reason="flax not installed (pip install '.[flax]')")
needs_torch = pytest.mark.skipif(not _installed("torch", "torchax"),
                                 reason="torch/torchax not installed (pip install '.[torch]')")
needs_elixir = pytest.mark.skipif(shutil.which("elixir") is None,
                                  reason="elixir not installed (apt-get install elixir)")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _run_example(script: str, args: list, tmp_path, timeout: int = 900) -> dict:
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args, "--out", str(tmp_path / "work"),
         "--json", str(out)],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=timeout)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


# ------------------------------------------------------------------------------ JAX / flax
@needs_flax
def test_jax_flax_example_export_rewrite_load_and_attention_hook(tmp_path):
    r = _run_example("jax_export_rewrite.py",
                     ["--seq", "16", "--heads", "2", "--head-dim", "32", "--layers", "2"], tmp_path)
    assert r["ok"]
    e = r["export_rewrite"]
    assert e["sites_rewritten"] == 2 and e["flashgen_calls_in_module"] == 2
    assert e["verified"]["outputs"] and all(row["ok"] for row in e["verified"]["outputs"])
    for name in ("rewritten vs original export", "rewritten vs flax model.apply"):
        assert e[name]["ok"] and e[name]["max_rel_error"] < 1e-4, (name, e[name])
    h = r["attention_hook"]
    for name in ("linen GPT output", "linen GPT grad (params, input)",
                 "nnx MultiHeadAttention is_causal", "nnx MultiHeadAttention grad",
                 "attention_fn bias", "attention_fn run-time padding mask",
                 "attention_fn arbitrary mask", "attention_fn bias grad"):
        assert h[name]["ok"] and h[name]["max_rel_error"] < 1e-4, (name, h[name])
    assert all(h["refused"].values()), h["refused"]
    assert "dropout" in h["refused"]["dropout"]


def test_flax_adapter_reads_causality_from_concrete_masks():
    from flashgen.frontends.flax import _causal_from_mask
    i, j = np.arange(4)[:, None], np.arange(6)[None, :]
    assert _causal_from_mask(np.broadcast_to(j <= i, (2, 1, 4, 6)), 4, 6) == (True, False)
    assert _causal_from_mask(j <= i + 2, 4, 6) == (True, True)
    assert _causal_from_mask(np.ones((4, 6), bool), 4, 6) == (False, False)
    assert _causal_from_mask(j < i, 4, 6) is None  # strictly lower: an operand, not causal


# ------------------------------------------------------------------------------ PyTorch
@pytest.mark.torch
@needs_torch
def test_torch_example_sdpa_mha_gpt_match_torch(tmp_path):
    r = _run_example("torch_export_rewrite.py", ["--seq", "16", "--heads", "4", "--head-dim", "32"],
                     tmp_path)
    assert r["ok"]
    assert set(r["models"]) == {"sdpa", "mha", "gpt"}
    for name, row in r["models"].items():
        assert row["ok"], (name, row)
        assert row["sites_rewritten"] == 1 and row["flashgen_calls_in_module"] == 1, (name, row)
        assert row["targets"] == ["flashgen_fwd_d32_f32_causal"], (name, row)
        assert row["max_rel_error"] < 1e-4, (name, row)
        assert all(v["ok"] for v in row["verified"]["outputs"]), (name, row)


@pytest.mark.torch
@needs_torch
def test_torchax_compat_imports_and_restores_torch():
    code = """
import torch, torch._ops as ops
before = ops.OpOverloadPacket.__getattr__
from flashgen.frontends import torchax_compat
tx = torchax_compat.import_torchax()
assert tx.export.exported_program_to_stablehlo
assert ops.OpOverloadPacket.__getattr__ is before
for packet, name in torchax_compat.missing_overloads():
    try:
        getattr(getattr(torch.ops.aten, packet.split('.')[-1]), name)
    except AttributeError:
        pass
    else:
        raise SystemExit(f'{packet}.{name} exists: it should not have been papered over')
assert torchax_compat.import_torchax() is tx
print(len(torchax_compat.missing_overloads()))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


# ------------------------------------------------------------------------------ Elixir EXLA
def _documented_custom_calls() -> list[str]:
    """The ```mlir lines in FlashGen.Attention's moduledoc."""
    src = (EXLA / "lib" / "flash_gen" / "attention.ex").read_text()
    blocks = re.findall(r"```mlir\n(.*?)```", src, re.S)
    assert len(blocks) == 1, "attention.ex documents its custom calls in one ```mlir block"
    return [line.strip() for line in blocks[0].splitlines() if line.strip()]


def _exla_style_module(lines: list[str]) -> str:
    """The documented calls put into a module as EXLA builds one: a public @main, no layouts."""
    fwd, bwd = lines
    ins, outs = re.search(r":\s*\(([^)]*)\)\s*->\s*\(([^)]*)\)\s*$", fwd).groups()
    tq, tk, tv = [t.strip() for t in ins.split(", ")]
    to, tlse = [t.strip() for t in outs.split(", ")]
    bwd_outs = re.search(r"->\s*\(([^)]*)\)\s*$", bwd).group(1)
    results = [to, tlse, *[t.strip() for t in bwd_outs.split(", ")]]
    return (f"module @EXLA.flashgen {{\n"
            f"  func.func public @main(%arg0: {tq}, %arg1: {tk}, %arg2: {tv}, %arg3: {tq}) -> "
            f"({', '.join(results)}) {{\n    {fwd}\n    {bwd}\n"
            f"    return %0#0, %0#1, %1#0, %1#1, %1#2 : {', '.join(results)}\n  }}\n}}\n")


def _custom_calls(module) -> list:
    ops = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for o in block.operations:
                    if o.operation.name == "stablehlo.custom_call":
                        ops.append(o.operation)
                    walk(o.operation)
    walk(module.operation)
    return ops


def test_exla_documented_custom_calls_carry_flashgen_emit_attributes():
    from jaxlib.mlir import ir

    from flashgen import emit
    from flashgen.mlir_context import new_context
    from flashgen.spec import KernelSpec

    text = _exla_style_module(_documented_custom_calls())
    spec = KernelSpec(32, "f32", True, "cpu")
    reference = emit.attention_module(spec, batch=1, seq_q=8, seq_k=8, heads=2, scale=0.125,
                                     legacy_attrs=False)
    ref_text = str(reference)
    with new_context(), ir.Location.unknown():
        module = ir.Module.parse(text)
        assert module.operation.verify()
        fwd, bwd = _custom_calls(module)
        ref_module = ir.Module.parse(ref_text)  # keep it alive while its ops are used
        (emitted,) = _custom_calls(ref_module)
        assert emitted.attributes["backend_config"] == emit.attention_attributes(True, 0.125, False)
        for op, direction in ((fwd, "fwd"), (bwd, "bwd")):
            assert ir.StringAttr(op.attributes["call_target_name"]).value == \
                spec.target_name(direction)
            assert op.attributes["api_version"] == emitted.attributes["api_version"]
            assert op.attributes["backend_config"] == emit.attention_attributes(True, 0.125, False,
                                                                                direction=direction)
            for absent in ("operand_layouts", "result_layouts", "mhlo.backend_config"):
                assert absent not in op.attributes
        assert [str(r.type) for r in fwd.results] == [str(r.type) for r in emitted.results]
        assert [str(r.type) for r in bwd.results] == [str(o.type) for o in list(bwd.operands)[:3]]


def test_exla_style_module_runs_forward_and_backward_on_xla(rng):
    """The documented EXLA custom calls execute with flashgen's kernels and are right."""
    import jax
    import jax.numpy as jnp

    from flashgen import execute

    text = _exla_style_module(_documented_custom_calls())
    params, _ = execute.signature(text)
    q, k, v, do = (rng.standard_normal(p.shape).astype(np.float32) for p in params)
    o, lse, dq, dk, dv = execute.run(text, [q, k, v, do])

    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        t = s.shape[-1]
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v), \
            jax.nn.logsumexp(s, axis=-1)
    (ro, rlse), vjp = jax.vjp(attention, q, k, v)
    rq, rk, rv = vjp((jnp.asarray(do), jnp.zeros_like(rlse)))
    for got, want in ((o, ro), (lse, rlse), (dq, rq), (dk, rk), (dv, rv)):
        np.testing.assert_allclose(got, np.asarray(want), rtol=2e-4, atol=2e-4)


def test_exla_style_golden_module_rewrites(tmp_path):
    from flashgen.cli import main
    src = GOLDEN / "exla_attention.mlir"
    out, report_path = tmp_path / "exla.flashgen.mlir", tmp_path / "report.json"
    assert main(["rewrite", str(src), "-o", str(out), "--verify", "--report", str(report_path),
                 "-q"]) == 0
    report = json.loads(report_path.read_text())
    assert report["summary"] == {"rewritten": 1, "rejected": 0}
    assert all(row["ok"] for row in report["verified"]["outputs"])
    text = out.read_text()
    # the native form EXLA itself emits, in a module that keeps EXLA's shape
    assert re.search(r"stablehlo\.custom_call @flashgen_fwd_d32_f32_causal\(.*\{api_version = 4 : i32, "
                     r"backend_config = \{bottom_right = false, causal = true, extras = \"\", scale = [^}]*: f32, "
                     r"softcap = 0\.000000e\+00 : f32, window_left = -1 : i32, window_right = -1 : i32\}",
                     text)
    assert "func.func public @main" in text and "mhlo.backend_config" not in text
    # both call sites of the outlined @attention_11 now reach the kernel
    assert len(re.findall(r"call @attention_11\(", text)) == 2


def test_exla_module_with_a_foreign_native_call_rewrites_around_it(tmp_path):
    from flashgen.cli import main
    out = tmp_path / "native.mlir"
    assert main(["rewrite", str(GOLDEN / "exla_native_call.mlir"), "-o", str(out), "-q"]) == 0
    text = out.read_text()
    assert "@flashgen_fwd_d64_bf16(" in text
    assert re.search(r"custom_call @exla_native_qr\(%\w+\) \{api_version = 4 : i32, "
                     r"backend_config = \{full_matrices = false, rank = 2 : i64\}\}", text)


@needs_elixir
def test_exla_elixir_sources_parse():
    files = sorted(EXLA.rglob("*.ex")) + sorted(EXLA.rglob("*.exs"))
    assert len(files) >= 6
    script = "for f <- System.argv(), do: Code.string_to_quoted!(File.read!(f), file: f)"
    proc = subprocess.run(["elixir", "-e", script, *map(str, files)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# (direction, head dim, flashgen dtype, Nx type, causal, scale, bottom_right)
_TARGET_CASES = [
    ("fwd", 64, "bf16", "{:bf, 16}", True, 0.125, False),
    ("bwd", 32, "f32", "{:f, 32}", False, 1 / math.sqrt(32), True),
    ("fwd", 128, "f16", "{:f, 16}", True, 0.3, False),
    ("bwd", 256, "bf16", "{:bf, 16}", True, 1e-3 * 7, True),
]


@needs_elixir
def test_exla_elixir_target_module_matches_flashgen_emit():
    """Run FlashGen.Attention.Target under Elixir; its names and attributes are flashgen's."""
    from jaxlib.mlir import ir

    from flashgen import emit
    from flashgen.mlir_context import new_context
    from flashgen.spec import KernelSpec

    calls = "\n".join(
        f"IO.puts(T.name(:{d}, {h}, {nx}, {str(c).lower()}) <> \"|\" <> "
        f"Enum.map_join(T.backend_config({str(c).lower()}, {scale!r}, {str(br).lower()}), \", \", "
        f"fn {{k, v}} -> k <> \" = \" <> v end))"
        for d, h, _, nx, c, scale, br in _TARGET_CASES)
    script = (f'Code.require_file("lib/flash_gen/attention/target.ex")\n'
              f"alias FlashGen.Attention.Target, as: T\n{calls}\n")
    proc = subprocess.run(["elixir", "-e", script], capture_output=True, text=True, cwd=EXLA,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == len(_TARGET_CASES)
    with new_context(), ir.Location.unknown():
        for line, (d, h, dtype, _, c, scale, br) in zip(lines, _TARGET_CASES):
            name, entries = line.split("|")
            assert name == KernelSpec(h, dtype, c, "cpu").target_name(d)
            # EXLA joins the {name, attr} pairs into the backend_config dictionary like this
            got = ir.Attribute.parse("{" + entries + "}")
            assert got == emit.attention_attributes(c, scale, br), (line, str(got))
