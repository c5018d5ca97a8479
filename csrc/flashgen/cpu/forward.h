// The CPU forward: the work item (online softmax over key blocks, extras,
// softcap), split-KV and its merge, and the dense, paged and varlen entry points.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "flashgen/attention.h"
#include "flashgen/cpu/fwd_tiles.h"
#include "flashgen/cpu/parallel.h"
#include "flashgen/cpu/problems.h"

namespace flashgen {
namespace cpu {
namespace detail {

// ---------------------------------------------------------------------------
// Forward work item: one (problem, q head, q block), where a problem is a
// batch entry (dense, paged) or a packed sequence (varlen).
// ---------------------------------------------------------------------------
// D: the query/key head dim, DV: the value head dim (the last dim of v and o).
template <int D, int DV = D>
constexpr size_t fwd_ws_floats() {
  // Qt [D][BQ], St [BK][BQ], Oacc [BQ][max(D, DV)] (also the q rows' scratch), Kc [BK][D], Vc [BK][DV],
  // Pb [BK/2][BQ], m, l, alpha [BQ]; extras: Xt [BK][BQ], Xc [BQ][BK], q segment ids [BQ]
  return size_t(D) * kFwdBq + size_t(kFwdBk) * kFwdBq + size_t(kFwdBq) * std::max(D, DV) + size_t(kFwdBk) * (D + DV) +
         size_t(kFwdBk / 2) * kFwdBq + 3 * size_t(kFwdBq) + 2 * size_t(kFwdBk) * kFwdBq + size_t(kFwdBq);
}

// Xt[j][i] = the extras' score term of query q0 + i and key k0 + j in base-2
// units (log2(e) * (bias - slope * |i + aoff - j|)), -inf where masked; lanes
// [nq, nqp) stay finite or -inf. qsegb: the block's q segment ids, padded to nqp.
__attribute__((noinline)) inline void fwd_extras_tile(const HeadExtras& e, int64_t q0, int64_t nq, int64_t nqp, int64_t k0, int64_t nk,
                            int64_t aoff, const int32_t* qsegb, float* Xt, float* Xc) {
  constexpr int BQ = kFwdBq, BK = kFwdBk;
  const int nv = static_cast<int>(nqp / W);
  const float ninf = -std::numeric_limits<float>::infinity();
  if (e.bias != nullptr) {
    if (e.bias_type == ElemType::F32) {
      transpose32(reinterpret_cast<const uint32_t*>(static_cast<const float*>(e.bias) + q0 * e.bias_ld + k0), e.bias_ld, nq,
                  nk, nqp, reinterpret_cast<uint32_t*>(Xt), BQ);
    } else {
      for (int64_t i = 0; i < nq; ++i) bias_f32(e, (q0 + i) * e.bias_ld + k0, nk, Xc + i * BK);
      transpose32(Xc, BK, nq, nk, nqp, Xt, BQ);
    }
  }
  const vf l2 = splat(kLog2e), sl = splat(e.slope * kLog2e), ninfv = splat(ninf), zero = splat(0.0f);
  const vi iota = iota_i();
  for (int64_t j = 0; j < nk; ++j) {
    float* xr = Xt + j * BQ;
    const int32_t d0 = static_cast<int32_t>(q0 + aoff - (k0 + j));  // i + aoff - j for local row i = 0
    const vi kv = splat_i(e.kseg != nullptr ? e.kseg[k0 + j] : 0);
    for (int t = 0; t < nv; ++t) {
      vf x = e.bias != nullptr ? loadv(xr + t * W) * l2 : zero;
      if (e.alibi) x = x - sl * absdist(iota + splat_i(t * W + d0));
      if (e.qseg != nullptr) x = loadvi(qsegb + t * W) == kv ? x : ninfv;
      storev(xr + t * W, x);
    }
  }
  if (e.mask != nullptr)
    for (int64_t i = 0; i < nq; ++i) {
      const bool* m = e.mask + (q0 + i) * e.ld + k0;
      for (int64_t j = 0; j < nk; ++j)
        if (!m[j]) Xt[j * BQ + i] = ninf;
    }
}

// Scores with extras: St[j][i] = St * cv + Xt, -inf outside the band when `masked`
// (query i sees key j iff band.lo <= j + dk - i <= band.hi, dk = k0 - q0) and where
// Xt is -inf; mx = the lane-wise max over j.
__attribute__((noinline)) inline void fwd_extras_scores(float* St, const float* Xt, int64_t nk, int nv, vf cv,
                                                        bool masked, int64_t dk, VisibleBand band, vf* mx) {
  constexpr int BQ = kFwdBq;
  const vf ninfv = splat(-std::numeric_limits<float>::infinity());
  const vi iota = iota_i();
  for (int64_t j = 0; j < nk; ++j) {
    float* sr = St + j * BQ;
    int64_t ilo = -1, ihi = BQ;
    if (masked) {
      ilo = std::min<int64_t>(std::max<int64_t>(j + dk - band.hi, -1), BQ);
      ihi = std::min<int64_t>(std::max<int64_t>(j + dk - band.lo, -1), BQ);
    }
    const vi ilov = splat_i(static_cast<int32_t>(ilo)), ihiv = splat_i(static_cast<int32_t>(ihi));
    const float* xr = Xt + j * BQ;
    for (int t = 0; t < nv; ++t) {
      const vf x = loadv(xr + t * W);
      const vi idx = iota + splat_i(t * W);
      // Masked (outside the band, or x = -inf: mask, segments, a -inf bias): -inf whatever
      // the score is, NaN included; visible: IEEE (a NaN score or bias stays NaN).
      const vf y = ((idx >= ilov) & (idx <= ihiv) & (x != ninfv)) ? loadv(sr + t * W) * cv + x : ninfv;
      storev(sr + t * W, y);
      mx[t] = vmax(mx[t], y);
    }
  }
}

// The lse of a split-KV partial whose visible scores were all -inf (below any real
// partial's lse, which is >= its max score * ln 2 >= -FLT_MAX * ln 2).
constexpr float kAllNegInfPartial = -std::numeric_limits<float>::max();

// One forward problem at one q head. Rows of q / o are Hq * D / Hq * DV elements apart,
// lse rows are contiguous. With opart set, the item writes its normalized o in
// fp32 to opart and its lse to lpart (same layouts; split-KV partials) instead.
template <typename T>
struct FwdProblem {
  const T* q = nullptr;  // row 0 of this q head
  T* o = nullptr;
  float* lse = nullptr;
  float* opart = nullptr;
  float* lpart = nullptr;
  int64_t Sq = 0, Sk = 0;      // this problem's lengths (alignment, masks)
  int64_t kmin = 0, kmax = 0;  // keys this item may visit: [kmin, kmax)
  const HeadExtras* x = nullptr;
  const PackedKV* kv = nullptr;  // this kv head's rows packed once per call (fp32 products), or null
};

template <typename T, int D, int DV, typename Rows>
void fwd_item(const FwdProblem<T>& p, const Rows& krows, const Rows& vrows, int64_t Hq, const AttentionAttrs& a,
              int64_t qb, float* ws) {
  constexpr int BQ = kFwdBq, BK = kFwdBk;
  constexpr bool BF = kBf16Dot && std::is_same<T, bf16>::value;
  using E = typename std::conditional<BF, uint32_t, float>::type;  // product element: bf16 pair or float
  constexpr int KD = BF ? D / 2 : D;                                 // K steps of Q K^T
  const int64_t Sq = p.Sq, Sk = p.Sk;
  const AttentionShape s{1, Sq, Sk, 1, 1, D};
  const int64_t q0 = qb * BQ;
  const int64_t nq = std::min<int64_t>(BQ, Sq - q0);
  const int64_t nqp = round_up(nq, W);
  const int nv = static_cast<int>(nqp / W);
  const int64_t off = a.causal ? causal_offset(s, a) : 0;

  float* Qt = ws;                      // [D][BQ] floats or [D/2][BQ] bf16 pairs
  float* St = Qt + D * BQ;             // [BK][BQ]
  float* Oacc = St + BK * BQ;          // [BQ][DV]; before the key loop, q rows [BQ][D]
  float* Kc = Oacc + BQ * std::max(D, DV);  // [BK][D]
  float* Vc = Kc + BK * D;             // [BK][DV]
  float* Pbuf = Vc + BK * DV;          // [BK/2][BQ] bf16 pairs
  float* mrow = Pbuf + (BK / 2) * BQ;  // [BQ]
  float* lrow = mrow + BQ;             // [BQ]
  float* alpha = lrow + BQ;            // [BQ]
  float* Xt = alpha + BQ;              // [BK][BQ] extras' score terms
  float* Xc = Xt + BK * BQ;            // [BQ][BK] bias rows (scratch)
  int32_t* qsegb = reinterpret_cast<int32_t*>(Xc + BQ * BK);  // [BQ]
  E* Qe = reinterpret_cast<E*>(Qt);

  const int64_t ldq = Hq * D, ldo = Hq * DV;
  const T* qblk = p.q + q0 * ldq;
  if constexpr (BF) {
    transpose32(reinterpret_cast<const uint32_t*>(qblk), ldq / 2, nq, D / 2, nqp, reinterpret_cast<uint32_t*>(Qt),
                BQ);
  } else {
    load_transposed<T, D>(qblk, ldq, nq, nqp, Qt, BQ, Oacc);  // Oacc: scratch for converted rows
  }
  std::memset(Oacc, 0, sizeof(float) * size_t(nq) * DV);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < nqp; ++i) {
    mrow[i] = ninf;
    lrow[i] = 0.0f;
  }

