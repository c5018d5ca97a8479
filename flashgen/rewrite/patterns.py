"""The attention pattern: ``match(op)`` reads a site without touching it,
``rewrite(site)`` replaces it with one flashgen custom call.

match() runs the stages in order, each in its own module: scores (Q·K product to the
softmax), softmax, probabilities (to the P·V product), roles (V, the exit, Q/K/V sources);
then the closure check here, and the Plan: the composition of the variants' plan steps
(flashgen.rewrite.plan).

What is matched, starting at a ``dot_general`` (the Q·K product):

    scores = dot_general(Q, K)                   any operand order and layout
    scores -> [variants]                         what flashgen.rewrite.variants recognize
                                                 (one module each: scale, masks, biases, ...);
                                                 converts, reshapes, transposes, unit
                                                 broadcasts, private calls
    p = exp(x - rowconst) / rowsum               the softmax over the key axes R; rowconst is
                                                 anything constant along R (the row max)
    p -> [layout, converts, fully-masked guard]
    out = dot_general(p, V) contracting R        V on either side
    out -> [transpose/reshape/convert]           the site's exit value

Roles are read from dimension numbers: the operand of the first product
whose free axes the softmax reduces is K, the other is Q. Every tensor on the
way is described by which pieces of those logical axes each dimension holds
(flashgen.rewrite.layout), so layout, operand order and softmax axis are
never assumed.
"""
from __future__ import annotations

from jaxlib.mlir import ir

from flashgen.rewrite import adapters, backward, empty_rows
from flashgen.rewrite import extras as X
from flashgen.rewrite import layout as L
from flashgen.rewrite import plan as P
from flashgen.rewrite.chain import (
    ELEMENTWISE, LAYOUT_OPS, MatchState, covered, dot_dims, pieces_text, reduce_kind, shape_of,
)
from flashgen.rewrite.errors import Reject
from flashgen.rewrite.fold import Folder
from flashgen.rewrite.graph import Graph, Ref, op_name, short_location
from flashgen.rewrite.probabilities import ProbabilitiesStage
from flashgen.rewrite.report import AttentionSite, Rejection
from flashgen.rewrite.roles import RolesStage
from flashgen.rewrite.scores import ScoreWalk
from flashgen.rewrite.softmax import SoftmaxStage

# the name location of the ops a rewrite inserts
EMITTED = "flashgen.attention"


