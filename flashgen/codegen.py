"""Render the Jinja2 templates of a set of KernelSpecs into C++/CUDA sources.

One file per spec (both directions), plus a library table of contents and,
for Python hosts, the pybind11 face. Templates only bind names; the logic
lives in csrc/ headers.
"""
from __future__ import annotations

import dataclasses
import json

import jinja2

from flashgen import contract, resources, targets
from flashgen.spec import DIRECTIONS, FFI_DTYPES, KernelSpec

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


def _spec_context(spec: KernelSpec) -> dict:
    return {
        "head_dim": spec.head_dim,
        "dtype": spec.dtype,
        "ffi_dtype": FFI_DTYPES[spec.dtype],
        "causal": spec.causal,
        "fwd_symbol": spec.target_name("fwd"),
        "bwd_symbol": spec.target_name("bwd"),
        "fwd_varlen_symbol": spec.target_name("fwd_varlen"),
        "bwd_varlen_symbol": spec.target_name("bwd_varlen"),
        "fwd_paged_symbol": spec.target_name("fwd_paged"),
        "arch": spec.target,
    }


def render_spec(spec: KernelSpec) -> Source:
    family = targets.lookup(spec.target).family
    text = _ENV.get_template(family.template).render(**_spec_context(spec))
    return Source(f"{spec.stem}{family.suffix}", text, family.language)


def _handlers(specs: list[KernelSpec]) -> list[dict]:
    return [{"symbol": s.target_name(d), "platform": s.platform,
             "xla_platform": targets.lookup(s.target).xla_platform}
            for s in specs for d in DIRECTIONS]


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
# flashgen.spec's attribute types as the XLA FFI scalar types the NIF hands the handlers
# (a string attribute has no scalar type).
_NIF_ATTR_TYPES = {"i1": "XLA_FFI_DataType_PRED", "i32": "XLA_FFI_DataType_S32",
                   "f32": "XLA_FFI_DataType_F32", "string": "XLA_FFI_DataType_INVALID"}


def render_nif_face() -> Source:
    """The erl_nif face of a library (module NIF_MODULE), with the call contract's tables."""
    directions = [{"name": d, "attrs": [{"name": n, "type": _NIF_ATTR_TYPES[t]} for n, t in contract.ATTRIBUTE_TYPES[d].items()]}
                  for d in DIRECTIONS]
    extras = [{"name": n, "operands": [o.name for o in ops]} for n, ops in contract.EXTRAS.items()]
    text = _ENV.get_template("common/nif_face.cc.j2").render(module=NIF_MODULE, directions=directions,
                                                               extras=extras, inline_work=NIF_INLINE_WORK)
    return Source("nif_face.cc", text, "c++")
