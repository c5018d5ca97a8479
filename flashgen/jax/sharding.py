"""Partitioning flashgen custom calls over a device mesh (batch and heads).

Three pieces, one contract — batch and heads are parallel, sequence and
head_dim stay whole on every device:

* the Shardy ``#sdy.op_sharding_rule`` put on every flashgen custom call (by
  ``flash_attention`` here and by ``flashgen.emit.emit_custom_call``): pure IR,
  so it lives below both, in ``flashgen.sharding_rule``.
* XLA custom-call partitioners registered for every flashgen target name
  (``register_partitioners``, done on import): the SPMD partitioner asks them
  how to split a call; they keep batch and head tiling, replicate whatever
  else is tiled (or does not divide), and return the same custom call on the
  local shard shapes. They serve Shardy (after it propagated with the rule)
  and the GSPMD partitioner (``jax_use_shardy_partitioner=False``, through
  their sharding-inference callback) alike, and any module that holds
  flashgen calls: ``flash_attention``, ``jax.export`` round trips, emitted or
  rewritten StableHLO.
* checks of the shardings JAX can see before compiling (``check_operand_shardings``,
  ``attention_shardings``).

A partitioner reads the call it splits with the contract's one parse
(``contract.CallAttributes.parse``) and emits it again on the local shapes with those
attributes. Importing this module (flashgen.jax.primitive does) registers the partitioners, so
importing ``flashgen.jax`` does; ``register_partitioners()`` does it explicitly.
"""
from __future__ import annotations

import functools
import itertools
import threading

import jax
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxlib.mlir import ir

from flashgen.contract import CALLS, FP8_DTYPES, CallAttributes, calls, extra_operand_index
from flashgen.emit import emit_call
from flashgen.spec import DIRECTIONS, DTYPES, FP8_HEAD_DIMS, HEAD_DIMS, KernelSpec, parse_target_name, target_name
from flashgen.targets import fp8_targets

BATCH, SEQ_Q, HEADS, HEAD_DIM = 0, 1, 2, 3  # BSHD


# --------------------------------------------------------------------------------------
# XLA custom-call partitioners (HloSharding arithmetic; called by the SPMD partitioner).

_registered = False
_register_lock = threading.Lock()


def _xc():
    from jax._src.lib import xla_client  # the partitioner registry lives here (no public API)
    return xla_client


def _replicate_dims(sharding, dims):
    if sharding is None or not sharding.is_tiled():
        return sharding
    return _xc().hlo_sharding_util.PartiallyReplicateTiledShardingOnDims(sharding, list(dims))


def _plan(base, q_shape, kv_shape):
    """Shardings (q-like, kv-like, lse) derived from a q-like operand's sharding.

    Keeps the batch and head tiling, replicates sequence and head_dim, and
    replicates batch or heads too where the tile count does not divide B, Hq
    and Hkv: the kernel never sees padding, and q head chunk c pairs with kv
    head chunk c (Hkv/n kv heads for Hq/n q heads keeps h -> h // G)."""
    xc = _xc()
    if base is None or base.is_replicated() or not base.is_tiled():
        rep = xc.HloSharding.replicate()
        return rep, rep, rep
    s = _replicate_dims(base, [SEQ_Q, HEAD_DIM])
    tiles = s.tile_assignment_dimensions()
    bad = []
    if q_shape[BATCH] % tiles[BATCH]:
        bad.append(BATCH)
    if q_shape[HEADS] % tiles[HEADS] or kv_shape[HEADS] % tiles[HEADS]:
        bad.append(HEADS)
    if bad:
        s = _replicate_dims(s, bad)
    if s.is_replicated():
        rep = xc.HloSharding.replicate()
        return rep, rep, rep
    return s, s, _lse_sharding(s)


def _lse_sharding(s):
    """[B, S, H, D] tiling (S, D untiled) -> the same devices tiling lse [B, H, S]."""
    xc = _xc()
    dims = list(s.tile_assignment_dimensions())
    devices = np.asarray(s.tile_assignment_devices()).reshape(dims)
    devices = devices.transpose([0, 2, 1, 3] + list(range(4, len(dims))))
    op = xc.OpSharding()
    op.type = xc.OpSharding.Type.OTHER
    op.tile_assignment_dimensions = [dims[0], dims[2], dims[1] * dims[3]] + dims[4:]
    op.tile_assignment_devices = [int(x) for x in devices.reshape(-1)]
    if s.replicate_on_last_tile_dim():
        op.replicate_on_last_tile_dim = True
    else:
        op.last_tile_dims = list(s.subgroup_types())
    return xc.HloSharding.from_proto(op)


