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


# ----------------------------------------------------------------------------- library spellings
def _fold_exported(fn):
    """Fold the result of ``fn`` (no arguments) as exported by jax, and jax's own value."""
    import jax
    exp = jax.export.export(jax.jit(fn), platforms=["cpu"])()
    ctx, m = _module(exp.mlir_module())
    with ctx:
        c = Folder(Graph(m)).fold(Ref(_result_of_main(m)))
    return c, np.asarray(fn())


def _cases():
    import jax
    import jax.numpy as jnp
    from jax import lax

    s = 12
    pos = lambda: jnp.arange(s, dtype=jnp.int32)  # noqa: E731

    def carried_out():
        # a while result that the body passes through unchanged is its initial value
        p, _ = lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0], c[1] + 1), (pos(), 0))
        return p[:, None] - p[None, :]

    return {
        "cumsum": lambda: jnp.cumsum((pos() % 3 == 0).astype(jnp.int32)),
        "window_sum_strided": lambda: lax.reduce_window(
            pos().reshape(3, 4) * 3 - 7, 0, lax.add, (2, 3), (1, 2), [(1, 0), (2, 1)]),
        "cumsum_wraps": lambda: jnp.cumsum(jnp.full(s, 2**30, jnp.int32)),
        "cumsum_float": lambda: jnp.cumsum(jnp.sin(pos().astype(jnp.float32))),
        "cummax_2d": lambda: lax.cummax(jnp.sin(pos().reshape(3, 4).astype(jnp.float32)), axis=1),
        "gather_positions": lambda: jnp.take(pos() * 7 % 5, (pos()[::-1] + 2) % s),
        "gather_2d": lambda: (pos().reshape(3, 4) * 3)[jnp.array([2, 0, 1]), 1:3],
        "gather_batched": lambda: jnp.take_along_axis(
            pos().reshape(3, 4), jnp.array([[3, 0], [1, 1], [2, 0]]), axis=1),
        "concatenate": lambda: jnp.concatenate(
            [jnp.broadcast_to(pos()[:1], (1, 4)), pos().reshape(3, 4)], axis=0),
        "pad_interior": lambda: lax.pad(pos().reshape(3, 4), -1, [(1, 2, 1), (-1, 0, 2)]),
        "dynamic_slice": lambda: lax.dynamic_slice(pos().reshape(3, 4), (jnp.int32(2), 1), (2, 2)),
        "reduce_max_sum": lambda: jnp.max(pos().reshape(3, 4), axis=0) + pos().reshape(3, 4).sum(1)[0],
        "reduce_all": lambda: jnp.all(pos().reshape(3, 4) < 10, axis=1),
        "min_of_converted_masks": lambda: jnp.minimum(
            (pos()[:, None] >= pos()[None, :]).astype(jnp.int32),
            (pos()[None, :] < 9).astype(jnp.int32)),
        "while_result": carried_out,
    }


import pytest  # noqa: E402


@pytest.mark.parametrize("name", sorted(_cases()))
def test_folds_library_spellings_like_jax(name):
    c, expected = _fold_exported(_cases()[name])
    assert c is not None, f"{name} did not fold"
    assert c.full().dtype == expected.dtype
    # numpy's and XLA's sin may differ in the last bit; integers and booleans compare exactly
    np.testing.assert_allclose(c.full(), expected, rtol=1e-6)


def test_folds_a_loop_invariant_carry_inside_a_scan_body():
    """jax hoists the position iota out of a lax.scan body and carries it unchanged: the mask
    computed from it inside the body is constant."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    s = 12

    def f(x):
        def body(c, _):
            p, acc = c
            return (p, acc + jnp.where(p[:, None] >= p[None, :], x, 0)), None
        (_, acc), _ = lax.scan(body, (jnp.arange(s), jnp.zeros((s, s))), None, length=2)
        return acc

    exp = jax.export.export(jax.jit(f), platforms=["cpu"])(jax.ShapeDtypeStruct((s, s), np.float32))
    ctx, m = _module(exp.mlir_module())
    with ctx:
        g = Graph(m)
        whiles = []
        main = g.funcs["main"]
        main.walk(lambda op: whiles.append(op) or ir.WalkResult.ADVANCE
                  if op.name == "stablehlo.while" else ir.WalkResult.ADVANCE)
        (loop,) = whiles
        call = next(op for op in loop.regions[1].blocks[0].operations
                    if op.operation.name == "func.call")
        body = g.callee(call)
        found = []
        body.walk(lambda op: found.append(op) or ir.WalkResult.ADVANCE
                  if op.name in ("stablehlo.compare", "stablehlo.add") else ir.WalkResult.ADVANCE)
        (cmp,) = [op for op in found if op.name == "stablehlo.compare"]
        (acc,) = [op for op in found if op.name == "stablehlo.add"]
        folder = Folder(g)
        pred = folder.fold(Ref(cmp.result, (call.operation,)))
        assert pred is not None
        np.testing.assert_array_equal(pred.full(), np.arange(s)[:, None] >= np.arange(s)[None, :])
        # the accumulated carry changes every iteration: never constant
        assert folder.fold(Ref(acc.result, (call.operation,))) is None
        assert folder.fold(Ref(loop.results[len(loop.results) - 1])) is None


def test_a_band_from_positions_is_folded_as_a_diagonal():
    """transformers' spelling at a long sequence: positions gathered, compared and combined.
    The folded value keeps one entry per diagonal (2S - 1), never S² -- and reads the same."""
    import jax.numpy as jnp

    s = 16384  # S² booleans would be 256 MiB

    def f():
        pos = jnp.take(jnp.arange(s, dtype=jnp.int32) + 5, jnp.arange(s))
        q, k = pos[:, None], pos[None, :]
        visible = (k <= q) & (k > q - 100)
        return jnp.where(visible, 0.0, jnp.finfo(jnp.float32).min)[None, None]

    import jax
    exp = jax.export.export(jax.jit(f), platforms=["cpu"])()
    ctx, m = _module(exp.mlir_module())
    with ctx:
        c = Folder(Graph(m)).fold(Ref(_result_of_main(m)))
    assert c is not None and c.diagonal is not None
    assert c.diagonal.values.size == 2 * s - 1 and c.shape == (1, 1, s, s)
    rows = np.array([0, 1, 99, 100, 5000, s - 1])
    j = np.arange(s)[None, :]
    want = np.where((j <= rows[:, None]) & (j > rows[:, None] - 100), 0.0,
                    np.finfo(np.float32).min)
    np.testing.assert_array_equal(c.array[0, 0, rows], want)
    from flashgen.rewrite import masks
    vis = c.map(lambda a: a == 0)
    assert masks.band(vis.array[0, 0]) == (True, False, (99, -1))
