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
};

// Offset added to a query index to get the last key index it may see.
FLASHGEN_HD int64_t causal_offset(const AttentionShape& s, const AttentionAttrs& a) {
  return a.bottom_right ? s.seqlen_k - s.seqlen_q : 0;
}

}  // namespace flashgen
