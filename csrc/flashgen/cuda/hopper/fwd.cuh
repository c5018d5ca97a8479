// Hopper (sm_90a) dense forward, v0: wgmma tensor cores, a producer / consumer CTA.
//
// One CTA = 64 query rows of one (batch, q head), 256 threads:
//   warpgroup 0 (producer) loads the key/value blocks of 64 keys into a 2-stage shared-memory
//     ring (128B-swizzled, sm90.cuh), each stage guarded by a `full` mbarrier (128 producer
//     arrivals after their stores and fence.proxy.async) and an `empty` one (one consumer
//     arrival after the wgmma that read the stage retired);
//   warpgroup 1 (consumer) loads Q once, then per block: S = Q K^T (wgmma, both operands from
//     shared memory), the band mask on blocks that need it (tail and diagonal), online softmax
//     in the log2 domain (ex2), O += P V (wgmma, P from registers, V MN-major from shared memory).
// Loads are plain 16-byte ld.global / st.shared (no TMA yet: the emulated CUDA runtime has no
// cuTensorMapEncodeTiled), so the producer's latency hiding is the ring alone. Blocks outside the
// visible band (causal, window) are never loaded. Epilogue straight from registers: o = O / l, lse =
// m * scale + ln(l), or o = 0, lse = -inf for a row that sees no key.
#pragma once

#include "flashgen/call.h"
#include "flashgen/cuda/fwd.cuh"
#include "flashgen/cuda/hopper/sm90.cuh"

namespace flashgen {
namespace cuda {
namespace {

// Which dense forward calls this kernel serves; the others keep the sm80 family's kernels.
// Compiled for f16 / bf16 at head dims that are multiples of 64 up to 256 (the swizzled panels;
// Q, K and V stages fit in shared memory). At run time: any band (causal top-left or
// bottom-right, sliding window), but no extras and no softcap (not ported yet).
template <class T, int D>
constexpr bool kHopperFwdCompiles =
    D % sm90::kPanelCols == 0 && D <= 256 && (std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value);

inline bool hopper_fwd_supports(const FwdCall& c) {
  return !c.x.any() && c.attrs.softcap == 0.f;
}

struct HopperFwdConfig {
  static constexpr int BR = 64;         // query rows per CTA (one consumer warpgroup)
  static constexpr int BC = 64;         // keys per block
  static constexpr int kStages = 2;
  static constexpr int kThreads = 256;  // producer warpgroup + consumer warpgroup
  // A [64][head_dim] tile of 16-bit elements.
  __host__ __device__ static constexpr int tile_bytes(int head_dim) { return BR * head_dim * 2; }
  // Q, then per stage K and V; +1024 to align the base to the swizzle atom.
  __host__ __device__ static constexpr size_t smem_bytes(int head_dim) {
    return (1 + 2 * kStages) * tile_bytes(head_dim) + sm90::kSwizzleAtom;
  }
};

template <class T, int D, bool CAUSAL>
__global__ void __launch_bounds__(HopperFwdConfig::kThreads, 1) hopper_fwd_kernel(const FwdParams p) {
  using Cfg = HopperFwdConfig;
  constexpr int BR = Cfg::BR, BC = Cfg::BC, kStages = Cfg::kStages;
  constexpr int kTile = Cfg::tile_bytes(D);
  constexpr int kPanels = D / sm90::kPanelCols;
  constexpr int kPanelBytes = BR * 128;
  static_assert(BR == BC, "K / V tiles share the Q tile's panel size");

  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  const uint32_t raw = smem_addr(smem_raw);
  uint8_t* smem = smem_raw + ((raw + sm90::kSwizzleAtom - 1) / sm90::kSwizzleAtom * sm90::kSwizzleAtom - raw);
  uint8_t* sQ = smem;
  auto sK = [&](int s) { return smem + (1 + 2 * s) * kTile; };
  auto sV = [&](int s) { return smem + (2 + 2 * s) * kTile; };

  // Causal: the last query blocks have the most work; launch them first.
  const int mblk = CAUSAL ? static_cast<int>(gridDim.x - 1 - blockIdx.x) : static_cast<int>(blockIdx.x);
  const int h = blockIdx.y, hk = h / p.group, b = blockIdx.z;
  const int q0 = mblk * BR;
  const int Sq = p.seqlen_q, Sk = p.seqlen_k;
  const int64_t q_stride = static_cast<int64_t>(p.heads_q) * D;
  const int64_t kv_stride = static_cast<int64_t>(p.heads_kv) * D;
  const T* qg = static_cast<const T*>(p.q) + (static_cast<int64_t>(b) * Sq * p.heads_q + h) * D;
  const T* kg = static_cast<const T*>(p.k) + (static_cast<int64_t>(b) * Sk * p.heads_kv + hk) * D;
  const T* vg = static_cast<const T*>(p.v) + (static_cast<int64_t>(b) * Sk * p.heads_kv + hk) * D;

  // Key blocks [n_first, n_end) cover the band of rows q0 .. q_last.
  const int q_last = min(q0 + BR, Sq) - 1;
  const long long kv_begin = max(0LL, static_cast<long long>(q0) + p.band_lo);
  const long long kv_end = min(static_cast<long long>(Sk), static_cast<long long>(q_last) + p.band_hi + 1);
  const int n_first = kv_end > kv_begin ? static_cast<int>(kv_begin / BC) : 0;
  const int n_end = kv_end > kv_begin ? static_cast<int>((kv_end + BC - 1) / BC) : 0;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::mbar_init(smem_addr(&full[s]), 128);
      sm90::mbar_init(smem_addr(&empty[s]), 1);
    }
    sm90::fence_mbarrier_init();
  }
  __syncthreads();

