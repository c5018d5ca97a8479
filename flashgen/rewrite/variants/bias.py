"""Additive biases: what is added to (or subtracted from) the scores, split into its terms.
Constant terms are recorded as a constant bias (ALiBi slopes or a ``bias`` operand when the
site is resolved, flashgen.rewrite.extras), their large negative entries as masks;
``where(p, 0, -inf)`` terms as masks (flashgen.rewrite.variants.mask); other run-time terms
as a ``bias`` operand.
"""
from __future__ import annotations

import numpy as np
from jaxlib.mlir import ir

from flashgen.rewrite import extras as X
from flashgen.rewrite.chain import LARGE_NEGATIVE, MAX_CHAIN, elt
from flashgen.rewrite.errors import Reject
from flashgen.rewrite.graph import Ref, op_name
from flashgen.rewrite.variants.mask import mask_terms
from flashgen.rewrite.variants.state import BinaryVariant, Scores, Step


class Bias(BinaryVariant):
    name, either, lhs = "bias", "stablehlo.add", "stablehlo.subtract"

    def on_binary(self, walk, found: Scores, step: Step) -> Scores:
        # a fill already in the scores now has this term added: it must absorb it
        found = found.but(add_dtype=elt(step.op.result),
                          fills=tuple(("add", v, dt) for _, v, dt in found.fills))
        found = bias_terms(walk, found, step.other, step.layout,
                           -1.0 if step.name == "stablehlo.subtract" else 1.0, 0)
        return found.plus(step="bias")


def bias_terms(walk, found: Scores, ref: Ref, layout, factor: float, depth: int) -> Scores:
    """``found`` with what is added to the scores (times ``factor``) recorded: constant
    terms, masks spelled as 0 / -inf biases, run-time terms."""
    if depth > MAX_CHAIN:
        raise Reject("the additive bias expression is too deep to analyse")
    c = walk.folder.fold(ref)
    if c is not None:
        # elementwise through Const.map: a band built from positions stays O(Sq + Sk)
        with np.errstate(invalid="ignore"):  # a NaN constant is refused just below
            b = c.map(lambda a: a.astype(np.float64) * factor)
        if b.map(np.isnan).any():  # found by tests/test_fuzz.py (mutated_numerics)
            raise Reject("a constant bias holds NaN: the original's rows there are NaN, "
                         "a kernel mask would hide it")
        if b.map(lambda a: a <= LARGE_NEGATIVE).any():
            el = b.elements()
            found = found.plus(masks=[(b.map(lambda a: a > LARGE_NEGATIVE), layout, "bias")],
                               fills=[("add", float(f), found.add_dtype)
                                      for f in np.unique(el[el <= LARGE_NEGATIVE])])
            b = b.map(lambda a: np.where(a <= LARGE_NEGATIVE, 0.0, a))
        if b.map(lambda a: a != 0).any():
            found = found.plus(biases=[X.ConstBias(b, layout, 1.0, found.scale)])
        return found
    views = []
    source, (r, lay, f) = walk.source(ref, layout, scale=True, views=views)
    op = None if isinstance(r.value, ir.BlockArgument) else r.value.owner
    name = op_name(op) if op is not None else None
    f *= factor
    if name in ("stablehlo.add", "stablehlo.subtract") and f == 1.0:
        # a sum of terms (e.g. ALiBi + a padding bias): each one on its own
        found = bias_terms(walk, found, Ref(op.operands[0], r.ctx), lay, 1.0, depth + 1)
        return bias_terms(walk, found, Ref(op.operands[1], r.ctx), lay,
                          -1.0 if name == "stablehlo.subtract" else 1.0, depth + 1)
    if name == "stablehlo.select":
        a = walk.folder.fold(Ref(op.operands[1], r.ctx))
        b = walk.folder.fold(Ref(op.operands[2], r.ctx))
        if a is not None and b is not None and a.uniform and b.uniform:
            va, vb = float(a.scalar()) * f, float(b.scalar()) * f
            if va == 0 and vb <= LARGE_NEGATIVE:    # where(p, 0, -inf): visible = p
                found = found.plus(fills=[("add", vb, found.add_dtype)])
                return mask_terms(walk, found, Ref(op.operands[0], r.ctx), lay, False, depth + 1)
            if vb == 0 and va <= LARGE_NEGATIVE:
                found = found.plus(fills=[("add", va, found.add_dtype)])
                return mask_terms(walk, found, Ref(op.operands[0], r.ctx), lay, True, depth + 1)
        for fill, other, negate in ((a, 2, True), (b, 1, False)):
            if fill is not None and fill.uniform and float(fill.scalar()) * f <= LARGE_NEGATIVE:
                # where(p, -inf, x) (torch's masked_fill of a bias: Falcon's ALiBi with its
                # causal and padding masks): the mask, and x on the entries it leaves visible
                found = found.plus(fills=[("add", float(fill.scalar()) * f, found.add_dtype)])
                found = mask_terms(walk, found, Ref(op.operands[0], r.ctx), lay, negate,
                                   depth + 1)
                return bias_terms(walk, found, Ref(op.operands[other], r.ctx), lay, f,
                                  depth + 1)
    if source is None:
        raise Reject("the additive bias is computed inside a called function from values "
                     "of that function")
    value, lay, f = source
    return found.plus(extras=[X.ValueBias(value, lay, f * factor, found.scale,
                                          tuple((v, vl, vf * factor) for v, vl, vf in views))],
                      note="run-time additive bias passed as an operand")
