"""Query rows that see no key: what the original program computes there, and the fix-up
that makes the rewritten program compute the same.

A run-time mask (a ``mask`` operand, segment ids, key padding) can leave a query row with
every key masked, and so can a constant one (a strictly-below-diagonal mask, bottom-right
causal with Sq > Sk: those rows are known when the site is resolved). The kernel outputs 0
on such a row. The original program gives:

  zero   its probabilities are zeroed again after the softmax (torch's fully-masked-row guard,
         keras' re-applied mask): 0, the kernel's answer.
  mean   the masked scores all become one finite value: a select replaces them by a finite
         fill (flax, jax.nn, masked_fill), or an added fill absorbs them (s + fill == fill for
         every score, e.g. transformers' finfo(f32).min). The softmax of equal scores is
         uniform, so the row is the mean of V over the row's keys. flashgen emits
         ``select(no_visible_key, mean over Sk of V, o)`` after the call. no_visible_key
         comes from the call's own mask operands: a constant [1|B, 1|Hq, Sq] when every
         mask is constant; for key padding under no band, causal or a
         right-bounded window, from each sequence's first real key (O(B·S)); otherwise an
         OR-reduction of the visibility over the keys (XLA CPU materializes it, one byte an
         [Sq, Sk] entry). The mean reads the kernel's V operand (so GQA and broadcast K/V
         are averaged as the original averages them).
  nan    the fill is -inf (or the softmax subtracts no row max, so exp(fill) underflows to
         0 and the row is 0/0): NaN. The rewritten program keeps 0 there; `--verify`
         accepts NaN → 0 where a site reports this.

A run-time additive bias (not recognisable as a mask) can carry the fill itself, e.g.
``(1 - mask) * finfo(f32).min``: the kernel works in log2 units (bias · log2 e), where
finfo.min overflows to -inf and the row would come out as an empty row (0), not the
original's uniform mean. ``emit_bias_floor`` raises such entries to -2^127 (finite in log2
units, still absorbing every score) and keeps -inf entries -inf.

Anything else is rejected: an added fill too small to absorb the scores (e.g. -1e4 in f32:
the row is the softmax of the rounded scores, which no kernel mode reproduces), masks of
different fills, or fills that add up to -inf (``where(causal, s, min) + where(pad, 0, min)``:
min + min overflows): the row is uniform over only some keys.
"""
from __future__ import annotations

import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

from flashgen.rewrite import adapters
from flashgen.rewrite.errors import Reject

# An added fill absorbs every score whose magnitude is below this: s + fill rounds to fill.
ABSORBED_SCORE = 2.0 ** 20
_MANTISSA_BITS = {"f16": 10, "bf16": 7, "f32": 23, "f64": 52}
_LARGEST = {"f16": 65504.0, "bf16": 3.3895313892515355e38, "f32": 3.4028234663852886e38}


def absorbs(fill: float, dtype: str) -> bool:
    """Does adding ``fill`` in ``dtype`` turn every score below ABSORBED_SCORE into ``fill``?"""
    bits = _MANTISSA_BITS.get(dtype)
    if bits is None or not np.isfinite(fill):
        return False
    half_ulp = 2.0 ** (np.floor(np.log2(abs(fill))) - bits - 1)
    return half_ulp >= ABSORBED_SCORE


def behaviour(fills, *, zeroed_after: bool, max_subtracted: bool, may_empty: bool) -> str:
    """'none' (no row can lose every key), 'zero', 'mean' or 'nan' (see the module doc).

    ``fills``: (how, value, dtype) per masking step on the scores: how = 'select' (the fill
    replaces the score) or 'add' (the fill is added to it). ``may_empty``: may_empty_rows()."""
    if not may_empty:
        return "none"
    if zeroed_after:
        return "zero"
    if not max_subtracted or all(np.isneginf(v) for _, v, _ in fills):
        return "nan"
    if len(fills) > 1 and any(how == "add" for how, _, _ in fills) and \
            abs(sum(v for _, v, _ in fills)) > _LARGEST.get(fills[-1][2], np.inf):
        # where(causal, s, min) + where(pad, 0, min): min + min is -inf, so a padded row's
        # original averages only the keys its other masks leave
        raise Reject("the masks' fills add up past the largest "
                     f"{fills[-1][2]} (to -inf): a query row whose keys are all masked "
                     "would average only some keys")
    values = {v for _, v, _ in fills}
    if len(values) > 1:
        raise Reject("the masks use different fill values "
                     f"({', '.join(f'{v:g}' for v in sorted(values))}): a query row whose keys "
                     "are all masked would average only some keys")
    for how, value, dtype in fills:
        if how == "add" and not absorbs(value, dtype):
            raise Reject(f"the mask adds the fill {value:g} in {dtype}, too small to absorb the "
                         "scores: a query row whose keys are all masked is the "
                         "softmax of the rounded scores, which the kernel cannot reproduce")
    return "mean"