  int64_t kend = Sk;
  if (a.causal) kend = std::max<int64_t>(0, std::min<int64_t>(Sk, q0 + nq + off));
  // Sliding window: keys [kbeg, kend) are visible to some row of the block; blocks
  // crossing a window edge get a per-element mask (the causal-only path keeps its
  // diagonal tiles). band.hi already includes causal.
  const VisibleBand band = visible_band(s, a);
  const bool windowed = a.window_left >= 0 || (!a.causal && a.window_right >= 0);
  int64_t kbeg = 0;
  if (windowed) {
    kbeg = std::min<int64_t>(Sk, std::max<int64_t>(0, q0 + band.lo));
    kend = std::min<int64_t>(Sk, std::max<int64_t>(0, q0 + nq + band.hi));
  }
  kbeg = std::max(kbeg, p.kmin);
  kend = std::min(kend, p.kmax);
  // Softcap: S = c * tanh(S * scale / c), after which the softmax scale is 1.
  const bool capped = a.softcap > 0.0f;
  const float cap_in = capped ? a.scale / a.softcap : 0.0f;
  const vf cv = splat(capped ? kLog2e : a.scale * kLog2e);
  const vf ninfv = splat(ninf), zero = splat(0.0f);
  const vi iota = iota_i();
  vf mx[BQ / W], msub[BQ / W], lacc[BQ / W];

  // Extras: the ALiBi offset (as causal's, even without causal) and the q block's segment ids.
  const HeadExtras* x = p.x;
  const int64_t aoff = causal_offset(s, a);
  int32_t qseg_lo = 0, qseg_hi = 0;
  if (x != nullptr && x->qseg != nullptr && nq > 0) {
    for (int64_t i = 0; i < nqp; ++i) qsegb[i] = x->qseg[q0 + std::min<int64_t>(i, nq - 1)];
    id_range(qsegb, nq, &qseg_lo, &qseg_hi);
  }

