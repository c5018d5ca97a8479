"""Shape-polymorphic modules (``jax.export`` with symbolic dims ``b, s``): match and rewrite.

The matcher reasons about static shapes (masks are folded to arrays), so a polymorphic
module is matched through two static instances (flashgen.rewrite.instances): copies refined,
as JAX does at call time, at two different sets of sizes for its dimension variables. A
site is rewritten only when both instances match it alike (the same kernel, attributes and
roles; only the symbolic sizes differ); the pieces whose sizes differ are the symbolic ones.
The dynamic original is then rewritten around the same two dot_generals (found by their
tags): Q, K and V are the sources the matcher walked back to, where those have a
counterpart in the original, else the products' own operands; they are reshaped with
dynamic_reshape where needed, and the custom call gets dynamic result types plus the i32
shape operands named by ``indices_of_shape_operands`` -- the form of JAX's own custom calls
with dynamic results, which shape refinement resolves at call time.

Run-time extra operands (masks, biases, segment ids; flashgen.rewrite.extras), a run-time
scale and the empty-row fix-up (flashgen.rewrite.polymorphic_rows) are built from the dynamic
module's counterparts of the values the instance's site reads.

Limits (each a Rejection with its reason): head counts and head dims must be static; no
constant mask or bias operand (it has the instance's sizes); no training site; every
dynamic dim of @main must be a dimension variable itself (not ``2*s``).
"""
from __future__ import annotations

import dataclasses
from math import prod

import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

from flashgen.rewrite import adapters, empty_rows, polymorphic_rows
from flashgen.rewrite import extras as X
from flashgen.rewrite.graph import Graph, nested_ops, op_name
from flashgen.rewrite.instances import (
    ARG, Unsupported, dimension_variables, function, instantiate, instantiation_sizes,
    sizes_text, tag as tag_of,
)
from flashgen.rewrite.report import AttentionSite, Rejection


# ----------------------------------------------------------------------------- matching
@dataclasses.dataclass
class PolyPlan:
    """What the rewrite of one site in the dynamic module needs."""
    dot1: object              # the Q·K and P·V products in the dynamic module
    dot2: object
    values: dict              # 'q'|'k'|'v' -> the call's source value in the dynamic module
    inputs: dict              # 'q'|'k'|'v' -> its layout (pieces sized as in the first instance)
    kernel: dict
    exit_layout: tuple
    symbols: dict             # piece -> dimension variable, for the pieces that are symbolic
    spec: object
    attributes: dict          # the call's attributes (flashgen.rewrite.plan.Plan.attributes)
    extras: object = None     # extras.Resolved over the dynamic module's values
    empty_rows: str = "none"  # as flashgen.rewrite.plan.Plan's
    runtime_scales: tuple = ()  # (scalar value of the dynamic module, divide)
    band: tuple = (False, False, (-1, -1))   # causal, bottom_right, window: for the fix-up


def _operands(site: AttentionSite, dot1, dot2, dyn1, dyn2) -> dict | None:
    """Q, K, V as operands of the products in the dynamic module (their counterparts in
    the instance ``site`` was matched on), or None."""
    out = {}
    for name, dot, dyn in (("q", dot1, dyn1), ("k", dot1, dyn1), ("v", dot2, dyn2)):
        found = [i for i, x in enumerate(dot.operands) if x == site.plan.inputs[name][0]]
        if not found:
            return None
        out[name] = dyn.operands[found[0]]
    return out


def _sources(ctx, site: AttentionSite, dyn2) -> dict | None:
    """Q, K, V walked back to their sources in the instance, found in the dynamic module
    (_counterpart); None where one has none."""
    out = {name: _counterpart(ctx, site.plan.inputs[name][0], dyn2) for name in "qkv"}
    return None if any(v is None for v in out.values()) else out


