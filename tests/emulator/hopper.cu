// Hopper micro-kernels for the emulator's self-checks (tests/test_emulator_hopper.py), compiled
// for sm_90a. Each instruction is written as inline PTX in the forms CUTLASS emits
// (cutlass/arch/barrier.h, cute/arch/mma_sm90_gmma.hpp, cute/arch/copy_sm90*.hpp).
#include <cuda.h>  // CUtensorMap

#include <cstdint>

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_complete_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.complete_tx.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done != 0;
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}
// The same wait as a loop inside the asm, as barrier.h's ClusterBarrier::wait writes it: every
// inlined copy repeats the labels, which only their brace scope tells apart.
__device__ __forceinline__ void mbar_wait_in_asm(uint32_t bar, uint32_t parity) {
  asm volatile("{\n .reg .pred P1;\n LAB_WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1, %2;\n"
               " @P1 bra DONE;\n bra LAB_WAIT;\n DONE:\n}" ::"r"(bar), "r"(parity), "r"(0x989680) : "memory");
}
__device__ __forceinline__ void named_sync(uint32_t id, uint32_t n) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_arrive(uint32_t id, uint32_t n) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}

// Producer warp 0 hands `rounds` rows of 32 floats to consumer warp 1 through a global buffer,
// guarded by a full and an empty mbarrier (all 32 lanes arrive): out = 2 * a, row by row. A wait
// that returned early would read the poisoned buffer or a row the producer already replaced.
// `asm_loops`: wait with mbar_wait_in_asm.
extern "C" __global__ void mbarrier_handoff(const float* a, float* buf, float* out, int rounds, int asm_loops) {
  __shared__ __align__(8) uint64_t full, empty;
  const uint32_t f = smem_u32(&full), e = smem_u32(&empty);
  const int lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    mbar_init(f, 32);
    mbar_init(e, 32);
  }
  __syncthreads();
  for (int i = 0; i < rounds; ++i) {
    if (threadIdx.x < 32) {
      if (asm_loops) {
        mbar_wait_in_asm(e, (i & 1) ^ 1);
      } else {
        mbar_wait(e, (i & 1) ^ 1);         // a fresh barrier's phase "-1" (parity 1) is complete
      }
      buf[lane] = a[i * 32 + lane];
      mbar_arrive(f);
    } else {
      if (asm_loops) {
        mbar_wait_in_asm(f, i & 1);
      } else {
        mbar_wait(f, i & 1);
      }
      out[i * 32 + lane] = 2.0f * buf[lane];
      mbar_arrive(e);
    }
  }
}

// A barrier of count 1 nobody arrives on: parity 1 (the phase before the first) is complete,
// parity 0 never completes, so the wait spins until the instruction budget.
extern "C" __global__ void mbarrier_wait_parity(int* out, int parity) {
  __shared__ __align__(8) uint64_t bar;
  const uint32_t b = smem_u32(&bar);
  if (threadIdx.x == 0) mbar_init(b, 1);
  __syncthreads();
  mbar_wait(b, parity);
  out[threadIdx.x] = 1;
}

// Transaction counts: lane 0 announces `expect` bytes with its arrival (count 1), then completes
// `done` bytes; the phase completes only when both the arrival and the bytes are in.
extern "C" __global__ void mbarrier_tx(int* out, int expect, int done) {
  __shared__ __align__(8) uint64_t bar;
  const uint32_t b = smem_u32(&bar);
  if (threadIdx.x == 0) {
    mbar_init(b, 1);
    out[0] = mbar_try_wait(b, 0);
    mbar_arrive_expect_tx(b, expect);
    out[1] = mbar_try_wait(b, 0);          // arrived, bytes pending: not complete
    mbar_complete_tx(b, done);
    mbar_wait(b, 0);
    out[2] = mbar_try_wait(b, 1);          // the next phase has not completed
  }
}

// Named barriers: warps 0-1 write `out[0:64]`, then arrive on barrier 1 (128 threads) without
// waiting; warps 2-3 wait there and then read what warps 0-1 wrote. `count` is the thread count
// warps 2-3 use (128 is right; another count is a misuse).
extern "C" __global__ void named_barrier_arrive(const float* a, float* out, int count) {
  const int t = threadIdx.x;
  if (t < 64) {
    out[t] = a[t] + 1.0f;
    named_arrive(1, 128);
  } else {
    named_sync(1, count);
    out[t] = out[t - 64] * 3.0f;
  }
}

