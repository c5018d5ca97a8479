"""A module's flashgen custom calls checked against their contract (flashgen.contract) before
XLA sees them: XLA's own decoder only says "Failed to decode all FFI handler operands (bad
operands at: 8)". Used by execute.run (flashgen run, rewrite --verify) and open to any caller as
check_module."""
from __future__ import annotations

from flashgen.contract import CALLS, CallAttributes
from flashgen.errors import UsageError
from flashgen.spec import parse_target_name


def check_module(source) -> None:
    """UsageError naming the first call, attribute or operand that breaks the contract.
    ``source``: anything flashgen.rewrite.modules.load reads, a loaded module, or a
    jax.export.Exported (flashgen.jax.check_calls: before calling a deserialized module)."""
    from flashgen.rewrite import modules
    from flashgen.rewrite.graph import flashgen_calls
    if hasattr(source, "mlir_module_serialized"):
        source = source.mlir_module_serialized
    loaded = source if isinstance(source, modules.LoadedModule) else modules.load(source)
    with loaded.context:
        for op, name in flashgen_calls(loaded.module.operation):
            parsed = parse_target_name(name)
            if parsed is not None:
                try:
                    attrs = CallAttributes.parse(op, parsed[0])
                    problem = _operand_problem(op, parsed)
                except ValueError as e:
                    problem = str(e)
                else:
                    if not problem and attrs.causal != parsed[3]:
                        problem = (f"attribute causal is {str(attrs.causal).lower()}, but the target is the "
                                   f"{'causal' if parsed[3] else 'non-causal'} specialization")
                if problem:
                    raise UsageError(f"the call of {name} at {op.location}: {problem}")


def _operand_problem(op, parsed):
    from jaxlib.mlir import ir
    direction, dtype = parsed.direction, parsed.dtype
    fixed = CALLS[direction].operands
    if len(op.operands) < len(fixed):
        return (f"{len(op.operands)} operands, expected at least {len(fixed)} "
                f"({', '.join(o.name for o in fixed)})")
    for i, (want, value) in enumerate(zip(fixed, op.operands)):
        got = str(value.type.element_type) if isinstance(value.type, ir.RankedTensorType) \
            else str(value.type)
        if got not in want.dtypes(dtype):
            return f"operand {i} ({want.name}) is {got}, expected {' or '.join(want.dtypes(dtype))}"
    return None
