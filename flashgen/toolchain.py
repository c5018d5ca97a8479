"""Compilers and the flags flashgen builds with.

Every compiler is invoked with an argument list (never a shell), and every
fact that changes the produced binary (compiler version, flags, host ISA,
FFI headers, Python for the Python face) is reported here so that the cache
key and the manifest can record it.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig

from flashgen import resources, targets
from flashgen.errors import BuildError

@dataclasses.dataclass(frozen=True)
class Compiler:
    """A compiler as CXX/NVCC name it: launchers (ccache, sccache, distcc), which run the compiler
    and change nothing it produces, then the compiler, then options that were part of the setting."""
    launcher: tuple[str, ...]
    exe: str                     # the compiler itself, resolved on PATH
    options: tuple[str, ...]

    @property
    def command(self) -> list[str]:
        return [*self.launcher, self.exe, *self.options]

    @property
    def name(self) -> str:
        return os.path.basename(self.exe)


_COMPILERS = {
    # kind: env var, names looked up on PATH, fallback paths, what to say when none is found
    "cxx": ("CXX", ("c++", "g++", "clang++"), (),
            "no C++ compiler found: install g++ (or clang++) or set CXX"),
    "nvcc": ("NVCC", ("nvcc",), ("/usr/local/cuda/bin/nvcc",),
             "nvcc not found: install the CUDA toolkit, put nvcc on PATH or set NVCC "
             "(or build for --target cpu)"),
}


def requested(kind: str) -> str | None:
    """The "cxx"/"nvcc" compiler the environment asks for, as the cache keys it: the file it
    resolves to on PATH (symbolic links followed), so that CXX=g++ and CXX=/usr/bin/g++ share
    entries; None when it is not installed (a serving host, which only looks up). Found without
    running anything, so that finding a cached library needs no compiler. A launcher is left out
    (it changes nothing in the output); so is the version (a compiler upgraded in place does not
    invalidate what the old one built; the manifest records which compiler built it)."""
    _, word, options = _spelled(kind)
    exe = shutil.which(word) if word else _default(kind)
    return shlex.join([os.path.realpath(exe), *options]) if exe else None


def _spelled(kind: str) -> tuple[list[str], str | None, list[str]]:
    """(launcher, compiler, options) as CXX/NVCC spell them; (_, None, _) when unset."""
    words = _words(_COMPILERS[kind][0])
    if not words:
        return [], None, []
    i = _compiler_index(words)
    return words[:i], words[i], words[i + 1:]


def _default(kind: str) -> str | None:
    """The conventional compiler found on PATH or in its usual place, if any."""
    _, names, extra, _ = _COMPILERS[kind]
    return next(filter(None, [shutil.which(n) for n in names]
                       + [p for p in extra if os.access(p, os.X_OK)]), None)


def _compiler_index(words: list[str]) -> int:
    # The compiler is the last word before the first option; words before it are launchers:
    # "ccache g++", "g++ -m64", "env CCACHE_DIR=/x ccache clang++ -I /opt/inc".
    first_option = next((i for i, w in enumerate(words) if w.startswith("-")), len(words))
    return max(first_option - 1, 0)


def _words(env_var: str) -> list[str]:
    try:
        return shlex.split(os.environ.get(env_var, ""))
    except ValueError as e:
        raise BuildError(f"{env_var}={os.environ[env_var]!r} cannot be parsed: {e}") from None


@functools.cache
def compiler(kind: str) -> Compiler:
    """The "cxx" or "nvcc" compiler with its launcher; BuildError when there is none."""
    env_var, _, _, missing = _COMPILERS[kind]
    launcher, word, options = _spelled(kind)
    if word is None:
        found = _default(kind)
        if found:
            return Compiler((), found, ())
        raise BuildError(missing)
    for w in launcher[:1] + [word]:
        if not shutil.which(w):
            what = "" if not launcher and not options else f": {w!r}"
            raise BuildError(f"{env_var}={os.environ[env_var]!r}{what} is not an executable")
    return Compiler(tuple(launcher), shutil.which(word), tuple(options))


def cxx() -> str:
    """The C++ compiler's executable (for tools run directly, without a launcher)."""
    return compiler("cxx").exe


def nvcc() -> str:
    return compiler("nvcc").exe


