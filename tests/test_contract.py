"""flashgen.contract is the one statement of the call: CallAttributes builds the typed dictionary
and reads it back, and emit, the contract checker and the JAX lowering agree with its tables."""
import numpy as np
import pytest

from flashgen.contract import ATTRIBUTE_TYPES, CALLS, DIRECTIONS, CallAttributes

# Sizes of the contract's symbolic dims, all different so a swapped dim shows.
DIMS = {"B": 2, "Sq": 16, "Sk": 24, "Hq": 4, "Hkv": 2, "D": 32, "Dv": 32, "Tq": 40, "Tk": 50, "B+1": 3,
        "NB": 6, "BS": 16, "MB": 3}


def _attrs(direction):
    """Every attribute away from its default, with every extra the call takes."""
    return CallAttributes(True, 0.3, bottom_right=True, window=(5, 0), softcap=7.5,
                          extras=CALLS[direction].extras,
                          max_seqlen=(11, 13) if direction.endswith("varlen") else None)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_to_mlir_and_parse_round_trip(direction):
    from flashgen.contract import _mlir_type
    from flashgen.mlir_context import new_context
    attrs = _attrs(direction)
    with new_context():
        config = attrs.to_mlir(direction)
        assert {config[i].name: _mlir_type(config[i].attr) for i in range(len(config))} == \
            ATTRIBUTE_TYPES[direction]
        assert CallAttributes.parse(config, direction) == attrs
        text = str(config)
    assert CallAttributes.parse(text, direction) == attrs  # the text a partitioner gets
    assert CallAttributes.parse(text.encode(), direction) == attrs
    kwargs = attrs.ffi_kwargs(direction)
    assert list(kwargs) == list(ATTRIBUTE_TYPES[direction])
    assert kwargs["scale"].dtype == np.float32 and kwargs["window_left"].dtype == np.int32
    assert isinstance(kwargs["causal"], bool) and isinstance(kwargs["extras"], str)


def test_every_attribute_has_one_call_attributes_field():
    """A new contract attribute needs its place in CallAttributes (contract._FIELD_OF)."""
    import dataclasses
    from flashgen.contract import ATTRIBUTES, _FIELD_OF
    assert set(_FIELD_OF) == set(ATTRIBUTES)
    assert {f for f, _ in _FIELD_OF.values()} == {f.name for f in dataclasses.fields(CallAttributes)}


GOOD = ('{bottom_right = false, causal = true, extras = "", scale = 2.500000e-01 : f32, '
        'softcap = 0.000000e+00 : f32, window_left = -1 : i32, window_right = -1 : i32}')


@pytest.mark.parametrize("edit, direction, words", [
    (lambda t: t.replace(", window_left = -1 : i32", ""), "fwd",
     r"attribute window_left is missing \(expected i32\)"),
    (lambda t: t.replace("window_left = -1 : i32", "window_left = -1 : i64"), "bwd",
     "attribute window_left is i64, expected i32"),
    (lambda t: t.replace("2.500000e-01 : f32", "2.500000e-01 : f64"), "fwd", "attribute scale is f64, expected f32"),
    (lambda t: t.replace("causal = true", "causal = 1 : i32"), "fwd", "attribute causal is i32, expected i1"),
    (lambda t: t.replace('extras = ""', "extras = 0 : i32"), "fwd", "attribute extras is i32, expected string"),
    (lambda t: t.replace("bottom_right = false,", "bottom_right = false, block = 64 : i32,"), "fwd",
     "unexpected attribute block"),
    (lambda t: t, "fwd_varlen", "attribute max_seqlen_q is missing"),
    (lambda t: t.replace("2.500000e-01 : f32", "-2.500000e-01 : f32"), "fwd", "scale must be a finite positive f32"),
    (lambda t: t.replace('extras = ""', 'extras = "relative"'), "fwd", "unknown extras"),
    (lambda t: t.replace('extras = ""', 'extras = "bias"'), "fwd_paged", "fwd_paged call takes only the extras alibi"),
    (lambda t: t.replace("window_left = -1", "window_left = -2"), "fwd", r"window left must be in \[-1, 2\^31\)"),
    (lambda t: "42 : i32", "fwd", "not a dictionary of typed attributes"),
    (lambda t: t[:-1], "fwd", "is not an MLIR attribute"),
    (lambda t: t, "sideways", "direction must be one of"),
])
def test_parse_names_what_is_wrong(edit, direction, words):
    assert CallAttributes.parse(GOOD, "fwd") == CallAttributes(True, 0.25)
    with pytest.raises(ValueError, match=words):
        CallAttributes.parse(edit(GOOD), direction)


def test_bad_values_are_refused_when_built():
    with pytest.raises(ValueError, match="varlen calls need max_seqlen"):
        CallAttributes(False, 1.0).to_mlir("bwd_varlen")
    with pytest.raises(ValueError, match="max_seqlen_k must be an int"):
        CallAttributes(False, 1.0, max_seqlen=(3, 2**31))
    with pytest.raises(ValueError, match="window must be a pair"):
        CallAttributes(False, 1.0, window=3)


def _operand_types(direction, dtype="f32"):
    """A call's operand types built from the contract alone: fixed operands, then every extra
    it takes, at their full (unbroadcast) shapes."""
    from jaxlib.mlir import ir
    call = CALLS[direction]
    ops = call.operands + call.extra_operands(call.extras)
    return [ir.RankedTensorType.get(o.full_shape(DIMS), ir.Type.parse(o.full_dtype(dtype))) for o in ops]


