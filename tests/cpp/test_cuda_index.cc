// Host-side test of the pure index arithmetic of the CUDA variants
// (csrc/flashgen/cuda/extras.cuh): per-sequence visible band, clamped
// cu_seqlens ranges, the varlen grid/fill row coverage, split-KV chunking,
// the log-sum-exp merge of split partials and the per-sequence ALiBi offset
// and term of the varlen / paged kernels. No GPU needed:
//
//   g++ -std=c++17 -O2 -I/work/main/csrc tests/cpp/test_cuda_index.cc -o /tmp/t && /tmp/t
//
// The kernels call exactly these functions; what this cannot check is the
// device code around them (loads, mma, atomics) -- that needs a GPU run.
#include "flashgen/cuda/extras.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

using namespace flashgen;
using namespace flashgen::cuda;

static int g_failures = 0;
#define CHECK(cond, ...)                                      \
  do {                                                        \
    if (!(cond)) {                                            \
      if (++g_failures <= 20) {                               \
        std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
        std::printf(__VA_ARGS__);                             \
        std::printf("\n");                                    \
      }                                                       \
    }                                                         \
  } while (0)

// The README definition of visibility (causal / window, both alignments).
static bool visible_ref(int64_t i, int64_t j, int64_t sq, int64_t sk, bool causal, bool br, int wl, int wr) {
  const int64_t off = br ? sk - sq : 0;
  if (causal && j > i + off) return false;
  if (wl >= 0 && j < i + off - wl) return false;
  if (wr >= 0 && j > i + off + wr) return false;
  return true;
}

static void test_int_band() {
  int cases = 0;
  for (int sq = 0; sq <= 9; ++sq)
    for (int sk = 0; sk <= 9; ++sk)
      for (int causal = 0; causal < 2; ++causal)
        for (int br = 0; br < 2; ++br)
          for (int wl = -1; wl <= 4; ++wl)
            for (int wr = -1; wr <= 4; ++wr) {
              const IntBand b = int_band(sq, sk, causal, br, wl, wr);
              bool any_masked = false;
              for (int i = 0; i < sq; ++i)
                for (int j = 0; j < sk; ++j) {
                  const bool ref = visible_ref(i, j, sq, sk, causal, br, wl, wr);
                  const bool got = j - i >= b.lo && j - i <= b.hi;
                  any_masked |= !ref;
                  CHECK(ref == got, "sq=%d sk=%d causal=%d br=%d wl=%d wr=%d i=%d j=%d", sq, sk, causal, br, wl,
                        wr, i, j);
                }
              // masked may be conservative (1 when nothing is masked) but must be 1 when something is.
              CHECK(!any_masked || b.masked, "masked flag sq=%d sk=%d", sq, sk);
              ++cases;
            }
  // Extreme lengths stay inside int.
  const IntBand b = int_band(int64_t{1} << 30, int64_t{1} << 30, false, true, -1, -1);
  CHECK(b.lo == -((1 << 30) + 1) && b.hi == (1 << 30) + 1, "clamp lo=%d hi=%d", b.lo, b.hi);
  std::printf("int_band: %d cases\n", cases);
}

static void test_seq_range_and_coverage() {
  std::mt19937 rng(1234);
  int cases = 0;
  for (int iter = 0; iter < 4000; ++iter) {
    const int batch = rng() % 7;
    const bool valid = iter % 3 != 0;
    std::vector<int32_t> cu(batch + 1);
    int total;
    if (valid) {  // non-decreasing from 0, empty sequences allowed, cu[B] <= total
      cu[0] = 0;
      for (int b = 0; b < batch; ++b) cu[b + 1] = cu[b] + (rng() % 4 == 0 ? 0 : static_cast<int>(rng() % 9));
      total = cu[batch] + static_cast<int>(rng() % 4);
    } else {  // garbage: anything, including negative and past the end
      for (auto& c : cu) c = static_cast<int>(rng() % 41) - 10;
      total = static_cast<int>(rng() % 20);
    }
    const int max_len = iter % 5 == 0 ? static_cast<int>(rng() % 4) : 1 << 20;  // sometimes too small

    // Rows each sequence's CTAs write (the kernels' seq_range) and the fill kernel's rows.
    std::vector<int> written(total, 0);
    const int bm = 4;  // a small "BR" to exercise several row blocks
    const int grid_rows = std::min(max_len, total);
    for (int b = 0; b < batch; ++b) {
      const SeqRange r = seq_range(cu[b], cu[b + 1], total, max_len);
      CHECK(r.start >= 0 && r.len >= 0 && r.start + r.len <= total, "range b=%d start=%d len=%d total=%d", b,
            r.start, r.len, total);
      CHECK(r.len <= std::max(max_len, 0), "len %d > max_len %d", r.len, max_len);
      for (int mblk = 0; mblk * bm < grid_rows; ++mblk) {
        const int q0 = mblk * bm;
        if (q0 >= r.len) continue;  // early exit
        for (int i = q0; i < std::min(q0 + bm, r.len); ++i) written[r.start + i]++;
      }
    }
    for (int r = 0; r < total; ++r) {
      const bool cov = row_covered(cu.data(), batch, total, max_len, r);
      if (valid) {
        CHECK(cov == (written[r] > 0), "coverage row %d: covered=%d written=%d", r, cov, written[r]);
        CHECK(written[r] + (cov ? 0 : 1) == 1, "row %d written %d times (+fill %d)", r, written[r], !cov);
      }
    }
    ++cases;
  }
  std::printf("seq_range / row_covered: %d cases\n", cases);
}

