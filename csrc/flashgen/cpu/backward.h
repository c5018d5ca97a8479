// The CPU backward (FlashAttention-2 per key block): dQ/dK/dV with extras and
// dbias groups, dq chunking and reduction, the dense and varlen entry points.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "flashgen/attention.h"
#include "flashgen/cpu/bwd_tiles.h"
#include "flashgen/cpu/parallel.h"
#include "flashgen/cpu/problems.h"

namespace flashgen {
namespace cpu {
namespace detail {

// ---------------------------------------------------------------------------
// Backward.
// ---------------------------------------------------------------------------
// D: the widest of the query/key and the value head dims (every row buffer is sized by it).
template <int D>
constexpr size_t bwd_ws_floats() {
  // Kt, Vt [D][BK]; Kc, dKa, dVa [BK][D]; Qc, dOc [BQ][D]; P, dS [BQ][BK];
  // Qb, dOb [BQ][D/2] bf16 pairs; tmp [BK][D]; Pp, dSp [BQ/2][BK] and dSb [BQ][BK/2] bf16 pairs;
  // extras: xrow [BK], kv segment ids [BK]
  return 2 * size_t(D) * kBwdBk + 3 * size_t(kBwdBk) * D + 2 * size_t(kBwdBq) * D + 2 * size_t(kBwdBq) * kBwdBk +
         size_t(kBwdBq) * D + size_t(kBwdBk) * D + 2 * size_t(kBwdBq) * kBwdBk + 2 * size_t(kBwdBk);
}

// xr[t] (t < nkp) = the extras' score term of query i and key k0 + t in base-2
// units, -inf where masked (lanes [nk, nkp) finite or -inf). ksegb: the key
// block's segment ids, padded to nkp.
inline void bwd_extras_row(const HeadExtras& e, int64_t i, int64_t k0, int64_t nk, int64_t nkp, int64_t aoff,
                           const int32_t* ksegb, float* xr) {
  const float ninf = -std::numeric_limits<float>::infinity();
  if (e.bias != nullptr) {
    bias_f32(e, i * e.bias_ld + k0, nk, xr);
    for (int64_t t = nk; t < nkp; ++t) xr[t] = 0.0f;
  }
  const vf l2 = splat(kLog2e), sl = splat(e.slope * kLog2e), ninfv = splat(ninf), zero = splat(0.0f);
  const vi iota = iota_i();
  const int32_t d0 = static_cast<int32_t>(i + aoff - k0);  // i + aoff - j for local key 0
  const vi qv = splat_i(e.qseg != nullptr ? e.qseg[i] : 0);
  for (int64_t t = 0; t < nkp; t += W) {
    vf y = e.bias != nullptr ? loadv(xr + t) * l2 : zero;
    if (e.alibi) y = y - sl * absdist(splat_i(d0 - static_cast<int32_t>(t)) - iota);
    if (e.qseg != nullptr) y = loadvi(ksegb + t) == qv ? y : ninfv;
    storev(xr + t, y);
  }
  if (e.mask != nullptr) {
    const bool* m = e.mask + i * e.ld + k0;
    for (int64_t t = 0; t < nk; ++t)
      if (!m[t]) xr[t] = ninf;
  }
}

// One row of the backward with extras: prow (S) becomes P, dr (dP) becomes dS.
// s' = softcap(scale * S) + extras; dS' = P o (dP - Drow) is dbias's share (added
// to e.dbias); dS = dS' * scale (* (1 - u^2) with softcap). Keys outside [lo, hi]
// (band) get P = 0.
__attribute__((noinline)) inline void bwd_extras_p_ds(const HeadExtras& e, const AttentionAttrs& a, int64_t i,
                                                      int64_t k0, int64_t nk, int64_t nkp, int64_t aoff, int64_t lo,
                                                      int64_t hi, float lse2, float drow, const int32_t* ksegb,
                                                      float* xrow, float* prow, float* dr) {
  constexpr int BK = kBwdBk;
  bwd_extras_row(e, i, k0, nk, nkp, aoff, ksegb, xrow);
  const bool capped = a.softcap > 0.0f;
  const vf zero = splat(0.0f), scv = splat(a.scale), Lv = splat(-lse2), Dv = splat(drow);
  const vf ninfv = splat(-std::numeric_limits<float>::infinity()), masked_p = splat(-0.0f);
  const vi iota = iota_i(), lov = splat_i(static_cast<int32_t>(lo)), hiv = splat_i(static_cast<int32_t>(hi));
  alignas(64) float du[BK];
  vf cx = splat(a.scale * kLog2e);
  if (capped) {
    const vf capv = splat(a.softcap), cinv = splat(a.scale / a.softcap), one = splat(1.0f);
    for (int64_t t = 0; t < nkp; t += W) {
      const vf u = tanhv(loadv(prow + t) * cinv);
      storev(prow + t, capv * u);
      storev(du + t, one - u * u);
    }
    cx = splat(kLog2e);
  }
  float* dbr = e.dbias != nullptr ? e.dbias + i * e.bias_ld + k0 : nullptr;
  for (int64_t t = 0; t < nkp; t += W) {
    const vi idx = iota + splat_i(static_cast<int32_t>(t));
    const vf xv = loadv(xrow + t);
    // Masked pairs get P = dS = 0 whatever their S, dP or softcap factor (NaN included).
    const vi vis = (idx >= lov) & (idx <= hiv) & (xv != ninfv);
    const vf pv = vis ? exp2v(vfma(loadv(prow + t), cx, Lv) + xv) : masked_p;
    storev(prow + t, pv);
    const vf ds0 = vis ? pv * (loadv(dr + t) - Dv) : zero;
    if (dbr != nullptr) {
      if (t + W <= nk) {
        storev(dbr + t, loadv(dbr + t) + ds0);
      } else {
        for (int64_t l = 0; l < nk - t; ++l) dbr[t + l] += ds0[l];
      }
    }
    vf ds = ds0 * scv;
    if (capped) ds = vis ? ds * loadv(du + t) : zero;
    storev(dr + t, ds);
  }
}

// One backward problem (a batch entry or a packed sequence). q, dout and the
// dq accumulator: row 0 of head 0, rows Hq * D (dout: Hq * DV) apart; k, v, dk, dv: row 0 of
// head 0, rows Hkv * D (v, dv: Hkv * DV) apart; lse2, Drow: row 0 of head 0, heads lse_hs apart.
template <typename T>
struct BwdProblem {
  const T* q = nullptr;
  const T* dout = nullptr;
  const T* k = nullptr;
  const T* v = nullptr;
  T* dk = nullptr;
  T* dv = nullptr;
  float* dqacc = nullptr;
  const float* lse2 = nullptr;
  const float* Drow = nullptr;
  int64_t lse_hs = 0;
  int64_t Sq = 0, Sk = 0;
  // q and dout as fp32 [Hq][Sq][D], [Hq][Sq][DV] (packed once per call, bwd_row_terms), and per
  // (q head, q block) how many of their rows hold a NaN or an infinity; or null.
  const float* qpack = nullptr;
  const float* dopack = nullptr;
  const int32_t* qbad = nullptr;
};

// Key block kb of kv head hk: writes its dK, dV rows and adds its dQ terms to
// the dq accumulator rows of the group's q heads. x, b: the dense targets'
// extras and batch entry. With a bias, dS' is added to the fp32 dbias
// accumulator dbacc (bias layout), q head by q head (ascending), q block by q
// block (ascending).
// D: q, k, dq, dk's head dim; DV: v, dout, dv's (the workspace is bwd_ws_floats<max(D, DV)>).
template <typename T, int D, int DV>
void bwd_block(const BwdProblem<T>& pr, int64_t Hq, int64_t Hkv, const AttentionAttrs& a, int64_t hk, int64_t kb,
               const ScoreExtras* x, int64_t b, float* dbacc, float* ws) {
  constexpr int BQ = kBwdBq, BK = kBwdBk, M = std::max(D, DV);
  constexpr bool BF = kBf16Dot && std::is_same<T, bf16>::value;
  const int64_t Sq = pr.Sq, Sk = pr.Sk;
  const AttentionShape s{1, Sq, Sk, Hq, Hkv, D};
  const int64_t G = Hq / Hkv;
  const int64_t ldq = Hq * D, ldkv = Hkv * D, ldo = Hq * DV, ldv = Hkv * DV;

  float* Kt = ws;                // [D][BK] (or [D/2][BK] bf16 pairs)
  float* Vt = Kt + M * BK;       // [DV][BK] (or pairs)
  float* Kc = Vt + M * BK;       // [BK][D]
  float* dKa = Kc + BK * M;      // [BK][D]
  float* dVa = dKa + BK * M;     // [BK][DV]
  float* Qc = dVa + BK * M;      // [BQ][D]
  float* dOc = Qc + BQ * M;      // [BQ][DV]
  float* P = dOc + BQ * M;       // [BQ][BK]
  float* dS = P + BQ * BK;       // [BQ][BK]
  float* QdOb = dS + BQ * BK;    // [BQ][D/2] + [BQ][DV/2] bf16 pairs
  float* tmp = QdOb + BQ * M;    // [BK][max(D, DV)]
  float* PdSp = tmp + BK * M;    // [BQ/2][BK] + [BQ/2][BK] bf16 pairs along the query axis
  [[maybe_unused]] float* dSbuf = PdSp + BQ * BK;  // [BQ][BK/2] bf16 pairs along the key axis
  float* xrow = PdSp + 2 * BQ * BK;                // [BK] extras' terms of one row
  int32_t* ksegb = reinterpret_cast<int32_t*>(xrow + BK);  // [BK]

  const float c = a.scale * kLog2e;
  const vf cv = splat(c), scv = splat(a.scale), zero = splat(0.0f);
  // Masked pairs get P = -0 (a visible P is +0 or more, or NaN): how the non-finite
  // row terms below tell them apart (tiles.h, "Non-finite operand rows").
  const vf masked_p = splat(-0.0f);
  // Causal and sliding window as one band lo <= j - i <= hi (attention.h).
  const VisibleBand band = visible_band(s, a);
  const bool banded = band_masks_anything(s, band);
  const bool capped = a.softcap > 0.0f;
  const float cap_in = capped ? a.scale / a.softcap : 0.0f;
  const vi iota = iota_i();
  const int64_t aoff = causal_offset(s, a);

  const int64_t k0 = kb * BK;
  const int64_t nk = std::min<int64_t>(BK, Sk - k0);
  const int64_t nkp = round_up(nk, W);
  const T* kblk = pr.k + (k0 * Hkv + hk) * D;
  const T* vblk = pr.v + (k0 * Hkv + hk) * DV;
  if constexpr (BF) {
    transpose32(reinterpret_cast<const uint32_t*>(kblk), ldkv / 2, nk, D / 2, nkp, reinterpret_cast<uint32_t*>(Kt),
                BK);
    transpose32(reinterpret_cast<const uint32_t*>(vblk), ldv / 2, nk, DV / 2, nkp, reinterpret_cast<uint32_t*>(Vt),
                BK);
  } else {
    load_transposed<T, D>(kblk, ldkv, nk, nkp, Kt, BK, tmp);
    load_transposed<T, DV>(vblk, ldv, nk, nkp, Vt, BK, tmp);
  }
  int64_t ldk = D;
  const float* Kp = Kc;
  if constexpr (BF) {
#if FLASHGEN_CPU_BF16_DOT
    interleave_row_pairs<D>(reinterpret_cast<const bf16*>(kblk), ldkv, nk, reinterpret_cast<uint32_t*>(Kc));
#endif
  } else {
    Kp = rows_f32<T, D>(kblk, ldkv, nk, Kc, &ldk);
  }
  // K rows with a NaN or an infinity: zeroed for dQ += dS K, added back for visible pairs.
  int32_t badk[BK];
  int nbadk = 0;
  if constexpr (BF) {
#if FLASHGEN_CPU_BF16_DOT
    nbadk = take_nonfinite_rows_bf16<D>([&](int64_t r) { return reinterpret_cast<const bf16*>(kblk) + r * ldkv; },
                                        nk, reinterpret_cast<uint32_t*>(Kc), badk);
#endif
  } else {
    nbadk = take_nonfinite_rows<D>(Kc, nk, D, badk);
  }
  std::memset(dKa, 0, sizeof(float) * size_t(nk) * D);
  std::memset(dVa, 0, sizeof(float) * size_t(nk) * DV);

  // Rows that see some key of the block: [qstart, qend).
  const int64_t qstart = banded ? std::min<int64_t>(Sq, std::max<int64_t>(0, k0 - band.hi)) : 0;
  const int64_t qend = banded ? std::min<int64_t>(Sq, std::max<int64_t>(0, k0 + nk - band.lo)) : Sq;
  const int64_t qbend = qend > qstart ? (qend + BQ - 1) / BQ : 0;
  // Segment ids of the key block.
  int32_t kseg_lo = 0, kseg_hi = 0;
  const bool segs = x != nullptr && x->q_segment_ids != nullptr;
  if (segs) {
    const int32_t* ks = x->kv_segment_ids + b * Sk + k0;
    for (int64_t t = 0; t < nkp; ++t) ksegb[t] = ks[std::min<int64_t>(t, nk - 1)];
    id_range(ksegb, nk, &kseg_lo, &kseg_hi);
  }
  for (int64_t g = 0; g < G && qstart < qend; ++g) {
    const int64_t h = hk * G + g;
    HeadExtras e;
    if (x != nullptr) e = head_extras(*x, b, h, Sq, Sk, dbacc);
    for (int64_t qb = qstart / BQ; qb < qbend; ++qb) {
      const int64_t q0 = qb * BQ;
      const int64_t nq = std::min<int64_t>(BQ, Sq - q0);
      if (segs) {
        int32_t lo, hi;
        id_range(e.qseg + q0, nq, &lo, &hi);
        if (hi < kseg_lo || lo > kseg_hi) continue;  // no query of the block shares a key's segment
      }
      float* dq_rows = pr.dqacc + (q0 * Hq + h) * D;
      // dQ's rows (Hq * D apart, last touched a key block ago: out of L1 and, at long
      // sequences, of L2) are fetched while S and dP run, so that dQ += dS K does not
      // stall on loading them (≈ 7 % of the time at S=2048 D=64 without).
      for (int64_t i = 0; i < nq; ++i)
        for (int d = 0; d < D; d += 16) __builtin_prefetch(dq_rows + i * ldq + d, 1, 3);
      const T* qrows = pr.q + (q0 * Hq + h) * D;
      const T* dorows = pr.dout + (q0 * Hq + h) * DV;
      int64_t ldqf = D, lddo = DV;
      const float* Qp = Qc;
      const float* dOp = dOc;
      if constexpr (!BF) {
        if (pr.qpack != nullptr) {
          Qp = pr.qpack + (h * Sq + q0) * D;
          dOp = pr.dopack + (h * Sq + q0) * DV;
        } else {
          Qp = rows_f32<T, D>(qrows, ldq, nq, Qc, &ldqf);
          dOp = rows_f32<T, DV>(dorows, ldo, nq, dOc, &lddo);
        }
      }

      const bool diag = banded && (k0 - (q0 + nq - 1) < band.lo || k0 + nk - 1 - q0 > band.hi);
      // A block the band crosses: its visible local pairs.
      const BlockBand bb{q0 - k0 + band.lo, q0 - k0 + band.hi, nq, nk};
      // Every lane of the block visible, no extras or softcap: P and dS in the epilogues of S and dP.
      const bool fused = !diag && nk == nkp && x == nullptr && !capped;
      const float* L = pr.lse2 + h * pr.lse_hs + q0;
      const float* Dr = pr.Drow + h * pr.lse_hs + q0;
      if constexpr (BF) {
#if FLASHGEN_CPU_BF16_DOT
        const uint32_t* Qb = rows_pairs<T, D>(qrows, ldq, nq, QdOb);
        const uint32_t* dOb = rows_pairs<T, DV>(dorows, ldo, nq, QdOb + BQ * M / 2);
        gemm<uint32_t, false>(nq, nkp, D / 2, Qb, D / 2, 1, reinterpret_cast<const uint32_t*>(Kt), BK, P, BK);
        gemm<uint32_t, false>(nq, nkp, DV / 2, dOb, DV / 2, 1, reinterpret_cast<const uint32_t*>(Vt), BK, dS, BK);
#endif
      } else if (fused) {
        gemm<float, false>(nq, nkp, D, Qp, ldqf, 1, Kt, BK, P, BK, nullptr, FullTile(), ProbsEpilogue{cv, L});  // P
        gemm<float, false>(nq, nkp, DV, dOp, lddo, 1, Vt, BK, dS, BK, nullptr, FullTile(),
                           GradEpilogue{scv, Dr, P, BK});  // dS
      } else if (diag) {
        gemm_spans<false>(nq, nkp, Qp, ldqf, 1, Kt, BK, P, BK,
                          [&](int64_t r, int rows) { return bb.scores(r, rows, D); });  // S
        gemm_spans<false>(nq, nkp, dOp, lddo, 1, Vt, BK, dS, BK,
                          [&](int64_t r, int rows) { return bb.scores(r, rows, DV); });  // dP
      } else {
        gemm<float, false>(nq, nkp, D, Qp, ldqf, 1, Kt, BK, P, BK);     // S
        gemm<float, false>(nq, nkp, DV, dOp, lddo, 1, Vt, BK, dS, BK);  // dP
      }

      const bool terms_in_epilogues = fused && !BF;  // f32: P and dS are already there
      for (int64_t i = 0; i < nq && !terms_in_epilogues; ++i) {
        int64_t lo = 0, hi = nk - 1;  // visible local keys [lo, hi]
        if (diag) {
          lo = std::min<int64_t>(std::max<int64_t>(q0 + i + band.lo - k0, 0), nk);
          hi = std::min<int64_t>(std::max<int64_t>(q0 + i + band.hi - k0, -1), nk - 1);
        }
        const vi lov = splat_i(static_cast<int32_t>(lo)), hiv = splat_i(static_cast<int32_t>(hi));
        const vf Lv = splat(-L[i]), Dv = splat(Dr[i]);
        float* prow = P + i * BK;
        float* dr = dS + i * BK;
        if (x != nullptr) {
          bwd_extras_p_ds(e, a, q0 + i, k0, nk, nkp, aoff, lo, hi, L[i], Dr[i], ksegb, xrow, prow, dr);
          continue;
        }
        if (capped) {
          // u = tanh(S * scale / c); P = exp2(c * u * log2e - lse2); dS *= 1 - u^2.
          alignas(64) float du[BK];
          const vf capv = splat(a.softcap), cinv = splat(cap_in), one = splat(1.0f);
          for (int64_t t = 0; t < nkp; t += W) {
            const vf u = tanhv(loadv(prow + t) * cinv);
            storev(prow + t, capv * u);
            storev(du + t, one - u * u);
          }
          const vf lv2 = splat(kLog2e);
          for (int64_t t = 0; t < nkp; t += W) {
            const vi idx = iota + splat_i(static_cast<int32_t>(t));
            const vi vis = (idx >= lov) & (idx <= hiv);
            const vf pv = vis ? exp2v(vfma(loadv(prow + t), lv2, Lv)) : masked_p;
            storev(prow + t, pv);
            storev(dr + t, vis ? pv * (loadv(dr + t) - Dv) * scv * loadv(du + t) : zero);
          }
          continue;
        }
        if (fused) {  // bf16: every lane visible, no lane masks (f32: done in the epilogues)
          for (int64_t t = 0; t < nkp; t += W) {
            const vf pv = exp2v(vfma(loadv(prow + t), cv, Lv));
            storev(prow + t, pv);
            storev(dr + t, pv * (loadv(dr + t) - Dv) * scv);
          }
          continue;
        }
        for (int64_t t = 0; t < nkp; t += W) {
          // Masked pairs: P = dS = 0 even where S or dP is NaN (a NaN key or V row of a
          // key this row does not see must not reach it).
          const vi idx = iota + splat_i(static_cast<int32_t>(t));
          const vi vis = (idx >= lov) & (idx <= hiv);
          const vf pv = vis ? exp2v(vfma(loadv(prow + t), cv, Lv)) : masked_p;
          storev(prow + t, pv);
          storev(dr + t, vis ? pv * (loadv(dr + t) - Dv) * scv : zero);
        }
      }
      // Q and dO rows with a NaN or an infinity: zeroed for dK += dS^T Q and dV += P^T dO
      // (S and dP are done), added back for visible pairs below.
      int32_t badq[BQ], bado[BQ];
      int nbadq = 0, nbado = 0;
      if constexpr (!BF) {
        const bool bad_rows = pr.qpack == nullptr || pr.qbad[h * ((Sq + BQ - 1) / BQ) + qb] > 0;
        if (bad_rows && pr.qpack != nullptr) {  // zeroed in copies: the packed rows are shared
          std::memcpy(Qc, Qp, sizeof(float) * size_t(nq) * D);
          std::memcpy(dOc, dOp, sizeof(float) * size_t(nq) * DV);
          Qp = Qc;
          dOp = dOc;
        }
        if (bad_rows) {
          nbadq = take_nonfinite_rows<D>(Qc, nq, D, badq);
          nbado = take_nonfinite_rows<DV>(dOc, nq, DV, bado);
        }
      }
      if constexpr (BF) {
#if FLASHGEN_CPU_BF16_DOT
        // P, dS rounded to bf16 (as GPU FlashAttention-2 does); Q, dO, K are bf16 inputs.
        uint32_t* Qi = reinterpret_cast<uint32_t*>(Qc);    // Q pairs along the query axis [BQ/2][D]
        uint32_t* dOi = reinterpret_cast<uint32_t*>(dOc);  // dO pairs along the query axis
        uint32_t* Pp = reinterpret_cast<uint32_t*>(PdSp);
        uint32_t* dSp = Pp + (BQ / 2) * BK;
        uint32_t* dSb = reinterpret_cast<uint32_t*>(dSbuf);
        interleave_row_pairs<D>(reinterpret_cast<const bf16*>(qrows), ldq, nq, Qi);
        interleave_row_pairs<DV>(reinterpret_cast<const bf16*>(dorows), ldo, nq, dOi);
        nbadq = take_nonfinite_rows_bf16<D>(
            [&](int64_t r) { return reinterpret_cast<const bf16*>(qrows) + r * ldq; }, nq, Qi, badq);
        nbado = take_nonfinite_rows_bf16<DV>(
            [&](int64_t r) { return reinterpret_cast<const bf16*>(dorows) + r * ldo; }, nq, dOi, bado);
        pack_p_pairs(P, BK, nq, nkp, Pp, BK);
        pack_p_pairs(dS, BK, nq, nkp, dSp, BK);
        rows_to_bf16_pairs(dS, BK, nq, nkp, dSb, BK / 2);
        const int64_t qp = (nq + 1) / 2, kp = (nk + 1) / 2;
        gemm<uint32_t, true>(nk, DV, qp, Pp, 1, BK, dOi, DV, dVa, DV);  // dV += P^T dO
        gemm<uint32_t, true>(nk, D, qp, dSp, 1, BK, Qi, D, dKa, D);  // dK += dS^T Q
        gemm<uint32_t, true>(nq, D, kp, dSb, BK / 2, 1, reinterpret_cast<const uint32_t*>(Kc), D, dq_rows,
                             ldq);                                   // dQ += dS K
#endif
      } else if (diag) {  // masked pairs' P and dS are zeros: the tiles holding only those are skipped
        gemm_spans<true>(nk, DV, P, 1, BK, dOp, lddo, dVa, DV,
                         [&](int64_t r, int rows) { return bb.dkv(r, rows, DV / W); });  // dV += P^T dO
        gemm_spans<true>(nk, D, dS, 1, BK, Qp, ldqf, dKa, D,
                         [&](int64_t r, int rows) { return bb.dkv(r, rows, D / W); });  // dK += dS^T Q
        gemm_spans<true>(nq, D, dS, BK, 1, Kp, ldk, dq_rows, ldq,
                         [&](int64_t r, int rows) { return bb.dq(r, rows, D / W); });  // dQ += dS K
      } else {
        gemm<float, true>(nk, DV, nq, P, 1, BK, dOp, lddo, dVa, DV);     // dV += P^T dO
        gemm<float, true>(nk, D, nq, dS, 1, BK, Qp, ldqf, dKa, D);       // dK += dS^T Q
        gemm<float, true>(nq, D, nk, dS, BK, 1, Kp, ldk, dq_rows, ldq);  // dQ += dS K
      }
      if (nbado + nbadq + nbadk > 0) {
        auto weight = [&](const float* W, int64_t i, int64_t j, float* w) {
          if (std::signbit(P[i * BK + j])) return false;  // masked pair
          *w = W[i * BK + j];
          return true;
        };
        add_nonfinite_terms<DV>(
            nk, bado, nbado, [&](int64_t j, int32_t i, float* w) { return weight(P, i, j, w); },
            [&](int32_t i, float* dst) { load_f32<T>(dorows + i * ldo, dst, DV); }, dVa, DV);
        add_nonfinite_terms<D>(
            nk, badq, nbadq, [&](int64_t j, int32_t i, float* w) { return weight(dS, i, j, w); },
            [&](int32_t i, float* dst) { load_f32<T>(qrows + i * ldq, dst, D); }, dKa, D);
        add_nonfinite_terms<D>(
            nq, badk, nbadk, [&](int64_t i, int32_t j, float* w) { return weight(dS, i, j, w); },
            [&](int32_t j, float* dst) { load_f32<T>(kblk + j * ldkv, dst, D); }, dq_rows, ldq);
      }
    }
  }
  for (int64_t j = 0; j < nk; ++j) {
    store_from_f32<T>(dKa + j * D, pr.dk + ((k0 + j) * Hkv + hk) * D, D, 1.0f);
    store_from_f32<T>(dVa + j * DV, pr.dv + ((k0 + j) * Hkv + hk) * DV, DV, 1.0f);
  }
}

// Number of interleaved key-block chunks per (batch, kv head) in the backward:
// the smallest count that keeps nt threads >= 95% busy (or the best one found).
// The chunks' dq slabs are summed in chunk order, so the count decides dq's bits: a
// deterministic backward (AttentionAttrs::deterministic) sizes it for this many threads,
// whatever the threads it runs on.
constexpr int kDeterministicChunkThreads = 16;
inline int64_t pick_chunks(int64_t nbh, int64_t nkb, int nt) {
  if (nt <= 1 || nkb <= 1) return 1;
  int64_t best = 1;
  double best_eff = 0.0;
  const int64_t cmax = std::min<int64_t>(nkb, 4 * int64_t(nt));
  for (int64_t c = 1; c <= cmax; ++c) {
    const int64_t items = nbh * c;
    const double eff = double(items) / double((items + nt - 1) / nt * nt);
    if (eff > best_eff + 0.02) best = c, best_eff = eff;
    if (eff >= 0.95) break;
  }
  return best;
}

// lse2 = lse * log2(e) (+inf for rows that see no key) and Drow = rowsum(dO o O)
// for B x Hq x Sq rows (lse [B][Hq][Sq]; o, dout [B][Sq][Hq][DV]).
// With q set, also packs q and dout as fp32 [B][Hq][Sq][D], [..][DV] into qpack, dopack
// and counts per (batch, head, q block of kBwdBq) the rows holding a NaN or an
// infinity in either (qbad [B][Hq][blocks]).
template <typename T, int D, int DV = D>
void bwd_row_terms(const T* o, const T* dout, const float* lse, int64_t B, int64_t Sq, int64_t Hq, float* lse2,
                   float* Drow, int nt, Workers* workers, const T* q = nullptr, float* qpack = nullptr,
                   float* dopack = nullptr, int32_t* qbad = nullptr) {
  if (Sq <= 0) return;
  const int64_t nqc = (Sq + kBwdBq - 1) / kBwdBq;
  // Items: (batch entry, q block), rows in memory order (each q block's Hq rows of a
  // position together): o, dout and q are read as streams, not Hq * D apart.
  parallel_for(
      B * nqc, nt,
      [&](int64_t item, int) {
        const int64_t b = item / nqc, qb = item % nqc;
        const int64_t i0 = qb * kBwdBq, i1 = std::min<int64_t>(Sq, i0 + kBwdBq);
        alignas(64) float to[DV], tdbuf[DV];
        for (int64_t i = i0; i < i1; ++i) {
          for (int64_t h = 0; h < Hq; ++h) {
            const int64_t bh = b * Hq + h, r = bh * Sq + i;
            if (q != nullptr && i == i0) qbad[bh * nqc + qb] = 0;
            const float l = lse[r];
            lse2[r] = l == -std::numeric_limits<float>::infinity() ? std::numeric_limits<float>::infinity() : l * kLog2e;
            const int64_t row = (b * Sq + i) * Hq + h;
            load_f32<T>(o + row * DV, to, DV);
            float* td = q != nullptr ? dopack + r * DV : tdbuf;
            load_f32<T>(dout + row * DV, td, DV);
            if (q != nullptr) {
              load_f32<T>(q + row * D, qpack + r * D, D);
              qbad[bh * nqc + qb] += row_nonfinite<D>(qpack + r * D) || row_nonfinite<DV>(td);
            }
            vf acc = splat(0.0f);
            for (int d = 0; d < DV; d += W) acc = vfma(loadv(to + d), loadv(td + d), acc);
            float sum = 0.0f;
            for (int t = 0; t < W; ++t) sum += acc[t];
            Drow[r] = sum;
          }
        }
      },
      workers);
}

// dq (rows x rowlen) = the sum of nchunks fp32 accumulators (elems apart), converted.
template <typename T>
void reduce_dq(float* dqacc, int64_t nchunks, int64_t elems, int64_t rows, int64_t rowlen, T* dq, int nt,
               Workers* workers) {
  if (rows <= 0) return;
  const int64_t per = std::max<int64_t>(1, 16384 / std::max<int64_t>(rowlen, 1));
  const int64_t nitems = (rows + per - 1) / per;
  parallel_for(
      nitems, nt,
      [&](int64_t it, int) {
        const int64_t r0 = it * per, r1 = std::min(rows, r0 + per);
        float* base = dqacc + r0 * rowlen;
        const int64_t len = (r1 - r0) * rowlen;
        for (int64_t c = 1; c < nchunks; ++c) {
          const float* src = base + c * elems;
          for (int64_t e = 0; e < len; ++e) base[e] += src[e];
        }
        store_from_f32<T>(base, dq + r0 * rowlen, len, 1.0f);
      },
      workers);
}

// Dense backward; x (optional) may carry a bias and its dbias.
template <typename T, int D, int DV>
void bwd_dense(const T* q, const T* k, const T* v, const T* o, const float* lse, const T* dout, T* dq, T* dk, T* dv,
               const AttentionShape& s, const AttentionAttrs& a, const ScoreExtras* x, int num_threads,
               Workers* workers) {
  const int64_t B = s.batch, Sq = s.seqlen_q, Sk = s.seqlen_k, Hq = s.heads_q, Hkv = s.heads_kv;
  const int64_t G = Hq / Hkv;
  const double bwd_flops = 5.0 * double(B * Hq) * std::max(visible_pairs(s, a), double(std::max(Sq, Sk))) * (D + DV);
  const int nthreads = threads_for(num_threads, bwd_flops);
  const int light_threads =
      threads_for(nthreads, 4.0 * double(B * Hq) * double(std::max<int64_t>(Sq, Sk)) * (D + DV));

  // dbias: fp32 accumulator (dbias itself when f32), bias layout. When no two
  // (batch entry, kv head) pairs share a dbias slot, the work items are
  // (batch entry, kv head, key chunk) and each owns its slots' columns of its
  // key blocks: it zeroes them, then adds dS' into them directly. When the
  // bias broadcasts over the batch or over kv-head groups ("shared slots"),
  // the pairs that share slots form a group and the items are (group, key
  // chunk): per key block, the item zeroes the group's slot columns, then runs
  // the group's pairs in a fixed order (batch entry, then kv head). Every dbias
  // element is accumulated by one item in one order, whatever the threads: no
  // locks, and bit-reproducible.
  const bool has_db = x != nullptr && x->bias != nullptr && x->dbias != nullptr;
  const int64_t sb = has_db ? x->bias_stride_b : 0, sh = has_db ? x->bias_stride_h : 0;
  const bool db_shared = has_db && ((sb == 0 && B > 1) || (sh == 0 && Hkv > 1));
  const int64_t db_rows = has_db && x->bias_stride_q != 0 ? Sq : 1;  // 1: summed over the queries
  const size_t db_elems = has_db ? size_t((sb ? B : 1) * (sh ? Hq : 1) * db_rows * Sk) : 0;
  const bool db_direct = has_db && x->bias_type == ElemType::F32;
  AlignedFloats dbbuf(has_db && !db_direct ? db_elems : 0);
  float* dbacc = !has_db ? nullptr : db_direct ? static_cast<float*>(x->dbias) : dbbuf.p;

  // Split each (batch, kv head)'s (or each shared-slot group's) key blocks into
  // interleaved chunks when there are too few of them to keep the threads
  // busy; dq then accumulates per chunk and the chunks are summed in order at
  // the end. With shared slots the chunk count follows the threads of the
  // machine (default_num_threads()), not num_threads, so dq too is the same
  // for every num_threads.
  const int64_t nkb = (Sk + kBwdBk - 1) / kBwdBk;
  const int64_t gB = db_shared && sb != 0 ? B : 1, gH = db_shared && sh != 0 ? Hkv : 1;  // groups: gB x gH
  const int64_t pB = db_shared ? B / gB : 1, pH = db_shared ? Hkv / gH : 1;              // pairs per group
  const int64_t nbh = db_shared ? gB * gH : B * Hkv;
  const int64_t nchunks = pick_chunks(nbh, nkb, a.deterministic ? kDeterministicChunkThreads
                                                : db_shared ? threads_for(default_num_threads(), bwd_flops)
                                                            : nthreads);
  const bool direct = std::is_same<T, float>::value && nchunks == 1;
  const size_t dq_elems = size_t(B * Sq * Hq * D);

  // fp32 products read each q / dout block once per key block: pack them once
  // when that is more than once (bf16 pairs are gathered per block).
  const bool pack = !(kBf16Dot && std::is_same<T, bf16>::value) && Sk > kBwdBk;
  const int64_t nqc = (Sq + kBwdBq - 1) / kBwdBq;
  // The call's fp32 buffers (row terms, packed q / dout, dq's chunk accumulators)
  // in the calling thread's kept scratch: a buffer mapped per call took a page
  // fault per 4 KiB in a JAX process (512 a call for q / dout at S=512, D=64).
  const int64_t rows = B * Hq * Sq, qdo_elems = pack ? rows * (D + DV) : 0;
  const int64_t line = 64 / sizeof(float);  // each buffer starts a cache line
  const int64_t rows_pad = round_up(rows, line), qdo_pad = round_up(qdo_elems, line);
  const CallScratch scratch(size_t(2 * rows_pad + qdo_pad) + (direct ? 0 : dq_elems * nchunks));
  float* const lse2 = scratch.data();
  float* const Drow = lse2 + rows_pad;
  float* const qdo = Drow + rows_pad;
  float* const dqacc = direct ? reinterpret_cast<float*>(dq) : qdo + qdo_pad;
  std::vector<int32_t> qbad(pack ? size_t(B * Hq * nqc) : 0);
  if (pack)
    bwd_row_terms<T, D, DV>(o, dout, lse, B, Sq, Hq, lse2, Drow, light_threads, workers, q, qdo,
                            qdo + B * Hq * Sq * D, qbad.data());
  else
    bwd_row_terms<T, D, DV>(o, dout, lse, B, Sq, Hq, lse2, Drow, light_threads, workers);

  auto problem = [&](int64_t b, float* slab) {
    BwdProblem<T> p;
    p.q = q + b * Sq * Hq * D;
    p.dout = dout + b * Sq * Hq * DV;
    p.k = k + b * Sk * Hkv * D;
    p.v = v + b * Sk * Hkv * DV;
    p.dk = dk + b * Sk * Hkv * D;
    p.dv = dv + b * Sk * Hkv * DV;
    p.dqacc = slab + b * Sq * Hq * D;
    p.lse2 = lse2 + b * Hq * Sq;
    p.Drow = Drow + b * Hq * Sq;
    p.lse_hs = Sq;
    p.Sq = Sq;
    p.Sk = Sk;
    if (pack) {
      p.qpack = qdo + b * Hq * Sq * D;
      p.dopack = qdo + B * Hq * Sq * D + b * Hq * Sq * DV;
      p.qbad = qbad.data() + b * Hq * nqc;
    }
    return p;
  };
  auto zero_dq = [&](float* slab, int64_t b, int64_t hk) {
    for (int64_t i = 0; i < Sq; ++i)
      std::memset(slab + ((b * Sq + i) * Hq + hk * G) * D, 0, sizeof(float) * size_t(G * D));
  };
  // Zeroes columns [k0, k0 + nk) of the slots of batch entry b, q heads [h0, h1).
  auto zero_db = [&](int64_t b, int64_t h0, int64_t h1, int64_t k0, int64_t nk) {
    for (int64_t h = h0; h < h1; ++h) {
      float* base = dbacc + b * sb + h * sh + k0;
      for (int64_t i = 0; i < db_rows; ++i) std::memset(base + i * Sk, 0, sizeof(float) * size_t(nk));
    }
  };

  const int64_t n = nbh * nchunks;
  const int nt = static_cast<int>(std::min<int64_t>(nthreads, n));
  parallel_for(
      n, nt,
      [&](int64_t item, int) {
        const int64_t c = item % nchunks, bh = item / nchunks;
        float* slab = dqacc + c * dq_elems;
        float* ws = thread_workspace(bwd_ws_floats<std::max(D, DV)>());
        if (db_shared) {
          // Group (gb, gh): batch entries [b0, b0 + pB) x kv heads [h0, h0 + pH).
          const int64_t b0 = (bh / gH) * pB, h0 = (bh % gH) * pH;
          for (int64_t b = b0; b < b0 + pB; ++b)
            for (int64_t hk = h0; hk < h0 + pH; ++hk) zero_dq(slab, b, hk);
          for (int64_t kb = c; kb < nkb; kb += nchunks) {
            const int64_t k0 = kb * kBwdBk, nk = std::min<int64_t>(kBwdBk, Sk - k0);
            // The group's slots: batch entry b0 (sb != 0) or 0, q heads of [h0, h0 + pH) (sh != 0) or head 0.
            zero_db(b0, h0 * G, sh ? (h0 + pH) * G : 1, k0, nk);
            for (int64_t b = b0; b < b0 + pB; ++b) {
              const BwdProblem<T> p = problem(b, slab);
              for (int64_t hk = h0; hk < h0 + pH; ++hk) bwd_block<T, D, DV>(p, Hq, Hkv, a, hk, kb, x, b, dbacc, ws);
            }
          }
          return;
        }
        const int64_t b = bh / Hkv, hk = bh % Hkv;
        zero_dq(slab, b, hk);
        const BwdProblem<T> p = problem(b, slab);
        for (int64_t kb = c; kb < nkb; kb += nchunks) {
          const int64_t k0 = kb * kBwdBk, nk = std::min<int64_t>(kBwdBk, Sk - k0);
          // This item owns the slots of (b, heads of hk): zero the block's columns.
          if (dbacc != nullptr) zero_db(b, hk * G, sh ? (hk + 1) * G : hk * G + 1, k0, nk);
          bwd_block<T, D, DV>(p, Hq, Hkv, a, hk, kb, x, b, dbacc, ws);
        }
      },
      workers);

  if (!direct) reduce_dq<T>(dqacc, nchunks, int64_t(dq_elems), B * Sq, Hq * D, dq, light_threads, workers);
  if (has_db && !db_direct) {
    const int64_t per = 16384, nitems = (int64_t(db_elems) + per - 1) / per;
    parallel_for(
        nitems, light_threads,
        [&](int64_t it, int) {
          const int64_t e0 = it * per, len = std::min<int64_t>(per, int64_t(db_elems) - e0);
          if (x->bias_type == ElemType::BF16)
            store_from_f32<bf16>(dbbuf.p + e0, static_cast<bf16*>(x->dbias) + e0, len, 1.0f);
          else
            store_from_f32<f16>(dbbuf.p + e0, static_cast<f16*>(x->dbias) + e0, len, 1.0f);
        },
        workers);
  }
}

}  // namespace detail

// Entry points: preconditions, threads and workers as forward.h's.
// x.dbias (with x.bias): receives dS summed over the bias's broadcast dims,
// every element written.
// DV: the value head dim (v, o, dout, dv [..][DV]), D unless given.
template <typename T, int D, int DV = D>
void attention_bwd(const T* q, const T* k, const T* v, const T* o, const float* lse, const T* dout, T* dq, T* dk,
                   T* dv, const AttentionShape& s, const AttentionAttrs& a, const ScoreExtras& x, int num_threads,
                   Workers* workers = nullptr) {
  static_assert(std::is_same<T, float>::value || std::is_same<T, bf16>::value || std::is_same<T, f16>::value,
                "T must be float, bf16 or f16");
  static_assert(detail::valid_head_dim<T>(D) && detail::valid_head_dim<T>(DV), "unsupported head_dim");
  const int64_t B = s.batch, Sq = s.seqlen_q, Sk = s.seqlen_k, Hq = s.heads_q, Hkv = s.heads_kv;
  if (B <= 0 || Hq <= 0 || Hkv <= 0 || Sq < 0 || Sk < 0) return;
  if (s.head_dim != D || Hq % Hkv != 0) return;  // precondition violated
  if (Sq == 0 && Sk == 0) return;
  detail::bwd_dense<T, D, DV>(q, k, v, o, lse, dout, dq, dk, dv, s, a, x.any() ? &x : nullptr, num_threads,
                              workers);
}

template <typename T, int D, int DV = D>
void attention_bwd(const T* q, const T* k, const T* v, const T* o, const float* lse, const T* dout, T* dq, T* dk,
                   T* dv, const AttentionShape& s, const AttentionAttrs& a, int num_threads,
                   Workers* workers = nullptr) {
  attention_bwd<T, D, DV>(q, k, v, o, lse, dout, dq, dk, dv, s, a, ScoreExtras{}, num_threads, workers);
}

// Packed varlen backward: q, o, dout, dq [Tq][Hq][D]; k, v, dk, dv [Tk][Hkv][D];
// lse [Hq][Tq]. Rows outside every sequence get zero gradients. x: only its
// ALiBi slopes are used (a constant: no slope gradient).
template <typename T, int D>
void attention_bwd_varlen(const T* q, const T* k, const T* v, const T* o, const float* lse, const T* dout, T* dq,
                          T* dk, T* dv, const AttentionShape& s, const VarlenArgs& va, const AttentionAttrs& a,
                          const ScoreExtras& x, int num_threads, Workers* workers = nullptr) {
  static_assert(std::is_same<T, float>::value || std::is_same<T, bf16>::value || std::is_same<T, f16>::value,
                "T must be float, bf16 or f16");
  static_assert(detail::valid_head_dim<T>(D), "unsupported head_dim");
  using namespace detail;
  const int64_t B = s.batch, Tq = s.seqlen_q, Tk = s.seqlen_k, Hq = s.heads_q, Hkv = s.heads_kv;
  if (B < 0 || Hq <= 0 || Hkv <= 0 || Tq < 0 || Tk < 0) return;
  if (s.head_dim != D || Hq % Hkv != 0) return;  // precondition violated
  const int64_t G = Hq / Hkv;
  const int32_t* cq = va.cu_seqlens_q;
  const int32_t* ck = va.cu_seqlens_k;
  const int64_t used_q = B > 0 ? cq[B] : 0, used_k = B > 0 ? ck[B] : 0;
  ScoreExtras keep;
  const ScoreExtras* xa = alibi_only(x, &keep);
  // Keys outside every sequence.
  if (Tk > used_k) {
    std::memset(static_cast<void*>(dk + used_k * Hkv * D), 0, sizeof(T) * size_t((Tk - used_k) * Hkv * D));
    std::memset(static_cast<void*>(dv + used_k * Hkv * D), 0, sizeof(T) * size_t((Tk - used_k) * Hkv * D));
  }
  if (Tq <= 0) return;
  double pairs = 0.0;
  int64_t nkb = 0;
  std::vector<int64_t> order;
  std::vector<double> cost(size_t(std::max<int64_t>(B, 0)));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t sq = cq[b + 1] - cq[b], sk = ck[b + 1] - ck[b];
    const AttentionShape sb{1, sq, sk, Hq, Hkv, D};
    cost[size_t(b)] = std::max(visible_pairs(sb, a), double(std::max(sq, sk)));
    pairs += cost[size_t(b)];
    nkb = std::max<int64_t>(nkb, (sk + kBwdBk - 1) / kBwdBk);
    order.push_back(b);
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return cost[size_t(x)] > cost[size_t(y)]; });
  const int nthreads = threads_for(num_threads, 10.0 * double(Hq) * pairs * D);
  const int light_threads = threads_for(nthreads, 8.0 * double(Hq) * double(std::max(Tq, Tk)) * D);

