"""Reshape/transpose/convert a site's tensors to and from the kernel's [B, S, H, D].

Both sides are described by layout pieces (flashgen.rewrite.layout); the adapter
reshapes to the finest pieces only when a transpose is needed, permutes, and
reshapes to the target. Every op created is appended to ``created`` so that a
failed rewrite can erase what it inserted.
"""
from __future__ import annotations

from math import prod

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


def adapt(value: ir.Value, src, dst, created, final_shape=None) -> ir.Value:
    """Reshape/transpose ``value`` (dims ``src``) into dims ``dst`` (same pieces)."""
    cuts = L.boundaries([src, dst])
    src, dst = L.refine(src, cuts), L.refine(dst, cuts)
    fine_src = L.pieces(src)
    fine_dst = L.pieces(dst)
    x = value
    perm = [fine_src.index(p) for p in fine_dst]
    target = list(final_shape) if final_shape is not None else \
        [prod(p[2] for p in d) for d in dst]
    if perm != list(range(len(perm))):
        fine_shape = [p[2] for p in fine_src]
        if fine_shape != list(x.type.shape):
            x = reshape(x, fine_shape, created)
        op = stablehlo.TransposeOp(x, perm)
        created.append(op)
        x = op.result
    if list(x.type.shape) != target:
        x = reshape(x, target, created)
    return x