static void test_split_blocks() {
  int cases = 0;
  for (int first = 0; first < 6; ++first)
    for (int end = 0; end < 40; ++end)
      for (int ns = 1; ns <= 12; ++ns) {
        std::vector<int> hit(64, 0);
        int prev_hi = -1;
        for (int s = 0; s < ns; ++s) {
          const BlockRange r = split_blocks(first, end, ns, s);
          CHECK(r.lo <= r.hi, "lo>hi");
          if (r.lo < r.hi) {
            CHECK(r.lo >= first && r.hi <= end, "outside");
            CHECK(prev_hi < 0 || r.lo == prev_hi, "chunks not contiguous");
            prev_hi = r.hi;
          }
          for (int n = r.lo; n < r.hi; ++n) hit[n]++;
        }
        for (int n = 0; n < 64; ++n) CHECK(hit[n] == (n >= first && n < end ? 1 : 0), "block %d hit %d", n, hit[n]);
        ++cases;
      }
  for (int64_t ctas : {1, 3, 32, 100, 132, 264, 1000})
    for (int64_t kb : {1, 4, 64, 1000})
      for (int occ : {1, 2}) {
        const int n = choose_nsplit(ctas, kb, 132, occ);
        CHECK(n >= 1 && n <= kMaxSplits, "nsplit %d", n);
        if (ctas * 2 > 132 * occ) CHECK(n == 1, "split with a full grid");
        CHECK(n == 1 || n <= (kb + 3) / 4, "chunks below 4 blocks");
      }
  std::printf("split_blocks / choose_nsplit: %d cases\n", cases);
}

// Split-KV end to end on one row: partials (normalized o, lse) per chunk of
// key blocks, merged with lse_merge, against the unsplit softmax.
static void test_lse_merge() {
  std::mt19937 rng(77);
  std::normal_distribution<double> nd(0.0, 3.0);
  int cases = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    const int bc = 4, dim = 3;
    const int keys = static_cast<int>(rng() % 40);
    const int nblocks = (keys + bc - 1) / bc;
    const int ns = 1 + static_cast<int>(rng() % 9);
    const int mask_mode = iter % 4;  // 0: none, 1: random, 2: all masked, 3: a masked prefix
    std::vector<double> s(keys), v(keys * dim);
    for (int j = 0; j < keys; ++j) {
      s[j] = nd(rng);
      if ((mask_mode == 1 && rng() % 3 == 0) || mask_mode == 2 || (mask_mode == 3 && j < keys / 2))
        s[j] = -INFINITY;
      for (int d = 0; d < dim; ++d) v[j * dim + d] = nd(rng);
    }
    // reference
    double m = -INFINITY;
    for (double x : s) m = std::max(m, x);
    double l = 0, o_ref[dim] = {0, 0, 0};
    if (m != -INFINITY)
      for (int j = 0; j < keys; ++j) {
        const double p = std::exp(s[j] - m);
        l += p;
        for (int d = 0; d < dim; ++d) o_ref[d] += p * v[j * dim + d];
      }
    const double lse_ref = l > 0 ? m + std::log(l) : -INFINITY;
    // partials, as the split kernel writes them (o normalized by its own l; empty: o 0, lse -inf)
    std::vector<float> lse_part(ns), o_part(ns * dim);
    for (int sp = 0; sp < ns; ++sp) {
      const BlockRange r = split_blocks(0, nblocks, ns, sp);
      double mm = -INFINITY;
      for (int j = r.lo * bc; j < std::min(r.hi * bc, keys); ++j) mm = std::max(mm, s[j]);
      double ll = 0, oo[dim] = {0, 0, 0};
      if (mm != -INFINITY)
        for (int j = r.lo * bc; j < std::min(r.hi * bc, keys); ++j) {
          const double p = std::exp(s[j] - mm);
          ll += p;
          for (int d = 0; d < dim; ++d) oo[d] += p * v[j * dim + d];
        }
      lse_part[sp] = ll > 0 ? static_cast<float>(mm + std::log(ll)) : -INFINITY;
      for (int d = 0; d < dim; ++d) o_part[sp * dim + d] = ll > 0 ? static_cast<float>(oo[d] / ll) : 0.f;
    }
    const LseMerge mg = lse_merge(lse_part.data(), 1, ns);
    float o[dim] = {0, 0, 0};
    for (int sp = 0; sp < ns; ++sp) {
      const float w = lse_merge_weight(mg, lse_part[sp]);
      for (int d = 0; d < dim; ++d) o[d] += w * o_part[sp * dim + d];
    }
    if (lse_ref == -INFINITY) {
      CHECK(mg.lse == -INFINITY, "lse %g, want -inf", mg.lse);
      for (int d = 0; d < dim; ++d) CHECK(o[d] == 0.f, "o %g, want 0", o[d]);
    } else {
      CHECK(std::fabs(mg.lse - lse_ref) <= 1e-5 * (1 + std::fabs(lse_ref)), "lse %g vs %g", mg.lse, lse_ref);
      for (int d = 0; d < dim; ++d) {
        const double ref = o_ref[d] / l;
        CHECK(std::fabs(o[d] - ref) <= 1e-5 * (1 + std::fabs(ref)) * 8, "o %g vs %g", o[d], ref);
      }
    }
    ++cases;
  }
  std::printf("lse_merge: %d cases\n", cases);
}

