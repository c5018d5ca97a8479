"""Evaluate compile-time-constant subgraphs (masks, scales, fills) with numpy.

Results are kept *compact*: an array whose every dimension is either the
full size or 1 (broadcast), so a causal mask broadcast to
[batch, heads, S, S] costs S*S elements. ``fold(ref)`` returns a ``Const``
or None when the value depends on a function argument, on an op this
evaluator does not know, or would be too large.
"""
from __future__ import annotations

import dataclasses
import re

import ml_dtypes
import numpy as np
from jaxlib.mlir import ir

from flashgen.rewrite.graph import Graph, Ref

MAX_ELEMENTS = 1 << 24
_SQUEEZE_LIMIT = 1 << 20

_NP_TYPES = {
    "i1": np.bool_, "i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64,
    "ui8": np.uint8, "ui16": np.uint16, "ui32": np.uint32, "ui64": np.uint64,
    "f16": np.float16, "bf16": ml_dtypes.bfloat16, "f32": np.float32, "f64": np.float64,
}


def np_dtype(element_type) -> np.dtype | None:
    t = _NP_TYPES.get(str(element_type))
    return np.dtype(t) if t is not None else None


@dataclasses.dataclass(frozen=True)
class Diagonal:
    """Where a value depends only on the distance ``idx[q] - idx[p]`` between two of its
    axes (``q`` minus ``p``) and on no other axis: a causal or sliding-window band over
    (query, key), as libraries build it from two position vectors. ``values[d + n_p - 1]``
    is the value at distance d, so an S x S mask costs 2S - 1 entries, not S²."""
    p: int
    q: int
    values: np.ndarray


@dataclasses.dataclass(frozen=True)
class Const:
    array: np.ndarray  # compact: each dim is 1 or shape[i]
    shape: tuple
    diagonal: Diagonal | None = None  # set when ``array`` is a read-only view of a Diagonal

    @property
    def uniform(self) -> bool:
        a = self.elements()
        return a.size == 1 or bool(np.all(a == a.flat[0]))

    def scalar(self):
        return self.array.flat[0].item()

    def full(self) -> np.ndarray:
        return np.broadcast_to(self.array, self.shape)

    def map(self, fn) -> "Const":
        """An elementwise function of this value, computed on its diagonal when it has one."""
        if self.diagonal is not None:
            d = self.diagonal
            return on_diagonal(np.asarray(fn(d.values)), d.p, d.q, self.shape)
        return Const(np.asarray(fn(self.array)), self.shape)

    def elements(self) -> np.ndarray:
        """Every value this holds (each at least once), without expanding a diagonal."""
        return self.diagonal.values if self.diagonal is not None else self.array

    def any(self) -> bool:
        return bool(np.any(self.elements()))


def on_diagonal(values: np.ndarray, p: int, q: int, shape) -> Const:
    """A Const over ``shape`` whose value at idx is ``values[idx[q] - idx[p] + shape[p] - 1]``
    (other axes broadcast); its array is a strided view of ``values`` (a Toeplitz matrix)."""
    values = np.ascontiguousarray(values)
    view_shape = [1] * len(shape)
    view_shape[p], view_shape[q] = shape[p], shape[q]
    strides = [0] * len(shape)
    strides[p], strides[q] = -values.itemsize, values.itemsize
    view = np.lib.stride_tricks.as_strided(values[shape[p] - 1:], view_shape, strides,
                                           writeable=False)
    return Const(view, tuple(shape), Diagonal(p, q, values))


def compact(a: np.ndarray, shape) -> Const:
    """Shrink dimensions along which ``a`` is constant (cheaply: stride-0 views only)."""
    a = np.asarray(a)
    idx = tuple(slice(0, 1) if (a.shape[i] > 1 and a.strides[i] == 0) else slice(None)
                for i in range(a.ndim))
    return Const(np.ascontiguousarray(a[idx]), tuple(shape))


