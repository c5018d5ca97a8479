"""Static instances of a shape-polymorphic module (``jax.export`` with symbolic dims).

Such a module types batch and sequence as ``?`` and computes shapes at run time
(get_dimension_size, dynamic_broadcast_in_dim, dynamic_iota, dynamic_reshape); the
dimension variables reach the body as ``jax.global_constant`` arguments, and @main asserts
their constraints (shape_assertion). At call time JAX refines the shapes (inlining and
folding everything) before XLA compiles. ``instantiate`` does the same to a copy, at sizes
``instantiation_sizes`` chooses, and tags the copy's ops with their place in the original
so that what is found in the copy can be found again in the original
(flashgen.rewrite.polymorphic).
"""
from __future__ import annotations

import itertools

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

from flashgen.errors import LoadError
from flashgen.rewrite.graph import nested_ops, op_name
from flashgen.rewrite.modules import first_line

TAG = "flashgen.poly_tag"    # an op's index in the original's op order
ARG = "flashgen.poly_arg"    # a cast of @main's argument: its number
_GLOBAL_CONSTANT = "jax.global_constant"


class Unsupported(Exception):
    """The module's dimension variables cannot be read or instantiated."""


def is_polymorphic(module: ir.Module) -> bool:
    """Whether any function of the module takes or returns a dynamically shaped tensor."""
    for op in module.body.operations:
        if op.operation.name != "func.func":
            continue
        ftype = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
        for t in list(ftype.inputs) + list(ftype.results):
            if isinstance(t, ir.RankedTensorType) and not t.has_static_shape:
                return True
    return False


def function(module: ir.Module, name: str):
    for op in module.body.operations:
        if op.operation.name == "func.func" and \
                ir.StringAttr(op.attributes["sym_name"]).value == name:
            return op
    return None


def _arg_attr(fn, i: int, key: str):
    if "arg_attrs" not in fn.attributes:
        return None
    d = ir.DictAttr(ir.ArrayAttr(fn.attributes["arg_attrs"])[i])
    return ir.StringAttr(d[key]).value if key in d else None


def dimension_variables(module: ir.Module) -> dict:
    """{(argument index, dim): variable name} for every dynamic dim of @main's arguments.

    JAX computes each variable from one argument dim (get_dimension_size) and passes it
    to the body as a ``jax.global_constant`` argument; the other dims holding it are
    asserted EQ to that value (shape_assertion)."""
    main = function(module, "main")
    args = list(main.regions[0].blocks[0].arguments)

    def dim_read(v):  # (arg index, dim) when v = get_dimension_size(@main arg, dim)
        if isinstance(v, ir.OpResult) and op_name(v.owner) == "stablehlo.get_dimension_size":
            src = v.owner.operands[0]
            if isinstance(src, ir.BlockArgument) and src.owner == main.regions[0].blocks[0]:
                return src.arg_number, ir.IntegerAttr(v.owner.attributes["dimension"]).value
        return None

    names = {}          # (arg, dim) -> variable
    ops = list(main.regions[0].blocks[0].operations)
    for op in ops:
        if op_name(op) != "func.call":
            continue
        callee = function(module, ir.FlatSymbolRefAttr(op.attributes["callee"]).value)
        for i, v in enumerate(op.operands):
            name = _arg_attr(callee, i, _GLOBAL_CONSTANT) if callee is not None else None
            if name is None:
                continue
            at = dim_read(v)
            if at is None:
                raise Unsupported(f"the dimension variable {name!r} is not read from one "
                                  "argument dim")
            names.setdefault(at, name)
    for op in ops:  # dims asserted equal to a variable's own dim
        if op_name(op) != "stablehlo.compare" or \
                "EQ" not in str(op.attributes["comparison_direction"]):
            continue
        a, b = (dim_read(x) for x in op.operands)
        if a is not None and b in names:
            names.setdefault(a, names[b])
    out = {}
    for i, a in enumerate(args):
        t = a.type
        if not isinstance(t, ir.RankedTensorType):
            continue
        for d in range(t.rank):
            if t.is_dynamic_dim(d):
                if (i, d) not in names:
                    raise Unsupported(f"@main's argument {i} dim {d} is dynamic but not a "
                                      "plain dimension variable (e.g. 2*s, or no jax.export "
                                      "shape specification)")
                out[(i, d)] = names[(i, d)]
    return out


