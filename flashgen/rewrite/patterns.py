"""The attention pattern: ``match(op)`` reads a site without touching it,
``rewrite(site)`` replaces it with one flashgen custom call.

What is matched, starting at a ``dot_general`` (the Q·K product):

    scores = dot_general(Q, K)                   any operand order and layout
    scores -> [scale] -> [softcap] -> [mask]     multiply/divide by constants; softcap
                                                 c·tanh(x/c): tanh then a multiply by c (the
                                                 divide by c is part of the scale); select with
                                                 a large negative fill; additive biases;
                                                 converts, reshapes, transposes, unit
                                                 broadcasts, private calls
    p = exp(x - rowconst) / rowsum               the softmax over the key axes R; rowconst is
                                                 anything constant along R (the row max)
    p -> [layout, converts, fully-masked guard]
    out = dot_general(p, V) contracting R        V on either side
    out -> [transpose/reshape/convert]           the site's exit value

Masks and biases (flashgen.rewrite.extras, README "Variants"): a select's predicate is split
into its AND-ed conjuncts. Constant conjuncts that form a causal / sliding-window band become
the call's attributes (flashgen.rewrite.masks), other constant masks a constant ``mask``
operand; run-time conjuncts a ``mask`` operand, or ``segment_ids`` when they compare integer
ids along the queries with ids along the keys. An added value is split into its terms:
constants (whose large negative entries mask) become ALiBi slopes when they equal
-slope·|i + off - j| up to per-row constants on the visible entries, else a constant
``bias``; ``where(p, 0, -inf)`` terms are masks; other run-time terms a ``bias`` operand.
Run-time operands are walked back through layout ops to their most compact form and must
not depend on the Q·K product; they are rejected after a tanh (the kernel caps first).

Roles are read from dimension numbers: the operand of the first product
whose free axes the softmax reduces is K, the other is Q. Every tensor on the
way is described by which pieces of those logical axes each dimension holds
(flashgen.rewrite.layout), so layout, operand order and softmax axis are
never assumed.
"""
from __future__ import annotations

import dataclasses
from math import prod

import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

from flashgen.rewrite import adapters, masks
from flashgen.rewrite import extras as X
from flashgen.rewrite import layout as L
from flashgen.rewrite.errors import Reject
from flashgen.rewrite.fold import Const, Folder
from flashgen.rewrite.graph import Graph, Ref, op_name, short_location
from flashgen.rewrite.report import AttentionSite, Rejection
from flashgen.spec import HEAD_DIMS, KernelSpec

LARGE_NEGATIVE = -1e4      # a fill at or below this masks a score out
MAX_CHAIN = 64             # ops followed along one chain before giving up

_FLOAT_TYPES = ("f16", "bf16", "f32", "f64")
_KERNEL_DTYPES = {"f16": "f16", "bf16": "bf16", "f32": "f32"}
_WIDTH = {"f16": 16, "bf16": 16, "f32": 32, "f64": 64}
_LAYOUT_OPS = ("stablehlo.transpose", "stablehlo.reshape", "stablehlo.convert",
               "stablehlo.broadcast_in_dim")
_ELEMENTWISE = {
    "stablehlo.add", "stablehlo.subtract", "stablehlo.multiply", "stablehlo.divide",
    "stablehlo.maximum", "stablehlo.minimum", "stablehlo.negate", "stablehlo.abs",
    "stablehlo.exponential", "stablehlo.log", "stablehlo.sqrt", "stablehlo.rsqrt",
    "stablehlo.compare", "stablehlo.select", "stablehlo.and", "stablehlo.or", "stablehlo.not",
    "stablehlo.is_finite", "stablehlo.convert", "stablehlo.clamp", "stablehlo.power",
    "stablehlo.tanh", "stablehlo.logistic", "stablehlo.sign", "stablehlo.floor",
}
_RNG_OPS = ("stablehlo.rng_bit_generator", "stablehlo.rng")


def _ints(attr) -> list[int]:
    return list(ir.DenseI64ArrayAttr(attr))


def _elt(ref_or_value) -> str:
    v = ref_or_value.value if isinstance(ref_or_value, Ref) else ref_or_value
    return str(v.type.element_type)


def _shape(v) -> tuple:
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
class _Term:
    """A value computed from the site's chain values by elementwise ops and reductions."""
    layout: tuple             # per dim: pieces, or None where constant (broadcast)
    full: bool                # depends on a chain value without a reduction over R in between
    reduces: list             # [(kind, tag of the reduced chain value, reduced pieces)]
    ops: list                 # op names after the (single) reduction, for the normalizer check
    tag: str | None = None    # the chain value's tag when only layout ops/converts lead here


@dataclasses.dataclass
class Plan:
    """Everything rewrite() needs; built by match(), valid until the module changes."""
    dot1: object
    exit_op: object
    exit_value: ir.Value
    exit_layout: tuple
    inputs: dict              # 'q'|'k'|'v' -> (ir.Value, layout)
    kernel: dict              # 'q'|'k'|'v'|'o' -> tuple of dims (each a tuple of pieces)
    spec: KernelSpec
    scale: float
    bottom_right: bool
    site_ops: set             # {(ir.Operation, ctx)} the site's own ops
    window: tuple = (-1, -1)  # (left, right), -1 = unbounded
    softcap: float = 0.0      # 0 = none
    extras: object = None     # extras.Resolved: the operands after q, k, v


class _Match:
    """Mutable state of one match attempt."""

    def __init__(self):
        self.ops: set = set()          # (operation, ctx)
        self.chain: dict = {}          # (value, ctx) -> (layout, tag)
        self.scale = 1.0
        self.masks: list = []          # (Const visible, layout, how)
        self.matched: list = []
        self.notes: list = []
        self.guards: list = []         # row-wise predicates of fully-masked-row guards
        self.probs_layout = None       # the probabilities' layout at the P·V product
        self.tanh = False              # the scores went through tanh (a softcap's first half)
        self.softcap = 0.0             # the cap c multiplied onto tanh (0: no softcap)
        self.biases: list = []         # X.ConstBias: constant additive biases
        self.extras: list = []         # X.ValueBias | X.ValueMask | X.SegmentIds (run time)
        self.dot1 = None               # the Q·K product

    def add(self, op, ctx):
        self.ops.add((op.operation, ctx))

    def record(self, ref: Ref, layout, tag: str):
        self.chain[(ref.value, ref.ctx)] = (layout, tag)