// Ping-pong on two named barriers between the two warpgroups of 256 threads, the FA3 pattern:
// warpgroup g waits on barrier 2+g, takes its turn, then signals barrier 3-g. Turn k reads the
// value turn k-1 wrote (out starts poisoned): out[k] = k only if the turns really alternate.
// Without warpgroup 1's first arrival (`no_start`) both wait forever.
extern "C" __global__ void named_barrier_pingpong(int* out, int turns, int no_start) {
  const int g = threadIdx.x / 128, t = threadIdx.x % 128;
  if (g == 1 && !no_start) named_arrive(2, 256);   // warpgroup 0 goes first
  for (int i = 0; i < turns; ++i) {
    named_sync(2 + g, 256);
    const int k = 2 * i + g;
    if (t == 0) out[k] = k == 0 ? 0 : out[k - 1] + 1;
    if (i + 1 < turns || g == 0) named_arrive(3 - g, 256);
  }
}

// elect.sync among the lanes of `mask` (the others skip it): leader lane and predicate per lane.
extern "C" __global__ void elect_one(int* leader, int* is_leader, unsigned mask) {
  const int lane = threadIdx.x % 32;
  leader[threadIdx.x] = -1;
  is_leader[threadIdx.x] = -1;
  if ((mask >> lane) & 1) {
    uint32_t who, pred;
    asm volatile("{\n .reg .pred p;\n elect.sync %0|p, %2;\n selp.u32 %1, 1, 0, p;\n}"
                 : "=r"(who), "=r"(pred) : "r"(mask));
    leader[threadIdx.x] = who;
    is_leader[threadIdx.x] = pred;
  }
}

// ---- wgmma.mma_async m64n64k{16,8,32}, f32 += {bf16, f16, tf32, e4m3} x the same ------------
// The host lays A (64 x 16) and B (64 x 16, D = A B^T) out in a shared-memory image by CuTe's
// canonical layouts and passes the descriptors (start address relative to the image); C and D
// are the accumulator registers per (thread, register). `flags` switches misuses on:
enum {
  ACCUMULATE = 1, NO_PROXY_FENCE = 2, NO_WGMMA_FENCE = 4, NO_WAIT = 8, WRITE_IN_FLIGHT = 16, WARP_3_EXITS = 32,
  WARP_3_OTHER_B = 64,                      // warp 3 names another B tile than its warpgroup
  NO_SYNC = 128                             // no barrier between the image's stores and the wgmma
};
#define D_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define D_OUTS "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

__device__ __forceinline__ void load_image(const uint32_t* img, int words, int flags) {
  extern __shared__ __align__(1024) uint32_t smem_img[];
  for (int i = threadIdx.x; i < words; i += blockDim.x) smem_img[i] = img[i];
  if (!(flags & NO_PROXY_FENCE)) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  if (!(flags & NO_SYNC)) __syncthreads();
}
__device__ __forceinline__ uint64_t image_base() {
  extern __shared__ __align__(1024) uint32_t smem_img[];
  return smem_u32(smem_img) >> 4;            // added to the descriptors' start-address field
}
__device__ __forceinline__ void finish(float* d, float* out, int flags) {
  extern __shared__ __align__(1024) uint32_t smem_img[];
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  if (flags & WRITE_IN_FLIGHT) {             // after every warp issued (else its wgmma would read it)
    __syncthreads();
    smem_img[threadIdx.x] = 0u;
  }
  if (!(flags & NO_WAIT)) asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  for (int i = 0; i < 32; ++i) out[threadIdx.x * 32 + i] = d[i];
}

// A_ARG: the A descriptor (relative to the image) or the A registers, a[thread * 4 + j] being
// register j of the thread; A_SET: what reads them before the wgmma.fence; A_ASM / A_IN: its
// operand text and inputs (numbered from %34); TRANS: the transpose immediates (16-bit types
// only: imm-trans-a for a descriptor, imm-trans-b).
#define DEFINE_WGMMA(NAME, TY, K, A_ARG, A_SET, A_ASM, A_IN, TRANS)                               \
  extern "C" __global__ void NAME(const uint32_t* img, int words, A_ARG, uint64_t desc_b,          \
                                  const float* c, float* out, int flags) {                        \
    load_image(img, words, flags);                                                                \
    const uint64_t base = image_base();                                                           \
    if ((flags & WARP_3_EXITS) && threadIdx.x >= 96) return;                                      \
    A_SET;                                                                                        \
    float d[32];                                                                                  \
    for (int i = 0; i < 32; ++i) d[i] = c[threadIdx.x * 32 + i];                                  \
    if (!(flags & NO_WGMMA_FENCE)) asm volatile("wgmma.fence.sync.aligned;" ::: "memory");        \
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %33, 0;\n"                                   \
                 "wgmma.mma_async.sync.aligned.m64n64k" #K ".f32." TY "." TY " " D_REGS           \
                 ", " A_ASM ", %32, p, 1, 1" TRANS ";\n}"                                         \
                 : D_OUTS                                                                         \
                 : "l"(desc_b + base + ((flags & WARP_3_OTHER_B) && threadIdx.x >= 96 ? 2 : 0)),   \
                   "r"(flags & ACCUMULATE), A_IN);                                                \
    finish(d, out, flags);                                                                        \
  }
