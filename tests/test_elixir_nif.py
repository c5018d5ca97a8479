"""examples/elixir under a real BEAM: `flashgen build --for nif` and FlashGen.Attention's ExUnit suite.

The suite (`mix test` with Debian's elixir 1.14 / erlang 25) runs the NIF's own tests (an
Elixir float64 reference, bad input, dirty scheduling) and the cases written here: fresh random
inputs in the kernel's dtype, expected outputs from flashgen/reference.py in float64. ExUnit
asserts each output's error and writes it to errors.txt, which this file checks again and prints.
Tolerances relative to max(1, max |reference|), as tests/test_cpu_numerics.py states them.
"""
import os
import pathlib
import re
import shutil
import subprocess

import ml_dtypes
import numpy as np
import pytest

from flashgen import KernelSpec, build, reference, toolchain
from flashgen.cli import make_parser
from flashgen.errors import BuildError

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT = ROOT / "examples" / "elixir"
TOL = {"f32": (2e-5, 1e-4), "f16": (3e-3, 1e-2), "bf16": (2e-2, 5e-2)}
NUMPY = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}



def _skip_without_the_beam():
    if shutil.which("mix") is None or shutil.which("erl") is None:
        pytest.skip("elixir not installed (apt-get install elixir erlang-dev; .ci/deps does)")
    try:
        toolchain.erts_include()
    except BuildError as e:
        pytest.skip(str(e))

# (name, dtype, head dim, causal, kind, sizes, options). Dense sizes: (B, Sq, Sk, Hq, Hkv);
# varlen: (cu_seqlens, Hq, Hkv).
CASES = [
    ("gqa_f32_d64", "f32", 64, False, "dense", (2, 33, 47, 4, 2), {}),
    ("mqa_bf16_d64_causal", "bf16", 64, True, "dense", (1, 64, 64, 4, 1), {}),
    ("f16_d32_causal_bottom_right_window", "f16", 32, True, "dense", (1, 40, 72, 2, 2),
     {"bottom_right": True, "window": (16, -1)}),
    ("f32_d128_window_softcap_alibi", "f32", 128, False, "dense", (1, 48, 48, 2, 2),
     {"scale": 0.5, "window": (8, 8), "softcap": 30.0, "alibi_slopes": "random"}),
    ("bf16_d64_key_padding", "bf16", 64, False, "dense", (2, 24, 40, 4, 4), {"key_lengths": [40, 17]}),
    ("f16_d64_segment_ids", "f16", 64, False, "dense", (2, 20, 20, 2, 1), {"segment_ids": "random"}),
    ("bf16_d128_causal_gqa", "bf16", 128, True, "dense", (1, 50, 50, 4, 2), {}),
    ("f32_d64_bias_mask_dbias", "f32", 64, False, "dense", (1, 20, 20, 2, 2), {"bias": "random", "mask": "random"}),
    ("f32_d64_varlen_causal", "f32", 64, True, "varlen", ([0, 5, 17, 30], 4, 2), {}),
]
# The NIF tests' own calls need flashgen_{fwd,bwd}_d64_f32_causal (in CASES' specs too).
SPECS = sorted({KernelSpec(d, t, c, "cpu") for _, t, d, c, *_ in CASES})


def test_build_for_nif_is_in_the_help_and_cpu_only(capsys):
    with pytest.raises(SystemExit):
        make_parser().parse_args(["build", "--help"])
    assert "nif: an erl_nif library for Elixir/Erlang" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(ValueError, match="host 'nif' calls the CPU kernels"):
        build(KernelSpec(64, "f32", False, "sm80"), host="nif")


def _elixir_value(x) -> str:
    """A Python value as Elixir source."""
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, float):
        return f"{x:.17e}"
    if isinstance(x, str):
        return '"' + x + '"'
    if isinstance(x, tuple):
        return "{" + ", ".join(map(_elixir_value, x)) + "}"
    if isinstance(x, list):
        return "[" + ", ".join(map(_elixir_value, x)) + "]"
    if isinstance(x, dict):
        return "[" + ", ".join(f"{k}: {_elixir_value(v)}" for k, v in x.items()) + "]"
    return str(int(x))


