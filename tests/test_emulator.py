"""The PTX emulator's self-checks: real kernels against float64, fragment tables against CuTe,
one-instruction micro-kernels (tests/emulator/micro.cu, compiled by nvcc) against numpy and
ml_dtypes, and every failure mode triggered by a tiny kernel."""
from __future__ import annotations

import itertools
import pathlib
import struct

import ml_dtypes
import numpy as np
import pytest

from conftest import needs_nvcc
from flashgen import reference
from flashgen.emulate import EmulationError, GlobalMemory, PtxModule, launch
from flashgen.emulate.semantics import warpops

MICRO = pathlib.Path(__file__).parent / "emulator" / "micro.cu"


# ---------------------------------------------------------------------------------------------
# Fragment and ldmatrix tables against CuTe's (thread, value) layouts. Numbers transcribed from
# CUTLASS include/cute/atom/mma_traits_sm80.hpp (SM80_16x8x16_F16F16F16F16_TN, reused by the
# F32BF16BF16F32 / F32F16F16F32 traits; SM80_16x8x8_F32TF32TF32F32_TN; SM80_16x8_Row) and
# include/cute/atom/copy_traits_sm75.hpp (SM75_U32x{1,2,4}_LDSM_N, SM75_U16x{2,4,8}_LDSM_T).
# ---------------------------------------------------------------------------------------------
def cute_layout(shape, stride):
    """f(thread, value) -> index of a CuTe layout ((thread modes), (value modes)); modes are
    decomposed colexicographically (first mode fastest), as CuTe does."""
    def mode(i, shp, std):
        shp, std = (shp, std) if isinstance(shp, tuple) else ((shp,), (std,))
        out = 0
        for s, d in zip(shp, std):
            out += (i % s) * d
            i //= s
        return out
    return lambda t, v: mode(t, shape[0], stride[0]) + mode(v, shape[1], stride[1])


