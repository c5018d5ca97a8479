"""Query rows left without a visible key: what the original computes there (zero, the mean
of V, NaN; flashgen.rewrite.empty_rows), from the masks' fills, the softmax's spelling and
whether the probabilities are zeroed again.
"""
from __future__ import annotations

import numpy as np

from flashgen.rewrite import empty_rows
from flashgen.rewrite.errors import Reject
from flashgen.rewrite.variants.state import ScoreVariant


class EmptyRows(ScoreVariant):
    name = "empty rows"

    def plan(self, site, draft):
        if site.masked_sum and not site.remasked:
            # a row without a visible key would be e / 0 in the original
            raise Reject("the softmax sums only the unmasked exponentials, but the "
                         "probabilities are not masked again")
        # torch's guard (_safe_softmax) zeroes the rows whose scores are all -inf: after a
        # finite fill (Falcon's masked_fill of its ALiBi by finfo.min) it never fires
        guard_fires = site.guarded and all(np.isneginf(v) for _, v, _ in site.scores.fills)
        empty = empty_rows.behaviour(
            site.scores.fills, zeroed_after=guard_fires or site.remasked,
            max_subtracted=site.max_subtracted,
            may_empty=empty_rows.may_empty_rows(draft.extras, draft.seq_q, draft.seq_k))
        return draft.but(empty_rows=empty, note=empty_rows.NOTES.get(empty))
