// FlashAttention for the CPU: header-only, fp32 compute, O(S*D) extra memory.
//
// Layout and masking follow flashgen/attention.h (BSHD, GQA/MQA, causal with a
// top-left or bottom-right offset; a row that sees no key gives o = 0,
// lse = -inf and no gradient).
//
// Forward, per work item (batch, q head, block of BQ query rows):
//   Qt = the q block transposed, fp32 [D][BQ] (loaded once per item);
//   for each visible key block of BK keys:
//     St = K_blk * Qt            [BK][BQ] fp32, lanes run over query rows,
//     online softmax over the key axis (row max / row sum are lane-wise, no
//     horizontal reductions), exponentials in base 2 with the scale folded in,
//     O = diag(alpha) O + P V    (P read transposed from St).
//   Key blocks that are fully masked (causal) are skipped; blocks that cross the
//   diagonal get a per-element mask.
// Backward (FlashAttention-2), per work item (batch, kv head, key chunk):
//   for each key block of the chunk (Kt, Vt transposed once per block):
//     for each q head of the group and each q block that sees the key block:
//       S = Q Kt, P = exp2(S*scale*log2e - lse*log2e), dP = dO Vt,
//       dS = scale * P o (dP - Drow), dV += P^T dO, dK += dS^T Q, dQ += dS K.
//   dQ accumulates in fp32: in dq itself (T = float and one chunk per kv head)
//   or in a [chunks][B][Sq][Hq][D] buffer reduced at the end; every accumulator
//   region belongs to exactly one work item, so there are no races.
//
// All matrix products go through one register-blocked micro-kernel written with
// GCC/Clang vector extensions (AVX-512, AVX2/FMA, or SSE2 depending on the
// target flags), so the header compiles with and without -march=native.
// Not supported: -ffast-math / -ffinite-math-only (masking relies on infinities).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "flashgen/attention.h"

