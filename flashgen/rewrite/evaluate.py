"""Evaluate a subgraph numerically in float64, with chosen values for its leaves.

The backward rewrite (flashgen.rewrite.backward) proves that a cluster of ops is the
attention VJP by running it, and the forward it belongs to, on random inputs. This is
the constant folder (flashgen.rewrite.fold) with three differences: the caller binds
leaf values (any SSA value, seen through calls), every float is computed in float64
(a bf16 program is checked as the exact function it rounds), and products
(dot_general) are evaluated too. A value that cannot be evaluated (an unbound argument,
an op neither knows) evaluates to None.
"""
from __future__ import annotations

import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

from flashgen.rewrite.fold import Const, Folder, np_dtype
from flashgen.rewrite.graph import Graph, Ref


class Evaluator(Folder):
    """Memoized float64 evaluator; ``bindings`` maps Refs to the arrays they stand for;
    ``operands`` maps (operation, operand index) to the array that one use of a value reads
    instead (a top-level op: moving one role of a value that is also another's)."""

    def __init__(self, graph: Graph, bindings: dict, operands: dict | None = None):
        super().__init__(graph)
        for ref, array in bindings.items():
            r = graph.resolve(ref)
            self._memo[(r.value, r.ctx)] = Const(np.asarray(array), tuple(r.value.type.shape))
        self._uses = {op: {} for op, _ in (operands or {})}
        for (op, idx), array in (operands or {}).items():
            self._uses[op][idx] = Const(np.asarray(array), tuple(op.operands[idx].type.shape))

    @staticmethod
    def value_dtype(element_type):
        if str(element_type) in ("f16", "bf16", "f32", "f64"):  # bf16's numpy kind is 'V'
            return np.dtype(np.float64)
        return np_dtype(element_type)

    def value(self, ref: Ref) -> np.ndarray | None:
        """The full array of ``ref``, or None when it cannot be evaluated."""
        c = self.fold(ref)
        return None if c is None else np.asarray(c.full())

    def _operands(self, r: Ref):
        v = r.value
        if not isinstance(v, ir.BlockArgument) and v.owner.operation.name == "stablehlo.dot_general":
            return [self.graph.resolve(Ref(x, r.ctx)) for x in v.owner.operands]
        return super()._operands(r)

    def _eval(self, r: Ref, a: list):
        v = r.value
        if self._uses and not r.ctx and not isinstance(v, ir.BlockArgument) and \
                v.owner.operation in self._uses:
            a = list(a)
            for idx, c in self._uses[v.owner.operation].items():
                a[idx] = c
        if not isinstance(v, ir.BlockArgument) and v.owner.operation.name == "stablehlo.dot_general":
            return self._dot(v.owner, a)
        return super()._eval(r, a)

    @staticmethod
    def _dot(op, a: list) -> Const:
        """As one batched matmul: [batch, lhs free, contracted] @ [batch, contracted, rhs free]."""
        dn = stablehlo.DotDimensionNumbers(op.operation.attributes["dot_dimension_numbers"])
        lb, rb = list(dn.lhs_batching_dimensions), list(dn.rhs_batching_dimensions)
        lc, rc = list(dn.lhs_contracting_dimensions), list(dn.rhs_contracting_dimensions)
        x, y = (_float64(c) for c in a)
        lf = [i for i in range(x.ndim) if i not in lb + lc]
        rf = [j for j in range(y.ndim) if j not in rb + rc]
        nb = int(np.prod([x.shape[i] for i in lb], dtype=np.int64))
        nk = int(np.prod([x.shape[i] for i in lc], dtype=np.int64))
        xm = x.transpose(lb + lf + lc).reshape(nb, -1, nk)
        ym = y.transpose(rb + rc + rf).reshape(nb, nk, -1)
        res = np.matmul(xm, ym).reshape(tuple(op.result.type.shape))
        return Const(res, tuple(op.result.type.shape))


def _float64(c: Const) -> np.ndarray:
    """The full array in float64 (constants keep their own type, e.g. bf16, until here)."""
    return np.asarray(c.full(), dtype=np.float64)
