// Hopper (sm_90a) dense forward: wgmma tensor cores, TMA loads, a warp-specialized CTA with two
// ping-ponging consumer warpgroups.
//
// One CTA = 128 query rows of one (batch, q head), 384 threads, __launch_bounds__(384, 1):
//   warpgroup 0 (producer) gives its registers away (setmaxnreg.dec) and one elected thread of
//     its first warp issues every load as a TMA box (cp.async.bulk.tensor, 128B swizzle, from
//     the host's tensor maps): Q once, then the key/value blocks of 64 keys into a 2-stage ring.
//     Each stage's `full` mbarrier completes when the producer's arrive.expect_tx and the boxes'
//     bytes are in; its `empty` one when both consumers released it. Rows past the tensor's end
//     arrive as zeros (TMA's out-of-bounds fill) and the band mask hides them.
//   warpgroups 1 and 2 (consumers, setmaxnreg.inc) own 64 query rows each. Per block j:
//     S = Q K^T (wgmma from shared memory), [softcap], the band mask on blocks that need it (tail,
//     diagonal, window edge), online softmax in the log2 domain (ex2), O += P V (wgmma, P from
//     registers, V MN-major from shared memory). A consumer issues QK^T(j) and PV(j-1) together
//     and runs softmax(j) while PV(j-1) is still on the tensor cores; the two consumers take turns
//     issuing (named barriers kPingPongBar + w, FA3's ping-pong), so one's softmax overlaps the
//     other's GEMMs.
// Blocks outside the CTA's visible band (causal, window) are never loaded. Epilogue: o = O / l
// written into the consumer's (spent) Q tile in the same swizzled layout and TMA-stored (rows past
// Sq skipped); lse = m * scale + ln(l) straight from registers; o = 0, lse = -inf for a row that
// sees no key.
// Varlen (packed sequences, blockIdx.z = sequence): the maps span all Tq / Tk rows as one batch and
// the CTA offsets its boxes by the sequence's cu_seqlens start, so a box may run into the next
// sequence. Its keys there are past the sequence's Sk: the tail mask hides them. Its query rows
// there are computed but never written: a consumer whose 64 rows cross the sequence's end stores O
// with plain per-row stores (rows < Sq) instead of the TMA box, which would overwrite the next
// sequence. (One map per sequence would clip in hardware but costs B encodes per call, and the
// cu_seqlens are device data; the plain store touches one tile per sequence.)
// FP8 (T = e4m3, contract.FP8_CALLS: per-tensor descales, real value = stored * descale; o bf16):
//   - tiles are 64-byte-swizzled panels of 64 e4m3 columns (sm90.cuh); a wgmma K step is k32;
//   - the descales of q and k fold into the softmax scale, v's into o's 1 / l;
//   - 8-bit wgmma reads B K-major only, so the producer warpgroup (all 128 threads) stores each
//     value block TRANSPOSED (V^T, a row per head-dim column, keys along it) with plain loads and
//     shared stores, while its elected thread TMA-loads the keys; the stage's `full` barrier also
//     counts the 128 threads' arrivals. Keys are stored in the order P's registers hold them
//     (store_v_transposed), so P (rounded to e4m3) is the PV wgmma's A operand without shuffles;
//   - l sums the f32 probabilities, not their e4m3 roundings (as FlashAttention-3): o's error is
//     the rounding of P weighted by |v| (tests/test_fp8.py derives the bound);
//   - o (bf16) is twice the Q tile's bytes: every row is stored with plain stores, no TMA box.
#pragma once

#include <cuda_fp8.h>

#include "flashgen/call.h"
#include "flashgen/cuda/fwd.cuh"
#include "flashgen/cuda/hopper/sm90.cuh"

