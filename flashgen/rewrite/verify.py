"""Check a rewrite numerically: run the original and the rewritten module on the same random
inputs on CPU and compare every output (`flashgen rewrite --verify`, the golden tests).

The inputs must reach the rows where a rewrite can go wrong, among them query rows whose keys
are all masked (flashgen.rewrite.empty_rows): boolean and integer arguments, which is where
masks, padding and segment ids come in, get rows (along their last axis) of every kind.
"""
from __future__ import annotations

import numpy as np

from flashgen import execute

_ORDER = {"bf16": 0, "f16": 1, "f32": 2}


def mask_rows(inputs: list) -> list:
    """Boolean arguments: row 0 all False (every key masked, or a fully padded query/batch),
    row 2 all True (every key masked where True means masked), the other rows mixed with
    the first entry False and the last True (under a causal band the first query then sees
    no key, as in a left-padded batch). Integer arguments likewise: row 0 all 0 and the
    first entry of every row 0 (a padding mask given as integers; 0 is a valid id or index
    everywhere else)."""
    out = []
    for x in inputs:
        if x.ndim and x.shape[-1] >= 2 and (x.dtype == bool or np.issubdtype(x.dtype, np.integer)):
            x = x.copy()
            rows = x.reshape(-1, x.shape[-1])
            if x.dtype == bool:
                rows[:, 0], rows[:, -1] = False, True
                rows[0] = False
                if len(rows) > 2:
                    rows[2] = True
            else:
                rows[:, 0] = 0
                rows[0] = 0
        out.append(x)
    return out


def inputs_for(module, seed: int) -> list:
    params, _ = execute.signature(module)
    return mask_rows(fan_in_scaled(execute.random_inputs(concrete(module, params), seed)))


def concrete(module, params: list) -> list:
    """``params`` with the symbolic dims of a shape-polymorphic .jax_exported set to the sizes
    the rewriter matched it at first (odd primes from 37 up, within its constraints)."""
    import dataclasses
    from flashgen.rewrite import instances
    if all(isinstance(n, (int, np.integer)) for p in params for n in p.shape):
        return params
    with module.context:
        dims = instances.dimension_variables(module.module)
        sizes, _ = instances.instantiation_sizes(module.module, dims,
                                                   sorted(set(dims.values())))
    return [dataclasses.replace(p, shape=tuple(
        n if isinstance(n, (int, np.integer)) else sizes[str(n)] for n in p.shape))
        for p in params]


def fan_in_scaled(inputs: list) -> list:
    """Float arrays whose next-to-last dim has 64 or more entries (weights [.., in, out])
    divided by sqrt(in). With unit-variance weights activations grow by sqrt(width) per layer;
    in a training graph the logits then reach 1e4 and the softmax gradients are so
    ill-conditioned that two valid f32 summation orders differ by 1e-2."""
    out = []
    for x in inputs:
        if x.ndim >= 2 and x.shape[-2] >= 64 and (x.dtype.kind == "f" or x.dtype.kind == "V"):
            x = (x.astype(np.float32) / np.float32(np.sqrt(x.shape[-2]))).astype(x.dtype)
        out.append(x)
    return out


# A training step's outputs come from one backward pass: one that is zero in exact arithmetic
# (a key bias's gradient: the softmax ignores a per-row shift) is rounding noise of the step's
# large terms in both programs, ~1e-6 of its largest output in f32. Each output's error is
# measured against at least this fraction of the largest one (a loss summed instead of
# averaged must not make --verify refuse a correct rewrite).
STEP_FLOOR = 2e-3


def compare(ref, got, sites) -> list:
    """execute.compare in the coarsest kernel dtype of ``sites``. Where a site keeps 0 on rows
    the original computes as NaN (a -inf fill, empty_rows 'nan'), the original's NaN entries
    are not compared; each output row says how many were skipped. With a training site,
    errors are relative to at least STEP_FLOOR of the largest output."""
    dtype = min((s.dtype for s in sites), key=_ORDER.get, default=None)
    floor = 1.0
    if any(getattr(s, "backward_target", None) for s in sites):
        sizes = [np.abs(a[np.isfinite(a)]).max(initial=0.0) for a in
                 (np.asarray(r).astype(np.float64) for r in ref if _is_float(r))]
        floor = max(floor, STEP_FLOOR * float(max(sizes, default=0.0)))
    skipped = []
    if any(getattr(s, "empty_rows", "none") == "nan" for s in sites):
        ref = list(ref)
        for i, (r, c) in enumerate(zip(ref, got)):
            r, c = np.asarray(r), np.asarray(c)
            if _is_float(r):
                hole = np.isnan(r.astype(np.float64)) & ~np.isnan(c.astype(np.float64))
                if hole.any():
                    ref[i] = np.where(hole, c, r).astype(r.dtype)
                skipped.append(int(hole.sum()))
            else:
                skipped.append(0)
    rows = execute.compare(ref, got, dtype, floor)
    for row, n in zip(rows, skipped):
        if n:
            row["nan_rows_not_compared"] = n
    return rows


def verify(result, seed: int) -> dict:
    """Run the original and the rewritten module of a RewriteResult; the report's rows."""
    from flashgen.rewrite import modules
    original = modules.load(result.loaded.data)
    rewritten = modules.load(result.to_bytes())
    inputs = inputs_for(original, seed)
    ref = execute.run(original, inputs, register=False)
    got = execute.run(rewritten, inputs)
    return {"seed": seed, "outputs": compare(ref, got, result.rewritten)}


def _is_float(a) -> bool:
    a = np.asarray(a)
    return a.dtype.kind in "fV" or a.dtype.itemsize == 2  # bf16 reads as void or 2-byte