#define SS_ARG uint64_t desc_a
#define SS_IN "l"(desc_a + base)
#define RS_ARG const uint32_t* a
#define RS_SET                                                                                    \
  uint32_t r[4];                                                                                  \
  for (int j = 0; j < 4; ++j) r[j] = a[threadIdx.x * 4 + j]
#define RS_IN "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
// the A registers loaded as the asm's inputs: after the wgmma.fence (a misuse)
#define LATE_IN "r"(a[threadIdx.x * 4]), "r"(a[threadIdx.x * 4 + 1]), "r"(a[threadIdx.x * 4 + 2]), \
                "r"(a[threadIdx.x * 4 + 3])
#define RS_ASM "{%34, %35, %36, %37}"
DEFINE_WGMMA(wgmma_ss_bf16_kk, "bf16", 16, SS_ARG, , "%34", SS_IN, ", 0, 0")
DEFINE_WGMMA(wgmma_ss_bf16_km, "bf16", 16, SS_ARG, , "%34", SS_IN, ", 0, 1")
DEFINE_WGMMA(wgmma_ss_bf16_mk, "bf16", 16, SS_ARG, , "%34", SS_IN, ", 1, 0")
DEFINE_WGMMA(wgmma_ss_bf16_mm, "bf16", 16, SS_ARG, , "%34", SS_IN, ", 1, 1")
DEFINE_WGMMA(wgmma_ss_f16_kk, "f16", 16, SS_ARG, , "%34", SS_IN, ", 0, 0")
DEFINE_WGMMA(wgmma_ss_tf32, "tf32", 8, SS_ARG, , "%34", SS_IN, "")
DEFINE_WGMMA(wgmma_ss_e4m3, "e4m3", 32, SS_ARG, , "%34", SS_IN, "")
DEFINE_WGMMA(wgmma_ss_e5m2, "e5m2", 32, SS_ARG, , "%34", SS_IN, "")
DEFINE_WGMMA(wgmma_rs_bf16_k, "bf16", 16, RS_ARG, RS_SET, RS_ASM, RS_IN, ", 0")
DEFINE_WGMMA(wgmma_rs_f16_m, "f16", 16, RS_ARG, RS_SET, RS_ASM, RS_IN, ", 1")
DEFINE_WGMMA(wgmma_rs_tf32, "tf32", 8, RS_ARG, RS_SET, RS_ASM, RS_IN, "")
DEFINE_WGMMA(wgmma_rs_e4m3, "e4m3", 32, RS_ARG, RS_SET, RS_ASM, RS_IN, "")
DEFINE_WGMMA(wgmma_rs_late_a, "bf16", 16, RS_ARG, , RS_ASM, LATE_IN, ", 0")

