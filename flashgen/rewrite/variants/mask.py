"""Masks: a select of the scores against a large negative fill. Its predicate is split into
AND-ed conjuncts: constant ones are recorded as visibility arrays (a causal / window band
becomes attributes, flashgen.rewrite.variants.bands; the rest a constant ``mask`` operand),
run-time ones as a ``mask`` operand, or ``segment_ids`` where integer ids along the queries
are compared with ids along the keys.
"""
from __future__ import annotations

from flashgen.rewrite import extras as X
from flashgen.rewrite.chain import (
    LARGE_NEGATIVE, MAX_CHAIN, WIDTH, back_layout, compare_direction, elt,
)
from flashgen.rewrite.errors import Reject
from flashgen.rewrite.fold import compare
from flashgen.rewrite.graph import Ref, op_name
from flashgen.rewrite.variants.state import Scores, ScoreVariant, Step

# compare directions that, with 0 on one side of a nonnegative x, test x != 0 (True) or
# x == 0 (False), indexed by the side x is on; None: no such test (x < 0, 0 > x, ...)
NONZERO_TESTS = {"NE": (True, True), "EQ": (False, False), "GT": (True, None),
                 "LT": (None, True), "LE": (False, None), "GE": (None, False)}


class Mask(ScoreVariant):
    name = "mask"
    ops = ("stablehlo.select",)

    def recognize(self, walk, found: Scores, step: Step) -> Scores | None:
        user, idx, ctx, layout = step
        if op_name(user) != "stablehlo.select" or idx not in (1, 2):
            return None
        fill = walk.folder.fold(Ref(user.operands[3 - idx], ctx))
        if fill is None or not fill.uniform:
            raise Reject("the masked-out fill value is not a constant")
        value = float(fill.scalar())
        if not value <= LARGE_NEGATIVE:
            raise Reject(f"the mask fill value {value:g} is not a large negative number")
        found = mask_terms(walk, found, Ref(user.operands[0], ctx), layout, idx == 2, 0)
        root = walk.predicate_root(Ref(user.operands[0], ctx), layout) + (idx == 2,)
        return found.plus(step="mask", fills=[("select", value, elt(user.result))],
                          score_masks=[root])


def mask_terms(walk, found: Scores, ref: Ref, layout, negate: bool, depth: int) -> Scores:
    """``found`` with a predicate recorded (visible where true, or false with ``negate``):
    constant conjuncts as masks, run-time conjuncts as mask / segment-id operands."""
    if depth > MAX_CHAIN:
        raise Reject("the mask expression is too deep to analyse")
    c = walk.folder.fold(ref)
    if c is not None:
        return found.plus(masks=[(c.map(lambda a: a.astype(bool) != negate), layout, "select")])
    op, r = walk.g.producer(ref)
    name = op_name(op) if op is not None else None
    if name == ("stablehlo.or" if negate else "stablehlo.and"):
        for x in op.operands:   # a conjunction (De Morgan under a negation)
            found = mask_terms(walk, found, Ref(x, r.ctx), layout, negate, depth + 1)
        return found
    if name == "stablehlo.not":
        return mask_terms(walk, found, Ref(op.operands[0], r.ctx), layout, not negate, depth + 1)
    if name == "stablehlo.convert" and elt(op.operands[0]) == elt(op.result) == "i1":  # keras
        return mask_terms(walk, found, Ref(op.operands[0], r.ctx), layout, negate, depth + 1)
    if name in ("stablehlo.broadcast_in_dim", "stablehlo.transpose", "stablehlo.reshape"):
        back = back_layout(op, layout)
        if back is not None:
            return mask_terms(walk, found, Ref(op.operands[0], r.ctx), back, negate, depth + 1)
    if name == "stablehlo.compare" and compare_direction(op) in NONZERO_TESTS:
        # x != 0 / x == 0 of a boolean converted to numbers (flax's float masks), also
        # x > 0 / x <= 0 (keras' masked Softmax on keras_hub's merged GPT-2 and Gemma
        # masks): the 0/1 numbers _bools_of finds are never negative, so > 0 is != 0
        for i in (0, 1):
            zero = walk.folder.fold(Ref(op.operands[1 - i], r.ctx))
            if zero is None or not zero.uniform or float(zero.scalar()) != 0:
                continue
            bools = _bools_of(walk, Ref(op.operands[i], r.ctx), layout, depth)
            # True when the compare holds exactly where x != 0 (x on side i)
            nonzero = NONZERO_TESTS[compare_direction(op)][i]
            if nonzero is None:
                continue    # x < 0 or x >= 0 of a nonnegative x: no mask spelled so
            visible_if_true = negate != nonzero
            # a product of several 0/1 numbers is nonzero where all its booleans hold:
            # a conjunction only when "nonzero" means visible
            if bools is not None and (len(bools) == 1 or visible_if_true):
                for b, lay in bools:
                    found = mask_terms(walk, found, b, lay, not visible_if_true, depth + 1)
                return found
    if name == "stablehlo.compare":
        for i in (0, 1):
            # where(p, 0, -inf) < -1 (Falcon's masked_fill of its ALiBi by its float mask):
            # a compare of a select of two constants is p, or not p
            c = walk.folder.fold(Ref(op.operands[1 - i], r.ctx))
            sel = _select_of_constants(walk, Ref(op.operands[i], r.ctx), layout) \
                if c is not None and c.uniform else None
            if sel is None:
                continue
            pred, lay, branches = sel
            holds = [bool(compare(compare_direction(op), *((x, c.scalar()) if i == 0
                                                          else (c.scalar(), x))))
                     for x in branches]
            if holds[0] != holds[1]:
                return mask_terms(walk, found, pred, lay, negate != (not holds[0]), depth + 1)
    leaf = _value_mask(walk, ref, layout, negate)
    if name == "stablehlo.compare" and not negate and compare_direction(op) == "EQ" and \
            elt(op.operands[0]).lstrip("u").startswith("i") and elt(op.operands[0]) != "i1":
        sides = [walk.source(Ref(x, r.ctx), layout)[0] for x in op.operands]
        if all(sd is not None for sd in sides):
            return found.plus(extras=[X.SegmentIds((sides[0][0], sides[0][1]),
                                                   (sides[1][0], sides[1][1]), leaf)])
    if leaf is None:
        raise Reject("the mask is computed inside a called function from values of that "
                     "function")
    return found.plus(extras=[leaf], note="run-time mask passed as an operand")


