"""flashgen.targets: one row per target, and a new row reusing a kernel family needs no other edit."""
import dataclasses
import subprocess
import types

import pytest

from flashgen import build, codegen, resources, runtime, targets, toolchain
from flashgen.emulate import nvcc as emulate_nvcc
from flashgen.spec import DIRECTIONS, KernelSpec

from conftest import needs_nvcc

COMPILER_OF_LANGUAGE = {"c++": "cxx", "cuda": "nvcc"}


def check_row(row):
    assert targets.TARGETS[row.name] is row and targets.lookup(row.name) is row
    assert row.name.isidentifier()  # it ends up in file and module names (KernelSpec.stem)
    family = row.family
    assert (resources.templates_dir() / family.template).is_file()
    assert family.suffix.startswith(".") and family.language in COMPILER_OF_LANGUAGE
    # The family's sources, the kernels' compiler and the library's linker are one compiler.
    assert row.compiler == COMPILER_OF_LANGUAGE[family.language]
    assert row.on_host == (family.language == "c++") == (row.arch_flags == ())
    assert row.jax_platforms and all(p == p.lower() for p in row.jax_platforms)
    if row.gpu:
        assert row.name in targets.emulated()
        assert row.gpu.runs_on(row.gpu.compute_capability)
        assert row.gpu.smem_limit > 48 * 1024 and row.gpu.sm_count > 0
        assert row.arch_flags[1].startswith(f"arch={row.gpu.ptx_arch},code=")


@pytest.mark.parametrize("row", targets.TARGETS.values(), ids=list(targets.TARGETS))
def test_each_row_is_consistent(row):
    check_row(row)


def test_one_host_target_and_gpu_backends_apart_from_it():
    hosts = [t for t in targets.TARGETS.values() if t.on_host]
    assert len(hosts) == 1
    gpu_platforms = {p for t in targets.TARGETS.values() if t.gpu for p in t.jax_platforms}
    assert not gpu_platforms & set(hosts[0].jax_platforms)
    assert {t.platform for t in targets.TARGETS.values() if t.gpu} == {"CUDA"}


def test_the_existing_targets_keep_their_flags():
    """What the cache keys and manifests of cpu, sm80 and sm90a libraries were built from."""
    assert targets.lookup("sm80").arch_flags == ("-gencode", "arch=compute_80,code=[sm_80,compute_80]")
    assert targets.lookup("sm90a").arch_flags == ("-gencode", "arch=compute_90a,code=sm_90a")
    assert [(t.compiler, t.link_flags, t.platform, t.xla_platform) for t in map(targets.lookup, ("cpu", "sm80", "sm90a"))] \
        == [("cxx", ("-pthread",), "cpu", "Host"), ("nvcc", (), "CUDA", "CUDA"), ("nvcc", (), "CUDA", "CUDA")]
    assert emulate_nvcc.ptx_flags("sm90a")[4] == "-arch=compute_90a"


@pytest.mark.parametrize("bad", ["sm70", "CPU", "", ["cpu"], None])
def test_an_unknown_target_is_refused_naming_the_supported_ones(bad):
    with pytest.raises(ValueError) as e:
        targets.lookup(bad)
    assert str(e.value) == f"unsupported target {bad!r}: supported targets are {', '.join(targets.TARGETS)}"


def _nvidia_smi_says(monkeypatch, answer):
    """Make nvidia-smi report `answer` (None: no nvidia-smi); returns the list of its invocations."""
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        return types.SimpleNamespace(returncode=0, stdout=answer + "\n", stderr="")
    monkeypatch.setattr(targets.shutil, "which", lambda name: None if answer is None else f"/usr/bin/{name}")
    monkeypatch.setattr(targets.subprocess, "run", run)
    return calls


# A GPU runs the newest target whose machine code fits it (same major, sm_90a only on 9.0) or whose
# embedded PTX the driver can JIT for it (sm80's, on anything newer).
@pytest.mark.parametrize("cc, want", [("7.5", None), ("8.0", "sm80"), ("8.6", "sm80"), ("8.9", "sm80"),
                                      ("9.0", "sm90a"), ("10.0", "sm80"), ("12.0", "sm80"), ("[N/A]", None)])
def test_a_gpu_is_given_the_target_that_runs_on_it(monkeypatch, cc, want):
    calls = _nvidia_smi_says(monkeypatch, cc)
    row = targets.local("cuda")
    assert (row and row.name) == want
    assert len(calls) == 1
    # Told the compute capability (JAX's device knows it), the same answer without asking nvidia-smi.
    assert targets.local("gpu", cc) is row
    assert len(calls) == 1


