"""The logit softcap c·tanh(x/c): a tanh of the scaled scores, then a multiply by a constant
c (the divide by c is part of the scale). The kernel caps before it masks or adds a bias,
so a mask or bias before the tanh, or between the tanh and its multiply, is refused.
"""
from __future__ import annotations

import numpy as np

from flashgen.rewrite import extras as X
from flashgen.rewrite.errors import Reject
from flashgen.rewrite.variants.state import Scores, ScoreVariant, Step


class Softcap(ScoreVariant):
    name = "softcap"
    # a select, add or subtract only to refuse it between the tanh and the cap
    ops = ("stablehlo.tanh", "stablehlo.multiply", "stablehlo.divide", "stablehlo.select",
           "stablehlo.add", "stablehlo.subtract")

    def recognize(self, walk, found: Scores, step: Step) -> Scores | None:
        name = step.name
        if name == "stablehlo.tanh":
            if found.tanh:
                raise Reject("the scores pass through tanh twice")
            if found.biases or any(isinstance(x, X.ValueBias) for x in found.extras):
                raise Reject("the scores get an additive bias before the softcap's tanh (the "
                             "kernel caps before adding a bias)")
            if found.masks or found.extras:
                raise Reject("the scores are masked before the softcap's tanh (the kernel caps "
                             "before masking)")
            return found.plus(step="softcap tanh").but(tanh=True)
        if not found.tanh:
            return None
        if name in ("stablehlo.multiply", "stablehlo.divide"):
            if found.softcap or name == "stablehlo.divide":
                raise Reject("the scores are scaled after the softcap's tanh (only c·tanh(x/c) "
                             "is supported)")
            c = walk.uniform(step.other, "softcap")
            if not (c > 0 and np.isfinite(c)):
                raise Reject(f"the softcap {c:g} is not a finite positive number")
            return found.plus(step="softcap").but(softcap=c)
        if name in ("stablehlo.select", "stablehlo.add", "stablehlo.subtract") and \
                not found.softcap:
            raise Reject("the scores are masked or biased between the softcap's tanh and its "
                         "multiply by the cap")
        return None

    def finish(self, found: Scores) -> None:
        """A tanh must have had its cap."""
        if found.tanh and not found.softcap:
            raise Reject("the scores pass through tanh without a multiply by a constant "
                         "cap after it (not a softcap c·tanh(x/c))")

    def plan(self, site, draft):
        """c·tanh(pre·qk): the kernel's scale is pre·c, its softcap c."""
        c = site.scores.softcap
        if not c:
            return draft
        return draft.but(scale_factor=draft.scale_factor * c, attrs=dict(softcap=c))

    def describe(self, site) -> str:
        return f", softcap {site.softcap:g}" if site.softcap else ""