namespace flashgen {
namespace cpu {

// Storage types; layout-compatible with uint16_t.
struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};
static_assert(sizeof(bf16) == 2 && std::is_standard_layout<bf16>::value, "bf16 layout");
static_assert(sizeof(f16) == 2 && std::is_standard_layout<f16>::value, "f16 layout");

// Threads to use by default: FLASHGEN_CPU_THREADS if set and > 0, else the
// hardware concurrency (at least 1).
inline int default_num_threads() {
  if (const char* e = std::getenv("FLASHGEN_CPU_THREADS")) {
    char* end = nullptr;
    long n = std::strtol(e, &end, 10);
    if (end != e && n > 0) return n > 4096 ? 4096 : static_cast<int>(n);
  }
  unsigned hc = std::thread::hardware_concurrency();
  return hc > 0 ? static_cast<int>(hc) : 1;
}

// Runs fn(i, worker) for i in [0, n) on min(num_threads, n) workers (the calling
// thread is worker 0; worker < that count). Items are handed out dynamically in
// increasing order. num_threads <= 1 runs everything inline without creating
// threads. fn must not throw.
template <typename F>
void parallel_for(int64_t n, int num_threads, F&& fn) {
  if (n <= 0) return;
  const int nt = static_cast<int>(std::min<int64_t>(std::max(num_threads, 1), n));
  if (nt <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  std::atomic<int64_t> next{0};
  auto worker = [&](int w) {
    for (;;) {
      const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n) break;
      fn(i, w);
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(nt - 1);
  for (int w = 1; w < nt; ++w) {
    try {
      threads.emplace_back(worker, w);
    } catch (...) {  // could not start a thread: the started workers take the remaining items
      break;
    }
  }
  worker(0);
  for (auto& t : threads) t.join();
}

namespace detail {

#define FLASHGEN_CPU_INLINE inline __attribute__((always_inline))

// ---------------------------------------------------------------------------
// Scalar conversions (round-to-nearest-even, NaN and infinity preserving).
// ---------------------------------------------------------------------------
FLASHGEN_CPU_INLINE float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
FLASHGEN_CPU_INLINE uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

FLASHGEN_CPU_INLINE float bf16_bits_to_f32(uint16_t h) { return bits_to_f32(uint32_t(h) << 16); }

FLASHGEN_CPU_INLINE uint16_t f32_to_bf16_bits(float f) {
  const uint32_t u = f32_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);  // quiet NaN, keep sign/payload
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

FLASHGEN_CPU_INLINE float f16_bits_to_f32_soft(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  uint32_t u;
  if (em >= 0x7c00u) {
    u = 0x7f800000u | ((em & 0x3ffu) << 13);  // inf / NaN (payload kept)
  } else if (em >= 0x0400u) {
    u = (em << 13) + (uint32_t(127 - 15) << 23);  // normal
  } else {
    u = f32_to_bits(float(em) * 5.9604644775390625e-8f);  // subnormal / zero: em * 2^-24, exact
  }
  return bits_to_f32(u | sign);
}

FLASHGEN_CPU_INLINE uint16_t f32_to_f16_bits_soft(float f) {
  uint32_t u = f32_to_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  uint16_t o;
  if (u >= 0x7f800000u) {
    o = u > 0x7f800000u ? uint16_t(0x7e00u | ((u >> 13) & 0x3ffu)) : uint16_t(0x7c00u);
  } else if (u >= 0x477ff000u) {  // >= 65520: rounds to infinity
    o = 0x7c00u;
  } else if (u >= 0x38800000u) {  // >= 2^-14: normal half
    const uint32_t r = u + 0x0fffu + ((u >> 13) & 1u);
    o = uint16_t((r >> 13) - (uint32_t(127 - 15) << 10));
  } else {  // half subnormal or zero: add 0.5 so the f32 ulp is 2^-24 and let the FPU round
    volatile float a = bits_to_f32(u);  // volatile: keep the rounding add as written
    const float s = a + 0.5f;
    o = uint16_t(f32_to_bits(s) - 0x3f000000u);
  }
  return uint16_t(o | sign);
}

FLASHGEN_CPU_INLINE float f16_bits_to_f32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return f16_bits_to_f32_soft(h);
#endif
}
FLASHGEN_CPU_INLINE uint16_t f32_to_f16_bits(float f) {
#if defined(__F16C__)
  return uint16_t(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
  return f32_to_f16_bits_soft(f);
#endif
}

FLASHGEN_CPU_INLINE float to_f32(float x) { return x; }
FLASHGEN_CPU_INLINE float to_f32(bf16 x) { return bf16_bits_to_f32(x.bits); }
FLASHGEN_CPU_INLINE float to_f32(f16 x) { return f16_bits_to_f32(x.bits); }

template <typename T>
FLASHGEN_CPU_INLINE T from_f32(float x);
template <>
FLASHGEN_CPU_INLINE float from_f32<float>(float x) {
  return x;
}
template <>
FLASHGEN_CPU_INLINE bf16 from_f32<bf16>(float x) {
  return bf16{f32_to_bf16_bits(x)};
}
template <>
FLASHGEN_CPU_INLINE f16 from_f32<f16>(float x) {
  return f16{f32_to_f16_bits(x)};
}

// Bulk conversions of n contiguous elements.
template <typename T>
inline void load_f32(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f32(src[i]);
}
template <>
inline void load_f32<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, size_t(n) * sizeof(float));
}
template <>
inline void load_f32<bf16>(const bf16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = uint32_t(s[i]) << 16;
    std::memcpy(dst + i, &u, 4);
  }
}
#if defined(__F16C__)
template <>
inline void load_f32<f16>(const f16* src, float* dst, int64_t n) {
  const int64_t n8 = n & ~int64_t(7);
  for (int64_t i = 0; i < n8; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (int64_t i = n8; i < n; ++i) dst[i] = f16_bits_to_f32(src[i].bits);
}
#endif

template <typename T>
inline void store_from_f32(const float* src, T* dst, int64_t n, float mul) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_f32<T>(src[i] * mul);
}
template <>
inline void store_from_f32<bf16>(const float* src, bf16* dst, int64_t n, float mul) {
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = f32_to_bits(src[i] * mul);
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t q = (u >> 16) | 0x0040u;
    d[i] = uint16_t((u & 0x7fffffffu) > 0x7f800000u ? q : r);
  }
}
#if defined(__F16C__)
template <>
inline void store_from_f32<f16>(const float* src, f16* dst, int64_t n, float mul) {
  const int64_t n8 = n & ~int64_t(7);
  const __m256 m = _mm256_set1_ps(mul);
  for (int64_t i = 0; i < n8; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(src + i), m), _MM_FROUND_TO_NEAREST_INT));
  for (int64_t i = n8; i < n; ++i) dst[i] = f16{f32_to_f16_bits(src[i] * mul)};
}
#endif

// ---------------------------------------------------------------------------
// Vector type and helpers.
// ---------------------------------------------------------------------------
#if defined(__AVX512F__)
#define FLASHGEN_CPU_VBYTES 64
#elif defined(__AVX__)
#define FLASHGEN_CPU_VBYTES 32
#else
#define FLASHGEN_CPU_VBYTES 16
#endif

typedef float vf __attribute__((vector_size(FLASHGEN_CPU_VBYTES)));
typedef int32_t vi __attribute__((vector_size(FLASHGEN_CPU_VBYTES)));
constexpr int W = FLASHGEN_CPU_VBYTES / 4;  // floats per vector

// Micro-kernel tile: RMAX rows x (NVMAX * W) columns of accumulators.
#if FLASHGEN_CPU_VBYTES == 64
constexpr int RMAX = 4, NVMAX = 4;  // 16 zmm accumulators of 32 (6x4 and 7x4 measured no faster)
#else
constexpr int RMAX = 4, NVMAX = 2;  // 8 accumulators of 16
#endif

