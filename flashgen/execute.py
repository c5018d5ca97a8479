"""Run a StableHLO module on CPU (or CUDA) with numpy inputs.

Any format flashgen reads works: StableHLO text, MLIR bytecode, a portable
artifact, or a serialized ``jax.export.Exported``. Plain modules are called
through ``jax.export`` (an Exported built around them), so only public JAX
APIs run them. flashgen custom calls found in the module are built (through
the cache) and registered first.

Inputs follow @main's parameters in order; bf16 travels through numpy as
ml_dtypes.bfloat16, and 2-byte arrays stored as uint16 or raw void (``|V2``,
what ``np.save`` writes for bfloat16) are reinterpreted by the parameter's
element type.
"""
from __future__ import annotations

import dataclasses
import re
import zipfile
import zlib
from typing import Optional, Sequence

import ml_dtypes
import numpy as np

from flashgen.errors import FlashgenError, LoadError, UsageError

PLATFORMS = ("cpu", "cuda")

# Output tolerance per dtype, relative to max(1, max |reference|).
TOLERANCE = {"f32": 2e-3, "f16": 1e-2, "bf16": 6e-2, "f64": 1e-6}


@dataclasses.dataclass(frozen=True)
class TensorType:
    shape: tuple
    dtype: np.dtype        # numpy dtype (ml_dtypes.bfloat16 for bf16)
    element_type: str      # MLIR element type, e.g. 'bf16'

    def __str__(self):
        return f"tensor<{'x'.join(map(str, self.shape))}{'x' if self.shape else ''}{self.element_type}>"


def _np_dtype(element_type: str) -> np.dtype:
    from flashgen.rewrite.fold import np_dtype
    dt = np_dtype(element_type)
    if dt is None:
        raise UsageError(f"element type {element_type} is not supported by flashgen run")
    return dt


def _element_name(dtype: np.dtype) -> str:
    names = {np.dtype(ml_dtypes.bfloat16): "bf16", np.dtype(np.float16): "f16",
             np.dtype(np.float32): "f32", np.dtype(np.float64): "f64", np.dtype(np.bool_): "i1"}
    if dtype in names:
        return names[dtype]
    if np.issubdtype(dtype, np.signedinteger):
        return f"i{dtype.itemsize * 8}"
    if np.issubdtype(dtype, np.unsignedinteger):
        return f"ui{dtype.itemsize * 8}"
    return str(dtype)


def _as_loaded(source):
    from flashgen.rewrite import modules
    if isinstance(source, modules.LoadedModule):
        return source
    return modules.load(source)


def signature(source) -> tuple[list[TensorType], list[TensorType]]:
    """@main's parameter and result types."""
    from jaxlib.mlir import ir
    loaded = _as_loaded(source)
    if loaded.format == "jax_exported":
        exp = loaded.exported
        ins = [exp.in_avals[i] for i in exp.module_kept_var_idx]
        conv = lambda a: TensorType(tuple(a.shape), np.dtype(a.dtype), _element_name(np.dtype(a.dtype)))
        return [conv(a) for a in ins], [conv(a) for a in exp.out_avals]
    with loaded.context:
        main = _main(loaded.module)
        ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
        conv = lambda t: _tensor_type(ir.RankedTensorType(t)) if isinstance(
            t, ir.RankedTensorType) else _unsupported(t)
        return [conv(t) for t in ftype.inputs], [conv(t) for t in ftype.results]


def _unsupported(t):
    raise UsageError(f"@main has a parameter or result of type {t}: only ranked tensors are supported")


def _tensor_type(t) -> TensorType:
    if not t.has_static_shape:
        raise UsageError(f"@main has a dynamically shaped tensor {t}: give static shapes")
    elt = str(t.element_type)
    return TensorType(tuple(t.shape), _np_dtype(elt), elt)


def _main(module):
    from jaxlib.mlir import ir
    for op in module.body.operations:
        if op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main":
            return op
    raise LoadError("the module has no @main function")


