"""Stage 2: the softmax. Finds exp(x - rowconst) / rowsum over the key axes R, in any
spelling of the row max, the sum and its reciprocal, and reports R.
"""
from __future__ import annotations

import numpy as np
from jaxlib.mlir import ir

from flashgen.rewrite import layout as L
from flashgen.rewrite.chain import (
    ELEMENTWISE, FLOAT_TYPES, MAX_CHAIN, MatchState, Term, elt, ints, layout_step,
    merge_layouts, reduce_kind, shape_of,
)
from flashgen.rewrite.errors import Reject
from flashgen.rewrite.graph import Ref, op_name
from flashgen.rewrite.scores import is_score_mask
from flashgen.rewrite.variants.state import Scores


class SoftmaxStage:
    """The softmax and its row statistics, for one match attempt (the trace ``m`` passed to
    each method); ``scores`` is what the score walk recognized (its mask, for a masked sum)."""

    def __init__(self, g, folder, scores: Scores):
        self.g, self.folder, self.scores = g, folder, scores
        self.max_subtracted = True     # found: the softmax subtracts a row max before exp
        self.masked_sum = False        # found: the row sum adds only the unmasked exponentials

    def match(self, m: MatchState, x: Ref, x_layout):
        # the row max may be taken on one view of the scores and subtracted from another
        # (JAX transposes between the two): follow the non-reduce users through layout ops
        for _ in range(MAX_CHAIN):
            users = list(self.g.users(x)) + [u for t in m.twins.get((x.value, x.ctx), ())
                                             for u in self.g.users(t)]
            if any(op_name(u[0]) in ("stablehlo.subtract", "stablehlo.exponential") for u in users):
                break
            views = [u for u in users if op_name(u[0]) in (
                "stablehlo.transpose", "stablehlo.reshape", "stablehlo.convert",
                "stablehlo.broadcast_in_dim")]
            if len(views) != 1:
                raise Reject("the row maximum is not subtracted from the scores before the "
                             "exponential")
            user, _, ctx = views[0]
            if op_name(user) == "stablehlo.convert" and elt(user.result) not in FLOAT_TYPES:
                raise Reject("the scores are converted to a non-float type")
            x_layout = layout_step(user, x_layout, what="scores")
            m.add(user, ctx)
            x = Ref(user.results[0], ctx)
            m.record(x, x_layout, "scores")
        subs = [u for u in users if op_name(u[0]) == "stablehlo.subtract" and u[1] == 0]
        shift = None
        if subs:
            # with several (a backward pass also subtracts), take the one by a row-wise value
            first_error = None
            # x - (log(rowsum(exp(x - c))) + c) is the logsumexp form's second subtraction
            subs.sort(key=lambda u: self._is_log_plus(Ref(u[0].operands[1], u[2])))
            for sub, _, ctx in subs:
                saved = set(m.ops)
                try:
                    shift = self.term(m, Ref(sub.operands[1], ctx))
                except Reject as e:
                    m.ops, first_error = saved, first_error or e
                    continue
                if not shift.full:
                    break
                m.ops, shift = saved, None
            if shift is None:
                raise first_error or Reject("the value subtracted before the exponential is not "
                                            "constant along the softmax axis")
            m.add(sub, ctx)
            shift_ref = Ref(sub.operands[1], ctx)
            d = Ref(sub.result, ctx)
            m.record(d, x_layout, "scores")
            exps = [u for u in self.g.users(d) if op_name(u[0]) == "stablehlo.exponential"]
            if not exps:
                raise Reject("the scores minus the row maximum do not go into an exponential")
        else:
            exps = [u for u in users if op_name(u[0]) == "stablehlo.exponential"]
            if not exps:
                raise Reject("no exponential follows the row maximum")
            m.notes.append("softmax without max subtraction")
            self.max_subtracted = False
        exp, _, ctx = exps[0]
        m.add(exp, ctx)
        e = Ref(exp.result, ctx)
        m.record(e, x_layout, "exp")
        # e and its converts; one of them is divided (or multiplied by the reciprocal)
        views, candidates = [e], []
        i = 0
        while i < len(views):
            for user, idx, uctx in self.g.users(views[i]):
                name = op_name(user)
                if name == "stablehlo.convert" and elt(user.result) in FLOAT_TYPES:
                    m.add(user, uctx)
                    r = Ref(user.result, uctx)
                    m.record(r, x_layout, "exp")
                    views.append(r)
                elif name in ("stablehlo.divide", "stablehlo.multiply") and (
                        idx == 0 or name == "stablehlo.multiply"):
                    den = Ref(user.operands[1 - idx], uctx)
                    if (den.value, den.ctx) not in m.chain:
                        candidates.append((user, den, uctx))
            i += 1
        if not candidates and shift is not None:
            log_softmax = (self._log_softmax(m, d, x_layout)
                           or self._minus_logsumexp(m, x, d, shift_ref, x_layout))
            if log_softmax is not None:
                p, R = log_softmax
                if not rowwise_ok(shift.layout, x_layout, R):
                    raise Reject("the value subtracted before the exponential is not constant "
                                 "along the softmax axis")
                return p, x_layout, R
        if not candidates:
            raise Reject("the exponentials are not divided by their row sum (not a softmax)")
        # with several (a backward pass also multiplies them), take the one by the row sum
        first_error = None
        for user, den, uctx in candidates:
            saved = set(m.ops)
            try:
                R = self._normalizer(m, user, den, x_layout)
            except Reject as e_:
                m.ops, first_error = saved, first_error or e_
                continue
            m.add(user, uctx)
            break
        else:
            raise first_error
        if shift is not None and (shift.full or not rowwise_ok(shift.layout, x_layout, R)):
            raise Reject("the value subtracted before the exponential is not constant along "
                         "the softmax axis")
        p = Ref(user.result, uctx)
        m.record(p, x_layout, "probs")
        return p, x_layout, R

    def _log_softmax(self, m: MatchState, d: Ref, x_layout):
        """exp(d - log(rowsum(exp(d)))), i.e. exp(log_softmax(x)) with d = x - rowmax:
        (probabilities Ref, R), or None."""
        for user, idx, ctx in self.g.users(d):
            if op_name(user) != "stablehlo.subtract" or idx != 0:
                continue
            lse = Ref(user.operands[1], ctx)
            found = self._attempt(m, lambda: self._exp_of_minus_log_sum(
                m, user, ctx, lse, lse, x_layout, "exp(log_softmax)"))
            if found is not None:
                return found
        return None

    def _minus_logsumexp(self, m: MatchState, x: Ref, d: Ref, shift_ref: Ref, x_layout):
        """exp(x - (log(rowsum(exp(d))) + c)) with d = x - c, the same row-wise c on both
        sides (jax.scipy.special.logsumexp, keras' Softmax over several axes):
        (probabilities Ref, R), or None."""
        c = self._under_views(shift_ref)
        for user, idx, ctx in self.g.users(x):
            if op_name(user) != "stablehlo.subtract" or idx != 0 or \
                    self.g.resolve(Ref(user.result, ctx)) == self.g.resolve(d):
                continue
            total = self._under_views(Ref(user.operands[1], ctx))
            if isinstance(total.value, ir.BlockArgument) or \
                    op_name(total.value.owner) != "stablehlo.add":
                continue
            add = total.value.owner
            sides = [self._under_views(Ref(o, total.ctx)) for o in add.operands]
            if c not in sides:
                continue
            log_sum = Ref(add.operands[1 - sides.index(c)], total.ctx)
            found = self._attempt(m, lambda: self._exp_of_minus_log_sum(
                m, user, ctx, log_sum, Ref(user.operands[1], ctx), x_layout,
                "exp(x - logsumexp)"))
            if found is not None:
                return found
        return None

    def _attempt(self, m: MatchState, match):
        """``match()``'s result, or None with ``m``'s ops as before when it finds nothing."""
        saved = set(m.ops)
        try:
            found = match()
        except Reject:
            found = None
        if found is None:
            m.ops = saved
        return found

    def _exp_of_minus_log_sum(self, m: MatchState, user, ctx, log_sum: Ref, subtracted: Ref,
                              x_layout, spelling: str):
        """``user`` subtracts ``subtracted`` (a row-wise value whose log(rowsum(exp)) part is
        ``log_sum``) from the scores; its one exponential is the probabilities: (Ref, R),
        recorded in ``m``, or None. An abs is allowed before the log only (logsumexp's, a
        no-op on a sum of exponentials; after the log it would flip a negative log)."""
        log_term, subtracted = self.term(m, log_sum), self.term(m, subtracted)
        sums = [r for r in log_term.reduces if r[0] == "add" and r[1] == "exp"]
        allowed = ("stablehlo.convert", "stablehlo.broadcast_in_dim", "stablehlo.reshape",
                   "stablehlo.transpose", "stablehlo.abs", "stablehlo.log")
        lse = Ref(user.result, ctx)
        exps = [u for u in self.g.users(lse) if op_name(u[0]) == "stablehlo.exponential"]
        if len(log_term.reduces) != 1 or not sums or log_term.full or len(exps) != 1 or \
                log_term.ops.count("stablehlo.log") != 1 or \
                any(o not in allowed for o in log_term.ops) or \
                "stablehlo.abs" in log_term.ops[log_term.ops.index("stablehlo.log"):] or \
                not rowwise_ok(subtracted.layout, x_layout, sums[0][2]):
            return None
        m.add(user, ctx)
        m.record(lse, x_layout, "scores")
        exp, _, ectx = exps[0]
        m.add(exp, ectx)
        p = Ref(exp.result, ectx)
        m.record(p, x_layout, "probs")
        m.matched.append(spelling)
        return p, sums[0][2]

    def _is_log_plus(self, ref: Ref) -> bool:
        """``ref`` is (a view of) log(...) + something (or abs(...) + something: ordering only,
        the match checks the rest)."""
        total = self._under_views(ref)
        if isinstance(total.value, ir.BlockArgument) or \
                op_name(total.value.owner) != "stablehlo.add":
            return False
        return any(not isinstance(v.value, ir.BlockArgument) and
                   op_name(v.value.owner) in ("stablehlo.log", "stablehlo.abs")
                   for v in (self._under_views(Ref(o, total.ctx))
                             for o in total.value.owner.operands))

    def _under_views(self, ref: Ref) -> Ref:
        """The value under broadcasts, reshapes, transposes and float converts."""
        for _ in range(MAX_CHAIN):
            r = self.g.resolve(ref)
            if isinstance(r.value, ir.BlockArgument) or op_name(r.value.owner) not in (
                    "stablehlo.broadcast_in_dim", "stablehlo.reshape", "stablehlo.transpose",
                    "stablehlo.convert"):
                return r
            ref = Ref(r.value.owner.operands[0], r.ctx)
        return self.g.resolve(ref)

    def _masked_by_scores_mask(self, m: MatchState, op, ctx):
        """select(mask, x, 0) with the scores' own mask (a masked row sum, jax.nn.softmax
        where=): the Ref of x, else None."""
        for keep in (1, 2):
            zero = self.folder.fold(Ref(op.operands[3 - keep], ctx))
            if zero is None or not zero.uniform or float(zero.scalar()) != 0.0:
                continue
            hit = m.chain.get((self.g.resolve(Ref(op.operands[keep], ctx)).value,
                               self.g.resolve(Ref(op.operands[keep], ctx)).ctx))
            if hit is None:
                continue
            if is_score_mask(self.g, self.scores, Ref(op.operands[0], ctx), hit[0], keep == 2):
                return Ref(op.operands[keep], ctx)
        return None

    def _normalizer(self, m: MatchState, user, den: Ref, x_layout):
        """Check ``user`` (divide or multiply) normalizes by the row sum; return R."""
        term = self.term(m, den)
        sums = [r for r in term.reduces if r[0] == "add" and r[1] == "exp"]
        if len(term.reduces) != 1 or not sums or term.full:
            raise Reject("the softmax denominator is not the row sum of the exponentials")
        recip = term.ops.count("reciprocal") % 2
        if (op_name(user) == "stablehlo.divide") == bool(recip):
            raise Reject("the softmax denominator is not the row sum of the exponentials")
        if any(o not in ("stablehlo.convert", "stablehlo.broadcast_in_dim", "stablehlo.reshape",
                         "stablehlo.transpose", "reciprocal") for o in term.ops):
            raise Reject("the softmax denominator is modified after the row sum")
        R = sums[0][2]
        if not rowwise_ok(term.layout, x_layout, R):
            raise Reject("the softmax denominator is not broadcast along the summed axis")
        return R

    def term(self, m: MatchState, ref: Ref, depth: int = 0) -> Term:
        """Analyse a value computed from chain values by elementwise ops and reductions."""
        if depth > 40:
            raise Reject("the softmax bookkeeping is too deep to analyse")
        r = self.g.resolve(ref)
        hit = m.chain.get((r.value, r.ctx))
        if hit is not None:
            return Term(hit[0], True, [], [], hit[1])
        c = self.folder.fold(r)
        if c is not None:
            if not c.uniform:
                raise Reject("the softmax's row statistics use a non-uniform constant")
            if c.array.dtype.kind == "f" and c.array.size and np.isnan(c.scalar()):
                raise Reject("the softmax's row statistics use a NaN constant")
            return Term(tuple([None] * len(c.shape)), False, [], [])
        if isinstance(r.value, ir.BlockArgument):
            raise Reject("the softmax uses a value from outside the attention site")
        op = r.value.owner
        name = op_name(op)
        m.add(op, r.ctx)
        if name == "stablehlo.reduce":
            kind = reduce_kind(op)
            if kind is None:
                raise Reject("the softmax uses an unsupported reduction")
            init = self.folder.fold(Ref(op.operands[1], r.ctx))
            if init is None:
                raise Reject("a softmax reduction has a runtime initial value")
            src = self.term(m, Ref(op.operands[0], r.ctx), depth + 1)
            if not src.full:
                raise Reject("the softmax reduces a row-wise value again")
            dims = ints(op.operation.attributes["dimensions"])
            reduced = tuple(p for i in dims for p in (src.layout[i] or ()))
            if any(src.layout[i] is None for i in dims):
                raise Reject("the softmax reduces a broadcast axis")
            if kind == "add" and float(init.scalar()) != 0.0:
                raise Reject("the softmax sum starts from a nonzero value")
            if kind == "maximum" and float(init.scalar()) != float("-inf"):
                # found by tests/test_fuzz.py: a NaN init makes every original row NaN, a
                # finite one changes what a row without a visible key computes
                raise Reject(f"the softmax max starts from {float(init.scalar())}, not -inf")
            tag = src.tag
            out = tuple(d for i, d in enumerate(src.layout) if i not in dims)
            return Term(out, False, [(kind, tag, reduced)], [])
        if name in ("stablehlo.transpose", "stablehlo.reshape", "stablehlo.broadcast_in_dim",
                    "stablehlo.convert"):
            src = self.term(m, Ref(op.operands[0], r.ctx), depth + 1)
            lay = term_layout_step(op, src.layout)
            return Term(lay, src.full, src.reduces, src.ops + [name], src.tag)
        if name == "stablehlo.select":
            kept = self._masked_by_scores_mask(m, op, r.ctx)
            if kept is not None:
                self.masked_sum = True
                return self.term(m, kept, depth + 1)
        if name in ELEMENTWISE:
            parts = [self.term(m, Ref(x, r.ctx), depth + 1) for x in op.operands]
            lay = merge_layouts([t.layout for t in parts])
            if lay is None:
                raise Reject("the softmax combines misaligned values")
            ops = [o for t in parts for o in t.ops]
            if name == "stablehlo.divide" and not parts[0].reduces and not parts[0].full:
                ops.append("reciprocal")  # const / x
            else:
                ops.append(name)
            return Term(lay, any(t.full for t in parts), [x for t in parts for x in t.reduces], ops)
        raise Reject(f"the softmax's row max/sum is computed through {name}, not from the "
                     "scores alone")


