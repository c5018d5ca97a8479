"""The kernel cache verifies what it loads: damaged entries are rebuilt, never dlopened; builds
killed mid-way leave no compilers running and no staging behind; `flashgen cache`.

Every test works on its own copy of one built cache entry (the seed), so damaging it costs a
relink (or the 0.2 s compile of library.cc), not a cold build.
"""
import json
import os
import pathlib
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest

from flashgen import KernelSpec, build, cache, toolchain

SPEC = KernelSpec(32, "f32", False, "cpu")
REPO = pathlib.Path(__file__).resolve().parent.parent


def _python(code, env=None, **kw):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, **kw)


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "flashgen", *args], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


# Builds SPEC through the cache, loads it and runs the forward kernel against float64 on fresh
# random inputs: a damaged library that reached dlopen would kill this child (SIGBUS/SIGSEGV).
LOAD_AND_RUN = """
import numpy as np, jax, jax.numpy as jnp
import flashgen, flashgen.runtime as rt, flashgen.jax as fj
from flashgen import reference
lib = flashgen.build([flashgen.KernelSpec(32, 'f32', False, 'cpu')])
rt.load(lib.path)
rng = np.random.default_rng()
q, k, v = (rng.standard_normal((1, 24, 2, 32)).astype(np.float32) for _ in range(3))
o = np.asarray(fj.flash_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)))
ref = reference.attention(q, k, v)[0]
assert np.max(np.abs(o - ref)) < 1e-4, np.max(np.abs(o - ref))
print('hit' if lib.cache_hit else 'rebuilt')
"""


def _damage_and_load(root, damage):
    damage()
    r = _python(LOAD_AND_RUN, env={"FLASHGEN_CACHE_DIR": str(root)})
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    return r


def _so(lib_dir):
    (so,) = lib_dir.glob("*.so")
    return so


