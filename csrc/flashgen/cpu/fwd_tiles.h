// The forward's products: which micro-tiles a diagonal block needs, the Q K^T
// epilogues (scale and max; exponentials against a settled or a seed max) and O += P V.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "flashgen/cpu/tiles.h"

namespace flashgen {
namespace cpu {
namespace detail {

// Causal tiles of St = K Qt in a block crossing the diagonal: key row r sees
// the local query columns >= r + c.
struct ScoreTiles {
  int64_t c;
  FLASHGEN_CPU_INLINE int64_t vbegin(int64_t r) const { return r + c <= 0 ? 0 : (r + c) / W; }
  FLASHGEN_CPU_INLINE int64_t vend(int64_t, int, int64_t nvt) const { return nvt; }
  FLASHGEN_CPU_INLINE int64_t klen(int64_t, int, int64_t K) const { return K; }
};
// Causal tiles of O += P V: query row r sees the local keys <= r + e (K steps
// of `per` keys).
template <int per>
struct ValueTiles {
  int64_t e;
  FLASHGEN_CPU_INLINE int64_t vbegin(int64_t) const { return 0; }
  FLASHGEN_CPU_INLINE int64_t vend(int64_t, int, int64_t nvt) const { return nvt; }
  FLASHGEN_CPU_INLINE int64_t klen(int64_t r, int rows, int64_t) const {
    const int64_t keys = r + rows + e;  // keys [0, r + rows - 1 + e] are visible to some row of the group
    return keys <= 0 ? 0 : (keys + per - 1) / per;
  }
};

// Oacc [nq][DV] = diag(alpha) Oacc + P V over K steps of P [.][BQ] (transposed
// scores) and V [K][DV]; the row scale only when `rescale`, the diagonal
// block's tiles only when `diag`.
template <typename E, int DV, typename Tiles>
FLASHGEN_CPU_INLINE void value_product(bool rescale, bool diag, int64_t nq, int64_t K, const E* P, const E* V,
                                       int64_t ldv, float* Oacc, const float* alpha, const Tiles& tiles) {
  constexpr int BQ = kFwdBq;
  if (rescale) {
    if (diag) gemm<E, true, true>(nq, DV, K, P, 1, BQ, V, ldv, Oacc, DV, alpha, tiles);
    else gemm<E, true, true>(nq, DV, K, P, 1, BQ, V, ldv, Oacc, DV, alpha);
  } else {
    if (diag) gemm<E, true, false>(nq, DV, K, P, 1, BQ, V, ldv, Oacc, DV, nullptr, tiles);
    else gemm<E, true, false>(nq, DV, K, P, 1, BQ, V, ldv, Oacc, DV);
  }
}

// Scores within this many (base-2 units) above the running max keep it: P <= 2^8.
constexpr float kExpSlack = 8.0f;

// GEMM epilogue of an unmasked block whose running max m is finite: the scores'
// lane-wise max (as ScaledMax) and P = 2^(scores - m), summed per lane into sum.
struct ExpAgainst {
  vf cv;
  const vf* m;
  vf* mx;
  vf* sum;
  FLASHGEN_CPU_INLINE vf operator()(int64_t v, vf acc) const { return scaled(v, acc * cv); }
  // The same for scores y already in base-2 units.
  FLASHGEN_CPU_INLINE vf scaled(int64_t v, vf y) const {
    mx[v] = vmax(mx[v], y);
    const vf p = exp2v(y - m[v]);
    sum[v] += p;
    return p;
  }
};

// The first unmasked block of a row block, before any running max: the lane-wise
// max of its first kSeedRows key rows (their scores kept, made P after the
// product) is the max the later rows' P = 2^(S - m) are taken against.
constexpr int kSeedRows = 4;
struct ExpAgainstSeed {
  ExpAgainst e;  // e.m: the seed max, written here
  vf* seed;
  FLASHGEN_CPU_INLINE vf operator()(int64_t row, int64_t v, vf acc) const {
    const vf y = acc * e.cv;
    if (row >= kSeedRows) return e.scaled(v, y);
    e.mx[v] = vmax(e.mx[v], y);
    seed[v] = row == 0 ? y : vmax(seed[v], y);
    return y;
  }
};

// ExpAgainst in a block crossing the causal diagonal (key row `row` sees the
// local query lanes >= row + c): masked scores are -inf, so P = 0 there whatever
// the score was (NaN included), as in the separate pass.
struct ExpAgainstCausal {
  ExpAgainst e;
  int64_t c;
  vi iota;
  FLASHGEN_CPU_INLINE vf operator()(int64_t row, int64_t v, vf acc) const {
    const int64_t lo = std::min<int64_t>(std::max<int64_t>(row + c - v * W, -1), W);
    const vf y = acc * e.cv;
    return e.scaled(v, iota >= splat_i(static_cast<int32_t>(lo)) ? y : splat(-std::numeric_limits<float>::infinity()));
  }
};

// GEMM epilogue of a block without masks or extras: the scores in base-2 units
// (times cv) and their running lane-wise max, in the order of the separate pass
// it replaces (rows increasing per column vector: the same max, NaN included).
struct ScaledMax {
  vf cv;
  vf* mx;
  FLASHGEN_CPU_INLINE vf operator()(int64_t v, vf acc) const {
    const vf y = acc * cv;
    mx[v] = vmax(mx[v], y);
    return y;
  }
};

}  // namespace detail
}  // namespace cpu
}  // namespace flashgen
