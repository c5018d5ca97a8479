// Tile building blocks of the CPU kernels: block sizes, the register-blocked
// GEMM micro-kernel (FMA or vdpbf16ps), transposed / converted tile loads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "flashgen/cpu/numerics.h"

namespace flashgen {
namespace cpu {
namespace detail {

// ---------------------------------------------------------------------------
// GEMM: C[M][N] (=|+=) A[M][K] * B[K][N], N a multiple of W.
// A is read by scalar broadcasts at A[r*sar + k*sak] (any layout); B rows are
// contiguous with row stride ldb; C rows with stride ldc. With SCALE, C is
// first multiplied by rs[r] (row scale).
// Element type E: float (FMA), or uint32_t = a pair of bf16 (low half the
// even element) with K counting pairs: C += a.lo*b.lo + a.hi*b.hi (vdpbf16ps).
// ---------------------------------------------------------------------------
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__) && !defined(FLASHGEN_CPU_NO_BF16_DOT)
#define FLASHGEN_CPU_BF16_DOT 1
#else
#define FLASHGEN_CPU_BF16_DOT 0
#endif
constexpr bool kBf16Dot = FLASHGEN_CPU_BF16_DOT != 0;  // bf16 products on vdpbf16ps

template <typename E>
struct Mac;
template <>
struct Mac<float> {
  static FLASHGEN_CPU_INLINE vf bcast(const float* p) { return splat(*p); }
  static FLASHGEN_CPU_INLINE vf load(const float* p) { return loadv(p); }
  static FLASHGEN_CPU_INLINE vf mac(vf a, vf b, vf c) { return vfma(a, b, c); }
};
#if FLASHGEN_CPU_BF16_DOT
template <>
struct Mac<uint32_t> {
  static FLASHGEN_CPU_INLINE vf bcast(const uint32_t* p) { return (vf)_mm512_set1_epi32(static_cast<int>(*p)); }
  static FLASHGEN_CPU_INLINE vf load(const uint32_t* p) {
    vf v;
    std::memcpy(&v, p, sizeof(vf));
    return v;
  }
  static FLASHGEN_CPU_INLINE vf mac(vf a, vf b, vf c) {
    return (vf)_mm512_dpbf16_ps((__m512)c, (__m512bh)a, (__m512bh)b);
  }
};
#endif

// What a product does with its finished accumulators: Plain stores them;
// another epilogue (fwd_tiles.h's ScaledMax) maps each accumulator vector, given
// its column vector index, before it is stored.
struct Plain {
  FLASHGEN_CPU_INLINE vf operator()(int64_t, vf acc) const { return acc; }
};

// An epilogue callable as (row, column vector, acc) also gets the row of the
// accumulator (fwd_tiles.h's causal one masks by it).
template <typename Epi>
FLASHGEN_CPU_INLINE vf apply_epilogue(const Epi& epi, int64_t row, int64_t v, vf acc) {
  if constexpr (std::is_invocable_v<const Epi&, int64_t, int64_t, vf>)
    return epi(row, v, acc);
  else
    return epi(v, acc);
}

template <typename E, int R, int NV, bool ACC, bool SCALE, typename Epi>
inline void micro_kernel(int64_t K, const E* __restrict A, int64_t sar, int64_t sak, const E* __restrict B,
                         int64_t ldb, float* __restrict C, int64_t ldc, const float* __restrict rs, const Epi& epi,
                         int64_t row, int64_t vcol) {
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
  const E* ap[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) ap[r] = A + r * sar;
  for (int64_t k = 0; k < K; ++k) {
    vf bv[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) bv[v] = Mac<E>::load(B + v * W);
    B += ldb;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vf a = Mac<E>::bcast(ap[r]);
      ap[r] += sak;
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] = Mac<E>::mac(a, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) storev(C + r * ldc + v * W, apply_epilogue(epi, row + r, vcol + v, acc[r][v]));
}

template <typename E, int R, bool ACC, bool SCALE, typename Epi>
inline void micro_rows(int nv, int64_t K, const E* A, int64_t sar, int64_t sak, const E* B, int64_t ldb, float* C,
                       int64_t ldc, const float* rs, const Epi& epi, int64_t row, int64_t vcol) {
  static_assert(NVMAX == 2 || NVMAX == 4, "NVMAX");
  switch (nv) {
    case 1: micro_kernel<E, R, 1, ACC, SCALE>(K, A, sar, sak, B, ldb, C, ldc, rs, epi, row, vcol); break;
    case 2: micro_kernel<E, R, 2, ACC, SCALE>(K, A, sar, sak, B, ldb, C, ldc, rs, epi, row, vcol); break;
#if FLASHGEN_CPU_VBYTES == 64
    case 3: micro_kernel<E, R, 3, ACC, SCALE>(K, A, sar, sak, B, ldb, C, ldc, rs, epi, row, vcol); break;
    case 4: micro_kernel<E, R, 4, ACC, SCALE>(K, A, sar, sak, B, ldb, C, ldc, rs, epi, row, vcol); break;
#endif
    default: break;
  }
}

template <typename E, bool ACC, bool SCALE, typename Epi>
FLASHGEN_CPU_INLINE void micro_any(int rows, int nv, int64_t K, const E* A, int64_t sar, int64_t sak, const E* B,
                                   int64_t ldb, float* C, int64_t ldc, const float* rs, const Epi& epi,
                                   int64_t row, int64_t vcol) {
  static_assert(RMAX == 4, "RMAX");
  switch (rows) {
    case 4: micro_rows<E, 4, ACC, SCALE>(nv, K, A, sar, sak, B, ldb, C, ldc, rs, epi, row, vcol); break;
    case 3: micro_rows<E, 3, ACC, SCALE>(nv, K, A, sar, sak, B, ldb, C, ldc, rs, epi, row, vcol); break;
    case 2: micro_rows<E, 2, ACC, SCALE>(nv, K, A, sar, sak, B, ldb, C, ldc, rs, epi, row, vcol); break;
    case 1: micro_rows<E, 1, ACC, SCALE>(nv, K, A, sar, sak, B, ldb, C, ldc, rs, epi, row, vcol); break;
    default: break;
  }
}

// Which micro-tiles a product needs: for the row group [r, r + rows), column
// vectors [vbegin, vend) and the first klen steps of K. Tiles outside are not
// written (callers skip only tiles they never read, or rows whose scale is 1).
struct FullTile {
  FLASHGEN_CPU_INLINE int64_t vbegin(int64_t) const { return 0; }
  FLASHGEN_CPU_INLINE int64_t vend(int64_t, int, int64_t nvt) const { return nvt; }
  FLASHGEN_CPU_INLINE int64_t klen(int64_t, int, int64_t K) const { return K; }
};

// Rows go in increasing order for each column vector, the order in which an
// epilogue sees them.
template <typename E, bool ACC, bool SCALE = false, typename Tiles = FullTile, typename Epi = Plain>
inline void gemm(int64_t M, int64_t N, int64_t K, const E* A, int64_t sar, int64_t sak, const E* B, int64_t ldb,
                 float* C, int64_t ldc, const float* rs = nullptr, const Tiles& tiles = Tiles(),
                 const Epi& epi = Epi()) {
  const int64_t nvt = N / W;
  for (int64_t v0 = 0; v0 < nvt; v0 += NVMAX) {
    const int64_t v1 = std::min<int64_t>(nvt, v0 + NVMAX);
    for (int64_t r = 0; r < M; r += RMAX) {
      const int rows = static_cast<int>(std::min<int64_t>(RMAX, M - r));
      const int64_t vb = std::max(v0, tiles.vbegin(r));
      const int64_t ve = std::min(v1, tiles.vend(r, rows, nvt));
      const int64_t kl = std::min(K, tiles.klen(r, rows, K));
      if (vb >= ve || kl <= 0) continue;
      micro_any<E, ACC, SCALE>(rows, static_cast<int>(ve - vb), kl, A + r * sar, sar, sak, B + vb * W, ldb,
                               C + r * ldc + vb * W, ldc, rs + (SCALE ? r : 0), epi, r, vb);
    }
  }
}

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

// ---------------------------------------------------------------------------
// Loads.
// ---------------------------------------------------------------------------

// dst[c][i] = src[i][c] for 32-bit elements: n rows (stride ld) of ncols
// columns into a [ncols][ldd] matrix, columns [n, npad) zero-filled.
// ncols and npad are multiples of 16 where AVX-512 is used.
#if defined(__AVX512F__)
// Masked forms: the unmasked intrinsics trip -Wmaybe-uninitialized in GCC 12.
FLASHGEN_CPU_INLINE __m512 unpacklo32(__m512 a, __m512 b) { return _mm512_mask_unpacklo_ps(a, 0xffff, a, b); }
FLASHGEN_CPU_INLINE __m512 unpackhi32(__m512 a, __m512 b) { return _mm512_mask_unpackhi_ps(a, 0xffff, a, b); }
FLASHGEN_CPU_INLINE __m512 unpacklo64(__m512 a, __m512 b) {
  const __m512d x = _mm512_castps_pd(a);
  return _mm512_castpd_ps(_mm512_mask_unpacklo_pd(x, 0xff, x, _mm512_castps_pd(b)));
}
FLASHGEN_CPU_INLINE __m512 unpackhi64(__m512 a, __m512 b) {
  const __m512d x = _mm512_castps_pd(a);
  return _mm512_castpd_ps(_mm512_mask_unpackhi_pd(x, 0xff, x, _mm512_castps_pd(b)));
}
template <int IMM>
FLASHGEN_CPU_INLINE __m512 shuffle128(__m512 a, __m512 b) {
  return _mm512_mask_shuffle_f32x4(a, 0xffff, a, b, IMM);
}
#endif

template <typename U>
inline void transpose32(const U* src, int64_t ld, int64_t n, int64_t ncols, int64_t npad, U* dst, int64_t ldd) {
  static_assert(sizeof(U) == 4, "32-bit elements");
#if defined(__AVX512F__)
  if (ncols % 16 == 0 && npad % 16 == 0) {
    for (int64_t i0 = 0; i0 < npad; i0 += 16) {
      const int64_t rows = std::min<int64_t>(16, std::max<int64_t>(n - i0, 0));
      for (int64_t c0 = 0; c0 < ncols; c0 += 16) {
        __m512 r[16], t[16];
        for (int i = 0; i < 16; ++i)
          r[i] = i < rows ? _mm512_loadu_ps(reinterpret_cast<const float*>(src + (i0 + i) * ld + c0))
                          : _mm512_setzero_ps();
        for (int i = 0; i < 16; i += 2) {
          t[i] = unpacklo32(r[i], r[i + 1]);
          t[i + 1] = unpackhi32(r[i], r[i + 1]);
        }
        for (int i = 0; i < 16; i += 4) {  // r[i + k]: column 4L + k of rows i..i+3 in 128-bit lane L
          r[i] = unpacklo64(t[i], t[i + 2]);
          r[i + 1] = unpackhi64(t[i], t[i + 2]);
          r[i + 2] = unpacklo64(t[i + 1], t[i + 3]);
          r[i + 3] = unpackhi64(t[i + 1], t[i + 3]);
        }
        for (int k = 0; k < 4; ++k) {
          const __m512 x = shuffle128<0x88>(r[k], r[4 + k]), y = shuffle128<0xDD>(r[k], r[4 + k]);
          const __m512 x2 = shuffle128<0x88>(r[8 + k], r[12 + k]), y2 = shuffle128<0xDD>(r[8 + k], r[12 + k]);
          float* d = reinterpret_cast<float*>(dst + (c0 + k) * ldd + i0);
          _mm512_storeu_ps(d, shuffle128<0x88>(x, x2));
          _mm512_storeu_ps(d + 4 * ldd, shuffle128<0x88>(y, y2));
          _mm512_storeu_ps(d + 8 * ldd, shuffle128<0xDD>(x, x2));
          _mm512_storeu_ps(d + 12 * ldd, shuffle128<0xDD>(y, y2));
        }
      }
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < ncols; ++c) dst[c * ldd + i] = src[i * ld + c];
  for (int64_t c = 0; c < ncols; ++c)
    for (int64_t i = n; i < npad; ++i) dst[c * ldd + i] = U{};
}

// Copies n rows of D elements (row stride ld, in elements) to fp32 columns of
// a [D][ldt] matrix and zero-fills columns [n, npad). Non-float rows are
// converted through tmp ([n][D] floats).
template <typename T, int D>
inline void load_transposed(const T* src, int64_t ld, int64_t n, int64_t npad, float* dst, int64_t ldt,
                            float* tmp) {
  if (std::is_same<T, float>::value) {
    transpose32(reinterpret_cast<const float*>(src), ld, n, D, npad, dst, ldt);
  } else {
    for (int64_t i = 0; i < n; ++i) load_f32<T>(src + i * ld, tmp + i * D, D);
    transpose32(tmp, D, n, D, npad, dst, ldt);
  }
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

// Copies n rows of D 16-bit elements to a contiguous [n][D] buffer, as bf16
// pairs (uint32, D / 2 per row).
template <typename T, int D>
FLASHGEN_CPU_INLINE const uint32_t* rows_pairs(const T* src, int64_t ld_in, int64_t n, float* buf) {
  static_assert(sizeof(T) == 2 && D % 2 == 0, "pairs of 16-bit elements");
  uint32_t* out = reinterpret_cast<uint32_t*>(buf);
  for (int64_t i = 0; i < n; ++i) std::memcpy(out + i * (D / 2), src + i * ld_in, D * sizeof(T));
  return out;
}

#if FLASHGEN_CPU_BF16_DOT
// Vp[jp][d] = (v[2jp][d], v[2jp+1][d]) for n rows of bf16 (stride ld), an odd
// last row paired with 0: the B operand of P V on vdpbf16ps. interleave_rows:
// the same for rows [j0, j0 + n) of a row source.
template <int D, typename Rows>
inline void interleave_rows(const Rows& rows, int64_t j0, int64_t n, uint32_t* dst) {
  static_assert(D % 32 == 0, "D multiple of 32");
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i il = _mm512_load_si512(lo_idx), ih = _mm512_load_si512(hi_idx);
  for (int64_t jp = 0; 2 * jp < n; ++jp) {
    const bool has1 = 2 * jp + 1 < n;
    const bf16* r0 = rows(j0 + 2 * jp);
    const bf16* r1 = has1 ? rows(j0 + 2 * jp + 1) : r0;
    uint32_t* out = dst + jp * D;
    for (int d = 0; d < D; d += 32) {
      const __m512i a = _mm512_loadu_si512(r0 + d);
      const __m512i b = has1 ? _mm512_loadu_si512(r1 + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + d, _mm512_permutex2var_epi16(a, il, b));
      _mm512_storeu_si512(out + d + 16, _mm512_permutex2var_epi16(a, ih, b));
    }
  }
}
template <int D>
inline void interleave_row_pairs(const bf16* src, int64_t ld, int64_t n, uint32_t* dst) {
  interleave_rows<D>([src, ld](int64_t j) { return src + j * ld; }, 0, n, dst);
}

// Pb[jp][i] = bf16 pair (P[2jp][i], P[2jp+1][i]) (round to nearest even) for
// the rows [0, nk) of P [.][ld] over lanes [0, nlanes); an odd last row is
// paired with 0: the A operand of P V on vdpbf16ps.
inline void pack_p_pairs(const float* P, int64_t ld, int64_t nk, int64_t nlanes, uint32_t* dst, int64_t ldd) {
  alignas(64) static const uint16_t idx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                               8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i ix = _mm512_load_si512(idx);
  for (int64_t jp = 0; 2 * jp < nk; ++jp) {
    const float* r0 = P + 2 * jp * ld;
    const bool has1 = 2 * jp + 1 < nk;
    for (int64_t i = 0; i < nlanes; i += 16) {
      const __m512 a = _mm512_loadu_ps(r0 + i);
      const __m512 b = has1 ? _mm512_loadu_ps(r0 + ld + i) : _mm512_setzero_ps();
      const __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // a in the low 16 words, b in the high 16
      _mm512_storeu_si512(dst + jp * ldd + i, _mm512_permutexvar_epi16(ix, ab));
    }
  }
}

// dst row i = the bf16 (round to nearest even) of src row i, columns [0, ncols)
// (a multiple of 16), as pairs of adjacent columns: the A operand of dS K.
inline void rows_to_bf16_pairs(const float* src, int64_t ld, int64_t n, int64_t ncols, uint32_t* dst,
                               int64_t ldd) {
  for (int64_t i = 0; i < n; ++i) {
    const float* r = src + i * ld;
    uint32_t* o = dst + i * ldd;
    int64_t c = 0;
    for (; c + 32 <= ncols; c += 32)
      _mm512_storeu_si512(o + c / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(r + c + 16), _mm512_loadu_ps(r + c)));
    if (c < ncols) _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c / 2), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(r + c)));
  }
}
#endif