  for (int64_t k0 = kbeg; k0 < kend; k0 += BK) {
    const int64_t nk = std::min<int64_t>(BK, kend - k0);
    if (x != nullptr && x->kseg != nullptr) {
      int32_t lo, hi;
      id_range(x->kseg + k0, nk, &lo, &hi);
      if (hi < qseg_lo || lo > qseg_hi) continue;  // no key of the block shares a query's segment
    }
    const bool diag = !windowed && a.causal && (k0 + nk - 1 > q0 + off);
    const bool edge = windowed && (k0 - (q0 + nq - 1) < band.lo || k0 + nk - 1 - q0 > band.hi);

    // St = K * Qt : scores, one key per row, query rows along the lanes.
    const E* Kp;
    int64_t ldk = KD;
    if constexpr (BF) {
      Kp = gather_pairs<T, D>(krows, k0, nk, Kc);
    } else if constexpr (std::is_same<Rows, DenseRows<float>>::value) {
      // f32 rows that were not packed (read once per call, but for varlen): in place, no copy.
      Kp = p.kv != nullptr ? p.kv->k + k0 * D : krows(k0);
      ldk = p.kv != nullptr ? D : krows.ld;
    } else {
      Kp = p.kv != nullptr ? p.kv->k + k0 * D : gather_f32<T, D>(krows, k0, nk, Kc);
    }
    // Online softmax (base 2), lane-wise over query rows: mx = the block's max.
    for (int t = 0; t < nv; ++t) mx[t] = ninfv;
    const bool plain = x == nullptr && !capped && !edge && !diag;
    // An unmasked block after the first whose scores stay within kExpSlack of the
    // running max m: P = 2^(S - m) in the product's epilogue, m, O and l unchanged
    // (no separate exponential pass, no rescale). Otherwise (a new max beyond the
    // slack, an infinity or a NaN) the block's product is computed again below.
    bool fused = false;
    vi mfinite = splat_i(-1);
    for (int t = 0; t < nv; ++t) {
      msub[t] = loadv(mrow + t * W);
      mfinite &= (vi)(msub[t] - msub[t] == zero);
      lacc[t] = zero;
    }
    // A block crossing the causal diagonal takes the same path, its masked scores
    // -inf in the epilogue; the tiles ScoreTiles skips hold no visible pair, and
    // O += P V (ValueTiles) reads none of them.
    bool settled = plain || (diag && x == nullptr && !capped);
    for (int l = 0; l < W; ++l) settled &= mfinite[l] != 0;
    // Whether P could be taken against msub: every lane's block max within the slack
    // (false for a NaN max) where `lanes` holds; else mx restarts for the redo.
    const auto within_slack = [&](vi lanes) {
      for (int t = 0; t < nv; ++t) lanes &= (vi)(mx[t] <= msub[t] + splat(kExpSlack));
      bool all = true;
      for (int l = 0; l < W; ++l) all &= lanes[l] != 0;
      if (!all)
        for (int t = 0; t < nv; ++t) mx[t] = ninfv;
      return all;
    };
    // The first block (no row's max set yet) takes a seed max from its first rows
    // instead, redone below as the others are when a score exceeds it by more than the slack.
    const bool seeded = plain && k0 == kbeg && nk > kSeedRows;
    if (seeded) {
      gemm<E, false>(nk, nqp, KD, Kp, ldk, 1, Qe, BQ, St, BQ, nullptr, FullTile(),
                     ExpAgainstSeed{ExpAgainst{cv, msub, mx, lacc}, msub});
      vi finite = splat_i(-1);  // a NaN or infinite seed: redone
      for (int t = 0; t < nv; ++t) finite &= (vi)(msub[t] - msub[t] == zero);
      fused = within_slack(finite);
      if (fused) {
        for (int64_t j = 0; j < kSeedRows; ++j)
          for (int t = 0; t < nv; ++t) {
            float* sp = St + j * BQ + t * W;
            const vf pv = exp2v(loadv(sp) - msub[t]);
            storev(sp, pv);
            lacc[t] += pv;
          }
        for (int t = 0; t < nv; ++t) {
          storev(lrow + t * W, lacc[t]);
          storev(mrow + t * W, msub[t]);
        }
      }
    } else if (settled) {
      const ExpAgainst exp_against{cv, msub, mx, lacc};
      const ScoreTiles diag_tiles{k0 - off - q0};
      if (diag)
        gemm<E, false>(nk, nqp, KD, Kp, ldk, 1, Qe, BQ, St, BQ, nullptr, diag_tiles,
                       ExpAgainstCausal{exp_against, diag_tiles.c, iota});
      else
        gemm<E, false>(nk, nqp, KD, Kp, ldk, 1, Qe, BQ, St, BQ, nullptr, FullTile(), exp_against);
      fused = within_slack(splat_i(-1));
      if (fused)
        for (int t = 0; t < nv; ++t) storev(lrow + t * W, loadv(lrow + t * W) + lacc[t]);
    }
    bool rescale = false;
    if (!fused) {
      if (plain)
        gemm<E, false>(nk, nqp, KD, Kp, ldk, 1, Qe, BQ, St, BQ, nullptr, FullTile(), ScaledMax{cv, mx});
      else if (diag)
        gemm<E, false>(nk, nqp, KD, Kp, ldk, 1, Qe, BQ, St, BQ, nullptr, ScoreTiles{k0 - off - q0});
      else
        gemm<E, false>(nk, nqp, KD, Kp, ldk, 1, Qe, BQ, St, BQ);

      if (capped) {
        const vf capv = splat(a.softcap), cinv = splat(cap_in);
        for (int64_t j = 0; j < nk; ++j)
          for (int t = 0; t < nv; ++t) {
            float* p = St + j * BQ + t * W;
            storev(p, capv * tanhv(loadv(p) * cinv));
          }
      }
      if (x != nullptr) fwd_extras_tile(*x, q0, nq, nqp, k0, nk, aoff, qsegb, Xt, Xc);

      if (x != nullptr) fwd_extras_scores(St, Xt, nk, nv, cv, edge || diag, k0 - q0, band, mx);
      else if (!plain) for (int64_t j = 0; j < nk; ++j) {
        float* sr = St + j * BQ;
        if (edge) {
          // Query row i (local) sees key k0+j iff k0+j-q0-hi <= i <= k0+j-q0-lo.
          const int64_t ilo = std::min<int64_t>(std::max<int64_t>(k0 + j - q0 - band.hi, -1), BQ);
          const int64_t ihi = std::min<int64_t>(std::max<int64_t>(k0 + j - q0 - band.lo, -1), BQ);
          const vi ilov = splat_i(static_cast<int32_t>(ilo)), ihiv = splat_i(static_cast<int32_t>(ihi));
          for (int t = 0; t < nv; ++t) {
            vf y = loadv(sr + t * W) * cv;
            const vi idx = iota + splat_i(t * W);
            y = ((idx >= ilov) & (idx <= ihiv)) ? y : ninfv;
            storev(sr + t * W, y);
            mx[t] = vmax(mx[t], y);
          }
        } else if (diag) {
          // Query row i (local) sees key k0+j iff i >= k0 + j - off - q0.
          const int64_t lo = std::min<int64_t>(std::max<int64_t>(k0 + j - off - q0, -1), BQ);
          const vi lov = splat_i(static_cast<int32_t>(lo));
          for (int t = 0; t < nv; ++t) {
            vf y = loadv(sr + t * W) * cv;
            y = (iota + splat_i(t * W)) >= lov ? y : ninfv;
            storev(sr + t * W, y);
            mx[t] = vmax(mx[t], y);
          }
        } else {
          for (int t = 0; t < nv; ++t) {
            const vf y = loadv(sr + t * W) * cv;
            storev(sr + t * W, y);
            mx[t] = vmax(mx[t], y);
          }
        }
      }
      // O needs rescaling only where a row's max moved (alpha != 1, NaN included);
      // once the maxima settle most blocks skip the multiply.
      vi moved = splat_i(0);
      for (int t = 0; t < nv; ++t) {
        const vf mold = loadv(mrow + t * W);
        const vf mnew = vmax(mold, mx[t]);
        const vf muse = mnew == ninfv ? zero : mnew;
        const vf al = exp2v(mold - muse);
        moved |= (vi)(al != splat(1.0f));
        storev(alpha + t * W, al);
        storev(mrow + t * W, mnew);
        msub[t] = muse;
        lacc[t] = zero;
      }
      for (int l = 0; l < W; ++l) rescale |= moved[l] != 0;
      for (int64_t j = 0; j < nk; ++j) {
        float* sr = St + j * BQ;
        for (int t = 0; t < nv; ++t) {
          const vf pv = exp2v(loadv(sr + t * W) - msub[t]);
          storev(sr + t * W, pv);
          lacc[t] += pv;
        }
      }
      for (int t = 0; t < nv; ++t) storev(lrow + t * W, loadv(lrow + t * W) * loadv(alpha + t * W) + lacc[t]);
    }

    // O = diag(alpha) O + P V; in a diagonal block a row group stops at its
    // last visible key, and rows that see nothing of the block (alpha = 1) are
    // skipped.
    // V rows with a NaN or an infinity are zeroed for the product and added back
    // below for the rows that see them (tiles.h, "Non-finite operand rows").
    int32_t badv[BK];
    int nbad = 0;
    if constexpr (BF) {
#if FLASHGEN_CPU_BF16_DOT
      uint32_t* Vp = reinterpret_cast<uint32_t*>(Vc);
      uint32_t* Pb = reinterpret_cast<uint32_t*>(Pbuf);
      interleave_rows<DV>(vrows, k0, nk, Vp);
      nbad = take_nonfinite_rows_bf16<DV>([&](int64_t r) { return vrows(k0 + r); }, nk, Vp, badv);
      pack_p_pairs(St, BQ, nk, nqp, Pb, BQ);
      const int64_t kp = (nk + 1) / 2;
      value_product<uint32_t, DV>(rescale, diag, nq, kp, Pb, Vp, DV, Oacc, alpha, ValueTiles<2>{off + q0 - k0});
#endif
    } else {
      const float* Vp = Vc;
      int64_t ldv = DV;
      bool in_place = false;  // the same for V, unless a row must be zeroed
      if constexpr (std::is_same<Rows, DenseRows<float>>::value) {
        in_place = p.kv == nullptr;
        for (int64_t j = 0; j < nk && in_place; ++j) in_place = !row_nonfinite<DV>(vrows(k0 + j));
        if (in_place) Vp = vrows(k0), ldv = vrows.ld;
      }
      if (!in_place && p.kv != nullptr) {
        Vp = p.kv->v + k0 * DV;
        nbad = packed_nonfinite_rows<T, DV>(*p.kv, vrows, k0, nk, badv);
      } else if (!in_place) {
        gather_f32<T, DV>(vrows, k0, nk, Vc);
        nbad = take_nonfinite_rows<DV>(Vc, nk, DV, badv);
      }
      value_product<float, DV>(rescale, diag, nq, nk, St, Vp, ldv, Oacc, alpha, ValueTiles<1>{off + q0 - k0});
    }
    if (nbad > 0)
      add_nonfinite_terms<DV>(
          nq, badv, nbad,
          [&](int64_t i, int32_t j, float* w) {  // visible: in the band and not masked by the extras
            const int64_t dist = k0 + j - (q0 + i);
            if (dist < band.lo || dist > band.hi || (x != nullptr && Xt[j * BQ + i] == ninf)) return false;
            *w = St[j * BQ + i];
            return true;
          },
          [&](int32_t j, float* dst) { load_f32<T>(vrows(k0 + j), dst, DV); }, Oacc, DV);
  }