class AttentionPattern:
    """Finds dot_general → softmax → dot_general attention and replaces it."""

    name = "attention"

    def __init__(self, graph: Graph, *, legacy_attrs: bool = False, target: str = "cpu"):
        self.g = graph
        self.folder = Folder(graph)
        self.legacy_attrs = legacy_attrs
        self.target = target

    # ------------------------------------------------------------------ candidates
    def is_candidate(self, op) -> bool:
        """Does this dot_general's result reach a softmax (or a second batched product)?"""
        if op_name(op) != "stablehlo.dot_general":
            return False
        batched = bool(self._dims(op)[0])
        frontier, seen = [Ref(op.result)], set()
        for _ in range(16):
            nxt = []
            for ref in frontier:
                for user, idx, ctx in self.g.users(ref):
                    name = op_name(user)
                    key = (user.operation, ctx)
                    if key in seen:
                        continue
                    seen.add(key)
                    if name == "stablehlo.exponential":
                        return True
                    if name == "stablehlo.reduce" and reduce_kind(user) == "maximum":
                        return True
                    if name == "stablehlo.logistic" and batched:
                        return True
                    if name == "stablehlo.dot_general":
                        if batched and self._dims(user)[0]:
                            return True
                        continue
                    if name in _ELEMENTWISE or name in _LAYOUT_OPS:
                        nxt.extend(Ref(r, ctx) for r in user.results)
            frontier = nxt
            if not frontier:
                break
        return False

    @staticmethod
    def _dims(op):
        dn = stablehlo.DotDimensionNumbers(op.operation.attributes["dot_dimension_numbers"])
        return (list(dn.lhs_batching_dimensions), list(dn.rhs_batching_dimensions),
                list(dn.lhs_contracting_dimensions), list(dn.rhs_contracting_dimensions))

    # ------------------------------------------------------------------ match
    def match(self, op):
        """An AttentionSite, a Rejection, or None when ``op`` is no attention candidate."""
        if not self.is_candidate(op):
            return None
        fn = self.g.function_of(op)
        where = dict(location=str(op.location), function=self.g.function_name(fn),
                     op=_describe_op(op, self.g.asm_state(fn)))
        m = _Match()
        try:
            site = self._match(op, m, where)
        except Reject as e:
            details = {k: v for k, v in e.details.items() if v is not None}
            return Rejection(where["location"], where["function"], where["op"], e.reason,
                             matched=m.matched, details=details)
        site.notes = m.notes
        return site

    def _match(self, dot1, m: _Match, where: dict) -> AttentionSite:
        for v in list(dot1.operands) + [dot1.result]:
            t = v.type
            if not isinstance(t, ir.RankedTensorType) or not t.has_static_shape:
                raise Reject("dynamic shapes are not supported")
        lb, rb, lc, rc = self._dims(dot1)
        lhs, rhs = dot1.operands
        ls, rs = _shape(lhs), _shape(rhs)
        lfree = [i for i in range(len(ls)) if i not in lb and i not in lc]
        rfree = [i for i in range(len(rs)) if i not in rb and i not in rc]
        sizes = {}
        lhs_layout, rhs_layout = [None] * len(ls), [None] * len(rs)
        for i, (a, b) in enumerate(zip(lb, rb)):
            sizes[f"B{i}"] = ls[a]
            lhs_layout[a] = rhs_layout[b] = L.whole(f"B{i}", ls[a])
        for i, (a, b) in enumerate(zip(lc, rc)):
            sizes[f"C{i}"] = ls[a]
            lhs_layout[a] = rhs_layout[b] = L.whole(f"C{i}", ls[a])
        for j, a in enumerate(lfree):
            sizes[f"L{j}"] = ls[a]
            lhs_layout[a] = L.whole(f"L{j}", ls[a])
        for j, b in enumerate(rfree):
            sizes[f"R{j}"] = rs[b]
            rhs_layout[b] = L.whole(f"R{j}", rs[b])
        scores_layout = tuple([L.whole(f"B{i}", ls[a]) for i, a in enumerate(lb)]
                              + [L.whole(f"L{j}", ls[a]) for j, a in enumerate(lfree)]
                              + [L.whole(f"R{j}", rs[b]) for j, b in enumerate(rfree)])
        m.add(dot1, ())
        m.dot1 = dot1
        m.matched.append("Q·K product")

        # 1. scores -> softmax entry
        x, x_layout = self._walk_scores(m, Ref(dot1.result), scores_layout)
        # 2. the softmax
        p, p_layout, R = self._softmax(m, x, x_layout)
        m.matched.append("softmax")
        # 3. probabilities -> P·V product
        dot2, p_idx, dot2_ctx = self._walk_probs(m, p, p_layout)
        m.matched.append("P·V product")
        if dot2_ctx:
            raise Reject("the P·V product is inside a called function; the site spans functions")
        # 4. roles
        r_labels = {pc[0] for pc in R}
        if any(lbl[0] in "BC" for lbl in r_labels):
            raise Reject("the softmax reduces over a batch or head axis")
        l_labels = {f"L{j}" for j in range(len(lfree))} - {k for k in sizes if sizes[k] == 1}
        r_side = {f"R{j}" for j in range(len(rfree))} - {k for k in sizes if sizes[k] == 1}
        if r_labels and r_labels <= r_side:
            k_side, q_labels, k_labels = "rhs", l_labels, r_side
        elif r_labels and r_labels <= l_labels:
            k_side, q_labels, k_labels = "lhs", r_side, l_labels
        else:
            raise Reject("the softmax axis mixes axes of both operands of the Q·K product")
        if r_labels != k_labels or _covered(R) != {lbl: sizes[lbl] for lbl in k_labels}:
            raise Reject("the softmax normalizes over only part of the key axes",
                         softmax_axes=_pieces_text(R))
        # 5. P·V product dimension roles
        v_ref, v_layout, out_layout = self._pv_roles(m, dot2, p_idx, p_layout, R, sizes)
        # 6. exit chain
        exit_op, exit_value, exit_layout = self._exit(m, dot2, out_layout)
        # 7. inputs
        q_val, k_val = (rhs, lhs) if k_side == "lhs" else (lhs, rhs)
        q_lay, k_lay = (rhs_layout, lhs_layout) if k_side == "lhs" else (lhs_layout, rhs_layout)
        q_in = self._walk_input(Ref(q_val), tuple(q_lay), scale=True, bcast=False)
        k_in = self._walk_input(Ref(k_val), tuple(k_lay), scale=True, bcast=True)
        v_in = self._walk_input(v_ref, v_layout, scale=False, bcast=True)
        if L.common_refinement((k_in[3],), (v_in[3],)) is None or \
                _covered(k_in[3]) != _covered(v_in[3]):
            k_in = self._walk_input(Ref(k_val), tuple(k_lay), scale=True, bcast=False)
            v_in = self._walk_input(v_ref, v_layout, scale=False, bcast=False)
        if q_in[2] != 1.0 and k_in[2] != 1.0:
            m.notes.append("scale split between Q and K")
        if _covered(k_in[3]):
            m.notes.append("K/V broadcast over heads (GQA) read through")
        scale = m.scale * q_in[2] * k_in[2]
        if m.softcap:
            # c·tanh(pre·qk): the kernel's scale is pre·c, its softcap c
            scale *= m.softcap
        # 8. closure: no intermediate may have a user outside the site
        self._check_closure(m, exit_op)
        # 9. mask, kernel layout, limits
        return self._plan(m, where, dot1, sizes, q_labels, k_labels, R, q_in, k_in, v_in,
                          exit_op, exit_value, exit_layout, scale)

    # ------------------------------------------------------------------ scores
    def _walk_scores(self, m: _Match, ref: Ref, layout):
        for _ in range(MAX_CHAIN):
            m.record(ref, layout, "scores")
            users = list(self.g.users(ref))
            if not users:
                raise Reject("the scores are never used")
            if self._is_softmax_entry(m, users):
                if m.tanh and not m.softcap:
                    raise Reject("the scores pass through tanh without a multiply by a constant "
                                 "cap after it (not a softcap c·tanh(x/c))")
                return ref, layout
            steps = [u for u in users if op_name(u[0]) in _SCORE_STEPS]
            if len(steps) != 1:
                if not steps:
                    raise Reject(self._why_not_softmax(users))
                raise Reject(f"the scores have {len(users)} users "
                             f"({', '.join(op_name(u[0]) for u in users)})")
            user, idx, ctx = steps[0]
            layout = self._score_step(m, user, idx, ctx, layout)
            m.add(user, ctx)
            ref = Ref(user.results[0], ctx)
        raise Reject("the chain from the scores to the softmax is too long")

    @staticmethod
    def _why_not_softmax(users) -> str:
        names = [op_name(u[0]) for u in users]
        for name in names:
            if name == "stablehlo.negate" and any(
                    op_name(u2) == "stablehlo.exponential"
                    for u in users for r in u[0].results for u2, _ in
                    [(x.owner, None) for x in r.uses]):
                return "the scores go through exp(-x), a sigmoid, not a softmax (sigmoid attention)"
            if name == "stablehlo.logistic":
                return "the scores go through a sigmoid, not a softmax (sigmoid attention)"
            if name == "stablehlo.dot_general":
                return "no softmax between the two products (linear attention?)"
            if name == "func.return":
                return "the scores are returned; no softmax follows"
        return f"the scores pass through {names[0]} before any softmax"

    def _is_softmax_entry(self, m: _Match, users) -> bool:
        for user, idx, ctx in users:
            name = op_name(user)
            if name == "stablehlo.exponential":
                return True
            if name == "stablehlo.reduce" and reduce_kind(user) == "maximum":
                return True
            if name == "stablehlo.subtract" and idx == 0:
                other = Ref(user.operands[1], ctx)
                if self.folder.fold(other) is None:
                    # the row maximum comes from the scores; a run-time bias does not
                    r = self.g.resolve(other)
                    if r.ctx or not self._independent(m, r.value):
                        return True
        return False

    def _score_step(self, m: _Match, user, idx: int, ctx, layout):
        name = op_name(user)
        if name == "stablehlo.convert":
            if _elt(user.result) not in _FLOAT_TYPES:
                raise Reject("the scores are converted to a non-float type")
            return layout
        if name in ("stablehlo.transpose", "stablehlo.reshape", "stablehlo.broadcast_in_dim"):
            return self._layout_step(user, layout, what="scores")
        other = Ref(user.operands[1 - idx], ctx) if len(user.operands) == 2 else None
        if name == "stablehlo.tanh":
            if m.tanh:
                raise Reject("the scores pass through tanh twice")
            if m.biases or any(isinstance(x, X.ValueBias) for x in m.extras):
                raise Reject("the scores get an additive bias before the softcap's tanh (the "
                             "kernel caps before adding a bias)")
            if m.masks or m.extras:
                raise Reject("the scores are masked before the softcap's tanh (the kernel caps "
                             "before masking)")
            m.tanh = True
            m.matched.append("softcap tanh")
            return layout
        if m.tanh and name in ("stablehlo.multiply", "stablehlo.divide"):
            if m.softcap or name == "stablehlo.divide":
                raise Reject("the scores are scaled after the softcap's tanh (only c·tanh(x/c) "
                             "is supported)")
            c = self._uniform(other, "softcap")
            if not (c > 0 and np.isfinite(c)):
                raise Reject(f"the softcap {c:g} is not a finite positive number")
            m.softcap = c
            m.matched.append("softcap")
            return layout
        if name == "stablehlo.multiply" or (name == "stablehlo.divide" and idx == 0):
            s = self._uniform(other, "scale")
            if s == 0 or not np.isfinite(s):
                raise Reject(f"the scores are scaled by {s}")
            m.scale = m.scale * s if name == "stablehlo.multiply" else m.scale / s
            m.matched.append("scale")
            return layout
        if name in ("stablehlo.select", "stablehlo.add", "stablehlo.subtract") and m.tanh \
                and not m.softcap:
            raise Reject("the scores are masked or biased between the softcap's tanh and its "
                         "multiply by the cap")
        if name == "stablehlo.select" and idx in (1, 2):
            fill = self.folder.fold(Ref(user.operands[3 - idx], ctx))
            if fill is None or not fill.uniform:
                raise Reject("the masked-out fill value is not a constant")
            value = float(fill.scalar())
            if not value <= LARGE_NEGATIVE:
                raise Reject(f"the mask fill value {value:g} is not a large negative number")
            self._mask_terms(m, Ref(user.operands[0], ctx), layout, idx == 2, 0)
            m.matched.append("mask")
            return layout
        if name == "stablehlo.add" or (name == "stablehlo.subtract" and idx == 0):
            self._bias_terms(m, other, layout, -1.0 if name == "stablehlo.subtract" else 1.0, 0)
            m.matched.append("bias")
            return layout
        raise Reject(f"the scores pass through {name}")

    # ------------------------------------------------------------------ masks and biases
    def _mask_terms(self, m: _Match, ref: Ref, layout, negate: bool, depth: int) -> None:
        """Record a select's predicate (visible where true, or false with ``negate``): constant
        conjuncts as masks, run-time conjuncts as mask / segment-id operands."""
        if depth > MAX_CHAIN:
            raise Reject("the mask expression is too deep to analyse")
        c = self.folder.fold(ref)
        if c is not None:
            visible = c.array.astype(bool)
            m.masks.append((Const(~visible if negate else visible, c.shape), layout, "select"))
            return
        op, r = self.g.producer(ref)
        name = op_name(op) if op is not None else None
        if name == ("stablehlo.or" if negate else "stablehlo.and"):
            for x in op.operands:   # a conjunction (De Morgan under a negation)
                self._mask_terms(m, Ref(x, r.ctx), layout, negate, depth + 1)
            return
        if name == "stablehlo.not":
            return self._mask_terms(m, Ref(op.operands[0], r.ctx), layout, not negate, depth + 1)
        if name in ("stablehlo.broadcast_in_dim", "stablehlo.transpose", "stablehlo.reshape"):
            back = self._back(op, layout)
            if back is not None:
                return self._mask_terms(m, Ref(op.operands[0], r.ctx), back, negate, depth + 1)
        if name == "stablehlo.compare" and _direction(op) in ("EQ", "NE"):
            # x != 0 / x == 0 of a boolean converted to numbers (flax's float masks)
            for i in (0, 1):
                zero = self.folder.fold(Ref(op.operands[1 - i], r.ctx))
                if zero is None or not zero.uniform or float(zero.scalar()) != 0:
                    continue
                found = self._bool_of(Ref(op.operands[i], r.ctx), layout)
                if found is not None:
                    return self._mask_terms(m, found[0], found[1],
                                            negate != (_direction(op) == "EQ"), depth + 1)
        leaf = self._value_mask(m, ref, layout, negate)
        if name == "stablehlo.compare" and not negate and _direction(op) == "EQ" and \
                _elt(op.operands[0]).lstrip("u").startswith("i") and _elt(op.operands[0]) != "i1":
            sides = [self._source(m, Ref(x, r.ctx), layout)[0] for x in op.operands]
            if all(sd is not None for sd in sides):
                m.extras.append(X.SegmentIds((sides[0][0], sides[0][1]),
                                             (sides[1][0], sides[1][1]), leaf))
                return
        if leaf is None:
            raise Reject("the mask is computed inside a called function from values of that "
                         "function")
        m.extras.append(leaf)
        m.notes.append("run-time mask passed as an operand")

    def _bool_of(self, ref: Ref, layout):
        """(Ref, layout) of the i1 value that ``ref`` converts to numbers (through layout
        ops and float converts), or None."""
        r = ref
        for _ in range(MAX_CHAIN):
            op, r = self.g.producer(r)
            if op is None:
                return None
            name = op_name(op)
            if name in ("stablehlo.broadcast_in_dim", "stablehlo.transpose", "stablehlo.reshape"):
                layout = self._back(op, layout)
                if layout is None:
                    return None
                r = Ref(op.operands[0], r.ctx)
                continue
            if name == "stablehlo.convert":
                src = _elt(op.operands[0])
                if src == "i1":
                    return Ref(op.operands[0], r.ctx), layout
                if src in _WIDTH and _elt(op.result) in _WIDTH:
                    r = Ref(op.operands[0], r.ctx)
                    continue
            return None
        return None

    def _value_mask(self, m: _Match, ref: Ref, layout, negate: bool):
        found, _ = self._source(m, ref, layout)
        if found is None:
            return None
        value, lay, _ = found
        return X.ValueMask(value, lay, negate)

    def _bias_terms(self, m: _Match, ref: Ref, layout, factor: float, depth: int) -> None:
        """Record what is added to the scores (times ``factor``): constant terms, masks spelled
        as 0 / -inf biases, run-time terms."""
        if depth > MAX_CHAIN:
            raise Reject("the additive bias expression is too deep to analyse")
        c = self.folder.fold(ref)
        if c is not None:
            b = c.array.astype(np.float64) * factor
            masked = b <= LARGE_NEGATIVE
            if np.any(masked):
                m.masks.append((Const(~masked, c.shape), layout, "bias"))
                b = np.where(masked, 0.0, b)
            if np.any(b != 0):
                m.biases.append(X.ConstBias(Const(b, c.shape), layout, 1.0, m.scale))
            return
        found, (r, lay, f) = self._source(m, ref, layout, scale=True)
        op = None if isinstance(r.value, ir.BlockArgument) else r.value.owner
        name = op_name(op) if op is not None else None
        f *= factor
        if name in ("stablehlo.add", "stablehlo.subtract") and f == 1.0:
            # a sum of terms (e.g. ALiBi + a padding bias): each one on its own
            self._bias_terms(m, Ref(op.operands[0], r.ctx), lay, 1.0, depth + 1)
            self._bias_terms(m, Ref(op.operands[1], r.ctx), lay,
                             -1.0 if name == "stablehlo.subtract" else 1.0, depth + 1)
            return
        if name == "stablehlo.select":
            a = self.folder.fold(Ref(op.operands[1], r.ctx))
            b = self.folder.fold(Ref(op.operands[2], r.ctx))
            if a is not None and b is not None and a.uniform and b.uniform:
                va, vb = float(a.scalar()) * f, float(b.scalar()) * f
                if va == 0 and vb <= LARGE_NEGATIVE:    # where(p, 0, -inf): visible = p
                    return self._mask_terms(m, Ref(op.operands[0], r.ctx), lay, False, depth + 1)
                if vb == 0 and va <= LARGE_NEGATIVE:
                    return self._mask_terms(m, Ref(op.operands[0], r.ctx), lay, True, depth + 1)
        if found is None:
            raise Reject("the additive bias is computed inside a called function from values "
                         "of that function")
        value, lay, f = found
        m.extras.append(X.ValueBias(value, lay, f * factor, m.scale))
        m.notes.append("run-time additive bias passed as an operand")

    def _source(self, m: _Match, ref: Ref, layout, *, scale: bool = False):
        """Walk back from a bias/mask operand through layout ops (and, with ``scale``,
        multiplies by constants). Returns ((value, layout, factor) of the last value seen in
        the site's own function, proven independent of the Q·K product, or None), and
        (Ref, layout, factor) where the walk stopped."""
        best, factor = None, 1.0
        r = ref
        for _ in range(MAX_CHAIN):
            if not r.ctx:
                best = (r.value, layout, factor)
            r = self.g.resolve(r)
            if not r.ctx:
                best = (r.value, layout, factor)
            v = r.value
            if isinstance(v, ir.BlockArgument):
                break
            op = v.owner
            name = op_name(op)
            if name in ("stablehlo.broadcast_in_dim", "stablehlo.transpose", "stablehlo.reshape"):
                back = self._back(op, layout)
                if back is None:
                    break
                layout, r = back, Ref(op.operands[0], r.ctx)
                continue
            if name == "stablehlo.convert":
                src, dst = _elt(op.operands[0]), _elt(v)
                if not _widening(src, dst):
                    break
                r = Ref(op.operands[0], r.ctx)
                continue
            if scale and name in ("stablehlo.multiply", "stablehlo.divide"):
                found = None
                for i in ((0, 1) if name == "stablehlo.multiply" else (1,)):
                    c = self.folder.fold(Ref(op.operands[i], r.ctx))
                    if c is not None and c.uniform and np.isfinite(float(c.scalar())) and \
                            float(c.scalar()) != 0:
                        found = (i, float(c.scalar()))
                        break
                if found is None:
                    break
                i, k = found
                factor = factor * k if name == "stablehlo.multiply" else factor / k
                r = Ref(op.operands[1 - i], r.ctx)
                continue
            if scale and name == "stablehlo.negate":
                factor, r = -factor, Ref(op.operands[0], r.ctx)
                continue
            break
        if best is not None and not self._independent(m, best[0]):
            raise Reject("the bias or mask depends on the scores (computed from the Q·K product)")
        return best, (r, layout, factor)

    @staticmethod
    def _back(op, layout):
        """The layout of a layout op's operand given its result's (size-1 dims hold no piece),
        or None where a reshape mixes axes."""
        name = op_name(op)
        if name == "stablehlo.transpose":
            perm = _ints(op.operation.attributes["permutation"])
            out = [()] * len(perm)
            for i, pp in enumerate(perm):
                out[pp] = layout[i]
            return tuple(out)
        if name == "stablehlo.reshape":
            return L.regroup(layout, _shape(op.operands[0]))
        dims = _ints(op.operation.attributes["broadcast_dimensions"])
        src, dst = _shape(op.operands[0]), _shape(op.result)
        return tuple(layout[d] if src[i] == dst[d] else () for i, d in enumerate(dims))

    def _independent(self, m: _Match, value) -> bool:
        """Can ``value`` (in the site's function) be computed without the Q·K product? Ops
        before the product in its block (or outside its region) are; others are followed back
        to their operands."""
        dot1 = m.dot1.operation
        home = dot1.block
        outer = set()
        o = dot1
        while o.parent is not None and o.parent.name != "func.func":
            o = o.parent
            outer.add(o.block)
        stack, seen = [value], set()
        while stack:
            v = stack.pop()
            if v == m.dot1.result:
                return False
            if isinstance(v, ir.BlockArgument):
                continue
            op = v.owner.operation
            key = hash(op)
            if key in seen:
                continue
            seen.add(key)
            if len(seen) > 4096:
                return False
            blk = op.block
            if blk == home:
                if op.is_before_in_block(dot1):
                    continue
            elif blk in outer:
                continue
            stack.extend(op.operands)
        return True

    def _uniform(self, ref: Ref, what: str) -> float:
        c = self.folder.fold(ref)
        if c is None:
            raise Reject(f"the {what} is known only at run time")
        if not c.uniform:
            raise Reject(f"the {what} is not a single number (a per-element tensor)")
        return float(c.scalar())

    def _layout_step(self, user, layout, *, what: str):
        name = op_name(user)
        if name == "stablehlo.transpose":
            return L.transpose(layout, _ints(user.operation.attributes["permutation"]))
        if name == "stablehlo.reshape":
            out = L.regroup(layout, _shape(user.result))
            if out is None:
                raise Reject(f"a reshape of the {what} mixes axes")
            return out
        if name == "stablehlo.broadcast_in_dim":
            dims = _ints(user.operation.attributes["broadcast_dimensions"])
            src, dst = _shape(user.operands[0]), _shape(user.result)
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

    # ------------------------------------------------------------------ softmax
    def _softmax(self, m: _Match, x: Ref, x_layout):
        # the row max may be taken on one view of the scores and subtracted from another
        # (JAX transposes between the two): follow the non-reduce users through layout ops
        for _ in range(MAX_CHAIN):
            users = list(self.g.users(x))
            if any(op_name(u[0]) in ("stablehlo.subtract", "stablehlo.exponential") for u in users):
                break
            views = [u for u in users if op_name(u[0]) in (
                "stablehlo.transpose", "stablehlo.reshape", "stablehlo.convert",
                "stablehlo.broadcast_in_dim")]
            if len(views) != 1:
                raise Reject("the row maximum is not subtracted from the scores before the "
                             "exponential")
            user, _, ctx = views[0]
            if op_name(user) == "stablehlo.convert" and _elt(user.result) not in _FLOAT_TYPES:
                raise Reject("the scores are converted to a non-float type")
            x_layout = self._layout_step(user, x_layout, what="scores")
            m.add(user, ctx)
            x = Ref(user.results[0], ctx)
            m.record(x, x_layout, "scores")
        subs = [u for u in users if op_name(u[0]) == "stablehlo.subtract" and u[1] == 0]
        shift = None
        if subs:
            # with several (a backward pass also subtracts), take the one by a row-wise value
            first_error = None
            for sub, _, ctx in subs:
                saved = set(m.ops)
                try:
                    shift = self._term(m, Ref(sub.operands[1], ctx))
                except Reject as e:
                    m.ops, first_error = saved, first_error or e
                    continue
                if not shift.full:
                    break
                m.ops, shift = saved, None
            if shift is None:
                raise first_error or Reject("the value subtracted before the exponential is not "
                                            "constant along the softmax axis")
            m.add(sub, ctx)
            d = Ref(sub.result, ctx)
            m.record(d, x_layout, "scores")
            exps = [u for u in self.g.users(d) if op_name(u[0]) == "stablehlo.exponential"]
            if not exps:
                raise Reject("the scores minus the row maximum do not go into an exponential")
        else:
            exps = [u for u in users if op_name(u[0]) == "stablehlo.exponential"]
            if not exps:
                raise Reject("no exponential follows the row maximum")
            m.notes.append("softmax without max subtraction")
        exp, _, ctx = exps[0]
        m.add(exp, ctx)
        e = Ref(exp.result, ctx)
        m.record(e, x_layout, "exp")
        # e and its converts; one of them is divided (or multiplied by the reciprocal)
        views, candidates = [e], []
        i = 0
        while i < len(views):
            for user, idx, uctx in self.g.users(views[i]):
                name = op_name(user)
                if name == "stablehlo.convert" and _elt(user.result) in _FLOAT_TYPES:
                    m.add(user, uctx)
                    r = Ref(user.result, uctx)
                    m.record(r, x_layout, "exp")
                    views.append(r)
                elif name in ("stablehlo.divide", "stablehlo.multiply") and (
                        idx == 0 or name == "stablehlo.multiply"):
                    den = Ref(user.operands[1 - idx], uctx)
                    if (den.value, den.ctx) not in m.chain:
                        candidates.append((user, den, uctx))
            i += 1
        if not candidates:
            raise Reject("the exponentials are not divided by their row sum (not a softmax)")
        # with several (a backward pass also multiplies them), take the one by the row sum
        first_error = None
        for user, den, uctx in candidates:
            saved = set(m.ops)
            try:
                R = self._normalizer(m, user, den, x_layout)
            except Reject as e_:
                m.ops, first_error = saved, first_error or e_
                continue
            m.add(user, uctx)
            break
        else:
            raise first_error
        if shift is not None and (shift.full or not self._rowwise_ok(shift.layout, x_layout, R)):
            raise Reject("the value subtracted before the exponential is not constant along "
                         "the softmax axis")
        p = Ref(user.result, uctx)
        m.record(p, x_layout, "probs")
        return p, x_layout, R

    def _normalizer(self, m: _Match, user, den: Ref, x_layout):
        """Check ``user`` (divide or multiply) normalizes by the row sum; return R."""
        term = self._term(m, den)
        sums = [r for r in term.reduces if r[0] == "add" and r[1] == "exp"]
        if len(term.reduces) != 1 or not sums or term.full:
            raise Reject("the softmax denominator is not the row sum of the exponentials")
        recip = term.ops.count("reciprocal") % 2
        if (op_name(user) == "stablehlo.divide") == bool(recip):
            raise Reject("the softmax denominator is not the row sum of the exponentials")
        if any(o not in ("stablehlo.convert", "stablehlo.broadcast_in_dim", "stablehlo.reshape",
                         "stablehlo.transpose", "reciprocal") for o in term.ops):
            raise Reject("the softmax denominator is modified after the row sum")
        R = sums[0][2]
        if not self._rowwise_ok(term.layout, x_layout, R):
            raise Reject("the softmax denominator is not broadcast along the summed axis")
        return R

    @staticmethod
    def _rowwise_ok(term_layout, x_layout, R) -> bool:
        """term broadcast along every dim that holds a piece of R, equal to x elsewhere."""
        if len(term_layout) != len(x_layout):
            return False
        fixed = [d for d in term_layout if d is not None]
        refined = L.common_refinement(tuple(fixed), tuple(x_layout), (tuple(R),))
        if refined is None:
            return False
        cuts = L.boundaries([tuple(fixed), tuple(x_layout), (tuple(R),)])
        r_set = set(L.refine_dim(tuple(R), cuts))
        for t, xd in zip(term_layout, x_layout):
            xs = L.refine_dim(xd, cuts)
            holds_r = any(p in r_set for p in xs)
            if t is None:
                continue
            if holds_r:
                return False
            if L.refine_dim(t, cuts) != xs:
                return False
        return True

    def _term(self, m: _Match, ref: Ref, depth: int = 0) -> _Term:
        """Analyse a value computed from chain values by elementwise ops and reductions."""
        if depth > 40:
            raise Reject("the softmax bookkeeping is too deep to analyse")
        r = self.g.resolve(ref)
        hit = m.chain.get((r.value, r.ctx))
        if hit is not None:
            return _Term(hit[0], True, [], [], hit[1])
        c = self.folder.fold(r)
        if c is not None:
            if not c.uniform:
                raise Reject("the softmax's row statistics use a non-uniform constant")
            return _Term(tuple([None] * len(c.shape)), False, [], [])
        if isinstance(r.value, ir.BlockArgument):
            raise Reject("the softmax uses a value from outside the attention site")
        op = r.value.owner
        name = op_name(op)
        m.add(op, r.ctx)
        if name == "stablehlo.reduce":
            kind = reduce_kind(op)
            if kind is None:
                raise Reject("the softmax uses an unsupported reduction")
            init = self.folder.fold(Ref(op.operands[1], r.ctx))
            if init is None:
                raise Reject("a softmax reduction has a runtime initial value")
            src = self._term(m, Ref(op.operands[0], r.ctx), depth + 1)
            if not src.full:
                raise Reject("the softmax reduces a row-wise value again")
            dims = _ints(op.operation.attributes["dimensions"])
            reduced = tuple(p for i in dims for p in (src.layout[i] or ()))
            if any(src.layout[i] is None for i in dims):
                raise Reject("the softmax reduces a broadcast axis")
            if kind == "add" and float(init.scalar()) != 0.0:
                raise Reject("the softmax sum starts from a nonzero value")
            tag = src.tag
            out = tuple(d for i, d in enumerate(src.layout) if i not in dims)
            return _Term(out, False, [(kind, tag, reduced)], [])
        if name in ("stablehlo.transpose", "stablehlo.reshape", "stablehlo.broadcast_in_dim",
                    "stablehlo.convert"):
            src = self._term(m, Ref(op.operands[0], r.ctx), depth + 1)
            lay = self._term_layout_step(op, src.layout)
            return _Term(lay, src.full, src.reduces, src.ops + [name], src.tag)
        if name in _ELEMENTWISE:
            parts = [self._term(m, Ref(x, r.ctx), depth + 1) for x in op.operands]
            lay = _merge_layouts([t.layout for t in parts])
            if lay is None:
                raise Reject("the softmax combines misaligned values")
            ops = [o for t in parts for o in t.ops]
            if name == "stablehlo.divide" and not parts[0].reduces and not parts[0].full:
                ops.append("reciprocal")  # const / x
            else:
                ops.append(name)
            return _Term(lay, any(t.full for t in parts), [x for t in parts for x in t.reduces], ops)
        raise Reject(f"the softmax's row max/sum is computed through {name}, not from the "
                     "scores alone")

    @staticmethod
    def _tag_of(m: _Match, ref: Ref) -> str | None:
        hit = m.chain.get((ref.value, ref.ctx))
        return hit[1] if hit else None

    @staticmethod
    def _term_layout_step(op, layout):
        name = op_name(op)
        if name == "stablehlo.convert":
            return layout
        if name == "stablehlo.transpose":
            return L.transpose(layout, _ints(op.operation.attributes["permutation"]))
        if name == "stablehlo.reshape":
            dst = _shape(op.result)
            src = _shape(op.operands[0])
            lay = tuple(() if d is None and n == 1 else d for d, n in zip(layout, src))
            out = L.regroup(lay, dst)
            if out is None:
                raise Reject("a reshape in the softmax mixes axes")
            return out
        dims = _ints(op.operation.attributes["broadcast_dimensions"])
        src, dst = _shape(op.operands[0]), _shape(op.result)
        out = [None] * len(dst)
        for d in range(len(dst)):
            if dst[d] == 1:
                out[d] = ()
        for i, d in enumerate(dims):
            out[d] = layout[i] if src[i] == dst[d] else None
        return tuple(out)

    # ------------------------------------------------------------------ probabilities
    def _walk_probs(self, m: _Match, p: Ref, layout):
        for _ in range(MAX_CHAIN):
            users = list(self.g.users(p))
            steps = [u for u in users if op_name(u[0]) in _PROB_STEPS]
            if len(steps) != 1:
                if not users:
                    raise Reject("the probabilities are never used")
                raise Reject(self._why_not_pv(users, p))
            user, idx, ctx = steps[0]
            name = op_name(user)
            m.add(user, ctx)
            if name == "stablehlo.dot_general":
                m.probs_layout = layout
                return user, idx, ctx
            if name == "stablehlo.select":
                if idx == 0:
                    raise Reject("the probabilities are used as a predicate")
                other = self.folder.fold(Ref(user.operands[3 - idx], ctx))
                if other is None or not other.uniform or float(other.scalar()) != 0.0:
                    raise Reject(self._dropout_or(p, "the probabilities are selected against "
                                                     "a non-zero value"))
                try:
                    pred = self._term(m, Ref(user.operands[0], ctx))
                except Reject:
                    raise Reject(self._dropout_or(p, "the probabilities are masked after the "
                                                     "softmax")) from None
                if pred.full:
                    raise Reject(self._dropout_or(p, "the probabilities are masked after the "
                                                     "softmax"))
                m.guards.append((pred, layout))
                m.notes.append("fully-masked-row guard after the softmax")
            elif name == "stablehlo.convert":
                if _elt(user.result) not in _FLOAT_TYPES:
                    raise Reject("the probabilities are converted to a non-float type")
            else:
                layout = self._layout_step(user, layout, what="probabilities")
            p = Ref(user.results[0], ctx)
            m.record(p, layout, "probs")
        raise Reject("the chain from the softmax to the P·V product is too long")

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
                                _elt(x) in ("i1", "f32", "bf16", "f16") and \
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
            if op_name(op) in _RNG_OPS:
                return True
            stack.extend(Ref(x, r.ctx) for x in op.operands)
        return False

    def _pv_roles(self, m: _Match, dot2, p_idx: int, p_layout, R, sizes):
        """Check the P·V product; return V (Ref, layout) and the product's result layout."""
        p_layout = m.probs_layout
        for t, at in m.guards:
            if not self._rowwise_ok(t.layout, at, R):
                raise Reject("the fully-masked-row guard is not constant along the softmax axis")
        lb, rb, lc, rc = self._dims(dot2)
        pb, vb, pc, vc = (lb, rb, lc, rc) if p_idx == 0 else (rb, lb, rc, lc)
        v_val = dot2.operands[1 - p_idx]
        ps, vs = _shape(dot2.operands[p_idx]), _shape(v_val)
        contracted = tuple(pc_ for i in pc for pc_ in p_layout[i])
        refined = L.common_refinement((contracted,), (tuple(R),))
        if refined is None or sorted(refined[0][0]) != sorted(refined[1][0]):
            ax = _pieces_text(contracted)
            raise Reject("the softmax is over the query axis: it normalizes over "
                         f"{_pieces_text(R)} but the P·V product contracts {ax}"
                         if any(pc_[0][0] in "LR" for pc_ in contracted) else
                         f"the P·V product contracts {ax}, not the softmax axis {_pieces_text(R)}")
        for i in range(len(ps)):
            if i in pb or i in pc:
                continue
            if any(pc_[0][0] == "B" for pc_ in p_layout[i]):
                raise Reject("a batch/head axis of the probabilities is not batched in the "
                             "P·V product")
        v_layout = [None] * len(vs)
        for a, b in zip(pb, vb):
            v_layout[b] = p_layout[a]
        for a, b in zip(pc, vc):
            v_layout[b] = p_layout[a]
        vfree = [i for i in range(len(vs)) if i not in vb and i not in vc]
        for j, b in enumerate(vfree):
            sizes[f"V{j}"] = vs[b]
            v_layout[b] = L.whole(f"V{j}", vs[b])
        pfree = [i for i in range(len(ps)) if i not in pb and i not in pc]
        batch = [p_layout[a] for a in pb]
        p_free = [p_layout[a] for a in pfree]
        v_free = [L.whole(f"V{j}", vs[b]) for j, b in enumerate(vfree)]
        out = batch + (p_free + v_free if p_idx == 0 else v_free + p_free)
        return Ref(v_val), tuple(v_layout), tuple(out)

    def _exit(self, m: _Match, dot2, layout):
        op, value = dot2, dot2.result
        while True:
            uses = self.g.raw_users(value)
            if len(uses) != 1:
                break
            user = uses[0][0]
            name = op_name(user)
            if name not in ("stablehlo.transpose", "stablehlo.reshape", "stablehlo.convert"):
                break
            if name == "stablehlo.convert" and _elt(user.result) not in _FLOAT_TYPES:
                break
            if name == "stablehlo.reshape" and L.regroup(layout, _shape(user.result)) is None:
                break
            layout = self._layout_step(user, layout, what="output")
            m.add(user, ())
            op, value = user, user.result
        return op, value, layout

    # ------------------------------------------------------------------ inputs
    def _walk_input(self, ref: Ref, layout, *, scale: bool, bcast: bool):
        """Look back from a product's operand through layout ops, upcasts, constant
        scales and (for K/V) head broadcasts. Returns (value, layout, scale, absent pieces)."""
        value, factor, absent = ref.value, 1.0, ()
        for _ in range(MAX_CHAIN):
            if isinstance(value, ir.BlockArgument):
                break
            op = value.owner
            name = op_name(op)
            if name == "stablehlo.convert":
                src, dst = _elt(op.operands[0]), _elt(value)
                if src not in _WIDTH or dst not in _WIDTH or _WIDTH[src] >= _WIDTH[dst]:
                    break
                value = op.operands[0]
                continue
            if name == "stablehlo.transpose":
                perm = _ints(op.operation.attributes["permutation"])
                inv = [0] * len(perm)
                for i, pp in enumerate(perm):
                    inv[pp] = i
                layout = L.transpose(layout, inv)
                value = op.operands[0]
                continue
            if name == "stablehlo.reshape":
                new = L.regroup(layout, _shape(op.operands[0]))
                if new is None:
                    break
                layout, value = new, op.operands[0]
                continue
            if name == "stablehlo.broadcast_in_dim" and bcast:
                dims = _ints(op.operation.attributes["broadcast_dimensions"])
                src, dst = _shape(op.operands[0]), _shape(value)
                lost = [p for d in range(len(dst)) if d not in dims for p in layout[d]]
                new = []
                for i, d in enumerate(dims):
                    if src[i] == dst[d]:
                        new.append(layout[d])
                    else:
                        new.append(())
                        lost.extend(layout[d])
                if any(p[0][0] != "B" for p in lost):
                    break
                layout, value = tuple(new), op.operands[0]
                absent = absent + tuple(lost)
                continue
            if name in ("stablehlo.multiply", "stablehlo.divide") and scale:
                found = None
                for i in ((0, 1) if name == "stablehlo.multiply" else (1,)):
                    c = self.folder.fold(Ref(op.operands[i], ()))
                    if c is not None and c.uniform and float(c.scalar()) > 0 and \
                            np.isfinite(float(c.scalar())):
                        found = (i, float(c.scalar()))
                        break
                if found is None:
                    break
                i, s = found
                factor = factor * s if name == "stablehlo.multiply" else factor / s
                value = op.operands[1 - i]
                continue
            break
        return value, tuple(layout), factor, tuple(absent)

    # ------------------------------------------------------------------ closure
    def _check_closure(self, m: _Match, exit_op) -> None:
        exit_key = exit_op.operation
        tags = {k: v[1] for k, v in m.chain.items()}
        for op, ctx in list(m.ops):
            if op == exit_key and not ctx:
                continue
            for res in op.results:
                for user, idx, uctx in self.g.users(Ref(res, ctx)):
                    if (user.operation, uctx) in m.ops:
                        continue
                    what = {"scores": "the scores", "exp": "the exponentials",
                            "probs": "the probabilities"}.get(
                        tags.get((res, ctx)), "an intermediate of the softmax")
                    if op_name(user) == "func.return":
                        fn = user.operation.parent.operation
                        raise Reject(f"{what} are returned as output {idx} of "
                                     f"@{self.g.function_name(fn)}")
                    raise Reject(f"{what} have another user ({op_name(user)} at "
                                 f"{short_location(user)})")

    # ------------------------------------------------------------------ plan
    def _plan(self, m, where, dot1, sizes, q_labels, k_labels, R, q_in, k_in, v_in,
              exit_op, exit_value, exit_layout, scale) -> AttentionSite:
        q_val, q_lay, _, q_abs = q_in
        k_val, k_lay, _, k_abs = k_in
        v_val, v_lay, _, v_abs = v_in
        if q_abs:
            raise Reject("the query is broadcast")
        mask_layouts = [lay for _, lay, _ in m.masks] + [b.layout for b in m.biases] + \
            X.layouts(m.extras)
        everything = [q_lay, k_lay, v_lay, exit_layout, (k_abs,), (v_abs,), (tuple(R),)] + mask_layouts
        cuts = L.boundaries(everything)
        if cuts is None:
            raise Reject("the axes are split inconsistently between the pieces of the site")
        q_lay, k_lay, v_lay, exit_layout = (L.refine(x, cuts) for x in (q_lay, k_lay, v_lay, exit_layout))
        absent = set(L.refine_dim(k_abs, cuts))
        qp, kp, vp = L.pieces(q_lay), L.pieces(k_lay), L.pieces(v_lay)
        q_free = [p for p in qp if p[0] in q_labels]
        k_free = [p for p in kp if p[0] in k_labels]
        c_pieces = [p for p in qp if p[0][0] == "C"]
        v_pieces = [p for p in vp if p[0][0] == "V"]
        batching = [p for p in qp if p[0][0] == "B"]

        # mask -> causal / window attributes, or a constant mask operand
        band_masks, const_masks = m.masks, []
        try:
            causal, bottom_right, q_seq, window = masks.classify(m.masks, cuts, q_free, k_free)
        except masks.NotBand as e:
            causal, bottom_right, q_seq, window = False, False, [], (-1, -1)
            band_masks, const_masks = [], m.masks
            m.notes.append(f"constant mask passed as an operand ({e.reason})")
        if not q_seq and q_free:
            # without a band any split is correct: name the query axis that a constant bias,
            # constant mask or segment ids vary along the sequence, else the largest
            hint = self._seq_hint(m, const_masks, cuts, q_free)
            q_seq = [hint if hint is not None else
                     max(q_free, key=lambda p: (p[2], -qp.index(p)))]
        group_q = [p for p in q_free if p not in q_seq]
        first_seq = min((qp.index(p) for p in q_seq), default=len(qp))
        kv_batch = [p for p in batching if p not in absent]
        b_pieces = [p for p in kv_batch if qp.index(p) < first_seq]
        held = self._held_pieces(m, const_masks, cuts)
        if held is not None and len(b_pieces) > 1:
            # an extra operand is [1|B, 1|H, Sq, Sk]: keep the heads it does not vary along
            # out of the batch, or it would be materialized once per head
            last = max((i for i, p in enumerate(b_pieces) if p in held), default=0)
            b_pieces = b_pieces[:last + 1]
        hkv = [p for p in kv_batch if p not in b_pieces]
        group = sorted([p for p in batching if p in absent] + group_q, key=qp.index)
        hq = hkv + group
        kernel = {
            "q": (tuple(b_pieces), tuple(q_seq), tuple(hq), tuple(c_pieces)),
            "k": (tuple(b_pieces), tuple(k_free), tuple(hkv), tuple(c_pieces)),
            "v": (tuple(b_pieces), tuple(k_free), tuple(hkv), tuple(v_pieces)),
            "o": (tuple(b_pieces), tuple(q_seq), tuple(hq), tuple(v_pieces)),
        }
        for name, lay in (("q", q_lay), ("k", k_lay), ("v", v_lay), ("o", exit_layout)):
            if sorted(L.pieces(lay)) != sorted(L.pieces(kernel[name])):
                raise Reject(f"the {'output' if name == 'o' else name} layout does not map onto "
                             f"the kernel's [batch, seq, heads, head_dim]",
                             layout=L.describe(lay))
        dims = {k: [prod(pc[2] for pc in d) for d in v] for k, v in kernel.items()}
        _, seq_q, _, head_dim = dims["q"]
        seq_k = dims["k"][1]
        head_dim_v = dims["v"][3]
        # logical sizes for the report: the outermost batching axis is the batch, every
        # other batching axis and the query's extra axes are heads (GQA groups included)
        first = batching[:1]
        batch = prod(p[2] for p in first)
        heads = prod(p[2] for p in batching[1:]) * prod(p[2] for p in group_q)
        kv_heads = heads // prod(p[2] for p in group)
        # dtype
        dts = [_elt(x) for x in (q_val, k_val, v_val)]
        for dt in dts:
            if dt not in _KERNEL_DTYPES:
                raise Reject(f"element type {dt} is not supported (f16, bf16, f32)")
        dtype = dts[0] if len(set(dts)) == 1 else "f32"
        details = dict(q_shape=_shape(q_val), head_dim=head_dim, dtype=dtype)
        if head_dim != head_dim_v:
            raise Reject(f"the value head dim ({head_dim_v}) differs from the query/key head dim "
                         f"({head_dim})", **details)
        if head_dim not in HEAD_DIMS:
            raise Reject(f"head dim {head_dim} is not supported (supported: "
                         f"{', '.join(map(str, HEAD_DIMS))})", **details)
        if not (scale > 0 and np.isfinite(scale)):
            raise Reject(f"the scale {scale:g} is not a finite positive number", **details)
        resolved = X.resolve(m.extras, m.biases, const_masks, cuts=cuts,
                             kernel_q=kernel["q"], k_free=tuple(k_free), final_scale=m.scale,
                             causal=causal, bottom_right=bottom_right, window=window,
                             kernel_dtype=dtype)
        bottom_right = resolved.bottom_right
        m.notes.extend(resolved.notes)
        spec = KernelSpec(head_dim, dtype, causal, self.target)
        layout_text = _layout_letters(q_lay, first, q_seq, batching[1:] + group_q, c_pieces)
        plan = Plan(dot1=dot1, exit_op=exit_op, exit_value=exit_value, exit_layout=exit_layout,
                    inputs={"q": (q_val, q_lay), "k": (k_val, k_lay), "v": (v_val, v_lay)},
                    kernel=kernel, spec=spec, scale=float(np.float32(scale)),
                    bottom_right=bottom_right, site_ops=set(m.ops), window=tuple(window),
                    softcap=float(np.float32(m.softcap)), extras=resolved)
        return AttentionSite(
            location=where["location"], function=where["function"], op=where["op"],
            q_shape=_shape(q_val), k_shape=_shape(k_val), v_shape=_shape(v_val),
            out_shape=_shape(exit_value), layout=layout_text, dtype=dtype, batch=batch,
            seq_q=seq_q, seq_k=seq_k, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
            causal=causal, bottom_right=bottom_right, scale=float(np.float32(scale)),
            target=spec.target_name("fwd"), spec=spec.to_json(), plan=plan,
            window=list(window), softcap=float(np.float32(m.softcap)),
            extras=list(resolved.names), extras_detail=list(resolved.describe))

    @staticmethod
    def _held_pieces(m: _Match, const_masks, cuts):
        """The pieces the extra operands vary along (None without extras)."""
        if not (m.extras or m.biases or const_masks):
            return None
        held = set()
        consts = [(b.const.array, b.layout) for b in m.biases] + \
            [(c.array, lay) for c, lay, _ in const_masks]
        for arr, lay in consts:
            for i, d in enumerate(L.refine(lay, cuts)):
                if arr.shape[i] > 1:
                    held |= set(d)
        for lay in X.layouts(m.extras):
            held |= set(L.pieces(L.refine(lay, cuts)))
        return held

    @staticmethod
    def _seq_hint(m: _Match, const_masks, cuts, q_free):
        """The one query piece that a constant bias / mask or segment ids vary along, or None."""
        found = set()
        q_set = set(q_free)
        consts = [(b.const.array, b.layout) for b in m.biases] + \
            [(c.array, lay) for c, lay, _ in const_masks]
        for arr, lay in consts:
            for i, d in enumerate(L.refine(lay, cuts)):
                if arr.shape[i] > 1:
                    found |= {p for p in d if p in q_set}
        for it in m.extras:
            if isinstance(it, X.SegmentIds):
                for _, lay in (it.a, it.b):
                    found |= {p for p in L.pieces(L.refine(lay, cuts)) if p in q_set}
        return found.pop() if len(found) == 1 else None

    # ------------------------------------------------------------------ rewrite
    def rewrite(self, site: AttentionSite) -> None:
        """Insert the custom call and its adapters before the site's exit; redirect uses.

        Dead ops are removed by the driver afterwards.
        """
        from flashgen.emit import emit_custom_call
        plan: Plan = site.plan
        exit_op = plan.exit_op
        loc = ir.Location.name("flashgen.attention", childLoc=plan.dot1.location)
        kdt = ir.Type.parse(plan.spec.dtype)
        created = []
        with loc, ir.InsertionPoint(exit_op.operation):
            try:
                operands = []
                for name in ("q", "k", "v"):
                    value, lay = plan.inputs[name]
                    x = adapters.adapt(value, lay, plan.kernel[name], created)
                    if str(x.type.element_type) != plan.spec.dtype:
                        x = adapters.convert(x, kdt, created)
                    operands.append(x)
                names = plan.extras.names if plan.extras is not None else ()
                if names:
                    operands += X.emit(plan.extras, plan.spec.dtype, created)
                o, lse = emit_custom_call(plan.spec, "fwd", operands, scale=plan.scale,
                                          bottom_right=plan.bottom_right, window=plan.window,
                                          softcap=plan.softcap, extras=names,
                                          legacy_attrs=self.legacy_attrs)
                created.append(o.owner)
                out = adapters.adapt(o, plan.kernel["o"], plan.exit_layout, created,
                             final_shape=_shape(plan.exit_value))
                want = plan.exit_value.type.element_type
                if out.type.element_type != want:
                    out = adapters.convert(out, want, created)
            except Exception:
                for op in reversed(created):
                    op.operation.erase()
                raise
        plan.exit_value.replace_all_uses_with(out)