def test_mma_fragment_tables_equal_cute():
    for atype, k, a_cute, b_cute in (
        ("bf16", 16, (((4, 8), (2, 2, 2)), ((32, 1), (16, 8, 128))), (((4, 8), (2, 2)), ((16, 1), (8, 64)))),
        ("f16", 16, (((4, 8), (2, 2, 2)), ((32, 1), (16, 8, 128))), (((4, 8), (2, 2)), ((16, 1), (8, 64)))),
        ("tf32", 8, (((4, 8), (2, 2)), ((16, 1), (8, 64))), (((4, 8), 2), ((8, 1), 32))),
    ):
        A, B = cute_layout(*a_cute), cute_layout(*b_cute)
        ar, ac = warpops.mma_a_table(k, atype)          # [lane, reg, half]
        br, bc = warpops.mma_b_table(k, atype)
        per_reg = ar.shape[2]
        for lane, reg, h in itertools.product(range(32), range(ar.shape[1]), range(per_reg)):
            idx = A(lane, reg * per_reg + h)            # CuTe A is (M, K), column-major
            assert (ar[lane, reg, h], ac[lane, reg, h]) == (idx % 16, idx // 16), (atype, lane, reg, h)
        for lane, reg, h in itertools.product(range(32), range(br.shape[1]), range(per_reg)):
            idx = B(lane, reg * per_reg + h)            # CuTe B is (N, K): n = idx % 8, k = idx // 8
            assert (br[lane, reg, h], bc[lane, reg, h]) == (idx // 8, idx % 8), (atype, lane, reg, h)
    C = cute_layout(((4, 8), (2, 2)), ((32, 1), (16, 8)))    # SM80_16x8_Row, (M16, N8)
    cr, cc = warpops.mma_c_table()
    for lane, reg in itertools.product(range(32), range(4)):
        assert (cr[lane, reg], cc[lane, reg]) == (C(lane, reg) % 16, C(lane, reg) // 16)


# (trans, number of matrices, DstLayout of SM75_U32x{1,2,4}_LDSM_N / SM75_U16x{2,4,8}_LDSM_T)
LDSM_DST_LAYOUTS = [
    (False, 1, ((32, 32), (32, 1))),
    (False, 2, ((32, (32, 2)), (32, (1, 1024)))),
    (False, 4, ((32, (32, 4)), (32, (1, 1024)))),
    (True, 1, (((4, 8), (16, 2)), ((256, 16), (1, 128)))),
    (True, 2, (((4, 8), (16, 2, 2)), ((256, 16), (1, 128, 1024)))),
    (True, 4, (((4, 8), (16, 2, 4)), ((256, 16), (1, 128, 1024)))),
]


@pytest.mark.parametrize("trans,nmat,cute", LDSM_DST_LAYOUTS)
def test_ldmatrix_table_equals_cute(trans, nmat, cute):
    # DstLayout maps (lane, value bit) to a bit of the nmat 8x8 b16 matrices (1024 bits each,
    # row-major: row r, column c at bit 128 r + 16 c).
    dst = cute_layout(*cute)
    rows, cols = warpops.ldmatrix_table(trans)
    for lane, j, h in itertools.product(range(32), range(nmat), range(2)):
        bit = dst(lane, 32 * j + 16 * h)
        assert (bit // 1024, bit % 1024 // 128, bit % 128 // 16) == (j, rows[lane, h], cols[lane, h])


# ---------------------------------------------------------------------------------------------
# Micro-kernels
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def micro():
    from flashgen.emulate.nvcc import compile_ptx
    return PtxModule.parse(compile_ptx(MICRO, "sm80"))


@pytest.fixture(scope="module")
def micro_sm90():
    from flashgen.emulate.nvcc import compile_ptx
    return PtxModule.parse(compile_ptx(MICRO, "sm90a"))


def run(module, name, args, grid=(1, 1, 1), block=(32, 1, 1), smem=0, arch="sm80", device=(), **kw):
    """Launch `name` with numpy arrays (registered as device memory, passed as pointers), bytes
    (passed by value: a struct parameter) and Python scalars (packed by the parameter's PTX type);
    `device`: more arrays the kernel reaches through those (registered, not passed)."""
    kernel = module.kernel(name)
    mem = GlobalMemory()
    for i, a in enumerate(device):
        mem.add(a.ctypes.data, a.nbytes, f"device{i}")
    params = []
    for i, (p, a) in enumerate(zip(kernel.params, args)):
        if isinstance(a, np.ndarray):
            mem.add(a.ctypes.data, a.nbytes, f"arg{i}")
            params.append(struct.pack("<Q", a.ctypes.data))
        elif isinstance(a, bytes):
            params.append(a)
        else:
            params.append(struct.pack({"u32": "<I", "s32": "<i", "f32": "<f", "u64": "<Q"}[p.ptx_type], a))
    return launch(module, name, grid, block, smem, params, mem, arch=arch, **kw)


def special_f32(rng, n):
    """Random f32 values plus the edge cases of rounding: ties (even and odd), ±inf, NaN, ±0,
    subnormals, the largest finite values."""
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    edge = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F80_1000, 0x3F80_3000, 0x7F7FFFFF, 0xFF7FFFFF,
                     0x7F800000, 0xFF800000, 0x7FC00000, 0xFFFFFFFF, 0, 0x80000000, 0x00000001, 0x807FFFFF,
                     0x477FF000, 0x477FE000, 0x38800000, 0x33800000, 0x33000000], np.uint32)
    return np.concatenate([edge, bits]).view(np.float32)


def same_bits_or_both_nan(got, want):
    got, want = np.asarray(got), np.asarray(want)
    nan = np.isnan(want.astype(np.float32))
    assert (np.isnan(got.astype(np.float32)) == nan).all()
    assert (got[~nan].view(np.uint8) == want[~nan].view(np.uint8)).all()


@needs_nvcc
@pytest.mark.parametrize("kernel,dtype", [("cvt_bf16x2", ml_dtypes.bfloat16), ("cvt_f16x2", np.float16)])
def test_cvt_pairs_round_to_nearest_even(micro, rng, kernel, dtype):
    a, b = special_f32(rng, 200), special_f32(rng, 220)[::-1][:220].copy()
    n = a.size
    b = b[:n].copy()
    out = np.full(2 * n, 0xFFFF, np.uint16)
    run(micro, kernel, [a, b, out, n], grid=(-(-n // 64), 1, 1), block=(64, 1, 1))
    pair = out.view(dtype).reshape(n, 2)
    with np.errstate(over="ignore", invalid="ignore"):
        want_a, want_b = a.astype(dtype), b.astype(dtype)
    same_bits_or_both_nan(pair[:, 0], want_a)   # .x (low half) = a
    same_bits_or_both_nan(pair[:, 1], want_b)


@needs_nvcc
def test_cvt_bf16_scalar(micro, rng):
    a = special_f32(rng, 100)
    out = np.zeros(a.size, np.uint16)
    run(micro, "cvt_bf16", [a, out, a.size], grid=(4, 1, 1), block=(64, 1, 1))
    same_bits_or_both_nan(out.view(ml_dtypes.bfloat16), a.astype(ml_dtypes.bfloat16))


@needs_nvcc
def test_cvt_tf32_rounds_ties_away(micro, rng):
    a = special_f32(rng, 300)
    out = np.zeros(a.size, np.uint32)
    run(micro, "cvt_tf32", [a, out, a.size], grid=(6, 1, 1), block=(64, 1, 1))
    got = out.view(np.float32)
    with np.errstate(invalid="ignore"):
        x = a.astype(np.float64)
    finite = np.isfinite(x)
    _, e = np.frexp(np.where(finite, x, 1.0))
    ulp = np.maximum(np.ldexp(1.0, e - 11), 2.0 ** -136)      # 10 mantissa bits (+ implicit)
    with np.errstate(over="ignore"):
        want = np.copysign(np.floor(np.abs(x) / ulp + 0.5) * ulp, x).astype(np.float32)
    want = np.where(finite, want, a)
    assert (out & 0x1FFF)[~np.isnan(a)].max() == 0
    same_bits_or_both_nan(got, want)


@needs_nvcc
def test_ex2_approx_and_rcp(micro, rng):
    x = np.concatenate([np.array([-np.inf, np.inf, np.nan, 0.0, -0.0, -126.5, -149.0, 127.9, 128.0],
                                 np.float32), rng.uniform(-30, 30, 200).astype(np.float32)])
    out = np.full(x.size, np.nan, np.float32)
    run(micro, "exp2_approx", [x, out, x.size], grid=(4, 1, 1), block=(64, 1, 1))
    assert out[0] == 0.0 and np.signbit(out[0]) == False  # ex2(-inf) = +0 (the masked-score case)
    assert out[1] == np.inf and np.isnan(out[2]) and out[3] == 1.0 and out[4] == 1.0
    assert out[5] == 0.0 and out[6] == 0.0                # .ftz: subnormal results flush to zero
    assert out[7] == np.float32(2.0 ** float(x[7])) and out[8] == np.inf
    want = np.exp2(x[9:].astype(np.float64))
    assert (np.abs(out[9:] - want) <= 2 * np.spacing(want.astype(np.float32))).all()   # 2 ulp
    y = special_f32(rng, 200)
    got = np.full(y.size, np.nan, np.float32)
    run(micro, "reciprocal", [y, got, y.size], grid=(4, 1, 1), block=(64, 1, 1))
    with np.errstate(divide="ignore", over="ignore"):
        same_bits_or_both_nan(got, np.float32(1) / y)     # rcp.rn: IEEE division


@needs_nvcc
def test_copysign_operand_order_and_tanh(micro, rng):
    a, b = rng.standard_normal(100).astype(np.float32), rng.standard_normal(100).astype(np.float32)
    b[:4] = [0.0, -0.0, np.inf, -np.inf]
    out = np.zeros(100, np.float32)
    run(micro, "copy_sign", [a, b, out, 100], grid=(2, 1, 1), block=(64, 1, 1))
    same_bits_or_both_nan(out, np.copysign(a, b))         # copysignf(a, b): |a| with b's sign
    x = np.concatenate([np.array([0.0, -0.0, np.inf, -np.inf, 1e-30, 20.0, -20.0], np.float32),
                        rng.uniform(-6, 6, 150).astype(np.float32)])
    t = np.full(x.size, np.nan, np.float32)
    run(micro, "tanh_f32", [x, t, x.size], grid=(3, 1, 1), block=(64, 1, 1))
    want = np.tanh(x.astype(np.float64))
    assert (np.abs(t - want) <= 4 * np.spacing(np.abs(want).astype(np.float32)) + 1e-45).all()


@needs_nvcc
@pytest.mark.parametrize("m", [1, 2, 7, 16, 31])
def test_shfl_bfly(micro, rng, m):
    a = rng.standard_normal(32).astype(np.float32)
    out = np.full(96, np.nan, np.float32)
    run(micro, "shuffle_xor", [a, out, m])
    lanes = np.arange(32)
    assert (out[:32] == a[lanes ^ m]).all()
    s1 = a + a[lanes ^ 1]
    assert (out[32:64] == s1 + s1[lanes ^ 2]).all()       # same f32 order of additions
    assert (out[64:] == np.maximum.reduceat(a, np.arange(0, 32, 4)).repeat(4)).all()


@needs_nvcc
def test_atomic_add_is_a_chain_per_address(micro, rng):
    n = 256
    a = rng.standard_normal(n).astype(np.float32)
    idx = rng.integers(0, 5, n).astype(np.int32)         # heavy contention on 5 addresses
    acc = rng.standard_normal(5).astype(np.float32)
    init = acc.copy()
    old = np.full(n, np.nan, np.float32)
    run(micro, "atomic_add", [a, idx, acc, old, n], grid=(4, 1, 1), block=(64, 1, 1))
    for slot in range(5):
        sel = idx == slot
        # Every add saw a distinct predecessor value: {init} + {old + a} == {old} + {final}.
        before = sorted([init[slot], *(old[sel] + a[sel]).tolist()])
        after = sorted([*old[sel].tolist(), acc[slot]])
        assert np.array_equal(np.float32(before), np.float32(after))
        assert abs(acc[slot] - (init[slot] + a[sel].astype(np.float64).sum())) < 1e-4


@needs_nvcc
def test_same_address_atomics_of_one_instruction_go_in_the_seeded_order(micro, rng):
    """The hardware orders one instruction's updates of an address in no defined way: the
    emulator's order is the schedule seed's, not lane order (which would make every schedule's
    f32 sums the same bits), and each order is still one chain."""
    a = rng.standard_normal(64).astype(np.float32)
    chains = set()
    for seed in range(4):
        acc, old = np.zeros(1, np.float32), np.full(64, np.nan, np.float32)
        run(micro, "atomic_add", [a, np.zeros(64, np.int32), acc, old, 64], block=(64, 1, 1), seed=seed)
        # one chain: every add saw a distinct predecessor value, {0} + {old + a} == {old} + {final}
        assert np.array_equal(np.sort(np.r_[np.float32(0), old + a]), np.sort(np.r_[old, acc]))
        chains.add(old.tobytes())
    assert len(chains) > 1, "same-address atomics apply in one order whatever the seed"


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm80", "sm90a"])
def test_pair_atomics_sum_exactly_per_address(micro, micro_sm90, rng, arch):
    module = micro if arch == "sm80" else micro_sm90
    vector_form = "atom.global.add.v2.f32" in " ".join(i.text for i in module.kernel("atomic_add_pairs").instructions)
    assert vector_form == (arch == "sm90a")
    n = 200
    a = rng.integers(-8, 8, (n, 2)).astype(np.float32)      # small integers: any order sums exactly
    idx = rng.integers(0, 3, n).astype(np.int32)
    acc = np.zeros((3, 2), np.float32)
    run(module, "atomic_add_pairs", [a, idx, acc, n], grid=(4, 1, 1), block=(64, 1, 1), arch=arch)
    assert (acc == np.array([a[idx == s].sum(0) for s in range(3)])).all()


@needs_nvcc
def test_ldmatrix_mma_bf16(micro, rng):
    a = rng.standard_normal((16, 16)).astype(ml_dtypes.bfloat16)
    bt = rng.standard_normal((8, 16)).astype(ml_dtypes.bfloat16)      # B^T: [n][k]
    d = np.full((16, 8), np.nan, np.float32)
    run(micro, "mma_bf16", [a, bt, d])
    want = a.astype(np.float64) @ bt.astype(np.float64).T
    assert np.abs(d - want).max() <= 1e-6 * np.abs(want).max()


def _c_div(x, y):
    q = abs(x) // abs(y)
    return q if (x < 0) == (y < 0) else -q


@needs_nvcc
def test_integer_semantics_match_c(micro, rng):
    n = 64
    a = rng.integers(-2**31, 2**31, n).astype(np.int32)
    b = rng.integers(-2**31, 2**31, n).astype(np.int32)
    a[:4], b[:4] = [-7, 7, -2**31, 5], [2, -2, 3, 63]
    b[b == 0] = 1
    c = rng.integers(-2**63, 2**63, n, dtype=np.int64)
    d = rng.integers(-2**40, 2**40, n, dtype=np.int64)
    d[d == 0] = 3
    o32, o64, ou = np.zeros(8 * n, np.int32), np.zeros(4 * n, np.int64), np.zeros(4 * n, np.uint32)
    run(micro, "int_ops", [a, b, c, d, o32, o64, ou], block=(n, 1, 1))
    wrap32 = lambda v: (v + 2**31) % 2**32 - 2**31
    for i in range(n):
        x, y, cx, dx = int(a[i]), int(b[i]), int(c[i]), int(d[i])
        q = _c_div(x, y)
        want32 = [wrap32(q), x - q * y if q == wrap32(q) else 0, _c_div(x, 7), x - _c_div(x, 7) * 7,
                  x >> (y & 31), min(x, y), (x * y) >> 32, wrap32(abs(x) - max(x, y))]
        if x == -2**31 and y == -1:          # the one overflowing quotient: undefined in C, skip
            want32[:2] = o32[8 * i:8 * i + 2].tolist()
        assert o32[8 * i:8 * i + 8].tolist() == want32, i
        q64 = _c_div(cx, dx)
        assert o64[4 * i:4 * i + 4].tolist() == [q64, cx - q64 * dx, x * y, cx >> (y & 63)], i
        ux, uy = x % 2**32, y % 2**32
        assert ou[4 * i:4 * i + 4].tolist() == [ux // uy, ux >> (uy & 31), (ux * uy) >> 32,
                                                 ((ux << (uy & 15)) % 2**32) | (ux >> 3)], i


@needs_nvcc
def test_float_min_max_fma(micro, rng):
    n = 64
    a, b, c = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    a[:4], b[:4], c[3] = [np.nan, 1.0, np.nan, 1 + 2**-12], [2.0, np.nan, np.nan, 1 - 2**-12], -1.0
    out = np.full(4 * n, np.nan, np.float32).reshape(n, 4)
    run(micro, "float_ops", [a, b, c, out], block=(n, 1, 1))
    same_bits_or_both_nan(out[:, 0], np.fmin(a, b))       # the non-NaN operand wins
    same_bits_or_both_nan(out[:, 1], np.fmax(a, b))
    exact = a.astype(np.float64) * b + c                  # fma: one rounding
    same_bits_or_both_nan(out[:, 2], exact.astype(np.float32))
    assert out[3, 2] == -2.0**-24                         # a*b+c rounded once (mul+add gives 0)
    root = np.sqrt(np.abs(a))                             # sqrt.rn: correctly rounded
    want = root.astype(np.float64) - a.astype(np.float64) * b
    ok = ~np.isnan(want)                                  # rounding of the product and the difference:
    bound = 2 * np.spacing(np.maximum(np.abs(root), np.abs(a * b)))
    assert (np.abs(out[ok, 3] - want[ok]) <= bound[ok]).all()


@needs_nvcc
def test_divergent_loop_per_lane_pcs(micro, rng):
    trips = rng.integers(0, 12, 32).astype(np.int32)
    out = np.full(32, np.nan, np.float32)
    run(micro, "divergent_loop", [trips, out])
    want = [sum(j + t for j in range(n if t % 2 == 0 else min(n, 7))) for t, n in enumerate(trips)]
    assert (out == np.float32(want)).all()


# ---------------------------------------------------------------------------------------------
# Failure modes: each must raise EmulationError naming the problem (and the kernel / pc).
# ---------------------------------------------------------------------------------------------
@needs_nvcc
def test_unimplemented_opcode_fails_before_running(micro):
    a, out = np.arange(32, dtype=np.uint32), np.zeros(32, np.uint32)
    with pytest.raises(EmulationError, match=r"unimplemented PTX form brev\.b32"):
        run(micro, "bad_opcode", [a, out])
    assert (out == 0).all()


# cp-size is 4, 8 or 16 bytes (PTX ISA); nvcc emits no other, so hand-written PTX (inline asm) shows it
ODD_CP_ASYNC = """
.version 7.8
.target sm_80
.address_size 64

.visible .entry odd_copy(
	.param .u64 odd_copy_param_0
)
{
	.reg .b32 	%r<2>;
	.reg .b64 	%rd<2>;
	.shared .align 16 .b8 buf[64];

	ld.param.u64 	%rd1, [odd_copy_param_0];
	mov.u32 	%r1, buf;
	cp.async.ca.shared.global [%r1], [%rd1], 12;
	cp.async.wait_all;
	ret;
}
"""


def test_cp_async_of_an_odd_size_fails_before_running():
    src = np.arange(16, dtype=np.uint8)
    memory = GlobalMemory()
    memory.add(src.ctypes.data, src.nbytes, "src")
    with pytest.raises(EmulationError, match=r"unimplemented PTX form cp\.async\.ca\.shared\.global: cp-size 12"):
        launch(PtxModule.parse(ODD_CP_ASYNC), "odd_copy", (1, 1, 1), (32, 1, 1), 0,
               [src.ctypes.data.to_bytes(8, "little")], memory, arch="sm80")


# Shifts by immediates below, at and above the width (those clamp to the width: PTX ISA, shl/shr)
_SHIFTS = [("shl.b32", "r", 0), ("shl.b32", "r", 5), ("shl.b32", "r", 31), ("shl.b32", "r", 32),
           ("shr.u32", "r", 7), ("shr.u32", "r", 33), ("shr.s32", "r", 31), ("shr.s32", "r", 40),
           ("shl.b64", "rd", 63), ("shl.b64", "rd", 64), ("shr.u64", "rd", 9), ("shr.s64", "rd", 63),
           ("shr.s64", "rd", 70)]
def _lanewise(name: str, ops: list, guards=("",)) -> str:
    """PTX kernel `name`(p32, p64, q32, q64): lane l loads x32[l] into %r1 and x64[l] into %rd9
    and, for each guard and (op, register kind, immediate), stores op(x, immediate) to row i of
    q32 or q64, its destination first set to x (so a guarded-off lane stores x). %p1: lane < 16."""
    return f"""
.version 7.8
.target sm_80
.address_size 64

.visible .entry {name}(.param .u64 p32, .param .u64 p64, .param .u64 q32, .param .u64 q64)
{{
\t.reg .pred \t%p<2>;
\t.reg .b32 \t%r<4>;
\t.reg .b64 \t%rd<13>;
\tld.param.u64 \t%rd1, [p32];
\tld.param.u64 \t%rd2, [p64];
\tld.param.u64 \t%rd3, [q32];
\tld.param.u64 \t%rd4, [q64];
\tmov.u32 \t%r3, %tid.x;
\tsetp.lt.u32 \t%p1, %r3, 16;
\tmul.wide.u32 \t%rd5, %r3, 4;
\tmul.wide.u32 \t%rd6, %r3, 8;
\tadd.s64 \t%rd7, %rd1, %rd5;
\tadd.s64 \t%rd8, %rd2, %rd6;
\tadd.s64 \t%rd11, %rd3, %rd5;
\tadd.s64 \t%rd12, %rd4, %rd6;
\tld.global.u32 \t%r1, [%rd7];
\tld.global.u64 \t%rd9, [%rd8];
""" + "".join(f"\tmov.b32 \t%r2, %r1;\n\t{g}{op} \t%r2, %r1, {n};\n\tst.global.u32 \t[%rd11+{i * 128}], %r2;\n"
              if r == "r" else
              f"\tmov.b64 \t%rd10, %rd9;\n\t{g}{op} \t%rd10, %rd9, {n};\n\tst.global.u64 \t[%rd12+{i * 256}], %rd10;\n"
              for i, (g, (op, r, n)) in enumerate((g, x) for g in guards for x in ops)) + "\tret;\n}\n"


IMMEDIATE_SHIFTS = _lanewise("shifts", _SHIFTS)


def test_shifts_by_immediates_match_the_isa(rng):
    x32 = rng.integers(0, 2**32, 32, dtype=np.uint64).astype(np.uint32)
    x64 = rng.integers(0, 2**64, 32, dtype=np.uint64)
    x32[0], x64[0] = 0x80000001, 2**63 + 1                      # sign bits set
    out32, out64 = np.zeros((len(_SHIFTS), 32), np.uint32), np.zeros((len(_SHIFTS), 32), np.uint64)
    memory = GlobalMemory()
    for i, a in enumerate((x32, x64, out32, out64)):
        memory.add(a.ctypes.data, a.nbytes, f"arg{i}")
    launch(PtxModule.parse(IMMEDIATE_SHIFTS), "shifts", (1, 1, 1), (32, 1, 1), 0,
           [a.ctypes.data.to_bytes(8, "little") for a in (x32, x64, out32, out64)], memory, arch="sm80")
    for i, (op, r, n) in enumerate(_SHIFTS):
        bits = 32 if r == "r" else 64
        x = [int(v) for v in (x32 if r == "r" else x64)]
        signed = [v - (1 << bits) if v >> (bits - 1) else v for v in x]
        k = min(n, bits)
        if op.startswith("shl"):
            want = [(v << k) % (1 << bits) for v in x]
        elif ".s" in op:
            want = [(v >> min(k, bits - 1)) % (1 << bits) for v in signed]
        else:
            want = [v >> k for v in x]
        got = (out32 if r == "r" else out64)[i]
        assert got.tolist() == want, (op, n)


# add, sub and mul.lo wrap at the width whatever their signedness (the emulator computes them on
# the registers' .bN bits): negative and large immediates, each op unguarded and then guarded to
# lanes 0-15 (the others keep the register's value: the masked write)
_WRAPPING = [("add.s32", "r", "-7"), ("sub.u32", "r", "-1"), ("mul.lo.s32", "r", "-3"), ("add.u32", "r", "0xFFFFFFF0"),
             ("add.s64", "rd", "-5"), ("mul.lo.u64", "rd", "0x9E3779B97F4A7C15"), ("sub.s64", "rd", "9223372036854775807")]
WRAPPING = _lanewise("wrapping", _WRAPPING, guards=("", "@%p1 "))


def test_add_sub_mul_lo_wrap_at_the_width_masked_or_not(rng):
    x32 = rng.integers(0, 2**32, 32, dtype=np.uint64).astype(np.uint32)
    x64 = rng.integers(0, 2**64, 32, dtype=np.uint64)
    x32[:2], x64[:2] = (0x80000001, 5), (2**63 + 1, 3)
    n = 2 * len(_WRAPPING)
    out32, out64 = np.zeros((n, 32), np.uint32), np.zeros((n, 32), np.uint64)
    memory = GlobalMemory()
    for i, a in enumerate((x32, x64, out32, out64)):
        memory.add(a.ctypes.data, a.nbytes, f"arg{i}")
    launch(PtxModule.parse(WRAPPING), "wrapping", (1, 1, 1), (32, 1, 1), 0,
           [a.ctypes.data.to_bytes(8, "little") for a in (x32, x64, out32, out64)], memory, arch="sm80")
    for i in range(n):
        op, r, imm = _WRAPPING[i % len(_WRAPPING)]
        bits = 32 if r == "r" else 64
        x, k = [int(v) for v in (x32 if r == "r" else x64)], int(imm, 0)
        f = {"add": lambda v: v + k, "sub": lambda v: v - k, "mul": lambda v: v * k}[op.split(".")[0]]
        want = [f(v) % (1 << bits) if i < len(_WRAPPING) or lane < 16 else v for lane, v in enumerate(x)]
        assert (out32 if r == "r" else out64)[i].tolist() == want, (op, imm, i >= len(_WRAPPING))


PARAM_PAST_THE_END = """
.version 7.8
.target sm_80
.address_size 64

.visible .entry past(.param .u64 p)
{
	.reg .b64 	%rd<2>;
	ld.param.u64 	%rd1, [p+8];
	ret;
}
"""


def test_parameter_read_past_the_buffer_fails():
    with pytest.raises(EmulationError, match=r"parameter access at offset 8 outside the 8-byte parameter buffer"):
        launch(PtxModule.parse(PARAM_PAST_THE_END), "past", (1, 1, 1), (32, 1, 1), 0, [bytes(8)], GlobalMemory(),
               arch="sm80")


@needs_nvcc
def test_barrier_in_diverged_warp_fails(micro):
    with pytest.raises(EmulationError, match=r"bad_diverged_barrier.*bar\.sync executed by a diverged warp"):
        run(micro, "bad_diverged_barrier", [np.zeros(32, np.float32)])


@needs_nvcc
def test_sync_aligned_op_in_diverged_warp_fails(micro):
    with pytest.raises(EmulationError, match=r"ldmatrix.*diverged or partial warp"):
        run(micro, "bad_diverged_ldmatrix", [np.zeros(32, np.float32)])


@needs_nvcc
def test_out_of_bounds_global_access_fails(micro):
    a = np.zeros(32, np.float32)
    with pytest.raises(EmulationError, match=r"PTX line.*out-of-bounds global load.*past the end of 'arg0'"):
        run(micro, "bad_oob_load", [a, np.zeros(32, np.float32), 1])
    run(micro, "bad_oob_load", [np.zeros(33, np.float32), np.zeros(32, np.float32), 1])   # in bounds


@needs_nvcc
def test_misaligned_global_access_fails(micro):
    with pytest.raises(EmulationError, match=r"misaligned global load of 4 bytes"):
        run(micro, "bad_misaligned_load", [np.zeros(40, np.float32), np.zeros(32, np.float32)])


@needs_nvcc
def test_read_before_cp_async_wait_fails(micro, rng):
    a = rng.standard_normal((32, 4)).astype(np.float32)
    out = np.full((32, 4), np.nan, np.float32)
    with pytest.raises(EmulationError, match=r"cp\.async has not delivered"):
        run(micro, "cp_async_read", [a, out, 0])
    run(micro, "cp_async_read", [a, out, 1])
    assert (out == a).all()


@needs_nvcc
def test_race_detector(micro, rng):
    a = rng.standard_normal(64).astype(np.float32)
    out = np.full(64, np.nan, np.float32)
    with pytest.raises(EmulationError, match=r"shared-memory race: warp \d (reads|writes) offset \d+"):
        run(micro, "cross_warp_read", [a, out, 0], block=(64, 1, 1))
    run(micro, "cross_warp_read", [a, out, 1], block=(64, 1, 1))
    assert (out == np.roll(a, -32)).all()


@needs_nvcc
def test_lanes_of_one_warp_need_syncwarp(micro, rng):
    a = rng.standard_normal(32).astype(np.float32)
    out = np.full(32, np.nan, np.float32)
    with pytest.raises(EmulationError, match=r"race in warp 0: lane \d+ reads offset \d+, written by lane \d+ "
                                             r"with no __syncwarp"):
        run(micro, "lane_exchange", [a, out, 0])
    run(micro, "lane_exchange", [a, out, 1])
    assert (out == a[np.arange(32) ^ 1]).all()


@needs_nvcc
def test_race_within_one_instruction_of_two_warps(micro):
    """Warps executing together as a gang are still checked warp by warp."""
    for seed in range(4):
        with pytest.raises(EmulationError, match=r"shared-memory race: warp \d writes offset \d+, written by warp \d"):
            run(micro, "same_smem_slot", [np.zeros(64, np.float32)], block=(64, 1, 1), seed=seed)


@needs_nvcc
def test_global_write_race_between_ctas(micro):
    out = np.full(32, np.nan, np.float32)
    with pytest.raises(EmulationError, match=r"global-memory race: CTA \d writes 0x[0-9a-f]+ .*'arg0'.*written by CTA \d"):
        run(micro, "same_slot_store", [out], grid=(2, 1, 1))
    run(micro, "same_slot_store", [out], grid=(1, 1, 1))
    assert (out == 0).all()


@needs_nvcc
def test_global_read_then_write_by_another_cta_is_a_race_in_any_order(micro):
    """A read by one CTA and a write by another in one launch race whichever comes first: the
    verdict must not depend on the schedule (every seed)."""
    for seed in range(8):
        with pytest.raises(EmulationError, match=r"global-memory race: CTA \d (writes|reads) 0x[0-9a-f]+ .*'arg0'.*"
                                                 r"(read by (CTA 0|several CTAs)|written by CTA 1)"):
            run(micro, "read_then_other_writes", [np.zeros(32, np.float32), np.zeros(64, np.float32)],
                grid=(2, 1, 1), seed=seed)
    out = np.full(32, np.nan, np.float32)
    run(micro, "read_then_other_writes", [np.zeros(32, np.float32), out], grid=(1, 1, 1))
    assert (out == 0).all()


@needs_nvcc
def test_random_schedule_is_seeded_and_exposes_missing_barriers(micro, rng):
    """Without the detector, the racy kernel's result depends on the warp order: different seeds
    must show different outcomes, the same seed the same one."""
    a = rng.standard_normal(64).astype(np.float32) + 10
    outcomes = {}
    for seed in range(12):
        out = np.full(64, np.nan, np.float32)
        run(micro, "cross_warp_read", [a, out, 0], block=(64, 1, 1), seed=seed, race_check=False)
        outcomes[seed] = out.tobytes()
    assert len(set(outcomes.values())) > 1
    out = np.full(64, np.nan, np.float32)
    run(micro, "cross_warp_read", [a, out, 0], block=(64, 1, 1), seed=5, race_check=False)
    assert out.tobytes() == outcomes[5]


@needs_nvcc
def test_dynamic_shared_memory_limit_per_arch(micro):
    out = np.full(64, np.nan, np.float32)
    with pytest.raises(EmulationError, match=r"exceed the sm80 limit of 166912 bytes"):
        run(micro, "dynamic_smem", [out], block=(64, 1, 1), smem=200 * 1024, arch="sm80")
    run(micro, "dynamic_smem", [out], block=(64, 1, 1), smem=200 * 1024, arch="sm90a")
    assert (out == 1).all()
    with pytest.raises(EmulationError, match=r"out-of-bounds shared store"):
        run(micro, "dynamic_smem", [out], block=(64, 1, 1), smem=128, arch="sm80")


@needs_nvcc
def test_instruction_budget_stops_an_endless_kernel(micro):
    with pytest.raises(EmulationError, match=r"spin.*more than 5000 warp-instructions"):
        run(micro, "spin", [np.zeros(1, np.int32)], max_warp_instructions=5000)


# ---------------------------------------------------------------------------------------------
# A real kernel end to end (the handlers' path is tested in test_cuda_emulated.py)
# ---------------------------------------------------------------------------------------------
@needs_nvcc
def test_dense_forward_bf16_causal_matches_float64(rng):
    from emulated_dense import NP_DTYPES, run_dense_forward, spec_module
    module = spec_module(64, "bf16", True)
    b, sq, sk, hq, hkv, d = 1, 77, 77, 2, 1, 64       # not a tile multiple; GQA
    q = rng.standard_normal((b, sq, hq, d)).astype(NP_DTYPES["bf16"])
    k = rng.standard_normal((b, sk, hkv, d)).astype(NP_DTYPES["bf16"])
    v = rng.standard_normal((b, sk, hkv, d)).astype(NP_DTYPES["bf16"])
    o, lse, stats = run_dense_forward(module, q, k, v, causal=True, dtype="bf16")
    ro, rlse = reference.attention(q, k, v, causal=True)[:2]
    assert (np.abs(o - ro) / (1 + np.abs(ro))).max() < 1e-2     # bf16 outputs
    assert np.abs(lse - rlse).max() < 1e-4
    assert stats.warp_instructions > 1000
    assert stats.opcode_counts["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"] > 0


@needs_nvcc
def test_every_instruction_of_a_spec_has_a_handler():
    """Static coverage: every entry of a built spec (dense, extras, varlen, paged, split-KV
    combine, backward pre/main/convert) compiles, i.e. has no unimplemented opcode or form."""
    from emulated_dense import spec_module
    from flashgen.emulate.machine import compiled
    module = spec_module(64, "bf16", True)
    forms = set()
    for kernel in module.kernels.values():
        compiled(kernel)
        forms.update(ins.form for ins in kernel.instructions)
    names = " ".join(module.kernels)
    for entry in ("flash_fwd_kernel", "flash_bwd_kernel", "flash_bwd_pre_kernel", "flash_bwd_convert_kernel",
                  "flash_fwd_combine_kernel", "flash_fwd_varlen_fill_kernel"):
        assert entry in names
    assert len(module.kernels) >= 14 and len(forms) > 100