// ---- TMA: cp.async.bulk.tensor tile loads and stores ------------------------------------------
enum { TMA_NO_WAIT = 1, TMA_NO_PROXY_FENCE = 2, TMA_WRITE_IN_FLIGHT = 4 };
#define COORDS_1 "{%3}"
#define COORDS_2 "{%3, %4}"
#define COORDS_3 "{%3, %4, %5}"
#define COORDS_4 "{%3, %4, %5, %6}"
#define COORDS_5 "{%3, %4, %5, %6, %7}"
// Thread 0 announces `expect` bytes and loads the box at (c0, ..) into the tile; every thread
// waits, then copies the tile's `bytes` bytes out (raw, swizzled as they lie).
#define DEFINE_TMA_LOAD(N)                                                                          \
  extern "C" __global__ void tma_load_##N##d(const __grid_constant__ CUtensorMap tmap, uint8_t* out, \
                                             int bytes, int expect, int c0, int c1, int c2, int c3,  \
                                             int c4, int flags) {                                   \
    extern __shared__ __align__(1024) uint8_t tile[];                                               \
    __shared__ __align__(8) uint64_t bar;                                                           \
    const uint32_t b = smem_u32(&bar);                                                              \
    if (threadIdx.x == 0) {                                                                         \
      mbar_init(b, 1);                                                                              \
      asm volatile("prefetch.tensormap [%0];" ::"l"(&tmap) : "memory");                             \
    }                                                                                               \
    __syncthreads();                                                                                \
    if (threadIdx.x == 0) {                                                                         \
      mbar_arrive_expect_tx(b, expect);                                                             \
      asm volatile("cp.async.bulk.tensor." #N "d.shared::cluster.global.mbarrier::complete_tx::bytes" \
                   " [%0], [%1, " COORDS_##N "], [%2];"                                             \
                   ::"r"(smem_u32(tile)), "l"(&tmap), "r"(b), "r"(c0), "r"(c1), "r"(c2), "r"(c3),    \
                   "r"(c4) : "memory");                                                             \
    }                                                                                               \
    if (!(flags & TMA_NO_WAIT)) mbar_wait(b, 0);                                                    \
    for (int i = threadIdx.x; i < bytes; i += blockDim.x) out[i] = tile[i];                         \
  }
DEFINE_TMA_LOAD(1)
DEFINE_TMA_LOAD(2)
DEFINE_TMA_LOAD(3)
DEFINE_TMA_LOAD(4)
DEFINE_TMA_LOAD(5)

// The threads fill the tile with `in` (generic stores), fence them to the async proxy, and
// thread 0 stores the box at (c0, c1) and waits until the tile has been read.
extern "C" __global__ void tma_store_2d(const __grid_constant__ CUtensorMap tmap, const uint8_t* in, int bytes,
                                        int c0, int c1, int flags) {
  extern __shared__ __align__(1024) uint8_t tile[];
  for (int i = threadIdx.x; i < bytes; i += blockDim.x) tile[i] = in[i];
  if (!(flags & TMA_NO_PROXY_FENCE)) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];"
                 ::"l"(&tmap), "r"(c0), "r"(c1), "r"(smem_u32(tile)) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (flags & TMA_WRITE_IN_FLIGHT) tile[0] = 0;
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  }
}

// ---- stmatrix: each thread's registers in[thread][j] stored by stmatrix.x4 (.trans) ---------------
// Lane i gives the address of row i % 8 of matrix i / 8: matrices 128 bytes apart, rows 16
// bytes apart, in a row order permuted by `perm` (to show the rows go where the lanes say).
#define DEFINE_STSM(NAME, TRANS)                                                                    \
  extern "C" __global__ void NAME(const uint32_t* in, const int* perm, uint8_t* out) {             \
    __shared__ __align__(128) uint8_t rows[512];                                                   \
    const int lane = threadIdx.x;                                                                  \
    const uint32_t addr = smem_u32(rows) + (lane / 8) * 128 + perm[lane % 8] * 16;                \
    asm volatile("stmatrix.sync.aligned.x4" TRANS ".m8n8.shared.b16 [%0], {%1, %2, %3, %4};"       \
                 ::"r"(addr), "r"(in[lane * 4]), "r"(in[lane * 4 + 1]), "r"(in[lane * 4 + 2]),     \
                 "r"(in[lane * 4 + 3]) : "memory");                                                \
    __syncwarp();                                                                                  \
    for (int i = 0; i < 16; ++i) out[lane * 16 + i] = rows[lane * 16 + i];                        \
  }
DEFINE_STSM(stmatrix_x4, "")
DEFINE_STSM(stmatrix_x4_trans, ".trans")

// ---- setmaxnreg: FA3's rebalancing; warpgroup 0 (the producer) gives registers away, the others
// take `take` each (240 fits with two consumer warpgroups, 256 does not).
template <int kTake>
__device__ void rebalance(int* out) {
  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;" ::: "memory");
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kTake) : "memory");
  }
  out[threadIdx.x] = threadIdx.x;
}
extern "C" __global__ void __launch_bounds__(384, 1) setmaxnreg_240(int* out) { rebalance<240>(out); }
extern "C" __global__ void __launch_bounds__(384, 1) setmaxnreg_256(int* out) { rebalance<256>(out); }
extern "C" __global__ void setmaxnreg_unbounded(int* out) { rebalance<240>(out); }