def test_truncated_library_is_rebuilt_not_loaded(cache_copy):
    root, lib_dir = cache_copy
    so = _so(lib_dir)
    r = _damage_and_load(root, lambda: os.truncate(so, so.stat().st_size // 2))
    assert r.stdout.strip() == "rebuilt"
    assert "damaged" in r.stderr and "truncated" in r.stderr


def test_flipped_bytes_in_library_are_rebuilt(cache_copy):
    root, lib_dir = cache_copy
    so = _so(lib_dir)

    def flip():
        data = bytearray(so.read_bytes())
        for i in range(4096, len(data), 9973):
            data[i] ^= 0xFF
        so.write_bytes(bytes(data))
    r = _damage_and_load(root, flip)
    assert r.stdout.strip() == "rebuilt" and "sha256" in r.stderr


@pytest.mark.parametrize("damage", ["delete", "truncate", "edit"])
def test_damaged_manifest_is_rebuilt(cache_copy, damage):
    root, lib_dir = cache_copy
    manifest = lib_dir / "manifest.json"
    if damage == "delete":
        manifest.unlink()
    elif damage == "truncate":
        os.truncate(manifest, 100)
    else:  # valid JSON that lies: caught by the manifest's own digest
        m = json.loads(manifest.read_text())
        m["specs"][0]["causal"] = True
        manifest.write_text(json.dumps(m))
    lib = build([SPEC])
    assert not lib.cache_hit
    assert cache.verify_library(lib.path.parent)["specs"][0]["causal"] is False
    assert build([SPEC]).cache_hit


def test_empty_object_is_recompiled(cache_copy):
    root, lib_dir = cache_copy
    manifest = json.loads((lib_dir / "manifest.json").read_text())
    obj = cache.object_path(root, manifest["objects"]["library.cc"])
    obj.write_bytes(b"")
    shutil.rmtree(lib_dir)  # the library must be linked again, from that object
    lib = build([SPEC])
    assert not lib.cache_hit and obj.stat().st_size > 0
    assert cache.lookup_object(root, obj.stem) == obj
    r = _python(LOAD_AND_RUN, env={"FLASHGEN_CACHE_DIR": str(root)})
    assert r.returncode == 0 and r.stdout.strip() == "hit", r.stderr[-3000:]


def test_loading_a_damaged_shipped_library_is_a_clear_error(cache_copy, tmp_path):
    out = tmp_path / "shipped"
    build([SPEC], out=out)
    so = _so(out)
    os.truncate(so, 1000)
    code = f"import flashgen.jax as fj; fj.load({str(out)!r})"
    r = _python(code)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "refusing to load" in r.stderr and "truncated" in r.stderr
    so.unlink()
    (out / "manifest.json").unlink()
    build([SPEC], out=out)
    (out / "manifest.json").unlink()  # a library without its manifest cannot be verified
    r = _python(f"import flashgen.jax as fj; fj.load({str(_so(out))!r})")
    assert r.returncode == 1 and "no manifest.json beside" in r.stderr


def _slow_compiler(tmp_path) -> pathlib.Path:
    """A launcher that records its pid and a grandchild's (as g++ runs cc1plus), writes part
    of its output, then sleeps: a compile that a killed build must not leave running."""
    script = tmp_path / "slowcc"
    script.write_text(f"""#!/bin/sh
out=""
prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
[ -n "$out" ] && printf 'partial' > "$out"
sleep 300 &
echo $$ $! >> {tmp_path}/pids
wait
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def kill_once_compiling(proc: subprocess.Popen, pids_file: pathlib.Path, count: int) -> None:
    """Wait until `count` compiler processes have written their pids to `pids_file`, kill -9
    the build `proc`, and check that every one of them dies with it."""
    deadline = time.time() + 60
    while time.time() < deadline and len(pids_file.read_text().split() if pids_file.exists() else []) < count:
        time.sleep(0.1)
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == count, pids
    assert all(_alive(p) for p in pids)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "compilers outlived the killed build"


def test_killed_build_leaves_no_compiler_running_and_no_staging(tmp_path):
    root = tmp_path / "cache"
    env = {"FLASHGEN_CACHE_DIR": str(root), "CXX": f"{_slow_compiler(tmp_path)} g++"}
    proc = subprocess.Popen([sys.executable, "-m", "flashgen", "build", "--hdim", "32",
                             "--dtype", "f32", "--target", "cpu", "-j", "2"],
                            env={**os.environ, "PYTHONPATH": str(REPO), **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_once_compiling(proc, tmp_path / "pids", 4)  # two compiles, each a driver and its child

    left = [p.name for sub in ("libs", "objects") for p in (root / sub).iterdir()]
    assert left and all(n.startswith(".tmp-") for n in left), left  # staging, temp objects
    r = _cli("cache", "clean", env={"FLASHGEN_CACHE_DIR": str(root)})
    assert r.returncode == 0, r.stderr
    assert not [p for sub in ("libs", "objects") for p in (root / sub).iterdir()]


def test_next_build_removes_stale_staging_but_not_a_live_one(cache_copy):
    root, lib_dir = cache_copy
    dead_key, live_key = "a" * 32, "b" * 32
    stale = [root / "libs" / f".tmp-{dead_key}-0123", root / "objects" / f".tmp-{dead_key}-4567.o"]
    stale[0].mkdir()
    stale[1].write_bytes(b"partial")
    live = root / "libs" / f".tmp-{live_key}-89ab"
    live.mkdir()
    with cache.locked(root, live_key):  # a build of live_key is under way
        assert build([SPEC]).cache_hit
        assert not any(p.exists() for p in stale) and live.exists()
    assert build([SPEC]).cache_hit and not live.exists()


def test_files_follow_the_umask(cache_copy, tmp_path):
    root, lib_dir = cache_copy
    old = os.umask(0o022)
    try:
        shutil.rmtree(lib_dir)  # relinked from the cached objects under this umask
        lib = build([SPEC], out=tmp_path / "shared")
        entry = root / "libs" / lib_dir.name
        for p in [entry, *entry.rglob("*"), tmp_path / "shared", *(tmp_path / "shared").iterdir()]:
            mode = p.stat().st_mode
            assert mode & 0o044 == 0o044, (p, oct(mode))  # group/others can read what we wrote
            if p.is_dir():
                assert mode & 0o011 == 0o011, (p, oct(mode))
        os.umask(0o077)
        private = build([SPEC], out=tmp_path / "private")
        assert private.path.stat().st_mode & 0o077 == 0
        assert lib.path.read_bytes() == private.path.read_bytes()
    finally:
        os.umask(old)


def test_launcher_and_heartbeat(cache_copy, tmp_path, monkeypatch):
    """CXX="launcher g++" (ccache's spelling) runs through the launcher; a cold compile reports
    which source is compiling and for how long."""
    root, lib_dir = cache_copy
    launcher = tmp_path / "launch"
    launcher.write_text(f'#!/bin/sh\necho "$1" >> {tmp_path}/launched\nsleep 1.2\nexec "$@"\n')
    launcher.chmod(launcher.stat().st_mode | stat.S_IEXEC)
    manifest = json.loads((lib_dir / "manifest.json").read_text())
    cache.object_path(root, manifest["objects"]["library.cc"]).unlink()
    shutil.rmtree(lib_dir)
    monkeypatch.setenv("CXX", f"{launcher} c++")
    monkeypatch.setattr(sys.modules["flashgen.build"], "HEARTBEAT_SECONDS", 0.4)
    toolchain.compiler.cache_clear()
    try:
        lines = []
        lib = build([SPEC], progress=lines.append)
    finally:
        toolchain.compiler.cache_clear()
    assert lib.path.parent == root / "libs" / lib_dir.name  # the launcher is not part of the key
    launched = [os.path.basename(w) for w in (tmp_path / "launched").read_text().split()]
    assert launched == ["c++", "c++"]  # the compile of library.cc, the link
    assert lines[0].startswith("compiling d32_f32_full_cpu for cpu")
    assert any(l.startswith("still compiling library.cc (") for l in lines), lines
    assert any("library.cc: compiled in" in l for l in lines)


def test_cli_cache_list_verify_clean(cache_copy):
    root, lib_dir = cache_copy
    env = {"FLASHGEN_CACHE_DIR": str(root)}
    r = _cli("cache", "list", env=env)
    assert r.returncode == 0 and lib_dir.name in r.stdout and "d32_f32" in r.stdout
    assert "1 libraries, 3 objects" in r.stdout
    r = _cli("cache", "verify", env=env)
    assert r.returncode == 0 and "all intact" in r.stdout, r.stderr
    os.truncate(_so(lib_dir), 4096)
    r = _cli("cache", "verify", env=env)
    assert r.returncode == 1 and f"damaged library {lib_dir}" in r.stdout
    r = _cli("cache", "clean", env=env)
    assert r.returncode == 0 and not lib_dir.exists()
    assert len(list((root / "objects").glob("*.o"))) == 3  # intact objects stay
    r = _cli("cache", "verify", env=env)
    assert r.returncode == 0
    r = _cli("cache", "clean", "--all", env=env)
    assert r.returncode == 0 and not list((root / "objects").iterdir())
