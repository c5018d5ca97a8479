"""The extra operands of a site (README "Variants"): ALiBi slopes, an additive bias, a boolean
mask, segment ids.

While it walks the scores, the matcher records what is added to them or masks them
(flashgen.rewrite.patterns):

  ConstBias   a compile-time additive bias (its large negative / -inf entries are recorded as
              masks; this is the finite rest)
  ValueBias   an additive bias computed at run time: a value of the function, walked back through
              layout ops to its most compact form, times a constant factor
  ValueMask   a boolean conjunct of a select's predicate known only at run time
  SegmentIds  a conjunct ``ids_a == ids_b`` of two run-time integer tensors, one along the
              query axis, one along the key axis (packed sequences)

Once the kernel roles are known, ``resolve`` turns them into the kernel's operands:

  * the constant biases are summed in the kernel's [1|B, 1|Hq, Sq, Sk] form. If, on every
    visible entry, the sum equals -slope_h·|i + off - j| up to a per-row constant (softmax
    ignores those) it becomes ``alibi`` with f32 [Hq] (or [B, Hq]) slopes; if it is a
    per-row constant only, it is dropped; otherwise it is a constant ``bias`` operand;
  * run-time biases become ``bias`` (added together with a constant bias that is no ALiBi),
    [1|B, 1|Hq, 1|Sq, Sk]: a key-only one is not broadcast over the queries;
  * run-time masks, segment ids that do not fit [B, Sq] / [B, Sk], and constant masks that are
    no causal/window band become one ``mask`` (their AND);
  * one segment-id pair becomes ``segment_ids`` (i32).

Nothing here touches the module: ``resolve`` returns recipes that ``emit`` (called by the
pattern's rewrite) turns into ops.
"""
from __future__ import annotations

import dataclasses
from math import prod
from typing import Optional

import numpy as np
from jaxlib.mlir import ir

from flashgen.rewrite import adapters, empty_rows
from flashgen.rewrite import layout as L
from flashgen.rewrite.errors import Reject
from flashgen.rewrite.fold import Const

ALIBI_RTOL = 1e-5          # |fit error| <= ALIBI_RTOL * max(1, max |bias|) on visible entries


@dataclasses.dataclass
class ConstBias:
    const: Const
    layout: tuple
    factor: float          # sign of a subtract, constant multiplies on the way
    at_scale: float        # the scores' accumulated scale where it was added


@dataclasses.dataclass
class ValueBias:
    value: ir.Value
    layout: tuple
    factor: float
    at_scale: float
    views: tuple = ()      # (value, layout, factor) of each step from the term as added back
    #                        to ``value``: a training graph may differentiate any of them


@dataclasses.dataclass
class ValueMask:
    value: ir.Value
    layout: tuple
    negate: bool = False


@dataclasses.dataclass
class SegmentIds:
    a: tuple               # (value, layout)
    b: tuple
    fallback: Optional[ValueMask]   # the comparison itself, as a plain mask


def layouts(items) -> list:
    """Every layout the items use (for the site's common refinement)."""
    out = []
    for it in items:
        if isinstance(it, SegmentIds):
            out += [it.a[1], it.b[1]]
            if it.fallback is not None:
                out.append(it.fallback.layout)
        else:
            out.append(it.layout)
    return out


@dataclasses.dataclass
class Resolved:
    names: tuple                      # canonical order: alibi, bias, mask, segment_ids
    recipes: list                     # per name: what emit() builds
    bottom_right: bool
    notes: list
    describe: list                    # per name: a short text for the report
    kernel_q: tuple = ()              # the kernel's q dims (pieces), for emit()
    k_free: tuple = ()
    bias_views: dict = dataclasses.field(default_factory=dict)
    # run-time bias source -> [(view value, its refined layout, the factor the kernel's
    # bias holds it with)] for the views (ValueBias.views) that map onto the kernel operand:
    # where a training graph's bias gradient may be taken (emit_bias_grads)
    const_empty: Optional[np.ndarray] = None
    # [1|B, 1|Hq, Sq] bool: the query rows that the constant masks alone (causal / window
    # attributes, a constant mask operand) leave without a visible key; None if there are none


def _groups(kernel_q, k_free, *, bias=False):
    """The kernel operand's dims as groups of pieces (adapters.target_recipe); a bias also
    broadcasts over the queries: a key-only bias (BLOOM's ALiBi from a padded batch's
    positions) stays [.., 1, Sk], O(Sk)."""
    b, s, h, _ = kernel_q
    return [(tuple(b), False), (tuple(h), False), (tuple(s), not bias), (tuple(k_free), True)]


