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
//
// One kernel body, four variants (template parameter MODE, see FwdMode):
//   kFwdDense   the fast path above, unchanged.
//   kFwdExtras  dense + ALiBi / bias / mask / segment ids (extras.cuh): every
//               visited block evaluates them per element; the scores are
//               turned into log2 units (x*scale*log2e + add*log2e) before the
//               online softmax, which then runs with a multiplier of 1.
//   kFwdVarlen  packed variable-length batch: blockIdx.z is the sequence, its
//               rows/keys come from cu_seqlens (clamped on the device, never
//               trusted); blocks past the sequence's length exit at once.
//   kFwdPaged   paged KV cache: per key tile, threads 0..BC-1 look up the
//               physical cache row of each key in the block table (-1 for keys
//               past seqused_k or block ids outside [0, num_blocks)) into a
//               double-buffered shared array; the K/V cp.async loads read it
//               (-1: zero-filled) and the mask stage masks -1 keys. With
//               split-KV (nsplit > 1, blockIdx.z = b * nsplit + split) each
//               CTA walks one chunk of the key blocks and writes an f32
//               partial O and its lse to a workspace;
//               flash_fwd_combine_kernel merges them by log-sum-exp.
//   kFwdVarlenAlibi / kFwdPagedAlibi  varlen / paged + ALiBi: every visited
//               block is masked per element and gets -slope(b,h) *
//               |i + off_b - j| (off_b = bottom_right ? Sk_b - Sq_b : 0, the
//               sequence's own lengths); scores in log2 units as kFwdExtras.
//               Without ALiBi the varlen / paged modes above are unchanged.
#pragma once

#include "flashgen/cuda/common.cuh"
#include "flashgen/cuda/extras.cuh"

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

// Parameters of the variants (the dense fast path keeps FwdParams, unchanged).
struct FwdVarParams : FwdParams {
  // Raw attributes: varlen / paged compute the band per sequence on the device.
  int causal, bottom_right, window_left, window_right;
  ExtrasParams x;  // kFwdExtras; *Alibi modes: alibi / alibi_stride_b only
  // kFwdVarlen: seqlen_q / seqlen_k are the totals Tq / Tk, batch the number of sequences.
  const int* cu_q;
  const int* cu_k;
  int max_seqlen_q, max_seqlen_k;
  // kFwdPaged: k / v are the caches [num_blocks, block_size, Hkv, D]; seqlen_k = max keys.
  const int* block_table;  // [batch, max_blocks]
  const int* seqused_k;    // [batch]
  long long num_blocks;
  int block_size, max_blocks;
  int nsplit;       // >= 1; > 1: write partials to o_part / lse_part
  float* o_part;    // [nsplit, B, Hq, Sq, D] f32
  float* lse_part;  // [nsplit, B, Hq, Sq] f32
};

enum FwdMode : int {
  kFwdDense = 0,
  kFwdExtras = 1,
  kFwdVarlen = 2,
  kFwdPaged = 3,
  kFwdVarlenAlibi = 4,  // kFwdVarlen + ALiBi (FwdVarParams::x.alibi)
  kFwdPagedAlibi = 5,   // kFwdPaged + ALiBi
};
__host__ __device__ constexpr bool fwd_is_varlen(int mode) { return mode == kFwdVarlen || mode == kFwdVarlenAlibi; }
__host__ __device__ constexpr bool fwd_is_paged(int mode) { return mode == kFwdPaged || mode == kFwdPagedAlibi; }
template <int MODE>
using FwdParamsT = typename std::conditional<MODE == kFwdDense, FwdParams, FwdVarParams>::type;

