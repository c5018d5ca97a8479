"""The targets a KernelSpec can name, one row each: what every layer needs to know about one.

A row says where the kernels run (the platform names JAX, jax.ffi and XLA's registry use), which
kernel family it renders (template, source suffix, language), which compiler builds it with which
architecture and link flags, which GPU it is for (compute capability, nvcc architecture, the
limits flashgen.emulate enforces) and so which local device it is picked for. A new target that
reuses a kernel family is one new row in TARGETS; nothing else compares target names.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess


@dataclasses.dataclass(frozen=True)
class KernelFamily:
    """The kernels a target compiles: one template rendered per KernelSpec (codegen), with the
    csrc/ headers it includes."""
    name: str
    template: str   # under templates/
    suffix: str     # of the rendered source's file name
    language: str   # codegen.Source.language: "c++" or "cuda"
    # Whether its dense fwd / bwd kernels take a value head dim other than the query/key one
    # (KernelSpec.head_dim_v: any pair of spec.HEAD_DIMS); its varlen and paged calls refuse one.
    split_head_dims: bool = False
    # Whether it has the FP8 (e4m3) forward (contract.FP8_CALLS): KernelSpec refuses dtype e4m3 elsewhere.
    fp8_forward: bool = False


CPU_KERNELS = KernelFamily("cpu", "cpu/spec.cc.j2", ".cc", "c++", split_head_dims=True)
# Ampere's warp-level mma.sync kernels.
MMA_SYNC_KERNELS = KernelFamily("mma_sync", "cuda/spec.cu.j2", ".cu", "cuda", split_head_dims=True)
# Hopper: the mma.sync family plus the wgmma kernels of csrc/flashgen/cuda/hopper/ for the calls
# they serve (hopper_fwd_supports there says which; the rest, a split head dim included, keep the
# mma.sync kernels), and the FP8 forward (the same cuda/hopper/fwd.cuh kernel for e4m3).
WGMMA_KERNELS = KernelFamily("wgmma", "cuda/spec.cu.j2", ".cu", "cuda", split_head_dims=True, fp8_forward=True)


@dataclasses.dataclass(frozen=True)
class Gpu:
    """The NVIDIA GPU a CUDA target compiles for, and the device flashgen.emulate stands in for."""
    arch: str            # nvcc's architecture number: "80" -> compute_80 / sm_80; an "a" suffix
                         # (sm_90a) uses arch-specific features and runs only on that exact GPU
    embeds_ptx: bool     # the library also carries the PTX, which the driver JIT-compiles for newer GPUs
    smem_limit: int      # dynamic shared memory per block after cudaFuncSetAttribute opt-in (bytes)
    sm_count: int        # of the GPU emulated (A100, H100 SXM)

    @property
    def ptx_arch(self) -> str:
        return f"compute_{self.arch}"

    @property
    def compute_capability(self) -> tuple[int, int]:
        digits = self.arch.rstrip("abcdefghijklmnopqrstuvwxyz")
        return int(digits[:-1]), int(digits[-1])

    @property
    def arch_flags(self) -> tuple[str, ...]:
        """nvcc's -gencode for this GPU."""
        sass = f"sm_{self.arch}"
        code = f"[{sass},{self.ptx_arch}]" if self.embeds_ptx else sass
        return ("-gencode", f"arch={self.ptx_arch},code={code}")

    def runs_on(self, compute_capability: tuple[int, int]) -> bool:
        """Whether a library built for this GPU runs on one of `compute_capability`: its machine code
        on the same major version at an equal or higher minor (an arch-specific one only on its
        own), its PTX, when embedded, on any newer GPU."""
        own = self.compute_capability
        arch_specific = not self.arch[-1].isdigit()
        sass = compute_capability == own if arch_specific else \
            (compute_capability[0] == own[0] and compute_capability >= own)
        return sass or (self.embeds_ptx and compute_capability >= own)


@dataclasses.dataclass(frozen=True)
class Target:
    """One value of KernelSpec.target."""
    name: str
    family: KernelFamily
    platform: str                  # what its handlers register for with jax.ffi (the manifest's "platform")
    xla_platform: str              # XLA's registry name, for static registration (EXLA)
    jax_platforms: tuple[str, ...]  # JAX's names for the backend it runs on
    compiler: str                  # toolchain.compiler kind that compiles its kernels and links the library
    link_flags: tuple[str, ...]    # besides -shared
    gpu: Gpu | None                # None: the kernels run on the host CPU

    @property
    def on_host(self) -> bool:
        return self.gpu is None

    @property
    def arch_flags(self) -> tuple[str, ...]:
        """The compiler's flags that pick the architecture the kernels compile for (the host's is
        -march=native, in toolchain's flags for every C++ source)."""
        return self.gpu.arch_flags if self.gpu else ()


