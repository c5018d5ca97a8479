"""The FP8 (e4m3) forward: csrc/flashgen/cuda/hopper/fwd.cuh's kernel with T = e4m3 run on the CPU
through its FFI handler under the emulator (sm90a), against flashgen.reference.attention_fp8
(float64 on the dequantized inputs), and the API's refusals.

Inputs are quantized as users do: real values x ~ N(0, sigma) stored as e4m3(x / descale) with
descale = amax / 448, so the stored values span e4m3's range and the descales are far from 1.

Tolerance (derived, elementwise). The scores are exact (e4m3 products are exact, the f32 sum
rounds once per step), so lse's error is f32 rounding: 1e-5 relative. o: the kernel rounds
each probability p_j = exp(s_j - m) <= 1 to e4m3 before P V (3 mantissa bits: relative error
<= 2^-4 for p >= 2^-6, the smallest normal; absolute <= 2^-10, half the subnormal spacing,
below it) and divides by l = sum p_j of the unrounded ones, so
    |o - o_ref| <= v_descale * sum_j (2^-4 p_j + 2^-10) |v_j| / l
(running maxima only shrink the absolute term), plus bf16's rounding of o (2^-8 |o|). A
descale applied twice or not at all moves o or lse far past this bound (test_descale_mutations).
"""
import functools

import ml_dtypes
import numpy as np
import pytest

from conftest import needs_nvcc
from flashgen import reference
from flashgen.build import build
from flashgen.contract import CallAttributes
from flashgen.emulate.host import EmulatedLibrary, HandlerError
from flashgen.spec import KernelSpec

E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = 448.0
# One library with both specs (one build, ~1 min on 2 cores): causal d64 and non-causal d128.
SPECS = (KernelSpec(64, "e4m3", True, "sm90a"), KernelSpec(128, "e4m3", False, "sm90a"))


@functools.cache
def _library(specs=SPECS) -> EmulatedLibrary:
    return EmulatedLibrary(build(list(specs), host="emulate"))


def quantize(rng, shape, sigma):
    """(e4m3 values, their f32 [1] descale): x ~ N(0, sigma) scaled to e4m3's range."""
    x = rng.standard_normal(shape) * sigma
    descale = np.float32(np.abs(x).max() / E4M3_MAX)
    return (x / descale).astype(E4M3), np.array([descale], np.float32)


def run(spec, q, k, v, descales, library=None, **attrs):
    b, sq, hq, d = q.shape
    scale = float(np.float32(1 / np.sqrt(d)))
    values = CallAttributes(spec.causal, scale, **attrs).values("fwd")
    library = library or _library(SPECS if spec in SPECS else (spec,))
    (o, lse), record = library.call(spec.target_name("fwd"), [q, k, v, *descales],
                                    [((b, sq, hq, d), ml_dtypes.bfloat16), ((b, hq, sq), np.float32)], **values)
    # the Hopper forward's one template, instantiated for e4m3
    assert ["17hopper_fwd_kernelI13__nv_fp8_e4m3" in l.entry for l in record.launches] == [True], record.launches
    return o.astype(np.float64), lse.astype(np.float64), scale