# Seconds a compiler gets to answer --version: a wrapper that hangs must not hang the build.
VERSION_PROBE_SECONDS = 60.0


def _probe(argv: list[str], tool: str, question: str) -> tuple[int, str, str]:
    """(returncode, stdout, stderr) of a short query of a tool, in its own process group so
    that a wrapper that hangs is killed with its children (which hold the pipes too)."""
    try:
        probe = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 process_group=0)
    except OSError as e:
        raise BuildError(f"cannot run {argv[0]}: {e}") from e
    try:
        stdout, stderr = probe.communicate(timeout=VERSION_PROBE_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(probe.pid, signal.SIGKILL)
        probe.communicate()
        raise BuildError(f"{tool} did not answer {question} within {VERSION_PROBE_SECONDS:g} s "
                         "(hung, or a wrapper that hangs?)") from None
    return probe.returncode, stdout, stderr


@functools.cache
def compiler_version(exe: str) -> str:
    returncode, stdout, stderr = _probe([exe, "--version"], f"the compiler {exe}",
                                         f"`{os.path.basename(exe)} --version`")
    lines = [l for l in stdout.splitlines() if l.strip()]
    if returncode != 0 or not lines:
        raise BuildError(f"{exe} --version failed: {stderr.strip()}")
    # nvcc puts its release on the last line, gcc/clang on the first.
    return lines[-1] if "cuda" in lines[-1].lower() else lines[0]


def _cpuinfo() -> str:
    try:
        return pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


@functools.cache
def host_isa() -> str:
    """A digest of the CPU features -march=native compiles for."""
    lines = sorted({l.split(":", 1)[1].strip() for l in _cpuinfo().splitlines()
                    if l.startswith(("flags", "model name", "Features", "CPU part"))})
    import platform
    return hashlib.sha256("\n".join([platform.machine(), *lines]).encode()).hexdigest()[:16]


# x86 cpuinfo flags that name instruction-set extensions -march=native may use; the others
# (hypervisor, ht, tsc_known_freq, ...) differ between hosts that run the same code.
_X86_ISA = re.compile(r"^(sse|ssse|avx|fma|f16c|bmi|amx|vaes|vpclmulqdq|gfni|movbe|popcnt|abm|adx"
                      r"|sha_ni|aes|pclmulqdq|lzcnt)")


@functools.cache
def cpu_isa() -> tuple[str, ...]:
    """This CPU's instruction-set extensions: a CPU library (-march=native) runs only on a CPU
    that has all those of the CPU it was built on (else SIGILL)."""
    for line in _cpuinfo().splitlines():
        if line.startswith("flags"):  # x86
            return tuple(sorted(f for f in set(line.split(":", 1)[1].split()) if _X86_ISA.match(f)))
        if line.startswith("Features"):  # arm64: every listed feature is an ISA feature
            return tuple(sorted(set(line.split(":", 1)[1].split())))
    return ()


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


def cuda_compile_flags(target: str) -> list[str]:
    return ["-std=c++17", "-O3", "-Xcompiler", "-fPIC", *targets.lookup(target).arch_flags,
            "-Xptxas", "-warn-spills", *_includes()]


def python_face_flags() -> list[str]:
    import pybind11
    return ["-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden",
            "-I", pybind11.get_include(), "-I", sysconfig.get_paths()["include"], *_includes()]


@functools.cache
def erts_include() -> dict:
    """The BEAM's erl_nif headers a NIF face compiles against (from `erl`), and their identity."""
    erl = shutil.which("erl")
    if not erl:
        raise BuildError("erl not found: a NIF face needs Erlang's headers "
                         "(apt-get install erlang-dev, or put erl on PATH)")
    script = 'io:format("~s", [filename:join([code:root_dir(), "usr", "include"])]), halt().'
    returncode, stdout, _ = _probe([erl, "-noshell", "-eval", script], erl, "where its headers are")
    include = pathlib.Path(stdout.strip() or "/nonexistent")
    if returncode != 0 or not (include / "erl_nif.h").is_file():
        raise BuildError(f"erl_nif.h not found under {stdout.strip() or 'the Erlang root'}: "
                         "install erlang-dev (Debian) for the NIF headers")
    digest = hashlib.sha256(b"".join((include / n).read_bytes() for n in sorted(
        p.name for p in include.glob("erl_*.h")))).hexdigest()[:16]
    return {"include_dir": str(include), "sha256": digest}


def nif_face_flags() -> list[str]:
    return [*cpu_compile_flags(), "-I", erts_include()["include_dir"]]


def python_identity() -> str:
    import pybind11
    return f"cpython-{sys.version_info.major}.{sys.version_info.minor}/pybind11-{pybind11.__version__}"


class ProcessGroup:
    """A process group for compiler children that dies with this process.

    Its leader is a watchdog blocked reading a pipe from us. However we end -- kill -9
    included -- the pipe closes and the watchdog kills the whole group: compiler drivers and
    what they spawn (cc1plus, as, cicc, ptxas). close() does the same on purpose, so a failed
    or interrupted build stops the compiles still running.
    """
    _WATCHDOG = "import os, signal, sys; sys.stdin.buffer.read(); os.killpg(0, signal.SIGKILL)"

    def __init__(self):
        self._leader = subprocess.Popen([sys.executable, "-c", self._WATCHDOG],
                                        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, process_group=0)
        self.pgid = self._leader.pid

    def close(self) -> None:
        self._leader.stdin.close()
        self._leader.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# Variables that change what a compiler produces without appearing on its command line. They
# are cleared for flashgen's compiles (the cache key covers only the command line): options
# (NVCC_PREPEND_FLAGS / NVCC_APPEND_FLAGS, clang's CCC_OVERRIDE_OPTIONS), nvcc's host compiler
# (NVCC_CCBIN), search paths for headers, libraries and compiler parts (CPATH, C_INCLUDE_PATH,
# CPLUS_INCLUDE_PATH, LIBRARY_PATH, COMPILER_PATH, GCC_EXEC_PREFIX) and side outputs
# (DEPENDENCIES_OUTPUT, SUNPRO_DEPENDENCIES). CFLAGS/CXXFLAGS/LDFLAGS are read by build systems,
# not by compilers, and flashgen does not read them.
CLEARED_ENV = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN", "CCC_OVERRIDE_OPTIONS",
               "CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "OBJC_INCLUDE_PATH", "LIBRARY_PATH",
               "COMPILER_PATH", "GCC_EXEC_PREFIX", "DEPENDENCIES_OUTPUT", "SUNPRO_DEPENDENCIES")

