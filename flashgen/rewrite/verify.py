"""Check a rewrite numerically: run the original and the rewritten module on the same random
inputs on CPU and compare every output (`flashgen rewrite --verify`, the golden tests).

The inputs must reach the rows where a rewrite can go wrong, among them query rows whose keys
are all masked (flashgen.rewrite.empty_rows): boolean and integer arguments, which is where
masks, padding and segment ids come in, get rows (along their last axis) of every kind.
"""
from __future__ import annotations

import re
from typing import Optional

import ml_dtypes
import numpy as np

from flashgen import execute
from flashgen.errors import FlashgenError

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


# A bf16/f16 original rounds every intermediate: on inputs that excite it (random weights) its
# own error can exceed the dtype's tolerance, while that tolerance is too loose to see a wrong
# scale on inputs that do not. Such a module is run once more in f32 (every bf16/f16 type
# widened) as the arbiter: a rewrite is accepted when its error against the arbiter is at most
# ARBITER_FACTOR times the original's own, or within f32's tolerance. Measured on the goldens
# and a flax bf16 block: correct rewrites 0.44-1.0 times the original's error, a scale x1.1
# 7-22 times (where the outputs depend on the scale at all: a saturated softmax does not).
ARBITER_FACTOR = 2.0


def verify(result, seed: int, inputs_file: Optional[str] = None) -> dict:
    """Run the original and the rewritten module of a RewriteResult on random inputs (or on
    the arrays of ``inputs_file``, an .npz as `flashgen run --inputs` reads); the report's rows."""
    from flashgen.rewrite import modules
    original = modules.load(result.loaded.data)
    rewritten = modules.load(result.to_bytes())
    if inputs_file:
        inputs = execute.load_npz(inputs_file, execute.signature(original)[0])
    else:
        inputs = inputs_for(original, seed)
    try:
        ref = execute.run(original, inputs, register=False)
    except execute.OutOfMemory as e:
        raise FlashgenError(f"--verify: the original module {e}: its attention holds every score in "
                            "memory; the rewritten module alone may still run (rewrite without "
                            "--verify, then flashgen run it)") from None
    got = execute.run(rewritten, inputs)
    rows = compare(ref, got, result.rewritten)
    _judge_against_f32(rows, original, inputs, ref, got, result.rewritten)
    return {"inputs": inputs_file, "outputs": rows} if inputs_file else \
        {"seed": seed, "outputs": rows}


def _judge_against_f32(rows, original, inputs, ref, got, sites) -> None:
    wide = widened(original)
    if wide is None:
        return
    try:
        arbiter = execute.run(wide, inputs, register=False)
    except FlashgenError as e:  # e.g. an op whose meaning depends on the width (bitcast)
        for row in rows:
            row["f32_original"] = f"not available: {e}"
        return
    own, rewrite = compare(arbiter, ref, sites), compare(arbiter, got, sites)
    for row, o, r in zip(rows, own, rewrite):
        if o["dtype"] == "f32":  # a low-precision result: integer outputs stay exact
            row["f32_original"] = {"original_error": o["max_error"], "rewrite_error": r["max_error"],
                                   "factor": ARBITER_FACTOR}
            row["ok"] = (r["nonfinite_mismatch"] <= o["nonfinite_mismatch"] and r["max_error"]
                         <= max(ARBITER_FACTOR * o["max_error"], execute.TOLERANCE["f32"]))


def describe(row: dict) -> str:
    """execute.describe, and what the f32 original said."""
    text = execute.describe(row)
    judged = row.get("f32_original")
    if isinstance(judged, dict):
        text += (f"; against the original run in f32 the rewrite's error is "
                 f"{judged['rewrite_error']:.3g}, the original's own {judged['original_error']:.3g} "
                 f"(accepted up to {judged['factor']:g}x)")
    elif judged:
        text += f"; the original in f32 is {judged}"
    return text


_LOW = r"(bf16|f16)"
# a bf16/f16 constant written as bit patterns: dense<0xFF80> or dense<"0x...">
_HEX_CONSTANT = re.compile(r'dense<("?)0x([0-9A-Fa-f]+)\1>(\s*:\s*tensor<(?:[0-9]+x)*)' + _LOW + ">")
_LOW_TYPE = re.compile(r"(?<=[x<])" + _LOW + r"(?=>)")


def widened(loaded):
    """The module with every bf16/f16 tensor type made f32 (constants converted), loaded; None
    when it has none."""
    from flashgen.rewrite import modules
    with loaded.context:
        text = modules.module_text(loaded.module, False)

    def constant(m):
        low = ml_dtypes.bfloat16 if m.group(4) == "bf16" else np.float16
        values = np.frombuffer(bytes.fromhex(m.group(2)), np.dtype(low).newbyteorder("<"))
        wide = values.astype("<f4").tobytes().hex().upper()
        return f'dense<"0x{wide}">{m.group(3)}f32>'
    wide = _LOW_TYPE.sub("f32", _HEX_CONSTANT.sub(constant, text))
    if wide == text:
        return None
    try:
        return modules.load(wide)
    except FlashgenError:
        return None


def _is_float(a) -> bool:
    a = np.asarray(a)
    return a.dtype.kind in "fV" or a.dtype.itemsize == 2  # bf16 reads as void or 2-byte
