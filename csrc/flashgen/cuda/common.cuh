// Device building blocks shared by the flashgen CUDA kernels (sm_80+):
// cp.async tile loads, ldmatrix, mma.sync wrappers and per-element-type
// "Ops" that hide the difference between the f16/bf16 path (m16n8k16) and the
// f32 path (m16n8k8 TF32, error-compensated by default).
//
// Everything lives in an anonymous namespace on purpose: the generated
// libraries link several spec translation units (possibly built for
// different architectures) into one shared object, and internal linkage keeps
// each TU's kernels and their host stubs private to that TU.
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16 / m16n8k8"),
// with lane = 4 * g + t (g = groupID 0..7, t = thread in group 0..3):
//   C/D (16x8, f32):  c0,c1 -> row g,   cols 2t, 2t+1;  c2,c3 -> row g+8, same cols.
//   A f16 (16x16):    r0 = A[g][2t..2t+1], r1 = A[g+8][2t..], r2 = A[g][2t+8..], r3 = A[g+8][2t+8..]
//   B f16 (16x8):     r0 = B[2t..2t+1][g], r1 = B[2t+8..2t+9][g]
//   A tf32 (16x8):    a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4], a3 = A[g+8][t+4]
//   B tf32 (8x8):     b0 = B[t][g], b1 = B[t+4][g]
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

// f32 inputs use TF32 tensor cores. With FLASHGEN_F32_3XTF32=1 (default) every
// product is computed as a_hi*b_hi + a_hi*b_lo + a_lo*b_hi, where x_hi is x
// rounded to TF32 and x_lo the TF32-rounded remainder: ~fp32 accuracy
// (relative error of a product ~2^-21) at 3x the tensor-core work. With 0, a
// single TF32 product per term (10-bit mantissa, relative error ~2^-11).
#ifndef FLASHGEN_F32_3XTF32
#define FLASHGEN_F32_3XTF32 1
#endif

#define FG_DEV __device__ __forceinline__

namespace flashgen {
namespace cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

// ---------------------------------------------------------------------------
// PTX wrappers
// ---------------------------------------------------------------------------
FG_DEV uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// 16-byte global->shared copy; when !valid nothing is read and the 16 bytes
// are zero-filled (src-size 0).
FG_DEV void cp_async_16(void* dst_smem, const void* src_gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst_smem)), "l"(src_gmem),
               "r"(src_bytes)
               : "memory");
}
FG_DEV void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
FG_DEV void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

FG_DEV void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
FG_DEV void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

