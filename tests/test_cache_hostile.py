"""The cache under concurrency and hostile environments: no shell expands a path, the compiler's
environment cannot change an object behind its key, a cleaner never pulls an object from under a
build, the emulation runtime and PTX are verified like every entry, a planted lock is refused,
an unusable cache is an error naming it, and work is not done twice."""
import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import threading
import time

import pytest

from conftest import needs_nvcc
from flashgen import BuildError, KernelSpec, build, cache, toolchain
from test_cache import _cli, kill_once_compiling

SPEC = KernelSpec(32, "f32", False, "cpu")
REPO = pathlib.Path(__file__).resolve().parent.parent
TINY_CU = "__global__ void k(float* x) { x[threadIdx.x] = tanhf(x[threadIdx.x]) / x[1]; }\n"


def _script(path: pathlib.Path, text: str) -> pathlib.Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


# ----------------------------------------------------------------------------- 1: no shell
@needs_nvcc
def test_shell_metacharacters_in_the_cache_path_are_refused(tmp_path):
    root = tmp_path / "inj$(touch PWNED)"
    r = _cli("build", "--hdim", "32", "--dtype", "f32", "--target", "sm80", "--for", "c",
             env={"FLASHGEN_CACHE_DIR": str(root)})
    assert r.returncode == 1, r.stderr[-2000:]
    (line,) = [l for l in r.stderr.splitlines() if l.startswith("flashgen: error")]
    assert f"the cache directory {str(root)!r} contains '$'" in line, line
    assert not list(tmp_path.rglob("PWNED")) and not pathlib.Path("PWNED").exists()


@needs_nvcc
def test_nvcc_gets_a_tmpdir_flashgen_chose_and_no_shell_active_path(tmp_path, monkeypatch):
    """TMPDIR='.../t$(touch PWNED)' reached nvcc's shell; now nvcc's TMPDIR is flashgen's own
    staging directory, and an argument a shell would expand is refused before nvcc runs."""
    monkeypatch.chdir(tmp_path)
    evil_tmp = tmp_path / "t$(touch PWNED)"
    evil_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(evil_tmp))
    src, staging = tmp_path / "k.cu", tmp_path / "staging"
    src.write_text(TINY_CU)
    staging.mkdir()
    toolchain.run([toolchain.nvcc(), "-c", str(src), "-o", str(tmp_path / "k.o")], "compiling k.cu",
                  nvcc_tmpdir=staging)
    assert (tmp_path / "k.o").stat().st_size > 0
    with pytest.raises(BuildError, match=r"contains '\$', which nvcc would hand to a shell"):
        toolchain.run([toolchain.nvcc(), "-c", str(src), "-o", str(evil_tmp / "k.o")],
                      "compiling k.cu", nvcc_tmpdir=staging)
    assert not list(tmp_path.rglob("PWNED"))


# ----------------------------------------------------------------------------- 2: environment
@needs_nvcc
def test_nvcc_flags_from_the_environment_do_not_reach_the_compile(tmp_path, monkeypatch):
    """NVCC_APPEND_FLAGS=--use_fast_math turned tanhf and the division into approximations under
    the same cache key; flashgen's compiles run without it (toolchain.CLEARED_ENV)."""
    src = tmp_path / "k.cu"
    src.write_text(TINY_CU)

    def ptx(*flags) -> str:
        toolchain.run([toolchain.nvcc(), *flags, "-arch=compute_80", "-ptx", str(src), "-o",
                       str(tmp_path / "k.ptx")], "nvcc -ptx", nvcc_tmpdir=tmp_path)
        return (tmp_path / "k.ptx").read_text()
    exact, fast = ptx(), ptx("--use_fast_math")
    assert "tanh.approx" in fast and "tanh.approx" not in exact
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "--use_fast_math")
    monkeypatch.setenv("NVCC_PREPEND_FLAGS", "--use_fast_math")
    assert ptx() == exact


def test_compiler_spelling_does_not_change_the_key(monkeypatch):
    gxx = shutil.which("g++")
    if not gxx:
        pytest.skip("g++ not installed")
    monkeypatch.setenv("CXX", "g++")
    short = toolchain.requested("cxx")
    monkeypatch.setenv("CXX", gxx)
    assert toolchain.requested("cxx") == short == os.path.realpath(gxx)