def _read_call(name: str, backend_string: bytes):
    """(spec, direction, attributes) of the call XLA asks about, read by the contract's parse."""
    p = parse_target_name(name)
    # The target only names the call (names carry no architecture); FP8 specs exist on FP8 targets.
    target = fp8_targets()[0] if p.dtype in FP8_DTYPES else "cpu"
    spec = KernelSpec(p.head_dim, p.dtype, p.causal, target, p.head_dim_v)
    return spec, p.direction, CallAttributes.parse(backend_string, p.direction)


_MLIR_ELEMENTS = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "bool": "i1", "int32": "i32",
                  "float8_e4m3fn": "f8E4M3FN"}


def _local_module(spec: KernelSpec, direction: str, local_shapes, elements, attrs: CallAttributes,
                  dbias: bool) -> bytes:
    """A module whose @main is the same flashgen call on per-device shapes."""
    from jaxlib.mlir.dialects import func
    from flashgen.mlir_context import new_context
    with new_context(), ir.Location.unknown():
        module = ir.Module.create()
        types = [ir.RankedTensorType.get(list(shape), ir.Type.parse(_MLIR_ELEMENTS[elt]))
                 for shape, elt in zip(local_shapes, elements)]
        with ir.InsertionPoint(module.body):
            fn = func.FuncOp("main", ir.FunctionType.get(types, []))
            fn.attributes["sym_visibility"] = ir.StringAttr.get("public")
            block = fn.add_entry_block()
            with ir.InsertionPoint(block):
                results = emit_call(spec, direction, list(block.arguments), attrs, dbias=dbias,
                                    legacy_attrs=True, sharding_rule=False)
                func.ReturnOp(results)
            fn.attributes["function_type"] = ir.TypeAttr.get(
                ir.FunctionType.get(types, [r.type for r in results]))
        return str(module).encode()


def _shardings_for(direction, plan, dtype):
    qs, kvs, lses = plan
    if direction == "fwd":  # an FP8 call's descales ([1] each) after q, k, v: replicated
        scalars = [_xc().HloSharding.replicate()] * (len(calls(dtype)["fwd"].operands) - 3)
        return [qs, kvs, kvs, *scalars], [qs, lses]
    return [qs, kvs, kvs, qs, lses, qs], [qs, kvs, kvs]


def _plan_for(direction, base, shapes, extras, with_dbias):
    """_plan, except that a backward returning the dbias of a bias broadcast over batch or
    heads keeps that dim whole: dbias sums over it, which per-device calls cannot do."""
    if with_dbias and base is not None and base.is_tiled():
        bias = shapes[len(CALLS[direction].operands) + extra_operand_index(extras, "bias")]
        whole = [dim for dim, n in ((BATCH, bias[0]), (HEADS, bias[1])) if n == 1]
        if whole:
            base = _replicate_dims(base, whole)
    return _plan(base, shapes[0], shapes[1])


def _batch_head_devices(qs, batch_dim, head_dim):
    """q's tile assignment as devices[b, h, rest] (batch_dim None: q has no batch axis), the
    rest being replicas; None when q's sharding has subgroups other than replication. q's
    other dims must already be untiled."""
    if list(qs.subgroup_types()) and not qs.replicate_on_last_tile_dim():
        return None
    dims = list(qs.tile_assignment_dimensions())
    devices = np.asarray(qs.tile_assignment_devices()).reshape(dims)
    order = ([batch_dim] if batch_dim is not None else []) + [head_dim]
    devices = devices.transpose(order + [i for i in range(len(dims)) if i not in order])
    if batch_dim is None:
        devices = devices[None]
    return devices.reshape(devices.shape[0], devices.shape[1], -1)


def _follow(devices, roles, shape):
    """The sharding of a tensor whose dims have roles 'b' (batch), 'h' (heads) or None, split as
    devices[b, h, rest] splits q: b/h where the dim is not of size 1; a factor the tensor
    lacks, and the rest, become replication."""
    xc = _xc()
    keep = [i for i, (role, n) in enumerate(zip(roles, shape)) if role and n > 1]
    used = [{"b": 0, "h": 1}[roles[i]] for i in keep]
    arr = devices.transpose(used + [a for a in (0, 1) if a not in used] + [2])
    tiles = [arr.shape[k] for k in range(len(used))]
    if all(t == 1 for t in tiles):
        return xc.HloSharding.replicate()
    full = [1] * len(shape)
    for k, i in enumerate(keep):
        full[i] = tiles[k]
    op = xc.OpSharding()
    op.type = xc.OpSharding.Type.OTHER
    rep = int(np.prod(arr.shape[len(used):]))
    op.tile_assignment_dimensions = full + ([rep] if rep > 1 else [])
    op.tile_assignment_devices = [int(x) for x in arr.reshape(-1)]
    if rep > 1:
        op.replicate_on_last_tile_dim = True
    return xc.HloSharding.from_proto(op)


