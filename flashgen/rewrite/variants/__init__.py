"""The attention pattern's variants: each score modifier and mask form in its own module,
owning its recognizer on the scores and its part of the plan (README "Rewrite").

The score walk (flashgen.rewrite.scores) asks SCORE_VARIANTS, in order, about each op the
scores pass through; the first that recognizes it returns the new, immutable
flashgen.rewrite.variants.state.Scores. The Plan (flashgen.rewrite.plan) is the composition
of the variants' ``plan`` steps. A new score modifier is one module here and its entries in
these lists (plus its attribute in flashgen.contract, when the kernel needs a new one).
"""
from __future__ import annotations

from flashgen.rewrite.variants.bands import Bands
from flashgen.rewrite.variants.bias import Bias
from flashgen.rewrite.variants.empty_rows import EmptyRows
from flashgen.rewrite.variants.mask import Mask
from flashgen.rewrite.variants.operands import Operands
from flashgen.rewrite.variants.scale import Scale
from flashgen.rewrite.variants.softcap import Softcap

SOFTCAP, SCALE, BANDS = Softcap(), Scale(), Bands()
# order matters: a multiply after a tanh is the softcap's cap, not a scale
SCORE_VARIANTS = (SOFTCAP, SCALE, Mask(), Bias())
# the plan (flashgen.rewrite.plan): the bands come before the kernel layout (they name the
# query sequence axis), the rest after it, in this order (the softcap's cap is part of the
# kernel's scale; empty rows depend on the resolved operands)
BAND_VARIANTS = (BANDS,)
PLAN_VARIANTS = (SOFTCAP, SCALE, Operands(), EmptyRows())
# the --explain line of a matched site: "causal, softcap 50, scale 0.125"
DESCRIBED = (BANDS, SOFTCAP, SCALE)
