"""What every stage of the attention matcher shares: the state of one match attempt
(MatchState), the record of a row statistic (Term), and small helpers for reading op
attributes, types and layouts.

The stages (scores, softmax, probabilities, roles) are objects that
flashgen.rewrite.patterns.AttentionPattern builds per match attempt from the Graph and the
constant Folder; what the score walk recognizes is an immutable record
(flashgen.rewrite.variants.state.Scores) passed on explicitly.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

from flashgen.rewrite import layout as L
from flashgen.rewrite.errors import Reject
from flashgen.rewrite.graph import Ref, op_name

LARGE_NEGATIVE = -1e4      # a fill at or below this masks a score out
MAX_CHAIN = 64             # ops followed along one chain before giving up

FLOAT_TYPES = ("f16", "bf16", "f32", "f64")
KERNEL_DTYPES = {"f16": "f16", "bf16": "bf16", "f32": "f32"}
WIDTH = {"f16": 16, "bf16": 16, "f32": 32, "f64": 64}
LAYOUT_OPS = ("stablehlo.transpose", "stablehlo.reshape", "stablehlo.convert",
              "stablehlo.broadcast_in_dim")
ELEMENTWISE = {
    "stablehlo.add", "stablehlo.subtract", "stablehlo.multiply", "stablehlo.divide",
    "stablehlo.maximum", "stablehlo.minimum", "stablehlo.negate", "stablehlo.abs",
    "stablehlo.exponential", "stablehlo.log", "stablehlo.sqrt", "stablehlo.rsqrt",
    "stablehlo.compare", "stablehlo.select", "stablehlo.and", "stablehlo.or", "stablehlo.not",
    "stablehlo.is_finite", "stablehlo.convert", "stablehlo.clamp", "stablehlo.power",
    "stablehlo.tanh", "stablehlo.logistic", "stablehlo.sign", "stablehlo.floor",
}
RNG_OPS = ("stablehlo.rng_bit_generator", "stablehlo.rng")


def ints(attr) -> list[int]:
    return list(ir.DenseI64ArrayAttr(attr))


def elt(ref_or_value) -> str:
    v = ref_or_value.value if isinstance(ref_or_value, Ref) else ref_or_value
    return str(v.type.element_type)


def shape_of(v) -> tuple:
    v = v.value if isinstance(v, Ref) else v
    return tuple(v.type.shape)


def reduce_kind(op) -> str | None:
    """'add', 'maximum', ... for a single-input stablehlo.reduce with a one-op body."""
    if op_name(op) != "stablehlo.reduce" or len(op.operands) != 2:
        return None
    body = op.operation.regions[0].blocks[0]
    ops = list(body.operations)
    if len(ops) != 2:
        return None
    return ops[0].operation.name.split(".")[-1]


@dataclasses.dataclass
class Term:
    """A value computed from the site's chain values by elementwise ops and reductions."""
    layout: tuple             # per dim: pieces, or None where constant (broadcast)
    full: bool                # depends on a chain value without a reduction over R in between
    reduces: list             # [(kind, tag of the reduced chain value, reduced pieces)]
    ops: list                 # op names after the (single) reduction, for the normalizer check
    tag: str | None = None    # the chain value's tag when only layout ops/converts lead here


class MatchState:
    """The trace of one match attempt: the ops and values it visited (read by the closure
    check and the backward's walk), what matched and the notes (for the report). What the
    stages find is theirs and passed on explicitly (variants.state.Scores, the stages'
    own fields)."""

    def __init__(self):
        self.ops: set = set()          # (operation, ctx)
        self.chain: dict = {}          # (value, ctx) -> (layout, tag)
        self.matched: list = []
        self.notes: list = []
        self.twins: dict = {}          # (value, ctx) -> refs of equal selects (softmax where=)
        self.dot1 = None               # the Q·K product
        # a training graph: the forward's intermediates also feed its backward
        # (flashgen.rewrite.backward); only tried after a plain match met such uses
        self.training = False
        self.escaped = False           # a plain match failed on a use outside the site

    def add(self, op, ctx):
        self.ops.add((op.operation, ctx))

    def record(self, ref: Ref, layout, tag: str):
        self.chain[(ref.value, ref.ctx)] = (layout, tag)