// ---- Everything together: a warp-specialized GEMM, D (64 x 64, f32) = A (64 x K) B (64 x K)^T,
// bf16, FA3's structure in miniature. Warpgroup 0 is the producer: one elected thread of warp 0
// TMA-loads 64 x 64 tiles of A and B (128B swizzle) into a 2-stage ring guarded by full/empty
// mbarriers; warpgroup 1 consumes each stage with four k16 wgmmas whose descriptors advance 32
// bytes inside the swizzle atom, then frees the stage. `misuse` breaks one rule:
enum { EARLY_RELEASE = 1, WRONG_PARITY = 2, SHORT_EXPECT = 4 };
extern "C" __global__ void __launch_bounds__(256, 1)
    pipelined_gemm(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                   float* out, int k_blocks, int misuse) {
  extern __shared__ __align__(1024) uint8_t ring[];             // stage s: A at 32 KiB s, B 16 KiB later
  __shared__ __align__(8) uint64_t full[2], empty[2];
  constexpr int kTile = 64 * 64 * 2;
  if (threadIdx.x == 0) {
    for (int s = 0; s < 2; ++s) {
      mbar_init(smem_u32(&full[s]), 1);
      mbar_init(smem_u32(&empty[s]), 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x < 128) {                                        // producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;" ::: "memory");
    if (threadIdx.x < 32) {
      uint32_t leader;
      asm volatile("{\n .reg .pred p;\n elect.sync _|p, 0xffffffff;\n selp.u32 %0, 1, 0, p;\n}" : "=r"(leader));
      if (leader) {
        for (int kb = 0; kb < k_blocks; ++kb) {
          const int s = kb % 2;
          mbar_wait(smem_u32(&empty[s]), ((kb / 2) & 1) ^ 1);
          const uint32_t bar = smem_u32(&full[s]), a = smem_u32(ring + s * 2 * kTile);
          mbar_arrive_expect_tx(bar, (misuse & SHORT_EXPECT) ? kTile : 2 * kTile);
          asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                       " [%0], [%1, {%3, %4}], [%2];" ::"r"(a), "l"(&map_a), "r"(bar), "r"(kb * 64), "r"(0)
                       : "memory");
          asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                       " [%0], [%1, {%3, %4}], [%2];" ::"r"(a + kTile), "l"(&map_b), "r"(bar), "r"(kb * 64), "r"(0)
                       : "memory");
        }
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 248;" ::: "memory");
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.0f;
  for (int kb = 0; kb < k_blocks; ++kb) {
    const int s = kb % 2;
    mbar_wait(smem_u32(&full[s]), ((kb / 2) & 1) ^ ((misuse & WRONG_PARITY) ? 1 : 0));
    // K-major, 128B swizzle: 8-row atoms 1024 bytes apart (SBO), LBO unused (1)
    const uint64_t desc = (1ull << 62) | (uint64_t(1024 >> 4) << 32) | (1ull << 16);
    const uint32_t a = smem_u32(ring + s * 2 * kTile);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    for (int kk = 0; kk < 4; ++kk) {
      const uint64_t da = desc | ((a + 32 * kk) >> 4), db = desc | ((a + kTile + 32 * kk) >> 4);
      asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " D_REGS ", %32, %33, p, 1, 1, 0, 0;\n}"
                   : D_OUTS : "l"(da), "l"(db), "r"(1));
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    if ((misuse & EARLY_RELEASE) && threadIdx.x == 128) mbar_arrive(smem_u32(&empty[s]));
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    if (!(misuse & EARLY_RELEASE) && threadIdx.x == 128) mbar_arrive(smem_u32(&empty[s]));
  }
  for (int i = 0; i < 32; ++i) out[(threadIdx.x - 128) * 32 + i] = d[i];
}

// wait_group N keeps the N newest groups in flight: two m64n8k16 groups into d and e; after
// wait_group 1 only d may be read (`read_early` reads e too soon).
extern "C" __global__ void wgmma_wait_one(const uint32_t* img, int words, uint64_t desc_a, uint64_t desc_b,
                                          float* out, int read_early) {
  load_image(img, words, 0);
  const uint64_t base = image_base();
  float d[4] = {0, 0, 0, 0}, e[4] = {0, 0, 0, 0};
  for (int i = 0; i < 4; ++i) {   // CUTLASS's warpgroup_fence_operand: defined before the wgmma.fence
    asm volatile("" : "+f"(d[i])::"memory");
    asm volatile("" : "+f"(e[i])::"memory");
  }
#define WGMMA_N8(R)                                                                                 \
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");                                           \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %6, 0;\n"                                        \
               "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, 0, 0;\n}" \
               : "+f"(R[0]), "+f"(R[1]), "+f"(R[2]), "+f"(R[3]) : "l"(desc_a + base), "l"(desc_b + base), "r"(1)); \
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory")
  WGMMA_N8(d);
  WGMMA_N8(e);
  asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
  for (int i = 0; i < 4; ++i) out[threadIdx.x * 8 + i] = d[i];
  if (read_early) out[threadIdx.x * 8 + 4] = e[0];
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  for (int i = 0; i < 4; ++i) out[threadIdx.x * 8 + 4 + i] = e[i];
}

// A stage reused: warp 1 writes the tile (generic stores, as an epilogue would) and arrives on
// `done`; warp 0 waits for that, TMA-loads a box over it, and warp 2 reads the box after the
// full barrier. Every access is ordered by an mbarrier, none by a CTA barrier.
extern "C" __global__ void tma_reuses_a_stage(const __grid_constant__ CUtensorMap tmap, float* out) {
  extern __shared__ __align__(1024) float stage[];
  __shared__ __align__(8) uint64_t done, full;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    mbar_init(smem_u32(&done), 32);
    mbar_init(smem_u32(&full), 1);
  }
  __syncthreads();
  if (warp == 1) {
    stage[lane] = -1.0f;
    mbar_arrive(smem_u32(&done));
  } else if (warp == 0) {
    mbar_wait(smem_u32(&done), 0);
    if (lane == 0) {
      mbar_arrive_expect_tx(smem_u32(&full), 128);
      asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                   " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_u32(stage)), "l"(&tmap), "r"(smem_u32(&full)),
                   "r"(0), "r"(0) : "memory");
    }
  } else {
    mbar_wait(smem_u32(&full), 0);
    out[lane] = stage[lane];
  }
}

