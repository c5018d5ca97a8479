"""emit_custom_call for the variants (README "Variants"): extra operands of the dense targets,
the varlen and paged targets, their attributes, result types and Shardy rules; bad operands
are refused in Python with a message naming the problem. No kernels are run here."""
import pytest
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import func

from flashgen import KernelSpec
from flashgen.emit import emit_custom_call
from flashgen.mlir_context import new_context

SPEC = KernelSpec(64, "bf16", True, "cpu")


def _emit(types, direction, **kw):
    """Emit one call in @main(types...); returns (module text, result types)."""
    with new_context(), ir.Location.unknown():
        module = ir.Module.create()
        args = [ir.RankedTensorType.parse(t) for t in types]
        with ir.InsertionPoint(module.body):
            fn = func.FuncOp("main", ir.FunctionType.get(args, []))
            block = fn.add_entry_block()
            with ir.InsertionPoint(block):
                results = emit_custom_call(SPEC, direction, list(block.arguments), scale=0.125, **kw)
                func.ReturnOp(results)
            fn.attributes["function_type"] = ir.TypeAttr.get(
                ir.FunctionType.get(args, [r.type for r in results]))
        assert module.operation.verify()
        return str(module), [str(r.type) for r in results]


Q, KV = "tensor<2x16x8x64xbf16>", "tensor<2x24x2x64xbf16>"
LSE = "tensor<2x8x16xf32>"


def test_dense_call_names_its_extras_and_types_them():
    text, results = _emit([Q, KV, KV, "tensor<8xf32>", "tensor<1x8x16x24xf32>", "tensor<2x1x16x24xi1>",
                           "tensor<2x16xi32>", "tensor<2x24xi32>"], "fwd",
                          extras=("alibi", "bias", "mask", "segment_ids"))
    assert 'extras = "alibi,bias,mask,segment_ids"' in text
    assert results == [Q, LSE]
    assert "sdy.sharding_rule" in text


def test_plain_dense_call_has_empty_extras():
    text, _ = _emit([Q, KV, KV], "fwd")
    assert 'extras = ""' in text


def test_backward_with_bias_returns_dbias_like_the_bias():
    bias = "tensor<2x1x16x24xbf16>"
    text, results = _emit([Q, KV, KV, Q, LSE, Q, bias], "bwd", extras="bias")
    assert results == [Q, KV, KV, bias]


def test_varlen_and_paged_calls():
    text, results = _emit(["tensor<100x8x64xbf16>", "tensor<120x2x64xbf16>", "tensor<120x2x64xbf16>",
                           "tensor<5xi32>", "tensor<5xi32>"], "fwd_varlen", max_seqlen=(40, 50))
    assert "flashgen_fwd_varlen_d64_bf16_causal" in text and "max_seqlen_q = 40 : i32" in text
    assert results == ["tensor<100x8x64xbf16>", "tensor<8x100xf32>"]
    text, results = _emit([Q, "tensor<30x16x2x64xbf16>", "tensor<30x16x2x64xbf16>", "tensor<2x7xi32>",
                           "tensor<2xi32>"], "fwd_paged", bottom_right=True)
    assert "flashgen_fwd_paged_d64_bf16_causal" in text and 'extras = ""' in text
    assert results == [Q, LSE]
    text, _ = _emit([Q, "tensor<30x16x2x64xbf16>", "tensor<30x16x2x64xbf16>", "tensor<2x7xi32>",
                     "tensor<2xi32>", "tensor<2x8xf32>"], "fwd_paged", extras="alibi")
    assert 'extras = "alibi"' in text
    text, _ = _emit(["tensor<100x8x64xbf16>", "tensor<120x2x64xbf16>", "tensor<120x2x64xbf16>",
                     "tensor<5xi32>", "tensor<5xi32>", "tensor<4x8xf32>"], "fwd_varlen",
                    max_seqlen=(40, 50), extras="alibi")
    assert 'extras = "alibi"' in text