def _counterpart(ctx, value, dyn2) -> ir.Value | None:
    """The dynamic module's value that ``value`` of an instance refines, seen from the P·V
    product ``dyn2``'s block, before it (where the call goes); None where it has no usable
    one (an op the refinement replaced, a value of a caller that calls the site's function
    twice)."""
    main = ctx.main
    if isinstance(value, ir.BlockArgument):
        at = value.arg_number if op_name(value.owner.owner) == "func.func" and \
            Graph.function_name(value.owner.owner) == "main" else None
        dyn = main.regions[0].blocks[0].arguments[at] if at is not None else None
    elif tag_of(value.owner, ARG) is not None:
        dyn = main.regions[0].blocks[0].arguments[tag_of(value.owner, ARG)]
    else:
        t = tag_of(value.owner)
        dyn = ctx.ops[t].results[value.result_number] if t is not None else None
    return _seen_from(dyn, dyn2, ctx.graph) if dyn is not None else None


def _dynamic_extras(ctx, plan, dyn2) -> tuple:
    """(extras.Resolved, run-time scales) of an instance's plan over the dynamic module's
    values; Unsupported where one has no counterpart there."""
    def find(value, _layout=None):
        dyn = _counterpart(ctx, value, dyn2)
        if dyn is None:
            raise Unsupported("an extra operand (a run-time mask, bias, segment ids or scale) "
                              "has no counterpart in the dynamic module")
        return dyn
    scales = tuple((find(x), divide) for x, divide in plan.runtime_scales)
    return _with_values(plan.extras, find), scales


def _runtime_parts(extras) -> list:
    """[(value, layout)] of the run-time extra operands a Resolved reads."""
    out: list = []
    _with_values(extras, lambda value, layout: out.append((value, layout)) or value)
    return out


def _with_values(extras, fn):
    """``extras`` (an extras.Resolved, or None) with each run-time value it reads replaced
    by ``fn(value, layout)``; ALiBi slopes are constants of the head count."""
    if extras is None:
        return None
    recipes = []
    for name, r in zip(extras.names, extras.recipes):
        if name in ("bias", "mask"):   # (kind, parts, ...): a part ('value', v, layout, ...)
            r = (r[0], [(p[0], fn(p[1], p[2])) + tuple(p[2:]) if p[0] == "value" else p
                        for p in r[1]]) + tuple(r[2:])
        elif r[0] == "padding":
            r = (r[0], fn(r[1], r[2])) + tuple(r[2:])
        elif r[0] == "segment_ids":
            r = (r[0],) + tuple((fn(v, lay), lay) for v, lay in r[1:])
        recipes.append(r)
    return dataclasses.replace(extras, recipes=recipes)


def _static_extras(a: AttentionSite, b: AttentionSite) -> str | None:
    """Why the extra operands of a site matched alike at ``a`` and ``b`` cannot be built in
    the dynamic module: a constant mask or bias operand has the instance's sizes."""
    ea, eb = a.plan.extras, b.plan.extras
    if ea is None or not ea.names:
        return None
    for name, ra, rb in zip(ea.names, ea.recipes, eb.recipes):
        if name in ("bias", "mask") and any(p[0] == "const" for p in ra[1]):
            return (f"a constant {name} operand (computed from the sizes, not a causal or "
                    "window band) cannot be built at symbolic sizes")
        if name == "alibi" and (ra[1].shape != rb[1].shape or not np.array_equal(ra[1], rb[1])):
            return "the ALiBi slopes differ between the instantiations"
    if a.empty_rows == "mean" and ea.const_empty is not None and not _runtime_parts(ea):
        return ("constant masks leave rows without a visible key (their fix-up is built at "
                "static sizes only)")
    return None


def _seen_from(value, dot, graph: Graph) -> ir.Value | None:
    """``value`` as an SSA value of ``dot``'s block: passed down the unique call chain from
    its function to ``dot``'s, and defined before ``dot`` there; else None."""
    target = Graph.function_of(dot)
    home = (value.owner.owner.operation if isinstance(value, ir.BlockArgument)
            else Graph.function_of(value.owner))
    chain, fn = [], target
    while fn is not None and fn != home and len(chain) < 16:
        call = graph.only_call_site(fn)
        if call is None:
            return None
        chain.append((call, fn))
        fn = Graph.function_of(call)
    if fn != home:
        return None
    for call, callee in reversed(chain):
        at = [i for i, x in enumerate(call.operands) if x == value]
        if not at:
            return None
        value = callee.regions[0].blocks[0].arguments[at[0]]
    block = dot.operation.block
    if isinstance(value, ir.BlockArgument):
        return value if value.owner == block else None
    owner = value.owner.operation
    return value if owner.block == block and owner.is_before_in_block(dot.operation) else None


