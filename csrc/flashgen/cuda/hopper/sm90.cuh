// Hopper (sm_90a) building blocks of the cuda/hopper kernels: mbarriers, named barriers, the
// async-proxy fence, TMA tile loads, elect.sync, setmaxnreg, wgmma (m64n64k16 f16 / bf16,
// m64n64k32 e4m3; A from shared memory or registers, B from shared memory) and the swizzled tile
// layouts the wgmma descriptors read (which a TMA load with CU_TENSOR_MAP_SWIZZLE_128B and a box
// row of 64 16-bit elements writes; e4m3: the 64-byte swizzle, below).
//
// Tile layout (CuTe's canonical K-major SW128 atom, cute/atom/mma_traits_sm90_gmma.hpp): a
// [rows][D] tile of 16-bit elements is stored as D/64 panels of 64 columns; in a panel row r
// takes 128 bytes at r * 128, its 16-byte chunk c at chunk c ^ (r % 8) (Swizzle<3,4,3> of the
// address: panels are 1024-byte aligned). The same bytes serve both operand roles:
//   K-major (Q, K as the A / B of S = Q K^T): 8-row atoms 1024 bytes apart (SBO), k16 step kk
//     of a panel starts 32 * kk bytes in;
//   MN-major (V as the B of O = P V, N = the head dim): 8 keys (K rows) 1024 bytes apart (SBO),
//     k16 step kk starts 16 keys = 2048 bytes in; one wgmma per 64-column panel.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "flashgen/cuda/common.cuh"

namespace flashgen {
namespace cuda {
namespace {
namespace sm90 {

constexpr int kPanelCols = 64;                  // 16-bit columns per 128-byte swizzle row
constexpr int kSwizzleAtom = 1024;              // 8 rows x 128 bytes

FG_DEV void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
FG_DEV void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Arrives and adds `bytes` to the phase's pending transaction count (the TMA loads it guards).
FG_DEV void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
FG_DEV bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
// Spins in C: labels inside inline asm are not scoped by the emulator's parser.
FG_DEV void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}
FG_DEV void fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
FG_DEV void named_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
FG_DEV void named_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Orders this thread's generic shared-memory stores before later async-proxy (wgmma) reads.
FG_DEV void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// True in one lane of the (fully active) warp.
FG_DEV bool elect_one() {
  uint32_t leader;
  asm volatile("{\n .reg .pred p;\n elect.sync _|p, 0xffffffff;\n selp.u32 %0, 1, 0, p;\n}" : "=r"(leader));
  return leader != 0;
}

// Register budget per thread of the calling warpgroup (every warp of it calls); the kernel must
// have __launch_bounds__(threads, 1).
template <int kRegs>
FG_DEV void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs) : "memory");
}
template <int kRegs>
FG_DEV void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs) : "memory");
}

// TMA: the box of `map` at coordinates (c0 innermost .. c3) into shared memory at `dst`, its
// bytes counted on mbarrier `bar`. `map` must be a __grid_constant__ parameter (or global).
FG_DEV void tma_load_4d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, int c3, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];" ::"r"(dst),
      "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// TMA: the box of `map` at (c0 .. c3) from shared memory at `src` (generic writes to it fenced
// with fence_proxy_async first); elements outside the tensor are skipped. Completes with
// bulk_commit / bulk_wait_read (the source may be reused after the latter).
FG_DEV void tma_store_4d(const CUtensorMap* map, int c0, int c1, int c2, int c3, uint32_t src) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];" ::"l"(map),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
               : "memory");
}
FG_DEV void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
FG_DEV void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

FG_DEV void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
FG_DEV void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
FG_DEV void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Waits until at most N committed wgmma groups of this warpgroup are in flight.
template <int N>
FG_DEV void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// 128B-swizzled descriptor (layout type 1) of the operand starting at shared address `addr`,
// 8-row (K-major) or 8-key (MN-major) atoms 1024 bytes apart; the leading byte offset is unused
// by both (one 64-column panel per wgmma) and set to 1 as CUTLASS does.
FG_DEV uint64_t sw128_desc(uint32_t addr) {
  return (uint64_t{1} << 62) | (uint64_t{kSwizzleAtom >> 4} << 32) | (uint64_t{1} << 16) | ((addr & 0x3FFFF) >> 4);
}

#define FG_WGMMA_D32                                                                                          \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define FG_WGMMA_D32_OUTS(d)                                                                                    \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),   \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),    \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),   \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// d (64 x 64, f32; thread layout: PTX ISA "wgmma .m64nNk16 accumulator D") += A B^T over one
// 32-byte K step (k16 of f16 / bf16, k32 of e4m3), A and B K-major in shared memory.
template <class T>
FG_DEV void wgmma_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
  if constexpr (std::is_same<T, __half>::value)
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " FG_WGMMA_D32 ", %32, %33, p, 1, 1, 0, 0;\n}"
                 : FG_WGMMA_D32_OUTS(d)
                 : "l"(desc_a), "l"(desc_b), "r"(1));
  else if constexpr (std::is_same<T, __nv_bfloat16>::value)
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " FG_WGMMA_D32 ", %32, %33, p, 1, 1, 0, 0;\n}"
                 : FG_WGMMA_D32_OUTS(d)
                 : "l"(desc_a), "l"(desc_b), "r"(1));
  else  // e4m3: 8-bit wgmma takes no transpose immediates
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " FG_WGMMA_D32 ", %32, %33, p, 1, 1;\n}"
                 : FG_WGMMA_D32_OUTS(d)
                 : "l"(desc_a), "l"(desc_b), "r"(1));
}