@pytest.mark.parametrize("types,direction,kw,match", [
    ([Q, KV, KV, "tensor<8xf32>"], "fwd", {}, "takes 3 operands"),
    ([Q, KV, KV], "fwd", {"extras": "bias"}, "takes 4 operands"),
    ([Q, KV, KV, "tensor<7xf32>"], "fwd", {"extras": "alibi"}, "alibi_slopes has type"),
    ([Q, KV, KV, "tensor<1x8x16x23xf32>"], "fwd", {"extras": "bias"}, "bias has type"),
    ([Q, KV, KV, "tensor<1x8x16x24xf16>"], "fwd", {"extras": "bias"}, "bias has type"),
    ([Q, KV, KV, "tensor<1x8x16x24xf32>"], "fwd", {"extras": "mask"}, "mask has type"),
    ([Q, KV, KV, "tensor<2x16xi32>", "tensor<2x16xi32>"], "fwd", {"extras": "segment_ids"},
     "kv_segment_ids has type"),
    ([Q, KV, KV], "fwd", {"extras": "relative"}, "unknown extras"),
    (["tensor<100x8x64xbf16>", "tensor<120x2x64xbf16>", "tensor<120x2x64xbf16>", "tensor<5xi32>",
      "tensor<4xi32>"], "fwd_varlen", {"max_seqlen": (4, 4)}, "cu_seqlens_k has type"),
    (["tensor<100x8x64xbf16>", "tensor<120x2x64xbf16>", "tensor<120x2x64xbf16>", "tensor<5xi32>",
      "tensor<5xi32>"], "fwd_varlen", {}, "max_seqlen"),
    ([Q, KV, KV, "tensor<3x7xi32>", "tensor<2xi32>"], "fwd_paged", {}, "block_table has type"),
    ([Q, KV, KV, "tensor<2x7xi32>", "tensor<2xi32>", "tensor<1x8x16x24xf32>"], "fwd_paged",
     {"extras": "bias"}, "takes only the extras alibi"),
    (["tensor<100x8x64xbf16>", "tensor<120x2x64xbf16>", "tensor<120x2x64xbf16>", "tensor<5xi32>",
      "tensor<5xi32>", "tensor<5x8xf32>"], "fwd_varlen", {"max_seqlen": (4, 4), "extras": "alibi"},
     "alibi_slopes has type"),
])
def test_bad_operands_are_refused_in_python(types, direction, kw, match):
    with pytest.raises(ValueError, match=match):
        _emit(types, direction, **kw)


def test_attribute_schemas_are_what_the_handlers_bind():
    from flashgen.contract import ATTRIBUTE_TYPES as ATTRIBUTES, DIRECTIONS
    assert set(ATTRIBUTES) == set(DIRECTIONS)
    base = {"causal", "scale", "bottom_right", "window_left", "window_right", "softcap"}
    assert set(ATTRIBUTES["fwd"]) == base | {"extras"}
    assert set(ATTRIBUTES["bwd"]) == base | {"extras", "deterministic"}
    assert set(ATTRIBUTES["fwd_varlen"]) == base | {"extras", "max_seqlen_q", "max_seqlen_k"}
    assert set(ATTRIBUTES["bwd_varlen"]) == base | {"extras", "max_seqlen_q", "max_seqlen_k", "deterministic"}
    assert set(ATTRIBUTES["fwd_paged"]) == base | {"extras"}


def test_cli_emit_with_extras():
    import subprocess
    import sys
    args = [sys.executable, "-m", "flashgen", "emit", "--hdim", "32", "--dtype", "f32", "--seq-q", "8",
            "--heads", "2", "--module"]
    out = subprocess.run(args + ["--extras", "alibi,mask"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert 'extras = "alibi,mask"' in out.stdout and "tensor<2xf32>, %arg4: tensor<1x2x8x8xi1>" in out.stdout
    bad = subprocess.run(args + ["--extras", "relative"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown extras" in bad.stderr and "Traceback" not in bad.stderr
