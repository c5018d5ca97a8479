"""The Plan of a matched site: what rewrite() needs, composed from the variants' plan steps.

``build`` folds STEPS over an immutable Draft: first the site's common refinement of axes,
then the band variant (causal / window attributes: it names the query sequence axis), the
kernel layout and dtype (here), then every other variant's step in
flashgen.rewrite.variants.PLAN_VARIANTS order.
Each step reads the stages' findings (Site) and returns a new Draft; none changes the IR.
"""
from __future__ import annotations

import dataclasses
from math import prod
from typing import Optional

import numpy as np
from jaxlib.mlir import ir

from flashgen.contract import ATTRIBUTES
from flashgen.rewrite import extras as X
from flashgen.rewrite import layout as L
from flashgen.rewrite.chain import KERNEL_DTYPES, elt, shape_of
from flashgen.rewrite.errors import Reject
from flashgen.rewrite.report import AttentionSite
from flashgen.rewrite.variants import BAND_VARIANTS, PLAN_VARIANTS
from flashgen.rewrite.variants.state import Scores
from flashgen.spec import KernelSpec, kernel_head_dim, kernel_head_dims


# emit_custom_call takes the window as one keyword, the pair of the contract's attributes
WINDOW = ("window_left", "window_right")


def default(name: str):
    """The contract's default of an attribute the plan names by emit's keyword (which emit
    applies where a site leaves it unset)."""
    if name == "window":
        return tuple(ATTRIBUTES[n].default for n in WINDOW)
    return ATTRIBUTES[name].default if name in ATTRIBUTES else None


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
    attributes: dict          # the call's attributes the variants set (emit's keywords)
    site_ops: set             # {(ir.Operation, ctx)} the site's own ops
    extras: object = None     # extras.Resolved: the operands after q, k, v
    empty_rows: str = "none"  # rows without a visible key: empty_rows.behaviour()
    backward: object = None   # backward.Backward: a training site's VJP cluster
    runtime_scales: tuple = ()  # (scalar value, divide): multiplied into Q before the call
    head_dim_v: int = 0       # the model's value head dim (its output's last kernel dim)

    def attribute(self, name: str):
        return self.attributes.get(name, default(name))

    # the band's attributes, which the empty-row fix-up reads too
    bottom_right = property(lambda self: self.attribute("bottom_right"))
    window = property(lambda self: self.attribute("window"))

    @property
    def scale(self) -> float:
        return self.attributes["scale"]

    @scale.setter
    def scale(self, value: float) -> None:
        # what a deliberately wrong rewrite changes (the --verify tests)
        self.attributes["scale"] = value


@dataclasses.dataclass(frozen=True)
class Site:
    """What the stages found, as the plan steps read it."""
    scores: Scores
    q: tuple                  # (value, layout, constant scale, absent pieces) of Q's source
    k: tuple
    v: tuple
    exit_layout: tuple
    q_labels: frozenset       # the Q·K product's axes that are the query's / key's
    k_labels: frozenset
    softmax_axes: tuple       # R
    max_subtracted: bool      # the softmax subtracts a row max
    masked_sum: bool          # the row sum adds only the unmasked exponentials
    remasked: bool            # the probabilities are masked again by the scores' mask
    guarded: bool             # a fully-masked-row guard zeroes probabilities after the softmax

    @property
    def q_scale(self) -> float:
        return self.q[2]

    @property
    def k_scale(self) -> float:
        return self.k[2]


@dataclasses.dataclass(frozen=True)
class Draft:
    """The plan as the steps build it (each returns a copy)."""
    attributes: dict = dataclasses.field(default_factory=dict)  # what the variants set
    scale_factor: float = 1.0   # what variants fold into the kernel's scale (a cap)
    causal: bool = False
    # the refined axes (_refine)
    cuts: object = None
    layouts: dict = dataclasses.field(default_factory=dict)   # 'q'|'k'|'v'|'o' -> refined
    q_free: tuple = ()
    k_free: tuple = ()
    absent: frozenset = frozenset()
    # the band variant: the query sequence axis it runs along, the masks that are no band
    q_seq: tuple = ()
    const_masks: tuple = ()
    # the kernel layout (_kernel)
    kernel: Optional[dict] = None
    dtype: str = ""
    seq_q: int = 0
    seq_k: int = 0
    head_dim_v: int = 0
    details: dict = dataclasses.field(default_factory=dict)   # for a Rejection
    report: dict = dataclasses.field(default_factory=dict)    # AttentionSite's sizes
    # the other variants
    runtime_scales: tuple = ()
    extras: Optional[X.Resolved] = None
    empty_rows: str = "none"
    notes: tuple = ()

    def attribute(self, name: str):
        return self.attributes.get(name, default(name))

    def but(self, *, note: str | None = None, notes=(), attrs=None, **changes) -> "Draft":
        """A copy with ``changes``, the call attributes ``attrs`` set and the notes added."""
        if attrs:
            changes["attributes"] = {**self.attributes, **attrs}
        extra = tuple(notes) + ((note,) if note else ())
        if extra:
            changes["notes"] = self.notes + extra
        return dataclasses.replace(self, **changes)