def _bools_of(walk, ref: Ref, layout, depth: int):
    """[(Ref, layout)] of the i1 values whose product ``ref`` is, as numbers: one boolean
    converted to numbers (through layout ops and converts), or the integer ``minimum`` /
    ``multiply`` of such 0/1 numbers (keras_hub merges its causal and padding masks so).
    None otherwise -- e.g. a padding mask given as arbitrary integers, where minimum is
    not a conjunction (a negative entry would show masked keys)."""
    r = ref
    for _ in range(MAX_CHAIN):
        op, r, layout = _behind_layout_ops(walk, r, layout)
        if op is None:
            return None
        name = op_name(op)
        if name == "stablehlo.convert":
            src = elt(op.operands[0])
            if src == "i1":
                return [(Ref(op.operands[0], r.ctx), layout)]
            if src in WIDTH and elt(op.result) in WIDTH:
                r = Ref(op.operands[0], r.ctx)
                continue
        if name in ("stablehlo.minimum", "stablehlo.multiply") and depth < MAX_CHAIN:
            parts = [_bools_of(walk, Ref(x, r.ctx), layout, depth + 1) for x in op.operands]
            if any(p is None for p in parts):
                return None
            return [b for p in parts for b in p]
        return None
    return None


def _select_of_constants(walk, ref: Ref, layout):
    """(predicate Ref, its layout, (on-true, on-false) scalars) when ``ref`` is, through
    layout ops, a select between two uniform constants; else None."""
    op, r, layout = _behind_layout_ops(walk, ref, layout)
    if op is None or op_name(op) != "stablehlo.select" or \
            op.operands[0].type.shape != op.result.type.shape:  # not a scalar predicate
        return None
    branches = [walk.folder.fold(Ref(x, r.ctx)) for x in op.operands[1:]]
    if any(b is None or not b.uniform for b in branches):
        return None
    return Ref(op.operands[0], r.ctx), layout, tuple(b.scalar() for b in branches)


def _behind_layout_ops(walk, ref: Ref, layout):
    """(op, its result Ref, layout there) of the first producer of ``ref`` that is no
    broadcast / transpose / reshape; op None when there is none or a layout is lost."""
    r = ref
    for _ in range(MAX_CHAIN):
        op, r = walk.g.producer(r)
        if op is None or op_name(op) not in ("stablehlo.broadcast_in_dim",
                                             "stablehlo.transpose", "stablehlo.reshape"):
            return op, r, layout
        layout = back_layout(op, layout)
        if layout is None:
            return None, r, layout
        r = Ref(op.operands[0], r.ctx)
    return None, r, layout


def _value_mask(walk, ref: Ref, layout, negate: bool):
    found, _ = walk.source(ref, layout)
    if found is None:
        return None
    value, lay, _ = found
    return X.ValueMask(value, lay, negate)