def _extra_shardings(direction, qs, shapes, extras):
    """Shardings of the extra operands that follow q's batch/head tiling `qs` (contract.EXTRAS:
    a batch or q-head dim splits as q's, a dim of size 1 (broadcast) is not split; factors an
    operand lacks become replication). None when q's sharding has subgroups other than
    replication (the call then runs whole)."""
    xc = _xc()
    if not extras:
        return []
    if qs.is_replicated():
        return [xc.HloSharding.replicate()] * len(shapes)
    devices = _batch_head_devices(qs, BATCH, HEADS)
    if devices is None:
        return None
    return [_follow(devices, _roles(o, s), s) for o, s in zip(CALLS[direction].extra_operands(extras), shapes)]


def _roles(operand, shape) -> tuple:
    """_follow's roles of an extra operand's dims: 'b' for the batch, 'h' for the q heads."""
    symbolic = operand.shape if len(shape) == len(operand.shape) else operand.other_shape
    return tuple({"B": "b", "Hq": "h"}.get(d.split("|")[-1]) for d in symbolic)


def _packed_shardings(direction, base, shapes, extras):
    """(operand, result) shardings of a varlen call (heads split; the packed tokens and
    cu_seqlens stay whole: sequence boundaries are data) or a paged call (batch and heads
    split; the caches split by kv head only, their blocks are addressed by global ids)."""
    xc = _xc()
    rep = xc.HloSharding.replicate()
    paged = direction == "fwd_paged"
    n_results = 2 if direction.startswith("fwd") else 3
    whole = ([rep] * len(shapes), [rep] * n_results)
    if base is None or not base.is_tiled() or base.is_replicated():
        return whole
    q_shape, hkv = shapes[0], shapes[1][-2]
    batch_dim, head_dim = (0, 2) if paged else (None, 1)
    base = _replicate_dims(base, [d for d in range(len(q_shape)) if d not in (batch_dim, head_dim)])
    if q_shape[head_dim] % base.tile_assignment_dimensions()[head_dim] or \
            hkv % base.tile_assignment_dimensions()[head_dim]:
        base = _replicate_dims(base, [head_dim])
    if paged and q_shape[0] % base.tile_assignment_dimensions()[0]:
        base = _replicate_dims(base, [0])
    devices = None if base.is_replicated() else _batch_head_devices(base, batch_dim, head_dim)
    if devices is None:
        return whole
    f = functools.partial(_follow, devices)
    nfixed = len(CALLS[direction].operands)
    # The extras follow the heads (and, for paged calls, the batch; varlen has no batch axis).
    extra = [f(_roles(o, x), x) for o, x in zip(CALLS[direction].extra_operands(extras), shapes[nfixed:])]
    if paged:
        q, cache = f(("b", None, "h", None), q_shape), f((None, None, "h", None), shapes[1])
        lse = f(("b", "h", None), (q_shape[0], q_shape[2], q_shape[1]))
        return [q, cache, cache, f(("b", None), shapes[3]), f(("b",), shapes[4]), *extra], [q, lse]
    q, kv = f((None, "h", None), q_shape), f((None, "h", None), shapes[1])
    lse = f(("h", None), (q_shape[1], q_shape[0]))
    if direction == "fwd_varlen":
        return [q, kv, kv, rep, rep, *extra], [q, lse]
    return [q, kv, kv, q, lse, q, rep, rep, *extra], [q, kv, kv]


def _base_sharding(direction, arg_shardings, result_sharding=None):
    """The sharding to follow: q's, else o's/dO's, else the first result's."""
    candidates = [arg_shardings[0]] + ([arg_shardings[3], arg_shardings[5]]
                                       if direction == "bwd" and len(arg_shardings) == 6 else [])
    if result_sharding is not None and result_sharding.tuple_elements():
        candidates.append(result_sharding.tuple_elements()[0])
    for s in candidates:
        if s is not None and s.is_tiled():
            return s
    return None


def _with_dbias(direction, result_shape) -> bool:
    """A backward with a bias that returns dbias: one result more than the call's fixed ones."""
    return CALLS[direction].dbias and len(result_shape.tuple_shapes()) > len(CALLS[direction].results)


