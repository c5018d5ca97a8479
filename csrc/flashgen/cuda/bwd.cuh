// FlashAttention-2 style backward (mma.sync tensor cores, sm_80+), 3 kernels:
//
//  1. flash_bwd_pre_kernel:  Dsum[b,h,i] = sum_d dO[b,i,h,d] * O[b,i,h,d]   (f32)
//  2. flash_bwd_kernel:      one CTA per (key block of BC rows, head-dim slice,
//     q head, batch). Each warp owns 16 key rows; dK and dV for those rows
//     (and the CTA's head-dim slice) stay in f32 registers while the CTA walks
//     all query blocks that can see the key block. Per query block, in chunks
//     of QC query columns:
//        S^T = K Q^T, P^T = exp2(S^T*scale*log2e - lse*log2e)
//          [softcap c: u = tanh(S^T*scale/c), P^T = exp2(c*u*log2e - lse*log2e)]
//        dV += P^T dO             (P^T from registers)
//        dP^T = V dO^T
//        dS^T = P^T * (dP^T - Dsum)   [softcap: * (1 - u^2)]
//        dK += dS^T Q             (dS^T from registers)
//        dS^T -> shared memory
//     then dQ[q block, slice] += scale * dS K, accumulated with f32 atomicAdd
//     into a workspace (or straight into dq when the dtype is f32).
//     Head dims > 128 are split into 2 slices of the dK/dV/dQ columns
//     (NSPLIT = 2, separate CTAs): each CTA recomputes S and dP on the full
//     head dim, which keeps dK+dV at <= 128 f32 registers per thread.
//     GQA (group > 1): the CTA handles one q head; dK/dV are atomically added
//     in f32 to per-kv-head workspaces (or to dk/dv directly when f32).
//     Without GQA dK/dV are written directly in the output dtype.
//  3. flash_bwd_convert_kernel: f32 workspace -> output dtype (dQ, and dK/dV
//     under GQA, dbias); not needed for f32.
//
// Variants of the main kernel (template parameter MODE, see BwdMode):
//   kBwdDense   the fast path above, unchanged.
//   kBwdExtras  dense + ALiBi / bias / mask / segment ids (extras.cuh), per
//               element on every visited block: P^T = exp2((x + add) * log2e
//               - lse * log2e), x = scale*s or softcap(scale*s). dS' = P^T *
//               (dP^T - Dsum) is the gradient of the biased score: with a
//               bias it is atomically added (f32) into the dbias accumulator
//               (summing the broadcast dims). Softcap: 1 - u^2 with u
//               recovered from P after subtracting the (recomputed) add term.
//   kBwdVarlen  packed variable-length batch (blockIdx.z = sequence; clamped
//               cu_seqlens; key blocks past the sequence exit at once; the
//               handler zeroes dK/dV first, so uncovered rows read 0).
//   kBwdVarlenAlibi  kBwdVarlen + ALiBi: the recomputed P^T gets the constant
//               term -slope(b,h) * |i + off_b - j| (off_b from the sequence's
//               own lengths; no slope gradient); softcap's u is recovered
//               after subtracting it. Without ALiBi kBwdVarlen is unchanged.
//   | kBwdDeterministic  (any of the above) the f32 accumulations happen in a fixed order, so
//               every run gives the same bits: a CTA takes its work item from a ticket counter
//               (launch order, whatever order the hardware dispatches blocks in), and waits on
//               a counter in global memory before it adds its share: dQ of a query block after
//               the key blocks before it (bwd_wait_turn), GQA dK/dV of a key block after the q heads
//               before it in the group, a broadcast dbias slab after the (batch, head) before
//               it. A CTA only ever waits on a lower ticket, i.e. a CTA that already runs, so
//               the waits cannot deadlock. Its barriers are barrier 1 over all threads (the
//               same as __syncthreads; the emulator releases it when the CTA's warps arrive,
//               while other CTAs spin).
#pragma once

#include "flashgen/cuda/common.cuh"
#include "flashgen/cuda/extras.cuh"

#ifndef FLASHGEN_BWD_EXTRAS_QC16_MIN_D
#define FLASHGEN_BWD_EXTRAS_QC16_MIN_D 224
#endif

