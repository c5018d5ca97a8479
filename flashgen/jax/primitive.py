"""The JAX primitive behind flashgen's JAX functions: one bind, one flashgen custom call.

Laid out as JAX's own fused attention (jax/_src/cudnn/fused_attention_stablehlo.py): the
primitive, its abstract evaluation and lowering; then batching (vmap folds the mapped axis into
the batch) and partitioning (the XLA custom-call partitioners of flashgen.jax.sharding,
registered on import). The call's attributes travel as one contract.CallAttributes from
flash_attention to the lowering, which hands them to jax.ffi with their contract types.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir as jax_mlir
from jax.sharding import PartitionSpec as P

from flashgen.contract import CALLS, CallAttributes, calls, extra_operand_index
from flashgen.jax.sharding import BATCH, HEADS, register_partitioners
from flashgen.sharding_rule import sharding_rule_attr
from flashgen.spec import KernelSpec, normalize_dtype, numpy_name

_kernel_p = Primitive("flashgen_kernel")
_kernel_p.multiple_results = True


def _abstract_eval(*avals, target, direction, attrs: CallAttributes, dbias):
    q = avals[0]
    if direction.startswith("bwd"):
        nfixed = len(CALLS[direction].operands)
        dbias = [avals[nfixed + extra_operand_index(attrs.extras, "bias")]] if dbias else []
        return [a.update(weak_type=False) for a in [*avals[:3], *dbias]]
    if direction == "fwd_varlen":
        lse = q.update(shape=(q.shape[1], q.shape[0]), dtype=jnp.float32, weak_type=False)
        return [q.update(weak_type=False), lse]
    o_dtype = calls(normalize_dtype(q.dtype))[direction].results[0].full_dtype(normalize_dtype(q.dtype))
    o = q.update(shape=(*q.shape[:-1], avals[2].shape[-1]), dtype=jnp.dtype(numpy_name(o_dtype)),
                 weak_type=False)  # v's head dim; an FP8 call's o is bf16
    b, sq, hq, _ = q.shape
    sharding = q.sharding
    spec = tuple(sharding.spec) + (None,) * (4 - len(sharding.spec))
    lse = q.update(shape=(b, hq, sq), dtype=jnp.float32, weak_type=False,
                   sharding=sharding.update(spec=P(spec[BATCH], spec[HEADS], None)))
    return [o, lse]


def _fully_manual(ctx) -> bool:
    axis_context = ctx.module_context.axis_context
    manual = getattr(axis_context, "manual_axes", None)
    mesh = getattr(axis_context, "mesh", None)
    return bool(manual) and mesh is not None and set(manual) == set(mesh.axis_names)


def _lowering(ctx, *args, target, direction, attrs: CallAttributes, dbias):
    extra = {}
    if jax.config.jax_use_shardy_partitioner and not _fully_manual(ctx):
        extra["sdy.sharding_rule"] = sharding_rule_attr(direction, [a.shape for a in ctx.avals_in], attrs.extras,
                                                        dbias, normalize_dtype(ctx.avals_in[0].dtype))
    rule = jax.ffi.ffi_lowering(target, extra_attributes=extra or None)
    return rule(ctx, *args, **attrs.ffi_kwargs(direction))


@functools.partial(jax.jit, static_argnames=("target", "direction", "attrs", "dbias"))
def _apply(*args, target, direction, attrs, dbias):
    return _kernel_p.bind(*args, target=target, direction=direction, attrs=attrs, dbias=dbias)


_kernel_p.def_abstract_eval(_abstract_eval)
_kernel_p.def_impl(lambda *args, **params: _apply(*args, **params))
jax_mlir.register_lowering(_kernel_p, _lowering)


def kernel_call(spec: KernelSpec, direction: str, operands, attrs: CallAttributes, *, dbias: bool = True):
    """Bind one flashgen kernel (`direction` one of contract.DIRECTIONS; operands as
    contract.CALLS[direction] lists them, followed by the operands `attrs.extras` names; a
    dense backward with a bias also returns dbias unless `dbias=False`)."""
    attrs.values(direction)  # ValueError now, not at lowering, for extras the call does not take
    operands = match_varying(*operands)
    with_dbias = bool(dbias) and CALLS[direction].dbias and "bias" in attrs.extras
    return tuple(_kernel_p.bind(*operands, target=spec.target_name(direction),
                                direction=direction, attrs=attrs, dbias=with_dbias))


def _varying(x) -> frozenset:
    mat = getattr(jax.typeof(x), "mat", None)
    return frozenset(getattr(mat, "varying", ()) or ())


def match_varying(*operands):
    """Inside shard_map, make every operand vary over the union of their manual axes
    (a replicated k next to a sequence-split q). Outside, the operands unchanged."""
    varying = frozenset().union(*map(_varying, operands))
    if not varying:
        return operands
    return tuple(x if _varying(x) == varying else
                 jax.lax.pcast(x, tuple(sorted(varying - _varying(x), key=str)), to="varying")
                 for x in operands)


# --------------------------------------------------------------------------------------
# Batching.

def fold_vmap(call, fold: bool = True):
    """Batching rule for a kernel call: fold the vmapped axis into the batch axis (when every
    operand leads with the batch: `fold`), else map the call over it."""
    call = jax.custom_batching.custom_vmap(call)

    @call.def_vmap
    def rule(axis_size, in_batched, *args):
        args = [x if b else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, b in zip(args, in_batched)]
        if not fold:
            outs = jax.lax.map(lambda xs: call(*xs), tuple(args))
            return tuple(outs), (True,) * len(outs)
        outs = call(*(x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in args))
        outs = tuple(y.reshape(axis_size, y.shape[0] // axis_size, *y.shape[1:]) for y in outs)
        return outs, (True,) * len(outs)

    return call


# --------------------------------------------------------------------------------------
# Partitioning: flashgen.jax.sharding's partitioners serve every flashgen call XLA partitions.

register_partitioners()
