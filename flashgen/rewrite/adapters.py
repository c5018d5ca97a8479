"""Reshape/transpose/convert a site's tensors to and from the kernel's [B, S, H, D].

Both sides are described by layout pieces (flashgen.rewrite.layout); the adapter
reshapes to the finest pieces only when a transpose is needed, permutes, and
reshapes to the target. Every op created is appended to ``created`` so that a
failed rewrite can erase what it inserted.
"""
from __future__ import annotations

from math import prod

import numpy as np

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

from flashgen.rewrite import layout as L


def reshape(x: ir.Value, shape, created) -> ir.Value:
    t = ir.RankedTensorType.get(list(shape), x.type.element_type)
    op = stablehlo.ReshapeOp(t, x)
    created.append(op)
    return op.result


def convert(x: ir.Value, elt, created) -> ir.Value:
    t = ir.RankedTensorType.get(list(x.type.shape), elt)
    op = stablehlo.ConvertOp(t, x)
    created.append(op)
    return op.result


def adapt(value: ir.Value, src, dst, created, final_shape=None, dynamic=None) -> ir.Value:
    """Reshape/transpose ``value`` (dims ``src``) into dims ``dst`` (same pieces).

    ``dynamic`` (flashgen.rewrite.polymorphic.SymbolicSizes): some pieces have sizes known
    only at run time; reshapes are then decided by the pieces each dim holds (two dynamic
    dims print alike in the type) and built as dynamic_reshape where needed."""
    cuts = L.boundaries([src, dst])
    src, dst = L.refine(src, cuts), L.refine(dst, cuts)
    fine_src = L.pieces(src)
    fine_dst = L.pieces(dst)
    x, dims = value, list(src)
    perm = [fine_src.index(p) for p in fine_dst]
    if perm != list(range(len(perm))):
        x, dims = _regroup(x, dims, [(p,) for p in fine_src], created, dynamic)
        op = stablehlo.TransposeOp(x, perm)
        created.append(op)
        x, dims = op.result, [(p,) for p in fine_dst]
    if final_shape is not None and dynamic is None:
        return x if list(x.type.shape) == list(final_shape) else reshape(x, final_shape, created)
    return _regroup(x, dims, list(dst), created, dynamic)[0]


def _regroup(x: ir.Value, dims, target, created, dynamic):
    """``x`` (whose dims hold ``dims``) reshaped to hold ``target``; (value, target)."""
    if dynamic is not None:
        same = [tuple(d) for d in dims] == [tuple(d) for d in target]
        return (x if same else dynamic.reshape(x, target, created)), target
    shape = [prod(p[2] for p in d) for d in target]
    return (x if list(x.type.shape) == shape else reshape(x, shape, created)), target


# ----------------------------------------------------------------------------- extra operands
def target_recipe(src_layout, groups):
    """How to bring a tensor whose dims hold ``src_layout`` (refined pieces; () = a size-1,
    broadcast dim) into one dim per group. ``groups``: [(pieces, full)]; a group is kept at
    its full size when ``full`` or when the tensor holds any of its pieces, else it is 1.

    Returns (fine, perm, target, bdims, final): the tensor's pieces in order, the transpose
    that orders them as in the target, the target's pieces, where each of the tensor's
    (permuted) pieces goes among them, and the final shape. ValueError if the tensor holds a
    piece that no group has.
    """
    fine = L.pieces(src_layout)
    present = set(fine)
    target, final = [], []
    for pcs, full in groups:
        if full or any(p in present for p in pcs):
            target += list(pcs)
            final.append(prod(p[2] for p in pcs))
        else:
            final.append(1)
    missing = [p for p in fine if p not in target]
    if missing:
        raise ValueError(f"pieces {missing} have no place in the kernel operand")
    perm = sorted(range(len(fine)), key=lambda i: target.index(fine[i]))
    ordered = [fine[i] for i in perm]
    bdims = [target.index(p) for p in ordered]
    return fine, perm, target, bdims, final


def np_to_kernel(arr, layout, groups) -> np.ndarray:
    """A compact constant (each dim full or 1) whose dims hold ``layout`` (refined pieces),
    as one dim per group (target_recipe)."""
    arr = np.asarray(arr)
    lay = tuple(d if arr.shape[i] != 1 else () for i, d in enumerate(layout))
    fine, perm, target, bdims, final = target_recipe(lay, groups)
    x = arr.reshape([p[2] for p in fine])
    x = np.transpose(x, perm)
    expanded = [1] * len(target)
    for i, d in enumerate(bdims):
        expanded[d] = target[d][2]
    x = x.reshape(expanded)
    x = np.broadcast_to(x, [p[2] for p in target])
    return np.ascontiguousarray(x.reshape(final))