  AlignedFloats lse2(size_t(Hq * Tq)), Drow(size_t(Hq * Tq));
  bwd_row_terms<T, D>(o, dout, lse, 1, Tq, Hq, lse2.p, Drow.p, light_threads, workers);

  const int64_t nown = B * Hkv;
  const int64_t nchunks =
      pick_chunks(std::max<int64_t>(nown, 1), nkb, a.deterministic ? kDeterministicChunkThreads : nthreads);
  const bool direct = std::is_same<T, float>::value && nchunks == 1;
  const size_t dq_elems = size_t(Tq * Hq * D);
  AlignedFloats dqbuf(direct ? 0 : dq_elems * nchunks);
  float* dqacc = direct ? reinterpret_cast<float*>(dq) : dqbuf.p;
  // Rows outside every sequence.
  for (int64_t c = 0; c < nchunks; ++c)
    if (Tq > used_q)
      std::memset(dqacc + c * dq_elems + used_q * Hq * D, 0, sizeof(float) * size_t((Tq - used_q) * Hq * D));

  const int64_t n = nown * nchunks;
  const int nt = static_cast<int>(std::min<int64_t>(nthreads, std::max<int64_t>(n, 1)));
  parallel_for(
      n, nt,
      [&](int64_t item, int) {
        const int64_t c = item % nchunks, own = item / nchunks;
        const int64_t b = order[size_t(own / Hkv)], hk = own % Hkv;
        BwdProblem<T> p;
        p.Sq = cq[b + 1] - cq[b];
        p.Sk = ck[b + 1] - ck[b];
        p.q = q + int64_t(cq[b]) * Hq * D;
        p.dout = dout + int64_t(cq[b]) * Hq * D;
        p.k = k + int64_t(ck[b]) * Hkv * D;
        p.v = v + int64_t(ck[b]) * Hkv * D;
        p.dk = dk + int64_t(ck[b]) * Hkv * D;
        p.dv = dv + int64_t(ck[b]) * Hkv * D;
        p.dqacc = dqacc + c * dq_elems + int64_t(cq[b]) * Hq * D;
        p.lse2 = lse2.p + cq[b];
        p.Drow = Drow.p + cq[b];
        p.lse_hs = Tq;
        for (int64_t i = 0; i < p.Sq; ++i)
          std::memset(p.dqacc + (i * Hq + hk * G) * D, 0, sizeof(float) * size_t(G * D));
        float* ws = thread_workspace(bwd_ws_floats<D>());
        const int64_t nkb_b = (p.Sk + kBwdBk - 1) / kBwdBk;
        for (int64_t kb = c; kb < nkb_b; kb += nchunks)
          bwd_block<T, D, D>(p, Hq, Hkv, a, hk, kb, xa, b, nullptr, ws);
      },
      workers);
  if (!direct) reduce_dq<T>(dqacc, nchunks, int64_t(dq_elems), Tq, Hq * D, dq, light_threads, workers);
}

template <typename T, int D>
void attention_bwd_varlen(const T* q, const T* k, const T* v, const T* o, const float* lse, const T* dout, T* dq,
                          T* dk, T* dv, const AttentionShape& s, const VarlenArgs& va, const AttentionAttrs& a,
                          int num_threads, Workers* workers = nullptr) {
  attention_bwd_varlen<T, D>(q, k, v, o, lse, dout, dq, dk, dv, s, va, a, ScoreExtras{}, num_threads, workers);
}

}  // namespace cpu
}  // namespace flashgen

