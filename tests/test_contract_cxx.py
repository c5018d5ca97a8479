"""The C++ side of the call contract agrees with flashgen/contract.py.

Each handler's generated binding (templates/common/bind.j2, for the CPU and the CUDA template),
the attribute structs csrc/flashgen/call.h decodes into (their members and the FFI's struct
decoding), call.h's per-call decode signatures and the NIF face's tables are read back from the
sources and compared with contract.CALLS / ATTRIBUTES / EXTRAS. Each check is also run against
a contract with one fact changed, which it must report. And call.h validates once for every
backend: the CPU and the (emulated) CUDA handlers refuse a bad call in the same words.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from conftest import needs_nvcc
from flashgen import codegen, contract, resources
from flashgen.spec import FFI_DTYPES, KernelSpec

CALL_H = resources.csrc_dir() / "flashgen" / "call.h"
# Operand names C++ cannot spell.
CXX_NAMES = {"do": "dout"}
# call.h's buffer parameter types -> contract dtype ("T": the spec's).
BUFFER_DTYPES = {"T": "T", "ffi::F32": "f32", "ffi::S32": "i32"}
SPECS = [KernelSpec(64, "bf16", True, "cpu"), KernelSpec(32, "f32", False, "cpu"), KernelSpec(64, "f16", False, "sm80")]


def _ffi_type(dtype: str, spec: KernelSpec) -> str:
    return FFI_DTYPES[spec.dtype] if dtype == "T" else {"f32": "F32", "i32": "S32"}[dtype]


def _attrs_type(call: contract.Call) -> str:
    return codegen._ATTRS_TYPES.get(call.attributes, "<no struct>")


def binding_mismatches(spec: KernelSpec, calls: dict) -> list[str]:
    """Where the rendered handlers of `spec` differ from `calls` (contract.CALLS)."""
    text = codegen.render_spec(spec).text
    blocks = re.findall(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\((\w+), \(.*?flashgen::(\w+)>\{\"(\w+)\"\}\),(.*?)\);",
                        text, re.S)
    got = {}
    for symbol, call_type, symbol_again, body in blocks:
        args = re.findall(r"\.Arg<ffi::Buffer<ffi::DataType::(\w+)>>\(\)\s*// (\w+)", body)
        rets = re.findall(r"\.Ret<ffi::Buffer<ffi::DataType::(\w+)>>\(\)\s*// (\w+)", body)
        got[symbol] = dict(call_type=call_type, symbol=symbol_again, args=args, rets=rets,
                           remaining_args=".RemainingArgs()" in body, dbias=".RemainingRets()" in body,
                           attrs=re.findall(r"\.Attrs<flashgen::(\w+)>\(\)", body),
                           single_attrs=re.findall(r"\.Attr<", body))
    bad = []
    if set(got) != {spec.target_name(d) for d in calls}:
        bad.append(f"{spec.stem}: handlers {sorted(got)} but the contract has {sorted(calls)}")
    for d, call in calls.items():
        h = got.get(spec.target_name(d))
        if h is None:
            continue
        want = dict(call_type="".join(w.capitalize() for w in d.split("_")) + "Call", symbol=spec.target_name(d),
                    args=[(_ffi_type(o.dtype, spec), o.name) for o in call.operands],
                    rets=[(_ffi_type(o.dtype, spec), o.name) for o in call.results],
                    remaining_args=True, dbias=call.dbias, attrs=[_attrs_type(call)], single_attrs=[])
        bad += [f"{spec.stem} {d}: {k} is {h[k]}, contract says {v}" for k, v in want.items() if h[k] != v]
    return bad


def _struct_members(text: str, name: str) -> list[tuple[str, str]]:
    """(C++ type, name) of struct `name`'s data members, its base's first."""
    m = re.search(rf"struct {name}(?: : (\w+))? \{{(.*?)\n\}};", text, re.S)
    assert m, f"struct {name} not found in call.h"
    members = _struct_members(text, m.group(1)) if m.group(1) else []
    for line in m.group(2).splitlines():
        d = re.fullmatch(r"\s*([\w:]+) (\w+);", line)
        if d:
            members.append((d.group(1), d.group(2)))
    return members


def _decoded_members(text: str, name: str) -> list[tuple[str, str]]:
    """(C++ type, name) of the FFI struct decoding registered for flashgen::`name`."""
    macros = {}
    for m in re.finditer(r"^#define (\w+)((?:.*\\\n)+.*)$", text, re.M):
        macros[m.group(1)] = m.group(2).replace("\\\n", " ")
    m = re.search(rf"XLA_FFI_REGISTER_STRUCT_ATTR_DECODING\(flashgen::{name},(.*?)\);", text, re.S)
    assert m, f"no struct decoding registered for {name}"
    body = m.group(1)
    for macro, expansion in macros.items():
        body = body.replace(macro, expansion)
    return re.findall(r"StructMember<([\w:]+)>\(\"(\w+)\"\)", body)


def attribute_mismatches(calls: dict, attributes: dict) -> list[str]:
    """Where call.h's attribute structs differ from the attributes `calls` declare."""
    text = CALL_H.read_text()
    bad = []
    for d, call in calls.items():
        struct = _attrs_type(call)
        if struct == "<no struct>":
            bad.append(f"{d}: no call.h struct decodes the attributes {call.attributes}")
            continue
        want = [(attributes[n].cxx, n) for n in call.attributes]
        for what, got in (("members", _struct_members(text, struct)), ("struct decoding", _decoded_members(text, struct))):
            if got != want:
                bad.append(f"{d}: {struct}'s {what} are {got}, contract says {want}")
    return bad


