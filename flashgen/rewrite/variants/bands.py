"""Causal and sliding-window bands: the constant masks the mask and bias variants recorded
become the ``causal`` flag and the ``bottom_right`` / ``window`` attributes when together
they are a band on the query-key distance (flashgen.rewrite.masks); otherwise they stay
for the extra operands as a constant ``mask``.
"""
from __future__ import annotations

from flashgen.rewrite import masks
from flashgen.rewrite.variants.state import ScoreVariant


class Bands(ScoreVariant):
    name = "bands"

    def plan(self, site, draft):
        try:
            causal, bottom_right, q_seq, window = masks.classify(
                site.scores.masks, draft.cuts, draft.q_free, draft.k_free)
        except masks.NotBand as e:
            return draft.but(const_masks=site.scores.masks,
                             note=f"constant mask passed as an operand ({e.reason})")
        return draft.but(causal=causal, q_seq=tuple(q_seq),
                         attrs=dict(bottom_right=bottom_right, window=tuple(window)))

    def describe(self, site) -> str:
        mask = ("causal (bottom-right aligned)" if site.bottom_right else "causal") \
            if site.causal else "no mask"
        if tuple(site.window) != (-1, -1):
            w = f"sliding window (left {site.window[0]}, right {site.window[1]})"
            mask = w if mask == "no mask" else f"{mask}, {w}"
            if site.bottom_right and not site.causal:
                mask += " bottom-right aligned"
        return mask