def test_cache_hit_under_another_spelling_of_the_same_compiler(cache_copy, monkeypatch):
    root, lib_dir = cache_copy
    cxx = toolchain.compiler("cxx").exe  # what the seed was built with (CXX unset)
    monkeypatch.setenv("CXX", os.path.realpath(cxx))
    toolchain.compiler.cache_clear()
    try:
        lib = build([SPEC])
    finally:
        toolchain.compiler.cache_clear()
    assert lib.cache_hit and lib.path.parent == lib_dir


# ----------------------------------------------------------------------------- 6: clean during a build
def test_clean_all_during_a_build_leaves_what_it_links(cache_copy, tmp_path, monkeypatch):
    """A launcher runs `flashgen cache clean --all` at the moment the build links: the objects the
    build looked up are pinned (shared locks), so the cleaner leaves them and the link succeeds."""
    root, lib_dir = cache_copy
    shutil.rmtree(lib_dir)  # relinked from the cached objects
    launcher = _script(tmp_path / "launch", f"""#!/bin/sh
case " $* " in *" -shared "*)
  PYTHONPATH={REPO} {sys.executable} -m flashgen cache clean --all > {tmp_path}/cleaned 2>&1 ;;
esac
exec "$@"
""")
    monkeypatch.setenv("CXX", f"{launcher} c++")
    toolchain.compiler.cache_clear()
    try:
        lib = build([SPEC])
    finally:
        toolchain.compiler.cache_clear()
    assert "entries removed" in (tmp_path / "cleaned").read_text()
    assert lib.path.exists() and not lib.cache_hit
    assert build([SPEC]).cache_hit
    r = _cli("cache", "clean", "--all")
    assert r.returncode == 0 and not list((root / "objects").glob("*.o")), r.stdout


# ----------------------------------------------------------------------------- 7: runtime, PTX
def _fake_entry(root: pathlib.Path, tmp_path: pathlib.Path, kind: str, key: str, companions=()):
    made = {}
    for suffix in ("main", *companions):
        made[suffix] = tmp_path / f"{key}-{suffix.strip('.')}"
        made[suffix].write_bytes(os.urandom(4096))
    return cache.store_object(root, key, made.pop("main"), kind, companions=made)


def test_runtime_and_ptx_are_verified_listed_and_cleaned(cache_copy, tmp_path):
    root, _ = cache_copy
    runtime = _fake_entry(root, tmp_path, "runtime", "c" * 32)
    obj = _fake_entry(root, tmp_path, "object", "d" * 32, companions=(".ptx",))
    assert cache.lookup_object(root, "c" * 32, "runtime") == runtime
    assert cache.lookup_object(root, "d" * 32, companions=(".ptx",)) == obj
    r = _cli("cache", "list")
    assert "1 libraries, 4 objects" in r.stdout and "1 runtimes" in r.stdout, r.stdout
    os.truncate(runtime, 100)
    os.truncate(obj.with_suffix(".ptx"), 100)
    assert cache.lookup_object(root, "c" * 32, "runtime") is None
    assert cache.lookup_object(root, "d" * 32, companions=(".ptx",)) is None
    r = _cli("cache", "verify")
    assert r.returncode == 1, r.stdout
    assert f"damaged runtime {runtime}" in r.stdout and f"damaged object {obj}" in r.stdout
    r = _cli("cache", "clean")
    assert r.returncode == 0 and not runtime.exists() and not obj.with_suffix(".ptx").exists()
    _fake_entry(root, tmp_path, "runtime", "c" * 32)
    _fake_entry(root, tmp_path, "object", "d" * 32, companions=(".ptx",))
    r = _cli("cache", "clean", "--all")
    assert r.returncode == 0
    assert not [p for sub in ("objects", "runtime") for p in (root / sub).iterdir()]


