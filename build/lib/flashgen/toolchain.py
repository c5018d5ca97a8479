"""Compilers and the flags flashgen builds with.

Every compiler is invoked with an argument list (never a shell), and every
fact that changes the produced binary (compiler version, flags, host ISA,
FFI headers, Python for the Python face) is reported here so that the cache
key and the manifest can record it.
"""
from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig

from flashgen import resources
from flashgen.errors import BuildError

CUDA_ARCH_FLAGS = {
    # PTX alongside the sm_80 SASS lets the Ampere build JIT onto newer GPUs.
    "sm80": ["-gencode", "arch=compute_80,code=[sm_80,compute_80]"],
    "sm90a": ["-gencode", "arch=compute_90a,code=sm_90a"],
}


def _which(env_var: str, names: tuple[str, ...], extra: tuple[str, ...] = ()) -> str | None:
    explicit = os.environ.get(env_var)
    if explicit:
        found = shutil.which(explicit)
        if not found:
            raise BuildError(f"{env_var}={explicit!r} is not an executable")
        return found
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    for path in extra:
        if os.access(path, os.X_OK):
            return path
    return None


@functools.cache
def cxx() -> str:
    found = _which("CXX", ("c++", "g++", "clang++"))
    if not found:
        raise BuildError("no C++ compiler found: install g++ (or clang++) or set CXX")
    return found


@functools.cache
def nvcc() -> str:
    found = _which("NVCC", ("nvcc",), ("/usr/local/cuda/bin/nvcc",))
    if not found:
        raise BuildError("nvcc not found: install the CUDA toolkit, put nvcc on PATH or set NVCC "
                         "(or build for --target cpu)")
    return found


@functools.cache
def compiler_version(exe: str) -> str:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise BuildError(f"cannot run {exe}: {e}") from e
    lines = [l for l in out.stdout.splitlines() if l.strip()]
    if out.returncode != 0 or not lines:
        raise BuildError(f"{exe} --version failed: {out.stderr.strip()}")
    # nvcc puts its release on the last line, gcc/clang on the first.
    return lines[-1] if "cuda" in lines[-1].lower() else lines[0]


@functools.cache
def host_isa() -> str:
    """A digest of the CPU features -march=native compiles for."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    lines = sorted({l.split(":", 1)[1].strip() for l in text.splitlines()
                    if l.startswith(("flags", "model name", "Features", "CPU part"))})
    import platform
    return hashlib.sha256("\n".join([platform.machine(), *lines]).encode()).hexdigest()[:16]


@functools.cache
def ffi_headers() -> dict:
    """The XLA FFI headers flashgen compiles against, and their identity."""
    try:
        import jax.ffi
        import jaxlib
    except ImportError as e:
        raise BuildError(f"jax is needed for the XLA FFI headers: {e}") from e
    include = pathlib.Path(jax.ffi.include_dir())
    api = include / "xla" / "ffi" / "api"
    if not (api / "ffi.h").is_file():
        raise BuildError(f"XLA FFI headers missing under {include}")
    text = (api / "c_api.h").read_text()
    major = minor = "?"
    for line in text.splitlines():
        if line.startswith("#define XLA_FFI_API_MAJOR"):
            major = line.split()[-1]
        elif line.startswith("#define XLA_FFI_API_MINOR"):
            minor = line.split()[-1]
    return {
        "include_dir": str(include),
        "api_version": f"{major}.{minor}",
        "jaxlib": jaxlib.__version__,
        "sha256": resources.tree_digest(api),
    }


def _includes() -> list[str]:
    return ["-I", str(resources.csrc_dir()), "-I", ffi_headers()["include_dir"]]


def cpu_compile_flags() -> list[str]:
    return ["-std=c++17", "-O3", "-march=native", "-fPIC", "-pthread", *_includes()]


def cuda_compile_flags(arch: str) -> list[str]:
    return ["-std=c++17", "-O3", "-Xcompiler", "-fPIC", *CUDA_ARCH_FLAGS[arch],
            "-Xptxas", "-warn-spills", *_includes()]


def python_face_flags() -> list[str]:
    import pybind11
    return ["-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden",
            "-I", pybind11.get_include(), "-I", sysconfig.get_paths()["include"], *_includes()]


def python_identity() -> str:
    import pybind11
    return f"cpython-{sys.version_info.major}.{sys.version_info.minor}/pybind11-{pybind11.__version__}"


def run(cmd: list[str], what: str) -> None:
    """Run a compiler; on failure raise BuildError carrying the compiler's own message."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise BuildError(f"{what}: cannot run {cmd[0]}: {e}") from e
    if out.returncode != 0:
        msg = (out.stderr or out.stdout).strip().splitlines()
        tail = "\n".join(msg[-40:])
        raise BuildError(f"{what} failed (exit {out.returncode}):\n{tail}")


def detect_gpu_target() -> str | None:
    """sm90a / sm80 for the local GPU, None without one."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    caps = [l.strip() for l in out.stdout.splitlines() if l.strip()]
    if out.returncode != 0 or not caps:
        return None
    major = int(caps[0].split(".")[0])
    if major >= 9:
        return "sm90a" if caps[0].startswith("9.") else "sm80"
    return "sm80" if major == 8 else None
