"""Stage 1: from the Q·K product to the softmax's entry. Walks the scores through
layout ops, constant scales, a softcap c·tanh(x/c), masks (selects with a large negative
fill) and additive biases, and records each mask and bias term (constant or run time) for
flashgen.rewrite.extras / masks to resolve.
"""
from __future__ import annotations

import numpy as np
from jaxlib.mlir import ir

from flashgen.rewrite import extras as X
from flashgen.rewrite.chain import (
    FLOAT_TYPES, LARGE_NEGATIVE, MAX_CHAIN, WIDTH, MatchState, back_layout, compare_direction,
    constant_factor, elt, layout_step, reduce_kind, shape_of, widening,
)
from flashgen.rewrite.errors import Reject
from flashgen.rewrite.graph import Ref, op_name

# which users continue the chain of the scores
SCORE_STEPS = {"stablehlo.convert", "stablehlo.transpose", "stablehlo.reshape",
               "stablehlo.broadcast_in_dim", "stablehlo.multiply", "stablehlo.divide",
               "stablehlo.select", "stablehlo.add", "stablehlo.subtract", "stablehlo.tanh"}


# compare directions that, with 0 on one side of a nonnegative x, test x != 0 (True) or
# x == 0 (False), indexed by the side x is on; None: no such test (x < 0, 0 > x, ...)
NONZERO_TESTS = {"NE": (True, True), "EQ": (False, False), "GT": (True, None),
                 "LT": (None, True), "LE": (False, None), "GE": (None, False)}