// Broadcasts. (A lane-by-lane loop makes GCC emit one masked broadcast per lane.)
FLASHGEN_CPU_INLINE vf splat(float x) {
#if FLASHGEN_CPU_VBYTES == 64
  return (vf)_mm512_set1_ps(x);
#elif FLASHGEN_CPU_VBYTES == 32
  return (vf)_mm256_set1_ps(x);
#elif defined(__SSE__)
  return (vf)_mm_set1_ps(x);
#else
  return x - vf{};
#endif
}
FLASHGEN_CPU_INLINE vi splat_i(int32_t x) {
#if FLASHGEN_CPU_VBYTES == 64
  return (vi)_mm512_set1_epi32(x);
#elif FLASHGEN_CPU_VBYTES == 32
  return (vi)_mm256_set1_epi32(x);
#elif defined(__SSE2__)
  return (vi)_mm_set1_epi32(x);
#else
  return x + vi{};
#endif
}
FLASHGEN_CPU_INLINE vi iota_i() {
  vi v;
  for (int i = 0; i < W; ++i) v[i] = i;
  return v;
}
FLASHGEN_CPU_INLINE vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(vf));
  return v;
}
FLASHGEN_CPU_INLINE void storev(float* p, vf v) { std::memcpy(p, &v, sizeof(vf)); }

FLASHGEN_CPU_INLINE vf vfma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}
FLASHGEN_CPU_INLINE vf vmax(vf a, vf b) {
#if defined(__AVX512F__)
  // Masked forms: the unmasked intrinsics trip -Wmaybe-uninitialized in GCC 12.
  return (vf)_mm512_mask_max_ps((__m512)a, __mmask16(0xffff), (__m512)a, (__m512)b);
#else
  return a > b ? a : b;
#endif
}

// 2^x, ~2 ulp for x in [-126, 127]; x <= -127 (including -inf) gives 0.
FLASHGEN_CPU_INLINE vf exp2v(vf x) {
#if defined(__AVX512F__)
  x = vmax(x, splat(-150.0f));
  const vf n = (vf)_mm512_mask_roundscale_ps((__m512)x, __mmask16(0xffff), (__m512)x,
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const vf lo = splat(-127.0f), hi = splat(127.0f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // n = floor(x + 0.5) without relying on the rounding mode.
  const vf xr = x + splat(0.5f);
  vi ni = __builtin_convertvector(xr, vi);  // truncation toward zero
  ni += (vi)(__builtin_convertvector(ni, vf) > xr);  // -1 where truncation rounded up
  const vf n = __builtin_convertvector(ni, vf);
#endif
  const vf f = x - n;  // [-0.5, 0.5]
  // Cephes exp2f minimax polynomial on [-0.5, 0.5].
  vf p = splat(1.535336188319500e-4f);
  p = vfma(p, f, splat(1.339887440266574e-3f));
  p = vfma(p, f, splat(9.618437357674640e-3f));
  p = vfma(p, f, splat(5.550332471162809e-2f));
  p = vfma(p, f, splat(2.402264791363012e-1f));
  p = vfma(p, f, splat(6.931472028550421e-1f));
  p = vfma(p, f, splat(1.0f));
#if defined(__AVX512F__)
  return (vf)_mm512_mask_scalef_ps((__m512)p, __mmask16(0xffff), (__m512)p, (__m512)n);
#else
  return p * (vf)((ni + splat_i(127)) << 23);  // n = -127 gives the bit pattern 0, i.e. 0.0f
#endif
}

// ---------------------------------------------------------------------------
// GEMM: C[M][N] (=|+=) A[M][K] * B[K][N], N a multiple of W.
// A is read by scalar broadcasts at A[r*sar + k*sak] (any layout); B rows are
// contiguous with row stride ldb; C rows with stride ldc. With SCALE, C is
// first multiplied by rs[r] (row scale).
// ---------------------------------------------------------------------------
template <int R, int NV, bool ACC, bool SCALE>
inline void micro_kernel(int64_t K, const float* __restrict A, int64_t sar, int64_t sak,
                         const float* __restrict B, int64_t ldb, float* __restrict C, int64_t ldc,
                         const float* __restrict rs) {
  vf acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    vf sc = splat(SCALE ? rs[r] : 1.0f);
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      if (ACC) {
        acc[r][v] = loadv(C + r * ldc + v * W);
        if (SCALE) acc[r][v] *= sc;
      } else {
        acc[r][v] = splat(0.0f);
      }
    }
  }
  const float* ap[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) ap[r] = A + r * sar;
  for (int64_t k = 0; k < K; ++k) {
    vf bv[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) bv[v] = loadv(B + v * W);
    B += ldb;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vf a = splat(*ap[r]);
      ap[r] += sak;
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] = vfma(a, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) storev(C + r * ldc + v * W, acc[r][v]);
}

template <int R, bool ACC, bool SCALE>
inline void micro_rows(int nv, int64_t K, const float* A, int64_t sar, int64_t sak, const float* B, int64_t ldb,
                       float* C, int64_t ldc, const float* rs) {
  static_assert(NVMAX == 2 || NVMAX == 4, "NVMAX");
  switch (nv) {
    case 1: micro_kernel<R, 1, ACC, SCALE>(K, A, sar, sak, B, ldb, C, ldc, rs); break;
    case 2: micro_kernel<R, 2, ACC, SCALE>(K, A, sar, sak, B, ldb, C, ldc, rs); break;
#if FLASHGEN_CPU_VBYTES == 64
    case 3: micro_kernel<R, 3, ACC, SCALE>(K, A, sar, sak, B, ldb, C, ldc, rs); break;
    case 4: micro_kernel<R, 4, ACC, SCALE>(K, A, sar, sak, B, ldb, C, ldc, rs); break;
#endif
    default: break;
  }
}