def _layouts(plan) -> list:
    return [plan.inputs[n][1] for n in "qkv"] + [plan.kernel[n] for n in "qkvo"] + \
        [plan.exit_layout] + [lay for _, lay in _runtime_parts(plan.extras)]


def _same_layouts(a: AttentionSite, b: AttentionSite) -> str | None:
    shape = lambda lays: [[[(p[0], p[1]) for p in d] for d in lay] for lay in lays]  # noqa: E731
    if shape(_layouts(a.plan)) != shape(_layouts(b.plan)):
        return "the layouts of Q, K, V or the output differ"
    return None


def _same_attributes(a: AttentionSite, b: AttentionSite) -> str | None:
    site = lambda *names: [(f, getattr(a, f), getattr(b, f)) for f in names]  # noqa: E731
    pairs = site("target", "causal") + \
        [(f, a.plan.attribute(f), b.plan.attribute(f))   # the call's other attributes
         for f in {**a.plan.attributes, **b.plan.attributes}] + \
        site("layout", "heads", "kv_heads", "head_dim", "dtype", "extras", "empty_rows")
    for f, x, y in pairs:
        if x != y:
            return f"{f} {x!r} vs {y!r}"
    return None


def _symbols(a, b, first: dict, second: dict) -> dict:
    """{piece of ``a``: variable} for the pieces whose sizes differ between the two
    instantiations; Unsupported for a piece that is no single variable."""
    out = {}
    for lay_a, lay_b in zip(_layouts(a), _layouts(b)):
        for da, db in zip(lay_a, lay_b):
            for pa, pb in zip(da, db):
                if pa[2] == pb[2]:
                    continue
                names = [v for v in first if first[v] == pa[2] and second[v] == pb[2]]
                if len(names) != 1:
                    raise Unsupported(f"an axis of size {pa[2]} / {pb[2]} in the two "
                                      "instantiations is no single dimension variable "
                                      "(a product of them, or a multiple)")
                out[pa] = names[0]
    return out


def match_module(module: ir.Module, options) -> list:
    """[(dot_general of ``module``, AttentionSite | Rejection)] for a polymorphic module.

    A matched AttentionSite's plan is a PolyPlan over ``module``'s own ops. Each site is
    matched twice per instance: with Q, K, V walked back to their sources (a constant scale,
    upcasts and a K/V head broadcast then go into the call, as for static modules), used
    when every source has a counterpart in the dynamic module; else on the products' own
    operands."""
    from flashgen.rewrite.driver import collect_dots, failure_reason, match_all, site_where
    ops = [op.operation for op in nested_ops(module.operation)]
    try:
        dims = dimension_variables(module)
        variables = sorted(set(dims.values()))
        first, second = instantiation_sizes(module, dims, variables)
        copies = [instantiate(module, dims, sizes) for sizes in (first, second)]
    except Unsupported as e:
        return _module_rejections(module, collect_dots(module), options,
                                  f"a shape-polymorphic module: {e}")
    except Exception as e:   # noqa: BLE001 - see driver.failure_reason
        return _module_rejections(module, collect_dots(module), options, failure_reason(
            "instantiating the shape-polymorphic module at static sizes", e))
    found = {True: [], False: []}     # walk_inputs -> per instance {tag: [(op, record)]}
    for copy in copies:
        with copy.context:
            for walk in (True, False):
                by_tag: dict = {}
                for op, r in match_all(copy, options, polymorphic=True, walk_inputs=walk):
                    by_tag.setdefault(tag_of(op), []).append((op, r))
                found[walk].append(by_tag)
    out = []
    with module.context:
        ctx = _Context(ops, function(module, "main"), Graph(module), first, second)
        for tag in sorted(t for t in found[False][0] if t is not None):
            try:
                record = _decide(ctx, tag, found[True], walk=True)
                if not isinstance(record, AttentionSite):
                    record = _decide(ctx, tag, found[False], walk=False)
            except Exception as e:   # noqa: BLE001 - see driver.failure_reason
                record = Rejection(*site_where(ops[tag]), failure_reason(
                    "matching the shape-polymorphic site", e))
            out.append((ops[tag], record))
    return out