namespace flashgen {
namespace cuda {
namespace {

// Which dense forward calls this kernel serves; the others keep the sm80 family's kernels.
// Compiled for f16 / bf16 / e4m3 at head dims that are multiples of 64 up to 256 (the swizzled
// panels; Q, K and V stages fit in shared memory). At run time: any band (causal top-left or
// bottom-right, sliding window), softcap (not e4m3: its call refuses it), GQA / MQA; no extras
// (bias, mask, segment ids, ALiBi: not ported).
template <class T, int D>
constexpr bool kHopperFwdCompiles = D % sm90::kPanelCols == 0 && D <= 256 &&
                                    (std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value ||
                                     std::is_same<T, __nv_fp8_e4m3>::value);

// What the element type changes in the kernel.
template <class T>
struct HopperFwdElem {
  static constexpr bool kFp8 = std::is_same<T, __nv_fp8_e4m3>::value;
  static constexpr int kK = 32 / static_cast<int>(sizeof(T));  // wgmma K step: 32 bytes of a panel row
  static constexpr int kPanelBytes = 64 * sm90::kPanelCols * static_cast<int>(sizeof(T));  // 64 rows' panel
  // PV's K step kk in V's stage: 16 keys of 128-byte rows (MN-major), or 32 bytes along V^T's rows.
  static constexpr int kVStepBytes = kFp8 ? kK : kK * 128;
  using Out = typename std::conditional<kFp8, __nv_bfloat16, T>::type;
};

// FP8: the dense call's parameters and the descale operands ([1] each, device memory).
struct Fp8FwdParams : FwdParams {
  const float* q_descale;
  const float* k_descale;
  const float* v_descale;
};
template <class T, bool VARLEN>
using HopperFwdParams = typename std::conditional<
    VARLEN, FwdVarParams, typename std::conditional<HopperFwdElem<T>::kFp8, Fp8FwdParams, FwdParams>::type>::type;
// Factors on the scores (q's and k's descales) and on o (v's); 1 where the inputs are not scaled.
inline __device__ float qk_descale_of(const FwdParams&) { return 1.f; }
inline __device__ float qk_descale_of(const Fp8FwdParams& p) { return *p.q_descale * *p.k_descale; }
inline __device__ float v_descale_of(const FwdParams&) { return 1.f; }
inline __device__ float v_descale_of(const Fp8FwdParams& p) { return *p.v_descale; }

// P of one block (this thread's S accumulator registers, probabilities in f32) as the A fragments
// of the PV wgmmas. 16-bit: k16 step kk is S's columns 16 kk .. (registers 8 kk ..), mma.m16n8k16's
// A order. e4m3: k32 step kk is registers 16 kk ..; register r takes row g + 8 (r % 2) of the
// 16-column half r / 2, and the thread's keys {2t, 2t+1, 8+2t, 9+2t} of it go to A positions
// 4t .. 4t+3, the order store_v_transposed gives V^T's keys.
template <class T>
FG_DEV void p_fragments(const float (&s)[32], uint32_t (&pa)[64 / HopperFwdElem<T>::kK][4]) {
#pragma unroll
  for (int kk = 0; kk < 64 / HopperFwdElem<T>::kK; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      if constexpr (HopperFwdElem<T>::kFp8) {
        const float* x = s + 16 * kk + 8 * (r / 2) + 2 * (r % 2);
        pa[kk][r] = sm90::pack_e4m3x4(x[0], x[1], x[4], x[5]);
      } else {
        pa[kk][r] = HalfOps<T>::pack(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
      }
    }
}

// Keys [row0, row0 + 64) of V ([rows][D] e4m3 at `src`, `stride` bytes per row) as V^T at shared
// address `vt` (1024-byte aligned): D rows of 64 key positions, 64-byte swizzled (sm90::sw64), A
// position 4t + i of each 16 holding key 2t + (i % 2) + 8 (i / 2) (p_fragments' order, so
// sum_k P[:, k] V[k, :] is unchanged). Keys at or past `keys_valid` are zeros (their P is 0, and
// 0 * NaN would not be). Each of NT threads moves 4 keys x 4 columns at a time: 4 coalesced 4-byte
// loads, a 4 x 4 byte transpose, 4 stores.
template <int D, int NT>
FG_DEV void store_v_transposed(uint32_t vt, const uint8_t* src, int64_t stride, int row0, int keys_valid, int tid) {
  constexpr int kWords = D / 4;  // 4-column words per key
#pragma unroll 2
  for (int i = tid; i < 16 * kWords; i += NT) {
    const int w = i % kWords, quad = i / kWords;  // quad: positions 4 quad .. 4 quad + 3
    const int group = quad / 4, t = quad % 4;
    uint32_t v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = row0 + 16 * group + 2 * t + (e % 2) + 8 * (e / 2);
      v[e] = key < keys_valid ? *reinterpret_cast<const uint32_t*>(src + key * stride + 4 * w) : 0u;
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {  // column 4 w + c: byte c of each key's word
      const uint32_t row = ((v[0] >> (8 * c)) & 0xFFu) | (((v[1] >> (8 * c)) & 0xFFu) << 8) |
                           (((v[2] >> (8 * c)) & 0xFFu) << 16) | (((v[3] >> (8 * c)) & 0xFFu) << 24);
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(vt + sm90::sw64((4 * w + c) * 64 + 4 * quad)), "r"(row) : "memory");
    }
  }
}

// Dense and varlen calls (varlen's only extra is ALiBi).
inline bool hopper_fwd_supports(const Decoded& c) { return !c.x.any(); }

struct HopperFwdConfig {
  static constexpr int kConsumers = 2;             // consumer warpgroups
  static constexpr int BM = 64;                    // query rows per consumer (one wgmma M)
  static constexpr int BR = kConsumers * BM;       // query rows per CTA
  static constexpr int BC = 64;                    // keys per block (the TMA box's rows)
  static constexpr int kStages = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // setmaxnreg: FA3's split for two consumers; the CTA (one per SM) must fit the register file.
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  // FP8: the producer warpgroup also transposes V (store_v_transposed).
  static constexpr int kFp8ProducerRegs = 40, kFp8ConsumerRegs = 232;
  static_assert(128 * (kProducerRegs + kConsumers * kConsumerRegs) <= 65536, "setmaxnreg budget over 64K registers");
  static_assert(128 * (kFp8ProducerRegs + kConsumers * kFp8ConsumerRegs) <= 65536, "FP8 budget over 64K registers");
  static constexpr int kPingPongBar = 1;           // named barriers 1, 2: consumer w's turn to issue
  static constexpr int kEpilogueBar = 3;           // named barriers 3, 4: consumer w's O tile written
  // A [64][head_dim] tile of T (one consumer's Q, or one block's K or V; V^T [head_dim][64] for e4m3).
  template <class T>
  __host__ __device__ static constexpr int tile_bytes(int head_dim) {
    return BC * head_dim * static_cast<int>(sizeof(T));
  }
  // Q per consumer, then per stage K and V; +1024 to align the base to the swizzle atom.
  template <class T>
  __host__ __device__ static constexpr size_t smem_bytes(int head_dim) {
    return (kConsumers + 2 * kStages) * tile_bytes<T>(head_dim) + sm90::kSwizzleAtom;
  }
};
static_assert(HopperFwdConfig::BM == HopperFwdConfig::BC, "Q, K and V tiles share one TMA box shape");

// The rows one CTA works on: its sequence's lengths and band, where the sequence starts in the
// tensor maps' (row, batch) coordinates, and its lse row.
struct HopperFwdSeq {
  int Sq, Sk, band_lo, band_hi, masked;
  int q_start, k_start, map_batch;
  float* lse;
};
inline __device__ HopperFwdSeq hopper_fwd_seq(const FwdParams& p, int b, int h) {
  return {p.seqlen_q, p.seqlen_k, p.band_lo, p.band_hi, p.masked, 0, 0, b,
          p.lse + (static_cast<int64_t>(b) * p.heads_q + h) * p.seqlen_q};
}
// Sequence b of a packed batch, clamped as the sm80 varlen kernel clamps it (seq_range); lse [Hq, Tq].
inline __device__ HopperFwdSeq hopper_fwd_seq(const FwdVarParams& p, int b, int h) {
  const SeqRange rq = seq_range(p.cu_q[b], p.cu_q[b + 1], p.seqlen_q, p.max_seqlen_q);
  const SeqRange rk = seq_range(p.cu_k[b], p.cu_k[b + 1], p.seqlen_k, p.max_seqlen_k);
  const IntBand bd = int_band(rq.len, rk.len, p.causal, p.bottom_right, p.window_left, p.window_right);
  return {rq.len, rk.len, bd.lo, bd.hi, bd.masked, rq.start, rk.start, 0,
          p.lse + static_cast<int64_t>(h) * p.seqlen_q + rq.start};
}

// Tensor maps: q, k, v, o as 4-D [batch][seq][heads][head_dim] tensors (varlen: batch 1, seq the
// packed total), box {64 columns, 1 head, 64 rows, 1 batch} (one 128-byte swizzled panel of a
// tile); ffi_cuda.cuh encodes them.
template <class T, int D, bool CAUSAL, bool VARLEN = false>
__global__ void __launch_bounds__(HopperFwdConfig::kThreads, 1)
    hopper_fwd_kernel(const HopperFwdParams<T, VARLEN> p,
                      const __grid_constant__ CUtensorMap map_q,
                      const __grid_constant__ CUtensorMap map_k, const __grid_constant__ CUtensorMap map_v,
                      const __grid_constant__ CUtensorMap map_o) {
  using Cfg = HopperFwdConfig;
  using Elem = HopperFwdElem<T>;
  constexpr int BM = Cfg::BM, BR = Cfg::BR, BC = Cfg::BC, kStages = Cfg::kStages, kConsumers = Cfg::kConsumers;
  constexpr int kTile = Cfg::tile_bytes<T>(D);
  constexpr int kPanels = D / sm90::kPanelCols;
  constexpr int kPanelBytes = Elem::kPanelBytes;
  constexpr int kStepsPerPanel = sm90::kPanelCols / Elem::kK;

  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages], q_full;
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t smem = (raw + sm90::kSwizzleAtom - 1) / sm90::kSwizzleAtom * sm90::kSwizzleAtom;
  auto sQ = [&](int w) { return smem + w * kTile; };
  auto sK = [&](int s) { return smem + (kConsumers + 2 * s) * kTile; };
  auto sV = [&](int s) { return smem + (kConsumers + 1 + 2 * s) * kTile; };

