"""Build a set of KernelSpecs into one shared library, through a content cache.

Cache layout (root: $FLASHGEN_CACHE_DIR, else $XDG_CACHE_HOME/flashgen, else
~/.cache/flashgen):

    objects/<key>.o          one compiled source; key = its text, compiler,
                             compiler version, flags, csrc/ and FFI headers
    libs/<key>/              one library: lib*.so, manifest.json, src/
    locks/<key>.lock         fcntl locks so that concurrent builds of the
                             same thing compile it once

Entries appear atomically (os.replace of a finished file or directory), so
a crash or a concurrent reader never sees a half-written entry.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
import time
from typing import Callable, Iterable

from flashgen import codegen, resources, toolchain
from flashgen.spec import ATTRIBUTES, SIGNATURES, KernelSpec
from flashgen.errors import BuildError

__all__ = ["build", "Library", "BuildError", "cache_root", "resolve_target"]

MANIFEST = "manifest.json"
Progress = Callable[[str], None]


def cache_root() -> pathlib.Path:
    env = os.environ.get("FLASHGEN_CACHE_DIR")
    if env:
        return pathlib.Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (pathlib.Path(xdg) if xdg else pathlib.Path.home() / ".cache") / "flashgen"


@dataclasses.dataclass(frozen=True)
class Library:
    path: pathlib.Path           # the shared library
    manifest_path: pathlib.Path
    manifest: dict
    cache_hit: bool

    @property
    def specs(self) -> list[KernelSpec]:
        return [KernelSpec(s["head_dim"], s["dtype"], s["causal"], s["target"])
                for s in self.manifest["specs"]]


def resolve_target(target: str | None) -> tuple[str, str]:
    """(target, why) for 'auto' or None: the local GPU's arch, else cpu."""
    if target not in (None, "auto"):
        return target, "requested"
    gpu = toolchain.detect_gpu_target()
    if gpu:
        return gpu, f"auto: local GPU is {gpu}"
    return "cpu", "auto: no supported NVIDIA GPU found, using the CPU backend"


@contextlib.contextmanager
def _locked(root: pathlib.Path, key: str):
    locks = root / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{key}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _digest(*parts: object) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True).encode() if not isinstance(p, bytes) else p)
        h.update(b"\0")
    return h.hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class _Job:
    source: codegen.Source
    compiler: str
    flags: tuple[str, ...]
    key: str


def _job(source: codegen.Source, target: str, env_key: dict) -> _Job:
    if source.name == "python_face.cc":
        compiler, flags, extra = toolchain.cxx(), toolchain.python_face_flags(), toolchain.python_identity()
    elif source.language == "cuda":
        compiler, flags, extra = toolchain.nvcc(), toolchain.cuda_compile_flags(target), None
    else:
        compiler = toolchain.cxx()
        flags, extra = toolchain.cpu_compile_flags(), toolchain.host_isa()
    key = _digest(source.text, source.language, compiler, toolchain.compiler_version(compiler),
                  flags, extra, env_key)
    return _Job(source, compiler, tuple(flags), key)


def _compile(job: _Job, root: pathlib.Path, src_dir: pathlib.Path) -> tuple[pathlib.Path, bool]:
    """Compile one source into the object cache; returns (object, was_cached)."""
    obj = root / "objects" / f"{job.key}.o"
    if obj.exists():
        return obj, True
    with _locked(root, job.key):
        if obj.exists():
            return obj, True
        obj.parent.mkdir(parents=True, exist_ok=True)
        src = src_dir / job.source.name
        fd, tmp = tempfile.mkstemp(dir=obj.parent, suffix=".o.tmp")
        os.close(fd)
        try:
            toolchain.run([job.compiler, *job.flags, "-c", str(src), "-o", tmp],
                          f"compiling {job.source.name}")
            os.replace(tmp, obj)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return obj, False


def _library_info(specs: list[KernelSpec], target: str) -> dict:
    return {
        "target": target,
        "specs": [s.to_json() for s in specs],
        "attributes": ATTRIBUTES,
        "ffi_api_version": toolchain.ffi_headers()["api_version"],
    }


HOSTS = ("python", "exla", "c")


