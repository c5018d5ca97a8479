"""Direct emulator launches of the dense CUDA kernels with hand-packed parameters.

For the emulator's own tests and the mutation suite only: the real host path (the FFI handlers
filling these structs) is tested in test_cuda_emulated.py. The struct layouts below mirror
csrc/flashgen/cuda/fwd.cuh FwdParams; the size is checked against the kernel's PTX parameter.
"""
from __future__ import annotations

import functools
import struct

import ml_dtypes
import numpy as np

from flashgen.codegen import render_spec
from flashgen.emulate import GlobalMemory, PtxModule, launch
from flashgen.emulate.nvcc import compile_ptx
from flashgen.spec import KernelSpec

NP_DTYPES = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}
_BAND_LIMIT = (1 << 30) + 1
_LOG2E = np.float32(1.4426950408889634)


@functools.lru_cache(maxsize=None)
def spec_module(head_dim: int, dtype: str, causal: bool, arch: str = "sm80") -> PtxModule:
    spec = KernelSpec(head_dim, dtype, causal, arch)
    return PtxModule.parse(compile_ptx(render_spec(spec).text, arch, name=render_spec(spec).name))


def module_from_csrc(csrc_dir: str, head_dim: int, dtype: str, causal: bool, arch: str = "sm80") -> PtxModule:
    """The spec compiled against another copy of csrc/ (e.g. a mutated one)."""
    spec = KernelSpec(head_dim, dtype, causal, arch)
    src = render_spec(spec)
    return PtxModule.parse(compile_ptx(src.text, arch, include_first=csrc_dir, name=src.name))


def kernel_name(module: PtxModule, base: str, mode: int | None = None) -> str:
    """The mangled entry of `base` (e.g. flash_fwd_kernel) and template MODE (last int argument)."""
    names = [n for n in module.kernels if f"{len(base)}{base}I" in n
             and (mode is None or f"Li{mode}EE" in n.split(base)[1])]
    if len(names) != 1:
        raise LookupError(f"{len(names)} entries match {base} mode {mode}")
    return names[0]


def fwd_config(dtype: str, head_dim: int):
    """(threads, BR, BC, LD) of FwdConfig<T, D> in fwd.cuh."""
    f32 = dtype == "f32"
    warps = 4 if f32 else 8
    bc = (64 if head_dim <= 128 else 32) if f32 else 64
    return warps * 32, warps * 16, bc, head_dim + 16 // (4 if f32 else 2)


def run_dense_forward(module: PtxModule, q, k, v, *, causal: bool, dtype: str, arch: str = "sm80",
                      seed: int | None = None, race_check: bool = True):
    """o, lse (float64) and the LaunchStats of flash_fwd_kernel<.., kFwdDense> on inputs q/k/v."""
    threads, br, bc, ld = fwd_config(dtype, q.shape[3])
    smem = (br + 2 * bc) * ld * np.dtype(NP_DTYPES[dtype]).itemsize
    return run_forward_kernel(module, kernel_name(module, "flash_fwd_kernel", 0), br, threads, smem, q, k, v,
                              causal=causal, dtype=dtype, arch=arch, seed=seed, race_check=race_check)


