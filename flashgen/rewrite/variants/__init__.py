"""The attention pattern's variants: each score modifier and mask form in its own module,
owning its recognizer on the scores and its part of the plan (README "Rewrite").

The score walk (flashgen.rewrite.scores) asks SCORE_VARIANTS, in order, about each op the
scores pass through; the first that recognizes it returns the new, immutable
flashgen.rewrite.variants.state.Scores. A new score modifier is one module here and one entry
in this list (plus its attribute in flashgen.contract, when the kernel needs a new one).
"""
from __future__ import annotations

from flashgen.rewrite.variants.bias import Bias
from flashgen.rewrite.variants.mask import Mask
from flashgen.rewrite.variants.scale import Scale
from flashgen.rewrite.variants.softcap import Softcap

# order matters: a multiply after a tanh is the softcap's cap, not a scale
SCORE_VARIANTS = (Softcap(), Scale(), Mask(), Bias())
