"""Read and write the module formats flashgen rewrites.

  mlir          StableHLO text
  mlirbc        MLIR bytecode of stablehlo/func ops
  portable      a StableHLO portable artifact (VHLO bytecode, e.g. ``StableHLO_v1.10.0``)
  jax_exported  what ``jax.export.Exported.serialize()`` writes (a flatbuffer that holds a
                portable artifact plus the calling convention)

The format is read from the content, never from the file name; ``dump``
writes a module back in the format it came in.
"""
from __future__ import annotations

import dataclasses
import io
import os
import pathlib
import re
from typing import Any, Optional

from jaxlib.mlir import ir

from flashgen.errors import LoadError
from flashgen.mlir_context import new_context

FORMATS = ("mlir", "mlirbc", "portable", "jax_exported")
_BYTECODE_MAGIC = b"ML\xefR"
_VERSION = re.compile(rb"StableHLO_v(\d+\.\d+\.\d+)")
_ALLOWED_DIALECTS = {"builtin", "func", "stablehlo", "chlo", "sdy", "mhlo", "shardy"}


@dataclasses.dataclass
class LoadedModule:
    format: str
    module: ir.Module
    context: ir.Context
    data: bytes                       # the input exactly as read
    exported: Any = None              # the jax.export.Exported for jax_exported
    version: Optional[str] = None     # the StableHLO version of a portable artifact
    has_locations: bool = True        # print locations when writing text
    path: Optional[str] = None


def read_source(source) -> tuple[bytes, Optional[str]]:
    """Bytes of a path, bytes object or MLIR text; (data, path or None)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source), None
    if isinstance(source, str) and ("\n" in source or "func.func" in source
                                    or source.lstrip().startswith(("module", "#", "//"))):
        return source.encode(), None
    if isinstance(source, (str, os.PathLike)):
        p = pathlib.Path(source)
        try:
            return p.read_bytes(), str(p)
        except FileNotFoundError:
            raise LoadError(f"no such file: {p}") from None
        except IsADirectoryError:
            raise LoadError(f"{p} is a directory, not a module file") from None
    raise LoadError(f"cannot read a module from a {type(source).__name__}")


def detect_format(data: bytes) -> str:
    if not data:
        raise LoadError("empty input: not a StableHLO module")
    if data.startswith(_BYTECODE_MAGIC):
        return "portable" if _VERSION.search(data[:64]) else "mlirbc"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and "\x00" not in text:
        return "mlir"
    return "jax_exported"


def load(source) -> LoadedModule:
    """Parse a module from a path, bytes or text. LoadError on anything unreadable, and on
    input nested deeper than the MLIR reader can take (flashgen.rewrite.probe)."""
    from flashgen.rewrite import probe
    data, path = read_source(source)
    fmt = detect_format(data)
    exported = None
    if fmt == "jax_exported":  # a flatbuffer read by pure Python: only its artifact is probed
        exported = _deserialize_exported(data)
        probe.check(exported.mlir_module_serialized, "portable")
    else:
        probe.check(data, fmt)
    ctx = new_context()
    with ctx:
        module, exported, version = parse(data, fmt, exported)
        check_stablehlo(module)
    has_locs = b"loc(" in data if fmt == "mlir" else True
    return LoadedModule(fmt, module, ctx, data, exported, version, has_locs, path)


def parse(data: bytes, fmt: str, exported=None):
    """(module, Exported or None, StableHLO version or None) of ``data`` in the current
    context, without any safety check: use ``load``. ``exported``: ``data`` deserialized
    already (jax_exported)."""
    version = None
    if fmt == "mlir":
        module = _parse(data.decode("utf-8"), "StableHLO text")
    elif fmt == "mlirbc":
        module = _parse(data, "MLIR bytecode")
    elif fmt == "portable":
        version = _VERSION.search(data[:64]).group(1).decode()
        module = _deserialize_artifact(data)
    else:
        exported = exported or _deserialize_exported(data)
        art = exported.mlir_module_serialized
        m = _VERSION.search(art[:64])
        version = m.group(1).decode() if m else None
        module = _deserialize_artifact(art)
    return module, exported, version


def _parse(text_or_bytes, what: str) -> ir.Module:
    try:
        return ir.Module.parse(text_or_bytes)
    except ir.MLIRError as e:
        raise LoadError(f"cannot parse the input as {what}: {first_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - the bindings raise several types for bad input
        raise LoadError(f"cannot parse the input as {what}: {first_line(e)}") from None


def _deserialize_artifact(data: bytes) -> ir.Module:
    from jaxlib.mlir.dialects import stablehlo
    try:
        return stablehlo.deserialize_portable_artifact(ir.Context.current, data)
    except Exception as e:  # noqa: BLE001
        raise LoadError(f"cannot read the StableHLO portable artifact: {first_line(e)}") from None


def _deserialize_exported(data: bytes):
    from jax import export
    try:
        return export.deserialize(bytearray(data))
    except Exception as e:  # noqa: BLE001 - flatbuffers raise anything on garbage
        raise LoadError("not a StableHLO module: the input is neither MLIR text, MLIR bytecode "
                        f"nor a serialized jax.export.Exported ({type(e).__name__})") from None


def first_line(e: Exception) -> str:
    text = str(e).strip()
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("Unable to parse", "Diagnostics:")):
            return line.strip(":")
    return text.splitlines()[0] if text else type(e).__name__


def check_stablehlo(module: ir.Module) -> None:
    """A public @main must exist and every op must belong to a StableHLO program's dialects."""
    main = None
    for op in module.body.operations:
        name = op.operation.name
        if name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main":
            main = op
        elif name.split(".")[0] not in _ALLOWED_DIALECTS:
            raise LoadError(f"not a StableHLO module: top-level op '{name}'")
    if main is None:
        raise LoadError("the module has no @main function")
    from flashgen.rewrite.graph import nested_ops
    for op in nested_ops(module.operation):
        name = op.operation.name
        if name.split(".")[0] not in _ALLOWED_DIALECTS:
            raise LoadError(f"not a StableHLO module: it contains '{name}' "
                            f"(only {', '.join(sorted(_ALLOWED_DIALECTS))} ops are read)")
        bad = _malformed_type(op.operation)
        if bad:
            raise LoadError(f"malformed module: '{name}' has the type {bad} (a negative dimension)")