def _partition(name, arg_shapes, arg_shardings, result_shape, result_sharding, backend_string):
    xc = _xc()
    spec, direction, attrs = _read_call(name, backend_string)
    shapes = [tuple(s.dimensions()) for s in arg_shapes]
    elements = [str(np.dtype(s.numpy_dtype())) for s in arg_shapes]
    with_dbias = _with_dbias(direction, result_shape)
    if any(s is not None and s.is_manual() for s in arg_shardings):
        # Inside a fully manual region the call already sees local shapes.
        operand_sh = [xc.HloSharding.manual()] * len(shapes)
        result_sh = [xc.HloSharding.manual()] * len(result_shape.tuple_shapes())
        local = shapes
    elif direction not in ("fwd", "bwd"):
        operand_sh, result_sh = _packed_shardings(direction, _base_sharding(direction, arg_shardings, result_sharding),
                                                  shapes, attrs.extras)
        local = [tuple(sh.tile(s).dimensions()) for sh, s in zip(operand_sh, arg_shapes)]
    else:
        plan = _plan_for(direction, _base_sharding(direction, arg_shardings, result_sharding), shapes,
                         attrs.extras, with_dbias)
        operand_sh, result_sh = _shardings_for(direction, plan, spec.dtype)
        extra_sh = _extra_shardings(direction, plan[0], shapes[len(operand_sh):], attrs.extras)
        if extra_sh is None:  # a tiling the extras cannot follow: the call runs whole
            plan = (xc.HloSharding.replicate(),) * 3
            operand_sh, result_sh = _shardings_for(direction, plan, spec.dtype)
            extra_sh = [plan[0]] * (len(shapes) - len(operand_sh))
        operand_sh = operand_sh + extra_sh
        if with_dbias:
            result_sh = result_sh + [extra_sh[extra_operand_index(attrs.extras, "bias")]]
        local = [tuple(sh.tile(s).dimensions()) for sh, s in zip(operand_sh, arg_shapes)]
    module = _local_module(spec, direction, local, elements, attrs, with_dbias)
    return module, operand_sh, xc.HloSharding.tuple_sharding(result_shape, result_sh)


def _infer_from_operands(name, arg_shapes, arg_shardings, result_shape, backend_string):
    # GSPMD propagation. Must not raise (XLA aborts on a Python error here).
    try:
        spec, direction, attrs = _read_call(name, backend_string)
        base = _base_sharding(direction, arg_shardings)
        if base is None:
            return None
        shapes = [tuple(s.dimensions()) for s in arg_shapes]
        if direction not in ("fwd", "bwd"):
            result_sh = _packed_shardings(direction, base, shapes, attrs.extras)[1]
            return _xc().HloSharding.tuple_sharding(result_shape, result_sh)
        with_dbias = _with_dbias(direction, result_shape)
        plan = _plan_for(direction, base, shapes, attrs.extras, with_dbias)
        _, result_sh = _shardings_for(direction, plan, spec.dtype)
        nfixed = len(calls(spec.dtype)[direction].operands)
        if len(shapes) > nfixed:  # extras; the backward's dbias follows the bias
            extra_sh = _extra_shardings(direction, plan[0], shapes[nfixed:], attrs.extras)
            if extra_sh is None:
                return None
            if with_dbias:
                result_sh = result_sh + [extra_sh[extra_operand_index(attrs.extras, "bias")]]
        return _xc().HloSharding.tuple_sharding(result_shape, result_sh)
    except Exception:  # noqa: BLE001 - fall back to XLA's default (replicated) choice
        return None


def _propagate_user_sharding(user_sharding, shape, backend_string):
    return user_sharding


def all_target_names(directions=DIRECTIONS) -> list[str]:
    fp8 = [(d, h, t) for d, h, t in itertools.product(directions, FP8_HEAD_DIMS, FP8_DTYPES) if d in calls(t)]
    return [target_name(d, h, t, c)
            for (d, h, t), c in itertools.product([*itertools.product(directions, HEAD_DIMS, DTYPES), *fp8],
                                                  (False, True))]


def register_partitioners() -> None:
    """Register the partitioner of every flashgen target with XLA (idempotent)."""
    global _registered
    with _register_lock:
        if _registered:
            return
        xc = _xc()
        for name in all_target_names():
            callbacks = dict(prop_user_sharding=_propagate_user_sharding,
                             partition=functools.partial(_partition, name),
                             infer_sharding_from_operands=functools.partial(_infer_from_operands, name),
                             can_side_effecting_have_replicated_sharding=True)
            xc.register_custom_call_partitioner(name, **callbacks)
            try:  # PJRT plugins (CUDA) keep their own registry
                from jax._src import xla_bridge
                xla_bridge.register_plugin_callbacks(
                    functools.partial(xc.register_custom_call_partitioner, name=name, **callbacks))
            except Exception:  # noqa: BLE001 - no plugin support: CPU and built-in backends only
                pass
        _registered = True