template <int R, bool ACC, bool SCALE>
FLASHGEN_CPU_INLINE void micro_tail(int rem, int nv, int64_t K, const float* A, int64_t sar, int64_t sak,
                                    const float* B, int64_t ldb, float* C, int64_t ldc, const float* rs) {
  if constexpr (R >= 1) {
    if (rem == R)
      micro_rows<R, ACC, SCALE>(nv, K, A, sar, sak, B, ldb, C, ldc, rs);
    else
      micro_tail<R - 1, ACC, SCALE>(rem, nv, K, A, sar, sak, B, ldb, C, ldc, rs);
  }
}

template <bool ACC, bool SCALE = false>
inline void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t sar, int64_t sak, const float* B,
                 int64_t ldb, float* C, int64_t ldc, const float* rs = nullptr) {
  const int64_t nvt = N / W;
  for (int64_t v0 = 0; v0 < nvt; v0 += NVMAX) {
    const int nv = static_cast<int>(std::min<int64_t>(NVMAX, nvt - v0));
    const float* Bv = B + v0 * W;
    float* Cv = C + v0 * W;
    int64_t r = 0;
    for (; r + RMAX <= M; r += RMAX)
      micro_rows<RMAX, ACC, SCALE>(nv, K, A + r * sar, sar, sak, Bv, ldb, Cv + r * ldc, ldc, rs + (SCALE ? r : 0));
    const float* Ar = A + r * sar;
    float* Cr = Cv + r * ldc;
    const float* rr = rs + (SCALE ? r : 0);
    micro_tail<RMAX - 1, ACC, SCALE>(static_cast<int>(M - r), nv, K, Ar, sar, sak, Bv, ldb, Cr, ldc, rr);
  }
}

// ---------------------------------------------------------------------------
// Workspace.
// ---------------------------------------------------------------------------
struct AlignedFloats {
  float* p = nullptr;
  AlignedFloats() = default;
  explicit AlignedFloats(size_t n) {
    p = static_cast<float*>(::operator new(std::max<size_t>(n, 1) * sizeof(float), std::align_val_t(64)));
  }
  AlignedFloats(const AlignedFloats&) = delete;
  AlignedFloats& operator=(const AlignedFloats&) = delete;
  AlignedFloats(AlignedFloats&& o) noexcept : p(o.p) { o.p = nullptr; }
  ~AlignedFloats() {
    if (p) ::operator delete(p, std::align_val_t(64));
  }
};

constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Block sizes (tuning knobs; multiples of 16). Measured on Zen 5, D=64: fwd
// 128x64 and bwd 64x64 are at or near the best of {32,64,128,256} x {64,128}.
#ifndef FLASHGEN_CPU_FWD_BQ
#define FLASHGEN_CPU_FWD_BQ 128
#endif
#ifndef FLASHGEN_CPU_FWD_BK
#define FLASHGEN_CPU_FWD_BK 64
#endif
#ifndef FLASHGEN_CPU_BWD_BQ
#define FLASHGEN_CPU_BWD_BQ 64
#endif
#ifndef FLASHGEN_CPU_BWD_BK
#define FLASHGEN_CPU_BWD_BK 64
#endif
constexpr int kFwdBq = FLASHGEN_CPU_FWD_BQ, kFwdBk = FLASHGEN_CPU_FWD_BK;
constexpr int kBwdBq = FLASHGEN_CPU_BWD_BQ, kBwdBk = FLASHGEN_CPU_BWD_BK;
static_assert(kFwdBq % 16 == 0 && kFwdBk % 16 == 0 && kBwdBq % 16 == 0 && kBwdBk % 16 == 0,
              "block sizes must be multiples of 16");

template <int D>
constexpr size_t fwd_ws_floats() {
  return size_t(D) * kFwdBq + size_t(kFwdBk) * kFwdBq + size_t(kFwdBq) * D + 2 * size_t(kFwdBk) * D + 3 * kFwdBq + D;
}

// Copies n rows of D elements (row stride ld, in elements) to fp32 columns of
// a [D][ldt] matrix and zero-fills columns [n, npad).
template <typename T, int D>
inline void load_transposed(const T* src, int64_t ld, int64_t n, int64_t npad, float* dst, int64_t ldt,
                            float* tmp) {
  for (int64_t i = 0; i < n; ++i) {
    const float* row;
    if (std::is_same<T, float>::value) {
      row = reinterpret_cast<const float*>(src + i * ld);
    } else {
      load_f32<T>(src + i * ld, tmp, D);
      row = tmp;
    }
    for (int d = 0; d < D; ++d) dst[d * ldt + i] = row[d];
  }
  if (npad > n)
    for (int d = 0; d < D; ++d)
      for (int64_t i = n; i < npad; ++i) dst[d * ldt + i] = 0.0f;
}

