// Hopper (sm_90a) dense backward: the main kernel of the backward on wgmma tensor cores;
// bwd.cuh's preprocess (Dsum = rowsum(dO * O)) and convert (f32 -> output type) kernels run
// around it unchanged, and dQ (and dK / dV under GQA) go through the same f32 accumulators.
//
// One CTA = 64 keys of one (batch, q head), and with head dims above 128 one of 2 column halves
// of dK / dV / dQ (S and dP are recomputed on the full head dim by both halves: dK + dV of 64
// keys x 256 columns would not fit in registers); 256 threads:
//   warpgroup 0 (producer) loads Q and dO of the query blocks that can see the keys into a
//     2-stage shared-memory ring, each stage guarded by a `full` mbarrier (128 producer
//     arrivals after their stores and fence.proxy.async) and an `empty` one (one consumer
//     arrival once the wgmmas that read the stage retired);
//   warpgroup 1 (consumer) loads K, V and K^T once; each of its warps keeps its own copy of
//     the block's lse and Dsum (256 bytes each, fetched during the previous block's dQ GEMM,
//     ordered by __syncwarp alone: only wgmma reads what another warp wrote, as the race
//     detector of this emulator orders generic accesses by neither mbarriers nor named barriers
//     of 128 threads); then per query block of 64:
//   S^T  = K Q^T, dP^T = V dO^T       (wgmma, both operands from shared memory, 1 group)
//   P^T  = exp2(S^T * scale * log2e - lse * log2e), masked on tail / band-edge blocks
//          [softcap c: u = tanh(S^T * scale / c), P^T = exp2(c u log2e - lse log2e)]
//   dS^T = P^T (dP^T - Dsum)              [softcap: * (1 - u^2)]
//   dV  += P^T dO, dK += dS^T Q       (wgmma, P^T / dS^T from registers as the A operand)
//   dQ  += scale * dS K               (dS stored transposed to shared memory as the K-major A
//                                      operand, K^T as the K-major B; f32 atomicAdd of pairs)
// Every tile is 128B-swizzled (sm90.cuh); loads are plain 16-byte ld.global / st.shared (no TMA:
// main has no tensor-map helper yet), so the overlap of the next block's loads with this
// block's math is the ring alone. Query blocks outside the band (causal, window) are never visited.
// Deterministic (DET, the call's `deterministic`): the f32 additions happen in a fixed order, with
// the sm80 family's turn counters and helpers (bwd.cuh, kBwdDeterministic): the CTA takes its work
// item from the ticket counter, so it only ever waits on CTAs that already run; it adds its dQ
// share of a query block after the key blocks before it that see the block (bwd_dq_turn: with a
// band the order runs over exactly the key blocks that visit the block, so none waits on a
// turn that is never passed), and under GQA its dK / dV after the group's q heads before it.
// A wait is one consumer thread's spin, then the consumer warpgroup's named barrier; the producer
// waits on no other CTA.
// Varlen (packed sequences, blockIdx.z = sequence, clamped cu_seqlens as the sm80 kernel clamps
// them): the CTA offsets its rows by the sequence's start and clips every load, dQ addition and
// dK / dV store to the sequence's own lengths (the loads are plain, so no tile runs into the next
// sequence); key blocks past the sequence exit at once, and the handler zeroes dK / dV first (no
// CTA writes the rows no sequence covers).
#pragma once

#include "flashgen/call.h"
#include "flashgen/cuda/bwd.cuh"
#include "flashgen/cuda/hopper/fwd.cuh"
#include "flashgen/cuda/hopper/sm90.cuh"

