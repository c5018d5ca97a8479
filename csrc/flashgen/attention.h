// Shapes and attributes shared by every flashgen kernel (CPU and CUDA).
//
// Layout is BSHD: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D], o like q,
// lse [B, Hq, Sq] in f32 (natural log). Hkv divides Hq (GQA/MQA): q head h
// reads kv head h / (Hq / Hkv).
//
// Causal alignment: key j is visible to query i iff j <= i + causal_offset,
// with causal_offset = 0 (top-left, as jnp.tril) or Sk - Sq (bottom-right, as
// FlashAttention-2). A query row that sees no key yields o = 0 and
// lse = -inf; its gradients are 0.
//
// Sliding window (runtime attributes window_left / window_right, -1 =
// unbounded): key j is visible to query i iff
//   (left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right),
// with the same offset off (0, or Sk - Sq when bottom_right). Combined with
// causal, which makes right = 0 effectively. Both reduce to one band on the
// diagonal distance: lo <= j - i <= hi (visible_band below).
//
// Softcap (runtime attribute softcap, 0 = off): after scaling, scores
// x = scale * q.k become softcap * tanh(x / softcap) before masking and softmax
// (Gemma-2); the backward multiplies dS by 1 - tanh^2.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define FLASHGEN_HD __host__ __device__ __forceinline__
#else
#define FLASHGEN_HD inline
#endif

namespace flashgen {

struct AttentionShape {
  int64_t batch;
  int64_t seqlen_q;
  int64_t seqlen_k;
  int64_t heads_q;
  int64_t heads_kv;
  int64_t head_dim;
};

struct AttentionAttrs {
  float scale;
  bool causal;
  bool bottom_right;
  int32_t window_left = -1;   // -1: unbounded
  int32_t window_right = -1;  // -1: unbounded
  float softcap = 0.0f;       // 0: off
  // Backward only: accumulate in an order no schedule or thread count changes (the same bits
  // on every run). Every backend's backward kernels honor it or are not chosen.
  bool deterministic = false;
};

// Key j is visible to query i iff lo <= j - i <= hi. Unbounded sides are
// clamped to +-(Sq + Sk + 1), which no (i, j) pair reaches.
struct VisibleBand {
  int64_t lo;
  int64_t hi;
};

FLASHGEN_HD VisibleBand visible_band(const AttentionShape& s, const AttentionAttrs& a) {
  const int64_t off = a.bottom_right ? s.seqlen_k - s.seqlen_q : 0;
  const int64_t big = s.seqlen_q + s.seqlen_k + 1;
  int64_t lo = a.window_left < 0 ? -big : off - a.window_left;
  int64_t hi = a.causal ? off : (a.window_right < 0 ? big : off + a.window_right);
  if (lo < -big) lo = -big;
  if (hi > big) hi = big;
  return VisibleBand{lo, hi};
}

// Whether any (query, key) pair is masked out by causal / window.
FLASHGEN_HD bool band_masks_anything(const AttentionShape& s, const VisibleBand& b) {
  return b.lo > -(s.seqlen_q - 1) || b.hi < s.seqlen_k - 1;
}

// Optional score terms of the dense targets (README "Variants"), decoded and
// validated once for every backend (call.h, ffi_common.h decode_extras). A null pointer means
// absent. In natural-log units, after scale and softcap:
//   score(b,h,i,j) += -alibi(b,h) * |i + off - j|  (off as causal_offset)
//                  +  bias(b,h,i,j)
//   visible(b,h,i,j) &= mask(b,h,i,j) && q_seg(b,i) == kv_seg(b,j)
// bias / mask / dbias: element (b,h,i,j) at b*stride_b + h*stride_h + i*Sk + j
// (stride 0 on a broadcast dim); the bias (and dbias) at ... + i*bias_stride_q + j,
// bias_stride_q = 0 when it broadcasts over the queries ([.., 1, Sk]: a key-only
// bias such as BLOOM's ALiBi from a padded batch's positions, O(Sk) not O(Sq·Sk)). dbias (backward, iff bias) has the bias's
// layout and type and receives dS summed over the broadcast dims.
enum class ElemType : int32_t { F32 = 0, BF16 = 1, F16 = 2 };

struct ScoreExtras {
  const float* alibi = nullptr;  // slope(b, h) = alibi[b * alibi_stride_b + h]
  int64_t alibi_stride_b = 0;
  const void* bias = nullptr;
  ElemType bias_type = ElemType::F32;
  int64_t bias_stride_b = 0, bias_stride_h = 0, bias_stride_q = 0;
  const bool* mask = nullptr;
  int64_t mask_stride_b = 0, mask_stride_h = 0;
  const int32_t* q_segment_ids = nullptr;   // [B, Sq]
  const int32_t* kv_segment_ids = nullptr;  // [B, Sk]
  void* dbias = nullptr;                    // backward only

  FLASHGEN_HD bool any() const {
    return alibi != nullptr || bias != nullptr || mask != nullptr || q_segment_ids != nullptr;
  }
};

// Packed variable-length batches: sequence b owns q rows [cu_q[b], cu_q[b+1])
// and keys [cu_k[b], cu_k[b+1]) of q [Tq, Hq, D] / k, v [Tk, Hkv, D]; lse is
// [Hq, Tq]. The AttentionShape passed with it has batch = B, seqlen_q = Tq,
// seqlen_k = Tk (totals); masks and alignment use each sequence's lengths.
struct VarlenArgs {
  const int32_t* cu_seqlens_q;  // [B + 1]
  const int32_t* cu_seqlens_k;  // [B + 1]
  int32_t max_seqlen_q;
  int32_t max_seqlen_k;
};

// Paged KV: key j < seqused_k[b] of batch b is row j % block_size of cache
// block block_table[b * max_blocks + j / block_size] of k_cache / v_cache
// [num_blocks, block_size, Hkv, D]. The AttentionShape passed with it has
// seqlen_k = max_blocks * block_size (the most keys a row of the table holds).
struct PagedArgs {
  const int32_t* block_table;  // [B, max_blocks]
  const int32_t* seqused_k;    // [B]
  int64_t num_blocks;
  int64_t block_size;
  int64_t max_blocks;
};

// Offset added to a query index to get the last key index it may see.
FLASHGEN_HD int64_t causal_offset(const AttentionShape& s, const AttentionAttrs& a) {
  return a.bottom_right ? s.seqlen_k - s.seqlen_q : 0;
}

}  // namespace flashgen