  // Causal: the last query blocks have the most work; launch them first.
  const int mblk = CAUSAL ? static_cast<int>(gridDim.x - 1 - blockIdx.x) : static_cast<int>(blockIdx.x);
  const int h = blockIdx.y, hk = h / p.group, b = blockIdx.z;
  const int q0 = mblk * BR;
  const HopperFwdSeq seq = hopper_fwd_seq(p, b, h);
  const int Sq = seq.Sq, Sk = seq.Sk;
  if (q0 >= Sq) return;  // the whole CTA: past its sequence's rows (varlen; the fill kernel wrote them)

  // Key blocks [n_first, n_end) cover the band of rows q0 .. q_last.
  const int q_last = min(q0 + BR, Sq) - 1;
  const long long kv_begin = max(0LL, static_cast<long long>(q0) + seq.band_lo);
  const long long kv_end = min(static_cast<long long>(Sk), static_cast<long long>(q_last) + seq.band_hi + 1);
  const int n_first = kv_end > kv_begin ? static_cast<int>(kv_begin / BC) : 0;
  const int n_end = kv_end > kv_begin ? static_cast<int>((kv_end + BC - 1) / BC) : 0;
  const int n_blocks = n_end - n_first;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::mbar_init(smem_addr(&full[s]), Elem::kFp8 ? 1 + 128 : 1);  // the producer thread (+ V^T's storers)
      sm90::mbar_init(smem_addr(&empty[s]), kConsumers);
    }
    sm90::mbar_init(smem_addr(&q_full), 1);
    sm90::fence_mbarrier_init();
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {  // ---- producer
    sm90::setmaxnreg_dec<Elem::kFp8 ? Cfg::kFp8ProducerRegs : Cfg::kProducerRegs>();
    // A CTA that sees no key loads nothing (its consumers write o = 0, lse = -inf).
    const bool issuer = threadIdx.x < 32 && n_blocks > 0 && sm90::elect_one();
    if (!issuer && !(Elem::kFp8 && n_blocks > 0)) return;
    if (issuer) {
      const uint32_t qb = smem_addr(&q_full);
      sm90::mbar_arrive_expect_tx(qb, kConsumers * kTile);
      for (int w = 0; w < kConsumers; ++w)
        for (int pn = 0; pn < kPanels; ++pn)
          sm90::tma_load_4d(sQ(w) + pn * kPanelBytes, &map_q, pn * sm90::kPanelCols, h, seq.q_start + q0 + w * BM,
                            seq.map_batch, qb);
    }
    for (int it = 0; it < n_blocks; ++it) {
      const int s = it % kStages, row = seq.k_start + (n_first + it) * BC;
      sm90::mbar_wait(smem_addr(&empty[s]), ((it / kStages) & 1) ^ 1);  // a fresh barrier's phase -1 is done
      const uint32_t fb = smem_addr(&full[s]);
      if (issuer) {
        if constexpr (Elem::kFp8) sm90::mbar_arrive_expect_tx(fb, kTile);  // K alone
        else sm90::mbar_arrive_expect_tx(fb, 2 * kTile);
        for (int pn = 0; pn < kPanels; ++pn) {
          sm90::tma_load_4d(sK(s) + pn * kPanelBytes, &map_k, pn * sm90::kPanelCols, hk, row, seq.map_batch, fb);
          if constexpr (!Elem::kFp8)
            sm90::tma_load_4d(sV(s) + pn * kPanelBytes, &map_v, pn * sm90::kPanelCols, hk, row, seq.map_batch, fb);
        }
      }
      if constexpr (Elem::kFp8) {
        // V's rows of this (batch, kv head) in the maps' row coordinates, heads_kv * D bytes apart.
        const uint8_t* vg = static_cast<const uint8_t*>(p.v) +
                            (static_cast<int64_t>(seq.map_batch) * p.seqlen_k * p.heads_kv + hk) * D;
        store_v_transposed<D, 128>(sV(s), vg, static_cast<int64_t>(p.heads_kv) * D, row, seq.k_start + Sk,
                                   threadIdx.x);
        sm90::fence_proxy_async();  // V^T's generic writes, before the consumers' wgmmas read them
        sm90::mbar_arrive(fb);
      }
    }
    return;
  }

