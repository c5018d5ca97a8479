"""Build flashgen's stablehlo.custom_call ops with the MLIR Python bindings.

Two attribute forms:
  native (default): {api_version = 4 : i32, backend_config = {causal = ..., scale = ... : f32,
                     bottom_right = ..., window_left = -1 : i32, window_right = -1 : i32,
                     softcap = 0.0 : f32}} — StableHLO >= 1.3, what EXLA emits.
  legacy:           {backend_config = "", mhlo.backend_config = {...}, operand_layouts,
                     result_layouts} — what jax.ffi.ffi_call prints; XLA upgrades it.
"""
from __future__ import annotations

import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import func, stablehlo

from flashgen.mlir_context import new_context
from flashgen.spec import KernelSpec, normalize_dtype, normalize_softcap, normalize_window

_MLIR_DTYPES = {"f16": "f16", "bf16": "bf16", "f32": "f32"}


def element_dtype(t: ir.Type) -> str:
    """flashgen dtype name of an MLIR element type ('bf16', ...), or ValueError."""
    return normalize_dtype(str(t))


def attention_attributes(causal: bool, scale: float, bottom_right: bool = False,
                         window=(-1, -1), softcap: float = 0.0) -> ir.DictAttr:
    """The typed attribute dictionary every flashgen handler decodes (spec.ATTRIBUTE_SCHEMA)."""
    scale = float(np.float32(scale))
    if not (scale > 0 and np.isfinite(scale)):
        raise ValueError(f"scale must be a finite positive number, got {scale}")
    left, right = normalize_window(window)
    softcap = normalize_softcap(softcap)
    i32 = ir.IntegerType.get_signless(32)
    return ir.DictAttr.get({
        "causal": ir.BoolAttr.get(bool(causal)),
        "scale": ir.FloatAttr.get(ir.F32Type.get(), scale),
        "bottom_right": ir.BoolAttr.get(bool(bottom_right)),
        "window_left": ir.IntegerAttr.get(i32, left),
        "window_right": ir.IntegerAttr.get(i32, right),
        "softcap": ir.FloatAttr.get(ir.F32Type.get(), softcap),
    })


def _tensor(v: ir.Value, name: str) -> ir.RankedTensorType:
    t = v.type
    if not isinstance(t, ir.RankedTensorType):
        raise ValueError(f"{name} must be a ranked tensor, got {t}")
    if t.rank != 4:
        raise ValueError(f"{name} must be rank 4 [batch, seq, heads, head_dim] (BSHD), got {t}")
    if not t.has_static_shape:
        raise ValueError(f"{name} must have a static shape, got {t}")
    return t


def result_types(spec: KernelSpec, direction: str, operands: list[ir.Value]) -> list[ir.Type]:
    """Check operand types against the spec; return the call's result types."""
    names = ["q", "k", "v"] if direction == "fwd" else ["q", "k", "v", "o", "lse", "do"]
    if len(operands) != len(names):
        raise ValueError(f"{spec.target_name(direction)} takes {len(names)} operands "
                         f"({', '.join(names)}), got {len(operands)}")
    q, k, v = (_tensor(x, n) for x, n in zip(operands[:3], names))
    for t, n in ((q, "q"), (k, "k"), (v, "v")):
        if element_dtype(t.element_type) != spec.dtype:
            raise ValueError(f"{n} has element type {t.element_type}, the spec needs {spec.dtype}")
        if t.shape[3] != spec.head_dim:
            raise ValueError(f"{n} head_dim is {t.shape[3]}, the spec needs {spec.head_dim}")
    b, sq, hq, d = q.shape
    if k.shape != v.shape or k.shape[0] != b:
        raise ValueError(f"mismatched shapes: q {q}, k {k}, v {v}")
    if k.shape[2] == 0 or hq % k.shape[2]:
        raise ValueError(f"kv heads ({k.shape[2]}) must divide q heads ({hq})")
    f32 = ir.F32Type.get()
    lse = ir.RankedTensorType.get([b, hq, sq], f32)
    if direction == "fwd":
        return [q, lse]
    expected = {"o": q, "lse": lse, "do": q}
    for x, n in zip(operands[3:], names[3:]):
        if x.type != expected[n]:
            raise ValueError(f"{n} has type {x.type}, expected {expected[n]}")
    return [q, k, v]


