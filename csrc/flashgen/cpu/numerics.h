// Element types and lane-wise math of the CPU kernels: bf16/f16 storage and
// rounding conversions, the SIMD vector type, exp2 and tanh approximations.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

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
// max / min lane-wise; where either lane is NaN the result is b's lane (as vmaxps):
// vmax(bound, x) keeps a NaN x, vmax(x, bound) drops it.
FLASHGEN_CPU_INLINE vf vmax(vf a, vf b) {
#if defined(__AVX512F__)
  // Masked forms: the unmasked intrinsics trip -Wmaybe-uninitialized in GCC 12.
  return (vf)_mm512_mask_max_ps((__m512)a, __mmask16(0xffff), (__m512)a, (__m512)b);
#else
  return a > b ? a : b;
#endif
}
FLASHGEN_CPU_INLINE vf vmin(vf a, vf b) {
#if defined(__AVX512F__)
  return (vf)_mm512_mask_min_ps((__m512)a, __mmask16(0xffff), (__m512)a, (__m512)b);
#else
  return a < b ? a : b;
#endif
}

// 2^x, ~2 ulp for x in [-126, 127]; x <= -127 (including -inf) gives 0, +inf gives
// +inf, NaN gives NaN (a NaN score must reach its row, never read as a masked one).
FLASHGEN_CPU_INLINE vf exp2v(vf x) {
#if defined(__AVX512F__)
  x = vmin(splat(128.0f), vmax(splat(-150.0f), x));  // bounds first: NaN passes through
  const vf n = (vf)_mm512_mask_roundscale_ps((__m512)x, __mmask16(0xffff), (__m512)x,
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const vf lo = splat(-127.0f), hi = splat(128.0f);  // x >= 127.5: n = 128, the exponent bits of +inf
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // n = floor(x + 0.5) without relying on the rounding mode.
  const vf xr = (x == x ? x : splat(0.0f)) + splat(0.5f);  // NaN lanes: any n (the result is NaN)
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
  return p * (vf)((ni + splat_i(127)) << 23);  // n = -127: 0.0f, n = 128: +inf (as scalef); NaN p stays
#endif
}

constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

FLASHGEN_CPU_INLINE vi loadvi(const int32_t* p) {
  vi v;
  std::memcpy(&v, p, sizeof(vi));
  return v;
}
FLASHGEN_CPU_INLINE vf absdist(vi d) { return __builtin_convertvector(d < 0 ? -d : d, vf); }

// tanh, lane-wise (softcap): Cephes' odd polynomial below |x| = 0.625, else
// 1 - 2 / (exp(2|x|) + 1) with the sign restored; ~1e-7 relative error.
FLASHGEN_CPU_INLINE vf tanhv(vf x) {
  const vf zero = splat(0.0f), one = splat(1.0f);
  const vf ax = x < zero ? -x : x;
  const vf e = exp2v(ax * splat(2.0f * kLog2e));
  const vf big = one - splat(2.0f) / (e + one);
  const vf z = x * x;
  vf p = splat(-5.70498872745e-3f);
  p = vfma(p, z, splat(2.06390887954e-2f));
  p = vfma(p, z, splat(-5.37397155531e-2f));
  p = vfma(p, z, splat(1.33314422036e-1f));
  p = vfma(p, z, splat(-3.33332819422e-1f));
  const vf small = vfma(p * z, x, x);
  const vf large = x < zero ? -big : big;
  return ax < splat(0.625f) ? small : large;
}

}  // namespace detail

}  // namespace cpu
}  // namespace flashgen

