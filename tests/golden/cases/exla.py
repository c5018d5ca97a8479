"""Modules hand-written the way EXLA (Elixir Nx) emits them: a public @main, sub-computations
outlined into private functions reached by func.call, reducers as regions, and the native
api_version = 4 custom-call form. exla/native.mlir also carries an unrelated native custom
call that the rewrite must leave exactly as it is.
"""

import math
import pathlib

from .common import tname
from .registry import golden


class _Text:
    """A hand-written module (exla/<name>.mlir beside this file), written out as it is."""

    def __init__(self, name):
        self.text = (pathlib.Path(__file__).parent / "exla" / f"{name}.mlir").read_text()

    def mlir_module(self):
        return self.text


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, scale=1 / math.sqrt(32))
def exla_attention():
    return _Text("attention")


@golden(rewritten=1, targets=[tname(64, "bf16", False)], scale=0.125, numerics=False)
def exla_native_call():
    return _Text("native")


@golden(rewritten=1, targets=[tname(32, "f32", False)], scale=0.125, extras=["segment_ids"])
def exla_padding_mask():
    # EXLA-style: the attention outlined into a private function that takes the padding mask
    return _Text("padding")