def o_bound(q, k, v, descales, scale, causal, bottom_right=False, window=(-1, -1)):
    """The elementwise bound of the module docstring on |o - o_ref|."""
    qd, kd, vd = (np.asarray(q, np.float64) * descales[0][0], np.asarray(k, np.float64) * descales[1][0],
                  np.asarray(v, np.float64) * descales[2][0])
    group = q.shape[2] // k.shape[2]
    kr, vr = np.repeat(kd, group, axis=2), np.repeat(vd, group, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", qd, kr) * scale
    visible = reference.mask(q.shape[1], k.shape[1], causal, bottom_right, window)[None, None]
    s = np.where(visible, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    p = np.where(visible, np.exp(s - np.where(np.isfinite(m), m, 0)), 0.0)
    l = p.sum(-1, keepdims=True)
    weight = np.where(visible, 2.0 ** -4 * p + 2.0 ** -10, 0.0) / np.where(l > 0, l, 1)
    return np.einsum("bhqk,bkhd->bqhd", weight, np.abs(vr))


def errors(o, lse, ref, bound):
    """(largest |o - o_ref| / bound, largest lse error relative to max(1, |lse|)); inf for a
    non-finite mismatch."""
    ro, rl = ref[0], ref[1]
    finite = np.isfinite(rl)
    if not np.array_equal(lse[~finite], rl[~finite]) or not np.isfinite(o).all():
        return np.inf, np.inf
    o_err = np.abs(o - ro) / (bound + 2.0 ** -8 * np.abs(ro) + 1e-30)
    lse_err = np.abs(lse[finite] - rl[finite]).max(initial=0) / max(1.0, np.abs(rl[finite]).max(initial=0))
    return float(o_err.max()), float(lse_err)


LSE_TOL = 1e-5


@needs_nvcc
@pytest.mark.parametrize("spec,case", [
    # ragged, Sq < Sk, GQA, two batches; causal masks and skips blocks
    (SPECS[0], dict(b=2, sq=77, sk=130, hq=4, hkv=2)),
    # bottom-right, Sq > Sk: the first 85 rows see no key (o = 0, lse = -inf)
    (SPECS[0], dict(b=1, sq=130, sk=45, hq=2, hkv=1, bottom_right=True)),
    (SPECS[1], dict(b=1, sq=65, sk=100, hq=2, hkv=1)),
    (SPECS[1], dict(b=1, sq=70, sk=90, hq=2, hkv=1, window=(8, 5))),  # sliding window: blocks skipped, edges masked
    (SPECS[0], dict(b=1, sq=40, sk=0, hq=2, hkv=1)),  # no keys: o = 0, lse = -inf everywhere
    # a build each (about a minute on 2 cores): not in CI
    pytest.param(KernelSpec(128, "e4m3", True, "sm90a"), dict(b=1, sq=100, sk=70, hq=2, hkv=2),
                 marks=pytest.mark.slow),
    pytest.param(KernelSpec(256, "e4m3", True, "sm90a"), dict(b=1, sq=70, sk=90, hq=2, hkv=1, bottom_right=True),
                 marks=pytest.mark.slow),
    # three 64-column panels; 3 key blocks: the 2-stage ring wraps
    pytest.param(KernelSpec(192, "e4m3", False, "sm90a"), dict(b=1, sq=90, sk=150, hq=2, hkv=1),
                 marks=pytest.mark.slow),
], ids=["d64-causal-gqa-sq<sk", "d64-causal-bottom-right-sq>sk", "d128-full", "d128-window", "d64-no-keys",
        "d128-causal-sq>sk",
        "d256-causal-bottom-right", "d192-full"])
def test_fp8_forward_matches_float64(rng, spec, case):
    b, sq, sk, hq, hkv, d = case["b"], case["sq"], case["sk"], case["hq"], case["hkv"], spec.head_dim
    bottom_right, window = case.get("bottom_right", False), case.get("window", (-1, -1))
    q, qs = quantize(rng, (b, sq, hq, d), 1.5)
    k, ks = quantize(rng, (b, max(sk, 1), hkv, d), 1.5)
    v, vs = quantize(rng, (b, max(sk, 1), hkv, d), 3.0)
    k, v = k[:, :sk], v[:, :sk]
    descales = (qs, ks, vs)
    o, lse, scale = run(spec, q, k, v, descales, bottom_right=bottom_right, window=window)
    ref = reference.attention_fp8(q, k, v, *descales, causal=spec.causal, scale=scale, bottom_right=bottom_right,
                                  window=window)
    o_err, lse_err = errors(o, lse, ref, o_bound(q, k, v, descales, scale, spec.causal, bottom_right, window))
    print(f"{spec.stem} {case}: o error {o_err:.3f} of the bound, lse error {lse_err:.2e}")
    assert o_err <= 1 and lse_err <= LSE_TOL
    if sk:  # the P rounding shows (the check is not vacuous): o is not bf16-exact
        assert np.abs(o - ref[0]).max() > 2.0 ** -8 * np.abs(ref[0]).max()
    else:
        assert (o == 0).all() and (lse == -np.inf).all()


@needs_nvcc
def test_descale_mutations_are_caught(rng):
    # A kernel that applies a descale twice or drops it computes the reference of those
    # descales; the check must reject each against the kernel's real output.
    spec = SPECS[0]
    q, qs = quantize(rng, (1, 70, 2, 64), 1.5)
    k, ks = quantize(rng, (1, 90, 1, 64), 1.5)
    v, vs = quantize(rng, (1, 90, 1, 64), 3.0)
    descales = (qs, ks, vs)
    o, lse, scale = run(spec, q, k, v, descales)
    ok = errors(o, lse, reference.attention_fp8(q, k, v, *descales, causal=True, scale=scale),
                o_bound(q, k, v, descales, scale, True))
    assert ok[0] <= 1 and ok[1] <= LSE_TOL
    for i, name in enumerate(("q", "k", "v")):
        for how, wrong in (("twice", descales[i] ** 2), ("missing", np.ones(1, np.float32))):
            mutated = list(descales)
            mutated[i] = wrong
            ref = reference.attention_fp8(q, k, v, *mutated, causal=True, scale=scale)
            o_err, lse_err = errors(o, lse, ref, o_bound(q, k, v, mutated, scale, True))
            assert o_err > 1 or lse_err > LSE_TOL, f"{name}_descale {how} not caught"


# One-line bugs planted in what the FP8 path adds to hopper/fwd.cuh (test_hopper_mutations' harness,
# a copy of csrc/): each must raise an EmulationError or break the bound.
FP8_MUTATIONS = [
    ("v_transposed_in_natural_key_order", "fwd.cuh",
     "const int key = row0 + 16 * group + 2 * t + (e % 2) + 8 * (e / 2);", "const int key = row0 + 4 * quad + e;"),
    ("full_barrier_counts_only_the_tma_thread", "fwd.cuh", "Elem::kFp8 ? 1 + 128 : 1", "1"),
    ("missing_proxy_fence_after_v_transpose", "fwd.cuh",
     "        sm90::fence_proxy_async();  // V^T's generic writes, before the consumers' wgmmas read them\n", ""),
]


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("name,header,old,new", FP8_MUTATIONS, ids=[m[0] for m in FP8_MUTATIONS])
def test_mutation_is_caught(tmp_path, rng, monkeypatch, name, header, old, new):
    from flashgen import resources
    from test_hopper_mutations import TOLERANCE, _assert_caught
    spec = SPECS[0]
    _library()  # the unmutated emulation runtime first: a mutant's library binds to its symbols
    q, qs = quantize(rng, (1, 130, 2, 64), 1.5)
    k, ks = quantize(rng, (1, 150, 1, 64), 1.5)
    v, vs = quantize(rng, (1, 150, 1, 64), 3.0)
    descales = (qs, ks, vs)

    def errors_of(csrc):
        monkeypatch.setattr(resources, "csrc_dir", lambda: csrc)
        o, lse, scale = run(spec, q, k, v, descales, library=EmulatedLibrary(build([spec], host="emulate")))
        ref = reference.attention_fp8(q, k, v, *descales, causal=True, scale=scale)
        o_err, lse_err = errors(o, lse, ref, o_bound(q, k, v, descales, scale, True))
        return [o_err * TOLERANCE, lse_err / LSE_TOL * TOLERANCE]  # > TOLERANCE: past this module's bounds
    _assert_caught(tmp_path, name, header, old, new, errors_of)


@needs_nvcc
@pytest.mark.parametrize("operands,attrs,message", [
    ("descale [2]", {}, r"q_descale has shape \[2\], expected \[1\]"),
    ("", dict(softcap=2.0), "the FP8 forward has no softcap"),
    ("extra alibi", dict(extras="alibi"), "the FP8 forward takes no extras"),
], ids=["descale-shape", "softcap", "extras"])
def test_handler_refuses_bad_calls(rng, operands, attrs, message):
    spec = SPECS[0]
    q, qs = quantize(rng, (1, 16, 2, 64), 1.0)
    descales = [qs, qs, qs]
    if operands == "descale [2]":
        descales[0] = np.ones(2, np.float32)
    extra = [np.ones(2, np.float32)] if operands == "extra alibi" else []
    values = {**CallAttributes(True, 0.125).values("fwd"), **attrs}
    with pytest.raises(HandlerError, match=message):
        _library().call(spec.target_name("fwd"), [q, q, q, *descales, *extra],
                        [((1, 16, 2, 64), ml_dtypes.bfloat16), ((1, 2, 16), np.float32)], **values)


def test_spec_refuses_targets_and_head_dims_without_fp8_kernels():
    for target in ("cpu", "sm80"):
        with pytest.raises(ValueError, match=f"kernels only for target.*sm90a, not {target}"):
            KernelSpec(64, "e4m3", False, target)
    with pytest.raises(ValueError, match="head dims 64, 128, 192, 256"):
        KernelSpec(96, "e4m3", False, "sm90a")
    assert KernelSpec(128, "float8_e4m3fn", True, "sm90a").directions == ("fwd",)
    with pytest.raises(ValueError, match="direction must be one of"):
        KernelSpec(128, "e4m3", True, "sm90a").target_name("bwd")


def test_emit_checks_operand_types():
    from jaxlib.mlir import ir
    from flashgen.emit import attention_module, result_types
    from flashgen.mlir_context import new_context
    spec = KernelSpec(64, "e4m3", True, "sm90a")
    text = str(attention_module(spec, batch=1, seq_q=8, seq_k=8, heads=2))
    assert "tensor<1x8x2x64xf8E4M3FN>, tensor<1xf32>, tensor<1xf32>, tensor<1xf32>) -> " \
           "(tensor<1x8x2x64xbf16>, tensor<1x2x8xf32>)" in text
    with new_context(), ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            f8 = ir.RankedTensorType.get([1, 8, 2, 64], ir.Type.parse("f8E4M3FN"))
            bf = ir.RankedTensorType.get([1, 8, 2, 64], ir.BF16Type.get())
            one, two = (ir.RankedTensorType.get([n], ir.F32Type.get()) for n in (1, 2))
            from jaxlib.mlir.dialects import func
            fn = func.FuncOp("f", ir.FunctionType.get([f8, bf, one, two], []))
            a = fn.add_entry_block().arguments
            with pytest.raises(ValueError, match="k has element type bf16, the spec needs e4m3"):
                result_types(spec, "fwd", [a[0], a[1], a[0], a[2], a[2], a[2]])
            with pytest.raises(ValueError, match="v_descale has type tensor<2xf32>, expected tensor<1xf32>"):
                result_types(spec, "fwd", [a[0], a[0], a[0], a[2], a[2], a[3]])


def test_jax_api(monkeypatch):
    import jax
    import jax.numpy as jnp
    from flashgen import runtime
    from flashgen.jax import attention
    q = jnp.ones((1, 8, 2, 64), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="kernels only for target.*sm90a, not cpu"):  # this machine's target
        attention.flash_attention(q, q, q, q_descale=0.5)
    with pytest.raises(TypeError, match="must share one dtype"):
        attention.flash_attention(q, q.astype(jnp.bfloat16), q)
    with pytest.raises(ValueError, match=r"descale factors \(q_descale\) apply to float8_e4m3fn inputs only"):
        attention.flash_attention(*(q.astype(jnp.bfloat16),) * 3, q_descale=1.0)
    with pytest.raises(ValueError, match=r"k_descale must be a scalar or shape \[1\]"):
        attention.flash_attention(q, q, q, k_descale=jnp.ones(2))
    with pytest.raises(ValueError, match="takes no bias, mask"):
        attention.flash_attention(q, q, q, softcap=2.0)
    # As on an H100: the call's operands and result types, and no gradient.
    monkeypatch.setattr(attention, "local_target", lambda: "sm90a")
    monkeypatch.setattr(runtime, "ensure", lambda specs: None)
    f = lambda q, s: attention.flash_attention(q, q, q, causal=True, q_descale=s, v_descale=[0.5])  # noqa: E731
    text = jax.jit(f).lower(q, jnp.float32(0.25)).as_text()
    assert "@flashgen_fwd_d64_e4m3_causal(" in text
    assert "tensor<1xf32>, tensor<1xf32>, tensor<1xf32>) -> (tensor<1x8x2x64xbf16>, tensor<1x2x8xf32>)" in text
    with pytest.raises(NotImplementedError, match="forward-only"):
        jax.jit(jax.grad(lambda q: f(q, 1.0).astype(jnp.float32).sum())).lower(q)


def test_emulated_fp8_a_fragment_is_cutes():
    # The kernel's P fragment relies on the emulator's e4m3 A-register layout; it must be CuTe's
    # ALayout_64x32 (cute/atom/mma_traits_sm90_gmma.hpp, nvidia-cutlass 4.2.0.0):
    # (thread, value) -> m + 64 k, Shape ((4, 8, 4), (4, 2, 2)), Stride ((256, 1, 16), (64, 8, 1024));
    # value v is byte v % 4 of register v // 4.
    from flashgen.emulate.semantics.wgmma import a_register_table
    row, col = a_register_table("e4m3")  # [lane, register, byte] -> (row within the warp's 16, k)
    for tid in range(128):
        for v in range(16):
            idx = (256 * (tid % 4) + (tid // 4) % 8 + 16 * (tid // 32)
                   + 64 * (v % 4) + 8 * ((v // 4) % 2) + 1024 * (v // 8))
            lane, reg, byte = tid % 32, v // 4, v % 4
            assert (16 * (tid // 32) + row[lane, reg, byte], col[lane, reg, byte]) == (idx % 64, idx // 64)


def test_rendered_handler_binds_the_fp8_call():
    # The one handler of an e4m3 spec binds contract.FP8_CALLS["fwd"] in order, decoded by call.h's FwdFp8Call.
    import re
    from flashgen import codegen, contract
    from flashgen.spec import FFI_DTYPES
    spec = KernelSpec(128, "e4m3", True, "sm90a")
    text = codegen.render_spec(spec).text
    (symbol, call_type, body), = re.findall(
        r"XLA_FFI_DEFINE_HANDLER_SYMBOL\((\w+), \(.*?flashgen::(\w+)>\{\"\w+\"\}\),(.*?)\);", text, re.S)
    ffi = lambda o: FFI_DTYPES[spec.dtype] if o.dtype == "T" else {"f32": "F32", "bf16": "BF16"}[o.dtype]  # noqa: E731
    call = contract.FP8_CALLS["fwd"]
    assert (symbol, call_type) == ("flashgen_fwd_d128_e4m3_causal", "FwdFp8Call")
    assert re.findall(r"\.Arg<ffi::Buffer<ffi::DataType::(\w+)>>\(\)\s*// (\w+)", body) == \
        [(ffi(o), o.name) for o in call.operands]
    assert re.findall(r"\.Ret<ffi::Buffer<ffi::DataType::(\w+)>>\(\)\s*// (\w+)", body) == \
        [(ffi(o), o.name) for o in call.results]


# The two instructions the FP8 kernel brought to the emulator, against their PTX ISA definitions:
# cvt.rn.satfinite.e4m3x2.f32 (through the kernel's own sm90::pack_e4m3x4) and prmt.b32 (what
# nvcc makes of the V transpose's byte shuffles).
FP8_MICRO = r"""
#include "flashgen/cuda/hopper/sm90.cuh"
extern "C" __global__ void pack_e4m3(const float* x, unsigned* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = flashgen::cuda::sm90::pack_e4m3x4(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3]);
}
extern "C" __global__ void permute_bytes(const unsigned* a, const unsigned* b, const unsigned* s, unsigned* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  unsigned d;
  if (i < n) {
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a[i]), "r"(b[i]), "r"(s[i]));
    out[i] = d;
  }
}
"""


@needs_nvcc
def test_emulated_e4m3_pack_and_prmt(rng):
    from flashgen.emulate import GlobalMemory, PtxModule, launch
    from flashgen.emulate.nvcc import compile_ptx
    import struct
    module = PtxModule.parse(compile_ptx(FP8_MICRO, "sm90a"))

    def call(name, arrays, n):
        mem, params = GlobalMemory(), []
        for i, a in enumerate(arrays):
            mem.add(a.ctypes.data, a.nbytes, f"arg{i}")
            params.append(struct.pack("<Q", a.ctypes.data))
        launch(module, name, (-(-n // 64), 1, 1), (64, 1, 1), 0, params + [struct.pack("<i", n)], mem, arch="sm90a")

    # round to nearest even (ties included), subnormals, saturation of finite and infinite values
    # to +-448, NaN kept, -0
    edge = np.array([0.0, -0.0, 1.0, 1.0625, 1.1875, 0.3, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -11,
                     448.0, 464.0, 480.0, 1e9, -1e9, np.inf, -np.inf, np.nan, -1.5, 300.0], np.float32)
    x = np.concatenate([edge, (rng.standard_normal(236) * rng.choice([1e-3, 1.0, 100.0, 1e3], 236)).astype(np.float32)])
    out = np.full(x.size // 4, 0xDEADBEEF, np.uint32)
    call("pack_e4m3", [x, out], out.size)
    got = out.view(np.uint8).view(E4M3).astype(np.float32)  # byte i of word w: element 4 w + i
    want = np.clip(x, -E4M3_MAX, E4M3_MAX).astype(E4M3).astype(np.float32)
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    assert (got[~nan].view(np.uint32) == want[~nan].view(np.uint32)).all()  # -0 stays -0

    n = 256
    a, b = (rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32) for _ in range(2))
    s = rng.integers(0, 2 ** 16, n, dtype=np.uint64).astype(np.uint32)  # selector nibbles 0-15 (bit 3: sign)
    out = np.zeros(n, np.uint32)
    call("permute_bytes", [a, b, s, out], n)
    source = np.stack([a, b], 1).view(np.uint8)  # bytes 0-3 of a, then 4-7 of b
    want = np.zeros(n, np.uint32)
    for i in range(4):
        nib = (s >> (4 * i)) & 0xF
        byte = source[np.arange(n), nib & 7].astype(np.uint32)
        byte = np.where(nib & 8, np.where(byte & 0x80, 0xFF, 0), byte)
        want |= byte.astype(np.uint32) << np.uint32(8 * i)
    assert (out == want).all()


@needs_nvcc
@pytest.mark.slow
def test_static_budget_no_spills(tmp_path):
    # The FP8 register split (HopperFwdConfig: setmaxnreg 40 for the producer warpgroup, which also
    # transposes V, and 232 per consumer) must hold every e4m3 instantiation without spills; the
    # emulator does not see ptxas's allocation.
    import pathlib
    import re
    import subprocess
    from flashgen import toolchain
    from flashgen.emulate.nvcc import compile_ptx
    from flashgen.spec import FP8_HEAD_DIMS
    kernels = ", ".join(f"(void*)&flashgen::cuda::hopper_fwd_kernel<__nv_fp8_e4m3, {d}, {str(d % 128 == 0).lower()}>"
                        for d in FP8_HEAD_DIMS)
    ptx = tmp_path / "fp8.ptx"
    ptx.write_text(compile_ptx(f'#include "flashgen/cuda/hopper/fwd.cuh"\nvoid* kernels[] = {{{kernels}}};\n', "sm90a",
                               name="hopper_fwd_fp8_static.cu"))
    out = subprocess.run([str(pathlib.Path(toolchain.nvcc()).parent / "ptxas"), "-arch=sm_90a", "-v", str(ptx),
                          "-o", str(tmp_path / "fp8.cubin")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    print(out.stderr)
    assert re.findall(r"(\d+) bytes spill stores", out.stderr) == ["0"] * len(FP8_HEAD_DIMS)
