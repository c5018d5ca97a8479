"""The backward half of a training graph: find an attention site's VJP and prove it.

``jax.grad`` (and torch's autograd traced by torchax) leaves next to each attention
forward a *cluster* of ops that reads the forward's intermediates (probabilities,
exponentials, row sums) and the cotangent dO of the site's output, and produces the
gradients of Q, K and V: dV = Pᵀ·dO, dP = dO·Vᵀ, the softmax VJP, the transposes of
the mask/scale/layout steps, dQ = dS·K, dK = dSᵀ·Q. ``collect`` finds that cluster by
walking the uses of the intermediates; every use must land in it. ``prove`` runs the
forward site and the cluster in float64 on random inputs (flashgen.rewrite.evaluate)
and checks the adjoint identity, for each input X of the site and a random direction δ:

    <dO, (o(X + hδ) - o(X - hδ)) / 2h>  ==  <dX, δ>

which holds for the VJP and, with probability one, for nothing else. The cluster's
outputs are chosen by the same check among the values its last products flow through
(layout ops, converts, constant scales, the sum over a GQA group), so the transposes
of the input chains need no bookkeeping of their own. Only a proven cluster is
replaced (by flashgen.rewrite.patterns: one flashgen_bwd_* call); anything else is
rejected with the reason.

A site that adds a run-time bias may have its bias differentiated (a learned relative
position bias): the bias gradient is dS (the scores' cotangent where the bias is added)
summed over the dims the forward broadcast, shaped and typed as the bias's source. The
walk then follows the cluster past dbias into whatever consumes it (a return, the
gather's transpose, another layer's dbias); the source is one more input of the adjoint
identity (its own direction, checked separately so that an undifferentiated bias needs
no gradient), its gradient is chosen among the cluster's values shaped like it, and the
cluster is cut back to what the gradients are computed from: every other op the walk
reached must consume dbias only, and is kept, reading the kernel's dbias instead.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from jaxlib.mlir import ir

from flashgen.rewrite.errors import Reject
from flashgen.rewrite.evaluate import Evaluator
from flashgen.rewrite.fold import MAX_ELEMENTS
from flashgen.rewrite.graph import Graph, Ref, op_name, short_location

_NOT_THE_VJP = ("the ops reached from the attention's intermediates do not compute its "
                "gradients dQ, dK, dV (checked numerically against the forward)")
MAX_CLUSTER = 600          # ops in one backward cluster before giving up
MAX_LEAF_SEARCH = 4000     # ops visited looking for the leaves of the proof
STEP = 1e-4                # central-difference step (inputs are O(1))
TOLERANCE = 1e-6           # relative error allowed in the adjoint identity

_CLUSTER_OPS = {
    "stablehlo." + n for n in (
        "add subtract multiply divide negate maximum minimum exponential select compare "
        "and or not convert broadcast_in_dim reshape transpose reduce tanh sqrt rsqrt abs "
        "power clamp").split()}
_TAIL_OPS = {"stablehlo.transpose", "stablehlo.reshape", "stablehlo.convert",
             "stablehlo.multiply", "stablehlo.divide", "stablehlo.reduce",
             "stablehlo.broadcast_in_dim"}
_LAYOUT = {"stablehlo.transpose", "stablehlo.reshape", "stablehlo.convert",
           "stablehlo.broadcast_in_dim"}


@dataclasses.dataclass
class SiteView:
    """What the backward needs from a matched forward site."""
    ops: set                 # {(operation, ctx)} of the forward site
    exit_value: ir.Value     # the site's output o
    probs: set               # {(value, ctx)} the probabilities and their layout views
    q_operand: Ref           # the operands of the Q·K product
    k_operand: Ref
    v_operand: Ref           # V as the P·V product reads it
    inputs: dict             # 'q'|'k'|'v' -> ir.Value: what the kernel reads
    biases: dict = dataclasses.field(default_factory=dict)
    # the sources of the site's run-time bias terms -> the values on their way to the
    # scores (layout views, the source included) where their gradient may be taken
    uses: dict = dataclasses.field(default_factory=dict)
    # 'q'|'k'|'v' -> (product, operand index): where the forward reads that input
    added_fill: bool = False
    # rows without a visible key keep their scores' cotangent: an added finite fill (see
    # _flat_rows_zeroed); the rewrite adds those rows' dQ, dK terms after the call


@dataclasses.dataclass
class Backward:
    ops: set                 # {(operation, ctx)} of the cluster (closed: no outside user)
    do: ir.Value             # the cotangent of the site's output
    grads: dict              # 'q'|'k'|'v' -> ir.Value the kernel's gradient replaces
    roots: list              # ops to try erasing once the gradients are replaced
    dbias: dict = dataclasses.field(default_factory=dict)
    # bias view -> the value holding its gradient (one per differentiated source); its
    # uses outside ``ops`` are redirected
    added_fill: bool = False  # SiteView.added_fill: the rewrite adds the empty rows' dQ, dK


def find(g: Graph, site: SiteView, proven: dict | None = None) -> Backward:
    """The proven backward cluster of ``site``; raises Reject. ``proven`` remembers proofs
    by the ops they covered: the driver matches a site twice (once to list the sites, once
    right before rewriting it), and the check is the expensive part."""
    scores = max(_size(r) for op, _ in site.ops for r in op.results)
    if scores > MAX_ELEMENTS:
        # the check runs the site in float64 at its real size, holding its [.., Sq, Sk]
        # intermediates (the folder's size limit)
        raise Reject(f"the site is too large to check its backward ({scores} > 2^24 elements "
                     "in one intermediate)")
    ops, tails, dv_operand, escapes = _walk(g, site)
    if dv_operand is None:
        raise Reject("the backward has no dV = Pᵀ·dO product")
    do, do_views = _cotangent(g, site, dv_operand)
    ops |= _dp_products(g, site, ops, do_views)
    links = _links(g, ops) if site.biases else None
    bias_cands = [_bias_candidates(g, site, ops, links, tails, views)
                  for views in site.biases.values()]
    key = frozenset((hash(op), op.name, tuple(hash(c) for c in ctx))
                    for op, ctx in site.ops | ops) | {hash(do)}
    if proven is not None and key in proven:
        chosen = proven[key]
        if chosen.get("swapped"):
            tails["q"], tails["k"] = tails["k"], tails["q"]
    else:
        try:
            chosen = _prove(g, site, ops, tails, do, bias_cands)
        except Reject:
            # x·xᵀ: the walk cannot tell dQ = dS·K from dK = dSᵀ·Q (both read x); the
            # proof, moving each role alone, can
            if g.resolve(site.q_operand) != g.resolve(site.k_operand):
                raise
            tails["q"], tails["k"] = tails["k"], tails["q"]
            chosen = dict(_prove(g, site, ops, tails, do, bias_cands), swapped=True)
        if proven is not None:
            proven[key] = chosen
    grads = {r: dict(tails[r][1])[chosen[r]] for r in "qkv"}
    dbias = dict(cands[chosen[f"b{j}"]][1:] for j, cands in enumerate(bias_cands)
                 if chosen[f"b{j}"] is not None)
    if site.biases:
        cut = _cut(g, site, ops, links, tails, dbias, escapes)
        # a bias gradient that the program does not use (the backward's dS itself, for an
        # undifferentiated bias) is not asked of the kernel
        used = {v: d for v, d in dbias.items()
                if any((u.operation, uctx) not in cut for u, _, uctx in g.users(Ref(d)))}
        if used != dbias:
            dbias = used
            cut = _cut(g, site, ops, links, tails, dbias, escapes)
        ops = cut
    for role in "qkv":
        ops |= set(tails[role][0][:chosen[role] + 1])
    _check_closed(g, ops, set(grads.values()) | set(dbias.values()))
    roots = [op for op, ctx in ops if not ctx] + [ctx[0] for _, ctx in ops if ctx] + \
        [op for op, _ in do_views]
    return Backward(ops, do, grads, roots, dbias, site.added_fill)


# ----------------------------------------------------------------------------- the walk
def _walk(g: Graph, site: SiteView):
    """Every op reached from the forward's intermediates, up to the products that make
    dQ, dK and dV. Returns (ops, tails, dO as the dV product reads it, escapes).

    A use that cannot be part of the backward rejects the site, except, in a site with a
    run-time bias, a use of a value the backward computes (not of the forward's own
    intermediates): it may consume dbias, which only the cut after the proof can tell, so
    it is returned in ``escapes`` as (ref, the reason to reject with otherwise)."""
    internal = {(r, ctx) for op, ctx in site.ops for r in op.results
                if not (r == site.exit_value and not ctx)}
    q_op, k_op, v_op = (g.resolve(x) for x in (site.q_operand, site.k_operand, site.v_operand))
    ops: set = set()
    tails: dict = {}
    escapes: list = []
    dv_operand = None

    def escape(ref, reason):
        if not site.biases or (ref.value, ref.ctx) in internal:
            raise Reject(reason)
        escapes.append((ref, reason))

    stack = [Ref(v, ctx) for v, ctx in internal]
    while stack:
        ref = stack.pop()
        for user, idx, uctx in g.users(ref):
            key = (user.operation, uctx)
            if key in site.ops or key in ops:
                continue
            name = op_name(user)
            if name == "stablehlo.dot_general":
                other = g.resolve(Ref(user.operands[1 - idx], uctx))
                if (other.value, other.ctx) in internal or \
                        (other == v_op and other not in (q_op, k_op)):
                    # (with K = V, dQ = dS·K is such a product: the proof tells them apart)
                    raise Reject("an intermediate of the softmax meets V or another "
                                 f"intermediate in a product ({short_location(user)})")
                if other == k_op:
                    role = "k" if other == q_op and "q" in tails else "q"   # x·xᵀ: see find
                elif other == q_op:
                    role = "k"
                elif (ref.value, ref.ctx) in site.probs:
                    role, dv_operand = "v", Ref(user.operands[1 - idx], uctx)
                else:
                    escape(ref, "the softmax's intermediates feed a product that is not part "
                           f"of the attention backward ({short_location(user)})")
                    continue
                if role in tails or uctx:
                    raise Reject(f"the backward computes d{role.upper()} in more than one "
                                 "product")
                ops.add(key)
                tails[role] = _tail(g, user, site.inputs[role])
                continue
            if name == "func.return":
                fn = user.operation.parent.operation
                escape(ref, f"an intermediate of the attention leaves @{g.function_name(fn)} "
                       f"as output {idx} (a residual kept for a backward elsewhere, e.g. "
                       "lax.scan without jax.checkpoint, or a returned value)")
                continue
            if name in ("stablehlo.dynamic_update_slice", "stablehlo.return"):
                escape(ref, "an intermediate of the attention is stored for the backward "
                       "(a loop residual, e.g. lax.scan without jax.checkpoint): its "
                       "backward runs in another loop")
                continue
            if name not in _CLUSTER_OPS:
                escape(ref, f"an intermediate of the attention passes through {name} "
                       f"({short_location(user)}), which is not part of its backward")
                continue
            ops.add(key)
            if len(ops) > MAX_CLUSTER:
                raise Reject("the uses of the attention's intermediates grow beyond an "
                             "attention backward")
            stack.extend(Ref(r, uctx) for r in user.results)
    missing = sorted(set("qkv") - set(tails))
    if missing:
        raise Reject("the backward does not compute " + ", ".join(f"d{m.upper()}" for m in missing))
    return ops, tails, dv_operand, escapes


def _links(g: Graph, ops: set):
    """({op: its users among ``ops``}, {op: its producers among ``ops``})."""
    users = {k: [] for k in ops}
    for op, ctx in ops:
        for r in op.results:
            users[(op, ctx)] += [(u.operation, uctx) for u, _, uctx in g.users(Ref(r, ctx))
                                 if (u.operation, uctx) in ops]
    producers: dict = {}
    for k, us in users.items():
        for u in us:
            producers.setdefault(u, []).append(k)
    return users, producers


def _closure(seeds, edges: dict) -> set:
    """``seeds`` and everything reached from them along ``edges``."""
    out, stack = set(), list(seeds)
    while stack:
        k = stack.pop()
        if k not in out:
            out.add(k)
            stack.extend(edges.get(k, ()))
    return out


def _bias_candidates(g: Graph, site: SiteView, ops: set, links, tails: dict, views) -> list:
    """[(index, view, value)]: the values of the walked ops that may be the gradient of a
    bias with respect to one of its ``views`` (the view's shape, a float type, in the
    exit's block, and used beyond what dQ, dK, dV are computed from: a value only those
    read is no gradient the program takes), in program order."""
    core = _closure([tails[r][0][0] for r in "qkv"], links[1])
    block = site.exit_value.owner.operation.block
    position = {op: i for i, op in enumerate(block.operations)}

    def used_beyond(r, key):
        return key not in core or any((u.operation, uctx) not in core
                                      for u, _, uctx in g.users(Ref(r)))
    found = sorted((position[op], j, r) for op, ctx in ops if not ctx and op.block == block
                   for r in op.results if _is_float(r) and used_beyond(r, (op, ctx))
                   for j, view in enumerate(views)
                   if tuple(r.type.shape) == tuple(view.type.shape))
    return [(i, views[j], r) for i, (_, j, r) in enumerate(found)]


def _cut(g: Graph, site: SiteView, ops: set, links, tails: dict, dbias: dict,
         escapes: list) -> set:
    """The ops the gradients are computed from, out of everything the walk reached in a
    site with a run-time bias; raises Reject unless every other op consumes dbias only."""
    users, producers = links
    outputs = {(d.owner.operation, ()) for d in dbias.values()}
    keep = _closure([tails[r][0][0] for r in "qkv"] + list(outputs), producers)
    after = _closure([u for k in outputs for u in users[k] if u not in keep],
                     {k: [u for u in us if u not in keep] for k, us in users.items()})
    what = "dQ, dK, dV" + (" and dbias" if dbias else "")
    stray = sorted((op for op, _ in ops - keep - after), key=lambda op: str(op.location))
    if stray:
        raise Reject(f"the ops reached from the attention's intermediates compute more than "
                     f"{what} ({op_name(stray[0])} at {short_location(stray[0])})")
    for ref, reason in escapes:
        if ref.value in dbias.values() and not ref.ctx:
            continue
        if isinstance(ref.value, ir.BlockArgument) or \
                (ref.value.owner.operation, ref.ctx) not in after:
            raise Reject(f"{reason}; it is not downstream of a bias gradient (the site adds a "
                         f"run-time bias; the backward computes {what})")
    internal = [Ref(r, ctx) for op, ctx in site.ops for r in op.results
                if not (r == site.exit_value and not ctx)]
    for ref in internal:
        for user, _, uctx in g.users(ref):
            if (user.operation, uctx) not in keep and (user.operation, uctx) not in site.ops:
                raise Reject("an intermediate of the attention is read by an op that consumes "
                             f"its bias gradient ({op_name(user)} at {short_location(user)})")
    return keep


def _tail(g: Graph, dot, target: ir.Value):
    """The single-use chain after a gradient product: ([(op, ())...], [values]) where the
    values are shaped like ``target`` (the candidates for the gradient)."""
    chain, candidates = [(dot.operation, ())], []
    value = dot.result
    want = tuple(target.type.shape)
    for _ in range(24):
        if tuple(value.type.shape) == want:
            candidates.append((len(chain) - 1, value))
        uses = g.raw_users(value)
        if len(uses) != 1:
            break
        user = uses[0][0]
        if op_name(user) not in _TAIL_OPS or user.operation.block != dot.operation.block:
            break
        if op_name(user) in ("stablehlo.multiply", "stablehlo.divide") and \
                user.operands[1 - uses[0][1]] == value:
            break
        if op_name(user) == "stablehlo.broadcast_in_dim" and \
                _size(user.result) != _size(value):   # only a unit dim added (a reshape)
            break
        chain.append((user.operation, ()))
        value = user.results[0]
    return chain, candidates


def _cotangent(g: Graph, site: SiteView, dv_operand: Ref):
    """dO: the value shaped like the site's output that the dV product's other operand
    comes from through layout ops; and those layout ops."""
    want = tuple(site.exit_value.type.shape)
    r, views = dv_operand, []
    for _ in range(16):
        r = g.resolve(r)
        if r.ctx:
            break
        if tuple(r.value.type.shape) == want and _is_float(r.value):
            return r.value, views
        if isinstance(r.value, ir.BlockArgument):
            break
        op = r.value.owner
        if op_name(op) not in _LAYOUT:
            break
        views.append((op.operation, ()))
        r = Ref(op.operands[0], ())
    raise Reject("the cotangent of the attention output (dO) is not found: the dV product "
                 "reads a value that is not a layout view of one shaped like the output")


def _dp_products(g: Graph, site: SiteView, ops: set, do_views) -> set:
    """The dP = dO·Vᵀ products whose results the cluster reads (through layout ops),
    with those layout ops."""
    v_op = g.resolve(site.v_operand)
    found = set()
    for op, ctx in list(ops):
        for x in op.operands:
            r, path = g.resolve(Ref(x, ctx)), []
            while not isinstance(r.value, ir.BlockArgument) and \
                    op_name(r.value.owner) in _LAYOUT and len(path) < 8:
                path.append((r.value.owner.operation, r.ctx))
                r = g.resolve(Ref(r.value.owner.operands[0], r.ctx))
            if isinstance(r.value, ir.BlockArgument):
                continue
            prod_op = r.value.owner
            if op_name(prod_op) != "stablehlo.dot_general" or (prod_op.operation, r.ctx) in ops:
                continue
            sides = [g.resolve(Ref(y, r.ctx)) for y in prod_op.operands]
            if v_op in sides and any(_reaches(g, s, do_views) for s in sides if s != v_op):
                found |= {(prod_op.operation, r.ctx)} | set(path)
    return found


def _reaches(g: Graph, r: Ref, do_views) -> bool:
    """Is ``r`` one of the dO views the dV product reads (or dO through layout ops)?"""
    targets = {op for op, _ in do_views}
    for _ in range(16):
        if isinstance(r.value, ir.BlockArgument):
            return False
        op = r.value.owner.operation
        if op in targets:
            return True
        if op_name(op) not in _LAYOUT:
            return False
        r = g.resolve(Ref(op.operands[0], r.ctx))
    return False


def _check_closed(g: Graph, ops: set, outputs: set) -> None:
    for op, ctx in ops:
        for res in op.results:
            if res in outputs and not ctx:
                continue
            for user, idx, uctx in g.users(Ref(res, ctx)):
                if (user.operation, uctx) not in ops:
                    raise Reject("a value of the attention backward has another user "
                                 f"({op_name(user)} at {short_location(user)})")


# ----------------------------------------------------------------------------- the proof
def _prove(g: Graph, site: SiteView, ops: set, tails: dict, do: ir.Value,
           bias_cands: list) -> dict:
    """Choose each gradient among its candidates by the adjoint identity: Q, K, V among
    their tails' with one random direction for the three at once; each bias source's
    among ``bias_cands`` with a direction of its own (None: not differentiated). Returns
    {role: index}, roles 'q', 'k', 'v', 'b0', 'b1'...; raises Reject when Q, K, V have no
    choice that satisfies it."""
    rng = np.random.default_rng(20240)
    inputs = {n: site.inputs[n] for n in "qkv"}
    inputs.update({f"b{j}": b for j, b in enumerate(site.biases)})
    targets = [site.exit_value] + [v for role in tails for _, v in tails[role][1]] + \
        [v for cands in bias_cands for _, _, v in cands]
    base = {Ref(v): rng.standard_normal(tuple(v.type.shape)) for v in inputs.values()}
    base[Ref(do)] = rng.standard_normal(tuple(do.type.shape))
    for ref in _leaves(g, targets, set(base)):
        base[ref] = _random_like(rng, ref.value)
    delta = {n: rng.standard_normal(tuple(v.type.shape)) for n, v in inputs.items()}
    if site.added_fill:
        base[Ref(do)] = _flat_rows_zeroed(g, site, base, delta, base[Ref(do)])
    g0 = base[Ref(do)]

    def directional(roles):
        """<dO, the central difference of o along ``roles``' directions>, |dO|·|that|."""
        outs = []
        for sign in (1.0, -1.0):
            moved = dict(base)
            for n in roles:
                moved[Ref(inputs[n])] = base[Ref(inputs[n])] + sign * STEP * delta[n]
            out = Evaluator(g, moved).value(Ref(site.exit_value))
            if out is None:
                raise Reject("the attention forward cannot be evaluated to check its backward")
            outs.append(out)
        jvp = (outs[0] - outs[1]) / (2 * STEP)
        return float(np.sum(g0 * jvp)), float(np.linalg.norm(g0) * np.linalg.norm(jvp))

    ev = Evaluator(g, base)

    def terms(cands, direction):
        """[(index, <candidate, δ>, |candidate|·|δ|)]; ``direction(i)``: δ as candidate i
        sees it (a bias view: the source's δ carried along the view's layout ops)."""
        out = []
        for i, cand in cands:
            got, d = ev.value(Ref(cand)), direction(i)
            if got is not None and d is not None and np.all(np.isfinite(got)):
                out.append((i, float(np.sum(got * d)),
                            float(np.linalg.norm(got) * np.linalg.norm(d))))
        return out

    qkv = {r: terms(tails[r][1], lambda i, r=r: delta[r]) for r in "qkv"}
    bias = {}
    for j, cands in enumerate(bias_cands):
        carried = Evaluator(g, {Ref(inputs[f"b{j}"]): delta[f"b{j}"]})
        bias[f"b{j}"] = terms([(i, cand) for i, _, cand in cands],
                              lambda i, c=cands, e=carried: e.value(Ref(c[i][1])))
    del ev
    # candidates equal in float64 (a round trip through bf16) all pass; the last one is the
    # gradient in the input's own element type
    if _shared(site):
        chosen = _prove_by_role(g, site, base, delta, qkv, do)
    else:
        chosen = _prove_together(directional("qkv"), qkv)
    for role, cands in bias.items():
        chosen[role] = None
        if cands:
            lhs, scale = directional([role])
            for i, dot, norm in cands:
                if abs(lhs - dot) <= TOLERANCE * (scale + norm) + 1e-12:
                    chosen[role] = i
    return chosen


