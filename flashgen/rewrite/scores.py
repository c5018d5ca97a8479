"""Stage 1: from the Q·K product to the softmax's entry. Walks the scores through layout ops
and asks the score variants (flashgen.rewrite.variants) about every other op; what they recognize is an immutable Scores record that the walk returns.
"""
from __future__ import annotations

from jaxlib.mlir import ir

from flashgen.rewrite.chain import (
    FLOAT_TYPES, MAX_CHAIN, MatchState, back_layout, constant_factor, elt, layout_step,
    reduce_kind, shape_of, widening,
)
from flashgen.rewrite.errors import Reject
from flashgen.rewrite.graph import Ref, op_name
from flashgen.rewrite.variants import SCORE_VARIANTS
from flashgen.rewrite.variants.state import Scores, Step

# which users continue the chain of the scores: layout ops and what a variant may recognize
SCORE_STEPS = {"stablehlo.convert", "stablehlo.transpose", "stablehlo.reshape",
               "stablehlo.broadcast_in_dim", *(op for v in SCORE_VARIANTS for op in v.ops)}


class ScoreWalk:
    """The scores of one match attempt (``m``, the attempt's trace of visited ops and
    values), and the reads the variants share: ``source``, ``independent``, ``uniform``,
    ``predicate_root``."""

    def __init__(self, g, folder, m: MatchState):
        self.g, self.folder, self.m = g, folder, m

    def _forward_step(self, use) -> bool:
        user, idx, ctx = use
        if op_name(user) == "stablehlo.subtract" and idx == 1:
            return False
        return all(self.folder.fold(Ref(x, ctx)) is not None or
                   (not ctx and self.independent(x))
                   for i, x in enumerate(user.operands) if i != idx)

    def walk(self, ref: Ref, layout):
        """(the softmax's entry Ref, its layout, the Scores recognized on the way)."""
        m, found = self.m, Scores()
        for _ in range(MAX_CHAIN):
            m.record(ref, layout, "scores")
            users = list(self.g.users(ref))
            if not users:
                raise Reject("the scores are never used")
            if self._is_softmax_entry(users):
                for variant in SCORE_VARIANTS:
                    variant.finish(found)
                m.notes.extend(found.notes)
                return ref, layout, found
            steps = [u for u in users if op_name(u[0]) in SCORE_STEPS]
            if len(steps) > 1 and self._equal_selects(steps):
                # jax.nn.softmax(where=): one select for the row max, one for the exponent
                twins = [Ref(u[0].results[0], u[2]) for u in steps[1:]]
                for (user, _, ctx), twin in zip(steps[1:], twins):
                    m.add(user, ctx)
                    m.record(twin, layout, "scores")
                steps = steps[:1]
                m.twins[(steps[0][0].results[0], steps[0][2])] = twins
            if len(steps) > 1 and m.training:
                # a backward also reads the scores (e.g. tanh's derivative 1 - t²): the
                # forward step is the one whose other operands do not depend on the scores
                steps = [u for u in steps if self._forward_step(u)]
            if len(steps) != 1:
                if not steps:
                    raise Reject(why_not_softmax(users))
                m.escaped = len(steps) > 1
                raise Reject(f"the scores have {len(users)} users "
                             f"({', '.join(op_name(u[0]) for u in users)})")
            user, idx, ctx = steps[0]
            layout, new = self._step(found, Step(user, idx, ctx, layout))
            m.matched.extend(new.steps[len(found.steps):])
            found = new
            m.add(user, ctx)
            ref = Ref(user.results[0], ctx)
        raise Reject("the chain from the scores to the softmax is too long")

    def _is_softmax_entry(self, users) -> bool:
        for user, idx, ctx in users:
            name = op_name(user)
            if name == "stablehlo.exponential":
                return True
            if name == "stablehlo.reduce" and reduce_kind(user) == "maximum":
                return True
            if name == "stablehlo.subtract" and idx == 0:
                other = Ref(user.operands[1], ctx)
                if self.folder.fold(other) is None:
                    # the row maximum comes from the scores; a run-time bias does not
                    r = self.g.resolve(other)
                    if r.ctx or not self.independent(r.value):
                        return True
        return False

    def _step(self, found: Scores, step: Step):
        """(the layout after ``step``, the Scores after it)."""
        name = op_name(step.op)
        if name == "stablehlo.convert":
            if elt(step.op.result) not in FLOAT_TYPES:
                raise Reject("the scores are converted to a non-float type")
            return step.layout, found
        if name in ("stablehlo.transpose", "stablehlo.reshape", "stablehlo.broadcast_in_dim"):
            return layout_step(step.op, step.layout, what="scores"), found
        for variant in SCORE_VARIANTS:
            new = variant.recognize(self, found, step)
            if new is not None:
                return step.layout, new
        raise Reject(f"the scores pass through {name}")

    def source(self, ref: Ref, layout, *, scale: bool = False, views=None):
        """Walk back from a bias/mask operand through layout ops (and, with ``scale``,
        multiplies by constants). Returns ((value, layout, factor) of the last value seen in
        the site's own function, proven independent of the Q·K product, or None), and
        (Ref, layout, factor) where the walk stopped. ``views``, if given, receives every
        (value, layout, factor) seen in the site's own function, the last one ``best``."""
        best, factor = None, 1.0
        views = [] if views is None else views

        def seen(r):
            if not r.ctx and not (views and views[-1][0] == r.value):
                views.append((r.value, layout, factor))
            return views[-1] if views else None
        r = ref
        for _ in range(MAX_CHAIN):
            best = seen(r)
            r = self.g.resolve(r)
            best = seen(r)
            v = r.value
            if isinstance(v, ir.BlockArgument):
                break
            op = v.owner
            name = op_name(op)
            if name in ("stablehlo.broadcast_in_dim", "stablehlo.transpose", "stablehlo.reshape"):
                back = back_layout(op, layout)
                if back is None:
                    break
                layout, r = back, Ref(op.operands[0], r.ctx)
                continue
            if name == "stablehlo.convert":
                src, dst = elt(op.operands[0]), elt(v)
                if not widening(src, dst):
                    break
                r = Ref(op.operands[0], r.ctx)
                continue
            if scale and name in ("stablehlo.multiply", "stablehlo.divide"):
                found = constant_factor(self.folder, op, r.ctx, positive=False)
                if found is None:
                    break
                i, k, divide = found
                factor = factor / k if divide else factor * k
                r = Ref(op.operands[i], r.ctx)
                continue
            if scale and name == "stablehlo.negate":
                factor, r = -factor, Ref(op.operands[0], r.ctx)
                continue
            break
        if best is not None and not self.independent(best[0]):
            raise Reject("the bias or mask depends on the scores (computed from the Q·K product)")
        return best, (r, layout, factor)

    def independent(self, value) -> bool:
        """Can ``value`` (in the site's function) be computed without the Q·K product? Ops
        before the product in its block (or outside its region) are; others are followed back
        to their operands."""
        dot1 = self.m.dot1.operation
        home = dot1.block
        outer = set()
        o = dot1
        while o.parent is not None and o.parent.name != "func.func":
            o = o.parent
            outer.add(o.block)
        stack, seen = [value], set()
        while stack:
            v = stack.pop()
            if v == self.m.dot1.result:
                return False
            if isinstance(v, ir.BlockArgument):
                continue
            op = v.owner.operation
            key = hash(op)
            if key in seen:
                continue
            seen.add(key)
            if len(seen) > 4096:
                return False
            blk = op.block
            if blk == home:
                if op.is_before_in_block(dot1):
                    continue
            elif blk in outer:
                continue
            stack.extend(op.operands)
        return True

    def _equal_selects(self, steps) -> bool:
        """Are these users of the scores selects of one predicate and one constant fill, with
        the scores on the same side?"""
        keys = set()
        for user, idx, ctx in steps:
            if op_name(user) != "stablehlo.select" or idx == 0:
                return False
            fill = self.folder.fold(Ref(user.operands[3 - idx], ctx))
            if fill is None or not fill.uniform:
                return False
            layout = tuple(() for _ in shape_of(user.results[0]))
            keys.add((self.predicate_root(Ref(user.operands[0], ctx), layout)[0], idx,
                      float(fill.scalar())))
        return len(keys) == 1

    def predicate_root(self, ref: Ref, layout):
        return predicate_root(self.g, ref, layout)

    def uniform(self, ref: Ref, what: str) -> float:
        c = self.folder.fold(ref)
        if c is None:
            raise Reject(f"the {what} is known only at run time")
        if not c.uniform:
            raise Reject(f"the {what} is not a single number (a per-element tensor)")
        return float(c.scalar())



