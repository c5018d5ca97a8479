"""The golden cases, each registered under the name of the function that builds it.

A section module decorates its builders with ``@golden(...)`` (forward rewrites, listed in
tests/golden/cases.json) or ``@training_golden(...)`` (training graphs, train_cases.json); the
keywords are what the manifest records the case must rewrite or reject. ``load_sections()``
imports every module of this package, so a new section needs no list to be added to.
"""
from __future__ import annotations

import importlib
import pathlib
import pkgutil


class Goldens(dict):
    """name -> dict(fn=builder, fmt=file format, expect=manifest entry): one manifest's cases.
    Called with a case's keywords, it is the decorator that registers a builder."""

    def __init__(self, expect):
        super().__init__()
        self._expect = expect

    def __call__(self, *, fmt="mlir", **keywords):
        def register(fn):
            if fn.__name__ in self:
                raise ValueError(f"two golden builders named {fn.__name__}")
            self[fn.__name__] = dict(fn=fn, fmt=fmt, expect=self._expect(**keywords))
            return fn
        return register


def _forward(*, rewritten=0, rejected=(), targets=(), causal=None, bottom_right=None, scale=None,
             kv_heads=None, layout=None, numerics=True, window=None, softcap=None, extras=None):
    """``rejected`` lists substrings of the expected reasons. ``window``, ``softcap`` and
    ``extras`` (the extra operands' names, when given) are checked on every rewritten site."""
    extra = {k: v for k, v in (("window", window), ("softcap", softcap), ("extras", extras))
             if v is not None}
    return dict(rewritten=rewritten, rejected=list(rejected), targets=list(targets),
                causal=causal, bottom_right=bottom_right, scale=scale, kv_heads=kv_heads,
                layout=layout, numerics=numerics and rewritten > 0, **extra)


def _training(*, sites=0, rejected=(), fwd=(), bwd=(), kv_heads=None):
    """``sites``: training sites rewritten as a forward/backward pair; ``fwd``/``bwd``: the
    custom-call targets expected; ``rejected``: substrings of expected rejection reasons."""
    return dict(sites=sites, rejected=list(rejected), fwd=list(fwd), bwd=list(bwd),
                kv_heads=kv_heads)


golden = Goldens(_forward)
training_golden = Goldens(_training)


def load_sections() -> None:
    """Import every module of this package, which registers its builders."""
    for module in pkgutil.iter_modules([str(pathlib.Path(__file__).parent)]):
        importlib.import_module(f"{__package__}.{module.name}")