# What nvcc's host steps, run through `sh -c` with each path in double quotes, would expand.
_SHELL_ACTIVE = ('$', '`', '"', '\\', '\n')


def check_shell_safe(path: str | os.PathLike, what: str) -> None:
    """BuildError unless `path` can go to nvcc: nvcc runs its host steps through a shell."""
    text = os.fspath(path)
    bad = sorted({c for c in _SHELL_ACTIVE if c in text})
    if bad:
        raise BuildError(f"{what} {text!r} contains {' '.join(map(repr, bad))}, which nvcc would "
                         f"hand to a shell (it runs its host steps through one): use a path "
                         f"without $ ` \" \\")


def run(cmd: list[str], what: str, group: ProcessGroup | None = None, *,
        nvcc_tmpdir: pathlib.Path | None = None) -> None:
    """Run a compiler (in `group` if given), without the variables of CLEARED_ENV; on failure
    raise BuildError carrying the compiler's own message. An nvcc command gives `nvcc_tmpdir`,
    a directory flashgen chose (whatever TMPDIR says), for its intermediate files; every
    argument of it is checked with check_shell_safe first."""
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    if nvcc_tmpdir is not None:
        for word in [*cmd, str(nvcc_tmpdir)]:
            check_shell_safe(word, f"{what}: the argument")
        env["TMPDIR"] = str(nvcc_tmpdir)
    extra = {"process_group": group.pgid} if group else {}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, **extra)
    except OSError as e:
        raise BuildError(f"{what}: cannot run {cmd[0]}: {e}") from e
    if out.returncode != 0:
        if out.returncode < 0:
            raise BuildError(f"{what}: the compiler was stopped by signal {-out.returncode}")
        msg = (out.stderr or out.stdout).strip().splitlines()
        tail = "\n".join(msg[-40:])
        raise BuildError(f"{what} failed (exit {out.returncode}):\n{tail}")