# which users continue a chain in each phase
_SCORE_STEPS = {"stablehlo.convert", "stablehlo.transpose", "stablehlo.reshape",
                "stablehlo.broadcast_in_dim", "stablehlo.multiply", "stablehlo.divide",
                "stablehlo.select", "stablehlo.add", "stablehlo.subtract", "stablehlo.tanh"}
_PROB_STEPS = {"stablehlo.convert", "stablehlo.transpose", "stablehlo.reshape",
               "stablehlo.broadcast_in_dim", "stablehlo.select", "stablehlo.dot_general"}


def _direction(op) -> str:
    return str(op.operation.attributes["comparison_direction"]).split()[-1].strip(">").upper()


def _widening(src: str, dst: str) -> bool:
    """A convert that keeps every value: float to a wider float, integer to a wider integer
    of the same signedness, i1 to i1."""
    if src in _WIDTH and dst in _WIDTH:
        return _WIDTH[src] <= _WIDTH[dst] and not (src == "bf16" and dst == "f16")
    ints = {"i8": 8, "i16": 16, "i32": 32, "i64": 64}
    if src.lstrip("u") in ints and dst.lstrip("u") in ints:
        return src.startswith("u") == dst.startswith("u") and \
            ints[src.lstrip("u")] <= ints[dst.lstrip("u")]
    return src == dst