def to_kernel(value: ir.Value, layout, groups, created, dynamic=None) -> ir.Value:
    """The MLIR counterpart of np_to_kernel for a value whose dims hold ``layout`` exactly
    (size-1 dims hold no piece). ``dynamic``: as for adapt()."""
    fine, perm, target, bdims, final = target_recipe(layout, groups)
    if dynamic is not None:
        return _to_kernel_dynamic(value, layout, groups, (fine, perm, target, bdims), created,
                                  dynamic)
    x = value
    whole = [tuple(pcs) for pcs, _ in groups]
    if len(layout) == len(groups) and all(not d or tuple(d) == whole[i]
                                          for i, d in enumerate(layout)):
        # already one dim per group (size 1 where broadcast): at most one broadcast_in_dim
        return broadcast_to(x, final, created)
    kept = [d for d in layout if d]
    if all(tuple(d) in whole for d in kept):
        gidx = [whole.index(tuple(d)) for d in kept]
        if gidx == sorted(set(gidx)):
            squeezed = [final[g] for g in gidx]
            if list(x.type.shape) != squeezed:
                x = reshape(x, squeezed, created)
            if squeezed != list(final):
                x = broadcast(x, final, gidx, created)
            return x
    fine_shape = [p[2] for p in fine]
    if list(x.type.shape) != fine_shape:
        x = reshape(x, fine_shape, created)
    if perm != list(range(len(perm))):
        op = stablehlo.TransposeOp(x, perm)
        created.append(op)
        x = op.result
    tshape = [p[2] for p in target]
    if list(x.type.shape) != tshape:
        x = broadcast(x, tshape, bdims, created)
    if list(x.type.shape) != list(final):
        x = reshape(x, final, created)
    return x


def _to_kernel_dynamic(value, layout, groups, recipe, created, dynamic) -> ir.Value:
    """to_kernel with the reshapes and broadcasts decided by pieces (dynamic sizes print
    alike): regroup to single pieces, permute, broadcast the missing pieces, regroup."""
    fine, perm, target, bdims = recipe
    kept = [tuple(pcs) if full or set(pcs) & set(fine) else () for pcs, full in groups]
    if [tuple(d) for d in layout] == kept:
        return value
    x, _ = _regroup(value, [tuple(d) for d in layout], [(p,) for p in fine], created, dynamic)
    if perm != list(range(len(perm))):
        op = stablehlo.TransposeOp(x, perm)
        created.append(op)
        x = op.result
    if len(target) > len(fine):
        x = dynamic.broadcast(x, [(p,) for p in target], bdims, created)
    return _regroup(x, [(p,) for p in target], kept, created, dynamic)[0]


def from_kernel(x: ir.Value, layout, groups, shape, created) -> ir.Value:
    """The transpose of to_kernel: a kernel-form gradient (one dim per group) back to a value
    of ``shape`` whose dims hold ``layout``, summed over the dims to_kernel broadcast."""
    fine, perm, target, bdims, _ = target_recipe(layout, groups)
    tshape = [p[2] for p in target]
    if list(x.type.shape) != tshape:
        x = reshape(x, tshape, created)
    summed = [d for d in range(len(target)) if d not in bdims]
    if summed:
        x = sum_dims(x, summed, created)
    # what remains holds the value's pieces in target order: fine[perm[i]] at dim i
    inverse = [perm.index(i) for i in range(len(perm))]
    if inverse != list(range(len(inverse))):
        op = stablehlo.TransposeOp(x, inverse)
        created.append(op)
        x = op.result
    if list(x.type.shape) != list(shape):
        x = reshape(x, shape, created)
    return x


# ----------------------------------------------------------------------------- head dim
def pad_head_dim(x: ir.Value, head_dim: int, created) -> ir.Value:
    """A kernel-layout operand with zero columns appended to its last (head) dim up to the
    kernel's ``head_dim``: they add nothing to Q·Kᵀ and give zero output columns."""
    extra = head_dim - x.type.shape[-1]
    if not extra:
        return x
    elt = x.type.element_type
    rank = len(x.type.shape)
    op = stablehlo.PadOp(x, scalar(ir.FloatAttr.get(elt, 0.0), elt, created), [0] * rank,
                         [0] * (rank - 1) + [extra], [0] * rank)
    created.append(op)
    return op.result