// Reduce-adds: every CTA adds its tile (`in`, 32 floats) into the box at (c0, c1) of the tensor
// (`tensor`), or (`tensor` = 0) into dst[0:32] with the untiled form.
extern "C" __global__ void tma_reduce_add(const __grid_constant__ CUtensorMap tmap, const float* in, float* dst,
                                          int tensor, int c0, int c1) {
  extern __shared__ __align__(1024) float sums[];
  sums[threadIdx.x] = in[threadIdx.x];
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0) {
    if (tensor) {
      asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.bulk_group [%0, {%1, %2}], [%3];"
                   ::"l"(&tmap), "r"(c0), "r"(c1), "r"(smem_u32(sums)) : "memory");
    } else {
      asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                   ::"l"(dst), "r"(smem_u32(sums)), "r"(128) : "memory");
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  }
}

// Untiled bulk copies: thread 0 loads `nbytes` of `in` into shared memory (announcing `expect`
// bytes), every thread waits, and thread 0 stores them to `out`.
extern "C" __global__ void bulk_copy_roundtrip(const float* in, float* out, int nbytes, int expect) {
  extern __shared__ __align__(128) float staged[];
  __shared__ __align__(8) uint64_t bar;
  const uint32_t b = smem_u32(&bar);
  if (threadIdx.x == 0) mbar_init(b, 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    mbar_arrive_expect_tx(b, expect);
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(staged)), "l"(in), "r"(nbytes), "r"(b) : "memory");
  }
  mbar_wait(b, 0);
  if (threadIdx.x == 0) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(out), "r"(smem_u32(staged)),
                 "r"(nbytes) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
}

