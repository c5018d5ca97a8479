"""Apply the attention pattern to a whole module.

1. list every dot_general (functions and nested regions: while bodies, ...)
2. match each one (read-only) -> AttentionSite | Rejection | nothing
3. rewrite matched sites one at a time, in program order; each site is matched
   again right before its rewrite so that earlier rewrites never leave it stale
4. erase what became dead (only pure ops, only ops reached from a rewritten site),
   then private functions no call reaches any more
5. verify the module; a failure there is a flashgen bug and nothing is returned
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from jaxlib.mlir import ir

from flashgen.errors import FlashgenError
from flashgen.rewrite.graph import Graph, nested_ops, op_name
from flashgen.rewrite.patterns import AttentionPattern
from flashgen.rewrite.report import AttentionSite, Rejection

_PURE = {
    "stablehlo." + n for n in (
        "constant iota broadcast_in_dim broadcast reshape transpose convert bitcast_convert "
        "dot_general dot add subtract multiply divide remainder maximum minimum negate abs "
        "exponential exponential_minus_one log log_plus_one sqrt rsqrt cbrt power sign floor "
        "ceil round_nearest_even round_nearest_afz compare select and or not xor is_finite "
        "clamp tanh logistic sine cosine reduce slice dynamic_slice concatenate pad gather "
        "reverse real imag complex shift_left shift_right_logical shift_right_arithmetic "
        "popcnt count_leading_zeros dynamic_broadcast_in_dim dynamic_reshape dynamic_iota "
        "get_dimension_size").split()
} | {"chlo.erf", "chlo.tan", "chlo.top_k"}


@dataclasses.dataclass
class RewriteOptions:
    legacy_attrs: bool = False
    target: str = "cpu"


def collect_dots(module: ir.Module) -> list:
    return [op for op in nested_ops(module.operation)
            if op.operation.name == "stablehlo.dot_general"]


def match_all(module: ir.Module, options: RewriteOptions, proven: Optional[dict] = None,
              polymorphic: bool = False, walk_inputs: bool = True) -> list:
    graph = Graph(module)
    pattern = AttentionPattern(graph, legacy_attrs=options.legacy_attrs, target=options.target,
                               proven=proven, polymorphic=polymorphic, walk_inputs=walk_inputs)
    results = []
    for op in collect_dots(module):
        r = match_contained(pattern, op)
        if r is not None:
            results.append((op, r))
    # a matched site's P·V product is no candidate of its own; overlapping matches lose
    taken: set = set()
    out = []
    for op, r in results:
        if isinstance(r, AttentionSite):
            ops = set(r.plan.site_ops)
            if ops & taken:
                out.append((op, Rejection(r.location, r.function, r.op,
                                          "overlaps another attention site")))
                continue
            taken |= ops
        out.append((op, r))
    return [(op, r) for op, r in out
            if isinstance(r, AttentionSite) or (op.operation, ()) not in taken]


def rewrite_module(module: ir.Module, options: Optional[RewriteOptions] = None) -> list:
    """Rewrite every attention site of ``module`` in place; returns the report records."""
    options = options or RewriteOptions()
    proven: dict = {}   # training sites' backward proofs, reused when a site is matched again
    found = [(hash(op.operation), op, r) for op, r in match_all(module, options, proven)]
    records = []
    touched_functions: set = set()
    erased: set = set()
    for key, op, first in found:
        if isinstance(first, Rejection):
            records.append(first)
            continue
        if key in erased:
            records.append(Rejection(first.location, first.function, first.op,
                                     "removed by an earlier rewrite"))
            continue
        pattern = AttentionPattern(Graph(module), legacy_attrs=options.legacy_attrs,
                                   target=options.target, proven=proven)
        site = match_contained(pattern, op, describe=False)
        if not isinstance(site, AttentionSite):  # an earlier rewrite changed its surroundings
            if site is not None:
                site.op, site.location = first.op, first.location
            records.append(site if site is not None else Rejection(
                first.location, first.function, first.op, "no longer matches after earlier rewrites"))
            continue
        try:
            pattern.rewrite(site)
        except Exception as e:   # noqa: BLE001 - the site is left alone, with the reason
            records.append(rewrite_failed(site, e))
            continue
        roots = [o for o, ctx in site.plan.site_ops if not ctx]
        if site.plan.backward is not None:
            roots += site.plan.backward.roots
        touched_functions |= erase_dead(pattern.g, roots, erased)
        site.status = "rewritten"
        site.op, site.location = first.op, first.location  # named as in the input
        site.plan = None
        records.append(site)
    finish(module, touched_functions)
    return records


def site_where(op) -> tuple:
    """(location, function, op name) of ``op``, as a Rejection names a site."""
    return str(op.location), Graph.function_name(Graph.function_of(op)), op_name(op)


def failure_reason(what: str, e: Exception) -> str:
    """Why a site is left alone after ``what`` raised ``e``. Matching is read-only and a
    rewrite erases the ops it created before it raises, so the module is intact and one
    site's failure never ends the whole rewrite (nor reaches the user as a traceback)."""
    if isinstance(e, ir.MLIRError):
        detail = _first_error(e)
    elif isinstance(e, (ValueError, RuntimeError)):
        detail = str(e)
    else:
        detail = f"{type(e).__name__}: {e} (a flashgen bug)"
    return f"{what} failed: {detail}"


