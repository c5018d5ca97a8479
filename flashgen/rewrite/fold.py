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

_NP_TYPES = {
    "i1": np.bool_, "i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64,
    "ui8": np.uint8, "ui16": np.uint16, "ui32": np.uint32, "ui64": np.uint64,
    "f16": np.float16, "bf16": ml_dtypes.bfloat16, "f32": np.float32, "f64": np.float64,
}


def np_dtype(element_type) -> np.dtype | None:
    t = _NP_TYPES.get(str(element_type))
    return np.dtype(t) if t is not None else None


@dataclasses.dataclass(frozen=True)
class Const:
    array: np.ndarray  # compact: each dim is 1 or shape[i]
    shape: tuple

    @property
    def uniform(self) -> bool:
        a = self.array
        return a.size == 1 or bool(np.all(a == a.reshape(-1)[0]))

    def scalar(self):
        return self.array.reshape(-1)[0].item()

    def full(self) -> np.ndarray:
        return np.broadcast_to(self.array, self.shape)


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


def _cmp(direction: str, a, b):
    return {"EQ": np.equal, "NE": np.not_equal, "LT": np.less, "LE": np.less_equal,
            "GT": np.greater, "GE": np.greater_equal}[direction](a, b)


_UNARY = {
    "stablehlo.negate": np.negative, "stablehlo.abs": np.abs, "stablehlo.sqrt": np.sqrt,
    "stablehlo.rsqrt": lambda x: 1 / np.sqrt(x), "stablehlo.exponential": np.exp,
    "stablehlo.log": np.log, "stablehlo.floor": np.floor, "stablehlo.ceil": np.ceil,
    "stablehlo.sign": np.sign, "stablehlo.not": lambda x: np.logical_not(x) if x.dtype == bool else np.invert(x),
    "stablehlo.is_finite": np.isfinite, "stablehlo.tanh": np.tanh,
    "stablehlo.logistic": lambda x: 1 / (1 + np.exp(-x)),
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
               "stablehlo.compare", "stablehlo.select", "stablehlo.clamp", "stablehlo.slice")


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
            init = self._loop_invariant_init(r)
            return None if init is None else [self.graph.resolve(init)]
        name = v.owner.operation.name
        if name in _LEAVES:
            return []
        if name in _UNARY or name in _BINARY or name in _STRUCTURAL:
            return [self.graph.resolve(Ref(x, r.ctx)) for x in v.owner.operands]
        return None

    def _eval(self, r: Ref, a: list) -> Const | None:
        """The value of ``r`` from its folded operands ``a``."""
        v = r.value
        rtype = v.type
        shape = tuple(rtype.shape)
        dtype = np_dtype(rtype.element_type)
        if isinstance(v, ir.BlockArgument):
            return a[0]
        op = v.owner
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
        if name == "stablehlo.convert":
            return Const(a[0].array.astype(dtype), shape)
        if name in _UNARY:
            with np.errstate(all="ignore"):
                return Const(np.asarray(_UNARY[name](a[0].array)).astype(dtype), shape)
        if name in _BINARY:
            with np.errstate(all="ignore"):
                return self._sized(np.asarray(_BINARY[name](a[0].array, a[1].array)).astype(dtype), shape)
        if name == "stablehlo.divide":
            with np.errstate(all="ignore"):
                if np.issubdtype(dtype, np.integer):
                    q = np.trunc(a[0].array.astype(np.float64) / a[1].array).astype(dtype)
                else:
                    q = np.divide(a[0].array, a[1].array)
                return self._sized(np.asarray(q).astype(dtype), shape)
        if name == "stablehlo.remainder":
            with np.errstate(all="ignore"):
                return self._sized(np.fmod(a[0].array, a[1].array).astype(dtype), shape)
        if name == "stablehlo.compare":
            direction = str(attrs["comparison_direction"]).split()[-1].strip(">").upper()
            return self._sized(_cmp(direction, a[0].array, a[1].array), shape)
        if name == "stablehlo.select":
            return self._sized(np.where(a[0].array, a[1].array, a[2].array).astype(dtype), shape)
        if name == "stablehlo.clamp":
            return self._sized(np.clip(a[1].array, a[0].array, a[2].array).astype(dtype), shape)
        if name == "stablehlo.slice":
            start = list(ir.DenseI64ArrayAttr(attrs["start_indices"]))
            limit = list(ir.DenseI64ArrayAttr(attrs["limit_indices"]))
            step = list(ir.DenseI64ArrayAttr(attrs["strides"]))
            x = a[0].array
            idx = tuple(slice(0, 1) if x.shape[i] == 1 else slice(start[i], limit[i], step[i])
                        for i in range(x.ndim))
            return Const(x[idx], shape)
        return None

    @staticmethod
    def _sized(a: np.ndarray, shape) -> Const | None:
        if a.size > MAX_ELEMENTS:
            return None
        return Const(a, shape)

    @staticmethod
    def _loop_invariant_init(r: Ref) -> Ref | None:
        """The initial value of a while body/cond argument that the body passes through
        unchanged (so it is that value on every iteration), else None."""
        arg = r.value
        holder = arg.owner.owner.operation
        if holder.name != "stablehlo.while":
            return None
        body = holder.regions[1].blocks[0]
        ret = body.operations[len(body.operations) - 1]
        i = arg.arg_number
        if ret.operands[i] != body.arguments[i]:
            return None
        return Ref(holder.operands[i], r.ctx)