def may_empty_rows(resolved, seq_q: int, seq_k: int) -> bool:
    """Can a query row be left without a visible key? Yes when the constant masks leave such
    rows (``resolved.const_empty``) or a run-time value may -- not when the only run-time
    mask is one tensor of segment ids compared with itself over a square problem: every
    query then sees its own key (any causal / window band keeps the diagonal)."""
    if resolved is None:
        return False
    if resolved.const_empty is not None:
        return True
    for name, recipe in zip(resolved.names, resolved.recipes):
        if name == "mask" and any(p[0] == "value" for p in recipe[1]):
            return True
        if name == "segment_ids":
            if not (recipe[0] == "segment_ids" and seq_q == seq_k and _self_compared(
                    recipe[1], recipe[2], resolved.kernel_q[1], resolved.k_free)):
                return True
    return False


def _self_compared(q_side, kv_side, q_seq, k_free) -> bool:
    """Are the query and key ids one tensor read along the same dims?"""
    def roles(lay, seq):
        return tuple(tuple("seq" if p in seq else p for p in d) for d in lay)
    return q_side[0] == kv_side[0] and roles(q_side[1], q_seq) == roles(kv_side[1], k_free)


def visible_parts(resolved, extra_values) -> list:
    """The call's mask operands among its extra operands (``resolved.names`` order; segment
    ids are two operands; a key-padding mask's q ids are all 1). Where every mask is
    constant, [('static', the [1|B, 1|Hq, Sq] rows without a visible key)]: known here."""
    static = all(name != "segment_ids" and (name != "mask" or
                                            all(p[0] == "const" for p in recipe[1]))
                 for name, recipe in zip(resolved.names, resolved.recipes))
    if static and resolved.const_empty is not None:
        return [("static", resolved.const_empty)]
    parts, i = [], 0
    for name, recipe in zip(resolved.names, resolved.recipes):
        if name == "segment_ids":
            if recipe[0] == "padding":
                parts.append(("padding", extra_values[i + 1]))
            else:
                parts.append(("segments", extra_values[i], extra_values[i + 1]))
            i += 2
            continue
        if name == "mask":
            parts.append(("mask", extra_values[i]))
        i += 1
    return parts


NOTES = {
    "zero": "a query row whose keys are all masked outputs 0, as in the original (the "
            "probabilities are zeroed after the softmax)",
    "mean": "a query row whose keys are all masked gets the mean of V over its keys, as in the "
            "original (finite fill): exact fix-up after the call",
    "nan": "a query row whose keys are all masked outputs 0 where the original gives NaN "
           "(-inf fill, 0/0)",
}


# ----------------------------------------------------------------------------- emission
def emit_mean_fixup(o: ir.Value, v: ir.Value, visible_parts, *, causal: bool,
                    bottom_right: bool, window, created) -> ir.Value:
    """select(row has no visible key, mean of V over the keys, o) in the kernel's layout.

    ``o``: [B, Sq, Hq, Dv]; ``v``: [B, Sk, Hkv, Dv]; ``visible_parts``: the call's own mask
    operands as ('mask', [1|B, 1|Hq, Sq, Sk] i1) or ('segments', q ids [B, Sq], kv ids
    [B, Sk])."""
    b, sq, hq, dv = o.type.shape
    sk, hkv = v.type.shape[1], v.type.shape[2]
    empty = _no_visible_key(visible_parts, b, hq, sq, sk, causal, bottom_right, window,
                            created)                                  # [1|B, 1|Hq, Sq]
    mean = _mean_over_keys(v, created)                                # [B, Hkv, Dv] f32
    g = hq // hkv
    # q head h reads kv head h // g (the kernel's GQA convention)
    mean = adapters.broadcast(mean, [b, sq, hkv, g, dv], [0, 2, 4], created)
    mean = adapters.reshape(mean, [b, sq, hq, dv], created)
    if mean.type.element_type != o.type.element_type:
        mean = adapters.convert(mean, o.type.element_type, created)
    empty = adapters.broadcast(empty, [b, sq, hq, dv], [0, 2, 1], created)
    return _op(stablehlo.SelectOp(empty, mean, o), created)