def flashgen_targets(source) -> list[str]:
    """Names of the flashgen custom-call targets a module calls."""
    loaded = _as_loaded(source)
    from flashgen.rewrite import modules
    with loaded.context:
        text = modules.module_text(loaded.module, False)
    return sorted(set(re.findall(r"custom_call @(flashgen_[A-Za-z0-9_]+)", text)))


def specs_for_targets(names: Sequence[str], target: str = "cpu"):
    from flashgen.spec import KernelSpec, parse_target_name
    specs = set()
    for n in names:
        parsed = parse_target_name(n)
        if parsed is None:
            raise LoadError(f"unknown flashgen custom-call target {n!r}")
        specs.add(KernelSpec(parsed.head_dim, parsed.dtype, parsed.causal, target, parsed.head_dim_v))
    return sorted(specs)


def register_targets(source, platform: str = "cpu") -> list:
    """Build (through the cache) and register the flashgen kernels a module calls."""
    names = flashgen_targets(source)
    if not names:
        return []
    from flashgen import runtime, targets
    local = targets.local(platform)
    if local is None:
        raise FlashgenError("no supported NVIDIA GPU found to build flashgen kernels for")
    specs = specs_for_targets(names, local.name)
    runtime.ensure(specs)
    return specs


def register_library(source, library, platform: str = "cpu") -> list[str]:
    """Register a shipped library (its directory, manifest or .so) and check that it provides
    every flashgen target the module calls: a host that runs prebuilt kernels needs no compiler."""
    from flashgen import runtime
    names = runtime.load(library)
    lib_platform = runtime.library_platform(library)
    if lib_platform != platform:
        raise UsageError(f"the library {library} was built for {lib_platform}, not {platform}")
    missing = sorted(set(flashgen_targets(source)) - set(names))
    if missing:
        raise LoadError(f"the library {library} does not provide {', '.join(missing)} "
                        f"(it has {', '.join(sorted(set(names))) or 'no targets'}); build the "
                        f"module's kernels into it (flashgen rewrite --build DIR)")
    return names


def coerce_inputs(arrays: Sequence[np.ndarray], params: Sequence[TensorType]) -> list[np.ndarray]:
    """Check count, shapes and element kinds; reinterpret 2-byte bf16/f16 carriers.

    Accepted besides an exact dtype: a uint16 or raw 2-byte (|V2) array for a bf16/f16
    parameter (its bit patterns: .npz cannot hold bf16), a float array for a float parameter
    of another width, and integers for an integer parameter when every value fits. Anything
    else (e.g. integers for a float parameter, whose values a cast would silently change) is a
    UsageError naming the input."""
    if len(arrays) != len(params):
        raise UsageError(f"@main takes {len(params)} inputs, got {len(arrays)}")
    return [_coerce(i, np.asarray(a), p) for i, (a, p) in enumerate(zip(arrays, params))]


def _coerce(i: int, a: np.ndarray, p: TensorType) -> np.ndarray:
    # a symbolic dim of a shape-polymorphic .jax_exported takes any size: the module's own
    # shape assertions check that the sizes agree when it runs
    if len(a.shape) != len(p.shape) or any(isinstance(e, (int, np.integer)) and n != e
                                           for n, e in zip(a.shape, p.shape)):
        raise UsageError(f"input arg{i} has shape {list(a.shape)}, @main expects {p}")
    if a.dtype == p.dtype:
        return a
    floats = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64),
              np.dtype(ml_dtypes.bfloat16))
    if p.dtype in (floats[0], floats[3]) and (a.dtype == np.uint16 or (
            a.dtype.kind == "V" and a.dtype.itemsize == 2)):
        return a.view(p.dtype)
    if a.dtype in floats and p.dtype in floats:
        return a.astype(p.dtype)
    if a.dtype.kind in "iu" and p.dtype.kind in "iu":
        info = np.iinfo(p.dtype)
        if a.size == 0 or (int(a.min()) >= info.min and int(a.max()) <= info.max):
            return a.astype(p.dtype)
        raise UsageError(f"input arg{i} ({a.dtype}) has values outside {p.element_type}'s range")
    hint = (" (bf16 bit patterns are read as uint16 only for a bf16/f16 parameter)"
            if a.dtype == np.uint16 else "")
    raise UsageError(f"input arg{i} has dtype {a.dtype}, @main expects {p}: refusing to convert "
                     f"{_kind(a.dtype)} to {_kind(p.dtype)}{hint}")