_DYNAMIC = -(2**63)  # ir.ShapedType.get_dynamic_size()


def _malformed_type(op) -> Optional[str]:
    """A result or block-argument tensor type of ``op`` with a negative static dimension.
    Bytecode can carry one; its text form does not parse back, so nothing downstream (a
    rewrite written as text, a refined instance) could read it."""
    values = list(op.results) + [a for r in op.regions for b in r.blocks for a in b.arguments]
    for v in values:
        t = v.type
        if isinstance(t, ir.RankedTensorType) and any(d < 0 and d != _DYNAMIC for d in t.shape):
            return str(t)
    return None


def module_text(module: ir.Module, locations: bool = True) -> str:
    out = io.StringIO()
    module.operation.print(file=out, enable_debug_info=locations)
    return out.getvalue()


def dump(loaded: LoadedModule, module: ir.Module | None = None, *,
         extra_custom_calls: tuple = ()) -> bytes:
    """The module in ``loaded``'s format (``module`` defaults to loaded.module)."""
    module = loaded.module if module is None else module
    with loaded.context:
        if loaded.format == "mlir":
            return module_text(module, loaded.has_locations).encode()
        if loaded.format == "mlirbc":
            out = io.BytesIO()
            module.operation.write_bytecode(out)
            return out.getvalue()
        art = serialize_artifact(module, loaded.version)
        if loaded.format == "portable":
            return art
        return _reserialize_exported(loaded.exported, art, extra_custom_calls)


def serialize_artifact(module: ir.Module, version: Optional[str]) -> bytes:
    from jaxlib.mlir.dialects import stablehlo
    target = version or stablehlo.get_current_version()
    text = module_text(module, True)
    try:  # jax's own serializer keeps Shardy (sdy) ops as jax.export does
        from jax._src.lib import _jax
        return _jax.mlir.serialize_portable_artifact(text, target, True)
    except (ImportError, AttributeError, TypeError):
        return stablehlo.serialize_portable_artifact_str(text, target)


def _reserialize_exported(exported, artifact: bytes, custom_calls: tuple) -> bytes:
    from jax import export
    checks = tuple(exported.disabled_safety_checks) + tuple(
        export.DisabledSafetyCheck.custom_call(n) for n in custom_calls
        if export.DisabledSafetyCheck.custom_call(n) not in exported.disabled_safety_checks)
    new = dataclasses.replace(exported, mlir_module_serialized=artifact,
                              disabled_safety_checks=checks)
    order = 0
    try:
        order = 1 if exported.has_vjp() else 0
    except Exception:  # noqa: BLE001 - older/newer jax without has_vjp
        order = 0
    try:
        return bytes(new.serialize(vjp_order=order))
    except Exception:  # noqa: BLE001 - the vjp may not serialize; keep the primal
        return bytes(new.serialize())


def version_at_least(version: Optional[str], minimum: str) -> bool:
    if version is None:
        return True
    return tuple(map(int, version.split("."))) >= tuple(map(int, minimum.split(".")))