def run_forward_kernel(module: PtxModule, name: str, rows_per_block: int, threads: int, smem: int, q, k, v, *,
                       causal: bool, dtype: str, arch: str, seed: int | None = None, race_check: bool = True,
                       max_warp_instructions: int = 200_000_000, more_params=None):
    """o, lse (float64) and the LaunchStats of forward entry `name` (it takes FwdParams: the dense
    kernels of fwd.cuh and hopper/fwd.cuh) on q/k/v, one CTA per `rows_per_block` query rows.
    more_params(q, k, v, o): the raw parameters after FwdParams (hopper/fwd.cuh's tensor maps),
    made from the arrays the kernel reads and writes."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    dt = NP_DTYPES[dtype]
    q, k, v = (np.ascontiguousarray(x, dt) for x in (q, k, v))
    o = np.full(q.shape, np.nan, dt)
    lse = np.full((b, hq, sq), np.nan, np.float32)
    mem = GlobalMemory()
    for label, a in (("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse)):
        mem.add(a.ctypes.data, a.nbytes, label)
    scale = np.float32(1 / np.sqrt(d))
    lo, hi = (-_BAND_LIMIT, 0) if causal else (-_BAND_LIMIT, _BAND_LIMIT)
    params = struct.pack("<5Q6i3i4f", q.ctypes.data, k.ctypes.data, v.ctypes.data, o.ctypes.data,
                         lse.ctypes.data, b, sq, sk, hq, hkv, hq // hkv, lo, hi, int(causal), scale,
                         np.float32(scale * _LOG2E), 0.0, 0.0)
    kparam = module.kernels[name].params[0]
    params = params.ljust(kparam.size, b"\0")
    assert len(params) == kparam.size == 96, "FwdParams changed: update emulated_dense.py"
    extra = list(more_params(q, k, v, o)) if more_params else []
    stats = launch(module, name, (-(-sq // rows_per_block), hq, b), (threads, 1, 1), smem, [params, *extra], mem,
                   arch=arch, seed=seed, race_check=race_check, max_warp_instructions=max_warp_instructions)
    return o.astype(np.float64), lse.astype(np.float64), stats


def bwd_config(dtype: str, head_dim: int):
    """(threads, BC, NSPLIT, smem bytes) of BwdConfig<T, D> in bwd.cuh."""
    f32 = dtype == "f32"
    warps = (4 if head_dim <= 192 else 2) if f32 else 4
    bc, br = warps * 16, (32 if f32 else 64)
    pad = 16 // (4 if f32 else 2)
    ld, lds = head_dim + pad, br + pad
    esz = 4 if f32 else 2
    smem = (2 * bc + 2 * br) * ld * esz + bc * lds * esz + 2 * br * 4
    return warps * 32, bc, (2 if head_dim > 128 else 1), smem


def run_dense_backward(module: PtxModule, q, k, v, do, *, causal: bool, dtype: str, arch: str = "sm80",
                       seed: int | None = None, main=None, max_warp_instructions: int = 200_000_000):
    """dq, dk, dv (float64) from the pre / main / convert kernels (bf16/f16, heads_q == heads_kv).

    o and lse come from the float64 reference (rounded like the forward's outputs), so the
    backward is checked on its own. main: (entry, threads, keys per CTA, column splits, smem
    bytes) of another main kernel taking BwdParams (the sm90a hopper_bwd_kernel); default the
    dense flash_bwd_kernel. max_warp_instructions: the main kernel's budget (a deadlocked
    mutant spins into it).
    """
    from flashgen import reference
    b, sq, h, d = q.shape
    sk = k.shape[1]
    dt = NP_DTYPES[dtype]
    assert dtype != "f32" and k.shape[2] == h
    q, k, v, do = (np.ascontiguousarray(x, dt) for x in (q, k, v, do))
    ro, rlse = reference.attention(q, k, v, causal=causal)[:2]
    o = np.ascontiguousarray(ro, dt)  # astype keeps a transposed view's strides
    lse = np.ascontiguousarray(rlse, np.float32)
    dsum = np.full((b, h, sq), np.nan, np.float32)
    dq_acc = np.zeros((b, sq, h, d), np.float32)
    dq, dk, dv = (np.full(x.shape, np.nan, dt) for x in (q, k, v))
    mem = GlobalMemory()
    arrays = dict(q=q, k=k, v=v, do=do, o=o, lse=lse, dsum=dsum, dq_acc=dq_acc, dq=dq, dk=dk, dv=dv)
    for name, a in arrays.items():
        mem.add(a.ctypes.data, a.nbytes, name)
    total = []
    rows = b * sq * h
    cpr = d * 2 // 16
    lanes = 32 if cpr >= 32 else 16 if cpr >= 16 else 8 if cpr >= 8 else 4
    pre = kernel_name(module, "flash_bwd_pre_kernel")
    total.append(launch(module, pre, (-(-rows // (256 // lanes)), 1, 1), (256, 1, 1), 0,
                        [struct.pack("<Q", o.ctypes.data), struct.pack("<Q", do.ctypes.data),
                         struct.pack("<Q", dsum.ctypes.data), struct.pack("<q", rows), struct.pack("<i", sq),
                         struct.pack("<i", h)], mem, arch=arch, seed=seed))
    scale = np.float32(1 / np.sqrt(d))
    lo, hi = (-_BAND_LIMIT, 0) if causal else (-_BAND_LIMIT, _BAND_LIMIT)
    params = struct.pack("<11Q9i5fi", q.ctypes.data, k.ctypes.data, v.ctypes.data, do.ctypes.data, lse.ctypes.data,
                         dsum.ctypes.data, dq_acc.ctypes.data, 0, 0, dk.ctypes.data, dv.ctypes.data,
                         b, sq, sk, h, h, 1, lo, hi, int(causal), scale, np.float32(scale * _LOG2E), 0.0, 0.0, 0.0, 0)
    name, threads, bc, nsplit, smem = main or (kernel_name(module, "flash_bwd_kernel", 0), *bwd_config(dtype, d))
    size = module.kernels[name].params[0].size
    params = params.ljust(size, b"\0")
    assert len(params) == size == 152, "BwdParams changed: update emulated_dense.py"
    total.append(launch(module, name, (-(-sk // bc) * nsplit, h, b), (threads, 1, 1), smem, [params], mem,
                        arch=arch, seed=seed, max_warp_instructions=max_warp_instructions))
    n = dq_acc.size
    conv = kernel_name(module, "flash_bwd_convert_kernel")
    total.append(launch(module, conv, (max(1, -(-(n // 4) // 256)), 1, 1), (256, 1, 1), 0,
                        [struct.pack("<Q", dq_acc.ctypes.data), struct.pack("<Q", dq.ctypes.data),
                         struct.pack("<q", n)], mem, arch=arch, seed=seed))
    return (dq.astype(np.float64), dk.astype(np.float64), dv.astype(np.float64)), total