namespace flashgen {
namespace cuda {
namespace {

// Compiled for the forward's element types and head dims (the same swizzled panels); at run
// time every dense or varlen call without extras (any band, softcap or not): bwd_run sends the
// others and head_dim_v != head_dim to the sm80 family's kernels.
template <class T, int D>
constexpr bool kHopperBwdCompiles = kHopperFwdCompiles<T, D>;

// x: the call's extras (null: none).
inline bool hopper_bwd_supports(const ScoreExtras* x) { return x == nullptr || !x->any(); }

struct HopperBwdConfig {
  static constexpr int BC = 64;  // keys per CTA (one warpgroup's wgmma M)
  static constexpr int BR = 64;  // queries per block
  static constexpr int kStages = 2;
  static constexpr int kThreads = 256;  // producer warpgroup + consumer warpgroup
  // Column halves of dK / dV / dQ (separate CTAs) above head dim 128.
  __host__ __device__ static constexpr int nsplit(int head_dim) { return head_dim > 128 ? 2 : 1; }
  __host__ __device__ static constexpr int tile_bytes(int head_dim) { return 64 * head_dim * 2; }
  // K, V, per stage Q and dO (64 x D each), K^T (this CTA's columns x 64 keys), dS (64 x 64);
  // +1024 to align the base to the swizzle atom.
  __host__ __device__ static constexpr size_t smem_bytes(int head_dim) {
    return (2 + 2 * kStages) * tile_bytes(head_dim) + tile_bytes(head_dim / nsplit(head_dim)) + BR * BC * 2 +
           sm90::kSwizzleAtom;
  }
};

// Rows `col0 + [0, COLS)` of K^T (COLS columns of keys k0 .. k0 + 63 of K, transposed) into the
// swizzled K-major layout at `tile`: K^T row c is 64 keys = one 128-byte swizzle row; keys at
// or past Sk read 0.
template <class T, int COLS, int NT>
FG_DEV void load_kt_sw128(uint8_t* tile, const T* kg, int64_t stride, int k0, int Sk, int col0, int tid) {
  constexpr int kChunks = COLS / 8;  // 16-byte chunks per key row
  for (int i = tid; i < 64 * kChunks; i += NT) {
    const int r = i / kChunks, c = i % kChunks;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (k0 + r < Sk) v = *reinterpret_cast<const uint4*>(kg + static_cast<int64_t>(k0 + r) * stride + col0 + c * 8);
    const uint16_t* e = reinterpret_cast<const uint16_t*>(&v);
#pragma unroll
    for (int x = 0; x < 8; ++x) {
      const int col = c * 8 + x;
      *reinterpret_cast<uint16_t*>(tile + col * 128 + (((r / 8) ^ (col % 8)) << 4) + (r % 8) * 2) = e[x];
    }
  }
}

// Issues d (64 x 64, f32) += A B^T over K = KDIM: A and B are 64-row K-major swizzled tiles at
// shared addresses a and b (KDIM / 64 panels each; sm90.cuh).
template <class T, int KDIM>
FG_DEV void issue_abt(float (&d)[32], uint32_t a, uint32_t b) {
#pragma unroll
  for (int kk = 0; kk < KDIM / 16; ++kk) {
    const int off = (kk / 4) * 64 * 128 + (kk % 4) * 32;
    sm90::wgmma_ss<T>(d, sm90::sw128_desc(a + off), sm90::sw128_desc(b + off));
  }
}

// The rows one CTA works on: its sequence's lengths and band, its first q / k row in the
// tensors (counted in rows of all heads' columns), and its lse / Dsum rows.
struct HopperBwdSeq {
  int Sq, Sk, band_lo, band_hi, masked;
  int64_t q_start, k_start;
  const float *lse, *dsum;
};
// VARLEN: sequence b of a packed batch (lse / Dsum [Hq, Tq]), else batch b.
template <bool VARLEN, class Params>
inline __device__ HopperBwdSeq hopper_bwd_seq(const Params& p, int b, int h) {
  if constexpr (VARLEN) {
    const SeqRange rq = seq_range(p.cu_q[b], p.cu_q[b + 1], p.seqlen_q, p.max_seqlen_q);
    const SeqRange rk = seq_range(p.cu_k[b], p.cu_k[b + 1], p.seqlen_k, p.max_seqlen_k);
    const IntBand bd = int_band(rq.len, rk.len, p.causal, p.bottom_right, p.window_left, p.window_right);
    const int64_t stats = static_cast<int64_t>(h) * p.seqlen_q + rq.start;
    return {rq.len, rk.len, bd.lo, bd.hi, bd.masked, rq.start, rk.start, p.lse + stats, p.dsum + stats};
  } else {
    const int64_t stats = (static_cast<int64_t>(b) * p.heads_q + h) * p.seqlen_q;
    return {p.seqlen_q, p.seqlen_k, p.band_lo, p.band_hi, p.masked, static_cast<int64_t>(b) * p.seqlen_q,
            static_cast<int64_t>(b) * p.seqlen_k, p.lse + stats, p.dsum + stats};
  }
}

// CAPPED: softcap > 0 (a run-time branch instead spills at d128 / d256). VARLEN: a packed batch.
// DET: deterministic (see above).
template <class T, int D, bool CAPPED, bool VARLEN = false, bool DET = false>
__global__ void __launch_bounds__(HopperBwdConfig::kThreads, 1)
    hopper_bwd_kernel(const typename std::conditional<VARLEN || DET, BwdVarParams, BwdParams>::type p) {
  using Cfg = HopperBwdConfig;
  constexpr int BR = Cfg::BR, BC = Cfg::BC, kStages = Cfg::kStages, NT = 128;  // threads per role
  constexpr int kTile = Cfg::tile_bytes(D);
  constexpr int kSplit = Cfg::nsplit(D);
  constexpr int kOwn = D / sm90::kPanelCols / kSplit;  // 64-column panels of dK / dV / dQ per CTA
  constexpr int kPanelBytes = 64 * 128;
  static_assert(BR == 64 && BC == 64, "one swizzle panel of keys / queries per k-extent");

  extern __shared__ uint8_t smem_raw[];
  // Per consumer warp: lse * log2(e) (+inf: no probability), Dsum.
  __shared__ float sLse[NT / 32][BR], sDsum[NT / 32][BR];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  const uint32_t raw = smem_addr(smem_raw);
  uint8_t* smem = smem_raw + ((raw + sm90::kSwizzleAtom - 1) / sm90::kSwizzleAtom * sm90::kSwizzleAtom - raw);
  uint8_t* sK = smem;
  uint8_t* sV = sK + kTile;
  auto sQ = [&](int s) { return sV + (1 + 2 * s) * kTile; };
  auto sdO = [&](int s) { return sV + (2 + 2 * s) * kTile; };
  uint8_t* sKt = sV + (1 + 2 * kStages) * kTile;
  uint8_t* sdS = sKt + kOwn * kPanelBytes;

  // DET: the work item in ticket order, so that a CTA only waits on CTAs that already run.
  unsigned item_x = blockIdx.x, item_y = blockIdx.y, item_z = blockIdx.z;
  if constexpr (DET) {
    __shared__ unsigned ticket;
    if (threadIdx.x == 0) ticket = atomicAdd(p.ticket, 1u);
    __syncthreads();
    item_x = ticket % gridDim.x;
    item_y = ticket / gridDim.x % gridDim.y;
    item_z = ticket / gridDim.x / gridDim.y;
  }
  const int nblk = item_x / kSplit, split = item_x % kSplit;
  const int h = item_y, b = item_z, hk = h / p.group;
  const HopperBwdSeq seq = hopper_bwd_seq<VARLEN>(p, b, h);
  const int Sq = seq.Sq, Sk = seq.Sk;
  const int k0 = nblk * BC;
  if (VARLEN && k0 >= Sk) return;  // the whole CTA: past its sequence's keys
  const int pn0 = split * kOwn;  // first own panel
  const int64_t q_stride = static_cast<int64_t>(p.heads_q) * D;
  const int64_t kv_stride = static_cast<int64_t>(p.heads_kv) * D;
  const int64_t q_off = (seq.q_start * p.heads_q + h) * D;
  const int64_t kv_off = (seq.k_start * p.heads_kv + hk) * D;
  const T* qg = static_cast<const T*>(p.q) + q_off;
  const T* dog = static_cast<const T*>(p.dout) + q_off;
  const T* kg = static_cast<const T*>(p.k) + kv_off;
  const T* vg = static_cast<const T*>(p.v) + kv_off;
  const float* lseg = seq.lse;
  const float* dsumg = seq.dsum;
  float* dqg = p.dq_acc + q_off;

  // Query blocks that can see a key of this block: rows k0 - hi <= i <= k0 + BC - 1 - lo.
  const long long first_q = max(0LL, static_cast<long long>(k0) - seq.band_hi);
  const long long last_q = min(static_cast<long long>(Sq) - 1, static_cast<long long>(k0) + BC - 1 - seq.band_lo);
  const int m_begin = static_cast<int>(min(first_q, static_cast<long long>(Sq)) / BR);
  const int m_end = last_q >= first_q ? static_cast<int>(last_q / BR) + 1 : m_begin;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::mbar_init(smem_addr(&full[s]), NT);
      sm90::mbar_init(smem_addr(&empty[s]), 1);
    }
    sm90::fence_mbarrier_init();
  }
  __syncthreads();