def _write_case(rng, out: pathlib.Path, name, dtype, d, causal, kind, sizes, options) -> str:
    """Writes the case's inputs (kernel dtype) and float64 expectations; returns its Elixir map."""
    def tensor(label, array, elixir_type=None):
        (out / f"{name}.{label}").write_bytes(np.ascontiguousarray(array).tobytes())
        t = (f"{name}.{label}", tuple(array.shape))
        return t if elixir_type is None else (*t, elixir_type)

    def rounded(shape):
        return rng.standard_normal(shape).astype(NUMPY[dtype])

    if kind == "dense":
        b, sq, sk, hq, hkv = sizes
        shapes = [(b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d)]
    else:
        cu, hq, hkv = sizes
        shapes = [(cu[-1], hq, d), (cu[-1], hkv, d), (cu[-1], hkv, d), (cu[-1], hq, d)]
    q, k, v, do = (rounded(s) for s in shapes)
    opts = {"causal": causal}
    ref = {"causal": causal}
    for key in ("scale", "bottom_right", "softcap"):
        if key in options:
            opts[key] = ref[key] = options[key]
    if "window" in options:
        opts["window"] = ref["window"] = options["window"]
    if options.get("alibi_slopes"):
        slopes = rng.uniform(0.05, 0.5, hq).astype(np.float32)
        opts["alibi_slopes"], ref["alibi_slopes"] = tensor("alibi", slopes), slopes
    if "key_lengths" in options:
        opts["key_lengths"] = options["key_lengths"]
        ref["q_segment_ids"] = np.zeros((b, sq), np.int32)
        ref["kv_segment_ids"] = (np.arange(sk)[None, :] >= np.array(options["key_lengths"])[:, None]).astype(np.int32)
    if options.get("segment_ids"):  # sorted ids, as packed sequences have them; every row sees its own id
        ids = np.sort(rng.integers(0, 3, (b, sq)), axis=1).astype(np.int32)
        opts["q_segment_ids"], opts["kv_segment_ids"] = tensor("qseg", ids), tensor("kvseg", ids)
        ref["q_segment_ids"] = ref["kv_segment_ids"] = ids
    if options.get("bias"):
        bias = rng.standard_normal((1, hq, sq, sk)).astype(np.float32)
        opts["bias"], ref["bias"] = tensor("bias", bias), bias
        opts["dbias"] = True
    if options.get("mask"):
        mask = rng.random((b, 1, sq, sk)) < 0.7
        mask[..., np.arange(sq), np.arange(sq)] = True  # every row sees a key
        opts["mask"], ref["mask"] = tensor("mask", mask.astype(np.uint8)), mask
    f64 = [np.asarray(x, np.float64) for x in (q, k, v, do)]
    if kind == "dense":
        o, lse, grads = reference.attention(*f64[:3], do=f64[3], **ref)
    else:
        o, lse, grads = reference.attention_varlen(*f64[:3], cu, cu, do=f64[3], **ref)
    names = ["o", "lse", "dq", "dk", "dv", "dbias"][:2 + len(grads)]
    expect = {n: tensor(f"{n}.f64", np.asarray(x, "<f8")) for n, x in zip(names, (o, lse, *grads))}
    fields = {
        "name": name, "kind": kind, "type": dtype,
        "q": tensor("q", q), "k": tensor("k", k), "v": tensor("v", v), "do": tensor("do", do),
        "cu": cu if kind == "varlen" else [], "opts": opts, "expect": expect,
        "tol": {"fwd": TOL[dtype][0], "bwd": TOL[dtype][1]},
    }
    entries = [f"type: :{dtype}"] + [f"{k}: {_elixir_value(v)}" for k, v in fields.items() if k != "type"]
    return "%{" + ", ".join(entries) + "}"


def test_exunit_suite_under_the_beam(tmp_path, rng):
    _skip_without_the_beam()
    lib = build(SPECS, host="nif")
    assert lib.manifest["host"] == "nif" and lib.manifest["python"] is None
    symbols = subprocess.run(["nm", "-D", str(lib.path)], capture_output=True, text=True).stdout
    assert " T nif_init" in symbols and " U enif_make_tuple" in symbols  # enif_*: the BEAM's, at load
    assert "PyInit" not in symbols
    cases = tmp_path / "cases"
    cases.mkdir()
    maps = [_write_case(rng, cases, *c) for c in CASES]
    (cases / "cases.exs").write_text("[\n  " + ",\n  ".join(maps) + "\n]\n")
    env = {**os.environ, "MIX_ENV": "test", "FLASHGEN_NIF_LIBRARY": str(lib.path.parent),
           "FLASHGEN_ELIXIR_CASES": str(cases)}
    proc = subprocess.run(["mix", "test", "--no-color"], cwd=PROJECT, env=env, capture_output=True,
                          text=True, timeout=600)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report[-6000:]
    assert re.search(r"\b\d+ tests, 0 failures", report), report[-3000:]
    assert "excluded" not in report, report[-3000:]  # the NIF and the cases ran, none was left out

    rows = [line.split() for line in (cases / "errors.txt").read_text().splitlines()]
    assert {r[0] for r in rows} == {c[0] for c in CASES}
    print("\ncase                                   output  rel. error  tolerance")
    for case, output, err, tol in rows:
        print(f"{case:38s} {output:6s}  {float(err):.2e}    {float(tol):.0e}")
        assert float(err) <= float(tol), (case, output, err)