def match_contained(pattern: AttentionPattern, op, **kwargs):
    """pattern.match(op), or a Rejection naming the error it raised."""
    try:
        return pattern.match(op, **kwargs)
    except Exception as e:   # noqa: BLE001 - see failure_reason
        return Rejection(*site_where(op), failure_reason("matching the site", e))


def rewrite_failed(site: AttentionSite, e: Exception) -> AttentionSite:
    """``site``, whose rewrite raised ``e``, marked rejected with the reason."""
    site.status, site.reason = "rejected", failure_reason("the rewrite", e)
    site.plan = None
    return site


def finish(module: ir.Module, touched_functions: set) -> None:
    """Drop private functions the rewrites left unused; verify the module (FlashgenError)."""
    if touched_functions:
        _erase_unused_functions(module, touched_functions)
    try:
        ok = module.operation.verify()
    except ir.MLIRError as e:
        ok, why = False, _first_error(e)
    else:
        why = "verification failed"
    if not ok:
        raise FlashgenError(f"the rewritten module does not verify (a flashgen bug): {why}")


def _first_error(e: Exception) -> str:
    for line in str(e).splitlines():
        if "error:" in line:
            return line.split("error:", 1)[1].split(": ", 1)[-1].strip()
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _erasable(graph: Graph, op, pure_funcs: dict) -> bool:
    name = op.name
    if name in _PURE:
        return True
    if name == "func.call":
        fn = graph.callee(op)
        return fn is not None and _pure_function(graph, fn, pure_funcs)
    return False


def _pure_function(graph: Graph, fn, memo: dict) -> bool:
    """Whether every op ``fn`` runs is pure, through calls to private functions at any depth.

    A depth-first walk of the call graph on an explicit stack (call chains can be thousands
    deep); a call cycle counts as impure. ``memo`` maps function names to the answer."""
    name = Graph.function_name
    if name(fn) in memo:
        return bool(memo[name(fn)])
    memo[name(fn)] = None  # on the current call path
    stack = [[fn, _local_callees(graph, fn), 0]]
    while stack:
        frame = stack[-1]
        f, callees, i = frame
        if callees is not None and i < len(callees):
            c = callees[i]
            if name(c) not in memo:
                memo[name(c)] = None
                stack.append([c, _local_callees(graph, c), 0])
                continue
            if memo[name(c)]:
                frame[2] += 1
                continue
            callees = None  # the callee is impure, or on the path (a cycle)
        memo[name(f)] = callees is not None
        stack.pop()
    return bool(memo[name(fn)])


def _local_callees(graph: Graph, fn) -> list | None:
    """The private functions ``fn`` calls, or None when ``fn`` itself has an impure op."""
    callees = []
    for inner in nested_ops(fn):
        o = inner.operation
        if o.name in ("func.return", "stablehlo.return") or o.name in _PURE:
            continue
        callee = graph.callee(o) if o.name == "func.call" else None
        if callee is None:
            return None
        callees.append(callee)
    return callees


def erase_dead(graph: Graph, roots: list, erased: set) -> set:
    """Erase ops of ``roots`` (and their producers) that no longer have users.

    Adds the erased ops' keys to ``erased``; returns the callees of erased calls."""
    # keys are taken while an op is alive: a wrapper of an erased op must not be touched
    pending = [(hash(op), op) for op in roots]
    pure_funcs: dict = {}
    callees: set = set()
    while pending:
        key, op = pending.pop()
        if key in erased:
            continue
        if any(len(list(r.uses)) for r in op.results):
            continue
        if not _erasable(graph, op, pure_funcs):
            continue
        producers = [v.owner.operation for v in op.operands if isinstance(v, ir.OpResult)]
        producers = [(hash(p), p) for p in producers]
        if op.name == "func.call":
            callees.add(ir.FlatSymbolRefAttr(op.attributes["callee"]).value)
        erased.add(key)
        op.erase()
        pending.extend(p for p in producers if p[0] not in erased)
    return callees


def _erase_unused_functions(module: ir.Module, candidates: set) -> None:
    while True:
        used = _callees_of(module.operation)
        removed = False
        for op in list(module.body.operations):
            o = op.operation
            if o.name != "func.func":
                continue
            name = ir.StringAttr(o.attributes["sym_name"]).value
            vis = o.attributes["sym_visibility"] if "sym_visibility" in o.attributes else None
            if name in candidates and name not in used and vis is not None and \
                    ir.StringAttr(vis).value == "private":
                # functions it calls may become unused in turn
                candidates |= _callees_of(o)
                o.erase()
                removed = True
        if not removed:
            return


def _callees_of(fn) -> set:
    """Names of the functions `fn` (an op: a function or the module) calls or references."""
    out = set()
    for inner in nested_ops(fn):
        o = inner.operation
        if o.name == "func.call":
            out.add(ir.FlatSymbolRefAttr(o.attributes["callee"]).value)
        elif "called_computations" in o.attributes:
            for a in ir.ArrayAttr(o.attributes["called_computations"]):
                out.add(ir.FlatSymbolRefAttr(a).value)
    return out
