"""The extra operands after q, k, v (README "Variants"): ALiBi slopes, a ``bias``, a
``mask`` and ``segment_ids``, resolved together from what the mask and bias variants
recorded, once the kernel layout is known (flashgen.rewrite.extras: ALiBi is fitted on the
entries the masks leave visible, and may align the band bottom-right).
"""
from __future__ import annotations

from flashgen.rewrite import extras as X
from flashgen.rewrite.variants.state import ScoreVariant


class Operands(ScoreVariant):
    name = "operands"

    def plan(self, site, draft):
        sc = site.scores
        resolved = X.resolve(sc.extras, sc.biases, draft.const_masks, cuts=draft.cuts,
                             kernel_q=draft.kernel["q"], k_free=draft.k_free,
                             final_scale=sc.scale, causal=draft.causal,
                             bottom_right=draft.attribute("bottom_right"),
                             window=draft.attribute("window"), kernel_dtype=draft.dtype)
        return draft.but(extras=resolved, attrs=dict(bottom_right=resolved.bottom_right),
                         notes=resolved.notes)
