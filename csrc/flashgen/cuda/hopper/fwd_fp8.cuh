// Hopper (sm_90a) FP8 forward: q, k, v in e4m3 with per-tensor descale factors (real value =
// stored * descale), o in bf16, lse in f32 (contract.FP8_CALLS).
//
// The CTA is hopper/fwd.cuh's: 64 query rows of one (batch, q head), 256 threads; a producer
// warpgroup fills a 2-stage ring of key / value blocks (64 keys) guarded by `full` / `empty`
// mbarriers, a consumer warpgroup computes. What FP8 changes:
//   - S = Q K^T is wgmma m64n64k32 .e4m3 with both operands K-major from 64B-swizzled shared
//     memory (sm90.cuh); the descales of q and k fold into the softmax scale (exp2 domain).
//   - P (f32, in [0, 1]) is rounded to e4m3 in registers and is the A operand of O += P V. 8-bit
//     wgmma reads B K-major only, so the producer stages V TRANSPOSED (V^T: a row per head-dim
//     column, keys contiguous). The S accumulator gives thread t of a quad the key columns
//     {2t, 2t+1, 8+2t, 9+2t} of each 16; the k32 A fragment wants k = 4t .. 4t+3. Rather than
//     shuffle P between threads, the keys of V^T are stored in that order: A position 4t + i of
//     each 16 holds key 2t + (i % 2) + 8 (i / 2) (load_v_transposed), so P's registers are used as
//     they are and sum_k P[:, k] V[k, :] is unchanged.
//   - l sums the f32 probabilities (not their e4m3 roundings, as FlashAttention-3): o's error is
//     then the rounding of P weighted by |v| (tests/test_fp8.py derives the bound).
//   - The epilogue multiplies by v's descale: o = v_descale * (P~ V) / l.
#pragma once

#include <cuda_fp8.h>

#include "flashgen/call.h"
#include "flashgen/cuda/fwd.cuh"
#include "flashgen/cuda/hopper/sm90.cuh"