def _flat_rows_zeroed(g: Graph, site: SiteView, base: dict, delta: dict,
                      do: np.ndarray) -> np.ndarray:
    """``do`` with zeros where the forward's output does not move with Q and K.

    Under an added finite fill (transformers' ``scores + finfo.min``) a row without a
    visible key is ``fill`` everywhere: the forward is flat in Q and K there (its output
    the mean of V), but autodiff passes the scores' cotangent through the add, so the
    backward gives that row the VJP of a uniform softmax, nonzero dQ and dK: not the
    forward's derivative, which the identity would compare it with. Those rows are left
    out of the identity (dO = 0 there: every term of the VJP is linear in the row's dO);
    their gradients are the uniform softmax's, which the rewrite adds after the call
    (flashgen.rewrite.empty_rows.emit_added_fill_grads). Rows that see one key are flat
    too and drop out with them (their dQ, dK are zero on both sides)."""
    outs = []
    for sign in (1.0, -1.0):
        moved = dict(base)
        for n in "qk":
            moved[Ref(site.inputs[n])] = base[Ref(site.inputs[n])] + sign * STEP * delta[n]
        out = Evaluator(g, moved).value(Ref(site.exit_value))
        if out is None:
            raise Reject("the attention forward cannot be evaluated to check its backward")
        outs.append(out)
    moving = outs[0] != outs[1]
    if np.count_nonzero(moving) < moving.size // 2:
        # the identity would check too little (a mask leaving most rows without a key)
        raise Reject("the attention backward cannot be checked: the forward is flat in Q "
                     "and K on most rows of the random check")
    return np.where(moving, do, 0.0)