  // Normalize and write o, lse (or the fp32 partials). A NaN l (a NaN or overflowed
  // score) makes o and lse NaN. l == 0: no key the row sees here had a score above
  // -inf; if it sees none, o = 0 and lse = -inf (nothing to contribute), else all its
  // scores were -inf (an overflow, not a mask) and the row is NaN as IEEE softmax has
  // it (-inf - -inf); a split-KV partial marks that with lse = -FLT_MAX (merge_splits).
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t i = 0; i < nq; ++i) {
    const float l = lrow[i];
    bool all_ninf = false;
    if (l == 0.0f) {
      const int64_t r = q0 + i;
      const int64_t lo = std::max({int64_t(0), p.kmin, r + band.lo});
      const int64_t hi = std::min({Sk, p.kmax, r + band.hi + 1});
      all_ninf = lo < hi && (x == nullptr || extras_see_a_key(*x, r, lo, hi));
    }
    if (p.opart != nullptr) {
      float* orow = p.opart + (q0 + i) * ldo;
      const float inv = l != 0.0f ? 1.0f / l : 0.0f;
      for (int d = 0; d < DV; ++d) orow[d] = l != 0.0f ? Oacc[i * DV + d] * inv : 0.0f;
      p.lpart[q0 + i] = l != 0.0f ? mrow[i] * kLn2 + std::log(l) : all_ninf ? kAllNegInfPartial : ninf;
      continue;
    }
    T* orow = p.o + (q0 + i) * ldo;
    float* lrow_out = p.lse + q0 + i;
    if (l != 0.0f) {
      store_from_f32<T>(Oacc + i * DV, orow, DV, 1.0f / l);
      *lrow_out = mrow[i] * kLn2 + std::log(l);
    } else {
      for (int d = 0; d < DV; ++d) orow[d] = from_f32<T>(all_ninf ? nan : 0.0f);
      *lrow_out = all_ninf ? nan : ninf;
    }
  }
}

// Split-KV: the number of key ranges per row block when `items` row blocks
// cannot keep `want` threads busy (each range at least two key blocks), or
// `forced` (> 0) ranges; at most one per key block.
inline int64_t pick_splits(int64_t items, int64_t nkb, int want, int forced) {
  if (nkb <= 1 || items <= 0) return 1;
  if (forced > 0) return std::min<int64_t>(forced, nkb);
  if (items >= want) return 1;
  return std::max<int64_t>(1, std::min<int64_t>((want + items - 1) / items, nkb / 2));
}

// o, lse = the log-sum-exp merge of nsplit partials (o in fp32 laid out like o,
// lse like lse, parts o_elems / l_elems apart) for B x Sq x Hq rows. A partial
// whose lse is -inf contributes nothing; rows without any give o = 0, lse = -inf;
// a NaN lse in any partial makes the row NaN, and so does kAllNegInfPartial as the
// largest (the keys the row sees all had -inf scores).
template <typename T, int D>
void merge_splits(const float* opart, const float* lpart, int64_t nsplit, int64_t B, int64_t Sq, int64_t Hq, T* o,
                  float* lse, int num_threads, Workers* workers) {
  const int64_t o_elems = B * Sq * Hq * D, l_elems = B * Hq * Sq;
  const int nt = threads_for(num_threads, 4.0 * double(nsplit) * double(o_elems));
  parallel_for(
      B * Sq, nt,
      [&](int64_t r, int) {
        const int64_t b = r / Sq, i = r % Sq;
        alignas(64) float acc[D];
        for (int64_t h = 0; h < Hq; ++h) {
          const int64_t li = (b * Hq + h) * Sq + i, oi = (r * Hq + h) * D;
          float m = -std::numeric_limits<float>::infinity();
          bool nan = false;
          for (int64_t c = 0; c < nsplit; ++c) {
            const float l = lpart[c * l_elems + li];
            nan |= l != l;
            m = std::max(m, l);
          }
          if (nan) {  // a NaN partial (NaN or overflowed scores) makes the row NaN
            for (int d = 0; d < D; ++d) o[oi + d] = from_f32<T>(std::numeric_limits<float>::quiet_NaN());
            lse[li] = std::numeric_limits<float>::quiet_NaN();
            continue;
          }
          if (m == kAllNegInfPartial) {  // keys seen, every score -inf: NaN (fwd_item)
            for (int d = 0; d < D; ++d) o[oi + d] = from_f32<T>(std::numeric_limits<float>::quiet_NaN());
            lse[li] = std::numeric_limits<float>::quiet_NaN();
            continue;
          }
          if (m == -std::numeric_limits<float>::infinity()) {
            for (int d = 0; d < D; ++d) o[oi + d] = from_f32<T>(0.0f);
            lse[li] = m;
            continue;
          }
          float sum = 0.0f;
          for (int d = 0; d < D; ++d) acc[d] = 0.0f;
          for (int64_t c = 0; c < nsplit; ++c) {
            const float l = lpart[c * l_elems + li];
            if (l == -std::numeric_limits<float>::infinity()) continue;
            const float w = std::exp(l - m);
            sum += w;
            const float* src = opart + c * o_elems + oi;
            for (int d = 0; d < D; ++d) acc[d] += w * src[d];
          }
          store_from_f32<T>(acc, o + oi, D, 1.0f / sum);
          lse[li] = m + std::log(sum);
        }
      },
      workers);
}

// Forward over `n` row blocks of B x Sq x Hq rows (o [B][Sq][Hq][D], lse
// [B][Hq][Sq]) with optional split-KV: setup(item, c, kmin, kmax) runs row block
// `item` over the keys [kmin, kmax) of split c, writing o / lse directly
// (nsplit == 1) or the partials it is handed (set in its FwdProblem by
// bind_split), which are merged afterwards.
struct SplitPlan {
  int64_t nsplit = 1;
  int64_t keys = 0;  // keys per split (a multiple of the key block)
};

inline SplitPlan plan_splits(int64_t items, int64_t max_keys, int want, int forced) {
  const int64_t nkb = (max_keys + kFwdBk - 1) / kFwdBk;
  SplitPlan sp;
  const int64_t ns = pick_splits(items, nkb, want, forced);
  const int64_t per = ns > 1 ? (nkb + ns - 1) / ns : std::max<int64_t>(nkb, 1);
  sp.nsplit = ns > 1 ? (nkb + per - 1) / per : 1;
  sp.keys = per * kFwdBk;
  return sp;
}

// Dense forward (extras optional) and paged forward share this driver: `run`
// is called as run(b, h, qb, FwdProblem&) with q / o / lse / extras of (b, h)
// to fill in the kv rows and call fwd_item; Sk_of(b) gives the problem's keys.
// D here is o's last dim (the value head dim).
template <typename T, int D, typename SkOf, typename Run>
void fwd_batched(T* o, float* lse, int64_t B, int64_t Sq, int64_t Hq, const AttentionAttrs& a, int num_threads,
                 Workers* workers, int kv_splits, double flops, SkOf&& Sk_of, Run&& run) {
  const int64_t nqb = (Sq + kFwdBq - 1) / kFwdBq;
  const int64_t nbh = B * Hq;
  const int64_t n = nbh * nqb;
  const int want = threads_for(num_threads, flops);
  int64_t max_keys = 0;
  for (int64_t b = 0; b < B; ++b) max_keys = std::max<int64_t>(max_keys, Sk_of(b));
  const SplitPlan sp = plan_splits(n, max_keys, want, kv_splits);
  const int64_t ns = sp.nsplit;
  const int64_t o_elems = B * Sq * Hq * D, l_elems = B * Hq * Sq;
  AlignedFloats opart(ns > 1 ? size_t(ns * o_elems) : 0), lpart(ns > 1 ? size_t(ns * l_elems) : 0);
  const int nt = static_cast<int>(std::min<int64_t>(want, n * ns));
  (void)a;
  parallel_for(
      n * ns, nt,
      [&](int64_t item, int) {
        const int64_t c = item / n, r = item % n;
        // One (batch, head)'s q blocks in a row, last (for causal: most expensive) first:
        // a thread's next item mostly reads the key / value rows still in its caches.
        const int64_t qb = nqb - 1 - r % nqb;
        const int64_t bh = r / nqb;
        const int64_t b = bh / Hq, h = bh % Hq;
        FwdProblem<T> p;
        p.Sq = Sq;
        p.Sk = Sk_of(b);
        p.o = o + (b * Sq * Hq + h) * D;
        p.lse = lse + bh * Sq;
        p.kmin = 0;
        p.kmax = p.Sk;
        if (ns > 1) {
          p.opart = opart.p + c * o_elems + (b * Sq * Hq + h) * D;
          p.lpart = lpart.p + c * l_elems + bh * Sq;
          p.kmin = std::min(p.Sk, c * sp.keys);
          p.kmax = std::min(p.Sk, (c + 1) * sp.keys);
        }
        run(b, h, qb, p);
      },
      workers);
  if (ns > 1) merge_splits<T, D>(opart.p, lpart.p, ns, B, Sq, Hq, o, lse, num_threads, workers);
}

template <typename T, int D, int DV>
void fwd_dense(const T* q, const T* k, const T* v, T* o, float* lse, const AttentionShape& s,
               const AttentionAttrs& a, const ScoreExtras* x, int num_threads, Workers* workers, int kv_splits) {
  const int64_t B = s.batch, Sq = s.seqlen_q, Sk = s.seqlen_k, Hq = s.heads_q, Hkv = s.heads_kv;
  const int64_t G = Hq / Hkv;
  const double flops = 2.0 * double(B * Hq) * std::max(visible_pairs(s, a), double(Sq)) * (D + DV);
  // fp32 products gather each key / value block once per q block and q head of
  // the group: pack them once per call instead when that is more than once (into
  // the calling thread's kept buffer: measured on Zen 4, f32, 1 thread, 2-5 %
  // faster from S=256 to 1024 and 18 % at S=4096; a buffer freshly mapped per
  // call made it 10 % slower at S=512). bf16 pairs are gathered per block.
  // A kv head is packed by the first of its items to run, right before its q
  // blocks read the rows back from the cache (1 thread, S=512 D=64: +1.5 % over
  // packing every head first when the caches are cold between calls, as after
  // XLA's temporaries; within the noise when they are warm).
  const int64_t nkc = (Sk + kFwdBk - 1) / kFwdBk, k_elems = B * Hkv * Sk * D;
  const bool pack = !(kBf16Dot && std::is_same<T, bf16>::value) && (Sq > kFwdBq || G > 1);
  const CallScratch kvbuf(pack ? size_t(B * Hkv * Sk * (D + DV)) : 0);
  std::vector<int32_t> vbad(pack ? size_t(B * Hkv * nkc) : 0);
  std::vector<std::atomic<int>> packed(pack ? size_t(B * Hkv) : 0);
  float* const kvp = kvbuf.data();
  fwd_batched<T, DV>(
      o, lse, B, Sq, Hq, a, num_threads, workers, kv_splits, flops, [&](int64_t) { return Sk; },
      [&](int64_t b, int64_t h, int64_t qb, FwdProblem<T>& p) {
        const int64_t hk = h / G;
        p.q = q + (b * Sq * Hq + h) * D;
        HeadExtras e;
        if (x != nullptr) {
          e = head_extras(*x, b, h, Sq, Sk, nullptr);
          p.x = &e;
        }
        const DenseRows<T> kr{k + (b * Sk * Hkv + hk) * D, Hkv * D}, vr{v + (b * Sk * Hkv + hk) * DV, Hkv * DV};
        const int64_t bhk = b * Hkv + hk;
        const PackedKV kv{kvp + bhk * Sk * D, kvp + k_elems + bhk * Sk * DV, vbad.data() + bhk * nkc};
        if (pack && made_once(packed[bhk], [&] {
              pack_kv_head<T, D, DV>(kr, vr, Sk, kvp + bhk * Sk * D, kvp + k_elems + bhk * Sk * DV,
                                     vbad.data() + bhk * nkc);
            }))
          p.kv = &kv;
        fwd_item<T, D, DV>(p, kr, vr, Hq, a, qb, thread_workspace(fwd_ws_floats<D, DV>()));
      });
}

}  // namespace detail

