"""One place that creates MLIR contexts with the dialects exported programs use.

jaxlib ships the bindings but no public "context with stablehlo, chlo, sdy,
func, ..." constructor; JAX's own one is the right set, so use it rather than
keep a second list of dialects in sync.
"""
from __future__ import annotations

from jaxlib.mlir import ir


def new_context() -> ir.Context:
    from jax._src.interpreters import mlir as jax_mlir  # the dialect set JAX lowers into
    ctx = jax_mlir.make_ir_context()
    ctx.allow_unregistered_dialects = False
    return ctx