def _row_major_layouts(types: list[ir.Type]) -> ir.ArrayAttr:
    attrs = []
    for t in types:
        rank = t.rank
        attrs.append(ir.DenseElementsAttr.get(
            np.arange(rank - 1, -1, -1, dtype=np.int64), type=ir.IndexType.get()))
    return ir.ArrayAttr.get(attrs)


def emit_custom_call(spec: KernelSpec, direction: str, operands: list[ir.Value], *,
                     scale: float, bottom_right: bool = False, window=(-1, -1),
                     softcap: float = 0.0, legacy_attrs: bool = False,
                     sharding_rule: bool = True,
                     loc: ir.Location | None = None, ip: ir.InsertionPoint | None = None
                     ) -> list[ir.Value]:
    """Insert one flashgen custom call; returns its results (o, lse) or (dq, dk, dv).

    Must be called inside an active MLIR context with the stablehlo dialect
    loaded; `ip`/`loc` default to the current insertion point and location.
    With `sharding_rule` (and the sdy dialect in the context) the op carries
    an `sdy.sharding_rule` so SPMD partitioning splits it over batch and heads
    (flashgen/jax/sharding.py); it changes nothing on one device.
    """
    types = result_types(spec, direction, operands)
    attrs = attention_attributes(spec.causal, scale, bottom_right, window, softcap)
    name = spec.target_name(direction)
    if legacy_attrs:
        op = stablehlo.CustomCallOp(
            types, operands, name, backend_config=ir.StringAttr.get(""),
            operand_layouts=_row_major_layouts([o.type for o in operands]),
            result_layouts=_row_major_layouts(types), loc=loc, ip=ip)
        op.attributes["mhlo.backend_config"] = attrs
    else:
        op = stablehlo.CustomCallOp(
            types, operands, name, backend_config=attrs,
            api_version=ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 4), loc=loc, ip=ip)
    if sharding_rule:
        from flashgen.jax.sharding import context_has_sdy, sharding_rule_attr
        if context_has_sdy(op.context):
            op.attributes["sdy.sharding_rule"] = sharding_rule_attr(
                direction, operands[0].type.shape, operands[1].type.shape)
    return list(op.results)


def attention_module(spec: KernelSpec, *, batch: int, seq_q: int, seq_k: int, heads: int,
                     kv_heads: int | None = None, scale: float | None = None,
                     bottom_right: bool = False, window=(-1, -1), softcap: float = 0.0,
                     legacy_attrs: bool = False) -> ir.Module:
    """A complete module whose public @main(q, k, v) returns the forward (o, lse)."""
    kv_heads = heads if kv_heads is None else kv_heads
    scale = 1.0 / np.sqrt(spec.head_dim) if scale is None else scale
    with new_context(), ir.Location.unknown():
        module = ir.Module.create()
        elt = ir.Type.parse(_MLIR_DTYPES[spec.dtype])
        q_t = ir.RankedTensorType.get([batch, seq_q, heads, spec.head_dim], elt)
        kv_t = ir.RankedTensorType.get([batch, seq_k, kv_heads, spec.head_dim], elt)
        lse_t = ir.RankedTensorType.get([batch, heads, seq_q], ir.F32Type.get())
        with ir.InsertionPoint(module.body):
            main = func.FuncOp("main", ir.FunctionType.get([q_t, kv_t, kv_t], [q_t, lse_t]))
            main.attributes["sym_visibility"] = ir.StringAttr.get("public")
            block = main.add_entry_block()
            with ir.InsertionPoint(block):
                results = emit_custom_call(spec, "fwd", list(block.arguments), scale=scale,
                                           bottom_right=bottom_right, window=window,
                                           softcap=softcap, legacy_attrs=legacy_attrs)
                func.ReturnOp(results)
        if not module.operation.verify():
            raise RuntimeError("flashgen emitted an invalid module")  # a flashgen bug, not user error
        return module