def _primes(start: int, stop: int) -> list:
    return [n for n in range(max(start, 2), stop)
            if all(n % k for k in range(2, int(n ** 0.5) + 1))]


# Candidate sizes in order of preference: primes from 37 up (masks are checked over many rows,
# [S, S] still folds cheaply), then the small ones (for upper bounds such as b <= 8), then larger.
_CANDIDATES = _primes(37, 100) + _primes(3, 37)[::-1] + _primes(100, 2048)
_MAX_TRIES = 50_000


def instantiation_sizes(module: ir.Module, dims: dict, variables: list) -> tuple:
    """Two assignments {variable: size} of distinct primes that no static dim of @main's
    arguments has (so that a size in a matched layout names its variable) and under which
    @main's shape assertions (jax.export's symbolic constraints, e.g. ``t >= 128``) hold."""
    main = function(module, "main")
    static = set()
    for a in main.regions[0].blocks[0].arguments:
        if isinstance(a.type, ir.RankedTensorType):
            static |= {n for i, n in enumerate(a.type.shape) if not a.type.is_dynamic_dim(i)}
    order = [p for p in _CANDIDATES if p not in static]
    holds = _Assertions(main, dims)
    found, used, tries = [], set(), 0
    for pick in _by_rank(len(order), len(variables)):
        values = [order[i] for i in pick]
        if len(set(values)) < len(values) or used & set(values):
            continue
        tries += 1
        if tries > _MAX_TRIES:
            break
        sizes = dict(zip(variables, values))
        if holds(sizes) is False:
            continue
        found.append(sizes)
        used |= set(values)
        if len(found) == 2:
            return found[0], found[1]
    raise Unsupported("no two sets of prime sizes satisfy the module's shape assertions")


def _by_rank(n: int, k: int):
    """Index tuples into a preference list of ``n``, the least preferred index ascending."""
    for r in range(n):
        for pick in itertools.product(range(r + 1), repeat=k):
            if r in pick:
                yield pick


class _Assertions:
    """@main's shape_assertion predicates as a function of the dimension variables' sizes:
    True / False, or None when one is computed by an op this reader does not know."""

    _BINARY = {
        "stablehlo.add": lambda a, b: a + b, "stablehlo.subtract": lambda a, b: a - b,
        "stablehlo.multiply": lambda a, b: a * b, "stablehlo.maximum": max,
        "stablehlo.minimum": min, "stablehlo.and": lambda a, b: a and b,
        "stablehlo.or": lambda a, b: a or b,
        # integer division and remainder truncate toward zero
        "stablehlo.divide": lambda a, b: int(a / b) if b else None,
        "stablehlo.remainder": lambda a, b: a - b * int(a / b) if b else None,
    }
    _COMPARE = {"EQ": lambda a, b: a == b, "NE": lambda a, b: a != b,
                "GE": lambda a, b: a >= b, "GT": lambda a, b: a > b,
                "LE": lambda a, b: a <= b, "LT": lambda a, b: a < b}

    def __init__(self, main, dims: dict):
        self.ops = list(main.regions[0].blocks[0].operations)
        self.args = list(main.regions[0].blocks[0].arguments)
        self.dims = dims

    def __call__(self, sizes: dict):
        env, result = {}, True
        for op in self.ops:
            name = op.operation.name
            if name == "stablehlo.custom_call" and \
                    ir.StringAttr(op.attributes["call_target_name"]).value == "shape_assertion":
                ok = env.get(op.operands[0])
                if ok is None:
                    result = None
                elif not ok:
                    return False
                continue
            if len(op.results) != 1 or not isinstance(op.result.type, ir.RankedTensorType) or \
                    op.result.type.rank != 0:
                continue
            env[op.result] = self._value(op, name, env, sizes)
        return result

    def _value(self, op, name, env, sizes):
        args = [env.get(x) for x in op.operands]
        if name == "stablehlo.constant":
            try:
                return int(ir.DenseIntElementsAttr(op.attributes["value"])[0])
            except (ValueError, TypeError):  # a float scalar: no shape arithmetic
                return None
        if name == "stablehlo.get_dimension_size":
            src = op.operands[0]
            d = ir.IntegerAttr(op.attributes["dimension"]).value
            if isinstance(src, ir.BlockArgument) and src in self.args:
                at = (src.arg_number, d)
                return sizes[self.dims[at]] if at in self.dims else src.type.shape[d]
            return None
        if any(a is None for a in args):
            return None
        if name in ("stablehlo.convert", "stablehlo.reshape"):
            return args[0]
        if name == "stablehlo.negate":
            return -args[0]
        if name == "stablehlo.not":
            return not args[0]
        if name == "stablehlo.select":
            return args[1] if args[0] else args[2]
        if name == "stablehlo.compare":
            how = str(op.attributes["comparison_direction"]).split()[-1].strip(">")
            return self._COMPARE[how](args[0], args[1]) if how in self._COMPARE else None
        if name in self._BINARY:
            return self._BINARY[name](args[0], args[1])
        return None