// ---------------------------------------------------------------------------
// Public entry points. Preconditions: s.head_dim == D, heads_kv > 0 divides
// heads_q, all sizes >= 0, buffers contiguous BSHD (lse [B][Hq][Sq]).
// num_threads: the most threads to use (the calling thread included); helpers
// run on `workers` (the own pool when null). Small problems use fewer threads.
// kv_splits (forward): split-KV ranges per row block; 0 = automatic (split
// only when there are fewer row blocks than useful threads), 1 = never.
// ---------------------------------------------------------------------------
// DV: the value head dim (v, o [..][DV]; call.h checks the shapes), D unless given.
template <typename T, int D, int DV = D>
void attention_fwd(const T* q, const T* k, const T* v, T* o, float* lse, const AttentionShape& s,
                   const AttentionAttrs& a, const ScoreExtras& x, int num_threads, Workers* workers = nullptr,
                   int kv_splits = 0) {
  static_assert(std::is_same<T, float>::value || std::is_same<T, bf16>::value || std::is_same<T, f16>::value,
                "T must be float, bf16 or f16");
  static_assert(detail::valid_head_dim<T>(D) && detail::valid_head_dim<T>(DV), "unsupported head_dim");
  if (s.batch <= 0 || s.heads_q <= 0 || s.heads_kv <= 0 || s.seqlen_q <= 0) return;
  if (s.head_dim != D || s.heads_q % s.heads_kv != 0 || s.seqlen_k < 0) return;  // precondition violated
  detail::fwd_dense<T, D, DV>(q, k, v, o, lse, s, a, x.any() ? &x : nullptr, num_threads, workers, kv_splits);
}