// ---------------------------------------------------------------------------
// Non-finite operand rows. A product C += W X over (query, key) pairs multiplies
// masked pairs' zero weights too, and 0 * NaN (or 0 * inf) is NaN: a NaN in a V
// row would reach rows that never see that key. So the kernels zero the rows of
// X holding a NaN or an infinity before the GEMM (take_nonfinite_rows; rare, and
// a vector test per element when there are none) and add those rows' terms back
// for the visible pairs only (add_nonfinite_terms): NaN and inf reach exactly the
// rows that see them, IEEE there.
// ---------------------------------------------------------------------------

// Whether n contiguous floats hold a NaN or an infinity (x - x is NaN exactly then).
template <int D>
FLASHGEN_CPU_INLINE bool row_nonfinite(const float* x) {
  static_assert(D % W == 0, "D a multiple of the vector width");
  vi any = splat_i(0);
  for (int d = 0; d < D; d += W) {
    const vf v = loadv(x + d), z = v - v;
    any |= (vi)(z != z);
  }
  for (int l = 0; l < W; ++l)
    if (any[l]) return true;
  return false;
}
template <int D>
FLASHGEN_CPU_INLINE bool row_nonfinite(const bf16* x) {
  uint16_t any = 0;
  const uint16_t* u = reinterpret_cast<const uint16_t*>(x);
  for (int d = 0; d < D; ++d) any |= uint16_t((u[d] & 0x7f80u) == 0x7f80u);
  return any != 0;
}