def dot_dims(op):
    dn = stablehlo.DotDimensionNumbers(op.operation.attributes["dot_dimension_numbers"])
    return (list(dn.lhs_batching_dimensions), list(dn.rhs_batching_dimensions),
            list(dn.lhs_contracting_dimensions), list(dn.rhs_contracting_dimensions))


def constant_factor(folder, op, ctx, *, positive: bool):
    """For x·c, c·x or x/c with a finite nonzero constant c (positive with ``positive``):
    (index of x, c, whether x is divided by c), else None."""
    name = op_name(op)
    for i in ((0, 1) if name == "stablehlo.multiply" else (1,)):
        c = folder.fold(Ref(op.operands[i], ctx))
        if c is None or not c.uniform:
            continue
        k = float(c.scalar())
        if np.isfinite(k) and (k > 0 if positive else k != 0):
            return 1 - i, k, name == "stablehlo.divide"
    return None


def back_layout(op, layout):
    """The layout of a layout op's operand given its result's (size-1 dims hold no piece),
    or None where a reshape mixes axes."""
    name = op_name(op)
    if name == "stablehlo.transpose":
        perm = ints(op.operation.attributes["permutation"])
        out = [()] * len(perm)
        for i, pp in enumerate(perm):
            out[pp] = layout[i]
        return tuple(out)
    if name == "stablehlo.reshape":
        return L.regroup(layout, shape_of(op.operands[0]))
    dims = ints(op.operation.attributes["broadcast_dimensions"])
    src, dst = shape_of(op.operands[0]), shape_of(op.result)
    return tuple(layout[d] if src[i] == dst[d] else () for i, d in enumerate(dims))


def layout_step(user, layout, *, what: str):
    name = op_name(user)
    if name == "stablehlo.transpose":
        return L.transpose(layout, ints(user.operation.attributes["permutation"]))
    if name == "stablehlo.reshape":
        out = L.regroup(layout, shape_of(user.result))
        if out is None:
            raise Reject(f"a reshape of the {what} mixes axes")
        return out
    if name == "stablehlo.broadcast_in_dim":
        dims = ints(user.operation.attributes["broadcast_dimensions"])
        src, dst = shape_of(user.operands[0]), shape_of(user.result)
        out = [()] * len(dst)
        for i, d in enumerate(dims):
            if src[i] != dst[d]:
                raise Reject(f"the {what} are broadcast")
            out[d] = layout[i]
        for d in range(len(dst)):
            if d not in dims and dst[d] != 1:
                raise Reject(f"the {what} are broadcast")
        return tuple(out)
    if name == "stablehlo.convert":
        return layout
    raise AssertionError(name)


def compare_direction(op) -> str:
    return str(op.operation.attributes["comparison_direction"]).split()[-1].strip(">").upper()


def widening(src: str, dst: str) -> bool:
    """A convert that keeps every value: float to a wider float, integer to a wider integer
    of the same signedness, i1 to i1."""
    if src in WIDTH and dst in WIDTH:
        return WIDTH[src] <= WIDTH[dst] and not (src == "bf16" and dst == "f16")
    ints = {"i8": 8, "i16": 16, "i32": 32, "i64": 64}
    if src.lstrip("u") in ints and dst.lstrip("u") in ints:
        return src.startswith("u") == dst.startswith("u") and \
            ints[src.lstrip("u")] <= ints[dst.lstrip("u")]
    return src == dst


def merge_layouts(layouts):
    n = {len(x) for x in layouts}
    if len(n) != 1:
        return None
    out = []
    for dims in zip(*layouts):
        fixed = [d for d in dims if d is not None]
        if not fixed:
            out.append(None)
            continue
        if any(d != fixed[0] for d in fixed[1:]):
            ref = L.common_refinement(*[(d,) for d in fixed])
            if ref is None or any(r != ref[0] for r in ref[1:]):
                return None
        out.append(fixed[0])
    return tuple(out)


def covered(pieces) -> dict:
    """label -> product of the sizes of its pieces."""
    out: dict = {}
    for label, _, size in pieces:
        out[label] = out.get(label, 1) * size
    return out


def pieces_text(pieces) -> str:
    names = sorted({_AXIS_NAMES.get(p[0][0], p[0][0]) + p[0][1:] for p in pieces})
    return "axes " + ", ".join(names) if names else "no axis"


_AXIS_NAMES = {"B": "batch", "L": "lhs-free", "R": "rhs-free", "C": "contracting", "V": "value"}