  // ---- consumer w: rows q0 + 64 w ..
  sm90::setmaxnreg_inc<Elem::kFp8 ? Cfg::kFp8ConsumerRegs : Cfg::kConsumerRegs>();
  const int w = wg - 1, tid = threadIdx.x - 128 * wg, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int qw = q0 + w * BM;
  const uint32_t my_turn = Cfg::kPingPongBar + w, their_turn = Cfg::kPingPongBar + 1 - w;
  const bool capped = p.softcap > 0.f;
  // With softcap the capped scores already include the scale (e4m3 has no softcap).
  const float descale = qk_descale_of(p);
  const float s_mul = capped ? kLog2e : p.scale_log2 * descale;
  const float lse_mul = capped ? 1.f : p.scale * descale;

  // Accumulator register j of a 64-column tile holds row 16 warp + g + 8 ((j / 2) % 2), column
  // 8 (j / 4) + 2 t + j % 2.
  float acc_o[kPanels][32];
#pragma unroll
  for (int pn = 0; pn < kPanels; ++pn)
#pragma unroll
    for (int j = 0; j < 32; ++j) acc_o[pn][j] = 0.f;
  float acc_s[32];
  uint32_t pa[BC / Elem::kK][4];              // P of the previous block: the A operand of its PV
  float row_max[2] = {-INFINITY, -INFINITY};  // raw scores, rows g and g + 8 of the warp's 16
  float row_sum[2] = {0.f, 0.f};              // this thread's partial sum of exp
  const int row_base = qw + 16 * warp + g;