// A 2-stage ring through shared memory read and written by generic loads and stores: producer
// warp 0 fills stage i % 2 with row i of `a` (64 floats; with `tma`, by a bulk copy that the
// full barrier counts in transaction bytes), consumer warps 1 and 2 each read their half after
// waiting on the stage's full barrier, swap halves through `x` ordered by named barrier 1 (64
// threads, fewer than the block's 96), and free the stage on its empty barrier:
// out[i] = a[i] + 2 * (a[i] with its halves swapped). `misuse` 1: consumer warp 2 skips its
// full-barrier wait; 2: the producer skips its empty-barrier wait; 3: the consumers skip the
// named barriers around the swap.
extern "C" __global__ void mbarrier_ring(const float* a, float* out, int rounds, int tma, int misuse) {
  __shared__ __align__(128) float stage[2][64];
  __shared__ float x[64];
  __shared__ __align__(8) uint64_t full[2], empty[2];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < 2; ++s) {
      mbar_init(smem_u32(&full[s]), tma ? 1 : 32);
      mbar_init(smem_u32(&empty[s]), 64);
    }
  }
  __syncthreads();
  for (int i = 0; i < rounds; ++i) {
    const int s = i % 2, parity = (i / 2) & 1;
    if (warp == 0) {
      if (misuse != 2) mbar_wait(smem_u32(&empty[s]), parity ^ 1);
      if (!tma) {
        stage[s][lane] = a[i * 64 + lane];
        stage[s][lane + 32] = a[i * 64 + lane + 32];
        mbar_arrive(smem_u32(&full[s]));
      } else if (lane == 0) {
        mbar_arrive_expect_tx(smem_u32(&full[s]), 256);
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(smem_u32(stage[s])), "l"(a + i * 64), "r"(256), "r"(smem_u32(&full[s])) : "memory");
      }
    } else {
      const int c = warp - 1;
      if (!(misuse == 1 && c == 1)) mbar_wait(smem_u32(&full[s]), parity);
      const float mine = stage[s][32 * c + lane];
      x[32 * c + lane] = 2.0f * mine;
      if (misuse != 3) named_sync(1, 64);
      out[i * 64 + 32 * c + lane] = mine + x[32 * (1 - c) + lane];
      if (misuse != 3) named_sync(1, 64);   // both halves read before the next round rewrites x
      mbar_arrive(smem_u32(&empty[s]));
    }
  }
}

// An mbarrier addressed 64 bytes below its 32-bit shared address, through the address's
// immediate offset (`below`) or the register itself: the address wraps at 2^32, outside the
// CTA's shared memory, and the init must be refused (on a GPU: an illegal address).
extern "C" __global__ void mbarrier_below(int below_in_register) {
  __shared__ __align__(8) uint64_t bar[2];
  const uint32_t b = smem_u32(&bar[0]);
  if (below_in_register) {
    mbar_init(b - 64, 1);
  } else {
    asm volatile("mbarrier.init.shared::cta.b64 [%0+-64], %1;" ::"r"(b), "r"(1) : "memory");
  }
}

// ---- Where the hardware orders less than a naive emulation would (tests/test_emulator_hopper_order.py)
// wgmma is no barrier: warp w of warpgroup 0 stores the words i of the image with owner[i] ==
// w + 4 * phase; phase 0's stores end with fence.proxy.async and bar.sync 1, 128, phase 1's with
// fence.proxy.async and `sync` (0: nothing, 1: __syncwarp, 2: bar.sync 1, 128); then the
// warpgroup's wgmma reads the image. Warp 4 exits at once: the named barrier is a partial one.
extern "C" __global__ void wgmma_peer_stores(const uint32_t* img, const int* owner, int words, uint64_t desc_a,
                                             uint64_t desc_b, float* out, int sync) {
  extern __shared__ __align__(1024) uint32_t smem_img[];
  if (threadIdx.x >= 128) return;
  const int warp = threadIdx.x / 32;
  for (int phase = 0; phase < 2; ++phase) {
    for (int i = threadIdx.x % 32; i < words; i += 32)
      if (owner[i] == warp + 4 * phase) smem_img[i] = img[i];
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    if (phase == 0) named_sync(1, 128);
  }
  if (sync == 1) __syncwarp();
  if (sync == 2) named_sync(1, 128);
  const uint64_t base = image_base();
  float d[32];
  for (int i = 0; i < 32; ++i) {   // defined before the wgmma.fence (warpgroup_fence_operand)
    d[i] = 0.0f;
    asm volatile("" : "+f"(d[i])::"memory");
  }
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " D_REGS ", %32, %33, p, 1, 1, 0, 0;\n}"
               : D_OUTS : "l"(desc_a + base), "l"(desc_b + base), "r"(0));
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  for (int i = 0; i < 32; ++i) out[threadIdx.x * 32 + i] = d[i];
}

// An mbarrier of `count` arrivals that thread 0 initializes before a __syncthreads: its address.
__device__ __forceinline__ uint32_t block_mbarrier(uint64_t* bar, uint32_t count) {
  const uint32_t b = smem_u32(bar);
  if (threadIdx.x == 0) mbar_init(b, count);
  __syncthreads();
  return b;
}