def _dense_to_numpy(attr, rtype) -> np.ndarray | None:
    shape = tuple(rtype.shape)
    dtype = np_dtype(rtype.element_type)
    if dtype is None:
        return None
    try:
        dense = ir.DenseElementsAttr(attr)
    except (ValueError, TypeError):
        return None  # e.g. dense_resource blobs
    if dense.is_splat:
        v = dense.get_splat_value()
        if isinstance(v, ir.BoolAttr):
            x = v.value
        elif isinstance(v, ir.FloatAttr):
            x = v.value
        elif isinstance(v, ir.IntegerAttr):
            x = v.value
        else:
            return None
        return np.full((1,) * len(shape), x, dtype=dtype)
    try:
        return np.array(dense).astype(dtype, copy=False).reshape(shape)
    except (ValueError, TypeError, RuntimeError):
        pass
    text = str(dense)  # bf16 and friends: decode the printed form
    m = re.search(r'dense<"0x([0-9A-Fa-f]+)">', text)
    if m:
        raw = bytes.fromhex(m.group(1))
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    try:
        as_f32 = ir.Attribute.parse(text.replace(str(rtype.element_type), "f32"))
        return np.array(as_f32).astype(dtype).reshape(shape)
    except Exception:  # noqa: BLE001 - any failure means "not foldable"
        return None


def compare(direction: str, a, b):
    """stablehlo.compare's ``direction`` on numpy values."""
    return {"EQ": np.equal, "NE": np.not_equal, "LT": np.less, "LE": np.less_equal,
            "GT": np.greater, "GE": np.greater_equal}[direction](a, b)


_UNARY = {
    "stablehlo.negate": np.negative, "stablehlo.abs": np.abs, "stablehlo.sqrt": np.sqrt,
    "stablehlo.rsqrt": lambda x: 1 / np.sqrt(x), "stablehlo.exponential": np.exp,
    "stablehlo.log": np.log, "stablehlo.floor": np.floor, "stablehlo.ceil": np.ceil,
    "stablehlo.sign": np.sign, "stablehlo.not": lambda x: np.logical_not(x) if x.dtype == bool else np.invert(x),
    "stablehlo.is_finite": np.isfinite, "stablehlo.tanh": np.tanh,
    "stablehlo.logistic": lambda x: 1 / (1 + np.exp(-x)),
    "stablehlo.sine": np.sin, "stablehlo.cosine": np.cos,
}
_BINARY = {
    "stablehlo.add": np.add, "stablehlo.subtract": np.subtract, "stablehlo.multiply": np.multiply,
    "stablehlo.maximum": np.maximum, "stablehlo.minimum": np.minimum, "stablehlo.power": np.power,
    "stablehlo.and": lambda a, b: np.logical_and(a, b) if a.dtype == bool else np.bitwise_and(a, b),
    "stablehlo.or": lambda a, b: np.logical_or(a, b) if a.dtype == bool else np.bitwise_or(a, b),
    "stablehlo.xor": lambda a, b: np.logical_xor(a, b) if a.dtype == bool else np.bitwise_xor(a, b),
}


_LEAVES = ("stablehlo.constant", "stablehlo.iota")
_STRUCTURAL = ("stablehlo.broadcast_in_dim", "stablehlo.transpose", "stablehlo.reshape",
               "stablehlo.convert", "stablehlo.divide", "stablehlo.remainder",
               "stablehlo.compare", "stablehlo.select", "stablehlo.clamp", "stablehlo.slice",
               "stablehlo.concatenate", "stablehlo.pad", "stablehlo.reverse", "stablehlo.dynamic_slice",
               "stablehlo.gather", "stablehlo.reduce", "stablehlo.reduce_window")
# the reductions whose body is one of these ops on its two arguments: (ufunc, for booleans)
_REDUCERS = {
    "stablehlo.add": (np.add, np.logical_or), "stablehlo.multiply": (np.multiply, np.logical_and),
    "stablehlo.maximum": (np.maximum, np.logical_or), "stablehlo.minimum": (np.minimum, np.logical_and),
    "stablehlo.and": (np.bitwise_and, np.logical_and), "stablehlo.or": (np.bitwise_or, np.logical_or),
}