# --------------------------------------------------------------------------------------
# Checks on shardings JAX can see before compiling.

def _spec_of(x):
    """Explicit (sharding-in-types) PartitionSpec of a traced or concrete value, or None."""
    aval_sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(aval_sharding, "spec", None)
    if spec is not None and any(e is not None for e in spec):
        return tuple(spec) + (None,) * (x.ndim - len(spec))
    return None


def _axes(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def check_operand_shardings(q, k, v) -> None:
    """Refuse shardings flash_attention cannot honour, with a message saying why.

    Sees explicit (sharding-in-types) shardings and the shardings of
    committed concrete arrays. head_dim split over devices is always an
    error; under explicit sharding the sequence dims must be whole too, and
    q/k/v must split batch and heads over the same mesh axes. (Shardings
    chosen by jit's automatic propagation are handled by the partitioner:
    anything but batch and heads is gathered there.)"""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            shard = x.sharding.shard_shape(x.shape)
            if shard[HEAD_DIM] != x.shape[HEAD_DIM]:
                raise ValueError(
                    f"{name} is sharded along head_dim ({x.shape[HEAD_DIM]} split into pieces of "
                    f"{shard[HEAD_DIM]}, sharding {x.sharding}): flashgen kernels need whole head "
                    f"vectors on every device; shard batch and heads instead")
    specs = [_spec_of(x) for x in (q, k, v)]
    if not any(specs):
        return
    specs = [s or (None,) * 4 for s in specs]
    for name, s in zip("qkv", specs):
        if s[HEAD_DIM] is not None:
            raise ValueError(
                f"{name} is sharded along head_dim over mesh axes {_axes(s[HEAD_DIM])}: flashgen "
                f"kernels need whole head vectors on every device; shard batch and heads instead")
        if s[SEQ_Q] is not None:
            raise ValueError(
                f"{name} is sharded along the sequence over mesh axes {_axes(s[SEQ_Q])}: "
                f"flash_attention needs whole sequences per device (reshard it, or use "
                f"flashgen.jax.ring_attention inside shard_map for sequence parallelism)")
    if not (specs[0][BATCH] == specs[1][BATCH] == specs[2][BATCH]):
        raise ValueError(f"q, k, v must shard batch over the same mesh axes, got "
                         f"{[_axes(s[BATCH]) for s in specs]}")
    if not (specs[0][HEADS] == specs[1][HEADS] == specs[2][HEADS]):
        raise ValueError(
            f"q heads are sharded over {_axes(specs[0][HEADS])} but k/v heads over "
            f"{[_axes(s[HEADS]) for s in specs[1:]]}: kv heads must be split over the same mesh "
            f"axes as the q heads (each device holds whole GQA groups), so those axes must "
            f"divide the kv head count too")


def attention_shardings(mesh, q_shape, kv_shape, *, batch=None, heads=None):
    """NamedShardings (q/o, k/v, lse) splitting batch over `batch` and heads over `heads`
    (mesh axis names, a tuple of them, or None), after checking the split is exact:
    batch and both head counts divisible by the product of the axis sizes."""
    from jax.sharding import NamedSharding
    q_shape, kv_shape = tuple(q_shape), tuple(kv_shape)
    for what, axes, sizes in (("batch", batch, [(q_shape[BATCH], "batch")]),
                              ("heads", heads, [(q_shape[HEADS], "q heads"),
                                                (kv_shape[HEADS], "kv heads")])):
        n = 1
        for a in _axes(axes):
            if a not in mesh.shape:
                raise ValueError(f"no mesh axis {a!r} (mesh axes: {tuple(mesh.shape)})")
            n *= mesh.shape[a]
        for size, label in sizes:
            if size % n:
                raise ValueError(
                    f"cannot split {label} ({size}) over mesh axes {_axes(axes)} of total size "
                    f"{n}: {n} does not divide {size}"
                    + ("; with GQA the kv heads are split together with their q-head groups, so "
                       "the head axes must divide the kv head count" if label == "kv heads" else ""))
    qs = NamedSharding(mesh, P(batch, None, heads, None))
    return qs, NamedSharding(mesh, P(batch, None, heads, None)), NamedSharding(mesh, P(batch, heads, None))


register_partitioners()