// Tile shapes per (element type, q/k head dim D, v/o head dim DV). f16/bf16: 8 warps x 16 rows.
// Shared memory = BR * (max(D, DV) + pad) [Q, then the O staging] + BC * (D + pad) [K]
// + BC * (DV + pad) [V]; pad = 16 bytes per row (keeps ldmatrix and the fragment stores
// bank-conflict free).
template <class T, int D, int DV = D>
struct FwdConfig {
  static constexpr bool kF32 = std::is_same<T, float>::value;
  static constexpr int kDMax = D > DV ? D : DV;
  static constexpr int kWarps = kF32 ? 4 : 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int BR = kWarps * 16;
  static constexpr int BC = kF32 ? (kDMax <= 128 ? 64 : 32) : 64;
  static constexpr int kPad = 16 / static_cast<int>(sizeof(T));
  static constexpr int LD = D + kPad;    // row stride of the Q and K tiles
  static constexpr int LDV = DV + kPad;  // row stride of the V tile and the O staging
  static constexpr int kQRows = BR * (LD > LDV ? LD : LDV);  // elements of the Q / O staging region
  static constexpr size_t kSmem = (static_cast<size_t>(kQRows) + BC * LD + BC * LDV) * sizeof(T);
  static constexpr int kMinBlocks = (!kF32 && kDMax <= 64) ? 2 : 1;  // 2 CTAs/SM needs <= 128 regs
  static_assert(D % 32 == 0 && D >= 32 && D <= 256, "head dim must be a multiple of 32 in [32, 256]");
  static_assert(DV % 32 == 0 && DV >= 32 && DV <= 256, "value head dim must be a multiple of 32 in [32, 256]");
  static_assert(BC % 16 == 0 && D % 16 == 0, "tiles must be multiples of 16");
  static_assert(kSmem <= 166912, "exceeds the 163 KiB opt-in shared memory of sm_80");
};

// Paged KV: physical cache row of each key of tile n (keys [n*BC, n*BC + BC)),
// or -1 for keys >= Sk and keys whose block id is outside [0, num_blocks).
// Threads 0..BC-1 write rows[0..BC-1]; the caller orders it with a barrier.
template <int BC>
FG_DEV void paged_tile_rows(int* rows, int n, int Sk, const int* table_row, int block_size, long long num_blocks) {
  const int r = static_cast<int>(threadIdx.x);
  if (r < BC) {
    const int j = n * BC + r;
    int phys = -1;
    if (j < Sk) {
      const int blk = table_row[j / block_size];
      // num_blocks * block_size < 2^31 (checked by the handler): phys fits int.
      if (blk >= 0 && blk < num_blocks) phys = blk * block_size + j % block_size;
    }
    rows[r] = phys;
  }
}

// Gathers a ROWS x D tile of one kv head from a paged cache with cp.async
// (16-byte chunks): tile row r is cache row rows[r] (zero-filled when < 0).
template <class T, int ROWS, int D, int NT>
FG_DEV void load_tile_rows(T* s, int ld, const T* cache, int64_t row_stride, const int* rows) {
  constexpr int kEpc = 16 / sizeof(T);
  constexpr int kCpr = D / kEpc;
  constexpr int kTotal = ROWS * kCpr;
  // Not unrolled: an unrolled gather keeps every chunk's 64-bit address live
  // at once (register spills at large head dims).
#pragma unroll 1
  for (int it = 0; it < (kTotal + NT - 1) / NT; ++it) {
    const int idx = it * NT + static_cast<int>(threadIdx.x);
    if (kTotal % NT == 0 || idx < kTotal) {
      const int r = idx / kCpr, c = idx % kCpr;
      const int phys = rows[r];
      const bool ok = phys >= 0;
      const T* src = ok ? cache + static_cast<int64_t>(phys) * row_stride + c * kEpc : cache;
      cp_async_16(s + r * ld + c * kEpc, src, ok);
    }
  }
}

// Dynamic shared memory of one variant (the paged one adds the per-key flags).
template <class T, int D, int DV, int MODE>
constexpr size_t fwd_smem_bytes() {
  return FwdConfig<T, D, DV>::kSmem + (fwd_is_paged(MODE) ? 2 * FwdConfig<T, D, DV>::BC * sizeof(int) : 0);
}