@dataclasses.dataclass
class _Context:
    ops: list          # the dynamic module's ops, indexed by tag
    main: object
    graph: Graph
    first: dict        # the two instantiations' sizes
    second: dict


def _decide(ctx: _Context, tag: int, found: list, walk: bool):
    """The AttentionSite (plan over the dynamic module) or Rejection for the Q·K product
    ``tag``, from its records in the two instances ``found``."""
    dyn1 = ctx.ops[tag]
    records = found[0][tag] + found[1].get(tag, [])
    from flashgen.rewrite.driver import site_where
    where = site_where(dyn1)
    rejected = [r for _, r in records if not isinstance(r, AttentionSite)]
    if rejected:
        r = rejected[0]
        reason = r.reason
        details = {k: v for k, v in r.details.items() if k != "q_shape"}  # instance's
        if "head dim" in reason and _symbolic_contraction(dyn1):
            # the instantiation named an unsupported head dim of its own choosing
            reason = "the head dim is symbolic; the kernel specialization needs it static"
            details = {}
        return Rejection(*where, reason, matched=r.matched, details=details)
    a = records[0][1]
    why = None if tag in found[1] else "the second instantiation found no site here"
    for _, r in records[1:]:
        why = why or _same_layouts(a, r)
    tags2 = {tag_of(r.plan.exit_op) for _, r in records}
    if len(tags2) != 1 or None in tags2:
        why = why or "the P·V product is not one dot_general of the module"
    if why is None:
        dyn2 = ctx.ops[tags2.pop()]
        if dyn2.block != dyn1.block:
            why = "the Q·K and P·V products are in different functions"
    if why is None:
        try:
            symbols = _call_symbols(found[0][tag], found[1][tag], ctx.first, ctx.second)
            why = _static_kernel_dims(a.plan.kernel, symbols)
        except Unsupported as e:
            why = str(e)
        for model, kernel in ((a.head_dim, a.plan.spec.head_dim), (a.plan.head_dim_v, a.plan.spec.head_dim_v)):
            if why is None and kernel != model:
                why = (f"head dim {model} is not a kernel's (zero-padding it to "
                       f"{kernel} is done for static shapes only)")
        if why is not None:
            return Rejection(*where, f"a shape-polymorphic site: {why}")
    for _, r in records[1:]:
        why = why or _same_attributes(a, r)
    if why is not None:
        return Rejection(*where, "a shape-polymorphic site that does not match alike at two "
                         f"instantiations: {why}")
    why = _static_extras(a, found[1][tag][0][1])
    if why is not None:
        return Rejection(*where, f"a shape-polymorphic site: {why}")
    if walk:
        values = [_sources(ctx, r, dyn2) for _, r in records]
    else:
        values = [_operands(r, op, r.plan.exit_op, dyn1, dyn2) for op, r in records]
    if any(v is None for v in values) or any(v != values[0] for v in values[1:]):
        return Rejection(*where, "a shape-polymorphic site whose Q, K, V have no counterpart "
                         "in the dynamic module")
    try:
        extras = [_dynamic_extras(ctx, r.plan, dyn2) for _, r in records]
    except Unsupported as e:
        return Rejection(*where, f"a shape-polymorphic site: {e}")
    read = [([v for v, _ in _runtime_parts(x)], [v for v, _ in s]) for x, s in extras]
    if any(r != read[0] for r in read[1:]):
        return Rejection(*where, "a shape-polymorphic site whose inlined copies read "
                         "different extra operands")
    return _site(a, found[1][tag][0][1], dyn1, dyn2, values[0], symbols, where, ctx.first,
                 ctx.second, extras[0])


