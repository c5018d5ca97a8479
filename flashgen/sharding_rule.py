"""The Shardy ``#sdy.op_sharding_rule`` of a flashgen custom call: pure IR, no JAX.

Put on every flashgen call by ``flashgen.emit.emit_custom_call`` and by ``flash_attention``'s
lowering (flashgen/jax/sharding.py, which also holds the XLA partitioners that honour it).
Factors: b (batch), s (Sq), t (Sk), g (kv heads), h (q heads per kv head, Hq = Hkv·G, q heads =
the compound ``(g h)``), d (head_dim), v (the value head dim, where it differs from d). s, t, d and h are *need-replication* factors, so
propagation only ever shards b and g: q/k/v/o/lse (and dO/dQ/dK/dV) share them, and kv heads
travel with their q-head groups. (MQA, Hkv = 1: the q heads are all h, so only the batch is
split.) An FP8 forward's [1] descale operands get a unit factor each: replicated.
"""
from __future__ import annotations

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import sdy

from flashgen.contract import CALLS, DIRECTIONS, calls


def _rule_mappings(direction: str, shapes, extras=(), with_dbias: bool = True, dtype: str = "f32"):
    """Factor names per operand and result, and the factor sizes, of a call of a spec of element
    type `dtype`. A tuple is a compound dimension (major first); a broadcast (size-1) dimension
    gets a factor of its own, u0, u1..."""
    q_shape, kv_shape = shapes[0], shapes[1]
    heads, kv_heads = int(q_shape[-2]), int(kv_shape[-2])
    if kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"kv heads ({kv_heads}) must divide q heads ({heads})")
    # Shardy refuses size-1 factors inside a compound dimension: MQA's q heads are all h.
    qh = ("g",) if heads == kv_heads else ("h",) if kv_heads == 1 else ("g", "h")
    sizes = {"g": kv_heads, "h": heads // kv_heads, "d": int(q_shape[-1])}
    if direction in ("fwd_varlen", "bwd_varlen"):
        # Packed tokens: only heads are parallel (a token's sequence is data, cu_seqlens).
        nfixed = len(CALLS[direction].operands)
        sizes.update(s=int(q_shape[0]), t=int(kv_shape[0]), c=int(shapes[nfixed - 1][0]))
        q, kv, lse, cu = ("s", qh, "d"), ("t", "g", "d"), (qh, "s"), ("c",)
        sizes["e"] = sizes["c"] - 1  # the batch of a varlen call's extras (ALiBi [B, Hq]): stays whole
        extra = _extra_mappings(direction, shapes[nfixed:], extras, {"B": "e", "Hq": qh},
                                {"B": sizes["e"], "Hq": heads}, sizes)
        if direction == "fwd_varlen":
            return [q, kv, kv, cu, cu, *extra], [q, lse], sizes
        return [q, kv, kv, q, lse, q, cu, cu, *extra], [q, kv, kv], sizes
    b, sq = int(q_shape[0]), int(q_shape[1])
    sizes.update(b=b, s=sq)
    q, lse = ("b", "s", qh, "d"), ("b", qh, "s")
    if direction == "fwd_paged":
        # Cache blocks are addressed by global ids in block_table: the caches stay whole
        # along blocks; batch and kv heads are parallel.
        sizes.update(n=int(kv_shape[0]), p=int(kv_shape[1]), m=int(shapes[3][1]))
        cache = ("n", "p", "g", "d")
        extra = _extra_mappings(direction, shapes[5:], extras, {"B": "b", "Hq": qh}, {"B": b, "Hq": heads}, sizes)
        return [q, cache, cache, ("b", "m"), ("b",), *extra], [q, lse], sizes
    sizes["t"] = int(kv_shape[1])
    kv = ("b", "t", "g", "d")
    # v's head dim: a factor of its own (v) when it differs from q's and k's (MLA)
    v_dim = int(shapes[2][-1])
    v, o = (kv, q) if v_dim == sizes["d"] else (("b", "t", "g", "v"), ("b", "s", qh, "v"))
    if v_dim != sizes["d"]:
        sizes["v"] = v_dim
    fixed = [q, kv, v] if direction == "fwd" else [q, kv, v, o, lse, o]
    for _ in calls(dtype)[direction].operands[len(fixed):]:  # FP8's descales, [1] each
        fixed.append((f"u{len(sizes)}",))
        sizes[fixed[-1][0]] = 1
    extra = _extra_mappings(direction, shapes[len(fixed):], extras, {"B": "b", "Hq": qh, "Sq": "s", "Sk": "t"},
                            {"B": b, "Hq": heads, "Sq": sq, "Sk": sizes["t"]}, sizes)
    dbias = [m for m, o in zip(extra, CALLS[direction].extra_operands(extras)) if o.name == "bias"]
    if direction == "fwd":
        return fixed + extra, [o, lse], sizes
    if direction == "bwd":
        return fixed + extra, [q, kv, v] + (dbias if with_dbias else []), sizes
    raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")


def _extra_mappings(direction, shapes, extras, factors: dict, dims: dict, sizes: dict) -> list[tuple]:
    """The factors of the extra operands (contract.EXTRAS), from their symbolic dims: `factors`
    maps a dim name to its factor and `dims` to its size; a broadcast dim ("1|X") of size 1
    where X is not gets a unit factor of its own (added to `sizes`)."""
    out = []
    for operand, shape in zip(CALLS[direction].extra_operands(extras), shapes):
        symbolic = operand.shape if len(shape) == len(operand.shape) else operand.other_shape
        broadcast = [i for i, d in enumerate(symbolic) if "|" in d]  # each owns a unit, used or not
        units = {i: f"u{len(sizes) + k}" for k, i in enumerate(broadcast)}
        sizes.update({u: 1 for u in units.values()})
        out.append(tuple(units[i] if i in units and n == 1 and dims[d.split("|")[-1]] != 1
                         else factors[d.split("|")[-1]] for i, (d, n) in enumerate(zip(symbolic, shape))))
    return out


def sharding_rule_attr(direction: str, shapes, extras=(), with_dbias: bool = True,
                       dtype: str = "f32") -> ir.Attribute:
    """The ``#sdy.op_sharding_rule`` of one flashgen call of a spec of element type `dtype`
    (inside an MLIR context with sdy); `shapes` are the operands' shapes, in call order;
    `with_dbias`: a backward with a bias returns dbias."""
    operands, results, sizes = _rule_mappings(direction, [list(map(int, x)) for x in shapes], extras,
                                              with_dbias, dtype)
    order = ("b", "s", "g", "h", "d", "t", "c", "e", "n", "p", "m", "v") + tuple(
        sorted(f for f in sizes if f.startswith("u")))
    used = [f for f in order
            if any(f in (dim if isinstance(dim, tuple) else (dim,))
                   for m in operands + results for dim in m)]
    index = {f: i for i, f in enumerate(used)}

    def tensor(mapping):
        dims = [sdy.DimMappingAttr.get(factor_indices=[index[f] for f in
                                                      (dim if isinstance(dim, tuple) else (dim,))])
                for dim in mapping]
        return sdy.TensorMappingAttr.get(dim_mappings=dims)

    return sdy.OpShardingRuleAttr.get(
        factor_sizes=[sizes[f] for f in used],
        operand_mappings=[tensor(m) for m in operands],
        result_mappings=[tensor(m) for m in results],
        need_replication_factors=sorted(index[f] for f in ("s", "t", "d", "h", "c", "e", "n", "p", "m", "v")
                                        if f in index),
        is_custom=True)


def context_has_sdy(context: ir.Context | None = None) -> bool:
    """Whether the (current) MLIR context has the sdy dialect (building its attributes
    in a context without it crashes the process, so callers check first)."""
    ctx = context or ir.Context.current
    return bool(ctx.is_registered_operation("sdy.manual_computation"))
