"""Query rows without a visible key at a shape-polymorphic site: flashgen.rewrite.empty_rows'
"mean" fix-up, select(no visible key, mean of V over the keys, o), built on the dynamic
module's values (sizes from flashgen.rewrite.polymorphic.SymbolicSizes, dims named by their
pieces since dynamic sizes print alike).

The visibility is built per mask operand at its own extent and ANDed at their common one,
then OR-reduced over the keys: a key-padding mask alone (no band) is O(B·Sk); with a band,
segment ids or a [.., Sq, Sk] mask operand XLA materializes [1|B, 1|Hq, Sq, Sk] bytes.
"""
from __future__ import annotations

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

from flashgen.rewrite import adapters


def emit_mean_fixup(o: ir.Value, v: ir.Value, parts, kernel: dict, band, sizes,
                    created) -> ir.Value:
    """``o``: the call's [B, Sq, Hq, Dv] result; ``v``: its V operand; ``parts``:
    empty_rows.visible_parts() of its extra operands (run-time ones: no 'static' part);
    ``kernel``: the kernel dims (pieces) of q, k, v, o; ``band``: (causal, bottom_right,
    window) of the call."""
    b, sq, hq, dv = (tuple(d) for d in kernel["o"])
    sk, hkv = tuple(kernel["v"][1]), tuple(kernel["v"][2])
    empty = _no_visible_key(parts, (b, hq, sq, sk), band, sizes, created)
    empty = sizes.broadcast(empty, [b, sq, hq, dv], [0, 2, 1], created)
    f32 = ir.F32Type.get()
    x = v if str(v.type.element_type) == "f32" else adapters.convert(v, f32, created)
    total = adapters.sum_dims(x, [1], created)                           # [B, Hkv, Dv]
    n = adapters.convert(_i32(sizes.dim(sk), created), f32, created)
    mean = adapters.binary("divide", total, sizes.broadcast(n, [b, hkv, dv], [], created),
                           created)
    # q head h reads kv head h // g (the kernel's GQA convention)
    g = sizes.dim(hq) // sizes.dim(hkv)
    mean = sizes.broadcast(mean, [b, sq, hkv, g, dv], [0, 2, 4], created)
    mean = sizes.reshape(mean, [b, sq, hq, dv], created)
    if mean.type.element_type != o.type.element_type:
        mean = adapters.convert(mean, o.type.element_type, created)
    op = stablehlo.SelectOp(empty, mean, o)
    created.append(op)
    return op.result


def _no_visible_key(parts, axes, band, sizes, created) -> ir.Value:
    """[1|B, 1|Hq, 1|Sq] i1: the query row sees no key."""
    b, hq, sq, sk = axes
    terms = []                        # (value, its dims among [b, hq, sq, sk] or ())
    causal, bottom_right, window = band
    bounds = _band_bounds(causal, window)
    if bounds:
        terms.append((_band(bounds, bottom_right, sq, sk, sizes, created), ((), (), sq, sk)))
    for part in parts:
        if part[0] == "mask":
            m = part[1]
            dims = tuple(d if m.type.shape[i] != 1 else () for i, d in enumerate(axes))
            terms.append((m, dims))
        elif part[0] == "padding":
            one = sizes.full(1, part[1].type.element_type, [b, sk], created)
            terms.append((_compare(part[1], one, "EQ", created), (b, (), (), sk)))
        elif part[0] == "segments":
            dims = (b, (), sq, sk)
            q_ids = sizes.broadcast(part[1], dims, [0, 2], created)
            kv_ids = sizes.broadcast(part[2], dims, [0, 3], created)
            terms.append((_compare(q_ids, kv_ids, "EQ", created), dims))
        else:
            raise ValueError(f"no dynamic fix-up for a {part[0]} mask")
    common = tuple(next((t[1][i] for t in terms if t[1][i]), ()) for i in range(4))
    vis = None
    for value, dims in terms:
        if len(value.type.shape) != 4:
            value = sizes.reshape(value, dims, created)
        if dims != common:
            value = sizes.broadcast(value, common, range(4), created)
        vis = value if vis is None else adapters.binary("and", vis, value, created)
    i1 = ir.IntegerType.get_signless(1)
    false = adapters.scalar(ir.BoolAttr.get(False), i1, created)
    any_key = adapters.reduce(vis, false, stablehlo.OrOp, [3], created)
    return adapters.logical_not(any_key, created)


def _band_bounds(causal: bool, window) -> list:
    """[(direction, k)]: key j is visible from query i when (j - i - off) direction k."""
    left, right = window
    return ([("LE", 0)] if causal else []) + ([("LE", right)] if right >= 0 else []) + \
        ([("GE", -left)] if left >= 0 else [])


def _band(bounds, bottom_right: bool, sq, sk, sizes, created) -> ir.Value:
    """[Sq, Sk] i1 of the call's causal / window attributes (flashgen.rewrite.masks.visible),
    from dynamic iotas."""
    dims = [sq, sk]
    i, j = sizes.iota(dims, 0, created), sizes.iota(dims, 1, created)
    d = adapters.binary("subtract", j, i, created)      # visible on off + [lo, hi]
    off = _i32(0, created)
    if bottom_right and sq != sk:
        off = adapters.binary("subtract", _i32(sizes.dim(sk), created),
                              _i32(sizes.dim(sq), created), created)
    out = None
    for direction, k in bounds:
        c = adapters.binary("add", off, _i32(k, created), created)
        x = _compare(d, sizes.broadcast(c, dims, [], created), direction, created)
        out = x if out is None else adapters.binary("and", out, x, created)
    return out


def _i32(n, created) -> ir.Value:
    """An i32 scalar: ``n`` itself when it is one, else a constant."""
    if isinstance(n, ir.Value):
        return n
    i32 = ir.IntegerType.get_signless(32)
    return adapters.scalar(ir.IntegerAttr.get(i32, int(n)), i32, created)


def _compare(a, b, direction, created):
    op = stablehlo.CompareOp(a, b, stablehlo.ComparisonDirectionAttr.get(direction))
    created.append(op)
    return op.result
