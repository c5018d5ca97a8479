"""The softmax scale: constant multiplies and divides of the scores (folded into the
kernel's ``scale``), and a scalar known only at run time (multiplied into Q before the call;
the kernel's scale keeps the constant part).
"""
from __future__ import annotations

import numpy as np

from flashgen.contract import normalize_scale
from flashgen.rewrite.chain import FLOAT_TYPES, elt, shape_of
from flashgen.rewrite.errors import Reject
from flashgen.rewrite.variants.state import BinaryVariant, Scores, Step


class Scale(BinaryVariant):
    name, either, lhs = "scale", "stablehlo.multiply", "stablehlo.divide"

    def on_binary(self, walk, found: Scores, step: Step) -> Scores:
        divide = step.name == "stablehlo.divide"
        if walk.folder.fold(step.other) is None:
            return _runtime_scale(walk, found, step, divide=divide)
        s = walk.uniform(step.other, "scale")
        if s == 0 or not np.isfinite(s):
            raise Reject(f"the scores are scaled by {s}")
        return found.plus(step="scale").but(
            scale=found.scale / s if divide else found.scale * s)

    def plan(self, site, draft):
        """The kernel's scale: the constant factors of the scores and of Q and K's sources,
        times what the other variants fold into it (``draft.scale_factor``)."""
        scale = site.scores.scale * site.q_scale * site.k_scale * draft.scale_factor
        try:
            normalize_scale(scale)
        except ValueError as e:
            raise Reject(str(e), **draft.details) from None
        return draft.but(attrs=dict(scale=scale),
                         runtime_scales=tuple(site.scores.runtime_scales))

    def describe(self, site) -> str:
        return f", scale {site.scale:.6g}"


def _runtime_scale(walk, found: Scores, step: Step, *, divide: bool) -> Scores:
    """A scalar of the site's function, folded into Q when the site is rewritten."""
    if found.masks or found.extras or found.biases or found.tanh:
        # a fill, bias or cap already in the scores would be scaled too (and a negative
        # scale would unmask the fill)
        raise Reject("the scores are scaled by a value known only at run time after a mask, "
                     "bias or softcap")
    source, _ = walk.source(step.other, step.layout)
    if source is None or any(n != 1 for n in shape_of(source[0])) or \
            elt(source[0]) not in FLOAT_TYPES:
        raise Reject("the scale is known only at run time and is not a scalar of the "
                     "function")
    return found.plus(step="run-time scale", runtime_scales=[(source[0], divide)],
                      note="run-time scale folded into Q (the kernel's scale is the constant "
                           "part)")