def _kind(dtype: np.dtype) -> str:
    if dtype == np.bool_:
        return "booleans"
    return {"i": "integers", "u": "unsigned integers", "f": "floats", "V": "raw bytes",
            "c": "complex numbers"}.get(dtype.kind, str(dtype))


def needs_x64(types: Sequence[TensorType]) -> bool:
    """JAX runs 64-bit arrays only with jax_enable_x64; without it, f64/i64 become 32-bit."""
    return any(t.dtype.itemsize == 8 and t.dtype.kind in "iuf" for t in types)


def run(source, inputs: Sequence[np.ndarray], *, platform: str = "cpu",
        register: bool = True, library=None) -> list[np.ndarray]:
    """Execute @main on ``inputs``; returns numpy outputs in @main's result order.

    The flashgen kernels the module calls come from ``library`` (a built library's directory,
    manifest or .so; no compiler needed) or else are built through the cache (``register``)."""
    import jax
    if platform not in PLATFORMS:
        raise UsageError(f"platform must be one of {', '.join(PLATFORMS)}, got {platform!r}")
    from flashgen import call_contract
    loaded = _as_loaded(source)
    params, results = signature(loaded)
    arrays = coerce_inputs(inputs, params)
    call_contract.check_module(loaded)
    if needs_x64(params + results) and not jax.config.jax_enable_x64:
        with jax.enable_x64(True):  # scoped: the caller's JAX settings stay as they were
            return run(loaded, arrays, platform=platform, register=register)
    try:
        device = jax.devices(platform)[0]
    except RuntimeError:
        raise FlashgenError(f"no {platform} device is available to JAX") from None
    if library is not None:
        register_library(loaded, library, platform)
    elif register:
        register_targets(loaded, platform)
    exp = _exported(loaded, params, results, platform)
    full = _full_inputs(exp, arrays)
    args, kwargs = jax.tree_util.tree_unflatten(exp.in_tree, full)
    x64 = jax.config.jax_enable_x64  # thread-local: the helper thread below takes it along

    def execute():
        with jax.enable_x64(x64), jax.default_device(device):
            return [np.asarray(x) for x in jax.tree_util.tree_leaves(exp.call(*args, **kwargs))]
    try:  # the results are fetched inside: XLA raises some errors only then
        return _interruptible(execute)
    except Exception as e:  # noqa: BLE001 - XLA reports errors as several types
        if any(m in str(e) for m in _OUT_OF_MEMORY):
            raise OutOfMemory(f"ran out of memory running the module ({_first_line(e)})") from None
        raise FlashgenError(f"running the module failed: {_first_line(e)}") from None


class OutOfMemory(FlashgenError):
    """The module needs more memory than this machine gives it."""


# How XLA's CPU runtime words a failed allocation: a buffer it cannot allocate, or one a
# library kernel (YNNPACK) fails on when its result is fetched.
_OUT_OF_MEMORY = ("RESOURCE_EXHAUSTED", "Out of memory", "YNNPACK operation failed", "bad_alloc")


# How long a Ctrl-C waits for the flashgen kernels to stop at their next work item.
CANCEL_WAIT_SECONDS = 5.0
RUN_THREAD = "flashgen-run"