def _refine(site: Site, draft: Draft) -> Draft:
    """Every layout of the site cut at the same piece boundaries."""
    q_val, q_lay, _, q_abs = site.q
    _, k_lay, _, k_abs = site.k
    _, v_lay, _, v_abs = site.v
    if q_abs:
        raise Reject("the query is broadcast")
    sc = site.scores
    mask_layouts = [lay for _, lay, _ in sc.masks] + [b.layout for b in sc.biases] + \
        X.layouts(sc.extras)
    everything = [q_lay, k_lay, v_lay, site.exit_layout, (k_abs,), (v_abs,),
                  (tuple(site.softmax_axes),)] + mask_layouts
    cuts = L.boundaries(everything)
    if cuts is None:
        raise Reject("the axes are split inconsistently between the pieces of the site")
    layouts = {n: L.refine(x, cuts) for n, x in
               (("q", q_lay), ("k", k_lay), ("v", v_lay), ("o", site.exit_layout))}
    return draft.but(cuts=cuts, layouts=layouts,
                     q_free=tuple(p for p in L.pieces(layouts["q"]) if p[0] in site.q_labels),
                     k_free=tuple(p for p in L.pieces(layouts["k"]) if p[0] in site.k_labels),
                     absent=frozenset(L.refine_dim(k_abs, cuts)))


