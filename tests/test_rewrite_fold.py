"""The constant folder (flashgen.rewrite.fold) on long chains and on the mask spellings of
library code: results against numpy, and walks that never recurse."""
from __future__ import annotations

import sys

import numpy as np
from jaxlib.mlir import ir

from flashgen.mlir_context import new_context
from flashgen.rewrite.fold import Folder
from flashgen.rewrite.graph import Graph, Ref

# far deeper than Python's default recursion limit (1000), as in a model of hundreds of layers
DEPTH = 5000


def _module(text: str):
    ctx = new_context()
    return ctx, ir.Module.parse(text, ctx)


def _result_of_main(module):
    main = next(op for op in module.body.operations if op.operation.name == "func.func")
    ops = main.regions[0].blocks[0].operations
    return ops[len(ops) - 1].operands[0]


def _chain(depth: int, start: str) -> str:
    lines = [f"    %v0 = {start}"]
    for i in range(1, depth + 1):
        lines.append(f"    %v{i} = stablehlo.add %v{i - 1}, %one : tensor<4xi32>")
    return ("func.func @main(%arg0: tensor<4xi32>) -> tensor<4xi32> {\n"
            "    %one = stablehlo.constant dense<1> : tensor<4xi32>\n"
            + "\n".join(lines) + f"\n    return %v{depth} : tensor<4xi32>\n}}\n")


def test_deep_constant_chain_folds_without_recursion():
    assert sys.getrecursionlimit() <= 10_000  # the walk must not rely on a raised limit
    ctx, m = _module(_chain(DEPTH, "stablehlo.iota dim = 0 : tensor<4xi32>"))
    with ctx:
        c = Folder(Graph(m)).fold(Ref(_result_of_main(m)))
        assert c is not None
        np.testing.assert_array_equal(c.full(), np.arange(4) + DEPTH)


def test_deep_chain_from_an_argument_is_not_constant():
    ctx, m = _module(_chain(DEPTH, "stablehlo.abs %arg0 : tensor<4xi32>"))
    with ctx:
        folder = Folder(Graph(m))
        assert folder.fold(Ref(_result_of_main(m))) is None
        # every value on the chain is now known not constant, and a second query is memoized
        assert folder.fold(Ref(_result_of_main(m))) is None
