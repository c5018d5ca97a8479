// Device helpers of the attention variants (README "Variants"): the dense
// score extras (ALiBi, bias, mask, segment ids), the per-sequence band of the
// varlen / paged kernels and the clamped reading of cu_seqlens.
//
// Everything here is pure index arithmetic or per-element loads; the host
// parts (FLASHGEN_HD) are also compiled by tests/cpp/test_cuda_index.cc.
#pragma once

#include <cmath>
#include <cstdint>

#include "flashgen/attention.h"

#if defined(__CUDACC__)
#include "flashgen/cuda/common.cuh"
#endif

namespace flashgen {
namespace cuda {
namespace {

// ---------------------------------------------------------------------------
// Host + device index arithmetic
// ---------------------------------------------------------------------------

// The visible band clamped to +-(2^30 + 1) (fits int; no (i, j) pair with
// i < Sq <= 2^30, j < Sk <= 2^30 reaches past it, so the clamp changes no mask).
struct IntBand {
  int lo, hi, masked;
};
FLASHGEN_HD IntBand int_band(int64_t seqlen_q, int64_t seqlen_k, bool causal, bool bottom_right,
                             int32_t window_left, int32_t window_right) {
  constexpr int64_t kLim = (int64_t{1} << 30) + 1;
  AttentionShape s{1, seqlen_q, seqlen_k, 1, 1, 0};
  AttentionAttrs a;
  a.scale = 1.f;
  a.causal = causal;
  a.bottom_right = bottom_right;
  a.window_left = window_left;
  a.window_right = window_right;
  const VisibleBand b = visible_band(s, a);
  IntBand r;
  r.lo = static_cast<int>(b.lo < -kLim ? -kLim : (b.lo > kLim ? kLim : b.lo));
  r.hi = static_cast<int>(b.hi < -kLim ? -kLim : (b.hi > kLim ? kLim : b.hi));
  r.masked = band_masks_anything(s, b) ? 1 : 0;
  return r;
}

// Sequence b of a packed batch as the kernels see it: rows [start, start + len)
// with start = clamp(cu[b], 0, total), end = clamp(cu[b+1], start, total),
// len = min(end - start, max_len). Whatever cu holds, the rows lie inside
// [0, total); lengths above max_len are cut (the grid only covers max_len).
struct SeqRange {
  int start, len;
};
FLASHGEN_HD SeqRange seq_range(int cu_b, int cu_b1, int total, int max_len) {
  int start = cu_b < 0 ? 0 : (cu_b > total ? total : cu_b);
  int end = cu_b1 < start ? start : (cu_b1 > total ? total : cu_b1);
  int len = end - start;
  if (len > max_len) len = max_len < 0 ? 0 : max_len;
  return SeqRange{start, len};
}

// Paged KV: the keys batch b uses, seqused_k[b] clamped to [0, max_keys]
// (max_keys = max_blocks * block_size, what its table row can hold).
FLASHGEN_HD int paged_seqlen_k(int used, int max_keys) {
  return used < 0 ? 0 : (used > max_keys ? max_keys : used);
}

// ALiBi of the varlen / paged kernels, per sequence with its own lengths
// (varlen: the clamped seq_range lengths; paged: Sq and the clamped
// seqused_k[b]): score(i, j) -= slope * |i + off - j|, off = alibi_offset.
// For 0 <= i < Sq <= 2^30, 0 <= j < Sk <= 2^30: |i + off| <= 2^30, so
// i + off - j fits int.
FLASHGEN_HD int alibi_offset(int seqlen_q, int seqlen_k, int bottom_right) {
  return bottom_right ? seqlen_k - seqlen_q : 0;
}
// neg_slope * |row + off - col| (neg_slope = -slope, times log2(e) in the
// kernels' log2 units).
FLASHGEN_HD float alibi_term(float neg_slope, int row, int off, int col) {
  return neg_slope * fabsf(static_cast<float>(row + off - col));
}

// Whether packed row r (0 <= r < total) is computed by some sequence (then the
// attention kernel writes it; otherwise the fill kernel does). Binary search for
// the last b with clamped cu[b] <= r; exact when cu is non-decreasing.
FLASHGEN_HD bool row_covered(const int32_t* cu, int batch, int total, int max_len, int r) {
  auto at = [&](int i) {
    const int c = cu[i];
    return c < 0 ? 0 : (c > total ? total : c);
  };
  if (batch <= 0 || r < at(0)) return false;
  int lo = 0, hi = batch;  // invariant: at(lo) <= r; answer in [lo, hi]
  while (lo < hi) {
    const int mid = lo + (hi - lo + 1) / 2;
    if (at(mid) <= r)
      lo = mid;
    else
      hi = mid - 1;
  }
  if (lo >= batch) return false;  // r >= cu[B]
  const SeqRange sr = seq_range(cu[lo], cu[lo + 1], total, max_len);
  return r >= sr.start && r < sr.start + sr.len;
}

// Split-KV: the key blocks [n_first, n_end) of one row block, cut into nsplit
// chunks of ceil(n / nsplit) blocks; chunk `split` gets [lo, hi) (maybe empty).
struct BlockRange {
  int lo, hi;
};
FLASHGEN_HD BlockRange split_blocks(int n_first, int n_end, int nsplit, int split) {
  const int n = n_end > n_first ? n_end - n_first : 0;
  const int per = nsplit > 0 ? (n + nsplit - 1) / nsplit : n;
  int lo = n_first + split * per;
  int hi = lo + per;
  if (hi > n_end) hi = n_end;
  if (lo > hi) lo = hi;
  return BlockRange{lo, hi};
}

// How many chunks the paged forward splits the keys into: enough CTAs for
// about one full wave (sms * ctas_per_sm), each chunk at least min_blocks key
// blocks, at most kMaxSplits.
constexpr int kMaxSplits = 64;
inline int choose_nsplit(int64_t ctas, int64_t key_blocks, int sms, int ctas_per_sm, int min_blocks = 4) {
  if (ctas <= 0 || key_blocks <= 0 || sms <= 0) return 1;
  const int64_t slots = static_cast<int64_t>(sms) * ctas_per_sm;
  if (ctas * 2 > slots) return 1;  // already at least half a wave
  int64_t n = slots / ctas;
  const int64_t by_work = (key_blocks + min_blocks - 1) / min_blocks;
  if (n > by_work) n = by_work;
  if (n > kMaxSplits) n = kMaxSplits;
  return n < 1 ? 1 : static_cast<int>(n);
}

// Split-KV merge of one row from its nsplit partial lse values (lse[s * stride]):
// m = max lse; weight of partial s = exp(lse_s - m) / sum_s' exp(lse_s' - m)
// (0 for lse_s = -inf); merged lse = m + log(sum). All partials -inf (the row
// sees no key): every weight 0, lse = -inf (o = 0).
struct LseMerge {
  float m, inv_total, lse;
};
FLASHGEN_HD LseMerge lse_merge(const float* lse, int64_t stride, int nsplit) {
  float m = -INFINITY;
  bool nan = false;
  for (int s = 0; s < nsplit; ++s) {
    nan |= lse[s * stride] != lse[s * stride];
    m = fmaxf(m, lse[s * stride]);  // fmaxf drops NaN: hence `nan`
  }
  if (nan) return LseMerge{NAN, NAN, NAN};  // a NaN partial makes the row NaN (weights NaN)
  if (m == -INFINITY) return LseMerge{m, 0.f, -INFINITY};
  float total = 0.f;
  for (int s = 0; s < nsplit; ++s) {
    const float l = lse[s * stride];
    if (l != -INFINITY) total += expf(l - m);
  }
  return LseMerge{m, 1.f / total, m + logf(total)};  // total >= 1 (the max term)
}
FLASHGEN_HD float lse_merge_weight(const LseMerge& mg, float lse_s) {
  return lse_s == -INFINITY ? 0.f : expf(lse_s - mg.m) * mg.inv_total;
}

// ---------------------------------------------------------------------------
// Dense score extras (device)
// ---------------------------------------------------------------------------

// Kernel-parameter form of ScoreExtras (attention.h); null = absent.
struct ExtrasParams {
  const float* alibi;
  long long alibi_stride_b;
  const void* bias;
  int bias_f32;  // 1: f32, 0: the q dtype
  long long bias_stride_b, bias_stride_h, bias_stride_q;  // bias_stride_q: Sk, or 0 (broadcast over queries)
  const bool* mask;
  long long mask_stride_b, mask_stride_h;
  const int32_t* q_seg;   // [B, Sq]
  const int32_t* kv_seg;  // [B, Sk]
  float* dbias_acc;       // backward: f32 [bias shape], zeroed; receives dS summed over broadcast dims
  long long dbias_stride_b, dbias_stride_h;
  int alibi_off;          // bottom_right ? Sk - Sq : 0
};

#if defined(__CUDACC__)
// The ALiBi of one (sequence, head) in the varlen / paged kernels: -slope in
// log2 units and the sequence's offset (alibi_offset), for alibi_term.
struct AlibiRow {
  float neg_slope_l2;
  int off;
};
FG_DEV AlibiRow alibi_row(const ExtrasParams& x, int b, int h, int seqlen_q, int seqlen_k, int bottom_right) {
  return AlibiRow{-x.alibi[b * x.alibi_stride_b + h] * kLog2e, alibi_offset(seqlen_q, seqlen_k, bottom_right)};
}

// The extras of one (batch, head), resolved in the kernel prologue.
template <class T>
struct ExtrasView {
  const void* bias;  // offset to (b, h)
  const bool* mask;  // offset to (b, h)
  const int32_t* q_seg;
  const int32_t* kv_seg;
  float* dbias;  // offset to (b, h)
  float slope;
  int bias_f32, off, sk, bias_ld;  // bias / dbias element (row, col) at row * bias_ld + col

