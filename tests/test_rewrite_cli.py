"""`flashgen rewrite`: formats, bad input, reports, --explain, --verify, --build."""
from __future__ import annotations

import io
import json
import pathlib

import pytest

import flashgen
import flashgen.rewrite as fr
from flashgen import cli
from flashgen.errors import LoadError
from flashgen.rewrite import modules

GOLDEN = pathlib.Path(__file__).parent / "golden" / "inputs"
CAUSAL = GOLDEN / "jnn_causal_bf16.mlir"
NEG = GOLDEN / "neg_probs_returned.mlir"


def run_cli(*argv, capsys=None):
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr() if capsys else None
    return rc, out


# ------------------------------------------------------------------------------ API
def test_package_is_callable_and_api():
    result = flashgen.rewrite(CAUSAL)
    assert isinstance(result, fr.RewriteResult)
    assert [s.status for s in result.sites] == ["rewritten"]
    assert result.specs[0].causal and result.specs[0].dtype == "bf16"
    assert result.sites[0].function == "main"
    assert result.sites[0].op.endswith("stablehlo.dot_general")


def test_accepts_text_bytes_and_module():
    text = CAUSAL.read_text()
    assert fr.rewrite(text).changed
    assert fr.rewrite(CAUSAL.read_bytes()).changed
    loaded = modules.load(CAUSAL)
    with loaded.context:
        result = fr.rewrite(loaded.module)
    assert result.changed
    # the caller's module is not changed
    with loaded.context:
        assert "stablehlo.exponential" in modules.module_text(loaded.module)


def test_rest_of_module_unchanged():
    """Signature, attributes, result info and argument locations survive the rewrite."""
    src = (GOLDEN / "flax_linen_causal.mlir").read_text()
    out = fr.rewrite(src).to_bytes().decode()
    head = lambda t: t.split("\n", 2)[:2]  # noqa: E731 - module line and @main signature
    assert head(out) == head(src) or src.splitlines()[1] in out
    assert 'loc("args[0]")' in out and "jax.result_info" in out
    assert "mhlo.num_partitions = 1" in out


def test_legacy_attrs():
    out = fr.rewrite(CAUSAL, legacy_attrs=True).text()
    assert 'backend_config = ""' in out and "mhlo.backend_config = {bottom_right = false" in out
    assert "api_version = 4" not in out


def test_formats_roundtrip(tmp_path):
    # plain MLIR bytecode in -> bytecode out
    loaded = modules.load(CAUSAL)
    buf = io.BytesIO()
    with loaded.context:
        loaded.module.operation.write_bytecode(buf)
    data = buf.getvalue()
    assert modules.detect_format(data) == "mlirbc"
    result = fr.rewrite(data)
    assert result.format == "mlirbc" and modules.detect_format(result.to_bytes()) == "mlirbc"
    assert "flashgen_fwd_d32_bf16_causal" in modules.module_text(modules.load(result.to_bytes()).module)
    # portable artifact keeps its StableHLO version
    art = (GOLDEN / "jnn_f32_portable.mlirbc").read_bytes()
    out = fr.rewrite(art).to_bytes()
    assert modules.detect_format(out) == "portable"
    assert modules.load(out).version == modules.load(art).version


