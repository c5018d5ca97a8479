"""Build a set of KernelSpecs into one shared library, through the content cache (cache.py).

Keys are computed without running any compiler: a library's key covers its rendered sources,
flags, the compiler the environment asks for (CXX/NVCC, resolved to its file on PATH), the FFI
headers, Python and the host ISA, so a cached hit needs no compiler. An object's key adds the
compiler's version (compiling needs the compiler anyway). A spec is also served from any cached
library that holds it, built with the same toolchain (any toolchain, on a host without one).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import shutil
import sysconfig
import time
from typing import Callable, Iterable

from flashgen import cache, codegen, resources, targets, toolchain
from flashgen.cache import MANIFEST
from flashgen.contract import ATTRIBUTE_TYPES, DIRECTIONS, FP8_CALLS, FP8_DTYPES, signature
from flashgen.spec import KernelSpec
from flashgen.errors import BuildError

__all__ = ["build", "Library", "BuildError", "cache_root", "resolve_target"]

Progress = Callable[[str], None]
log = logging.getLogger("flashgen.build")
EMULATION_RUNTIME_DIR = "flashgen/emulate"  # under csrc/: flashgen.emulate's CUDA runtime and FFI host
HOST_CALL_HEADER = "flashgen/host_call.h"  # under csrc/: the call frame of the emulator's and the NIF's hosts
cache_root = cache.root
# Seconds between "still compiling" lines during a cold compile.
HEARTBEAT_SECONDS = 10.0


@dataclasses.dataclass(frozen=True)
class Library:
    path: pathlib.Path           # the shared library
    manifest_path: pathlib.Path
    manifest: dict
    cache_hit: bool

    @property
    def specs(self) -> list[KernelSpec]:
        return [KernelSpec.from_json(s) for s in self.manifest["specs"]]


def resolve_target(target: str | None) -> tuple[str, str]:
    """(target, why) for 'auto' or None: the local GPU's arch, else cpu."""
    if target not in (None, "auto"):
        return target, "requested"
    gpu = targets.local("cuda")
    if gpu:
        return gpu.name, f"auto: local GPU is {gpu.name}"
    return targets.local("cpu").name, "auto: no supported NVIDIA GPU found, using the CPU backend"


def _digest(*parts: object) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True).encode() if not isinstance(p, bytes) else p)
        h.update(b"\0")
    return h.hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class _Job:
    source: codegen.Source
    compiler: str              # "cxx" or "nvcc" (toolchain.compiler)
    flags: tuple[str, ...]
    extra: str | None          # what else the object depends on: host ISA, Python
    key: str                   # everything but the compiler's version


def _job(source: codegen.Source, target: str, env_key: dict) -> _Job:
    if source.name == "python_face.cc":
        compiler, flags, extra = "cxx", toolchain.python_face_flags(), toolchain.python_identity()
    elif source.name == "nif_face.cc":
        compiler, flags, extra = "cxx", toolchain.nif_face_flags(), [toolchain.host_isa(), toolchain.erts_include()]
    elif source.language == "cuda":
        compiler, flags, extra = "nvcc", toolchain.cuda_compile_flags(target), None
    else:
        compiler, flags, extra = "cxx", toolchain.cpu_compile_flags(), toolchain.host_isa()
    key = _digest(source.text, source.language, toolchain.requested(compiler),
                  flags, extra, env_key, "keeps-ptx" if source.language == "cuda" else None)
    return _Job(source, compiler, tuple(flags), extra, key)


def ptx_of(obj: pathlib.Path) -> pathlib.Path:
    """The PTX kept beside a cached CUDA object: what ptxas compiled, what flashgen.emulate runs."""
    return obj.with_suffix(".ptx")


def _object_key(job: _Job) -> str:
    return _digest(job.key, toolchain.compiler_version(toolchain.compiler(job.compiler).exe))


def _compile(job: _Job, root: pathlib.Path, src_dir: pathlib.Path, group: toolchain.ProcessGroup,
             pins: cache.Pins, say: Progress) -> tuple[pathlib.Path, bool]:
    """Compile one source into the object cache; returns (object, was_cached), the object
    pinned (a shared lock in `pins`) so that no `cache clean` removes it before the link.
    A CUDA compile keeps its PTX (nvcc --keep) beside the object, recorded with it."""
    key = _object_key(job)
    companions = (".ptx",) if job.source.language == "cuda" else ()
    pin = pins.try_pin(key)  # None while another build compiles it: wait below, saying so
    if pin is not None:
        obj = cache.lookup_object(root, key, companions=companions)
        if obj:
            return obj, True
        pins.release(pin)
    with cache.locked(root, key, f"compiling {job.source.name}", say, HEARTBEAT_SECONDS) as lock:
        obj = cache.lookup_object(root, key, companions=companions)
        was_cached = obj is not None
        if not was_cached:
            obj = _compile_locked(job, root, key, src_dir, group)
        pins.keep(lock)
        return obj, was_cached