namespace flashgen {
namespace cuda {
namespace {

template <int D>
constexpr bool kHopperFp8FwdCompiles = D % sm90::kFp8PanelCols == 0 && D <= 256;

struct Fp8FwdParams : FwdParams {
  const float* q_descale;  // [1] each, device memory
  const float* k_descale;
  const float* v_descale;
};

struct HopperFp8FwdConfig {
  static constexpr int BR = 64;  // query rows per CTA (one consumer warpgroup)
  static constexpr int BC = 64;  // keys per block: one 64-byte row of V^T
  static constexpr int kStages = 2;
  static constexpr int kThreads = 256;  // producer warpgroup + consumer warpgroup
  // Q and K tiles are [64][D] bytes, V^T [D][64]: the same size.
  __host__ __device__ static constexpr int tile_bytes(int head_dim) { return BR * head_dim; }
  // Q, then per stage K and V^T; + one swizzle atom to align the base.
  __host__ __device__ static constexpr size_t smem_bytes(int head_dim) {
    return (1 + 2 * kStages) * tile_bytes(head_dim) + sm90::kSw64Atom;
  }
};

// Block [row0, row0 + 64) of V ([keys][D] e4m3, `stride` bytes per key) as V^T ([D][64 key
// positions], sm90::sw64 rows) with the key order of the class comment; keys at or past
// `keys_valid` are zeros (their P is 0, and 0 * NaN would not be). Each of NT threads moves 4
// keys x 4 columns at a time: 4 coalesced 4-byte loads, a 4 x 4 byte transpose, 4 stores.
template <int D, int NT>
FG_DEV void load_v_transposed(uint8_t* vt, const uint8_t* src, int64_t stride, int row0, int keys_valid, int tid) {
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
      *reinterpret_cast<uint32_t*>(vt + sm90::sw64((4 * w + c) * 64 + 4 * quad)) = row;
    }
  }
}

template <int D, bool CAUSAL>
__global__ void __launch_bounds__(HopperFp8FwdConfig::kThreads, 1) hopper_fwd_fp8_kernel(const Fp8FwdParams p) {
  using Cfg = HopperFp8FwdConfig;
  constexpr int BR = Cfg::BR, BC = Cfg::BC, kStages = Cfg::kStages;
  constexpr int kTile = Cfg::tile_bytes(D);
  constexpr int kPanelBytes = BR * 64;       // a 64-column panel of a [64][D] tile
  constexpr int kBlocksN = D / 64;           // n64 blocks of O (64 rows of V^T each)
  static_assert(BR == BC, "K / V^T tiles share the Q tile's size");

  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  const uint32_t raw = smem_addr(smem_raw);
  uint8_t* smem = smem_raw + ((raw + sm90::kSw64Atom - 1) / sm90::kSw64Atom * sm90::kSw64Atom - raw);
  uint8_t* sQ = smem;
  auto sK = [&](int s) { return smem + (1 + 2 * s) * kTile; };
  auto sVt = [&](int s) { return smem + (2 + 2 * s) * kTile; };

  const int mblk = CAUSAL ? static_cast<int>(gridDim.x - 1 - blockIdx.x) : static_cast<int>(blockIdx.x);
  const int h = blockIdx.y, hk = h / p.group, b = blockIdx.z;
  const int q0 = mblk * BR;
  const int Sq = p.seqlen_q, Sk = p.seqlen_k;
  const int64_t q_stride = static_cast<int64_t>(p.heads_q) * D;  // bytes: e4m3
  const int64_t kv_stride = static_cast<int64_t>(p.heads_kv) * D;
  const uint8_t* qg = static_cast<const uint8_t*>(p.q) + (static_cast<int64_t>(b) * Sq * p.heads_q + h) * D;
  const uint8_t* kg = static_cast<const uint8_t*>(p.k) + (static_cast<int64_t>(b) * Sk * p.heads_kv + hk) * D;
  const uint8_t* vg = static_cast<const uint8_t*>(p.v) + (static_cast<int64_t>(b) * Sk * p.heads_kv + hk) * D;

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
      sm90::mbar_wait(smem_addr(&empty[s]), ((it / kStages) & 1) ^ 1);
      sm90::load_tile_sw64_e4m3<BC, D, 128>(sK(s), kg, kv_stride, n * BC, Sk, tid);
      load_v_transposed<D, 128>(sVt(s), vg, kv_stride, n * BC, Sk, tid);
      sm90::fence_proxy_async();
      sm90::mbar_arrive(smem_addr(&full[s]));
    }
    return;
  }

  // ---- consumer warpgroup
  const int tid = threadIdx.x - 128, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  sm90::load_tile_sw64_e4m3<BR, D, 128>(sQ, qg, q_stride, q0, Sq, tid);
  sm90::fence_proxy_async();
  sm90::named_sync(1, 128);

  // The scores the kernel multiplies are the stored values': the descales of q and k scale them.
  const float qk_descale = *p.q_descale * *p.k_descale;
  const float scale = p.scale * qk_descale, scale_log2 = p.scale_log2 * qk_descale;

  // Accumulator register j of a 64-column tile: row 16 warp + g + 8 ((j / 2) % 2), column
  // 8 (j / 4) + 2 t + j % 2.
  float acc_o[kBlocksN][32];
#pragma unroll
  for (int nb = 0; nb < kBlocksN; ++nb)