def _fit(fn, *args):
    try:
        return fn(*args)
    except ValueError as e:
        raise Reject(f"an extra operand cannot be laid out as the kernel's: {e}") from None


def resolve(items, const_biases, const_masks, *, cuts, kernel_q, k_free, final_scale: float,
            causal: bool, bottom_right: bool, window, kernel_dtype: str) -> Resolved:
    """Kernel operands for the recorded extras. ``const_masks``: the (Const visible, layout,
    how) of constant masks that are no causal/window band (ANDed into the mask operand)."""
    groups = _groups(kernel_q, k_free)
    bias_groups = _groups(kernel_q, k_free, bias=True)
    b_pieces, q_seq, hq, _ = kernel_q
    sq = prod(p[2] for p in q_seq)
    sk = prod(p[2] for p in k_free)
    nb = prod(p[2] for p in b_pieces)
    nh = prod(p[2] for p in hq)
    notes, recipes, names, describe = [], {}, [], {}
    from flashgen.rewrite import masks as M
    visible = M.visible(sq, sk, causal, bottom_right, window)[None, None]
    const_mask = None
    for const, lay, _ in const_masks:
        cm = _fit(adapters.np_to_kernel, const.array.astype(bool), L.refine(lay, cuts), groups)
        const_mask = cm if const_mask is None else (const_mask & cm)
    if const_mask is not None:
        if const_mask.all():
            const_mask = None
        else:
            visible = visible & const_mask
    # query rows the constant masks (band attributes and a constant mask operand) leave
    # without a visible key: the kernel's 0 there is fixed up like a run-time mask's empty
    # rows (flashgen.rewrite.empty_rows)
    const_empty = ~visible.any(axis=-1)                            # [1|B, 1|Hq, Sq]
    const_empty = _compact(const_empty[..., None])[..., 0] if const_empty.any() else None

    # ---- constant biases: ALiBi, dropped, or a constant operand
    bias_parts = []
    if const_biases:
        total = None
        for cb in const_biases:
            arr = cb.const.array.astype(np.float64) * (cb.factor * final_scale / cb.at_scale)
            k = _fit(adapters.np_to_kernel, arr, L.refine(cb.layout, cuts), groups)
            total = k if total is None else total + k
        vis = np.broadcast_to(visible, np.broadcast_shapes(visible.shape, total.shape))
        total = np.broadcast_to(total, vis.shape)
        if not np.all(np.isfinite(total[vis])):
            raise Reject("the constant bias has non-finite entries where the scores are visible")
        aligned = causal or tuple(window) != (-1, -1)
        offsets = [sk - sq if bottom_right else 0] if aligned else sorted({0, sk - sq},
                                                                           key=abs)
        fit = alibi_fit(total, vis, offsets)
        if fit is not None and not np.any(fit[0]):
            notes.append("the constant bias is constant along each row (softmax ignores it): "
                         "dropped")
        elif fit is not None:
            slopes, off = fit
            if not aligned and off != 0:
                bottom_right = True
            slopes = np.broadcast_to(slopes, (slopes.shape[0], nh))
            if slopes.shape[0] == 1 or np.all(slopes == slopes[:1]):
                slopes = slopes[0]
            else:
                slopes = np.broadcast_to(slopes, (nb, nh))
            slopes = np.ascontiguousarray(slopes, dtype=np.float32)
            names.append("alibi")
            recipes["alibi"] = ("const", slopes)
            describe["alibi"] = f"alibi slopes {list(slopes.shape)} (constant)"
        else:
            compact = _compact(np.where(vis, total, 0.0))
            bias_parts.append(("const", compact))

    # ---- run-time biases
    bias_views: dict = {}
    for it in items:
        if isinstance(it, ValueBias):
            _fit(adapters.target_recipe, L.refine(it.layout, cuts), bias_groups)
            bias_parts.append(("value", it.value, L.refine(it.layout, cuts),
                               it.factor * final_scale / it.at_scale))
            bias_views.setdefault(it.value, []).append(it)
    if bias_parts:
        names.append("bias")
        shape = _common_shape([_part_shape(p, bias_groups) for p in bias_parts])
        single = len(bias_parts) == 1 and bias_parts[0][0] == "value" and \
            bias_parts[0][3] == 1.0
        elt = str(bias_parts[0][1].type.element_type) if single else "f32"
        if elt not in ("f32", kernel_dtype):
            elt = "f32"
        recipes["bias"] = ("bias", bias_parts, shape, elt)
        bias_views = {src: [v for it in its for v in _mappable_views(it, cuts, bias_groups,
                                                                      final_scale, shape)]
                      for src, its in bias_views.items()}
        kinds = sorted({"constant" if p[0] == "const" else "runtime" for p in bias_parts})
        describe["bias"] = f"bias {_shape_text(shape)} {elt} ({' + '.join(kinds)})"

    # ---- masks and segment ids
    mask_parts = []
    if const_mask is not None:
        mask_parts.append(("const", _compact(const_mask)))
    segments = None
    for it in items:
        if isinstance(it, ValueMask):
            _fit(adapters.target_recipe, L.refine(it.layout, cuts), groups)
            mask_parts.append(("value", it.value, L.refine(it.layout, cuts), it.negate))
        elif isinstance(it, SegmentIds):
            sides = None if segments is not None else _segment_sides(it, cuts, kernel_q, k_free)
            if sides is not None:
                segments = sides
                continue
            if it.fallback is None:
                raise Reject("the segment-id comparison is computed inside a called function")
            fb = it.fallback
            _fit(adapters.target_recipe, L.refine(fb.layout, cuts), groups)
            mask_parts.append(("value", fb.value, L.refine(fb.layout, cuts), fb.negate))
    padding = None
    if segments is None and len(mask_parts) == 1 and mask_parts[0][0] == "value":
        _, value, lay, negate = mask_parts[0]
        if set(L.pieces(lay)) <= set(b_pieces) | set(k_free):
            # A key-padding mask ("key j is real"): segment ids with q id 1 and kv id = the
            # mask, O(B·Sk) instead of a [B, 1, Sq, Sk] operand; fully padded key blocks skip.
            padding, mask_parts = (value, lay, negate), []
    if mask_parts:
        names.append("mask")
        shape = _common_shape([_part_shape(p, groups) for p in mask_parts])
        recipes["mask"] = ("mask", mask_parts, shape)
        kinds = sorted({"constant" if p[0] == "const" else "runtime" for p in mask_parts})
        describe["mask"] = f"mask {_shape_text(shape)} ({' & '.join(kinds)})"
    if segments is not None:
        notes.append("segment ids: a run-time comparison of ids along the queries and the keys")
        names.append("segment_ids")
        recipes["segment_ids"] = ("segment_ids",) + segments
        describe["segment_ids"] = f"segment ids [{nb},{sq}] / [{nb},{sk}] i32 (runtime)"
    elif padding is not None:
        notes.append("a key-padding mask, passed as segment ids (q id 1, kv id = the mask)")
        names.append("segment_ids")
        recipes["segment_ids"] = ("padding",) + padding
        describe["segment_ids"] = f"key padding as segment ids [{nb},{sq}] / [{nb},{sk}] i32 (runtime)"
    return Resolved(tuple(names), [recipes[n] for n in names], bottom_right, notes,
                    [describe[n] for n in names], tuple(kernel_q), tuple(k_free), bias_views,
                    const_empty)