def decode_mismatches(calls: dict) -> list[str]:
    """Where call.h's <Direction>Call::decode parameters differ from the calls' buffers."""
    text = CALL_H.read_text()
    bad = []
    for d, call in calls.items():
        name = "".join(w.capitalize() for w in d.split("_")) + "Call"
        m = re.search(rf"static ffi::ErrorOr<{name}> decode\(const Callee& c, (.*?)\) \{{", text, re.S)
        if m is None:
            bad.append(f"{d}: call.h has no {name}::decode")
            continue
        params = [p.strip().rsplit(" ", 1) for p in m.group(1).split(",")]
        buffers = [(BUFFER_DTYPES.get(re.sub(r"ffi::(Result)?Buffer<(.*)>", r"\2", t)), n, "Result" in t)
                   for t, n in params if "Buffer<" in t]
        want = [(o.dtype, CXX_NAMES.get(o.name, o.name), False) for o in call.operands] + \
               [(o.dtype, CXX_NAMES.get(o.name, o.name), True) for o in call.results]
        if buffers != want:
            bad.append(f"{d}: {name}::decode takes {buffers}, contract says {want}")
        rest = [t for t, _ in params if "Buffer<" not in t]
        want_rest = ["ffi::RemainingArgs"] + (["ffi::RemainingRets"] if call.dbias else []) + [_attrs_type(call)]
        if rest != want_rest:
            bad.append(f"{d}: {name}::decode's other parameters are {rest}, contract says {want_rest}")
    return bad


def nif_mismatches(calls: dict, attributes: dict, extras: dict) -> list[str]:
    """Where the NIF face's rendered tables differ from the contract."""
    text = codegen.render_nif_face().text
    bad = []
    for d, call in calls.items():
        m = re.search(rf"k_{d}_attrs\[\] = \{{(.*?)\n\}};", text, re.S)
        got = re.findall(r'\{"(\w+)", XLA_FFI_DataType_(\w+)\}', m.group(1)) if m else None
        types = {"i1": "PRED", "i32": "S32", "f32": "F32", "string": "INVALID"}
        want = [(n, types[attributes[n].mlir]) for n in call.attributes]
        if got != want:
            bad.append(f"nif {d}: attributes {got}, contract says {want}")
    for name, ops in extras.items():
        m = re.search(rf"k_{name}_operands\[\] = \{{(.*?)\}};", text)
        got = re.findall(r'"(\w+)"', m.group(1)) if m else None
        if got != [o.name for o in ops]:
            bad.append(f"nif extra {name}: operands {got}, contract says {[o.name for o in ops]}")
    directions = re.findall(r'\{"(\w+)", k_\w+_attrs, \d+\}', text)
    if directions != list(calls):
        bad.append(f"nif directions {directions}, contract says {list(calls)}")
    return bad