def slice_head_dim(x: ir.Value, head_dim: int, created) -> ir.Value:
    """The first ``head_dim`` columns of a kernel-layout result (pad_head_dim's inverse)."""
    shape = list(x.type.shape)
    if shape[-1] == head_dim:
        return x
    op = stablehlo.SliceOp(x, [0] * len(shape), shape[:-1] + [head_dim], [1] * len(shape))
    created.append(op)
    return op.result


def broadcast(x: ir.Value, shape, dims, created) -> ir.Value:
    t = ir.RankedTensorType.get(list(shape), x.type.element_type)
    op = stablehlo.BroadcastInDimOp(t, x, list(dims))
    created.append(op)
    return op.result


def broadcast_to(x: ir.Value, shape, created) -> ir.Value:
    """Same rank, size-1 dims expanded."""
    if list(x.type.shape) == list(shape):
        return x
    return broadcast(x, shape, range(len(shape)), created)


def reduce(x: ir.Value, init: ir.Value, body_op, dims, created) -> ir.Value:
    """Reduce ``dims`` of ``x`` with ``body_op`` (a stablehlo op class, e.g. AddOp)."""
    elt = x.type.element_type
    shape = [n for i, n in enumerate(x.type.shape) if i not in dims]
    op = stablehlo.ReduceOp([ir.RankedTensorType.get(shape, elt)], [x], [init], list(dims))
    scalar_t = ir.RankedTensorType.get([], elt)
    block = op.regions[0].blocks.append(scalar_t, scalar_t)
    with ir.InsertionPoint(block):
        stablehlo.ReturnOp([body_op(block.arguments[0], block.arguments[1]).result])
    created.append(op)
    return op.result


def scalar(attr, elt, created) -> ir.Value:
    # constant() makes arrays of rank >= 1; a reduction's init value is rank 0
    t = ir.RankedTensorType.get([], elt)
    op = stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(t, attr))
    created.append(op)
    return op.result


def sum_dims(x: ir.Value, dims, created) -> ir.Value:
    """The sum of ``x`` (a float tensor) over ``dims``."""
    elt = x.type.element_type
    return reduce(x, scalar(ir.FloatAttr.get(elt, 0.0), elt, created), stablehlo.AddOp, dims,
                  created)


def constant(array: np.ndarray, elt, created) -> ir.Value:
    array = np.asarray(array)
    array = np.ascontiguousarray(array).reshape(array.shape)  # ascontiguousarray makes a 0-d array 1-d
    t = ir.RankedTensorType.get(list(array.shape), elt)
    if array.size and (array == array.reshape(-1)[0]).all():
        x = array.reshape(-1)[0]
        if array.dtype == np.bool_:
            scalar = ir.BoolAttr.get(bool(x))
        elif np.issubdtype(array.dtype, np.integer):
            scalar = ir.IntegerAttr.get(elt, int(x))
        else:
            scalar = ir.FloatAttr.get(elt, float(x))
        attr = ir.DenseElementsAttr.get_splat(t, scalar)
    else:
        attr = ir.DenseElementsAttr.get(array, type=t)
    op = stablehlo.ConstantOp(attr)
    created.append(op)
    return op.result


def scale_by_scalar(x: ir.Value, scalar: ir.Value, divide: bool, created, dynamic=None,
                    dims=()) -> ir.Value:
    """x * s (x / s) for a one-element tensor s, computed in f32 and converted back.
    ``dynamic`` (as for adapt()): ``x``'s dims hold the pieces ``dims``."""
    f32 = ir.F32Type.get()
    s = reshape(scalar, [], created) if list(scalar.type.shape) else scalar
    if s.type.element_type != f32:
        s = convert(s, f32, created)
    s = broadcast(s, x.type.shape, [], created) if dynamic is None else \
        dynamic.broadcast(s, dims, [], created)
    y = x if x.type.element_type == f32 else convert(x, f32, created)
    op = (stablehlo.DivOp if divide else stablehlo.MulOp)(y, s)
    created.append(op)
    y = op.result
    return y if x.type.element_type == f32 else convert(y, x.type.element_type, created)


def binary(kind: str, a: ir.Value, b: ir.Value, created) -> ir.Value:
    cls = {"add": stablehlo.AddOp, "and": stablehlo.AndOp, "multiply": stablehlo.MulOp,
           "divide": stablehlo.DivOp, "subtract": stablehlo.SubtractOp}[kind]
    op = cls(a, b)
    created.append(op)
    return op.result


def logical_not(x: ir.Value, created) -> ir.Value:
    op = stablehlo.NotOp(x)
    created.append(op)
    return op.result