def _mappable_views(it: ValueBias, cuts, groups, final_scale: float, shape) -> list:
    """The term's views whose gradient the kernel's dbias (``shape``) holds: their layouts
    map onto the operand with the site's cuts (a view that splits an axis more finely than
    the site does keeps no place) and they vary along no dim the operand is broadcast
    along (dbias is summed over those)."""
    out = []
    for value, lay, factor in it.views or ((it.value, it.layout, it.factor),):
        refined = L.refine(lay, cuts)
        if any(d is None for d in refined) or \
                [prod(p[2] for p in d) for d in refined] != list(value.type.shape):
            continue
        try:
            final = adapters.target_recipe(refined, groups)[4]
        except ValueError:
            continue
        if all(f in (1, n) for f, n in zip(final, shape)):
            out.append((value, refined, factor * final_scale / it.at_scale))
    return out


def _compact(a: np.ndarray) -> np.ndarray:
    """Shrink the batch/head dims of a kernel-form array to 1 where it is constant along them."""
    for ax in (0, 1):
        if a.shape[ax] > 1 and np.all(a == np.take(a, [0], axis=ax)):
            a = np.take(a, [0], axis=ax)
    return np.ascontiguousarray(a)


def _part_shape(part, groups):
    if part[0] == "const":
        return tuple(part[1].shape)
    _, _, _, _, final = adapters.target_recipe(part[2], groups)
    return tuple(final)


def _common_shape(shapes):
    return tuple(max(s[i] for s in shapes) for i in range(4))