def _symbolic_contraction(dot) -> bool:
    from flashgen.rewrite.chain import dot_dims
    lhs = dot.operands[0].type
    return any(lhs.is_dynamic_dim(i) for i in dot_dims(dot)[2])


def _call_symbols(records0: list, records1: list, first: dict, second: dict) -> dict:
    """The symbolic pieces of a site (_symbols), alike for every inlined copy of it (a
    private function called from several places is rewritten once)."""
    if len(records0) != len(records1):
        raise Unsupported("the two instantiations inline the site a different number of times")
    found = [_symbols(a.plan, b.plan, first, second) for (_, a), (_, b) in zip(records0, records1)]
    named = [{(p[0], p[1]): v for p, v in f.items()} for f in found]
    if any(n != named[0] for n in named[1:]):
        raise Unsupported("the calls of the site's function differ in which axes are symbolic")
    return found[0]


def _static_kernel_dims(kernel: dict, symbols: dict) -> str | None:
    for name in "qkvo":
        for role, dim in zip(("heads", "head dim"), kernel[name][2:]):
            if any(p in symbols for p in dim):
                # Q, K, V, O share one head dim: an instance at a dim no kernel has is padded
                what = "the head dim" if role == "head dim" else f"the {role} of {name}"
                return f"{what} is symbolic; the kernel specialization needs it static"
    return None


def _site(a: AttentionSite, b: AttentionSite, dot1, dot2, values, symbols, where, first,
          second, extras):
    """The report record and PolyPlan of a site matched alike as ``a`` and ``b`` in the two
    instances; sizes that differ between them are shown by their variable's name."""
    plan = a.plan

    def sym(x, y):
        if x == y:
            return x
        names = [v for v in first if first[v] == x and second[v] == y]
        return names[0] if len(names) == 1 else "?"

    def shape(f):
        return tuple(sym(x, y) for x, y in zip(getattr(a, f), getattr(b, f)))

    site = dataclasses.replace(
        a, location=where[0], function=where[1], op=where[2],
        q_shape=shape("q_shape"), k_shape=shape("k_shape"), v_shape=shape("v_shape"),
        out_shape=shape("out_shape"), batch=sym(a.batch, b.batch),
        seq_q=sym(a.seq_q, b.seq_q), seq_k=sym(a.seq_k, b.seq_k),
        notes=list(a.notes) + [
            f"shape-polymorphic ({', '.join(sorted(set(symbols.values())))} symbolic): "
            f"matched alike at {sizes_text(first)} and at {sizes_text(second)}; the call "
            "has dynamic result shapes that shape refinement resolves at call time"])
    site.plan = PolyPlan(dot1=dot1, dot2=dot2, values=values,
                         inputs={n: plan.inputs[n][1] for n in "qkv"}, kernel=plan.kernel,
                         exit_layout=plan.exit_layout, symbols=symbols, spec=plan.spec,
                         attributes=plan.attributes, extras=extras[0],
                         empty_rows=plan.empty_rows, runtime_scales=extras[1],
                         band=(plan.spec.causal, plan.bottom_right, plan.window))
    return site


def _module_rejections(module, dots, options, reason: str) -> list:
    """Every attention candidate of ``module`` rejected with ``reason``."""
    from flashgen.rewrite.patterns import AttentionPattern
    pattern = AttentionPattern(Graph(module), target=options.target)
    from flashgen.rewrite.driver import site_where
    return [(op, Rejection(*site_where(op), reason)) for op in dots if pattern.is_candidate(op)]


