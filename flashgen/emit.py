"""Build flashgen's stablehlo.custom_call ops with the MLIR Python bindings.

Two attribute forms, both carrying contract.CallAttributes' typed dictionary (every attribute of
contract.CALLS[direction]: extras on every call, max_seqlen_q/_k on varlen calls too):
  native (default): {api_version = 4 : i32, backend_config = {causal = false, extras = "",
                     scale = 1.250000e-01 : f32, ...}} — StableHLO >= 1.3, what EXLA emits.
  legacy:           {backend_config = "", mhlo.backend_config = {...}, operand_layouts,
                     result_layouts} — what jax.ffi.ffi_call prints; XLA upgrades it.
"""
from __future__ import annotations

import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import func, stablehlo

from flashgen.mlir_context import new_context
from flashgen.sharding_rule import context_has_sdy, sharding_rule_attr
from flashgen.contract import CALLS, FP8_DTYPES, CallAttributes, calls, normalize_extras
from flashgen.spec import KernelSpec, normalize_dtype

_MLIR_DTYPES = {"f16": "f16", "bf16": "bf16", "f32": "f32", "e4m3": "f8E4M3FN"}


def element_dtype(t: ir.Type) -> str:
    """flashgen dtype name of an MLIR element type ('bf16', ...), or ValueError."""
    return normalize_dtype(str(t))


def attention_attributes(causal: bool, scale: float, bottom_right: bool = False,
                         window=(-1, -1), softcap: float = 0.0, extras=(),
                         direction: str = "fwd", max_seqlen=None) -> ir.DictAttr:
    """The typed attribute dictionary a flashgen handler decodes (contract.CallAttributes)."""
    return CallAttributes(causal, scale, bottom_right, window, softcap, extras, max_seqlen).to_mlir(direction)


def _tensor(v: ir.Value, name: str, rank: int = 4, layout: str = "[batch, seq, heads, head_dim] (BSHD)",
            dynamic: bool = False) -> ir.RankedTensorType:
    """``dynamic``: batch and sequence (the leading two dims) may be dynamic; the handlers
    read them from the buffers, heads and head_dim select the kernel and stay static."""
    t = v.type
    if not isinstance(t, ir.RankedTensorType):
        raise ValueError(f"{name} must be a ranked tensor, got {t}")
    if t.rank != rank:
        raise ValueError(f"{name} must be rank {rank} {layout}, got {t}")
    static = t.has_static_shape or (dynamic and rank == 4 and
                                    not any(t.is_dynamic_dim(i) for i in (2, 3)))
    if not static:
        raise ValueError(f"{name} must have a static shape" +
                         (" except batch and sequence" if dynamic else "") + f", got {t}")
    return t


def _expect(x: ir.Value, name: str, shapes: list[list[int]], elements: list[str],
            dynamic: bool = False) -> ir.RankedTensorType:
    """``dynamic``: a dim sized B, Sq or Sk may be dynamic (``shapes`` then holds the dynamic
    size there, as the query's type does)."""
    t = x.type
    ok = (isinstance(t, ir.RankedTensorType) and (t.has_static_shape or dynamic)
          and list(t.shape) in shapes and str(t.element_type) in elements)
    if not ok:
        dim = lambda n: "?" if ir.ShapedType.is_dynamic_size(n) else str(n)  # noqa: E731
        want = " or ".join(f"tensor<{'x'.join(map(dim, s))}x{e}>" for s in shapes for e in elements)
        raise ValueError(f"{name} has type {t}, expected {want}")
    return t


def _check_extras(direction, extras, operands, dims: dict[str, int], q_elt: str,
                  dynamic: bool = False) -> list[ir.Type]:
    """Type-checks the extra operands against contract.EXTRAS (`dims`: the sizes of B, Sq, Sk,
    Hq); returns the dbias result type (the bias's) as a list, if there is a bias."""
    dbias = []
    for want, x in zip(CALLS[direction].extra_operands(extras), operands):
        t = _expect(x, want.name, want.shapes(dims), want.dtypes(q_elt), dynamic)
        if want.name == "bias":
            dbias = [t]
    return dbias