// d (64 x 64) += A B over one K step with A in registers and B in shared memory. f16 / bf16 (k16):
// A is mma.m16n8k16's A fragment per warp, B MN-major (imm-trans-b = 1). e4m3 (k32): per warp,
// register r holds row g + 8 (r % 2), k 4 t + 16 (r / 2) .. + 3, lowest byte first (g = lane / 4,
// t = lane % 4; CuTe's ALayout_64x32 for 8-bit GMMA), and B is K-major (8-bit wgmma has no
// transpose).
template <class T>
FG_DEV void wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (std::is_same<T, __half>::value)
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " FG_WGMMA_D32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}"
                 : FG_WGMMA_D32_OUTS(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  else if constexpr (std::is_same<T, __nv_bfloat16>::value)
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " FG_WGMMA_D32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}"
                 : FG_WGMMA_D32_OUTS(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  else
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " FG_WGMMA_D32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1;\n}"
                 : FG_WGMMA_D32_OUTS(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}
#undef FG_WGMMA_D32
#undef FG_WGMMA_D32_OUTS

// Keeps the compiler from moving accumulator reads/writes across the wgmma.fence / wait
// (CUTLASS's warpgroup_fence_operand).
template <int N>
FG_DEV void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Rows [0, ROWS) of a [ROWS][D] tile into the swizzled layout at `tile` (1024-byte aligned),
// by NT threads (thread `tid`), 16 bytes each: row r is global row `row0 + r` at `src +
// (row0 + r) * stride` elements; rows at or past `rows_valid` are zero-filled (never read).
template <class T, int ROWS, int D, int NT>
FG_DEV void load_tile_sw128(uint8_t* tile, const T* src, int64_t stride, int row0, int rows_valid, int tid) {
  constexpr int kChunks = D * static_cast<int>(sizeof(T)) / 16;  // per row
  constexpr int kPanelBytes = ROWS * 128;
#pragma unroll 4
  for (int i = tid; i < ROWS * kChunks; i += NT) {
    const int r = i / kChunks, c = i % kChunks;
    const int row = row0 + r;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row < rows_valid) v = *reinterpret_cast<const uint4*>(src + row * stride + c * 8);
    *reinterpret_cast<uint4*>(tile + (c / 8) * kPanelBytes + r * 128 + (((c % 8) ^ (r % 8)) << 4)) = v;
  }
}


// ---- e4m3 operands: 64-byte swizzle panels ----
// A panel row of e4m3 (kPanelCols one-byte elements) is 64 bytes: CuTe's SW64 K-major atom,
// 8 rows x 64 bytes = 512 bytes, 16-byte chunk c of row r at chunk c ^ ((r / 2) % 4)
// (Swizzle<2,4,3>: address bits [4,6) ^= bits [7,9); panels 512-byte aligned); what a TMA load with
// CU_TENSOR_MAP_SWIZZLE_64B and a box row of 64 bytes writes. K step kk of a panel starts 32 * kk
// bytes in, as with 16-bit elements.
constexpr int kSw64Atom = 512;  // 8 rows x 64 bytes

FG_DEV uint32_t sw64(uint32_t offset) { return offset ^ ((offset >> 3) & 0x30); }

// 64B-swizzled K-major descriptor (layout type 2) of the operand at shared address `addr`: 8-row
// atoms 512 bytes apart (SBO); the leading byte offset is unused (K within one 64-byte row).
FG_DEV uint64_t sw64_desc(uint32_t addr) {
  return (uint64_t{2} << 62) | (uint64_t{kSw64Atom >> 4} << 32) | (uint64_t{1} << 16) | ((addr & 0x3FFFF) >> 4);
}

// The descriptor of a panel of T elements: 128-byte rows (16-bit) or 64-byte rows (e4m3).
template <class T>
FG_DEV uint64_t panel_desc(uint32_t addr) {
  if constexpr (sizeof(T) == 1) return sw64_desc(addr);
  else return sw128_desc(addr);
}

// Four f32 -> four e4m3 (round to nearest even, saturated to +-448), x0 in the lowest byte.
FG_DEV uint32_t pack_e4m3x4(float x0, float x1, float x2, float x3) {
  uint32_t out;
  asm("{\n .reg .b16 lo, hi;\n cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      " mov.b32 %0, {lo, hi};\n}"
      : "=r"(out)
      : "f"(x0), "f"(x1), "f"(x2), "f"(x3));
  return out;
}

}  // namespace sm90
}  // namespace
}  // namespace cuda
}  // namespace flashgen