def _prove_together(jvp, qkv) -> dict:
    """One direction for Q, K and V at once: the tails' candidates whose sum satisfies the
    identity."""
    import itertools
    lhs, scale = jvp
    chosen = None
    for combo in itertools.product(*(qkv[r] for r in "qkv")):
        rhs = sum(t[1] for t in combo)
        bound = TOLERANCE * (scale + sum(t[2] for t in combo)) + 1e-12
        if abs(lhs - rhs) <= bound:
            chosen = {r: t[0] for r, t in zip("qkv", combo)}
    if chosen is None:
        raise Reject(_NOT_THE_VJP)
    return chosen


def _prove_by_role(g: Graph, site: SiteView, base: dict, delta: dict, qkv: dict,
                   do: ir.Value) -> dict:
    """Q, K and V are one value x (self-attention of x itself): moving x moves all three,
    and the identity would check only dQ + dK + dV. Each role is moved alone instead, where
    the forward's product reads it (``site.uses``: that operand gets x + hδ through the
    same ops as it reads x), and must satisfy the identity with its own gradient."""
    g0 = base[Ref(do)]
    chosen = {}
    for role in "qkv":
        op, idx = site.uses[role]
        outs = []
        for sign in (1.0, -1.0):
            moved = dict(base)
            moved[Ref(site.inputs[role])] = base[Ref(site.inputs[role])] + sign * STEP * delta[role]
            operand = Evaluator(g, moved).value(Ref(op.operands[idx]))
            out = None if operand is None else \
                Evaluator(g, base, {(op, idx): operand}).value(Ref(site.exit_value))
            if out is None:
                raise Reject("the attention forward cannot be evaluated to check its backward")
            outs.append(out)
        jvp = (outs[0] - outs[1]) / (2 * STEP)
        lhs, scale = float(np.sum(g0 * jvp)), float(np.linalg.norm(g0) * np.linalg.norm(jvp))
        passing = [i for i, dot, norm in qkv[role]
                   if abs(lhs - dot) <= TOLERANCE * (scale + norm) + 1e-12]
        if not passing:
            raise Reject(_NOT_THE_VJP)
        chosen[role] = passing[-1]
    return chosen