  if (n_blocks > 0) {
    if (w == 1) sm90::named_arrive(Cfg::kPingPongBar, 256);  // consumer 0 issues first
    sm90::mbar_wait(smem_addr(&q_full), 0);
  }

  // Iteration it issues QK^T(it) (it < n_blocks) and PV(it - 1) (it > 0) in one turn.
  for (int it = 0; n_blocks > 0 && it <= n_blocks; ++it) {
    const int s = it % kStages, prev = (it + kStages - 1) % kStages;
    const bool has_qk = it < n_blocks, has_pv = it > 0;
    if (has_qk) sm90::mbar_wait(smem_addr(&full[s]), (it / kStages) & 1);

    sm90::named_sync(my_turn, 256);
    if (has_qk) {  // ---- S = Q K^T
#pragma unroll
      for (int j = 0; j < 32; ++j) acc_s[j] = 0.f;
      sm90::fence_operands(acc_s);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / Elem::kK; ++kk) {
        const int off = (kk / kStepsPerPanel) * kPanelBytes + (kk % kStepsPerPanel) * 32;
        sm90::wgmma_ss<T>(acc_s, sm90::panel_desc<T>(sQ(w) + off), sm90::panel_desc<T>(sK(s) + off));
      }
      sm90::wgmma_commit();
    }
    if (has_pv) {  // ---- O += P V of the previous block (p_fragments: step kk's A)
#pragma unroll
      for (int pn = 0; pn < kPanels; ++pn) sm90::fence_operands(acc_o[pn]);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BC / Elem::kK; ++kk)
#pragma unroll
        for (int pn = 0; pn < kPanels; ++pn)
          sm90::wgmma_rs<T>(acc_o[pn], pa[kk],
                            sm90::panel_desc<T>(sV(prev) + pn * kPanelBytes + kk * Elem::kVStepBytes));
      sm90::wgmma_commit();
    }
    // Consumer 1's last turn hands none on: consumer 0 has no turn left to take.
    if (w == 0 || has_qk) sm90::named_arrive(their_turn, 256);