def _merge_layouts(layouts):
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


def _covered(pieces) -> dict:
    """label -> product of the sizes of its pieces."""
    out: dict = {}
    for label, _, size in pieces:
        out[label] = out.get(label, 1) * size
    return out


def _pieces_text(pieces) -> str:
    names = sorted({_AXIS_NAMES.get(p[0][0], p[0][0]) + p[0][1:] for p in pieces})
    return "axes " + ", ".join(names) if names else "no axis"


_AXIS_NAMES = {"B": "batch", "L": "lhs-free", "R": "rhs-free", "C": "contracting", "V": "value"}


def _layout_letters(q_lay, b, s, h, d) -> str:
    role = {}
    for pieces_, letter in ((b, "B"), (s, "S"), (h, "H"), (d, "D")):
        for p in pieces_:
            role[p] = letter
    out = []
    for dim in q_lay:
        letters = []
        for p in dim:
            if role.get(p) and role[p] not in letters:
                letters.append(role[p])
        if not letters:
            out.append("1")
        elif len(letters) == 1:
            out.append(letters[0])
        else:
            out.append("(" + "".join(letters) + ")")
    return "".join(out)


def _describe_op(op, state) -> str:
    try:
        return f"{op.result.get_name(state)} = {op_name(op)}"
    except Exception:  # noqa: BLE001 - naming is best effort; fall back to the op name
        return op_name(op)