def test_arch_specific_machine_code_runs_only_on_its_own_gpu():
    hopper = targets.Gpu("90a", embeds_ptx=False, smem_limit=227 * 1024, sm_count=132)
    assert hopper.compute_capability == (9, 0) and hopper.runs_on((9, 0))
    assert not hopper.runs_on((9, 5)) and not hopper.runs_on((10, 0))
    portable = dataclasses.replace(hopper, arch="90")
    assert portable.runs_on((9, 5)) and not portable.runs_on((10, 0)) and not portable.runs_on((8, 9))


def test_the_cpu_backend_needs_no_gpu_probe(monkeypatch):
    calls = _nvidia_smi_says(monkeypatch, "9.0")
    assert targets.local("cpu").name == "cpu"
    assert targets.local("rocm") is None
    assert targets.is_host("cpu") and not targets.is_host("cuda") and not targets.is_host("gpu")
    assert calls == []
    _nvidia_smi_says(monkeypatch, None)
    assert targets.local("cuda") is None


def test_jax_local_target_on_this_cpu_backend():
    import jax

    from flashgen.jax.attention import local_target
    assert jax.default_backend() == "cpu"
    assert local_target() == "cpu"


@pytest.fixture
def sm89(monkeypatch):
    """A hypothetical Ada target reusing the mma.sync family: one row, added at runtime."""
    row = dataclasses.replace(targets.lookup("sm80"), name="sm89",
                              gpu=targets.Gpu("89", embeds_ptx=True, smem_limit=99 * 1024, sm_count=128))
    monkeypatch.setitem(targets.TARGETS, "sm89", row)
    return row


def test_a_new_row_reusing_a_kernel_family_flows_through_every_layer(sm89):
    check_row(sm89)
    spec = KernelSpec(64, "bf16", True, "sm89")  # spec validation
    assert spec.platform == "CUDA" and spec.stem == "d64_bf16_causal_sm89"
    src = codegen.render_spec(spec)  # codegen renders the family's template
    ampere = codegen.render_spec(dataclasses.replace(spec, target="sm80"))
    assert (src.name, src.language) == ("d64_bf16_causal_sm89.cu", "cuda")
    assert src.text == ampere.text.replace("arch=sm80", "arch=sm89") != ampere.text
    handlers = codegen._handlers([spec])
    assert {h["xla_platform"] for h in handlers} == {"CUDA"} and len(handlers) == len(DIRECTIONS)
    flags = toolchain.cuda_compile_flags("sm89")  # nvcc's flags
    assert "arch=compute_89,code=[sm_89,compute_89]" in flags
    assert flags == [f.replace("80", "89") if f.startswith("arch=") else f for f in toolchain.cuda_compile_flags("sm80")]
    assert "-arch=compute_89" in emulate_nvcc.ptx_flags("sm89")
    assert "sm89" in targets.emulated()
    # Detection: an Ada GPU gets it, an Ampere one (8.6: no sm_89 code runs there) still sm80.
    assert targets.local("gpu", "8.9") is sm89
    assert targets.local("gpu", "8.6").name == "sm80"
    assert targets.local("gpu", "9.0").name == "sm90a"


def test_without_the_row_the_same_spec_is_refused():
    with pytest.raises(ValueError, match="unsupported target 'sm89'"):
        KernelSpec(64, "bf16", True, "sm89")


@needs_nvcc
def test_a_cuda_library_reports_the_jax_platform_flashgen_run_is_given():
    """`flashgen run --platform cuda --library DIR` compares the two; the manifest says "CUDA"
    (what jax.ffi registers for), which used to be returned and refused every CUDA library."""
    lib = build([KernelSpec(64, "bf16", True, "sm80"), KernelSpec(128, "f16", False, "sm80")])  # test_cuda_build's
    assert lib.manifest["platform"] == "CUDA"
    assert runtime.library_platform(lib.manifest_path) == "cuda"


def test_flashgen_target_picks_an_older_gpu_target_and_refuses_one_that_cannot_run(monkeypatch):
    assert targets.local("cuda", "9.0").name == "sm90a"
    monkeypatch.setenv(targets.OVERRIDE, "sm80")
    assert targets.local("cuda", "9.0").name == "sm80"        # mma.sync kernels run on an H100
    monkeypatch.setenv(targets.OVERRIDE, "sm90a")
    with pytest.raises(ValueError, match=r"FLASHGEN_TARGET=sm90a: .*compute capability 8\.0.*these do: sm80"):
        targets.local("cuda", "8.0")