class Folder:
    """Memoized evaluator of constant values over a Graph.

    The walk keeps its own stack rather than recursing: a model of a few hundred
    unrolled layers chains thousands of ops, far past Python's recursion limit."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self._memo: dict = {}

    def fold(self, ref: Ref) -> Const | None:
        root = self.graph.resolve(ref)
        root_key = (root.value, root.ctx)
        if root_key in self._memo:
            return self._memo[root_key]
        # frames: [resolved ref, operand refs still to fold, folded operands]
        stack = [self._enter(root)]
        while stack:
            frame = stack[-1]
            r, deps, done = frame
            if deps is not None and len(done) < len(deps):
                d = deps[len(done)]
                key = (d.value, d.ctx)
                if key not in self._memo:
                    stack.append(self._enter(d))
                    continue
                c = self._memo[key]
                if c is None:  # an operand is not constant (or is on a cycle): neither is this
                    deps = None
                    frame[1] = None
                else:
                    done.append(c)
                    continue
            stack.pop()
            key = (r.value, r.ctx)
            result = None
            if deps is not None:
                try:
                    result = self._eval(r, done)
                except (ValueError, TypeError, ArithmeticError, IndexError, KeyError, MemoryError):
                    result = None
            self._memo[key] = result
        return self._memo[root_key]

    def _enter(self, r: Ref) -> list:
        """A new frame for ``r`` (already resolved), marked in progress in the memo so that a
        cycle (a while loop's carried value) reads as not constant."""
        self._memo[(r.value, r.ctx)] = None
        return [r, self._operands(r), []]

    def _operands(self, r: Ref) -> list | None:
        """The values ``r`` is computed from (resolved), or None when it cannot be constant."""
        v = r.value
        rtype = v.type
        if not isinstance(rtype, ir.RankedTensorType) or not rtype.has_static_shape:
            return None
        if np_dtype(rtype.element_type) is None:
            return None
        if isinstance(v, ir.BlockArgument):
            init = self._loop_invariant_init(r) or self._argument_of_only_call(r)
            return None if init is None else [self.graph.resolve(init)]
        op = v.owner
        name = op.operation.name
        if name in _LEAVES:
            return []
        if name == "stablehlo.while":
            init = self._loop_invariant_init(r)
            return None if init is None else [self.graph.resolve(init)]
        if name in ("stablehlo.reduce", "stablehlo.reduce_window") and (
                len(op.operands) != 2 or _reducer(op) is None):
            return None
        if name in _UNARY or name in _BINARY or name in _STRUCTURAL:
            return [self.graph.resolve(Ref(x, r.ctx)) for x in op.operands]
        return None

    @staticmethod
    def value_dtype(element_type) -> np.dtype | None:
        """The numpy type values of this element type are computed in."""
        return np_dtype(element_type)

    def _eval(self, r: Ref, a: list) -> Const | None:
        """The value of ``r`` from its folded operands ``a``."""
        v = r.value
        rtype = v.type
        shape = tuple(rtype.shape)
        dtype = self.value_dtype(rtype.element_type)
        op = None if isinstance(v, ir.BlockArgument) else v.owner
        if op is None or op.operation.name == "stablehlo.while":
            return a[0]  # a loop-invariant carry: its initial value
        name = op.operation.name
        attrs = op.operation.attributes
        if name == "stablehlo.constant":
            arr = _dense_to_numpy(attrs["value"], rtype)
            return None if arr is None else Const(arr, shape)
        if name == "stablehlo.iota":
            dim = ir.IntegerAttr(attrs["iota_dimension"]).value
            arr = np.arange(shape[dim], dtype=dtype).reshape(
                [shape[dim] if i == dim else 1 for i in range(len(shape))])
            return Const(arr, shape)
        banded = _banded(name, op, a, shape, dtype)
        if banded is not None:
            return banded
        if name == "stablehlo.broadcast_in_dim":
            (x,) = a
            dims = list(ir.DenseI64ArrayAttr(attrs["broadcast_dimensions"]))
            src = x.array
            # move the operand dims into their result positions, then expand
            order = np.argsort(dims)
            src = np.transpose(src, order) if src.ndim else src
            sorted_dims = [dims[i] for i in order]
            new_shape = [1] * len(shape)
            for d, n in zip(sorted_dims, src.shape):
                new_shape[d] = n
            src = src.reshape(new_shape)
            return Const(src, shape)
        if name == "stablehlo.transpose":
            perm = list(ir.DenseI64ArrayAttr(attrs["permutation"]))
            return Const(np.transpose(a[0].array, perm), shape)
        if name == "stablehlo.reshape":
            x = a[0]
            if np.prod(shape, dtype=np.int64) > MAX_ELEMENTS:
                return None
            if x.array.size == 1:
                return Const(x.array.reshape((1,) * len(shape)), shape)
            return compact(x.full().reshape(shape), shape)
        if name in _ELEMENTWISE:
            out = _elementwise(name, attrs, a, dtype)
            return None if out is None else self._sized(out, shape)
        if name == "stablehlo.slice":
            start = list(ir.DenseI64ArrayAttr(attrs["start_indices"]))
            limit = list(ir.DenseI64ArrayAttr(attrs["limit_indices"]))
            step = list(ir.DenseI64ArrayAttr(attrs["strides"]))
            x = a[0].array
            idx = tuple(slice(0, 1) if x.shape[i] == 1 else slice(start[i], limit[i], step[i])
                        for i in range(x.ndim))
            return Const(x[idx], shape)
        if name == "stablehlo.reverse":
            dims = [d for d in ir.DenseI64ArrayAttr(attrs["dimensions"]) if a[0].array.shape[d] > 1]
            return Const(np.flip(a[0].array, dims) if dims else a[0].array, shape)
        if name == "stablehlo.concatenate":
            return self._sized_full(_concatenate(a, _int_attr(attrs["dimension"]), shape), shape)
        if name == "stablehlo.pad":
            return self._sized_full(_pad(a[0], a[1], attrs, shape), shape)
        if name == "stablehlo.dynamic_slice":
            sizes = list(ir.DenseI64ArrayAttr(attrs["slice_sizes"]))
            x = a[0]
            starts = [int(np.clip(c.scalar(), 0, n - k)) for c, n, k in zip(a[1:], x.shape, sizes)]
            idx = tuple(slice(0, 1) if x.array.shape[i] == 1 else slice(s, s + k)
                        for i, (s, k) in enumerate(zip(starts, sizes)))
            return Const(x.array[idx], shape)
        if name == "stablehlo.gather":
            return self._sized_full(_gather(a[0], a[1], attrs, shape), shape)
        if name == "stablehlo.reduce":
            dims = list(ir.DenseI64ArrayAttr(attrs["dimensions"]))
            return self._sized_full(np.asarray(_reduce(op, a[0], a[1], dims)).astype(dtype), shape)
        if name == "stablehlo.reduce_window":
            out = _reduce_window(op, a[0], a[1], attrs, shape)
            return None if out is None else self._sized_full(out.astype(dtype), shape)
        return None

    @staticmethod
    def _sized_full(a: np.ndarray | None, shape) -> Const | None:
        """A dense result, kept compact; None when it is too large to hold."""
        if a is None or a.size > MAX_ELEMENTS:
            return None
        c = compact(a, shape)
        if c.array.size <= _SQUEEZE_LIMIT:
            # gathered ids that are all equal (transformers' packed-sequence ids of a single
            # sequence) become one value, so what is computed from them stays small
            arr = c.array
            for ax in range(arr.ndim):
                if arr.shape[ax] > 1 and np.all(arr == arr.take([0], axis=ax)):
                    arr = arr.take([0], axis=ax)
            c = Const(arr, tuple(shape))
        return c

    @staticmethod
    def _sized(a: np.ndarray, shape) -> Const | None:
        if a.size > MAX_ELEMENTS:
            return None
        return Const(a, shape)

    def _argument_of_only_call(self, r: Ref) -> Ref | None:
        """An argument of a private function reached without a call context (a site inside
        a scan body is matched in its own function) has the value its only caller passes."""
        holder = r.value.owner.owner
        if r.ctx or holder.operation.name != "func.func":
            return None
        call = self.graph.only_call_site(holder.operation)
        return None if call is None else Ref(call.operands[r.value.arg_number], ())

    @staticmethod
    def _loop_invariant_init(r: Ref) -> Ref | None:
        """The initial value of a while body/cond argument, or of a while result, that the
        body passes through unchanged (so it is that value on every iteration), else None."""
        v = r.value
        if isinstance(v, ir.BlockArgument):
            holder, i = v.owner.owner.operation, v.arg_number
        else:
            holder, i = v.owner.operation, v.result_number
        if holder.name != "stablehlo.while":
            return None
        body = holder.regions[1].blocks[0]
        ret = body.operations[len(body.operations) - 1]
        if ret.operands[i] != body.arguments[i]:
            return None
        return Ref(holder.operands[i], r.ctx)


def _int_attr(attr) -> int:
    return ir.IntegerAttr(attr).value


def _checked_full(c: Const) -> np.ndarray:
    """The dense value of a compact operand, refused (ValueError: not foldable) when large."""
    if np.prod(c.shape, dtype=np.int64) > MAX_ELEMENTS:
        raise ValueError("too large to fold")
    return c.full()


def _reducer(op):
    """(ufunc, boolean ufunc) of a reduce/reduce_window whose body applies one elementwise
    op to its two arguments and returns it (jax's cumsum, sum, max...), else None."""
    body = op.regions[0].blocks[0]
    ops = list(body.operations)
    if len(ops) != 2 or ops[0].operation.name not in _REDUCERS:
        return None
    args = list(body.arguments)
    if sorted([hash(x) for x in ops[0].operands]) != sorted(hash(x) for x in args) \
            or ops[1].operands[0] != ops[0].result:
        return None
    return _REDUCERS[ops[0].operation.name]


def _ufunc(op, x: np.ndarray):
    f, f_bool = _reducer(op)
    return f_bool if x.dtype == np.bool_ else f


def _concatenate(parts: list, dim: int, shape) -> np.ndarray:
    arrays = []
    for c in parts:
        full = list(shape)
        full[dim] = c.shape[dim]
        arrays.append(np.broadcast_to(c.array, full) if np.prod(full) <= MAX_ELEMENTS
                      else _checked_full(c))
    return np.concatenate(arrays, axis=dim)


def _pad(x: Const, value: Const, attrs, shape) -> np.ndarray:
    low = list(ir.DenseI64ArrayAttr(attrs["edge_padding_low"]))
    high = list(ir.DenseI64ArrayAttr(attrs["edge_padding_high"]))
    interior = list(ir.DenseI64ArrayAttr(attrs["interior_padding"]))
    src = _checked_full(x)
    # interior padding first, then edges; negative edges cut
    grown = [n + max(n - 1, 0) * k + max(lo, 0) + max(hi, 0)
             for n, k, lo, hi in zip(src.shape, interior, low, high)]
    if np.prod(grown, dtype=np.int64) > MAX_ELEMENTS:
        raise ValueError("too large to fold")
    out = np.full(grown, value.scalar(), dtype=src.dtype)
    out[tuple(slice(max(lo, 0), max(lo, 0) + (n - 1) * (k + 1) + 1 if n else max(lo, 0), k + 1)
              for n, k, lo in zip(src.shape, interior, low))] = src
    cut = tuple(slice(-lo if lo < 0 else 0, g + hi if hi < 0 else g)
                for lo, hi, g in zip(low, high, grown))
    out = out[cut]
    assert out.shape == tuple(shape)
    return out


def _gather(x: Const, indices: Const, attrs, shape) -> np.ndarray:
    """stablehlo.gather on numpy arrays (the general form: batching dims included)."""
    from jaxlib.mlir.dialects import stablehlo

    dn = stablehlo.GatherDimensionNumbers(attrs["dimension_numbers"])
    sizes = list(ir.DenseI64ArrayAttr(attrs["slice_sizes"]))
    operand = x.array  # compact dims read index 0 whatever the start: no need to expand
    idx = _checked_full(indices).astype(np.int64)
    ivd = dn.index_vector_dim
    if ivd == idx.ndim:
        idx = idx[..., None]
    else:
        idx = np.moveaxis(idx, ivd, -1)
    batch_shape = idx.shape[:-1]
    n_batch = len(batch_shape)
    offset_src = [d for d in range(len(x.shape)) if d not in dn.collapsed_slice_dims
                  and d not in dn.operand_batching_dims]
    # for each operand dim: a start (over the batch dims) plus an offset (over offset dims)
    grids = []
    for d in range(len(x.shape)):
        start = np.zeros(batch_shape, np.int64)
        if d in dn.start_index_map:
            k = list(dn.start_index_map).index(d)
            start = np.clip(idx[..., k], 0, x.shape[d] - sizes[d])
        elif d in dn.operand_batching_dims:
            bd = dn.start_indices_batching_dims[list(dn.operand_batching_dims).index(d)]
            bd = bd if bd < ivd else bd - 1
            start = np.broadcast_to(np.arange(batch_shape[bd]).reshape(
                [-1 if i == bd else 1 for i in range(n_batch)]), batch_shape)
        start = start.reshape(batch_shape + (1,) * len(offset_src))
        if d in offset_src:
            j = offset_src.index(d)
            off = np.arange(sizes[d]).reshape([1] * n_batch + [-1 if i == j else 1
                                                               for i in range(len(offset_src))])
            start = start + off
        if operand.shape[d] == 1:
            start = np.zeros_like(start)
        grids.append(start)
    out = operand[tuple(grids)]  # [batch..., offsets...]
    # the result places offset dims at offset_dims, batch dims elsewhere in order
    offset_dims = list(dn.offset_dims)
    batch_pos = [i for i in range(len(shape)) if i not in offset_dims]
    order = [0] * len(shape)
    for i, pos in enumerate(batch_pos):
        order[pos] = i
    for j, pos in enumerate(offset_dims):
        order[pos] = n_batch + j
    return np.transpose(np.broadcast_to(out, batch_shape + tuple(
        sizes[d] for d in offset_src)), order)


def _reduce(op, x: Const, init: Const, dims: list) -> np.ndarray:
    f = _ufunc(op, x.array)
    arr = _checked_full(x)
    return f(f.reduce(arr, axis=tuple(dims)), init.scalar())


def _reduce_window(op, x: Const, init: Const, attrs, shape) -> np.ndarray | None:
    """stablehlo.reduce_window without dilations (jax's cumsum/cumprod/cummax, pooling)."""
    n = len(x.shape)
    window = list(ir.DenseI64ArrayAttr(attrs["window_dimensions"]))

    def ints(key, default):
        return list(ir.DenseI64ArrayAttr(attrs[key])) if key in attrs else [default] * n

    strides = ints("window_strides", 1)
    if ints("base_dilations", 1) != [1] * n or ints("window_dilations", 1) != [1] * n:
        return None
    padding = (np.array(ir.DenseIntElementsAttr(attrs["padding"])).reshape(n, 2).tolist()
               if "padding" in attrs else [[0, 0]] * n)
    f = _ufunc(op, x.array)
    arr = _checked_full(x)
    if any(lo < 0 or hi < 0 for lo, hi in padding):
        return None
    arr = np.pad(arr, padding, constant_values=init.scalar())
    # one dimension at a time: a box window is separable for these associative reducers
    for d in range(n):
        if window[d] == 1 and strides[d] == 1:
            continue
        every = tuple(slice(None, None, strides[d]) if i == d else slice(None) for i in range(n))
        if f is np.add and np.issubdtype(arr.dtype, np.integer):
            # integer window sums (jax's cumsum: a window as long as the axis) as differences
            # of one running sum: O(n), exact also where the sum wraps around
            run = np.cumsum(arr, axis=d, dtype=arr.dtype)
            run = np.concatenate([np.zeros_like(np.take(run, [0], axis=d)), run], axis=d)
            m = arr.shape[d] - window[d] + 1
            hi = np.take(run, np.arange(window[d], window[d] + m), axis=d)
            lo = np.take(run, np.arange(m), axis=d)
            with np.errstate(over="ignore"):
                arr = (hi - lo)[every]
            continue
        if arr.size * window[d] > 4 * MAX_ELEMENTS:
            raise ValueError("too large to fold")
        view = np.lib.stride_tricks.sliding_window_view(arr, window[d], axis=d)
        arr = f.reduce(view, axis=-1)[every]
    out = f(arr, init.scalar())  # each window's reduction starts from the init value
    assert out.shape == tuple(shape)
    return out


# ----------------------------------------------------------------------------- bands
_ELEMENTWISE = set(_UNARY) | set(_BINARY) | {
    "stablehlo.convert", "stablehlo.compare", "stablehlo.select", "stablehlo.clamp",
    "stablehlo.divide", "stablehlo.remainder"}


def _banded(name, op, a: list, shape, dtype) -> Const | None:
    """The result as a Diagonal when it is one, computed in O(Sq + Sk): an elementwise op
    on diagonals (and single values), a difference or comparison of two position vectors
    along different axes, or a layout op that moves a diagonal's axes. None otherwise."""
    attrs = op.operation.attributes
    if name in _ELEMENTWISE:
        axes = _common_diagonal(a)
        if axes is not None:
            p, q = axes
            vals = [c.diagonal.values if c.diagonal is not None else c.array.reshape(())
                    for c in a]
            out = _elementwise(name, attrs, [Const(v, v.shape) for v in vals], dtype)
            return None if out is None else on_diagonal(out, p, q, shape)
        if name in ("stablehlo.compare", "stablehlo.subtract"):
            return _outer_positions(name, attrs, a, shape, dtype)
        return None
    if not any(c.diagonal is not None for c in a):
        return None
    d = a[0].diagonal
    if name == "stablehlo.broadcast_in_dim":
        dims = list(ir.DenseI64ArrayAttr(attrs["broadcast_dimensions"]))
        return on_diagonal(d.values, dims[d.p], dims[d.q], shape)
    if name == "stablehlo.transpose":
        perm = list(ir.DenseI64ArrayAttr(attrs["permutation"]))
        return on_diagonal(d.values, perm.index(d.p), perm.index(d.q), shape)
    if name == "stablehlo.reshape":
        # only unit dims added or removed: the two axes keep their order among the others
        src_shape = a[0].shape
        big_src = [i for i, n in enumerate(src_shape) if n > 1]
        big_dst = [i for i, n in enumerate(shape) if n > 1]
        if [src_shape[i] for i in big_src] != [shape[i] for i in big_dst]:
            return None
        return on_diagonal(d.values, big_dst[big_src.index(d.p)], big_dst[big_src.index(d.q)],
                           shape)
    return None


def _common_diagonal(a: list):
    """(p, q) when every operand is a diagonal over the same axes or a single value, and at
    least one is a diagonal; else None."""
    axes = None
    for c in a:
        if c.diagonal is not None:
            here = (c.diagonal.p, c.diagonal.q)
            if axes is not None and here != axes:
                return None
            axes = here
        elif c.array.size != 1:
            return None
    return axes


def _elementwise(name, attrs, a: list, dtype) -> np.ndarray | None:
    """An elementwise op on numpy operands (broadcast), as stablehlo computes it."""
    x = [c.array for c in a]
    with np.errstate(all="ignore"):
        if name == "stablehlo.convert":
            return x[0].astype(dtype, copy=False)
        if name in _UNARY:
            return np.asarray(_UNARY[name](x[0])).astype(dtype, copy=False)
        if name in _BINARY:
            return np.asarray(_BINARY[name](x[0], x[1])).astype(dtype, copy=False)
        if name == "stablehlo.divide":
            if np.issubdtype(dtype, np.integer):
                return np.trunc(x[0].astype(np.float64) / x[1]).astype(dtype, copy=False)
            return np.asarray(np.divide(x[0], x[1])).astype(dtype, copy=False)
        if name == "stablehlo.remainder":
            return np.fmod(x[0], x[1]).astype(dtype, copy=False)
        if name == "stablehlo.compare":
            return compare(_direction(attrs), x[0], x[1])
        if name == "stablehlo.select":
            return np.where(x[0], x[1], x[2]).astype(dtype, copy=False)
        if name == "stablehlo.clamp":
            return np.clip(x[1], x[0], x[2]).astype(dtype, copy=False)
    return None


def _direction(attrs) -> str:
    return str(attrs["comparison_direction"]).split()[-1].strip(">").upper()


def _outer_positions(name, attrs, a: list, shape, dtype) -> Const | None:
    """x[i] - y[j] or compare(x[i], y[j]) where x varies along one axis only, y along another,
    both integer vectors of the same constant step (positions, as transformers gathers them):
    the value depends on j - i only."""
    x, y = a
    ax, ay = _single_axis(x), _single_axis(y)
    if ax is None or ay is None or ax == ay or not np.issubdtype(x.array.dtype, np.integer):
        return None
    xv, yv = x.array.reshape(-1).astype(np.int64), y.array.reshape(-1).astype(np.int64)
    step = xv[1] - xv[0]
    if step == 0 or yv[1] - yv[0] != step or np.any(np.diff(xv) != step) \
            or np.any(np.diff(yv) != step):
        return None
    n_x, n_y = len(xv), len(yv)
    dist = np.arange(-(n_x - 1), n_y)  # idx[ay] - idx[ax]
    i = np.maximum(0, -dist)
    out = _elementwise(name, attrs, [Const(x.array.reshape(-1)[i], i.shape),
                                     Const(y.array.reshape(-1)[i + dist], i.shape)], dtype)
    return on_diagonal(out, ax, ay, shape)


def _single_axis(c: Const) -> int | None:
    """The one axis along which a (non-diagonal) value has more than one entry, or None."""
    if c.diagonal is not None:
        return None
    big = [i for i, n in enumerate(c.array.shape) if n > 1]
    return big[0] if len(big) == 1 else None