  if (threadIdx.x < NT) {  // ---- producer warpgroup
    const int tid = threadIdx.x;
    for (int m = m_begin; m < m_end; ++m) {
      const int it = m - m_begin, s = it % kStages, q0 = m * BR;
      sm90::mbar_wait(smem_addr(&empty[s]), ((it / kStages) & 1) ^ 1);  // a fresh barrier's phase -1 is done
      sm90::load_tile_sw128<T, BR, D, NT>(sQ(s), qg, q_stride, q0, Sq, tid);
      sm90::load_tile_sw128<T, BR, D, NT>(sdO(s), dog, q_stride, q0, Sq, tid);
      sm90::fence_proxy_async();
      sm90::mbar_arrive(smem_addr(&full[s]));
    }
    return;
  }

  // ---- consumer warpgroup
  const int tid = threadIdx.x - NT, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;

  // Accumulator register j of a 64-column tile holds row (key) 16 warp + g + 8 ((j / 2) % 2),
  // column 8 (j / 4) + 2 t + j % 2 (PTX ISA "wgmma .m64nNk16 accumulator D").
  float acc_dk[kOwn][32], acc_dv[kOwn][32];
#pragma unroll
  for (int pn = 0; pn < kOwn; ++pn)
#pragma unroll
    for (int j = 0; j < 32; ++j) acc_dk[pn][j] = acc_dv[pn][j] = 0.f;