def emit_mean_fixup_grad(dv: ir.Value, do: ir.Value, visible_parts, *, causal: bool,
                         bottom_right: bool, window, created) -> ir.Value:
    """The gradient of emit_mean_fixup for V: a row without a visible key is the mean of V
    over all Sk keys, so each key's dV gains that row's dO / Sk (summed over the query heads
    of its kv head); the kernel's backward gives such rows no gradient at all (and dQ, dK
    none is right under a select fill: the original's scores there are constants; an added
    fill keeps their cotangent, emit_added_fill_grads).

    ``dv``: [B, Sk, Hkv, Dv] from the backward call; ``do``: [B, Sq, Hq, Dv] as it reads it."""
    b, sq, hq, d = do.type.shape
    sk, hkv = dv.type.shape[1], dv.type.shape[2]
    f32 = ir.F32Type.get()
    empty = _no_visible_key(visible_parts, b, hq, sq, sk, causal, bottom_right, window,
                            created)                                  # [1|B, 1|Hq, Sq]
    empty = adapters.broadcast(empty, [b, sq, hq, d], [0, 2, 1], created)
    g = do if str(do.type.element_type) == "f32" else adapters.convert(do, f32, created)
    zero = adapters.scalar(ir.FloatAttr.get(f32, 0.0), f32, created)
    g = _op(stablehlo.SelectOp(empty, g, adapters.broadcast(zero, [b, sq, hq, d], [],
                                                             created)), created)
    g = adapters.reshape(g, [b, sq, hkv, hq // hkv, d], created)
    g = adapters.reduce(g, zero, stablehlo.AddOp, [1, 3], created)   # [B, Hkv, Dv]
    n = adapters.constant(np.full(g.type.shape, sk, np.float32), f32, created)
    g = _op(stablehlo.DivOp(g, n), created)
    g = adapters.broadcast(g, [b, sk, hkv, d], [0, 2, 3], created)
    if g.type.element_type != dv.type.element_type:
        g = adapters.convert(g, dv.type.element_type, created)
    return _op(stablehlo.AddOp(dv, g), created)


def emit_added_fill_grads(dq: ir.Value, dk: ir.Value, operands, do: ir.Value, visible_parts,
                          *, scale: float, causal: bool, bottom_right: bool, window,
                          created) -> tuple:
    """dQ and dK of the rows without a visible key under an added finite fill, added to the
    backward call's (which gives those rows none).

    The original's scores there are ``fill`` everywhere, its probabilities uniform, but
    autodiff passes the scores' cotangent dS through the add: a row i gets the uniform
    softmax's VJP, dS_ij = (dO_i·v_j - dO_i·v̄) / Sk. Its products with K and Q need no
    [Sq, Sk] matrix:

        dQ_i += scale · dO_i · Σ_j (v_j - v̄) k_jᵀ / Sk              ([Dv, D] per head)
        dK_j += scale / Sk · (Σ_i∈empty q_i dO_iᵀ) · (v_j - v̄)      ([D, Dv] per kv head)

    ``operands``: the call's q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv];
    ``dq``, ``dk`` and ``do`` in the same layouts."""
    q, k, v = operands[:3]
    b, sq, hq, d = q.type.shape
    sk, hkv, dv = v.type.shape[1], v.type.shape[2], v.type.shape[3]
    grp = hq // hkv
    f32 = ir.F32Type.get()
    q, k, v, g = (x if str(x.type.element_type) == "f32" else adapters.convert(x, f32, created)
                  for x in (q, k, v, do))
    empty = _no_visible_key(visible_parts, b, hq, sq, sk, causal, bottom_right, window,
                            created)                                  # [1|B, 1|Hq, Sq]
    empty = adapters.broadcast(empty, [b, sq, hq, dv], [0, 2, 1], created)
    zero = adapters.scalar(ir.FloatAttr.get(f32, 0.0), f32, created)
    g = _op(stablehlo.SelectOp(empty, g, adapters.broadcast(zero, [b, sq, hq, dv], [],
                                                             created)), created)
    g = adapters.reshape(g, [b, sq, hkv, grp, dv], created)       # q head h: kv head h // grp
    centred = _op(stablehlo.SubtractOp(v, adapters.broadcast(
        _mean_over_keys(v, created), [b, sk, hkv, dv], [0, 2, 3], created)), created)
    cov = _scaled(_dot(centred, k, [0, 2], [0, 2], [1], [1], created), scale / sk,
                  created)                                            # [B, Hkv, Dv, D]
    dq_add = _dot(g, cov, [0, 2], [0, 1], [4], [2], created)          # [B, Hkv, Sq, grp, D]
    dq_add = adapters.reshape(_transpose(dq_add, [0, 2, 1, 3, 4], created), [b, sq, hq, d],
                              created)
    qg = adapters.reshape(q, [b, sq, hkv, grp, d], created)
    outer = _scaled(_dot(qg, g, [0, 2], [0, 2], [1, 3], [1, 3], created), scale / sk,
                    created)                                          # [B, Hkv, D, Dv]
    dk_add = _transpose(_dot(centred, outer, [0, 2], [0, 1], [3], [3], created), [0, 2, 1, 3],
                        created)                                      # [B, Sk, Hkv, D]
    return tuple(_op(stablehlo.AddOp(grad, add if add.type.element_type == grad.type.element_type
                                     else adapters.convert(add, grad.type.element_type,
                                                           created)), created)
                 for grad, add in ((dq, dq_add), (dk, dk_add)))


BIAS_FLOOR = -2.0 ** 127


def emit_bias_floor(x: ir.Value, created, full=None) -> ir.Value:
    """select(x == -inf, x, max(x, BIAS_FLOOR)) for an f32 / bf16 bias operand. ``full(value,
    elt)``: a tensor of x's shape holding ``value`` (for a shape known only at run time)."""
    elt = x.type.element_type
    if str(elt) not in ("f32", "bf16"):
        return x      # f16 (max 65504) cannot overflow in log2 units
    shape = list(x.type.shape)
    full = full or (lambda value, elt: adapters.constant(np.full(shape, value, np.float32),
                                                         elt, created))
    floor, ninf = full(BIAS_FLOOR, elt), full(-np.inf, elt)
    raised = _op(stablehlo.MaxOp(x, floor), created)
    return _op(stablehlo.SelectOp(_compare(x, ninf, "EQ", created), x, raised), created)


def _no_visible_key(parts, b, hq, sq, sk, causal, bottom_right, window, created):
    """[1|B, 1|Hq, Sq] i1: the query row sees no key."""
    i1 = ir.IntegerType.get_signless(1)
    if len(parts) == 1 and parts[0][0] == "static":     # constant masks only: a constant
        return adapters.constant(parts[0][1], i1, created)
    left, right = window
    if len(parts) == 1 and parts[0][0] == "padding" and left < 0:
        return _no_valid_key_before(parts[0][1], sq, sk, causal, bottom_right, right, created)
    # XLA materializes the [.., Sq, Sk] visibility (1 byte an entry) before reducing it
    pb, ph = 1, 1
    for part in parts:
        if part[0] == "mask":
            pb, ph = max(pb, part[1].type.shape[0]), max(ph, part[1].type.shape[1])
        else:
            pb = b
    shape = [pb, ph, sq, sk]
    vis = None
    band = _band(sq, sk, causal, bottom_right, window, created)
    if band is not None:
        vis = adapters.broadcast(band, shape, [2, 3], created)
    for part in parts:
        if part[0] == "mask":
            x = adapters.broadcast_to(part[1], shape, created)
        elif part[0] == "padding":
            one = adapters.constant(np.ones(shape, np.int32), part[1].type.element_type, created)
            x = _compare(adapters.broadcast(part[1], shape, [0, 3], created), one, "EQ", created)
        else:
            _, q_ids, kv_ids = part
            qb = adapters.broadcast(q_ids, shape, [0, 2], created)
            kb = adapters.broadcast(kv_ids, shape, [0, 3], created)
            x = _compare(qb, kb, "EQ", created)
        vis = x if vis is None else adapters.binary("and", vis, x, created)
    false = adapters.scalar(ir.BoolAttr.get(False), i1, created)
    any_key = adapters.reduce(vis, false, stablehlo.OrOp, [3], created)
    return adapters.logical_not(any_key, created)


def _no_valid_key_before(kv_ids, sq, sk, causal, bottom_right, right, created):
    """A key-padding mask (kv ids 1 = a real key) under no band or a band bounded on the right
    only: row i sees a key iff the first real key is at most i + off + right (or exists).
    O(B * S): [B, 1, Sq] i1."""
    i32 = ir.IntegerType.get_signless(32)
    nb = kv_ids.type.shape[0]
    j = _op(stablehlo.IotaOp(ir.RankedTensorType.get([nb, sk], i32), 1), created)
    one = adapters.constant(np.ones((nb, sk), np.int32), kv_ids.type.element_type, created)
    none = adapters.constant(np.full((nb, sk), sk, np.int32), i32, created)
    real = _compare(kv_ids, one, "EQ", created)
    first = adapters.reduce(_op(stablehlo.SelectOp(real, j, none), created),
                            adapters.scalar(ir.IntegerAttr.get(i32, sk), i32, created),
                            stablehlo.MinOp, [1], created)            # [B]
    off = (sk - sq) if bottom_right else 0
    shifts = ([off] if causal else []) + ([off + right] if right >= 0 else [])
    last = adapters.constant(np.full(sq, sk - 1, np.int32), i32, created)
    if shifts:              # the last visible key of row i: min(i + shift, Sk - 1)
        i = _op(stablehlo.IotaOp(ir.RankedTensorType.get([sq], i32), 0), created)
        shift = adapters.constant(np.full(sq, min(shifts), np.int32), i32, created)
        hi = _op(stablehlo.MinOp(_op(stablehlo.AddOp(i, shift), created), last), created)
    else:
        hi = last
    first = adapters.broadcast(first, [nb, 1, sq], [0], created)
    hi = adapters.broadcast(hi, [nb, 1, sq], [2], created)
    return _compare(first, hi, "GT", created)


def _band(sq, sk, causal, bottom_right, window, created):
    """[Sq, Sk] i1 of the call's causal / window attributes (flashgen.rewrite.masks.visible),
    from iotas; None when they mask nothing."""
    left, right = window
    bounds = []
    if causal:
        bounds.append(("LE", 0))
    if right >= 0:
        bounds.append(("LE", right))
    if left >= 0:
        bounds.append(("GE", -left))
    if not bounds:
        return None
    i32 = ir.IntegerType.get_signless(32)
    t = ir.RankedTensorType.get([sq, sk], i32)
    i = _op(stablehlo.IotaOp(t, 0), created)
    j = _op(stablehlo.IotaOp(t, 1), created)
    off = (sk - sq) if bottom_right else 0
    d = _op(stablehlo.SubtractOp(j, i), created)            # j - i, visible on off + [lo, hi]
    out = None
    for direction, k in bounds:
        c = adapters.constant(np.full((sq, sk), off + k, np.int32), i32, created)
        x = _compare(d, c, direction, created)
        out = x if out is None else adapters.binary("and", out, x, created)
    return out


def _mean_over_keys(v, created):
    f32 = ir.F32Type.get()
    x = v if str(v.type.element_type) == "f32" else adapters.convert(v, f32, created)
    total = adapters.sum_dims(x, [1], created)                        # [B, Hkv, Dv]
    n = adapters.constant(np.full(total.type.shape, v.type.shape[1], np.float32), f32, created)
    return _op(stablehlo.DivOp(total, n), created)


def _dot(a, b, a_batch, b_batch, a_contract, b_contract, created):
    """dot_general in f32: the batch dims, then ``a``'s free dims, then ``b``'s."""
    dims = stablehlo.DotDimensionNumbers.get(a_batch, b_batch, a_contract, b_contract)
    free = [[n for i, n in enumerate(x.type.shape) if i not in bd + cd]
            for x, bd, cd in ((a, a_batch, a_contract), (b, b_batch, b_contract))]
    shape = [a.type.shape[i] for i in a_batch] + free[0] + free[1]
    t = ir.RankedTensorType.get(shape, ir.F32Type.get())
    return _op(stablehlo.DotGeneralOp(t, a, b, dims), created)


def _transpose(x, perm, created):
    return _op(stablehlo.TransposeOp(x, perm), created)


def _scaled(x, factor: float, created):
    f32 = ir.F32Type.get()
    return _op(stablehlo.MulOp(x, adapters.constant(np.full(x.type.shape, factor, np.float32),
                                                     f32, created)), created)


def _compare(a, b, direction, created):
    attr = stablehlo.ComparisonDirectionAttr.get(direction)
    return _op(stablehlo.CompareOp(a, b, attr), created)


def _op(op, created):
    created.append(op)
    return op.result