// DV: the value head dim (v and o's last dim); only the dense and extras modes take DV != D.
template <class T, int D, int DV, bool CAUSAL, int MODE = kFwdDense>
__global__ void __launch_bounds__(FwdConfig<T, D, DV>::kThreads, FwdConfig<T, D, DV>::kMinBlocks)
    flash_fwd_kernel(const FwdParamsT<MODE> p) {
  using Cfg = FwdConfig<T, D, DV>;
  using Ops = typename OpsFor<T>::type;
  using FragA = typename Ops::FragA;
  using FragB = typename Ops::FragB;
  constexpr int BR = Cfg::BR, BC = Cfg::BC, LD = Cfg::LD, LDV = Cfg::LDV, NT = Cfg::kThreads;
  constexpr int KS = Ops::KS;
  constexpr int kNT = BC / 8;  // S accumulator tiles (8 keys each) per warp
  constexpr int kDT = DV / 8;  // O accumulator tiles (8 dims each) per warp
  constexpr bool kExtras = MODE == kFwdExtras;
  constexpr bool kPaged = fwd_is_paged(MODE);
  constexpr bool kVarlen = fwd_is_varlen(MODE);
  constexpr bool kAlibi = MODE == kFwdVarlenAlibi || MODE == kFwdPagedAlibi;
  // Scores in log2 units before the online softmax (multiplier 1).
  constexpr bool kLog2Units = kExtras || kAlibi;
  static_assert(!kPaged || NT >= BC, "paged_tile_rows needs a thread per key of the tile");
  static_assert(DV == D || MODE == kFwdDense || MODE == kFwdExtras, "varlen / paged need DV == D");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + Cfg::kQRows;
  T* sV = sK + BC * LD;
  // kFwdPaged: physical cache rows of the keys of tile n in sRows + (n & 1) * BC (-1: no key)
  int* sRows = reinterpret_cast<int*>(sV + BC * LDV);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  // Causal: the last query blocks have the most work; launch them first.
  const int mblk = CAUSAL ? static_cast<int>(gridDim.x - 1 - blockIdx.x) : static_cast<int>(blockIdx.x);
  const int h = blockIdx.y, hk = h / p.group;
  const int q0 = mblk * BR;
  int b = blockIdx.z, split = 0;
  if constexpr (kPaged) {
    b = static_cast<int>(blockIdx.z) / p.nsplit;
    split = static_cast<int>(blockIdx.z) - b * p.nsplit;
  }

  const int64_t q_stride = static_cast<int64_t>(p.heads_q) * D;    // between consecutive rows of q
  const int64_t o_stride = static_cast<int64_t>(p.heads_q) * DV;   // ... of o
  const int64_t kv_stride = static_cast<int64_t>(p.heads_kv) * D;  // ... of k
  const int64_t v_stride = static_cast<int64_t>(p.heads_kv) * DV;  // ... of v
  int Sq, Sk, band_lo, band_hi, band_masked;
  const T* qg;
  const T* kg;
  const T* vg;
  T* og;
  float* lseg;
  if constexpr (kVarlen) {
    // Sequence b (clamped: cu_seqlens live on the device and are not trusted).
    const SeqRange rq = seq_range(p.cu_q[b], p.cu_q[b + 1], p.seqlen_q, p.max_seqlen_q);
    const SeqRange rk = seq_range(p.cu_k[b], p.cu_k[b + 1], p.seqlen_k, p.max_seqlen_k);
    Sq = rq.len;
    Sk = rk.len;
    if (q0 >= Sq) return;  // the whole CTA: past this sequence's rows
    const IntBand bd = int_band(Sq, Sk, p.causal, p.bottom_right, p.window_left, p.window_right);
    band_lo = bd.lo;
    band_hi = bd.hi;
    band_masked = bd.masked;
    qg = static_cast<const T*>(p.q) + (static_cast<int64_t>(rq.start) * p.heads_q + h) * D;
    og = static_cast<T*>(p.o) + (static_cast<int64_t>(rq.start) * p.heads_q + h) * D;
    kg = static_cast<const T*>(p.k) + (static_cast<int64_t>(rk.start) * p.heads_kv + hk) * D;
    vg = static_cast<const T*>(p.v) + (static_cast<int64_t>(rk.start) * p.heads_kv + hk) * D;
    lseg = p.lse + static_cast<int64_t>(h) * p.seqlen_q + rq.start;  // lse [Hq, Tq]
  } else {
    Sq = p.seqlen_q;
    if constexpr (kPaged) {
      // Keys of batch b: seqused_k[b], clamped to what the table can hold.
      Sk = paged_seqlen_k(p.seqused_k[b], p.seqlen_k);
      const IntBand bd = int_band(Sq, Sk, p.causal, p.bottom_right, p.window_left, p.window_right);
      band_lo = bd.lo;
      band_hi = bd.hi;
      band_masked = bd.masked;
    } else {
      Sk = p.seqlen_k;
      band_lo = p.band_lo;
      band_hi = p.band_hi;
      band_masked = p.masked;
    }
    qg = static_cast<const T*>(p.q) + (static_cast<int64_t>(b) * Sq * p.heads_q + h) * D;
    if constexpr (kPaged) {
      kg = static_cast<const T*>(p.k) + static_cast<int64_t>(hk) * D;  // + physical row * kv_stride
      vg = static_cast<const T*>(p.v) + static_cast<int64_t>(hk) * D;
    } else {
      kg = static_cast<const T*>(p.k) + (static_cast<int64_t>(b) * Sk * p.heads_kv + hk) * D;
      vg = static_cast<const T*>(p.v) + (static_cast<int64_t>(b) * Sk * p.heads_kv + hk) * DV;
    }
    og = static_cast<T*>(p.o) + (static_cast<int64_t>(b) * Sq * p.heads_q + h) * DV;
    lseg = p.lse + (static_cast<int64_t>(b) * p.heads_q + h) * Sq;
  }
  const int* table_row = nullptr;
  if constexpr (kPaged) table_row = p.block_table + static_cast<int64_t>(b) * p.max_blocks;
  ExtrasView<T> xv;
  if constexpr (kExtras) xv.init(p.x, b, h, Sq, Sk);
  // ALiBi (varlen / paged): -slope * log2(e) and this sequence's offset.
  AlibiRow alibi{0.f, 0};
  if constexpr (kAlibi) alibi = alibi_row(p.x, b, h, Sq, Sk, p.bottom_right);

  // Keys this block needs: [kv_begin, kv_end) (the band of rows q0 .. q_last).
  const int q_last = min(q0 + BR, Sq) - 1;
  const long long kv_begin_ll = max(0LL, static_cast<long long>(q0) + band_lo);
  const long long kv_end_ll = min(static_cast<long long>(Sk), static_cast<long long>(q_last) + band_hi + 1);
  const int kv_begin = static_cast<int>(min(kv_begin_ll, static_cast<long long>(Sk)));
  const int kv_end = static_cast<int>(max(kv_end_ll, 0LL));
  int n_first = kv_begin / BC;
  int n_blocks = kv_end > kv_begin ? (kv_end + BC - 1) / BC : 0;  // one past the last block
  bool any_block = n_blocks > 0;
  if constexpr (kPaged) {
    if (p.nsplit > 1) {  // this CTA's chunk of the key blocks
      const BlockRange r = split_blocks(n_first, n_blocks, p.nsplit, split);
      n_first = r.lo;
      n_blocks = r.hi;
      any_block = r.hi > r.lo;
    }
  }
  const bool capped = p.softcap > 0.f;
  // With softcap the capped scores already include the scale. The extras and
  // ALiBi variants turn scores into log2 units before the softmax (multiplier 1).
  const float s_mul = capped ? kLog2e : p.scale_log2;
  const float sl2 = kLog2Units ? 1.f : s_mul;
  const float lse_mul = kLog2Units ? 0.6931471805599453f : (capped ? 1.f : p.scale);

  float acc_o[kDT][4];
#pragma unroll
  for (int i = 0; i < kDT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[i][e] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // running max of raw scores (rows g, g+8)
  // Extras / paged: whether rows g, g+8 met a key they see (a -inf bias masks it), so that
  // l == 0 tells a row without keys from one whose visible scores overflowed to -inf.
  bool seen[2] = {false, false};
  float row_sum[2] = {0.f, 0.f};              // this thread's partial sum of exp

  const int wrow0 = warp * 16;  // warp's first row inside the tile

  if (any_block) {
    load_tile_async<T, BR, D, NT>(sQ, LD, qg, q_stride, q0, Sq);
    if constexpr (kPaged) {
      int* rows = sRows + ((n_blocks - 1) & 1) * BC;
      paged_tile_rows<BC>(rows, n_blocks - 1, Sk, table_row, p.block_size, p.num_blocks);
      __syncthreads();
      load_tile_rows<T, BC, D, NT>(sK, LD, kg, kv_stride, rows);
    } else
      load_tile_async<T, BC, D, NT>(sK, LD, kg, kv_stride, (n_blocks - 1) * BC, Sk);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    for (int n = n_blocks - 1; n >= n_first; --n) {
      const int k0 = n * BC;
      if constexpr (kPaged)
        load_tile_rows<T, BC, DV, NT>(sV, LDV, vg, v_stride, sRows + (n & 1) * BC);
      else
        load_tile_async<T, BC, DV, NT>(sV, LDV, vg, v_stride, k0, Sk);
      cp_async_commit();
      // Rows of tile n-1 into the other buffer (its last readers finished before
      // the previous iteration's final barrier; the barrier below publishes it).
      if constexpr (kPaged) {
        if (n > n_first)
          paged_tile_rows<BC>(sRows + ((n - 1) & 1) * BC, n - 1, Sk, table_row, p.block_size, p.num_blocks);
      }

      // ---- S = Q K^T (16 x BC per warp)
      float s[kNT][4];
#pragma unroll
      for (int i = 0; i < kNT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[i][e] = 0.f;
      warp_gemm_abt<Ops, D, BC>(s, sQ, LD, wrow0, sK, LD, 0);

      // ---- softcap (before masking: a masked score must stay -inf)
      if (capped) {
#pragma unroll
        for (int j = 0; j < kNT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[j][e] = p.softcap * tanhf(s[j][e] * p.cap_in);
      }

      if constexpr (kExtras) {
        // ---- extras: every element; scores -> log2 units (x * s_mul + add * log2e)
#pragma unroll
        for (int j = 0; j < kNT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = q0 + wrow0 + g + (e >> 1) * 8;
            const int col = k0 + j * 8 + 2 * t + (e & 1);
            const int dist = col - row;
            float add = 0.f;
            bool vis = row < Sq && col < Sk && dist >= band_lo && dist <= band_hi;
            if (vis) vis = xv.term(row, col, add);
            seen[e >> 1] |= vis && add != -INFINITY;
            s[j][e] = vis ? fmaf(s[j][e], s_mul, add * kLog2e) : -INFINITY;
          }
      } else {
        // ---- mask: keys past Sk and keys outside the band (causal / window).
        // Block [k0, k0+BC) is fully visible to rows [q0, q0+BR) iff
        // k0 - (q0+BR-1) >= lo and (k0+BC-1) - q0 <= hi.
        // ALiBi: every block, visible scores -> log2 units plus the ALiBi term.
        const bool need_mask =
            kPaged || kAlibi || (k0 + BC > Sk) ||
            (band_masked && (k0 - (q0 + BR - 1) < band_lo || k0 + BC - 1 - q0 > band_hi));
        if (need_mask) {
#pragma unroll
          for (int j = 0; j < kNT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int row = q0 + wrow0 + g + (e >> 1) * 8;
              const int col = k0 + j * 8 + 2 * t + (e & 1);
              const int dist = col - row;  // |dist| < 2^30 + BR
              bool masked = col >= Sk || dist < band_lo || dist > band_hi;
              if constexpr (kPaged) {
                masked = masked || sRows[(n & 1) * BC + j * 8 + 2 * t + (e & 1)] < 0;
                seen[e >> 1] |= !masked;
              }
              if constexpr (kAlibi)
                s[j][e] = masked ? -INFINITY
                                 : fmaf(s[j][e], s_mul, alibi_term(alibi.neg_slope_l2, row, alibi.off, col));
              else if (masked)
                s[j][e] = -INFINITY;
            }
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
        if constexpr (kPaged)
          load_tile_rows<T, BC, D, NT>(sK, LD, kg, kv_stride, sRows + ((n - 1) & 1) * BC);
        else
          load_tile_async<T, BC, D, NT>(sK, LD, kg, kv_stride, k0 - BC, Sk);
        cp_async_commit();
      }

      // ---- O += P V (P from registers)
      warp_gemm_pb<Ops, BC, DV>(acc_o, s, sV, LDV, 0, 0);

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
    // A NaN l (a NaN or overflowed score) makes o and lse NaN, never 0. l == 0: the row
    // saw no key (o = 0, lse = -inf) or only -inf scores of keys it sees (an overflow, not
    // a mask): NaN as IEEE softmax. Without extras or paging the band alone says which.
    bool all_ninf;
    if constexpr (kExtras || kPaged) {
      const float seen_in_row = quad_sum(seen[r] ? 1.f : 0.f);  // every lane: a warp shuffle
      all_ninf = l == 0.f && seen_in_row > 0.f;
    } else {
      const long long row = q0 + wrow0 + g + 8 * r;
      all_ninf = l == 0.f && max(0LL, row + band_lo) < min(static_cast<long long>(Sk), row + band_hi + 1);
    }
    inv[r] = l != 0.f ? 1.f / l : all_ninf ? NAN : 0.f;
    lse_val[r] = l != 0.f ? row_max[r] * lse_mul + logf(l) : all_ninf ? NAN : -INFINITY;
  }
  if constexpr (kPaged) {
    if (p.nsplit > 1) {
      // Split-KV partial: f32 O (normalized by this chunk's l) and its lse.
      const int64_t prow0 = ((static_cast<int64_t>(split) * p.batch + b) * p.heads_q + h) * Sq;
      float* op = p.o_part + prow0 * D;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = q0 + wrow0 + g + 8 * r;
        if (row < Sq) {
#pragma unroll
          for (int i = 0; i < kDT; ++i)
            *reinterpret_cast<float2*>(op + static_cast<int64_t>(row) * D + i * 8 + 2 * t) =
                make_float2(acc_o[i][2 * r] * inv[r], acc_o[i][2 * r + 1] * inv[r]);
          if (t == 0) p.lse_part[prow0 + row] = lse_val[r];
        }
      }
      return;
    }
  }
  // O is staged in the Q region. With DV == D the warp reads only its own 16 rows of sQ,
  // so it may reuse them without a CTA barrier; with DV != D its staging rows (stride LDV)
  // overlap other warps' Q rows, which every warp finished reading at the key loop's final
  // barrier (and which nobody reads when the loop did not run).
  __syncwarp();
  T* sO = sQ + wrow0 * LDV;
#pragma unroll
  for (int i = 0; i < kDT; ++i) {
    Ops::store2(sO + g * LDV + i * 8 + 2 * t, acc_o[i][0] * inv[0], acc_o[i][1] * inv[0]);
    Ops::store2(sO + (g + 8) * LDV + i * 8 + 2 * t, acc_o[i][2] * inv[1], acc_o[i][3] * inv[1]);
  }
  __syncwarp();
  constexpr int kEpc = 16 / sizeof(T);
  constexpr int kCpr = DV / kEpc;
#pragma unroll
  for (int idx = lane; idx < 16 * kCpr; idx += 32) {
    const int r = idx / kCpr, c = idx % kCpr;
    const int row = q0 + wrow0 + r;
    if (row < Sq)
      *reinterpret_cast<uint4*>(og + row * o_stride + c * kEpc) =
          *reinterpret_cast<const uint4*>(sO + r * LDV + c * kEpc);
  }
  if (t == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = q0 + wrow0 + g + 8 * r;
      if (row < Sq) lseg[row] = lse_val[r];
    }
  }
}

// ---------------------------------------------------------------------------
// Split-KV combine: one warp per (b, h, i) row merges the nsplit partials by
// log-sum-exp (a partial with lse = -inf contributes nothing; all -inf: o = 0,
// lse = -inf; a NaN partial: NaN) into o [B, Sq, Hq, D] (T) and lse [B, Hq, Sq].
// ---------------------------------------------------------------------------
template <class T, int D>
__global__ void __launch_bounds__(256)
    flash_fwd_combine_kernel(const float* __restrict__ o_part, const float* __restrict__ lse_part,
                             T* __restrict__ o, float* __restrict__ lse, int nsplit, int batch, int heads_q,
                             int seqlen_q) {
  constexpr int kPer = D / 32;  // elements per lane
  const int lane = threadIdx.x & 31;
  const int64_t rows = static_cast<int64_t>(batch) * heads_q * seqlen_q;
  const int64_t warps_total = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; row < rows;
       row += warps_total) {
    // row = (b * Hq + h) * Sq + i
    const int64_t i = row % seqlen_q;
    const int64_t bh = row / seqlen_q;
    const int64_t hh = bh % heads_q;
    const int64_t bb = bh / heads_q;
    const LseMerge mg = lse_merge(lse_part + row, rows, nsplit);
    float acc[kPer];
#pragma unroll
    for (int e = 0; e < kPer; ++e) acc[e] = 0.f;
    if (mg.m != -INFINITY) {
      for (int sp = 0; sp < nsplit; ++sp) {
        const float w = lse_merge_weight(mg, lse_part[sp * rows + row]);
        if (w == 0.f) continue;
        const float* src = o_part + (sp * rows + row) * D;
#pragma unroll
        for (int e = 0; e < kPer; ++e) acc[e] = fmaf(w, src[e * 32 + lane], acc[e]);
      }
    }
    T* dst = o + ((bb * seqlen_q + i) * heads_q + hh) * D;
#pragma unroll
    for (int e = 0; e < kPer; ++e) dst[e * 32 + lane] = from_float<T>(acc[e]);
    if (lane == 0) lse[row] = mg.lse;
  }
}

// ---------------------------------------------------------------------------
// Varlen fill: rows of the packed q that no sequence computes (outside every
// [cu_q[b], cu_q[b+1]), or past max_seqlen_q inside one) get o = 0 and
// lse = -inf. One warp per row.
// ---------------------------------------------------------------------------
template <class T, int D>
__global__ void __launch_bounds__(256)
    flash_fwd_varlen_fill_kernel(const int* __restrict__ cu_q, int batch, int total_q, int max_seqlen_q,
                                 int heads_q, T* __restrict__ o, float* __restrict__ lse) {
  constexpr int kEpc = 16 / sizeof(T);
  const int lane = threadIdx.x & 31;
  const int64_t warps_total = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; r < total_q;
       r += warps_total) {
    if (row_covered(cu_q, batch, total_q, max_seqlen_q, static_cast<int>(r))) continue;
    const int64_t chunks = static_cast<int64_t>(heads_q) * D / kEpc;
    uint4* dst = reinterpret_cast<uint4*>(o + r * heads_q * D);
    for (int64_t c = lane; c < chunks; c += 32) dst[c] = make_uint4(0u, 0u, 0u, 0u);
    for (int hh = lane; hh < heads_q; hh += 32) lse[static_cast<int64_t>(hh) * total_q + r] = -INFINITY;
  }
}

}  // namespace
}  // namespace cuda
}  // namespace flashgen