def build(specs: Iterable[KernelSpec] | KernelSpec, target: str | None = None, *,
          out: str | os.PathLike | None = None, jobs: int | None = None,
          host: str = "python", progress: Progress | None = None) -> Library:
    """Render, compile and link `specs` into one library for one target.

    `target` overrides every spec's target ('auto' or None: the specs' own,
    which must agree). `host` picks the library's extra face: "python" (a
    pybind11 module for jax.ffi.register_ffi_target), "exla" (static
    XLA_FFI_REGISTER_HANDLER registration on load, no Python), "c" (plain C
    symbols only). Returns the cached Library; with `out`, the library and its
    manifest are also copied there.
    """
    if host not in HOSTS:
        raise ValueError(f"unsupported host {host!r}: choose one of {', '.join(HOSTS)}")
    specs = [specs] if isinstance(specs, KernelSpec) else list(specs)
    if not specs:
        raise ValueError("build needs at least one KernelSpec")
    if target not in (None, "auto"):
        specs = [dataclasses.replace(s, target=target) for s in specs]
    targets = {s.target for s in specs}
    if len(targets) != 1:
        raise ValueError(f"one library serves one target; got specs for {sorted(targets)}")
    (target,) = targets
    specs = sorted(set(specs))
    say = progress or (lambda _msg: None)

    t0 = time.perf_counter()
    root = cache_root()
    ffi = toolchain.ffi_headers()
    env_key = {"csrc": resources.tree_digest(resources.csrc_dir()), "ffi": ffi["sha256"],
               "jaxlib": ffi["jaxlib"]}
    info = _library_info(specs, target)
    compile_jobs = [_job(s, target, env_key) for s in codegen.render_library(specs, info)]
    if host == "exla":
        compile_jobs.append(_job(codegen.render_static_registration(specs), target, env_key))
    # The library's file and Python module are named after its C sources, so the
    # Python face (which must know its module name) can join the key.
    module_name = f"_flashgen_{target}_{_digest([j.key for j in compile_jobs])[:16]}"
    if host == "python":
        compile_jobs.append(_job(codegen.render_python_face(module_name), target, env_key))
    linker = toolchain.nvcc() if target != "cpu" else toolchain.cxx()
    link_flags = ["-shared"] + (["-pthread"] if target == "cpu" else [])
    lib_key = _digest([j.key for j in compile_jobs], linker, toolchain.compiler_version(linker),
                      link_flags)
    lib_dir = root / "libs" / lib_key
    lib_name = f"{module_name}.so"

    def finish(hit: bool) -> Library:
        manifest = json.loads((lib_dir / MANIFEST).read_text())
        lib = Library(lib_dir / lib_name, lib_dir / MANIFEST, manifest, hit)
        if out is not None:
            lib = _export(lib, pathlib.Path(out))
        return lib

    if (lib_dir / MANIFEST).exists():
        say(f"cache hit: {lib_dir / lib_name}")
        return finish(True)
    with _locked(root, lib_key):
        if (lib_dir / MANIFEST).exists():
            return finish(True)
        staging = pathlib.Path(tempfile.mkdtemp(prefix=".tmp-", dir=_mkdir(root / "libs")))
        try:
            src_dir = _mkdir(staging / "src")
            for j in compile_jobs:
                (src_dir / j.source.name).write_text(j.source.text)
            objects = _compile_all(compile_jobs, root, src_dir, jobs, say)
            toolchain.run([linker, *link_flags, *map(str, objects), "-o", str(staging / lib_name)],
                          f"linking {lib_name}")
            manifest = {
                "flashgen_library": lib_name,
                **info,
                "platform": specs[0].platform,
                "signatures": SIGNATURES,
                "host": host,
                "python_face": host == "python",
                "python": toolchain.python_identity() if host == "python" else None,
                "python_module": module_name if host == "python" else None,
                "undefined_symbols": ["XLA_FFI_GetApi"] if host == "exla" else [],
                "compilers": {os.path.basename(c): toolchain.compiler_version(c)
                              for c in {j.compiler for j in compile_jobs} | {linker}},
                "flags": {j.source.name: list(j.flags) for j in compile_jobs},
                "host_isa": toolchain.host_isa() if target == "cpu" else None,
                "ffi_headers": {k: v for k, v in ffi.items() if k != "include_dir"},
                "cache_key": lib_key,
                "build_seconds": round(time.perf_counter() - t0, 3),
            }
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            os.replace(staging, lib_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    say(f"built {lib_dir / lib_name} in {time.perf_counter() - t0:.1f}s")
    return finish(False)


def _mkdir(p: pathlib.Path) -> pathlib.Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def _compile_all(compile_jobs: list[_Job], root: pathlib.Path, src_dir: pathlib.Path,
                 jobs: int | None, say: Progress) -> list[pathlib.Path]:
    n = len(compile_jobs)
    workers = max(1, min(jobs or os.cpu_count() or 1, n))
    objects: dict[str, pathlib.Path] = {}
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        started = {pool.submit(_timed_compile, j, root, src_dir): j for j in compile_jobs}
        for done, fut in enumerate(concurrent.futures.as_completed(started), 1):
            job = started[fut]
            obj, hit, seconds = fut.result()
            objects[job.key] = obj
            say(f"[{done}/{n}] {job.source.name}: " + ("cached" if hit else f"compiled in {seconds:.1f}s"))
    return [objects[j.key] for j in compile_jobs]


def _timed_compile(job: _Job, root: pathlib.Path, src_dir: pathlib.Path):
    t = time.perf_counter()
    obj, hit = _compile(job, root, src_dir)
    return obj, hit, time.perf_counter() - t


def _export(lib: Library, out: pathlib.Path) -> Library:
    out.mkdir(parents=True, exist_ok=True)
    for src, name in ((lib.path, lib.path.name), (lib.manifest_path, MANIFEST)):
        fd, tmp = tempfile.mkstemp(dir=out, prefix=".tmp-")
        os.close(fd)
        shutil.copyfile(src, tmp)
        os.replace(tmp, out / name)
    return dataclasses.replace(lib, path=out / lib.path.name, manifest_path=out / MANIFEST)
