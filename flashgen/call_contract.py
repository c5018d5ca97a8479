"""A module's flashgen custom calls checked against their contract (spec.ATTRIBUTES,
spec.SIGNATURES) before XLA sees them: XLA's own decoder only says "Failed to decode all FFI
handler operands (bad operands at: 8)". Used by execute.run (flashgen run, rewrite --verify)
and open to any caller as check_module."""
from __future__ import annotations

from flashgen.errors import UsageError
from flashgen.spec import ATTRIBUTES, SIGNATURES, parse_target_name


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
                problem = _attribute_problem(op, parsed[0]) or _operand_problem(op, parsed)
                if problem:
                    raise UsageError(f"the call of {name} at {op.location}: {problem}")


def _attribute_problem(op, direction: str):
    from jaxlib.mlir import ir
    attrs = op.attributes
    config = attrs["mhlo.backend_config"] if "mhlo.backend_config" in attrs else attrs["backend_config"] \
        if "backend_config" in attrs else None
    if not isinstance(config, ir.DictAttr):
        return "its backend_config is not a dictionary of typed attributes (flashgen emit shows the form)"
    given = {config[i].name: config[i].attr for i in range(len(config))}
    expected = ATTRIBUTES[direction]
    for key, want in expected.items():
        if key not in given:
            return f"attribute {key} is missing (expected {want})"
        got = _attribute_type(given[key])
        if got != want:
            return f"attribute {key} is {got}, expected {want}"
    extra = sorted(set(given) - set(expected))
    return f"unexpected attribute {extra[0]}" if extra else None


def _attribute_type(attr) -> str:
    from jaxlib.mlir import ir
    if isinstance(attr, ir.BoolAttr):
        return "i1"
    if isinstance(attr, (ir.IntegerAttr, ir.FloatAttr)):
        return str(attr.type)
    if isinstance(attr, ir.StringAttr):
        return "string"
    return str(attr)


def _operand_problem(op, parsed):
    from jaxlib.mlir import ir
    direction, _, dtype, _ = parsed
    fixed = [n for n in SIGNATURES[direction]["operands"] if not n.startswith("*")]
    if len(op.operands) < len(fixed):
        return f"{len(op.operands)} operands, expected at least {len(fixed)} ({', '.join(fixed)})"
    for i, (spec, value) in enumerate(zip(fixed, op.operands)):
        name, _, forced = spec.partition(":")
        want = forced or dtype
        got = str(value.type.element_type) if isinstance(value.type, ir.RankedTensorType) \
            else str(value.type)
        if got != want:
            return f"operand {i} ({name.split('[')[0]}) is {got}, expected {want}"
    return None