template <typename T, int D, int DV = D>
void attention_fwd(const T* q, const T* k, const T* v, T* o, float* lse, const AttentionShape& s,
                   const AttentionAttrs& a, int num_threads, Workers* workers = nullptr) {
  attention_fwd<T, D, DV>(q, k, v, o, lse, s, a, ScoreExtras{}, num_threads, workers, 0);
}

// Paged KV forward (PagedArgs): q, o [B][Sq][Hq][D], lse [B][Hq][Sq]; k_cache,
// v_cache [num_blocks][block_size][Hkv][D]; batch entry b sees its first
// seqused_k[b] keys (alignment uses that length). s.seqlen_k is unused.
// Preconditions (the handler checks them): 0 <= seqused_k[b] <= max_blocks *
// block_size and every block id a used key reaches is in [0, num_blocks).
// x: only its ALiBi slopes are used (slope(b, h); offset from seqused_k[b]).
template <typename T, int D>
void attention_fwd_paged(const T* q, const T* k_cache, const T* v_cache, T* o, float* lse, const AttentionShape& s,
                         const PagedArgs& pa, const AttentionAttrs& a, const ScoreExtras& x, int num_threads,
                         Workers* workers = nullptr, int kv_splits = 0) {
  static_assert(std::is_same<T, float>::value || std::is_same<T, bf16>::value || std::is_same<T, f16>::value,
                "T must be float, bf16 or f16");
  static_assert(detail::valid_head_dim<T>(D), "unsupported head_dim");
  using namespace detail;
  const int64_t B = s.batch, Sq = s.seqlen_q, Hq = s.heads_q, Hkv = s.heads_kv;
  if (B <= 0 || Hq <= 0 || Hkv <= 0 || Sq <= 0) return;
  if (s.head_dim != D || Hq % Hkv != 0 || pa.block_size <= 0) return;  // precondition violated
  const int64_t G = Hq / Hkv, BS = pa.block_size, MB = pa.max_blocks;
  ScoreExtras keep;
  const ScoreExtras* xa = alibi_only(x, &keep);
  double flops = 0.0;
  for (int64_t b = 0; b < B; ++b) {
    const AttentionShape sb{1, Sq, pa.seqused_k[b], Hq, Hkv, D};
    flops += 4.0 * double(Hq) * std::max(visible_pairs(sb, a), double(Sq)) * D;
  }
  fwd_batched<T, D>(
      o, lse, B, Sq, Hq, a, num_threads, workers, kv_splits, flops,
      [&](int64_t b) { return int64_t(pa.seqused_k[b]); },
      [&](int64_t b, int64_t h, int64_t qb, FwdProblem<T>& p) {
        const int64_t hk = h / G;
        p.q = q + (b * Sq * Hq + h) * D;
        HeadExtras e;
        if (xa != nullptr) {
          e = head_extras(*xa, b, h, Sq, p.Sk, nullptr);
          p.x = &e;
        }
        const PagedRows<T> kr{k_cache + hk * D, pa.block_table + b * MB, BS, BS * Hkv * D, Hkv * D};
        const PagedRows<T> vr{v_cache + hk * D, pa.block_table + b * MB, BS, BS * Hkv * D, Hkv * D};
        fwd_item<T, D, D>(p, kr, vr, Hq, a, qb, thread_workspace(fwd_ws_floats<D>()));
      });
}