// Copies n rows (input row stride ld_in) to a contiguous fp32 [n][D] buffer and
// returns it with *ld = D. Also done for float: reading the strided input
// directly (stride Hkv*D, often a multiple of 2 KiB) thrashes L1 sets.
template <typename T, int D>
FLASHGEN_CPU_INLINE const float* rows_f32(const T* src, int64_t ld_in, int64_t n, float* buf, int64_t* ld) {
  for (int64_t i = 0; i < n; ++i) load_f32<T>(src + i * ld_in, buf + i * D, D);
  *ld = D;
  return buf;
}

// ---------------------------------------------------------------------------
// Forward work item: one (batch, q head, q block).
// ---------------------------------------------------------------------------
template <typename T, int D>
void fwd_item(const T* q, const T* k, const T* v, T* o, float* lse, const AttentionShape& s,
              const AttentionAttrs& a, int64_t b, int64_t h, int64_t qb, float* ws) {
  constexpr int BQ = kFwdBq, BK = kFwdBk;
  const int64_t Sq = s.seqlen_q, Sk = s.seqlen_k, Hq = s.heads_q, Hkv = s.heads_kv;
  const int64_t hk = h / (Hq / Hkv);
  const int64_t q0 = qb * BQ;
  const int64_t nq = std::min<int64_t>(BQ, Sq - q0);
  const int64_t nqp = round_up(nq, W);
  const int nv = static_cast<int>(nqp / W);
  const int64_t off = a.causal ? causal_offset(s, a) : 0;

  float* Qt = ws;                 // [D][BQ]
  float* St = Qt + D * BQ;        // [BK][BQ]
  float* Oacc = St + BK * BQ;     // [BQ][D]
  float* Kc = Oacc + BQ * D;      // [BK][D]
  float* Vc = Kc + BK * D;        // [BK][D]
  float* mrow = Vc + BK * D;      // [BQ]
  float* lrow = mrow + BQ;        // [BQ]
  float* alpha = lrow + BQ;       // [BQ]
  float* tmp = alpha + BQ;        // [D]

  const int64_t ldq = Hq * D, ldkv = Hkv * D;
  load_transposed<T, D>(q + ((b * Sq + q0) * Hq + h) * D, ldq, nq, nqp, Qt, BQ, tmp);
  std::memset(Oacc, 0, sizeof(float) * size_t(nq) * D);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < nqp; ++i) {
    mrow[i] = ninf;
    lrow[i] = 0.0f;
  }

  int64_t kend = Sk;
  if (a.causal) kend = std::max<int64_t>(0, std::min<int64_t>(Sk, q0 + nq + off));
  const vf cv = splat(a.scale * kLog2e);
  const vf ninfv = splat(ninf), zero = splat(0.0f);
  const vi iota = iota_i();
  vf mx[BQ / W], msub[BQ / W], lacc[BQ / W];

  for (int64_t k0 = 0; k0 < kend; k0 += BK) {
    const int64_t nk = std::min<int64_t>(BK, kend - k0);
    int64_t ldk, ldv;
    const float* Kp = rows_f32<T, D>(k + ((b * Sk + k0) * Hkv + hk) * D, ldkv, nk, Kc, &ldk);
    const float* Vp = rows_f32<T, D>(v + ((b * Sk + k0) * Hkv + hk) * D, ldkv, nk, Vc, &ldv);

    // St = K * Qt : scores, one key per row, query rows along the lanes.
    gemm<false>(nk, nqp, D, Kp, ldk, 1, Qt, BQ, St, BQ);

    // Online softmax (base 2), lane-wise over query rows.
    const bool diag = a.causal && (k0 + nk - 1 > q0 + off);
    for (int t = 0; t < nv; ++t) mx[t] = ninfv;
    for (int64_t j = 0; j < nk; ++j) {
      float* sr = St + j * BQ;
      if (diag) {
        // Query row i (local) sees key k0+j iff i >= k0 + j - off - q0.
        const int64_t lo = std::min<int64_t>(std::max<int64_t>(k0 + j - off - q0, -1), BQ);
        const vi lov = splat_i(static_cast<int32_t>(lo));
        for (int t = 0; t < nv; ++t) {
          vf x = loadv(sr + t * W) * cv;
          x = (iota + splat_i(t * W)) >= lov ? x : ninfv;
          storev(sr + t * W, x);
          mx[t] = vmax(mx[t], x);
        }
      } else {
        for (int t = 0; t < nv; ++t) {
          const vf x = loadv(sr + t * W) * cv;
          storev(sr + t * W, x);
          mx[t] = vmax(mx[t], x);
        }
      }
    }
    for (int t = 0; t < nv; ++t) {
      const vf mold = loadv(mrow + t * W);
      const vf mnew = vmax(mold, mx[t]);
      const vf muse = mnew == ninfv ? zero : mnew;
      storev(alpha + t * W, exp2v(mold - muse));
      storev(mrow + t * W, mnew);
      msub[t] = muse;
      lacc[t] = zero;
    }
    for (int64_t j = 0; j < nk; ++j) {
      float* sr = St + j * BQ;
      for (int t = 0; t < nv; ++t) {
        const vf p = exp2v(loadv(sr + t * W) - msub[t]);
        storev(sr + t * W, p);
        lacc[t] += p;
      }
    }
    for (int t = 0; t < nv; ++t) storev(lrow + t * W, loadv(lrow + t * W) * loadv(alpha + t * W) + lacc[t]);

    // O = diag(alpha) O + P V; rows that see nothing of this block are unchanged.
    int64_t r0 = 0;
    if (a.causal) r0 = std::min<int64_t>(std::max<int64_t>(k0 - off - q0, 0), nq);
    if (r0 < nq)
      gemm<true, true>(nq - r0, D, nk, St + r0, 1, BQ, Vp, ldv, Oacc + r0 * D, D, alpha + r0);
  }

  // Normalize and write o, lse.
  for (int64_t i = 0; i < nq; ++i) {
    T* orow = o + ((b * Sq + q0 + i) * Hq + h) * D;
    float* lrow_out = lse + (b * Hq + h) * Sq + q0 + i;
    const float l = lrow[i];
    if (l > 0.0f) {
      store_from_f32<T>(Oacc + i * D, orow, D, 1.0f / l);
      *lrow_out = mrow[i] * kLn2 + std::log(l);
    } else {
      for (int d = 0; d < D; ++d) orow[d] = from_f32<T>(0.0f);
      *lrow_out = ninf;
    }
  }
}