def result_types(spec: KernelSpec, direction: str, operands: list[ir.Value],
                 extras=(), dbias: bool = True, dynamic: bool = False) -> list[ir.Type]:
    """Check operand types against the spec (README "KernelSpec and the custom calls");
    return the call's result types. ``dynamic``: a dense call whose batch and sequence dims
    may be dynamic (its results, and its extra operands' B, Sq, Sk dims, then are too)."""
    extras = normalize_extras(extras)
    if dynamic and direction not in ("fwd", "bwd"):
        raise ValueError("dynamic batch/sequence dims are supported only by the dense fwd/bwd "
                         "calls")
    call_name = spec.target_name(direction)  # ValueError for an unknown direction
    if spec.head_dim_v != spec.head_dim and direction not in ("fwd", "bwd"):
        raise ValueError(f"{call_name}: only the dense fwd and bwd calls take a value head dim "
                         f"({spec.head_dim_v}) other than the query/key one ({spec.head_dim})")
    call = calls(spec.dtype)[direction]
    call.extra_operands(extras, call_name)
    names = call.operand_names(extras)
    if len(operands) != len(names):
        raise ValueError(f"{call_name} takes {len(names)} operands "
                         f"({', '.join(names)}), got {len(operands)}")
    rank = 3 if direction.endswith("varlen") else 4
    layout = "[tokens, heads, head_dim]" if rank == 3 else (
        "[blocks, block_size, kv_heads, head_dim]" if direction == "fwd_paged"
        else "[batch, seq, heads, head_dim] (BSHD)")
    q = _tensor(operands[0], "q", rank, "[tokens, heads, head_dim]" if rank == 3 else
                "[batch, seq, heads, head_dim] (BSHD)", dynamic)
    k, v = (_tensor(x, n, rank, layout, dynamic) for x, n in zip(operands[1:3], names[1:3]))
    for t, n, d in ((q, "q", spec.head_dim), (k, names[1], spec.head_dim), (v, names[2], spec.head_dim_v)):
        if element_dtype(t.element_type) != spec.dtype:
            raise ValueError(f"{n} has element type {t.element_type}, the spec needs {spec.dtype}")
        if t.shape[-1] != d:
            raise ValueError(f"{n} head_dim is {t.shape[-1]}, the spec needs {d}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"mismatched shapes: {names[1]} {k}, {names[2]} {v}")
    # o (and do): q's shape with v's head dim
    o = q if spec.head_dim_v == spec.head_dim else ir.RankedTensorType.get([*q.shape[:-1], spec.head_dim_v],
                                                                          q.element_type)
    if hkv == 0 or hq % hkv:
        raise ValueError(f"kv heads ({hkv}) must divide q heads ({hq})")
    if spec.dtype in FP8_DTYPES:  # the descale operands after q, k, v; o in the call's own type
        for x, want in zip(operands[3:], call.operands[3:]):
            _expect(x, want.name, want.shapes({}), want.dtypes(spec.dtype))
        o = ir.RankedTensorType.get(list(o.shape), ir.Type.parse(call.results[0].full_dtype(spec.dtype)))
    f32 = ir.F32Type.get()
    i32 = ["i32"]
    if rank == 3:  # varlen
        lse = ir.RankedTensorType.get([hq, q.shape[0]], f32)
        first = 3 if direction == "fwd_varlen" else 6
        cu = _tensor(operands[first], "cu_seqlens_q", 1, "[batch + 1]")
        if cu.shape[0] < 1:
            raise ValueError(f"cu_seqlens_q must be [batch + 1], got {cu}")
        _expect(operands[first], "cu_seqlens_q", [list(cu.shape)], i32)
        _expect(operands[first + 1], "cu_seqlens_k", [list(cu.shape)], i32)
        _check_extras(direction, extras, operands[first + 2:], {"B": cu.shape[0] - 1, "Hq": hq},
                      str(q.element_type))
        if direction == "fwd_varlen":
            return [q, lse]
        _check_saved(operands, q, lse)
        return [q, k, v]
    b, sq = q.shape[0], q.shape[1]
    lse = ir.RankedTensorType.get([b, hq, sq], f32)
    if direction == "fwd_paged":
        bt = _tensor(operands[3], "block_table", 2, f"[batch={b}, max_blocks]")
        _expect(operands[3], "block_table", [[b, bt.shape[1]]], i32)
        _expect(operands[4], "seqused_k", [[b]], i32)
        _check_extras(direction, extras, operands[5:], {"B": b, "Sq": sq, "Hq": hq}, str(q.element_type))
        return [q, lse]
    if k.shape[0] != b:
        raise ValueError(f"mismatched shapes: q {q}, k {k}, v {v}")
    sk = k.shape[1]
    nfixed = len(call.operands)
    dbias_type = _check_extras(direction, extras, operands[nfixed:], {"B": b, "Sq": sq, "Sk": sk, "Hq": hq},
                               str(q.element_type), dynamic)
    if direction == "fwd":
        return [o, lse]
    _check_saved(operands, o, lse)
    return [q, k, v, *(dbias_type if dbias else [])]


def _check_saved(operands, o: ir.Type, lse: ir.Type) -> None:
    """A backward's o, lse, do (operands 3..5) have the forward's result types."""
    for x, n, want in zip(operands[3:6], ("o", "lse", "do"), (o, lse, o)):
        if x.type != want:
            raise ValueError(f"{n} has type {x.type}, expected {want}")


def _row_major_layouts(types: list[ir.Type]) -> ir.ArrayAttr:
    attrs = []
    for t in types:
        rank = t.rank
        attrs.append(ir.DenseElementsAttr.get(
            np.arange(rank - 1, -1, -1, dtype=np.int64), type=ir.IndexType.get()))
    return ir.ArrayAttr.get(attrs)


def emit_custom_call(spec: KernelSpec, direction: str, operands: list[ir.Value], *,
                     scale: float, bottom_right: bool = False, window=(-1, -1),
                     softcap: float = 0.0, extras=(), max_seqlen=None, dbias: bool = True,
                     deterministic: bool = False, legacy_attrs: bool = False,
                     sharding_rule: bool = True, result_shapes=None,
                     loc: ir.Location | None = None, ip: ir.InsertionPoint | None = None
                     ) -> list[ir.Value]:
    """Insert one flashgen custom call; returns its results: (o, lse) for the forward
    directions, (dq, dk, dv[, dbias]) for the backward ones.

    `direction` is one of spec.DIRECTIONS; dense calls take the operands that `extras`
    names after the fixed ones (README "Variants"), varlen calls need
    `max_seqlen=(max_seqlen_q, max_seqlen_k)`. `result_shapes` (one 1-D i32 tensor per
    result) makes a dense call shape-polymorphic: batch and sequence may be
    dynamic, and shape refinement resolves the results from these tensors. A dense backward with a bias returns dbias
    unless `dbias=False` (then the kernel does no dbias work); `deterministic` (backward calls
    only) asks for the same bits on every run.

    Must be called inside an active MLIR context with the stablehlo dialect
    loaded; `ip`/`loc` default to the current insertion point and location.
    With `sharding_rule` (and the sdy dialect in the context) the op carries
    an `sdy.sharding_rule` so SPMD partitioning splits it over batch and heads
    (flashgen/sharding_rule.py; flashgen/jax/sharding.py partitions it); it
    changes nothing on one device.
    """
    attrs = CallAttributes(spec.causal, scale, bottom_right, window, softcap, extras, max_seqlen, deterministic)
    return emit_call(spec, direction, operands, attrs, dbias=dbias, legacy_attrs=legacy_attrs,
                     sharding_rule=sharding_rule, result_shapes=result_shapes, loc=loc, ip=ip)


def emit_call(spec: KernelSpec, direction: str, operands: list[ir.Value], attrs: CallAttributes, *,
              dbias: bool = True, legacy_attrs: bool = False, sharding_rule: bool = True,
              result_shapes=None, loc: ir.Location | None = None,
              ip: ir.InsertionPoint | None = None) -> list[ir.Value]:
    """emit_custom_call with the attributes as one contract.CallAttributes (whose causal flag
    must be the spec's)."""
    if attrs.causal != spec.causal:
        raise ValueError(f"the attributes say causal={attrs.causal}, the target "
                         f"{spec.target_name(direction)} causal={spec.causal}")
    dynamic = result_shapes is not None
    types = result_types(spec, direction, operands, attrs.extras, dbias, dynamic)
    if dynamic:
        if len(result_shapes) != len(types):
            raise ValueError(f"{len(types)} results need {len(types)} result shapes, got "
                             f"{len(result_shapes)}")
        sharding_rule = False   # the rule names static factor sizes
        if legacy_attrs:
            raise ValueError("dynamic result shapes need the native attribute form")
    config = attrs.to_mlir(direction)
    name = spec.target_name(direction)
    if legacy_attrs:
        op = stablehlo.CustomCallOp(
            types, operands, name, backend_config=ir.StringAttr.get(""),
            operand_layouts=_row_major_layouts([o.type for o in operands]),
            result_layouts=_row_major_layouts(types), loc=loc, ip=ip)
        op.attributes["mhlo.backend_config"] = config
    else:
        op = stablehlo.CustomCallOp(
            types, list(operands) + list(result_shapes or ()), name, backend_config=config,
            api_version=ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 4), loc=loc, ip=ip)
    if dynamic:
        # as jax's own custom calls with dynamic results: the trailing i32 shape operands
        # that shape refinement at call time reads, then drops with this attribute
        op.attributes["indices_of_shape_operands"] = ir.DenseIntElementsAttr.get(
            np.arange(len(operands), len(operands) + len(types), dtype=np.int64))
    if sharding_rule and context_has_sdy(op.context):
        op.attributes["sdy.sharding_rule"] = sharding_rule_attr(
            direction, [list(x.type.shape) for x in operands], attrs.extras, dbias, spec.dtype)
    return list(op.results)