def extras_order_mismatches(extras: dict) -> list[str]:
    """Where ffi_common.h's parse_extras (the names it accepts, their order, its error text)
    differs from contract.EXTRAS."""
    text = (resources.csrc_dir() / "flashgen" / "ffi_common.h").read_text()
    body = re.search(r"parse_extras\(.*?\n\}", text, re.S).group(0)
    order = re.search(r"const char\* order\[(\d+)\] = \{(.*?)\};", body)
    flags = re.search(r"bool\* flags\[(\d+)\] = \{(.*?)\};", body)
    allowed = re.search(r"allowed, in this order: ([\w,]+)", body)
    want = list(extras)
    got = {"order": re.findall(r'"(\w+)"', order.group(2)) if order else None,
           "flags": re.findall(r"&n\.(\w+)", flags.group(2)) if flags else None,
           "error text": allowed.group(1).split(",") if allowed else None,
           "loop bound": [None] * len(want) if f"i < {len(want)}" in body and f"i == {len(want)}" in body else None}
    return [f"parse_extras {what}: {names}, contract says {want}" for what, names in got.items()
            if names is None or len(names) != len(want) or (what != "loop bound" and names != want)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.stem)
def test_rendered_bindings_are_the_contract(spec):
    assert binding_mismatches(spec, contract.CALLS) == []


def test_call_h_attribute_structs_are_the_contract():
    assert attribute_mismatches(contract.CALLS, contract.ATTRIBUTES) == []


def test_call_h_decode_signatures_are_the_contract():
    assert decode_mismatches(contract.CALLS) == []


def test_nif_tables_are_the_contract():
    assert nif_mismatches(contract.CALLS, contract.ATTRIBUTES, contract.EXTRAS) == []


def test_ffi_common_parse_extras_is_the_contract():
    assert extras_order_mismatches(contract.EXTRAS) == []


def test_each_check_reports_a_changed_contract(monkeypatch):
    """The checks are not vacuous: a contract that says one thing differently is reported."""
    fwd, varlen = contract.CALLS["fwd"], contract.CALLS["fwd_varlen"]
    swapped = dataclasses.replace(varlen, operands=(*varlen.operands[:3], varlen.operands[4], varlen.operands[3]))
    calls = {**contract.CALLS, "fwd_varlen": swapped}
    assert decode_mismatches(calls) and nif_mismatches(calls, contract.ATTRIBUTES, contract.EXTRAS) == []
    # The templates render from contract.CALLS: change it where codegen reads it.
    monkeypatch.setattr(contract, "CALLS", calls)
    assert binding_mismatches(SPECS[0], calls) == []  # rendered from the changed contract, so it agrees ...
    assert decode_mismatches(calls)                    # ... and call.h, which did not change, is reported
    monkeypatch.undo()
    attrs = {**contract.ATTRIBUTES, "window_left": dataclasses.replace(contract.ATTRIBUTES["window_left"], cxx="int64_t")}
    assert attribute_mismatches(contract.CALLS, attrs)
    assert nif_mismatches(contract.CALLS, {**contract.ATTRIBUTES, "scale": dataclasses.replace(
        contract.ATTRIBUTES["scale"], mlir="i32")}, contract.EXTRAS)
    reordered = dataclasses.replace(fwd, attributes=(fwd.attributes[1], fwd.attributes[0], *fwd.attributes[2:]))
    assert attribute_mismatches({"fwd": reordered}, contract.ATTRIBUTES)
    assert binding_mismatches(SPECS[0], {**contract.CALLS, "bwd": dataclasses.replace(contract.CALLS["bwd"],
                                                                                        dbias=False)})
    names = list(contract.EXTRAS)
    assert extras_order_mismatches({n: contract.EXTRAS[n] for n in [names[1], names[0], *names[2:]]})
    assert extras_order_mismatches({**contract.EXTRAS, "softmax_sink": ()})


