"""Stage 3: from the probabilities to the P·V product: layout ops, converts and a
fully-masked-row guard; names dropout and other users when the chain does not close.
"""
from __future__ import annotations

import re

from jaxlib.mlir import ir

from flashgen.rewrite.chain import (
    FLOAT_TYPES, MAX_CHAIN, RNG_OPS, MatchState, dot_dims, elt, layout_step,
)
from flashgen.rewrite.errors import Reject
from flashgen.rewrite.graph import Ref, op_name
from flashgen.rewrite.scores import is_score_mask
from flashgen.rewrite.softmax import SoftmaxStage

# private functions jax.random lowers to: their values are random bits
_RANDOM_FUNCTIONS = re.compile(r"threefry|bernoulli|_uniform|random_bits")

# which users continue the chain of the probabilities
PROB_STEPS = {"stablehlo.convert", "stablehlo.transpose", "stablehlo.reshape",
              "stablehlo.broadcast_in_dim", "stablehlo.select", "stablehlo.dot_general"}


class ProbabilitiesStage:
    """The probabilities up to the P·V product, for one match attempt; ``softmax`` analyses
    a guard's row statistics."""

    def __init__(self, g, folder, softmax: SoftmaxStage):
        self.g, self.folder, self.softmax = g, folder, softmax
        self.remasked = False          # found: masked again by the scores' mask (keras)
        self.guards = []               # found: (row-wise Term, layout) of fully-masked-row guards

    def walk(self, m: MatchState, p: Ref, layout, axes):
        """(the P·V product, the probabilities' operand index, its ctx, their layout there);
        ``axes``: the pieces the softmax normalizes over."""
        for _ in range(MAX_CHAIN):
            users = list(self.g.users(p))
            steps = [u for u in users if op_name(u[0]) in PROB_STEPS]
            if len(steps) > 1 and m.training:
                # the backward's dV = Pᵀ·dO contracts the query axis: not the P·V product
                steps = [u for u in steps if op_name(u[0]) != "stablehlo.dot_general"
                         or _contracts(u, layout, axes)]
            if len(steps) != 1:
                if not users:
                    raise Reject("the probabilities are never used")
                m.escaped = len(steps) > 1
                raise Reject(self._why_not_pv(users, p))
            user, idx, ctx = steps[0]
            name = op_name(user)
            m.add(user, ctx)
            if name == "stablehlo.dot_general":
                return user, idx, ctx, layout
            if name == "stablehlo.select":
                if idx == 0:
                    raise Reject("the probabilities are used as a predicate")
                other = self.folder.fold(Ref(user.operands[3 - idx], ctx))
                if other is None or not other.uniform or float(other.scalar()) != 0.0:
                    raise Reject(self._dropout_or(p, "the probabilities are selected against "
                                                     "a non-zero value"))
                if is_score_mask(self.g, self.softmax.scores, Ref(user.operands[0], ctx), layout, idx == 2):
                    # keras' masked softmax: it changes only rows without a visible key (0)
                    self.remasked = True
                    m.notes.append("the scores' mask applied again after the softmax")
                else:
                    self.guards.append((self._guard(m, p, Ref(user.operands[0], ctx)), layout))
                    m.notes.append("fully-masked-row guard after the softmax")
            elif name == "stablehlo.convert":
                if elt(user.result) not in FLOAT_TYPES:
                    raise Reject("the probabilities are converted to a non-float type")
            else:
                layout = layout_step(user, layout, what="probabilities")
            p = Ref(user.results[0], ctx)
            m.record(p, layout, "probs")
        raise Reject("the chain from the softmax to the P·V product is too long")

    def _guard(self, m: MatchState, p: Ref, pred: Ref):
        """A row-wise predicate computed from the scores (torch's fully-masked-row guard)."""
        try:
            term = self.softmax.term(m, pred)
        except Reject:
            raise Reject(self._dropout_or(p, "the probabilities are masked after the "
                                             "softmax")) from None
        if term.full:
            raise Reject(self._dropout_or(p, "the probabilities are masked after the softmax"))
        return term

    def _why_not_pv(self, users, p: Ref) -> str:
        for user, idx, ctx in users:
            if op_name(user) == "func.return":
                fn = user.operation.parent.operation
                return (f"the probabilities are returned as output {idx} of "
                        f"@{self.g.function_name(fn)}"
                        + (" and no P·V product follows (a softmax classifier?)"
                           if not any(op_name(u[0]) == "stablehlo.dot_general" for u in users)
                           else ""))
        names = sorted({op_name(u[0]) for u in users})
        if len(users) > 1 and "stablehlo.dot_general" in names:
            others = [op_name(u[0]) for u in users]
            others.remove("stablehlo.dot_general")
            what = ", ".join(sorted(set(others)))
            if set(others) == {"stablehlo.dot_general"}:
                what += ": a second product, e.g. a backward pass"
            return self._dropout_or(p, f"the probabilities have another user ({what})")
        return self._dropout_or(p, f"the probabilities pass through {', '.join(names)}")

    def _dropout_or(self, p: Ref, reason: str) -> str:
        """Name dropout when what the probabilities meet next combines them with random
        numbers (an rng op) or with a runtime mask (e.g. inline threefry bits)."""
        frontier = [p]
        for _ in range(3):
            nxt = []
            for ref in frontier:
                for user, idx, ctx in self.g.users(ref):
                    name = op_name(user)
                    for i, x in enumerate(user.operands):
                        if i == idx:
                            continue
                        if self._mentions_rng(Ref(x, ctx)):
                            return "dropout on the probabilities (they are combined with a " \
                                   "random mask)"
                        if name in ("stablehlo.select", "stablehlo.multiply") and \
                                self.folder.fold(Ref(x, ctx)) is None and \
                                elt(x) in ("i1", "f32", "bf16", "f16") and \
                                self._depends_on_argument(Ref(x, ctx)):
                            return "the probabilities are masked by a runtime value " \
                                   "(dropout?)"
                    nxt.extend(Ref(r, ctx) for r in user.results)
            frontier = nxt
        return reason

    def _depends_on_argument(self, ref: Ref) -> bool:
        """Does the value depend on a function argument without going through the site?"""
        stack, seen = [ref], set()
        while stack and len(seen) < 200:
            r = self.g.resolve(stack.pop())
            key = (r.value, r.ctx)
            if key in seen:
                continue
            seen.add(key)
            if isinstance(r.value, ir.BlockArgument):
                return True
            op = r.value.owner
            if op_name(op) == "stablehlo.dot_general":
                continue
            stack.extend(Ref(x, r.ctx) for x in op.operands)
        return False

    def _mentions_rng(self, ref: Ref) -> bool:
        stack, seen = [ref], set()
        while stack and len(seen) < 200:
            r = self.g.resolve(stack.pop())
            if (r.value, r.ctx) in seen or isinstance(r.value, ir.BlockArgument):
                continue
            seen.add((r.value, r.ctx))
            op = r.value.owner
            if op_name(op) in RNG_OPS:
                return True
            if r.ctx and _RANDOM_FUNCTIONS.search(self.g.function_name(self.g.function_of(op))):
                return True     # jax.random inlined as integer ops (threefry from a seed)
            stack.extend(Ref(x, r.ctx) for x in op.operands)
        return False


def _contracts(use, layout, axes) -> bool:
    """Does the product ``use`` (user, operand index, ctx) of the probabilities (dims
    ``layout``) contract exactly the softmax axes?"""
    user, idx, _ = use
    lb, rb, lc, rc = dot_dims(user)
    contracted = {p[0] for i in (lc if idx == 0 else rc) for p in layout[i]}
    return contracted == {p[0] for p in axes}