// Rows [0, n) of fp32 x (row stride ld) holding a NaN or an infinity: their
// indices go to bad[], the rows are zeroed; returns how many.
template <int D>
inline int take_nonfinite_rows(float* x, int64_t n, int64_t ld, int32_t* bad) {
  int nbad = 0;
  for (int64_t r = 0; r < n; ++r)
    if (row_nonfinite<D>(x + r * ld)) {
      bad[nbad++] = static_cast<int32_t>(r);
      std::memset(x + r * ld, 0, sizeof(float) * D);
    }
  return nbad;
}

#if FLASHGEN_CPU_BF16_DOT
// The same for n bf16 rows row(r) whose interleaved pairs (interleave_rows: row r
// is the low (r even) or high half of pair r / 2, D pairs per pair row) are in il.
template <int D, typename Row>
inline int take_nonfinite_rows_bf16(const Row& row, int64_t n, uint32_t* il, int32_t* bad) {
  int nbad = 0;
  for (int64_t r = 0; r < n; ++r)
    if (row_nonfinite<D>(row(r))) {
      bad[nbad++] = static_cast<int32_t>(r);
      uint16_t* h = reinterpret_cast<uint16_t*>(il + (r / 2) * D) + (r & 1);
      for (int d = 0; d < D; ++d) h[2 * d] = 0;
    }
  return nbad;
}
#endif

// C[o][:] += w * row(k) for each bad row k and output row o in [0, nout) with
// weight(o, k, &w) true (a visible pair); row(k, dst) writes row k as fp32 [D].
template <int D, typename Weight, typename Row>
inline void add_nonfinite_terms(int64_t nout, const int32_t* bad, int nbad, Weight&& weight, Row&& row, float* C,
                                int64_t ldc) {
  alignas(64) float r[D];
  for (int b = 0; b < nbad; ++b) {
    row(bad[b], r);
    for (int64_t o = 0; o < nout; ++o) {
      float w;
      if (!weight(o, bad[b], &w)) continue;
      float* co = C + o * ldc;
      for (int d = 0; d < D; ++d) co[d] += w * r[d];
    }
  }
}

}  // namespace detail

}  // namespace cpu
}  // namespace flashgen