// ---------------------------------------------------------------------------
// Backward.
// ---------------------------------------------------------------------------
template <int D>
constexpr size_t bwd_ws_floats() {
  // Kt, Vt [D][BK]; Kc, dKa, dVa [BK][D]; Qc, dOc [BQ][D]; P, dS [BQ][BK]; tmp [2D]
  return 2 * size_t(D) * kBwdBk + 3 * size_t(kBwdBk) * D + 2 * size_t(kBwdBq) * D + 2 * size_t(kBwdBq) * kBwdBk +
         2 * size_t(D);
}

template <typename T, int D>
void bwd_item(const T* q, const T* k, const T* v, const T* dout, const float* lse2, const float* Drow, T* dk, T* dv,
              float* dqacc, const AttentionShape& s, const AttentionAttrs& a, int64_t b, int64_t hk, int64_t chunk,
              int64_t nchunks, float* ws) {
  constexpr int BQ = kBwdBq, BK = kBwdBk;
  const int64_t Sq = s.seqlen_q, Sk = s.seqlen_k, Hq = s.heads_q, Hkv = s.heads_kv;
  const int64_t G = Hq / Hkv;
  const int64_t off = a.causal ? causal_offset(s, a) : 0;
  const int64_t ldq = Hq * D, ldkv = Hkv * D;

  float* Kt = ws;                // [D][BK]
  float* Vt = Kt + D * BK;       // [D][BK]
  float* Kc = Vt + D * BK;       // [BK][D]
  float* dKa = Kc + BK * D;      // [BK][D]
  float* dVa = dKa + BK * D;     // [BK][D]
  float* Qc = dVa + BK * D;      // [BQ][D]
  float* dOc = Qc + BQ * D;      // [BQ][D]
  float* P = dOc + BQ * D;       // [BQ][BK]
  float* dS = P + BQ * BK;       // [BQ][BK]
  float* tmp = dS + BQ * BK;     // [2D]

  // Zero this item's dq accumulator region: rows (b, all i, heads of group hk).
  for (int64_t i = 0; i < Sq; ++i) std::memset(dqacc + ((b * Sq + i) * Hq + hk * G) * D, 0, sizeof(float) * G * D);

  const float c = a.scale * kLog2e;
  const vf cv = splat(c), scv = splat(a.scale), zero = splat(0.0f);
  const vi iota = iota_i();
  const int64_t nkb = (Sk + BK - 1) / BK;
  const int64_t nqb = (Sq + BQ - 1) / BQ;

  for (int64_t kb = chunk; kb < nkb; kb += nchunks) {
    const int64_t k0 = kb * BK;
    const int64_t nk = std::min<int64_t>(BK, Sk - k0);
    const int64_t nkp = round_up(nk, W);
    const T* kblk = k + ((b * Sk + k0) * Hkv + hk) * D;
    const T* vblk = v + ((b * Sk + k0) * Hkv + hk) * D;
    load_transposed<T, D>(kblk, ldkv, nk, nkp, Kt, BK, tmp);
    load_transposed<T, D>(vblk, ldkv, nk, nkp, Vt, BK, tmp);
    int64_t ldk;
    const float* Kp = rows_f32<T, D>(kblk, ldkv, nk, Kc, &ldk);
    std::memset(dKa, 0, sizeof(float) * size_t(nk) * D);
    std::memset(dVa, 0, sizeof(float) * size_t(nk) * D);

    const int64_t qstart = a.causal ? std::max<int64_t>(0, k0 - off) : 0;  // first row that sees key k0
    for (int64_t g = 0; g < G && qstart < Sq; ++g) {
      const int64_t h = hk * G + g;
      for (int64_t qb = qstart / BQ; qb < nqb; ++qb) {
        const int64_t q0 = qb * BQ;
        const int64_t nq = std::min<int64_t>(BQ, Sq - q0);
        int64_t ldqf, lddo;
        const float* Qp = rows_f32<T, D>(q + ((b * Sq + q0) * Hq + h) * D, ldq, nq, Qc, &ldqf);
        const float* dOp = rows_f32<T, D>(dout + ((b * Sq + q0) * Hq + h) * D, ldq, nq, dOc, &lddo);

        gemm<false>(nq, nkp, D, Qp, ldqf, 1, Kt, BK, P, BK);    // S
        gemm<false>(nq, nkp, D, dOp, lddo, 1, Vt, BK, dS, BK);  // dP

        const bool diag = a.causal && (k0 + nk - 1 > q0 + off);
        const float* L = lse2 + (b * Hq + h) * Sq + q0;
        const float* Dr = Drow + (b * Hq + h) * Sq + q0;
        for (int64_t i = 0; i < nq; ++i) {
          int64_t hi = nk - 1;  // last visible local key
          if (diag) hi = std::min<int64_t>(std::max<int64_t>(q0 + i + off - k0, -1), nk - 1);
          const vi hiv = splat_i(static_cast<int32_t>(hi));
          const vf Lv = splat(-L[i]), Dv = splat(Dr[i]);
          float* pr = P + i * BK;
          float* dr = dS + i * BK;
          for (int64_t t = 0; t < nkp; t += W) {
            vf p = exp2v(vfma(loadv(pr + t), cv, Lv));
            p = (iota + splat_i(static_cast<int32_t>(t))) <= hiv ? p : zero;
            storev(pr + t, p);
            storev(dr + t, p * (loadv(dr + t) - Dv) * scv);
          }
        }
        gemm<true>(nk, D, nq, P, 1, BK, dOp, lddo, dVa, D);   // dV += P^T dO
        gemm<true>(nk, D, nq, dS, 1, BK, Qp, ldqf, dKa, D);   // dK += dS^T Q
        gemm<true>(nq, D, nk, dS, BK, 1, Kp, ldk, dqacc + ((b * Sq + q0) * Hq + h) * D, ldq);  // dQ += dS K
      }
    }
    for (int64_t j = 0; j < nk; ++j) {
      store_from_f32<T>(dKa + j * D, dk + ((b * Sk + k0 + j) * Hkv + hk) * D, D, 1.0f);
      store_from_f32<T>(dVa + j * D, dv + ((b * Sk + k0 + j) * Hkv + hk) * D, D, 1.0f);
    }
  }
}