# ----------------------------------------------------------------------------- rewriting
def rewrite_module(module: ir.Module, options) -> list:
    """Rewrite every attention site of a polymorphic ``module`` in place (the counterpart of
    driver.rewrite_module); the report records. Its sites were matched on the instantiations
    and use disjoint ops, so they are rewritten without matching again."""
    from flashgen.rewrite.driver import erase_dead, finish, rewrite_failed
    records, touched, erased = [], set(), set()
    for _, site in match_module(module, options):
        if isinstance(site, AttentionSite):
            try:
                rewrite(site, options.legacy_attrs)
            except Exception as e:   # noqa: BLE001 - the site is left alone, with the reason
                site = rewrite_failed(site, e)
            else:
                touched |= erase_dead(Graph(module), [site.plan.dot2.operation], erased)
                site.status = "rewritten"
                site.plan = None
        records.append(site)
    finish(module, touched)
    return records


class SymbolicSizes:
    """Run-time sizes of a site's pieces in the dynamic module: a symbolic piece's size is
    read (get_dimension_size) from an input dim that holds it and otherwise static pieces."""

    def __init__(self, symbols: dict, inputs: list, created: list):
        self.symbols = symbols
        self.inputs = inputs          # [(value, layout)]
        self.created = created
        self._read: dict = {}     # variable -> i32 scalar
        self._parts: dict = {}    # i32 constants, 1-element dim sizes, shape tensors: built once

    def _i32(self, n: int, shape=()) -> ir.Value:
        key = (shape, n)
        if key not in self._parts:
            self._parts[key] = adapters.constant(np.full(shape, n, np.int32),
                                                 ir.IntegerType.get_signless(32), self.created)
        return self._parts[key]

    def variable(self, var: str) -> ir.Value:
        """The i32 scalar value of a dimension variable."""
        if var in self._read:
            return self._read[var]
        for value, layout in self.inputs:
            for i, dim in enumerate(layout):
                syms = [p for p in dim if p in self.symbols]
                if len(syms) == 1 and self.symbols[syms[0]] == var:
                    op = stablehlo.GetDimensionSizeOp(value, i)
                    self.created.append(op)
                    x = op.result
                    rest = prod(p[2] for p in dim if p not in self.symbols)
                    if rest != 1:
                        x = adapters.binary("divide", x, self._i32(rest), self.created)
                    self._read[var] = x
                    return x
        raise ValueError(f"no input dim holds the dimension variable {var!r} alone")

    def dim(self, pieces) -> ir.Value | int:
        """The size of a dim holding ``pieces`` (or of a static size, an int): an int when
        static, else an i32 scalar."""
        if isinstance(pieces, int):
            return pieces
        static = prod(p[2] for p in pieces if p not in self.symbols)
        dynamic = [self.variable(self.symbols[p]) for p in pieces if p in self.symbols]
        if not dynamic:
            return static
        x = dynamic[0]
        for y in dynamic[1:]:
            x = adapters.binary("multiply", x, y, self.created)
        if static != 1:
            x = adapters.binary("multiply", x, self._i32(static), self.created)
        return x

    def shape_tensor(self, dims) -> ir.Value:
        """A tensor<rank x i32> holding the sizes of ``dims``."""
        whole = ("shape", tuple(d if isinstance(d, int) else tuple(d) for d in dims))
        if whole in self._parts:
            return self._parts[whole]
        parts = []
        for d in dims:
            key = ("dim", d if isinstance(d, int) else tuple(d))
            if key not in self._parts:
                n = self.dim(d)
                self._parts[key] = self._i32(n, (1,)) if isinstance(n, int) else \
                    adapters.reshape(n, [1], self.created)
            parts.append(self._parts[key])
        if len(parts) == 1:
            self._parts[whole] = parts[0]
        else:
            op = stablehlo.ConcatenateOp(parts, 0)
            self.created.append(op)
            self._parts[whole] = op.result
        return self._parts[whole]

    def type_shape(self, dims) -> list:
        dyn = ir.ShapedType.get_dynamic_size()
        return [d if isinstance(d, int) else
                dyn if any(p in self.symbols for p in d) else prod(p[2] for p in d)
                for d in dims]

    def broadcast(self, x: ir.Value, dims, bdims, created) -> ir.Value:
        """broadcast_in_dim of ``x`` to a tensor whose dims hold ``dims``."""
        shape = self.type_shape(dims)
        if ir.ShapedType.get_dynamic_size() not in shape:
            return adapters.broadcast(x, shape, bdims, created)
        t = ir.RankedTensorType.get(shape, x.type.element_type)
        op = stablehlo.DynamicBroadcastInDimOp(t, x, self.shape_tensor(dims), list(bdims))
        created.append(op)
        return op.result

    def full(self, value, elt, dims, created) -> ir.Value:
        """A tensor of ``value`` whose dims hold ``dims``."""
        return self.broadcast(adapters.constant(np.full((), value), elt, created), dims, [],
                              created)

    def iota(self, dims, axis: int, created) -> ir.Value:
        """An i32 iota along ``axis`` of a tensor whose dims hold ``dims``."""
        t = ir.RankedTensorType.get(self.type_shape(dims), ir.IntegerType.get_signless(32))
        op = stablehlo.DynamicIotaOp(t, self.shape_tensor(dims), axis)
        created.append(op)
        return op.result

    def reshape(self, x: ir.Value, dims, created) -> ir.Value:
        shape = self.type_shape(dims)
        if ir.ShapedType.get_dynamic_size() not in shape:
            return adapters.reshape(x, shape, created)
        t = ir.RankedTensorType.get(shape, x.type.element_type)
        op = stablehlo.DynamicReshapeOp(t, x, self.shape_tensor(dims))
        created.append(op)
        return op.result