namespace flashgen {
namespace cuda {
namespace {

struct BwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* dout;
  const float* lse;   // [B, Hq, Sq]
  const float* dsum;  // [B, Hq, Sq]
  float* dq_acc;      // [B, Sq, Hq, D] f32, zeroed; receives scale * dS K
  float* dk_acc;      // [B, Sk, Hkv, D] f32, zeroed (only when atomic_kv)
  float* dv_acc;      // [B, Sk, Hkv, D] f32, zeroed (only when atomic_kv)
  void* dk;           // [B, Sk, Hkv, D] output dtype (only when !atomic_kv)
  void* dv;
  int batch, seqlen_q, seqlen_k, heads_q, heads_kv, group;
  int band_lo, band_hi;  // key j visible to query i iff band_lo <= j - i <= band_hi (clamped)
  int masked;            // 1 if the band excludes any (i, j) pair (causal or window)
  float scale;
  float scale_log2;
  float softcap;  // 0: off
  float cap_in;   // scale / softcap (when softcap > 0)
  float cap_out;  // 1 / (softcap * log2(e)) (when softcap > 0)
  int atomic_kv;  // 1: accumulate dK/dV into dk_acc/dv_acc with atomics (GQA)
};

// Parameters of the variants (the dense fast path keeps BwdParams, unchanged).
struct BwdVarParams : BwdParams {
  // Raw attributes: varlen computes the band per sequence on the device.
  int causal, bottom_right, window_left, window_right;
  ExtrasParams x;  // kBwdExtras; kBwdVarlenAlibi: alibi / alibi_stride_b only
  // kBwdVarlen: seqlen_q / seqlen_k are the totals Tq / Tk, batch the number of sequences;
  // lse / dsum are [Hq, Tq].
  const int* cu_q;
  const int* cu_k;
  int max_seqlen_q, max_seqlen_k;
  // kBwdDeterministic: zeroed counters (scratch) that order the accumulations.
  unsigned* ticket;        // the next work item (one counter)
  unsigned* dq_turn;       // [B, Hq, q_blocks, NSPLIT]: key blocks that added their dQ share
  unsigned* kv_turn;       // [B, Hkv, gridDim.x]: q heads that added their dK/dV share (atomic_kv)
  unsigned* dbias_turn;    // [B, Hq, key blocks]: (batch, head)s that added to a broadcast dbias slab
  int q_blocks;            // query blocks of the longest sequence
};

// The CTA barrier; deterministic kernels use barrier 1 over all threads (see above).
template <bool DET, int NT>
FG_DEV void cta_sync() {
  if constexpr (DET)
    asm volatile("bar.sync 1, %0;" ::"n"(NT) : "memory");
  else
    __syncthreads();
}

// One thread waits until *turn reaches `mine` (atomic reads: other CTAs update it), or
// publishes its CTA's writes and advances it (after a cta_sync).
FG_DEV void bwd_wait_turn(unsigned* turn, unsigned mine) {
  while (atomicAdd(turn, 0u) < mine) {
  }
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
}
FG_DEV void bwd_pass_turn(unsigned* turn) {
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
  atomicAdd(turn, 1u);
}
// A deterministic dQ share's turn: the key blocks (of bc keys) that see query block m (of br rows)
// are those from the first whose last key row sees the block's first row (band lower edge lo)
// to the last that sees any; key block nblk adds after the ones before it.
FG_DEV unsigned bwd_dq_turn(int nblk, int m, int br, int bc, int lo) {
  const long long first = static_cast<long long>(m) * br + lo - (bc - 1);
  return static_cast<unsigned>(nblk - (first <= 0 ? 0 : static_cast<int>((first + bc - 1) / bc)));
}

enum BwdMode : int { kBwdDense = 0, kBwdExtras = 1, kBwdVarlen = 2, kBwdVarlenAlibi = 3, kBwdDeterministic = 4 };
template <int MODE>
using BwdParamsT = typename std::conditional<MODE == kBwdDense, BwdParams, BwdVarParams>::type;

// D: q/k head dim; DV: v/o head dim (dO and dV have DV columns, dQ and dK D).
template <class T, int D, int DV = D>
struct BwdConfig {
  static constexpr bool kF32 = std::is_same<T, float>::value;
  static constexpr int kDMax = D > DV ? D : DV;
  static constexpr int kWarps = kF32 ? (kDMax <= 192 ? 4 : 2) : 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int BC = kWarps * 16;    // key rows per CTA
  static constexpr int BR = kF32 ? 32 : 64;  // query rows per iteration
  static constexpr int QC = 32;              // query columns per S^T chunk
  static constexpr int NSPLIT = kDMax > 128 ? 2 : 1;
  static constexpr int SK = D / NSPLIT;   // dK/dQ columns handled by one CTA
  static constexpr int SV = DV / NSPLIT;  // dV columns handled by one CTA
  static constexpr int kPad = 16 / static_cast<int>(sizeof(T));
  static constexpr int LD = D + kPad;    // row stride of the K and Q tiles
  static constexpr int LDV = DV + kPad;  // row stride of the V and dO tiles
  static constexpr int LDS = BR + kPad;  // row stride of the dS^T tile [BC][BR]
  // dQ GEMM warp layout: RG row groups of 16 query rows x CG column groups.
  static constexpr int RG = BR / 16;
  static constexpr int CG = kWarps / RG;
  // 16-column dQ tiles accumulated per pass (fewer for large D: register pressure).
  static constexpr int kDqPass = NSPLIT > 1 ? 2 : 4;
  static constexpr size_t kSmem =
      static_cast<size_t>(BC + BR) * (LD + LDV) * sizeof(T) + static_cast<size_t>(BC) * LDS * sizeof(T) +
      2 * BR * sizeof(float);
  static_assert(D % 32 == 0 && D >= 32 && D <= 256, "head dim must be a multiple of 32 in [32, 256]");
  static_assert(DV % 32 == 0 && DV >= 32 && DV <= 256, "value head dim must be a multiple of 32 in [32, 256]");
  static_assert(SK % 16 == 0 && SV % 16 == 0, "head-dim slices must be multiples of 16");
  static_assert(BR % QC == 0 && QC % 16 == 0, "bad query chunk");
  static_assert(kWarps % RG == 0, "warps must cover the dQ rows");
  static_assert(kSmem <= 166912, "exceeds the 163 KiB opt-in shared memory of sm_80");
};

// ---------------------------------------------------------------------------
// 1. Dsum = rowsum(dO * O)
// ---------------------------------------------------------------------------
template <class T, int D>
__global__ void __launch_bounds__(256) flash_bwd_pre_kernel(const T* __restrict__ o, const T* __restrict__ dout,
                                                            float* __restrict__ dsum, int64_t rows, int seqlen_q,
                                                            int heads_q) {
  constexpr int kEpc = 16 / sizeof(T);
  constexpr int kCpr = D / kEpc;  // 16-byte chunks per row
  constexpr int kLanes = kCpr >= 32 ? 32 : (kCpr >= 16 ? 16 : (kCpr >= 8 ? 8 : 4));  // lanes per row
  constexpr int kRowsPerWarp = 32 / kLanes;
  const int lane = threadIdx.x & 31;
  const int64_t warp_global = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps_total = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t base = warp_global * kRowsPerWarp; base < rows; base += warps_total * kRowsPerWarp) {
    const int64_t row = base + lane / kLanes;
    const int sub = lane % kLanes;
    float acc = 0.f;
    if (row < rows) {
      const T* po = o + row * D;
      const T* pd = dout + row * D;
      for (int c = sub; c < kCpr; c += kLanes) {
        uint4 vo = *reinterpret_cast<const uint4*>(po + c * kEpc);
        uint4 vd = *reinterpret_cast<const uint4*>(pd + c * kEpc);
        const T* eo = reinterpret_cast<const T*>(&vo);
        const T* ed = reinterpret_cast<const T*>(&vd);
#pragma unroll
        for (int e = 0; e < kEpc; ++e) acc = fmaf(to_float(eo[e]), to_float(ed[e]), acc);
      }
    }
#pragma unroll
    for (int off = kLanes / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (row < rows && sub == 0) {
      // row = (b * Sq + i) * Hq + h  ->  dsum[(b * Hq + h) * Sq + i]
      const int64_t h = row % heads_q;
      const int64_t bi = row / heads_q;
      const int64_t i = bi % seqlen_q;
      const int64_t b = bi / seqlen_q;
      dsum[(b * heads_q + h) * seqlen_q + i] = acc;
    }
  }
}

// ---------------------------------------------------------------------------
// 3. f32 -> T conversion (src 16-byte aligned; any n)
// ---------------------------------------------------------------------------
template <class T>
__global__ void __launch_bounds__(256) flash_bwd_convert_kernel(const float* __restrict__ src, T* __restrict__ dst,
                                                                int64_t n) {
  const int64_t n4 = n / 4;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 x = reinterpret_cast<const float4*>(src)[i];
    T* d = dst + 4 * i;
    d[0] = from_float<T>(x.x);
    d[1] = from_float<T>(x.y);
    d[2] = from_float<T>(x.z);
    d[3] = from_float<T>(x.w);
  }
  // n % 4 tail (dbias may have any element count)
  if (blockIdx.x == 0 && threadIdx.x < n - 4 * n4) dst[4 * n4 + threadIdx.x] = from_float<T>(src[4 * n4 + threadIdx.x]);
}

// A warp's 16 staged rows of `COLS` elements (shared, stride ld) to global rows row0.. (stride
// gstride) with 16-byte stores; rows >= nrows are skipped.
template <class T, int COLS>
FG_DEV void store_warp_rows(T* g, int64_t gstride, const T* s, int ld, int row0, int nrows, int lane) {
  constexpr int kEpc = 16 / sizeof(T);
  constexpr int kCpr = COLS / kEpc;
#pragma unroll
  for (int idx = lane; idx < 16 * kCpr; idx += 32) {
    const int r = idx / kCpr, c = idx % kCpr;
    if (row0 + r < nrows)
      *reinterpret_cast<uint4*>(g + (row0 + r) * gstride + c * kEpc) =
          *reinterpret_cast<const uint4*>(s + r * ld + c * kEpc);
  }
}

// ---------------------------------------------------------------------------
// 2. main backward kernel
// ---------------------------------------------------------------------------
// DV: the value head dim (v, do and dv's last dim); only the dense and extras modes take DV != D.
template <class T, int D, int DV, bool CAUSAL, int MODE = kBwdDense>
__global__ void __launch_bounds__(BwdConfig<T, D, DV>::kThreads, 1) flash_bwd_kernel(const BwdParamsT<MODE> p) {
  using Cfg = BwdConfig<T, D, DV>;
  using Ops = typename OpsFor<T>::type;
  using FragA = typename Ops::FragA;
  using FragB = typename Ops::FragB;
  constexpr int BR = Cfg::BR, BC = Cfg::BC, LD = Cfg::LD, LDV = Cfg::LDV, LDS = Cfg::LDS;
  // The extras variant keeps more values live per element: narrower S^T chunks
  // for large head dims (fewer accumulators) avoid register spills.
  // (f16/bf16 only: for f32 at those dims it makes the existing spills worse.) So does a value
  // head dim above the query/key one (d64v128 spilled 8 bytes at QC = 32).
  constexpr int kMode = MODE & ~kBwdDeterministic;
  constexpr bool kDet = (MODE & kBwdDeterministic) != 0;
  constexpr int QC =
      (kMode == kBwdExtras && !Cfg::kF32 && (D >= FLASHGEN_BWD_EXTRAS_QC16_MIN_D || DV > D)) ? 16 : Cfg::QC;
  constexpr int SK = Cfg::SK, SV = Cfg::SV, NSPLIT = Cfg::NSPLIT, NT = Cfg::kThreads, KS = Ops::KS;
  constexpr int kQT = QC / 8;  // S^T accumulator tiles per chunk
  constexpr int kKT = SK / 8;  // dK accumulator tiles
  constexpr int kVT = SV / 8;  // dV accumulator tiles
  constexpr bool kExtras = kMode == kBwdExtras;
  static_assert(DV == D || kMode == kBwdDense || kMode == kBwdExtras, "varlen needs DV == D");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + BC * LD;
  T* sQ = sV + BC * LDV;
  T* sdO = sQ + BR * LD;
  T* sdS = sdO + BR * LDV;  // dS^T, [BC][LDS]
  float* sLse = reinterpret_cast<float*>(sdS + BC * LDS);  // lse * log2(e); +inf for "no probability"
  float* sDsum = sLse + BR;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  unsigned item_x = blockIdx.x, item_y = blockIdx.y, item_z = blockIdx.z;
  if constexpr (kDet) {
    __shared__ unsigned item;
    if (tid == 0) item = atomicAdd(p.ticket, 1u);
    cta_sync<kDet, NT>();
    item_x = item % gridDim.x;
    item_y = item / gridDim.x % gridDim.y;
    item_z = item / gridDim.x / gridDim.y;
  }
  const int nblk = item_x / NSPLIT, split = item_x % NSPLIT;
  const int h = item_y, b = item_z, hk = h / p.group;
  constexpr bool kVarlen = kMode == kBwdVarlen || kMode == kBwdVarlenAlibi;
  constexpr bool kAlibi = kMode == kBwdVarlenAlibi;
  // Varlen: sequence b (clamped: cu_seqlens live on the device and are not trusted).
  SeqRange rq{0, 0}, rk{0, 0};
  if constexpr (kVarlen) {
    rq = seq_range(p.cu_q[b], p.cu_q[b + 1], p.seqlen_q, p.max_seqlen_q);
    rk = seq_range(p.cu_k[b], p.cu_k[b + 1], p.seqlen_k, p.max_seqlen_k);
  }
  const int Sq = kVarlen ? rq.len : p.seqlen_q, Sk = kVarlen ? rk.len : p.seqlen_k;
  const int k0 = nblk * BC;
  const int dcol0 = split * SK;   // first dK/dQ column of this CTA
  const int dvcol0 = split * SV;  // first dV column
  const int wrow0 = warp * 16;  // warp's first key row inside the tile
  int band_lo = 0, band_hi = 0, band_masked = 0;
  if constexpr (kVarlen) {
    if (k0 >= Sk) return;  // the whole CTA: past this sequence's keys
    const IntBand bd = int_band(Sq, Sk, p.causal, p.bottom_right, p.window_left, p.window_right);
    band_lo = bd.lo;
    band_hi = bd.hi;
    band_masked = bd.masked;
  }

  // Rows of q / dq (D), do (DV), k / dk (D), v / dv (DV): strides and this CTA's first element.
  const int64_t q_stride = static_cast<int64_t>(p.heads_q) * D;
  const int64_t do_stride = static_cast<int64_t>(p.heads_q) * DV;
  const int64_t kv_stride = static_cast<int64_t>(p.heads_kv) * D;
  const int64_t v_stride = static_cast<int64_t>(p.heads_kv) * DV;
  const int64_t q_row = kVarlen ? static_cast<int64_t>(rq.start) * p.heads_q + h
                                : static_cast<int64_t>(b) * Sq * p.heads_q + h;
  const int64_t kv_row = kVarlen ? static_cast<int64_t>(rk.start) * p.heads_kv + hk
                                 : static_cast<int64_t>(b) * Sk * p.heads_kv + hk;
  const int64_t q_off = q_row * D, kv_off = kv_row * D, v_off = kv_row * DV;
  const T* qg = static_cast<const T*>(p.q) + q_off;
  const T* dog = static_cast<const T*>(p.dout) + q_row * DV;
  const T* kg = static_cast<const T*>(p.k) + kv_off;
  const T* vg = static_cast<const T*>(p.v) + v_off;
  // lse / dsum: [B, Hq, Sq], or [Hq, Tq] for varlen
  const float* lseg = p.lse + (kVarlen ? static_cast<int64_t>(h) * p.seqlen_q + rq.start
                                       : (static_cast<int64_t>(b) * p.heads_q + h) * Sq);
  const float* dsumg = p.dsum + (kVarlen ? static_cast<int64_t>(h) * p.seqlen_q + rq.start
                                         : (static_cast<int64_t>(b) * p.heads_q + h) * Sq);
  float* dqg = p.dq_acc + q_off;
  ExtrasView<T> xv;
  if constexpr (kExtras) xv.init(p.x, b, h, Sq, Sk);
  // ALiBi (varlen): -slope * log2(e) and this sequence's offset.
  AlibiRow alibi{0.f, 0};
  if constexpr (kAlibi) alibi = alibi_row(p.x, b, h, Sq, Sk, p.bottom_right);
  // The dense variants read the band from the parameters at each use (as the
  // fast path always did); varlen computed it above.
#define FG_BAND_LO (kVarlen ? band_lo : p.band_lo)
#define FG_BAND_HI (kVarlen ? band_hi : p.band_hi)
#define FG_BAND_MASKED (kVarlen ? band_masked : p.masked)

  // Query blocks that can see at least one key of this block: rows i with
  // k0 - hi <= i <= k0 + BC - 1 - lo.
  const long long first_q = max(0LL, static_cast<long long>(k0) - FG_BAND_HI);
  const long long last_q = min(static_cast<long long>(Sq) - 1, static_cast<long long>(k0) + BC - 1 - FG_BAND_LO);
  const int m_begin = static_cast<int>(min(first_q, static_cast<long long>(Sq)) / BR);
  const int m_end = last_q >= first_q ? static_cast<int>(last_q / BR) + 1 : m_begin;
  const bool capped = p.softcap > 0.f;

  float acc_dk[kKT][4], acc_dv[kVT][4];
#pragma unroll
  for (int i = 0; i < kKT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dk[i][e] = 0.f;
#pragma unroll
  for (int i = 0; i < kVT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dv[i][e] = 0.f;

  // lse / Dsum of a query block go through registers (loaded early, stored
  // to shared memory late) so that their latency hides behind the dQ GEMM.
  auto fetch_row_stats = [&](int m, float& l, float& d) {
    l = INFINITY;
    d = 0.f;
    if (tid < BR) {
      const int row = m * BR + tid;
      if (row < Sq) {
        const float x = lseg[row];
        // lse = -inf marks a row that sees no key: its probabilities are 0.
        l = x == -INFINITY ? INFINITY : x * kLog2e;
        d = dsumg[row];
      }
    }
  };

  // Deterministic dbias: a slab the bias broadcasts over batch or heads takes the shares of
  // this key block's (batch, head)s in that order (dbias_rank of them before this CTA).
  unsigned* dbias_turn = nullptr;
  unsigned dbias_rank = 0;
  if constexpr (kDet && kExtras) {
    if (xv.dbias != nullptr && split == 0) {
      const bool over_b = p.x.dbias_stride_b == 0, over_h = p.x.dbias_stride_h == 0;
      dbias_turn = p.dbias_turn +
                   (static_cast<int64_t>(over_b ? 0 : b) * p.heads_q + (over_h ? 0 : h)) * (gridDim.x / NSPLIT) + nblk;
      dbias_rank = (over_b ? b : 0) * (over_h ? p.heads_q : 1) + (over_h ? h : 0);
      if (tid == 0) bwd_wait_turn(dbias_turn, dbias_rank);
      cta_sync<kDet, NT>();
    }
  }

  if (m_begin < m_end) {
    load_tile_async<T, BC, D, NT>(sK, LD, kg, kv_stride, k0, Sk);
    load_tile_async<T, BC, DV, NT>(sV, LDV, vg, v_stride, k0, Sk);
    load_tile_async<T, BR, D, NT>(sQ, LD, qg, q_stride, m_begin * BR, Sq);
    load_tile_async<T, BR, DV, NT>(sdO, LDV, dog, do_stride, m_begin * BR, Sq);
    cp_async_commit();
    {
      float l, d;
      fetch_row_stats(m_begin, l, d);
      if (tid < BR) {
        sLse[tid] = l;
        sDsum[tid] = d;
      }
    }
    cp_async_wait<0>();
    cta_sync<kDet, NT>();

    // dQ[q0 : q0+BR, dcol0 : dcol0+SK] += scale * dS K; then the next block's lse / Dsum, and its
    // Q / dO tiles landed.
    auto add_dq = [&](const int q0, const float next_l, const float next_d) {
      constexpr int kTiles = SK / 16;  // 16-column tiles of the slice
      constexpr int kPass = Cfg::kDqPass;  // 16-column tiles per pass
      const int rg = warp % Cfg::RG, cg = warp / Cfg::RG;
#pragma unroll 1
      for (int base = cg; base < kTiles; base += Cfg::CG * kPass) {
        float acc[kPass][2][4];
#pragma unroll
        for (int i = 0; i < kPass; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][0][e] = acc[i][1][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < BC / KS; ++ks) {
          FragA a;
          Ops::load_a_cm(sdS, LDS, rg * 16, ks * KS, a);
#pragma unroll
          for (int i = 0; i < kPass; ++i) {
            const int tile = base + i * Cfg::CG;
            if (tile < kTiles) {
              FragB b0, b1;
              Ops::load_b2_kn(sK, LD, dcol0 + tile * 16, ks * KS, b0, b1);
              Ops::mma(acc[i][0], a, b0);
              Ops::mma(acc[i][1], a, b1);
            }
          }
        }
#pragma unroll
        for (int i = 0; i < kPass; ++i) {
          const int tile = base + i * Cfg::CG;
          if (tile < kTiles) {
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
              for (int r = 0; r < 2; ++r) {
                const int row = q0 + rg * 16 + g + 8 * r;
                const int col = dcol0 + tile * 16 + half * 8 + 2 * t;
                if (row < Sq) {
                  float* dst = dqg + row * q_stride + col;
                  const float x = acc[i][half][2 * r] * p.scale, y = acc[i][half][2 * r + 1] * p.scale;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
                  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(x, y));
#else
                  atomicAdd(dst, x);
                  atomicAdd(dst + 1, y);
#endif
                }
              }
          }
        }
      }
      // Every warp is done with dS^T; the next Q/dO tiles have landed.
      if (tid < BR) {
        sLse[tid] = next_l;
        sDsum[tid] = next_d;
      }
      cp_async_wait<0>();
      cta_sync<kDet, NT>();
    };

    // Deterministic: block m's dQ share is added once its turn came (waited for below, after its
    // dS^T; added at the top of the next iteration, so that in code order the wait comes after
    // the additions other CTAs make meanwhile: the emulator's warps at the lowest pc run first).
    unsigned* dq_turn = nullptr;
    float next_l = INFINITY, next_d = 0.f;
    for (int m = m_begin; m < m_end + (kDet ? 1 : 0); ++m) {
      if constexpr (kDet) {
        if (m > m_begin) {
          add_dq((m - 1) * BR, next_l, next_d);
          if (tid == 0) bwd_pass_turn(dq_turn);
        }
        if (m == m_end) break;
      }
      const int q0 = m * BR;
      const bool need_mask =
          (k0 + BC > Sk) ||
          (FG_BAND_MASKED && (k0 - (q0 + BR - 1) < FG_BAND_LO || k0 + BC - 1 - q0 > FG_BAND_HI));

#pragma unroll 1
      for (int qc = 0; qc < BR / QC; ++qc) {
        const int c0 = qc * QC;  // first query column of the chunk (tile-local)
        // ---- S^T = K Q^T  (16 keys x QC queries per warp)
        float s[kQT][4];
#pragma unroll
        for (int i = 0; i < kQT; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[i][e] = 0.f;
        warp_gemm_abt<Ops, D, QC>(s, sK, LD, wrow0, sQ, LD, c0);
        // ---- P^T
        if constexpr (kExtras) {
#pragma unroll
          for (int j = 0; j < kQT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int qi = c0 + j * 8 + 2 * t + (e & 1);     // tile-local query
              const int kj = k0 + wrow0 + g + (e >> 1) * 8;  // global key
              const int row = q0 + qi;
              const int dist = kj - row;
              float add = 0.f;
              bool vis = row < Sq && kj < Sk && dist >= FG_BAND_LO && dist <= FG_BAND_HI;
              if (vis) vis = xv.term(row, kj, add);
              const float x = capped ? p.softcap * tanhf(s[j][e] * p.cap_in) : s[j][e] * p.scale;
              s[j][e] = vis ? fast_exp2(fmaf(x + add, kLog2e, -sLse[qi])) : -0.f;  // -0: masked
            }
        } else {
#pragma unroll
          for (int j = 0; j < kQT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int qi = c0 + j * 8 + 2 * t + (e & 1);     // tile-local query
              const int kj = k0 + wrow0 + g + (e >> 1) * 8;  // global key
              float pv;
              if constexpr (kAlibi) {
                // log2 units: x * log2e - slope * log2e * |i + off - j| - lse * log2e
                const float xl2 = capped ? p.softcap * tanhf(s[j][e] * p.cap_in) * kLog2e : s[j][e] * p.scale_log2;
                pv = fast_exp2(xl2 + alibi_term(alibi.neg_slope_l2, q0 + qi, alibi.off, kj) - sLse[qi]);
              } else if (capped)
                pv = fast_exp2(fmaf(p.softcap * tanhf(s[j][e] * p.cap_in), kLog2e, -sLse[qi]));
              else
                pv = fast_exp2(fmaf(s[j][e], p.scale_log2, -sLse[qi]));
              if (need_mask) {
                const int dist = kj - (q0 + qi);
                const bool masked = kj >= Sk || dist < FG_BAND_LO || dist > FG_BAND_HI;
                if (masked) pv = -0.f;  // -0 marks masked (visible P is +0 or more, or NaN)
              }
              s[j][e] = pv;
            }
        }
        // ---- dV += P^T dO
        warp_gemm_pb<Ops, QC, SV>(acc_dv, s, sdO, LDV, c0, dvcol0);
        // ---- dP^T = V dO^T
        float dpt[kQT][4];
#pragma unroll
        for (int i = 0; i < kQT; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) dpt[i][e] = 0.f;
        warp_gemm_abt<Ops, DV, QC>(dpt, sV, LDV, wrow0, sdO, LDV, c0);
        // ---- dS^T = P^T * (dP^T - Dsum)   (in place of P^T)
        // Softcap: times 1 - u^2 with u = tanh(x / c), recovered from P instead of
        // kept in registers: log2(P) = c*u*log2(e) - lse*log2(e). P = 0 gives dS = 0
        // (or NaN from a NaN dP), P NaN a NaN dS: neither needs the factor.
#pragma unroll
        for (int j = 0; j < kQT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int qi = c0 + j * 8 + 2 * t + (e & 1);
            // Masked (P = -0): dS = 0 even where dP is NaN (a NaN V or dO must not reach
            // pairs the row does not see); visible: IEEE, NaN included.
            const bool masked = signbit(s[j][e]);
            float ds = masked ? 0.f : s[j][e] * (dpt[j][e] - sDsum[qi]);
            if constexpr (kExtras) {
              // Visible (row < Sq, key < Sk), NaN included. With NSPLIT > 1 every split
              // recomputes this dS: one of them adds it.
              const bool to_dbias = ds != 0.f && xv.dbias != nullptr && split == 0;
              const int row = q0 + qi, kj = k0 + wrow0 + g + (e >> 1) * 8;
              if constexpr (kDet) {
                // The 4 lanes of a key row may share an element (a key-only bias): lane order.
#pragma unroll
                for (int lane_t = 0; lane_t < 4; ++lane_t) {
                  if (to_dbias && t == lane_t) xv.add_dbias(row, kj, ds);
                  __syncwarp();
                }
              } else if (to_dbias) {
                xv.add_dbias(row, kj, ds);
              }
              if (s[j][e] > 0.f) {
                const int row = q0 + qi, kj = k0 + wrow0 + g + (e >> 1) * 8;
                if (capped) {
                  const float u = (__log2f(s[j][e]) + sLse[qi] - xv.add_only(row, kj) * kLog2e) * p.cap_out;
                  ds *= 1.f - u * u;
                }
              }
            } else if constexpr (kAlibi) {
              if (capped && s[j][e] > 0.f) {
                const int kj = k0 + wrow0 + g + (e >> 1) * 8;
                const float a = alibi_term(alibi.neg_slope_l2, q0 + qi, alibi.off, kj);
                const float u = (__log2f(s[j][e]) + sLse[qi] - a) * p.cap_out;
                ds *= 1.f - u * u;
              }
            } else if (capped && s[j][e] > 0.f) {
              const float u = (__log2f(s[j][e]) + sLse[qi]) * p.cap_out;
              ds *= 1.f - u * u;
            }
            s[j][e] = ds;
          }
        // ---- dK += dS^T Q   (scale applied at the end)
        warp_gemm_pb<Ops, QC, SK>(acc_dk, s, sQ, LD, c0, dcol0);
        // ---- dS^T -> shared (element type, as the A operand of the dQ GEMM)
#pragma unroll
        for (int j = 0; j < kQT; ++j) {
          Ops::store2(sdS + (wrow0 + g) * LDS + c0 + j * 8 + 2 * t, s[j][0], s[j][1]);
          Ops::store2(sdS + (wrow0 + g + 8) * LDS + c0 + j * 8 + 2 * t, s[j][2], s[j][3]);
        }
      }

      // Deterministic: this key block's dQ share of query block m follows those of the key
      // blocks before it that see block m.
      if constexpr (kDet) {
        dq_turn = p.dq_turn + ((static_cast<int64_t>(b) * p.heads_q + h) * p.q_blocks + m) * NSPLIT + split;
        if (tid == 0) bwd_wait_turn(dq_turn, bwd_dq_turn(nblk, m, BR, BC, FG_BAND_LO));
      }
      // dS^T complete; every warp is done with Q, dO, lse and Dsum of block m.
      cta_sync<kDet, NT>();
      next_l = INFINITY, next_d = 0.f;
      if (m + 1 < m_end) {
        load_tile_async<T, BR, D, NT>(sQ, LD, qg, q_stride, q0 + BR, Sq);
        load_tile_async<T, BR, DV, NT>(sdO, LDV, dog, do_stride, q0 + BR, Sq);
        cp_async_commit();
        fetch_row_stats(m + 1, next_l, next_d);
      }

      if constexpr (!kDet) add_dq(q0, next_l, next_d);
    }
  }
  if constexpr (kDet && kExtras) {
    if (dbias_turn != nullptr) {
      cta_sync<kDet, NT>();
      if (tid == 0) bwd_pass_turn(dbias_turn);
    }
  }

  // ---- epilogue: dK = scale * acc_dk, dV = acc_dv for keys k0 + wrow0 + [0, 16)
  if (p.atomic_kv) {
    // Deterministic: the q heads of a group add in head order.
    unsigned* kv_turn = nullptr;
    if constexpr (kDet) {
      kv_turn = p.kv_turn + (static_cast<int64_t>(b) * p.heads_kv + hk) * gridDim.x + item_x;
      if (tid == 0) bwd_wait_turn(kv_turn, static_cast<unsigned>(h % p.group));
      cta_sync<kDet, NT>();
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = k0 + wrow0 + g + 8 * r;
      if (row < Sk) {
#pragma unroll
        for (int i = 0; i < kKT; ++i) {
          const int64_t off = kv_off + row * kv_stride + dcol0 + i * 8 + 2 * t;
          atomicAdd(p.dk_acc + off, acc_dk[i][2 * r] * p.scale);
          atomicAdd(p.dk_acc + off + 1, acc_dk[i][2 * r + 1] * p.scale);
        }
#pragma unroll
        for (int i = 0; i < kVT; ++i) {
          const int64_t off = v_off + row * v_stride + dvcol0 + i * 8 + 2 * t;
          atomicAdd(p.dv_acc + off, acc_dv[i][2 * r]);
          atomicAdd(p.dv_acc + off + 1, acc_dv[i][2 * r + 1]);
        }
      }
    }
    if constexpr (kDet) {
      cta_sync<kDet, NT>();
      if (tid == 0) bwd_pass_turn(kv_turn);
    }
  } else {
    // Stage through the warp's own rows of the K / V tiles (all reads of them
    // ended at the loop's final barrier), then 16-byte stores.
    T* stK = sK + wrow0 * LD;
    T* stV = sV + wrow0 * LDV;
#pragma unroll
    for (int i = 0; i < kKT; ++i) {
      Ops::store2(stK + g * LD + i * 8 + 2 * t, acc_dk[i][0] * p.scale, acc_dk[i][1] * p.scale);
      Ops::store2(stK + (g + 8) * LD + i * 8 + 2 * t, acc_dk[i][2] * p.scale, acc_dk[i][3] * p.scale);
    }
#pragma unroll
    for (int i = 0; i < kVT; ++i) {
      Ops::store2(stV + g * LDV + i * 8 + 2 * t, acc_dv[i][0], acc_dv[i][1]);
      Ops::store2(stV + (g + 8) * LDV + i * 8 + 2 * t, acc_dv[i][2], acc_dv[i][3]);
    }
    __syncwarp();
    store_warp_rows<T, SK>(static_cast<T*>(p.dk) + kv_off + dcol0, kv_stride, stK, LD, k0 + wrow0, Sk, lane);
    store_warp_rows<T, SV>(static_cast<T*>(p.dv) + v_off + dvcol0, v_stride, stV, LDV, k0 + wrow0, Sk, lane);
  }
#undef FG_BAND_LO
#undef FG_BAND_HI
#undef FG_BAND_MASKED
}

}  // namespace
}  // namespace cuda
}  // namespace flashgen