def _shape_text(shape) -> str:
    return "[" + ",".join(str(x) for x in shape) + "]"


def _segment_sides(it: SegmentIds, cuts, kernel_q, k_free):
    """((q value, layout), (kv value, layout)) when one side varies along batch and the query
    sequence only and the other along batch and the keys only; else None."""
    b_pieces, q_seq, _, _ = kernel_q
    q_ok = set(b_pieces) | set(q_seq)
    k_ok = set(b_pieces) | set(k_free)
    a = (it.a[0], L.refine(it.a[1], cuts))
    b = (it.b[0], L.refine(it.b[1], cuts))
    for q, k in ((a, b), (b, a)):
        qp, kp = set(L.pieces(q[1])), set(L.pieces(k[1]))
        if qp <= q_ok and kp <= k_ok and (qp & set(q_seq) or not q_seq) and kp & set(k_free):
            return q, k
    return None


def alibi_fit(F: np.ndarray, V: np.ndarray, offsets):
    """(slopes [nb, nh], offset) such that F == -slope·|i + offset - j| + a per-row constant on
    every entry where V holds (F [nb, nh, Sq, Sk], V bool of the same shape), or None."""
    nb, nh, sq, sk = F.shape
    if not V.any():
        return None
    tol = ALIBI_RTOL * max(1.0, float(np.abs(F[V]).max()))
    n = np.maximum(V.sum(-1, keepdims=True), 1)
    for off in offsets:
        D = np.abs(np.arange(sq)[:, None] + off - np.arange(sk)[None, :]).astype(np.float64)
        D = np.broadcast_to(D, F.shape)
        Fc = np.where(V, F - np.where(V, F, 0.0).sum(-1, keepdims=True) / n, 0.0)
        Dc = np.where(V, D - np.where(V, D, 0.0).sum(-1, keepdims=True) / n, 0.0)
        num = (Fc * Dc).sum((-1, -2))
        den = (Dc * Dc).sum((-1, -2))
        slopes = np.where(den > 0, -num / np.where(den > 0, den, 1.0), 0.0)
        resid = Fc + slopes[..., None, None] * Dc
        if np.all(np.abs(resid) <= tol):
            # an f32 slope must still fit
            s32 = slopes.astype(np.float32).astype(np.float64)
            if np.all(np.abs(Fc + s32[..., None, None] * Dc) <= tol):
                return s32, off
    return None


# ----------------------------------------------------------------------------- emission
def emit(resolved: Resolved, kernel_dtype, created, dynamic=None) -> list:
    """The extra operands (ir.Values, in ``resolved.names`` order); ops go to ``created``.
    ``dynamic`` (flashgen.rewrite.polymorphic.SymbolicSizes): a shape-polymorphic site, whose
    batch and sequence sizes are known at run time only (no constant mask or bias there)."""
    out = []
    f32 = ir.F32Type.get()
    i1 = ir.IntegerType.get_signless(1)
    i32 = ir.IntegerType.get_signless(32)
    groups, bias_groups = _groups_of(resolved), _groups_of(resolved, bias=True)
    b_pieces, q_seq, _, _ = resolved.kernel_q
    shaped = _Shaped(groups, created, dynamic)
    for name, recipe in zip(resolved.names, resolved.recipes):
        if name == "alibi":
            out.append(adapters.constant(recipe[1], f32, created))
        elif name == "bias":
            _, parts, shape, elt = recipe
            elt_t = ir.Type.parse(elt)
            acc = None
            for part in parts:
                if part[0] == "const":
                    x = adapters.constant(part[1].astype(np.float32), f32, created)
                else:
                    _, value, lay, factor = part
                    x = adapters.to_kernel(value, lay, bias_groups, created, dynamic)
                    if factor != 1.0:
                        if str(x.type.element_type) != "f32":
                            x = adapters.convert(x, f32, created)
                        c = shaped.full(factor, f32, adapters.target_recipe(lay, bias_groups)[4])
                        x = adapters.binary("multiply", x, c, created)
                if str(x.type.element_type) != elt:
                    x = adapters.convert(x, elt_t, created)
                x = shaped.broadcast_to(x, _part_shape(part, bias_groups), shape)
                acc = x if acc is None else adapters.binary("add", acc, x, created)
            if any(part[0] == "value" for part in parts):
                acc = empty_rows.emit_bias_floor(
                    acc, created, None if dynamic is None else
                    lambda value, elt: shaped.full(value, elt, shape))
            out.append(acc)
        elif name == "mask":
            _, parts, shape = recipe
            acc = None
            for part in parts:
                if part[0] == "const":
                    x = adapters.constant(part[1], i1, created)
                else:
                    _, value, lay, negate = part
                    if negate:
                        value = adapters.logical_not(value, created)
                    x = adapters.to_kernel(value, lay, groups, created, dynamic)
                x = shaped.broadcast_to(x, _part_shape(part, groups), shape)
                acc = x if acc is None else adapters.binary("and", acc, x, created)
            out.append(acc)
        elif recipe[0] == "padding":
            _, value, lay, negate = recipe
            if negate:
                value = adapters.logical_not(value, created)
            kv = adapters.to_kernel(value, lay, [(tuple(b_pieces), True),
                                                 (tuple(resolved.k_free), True)], created,
                                    dynamic)
            kv = adapters.convert(kv, i32, created)
            q_dims = [tuple(b_pieces), tuple(q_seq)]
            q_ids = adapters.constant(np.ones((kv.type.shape[0], prod(p[2] for p in q_seq)),
                                              np.int32), i32, created) if dynamic is None \
                else dynamic.full(1, i32, q_dims, created)
            out += [q_ids, kv]
        else:
            _, (qv, ql), (kv, kl) = recipe
            for v, lay, seq in ((qv, ql, q_seq), (kv, kl, resolved.k_free)):
                x = adapters.to_kernel(v, lay, [(tuple(b_pieces), True), (tuple(seq), True)],
                                       created, dynamic)
                if str(x.type.element_type) != "i32":
                    x = adapters.convert(x, i32, created)
                out.append(x)
    return out


