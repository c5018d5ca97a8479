"""Render the Jinja2 templates of a set of KernelSpecs into C++/CUDA sources.

One file per spec (the handler of each call flashgen.contract defines, bound as
its CALLS say), plus a library table of contents and, for Python hosts, the
pybind11 face. Templates only bind names; the logic lives in csrc/ headers.
"""
from __future__ import annotations

import dataclasses
import json

import jinja2

from flashgen import contract, resources, targets
from flashgen.spec import FFI_DTYPES, KernelSpec

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(resources.templates_dir())),
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
)


@dataclasses.dataclass(frozen=True)
class Source:
    name: str      # file name inside the build directory
    text: str
    language: str  # "c++" or "cuda"


# contract's fixed element types as XLA FFI data types ("T" is the spec's dtype).
_FFI_TYPES = {"i1": "PRED", "i32": "S32", "f32": "F32", "bf16": "BF16"}
# csrc/flashgen/call.h's decoded attributes: the struct each attribute list decodes into.
_ATTRS_TYPES = {contract.CALLS[d].attributes: t for d, t in (
    ("fwd", "DenseAttrs"), ("fwd_varlen", "VarlenAttrs"), ("bwd", "BwdAttrs"), ("bwd_varlen", "BwdVarlenAttrs"))}


def _buffer(op: contract.Operand, ffi_dtype: str) -> dict:
    return {"name": op.name, "ffi_type": ffi_dtype if op.dtype == "T" else _FFI_TYPES[op.dtype]}


def _shaped(ops) -> str:
    return ", ".join(f"{o.name} [{', '.join(o.shape)}]" for o in ops)


def call_bindings(spec: KernelSpec) -> list[dict]:
    """Each call of `spec` as its handler binds it: contract.calls(spec.dtype)'s operands and results
    in order, the call.h types its attributes and buffers decode into (an FP8 spec's: <Direction>Fp8Call)."""
    out, ffi_dtype = [], FFI_DTYPES[spec.dtype]
    fp8 = "Fp8" if spec.dtype in contract.FP8_DTYPES else ""
    for direction, call in contract.calls(spec.dtype).items():
        if call.attributes not in _ATTRS_TYPES:
            raise ValueError(f"no struct in csrc/flashgen/call.h decodes {direction}'s attributes {call.attributes}")
        extras = f" (+ {', '.join(call.extras)})" if call.extras else ""
        out.append({
            "direction": direction, "symbol": spec.target_name(direction),
            "summary": f"{_shaped(call.operands)}{extras} -> {_shaped(call.results)}" +
                       (" (+ dbias iff bias)" if call.dbias else ""),
            "operands": [_buffer(o, ffi_dtype) for o in call.operands],
            "results": [_buffer(o, ffi_dtype) for o in call.results],
            "dbias": call.dbias,
            "call_type": "".join(w.capitalize() for w in direction.split("_")) + fp8 + "Call",
            "attrs_type": _ATTRS_TYPES[call.attributes],
        })
    return out


def _spec_context(spec: KernelSpec) -> dict:
    return {
        "head_dim": spec.head_dim,
        "head_dim_v": spec.head_dim_v,
        "dtype": spec.dtype,
        "ffi_dtype": FFI_DTYPES[spec.dtype],
        "causal": spec.causal,
        "calls": call_bindings(spec),
        "arch": spec.target,
        "family": targets.lookup(spec.target).family.name,
    }


def render_spec(spec: KernelSpec) -> Source:
    family = targets.lookup(spec.target).family
    text = _ENV.get_template(family.template).render(**_spec_context(spec))
    return Source(f"{spec.stem}{family.suffix}", text, family.language)


def _handlers(specs: list[KernelSpec]) -> list[dict]:
    return [{"symbol": s.target_name(d), "platform": s.platform,
             "xla_platform": targets.lookup(s.target).xla_platform}
            for s in specs for d in s.directions]


def render_library(specs: list[KernelSpec], info: dict) -> list[Source]:
    """The C sources of one library: the specs and its table of contents."""
    handlers = _handlers(specs)
    info_json = json.dumps(info, sort_keys=True)
    if ")flashgen_json" in info_json:  # would end the raw string literal early
        raise ValueError("library info must not contain ')flashgen_json'")
    sources = [render_spec(s) for s in specs]
    sources.append(Source("library.cc", _ENV.get_template("common/library.cc.j2").render(
        handlers=handlers, info_json=info_json), "c++"))
    return sources


def render_static_registration(specs: list[KernelSpec]) -> Source:
    """Static XLA_FFI_REGISTER_HANDLER calls, for hosts such as EXLA."""
    text = _ENV.get_template("common/static_registration.cc.j2").render(handlers=_handlers(specs))
    return Source("static_registration.cc", text, "c++")


# The Python face's module init, the same in every library (so its object is compiled once per
# toolchain); build.py links each library's PyInit_<module> to it.
FACE_INIT = "flashgen_face"


def render_python_face() -> Source:
    """The pybind11 module of a library."""
    text = _ENV.get_template("common/python_face.cc.j2").render(module_name=FACE_INIT)
    return Source("python_face.cc", text, "c++")


# The Erlang module a NIF face's functions belong to (examples/elixir's FlashGen.NIF).
NIF_MODULE = "Elixir.FlashGen.NIF"
# The most work (B*Sq*Sk*Hq*D; twice that for a backward) a NIF call may do on the calling
# normal scheduler: about 100 us of kernel on one core (S = 64, H = 4, D = 64 forward), well
# inside the BEAM's 1 ms for a NIF; larger calls go to a dirty CPU scheduler.
NIF_INLINE_WORK = 1 << 20


def render_nif_face() -> Source:
    """The erl_nif face of a library (module NIF_MODULE), with the call contract's tables."""
    # An attribute's XLA FFI scalar type, as the NIF hands it to the handlers (a string has none).
    def scalar(name):
        mlir = contract.ATTRIBUTES[name].mlir
        return "XLA_FFI_DataType_" + ("INVALID" if mlir == "string" else _FFI_TYPES[mlir])
    directions = [{"name": d, "attrs": [{"name": n, "type": scalar(n)} for n in call.attributes]}
                  for d, call in contract.CALLS.items()]
    extras = [{"name": n, "operands": [o.name for o in ops]} for n, ops in contract.EXTRAS.items()]
    text = _ENV.get_template("common/nif_face.cc.j2").render(module=NIF_MODULE, directions=directions,
                                                               extras=extras, inline_work=NIF_INLINE_WORK)
    return Source("nif_face.cc", text, "c++")