@needs_nvcc
def test_truncated_emulation_runtime_is_rebuilt_not_loaded(tmp_path, monkeypatch):
    """A truncated runtime killed `flashgen check --emulate` with SIGBUS at dlopen, every time."""
    from flashgen.build import emulation_runtime
    good = emulation_runtime()  # the default cache's
    root = tmp_path / "cache"
    (root / "runtime").mkdir(parents=True)
    for f in (good, good.with_suffix(".json")):
        shutil.copy2(f, root / "runtime" / f.name)
    os.truncate(root / "runtime" / good.name, 4096)
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(root))
    rebuilt = emulation_runtime()
    assert rebuilt == root / "runtime" / good.name and rebuilt.stat().st_size == good.stat().st_size
    r = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(rebuilt)!r}, ctypes.RTLD_GLOBAL)"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_an_object_without_its_ptx_record_is_no_cuda_object(cache_copy, tmp_path):
    root, _ = cache_copy
    _fake_entry(root, tmp_path, "object", "e" * 32)  # as an older flashgen recorded a CUDA object
    assert cache.lookup_object(root, "e" * 32) is not None
    assert cache.lookup_object(root, "e" * 32, companions=(".ptx",)) is None


def test_emulated_library_verifies_its_ptx(cache_copy, tmp_path):
    """Every file a manifest records is checked before use, not only the .so."""
    _, lib_dir = cache_copy
    extra = lib_dir / "ptx" / "x.ptx"
    extra.parent.mkdir()
    extra.write_text("// ptx\n")
    manifest = json.loads((lib_dir / "manifest.json").read_text())
    del manifest["manifest_sha256"]
    manifest["files"]["ptx/x.ptx"] = cache.file_record(extra)
    (lib_dir / "manifest.json").write_text(cache.seal(manifest))
    cache.verify_library(lib_dir)
    extra.write_text("// pt\n")
    with pytest.raises(cache.CorruptEntry, match="x.ptx has 6 bytes"):
        cache.verify_library(lib_dir)