@pytest.mark.parametrize("data,needle", [
    (b"", "empty input"),
    (b"\x00\x01\x02garbage\xff" * 10, "not a StableHLO module"),
    (b"func.func @main( {", "cannot parse"),
    (b"module {\n  func.func private @f() {\n    return\n  }\n}\n", "no @main"),
    (b"func.func @main(%a: tensor<2xf32>) -> tensor<2xf32> {\n"
     b"  %0 = foo.bar %a : tensor<2xf32>\n  return %0 : tensor<2xf32>\n}\n", "cannot parse"),
    (b"func.func @main(%a: f32) -> f32 {\n  %0 = arith.addf %a, %a : f32\n"
     b"  return %0 : f32\n}\n", None),
])
def test_bad_input_raises_load_error(data, needle):
    with pytest.raises(LoadError) as e:
        fr.rewrite(data)
    if needle:
        assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_truncated_bytecode_and_exported():
    art = (GOLDEN / "jnn_f32_portable.mlirbc").read_bytes()
    with pytest.raises(LoadError):
        fr.rewrite(art[: len(art) // 2])
    exp = (GOLDEN / "jnn_causal_exported.jax_exported").read_bytes()
    with pytest.raises(LoadError):
        fr.rewrite(exp[: len(exp) // 3])


@pytest.mark.parametrize("data", [
    b"",
    b"\x00garbage" * 8,
    b"module {\n}\n",
    b"func.func @main(%a: f32) -> f32 {\n  %0 = arith.addf %a, %a : f32\n  return %0 : f32\n}\n",
])
def test_cli_bad_input_one_line_error_no_output(tmp_path, capsys, data):
    src = tmp_path / "in.mlir"
    src.write_bytes(data)
    out = tmp_path / "out.mlir"
    rc, io_ = run_cli("rewrite", src, "-o", out, capsys=capsys)
    assert rc != 0
    assert not out.exists()
    lines = [l for l in io_.err.splitlines() if l.startswith("flashgen")]
    assert len(lines) == 1 and lines[0].startswith("flashgen: error:")
    assert "Traceback" not in io_.err


def test_cli_missing_input(tmp_path, capsys):
    rc, io_ = run_cli("rewrite", tmp_path / "nope.mlir", "-o", tmp_path / "o.mlir", capsys=capsys)
    assert rc == 1 and "no such file" in io_.err


def test_cli_rewrite_report_explain(tmp_path, capsys):
    out, rep = tmp_path / "out.mlir", tmp_path / "r.json"
    rc, io_ = run_cli("rewrite", GOLDEN / "two_sites_shared_q.mlir", "-o", out, "--report", rep,
                      "--explain", capsys=capsys)
    assert rc == 0
    assert "REWRITTEN" in io_.out and "2 attention site(s) rewritten" in io_.out
    report = json.loads(rep.read_text())
    assert report["summary"] == {"rewritten": 2, "rejected": 0}
    assert report["targets"] == ["flashgen_fwd_d32_f32", "flashgen_fwd_d32_f32_causal"]
    site = report["sites"][0]
    for key in ("location", "function", "op", "q_shape", "layout", "dtype", "heads", "kv_heads",
                "causal", "scale", "target", "status", "reason"):
        assert key in site
    assert "flashgen_fwd_d32_f32_causal" in out.read_text()


def test_cli_explain_near_miss(tmp_path, capsys):
    rc, io_ = run_cli("rewrite", NEG, "-o", tmp_path / "o.mlir", "--explain", capsys=capsys)
    assert rc == 0
    assert "REJECTED" in io_.out and "returned as output 1" in io_.out
    assert (tmp_path / "o.mlir").read_bytes() == NEG.read_bytes()


def test_cli_output_format(tmp_path, capsys):
    out = tmp_path / "o.bin"
    rc, _ = run_cli("rewrite", CAUSAL, "-o", out, "--output-format", "portable", capsys=capsys)
    assert rc == 0 and modules.detect_format(out.read_bytes()) == "portable"
    rc, io_ = run_cli("rewrite", CAUSAL, "-o", out, "--output-format", "jax_exported",
                      capsys=capsys)
    assert rc == 2 and "jax_exported" in io_.err


def test_cli_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        cli.main(["rewrite", "--help"])
    text = capsys.readouterr().out
    for flag in ("--output", "--report", "--explain", "--verify", "--build", "--legacy-attrs",
                 "--output-format", "--seed"):
        assert flag in text


def test_cli_verify_and_build(tmp_path, capsys):
    out, rep = tmp_path / "o.mlir", tmp_path / "r.json"
    rc, io_ = run_cli("rewrite", GOLDEN / "jnn_gqa_causal.mlir", "-o", out, "--verify",
                      "--build", "--report", rep, capsys=capsys)
    assert rc == 0, io_.err
    report = json.loads(rep.read_text())
    assert all(row["ok"] for row in report["verified"]["outputs"])
    manifest = pathlib.Path(report["manifest"])
    assert manifest.parent == tmp_path and manifest.exists()
    assert (tmp_path / pathlib.Path(report["library"]).name).exists()


@pytest.mark.parametrize("name", ["jnn_mask_full", "torch_mha_key_padding"])
def test_cli_verify_with_mask_arguments(name, tmp_path, capsys):
    """--verify draws masks that leave every query a key (either mask convention) and
    --explain names the extra operands."""
    out, rep = tmp_path / "o.mlir", tmp_path / "r.json"
    rc, io_ = run_cli("rewrite", GOLDEN / f"{name}.mlir", "-o", out, "--verify", "--explain",
                      "--report", rep, capsys=capsys)
    assert rc == 0, io_.err
    assert "extras: mask" in io_.out + io_.err
    report = json.loads(rep.read_text())
    assert all(row["ok"] for row in report["verified"]["outputs"])
    assert report["sites"][0]["extras"] == ["mask"]


def test_cli_verify_failure_writes_nothing(tmp_path, capsys, monkeypatch):
    """A rewrite that computes something else (here: a wrong scale) fails --verify."""
    from flashgen.rewrite import patterns
    original = patterns.AttentionPattern.rewrite

    def wrong(self, site):
        site.plan.scale *= 3.0
        return original(self, site)
    monkeypatch.setattr(patterns.AttentionPattern, "rewrite", wrong)
    out = tmp_path / "o.mlir"
    rc, io_ = run_cli("rewrite", GOLDEN / "jnn_gqa_causal.mlir", "-o", out, "--verify",
                      capsys=capsys)
    assert rc == 1 and "--verify failed" in io_.err
    assert not out.exists()


def test_already_rewritten_is_unchanged(tmp_path, capsys):
    first, second = tmp_path / "a.mlir", tmp_path / "b.mlir"
    assert run_cli("rewrite", CAUSAL, "-o", first, capsys=capsys)[0] == 0
    assert run_cli("rewrite", first, "-o", second, capsys=capsys)[0] == 0
    assert first.read_bytes() == second.read_bytes()


def test_old_stablehlo_version_gets_legacy_attrs():
    """Artifacts older than StableHLO 1.3 cannot carry dictionary backend_configs."""
    from jaxlib.mlir.dialects import stablehlo
    loaded = modules.load(GOLDEN / "einsum_bshd.mlir")
    with loaded.context:
        art = modules.serialize_artifact(loaded.module, "1.1.0")
    result = fr.rewrite(art)
    assert result.changed and any("legacy" in n for n in result.notes)
    assert modules.load(result.to_bytes()).version == "1.1.0"
    assert stablehlo  # imported for the version API


def test_report_manifest_loads_from_anywhere_and_verify_is_said(tmp_path, capsys, monkeypatch):
    """The report's manifest was relative to the rewrite's working directory; --verify's
    success was only in the report; --explain named flashgen.runtime.load."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    rc, io_ = run_cli("rewrite", CAUSAL, "-o", "o.mlir", "--build", "lib", "--verify",
                      "--explain", "--report", "r.json", capsys=capsys)
    assert rc == 0, io_.err
    assert "verified: 1 output(s) match the original on random inputs (seed 0)" in io_.err
    assert "(register with flashgen.jax.load)" in io_.out
    report = json.loads((work / "r.json").read_text())
    monkeypatch.chdir(tmp_path)
    assert pathlib.Path(report["manifest"]).is_absolute()
    assert pathlib.Path(report["library"]).is_absolute()
    import flashgen.jax
    assert "flashgen_fwd_d32_bf16_causal" in flashgen.jax.load(report["manifest"])


def _read_without_sdy(path: pathlib.Path) -> str:
    """A portable artifact read as torch_xla's _run_stablehlo reads it: a context that knows
    StableHLO and not the sdy dialect."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import stablehlo
    ctx = ir.Context()
    stablehlo.register_dialect(ctx)
    with ctx:
        return str(stablehlo.deserialize_portable_artifact(ctx, path.read_bytes()))


def test_no_sharding_rule_writes_an_artifact_without_sdy_that_runs(tmp_path, capsys):
    with_rule, without = tmp_path / "rule.mlirbc", tmp_path / "plain.mlirbc"
    for out, extra in ((with_rule, ()), (without, ("--no-sharding-rule",))):
        rc, io_ = run_cli("rewrite", CAUSAL, "-o", out, "--output-format", "portable", *extra,
                          capsys=capsys)
        assert rc == 0, io_.err
    with pytest.raises(Exception):  # the default carries sdy.sharding_rule: unreadable there
        _read_without_sdy(with_rule)
    text = _read_without_sdy(without)
    assert "flashgen_fwd_d32_bf16_causal" in text and "sdy" not in text
    rc, io_ = run_cli("run", without, capsys=capsys)
    assert rc == 0 and io_.out.startswith("out0: [2, 8, 4, 32] bf16"), io_.err
    rc, io_ = run_cli("run", with_rule, capsys=capsys)
    assert rc == 0 and io_.out.splitlines()[0] == run_cli("run", without, capsys=capsys)[1].out.splitlines()[0]