# ---- one validation for every backend ---------------------------------------------------------
def _bad_calls():
    """(direction, operands, results, attribute changes, the words of the refusal): calls a
    hand-written module could make, each wrong in one way."""
    import ml_dtypes
    bf16, i32, f32 = ml_dtypes.bfloat16, np.int32, np.float32
    z = lambda *shape, t=bf16: np.zeros(shape, t)  # noqa: E731
    fwd_outs = [((1, 1, 2, 64), bf16), ((1, 2, 1), f32)]
    table, used = np.zeros((1, 2), i32), np.zeros((1,), i32)
    packed = [z(4, 2, 64), z(4, 2, 64), z(4, 2, 64), np.array([0, 4], i32), np.array([0, 4], i32)]
    return [
        ("fwd_paged", [z(1, 1, 2, 64), z(4, 16, 2, 64), z(4, 8, 2, 64), table, used], fwd_outs, {},
         "k_cache and v_cache shapes differ"),
        ("fwd_paged", [z(1, 1, 2, 64), z(4, 0, 2, 64), z(4, 0, 2, 64), table, used], fwd_outs, {},
         "block_size (k_cache dim 1) must be > 0"),
        ("fwd_paged", [z(1, 1, 2, 64), z(4, 16, 2, 64), z(4, 16, 2, 64), np.zeros((2, 2), i32), used], fwd_outs, {},
         "block_table must be [1, max_blocks]"),
        ("fwd_varlen", packed, [((4, 2, 64), bf16), ((2, 4), f32)], {"max_seqlen_q": -1},
         "max_seqlen_q / max_seqlen_k must be >= 0"),
        ("bwd", [z(1, 8, 2, 64)] * 4 + [z(1, 2, 7, t=f32), z(1, 8, 2, 64)], [((1, 8, 2, 64), bf16)] * 3, {},
         "lse has shape [1, 2, 7], expected [1, 2, 8]"),
        ("fwd", [z(1, 8, 2, 64)] * 3, [((1, 8, 2, 64), bf16), ((1, 2, 8), f32)], {"causal": False},
         "does not match this kernel"),
    ]


def _attributes(direction: str, changes: dict) -> dict:
    values = {"causal": True, "scale": 0.125, "max_seqlen_q": 4, "max_seqlen_k": 4}
    return {n: changes.get(n, values.get(n, contract.ATTRIBUTES[n].default))
            for n in contract.CALLS[direction].attributes}


def _cpu_refusal(target: str, operands, results, attrs) -> str:
    import jax
    types = {"i1": bool, "i32": np.int32, "f32": np.float32, "string": str}
    typed = {n: types[contract.ATTRIBUTES[n].mlir](v) for n, v in attrs.items()}
    outs = [jax.ShapeDtypeStruct(s, t) for s, t in results]
    with pytest.raises(Exception) as e:
        jax.block_until_ready(jax.ffi.ffi_call(target, outs)(*operands, **typed))
    return re.search(rf"{target}: ([^\n]*)", str(e.value)).group(1)


@needs_nvcc
def test_cpu_and_cuda_handlers_refuse_a_bad_call_alike():
    """call.h validates for both backends: the CPU handler (under XLA) and the CUDA handler (under
    the emulator's host) refuse the same bad call with the same message, before any kernel."""
    from flashgen import runtime
    from flashgen.build import build
    from flashgen.emulate.host import EmulatedLibrary, HandlerError
    cpu, cuda = KernelSpec(64, "bf16", True, "cpu"), KernelSpec(64, "bf16", True, "sm80")
    runtime.ensure([cpu])
    lib = EmulatedLibrary(build(cuda, host="emulate"))
    for direction, operands, results, changes, words in _bad_calls():
        target, attrs = cpu.target_name(direction), _attributes(direction, changes)
        assert target == cuda.target_name(direction)
        with pytest.raises(HandlerError) as e:
            lib.call(target, operands, results, **attrs)
        assert e.value.record.launches == []
        got = {"cpu": _cpu_refusal(target, operands, results, attrs), "cuda": e.value.message.split(": ", 1)[1]}
        assert got["cpu"] == got["cuda"] and words in got["cpu"], (direction, got)