def test_emitted_calls_follow_the_contract_and_pass_its_check():
    """Every direction emitted from the contract's operand shapes; the module passes
    check_module, and each call's dictionary parses back to the attributes it was given."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import func
    from flashgen import KernelSpec
    from flashgen.call_contract import check_module
    from flashgen.emit import emit_call
    from flashgen.mlir_context import new_context
    from flashgen.rewrite.graph import flashgen_calls
    from flashgen.spec import parse_target_name
    spec = KernelSpec(DIMS["D"], "f32", True, "cpu")
    with new_context(), ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            main = func.FuncOp("main", ir.FunctionType.get([], []))  # what check_module's loader wants
            main.attributes["sym_visibility"] = ir.StringAttr.get("public")
            with ir.InsertionPoint(main.add_entry_block()):
                func.ReturnOp([])
            for direction in DIRECTIONS:
                types = _operand_types(direction)
                fn = func.FuncOp(direction, ir.FunctionType.get(types, []))
                with ir.InsertionPoint(fn.add_entry_block()):
                    results = emit_call(spec, direction, list(fn.arguments), _attrs(direction))
                    func.ReturnOp(results)
                fn.attributes["function_type"] = ir.TypeAttr.get(
                    ir.FunctionType.get(types, [r.type for r in results]))
                want = [o.full_shape(DIMS) for o in CALLS[direction].results]
                assert [list(r.type.shape) for r in results][:len(want)] == want
        assert module.operation.verify()
        calls = list(flashgen_calls(module.operation))
        assert [parse_target_name(n)[0] for _, n in calls] == list(DIRECTIONS)
        for op, name in calls:
            direction = parse_target_name(name)[0]
            assert CallAttributes.parse(op, direction) == _attrs(direction)
        text = str(module)
    check_module(text)


def test_the_jax_lowering_passes_every_attribute_with_its_contract_type():
    """flash_attention, its gradient, the varlen and paged forms lower to calls of every
    direction whose dictionaries carry exactly the contract's attributes and types, which
    check_module accepts."""
    import jax
    import jax.numpy as jnp
    from jaxlib.mlir import ir
    import flashgen.jax as fj
    from flashgen.contract import _mlir_type
    from flashgen.mlir_context import new_context
    from flashgen.rewrite.graph import flashgen_calls
    from flashgen.spec import parse_target_name
    b, sq, h, d = 2, 8, 2, 32
    q = jnp.ones((b, sq, h, d), jnp.float32)
    bias = jnp.zeros((1, h, sq, sq), jnp.float32)
    slopes = jnp.full((h,), 0.1, jnp.float32)
    cu = jnp.array([0, 3, 8], jnp.int32)
    tok = jnp.ones((8, h, d), jnp.float32)

    def everything(q, tok):
        loss = fj.flash_attention(q, q, q, bias, causal=True, window=(4, 0), softcap=5.0,
                                  alibi_slopes=slopes).sum()
        loss += fj.flash_attention_varlen(tok, tok, tok, cu, cu, 5, 5, causal=True,
                                          alibi_slopes=slopes).sum()
        return loss

    def paged(q):
        cache = jnp.ones((4, 16, h, d), jnp.float32)
        return fj.flash_attention_paged(q, cache, cache, jnp.zeros((b, 2), jnp.int32),
                                        jnp.full((b,), 9, jnp.int32), alibi_slopes=slopes)

    texts = [jax.jit(jax.grad(everything, (0, 1))).lower(q, tok).as_text(),
             jax.jit(paged).lower(q).as_text()]
    seen = set()
    with new_context():
        for text in texts:
            module = ir.Module.parse(text)
            for op, name in flashgen_calls(module.operation):
                direction = parse_target_name(name)[0]
                seen.add(direction)
                config = next(op.attributes[k] for k in ("mhlo.backend_config", "backend_config")
                              if k in op.attributes)
                assert {config[i].name: _mlir_type(config[i].attr) for i in range(len(config))} == \
                    ATTRIBUTE_TYPES[direction], name
                attrs = CallAttributes.parse(op, direction)
                assert attrs.extras == (("alibi", "bias") if direction in ("fwd", "bwd") else ("alibi",))
                assert len(op.operands) == len(CALLS[direction].operand_names(attrs.extras))
    assert seen == set(DIRECTIONS)
    exported = fj.export(jax.grad(everything, (0, 1)), q, tok)
    fj.check_calls(exported)


@pytest.mark.parametrize("edit, words", [
    (lambda t: t.replace('extras = ""', 'extras = "relative"'), "unknown extras"),
    (lambda t: t.replace("window_left = -1 : i32", "window_left = -7 : i32"), "window left must be in"),
    (lambda t: t.replace("causal = false", "causal = true"),
     "attribute causal is true, but the target is the non-causal specialization"),
])
def test_check_module_refuses_bad_values_before_xla(edit, words):
    """The contract check used to compare only the attributes' names and types; a value the
    handler refuses (an unknown extra, a window below -1, causal against the target) passed it."""
    from flashgen import KernelSpec, emit
    from flashgen.call_contract import check_module
    from flashgen.errors import UsageError
    text = str(emit.attention_module(KernelSpec(32, "f32", False, "cpu"), batch=1, seq_q=8, seq_k=8, heads=1))
    check_module(text)
    bad = edit(text)
    assert bad != text
    with pytest.raises(UsageError, match=f"the call of flashgen_fwd_d32_f32 at .*: {words}"):
        check_module(bad)
