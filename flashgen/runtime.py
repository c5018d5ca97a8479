"""Load built libraries and register their handlers with JAX.

A library is found by its .so, its manifest.json or the directory holding
both, and is verified against the manifest's records before it is loaded.
Registration goes through the library's pybind11 face: each handler arrives
as a PyCapsule for jax.ffi.register_ffi_target.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import pathlib
import threading

from flashgen import cache, targets, toolchain
from flashgen.build import build
from flashgen.cache import MANIFEST
from flashgen.errors import LoadError
from flashgen.spec import KernelSpec

_lock = threading.Lock()
_registered: dict[tuple[str, str], str] = {}  # (target name, platform) -> library path
_loaded_modules: dict[str, object] = {}


def _resolve(path: str | pathlib.Path) -> tuple[pathlib.Path, dict]:
    """The library and its manifest, both verified against the manifest's records: a file that
    is truncated or altered must never reach dlopen (it crashes the process, or worse)."""
    p = pathlib.Path(path)
    if not p.exists():
        raise LoadError(f"no such library or manifest: {path}")
    directory = p if p.is_dir() else p.parent
    if p.suffix == ".json" and p.name != MANIFEST:  # its directory's manifest.json is another library
        raise LoadError(f"{path} is not a flashgen manifest: flashgen reads the {MANIFEST} beside "
                        f"its library; pass that file, the library or its directory")
    if not (directory / MANIFEST).exists():
        raise LoadError(f"no {MANIFEST} beside {p}: flashgen loads only libraries it can verify "
                        f"(ship the library with its manifest, e.g. flashgen build --out DIR)")
    try:
        manifest = cache.verify_library(directory)
    except cache.CorruptEntry as e:
        hint = "" if isinstance(e, cache.OutdatedEntry) else "; rebuild it or copy it again"
        raise LoadError(f"refusing to load the library in {directory}: {e}{hint}") from None
    missing = sorted(set(manifest.get("cpu_isa") or ()) - set(toolchain.cpu_isa()))
    if missing:  # -march=native code on a CPU without those instructions dies of SIGILL
        raise LoadError(f"the library in {directory} was built for a CPU with {', '.join(missing)}, "
                        f"which this CPU lacks: build it on (or for) this CPU")
    lib = directory / manifest["flashgen_library"]
    if p.is_file() and p.suffix != ".json" and p.resolve() != lib.resolve():
        raise LoadError(f"{p} is not the library its {MANIFEST} describes ({lib.name})")
    return lib, manifest


def _python_face(lib: pathlib.Path):
    key = str(lib.resolve())
    if key not in _loaded_modules:
        name = lib.name.split(".", 1)[0]  # build.py names the file after its module
        loader = importlib.machinery.ExtensionFileLoader(name, key)
        spec = importlib.util.spec_from_file_location(name, key, loader=loader)
        try:
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
        except ImportError as e:
            raise LoadError(f"cannot load {lib} as a flashgen library (built for another "
                            f"Python, or without its Python face?): {e}") from e
        _loaded_modules[key] = module
    return _loaded_modules[key]


def load(path: str | pathlib.Path) -> list[str]:
    """Register every handler of a built library with JAX; returns the target names."""
    import jax

    lib, manifest = _resolve(path)
    if not manifest.get("python_face"):
        raise LoadError(f"{lib} was built without its Python face (e.g. for EXLA); rebuild for Python")
    module = _python_face(lib)
    names = []
    with _lock:
        for name, platform, capsule in module.handlers():
            if (name, platform) not in _registered:
                jax.ffi.register_ffi_target(name, capsule, platform=platform)
                _registered[(name, platform)] = str(lib)
            names.append(name)
    return names


def cancel_kernels(on: bool) -> None:
    """Set (stop the running kernels of every loaded library at their next work item; their
    calls fail with "interrupted") or clear the libraries' cancel flag."""
    for module in list(_loaded_modules.values()):
        if hasattr(module, "cancel"):  # libraries built before the flag existed have none
            module.cancel(on)


def library_platform(path: str | pathlib.Path) -> str:
    """The JAX platform ("cpu", "cuda") a built library's handlers run on."""
    return targets.lookup(_resolve(path)[1]["target"]).jax_platforms[0]


def ensure(specs: list[KernelSpec]) -> None:
    """Build (through the cache) and register whatever of `specs` is not registered yet."""
    missing = [s for s in specs
               if any((s.target_name(d), s.platform) not in _registered for d in s.directions)]
    if missing:
        load(build(missing).path)