def predicate_root(g, ref: Ref, layout):
    """((value, ctx), layout) of a predicate walked back through calls and layout ops:
    two predicates with the same root and layout select the same entries."""
    r = ref
    for _ in range(MAX_CHAIN):
        r = g.resolve(r)
        if isinstance(r.value, ir.BlockArgument):
            break
        op = r.value.owner
        if op_name(op) not in ("stablehlo.broadcast_in_dim", "stablehlo.reshape",
                               "stablehlo.transpose"):
            break
        back = back_layout(op, layout)
        if back is None:
            break
        layout, r = back, Ref(op.operands[0], r.ctx)
    return (r.value, r.ctx), tuple(layout)


def is_score_mask(g, found: Scores, ref: Ref, layout, negate: bool) -> bool:
    """Is this predicate (keeping where true, or false with ``negate``) the one select
    that masked the scores?"""
    if len(found.fills) != 1 or len(found.score_masks) != 1:
        return False
    return predicate_root(g, ref, layout) + (negate,) == found.score_masks[0]


def why_not_softmax(users) -> str:
    names = [op_name(u[0]) for u in users]
    for name in names:
        if name == "stablehlo.negate" and any(
                op_name(u2) == "stablehlo.exponential"
                for u in users for r in u[0].results for u2, _ in
                [(x.owner, None) for x in r.uses]):
            return "the scores go through exp(-x), a sigmoid, not a softmax (sigmoid attention)"
        if name == "stablehlo.logistic":
            return "the scores go through a sigmoid, not a softmax (sigmoid attention)"
        if name == "stablehlo.dot_general":
            return "no softmax between the two products (linear attention?)"
        if name == "func.return":
            return "the scores are returned; no softmax follows"
    return f"the scores pass through {names[0]} before any softmax"