class _Shaped:
    """Kernel-form operands ([1|B, 1|Hq, Sq, Sk], by their sizes in the first instance for a
    shape-polymorphic site: a group of size 1 is broadcast) of a static or dynamic site."""

    def __init__(self, groups, created, dynamic):
        self.groups, self.created, self.dynamic = groups, created, dynamic

    def _dims(self, shape) -> list:
        return [tuple(pcs) if n != 1 else () for (pcs, _), n in zip(self.groups, shape)]

    def full(self, value, elt, shape) -> ir.Value:
        if self.dynamic is None:
            return adapters.constant(np.full(list(shape), value, np.float32), elt,
                                     self.created)
        return self.dynamic.full(value, elt, self._dims(shape), self.created)

    def broadcast_to(self, x: ir.Value, shape, target) -> ir.Value:
        """``x`` (of kernel-form ``shape``) expanded to ``target``."""
        if self.dynamic is None:
            return adapters.broadcast_to(x, target, self.created)
        if tuple(shape) == tuple(target):
            return x
        return self.dynamic.broadcast(x, self._dims(target), range(4), self.created)


def emit_bias_grads(resolved: Resolved, dbias: ir.Value, wanted: dict, created) -> dict:
    """The transpose of emit()'s ``bias`` onto each bias view in ``wanted`` (view value ->
    the value its gradient replaces, for the shape and type): the kernel's dbias summed over
    what emit broadcast, laid out as the view and times the factor the kernel's bias holds
    it with (summed over the terms that hold it). Returns view value -> gradient. (The bias
    floor passes gradients through: the entries it raises have zero probability either way.)"""
    _, _, shape, _ = resolved.recipes[resolved.names.index("bias")]
    groups = _groups_of(resolved, bias=True)
    f32 = ir.F32Type.get()
    x = dbias if str(dbias.type.element_type) == "f32" else adapters.convert(dbias, f32, created)
    out = {}
    for view, want in wanted.items():
        acc = None
        for value, lay, factor in (e for es in resolved.bias_views.values() for e in es):
            if value != view:
                continue
            final = adapters.target_recipe(lay, groups)[4]
            g = x
            summed = [i for i in range(len(shape)) if final[i] == 1 and shape[i] > 1]
            if summed:   # another term made the operand larger than this one
                g = adapters.reshape(adapters.sum_dims(g, summed, created), final, created)
            g = adapters.from_kernel(g, lay, groups, want.type.shape, created)
            if factor != 1.0:
                c = adapters.constant(np.full(list(g.type.shape), factor, np.float32), f32,
                                      created)
                g = adapters.binary("multiply", g, c, created)
            acc = g if acc is None else adapters.binary("add", acc, g, created)
        if acc.type.element_type != want.type.element_type:
            acc = adapters.convert(acc, want.type.element_type, created)
        out[view] = acc
    return out


def _groups_of(resolved: Resolved, *, bias=False):
    return _groups(resolved.kernel_q, resolved.k_free, bias=bias)