    float corr[2] = {1.f, 1.f};
    if (has_qk) {
      if (has_pv) sm90::wgmma_wait<1>();  // QK^T(it) done, PV(it - 1) may still run
      else sm90::wgmma_wait<0>();
      sm90::fence_operands(acc_s);
      // ---- softcap (before masking: a masked score must stay -inf)
      if (capped) {
#pragma unroll
        for (int j = 0; j < 32; ++j) acc_s[j] = p.softcap * tanhf(acc_s[j] * p.cap_in);
      }
      // ---- mask: keys past Sk, and the band's edge (causal diagonal, window)
      const int k0 = (n_first + it) * BC;
      const bool tail = k0 + BC > Sk;
      const bool edge = seq.masked && (k0 + BC - 1 - qw > seq.band_hi || k0 - (qw + BM - 1) < seq.band_lo);
      if (tail || edge) {
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          const int row = row_base + 8 * ((j / 2) % 2), col = k0 + 8 * (j / 4) + 2 * t + j % 2;
          const int rel = col - row;
          if (col >= Sk || rel < seq.band_lo || rel > seq.band_hi) acc_s[j] = -INFINITY;
        }
      }
      // ---- online softmax (log2 domain, scale folded into the exponent)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = row_max[r];
#pragma unroll
        for (int j = 0; j < 32; ++j)
          if ((j / 2) % 2 == r) mx = fmaxf(mx, acc_s[j]);
        mx = quad_max(mx);
        // A row with no visible key so far keeps max -inf: exponents use 0 instead (p = 0).
        const float base = mx == -INFINITY ? 0.f : mx * s_mul;
        corr[r] = fast_exp2(row_max[r] * s_mul - base);
        row_max[r] = mx;
        row_sum[r] *= corr[r];
#pragma unroll
        for (int j = 0; j < 32; ++j)
          if ((j / 2) % 2 == r) {
            acc_s[j] = fast_exp2(acc_s[j] * s_mul - base);
            row_sum[r] += acc_s[j];
          }
      }
    }
    if (has_pv) {
      sm90::wgmma_wait<0>();
#pragma unroll
      for (int pn = 0; pn < kPanels; ++pn) sm90::fence_operands(acc_o[pn]);
      // The wgmmas that read stage prev retired: hand it back to the producer.
      if (tid == 0) sm90::mbar_arrive(smem_addr(&empty[prev]));
    }
    if (has_qk) {
#pragma unroll
      for (int pn = 0; pn < kPanels; ++pn)
#pragma unroll
        for (int j = 0; j < 32; ++j) acc_o[pn][j] *= corr[(j / 2) % 2];
      p_fragments<T>(acc_s, pa);
    }
  }

  // ---- epilogue: the wgmmas that read Q retired, so its tile takes O
  // A box past the sequence's end would overwrite the next one (varlen); dense maps end at Sq.
  const bool clip_rows = VARLEN && qw + BM > Sq;
  const bool row_stores = Elem::kFp8 || clip_rows;  // FP8: o (bf16) does not fit the Q tile
  using TO = typename Elem::Out;
  TO* og = static_cast<TO*>(p.o) +
           ((static_cast<int64_t>(seq.map_batch) * p.seqlen_q + seq.q_start) * p.heads_q + h) * D;
  const float o_mul = v_descale_of(p);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_base + 8 * r, tile_row = 16 * warp + g + 8 * r;
    const float l = quad_sum(row_sum[r]);
    // l == 0 with visible keys: every score overflowed to -inf: NaN, as IEEE softmax.
    const bool sees_keys =
        max(0LL, static_cast<long long>(row) + seq.band_lo) <
        min(static_cast<long long>(Sk), static_cast<long long>(row) + seq.band_hi + 1);
    const float inv = l != 0.f ? o_mul / l : (sees_keys ? NAN : 0.f);