def instantiate(module: ir.Module, dims: dict, sizes: dict) -> ir.Module:
    """A copy of ``module`` refined as JAX does at call time, for @main's dynamic dims set
    to ``sizes``. Its ops carry their index in the original's op order (``TAG``; the
    refinement keeps them on the ops it does not replace), the casts of @main's arguments
    their argument number (``ARG``).

    The copy lives in a new context (the refinement parses its result)."""
    from jax._src.interpreters import mlir as jax_mlir

    text = module.operation.get_asm(enable_debug_info=True)
    ctx = jax_mlir.make_ir_context()
    with ctx, ir.Location.unknown():
        try:
            copy = ir.Module.parse(text)
        except ir.MLIRError as e:  # what bytecode carries need not print back as valid text
            raise LoadError(f"the module does not read back from its own text form: {first_line(e)}") from None
        i64 = ir.IntegerType.get_signless(64)
        for i, op in enumerate(nested_ops(copy.operation)):
            # custom calls keep their attributes: the refinement checks jax's own ones
            if op.operation.name != "stablehlo.custom_call":
                op.operation.attributes[TAG] = ir.IntegerAttr.get(i64, i)
        main = function(copy, "main")
        block = main.regions[0].blocks[0]
        first = block.operations[0]
        inputs = []
        for i, a in enumerate(list(block.arguments)):
            t = a.type
            if isinstance(t, ir.RankedTensorType) and not t.has_static_shape:
                shape = [sizes[dims[(i, d)]] if t.is_dynamic_dim(d) else t.shape[d]
                         for d in range(t.rank)]
                a.set_type(ir.RankedTensorType.get(shape, t.element_type, t.encoding))
                # the body keeps its dynamic types: a shape-changing convert in between,
                # as jax.export's call wrapper does
                cast = stablehlo.ConvertOp(t, a, ip=ir.InsertionPoint(first))
                cast.operation.attributes[ARG] = ir.IntegerAttr.get(i64, i)
                a.replace_all_uses_except(cast.result, cast.operation)
            inputs.append(a.type)
        ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
        main.attributes["function_type"] = ir.TypeAttr.get(
            ir.FunctionType.get(inputs, list(ftype.results)))
        try:
            return jax_mlir.refine_polymorphic_shapes(copy)
        except Exception as e:  # noqa: BLE001 - jax raises ValueError or its own error types
            cause = e.__cause__ or e
            raise Unsupported(f"shape refinement at {sizes_text(sizes)} failed: "
                              f"{str(cause).strip().splitlines()[0]}") from None


def sizes_text(sizes: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items())


def tag(op, key: str = TAG) -> int | None:
    attrs = op.operation.attributes
    return ir.IntegerAttr(attrs[key]).value if key in attrs else None