// Threads worth starting for `flops` of work: starting a thread costs tens of
// microseconds, i.e. a few MFLOP of kernel time.
inline int threads_for(int num_threads, double flops) {
  const double cap = 1.0 + flops / 4e6;
  return cap < double(num_threads) ? std::max(1, static_cast<int>(cap)) : std::max(1, num_threads);
}

// Number of interleaved key-block chunks per (batch, kv head) in the backward:
// the smallest count that keeps nt threads >= 95% busy (or the best one found).
inline int64_t pick_chunks(int64_t nbh, int64_t nkb, int nt) {
  if (nt <= 1 || nkb <= 1) return 1;
  int64_t best = 1;
  double best_eff = 0.0;
  const int64_t cmax = std::min<int64_t>(nkb, 4 * int64_t(nt));
  for (int64_t c = 1; c <= cmax; ++c) {
    const int64_t items = nbh * c;
    const double eff = double(items) / double((items + nt - 1) / nt * nt);
    if (eff > best_eff + 0.02) best = c, best_eff = eff;
    if (eff >= 0.95) break;
  }
  return best;
}

template <typename T>
FLASHGEN_CPU_INLINE constexpr bool valid_head_dim(int D) {
  return D == 32 || D == 64 || D == 96 || D == 128 || D == 160 || D == 192 || D == 224 || D == 256;
}

}  // namespace detail

// ---------------------------------------------------------------------------
// Public entry points. Preconditions: s.head_dim == D, heads_kv > 0 divides
// heads_q, all sizes >= 0, buffers contiguous BSHD (lse [B][Hq][Sq]).
// ---------------------------------------------------------------------------
template <typename T, int D>
void attention_fwd(const T* q, const T* k, const T* v, T* o, float* lse, const AttentionShape& s,
                   const AttentionAttrs& a, int num_threads) {
  static_assert(std::is_same<T, float>::value || std::is_same<T, bf16>::value || std::is_same<T, f16>::value,
                "T must be float, bf16 or f16");
  static_assert(detail::valid_head_dim<T>(D), "unsupported head_dim");
  using namespace detail;
  if (s.batch <= 0 || s.heads_q <= 0 || s.heads_kv <= 0 || s.seqlen_q <= 0) return;
  if (s.head_dim != D || s.heads_q % s.heads_kv != 0 || s.seqlen_k < 0) return;  // precondition violated
  const int64_t nqb = (s.seqlen_q + kFwdBq - 1) / kFwdBq;
  const int64_t nbh = s.batch * s.heads_q;
  const int64_t n = nbh * nqb;
  const double flops = 4.0 * double(nbh) * double(s.seqlen_q) * double(std::max<int64_t>(s.seqlen_k, 1)) * D;
  const int nt = static_cast<int>(std::min<int64_t>(threads_for(num_threads, flops), n));
  std::vector<AlignedFloats> ws;
  ws.reserve(nt);
  for (int t = 0; t < nt; ++t) ws.emplace_back(fwd_ws_floats<D>());
  // Last (for causal: most expensive) q blocks first.
  parallel_for(n, nt, [&](int64_t item, int w) {
    const int64_t qb = nqb - 1 - item / nbh;
    const int64_t bh = item % nbh;
    fwd_item<T, D>(q, k, v, o, lse, s, a, bh / s.heads_q, bh % s.heads_q, qb, ws[w].p);
  });
}