def attention_module(spec: KernelSpec, *, batch: int, seq_q: int, seq_k: int, heads: int,
                     kv_heads: int | None = None, scale: float | None = None,
                     bottom_right: bool = False, window=(-1, -1), softcap: float = 0.0,
                     extras=(), legacy_attrs: bool = False) -> ir.Module:
    """A complete module whose public @main(q, k, v, *extras) returns the forward (o, lse).
    Extras take their full shapes and widest types (contract.Operand.full_shape, full_dtype:
    a bias [B,Hq,Sq,Sk] f32)."""
    kv_heads = heads if kv_heads is None else kv_heads
    _check_problem(batch=batch, seq_q=seq_q, seq_k=seq_k, heads=heads, kv_heads=kv_heads)
    scale = 1.0 / np.sqrt(spec.head_dim) if scale is None else scale
    with new_context(), ir.Location.unknown():
        module = ir.Module.create()
        elt = ir.Type.parse(_MLIR_DTYPES[spec.dtype])
        q_t = ir.RankedTensorType.get([batch, seq_q, heads, spec.head_dim], elt)
        k_t = ir.RankedTensorType.get([batch, seq_k, kv_heads, spec.head_dim], elt)
        v_t = ir.RankedTensorType.get([batch, seq_k, kv_heads, spec.head_dim_v], elt)
        fwd = calls(spec.dtype)["fwd"]
        o_t = ir.RankedTensorType.get([batch, seq_q, heads, spec.head_dim_v],
                                      ir.Type.parse(_MLIR_DTYPES[fwd.results[0].full_dtype(spec.dtype)]))
        lse_t = ir.RankedTensorType.get([batch, heads, seq_q], ir.F32Type.get())
        dims = {"B": batch, "Sq": seq_q, "Sk": seq_k, "Hq": heads, "1": 1}
        # operands after q, k, v: an FP8 call's descales, then the extras
        extra_t = [ir.RankedTensorType.get(o.full_shape(dims), ir.Type.parse(o.full_dtype(spec.dtype)))
                   for o in fwd.operands[3:] + fwd.extra_operands(extras)]
        with ir.InsertionPoint(module.body):
            main = func.FuncOp("main", ir.FunctionType.get([q_t, k_t, v_t, *extra_t], [o_t, lse_t]))
            main.attributes["sym_visibility"] = ir.StringAttr.get("public")
            block = main.add_entry_block()
            with ir.InsertionPoint(block):
                results = emit_custom_call(spec, "fwd", list(block.arguments), scale=scale,
                                           bottom_right=bottom_right, window=window,
                                           softcap=softcap, extras=extras,
                                           legacy_attrs=legacy_attrs)
                func.ReturnOp(results)
        if not module.operation.verify():
            raise RuntimeError("flashgen emitted an invalid module")  # a flashgen bug, not user error
        return module


def _check_problem(**sizes) -> None:
    """Sizes checked here, by name: MLIR would only say "invalid tensor dimension size"."""
    from flashgen.errors import UsageError
    for name, n in sizes.items():
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or not 1 <= n < 2**31:
            raise UsageError(f"{name} must be a positive integer below 2**31, got {n!r}")
    if sizes["heads"] % sizes["kv_heads"]:
        raise UsageError(f"heads ({sizes['heads']}) must be a multiple of kv_heads "
                         f"({sizes['kv_heads']})")
