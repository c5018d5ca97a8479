"""Stage 4: the roles of the operands. V and the output layout from the P·V product's
dimension numbers, the site's exit through layout ops, and Q, K, V walked back to their
sources (upcasts, constant scales, head broadcasts of K/V for GQA).
"""
from __future__ import annotations

from jaxlib.mlir import ir

from flashgen.rewrite import layout as L
from flashgen.rewrite.chain import (
    FLOAT_TYPES, MAX_CHAIN, WIDTH, MatchState, constant_factor, dot_dims, elt, ints, layout_step,
    pieces_text, shape_of,
)
from flashgen.rewrite.errors import Reject
from flashgen.rewrite.graph import Ref, op_name
from flashgen.rewrite.softmax import rowwise_ok


class RolesStage:
    """The P·V product, the exit and the inputs."""

    def __init__(self, g, folder):
        self.g, self.folder = g, folder

    def pv_roles(self, dot2, p_idx: int, p_layout, R, sizes, guards):
        """Check the P·V product (the probabilities' ``p_layout`` there, the fully-masked-row
        ``guards`` on the way); return V (Ref, layout) and the product's result layout."""
        for t, at in guards:
            if not rowwise_ok(t.layout, at, R):
                raise Reject("the fully-masked-row guard is not constant along the softmax axis")
        lb, rb, lc, rc = dot_dims(dot2)
        pb, vb, pc, vc = (lb, rb, lc, rc) if p_idx == 0 else (rb, lb, rc, lc)
        v_val = dot2.operands[1 - p_idx]
        ps, vs = shape_of(dot2.operands[p_idx]), shape_of(v_val)
        contracted = tuple(pc_ for i in pc for pc_ in p_layout[i])
        refined = L.common_refinement((contracted,), (tuple(R),))
        if refined is None or sorted(refined[0][0]) != sorted(refined[1][0]):
            ax = pieces_text(contracted)
            raise Reject("the softmax is over the query axis: it normalizes over "
                         f"{pieces_text(R)} but the P·V product contracts {ax}"
                         if any(pc_[0][0] in "LR" for pc_ in contracted) else
                         f"the P·V product contracts {ax}, not the softmax axis {pieces_text(R)}")
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

    def exit(self, m: MatchState, dot2, layout):
        op, value = dot2, dot2.result
        while True:
            uses = self.g.raw_users(value)
            if len(uses) != 1:
                break
            user = uses[0][0]
            name = op_name(user)
            if name not in ("stablehlo.transpose", "stablehlo.reshape", "stablehlo.convert"):
                break
            if name == "stablehlo.convert" and elt(user.result) not in FLOAT_TYPES:
                break
            if name == "stablehlo.reshape" and L.regroup(layout, shape_of(user.result)) is None:
                break
            layout = layout_step(user, layout, what="output")
            m.add(user, ())
            op, value = user, user.result
        return op, value, layout

    # ------------------------------------------------------------------ inputs
    def walk_input(self, ref: Ref, layout, *, scale: bool, bcast: bool):
        """Look back from a product's operand through layout ops, upcasts, constant
        scales and (for K/V) head broadcasts. Returns (value, layout, scale, absent pieces)."""
        value, factor, absent = ref.value, 1.0, ()
        for _ in range(MAX_CHAIN):
            if isinstance(value, ir.BlockArgument):
                break
            op = value.owner
            name = op_name(op)
            if name == "stablehlo.convert":
                src, dst = elt(op.operands[0]), elt(value)
                if src not in WIDTH or dst not in WIDTH or WIDTH[src] >= WIDTH[dst]:
                    break
                value = op.operands[0]
                continue
            if name == "stablehlo.transpose":
                perm = ints(op.operation.attributes["permutation"])
                inv = [0] * len(perm)
                for i, pp in enumerate(perm):
                    inv[pp] = i
                layout = L.transpose(layout, inv)
                value = op.operands[0]
                continue
            if name == "stablehlo.reshape":
                new = L.regroup(layout, shape_of(op.operands[0]))
                if new is None:
                    break
                layout, value = new, op.operands[0]
                continue
            if name == "stablehlo.broadcast_in_dim" and bcast:
                dims = ints(op.operation.attributes["broadcast_dimensions"])
                src, dst = shape_of(op.operands[0]), shape_of(value)
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
                found = constant_factor(self.folder, op, (), positive=True)
                if found is None:
                    break
                i, k, divide = found
                factor = factor / k if divide else factor * k
                value = op.operands[i]
                continue
            break
        return value, tuple(layout), factor, tuple(absent)