def _interruptible(fn):
    """fn() on a helper thread while the main thread waits where Python takes a Ctrl-C (the
    thread that runs an XLA computation is held until it returns). On Ctrl-C the flashgen
    kernels are told to stop at their next work item and KeyboardInterrupt is raised here; a
    computation still running after CANCEL_WAIT_SECONDS (XLA's own ops) is left to the caller."""
    import threading
    from flashgen import runtime
    if threading.current_thread() is not threading.main_thread():
        return fn()
    runtime.cancel_kernels(False)
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            box["error"] = e
    worker = threading.Thread(target=target, name=RUN_THREAD, daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.05)
    except KeyboardInterrupt:
        runtime.cancel_kernels(True)
        worker.join(CANCEL_WAIT_SECONDS)
        if not worker.is_alive():
            runtime.cancel_kernels(False)
        raise
    if "error" in box:
        raise box["error"]
    return box["value"]


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _full_inputs(exp, kept: list) -> list:
    """Exported.call takes every flattened input, also those the module dropped."""
    if len(exp.module_kept_var_idx) == len(exp.in_avals):
        return list(kept)
    full = [np.zeros(a.shape, a.dtype) for a in exp.in_avals]
    for i, a in zip(exp.module_kept_var_idx, kept):
        full[i] = a
    return full


def _exported(loaded, params, results, platform: str):
    """An Exported that calls the module: the input's own, or one built around a plain module."""
    import jax
    import jax.numpy as jnp
    from jax import export
    from flashgen.rewrite import modules
    if loaded.format == "jax_exported":
        exp = loaded.exported
        if platform not in exp.platforms:
            raise UsageError(f"the module was exported for {', '.join(exp.platforms)}, "
                             f"not {platform}")
        return exp
    ins = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in params]

    def template(*_):
        return tuple(jnp.zeros(r.shape, r.dtype) for r in results)

    tmpl = export.export(jax.jit(template), platforms=[platform])(*ins)
    with loaded.context:
        art = modules.serialize_artifact(loaded.module, None)
    names = flashgen_targets(loaded)
    return dataclasses.replace(
        tmpl, mlir_module_serialized=art, module_kept_var_idx=tuple(range(len(params))),
        disabled_safety_checks=tuple(export.DisabledSafetyCheck.custom_call(n) for n in names))


def random_inputs(params: Sequence[TensorType], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for i, p in enumerate(params):
        if not all(isinstance(e, (int, np.integer)) for e in p.shape):
            raise UsageError(f"random inputs need concrete shapes: @main's arg{i} is {p} "
                             "(a shape-polymorphic module; give the inputs)")
        if p.dtype == np.bool_:
            out.append(rng.random(p.shape) < 0.5)
        elif np.issubdtype(p.dtype, np.integer):
            out.append(rng.integers(0, 4, p.shape).astype(p.dtype))
        else:
            out.append(rng.standard_normal(p.shape).astype(np.float32).astype(p.dtype))
    return out


# what numpy raises on a file that is no (intact) .npz / .npy: EOFError for an empty file,
# BadZipFile / zlib.error for a damaged archive or member (members are read on access)
_UNREADABLE = (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error)


def load_npz(path: str, params: Sequence[TensorType]) -> list[np.ndarray]:
    """Inputs from an .npz (arg0..argN), or from an .npy when @main takes one input."""
    try:
        data = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise UsageError(f"no such inputs file: {path}") from None
    except _UNREADABLE as e:
        raise UsageError(f"cannot read {path} as .npz or .npy: {e or type(e).__name__}") from None
    if isinstance(data, np.ndarray):  # an .npy: one array
        if len(params) != 1:
            raise UsageError(f"{path} is an .npy (one array); @main takes {len(params)} inputs: "
                             "give an .npz with arg0..argN")
        return coerce_inputs([data], params)
    names = set(data.files)
    want = [f"arg{i}" for i in range(len(params))]
    missing = [n for n in want if n not in names]
    extra = sorted(names - set(want))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing)}")
        if extra:
            parts.append(f"unexpected {', '.join(extra)}")
        sig = ", ".join(f"arg{i}: {p}" for i, p in enumerate(params))
        raise UsageError(f"{path}: {'; '.join(parts)} (@main takes {sig or 'no inputs'})")
    try:  # members are read (and inflated) only here
        arrays = [data[n] for n in want]
    except _UNREADABLE as e:
        raise UsageError(f"cannot read {path}: {e or type(e).__name__}") from None
    return coerce_inputs(arrays, params)