// A diverged wait: lane 0 of warp 0 alone waits on the barrier (its warp's other lanes went on
// to the kernel's end), which warp 1 completes after `delay` loop trips and storing `value`
// (delay < 0: never).
extern "C" __global__ void diverged_wait(int* out, int value, int delay) {
  __shared__ __align__(8) uint64_t bar;
  __shared__ int data;
  const uint32_t b = block_mbarrier(&bar, 1);
  if (threadIdx.x == 0) {
    mbar_wait(b, 0);
    out[0] = data;
  } else if (threadIdx.x == 32 && delay >= 0) {
    int x = value;
    for (int i = 0; i < delay; ++i) asm volatile("add.s32 %0, %0, 1;" : "+r"(x));
    data = x - delay;
    mbar_arrive(b);
  }
}

// An mbarrier phase hands `value` from warp 0 to warp 1, the phase completed by warp 0 (arrival
// count 1) `how`: 0 mbarrier.arrive after the store; 1 arrive.expect_tx of 4 bytes before the
// store and complete_tx of them after it (the phase completes at the complete_tx, which is
// .relaxed: it orders nothing); 2 expect_tx, the store, complete_tx, then the arrival; 3 an
// arrive.relaxed after the store; 4 as 0, but warp 1 waits with try_wait.relaxed.
extern "C" __global__ void complete_tx_handoff(int* out, int value, int how) {
  __shared__ __align__(8) uint64_t bar;
  __shared__ int data;
  const uint32_t b = block_mbarrier(&bar, 1);
  if (threadIdx.x == 0) {
    if (how == 1) mbar_arrive_expect_tx(b, 4);
    if (how == 2) asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], 4;" ::"r"(b) : "memory");
    data = value;
    if (how == 1 || how == 2) mbar_complete_tx(b, 4);
    if (how == 3) asm volatile("mbarrier.arrive.relaxed.cta.shared::cta.b64 _, [%0];" ::"r"(b) : "memory");
    if (how == 0 || how == 2 || how == 4) mbar_arrive(b);
  } else if (threadIdx.x == 32) {
    if (how == 4) {
      uint32_t done = 0;
      while (!done)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.relaxed.cta.shared::cta.b64 p, [%1], 0;\n"
                     " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(b) : "memory");
    } else {
      mbar_wait(b, 0);
    }
    out[0] = data;
  }
}

// Reads A register r[0] (with a mov, so that it is that register) while the wgmma that uses it
// is in flight (`early`), or after its wait_group. The PTX ISA makes the first undefined: an
// in-flight wgmma's A-fragment registers, like its accumulators, may be accessed only after the
// wait_group that retires it.
extern "C" __global__ void wgmma_rs_a_read(const uint32_t* img, int words, const uint32_t* a, uint64_t desc_b,
                                           float* out, uint32_t* a_out, int early) {
  load_image(img, words, 0);
  const uint64_t base = image_base();
  RS_SET;
  float d[32];
  for (int i = 0; i < 32; ++i) {
    d[i] = 0.0f;
    asm volatile("" : "+f"(d[i])::"memory");
  }
  for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[j])::"memory");
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %33, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " D_REGS ", " RS_ASM ", %32, p, 1, 1, 0;\n}"
               : D_OUTS : "l"(desc_b + base), "r"(0), RS_IN);
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  uint32_t peek = 0;
  if (early) asm volatile("mov.b32 %0, %1;" : "=r"(peek) : "r"(r[0]) : "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  if (!early) asm volatile("mov.b32 %0, %1;" : "=r"(peek) : "r"(r[0]) : "memory");
  a_out[threadIdx.x] = peek;
  for (int i = 0; i < 32; ++i) out[threadIdx.x * 32 + i] = d[i];
}

// mbarrier.init must be ordered before another thread uses the barrier: thread 0 initializes it
// (after a first __syncthreads), then (`sync`) fence.mbarrier_init and __syncthreads; warp 1
// arrives after `delay` loop trips, warp 0 waits.
extern "C" __global__ void mbarrier_init_then_use(int delay, int sync) {
  __shared__ __align__(8) uint64_t bar;
  const uint32_t b = smem_u32(&bar);
  __syncthreads();
  if (threadIdx.x == 0) mbar_init(b, 32);
  if (sync) {
    if (threadIdx.x == 0) asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();
  }
  if (threadIdx.x >= 32) {
    int x = 0;
    for (int i = 0; i < delay; ++i) asm volatile("add.s32 %0, %0, 1;" : "+r"(x));
    if (x == delay) mbar_arrive(b);
  } else {
    mbar_wait(b, 0);
  }
}