def _compile_locked(job: _Job, root: pathlib.Path, key: str, src_dir: pathlib.Path,
                    group: toolchain.ProcessGroup) -> pathlib.Path:
    tmp = cache.temp_path(root / "objects", key, ".o")
    keep = cache.staging_dir(root / "objects", key) if job.source.language == "cuda" else None
    try:
        compiler = toolchain.compiler(job.compiler)
        keep_flags = ["--keep", "--keep-dir", str(keep)] if keep else []
        toolchain.run([*compiler.command, *job.flags, *keep_flags, "-c", str(src_dir / job.source.name),
                       "-o", str(tmp)], f"compiling {job.source.name}", group, nvcc_tmpdir=keep)
        companions = {}
        if keep:
            ptx = sorted(keep.glob("*.ptx"))
            if len(ptx) != 1:
                raise BuildError(f"compiling {job.source.name}: expected one kept PTX file, "
                                 f"found {[p.name for p in ptx]}")
            companions[".ptx"] = ptx[0]
        try:
            return cache.store_object(root, key, tmp, companions=companions)
        except cache.CorruptEntry as e:
            raise BuildError(f"compiling {job.source.name}: {e}") from None
    finally:
        tmp.unlink(missing_ok=True)
        if keep:
            shutil.rmtree(keep, ignore_errors=True)


def _library_info(specs: list[KernelSpec], target: str) -> dict:
    return {
        "target": target,
        "specs": [s.to_json() for s in specs],
        "attributes": ATTRIBUTE_TYPES,
        "ffi_api_version": toolchain.ffi_headers()["api_version"],
    }


HOSTS = ("python", "exla", "c", "nif", "emulate")
LIBRARY_PREFIX = "_flashgen_"  # every library file's name starts so: _flashgen_<target>_<key>.so


