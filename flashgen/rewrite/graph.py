"""Navigation over a StableHLO module that sees through calls to private functions.

A ``Ref`` is an SSA value together with the chain of ``func.call`` ops
through which the matcher reached it (its *context*). Following a value
into a call steps into the callee's block argument (pushing the call);
reaching the callee's ``func.return`` steps back out to the call's result
(popping it). So one private function called from several places (JAX's
``@_where``, EXLA's outlined computations) is read separately for each
call site, and nothing is inlined in the module itself.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

from jaxlib.mlir import ir


def op_name(op) -> str:
    return op.operation.name


@dataclasses.dataclass(frozen=True)
class Ref:
    value: ir.Value
    ctx: tuple = ()  # the func.call operations entered, outermost first

    @property
    def type(self):
        return self.value.type

    @property
    def shape(self) -> tuple:
        return tuple(self.value.type.shape)

    @property
    def element_type(self) -> str:
        return str(self.value.type.element_type)


class Graph:
    """Index of a module: functions by name, call sites, producer/user look-ups."""

    def __init__(self, module: ir.Module):
        self.module = module
        self.funcs: dict[str, object] = {}
        for op in module.body.operations:
            if op_name(op) == "func.func":
                self.funcs[ir.StringAttr(op.attributes["sym_name"]).value] = op.operation
        self._users: dict = {}
        self._asm: dict = {}
        self._calls: dict | None = None

    def asm_state(self, fn):
        """One naming state per function, so that SSA names print as in the module."""
        key = hash(fn) if fn is not None else None
        if key not in self._asm:
            self._asm[key] = ir.AsmState(fn if fn is not None else self.module.operation, True)
        return self._asm[key]

    # -- functions -------------------------------------------------------------
    def callee(self, call_op):
        """The private, defined function a func.call reaches, or None."""
        if op_name(call_op) != "func.call":
            return None
        name = ir.FlatSymbolRefAttr(call_op.attributes["callee"]).value
        fn = self.funcs.get(name)
        if fn is None or not len(fn.regions[0].blocks):
            return None
        vis = fn.attributes["sym_visibility"] if "sym_visibility" in fn.attributes else None
        if vis is None or ir.StringAttr(vis).value != "private":
            return None
        return fn

    def only_call_site(self, fn):
        """The one func.call that reaches private function ``fn`` in the module, or None
        when there are several or none (so its arguments have one known value each)."""
        if self._calls is None:
            self._calls = {}
            for inner in nested_ops(self.module):
                if inner.operation.name == "func.call":
                    name = ir.FlatSymbolRefAttr(inner.attributes["callee"]).value
                    self._calls.setdefault(name, []).append(inner.operation)
        found = self._calls.get(self.function_name(fn), [])
        return found[0] if len(found) == 1 and self.callee(found[0]) is not None else None

    @staticmethod
    def function_of(op) -> object | None:
        """The func.func that (transitively) holds ``op``."""
        o = op.operation
        while o is not None:
            parent = o.parent
            if parent is None:
                return None
            parent = parent.operation
            if parent.name == "func.func":
                return parent
            o = parent
        return None

    @staticmethod
    def function_name(fn) -> str:
        return ir.StringAttr(fn.attributes["sym_name"]).value if fn is not None else "?"

    # -- producers ---------------------------------------------------------------
    def producer(self, ref: Ref):
        """(op, resolved Ref) of a value, seeing through calls; op is None for a leaf."""
        r = self.resolve(ref)
        if isinstance(r.value, ir.BlockArgument):
            return None, r
        return r.value.owner, r

    def resolve(self, ref: Ref) -> Ref:
        """The same value with calls and call arguments seen through."""
        v, ctx = ref.value, ref.ctx
        while True:
            if isinstance(v, ir.BlockArgument):
                owner = v.owner.owner
                if ctx and owner.operation.name == "func.func":
                    v, ctx = ctx[-1].operands[v.arg_number], ctx[:-1]
                    continue
                return Ref(v, ctx)
            op = v.owner
            if op.operation.name == "func.call":
                fn = self.callee(op)
                if fn is not None:
                    ret = _terminator(fn.regions[0].blocks[0])
                    v, ctx = ret.operands[v.result_number], ctx + (op.operation,)
                    continue
            return Ref(v, ctx)

    # -- users -----------------------------------------------------------------
    def raw_users(self, value: ir.Value) -> list:
        key = value
        found = self._users.get(key)
        if found is None:
            found = [(u.owner, u.operand_number) for u in value.uses]
            self._users[key] = found
        return found

    def users(self, ref: Ref) -> Iterator[tuple]:
        """(user op, operand index, ctx) of a value, seeing through calls and returns.

        A use by a call to a private function becomes the uses of the callee's
        argument (ctx pushed); a use by the func.return of a callee entered
        with a context becomes the uses of the call's result (ctx popped).
        Uses by anything else are yielded as they are.
        """
        stack = [ref]
        seen = set()
        while stack:
            r = stack.pop()
            key = (r.value, r.ctx)
            if key in seen:
                continue
            seen.add(key)
            for user, idx in self.raw_users(r.value):
                name = user.operation.name
                if name == "func.call":
                    fn = self.callee(user)
                    if fn is not None:
                        stack.append(Ref(fn.regions[0].blocks[0].arguments[idx], r.ctx + (user.operation,)))
                        continue
                if name == "func.return" and r.ctx:
                    fn = user.operation.parent.operation
                    call = r.ctx[-1]
                    target = self.callee(call)
                    if target is not None and target.operation == fn:
                        stack.append(Ref(call.results[idx], r.ctx[:-1]))
                        continue
                yield user, idx, r.ctx


def nested_ops(op) -> Iterator:
    """Every operation inside ``op``'s regions, at any depth, in program order (pre-order).

    An explicit stack instead of recursion: region nesting and layer chains of real
    models run deeper than Python's recursion limit."""
    stack = [iter(_ops_of(op.operation))]
    while stack:
        inner = next(stack[-1], None)
        if inner is None:
            stack.pop()
            continue
        yield inner
        if len(inner.operation.regions):
            stack.append(iter(_ops_of(inner.operation)))


def flashgen_calls(op) -> Iterator:
    """(operation, target name) of every flashgen custom call inside ``op``, in program order."""
    for inner in nested_ops(op):
        inner = inner.operation
        if inner.name == "stablehlo.custom_call":
            name = ir.StringAttr(inner.attributes["call_target_name"]).value
            if name.startswith("flashgen_"):
                yield inner, name


def _ops_of(op):
    return [inner for region in op.regions for block in region.blocks for inner in block.operations]


def _terminator(block):
    ops = block.operations
    return ops[len(ops) - 1]


def location_of(op) -> str:
    return str(op.location)


def short_location(op) -> str:
    """The most specific name in an op's location, e.g. 'jit(f)/dot_general' or 'file.py:3:4'."""
    text = str(op.location)
    # loc("name"(...)) or loc("file":l:c) or loc(callsite(...)); keep the first quoted part
    start = text.find('"')
    if start < 0:
        return text
    end = text.find('"', start + 1)
    head = text[start + 1:end]
    rest = text[end + 1:]
    if rest.startswith(":"):  # a file location: keep line:col
        tail = rest[1:].split(")")[0].split(" ")[0]
        return f"{head}:{tail}"
    return head