def rewrite(site: AttentionSite, legacy_attrs: bool = False) -> None:
    """Insert the dynamic custom call before the site's P·V product and redirect its uses."""
    from flashgen.emit import emit_custom_call
    plan: PolyPlan = site.plan
    if legacy_attrs:
        raise ValueError("a shape-polymorphic site needs the native attribute form "
                         "(StableHLO >= 1.3)")
    values = plan.values
    kdt = ir.Type.parse(plan.spec.dtype)
    created: list = []
    loc = ir.Location.name("flashgen.attention", childLoc=plan.dot1.location)
    with loc, ir.InsertionPoint(plan.dot2.operation):
        try:
            sizes = SymbolicSizes(plan.symbols, [(values[n], plan.inputs[n]) for n in "qkv"],
                                  created)
            operands = []
            for n in "qkv":
                x = adapters.adapt(values[n], plan.inputs[n], plan.kernel[n], created,
                                   dynamic=sizes)
                if x.type.element_type != kdt:
                    x = adapters.convert(x, kdt, created)
                if n == "q":
                    for scalar, divide in plan.runtime_scales:
                        x = adapters.scale_by_scalar(x, scalar, divide, created, sizes,
                                                     plan.kernel["q"])
                operands.append(x)
            names = plan.extras.names if plan.extras is not None else ()
            if names:
                operands += X.emit(plan.extras, plan.spec.dtype, created, dynamic=sizes)
            b, sq, hq, _ = plan.kernel["o"]
            o, _lse = emit_custom_call(
                plan.spec, "fwd", operands, **plan.attributes, extras=names,
                result_shapes=[sizes.shape_tensor(plan.kernel["o"]),
                               sizes.shape_tensor((b, hq, sq))])
            created.append(o.owner)
            if plan.empty_rows == "mean":
                o = polymorphic_rows.emit_mean_fixup(
                    o, operands[2], empty_rows.visible_parts(plan.extras, operands[3:]),
                    plan.kernel, plan.band, sizes, created)
            out = adapters.adapt(o, plan.kernel["o"], plan.exit_layout, created, dynamic=sizes)
            want = plan.dot2.result.type
            if out.type.element_type != want.element_type:
                out = adapters.convert(out, want.element_type, created)
            if out.type != want:   # a static dim the module types as dynamic, or the reverse
                op = stablehlo.ConvertOp(want, out)
                created.append(op)
                out = op.result
        except Exception:
            for op in reversed(created):
                op.operation.erase()
            raise
    plan.dot2.result.replace_all_uses_with(out)