class AttentionPattern:
    """Finds dot_general → softmax → dot_general attention and replaces it."""

    name = "attention"

    def __init__(self, graph: Graph, *, legacy_attrs: bool = False, target: str = "cpu",
                 proven: dict | None = None, polymorphic: bool = False,
                 walk_inputs: bool = True):
        self.g = graph
        # matching an instantiation of a shape-polymorphic module (flashgen.rewrite.
        # polymorphic): the site must be rewritable in the dynamic original, whose ops are
        # not these, so the exit is the P·V product and, without ``walk_inputs``, Q, K, V are
        # the products' own operands (where the sources walked back to have no counterpart)
        self.polymorphic = polymorphic
        self.walk_inputs = walk_inputs
        self.proven = proven      # backward proofs shared by the driver's two match passes
        self.folder = Folder(graph)
        self.roles = RolesStage(graph, self.folder)
        self.legacy_attrs = legacy_attrs
        self.target = target

    # ------------------------------------------------------------------ candidates
    def is_candidate(self, op) -> bool:
        """Does this dot_general's result reach a softmax (or a second batched product)?"""
        if op_name(op) != "stablehlo.dot_general":
            return False
        if str(op.location).startswith(f'loc("{EMITTED}"'):
            return False   # a product of a rewrite's own fix-up (empty rows' dQ, dK)
        batched = bool(dot_dims(op)[0])
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
                        if batched and dot_dims(user)[0]:
                            return True
                        continue
                    if name in ELEMENTWISE or name in LAYOUT_OPS:
                        nxt.extend(Ref(r, ctx) for r in user.results)
            frontier = nxt
            if not frontier:
                break
        return False

    # ------------------------------------------------------------------ match
    def match(self, op, describe: bool = True):
        """An AttentionSite, a Rejection, or None when ``op`` is no attention candidate.

        ``describe=False`` leaves the op's printed name empty: naming SSA values prints the
        whole function, and a caller that already named the op (the driver's re-match before
        each rewrite) would otherwise pay that once per site, quadratic in the model's depth."""
        if not self.is_candidate(op):
            return None
        fn = self.g.function_of(op)
        where = dict(location=str(op.location), function=self.g.function_name(fn),
                     op=_describe_op(op, self.g.asm_state(fn)) if describe else "")
        m = MatchState()
        try:
            site = self._match(op, m, where)
        except Reject as e:
            if not m.escaped:
                details = {k: v for k, v in e.details.items() if v is not None}
                return Rejection(where["location"], where["function"], where["op"], e.reason,
                                 matched=m.matched, details=details)
            # the intermediates have users outside the site: perhaps its backward
            m = MatchState()
            m.training = True
            try:
                site = self._match(op, m, where)
            except Reject as e2:
                details = {k: v for k, v in e2.details.items() if v is not None}
                return Rejection(where["location"], where["function"], where["op"],
                                 f"{e.reason}; as a training site: {e2.reason}",
                                 matched=m.matched, details=details)
            if self.polymorphic:
                return Rejection(where["location"], where["function"], where["op"],
                                 "a training site (forward and backward) in a "
                                 "shape-polymorphic module is not rewritten",
                                 matched=m.matched)
        site.notes = m.notes
        return site

    def _match(self, dot1, m: MatchState, where: dict) -> AttentionSite:
        for v in list(dot1.operands) + [dot1.result]:
            t = v.type
            if not isinstance(t, ir.RankedTensorType) or not t.has_static_shape:
                raise Reject("dynamic shapes are not supported (a shape-polymorphic export: "
                             "flashgen rewrites static shapes; export with concrete shapes)")
        lb, rb, lc, rc = dot_dims(dot1)
        lhs, rhs = dot1.operands
        ls, rs = shape_of(lhs), shape_of(rhs)
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
        x, x_layout, scores = ScoreWalk(self.g, self.folder, m).walk(Ref(dot1.result),
                                                                    scores_layout)
        # 2. the softmax
        softmax = SoftmaxStage(self.g, self.folder, scores)
        p, p_layout, R = softmax.match(m, x, x_layout)
        m.matched.append("softmax")
        # 3. probabilities -> P·V product
        probs = ProbabilitiesStage(self.g, self.folder, softmax)
        dot2, p_idx, dot2_ctx, p_layout = probs.walk(m, p, p_layout, R)
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
        if r_labels != k_labels or covered(R) != {lbl: sizes[lbl] for lbl in k_labels}:
            raise Reject("the softmax normalizes over only part of the key axes",
                         softmax_axes=pieces_text(R))
        # 5. P·V product dimension roles
        v_ref, v_layout, out_layout = self.roles.pv_roles(dot2, p_idx, p_layout, R, sizes,
                                                                probs.guards)
        # 6. exit chain
        if self.polymorphic:
            exit_op, exit_value, exit_layout = dot2, dot2.result, out_layout
        else:
            exit_op, exit_value, exit_layout = self.roles.exit(m, dot2, out_layout)
        # 7. inputs
        q_val, k_val = (rhs, lhs) if k_side == "lhs" else (lhs, rhs)
        q_lay, k_lay = (rhs_layout, lhs_layout) if k_side == "lhs" else (lhs_layout, rhs_layout)
        if not self.walk_inputs:
            # the products' operands as they are (a constant scale on Q stays in the graph)
            q_in = (q_val, tuple(q_lay), 1.0, ())
            k_in = (k_val, tuple(k_lay), 1.0, ())
            v_in = (v_ref.value, tuple(v_layout), 1.0, ())
        else:
            q_in, k_in, v_in = self._inputs(Ref(q_val), q_lay, Ref(k_val), k_lay, v_ref,
                                            v_layout)
        if q_in[2] != 1.0 and k_in[2] != 1.0:

            m.notes.append("scale split between Q and K")
        if covered(k_in[3]):
            m.notes.append("K/V broadcast over heads (GQA) read through")
        # 8. closure: no intermediate may have a user outside the site (in a training
        # graph: outside the site and its backward, checked by backward.find)
        if not m.training:
            self._check_closure(m, exit_op)
        # 9. the plan: the variants' steps (masks, kernel layout, limits)
        found = P.Site(scores=scores, q=q_in, k=k_in, v=v_in, exit_layout=exit_layout,
                       q_labels=frozenset(q_labels), k_labels=frozenset(k_labels),
                       softmax_axes=tuple(R), max_subtracted=softmax.max_subtracted,
                       masked_sum=softmax.masked_sum, remasked=probs.remasked,
                       guarded=bool(probs.guards))
        draft = P.build(found)
        site = P.finish(found, draft, target=self.target, where=where, dot1=dot1,
                        exit_op=exit_op, exit_value=exit_value, site_ops=m.ops)
        m.notes.extend(site.notes)
        if m.training:
            if scores.runtime_scales:
                raise Reject("a training site with a scale known only at run time (its "
                             "gradient would need the scale too)")
            added_fill = self._added_fill(site.plan, found.scores.fills)
            view = backward.SiteView(
                ops=set(m.ops), exit_value=exit_value,
                probs={k for k, (_, tag) in m.chain.items() if tag == "probs"},
                q_operand=Ref(q_val), k_operand=Ref(k_val), v_operand=v_ref,
                inputs={"q": q_in[0], "k": k_in[0], "v": v_in[0]},
                biases={s: tuple(v for v, _, _ in views)
                        for s, views in site.plan.extras.bias_views.items()},
                uses={"q": (dot1.operation, 0 if k_side == "rhs" else 1),
                      "k": (dot1.operation, 1 if k_side == "rhs" else 0),
                      "v": (dot2.operation, 1 - p_idx)},
                added_fill=added_fill)
            bw = backward.find(self.g, view, self.proven)
            if added_fill and bw.dbias:
                raise Reject("a training site with a differentiated bias and an added finite "
                             "fill: a query row whose keys are all masked gives the bias a "
                             "gradient the kernel's does not have")
            site.plan.backward = bw
            site.plan.site_ops |= bw.ops
            site.backward_target = site.plan.spec.target_name("bwd")
            m.notes.append(f"training site: the backward (dQ, dK, dV{', dbias' * bool(bw.dbias)}) "
                           "is replaced too, checked numerically against the forward")
            if added_fill:
                m.notes.append("a query row whose keys are all masked keeps its scores' gradient "
                               "through the added fill (a uniform softmax's VJP): its dQ, dK "
                               "terms are added after the backward call")
        return site

    @staticmethod
    def _added_fill(plan: P.Plan, fills) -> bool:
        """Do the rows without a visible key (finite fill, the mean of V) keep their scores'
        cotangent in the backward (an added fill: empty_rows.emit_added_fill_grads)? A
        select fill drops it (the kernel's answer); raises Reject where neither the kernel
        nor the fix-up gives the original's gradient."""
        if plan.empty_rows != "mean" or all(how == "select" for how, _, _ in fills):
            return False
        if any(how == "select" for how, _, _ in fills):
            raise Reject("a training site whose masks both add and select a finite fill: a "
                         "query row whose keys are all masked passes the scores' gradient "
                         "through only some keys")
        if plan.attribute("softcap"):
            raise Reject("a training site with a softcap and an added finite fill: a query "
                         "row whose keys are all masked has a gradient through the tanh that "
                         "the fix-up does not reproduce")
        return True

    def _inputs(self, q_ref, q_lay, k_ref, k_lay, v_ref, v_layout):
        """Q, K, V walked back to their sources: (value, layout, scale, absent pieces) each."""
        q_in = self.roles.walk_input(q_ref, tuple(q_lay), scale=True, bcast=False)
        k_in = self.roles.walk_input(k_ref, tuple(k_lay), scale=True, bcast=True)
        v_in = self.roles.walk_input(v_ref, v_layout, scale=False, bcast=True)
        if L.common_refinement((k_in[3],), (v_in[3],)) is None or \
                covered(k_in[3]) != covered(v_in[3]):
            k_in = self.roles.walk_input(k_ref, tuple(k_lay), scale=True, bcast=False)
            v_in = self.roles.walk_input(v_ref, v_layout, scale=False, bcast=False)
        return q_in, k_in, v_in

    # ------------------------------------------------------------------ closure
    def _check_closure(self, m: MatchState, exit_op) -> None:
        exit_key = exit_op.operation
        tags = {k: v[1] for k, v in m.chain.items()}
        for op, ctx in list(m.ops):
            if op == exit_key and not ctx:
                continue
            for res in op.results:
                for user, idx, uctx in self.g.users(Ref(res, ctx)):
                    if (user.operation, uctx) in m.ops:
                        continue
                    m.escaped = True
                    what = {"scores": "the scores", "exp": "the exponentials",
                            "probs": "the probabilities"}.get(
                        tags.get((res, ctx)), "an intermediate of the softmax")
                    if op_name(user) == "func.return":
                        fn = user.operation.parent.operation
                        raise Reject(f"{what} are returned as output {idx} of "
                                     f"@{self.g.function_name(fn)}")
                    raise Reject(f"{what} have another user ({op_name(user)} at "
                                 f"{short_location(user)})")

    # ------------------------------------------------------------------ rewrite
    def rewrite(self, site: AttentionSite) -> None:
        """Insert the custom call and its adapters before the site's exit; redirect uses.

        Dead ops are removed by the driver afterwards.
        """
        from flashgen.emit import emit_custom_call
        plan: P.Plan = site.plan
        exit_op = plan.exit_op
        loc = ir.Location.name(EMITTED, childLoc=plan.dot1.location)
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
                    if name == "q":
                        for scalar, divide in plan.runtime_scales:
                            x = adapters.scale_by_scalar(x, scalar, divide, created)
                    operands.append(adapters.pad_head_dim(
                        x, plan.spec.head_dim_v if name == "v" else plan.spec.head_dim, created))
                names = plan.extras.names if plan.extras is not None else ()
                if names:
                    operands += X.emit(plan.extras, plan.spec.dtype, created)
                o, lse = emit_custom_call(plan.spec, "fwd", operands, **plan.attributes,
                                          extras=names, legacy_attrs=self.legacy_attrs)
                created.append(o.owner)
                o_kernel = o
                if plan.empty_rows == "mean":
                    o = empty_rows.emit_mean_fixup(
                        o, operands[2], empty_rows.visible_parts(plan.extras, operands[3:]),
                        causal=plan.spec.causal, bottom_right=plan.bottom_right,
                        window=plan.window, created=created)
                out = adapters.adapt(adapters.slice_head_dim(o, plan.head_dim_v, created),
                                     plan.kernel["o"], plan.exit_layout, created,
                                     final_shape=shape_of(plan.exit_value))
                want = plan.exit_value.type.element_type
                if out.type.element_type != want:
                    out = adapters.convert(out, want, created)
                if plan.backward is not None:
                    grads, dbias = self._rewrite_backward(plan, site.head_dim, operands, o_kernel,
                                                          lse, created)
            except Exception:
                for op in reversed(created):
                    op.operation.erase()
                raise
        plan.exit_value.replace_all_uses_with(out)
        if plan.backward is not None:
            bw = plan.backward
            for name, g in grads.items():
                bw.grads[name].replace_all_uses_with(g)
            # the cluster may read a bias gradient too (dS itself, for a bias the forward
            # does not broadcast); those uses stay, ahead of the call
            inside = [op for op, ctx in bw.ops if not ctx]
            for source, g in dbias.items():
                bw.dbias[source].replace_all_uses_except(g, inside)

    def _rewrite_backward(self, plan: P.Plan, head_dim: int, operands, o, lse, created) -> dict:
        """One flashgen_bwd call for the site's backward cluster, placed before the first
        use of its gradients; returns ({'q'|'k'|'v': the value replacing that gradient},
        {differentiated bias source: the value replacing its gradient})."""
        from flashgen.emit import emit_custom_call
        bw = plan.backward
        block = plan.exit_op.operation.block
        first = None
        inside = {op for op, ctx in bw.ops if not ctx}
        for g in list(bw.grads.values()) + list(bw.dbias.values()):
            for use in g.uses:
                op = use.owner.operation
                if op in inside:   # a bias gradient's use by the cluster itself
                    continue
                while op.block != block:
                    op = op.parent.operation
                if first is None or op.is_before_in_block(first):
                    first = op
        if first is None or not plan.exit_op.operation.is_before_in_block(first):
            raise ValueError("the backward is used before the forward's output is computed")
        kdt = ir.Type.parse(plan.spec.dtype)
        with ir.InsertionPoint(first):
            do = adapters.adapt(bw.do, plan.exit_layout, plan.kernel["o"], created)
            if do.type.element_type != kdt:
                do = adapters.convert(do, kdt, created)
            do = adapters.pad_head_dim(do, plan.spec.head_dim_v, created)
            names = plan.extras.names if plan.extras is not None else ()
            results = emit_custom_call(plan.spec, "bwd", operands[:3] + [o, lse, do] + operands[3:],
                                       **plan.attributes, extras=names, dbias=bool(bw.dbias),
                                       legacy_attrs=self.legacy_attrs)
            created.append(results[0].owner)
            if plan.empty_rows == "mean":   # the forward's fix-up has a gradient too
                results[2] = empty_rows.emit_mean_fixup_grad(
                    results[2], do, empty_rows.visible_parts(plan.extras, operands[3:]),
                    causal=plan.spec.causal, bottom_right=plan.bottom_right,
                    window=plan.window, created=created)
                if plan.backward.added_fill:
                    results[0], results[1] = empty_rows.emit_added_fill_grads(
                        results[0], results[1], operands, do,
                        empty_rows.visible_parts(plan.extras, operands[3:]),
                        scale=plan.scale, causal=plan.spec.causal,
                        bottom_right=plan.bottom_right, window=plan.window, created=created)
            out = {}
            for name, x in zip("qkv", results[:3]):
                want = bw.grads[name]
                dim = plan.head_dim_v if name == "v" else head_dim
                g = adapters.adapt(adapters.slice_head_dim(x, dim, created), plan.kernel[name],
                                   plan.inputs[name][1], created, final_shape=shape_of(want))
                if g.type.element_type != want.type.element_type:
                    g = adapters.convert(g, want.type.element_type, created)
                out[name] = g
            dbias = X.emit_bias_grads(plan.extras, results[3], bw.dbias, created) \
                if bw.dbias else {}
        return out, dbias


def _describe_op(op, state) -> str:
    try:
        return f"{op.result.get_name(state)} = {op_name(op)}"
    except Exception:  # noqa: BLE001 - naming is best effort; fall back to the op name
        return op_name(op)