# What every CUDA target shares.
_CUDA = dict(platform="CUDA", xla_platform="CUDA", jax_platforms=("cuda", "gpu"), compiler="nvcc", link_flags=())

TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("cpu", CPU_KERNELS, platform="cpu", xla_platform="Host", jax_platforms=("cpu",), compiler="cxx",
           link_flags=("-pthread",), gpu=None),
    # PTX alongside the sm_80 machine code lets the Ampere build JIT onto newer GPUs.
    Target("sm80", MMA_SYNC_KERNELS, **_CUDA, gpu=Gpu("80", embeds_ptx=True, smem_limit=163 * 1024, sm_count=108)),
    Target("sm90a", WGMMA_KERNELS, **_CUDA, gpu=Gpu("90a", embeds_ptx=False, smem_limit=227 * 1024, sm_count=132)),
)}


def lookup(name: str) -> Target:
    """The row of target `name`; ValueError naming the supported targets for any other value."""
    if not isinstance(name, str) or name not in TARGETS:
        raise ValueError(f"unsupported target {name!r}: supported targets are {', '.join(TARGETS)}")
    return TARGETS[name]


def emulated() -> tuple[str, ...]:
    """The targets flashgen.emulate runs: those built for a GPU."""
    return tuple(name for name, t in TARGETS.items() if t.gpu)


def split_head_dim_targets() -> tuple[str, ...]:
    """The targets whose kernels take a value head dim other than the query/key one."""
    return tuple(name for name, t in TARGETS.items() if t.family.split_head_dims)


def fp8_targets() -> tuple[str, ...]:
    """The targets with the FP8 (e4m3) forward."""
    return tuple(name for name, t in TARGETS.items() if t.family.fp8_forward)


def is_host(platform: str) -> bool:
    """Whether JAX backend `platform` is the host CPU (the backend of a target without a GPU)."""
    return any(platform in t.jax_platforms and t.on_host for t in TARGETS.values())


# Names the GPU target to use instead of the newest that runs here (FLASHGEN_TARGET=sm80 on an H100:
# the mma.sync family, e.g. to compare it with sm90a's in `flashgen bench --impls flashgen@sm80`). GPU
# targets only: the CPU backend runs the host's kernels whatever it says.
OVERRIDE = "FLASHGEN_TARGET"


def local(platform: str, compute_capability: str | None = None) -> Target | None:
    """The target whose kernels run on this machine's JAX backend `platform` ("cpu", "cuda"/"gpu");
    None when none does. A GPU target is picked by the GPU's compute capability ("8.6"):
    `compute_capability` when the caller knows it (JAX's device does), else nvidia-smi's; the
    newest that runs there, or the one OVERRIDE names."""
    rows = [t for t in TARGETS.values() if platform in t.jax_platforms]
    host = [t for t in rows if t.on_host]
    if host or not rows:
        return host[0] if host else None
    cc = _parse_compute_capability(compute_capability or _nvidia_smi_compute_capability())
    fits = [t for t in rows if cc and t.gpu.runs_on(cc)]
    forced = os.environ.get(OVERRIDE)
    if forced:
        row = next((t for t in fits if t.name == forced), None)
        if row is None:
            raise ValueError(f"{OVERRIDE}={forced}: not a target whose kernels run on this GPU (compute capability "
                             f"{'.'.join(map(str, cc)) if cc else 'unknown'}); these do: "
                             f"{', '.join(t.name for t in fits) or 'none'}")
        return row
    return max(fits, key=lambda t: t.gpu.compute_capability, default=None)


def _parse_compute_capability(text: str | None) -> tuple[int, int] | None:
    try:
        major, minor = str(text).strip().split(".")
        return int(major), int(minor)
    except ValueError:
        return None


def _nvidia_smi_compute_capability() -> str | None:
    """The first GPU's compute capability as nvidia-smi reports it, None without one."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    caps = [l.strip() for l in out.stdout.splitlines() if l.strip()]
    return caps[0] if out.returncode == 0 and caps else None