def _kernel(site: Site, draft: Draft) -> Draft:
    """The kernel's [batch, seq, heads, head_dim] of Q, K, V and the output, the dtype, and
    the sizes the report gives."""
    q_lay, k_lay, v_lay, exit_layout = (draft.layouts[n] for n in "qkvo")
    qp, vp = L.pieces(q_lay), L.pieces(v_lay)
    q_free, k_free = list(draft.q_free), list(draft.k_free)
    c_pieces = [p for p in qp if p[0][0] == "C"]
    v_pieces = [p for p in vp if p[0][0] == "V"]
    batching = [p for p in qp if p[0][0] == "B"]
    q_seq = list(draft.q_seq)
    if not q_seq and q_free:
        # without a band any split is correct: name the query axis that a constant bias,
        # constant mask or segment ids vary along the sequence, else the largest
        hint = _seq_hint(site.scores, draft.const_masks, draft.cuts, q_free)
        q_seq = [hint if hint is not None else
                 max(q_free, key=lambda p: (p[2], -qp.index(p)))]
    group_q = [p for p in q_free if p not in q_seq]
    first_seq = min((qp.index(p) for p in q_seq), default=len(qp))
    kv_batch = [p for p in batching if p not in draft.absent]
    b_pieces = [p for p in kv_batch if qp.index(p) < first_seq]
    held = _held_pieces(site.scores, draft.const_masks, draft.cuts)
    if held is not None and len(b_pieces) > 1:
        # an extra operand is [1|B, 1|H, Sq, Sk]: keep the heads it does not vary along
        # out of the batch, or it would be materialized once per head
        last = max((i for i, p in enumerate(b_pieces) if p in held), default=0)
        b_pieces = b_pieces[:last + 1]
    hkv = [p for p in kv_batch if p not in b_pieces]
    group = sorted([p for p in batching if p in draft.absent] + group_q, key=qp.index)
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
    # logical sizes for the report: the outermost piece of the Q·K product's first
    # batching dim is the batch, every other batching piece and the query's extra axes
    # are heads (GQA groups included). Ordered by the product's dims, not by where the
    # pieces sit in Q's source: vmap puts the mapped batch anywhere in it.
    by_dim = sorted(batching, key=lambda p: (int(p[0][1:]), -p[1]))
    first, rest = by_dim[:1], by_dim[1:]
    heads = prod(p[2] for p in rest) * prod(p[2] for p in group_q)
    values = [site.q[0], site.k[0], site.v[0]]
    dts = [elt(x) for x in values]
    for dt in dts:
        if dt not in KERNEL_DTYPES:
            raise Reject(f"element type {dt} is not supported (f16, bf16, f32)")
    dtype = dts[0] if len(set(dts)) == 1 else "f32"
    details = dict(q_shape=shape_of(site.q[0]), head_dim=head_dim, dtype=dtype)
    try:   # finish() specializes at the kernel head dims; the adapters pad and slice
        padded, padded_v = kernel_head_dim(head_dim), kernel_head_dim(head_dim_v)
    except ValueError as e:
        raise Reject(str(e), **details) from None
    report = dict(layout=_layout_letters(q_lay, first, q_seq, rest + group_q, c_pieces),
                  batch=prod(p[2] for p in first), heads=heads,
                  kv_heads=heads // prod(p[2] for p in group), head_dim=head_dim)
    note = (f"head dim {head_dim} runs at the kernel's {padded}: Q, K, V get zero columns "
            "and the extra output columns are sliced off") if padded != head_dim else None
    if head_dim_v != head_dim:
        note = "; ".join(filter(None, [note, f"value head dim {head_dim_v}" + (
            f" runs at the kernel's {padded_v}" if padded_v != head_dim_v else "")]))
    return draft.but(q_seq=tuple(q_seq), kernel=kernel, dtype=dtype, seq_q=seq_q,
                     seq_k=seq_k, head_dim_v=head_dim_v, details=details, report=report, note=note)


STEPS = (_refine, *(v.plan for v in BAND_VARIANTS), _kernel, *(v.plan for v in PLAN_VARIANTS))


def build(site: Site) -> Draft:
    draft = Draft()
    for step in STEPS:
        draft = step(site, draft)
    return draft


def finish(site: Site, draft: Draft, *, target: str, where: dict, dot1, exit_op, exit_value,
           site_ops) -> AttentionSite:
    """The AttentionSite, its Plan attached."""
    head_dim, head_dim_v = kernel_head_dims(draft.report["head_dim"], draft.head_dim_v, target)
    spec = KernelSpec(head_dim, draft.dtype, draft.causal, target, head_dim_v)
    if kernel_head_dim(draft.report["head_dim"]) != kernel_head_dim(draft.head_dim_v) and head_dim == head_dim_v:
        draft = draft.but(note=f"target {target} has no kernels for a value head dim other than the "
                               f"query/key one: both run at {head_dim} (zero columns, sliced off)")
    # as the call carries them: f32, the window a pair
    attributes = {k: float(np.float32(x)) if isinstance(x, float) else
                  tuple(x) if isinstance(x, (list, tuple)) else x
                  for k, x in draft.attributes.items()}
    plan = Plan(dot1=dot1, exit_op=exit_op, exit_value=exit_value,
                exit_layout=draft.layouts["o"],
                inputs={n: (x[0], draft.layouts[n]) for n, x in zip("qkv", (site.q, site.k, site.v))},
                kernel=draft.kernel, spec=spec, attributes=attributes, site_ops=set(site_ops),
                extras=draft.extras, empty_rows=draft.empty_rows,
                runtime_scales=tuple(draft.runtime_scales), head_dim_v=draft.head_dim_v)
    resolved = draft.extras
    return AttentionSite(
        location=where["location"], function=where["function"], op=where["op"],
        q_shape=shape_of(site.q[0]), k_shape=shape_of(site.k[0]), v_shape=shape_of(site.v[0]),
        out_shape=shape_of(exit_value), dtype=draft.dtype, seq_q=draft.seq_q,
        seq_k=draft.seq_k, causal=draft.causal, target=spec.target_name("fwd"),
        spec=spec.to_json(), plan=plan, extras=list(resolved.names),
        extras_detail=list(resolved.describe), empty_rows=draft.empty_rows, notes=list(draft.notes),
        **draft.report, **_reported(plan))


def _reported(plan: Plan) -> dict:
    """The call's attributes that the report has a field for (scale, window, ...), as JSON."""
    attributes = {"window", *ATTRIBUTES} - {"causal", "extras"}   # causal: the spec's
    return {f.name: list(x) if isinstance(x, tuple) else x
            for f in dataclasses.fields(AttentionSite) if f.name in attributes
            for x in [plan.attribute(f.name)]}


def _held_pieces(scores: Scores, const_masks, cuts):
    """The pieces the extra operands vary along (None without extras)."""
    if not (scores.extras or scores.biases or const_masks):
        return None
    held = set()
    consts = [(b.const.array, b.layout) for b in scores.biases] + \
        [(c.array, lay) for c, lay, _ in const_masks]
    for arr, lay in consts:
        for i, d in enumerate(L.refine(lay, cuts)):
            if arr.shape[i] > 1:
                held |= set(d)
    for lay in X.layouts(scores.extras):
        held |= set(L.pieces(L.refine(lay, cuts)))
    return held


def _seq_hint(scores: Scores, const_masks, cuts, q_free):
    """The one query piece that a constant bias / mask or segment ids vary along, or None."""
    found = set()
    q_set = set(q_free)
    consts = [(b.const.array, b.layout) for b in scores.biases] + \
        [(c.array, lay) for c, lay, _ in const_masks]
    for arr, lay in consts:
        for i, d in enumerate(L.refine(lay, cuts)):
            if arr.shape[i] > 1:
                found |= {p for p in d if p in q_set}
    for it in scores.extras:
        if isinstance(it, X.SegmentIds):
            for _, lay in (it.a, it.b):
                found |= {p for p in L.pieces(L.refine(lay, cuts)) if p in q_set}
    return found.pop() if len(found) == 1 else None


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