// ALiBi of the varlen / paged kernels: per-sequence offset from the clamped
// lengths (varlen: seq_range; paged: paged_seqlen_k), the term
// -slope * |i + off - j| against a double reference, the int range at the
// 2^30 limits, and split-KV with ALiBi in log2 units (the kernels' lse_mul
// = ln 2) merged by lse_merge against the natural-log reference lse.
static double alibi_ref(double slope, int64_t i, int64_t off, int64_t j) {
  return -slope * std::fabs(static_cast<double>(i + off - j));
}

static void test_alibi() {
  std::mt19937 rng(4242);
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  int cases = 0;
  // Varlen: every sequence's offset uses its own clamped lengths.
  for (int iter = 0; iter < 2000; ++iter) {
    const int batch = 1 + static_cast<int>(rng() % 6);
    const bool valid = iter % 4 != 0;
    std::vector<int32_t> cu_q(batch + 1), cu_k(batch + 1);
    int tq, tk;
    if (valid) {
      cu_q[0] = cu_k[0] = 0;
      for (int b = 0; b < batch; ++b) {
        cu_q[b + 1] = cu_q[b] + static_cast<int>(rng() % 9);
        cu_k[b + 1] = cu_k[b] + static_cast<int>(rng() % 12);
      }
      tq = cu_q[batch];
      tk = cu_k[batch];
    } else {
      for (auto& c : cu_q) c = static_cast<int>(rng() % 41) - 10;
      for (auto& c : cu_k) c = static_cast<int>(rng() % 41) - 10;
      tq = static_cast<int>(rng() % 20);
      tk = static_cast<int>(rng() % 20);
    }
    const int max_q = iter % 5 == 0 ? static_cast<int>(rng() % 4) : 1 << 20;
    const int max_k = iter % 7 == 0 ? static_cast<int>(rng() % 4) : 1 << 20;
    for (int b = 0; b < batch; ++b) {
      const SeqRange rq = seq_range(cu_q[b], cu_q[b + 1], tq, max_q);
      const SeqRange rk = seq_range(cu_k[b], cu_k[b + 1], tk, max_k);
      const float slope = ud(rng);
      for (int br = 0; br < 2; ++br) {
        const int off = alibi_offset(rq.len, rk.len, br);
        CHECK(off == (br ? rk.len - rq.len : 0), "offset b=%d br=%d", b, br);
        // Bottom-right causal: the diagonal key j = i + off is the band's edge and has term 0.
        const IntBand band = int_band(rq.len, rk.len, true, br, -1, -1);
        CHECK(band.hi == off, "band hi %d != alibi offset %d", band.hi, off);
        for (int i = 0; i < rq.len; ++i)
          for (int j = 0; j < rk.len; ++j) {
            const float got = alibi_term(-slope, i, off, j);
            const double want = alibi_ref(slope, i, off, j);
            CHECK(std::fabs(got - want) <= 1e-6 * (1.0 + std::fabs(want)), "term i=%d j=%d off=%d: %g vs %g", i,
                  j, off, got, want);
            if (j == i + off) CHECK(got == 0.f, "diagonal term %g", got);
          }
        ++cases;
      }
    }
  }
  // Paged: Sq from q, Sk = clamped seqused_k[b].
  for (int used : {-5, 0, 1, 7, 64, 65, 1000})
    for (int max_keys : {0, 1, 64, 256})
      for (int sq : {1, 4, 9}) {
        const int sk = paged_seqlen_k(used, max_keys);
        CHECK(sk == std::max(0, std::min(used, max_keys)), "paged sk %d", sk);
        CHECK(alibi_offset(sq, sk, 1) == sk - sq && alibi_offset(sq, sk, 0) == 0, "paged offset");
        ++cases;
      }
  // The 2^30 limits: i + off - j stays inside int and the term is exact enough.
  {
    const int lim = 1 << 30;
    struct Case { int sq, sk, i, j; };
    const Case cs[] = {{1, lim, 0, 0}, {1, lim, 0, lim - 1}, {lim, 1, lim - 1, 0}, {lim, 1, 0, 0},
                       {lim, lim, 0, lim - 1}, {lim, lim, lim - 1, 0}};
    for (const Case& c : cs)
      for (int br = 0; br < 2; ++br) {
        const int off = alibi_offset(c.sq, c.sk, br);
        const double want = alibi_ref(0.5, c.i, off, c.j);
        const float got = alibi_term(-0.5f, c.i, off, c.j);
        CHECK(std::fabs(got - want) <= 1e-6 * std::fabs(want) + 1e-6, "limit sq=%d sk=%d i=%d j=%d br=%d: %g vs %g",
              c.sq, c.sk, c.i, c.j, br, got, want);
        ++cases;
      }
  }
  // Split-KV + ALiBi on one row, as the paged kernel computes it: scores in
  // log2 units x*scale*log2e + alibi_term(-slope*log2e, ...), per chunk
  // m = max, l = sum exp2(score - m), lse = m * ln2 + log(l); merged by
  // lse_merge against the natural-log reference.
  {
    constexpr double kL2e = 1.4426950408889634;
    std::normal_distribution<double> nd(0.0, 2.0);
    for (int iter = 0; iter < 2000; ++iter) {
      const int bc = 4;
      const int sk = static_cast<int>(rng() % 40);
      const int sq = 1 + static_cast<int>(rng() % 4);
      const int i = static_cast<int>(rng() % sq);
      const bool br = rng() % 2;
      const int off = alibi_offset(sq, sk, br);
      const float slope = ud(rng) * 2.f, scale = 0.125f + ud(rng);
      std::vector<float> s(sk);
      for (auto& x : s) x = static_cast<float>(nd(rng));
      // Reference (causal bottom-right or none; the row may see nothing).
      double mref = -INFINITY;
      std::vector<double> sc(sk);
      std::vector<bool> vis(sk);
      for (int j = 0; j < sk; ++j) {
        vis[j] = !br || j <= i + off;
        sc[j] = scale * s[j] + alibi_ref(slope, i, off, j);
        if (vis[j]) mref = std::max(mref, sc[j]);
      }
      double lref = 0.0;
      for (int j = 0; j < sk; ++j)
        if (vis[j]) lref += std::exp(sc[j] - mref);
      const double lse_ref = lref > 0 ? mref + std::log(lref) : -INFINITY;
      const int nblocks = (sk + bc - 1) / bc;
      const int ns = 1 + static_cast<int>(rng() % 6);
      std::vector<float> part(ns);
      const float neg_l2 = -slope * static_cast<float>(kL2e), s_mul = scale * static_cast<float>(kL2e);
      for (int sp = 0; sp < ns; ++sp) {
        const BlockRange r = split_blocks(0, nblocks, ns, sp);
        float m = -INFINITY, l = 0.f;
        for (int j = r.lo * bc; j < std::min(r.hi * bc, sk); ++j)
          if (vis[j]) m = std::max(m, std::fma(s[j], s_mul, alibi_term(neg_l2, i, off, j)));
        for (int j = r.lo * bc; j < std::min(r.hi * bc, sk); ++j)
          if (vis[j]) l += std::exp2(std::fma(s[j], s_mul, alibi_term(neg_l2, i, off, j)) - m);
        part[sp] = l > 0.f ? m * 0.6931471805599453f + std::log(l) : -INFINITY;
      }
      const LseMerge mg = lse_merge(part.data(), 1, ns);
      if (lse_ref == -INFINITY)
        CHECK(mg.lse == -INFINITY, "lse %g, want -inf", mg.lse);
      else
        CHECK(std::fabs(mg.lse - lse_ref) <= 1e-4 * (1.0 + std::fabs(lse_ref)), "split alibi lse %g vs %g", mg.lse,
              lse_ref);
      ++cases;
    }
  }
  std::printf("alibi offset / term / split: %d cases\n", cases);
}

int main() {
  test_int_band();
  test_seq_range_and_coverage();
  test_split_blocks();
  test_lse_merge();
  test_alibi();
  if (g_failures) {
    std::printf("%d FAILURES\n", g_failures);
    return 1;
  }
  std::printf("all passed\n");
  return 0;
}