  FG_DEV void init(const ExtrasParams& x, int b, int h, int Sq, int Sk) {
    bias = x.bias == nullptr ? nullptr
                             : static_cast<const char*>(x.bias) +
                                   (b * x.bias_stride_b + h * x.bias_stride_h) * (x.bias_f32 ? 4 : sizeof(T));
    mask = x.mask == nullptr ? nullptr : x.mask + b * x.mask_stride_b + h * x.mask_stride_h;
    q_seg = x.q_seg == nullptr ? nullptr : x.q_seg + static_cast<int64_t>(b) * Sq;
    kv_seg = x.kv_seg == nullptr ? nullptr : x.kv_seg + static_cast<int64_t>(b) * Sk;
    dbias = x.dbias_acc == nullptr ? nullptr : x.dbias_acc + b * x.dbias_stride_b + h * x.dbias_stride_h;
    slope = x.alibi == nullptr ? 0.f : x.alibi[b * x.alibi_stride_b + h];
    bias_f32 = x.bias_f32;
    off = x.alibi_off;
    sk = Sk;
    bias_ld = static_cast<int>(x.bias_stride_q);
  }
  // Element (row, col) with row < Sq, col < Sk: false if masked out; else
  // `add` = bias - slope * |row + off - col| (natural-log units).
  FG_DEV bool term(int row, int col, float& add) const {
    const int64_t idx = static_cast<int64_t>(row) * sk + col;
    if (mask != nullptr && !mask[idx]) return false;
    if (q_seg != nullptr && q_seg[row] != kv_seg[col]) return false;
    float a = 0.f;
    if (bias != nullptr) {
      const int64_t bidx = static_cast<int64_t>(row) * bias_ld + col;
      a = bias_f32 ? static_cast<const float*>(bias)[bidx] : to_float(static_cast<const T*>(bias)[bidx]);
    }
    // slope = 0 without ALiBi; |row + off - col| < 2^31 (row + off < Sk <= 2^30).
    a = fmaf(-slope, fabsf(static_cast<float>(row + off - col)), a);
    add = a;
    return true;
  }
  // Additive term only (the element is known to be visible).
  FG_DEV float add_only(int row, int col) const {
    float a = 0.f;
    if (bias != nullptr) {
      const int64_t idx = static_cast<int64_t>(row) * bias_ld + col;
      a = bias_f32 ? static_cast<const float*>(bias)[idx] : to_float(static_cast<const T*>(bias)[idx]);
    }
    return fmaf(-slope, fabsf(static_cast<float>(row + off - col)), a);
  }
  FG_DEV void add_dbias(int row, int col, float ds) const {
    atomicAdd(dbias + static_cast<int64_t>(row) * bias_ld + col, ds);
  }
};
#endif

}  // namespace
}  // namespace cuda
}  // namespace flashgen