#pragma unroll
    for (int j = 0; j < 32; ++j) acc_o[nb][j] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  const int row_base = q0 + 16 * warp + g;

  for (int n = n_first; n < n_end; ++n) {
    const int it = n - n_first, s = it % kStages;
    sm90::mbar_wait(smem_addr(&full[s]), (it / kStages) & 1);

    // ---- S = Q K^T: k32 step kk is 32 bytes into 64-column panel kk / 2
    float acc_s[32];
#pragma unroll
    for (int j = 0; j < 32; ++j) acc_s[j] = 0.f;
    sm90::fence_operands(acc_s);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 32; ++kk) {
      const int off = (kk / 2) * kPanelBytes + (kk % 2) * 32;
      sm90::wgmma_ss_e4m3(acc_s, sm90::sw64_desc(smem_addr(sQ) + off), sm90::sw64_desc(smem_addr(sK(s)) + off));
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait_all();
    sm90::fence_operands(acc_s);

    // ---- mask: keys past Sk, and the band's edge
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

    // ---- online softmax (log2 domain)
    float corr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = row_max[r];
#pragma unroll
      for (int j = 0; j < 32; ++j)
        if ((j / 2) % 2 == r) mx = fmaxf(mx, acc_s[j]);
      mx = quad_max(mx);
      const float base = mx == -INFINITY ? 0.f : mx * scale_log2;
      corr[r] = fast_exp2(row_max[r] * scale_log2 - base);
      row_max[r] = mx;
      row_sum[r] *= corr[r];
#pragma unroll
      for (int j = 0; j < 32; ++j)
        if ((j / 2) % 2 == r) {
          acc_s[j] = fast_exp2(acc_s[j] * scale_log2 - base);
          row_sum[r] += acc_s[j];
        }
    }
#pragma unroll
    for (int nb = 0; nb < kBlocksN; ++nb)
#pragma unroll
      for (int j = 0; j < 32; ++j) acc_o[nb][j] *= corr[(j / 2) % 2];

    // ---- P -> e4m3 A fragments: k32 step kk covers S columns 32 kk .. (registers 16 kk ..);
    // register r takes row g + 8 (r % 2) of the 16-column half r / 2, in V^T's key order.
    uint32_t a[2][4];
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float* x = acc_s + 16 * kk + 8 * (r / 2) + 2 * (r % 2);
        a[kk][r] = sm90::pack_e4m3x4(x[0], x[1], x[4], x[5]);
      }
#pragma unroll
    for (int nb = 0; nb < kBlocksN; ++nb) sm90::fence_operands(acc_o[nb]);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
#pragma unroll
      for (int nb = 0; nb < kBlocksN; ++nb)
        sm90::wgmma_rs_e4m3(acc_o[nb], a[kk], sm90::sw64_desc(smem_addr(sVt(s)) + nb * kPanelBytes + kk * 32));
    sm90::wgmma_commit();
    sm90::wgmma_wait_all();
#pragma unroll
    for (int nb = 0; nb < kBlocksN; ++nb) sm90::fence_operands(acc_o[nb]);
    if (tid == 0) sm90::mbar_arrive(smem_addr(&empty[s]));
  }

  // ---- epilogue: o = v_descale * O / l (bf16), lse = m * scale + ln(l)
  const float v_descale = *p.v_descale;
  __nv_bfloat16* og = static_cast<__nv_bfloat16*>(p.o) + (static_cast<int64_t>(b) * Sq * p.heads_q + h) * D;
  float* lseg = p.lse + (static_cast<int64_t>(b) * p.heads_q + h) * Sq;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_base + 8 * r;
    const float l = quad_sum(row_sum[r]);
    const bool sees_keys = max(0LL, static_cast<long long>(row) + p.band_lo) <
                           min(static_cast<long long>(Sk), static_cast<long long>(row) + p.band_hi + 1);
    const float inv = l != 0.f ? v_descale / l : (sees_keys ? NAN : 0.f);
    if (row >= Sq) continue;
#pragma unroll
    for (int nb = 0; nb < kBlocksN; ++nb)
#pragma unroll
      for (int j = 0; j < 32; ++j)
        if ((j / 2) % 2 == r && j % 2 == 0) {
          const int col = nb * 64 + 8 * (j / 4) + 2 * t;
          *reinterpret_cast<uint32_t*>(og + static_cast<int64_t>(row) * q_stride + col) =
              HalfOps<__nv_bfloat16>::pack(acc_o[nb][j] * inv, acc_o[nb][j + 1] * inv);
        }
    if (t == 0) lseg[row] = l != 0.f ? row_max[r] * scale + logf(l) : (sees_keys ? NAN : -INFINITY);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace flashgen