# ----------------------------------------------------------------------------- 8: killed runtime build
def test_killed_runtime_build_leaves_no_nvcc_and_no_staging(tmp_path):
    root = tmp_path / "cache"
    slow = _script(tmp_path / "slownvcc", f"""#!/bin/sh
[ "$1" = --version ] && {{ echo "Cuda compilation tools, release 99.0"; exit 0; }}
sleep 300 &
echo $$ $! >> {tmp_path}/pids
wait
""")
    env = {**os.environ, "PYTHONPATH": str(REPO), "FLASHGEN_CACHE_DIR": str(root), "NVCC": str(slow)}
    proc = subprocess.Popen([sys.executable, "-c", "from flashgen.build import emulation_runtime; emulation_runtime()"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_once_compiling(proc, tmp_path / "pids", 2)  # nvcc and its child
    assert [p.name.startswith(".tmp-") for p in (root / "runtime").iterdir()] == [True]
    r = _cli("cache", "clean", env={"FLASHGEN_CACHE_DIR": str(root)})
    assert r.returncode == 0 and "removed staging" in r.stdout, r.stdout
    assert not list((root / "runtime").iterdir())


# ----------------------------------------------------------------------------- 9: unusable caches
def test_cache_dir_that_is_a_file_is_an_error(tmp_path):
    f = tmp_path / "not-a-dir"
    f.write_text("")
    for args in (("cache", "list"), ("cache", "clean", "--all"),
                 ("build", "--hdim", "32", "--dtype", "f32", "--target", "cpu")):
        r = _cli(*args, env={"FLASHGEN_CACHE_DIR": str(f)})
        assert r.returncode == 1, (args, r.stdout)
        assert r.stderr.strip().splitlines()[-1] == f"flashgen: error: the cache {f} (from FLASHGEN_CACHE_DIR) is not a directory"


def test_empty_home_falls_back_to_the_account_home_and_says_so(tmp_path):
    import pwd
    home = pwd.getpwuid(os.getuid()).pw_dir
    env = {k: v for k, v in os.environ.items() if k not in ("FLASHGEN_CACHE_DIR", "XDG_CACHE_HOME")}
    r = subprocess.run([sys.executable, "-m", "flashgen", "cache", "list"], capture_output=True, text=True,
                       env={**env, "HOME": "", "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"cache: {home}/.cache/flashgen\n"), r.stdout[:200]
    assert f"HOME is empty: the kernel cache is under {home}" in r.stderr


def test_read_only_cache_cannot_be_cleaned(cache_copy):
    """Root ignores permission bits, so the cache is made read-only by a bind mount in a private
    mount namespace (skipped where that is not allowed)."""
    root, _ = cache_copy
    if not shutil.which("unshare"):
        pytest.skip("unshare not installed")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind -o ro {root} {root}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no read-only bind mount here: {probe.stderr.strip()}")
    code = (f"mount --bind -o ro {root} {root} && "
            f"PYTHONPATH={REPO} FLASHGEN_CACHE_DIR={root} {sys.executable} -m flashgen cache clean --all")
    r = subprocess.run(["unshare", "-m", "sh", "-c", code], capture_output=True, text=True)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stderr.strip() == f"flashgen: error: cannot clean the cache {root}: it is read-only"
    assert len(list((root / "objects").glob("*.o"))) == 3


# ----------------------------------------------------------------------------- 10: planted locks
def test_planted_symlink_lock_is_refused_not_followed(cache_copy, tmp_path):
    root, lib_dir = cache_copy
    target = tmp_path / "victim"
    (root / "locks").mkdir()
    (root / "locks" / f"{'f' * 32}.lock").symlink_to(target)
    with pytest.raises(cache.CacheError, match="is a symbolic link"):
        with cache.locked(root, "f" * 32):
            pass
    assert not target.exists() and not target.is_symlink()
    victim = tmp_path / "victim2"
    victim.write_text("keep me")
    os.link(victim, root / "locks" / f"{'a' * 32}.lock")
    with pytest.raises(cache.CacheError, match="hard link"):
        with cache.locked(root, "a" * 32):
            pass
    assert victim.read_text() == "keep me"
    shutil.rmtree(root / "locks")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "locks").symlink_to(elsewhere)
    shutil.rmtree(lib_dir)  # a build that must take locks
    with pytest.raises(cache.CacheError, match="lock directory .* is a symbolic link"):
        build([SPEC])
    assert not list(elsewhere.iterdir())


# ----------------------------------------------------------------------------- 11: waiting says for whom
def test_a_build_waiting_on_another_says_whom_it_waits_for(cache_copy, monkeypatch):
    root, lib_dir = cache_copy
    shutil.rmtree(lib_dir)
    monkeypatch.setattr(sys.modules["flashgen.build"], "HEARTBEAT_SECONDS", 0.5)
    lines = []
    with cache.locked(root, lib_dir.name, "building it elsewhere"):
        builder = threading.Thread(target=lambda: lines.append(build([SPEC], progress=lines.append)))
        builder.start()
        time.sleep(2.5)
    builder.join(120)
    waits = [l for l in lines if isinstance(l, str) and l.startswith("waiting for ")]
    assert len(waits) >= 2, lines
    assert waits[0].startswith(f"waiting for process {os.getpid()} (building it elsewhere) to finish "
                               f"with {root / 'locks' / lib_dir.name}.lock")
    assert lines[-1].path.exists()


# ----------------------------------------------------------------------------- 20: work done once
SPEC_CAUSAL = KernelSpec(32, "f32", True, "cpu")


def test_python_face_is_compiled_once_per_toolchain():
    one, other = build([SPEC]), build([SPEC_CAUSAL])
    assert one.path != other.path
    assert one.manifest["objects"]["python_face.cc"] == other.manifest["objects"]["python_face.cc"]


def test_a_spec_is_served_from_a_cached_library_holding_it(tmp_path, monkeypatch):
    both = build([SPEC, SPEC_CAUSAL])  # the default cache, as `flashgen build --both`
    root = tmp_path / "cache"
    shutil.copytree(both.path.parent, root / "libs" / both.path.parent.name)
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(root))  # no objects: a miss would compile
    lib = build([SPEC_CAUSAL], progress=lambda line: pytest.fail(f"built again: {line}"))
    assert lib.cache_hit and lib.path == root / "libs" / both.path.parent.name / both.path.name
    code = ("import numpy as np, jax.numpy as jnp, flashgen.jax as fj; from flashgen import reference\n"
            "q, k, v = (np.random.default_rng().standard_normal((1, 20, 2, 32)).astype(np.float32) for _ in range(3))\n"
            "o = np.asarray(fj.flash_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=True))\n"
            "assert np.max(np.abs(o - reference.attention(q, k, v, causal=True)[0])) < 1e-4")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO), "FLASHGEN_CACHE_DIR": str(root)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert [d.name for d in (root / "libs").iterdir()] == [both.path.parent.name]
