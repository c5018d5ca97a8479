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

// Offset added to a query index to get the last key index it may see.
FLASHGEN_HD int64_t causal_offset(const AttentionShape& s, const AttentionAttrs& a) {
  return a.bottom_right ? s.seqlen_k - s.seqlen_q : 0;
}

}  // namespace flashgen