#pragma unroll
    for (int pn = 0; pn < kPanels; ++pn)
#pragma unroll
      for (int j = 0; j < 32; ++j)
        if ((j / 2) % 2 == r && j % 2 == 0) {
          const uint32_t pair = HalfOps<TO>::pack(acc_o[pn][j] * inv, acc_o[pn][j + 1] * inv);
          if (row_stores) {
            if (row < Sq)
              *reinterpret_cast<uint32_t*>(og + static_cast<int64_t>(row) * p.heads_q * D + pn * sm90::kPanelCols +
                                           8 * (j / 4) + 2 * t) = pair;
            continue;
          }
          const uint32_t at = sQ(w) + pn * kPanelBytes + tile_row * 128 + (((j / 4) ^ (tile_row % 8)) << 4) + 4 * t;
          asm volatile("st.shared.b32 [%0], %1;" ::"r"(at), "r"(pair) : "memory");
        }
    if (t == 0 && row < Sq) seq.lse[row] = l != 0.f ? row_max[r] * lse_mul + logf(l) : (sees_keys ? NAN : -INFINITY);
  }
  if (row_stores) return;
  sm90::fence_proxy_async();  // the tile's generic writes, before the TMA store reads them
  sm90::named_sync(Cfg::kEpilogueBar + w, 128);
  if (tid == 0) {
    for (int pn = 0; pn < kPanels; ++pn)
      sm90::tma_store_4d(&map_o, pn * sm90::kPanelCols, h, seq.q_start + qw, seq.map_batch, sQ(w) + pn * kPanelBytes);
    sm90::bulk_commit();
    sm90::bulk_wait_read();  // shared memory must outlive the store's reads
  }
}

}  // namespace
}  // namespace cuda
}  // namespace flashgen