def build(specs: Iterable[KernelSpec] | KernelSpec, target: str | None = None, *,
          out: str | os.PathLike | None = None, jobs: int | None = None,
          host: str = "python", progress: Progress | None = None) -> Library:
    """Render, compile and link `specs` into one library for one target.

    `target` overrides every spec's target ('auto' or None: the specs' own,
    which must agree). `host` picks the library's extra face: "python" (a
    pybind11 module for jax.ffi.register_ffi_target), "exla" (static
    XLA_FFI_REGISTER_HANDLER registration on load, no Python), "c" (plain C
    symbols only), "nif" (an erl_nif library of module Elixir.FlashGen.NIF calling the
    handlers: examples/elixir), "emulate" (CUDA targets: plain C symbols, the CUDA runtime left
    undefined for flashgen.emulate's stand-in, each source's PTX under ptx/). Returns the cached Library; with `out`, the library and its
    manifest are also copied there. `progress` receives one line per step of a
    cold build (default: the "flashgen.build" logger at INFO).
    """
    if host not in HOSTS:
        raise ValueError(f"unsupported host {host!r}: choose one of {', '.join(HOSTS)}")
    if jobs is not None and jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    specs = [specs] if isinstance(specs, KernelSpec) else list(specs)
    if not specs:
        raise ValueError("build needs at least one KernelSpec")
    if target not in (None, "auto"):
        specs = [dataclasses.replace(s, target=target) for s in specs]
    names = {s.target for s in specs}
    if len(names) != 1:
        raise ValueError(f"one library serves one target; got specs for {sorted(names)}")
    (target,) = names
    row = targets.lookup(target)
    if host == "emulate" and row.on_host:
        raise ValueError(f"host 'emulate' runs CUDA targets ({', '.join(targets.emulated())}) on the CPU; "
                         f"a {target} library runs natively")
    specs = sorted(set(specs))
    say = progress or log.info

    t0 = time.perf_counter()
    root = cache.root()
    for stale in cache.clean_stale(root):
        log.debug("removed %s (left by an interrupted build)", stale)
    ffi = toolchain.ffi_headers()
    env_key = {"csrc": resources.tree_digest(resources.csrc_dir(), skip=(EMULATION_RUNTIME_DIR,)),
               "ffi": ffi["sha256"],
               "jaxlib": ffi["jaxlib"]}
    info = _library_info(specs, target)
    compile_jobs = [_job(s, target, env_key) for s in codegen.render_library(specs, info)]
    if host == "exla":
        compile_jobs.append(_job(codegen.render_static_registration(specs), target, env_key))
    if host == "nif":
        if not row.on_host:
            raise ValueError("host 'nif' calls the CPU kernels; build it with target cpu")
        compile_jobs.append(_job(codegen.render_nif_face(), target, env_key))
    # The library's file and Python module are named after its C sources. The Python face is
    # one object per toolchain (its module init is named PyInit_FACE_INIT); the link gives it
    # the library's module name as well.
    module_name = f"{LIBRARY_PREFIX}{target}_{_digest([j.key for j in compile_jobs])[:16]}"
    linker = row.compiler
    link_flags = ["-shared", *row.link_flags]
    if host == "emulate":  # cudart_emu.cc, loaded first by flashgen.emulate, is the runtime
        link_flags += ["-cudart", "none"]
    if host == "python":
        compile_jobs.append(_job(codegen.render_python_face(), target, env_key))
    toolchains = {kind: toolchain.requested(kind) for kind in {j.compiler for j in compile_jobs} | {linker}}
    serves = _serves(compile_jobs, target, host, link_flags, env_key, toolchains)
    if host == "python":
        alias = f"--defsym=PyInit_{module_name}=PyInit_{codegen.FACE_INIT}"
        link_flags += ["-Xlinker", alias] if linker == "nvcc" else [f"-Wl,{alias}"]
    lib_key = _digest([j.key for j in compile_jobs], toolchains[linker], link_flags, host)
    lib_dir = root / "libs" / lib_key
    lib_name = f"{module_name}.so"

    def finish(directory: pathlib.Path, manifest: dict, hit: bool) -> Library:
        lib = Library(directory / manifest["flashgen_library"], directory / MANIFEST, manifest, hit)
        if out is not None:
            lib = _export(lib, pathlib.Path(out))
        return lib

    def cached() -> tuple[pathlib.Path, dict] | None:
        if lib_dir.exists():
            try:
                return lib_dir, cache.verify_library(lib_dir)
            except cache.CorruptEntry as e:
                log.warning("cache entry %s is damaged (%s); rebuilding it", lib_dir, e)
        # Without one of its compilers this host cannot build: any toolchain's library serves.
        return _holding(root, specs, *(("toolchain", serves[0]) if all(toolchains.values())
                                       else ("any_toolchain", serves[1])))

    hit = cached()
    if hit:
        log.debug("cache hit: %s", hit[0])
        return finish(*hit, True)
    with cache.locked(root, lib_key, f"building {', '.join(s.stem for s in specs)} for {target}",
                      say, HEARTBEAT_SECONDS):
        hit = cached()
        if hit:
            return finish(*hit, True)
        if linker == "nvcc":  # checked before any work; toolchain.run checks every argument
            toolchain.check_shell_safe(root, "the cache directory")
        cache.discard(lib_dir)  # a damaged entry (absent: nothing to do)
        staging = cache.staging_dir(root / "libs", lib_key)
        try:
            src_dir = staging / "src"
            src_dir.mkdir()
            for j in compile_jobs:
                (src_dir / j.source.name).write_text(j.source.text)
            say(f"compiling {', '.join(s.stem for s in specs)} for {target} "
                f"({len(compile_jobs)} sources; first use of this build, cached afterwards)")
            with toolchain.ProcessGroup() as group, cache.Pins(root) as pins:
                objects = _compile_all(compile_jobs, root, src_dir, jobs, say, group, pins)
                link = toolchain.compiler(linker)
                toolchain.run([*link.command, *link_flags, *map(str, objects), "-o",
                               str(staging / lib_name)], f"linking {lib_name}", group,
                              nvcc_tmpdir=staging if linker == "nvcc" else None)
                files = {lib_name: cache.file_record(staging / lib_name)}
                if host == "emulate":
                    (staging / "ptx").mkdir()
                    for j, obj in zip(compile_jobs, objects):
                        if j.source.language == "cuda":
                            name = f"ptx/{pathlib.Path(j.source.name).stem}.ptx"
                            shutil.copyfile(ptx_of(obj), staging / name)
                            files[name] = cache.file_record(staging / name)
            compilers = {toolchain.compiler(c) for c in {j.compiler for j in compile_jobs} | {linker}}
            manifest = {
                "flashgen_library": lib_name,
                **info,
                "platform": specs[0].platform,
                "signatures": {d: signature(d) for d in DIRECTIONS},
                **({"fp8_signatures": {d: signature(d, t) for t in FP8_DTYPES for d in FP8_CALLS}}
                   if any(s.dtype in FP8_DTYPES for s in specs) else {}),
                "host": host,
                "python_face": host == "python",
                "python": toolchain.python_identity() if host == "python" else None,
                "python_module": module_name if host == "python" else None,
                "undefined_symbols": (["XLA_FFI_GetApi"] if host == "exla" else
                                      ["enif_* (the BEAM's erl_nif)"] if host == "nif" else
                                      ["the CUDA runtime (flashgen.emulate)"] if host == "emulate" else []),
                "ptx": sorted(n for n in files if n.startswith("ptx/")),
                "compilers": {c.name: toolchain.compiler_version(c.exe) for c in compilers},
                "compiler_paths": toolchains,
                "cleared_environment": list(toolchain.CLEARED_ENV),
                "flags": {j.source.name: list(j.flags) for j in compile_jobs},
                "link_flags": link_flags,
                "objects": {j.source.name: o.stem for j, o in zip(compile_jobs, objects)},
                "host_isa": toolchain.host_isa() if row.on_host else None,
                "cpu_isa": list(toolchain.cpu_isa()) if row.on_host else None,
                "ffi_headers": {k: v for k, v in ffi.items() if k != "include_dir"},
                "cache_key": lib_key,
                "serves": {"toolchain": serves[0], "any_toolchain": serves[1]},
                "files": files,
                "build_seconds": round(time.perf_counter() - t0, 3),
            }
            (staging / MANIFEST).write_text(cache.seal(manifest))
            os.replace(staging, lib_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    say(f"built {lib_dir / lib_name} in {time.perf_counter() - t0:.1f}s")
    return finish(lib_dir, cache.verify_library(lib_dir), False)


def _serves(compile_jobs: list[_Job], target: str, host: str, link_flags: list[str],
            env_key: dict, toolchains: dict) -> tuple[str, str]:
    """What a library is interchangeable on, whatever its specs: (with its toolchain, with any
    toolchain). A library holding a spec serves it wherever these agree: its sources for that
    spec come from the same templates, headers and flags."""
    kinds = sorted({json.dumps([j.compiler, j.source.language, j.flags, j.extra]) for j in compile_jobs})
    context = _digest(resources.tree_digest(resources.templates_dir()), env_key, target, host,
                      link_flags, kinds, ATTRIBUTE_TYPES)
    return _digest(context, toolchains), context


def _holding(root: pathlib.Path, specs: list[KernelSpec], field: str,
             value: str) -> tuple[pathlib.Path, dict] | None:
    """The smallest intact cached library whose manifest's `serves[field]` is `value` and
    which holds every one of `specs`."""
    wanted = [s.to_json() for s in specs]
    found = []
    libs = root / "libs"
    for d in libs.iterdir() if libs.is_dir() else ():
        if d.name.startswith(cache.STAGING_PREFIX):
            continue
        try:
            manifest = cache.read_manifest(d / MANIFEST)
        except cache.CorruptEntry:
            continue
        if (manifest.get("serves") or {}).get(field) == value and \
                all(w in manifest["specs"] for w in wanted):
            found.append((len(manifest["specs"]), d.name, d))
    for _, _, d in sorted(found):
        try:
            return d, cache.verify_library(d)
        except cache.CorruptEntry:
            continue
    return None


def _compile_all(compile_jobs: list[_Job], root: pathlib.Path, src_dir: pathlib.Path, jobs: int | None,
                 say: Progress, group: toolchain.ProcessGroup, pins: cache.Pins) -> list[pathlib.Path]:
    """Compile in parallel, reporting each finished source and, every HEARTBEAT_SECONDS, which
    are still compiling: a cold compile takes seconds to minutes and must not look hung."""
    n = len(compile_jobs)
    workers = max(1, min(jobs or os.cpu_count() or 1, n))
    objects: dict[str, pathlib.Path] = {}  # job key -> object
    started: dict[str, float] = {}
    t0 = time.perf_counter()

    def compile_one(job: _Job):
        started[job.source.name] = time.perf_counter()
        return _compile(job, root, src_dir, group, pins, say)

    pool = concurrent.futures.ThreadPoolExecutor(workers)
    try:
        pending = {pool.submit(compile_one, j): j for j in compile_jobs}
        done_count = 0
        while pending:
            done, _ = concurrent.futures.wait(pending, timeout=HEARTBEAT_SECONDS,
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            if not done:
                running = [j.source.name for j in pending.values() if j.source.name in started]
                say(f"still compiling {', '.join(running) or '...'} "
                    f"({time.perf_counter() - t0:.0f}s elapsed)")
            for fut in done:
                job = pending.pop(fut)
                obj, hit = fut.result()
                objects[job.key] = obj
                done_count += 1
                seconds = time.perf_counter() - started[job.source.name]
                say(f"[{done_count}/{n}] {job.source.name}: "
                    + ("cached" if hit else f"compiled in {seconds:.1f}s"))
    except BaseException:
        group.close()  # stop the compiles still running instead of waiting for them
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return [objects[j.key] for j in compile_jobs]


def _export(lib: Library, out: pathlib.Path) -> Library:
    """Copy the library, every file its manifest records (an emulated library's PTX) and the
    manifest into `out` (files get the umask's modes: a library shipped to another user stays
    readable)."""
    from flashgen import output_files
    names = [*lib.manifest["files"], MANIFEST]
    for name in names:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
    sources = [lib.manifest_path.parent / name for name in names]
    files = output_files.check([("--out", str(out / name)) for name in names], inputs=[str(s) for s in sources])
    for src, dst in zip(sources, files):
        dst.write(src.read_bytes())
    return dataclasses.replace(lib, path=out / lib.path.name, manifest_path=out / MANIFEST)


def emulation_runtime() -> pathlib.Path:
    """libflashgen_emu (csrc/flashgen/emulate: the stand-in CUDA runtime and XLA FFI host
    under which flashgen.emulate runs a library built with host="emulate"), cached by content
    and verified like an object."""
    src_dir = resources.csrc_dir() / EMULATION_RUNTIME_DIR
    flags = ["-std=c++17", "-O2", "-shared", "-Xcompiler", "-fPIC", "-cudart", "none",
             "-I", str(resources.csrc_dir()), "-I", toolchain.ffi_headers()["include_dir"]]
    # its call frame comes from csrc/flashgen/host_call.h, outside src_dir
    return _emulator_object("nvcc", flags, sorted(src_dir.glob("*.cc")), "libflashgen_emu.so", "the emulation runtime",
                            (resources.csrc_dir() / HOST_CALL_HEADER).read_bytes())


def emulation_native() -> pathlib.Path:
    """flashgen.emulate's native module (csrc/flashgen/emulate/native: the C helpers its memory
    and mma.sync semantics call per instruction, as a CPython extension), cached by content and
    the Python it was built for."""
    src_dir = resources.csrc_dir() / EMULATION_RUNTIME_DIR / "native"
    flags = ["-std=c++17", "-O2", "-shared", "-fPIC", "-I", str(resources.csrc_dir()),
             "-I", sysconfig.get_paths()["include"]]
    return _emulator_object("cxx", flags, sorted(src_dir.glob("*.cc")), "flashgen_emu_native.so",
                            "the emulator's native module", sysconfig.get_config_var("EXT_SUFFIX").encode())


def _emulator_object(compiler: str, flags: list[str], sources: list[pathlib.Path], name: str, what: str,
                     extra: bytes) -> pathlib.Path:
    """One shared object of the emulator built from `sources` by `compiler`, cached under the
    digest of csrc/flashgen/emulate, the compiler, its flags and `extra`."""
    root = cache.root()
    cc = toolchain.compiler(compiler)
    key = _digest(resources.tree_digest(resources.csrc_dir() / EMULATION_RUNTIME_DIR), extra,
                  toolchain.requested(compiler), toolchain.compiler_version(cc.exe), flags, name)
    lib = cache.lookup_object(root, key, "runtime")
    if lib:
        return lib
    with cache.locked(root, key, f"building {what}", log.info, HEARTBEAT_SECONDS):
        lib = cache.lookup_object(root, key, "runtime")
        if lib:
            return lib
        toolchain.check_shell_safe(root, "the cache directory")
        staging = cache.staging_dir(root / "runtime", key)
        try:
            tmp = staging / name
            with toolchain.ProcessGroup() as group:  # the compiler dies with us, kill -9 included
                toolchain.run([*cc.command, *flags, *map(str, sources), "-o", str(tmp)], f"building {what}", group,
                              nvcc_tmpdir=staging if compiler == "nvcc" else None)
            try:
                return cache.store_object(root, key, tmp, "runtime")
            except cache.CorruptEntry as e:
                raise BuildError(f"building {what}: {e}") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