template <typename T, int D>
void attention_bwd(const T* q, const T* k, const T* v, const T* o, const float* lse, const T* dout, T* dq, T* dk,
                   T* dv, const AttentionShape& s, const AttentionAttrs& a, int num_threads) {
  static_assert(std::is_same<T, float>::value || std::is_same<T, bf16>::value || std::is_same<T, f16>::value,
                "T must be float, bf16 or f16");
  static_assert(detail::valid_head_dim<T>(D), "unsupported head_dim");
  using namespace detail;
  const int64_t B = s.batch, Sq = s.seqlen_q, Sk = s.seqlen_k, Hq = s.heads_q, Hkv = s.heads_kv;
  if (B <= 0 || Hq <= 0 || Hkv <= 0 || Sq < 0 || Sk < 0) return;
  if (s.head_dim != D || Hq % Hkv != 0) return;  // precondition violated
  if (Sq == 0 && Sk == 0) return;
  const int nthreads = threads_for(num_threads, 10.0 * double(B * Hq) * double(std::max<int64_t>(Sq, 1)) *
                                                    double(std::max<int64_t>(Sk, 1)) * D);
  const int light_threads = threads_for(nthreads, 8.0 * double(B * Hq) * double(std::max<int64_t>(Sq, Sk)) * D);

  // Per-row terms: lse2 = lse*log2(e) (+inf for empty rows), Drow = rowsum(dO o O).
  AlignedFloats lse2(size_t(B * Hq * Sq)), Drow(size_t(B * Hq * Sq));
  if (Sq > 0) {
    const int64_t nbh = B * Hq;
    parallel_for(nbh, light_threads, [&](int64_t bh, int) {
      const int64_t b = bh / Hq, h = bh % Hq;
      alignas(64) float to[D], td[D];
      for (int64_t i = 0; i < Sq; ++i) {
        const int64_t r = bh * Sq + i;
        const float l = lse[r];
        lse2.p[r] = l == -std::numeric_limits<float>::infinity() ? std::numeric_limits<float>::infinity() : l * kLog2e;
        const int64_t off = ((b * Sq + i) * Hq + h) * D;
        load_f32<T>(o + off, to, D);
        load_f32<T>(dout + off, td, D);
        vf acc = splat(0.0f);
        for (int d = 0; d < D; d += W) acc = vfma(loadv(to + d), loadv(td + d), acc);
        float sum = 0.0f;
        for (int t = 0; t < W; ++t) sum += acc[t];
        Drow.p[r] = sum;
      }
    });
  }

  // Split each (b, kv head)'s key blocks into interleaved chunks when there are
  // too few (b, kv head) pairs to keep the threads busy.
  const int64_t nkb = (Sk + kBwdBk - 1) / kBwdBk;
  const int64_t nbh = B * Hkv;
  const int64_t nchunks = pick_chunks(nbh, nkb, nthreads);
  const bool direct = std::is_same<T, float>::value && nchunks == 1;
  const size_t dq_elems = size_t(B * Sq * Hq * D);
  AlignedFloats dqbuf(direct ? 0 : dq_elems * nchunks);
  float* dqacc = direct ? reinterpret_cast<float*>(dq) : dqbuf.p;

  const int64_t n = nbh * nchunks;
  const int nt = static_cast<int>(std::min<int64_t>(nthreads, n));
  std::vector<AlignedFloats> ws;
  ws.reserve(nt);
  for (int t = 0; t < nt; ++t) ws.emplace_back(bwd_ws_floats<D>());
  parallel_for(n, nt, [&](int64_t item, int w) {
    const int64_t c = item % nchunks, bh = item / nchunks;
    bwd_item<T, D>(q, k, v, dout, lse2.p, Drow.p, dk, dv, dqacc + c * dq_elems, s, a, bh / Hkv, bh % Hkv, c,
                   nchunks, ws[w].p);
  });

  if (!direct && Sq > 0) {
    // dq = sum over chunks, converted; items are blocks of rows.
    const int64_t rows = B * Sq;
    const int64_t per = std::max<int64_t>(1, 16384 / (Hq * D));
    const int64_t nitems = (rows + per - 1) / per;
    const int64_t rowlen = Hq * D;
    parallel_for(nitems, light_threads, [&](int64_t it, int) {
      const int64_t r0 = it * per, r1 = std::min(rows, r0 + per);
      float* base = dqacc + r0 * rowlen;
      const int64_t len = (r1 - r0) * rowlen;
      for (int64_t c = 1; c < nchunks; ++c) {
        const float* src = base + c * dq_elems;
        for (int64_t e = 0; e < len; ++e) base[e] += src[e];
      }
      store_from_f32<T>(base, dq + r0 * rowlen, len, 1.0f);
    });
  }
}

}  // namespace cpu
}  // namespace flashgen
