"""What the score walk recognized: one immutable record that the score variants (scale,
softcap, mask, bias) each extend by returning a new copy, never by changing it in place.

Each field has one owner (the variant that writes it); the others may only read it, e.g. a
run-time scale is refused once a mask or bias is in the scores, a tanh once a bias is.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

from flashgen.rewrite.graph import Ref, op_name


class Step(NamedTuple):
    """One user of the scores that the walk asks the variants about."""
    op: object               # the user (an op view)
    idx: int                 # which of its operands the scores are
    ctx: tuple               # the call context it is seen in
    layout: tuple            # the scores' layout there

    @property
    def name(self) -> str:
        return op_name(self.op)

    def is_binary(self, either: str, lhs: str) -> bool:
        """Is the op ``either`` (the scores on either side) or ``lhs`` with the scores as its
        left operand (x - b, x / c)?"""
        return self.name == either or (self.name == lhs and self.idx == 0)

    @property
    def other(self) -> Optional[Ref]:
        """The binary op's other operand."""
        return Ref(self.op.operands[1 - self.idx], self.ctx) if len(self.op.operands) == 2 \
            else None


@dataclasses.dataclass(frozen=True)
class Scores:
    scale: float = 1.0          # scale: the product of the constant factors
    runtime_scales: tuple = ()  # scale: (scalar ir.Value, divide) folded into Q
    tanh: bool = False          # softcap: the scores went through tanh (its first half)
    softcap: float = 0.0        # softcap: the cap c multiplied onto tanh (0: no softcap)
    masks: tuple = ()           # mask, bias: (Const visible, layout, how) constant masks
    score_masks: tuple = ()     # mask: (predicate root, layout, negate) of the masking selects
    fills: tuple = ()           # mask, bias: (how 'select'|'add', fill, dtype) per masking step
    add_dtype: Optional[str] = None  # bias: element type of the add/subtract being analysed
    biases: tuple = ()          # bias: extras.ConstBias, constant additive biases
    extras: tuple = ()          # mask, bias: extras.ValueBias | ValueMask | SegmentIds (run time)
    steps: tuple = ()           # what matched, in order ("scale", "mask", ...), for the report
    notes: tuple = ()

    def but(self, **changes) -> "Scores":
        return dataclasses.replace(self, **changes)

    def plus(self, *, step: str | None = None, note: str | None = None, **appended) -> "Scores":
        """A copy with each tuple field in ``appended`` extended by the given items, and
        ``step`` / ``note`` recorded."""
        changes = {k: getattr(self, k) + tuple(v) for k, v in appended.items()}
        if step is not None:
            changes["steps"] = self.steps + (step,)
        if note is not None:
            changes["notes"] = self.notes + (note,)
        return dataclasses.replace(self, **changes)


class ScoreVariant:
    """One score modifier or mask form: ``recognize`` a step of the scores (a new Scores, or
    None when the step is not this variant's; Reject when it is but cannot be rewritten),
    ``finish`` checks once the walk reached the softmax, ``plan`` its part of the site's
    Plan (flashgen.rewrite.plan), ``describe`` its part of the report's explanation. A variant with no step of its own on the scores (a band,
    empty rows) only plans."""
    name = ""
    ops: tuple = ()   # the ops on the scores it may recognize (the walk follows those)

    def recognize(self, walk, found: Scores, step: Step) -> Scores | None:
        return None

    def finish(self, found: Scores) -> None:
        return None

    def plan(self, site, draft):
        return draft

    def describe(self, site) -> str:
        """Its part of the ``--explain`` line of a matched site (report.AttentionSite)."""
        return ""


class BinaryVariant(ScoreVariant):
    """A variant of a binary op on the scores: ``either`` with the scores on either side
    (x·c, c·x), ``lhs`` with the scores on the left only (x / c, x - b)."""
    either = lhs = ""

    @property
    def ops(self) -> tuple:
        return (self.either, self.lhs)

    def recognize(self, walk, found: Scores, step: Step) -> Scores | None:
        if not step.is_binary(self.either, lhs=self.lhs):
            return None
        return self.on_binary(walk, found, step)

    def on_binary(self, walk, found: Scores, step: Step) -> Scores:
        raise NotImplementedError