FG_DEV void mma_16816_f16(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
FG_DEV void mma_16816_bf16(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
FG_DEV void mma_1688_tf32(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// 2^x, approximate (ex2.approx, ~2 ulp); ex2(-inf) = +0.
FG_DEV float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

FG_DEV uint32_t to_tf32(float x) {
  uint32_t y;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(y) : "f"(x));
  return y;
}

FG_DEV float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
FG_DEV float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

FG_DEV int lane_id() { return threadIdx.x & 31; }

// ---------------------------------------------------------------------------
// Element conversions
// ---------------------------------------------------------------------------
template <class T>
FG_DEV float to_float(T x);
template <>
FG_DEV float to_float<__half>(__half x) { return __half2float(x); }
template <>
FG_DEV float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
FG_DEV float to_float<float>(float x) { return x; }

template <class T>
FG_DEV T from_float(float x);
template <>
FG_DEV __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
FG_DEV __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
FG_DEV float from_float<float>(float x) { return x; }

// ---------------------------------------------------------------------------
// Ops: warp-level MMA fragments for one element type.
//
// Shared-memory operand views (ld = row stride in elements):
//   load_a_rm   A[m][k] = s[m*ld + k]      (16 x KS tile at m0, k0)
//   load_a_cm   A[m][k] = s[k*ld + m]
//   load_b2_nk  B[k][n] = s[n*ld + k]      (two 8-wide n tiles: n0, n0+8)
//   load_b2_kn  B[k][n] = s[k*ld + n]
//   load_b2_kn_regA  like load_b2_kn, but with the k order that a_from_acc
//               produces (identical for f16/bf16; permuted for TF32)
//   a_from_acc  A fragment for k-step ks taken from f32 accumulators of a
//               16 x (8*ntiles) C tile (the "P stays in registers" trick)
// ---------------------------------------------------------------------------
template <class T>
struct HalfOps {
  static_assert(std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value, "f16/bf16 only");
  using Elem = T;
  static constexpr int KS = 16;  // k per mma
  struct FragA {
    uint32_t r[4];
  };
  struct FragB {
    uint32_t r[2];
  };

  FG_DEV static void mma(float* c, const FragA& a, const FragB& b) {
    if constexpr (std::is_same<T, __half>::value)
      mma_16816_f16(c, a.r, b.r);
    else
      mma_16816_bf16(c, a.r, b.r);
  }

  FG_DEV static uint32_t pack(float lo, float hi) {
    if constexpr (std::is_same<T, __half>::value) {
      __half2 v = __floats2half2_rn(lo, hi);
      return *reinterpret_cast<uint32_t*>(&v);
    } else {
      __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
      return *reinterpret_cast<uint32_t*>(&v);
    }
  }

  FG_DEV static void load_a_rm(const T* s, int ld, int m0, int k0, FragA& a) {
    const int lane = lane_id();
    // matrices: (rows 0-7, k lo) (rows 8-15, k lo) (rows 0-7, k hi) (rows 8-15, k hi)
    const T* p = s + (m0 + (lane & 15)) * ld + k0 + (lane >> 4) * 8;
    ldsm_x4(a.r, smem_addr(p));
  }
  FG_DEV static void load_a_cm(const T* s, int ld, int m0, int k0, FragA& a) {
    const int lane = lane_id(), i = lane >> 3;
    // stored rows are k; .trans hands each thread A[m][2t..2t+1]
    const T* p = s + (k0 + (lane & 7) + (i >> 1) * 8) * ld + m0 + (i & 1) * 8;
    ldsm_x4_trans(a.r, smem_addr(p));
  }
  FG_DEV static void load_b2_nk(const T* s, int ld, int n0, int k0, FragB& b0, FragB& b1) {
    const int lane = lane_id(), i = lane >> 3;
    const T* p = s + (n0 + (lane & 7) + (i >> 1) * 8) * ld + k0 + (i & 1) * 8;
    uint32_t r[4];
    ldsm_x4(r, smem_addr(p));
    b0.r[0] = r[0];
    b0.r[1] = r[1];
    b1.r[0] = r[2];
    b1.r[1] = r[3];
  }
  FG_DEV static void load_b2_kn(const T* s, int ld, int n0, int k0, FragB& b0, FragB& b1) {
    const int lane = lane_id(), i = lane >> 3;
    const T* p = s + (k0 + (lane & 7) + (i & 1) * 8) * ld + n0 + (i >> 1) * 8;
    uint32_t r[4];
    ldsm_x4_trans(r, smem_addr(p));
    b0.r[0] = r[0];
    b0.r[1] = r[1];
    b1.r[0] = r[2];
    b1.r[1] = r[3];
  }
  FG_DEV static void load_b2_kn_regA(const T* s, int ld, int n0, int k0, FragB& b0, FragB& b1) {
    load_b2_kn(s, ld, n0, k0, b0, b1);
  }
  // k-step ks covers accumulator tiles 2ks (k 0..7) and 2ks+1 (k 8..15).
  template <int N>
  FG_DEV static void a_from_acc(const float (&acc)[N][4], int ks, FragA& a) {
    a.r[0] = pack(acc[2 * ks][0], acc[2 * ks][1]);
    a.r[1] = pack(acc[2 * ks][2], acc[2 * ks][3]);
    a.r[2] = pack(acc[2 * ks + 1][0], acc[2 * ks + 1][1]);
    a.r[3] = pack(acc[2 * ks + 1][2], acc[2 * ks + 1][3]);
  }
  // Stores two consecutive elements (4 bytes, aligned).
  FG_DEV static void store2(T* p, float x, float y) { *reinterpret_cast<uint32_t*>(p) = pack(x, y); }
};

struct Tf32Ops {
  using Elem = float;
  static constexpr int KS = 8;
  static constexpr bool kX3 = FLASHGEN_F32_3XTF32 != 0;
  struct FragA {
    uint32_t hi[4], lo[4];
  };
  struct FragB {
    uint32_t hi[2], lo[2];
  };

  FG_DEV static void split(float x, uint32_t& hi, uint32_t& lo) {
    hi = to_tf32(x);
    if constexpr (kX3) lo = to_tf32(x - __uint_as_float(hi));
  }
  FG_DEV static void mma(float* c, const FragA& a, const FragB& b) {
    if constexpr (kX3) {
      mma_1688_tf32(c, a.lo, b.hi);
      mma_1688_tf32(c, a.hi, b.lo);
    }
    mma_1688_tf32(c, a.hi, b.hi);
  }
  FG_DEV static void set_a(FragA& a, float x0, float x1, float x2, float x3) {
    split(x0, a.hi[0], a.lo[0]);
    split(x1, a.hi[1], a.lo[1]);
    split(x2, a.hi[2], a.lo[2]);
    split(x3, a.hi[3], a.lo[3]);
  }
  FG_DEV static void set_b(FragB& b, float x0, float x1) {
    split(x0, b.hi[0], b.lo[0]);
    split(x1, b.hi[1], b.lo[1]);
  }

  FG_DEV static void load_a_rm(const float* s, int ld, int m0, int k0, FragA& a) {
    const int lane = lane_id(), g = lane >> 2, t = lane & 3;
    const float* p = s + (m0 + g) * ld + k0 + t;
    set_a(a, p[0], p[8 * ld], p[4], p[8 * ld + 4]);
  }
  FG_DEV static void load_a_cm(const float* s, int ld, int m0, int k0, FragA& a) {
    const int lane = lane_id(), g = lane >> 2, t = lane & 3;
    const float* p = s + (k0 + t) * ld + m0 + g;
    set_a(a, p[0], p[8], p[4 * ld], p[4 * ld + 8]);
  }
  FG_DEV static void load_b2_nk(const float* s, int ld, int n0, int k0, FragB& b0, FragB& b1) {
    const int lane = lane_id(), g = lane >> 2, t = lane & 3;
    const float* p = s + (n0 + g) * ld + k0 + t;
    set_b(b0, p[0], p[4]);
    set_b(b1, p[8 * ld], p[8 * ld + 4]);
  }
  FG_DEV static void load_b2_kn(const float* s, int ld, int n0, int k0, FragB& b0, FragB& b1) {
    const int lane = lane_id(), g = lane >> 2, t = lane & 3;
    const float* p = s + (k0 + t) * ld + n0 + g;
    set_b(b0, p[0], p[4 * ld]);
    set_b(b1, p[8], p[4 * ld + 8]);
  }
  // a_from_acc puts accumulator column 2t in k-slot t and column 2t+1 in
  // k-slot t+4 (no shuffles needed); B must use the same k order.
  FG_DEV static void load_b2_kn_regA(const float* s, int ld, int n0, int k0, FragB& b0, FragB& b1) {
    const int lane = lane_id(), g = lane >> 2, t = lane & 3;
    const float* p = s + (k0 + 2 * t) * ld + n0 + g;
    set_b(b0, p[0], p[ld]);
    set_b(b1, p[8], p[ld + 8]);
  }
  // k-step ks covers accumulator tile ks (8 columns).
  template <int N>
  FG_DEV static void a_from_acc(const float (&acc)[N][4], int ks, FragA& a) {
    set_a(a, acc[ks][0], acc[ks][2], acc[ks][1], acc[ks][3]);
  }
  FG_DEV static void store2(float* p, float x, float y) { *reinterpret_cast<float2*>(p) = make_float2(x, y); }
};

template <class T>
struct OpsFor {
  using type = HalfOps<T>;
};
template <>
struct OpsFor<float> {
  using type = Tf32Ops;
};

// ---------------------------------------------------------------------------
// Warp tile GEMMs: one warp accumulates a 16 x N f32 C tile (N / 8 accumulator
// tiles) over K, in steps of Ops::KS, two 8-wide n tiles per B load.
//   warp_gemm_abt: C += A B^T, A = rows m0.. of a [m][k] shared tile, B^T = rows
//                  n0.. of a [n][k] shared tile (S = Q K^T and its backward kin).
//   warp_gemm_pb:  C += P B, P = the 16 x K f32 accumulators `p` kept in
//                  registers (a_from_acc), B = rows k0.., columns n0.. of a
//                  [k][n] shared tile (O += P V, dV += P^T dO, dK += dS^T Q).
// ---------------------------------------------------------------------------
template <class Ops, int K, int N, class T>
FG_DEV void warp_gemm_abt(float (&c)[N / 8][4], const T* sa, int lda, int m0, const T* sb, int ldb, int n0) {
#pragma unroll
  for (int ks = 0; ks < K / Ops::KS; ++ks) {
    typename Ops::FragA a;
    Ops::load_a_rm(sa, lda, m0, ks * Ops::KS, a);
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      typename Ops::FragB b0, b1;
      Ops::load_b2_nk(sb, ldb, n0 + np * 16, ks * Ops::KS, b0, b1);
      Ops::mma(c[2 * np], a, b0);
      Ops::mma(c[2 * np + 1], a, b1);
    }
  }
}

template <class Ops, int K, int N, class T>
FG_DEV void warp_gemm_pb(float (&c)[N / 8][4], const float (&p)[K / 8][4], const T* sb, int ldb, int k0, int n0) {
#pragma unroll
  for (int ks = 0; ks < K / Ops::KS; ++ks) {
    typename Ops::FragA a;
    Ops::a_from_acc(p, ks, a);
#pragma unroll
    for (int dp = 0; dp < N / 16; ++dp) {
      typename Ops::FragB b0, b1;
      Ops::load_b2_kn_regA(sb, ldb, n0 + dp * 16, k0 + ks * Ops::KS, b0, b1);
      Ops::mma(c[2 * dp], a, b0);
      Ops::mma(c[2 * dp + 1], a, b1);
    }
  }
}

// ---------------------------------------------------------------------------
// Cooperative global -> shared tile load of ROWS rows x D elements with
// cp.async (16-byte chunks). Row r of the tile is global row row0 + r at
// g + (row0 + r) * gstride; rows >= nrows are zero-filled. The shared tile has
// a row stride of ld elements (16-byte aligned). Caller commits / waits.
// ---------------------------------------------------------------------------
template <class T, int ROWS, int D, int NT>
FG_DEV void load_tile_async(T* s, int ld, const T* g, int64_t gstride, int row0, int nrows) {
  constexpr int kEpc = 16 / sizeof(T);
  constexpr int kCpr = D / kEpc;
  constexpr int kTotal = ROWS * kCpr;
  static_assert(D % kEpc == 0, "row must be a whole number of 16-byte chunks");
#pragma unroll
  for (int it = 0; it < (kTotal + NT - 1) / NT; ++it) {
    const int idx = it * NT + static_cast<int>(threadIdx.x);
    if (kTotal % NT == 0 || idx < kTotal) {
      const int r = idx / kCpr, c = idx % kCpr;
      const int row = row0 + r;
      const bool ok = row < nrows;
      const T* src = ok ? g + static_cast<int64_t>(row) * gstride + c * kEpc : g;
      cp_async_16(s + r * ld + c * kEpc, src, ok);
    }
  }
}

}  // namespace
}  // namespace cuda
}  // namespace flashgen
