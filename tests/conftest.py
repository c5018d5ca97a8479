import os
import shutil

import numpy as np
import pytest

# Handlers fill outputs with NaN before every kernel runs (csrc/flashgen/ffi_common.h), so an
# element a kernel forgets to write fails the comparison instead of passing on stale memory.
os.environ.setdefault("FLASHGEN_POISON", "1")


def _has_gpu() -> bool:
    try:
        import jax
        return any(d.platform == "gpu" for d in jax.devices())
    except Exception:
        return False


# Long sweeps (marked `slow`) run only when asked: FLASHGEN_SLOW=1 python3 -m pytest -m slow.
RUN_SLOW = os.environ.get("FLASHGEN_SLOW") == "1"


def pytest_collection_modifyitems(config, items):
    skip_gpu = None if _has_gpu() else pytest.mark.skip(reason="needs an NVIDIA GPU with CUDA jax")
    skip_slow = None if RUN_SLOW else pytest.mark.skip(reason="slow: set FLASHGEN_SLOW=1 to run")
    for item in items:
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        if skip_slow is not None and "slow" in item.keywords:
            item.add_marker(skip_slow)


@pytest.fixture
def rng(request):
    """Fresh random inputs every run (a test cannot pass by luck of one draw), from a seed
    that a failure reports: FLASHGEN_SEED=<seed> replays the draw."""
    seed = int(os.environ.get("FLASHGEN_SEED") or np.random.SeedSequence().entropy % 2**63)
    request.node.flashgen_seed = seed
    return np.random.default_rng(seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    seed = getattr(item, "flashgen_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("rng seed", f"replay with FLASHGEN_SEED={seed} "
                                            f"python3 -m pytest '{item.nodeid}'"))
    return report


def verified_rewrite(text, rng):
    """The rewrite of ``text``, which must rewrite a site and match the original on every
    output (flashgen.rewrite.verify, fresh inputs drawn from ``rng``)."""
    import flashgen.rewrite as fr
    from flashgen.rewrite import verify
    result = fr.rewrite(text)
    assert result.rewritten, [s.reason for s in result.rejected]
    rows = verify.verify(result, seed=int(rng.integers(2**31)))["outputs"]
    assert rows and all(r["ok"] for r in rows), rows
    return result


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty build cache for tests of the cache itself."""
    root = tmp_path / "cache"
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(root))
    return root


@pytest.fixture(scope="session")
def seed():
    """A verified cache entry for the d32 f32 cpu spec, in the default cache: the library
    directory and its objects."""
    from flashgen import KernelSpec, build, cache
    lib = build([KernelSpec(32, "f32", False, "cpu")])
    return lib.path.parent, [cache.object_path(cache.root(), k)
                             for k in lib.manifest["objects"].values()]


@pytest.fixture
def cache_copy(seed, tmp_path, monkeypatch):
    """A private cache holding a copy of the seed entry; returns (root, library directory).
    Tests of the cache damage their copy, so that it costs a relink, not a cold build."""
    lib_dir, objects = seed
    root = tmp_path / "cache"
    shutil.copytree(lib_dir, root / "libs" / lib_dir.name)
    (root / "objects").mkdir()
    for o in objects:
        shutil.copy2(o, root / "objects" / o.name)
        shutil.copy2(o.with_suffix(".json"), root / "objects" / o.with_suffix(".json").name)
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(root))
    return root, root / "libs" / lib_dir.name


needs_nvcc = pytest.mark.skipif(
    not (shutil.which("nvcc") or os.access("/usr/local/cuda/bin/nvcc", os.X_OK)),
    reason="nvcc not installed")


# Multi-device CPU tests need XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX
# starts, which would change every other test module's devices; such a module re-runs itself
# in a child interpreter and only the child (MULTIDEVICE_CHILD) runs its real tests.
MULTIDEVICE_CHILD = os.environ.get("FLASHGEN_MULTIDEVICE_CHILD") == "1"


def run_multidevice_child(path: str) -> None:
    import subprocess
    import sys
    env = dict(os.environ, FLASHGEN_MULTIDEVICE_CHILD="1",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"multi-device tests failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"


def mutated_csrc(dest, backend: str, mutation=None):
    """A copy of csrc/ at `dest` where `mutation` = (name, header under csrc/flashgen/<backend>,
    old, new) turned the header's first `old` into `new` (the mutation suites' planted bugs)."""
    import pathlib
    from flashgen import resources
    csrc = pathlib.Path(dest)
    shutil.copytree(resources.csrc_dir(), csrc)
    if mutation:
        name, header, old, new = mutation
        path = csrc / "flashgen" / backend / header
        text = path.read_text()
        assert old in text, f"{name}: the line to mutate is gone from {header}"
        path.write_text(text.replace(old, new, 1))
    return csrc


def assert_nan_where_the_reference_is(got, want, tol, what):
    """NaN exactly where the float64 reference is NaN; the same infinities, and finite values
    within `tol` of it (relative to max(1, its largest magnitude)), elsewhere."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN pattern")
    inf, fin = np.isinf(want), np.isfinite(want)
    assert np.array_equal(np.isinf(got), inf) and np.array_equal(got[inf], want[inf]), f"{what}: infinities differ"
    err = np.max(np.abs(got[fin] - want[fin]), initial=0.0) / max(1.0, np.max(np.abs(want[fin]), initial=0.0))
    assert err < tol, f"{what}: error {err:.3g} >= {tol}"
