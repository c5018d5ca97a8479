// FlashAttention-2 style forward kernel (mma.sync tensor cores, sm_80+).
//
// One CTA = one block of BR query rows of one (batch, q head); each warp owns
// 16 query rows for the whole kernel. The CTA walks the key/value blocks of
// BC keys from the last needed block down to block 0:
//   S = Q K^T (f32 accumulators), [softcap: S = c*tanh(S*scale/c), after
//   which the softmax scale is 1], mask (only on tail / diagonal / window
//   edge blocks), online softmax in the log2 domain (scale*log2(e) folded,
//   ex2.approx),
//   O += P V with P converted in registers to the A operand.
// Causal and the sliding window are one band lo <= j - i <= hi
// (attention.h visible_band): blocks outside it are never loaded.
// Loads: Q once; K and V single-buffered but overlapped with compute in the
// FA2 order (V[n] streams in during Q K[n]^T, K[n-1] during softmax and P V[n]).
// Epilogue: O / l staged through the warp's own rows of the Q tile, written
// with 16-byte stores; lse = m * scale + log(l) (natural log), or -inf (and
// O = 0) for rows that see no key.
#pragma once

#include "flashgen/cuda/common.cuh"

namespace flashgen {
namespace cuda {
namespace {

struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;
  int batch, seqlen_q, seqlen_k, heads_q, heads_kv, group;  // group = heads_q / heads_kv
  int band_lo, band_hi;  // key j visible to query i iff band_lo <= j - i <= band_hi (clamped)
  int masked;           // 1 if the band excludes any (i, j) pair (causal or window)
  float scale;          // softmax scale
  float scale_log2;     // scale * log2(e)
  float softcap;        // 0: off; else scores x = scale*s become softcap * tanh(x / softcap)
  float cap_in;         // scale / softcap (when softcap > 0)
};

// Tile shapes per (element type, head dim). f16/bf16: 8 warps x 16 rows.
// Shared memory = (BR + 2*BC) * (D + pad) * sizeof(T); pad = 16 bytes per row
// (keeps ldmatrix and the fragment stores bank-conflict free).
template <class T, int D>
struct FwdConfig {
  static constexpr bool kF32 = std::is_same<T, float>::value;
  static constexpr int kWarps = kF32 ? 4 : 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int BR = kWarps * 16;
  static constexpr int BC = kF32 ? (D <= 128 ? 64 : 32) : 64;
  static constexpr int LD = D + 16 / static_cast<int>(sizeof(T));
  static constexpr size_t kSmem = static_cast<size_t>(BR + 2 * BC) * LD * sizeof(T);
  static constexpr int kMinBlocks = (!kF32 && D <= 64) ? 2 : 1;  // 2 CTAs/SM needs <= 128 regs
  static_assert(D % 32 == 0 && D >= 32 && D <= 256, "head dim must be a multiple of 32 in [32, 256]");
  static_assert(BC % 16 == 0 && D % 16 == 0, "tiles must be multiples of 16");
  static_assert(kSmem <= 166912, "exceeds the 163 KiB opt-in shared memory of sm_80");
};

template <class T, int D, bool CAUSAL>
__global__ void __launch_bounds__(FwdConfig<T, D>::kThreads, FwdConfig<T, D>::kMinBlocks)
    flash_fwd_kernel(const FwdParams p) {
  using Cfg = FwdConfig<T, D>;
  using Ops = typename OpsFor<T>::type;
  using FragA = typename Ops::FragA;
  using FragB = typename Ops::FragB;
  constexpr int BR = Cfg::BR, BC = Cfg::BC, LD = Cfg::LD, NT = Cfg::kThreads;
  constexpr int KS = Ops::KS;
  constexpr int kNT = BC / 8;  // S accumulator tiles (8 keys each) per warp
  constexpr int kDT = D / 8;   // O accumulator tiles (8 dims each) per warp

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BR * LD;
  T* sV = sK + BC * LD;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  // Causal: the last query blocks have the most work; launch them first.
  const int mblk = CAUSAL ? static_cast<int>(gridDim.x - 1 - blockIdx.x) : static_cast<int>(blockIdx.x);
  const int h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const int q0 = mblk * BR;
  const int Sq = p.seqlen_q, Sk = p.seqlen_k;

  const int64_t q_stride = static_cast<int64_t>(p.heads_q) * D;   // between consecutive rows of q/o
  const int64_t kv_stride = static_cast<int64_t>(p.heads_kv) * D;  // between consecutive rows of k/v
  const T* qg = static_cast<const T*>(p.q) + (static_cast<int64_t>(b) * Sq * p.heads_q + h) * D;
  const T* kg = static_cast<const T*>(p.k) + (static_cast<int64_t>(b) * Sk * p.heads_kv + hk) * D;
  const T* vg = static_cast<const T*>(p.v) + (static_cast<int64_t>(b) * Sk * p.heads_kv + hk) * D;
  T* og = static_cast<T*>(p.o) + (static_cast<int64_t>(b) * Sq * p.heads_q + h) * D;
  float* lseg = p.lse + (static_cast<int64_t>(b) * p.heads_q + h) * Sq;

  // Keys this block needs: [kv_begin, kv_end) (the band of rows q0 .. q_last).
  const int q_last = min(q0 + BR, Sq) - 1;
  const long long kv_begin_ll = max(0LL, static_cast<long long>(q0) + p.band_lo);
  const long long kv_end_ll = min(static_cast<long long>(Sk), static_cast<long long>(q_last) + p.band_hi + 1);
  const int kv_begin = static_cast<int>(min(kv_begin_ll, static_cast<long long>(Sk)));
  const int kv_end = static_cast<int>(max(kv_end_ll, 0LL));
  const int n_first = kv_begin / BC;
  const int n_blocks = kv_end > kv_begin ? (kv_end + BC - 1) / BC : 0;  // one past the last block
  const bool capped = p.softcap > 0.f;
  // With softcap the capped scores already include the scale.
  const float sl2 = capped ? kLog2e : p.scale_log2;
  const float lse_mul = capped ? 1.f : p.scale;

  float acc_o[kDT][4];
#pragma unroll
  for (int i = 0; i < kDT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[i][e] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // running max of raw scores (rows g, g+8)
  float row_sum[2] = {0.f, 0.f};              // this thread's partial sum of exp

  const int wrow0 = warp * 16;  // warp's first row inside the tile

  if (n_blocks > 0) {
    load_tile_async<T, BR, D, NT>(sQ, LD, qg, q_stride, q0, Sq);
    load_tile_async<T, BC, D, NT>(sK, LD, kg, kv_stride, (n_blocks - 1) * BC, Sk);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    for (int n = n_blocks - 1; n >= n_first; --n) {
      const int k0 = n * BC;
      load_tile_async<T, BC, D, NT>(sV, LD, vg, kv_stride, k0, Sk);
      cp_async_commit();

      // ---- S = Q K^T (16 x BC per warp)
      float s[kNT][4];
#pragma unroll
      for (int i = 0; i < kNT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[i][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < D / KS; ++ks) {
        FragA a;
        Ops::load_a_rm(sQ, LD, wrow0, ks * KS, a);
#pragma unroll
        for (int np = 0; np < BC / 16; ++np) {
          FragB b0, b1;
          Ops::load_b2_nk(sK, LD, np * 16, ks * KS, b0, b1);
          Ops::mma(s[2 * np], a, b0);
          Ops::mma(s[2 * np + 1], a, b1);
        }
      }

      // ---- softcap (before masking: a masked score must stay -inf)
      if (capped) {
#pragma unroll
        for (int j = 0; j < kNT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[j][e] = p.softcap * tanhf(s[j][e] * p.cap_in);
      }

      // ---- mask: keys past Sk and keys outside the band (causal / window).
      // Block [k0, k0+BC) is fully visible to rows [q0, q0+BR) iff
      // k0 - (q0+BR-1) >= lo and (k0+BC-1) - q0 <= hi.
      const bool need_mask =
          (k0 + BC > Sk) ||
          (p.masked && (k0 - (q0 + BR - 1) < p.band_lo || k0 + BC - 1 - q0 > p.band_hi));
      if (need_mask) {
#pragma unroll
        for (int j = 0; j < kNT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = q0 + wrow0 + g + (e >> 1) * 8;
            const int col = k0 + j * 8 + 2 * t + (e & 1);
            const int dist = col - row;  // |dist| < 2^30 + BR
            const bool masked = col >= Sk || dist < p.band_lo || dist > p.band_hi;
            if (masked) s[j][e] = -INFINITY;
          }
      }

      // ---- online softmax (rows g and g+8 of the warp; a quad shares a row)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < kNT; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
        mx = quad_max(mx);
        const float m_new = fmaxf(row_max[r], mx);
        // A row that has seen only masked keys keeps m = -inf; subtract 0 then
        // so that exp2(-inf - m) is 0 and never NaN.
        const float m_scaled = m_new == -INFINITY ? 0.f : m_new * sl2;
        const float corr = fast_exp2(row_max[r] * sl2 - m_scaled);
        row_max[r] = m_new;
        row_sum[r] *= corr;
#pragma unroll
        for (int i = 0; i < kDT; ++i) {
          acc_o[i][2 * r] *= corr;
          acc_o[i][2 * r + 1] *= corr;
        }
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < kNT; ++j) {
          s[j][2 * r] = fast_exp2(fmaf(s[j][2 * r], sl2, -m_scaled));
          s[j][2 * r + 1] = fast_exp2(fmaf(s[j][2 * r + 1], sl2, -m_scaled));
          sum += s[j][2 * r] + s[j][2 * r + 1];
        }
        row_sum[r] += sum;
      }

      // V[n] has landed; every warp is done with K[n] -> prefetch K[n-1].
      cp_async_wait<0>();
      __syncthreads();
      if (n > n_first) {
        load_tile_async<T, BC, D, NT>(sK, LD, kg, kv_stride, k0 - BC, Sk);
        cp_async_commit();
      }

      // ---- O += P V (P from registers)
#pragma unroll
      for (int ks = 0; ks < BC / KS; ++ks) {
        FragA a;
        Ops::a_from_acc(s, ks, a);
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          FragB b0, b1;
          Ops::load_b2_kn_regA(sV, LD, dp * 16, ks * KS, b0, b1);
          Ops::mma(acc_o[2 * dp], a, b0);
          Ops::mma(acc_o[2 * dp + 1], a, b1);
        }
      }

      // K[n-1] has landed; every warp is done with V[n].
      cp_async_wait<0>();
      __syncthreads();
    }
  }

  // ---- epilogue
  float inv[2], lse_val[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(row_sum[r]);
    inv[r] = l > 0.f ? 1.f / l : 0.f;
    lse_val[r] = l > 0.f ? row_max[r] * lse_mul + logf(l) : -INFINITY;
  }
  // The warp reads only its own 16 rows of sQ, so it may reuse them as the
  // staging buffer for O without a CTA barrier.
  __syncwarp();
  T* sO = sQ + wrow0 * LD;
#pragma unroll
  for (int i = 0; i < kDT; ++i) {
    Ops::store2(sO + g * LD + i * 8 + 2 * t, acc_o[i][0] * inv[0], acc_o[i][1] * inv[0]);
    Ops::store2(sO + (g + 8) * LD + i * 8 + 2 * t, acc_o[i][2] * inv[1], acc_o[i][3] * inv[1]);
  }
  __syncwarp();
  constexpr int kEpc = 16 / sizeof(T);
  constexpr int kCpr = D / kEpc;
#pragma unroll
  for (int idx = lane; idx < 16 * kCpr; idx += 32) {
    const int r = idx / kCpr, c = idx % kCpr;
    const int row = q0 + wrow0 + r;
    if (row < Sq)
      *reinterpret_cast<uint4*>(og + row * q_stride + c * kEpc) =
          *reinterpret_cast<const uint4*>(sO + r * LD + c * kEpc);
  }
  if (t == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = q0 + wrow0 + g + 8 * r;
      if (row < Sq) lseg[row] = lse_val[r];
    }
  }
}

}  // namespace
}  // namespace cuda
}  // namespace flashgen