  if (threadIdx.x < 128) {  // ---- producer warpgroup
    const int tid = threadIdx.x;
    for (int n = n_first; n < n_end; ++n) {
      const int it = n - n_first, s = it % kStages;
      sm90::mbar_wait(smem_addr(&empty[s]), ((it / kStages) & 1) ^ 1);  // a fresh barrier's phase -1 is done
      sm90::load_tile_sw128<T, BC, D, 128>(sK(s), kg, kv_stride, n * BC, Sk, tid);
      sm90::load_tile_sw128<T, BC, D, 128>(sV(s), vg, kv_stride, n * BC, Sk, tid);
      sm90::fence_proxy_async();
      sm90::mbar_arrive(smem_addr(&full[s]));
    }
    return;
  }

  // ---- consumer warpgroup
  const int tid = threadIdx.x - 128, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  sm90::load_tile_sw128<T, BR, D, 128>(sQ, qg, q_stride, q0, Sq, tid);
  sm90::fence_proxy_async();
  sm90::named_sync(1, 128);

  // Accumulator register j of a 64-column tile holds row 16 warp + g + 8 ((j / 2) % 2), column
  // 8 (j / 4) + 2 t + j % 2.
  float acc_o[kPanels][32];
#pragma unroll
  for (int pn = 0; pn < kPanels; ++pn)
#pragma unroll
    for (int j = 0; j < 32; ++j) acc_o[pn][j] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // raw scores, rows g and g + 8 of the warp's 16
  float row_sum[2] = {0.f, 0.f};              // this thread's partial sum of exp
  const int row_base = q0 + 16 * warp + g;

  for (int n = n_first; n < n_end; ++n) {
    const int it = n - n_first, s = it % kStages;
    sm90::mbar_wait(smem_addr(&full[s]), (it / kStages) & 1);

    // ---- S = Q K^T
    float acc_s[32];
#pragma unroll
    for (int j = 0; j < 32; ++j) acc_s[j] = 0.f;
    sm90::fence_operands(acc_s);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int off = (kk / 4) * kPanelBytes + (kk % 4) * 32;
      sm90::wgmma_ss<T>(acc_s, sm90::sw128_desc(smem_addr(sQ) + off), sm90::sw128_desc(smem_addr(sK(s)) + off));
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait_all();
    sm90::fence_operands(acc_s);

    // ---- mask: keys past Sk, and the band's edge (causal diagonal)
    const int k0 = n * BC;
    const bool tail = k0 + BC > Sk;
    const bool edge = p.masked && (k0 + BC - 1 - q0 > p.band_hi || k0 - (q0 + BR - 1) < p.band_lo);
    if (tail || edge) {
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int row = row_base + 8 * ((j / 2) % 2), col = k0 + 8 * (j / 4) + 2 * t + j % 2;
        const int rel = col - row;
        if (col >= Sk || rel < p.band_lo || rel > p.band_hi) acc_s[j] = -INFINITY;
      }
    }

