// What one attention problem reads: key/value row sources (dense, packed varlen,
// paged; a kv head's rows packed to fp32), the score extras of a (batch entry,
// head), and per-problem work sizes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "flashgen/attention.h"
#include "flashgen/cpu/tiles.h"

namespace flashgen {
namespace cpu {
namespace detail {

// Key / value row sources: the address of row j (a key index of one problem)
// for one kv head. Dense (and packed varlen) rows are ld elements apart; paged
// rows are looked up in the block table (PagedArgs).
template <typename T>
struct DenseRows {
  const T* base;  // row 0
  int64_t ld;
  FLASHGEN_CPU_INLINE const T* operator()(int64_t j) const { return base + j * ld; }
};
template <typename T>
struct PagedRows {
  const T* base;         // k_cache (or v_cache) + kv head * D
  const int32_t* table;  // this batch entry's row of the block table
  int64_t block_size;
  int64_t ld_block;  // elements per cache block (block_size * Hkv * D)
  int64_t ld;        // elements per row of a block (Hkv * D)
  FLASHGEN_CPU_INLINE const T* operator()(int64_t j) const {
    const int64_t blk = j / block_size;
    return base + int64_t(table[blk]) * ld_block + (j - blk * block_size) * ld;
  }
};

// Rows [j0, j0 + n) of a row source as contiguous fp32 [n][D].
template <typename T, int D, typename Rows>
FLASHGEN_CPU_INLINE const float* gather_f32(const Rows& r, int64_t j0, int64_t n, float* buf) {
  for (int64_t i = 0; i < n; ++i) load_f32<T>(r(j0 + i), buf + i * D, D);
  return buf;
}
// Rows [j0, j0 + n) of 16-bit elements as contiguous bf16 pairs [n][D / 2].
template <typename T, int D, typename Rows>
FLASHGEN_CPU_INLINE const uint32_t* gather_pairs(const Rows& r, int64_t j0, int64_t n, float* buf) {
  static_assert(sizeof(T) == 2 && D % 2 == 0, "pairs of 16-bit elements");
  uint32_t* out = reinterpret_cast<uint32_t*>(buf);
  for (int64_t i = 0; i < n; ++i) std::memcpy(out + i * (D / 2), r(j0 + i), D * sizeof(T));
  return out;
}

#if FLASHGEN_CPU_BF16_DOT
// Dense rows: exactly the strided form.
template <int D>
inline void interleave_rows(const DenseRows<bf16>& rows, int64_t j0, int64_t n, uint32_t* dst) {
  interleave_row_pairs<D>(rows(j0), rows.ld, n, dst);
}
#endif

// Key and value rows of one kv head as contiguous fp32 [Sk][D] (V rows holding a
// NaN or an infinity zeroed, tiles.h "Non-finite operand rows"), packed once per
// call instead of once per q block; vbad[c]: how many of the V rows [c * BK,
// (c + 1) * BK) were zeroed.
struct PackedKV {
  const float* k;
  const float* v;
  const int32_t* vbad;
};

// The bad V rows of [k0, k0 + nk) (local indices) from the original rows, when
// the packed chunks they fall in have any.
template <typename T, int D, typename Rows>
inline int packed_nonfinite_rows(const PackedKV& kv, const Rows& vrows, int64_t k0, int64_t nk, int32_t* bad) {
  if (kv.vbad[k0 / kFwdBk] == 0 && kv.vbad[(k0 + nk - 1) / kFwdBk] == 0) return 0;
  alignas(64) float r[D];
  int nbad = 0;
  for (int64_t j = 0; j < nk; ++j) {
    load_f32<T>(vrows(k0 + j), r, D);
    if (row_nonfinite<D>(r)) bad[nbad++] = static_cast<int32_t>(j);
  }
  return nbad;
}

// Packs the rows of one kv head of k and v (row stride Hkv * D / Hkv * DV) to kp,
// vp ([Sk][D] fp32) in chunks of kFwdBk rows, zeroing V rows that hold a NaN or
// an infinity (counted per chunk in vbad).
template <typename T, int D, int DV>
void pack_kv_head(const DenseRows<T>& kr, const DenseRows<T>& vr, int64_t Sk, float* kp, float* vp, int32_t* vbad) {
  for (int64_t j0 = 0; j0 < Sk; j0 += kFwdBk) {
    const int64_t n = std::min<int64_t>(kFwdBk, Sk - j0);
    gather_f32<T, D>(kr, j0, n, kp + j0 * D);
    gather_f32<T, DV>(vr, j0, n, vp + j0 * DV);
    int32_t bad[kFwdBk];
    vbad[j0 / kFwdBk] = take_nonfinite_rows<DV>(vp + j0 * DV, n, DV, bad);
  }
}

// ---------------------------------------------------------------------------
// Score extras (ALiBi, bias, mask, segment ids) of one (batch entry, q head).
// ---------------------------------------------------------------------------
struct HeadExtras {
  bool alibi = false;
  float slope = 0.0f;  // natural-log units
  const void* bias = nullptr;  // element (i, j) at i * bias_ld + j (bias_ld 0: broadcast over queries)
  ElemType bias_type = ElemType::F32;
  const bool* mask = nullptr;     // element (i, j) at i * ld + j
  const int32_t* qseg = nullptr;  // [Sq]
  const int32_t* kseg = nullptr;  // [Sk]
  float* dbias = nullptr;         // fp32 accumulator, element (i, j) at i * bias_ld + j
  int64_t ld = 0;                 // Sk
  int64_t bias_ld = 0;            // Sk, or 0 (ScoreExtras::bias_stride_q)
};

inline HeadExtras head_extras(const ScoreExtras& x, int64_t b, int64_t h, int64_t Sq, int64_t Sk, float* dbacc) {
  HeadExtras e;
  e.ld = Sk;
  if (x.alibi != nullptr) {
    e.alibi = true;
    e.slope = x.alibi[b * x.alibi_stride_b + h];
  }
  if (x.bias != nullptr) {
    const int64_t off = b * x.bias_stride_b + h * x.bias_stride_h;
    e.bias_type = x.bias_type;
    e.bias_ld = x.bias_stride_q;
    e.bias = x.bias_type == ElemType::F32 ? static_cast<const void*>(static_cast<const float*>(x.bias) + off)
                                          : static_cast<const void*>(static_cast<const uint16_t*>(x.bias) + off);
    if (dbacc != nullptr) e.dbias = dbacc + off;
  }
  if (x.mask != nullptr) e.mask = x.mask + b * x.mask_stride_b + h * x.mask_stride_h;
  if (x.q_segment_ids != nullptr) {
    e.qseg = x.q_segment_ids + b * Sq;
    e.kseg = x.kv_segment_ids + b * Sk;
  }
  return e;
}

// n bias elements from element `idx` on, as fp32.
inline void bias_f32(const HeadExtras& e, int64_t idx, int64_t n, float* dst) {
  switch (e.bias_type) {
    case ElemType::F32:
      std::memcpy(dst, static_cast<const float*>(e.bias) + idx, size_t(n) * sizeof(float));
      break;
    case ElemType::BF16:
      load_f32<bf16>(static_cast<const bf16*>(e.bias) + idx, dst, n);
      break;
    default:
      load_f32<f16>(static_cast<const f16*>(e.bias) + idx, dst, n);
      break;
  }
}

// Whether query row i sees some key of [lo, hi) through the extras: the mask lets it,
// the segment ids match, the bias there is not -inf (the band is the caller's). Only
// for rows that ended without any probability mass, so a scalar scan is fine.
inline bool extras_see_a_key(const HeadExtras& e, int64_t i, int64_t lo, int64_t hi) {
  for (int64_t j = lo; j < hi; ++j) {
    if (e.mask != nullptr && !e.mask[i * e.ld + j]) continue;
    if (e.qseg != nullptr && e.qseg[i] != e.kseg[j]) continue;
    if (e.bias != nullptr) {
      float b;
      bias_f32(e, i * e.bias_ld + j, 1, &b);
      if (b == -std::numeric_limits<float>::infinity()) continue;
    }
    return true;
  }
  return false;
}

// Segment ids: [lo, hi] of ids[0, n); the segment ids of a query block and a key
// block whose ranges do not overlap are all different (the block is masked).
inline void id_range(const int32_t* ids, int64_t n, int32_t* lo, int32_t* hi) {
  int32_t a = std::numeric_limits<int32_t>::max(), b = std::numeric_limits<int32_t>::min();
  for (int64_t i = 0; i < n; ++i) a = std::min(a, ids[i]), b = std::max(b, ids[i]);
  *lo = a;
  *hi = b;
}

// (query, key) pairs that attend (causal: the visible triangle / band).
inline double visible_pairs(const AttentionShape& s, const AttentionAttrs& a) {
  const int64_t Sq = s.seqlen_q, Sk = s.seqlen_k;
  if (!a.causal) return double(Sq) * double(Sk);
  const int64_t off = causal_offset(s, a);
  // Rows [0, i0) see no key, rows [i0, i1) see i + off + 1 keys, rows [i1, Sq) see all Sk.
  const int64_t i0 = std::min<int64_t>(std::max<int64_t>(-off, 0), Sq);
  const int64_t i1 = std::min<int64_t>(std::max<int64_t>(Sk - off - 1, i0), Sq);
  const double n = double(i1 - i0);
  return n * (double(i0 + i1 - 1) / 2.0 + double(off + 1)) + double(Sq - i1) * double(Sk);
}

template <typename T>
FLASHGEN_CPU_INLINE constexpr bool valid_head_dim(int D) {
  return D == 32 || D == 64 || D == 96 || D == 128 || D == 160 || D == 192 || D == 224 || D == 256;
}

// The extras varlen / paged honor: ALiBi only (null when absent).
inline const ScoreExtras* alibi_only(const ScoreExtras& x, ScoreExtras* keep) {
  if (x.alibi == nullptr) return nullptr;
  *keep = ScoreExtras{};
  keep->alibi = x.alibi;
  keep->alibi_stride_b = x.alibi_stride_b;
  return keep;
}

}  // namespace detail

}  // namespace cpu
}  // namespace flashgen