def rowwise_ok(term_layout, x_layout, R) -> bool:
    """term broadcast along every dim that holds a piece of R, equal to x elsewhere."""
    if len(term_layout) != len(x_layout):
        return False
    fixed = [d for d in term_layout if d is not None]
    refined = L.common_refinement(tuple(fixed), tuple(x_layout), (tuple(R),))
    if refined is None:
        return False
    cuts = L.boundaries([tuple(fixed), tuple(x_layout), (tuple(R),)])
    r_set = set(L.refine_dim(tuple(R), cuts))
    for t, xd in zip(term_layout, x_layout):
        xs = L.refine_dim(xd, cuts)
        holds_r = any(p in r_set for p in xs)
        if t is None:
            continue
        if holds_r:
            return False
        if L.refine_dim(t, cuts) != xs:
            return False
    return True


def term_layout_step(op, layout):
    name = op_name(op)
    if name == "stablehlo.convert":
        return layout
    if name == "stablehlo.transpose":
        return L.transpose(layout, ints(op.operation.attributes["permutation"]))
    if name == "stablehlo.reshape":
        dst = shape_of(op.result)
        src = shape_of(op.operands[0])
        lay = tuple(() if d is None and n == 1 else d for d, n in zip(layout, src))
        out = L.regroup(lay, dst)
        if out is None:
            raise Reject("a reshape in the softmax mixes axes")
        return out
    dims = ints(op.operation.attributes["broadcast_dimensions"])
    src, dst = shape_of(op.operands[0]), shape_of(op.result)
    out = [None] * len(dst)
    for d in range(len(dst)):
        if dst[d] == 1:
            out[d] = ()
    for i, d in enumerate(dims):
        out[d] = layout[i] if src[i] == dst[d] else None
    return tuple(out)