template <typename T, int D>
void attention_fwd_paged(const T* q, const T* k_cache, const T* v_cache, T* o, float* lse, const AttentionShape& s,
                         const PagedArgs& pa, const AttentionAttrs& a, int num_threads, Workers* workers = nullptr,
                         int kv_splits = 0) {
  attention_fwd_paged<T, D>(q, k_cache, v_cache, o, lse, s, pa, a, ScoreExtras{}, num_threads, workers, kv_splits);
}

// Packed varlen forward (VarlenArgs): q, o [Tq][Hq][D], k, v [Tk][Hkv][D], lse
// [Hq][Tq], s = {B, Tq, Tk, Hq, Hkv, D}. Rows past cu_seqlens_q[B] get o = 0,
// lse = -inf. Preconditions (the handler checks them): cu_seqlens start at 0,
// do not decrease and end within Tq / Tk. x: only its ALiBi slopes are used
// (slope(b, h) for sequence b, offset from that sequence's lengths).
template <typename T, int D>
void attention_fwd_varlen(const T* q, const T* k, const T* v, T* o, float* lse, const AttentionShape& s,
                          const VarlenArgs& va, const AttentionAttrs& a, const ScoreExtras& x, int num_threads,
                          Workers* workers = nullptr) {
  static_assert(std::is_same<T, float>::value || std::is_same<T, bf16>::value || std::is_same<T, f16>::value,
                "T must be float, bf16 or f16");
  static_assert(detail::valid_head_dim<T>(D), "unsupported head_dim");
  using namespace detail;
  const int64_t B = s.batch, Tq = s.seqlen_q, Hq = s.heads_q, Hkv = s.heads_kv;
  if (B < 0 || Hq <= 0 || Hkv <= 0 || Tq <= 0) return;
  if (s.head_dim != D || Hq % Hkv != 0) return;  // precondition violated
  const int64_t G = Hq / Hkv;
  const int32_t* cq = va.cu_seqlens_q;
  const int32_t* ck = va.cu_seqlens_k;
  ScoreExtras keep;
  const ScoreExtras* xa = alibi_only(x, &keep);
  // Rows outside every sequence.
  const int64_t used = B > 0 ? cq[B] : 0;
  for (int64_t i = used; i < Tq; ++i) {
    std::memset(static_cast<void*>(o + i * Hq * D), 0, sizeof(T) * size_t(Hq * D));
    for (int64_t h = 0; h < Hq; ++h) lse[h * Tq + i] = -std::numeric_limits<float>::infinity();
  }
  // Row blocks (sequence, q block), most keys first.
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (sequence, q block)
  std::vector<double> cost;
  double flops = 0.0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t sq = cq[b + 1] - cq[b], sk = ck[b + 1] - ck[b];
    const AttentionShape sb{1, sq, sk, Hq, Hkv, D};
    flops += 4.0 * double(Hq) * std::max(visible_pairs(sb, a), double(sq)) * D;
    for (int64_t qb = 0; qb * kFwdBq < sq; ++qb) blocks.emplace_back(b, qb);
  }
  if (blocks.empty()) return;
  for (const auto& bl : blocks) {
    const int64_t sq = cq[bl.first + 1] - cq[bl.first], sk = ck[bl.first + 1] - ck[bl.first];
    const int64_t last = std::min<int64_t>(sq, (bl.second + 1) * kFwdBq) - 1;
    const int64_t off = a.bottom_right ? sk - sq : 0;
    cost.push_back(a.causal ? double(std::max<int64_t>(0, std::min<int64_t>(sk, last + off + 1))) : double(sk));
  }
  std::vector<size_t> order(blocks.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return cost[x] > cost[y]; });
  const int64_t n = int64_t(blocks.size()) * Hq;
  const int nt = static_cast<int>(std::min<int64_t>(threads_for(num_threads, flops), n));
  parallel_for(
      n, nt,
      [&](int64_t item, int) {
        const auto& bl = blocks[order[size_t(item / Hq)]];
        const int64_t h = item % Hq, hk = h / G, b = bl.first;
        FwdProblem<T> p;
        p.Sq = cq[b + 1] - cq[b];
        p.Sk = ck[b + 1] - ck[b];
        p.kmax = p.Sk;
        p.q = q + (int64_t(cq[b]) * Hq + h) * D;
        p.o = o + (int64_t(cq[b]) * Hq + h) * D;
        p.lse = lse + h * Tq + cq[b];
        HeadExtras e;
        if (xa != nullptr) {
          e = head_extras(*xa, b, h, p.Sq, p.Sk, nullptr);
          p.x = &e;
        }
        const DenseRows<T> kr{k + (int64_t(ck[b]) * Hkv + hk) * D, Hkv * D};
        const DenseRows<T> vr{v + (int64_t(ck[b]) * Hkv + hk) * D, Hkv * D};
        fwd_item<T, D, D>(p, kr, vr, Hq, a, bl.second, thread_workspace(fwd_ws_floats<D>()));
      },
      workers);
}

template <typename T, int D>
void attention_fwd_varlen(const T* q, const T* k, const T* v, T* o, float* lse, const AttentionShape& s,
                          const VarlenArgs& va, const AttentionAttrs& a, int num_threads,
                          Workers* workers = nullptr) {
  attention_fwd_varlen<T, D>(q, k, v, o, lse, s, va, a, ScoreExtras{}, num_threads, workers);
}

}  // namespace cpu
}  // namespace flashgen