def _shared(site: SiteView) -> bool:
    return len({site.inputs[n] for n in "qkv"}) < 3


def _leaves(g: Graph, targets: list, bound: set) -> list:
    """Values the targets depend on that are neither bound nor constant: function
    arguments, results of ops the evaluator does not know."""
    from flashgen.rewrite.fold import Folder
    folder = Folder(g)
    seen, out, stack = set(), [], [Ref(v) for v in targets]
    bound = {(r.value, r.ctx) for r in bound}
    while stack:
        r = g.resolve(stack.pop())
        key = (r.value, r.ctx)
        if key in seen or key in bound:
            continue
        seen.add(key)
        if len(seen) > MAX_LEAF_SEARCH:
            raise Reject("the attention backward depends on too much of the program to check")
        if isinstance(r.value, ir.BlockArgument):
            out.append(r)
            continue
        op = r.value.owner
        name = op_name(op)
        if name in ("stablehlo.constant", "stablehlo.iota"):
            continue
        if name not in _CLUSTER_OPS | _LAYOUT | {"stablehlo.dot_general", "stablehlo.iota"}:
            if folder.fold(r) is None:
                out.append(r)
            continue
        stack.extend(Ref(x, r.ctx) for x in op.operands)
    return out


def _random_like(rng, value: ir.Value) -> np.ndarray:
    shape = tuple(value.type.shape)
    elt = str(value.type.element_type)
    if elt == "i1":
        return rng.random(shape) < 0.8   # mostly visible: rows keep some keys
    if elt.lstrip("u").startswith("i"):
        return rng.integers(0, 2, shape).astype(np.int64)
    return rng.standard_normal(shape)


def _size(v: ir.Value) -> int:
    return int(np.prod(v.type.shape, dtype=np.int64))


def _is_float(v: ir.Value) -> bool:
    return str(v.type.element_type) in ("f16", "bf16", "f32", "f64")