def npz_bytes(outputs: Sequence[np.ndarray]) -> bytes:
    """An .npz of out0..outM; bf16 is stored as uint16 bit patterns (read back with
    .view(bfloat16))."""
    import io
    arrays = {}
    for i, a in enumerate(outputs):
        a = np.asarray(a)
        if a.dtype == np.dtype(ml_dtypes.bfloat16):
            a = a.view(np.uint16)
        arrays[f"out{i}"] = a
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def compare(reference: Sequence[np.ndarray], candidate: Sequence[np.ndarray],
            dtype: Optional[str] = None, floor: float = 1.0) -> list[dict]:
    """Per output: max error relative to max(floor, max|reference|) over the elements finite
    in both, whether NaN and ±inf sit at the same places, and whether all is in tolerance.

    ``dtype`` (a flashgen dtype) loosens the tolerance to that precision when it is
    coarser than the output's own type. A row's ``nonfinite_mismatch`` counts the elements
    where one side is NaN or ±inf and the other is not the same value; ``first_mismatch``
    is the first such element (index, reference value, candidate value). describe() words it.
    """
    rows = []
    for i, (r, c) in enumerate(zip(reference, candidate)):
        r, c = np.asarray(r), np.asarray(c)
        name = _element_name(r.dtype)
        if r.dtype.kind not in "fV" and r.dtype != np.dtype(ml_dtypes.bfloat16):
            ok = bool(np.array_equal(r, c))
            rows.append({"output": i, "dtype": name, "max_error": 0.0 if ok else float("inf"),
                         "tolerance": 0.0, "nonfinite_mismatch": 0, "ok": ok})
            continue
        r64, c64 = r.astype(np.float64), c.astype(np.float64)
        both = np.isfinite(r64) & np.isfinite(c64)
        # Non-finite elements must agree exactly: NaN with NaN, +inf with +inf.
        same = both | (np.isnan(r64) & np.isnan(c64)) | (~np.isnan(r64) & (r64 == c64))
        bad = ~same
        err = float(np.max(np.abs(r64[both] - c64[both]), initial=0.0))
        scale = max(floor, float(np.max(np.abs(r64[both]), initial=0.0)))
        tol = TOLERANCE.get(name, 1e-2)
        if dtype:
            tol = max(tol, TOLERANCE.get(dtype, tol))
        rel = err / scale
        row = {"output": i, "dtype": name, "max_error": rel, "tolerance": tol,
               "nonfinite_mismatch": int(np.count_nonzero(bad)),
               "ok": bool(not bad.any() and rel <= tol)}
        if bad.any():
            at = tuple(int(x) for x in np.argwhere(bad)[0])
            row["first_mismatch"] = {"index": list(at), "reference": float(r64[at]),
                                     "candidate": float(c64[at])}
        rows.append(row)
    return rows


def describe(row: dict, reference: str = "the original", candidate: str = "the rewrite") -> str:
    """One line for a compare() row: the error among finite values and where NaN / ±inf differ."""
    text = (f"output {row['output']} ({row['dtype']}): max error {row['max_error']:.3g} "
            f"(tolerance {row['tolerance']:.3g})")
    n = row.get("nonfinite_mismatch", 0)
    if n:
        m = row["first_mismatch"]
        text += (f"; {n} element(s) NaN or infinite in one and not the other, first at "
                 f"{m['index']}: {reference} {m['reference']!r}, {candidate} {m['candidate']!r}")
    return text
