// The backward's products in a block that a band (causal / sliding window)
// crosses: only the micro-tiles holding some visible pair are computed.
#pragma once

#include <algorithm>
#include <cstdint>

#include "flashgen/cpu/tiles.h"

namespace flashgen {
namespace cpu {
namespace detail {

// What a micro-tile of rows [r, r + rows) computes: column vectors [v0, v1) of
// C and K steps [k0, k1).
struct TileSpan {
  int64_t v0, v1, k0, k1;
};

// fp32 C[M][N] (=|+=) A B as gemm (tiles.h) does, each row group restricted to
// span(r, rows); tiles and K steps outside it are not computed (C there is not
// written: callers read none of it, or only products of zero weights belong there).
template <bool ACC, typename Span>
inline void gemm_spans(int64_t M, int64_t N, const float* A, int64_t sar, int64_t sak, const float* B, int64_t ldb,
                       float* C, int64_t ldc, const Span& span) {
  const int64_t nvt = N / W;
  for (int64_t vg = 0; vg < nvt; vg += NVMAX) {
    const int64_t vge = std::min<int64_t>(nvt, vg + NVMAX);
    for (int64_t r = 0; r < M; r += RMAX) {
      const int rows = static_cast<int>(std::min<int64_t>(RMAX, M - r));
      const TileSpan t = span(r, rows);
      const int64_t vb = std::max(vg, t.v0), ve = std::min(vge, t.v1);
      if (vb >= ve || t.k1 <= t.k0) continue;
      micro_any<float, ACC, false>(rows, static_cast<int>(ve - vb), t.k1 - t.k0, A + r * sar + t.k0 * sak, sar, sak,
                                   B + t.k0 * ldb + vb * W, ldb, C + r * ldc + vb * W, ldc, nullptr, Plain(), r, vb);
    }
  }
}

// The visible pairs of a block: local query i sees local keys j with lo <= j - i <= hi,
// j < nk, i < nq. Spans of its products:
struct BlockBand {
  int64_t lo, hi, nq, nk;
  // S = Q K^T and dP = dO V^T (rows: queries; columns: key vectors; K: the head dim).
  FLASHGEN_CPU_INLINE TileSpan scores(int64_t r, int rows, int64_t dim) const {
    const int64_t first = std::max<int64_t>(0, r + lo), last = std::min<int64_t>(nk - 1, r + rows - 1 + hi);
    if (last < first) return {0, 0, 0, 0};
    return {first / W, last / W + 1, 0, dim};
  }
  // dQ += dS K (rows: queries; K: keys).
  FLASHGEN_CPU_INLINE TileSpan dq(int64_t r, int rows, int64_t nv) const {
    return {0, nv, std::max<int64_t>(0, r + lo), std::min<int64_t>(nk, r + rows + hi)};
  }
  // dV += P^T dO and dK += dS^T Q (rows: keys; K: queries).
  FLASHGEN_CPU_INLINE TileSpan dkv(int64_t r, int rows, int64_t nv) const {
    return {0, nv, std::max<int64_t>(0, r - hi), std::min<int64_t>(nq, r + rows - lo)};
  }
};

// Epilogues of a block where every pair is visible (no band, extras or softcap),
// the row terms of the backward computed while the products' tiles are in registers,
// as the separate pass over P and dS would (the same operations, the same bits).
// Row r of S = Q K^T becomes P = 2^(S * c - lse2).
struct ProbsEpilogue {
  vf cv;
  const float* lse2;  // of the block's first row
  FLASHGEN_CPU_INLINE vf operator()(int64_t r, int64_t, vf acc) const {
    return exp2v(vfma(acc, cv, splat(-lse2[r])));
  }
};
// Row r of dP = dO V^T becomes dS = P o (dP - Drow) * scale.
struct GradEpilogue {
  vf scv;
  const float* drow;  // of the block's first row
  const float* p;     // P of the block
  int64_t ldp;
  FLASHGEN_CPU_INLINE vf operator()(int64_t r, int64_t v, vf acc) const {
    return loadv(p + r * ldp + v * W) * (acc - splat(drow[r])) * scv;
  }
};

}  // namespace detail
}  // namespace cpu
}  // namespace flashgen