class ScoresStage:
    """Mixin of AttentionPattern: the scores up to the softmax, masks and biases."""

    def _forward_step(self, m: MatchState, use) -> bool:
        user, idx, ctx = use
        if op_name(user) == "stablehlo.subtract" and idx == 1:
            return False
        return all(self.folder.fold(Ref(x, ctx)) is not None or
                   (not ctx and self._independent(m, x))
                   for i, x in enumerate(user.operands) if i != idx)

    def _walk_scores(self, m: MatchState, ref: Ref, layout):
        for _ in range(MAX_CHAIN):
            m.record(ref, layout, "scores")
            users = list(self.g.users(ref))
            if not users:
                raise Reject("the scores are never used")
            if self._is_softmax_entry(m, users):
                if m.tanh and not m.softcap:
                    raise Reject("the scores pass through tanh without a multiply by a constant "
                                 "cap after it (not a softcap c·tanh(x/c))")
                return ref, layout
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
                # a backward also reads the scores (softcap: tanh's derivative 1 - t²): the
                # forward step is the one whose other operands do not depend on the scores
                steps = [u for u in steps if self._forward_step(m, u)]
            if len(steps) != 1:
                if not steps:
                    raise Reject(why_not_softmax(users))
                m.escaped = len(steps) > 1
                raise Reject(f"the scores have {len(users)} users "
                             f"({', '.join(op_name(u[0]) for u in users)})")
            user, idx, ctx = steps[0]
            layout = self._score_step(m, user, idx, ctx, layout)
            m.add(user, ctx)
            ref = Ref(user.results[0], ctx)
        raise Reject("the chain from the scores to the softmax is too long")

    def _is_softmax_entry(self, m: MatchState, users) -> bool:
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
                    if r.ctx or not self._independent(m, r.value):
                        return True
        return False

    def _score_step(self, m: MatchState, user, idx: int, ctx, layout):
        name = op_name(user)
        if name == "stablehlo.convert":
            if elt(user.result) not in FLOAT_TYPES:
                raise Reject("the scores are converted to a non-float type")
            return layout
        if name in ("stablehlo.transpose", "stablehlo.reshape", "stablehlo.broadcast_in_dim"):
            return layout_step(user, layout, what="scores")
        other = Ref(user.operands[1 - idx], ctx) if len(user.operands) == 2 else None
        if name == "stablehlo.tanh":
            if m.tanh:
                raise Reject("the scores pass through tanh twice")
            if m.biases or any(isinstance(x, X.ValueBias) for x in m.extras):
                raise Reject("the scores get an additive bias before the softcap's tanh (the "
                             "kernel caps before adding a bias)")
            if m.masks or m.extras:
                raise Reject("the scores are masked before the softcap's tanh (the kernel caps "
                             "before masking)")
            m.tanh = True
            m.matched.append("softcap tanh")
            return layout
        if m.tanh and name in ("stablehlo.multiply", "stablehlo.divide"):
            if m.softcap or name == "stablehlo.divide":
                raise Reject("the scores are scaled after the softcap's tanh (only c·tanh(x/c) "
                             "is supported)")
            c = self._uniform(other, "softcap")
            if not (c > 0 and np.isfinite(c)):
                raise Reject(f"the softcap {c:g} is not a finite positive number")
            m.softcap = c
            m.matched.append("softcap")
            return layout
        if name == "stablehlo.multiply" or (name == "stablehlo.divide" and idx == 0):
            if self.folder.fold(other) is None:
                return self._runtime_scale(m, other, layout, divide=name == "stablehlo.divide")
            s = self._uniform(other, "scale")
            if s == 0 or not np.isfinite(s):
                raise Reject(f"the scores are scaled by {s}")
            m.scale = m.scale * s if name == "stablehlo.multiply" else m.scale / s
            m.matched.append("scale")
            return layout
        if name in ("stablehlo.select", "stablehlo.add", "stablehlo.subtract") and m.tanh \
                and not m.softcap:
            raise Reject("the scores are masked or biased between the softcap's tanh and its "
                         "multiply by the cap")
        if name == "stablehlo.select" and idx in (1, 2):
            fill = self.folder.fold(Ref(user.operands[3 - idx], ctx))
            if fill is None or not fill.uniform:
                raise Reject("the masked-out fill value is not a constant")
            value = float(fill.scalar())
            if not value <= LARGE_NEGATIVE:
                raise Reject(f"the mask fill value {value:g} is not a large negative number")
            self._mask_terms(m, Ref(user.operands[0], ctx), layout, idx == 2, 0)
            m.fills.append(("select", value, elt(user.result)))
            m.score_masks.append(self._predicate_root(Ref(user.operands[0], ctx), layout) +
                                 (idx == 2,))
            m.matched.append("mask")
            return layout
        if name == "stablehlo.add" or (name == "stablehlo.subtract" and idx == 0):
            m.add_dtype = elt(user.result)
            # a fill already in the scores now has this term added: it must absorb it
            m.fills = [("add", v, dt) for _, v, dt in m.fills]
            self._bias_terms(m, other, layout, -1.0 if name == "stablehlo.subtract" else 1.0, 0)
            m.matched.append("bias")
            return layout
        raise Reject(f"the scores pass through {name}")

    # ------------------------------------------------------------------ masks and biases
    def _mask_terms(self, m: MatchState, ref: Ref, layout, negate: bool, depth: int) -> None:
        """Record a select's predicate (visible where true, or false with ``negate``): constant
        conjuncts as masks, run-time conjuncts as mask / segment-id operands."""
        if depth > MAX_CHAIN:
            raise Reject("the mask expression is too deep to analyse")
        c = self.folder.fold(ref)
        if c is not None:
            m.masks.append((c.map(lambda a: a.astype(bool) != negate), layout, "select"))
            return
        op, r = self.g.producer(ref)
        name = op_name(op) if op is not None else None
        if name == ("stablehlo.or" if negate else "stablehlo.and"):
            for x in op.operands:   # a conjunction (De Morgan under a negation)
                self._mask_terms(m, Ref(x, r.ctx), layout, negate, depth + 1)
            return
        if name == "stablehlo.not":
            return self._mask_terms(m, Ref(op.operands[0], r.ctx), layout, not negate, depth + 1)
        if name == "stablehlo.convert" and elt(op.operands[0]) == elt(op.result) == "i1":  # keras
            return self._mask_terms(m, Ref(op.operands[0], r.ctx), layout, negate, depth + 1)
        if name in ("stablehlo.broadcast_in_dim", "stablehlo.transpose", "stablehlo.reshape"):
            back = back_layout(op, layout)
            if back is not None:
                return self._mask_terms(m, Ref(op.operands[0], r.ctx), back, negate, depth + 1)
        if name == "stablehlo.compare" and compare_direction(op) in NONZERO_TESTS:
            # x != 0 / x == 0 of a boolean converted to numbers (flax's float masks), also
            # x > 0 / x <= 0 (keras' masked Softmax on keras_hub's merged GPT-2 and Gemma
            # masks): the 0/1 numbers _bools_of finds are never negative, so > 0 is != 0
            for i in (0, 1):
                zero = self.folder.fold(Ref(op.operands[1 - i], r.ctx))
                if zero is None or not zero.uniform or float(zero.scalar()) != 0:
                    continue
                found = self._bools_of(Ref(op.operands[i], r.ctx), layout, depth)
                # True when the compare holds exactly where x != 0 (x on side i)
                nonzero = NONZERO_TESTS[compare_direction(op)][i]
                if nonzero is None:
                    continue    # x < 0 or x >= 0 of a nonnegative x: no mask spelled so
                visible_if_true = negate != nonzero
                # a product of several 0/1 numbers is nonzero where all its booleans hold:
                # a conjunction only when "nonzero" means visible
                if found is not None and (len(found) == 1 or visible_if_true):
                    for b, lay in found:
                        self._mask_terms(m, b, lay, not visible_if_true, depth + 1)
                    return
        leaf = self._value_mask(m, ref, layout, negate)
        if name == "stablehlo.compare" and not negate and compare_direction(op) == "EQ" and \
                elt(op.operands[0]).lstrip("u").startswith("i") and elt(op.operands[0]) != "i1":
            sides = [self._source(m, Ref(x, r.ctx), layout)[0] for x in op.operands]
            if all(sd is not None for sd in sides):
                m.extras.append(X.SegmentIds((sides[0][0], sides[0][1]),
                                             (sides[1][0], sides[1][1]), leaf))
                return
        if leaf is None:
            raise Reject("the mask is computed inside a called function from values of that "
                         "function")
        m.extras.append(leaf)
        m.notes.append("run-time mask passed as an operand")

    def _bools_of(self, ref: Ref, layout, depth: int):
        """[(Ref, layout)] of the i1 values whose product ``ref`` is, as numbers: one boolean
        converted to numbers (through layout ops and converts), or the integer ``minimum`` /
        ``multiply`` of such 0/1 numbers (keras_hub merges its causal and padding masks so).
        None otherwise -- e.g. a padding mask given as arbitrary integers, where minimum is
        not a conjunction (a negative entry would show masked keys)."""
        r = ref
        for _ in range(MAX_CHAIN):
            op, r = self.g.producer(r)
            if op is None:
                return None
            name = op_name(op)
            if name in ("stablehlo.broadcast_in_dim", "stablehlo.transpose", "stablehlo.reshape"):
                layout = back_layout(op, layout)
                if layout is None:
                    return None
                r = Ref(op.operands[0], r.ctx)
                continue
            if name == "stablehlo.convert":
                src = elt(op.operands[0])
                if src == "i1":
                    return [(Ref(op.operands[0], r.ctx), layout)]
                if src in WIDTH and elt(op.result) in WIDTH:
                    r = Ref(op.operands[0], r.ctx)
                    continue
            if name in ("stablehlo.minimum", "stablehlo.multiply") and depth < MAX_CHAIN:
                parts = [self._bools_of(Ref(x, r.ctx), layout, depth + 1) for x in op.operands]
                if any(p is None for p in parts):
                    return None
                return [b for p in parts for b in p]
            return None
        return None

    def _value_mask(self, m: MatchState, ref: Ref, layout, negate: bool):
        found, _ = self._source(m, ref, layout)
        if found is None:
            return None
        value, lay, _ = found
        return X.ValueMask(value, lay, negate)

    def _bias_terms(self, m: MatchState, ref: Ref, layout, factor: float, depth: int) -> None:
        """Record what is added to the scores (times ``factor``): constant terms, masks spelled
        as 0 / -inf biases, run-time terms."""
        if depth > MAX_CHAIN:
            raise Reject("the additive bias expression is too deep to analyse")
        c = self.folder.fold(ref)
        if c is not None:
            # elementwise through Const.map: a band built from positions stays O(Sq + Sk)
            with np.errstate(invalid="ignore"):  # a NaN constant is refused just below
                b = c.map(lambda a: a.astype(np.float64) * factor)
            if b.map(np.isnan).any():  # found by tests/test_fuzz.py (mutated_numerics)
                raise Reject("a constant bias holds NaN: the original's rows there are NaN, "
                             "a kernel mask would hide it")
            if b.map(lambda a: a <= LARGE_NEGATIVE).any():
                m.masks.append((b.map(lambda a: a > LARGE_NEGATIVE), layout, "bias"))
                el = b.elements()
                m.fills += [("add", float(f), m.add_dtype)
                            for f in np.unique(el[el <= LARGE_NEGATIVE])]
                b = b.map(lambda a: np.where(a <= LARGE_NEGATIVE, 0.0, a))
            if b.map(lambda a: a != 0).any():
                m.biases.append(X.ConstBias(b, layout, 1.0, m.scale))
            return
        views = []
        found, (r, lay, f) = self._source(m, ref, layout, scale=True, views=views)
        op = None if isinstance(r.value, ir.BlockArgument) else r.value.owner
        name = op_name(op) if op is not None else None
        f *= factor
        if name in ("stablehlo.add", "stablehlo.subtract") and f == 1.0:
            # a sum of terms (e.g. ALiBi + a padding bias): each one on its own
            self._bias_terms(m, Ref(op.operands[0], r.ctx), lay, 1.0, depth + 1)
            self._bias_terms(m, Ref(op.operands[1], r.ctx), lay,
                             -1.0 if name == "stablehlo.subtract" else 1.0, depth + 1)
            return
        if name == "stablehlo.select":
            a = self.folder.fold(Ref(op.operands[1], r.ctx))
            b = self.folder.fold(Ref(op.operands[2], r.ctx))
            if a is not None and b is not None and a.uniform and b.uniform:
                va, vb = float(a.scalar()) * f, float(b.scalar()) * f
                if va == 0 and vb <= LARGE_NEGATIVE:    # where(p, 0, -inf): visible = p
                    m.fills.append(("add", vb, m.add_dtype))
                    return self._mask_terms(m, Ref(op.operands[0], r.ctx), lay, False, depth + 1)
                if vb == 0 and va <= LARGE_NEGATIVE:
                    m.fills.append(("add", va, m.add_dtype))
                    return self._mask_terms(m, Ref(op.operands[0], r.ctx), lay, True, depth + 1)
        if found is None:
            raise Reject("the additive bias is computed inside a called function from values "
                         "of that function")
        value, lay, f = found
        m.extras.append(X.ValueBias(value, lay, f * factor, m.scale,
                                    tuple((v, vl, vf * factor) for v, vl, vf in views)))
        m.notes.append("run-time additive bias passed as an operand")

    def _source(self, m: MatchState, ref: Ref, layout, *, scale: bool = False, views=None):
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
        if best is not None and not self._independent(m, best[0]):
            raise Reject("the bias or mask depends on the scores (computed from the Q·K product)")
        return best, (r, layout, factor)

    def _independent(self, m: MatchState, value) -> bool:
        """Can ``value`` (in the site's function) be computed without the Q·K product? Ops
        before the product in its block (or outside its region) are; others are followed back
        to their operands."""
        dot1 = m.dot1.operation
        home = dot1.block
        outer = set()
        o = dot1
        while o.parent is not None and o.parent.name != "func.func":
            o = o.parent
            outer.add(o.block)
        stack, seen = [value], set()
        while stack:
            v = stack.pop()
            if v == m.dot1.result:
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
            keys.add((self._predicate_root(Ref(user.operands[0], ctx), layout)[0], idx,
                      float(fill.scalar())))
        return len(keys) == 1

    def _predicate_root(self, ref: Ref, layout):
        """((value, ctx), layout) of a predicate walked back through calls and layout ops:
        two predicates with the same root and layout select the same entries."""
        r = ref
        for _ in range(MAX_CHAIN):
            r = self.g.resolve(r)
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

    def _is_score_mask(self, m: MatchState, ref: Ref, layout, negate: bool) -> bool:
        """Is this predicate (keeping where true, or false with ``negate``) the one select
        that masked the scores?"""
        if len(m.fills) != 1 or len(m.score_masks) != 1:
            return False
        return self._predicate_root(ref, layout) + (negate,) == m.score_masks[0]

    def _runtime_scale(self, m: MatchState, ref: Ref, layout, *, divide: bool):
        """A scale known only at run time: a scalar of the site's function, folded into Q when
        the site is rewritten (the kernel's scale keeps the constant part)."""
        if m.masks or m.extras or m.biases or m.tanh:
            # a fill, bias or cap already in the scores would be scaled too (and a negative
            # scale would unmask the fill)
            raise Reject("the scores are scaled by a value known only at run time after a mask, "
                         "bias or softcap")
        found, _ = self._source(m, ref, layout)
        if found is None or any(n != 1 for n in shape_of(found[0])) or \
                elt(found[0]) not in FLOAT_TYPES:
            raise Reject("the scale is known only at run time and is not a scalar of the "
                         "function")
        m.runtime_scales.append((found[0], divide))
        m.matched.append("run-time scale")
        m.notes.append("run-time scale folded into Q (the kernel's scale is the constant part)")
        return layout

    def _uniform(self, ref: Ref, what: str) -> float:
        c = self.folder.fold(ref)
        if c is None:
            raise Reject(f"the {what} is known only at run time")
        if not c.uniform:
            raise Reject(f"the {what} is not a single number (a per-element tensor)")
        return float(c.scalar())


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