  // lse (log2 units) and Dsum of query rows q0 + lane + 32 i, i = 0, 1.
  float* wLse = sLse[warp];
  float* wDsum = sDsum[warp];
  auto fetch_row_stats = [&](int q0, float (&l2)[2], float (&dsum)[2]) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = q0 + lane + 32 * i;
      const float l = row < Sq ? lseg[row] : -INFINITY;
      l2[i] = l == -INFINITY ? INFINITY : l * kLog2e;  // lse = -inf: the row sees no key
      dsum[i] = row < Sq ? dsumg[row] : 0.f;
    }
  };
  auto store_row_stats = [&](const float (&l2)[2], const float (&dsum)[2]) {
    __syncwarp();  // the warp's lanes are done reading the previous block's
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      wLse[lane + 32 * i] = l2[i];
      wDsum[lane + 32 * i] = dsum[i];
    }
    __syncwarp();
  };

  if (m_begin < m_end) {
    float l2[2], dsum[2];
    fetch_row_stats(m_begin * BR, l2, dsum);
    store_row_stats(l2, dsum);
    sm90::load_tile_sw128<T, BC, D, NT>(sK, kg, kv_stride, k0, Sk, tid);
    sm90::load_tile_sw128<T, BC, D, NT>(sV, vg, kv_stride, k0, Sk, tid);
    load_kt_sw128<T, kOwn * sm90::kPanelCols, NT>(sKt, kg, kv_stride, k0, Sk, pn0 * sm90::kPanelCols, tid);
    sm90::fence_proxy_async();
    sm90::named_sync(1, NT);
  }

  // dQ[q0 .., own columns] += scale * dS K (dS of the block in shared memory), one 64-column panel
  // at a time.
  auto add_dq = [&](int q0) {
#pragma unroll 1
    for (int pn = 0; pn < kOwn; ++pn) {
      float acc_dq[32];
#pragma unroll
      for (int j = 0; j < 32; ++j) acc_dq[j] = 0.f;
      sm90::fence_operands(acc_dq);
      sm90::wgmma_fence();
      issue_abt<T, BC>(acc_dq, smem_addr(sdS), smem_addr(sKt) + pn * kPanelBytes);
      sm90::wgmma_commit();
      sm90::wgmma_wait_all();
      sm90::fence_operands(acc_dq);
#pragma unroll
      for (int j = 0; j < 32; j += 2) {
        const int row = q0 + 16 * warp + g + 8 * ((j / 2) % 2);
        const int col = (pn0 + pn) * sm90::kPanelCols + 8 * (j / 4) + 2 * t;
        if (row < Sq)
          atomicAdd(reinterpret_cast<float2*>(dqg + row * q_stride + col),
                    make_float2(acc_dq[j] * p.scale, acc_dq[j + 1] * p.scale));
      }
    }
  };

  // DET: query block m's dQ share is added once its turn came (waited for at the end of its
  // iteration; added at the top of the next one, so that in code order the wait follows the
  // additions other CTAs make meanwhile: the emulator runs the warps at the lowest pc first).
  unsigned* dq_turn = nullptr;
  for (int m = m_begin; m < m_end + (DET ? 1 : 0); ++m) {
    if constexpr (DET) {
      if (m > m_begin) {
        add_dq((m - 1) * BR);
        sm90::named_sync(1, NT);  // every consumer's additions are in; dS is free
        if (tid == 0) bwd_pass_turn(dq_turn);
      }
      if (m == m_end) break;
    }
    const int it = m - m_begin, s = it % kStages, q0 = m * BR;
    sm90::mbar_wait(smem_addr(&full[s]), (it / kStages) & 1);

    // ---- S^T = K Q^T and dP^T = V dO^T
    float acc_s[32], acc_dp[32];
#pragma unroll
    for (int j = 0; j < 32; ++j) acc_s[j] = acc_dp[j] = 0.f;
    sm90::fence_operands(acc_s);
    sm90::fence_operands(acc_dp);
    sm90::wgmma_fence();
    issue_abt<T, D>(acc_s, smem_addr(sK), smem_addr(sQ(s)));
    issue_abt<T, D>(acc_dp, smem_addr(sV), smem_addr(sdO(s)));
    sm90::wgmma_commit();
    sm90::wgmma_wait_all();
    sm90::fence_operands(acc_s);
    sm90::fence_operands(acc_dp);

    // ---- P^T and dS^T (in place of S^T and dP^T); masked pairs get P = dS = 0 even where dP
    // is NaN (a NaN V or dO must not reach pairs the row does not see).
    const bool need_mask =
        k0 + BC > Sk || (seq.masked && (k0 - (q0 + BR - 1) < seq.band_lo || k0 + BC - 1 - q0 > seq.band_hi));
    // Softcap c: the score is c u with u = tanh(scale s / c) (S^T becomes u in place), and dS
    // gains the factor 1 - u^2. A score of +-inf gives u = +-1, factor 0: dS 0 unless dP is NaN,
    // as float64 has it.
    if constexpr (CAPPED) {
#pragma unroll
      for (int j = 0; j < 32; ++j) acc_s[j] = tanhf(acc_s[j] * p.cap_in);
    }
    const float score_log2 = CAPPED ? p.softcap * kLog2e : p.scale_log2;  // per unit of S^T
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int key = k0 + 16 * warp + g + 8 * ((j / 2) % 2), qi = 8 * (j / 4) + 2 * t + j % 2;
      const float pv = fast_exp2(fmaf(acc_s[j], score_log2, -wLse[qi]));
      const float cap_grad = CAPPED ? 1.f - acc_s[j] * acc_s[j] : 1.f;
      const int rel = key - (q0 + qi);
      const bool masked = need_mask && (key >= Sk || rel < seq.band_lo || rel > seq.band_hi);
      acc_s[j] = masked ? 0.f : pv;
      acc_dp[j] = masked ? 0.f : pv * (acc_dp[j] - wDsum[qi]) * cap_grad;
    }
    // k16 step kk's A fragment (rows = keys, k = queries 16 kk ..) is accumulator tiles 2 kk and
    // 2 kk + 1, rounded to T.
    uint32_t a_p[4][4], a_ds[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a_p[kk][i] = HalfOps<T>::pack(acc_s[8 * kk + 2 * i], acc_s[8 * kk + 2 * i + 1]);
        a_ds[kk][i] = HalfOps<T>::pack(acc_dp[8 * kk + 2 * i], acc_dp[8 * kk + 2 * i + 1]);
      }
    // dS (rows = queries, k = keys: K-major) for dQ: element (key r, query c) at row c, column r.
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int r = 16 * warp + g + 8 * ((j / 2) % 2), c = 8 * (j / 4) + 2 * t + j % 2;
      const uint32_t pair = a_ds[j / 8][(j % 8) / 2];
      *reinterpret_cast<uint16_t*>(sdS + c * 128 + (((r / 8) ^ (c % 8)) << 4) + (r % 8) * 2) =
          static_cast<uint16_t>(j % 2 ? pair >> 16 : pair & 0xFFFF);
    }
    sm90::fence_proxy_async();

    // ---- dV += P^T dO, dK += dS^T Q (this CTA's panels; dO and Q MN-major: 16 queries per
    // k16 step = 2048 bytes)