    // ---- online softmax (log2 domain, scale folded into the exponent)
    float corr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = row_max[r];
#pragma unroll
      for (int j = 0; j < 32; ++j)
        if ((j / 2) % 2 == r) mx = fmaxf(mx, acc_s[j]);
      mx = quad_max(mx);
      // A row with no visible key so far keeps max -inf: exponents use 0 instead (p = 0).
      const float base = mx == -INFINITY ? 0.f : mx * p.scale_log2;
      corr[r] = fast_exp2(row_max[r] * p.scale_log2 - base);
      row_max[r] = mx;
      row_sum[r] *= corr[r];
#pragma unroll
      for (int j = 0; j < 32; ++j)
        if ((j / 2) % 2 == r) {
          acc_s[j] = fast_exp2(acc_s[j] * p.scale_log2 - base);
          row_sum[r] += acc_s[j];
        }
    }
#pragma unroll
    for (int pn = 0; pn < kPanels; ++pn)
#pragma unroll
      for (int j = 0; j < 32; ++j) acc_o[pn][j] *= corr[(j / 2) % 2];

    // ---- O += P V: k16 step kk's A fragment is S tiles 2 kk and 2 kk + 1, rounded to T
    uint32_t a[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const float* lo = acc_s + 8 * kk;
      a[kk][0] = HalfOps<T>::pack(lo[0], lo[1]);
      a[kk][1] = HalfOps<T>::pack(lo[2], lo[3]);
      a[kk][2] = HalfOps<T>::pack(lo[4], lo[5]);
      a[kk][3] = HalfOps<T>::pack(lo[6], lo[7]);
    }
#pragma unroll
    for (int pn = 0; pn < kPanels; ++pn) sm90::fence_operands(acc_o[pn]);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int pn = 0; pn < kPanels; ++pn)
        sm90::wgmma_rs<T>(acc_o[pn], a[kk], sm90::sw128_desc(smem_addr(sV(s)) + pn * kPanelBytes + kk * 2048));
    sm90::wgmma_commit();
    sm90::wgmma_wait_all();
#pragma unroll
    for (int pn = 0; pn < kPanels; ++pn) sm90::fence_operands(acc_o[pn]);
    // The wgmmas that read stage s retired: hand it back to the producer.
    if (tid == 0) sm90::mbar_arrive(smem_addr(&empty[s]));
  }

  // ---- epilogue
  T* og = static_cast<T*>(p.o) + (static_cast<int64_t>(b) * Sq * p.heads_q + h) * D;
  float* lseg = p.lse + (static_cast<int64_t>(b) * p.heads_q + h) * Sq;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_base + 8 * r;
    const float l = quad_sum(row_sum[r]);
    // l == 0 with visible keys: every score overflowed to -inf: NaN, as IEEE softmax.
    const bool sees_keys =
        max(0LL, static_cast<long long>(row) + p.band_lo) < min(static_cast<long long>(Sk), static_cast<long long>(row) + p.band_hi + 1);
    const float inv = l != 0.f ? 1.f / l : (sees_keys ? NAN : 0.f);
    if (row >= Sq) continue;
#pragma unroll
    for (int pn = 0; pn < kPanels; ++pn)
#pragma unroll
      for (int j = 0; j < 32; ++j)
        if ((j / 2) % 2 == r && j % 2 == 0) {
          const int col = pn * sm90::kPanelCols + 8 * (j / 4) + 2 * t;
          *reinterpret_cast<uint32_t*>(og + static_cast<int64_t>(row) * q_stride + col) =
              HalfOps<T>::pack(acc_o[pn][j] * inv, acc_o[pn][j + 1] * inv);
        }
    if (t == 0) lseg[row] = l != 0.f ? row_max[r] * p.scale + logf(l) : (sees_keys ? NAN : -INFINITY);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace flashgen