#pragma unroll
    for (int pn = 0; pn < kOwn; ++pn) {
      sm90::fence_operands(acc_dv[pn]);
      sm90::fence_operands(acc_dk[pn]);
    }
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int pn = 0; pn < kOwn; ++pn) {
        const int off = (pn0 + pn) * kPanelBytes + kk * 2048;
        sm90::wgmma_rs<T>(acc_dv[pn], a_p[kk], sm90::sw128_desc(smem_addr(sdO(s)) + off));
        sm90::wgmma_rs<T>(acc_dk[pn], a_ds[kk], sm90::sw128_desc(smem_addr(sQ(s)) + off));
      }
    sm90::wgmma_commit();
    sm90::wgmma_wait_all();
#pragma unroll
    for (int pn = 0; pn < kOwn; ++pn) {
      sm90::fence_operands(acc_dv[pn]);
      sm90::fence_operands(acc_dk[pn]);
    }
    // Every warp's dS rows are in shared memory, every warp's wgmmas that read stage s retired
    // (hand it back to the producer).
    sm90::named_sync(1, NT);
    if (tid == 0) sm90::mbar_arrive(smem_addr(&empty[s]));
    float next_l2[2], next_dsum[2];
    if (m + 1 < m_end) fetch_row_stats(q0 + BR, next_l2, next_dsum);
    if constexpr (DET) {
      if (m + 1 < m_end) store_row_stats(next_l2, next_dsum);
      dq_turn = p.dq_turn + ((static_cast<int64_t>(b) * p.heads_q + h) * p.q_blocks + m) * kSplit + split;
      if (tid == 0) bwd_wait_turn(dq_turn, bwd_dq_turn(nblk, m, BR, BC, seq.band_lo));
      sm90::named_sync(1, NT);
    } else {
      add_dq(q0);
      if (m + 1 < m_end) store_row_stats(next_l2, next_dsum);
      sm90::named_sync(1, NT);  // dS is free for the next block
    }
  }

  // ---- epilogue: dK = scale * acc_dk, dV = acc_dv for keys k0 + 16 warp + g (+ 8); DET with GQA:
  // the q heads of a group add in head order.
  unsigned* kv_turn = nullptr;
  if constexpr (DET) {
    if (p.atomic_kv) {
      kv_turn = p.kv_turn + (static_cast<int64_t>(b) * p.heads_kv + hk) * gridDim.x + item_x;
      if (tid == 0) bwd_wait_turn(kv_turn, static_cast<unsigned>(h % p.group));
      sm90::named_sync(1, NT);
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = k0 + 16 * warp + g + 8 * r;
    if (key >= Sk) continue;
#pragma unroll
    for (int pn = 0; pn < kOwn; ++pn)
#pragma unroll
      for (int j = 2 * r; j < 32; j += 4) {
        const int64_t off = kv_off + key * kv_stride + (pn0 + pn) * sm90::kPanelCols + 8 * (j / 4) + 2 * t;
        const float2 dk = make_float2(acc_dk[pn][j] * p.scale, acc_dk[pn][j + 1] * p.scale);
        const float2 dv = make_float2(acc_dv[pn][j], acc_dv[pn][j + 1]);
        if (p.atomic_kv) {  // GQA: the group's q heads add into the f32 accumulators
          atomicAdd(reinterpret_cast<float2*>(p.dk_acc + off), dk);
          atomicAdd(reinterpret_cast<float2*>(p.dv_acc + off), dv);
        } else {
          *reinterpret_cast<uint32_t*>(static_cast<T*>(p.dk) + off) = HalfOps<T>::pack(dk.x, dk.y);
          *reinterpret_cast<uint32_t*>(static_cast<T*>(p.dv) + off) = HalfOps<T>::pack(dv.x, dv.y);
        }
      }
  }
  if constexpr (DET) {
    if (p.atomic_kv) {
      sm90::named_sync(1, NT);
      if (tid == 0) bwd_pass_turn(kv_turn);
    }
  }
}

}  // namespace
}  // namespace cuda
}  // namespace flashgen
