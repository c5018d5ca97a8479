// Standalone test of csrc/flashgen/cpu/flash_cpu.h against a naive
// double-precision reference.
//
//   g++ -std=c++17 -O3 -march=native -I/work/main/csrc tests/cpp/test_flash_cpu.cc -o /tmp/t -pthread && /tmp/t
//
// Inputs are random, rounded to the tested type T; the reference works in double
// on those rounded values (the backward reference also uses the o that the
// kernel returned, since o is an input of the backward). Tolerance per element:
//   f32      : |out - ref| <= 1e-5*|ref|       + 1e-5*mag
//   bf16/f16 : |out - ref| <= 2 ulp_T(|ref|)   + 1e-5*mag
//   bf16 o, dq, dk, dv on the vdpbf16ps path (fc::detail::kBf16Dot, AVX512_BF16
//              hosts): P and dS are rounded to bf16 before the products that
//              take them, so + 2^-8*mag (the rounding bound is 2^-9*mag; build
//              with -DFLASHGEN_CPU_NO_BF16_DOT to test the fp32 path there)
// where mag is the same sum as ref taken over absolute values of every term
// (e.g. sum_j p_ij |v_jd| for o; sum_j scale p_ij (|dp_ij| + |D_i|) |k_jd| for
// dq, with |dp| and |D| themselves sums of absolute products): fp32
// accumulation error is bounded by a small multiple of eps_f32 * mag, and an
// exactly-zero gradient (e.g. a row that sees a single key) must come out tiny.
//   lse (f32 always): |out - ref| <= 1e-5*(1 + |ref|); -inf must match exactly.
// Outputs are poisoned with NaN before every call, so an unwritten element fails.
// Variants (one general double reference, same tolerance model): ALiBi [H] and
// [B, H], bias f32 / T with every broadcast combination (+ dbias, compared like
// the other gradients with mag = sum p (|dp| + |D|)), masks with fully masked
// rows, packed and random segment ids (a q segment without keys), combined with
// causal / window / softcap / GQA; packed varlen forward + backward (empty
// sequences, Sq != Sk, both alignments, padding rows); paged KV (shuffled block
// tables whose unused entries are out of range, seqused_k < capacity and 0,
// block sizes 16, 48 and 256) and split-KV decode (no split, auto, forced);
// ALiBi ([H] and [B, H] slopes) in varlen (fwd + bwd) and paged (incl. split-KV).
// Also checks the scalar bf16/f16 conversions against an exact reference, the
// 32-bit transpose, parallel_for on the own pool and on Workers whose
// helpers start late, run inline, or never start, and that a call made again
// takes no fresh pages for its buffers.
#include "flashgen/cpu/flash_cpu.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <thread>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#if defined(__GLIBC__)
#include <malloc.h>
#include <sys/resource.h>
#endif
#include <string>
#include <vector>

using flashgen::AttentionAttrs;
using flashgen::AttentionShape;
namespace fc = flashgen::cpu;

static int g_pass = 0, g_fail = 0;

// ---------------------------------------------------------------------------
// Type helpers.
// ---------------------------------------------------------------------------
template <typename T>
struct Traits;
template <>
struct Traits<float> {
  static const char* name() { return "f32"; }
  static float to(float x) { return x; }
  static float from(float x) { return x; }
  static float nan() { return std::numeric_limits<float>::quiet_NaN(); }
  static int mant() { return 23; }
  static int emin() { return -126; }
};
template <>
struct Traits<fc::bf16> {
  static const char* name() { return "bf16"; }
  static float to(fc::bf16 x) { return fc::detail::bf16_bits_to_f32(x.bits); }
  static fc::bf16 from(float x) { return fc::bf16{fc::detail::f32_to_bf16_bits(x)}; }
  static fc::bf16 nan() { return fc::bf16{0x7fc0}; }
  static int mant() { return 7; }
  static int emin() { return -126; }
};
template <>
struct Traits<fc::f16> {
  static const char* name() { return "f16"; }
  static float to(fc::f16 x) { return fc::detail::f16_bits_to_f32(x.bits); }
  static fc::f16 from(float x) { return fc::f16{fc::detail::f32_to_f16_bits(x)}; }
  static fc::f16 nan() { return fc::f16{0x7e00}; }
  static int mant() { return 10; }
  static int emin() { return -14; }
};

template <typename T>
double ulp_of(double x) {
  int e;
  std::frexp(std::fabs(x), &e);  // |x| = m * 2^e, m in [0.5, 1)
  e -= 1;
  if (x == 0.0 || e < Traits<T>::emin()) e = Traits<T>::emin();
  return std::ldexp(1.0, e - Traits<T>::mant());
}

// ---------------------------------------------------------------------------
// Conversion tests (exact references built from double arithmetic).
// ---------------------------------------------------------------------------
static double decode_half(uint16_t h) {
  const int sign = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v;
  if (e == 31) v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (e == 0) v = std::ldexp(double(m), -24);
  else v = std::ldexp(double(1024 + m), e - 25);
  return sign ? -v : v;
}

// Round x (finite) to a format with `mant` mantissa bits, min normal exponent
// emin, overflow threshold ovf (values >= ovf become inf), RNE.
static double round_ref(double x, int mant, int emin, double ovf) {
  const double ax = std::fabs(x);
  double r;
  if (ax >= ovf) {
    r = std::numeric_limits<double>::infinity();
  } else if (ax == 0) {
    r = 0;
  } else {
    int e;
    std::frexp(ax, &e);
    e -= 1;
    if (e < emin) e = emin;
    const double u = std::ldexp(1.0, e - mant);
    r = std::nearbyint(ax / u) * u;
  }
  return std::signbit(x) ? -r : r;
}

static bool same_value(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return a == b && std::signbit(a) == std::signbit(b);
}

static void check(bool ok, const std::string& what) {
  if (ok) ++g_pass;
  else ++g_fail;
  std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
}

static void test_conversions() {
  namespace d = fc::detail;
  // f16 -> f32, all 65536 patterns, soft and default path.
  int bad = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    const double ref = decode_half(uint16_t(h));
    if (!same_value(d::f16_bits_to_f32_soft(uint16_t(h)), ref)) ++bad;
    if (!same_value(d::f16_bits_to_f32(uint16_t(h)), ref)) ++bad;
    float buf[8];
    fc::f16 hs[8];
    for (int i = 0; i < 8; ++i) hs[i] = fc::f16{uint16_t(h)};
    d::load_f32<fc::f16>(hs, buf, 8);
    if (!same_value(buf[7], ref)) ++bad;
  }
  check(bad == 0, "f16->f32 exhaustive (" + std::to_string(bad) + " mismatches)");

  // bf16 -> f32, all patterns.
  bad = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    uint32_t u = h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    if (!same_value(d::bf16_bits_to_f32(uint16_t(h)), f)) ++bad;
  }
  check(bad == 0, "bf16->f32 exhaustive (" + std::to_string(bad) + " mismatches)");

  // f32 -> f16 / bf16: special values, all halfway points near f16 boundaries, random bits.
  std::vector<uint32_t> pats = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u,
                                0x7f800001u, 0x00000001u, 0x007fffffu, 0x00800000u, 0x477fe000u, 0x477ff000u,
                                0x477fefffu, 0x477ff001u, 0x47800000u, 0x33000000u, 0x33000001u, 0x33400000u,
                                0x387fc000u, 0x387fe000u, 0x387fffffu, 0x38800000u, 0x7f7fffffu, 0x7f7f8000u,
                                0x7f7f7fffu, 0x3f808000u, 0x3f818000u, 0x3f800fffu, 0x3f801000u, 0x3f803000u};
  for (uint32_t h = 0; h < 65536; ++h) {  // halfway points between adjacent halfs, and +-1 bit
    const double a = decode_half(uint16_t(h)), b = decode_half(uint16_t(h + 1));
    if (std::isnan(a) || std::isnan(b) || std::isinf(a) || std::isinf(b) || (h & 0x7fff) == 0x7fff) continue;
    float mid = float((a + b) / 2);
    uint32_t u;
    std::memcpy(&u, &mid, 4);
    pats.push_back(u);
    pats.push_back(u + 1);
    pats.push_back(u - 1);
  }
  std::mt19937_64 rng(123);
  for (int i = 0; i < 2000000; ++i) pats.push_back(uint32_t(rng()));
  int bad16 = 0, bad16s = 0, badb = 0, badbulk = 0;
  for (uint32_t u : pats) {
    float f;
    std::memcpy(&f, &u, 4);
    double r16, rb;
    if (std::isnan(f)) {
      r16 = rb = std::numeric_limits<double>::quiet_NaN();
    } else {
      r16 = round_ref(f, 10, -14, 65520.0);
      rb = round_ref(f, 7, -126, std::ldexp(2.0 - std::ldexp(1.0, -8), 127));
    }
    const uint16_t h = d::f32_to_f16_bits(f), hs = d::f32_to_f16_bits_soft(f);
    if (!same_value(decode_half(h), r16) || (std::isnan(f) && ((h >> 15) != (u >> 31)))) ++bad16;
    if (!same_value(decode_half(hs), r16) || (std::isnan(f) && ((hs >> 15) != (u >> 31)))) ++bad16s;
    const uint16_t bb = d::f32_to_bf16_bits(f);
    if (!same_value(d::bf16_bits_to_f32(bb), rb) || (std::isnan(f) && ((bb >> 15) != (u >> 31)))) ++badb;
    float src[9];
    fc::f16 dh[9];
    fc::bf16 db[9];
    for (int k = 0; k < 9; ++k) src[k] = f;
    d::store_from_f32<fc::f16>(src, dh, 9, 1.0f);
    d::store_from_f32<fc::bf16>(src, db, 9, 1.0f);
    if (!same_value(decode_half(dh[0].bits), r16) || !same_value(decode_half(dh[8].bits), r16)) ++badbulk;
    if (!same_value(d::bf16_bits_to_f32(db[0].bits), rb)) ++badbulk;
  }
  check(bad16 == 0, "f32->f16 RNE (" + std::to_string(pats.size()) + " values, " + std::to_string(bad16) + " bad)");
  check(bad16s == 0, "f32->f16 RNE soft path (" + std::to_string(bad16s) + " bad)");
  check(badb == 0, "f32->bf16 RNE (" + std::to_string(badb) + " bad)");
  check(badbulk == 0, "bulk f32->f16/bf16 (" + std::to_string(badbulk) + " bad)");
}

// ---------------------------------------------------------------------------
// Attention reference (double) and comparison.
// ---------------------------------------------------------------------------
struct Cfg {
  int64_t B, Sq, Sk, Hq, Hkv;
  bool causal, br;
  float key_growth = 0.0f;  // key row j scaled by 1 + key_growth * j: each key block raises the scores' max
};

struct Err {
  double max_abs = 0, worst_ratio = 0;  // worst |err| / tol
  bool ok = true;
};

template <typename T>
static void compare(const std::vector<T>& out, const std::vector<double>& ref, const std::vector<double>& mag,
                    Err& e, double mag_tol = 1e-5) {
  for (size_t i = 0; i < ref.size(); ++i) {
    const double o = Traits<T>::to(out[i]);
    const double err = std::fabs(o - ref[i]);
    double tol = std::is_same<T, float>::value ? 1e-5 * std::fabs(ref[i]) : 2.0 * ulp_of<T>(ref[i]);
    tol += mag_tol * mag[i] + 1e-30;
    if (!(err <= tol)) e.ok = false;
    if (!(err == err)) e.max_abs = std::numeric_limits<double>::infinity();
    else e.max_abs = std::max(e.max_abs, err);
    e.worst_ratio = std::max(e.worst_ratio, err == err ? err / tol : 1e9);
  }
}

static void compare_lse(const std::vector<float>& out, const std::vector<double>& ref, Err& e) {
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i])) {
      if (!(out[i] == ref[i])) e.ok = false;
      continue;
    }
    const double err = std::fabs(double(out[i]) - ref[i]);
    const double tol = 1e-5 * (1.0 + std::fabs(ref[i]));
    if (!(err <= tol)) e.ok = false;
    e.max_abs = err == err ? std::max(e.max_abs, err) : std::numeric_limits<double>::infinity();
    e.worst_ratio = std::max(e.worst_ratio, err == err ? err / tol : 1e9);
  }
}

struct DtypeSummary {
  double o = 0, lse = 0, dq = 0, dk = 0, dv = 0;
};
static DtypeSummary g_sum[3];

template <typename T>
static int type_index() {
  return std::is_same<T, float>::value ? 0 : std::is_same<T, fc::bf16>::value ? 1 : 2;
}

template <typename T, int D>
static void run_case(const Cfg& c, int nt, std::mt19937_64& rng, fc::Workers* workers = nullptr) {
  const int64_t B = c.B, Sq = c.Sq, Sk = c.Sk, Hq = c.Hq, Hkv = c.Hkv;
  AttentionShape s{B, Sq, Sk, Hq, Hkv, D};
  AttentionAttrs a{float(1.0 / std::sqrt(double(D))), c.causal, c.br};
  const int64_t nq = B * Sq * Hq * D, nk = B * Sk * Hkv * D, nl = B * Hq * Sq;
  std::uniform_real_distribution<float> U(-2.0f, 2.0f);
  std::vector<T> q(nq), k(nk), v(nk), dout(nq);
  for (auto& x : q) x = Traits<T>::from(U(rng));
  for (int64_t i = 0; i < nk; ++i) k[i] = Traits<T>::from(U(rng) * (1.0f + c.key_growth * float(i / (Hkv * D) % Sk)));
  for (auto& x : v) x = Traits<T>::from(U(rng));
  for (auto& x : dout) x = Traits<T>::from(U(rng));
  std::vector<T> o(nq, Traits<T>::nan()), dq(nq, Traits<T>::nan()), dk(nk, Traits<T>::nan()),
      dv(nk, Traits<T>::nan());
  std::vector<float> lse(nl, std::numeric_limits<float>::quiet_NaN());

  fc::attention_fwd<T, D>(q.data(), k.data(), v.data(), o.data(), lse.data(), s, a, nt, workers);
  fc::attention_bwd<T, D>(q.data(), k.data(), v.data(), o.data(), lse.data(), dout.data(), dq.data(), dk.data(),
                          dv.data(), s, a, nt, workers);

  // Reference.
  std::vector<double> ro(nq, 0.0), rlse(nl), rdq(nq, 0.0), rdk(nk, 0.0), rdv(nk, 0.0);
  std::vector<double> mo(nq, 0.0), mdq(nq, 0.0), mdk(nk, 0.0), mdv(nk, 0.0);  // magnitudes
  const int64_t off = c.br ? Sk - Sq : 0;
  const int64_t G = Hq / Hkv;
  std::vector<double> sc(std::max<int64_t>(Sk, 1)), p(std::max<int64_t>(Sk, 1)), qi(D), doi(D);
  auto Q = [&](int64_t b, int64_t i, int64_t h, int d) { return double(Traits<T>::to(q[((b * Sq + i) * Hq + h) * D + d])); };
  auto K = [&](int64_t b, int64_t j, int64_t h, int d) { return double(Traits<T>::to(k[((b * Sk + j) * Hkv + h) * D + d])); };
  auto V = [&](int64_t b, int64_t j, int64_t h, int d) { return double(Traits<T>::to(v[((b * Sk + j) * Hkv + h) * D + d])); };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / G;
      for (int64_t i = 0; i < Sq; ++i) {
        int64_t nvis = Sk;
        if (c.causal) nvis = std::max<int64_t>(0, std::min<int64_t>(Sk, i + off + 1));
        const int64_t base = ((b * Sq + i) * Hq + h) * D;
        const int64_t li = (b * Hq + h) * Sq + i;
        if (nvis == 0) {
          rlse[li] = -std::numeric_limits<double>::infinity();
          continue;  // o = 0, dq = 0
        }
        for (int d = 0; d < D; ++d) qi[d] = Q(b, i, h, d), doi[d] = Traits<T>::to(dout[base + d]);
        double m = -1e300;
        for (int64_t j = 0; j < nvis; ++j) {
          double acc = 0;
          for (int d = 0; d < D; ++d) acc += qi[d] * K(b, j, hk, d);
          sc[j] = acc * a.scale;
          m = std::max(m, sc[j]);
        }
        double l = 0;
        for (int64_t j = 0; j < nvis; ++j) l += (p[j] = std::exp(sc[j] - m));
        for (int64_t j = 0; j < nvis; ++j) p[j] /= l;
        rlse[li] = m + std::log(l);
        for (int d = 0; d < D; ++d) {
          double acc = 0, mag = 0;
          for (int64_t j = 0; j < nvis; ++j) acc += p[j] * V(b, j, hk, d), mag += p[j] * std::fabs(V(b, j, hk, d));
          ro[base + d] = acc;
          mo[base + d] = mag;
        }
        // Backward, with the o the kernel produced.
        double Di = 0, Dmag = 0;
        for (int d = 0; d < D; ++d) {
          const double od = Traits<T>::to(o[base + d]);
          Di += doi[d] * od;
          Dmag += std::fabs(doi[d] * od);
        }
        for (int64_t j = 0; j < nvis; ++j) {
          double dp = 0, dpmag = 0;
          for (int d = 0; d < D; ++d) dp += doi[d] * V(b, j, hk, d), dpmag += std::fabs(doi[d] * V(b, j, hk, d));
          const double ds = p[j] * (dp - Di) * a.scale;
          const double dsmag = p[j] * (dpmag + Dmag) * std::fabs(a.scale);
          const int64_t kbase = ((b * Sk + j) * Hkv + hk) * D;
          for (int d = 0; d < D; ++d) {
            const double kd = K(b, j, hk, d);
            rdq[base + d] += ds * kd;
            rdk[kbase + d] += ds * qi[d];
            rdv[kbase + d] += p[j] * doi[d];
            mdq[base + d] += dsmag * std::fabs(kd);
            mdk[kbase + d] += dsmag * std::fabs(qi[d]);
            mdv[kbase + d] += p[j] * std::fabs(doi[d]);
          }
        }
      }
    }

  Err eo, el, edq, edk, edv;
  const bool bf16_p = fc::detail::kBf16Dot && std::is_same<T, fc::bf16>::value;
  const double mtol = bf16_p ? std::ldexp(1.0, -8) : 1e-5;
  compare(o, ro, mo, eo, mtol);
  compare_lse(lse, rlse, el);
  compare(dq, rdq, mdq, edq, mtol);
  compare(dk, rdk, mdk, edk, mtol);
  compare(dv, rdv, mdv, edv, mtol);
  const bool ok = eo.ok && el.ok && edq.ok && edk.ok && edv.ok;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "%-4s D=%-3d B=%lld Sq=%-3lld Sk=%-3lld Hq=%lld Hkv=%lld causal=%d br=%d nt=%d | max abs err o=%.2e "
                "lse=%.2e dq=%.2e dk=%.2e dv=%.2e | worst err/tol %.2f",
                Traits<T>::name(), D, (long long)B, (long long)Sq, (long long)Sk, (long long)Hq, (long long)Hkv,
                int(c.causal), int(c.br), nt, eo.max_abs, el.max_abs, edq.max_abs, edk.max_abs, edv.max_abs,
                std::max({eo.worst_ratio, el.worst_ratio, edq.worst_ratio, edk.worst_ratio, edv.worst_ratio}));
  check(ok, buf);
  DtypeSummary& sm = g_sum[type_index<T>()];
  sm.o = std::max(sm.o, eo.max_abs);
  sm.lse = std::max(sm.lse, el.max_abs);
  sm.dq = std::max(sm.dq, edq.max_abs);
  sm.dk = std::max(sm.dk, edk.max_abs);
  sm.dv = std::max(sm.dv, edv.max_abs);
}

// ---------------------------------------------------------------------------
// Threads and loads.
// ---------------------------------------------------------------------------

// Helpers queued and run by a thread of its own, each after a delay: some
// start after parallel_for returned.
class LateWorkers final : public fc::Workers {
 public:
  int spawn(int count, void (*task)(void*), void* arg) noexcept override {
    for (int i = 0; i < count; ++i)
      threads_.emplace_back([task, arg, i] {
        std::this_thread::sleep_for(std::chrono::microseconds(200 * (i + 1)));
        task(arg);
      });
    return count;
  }
  void join() {
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

 private:
  std::vector<std::thread> threads_;
};

// Helpers run inline, inside spawn(), before the caller's own loop.
class InlineWorkers final : public fc::Workers {
 public:
  int spawn(int count, void (*task)(void*), void* arg) noexcept override {
    for (int i = 0; i < count; ++i) task(arg);
    return count;
  }
};

// No helper is ever scheduled.
class NoWorkers final : public fc::Workers {
 public:
  int spawn(int, void (*)(void*), void*) noexcept override { return 0; }
};

static void test_parallel_for() {
  LateWorkers late;
  InlineWorkers inl;
  NoWorkers none;
  fc::Workers* pools[4] = {nullptr, &late, &inl, &none};
  const char* names[4] = {"own pool", "late helpers", "inline helpers", "no helpers"};
  for (int p = 0; p < 4; ++p)
    for (int nt : {1, 2, 3, 8})
      for (int64_t n : {int64_t(0), int64_t(1), int64_t(7), int64_t(1000)}) {
        std::vector<std::atomic<int>> hits(size_t(n) + 1);
        std::atomic<int> bad_worker{0};
        fc::parallel_for(
            n, nt,
            [&](int64_t i, int w) {
              if (w < 0 || w >= std::max(1, int(std::min<int64_t>(nt, std::max<int64_t>(n, 1))))) bad_worker++;
              hits[size_t(i)]++;
              if (i % 97 == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
            },
            pools[p]);
        bool ok = bad_worker.load() == 0;
        for (int64_t i = 0; i < n; ++i) ok = ok && hits[size_t(i)].load() == 1;
        check(ok, std::string("parallel_for ") + names[p] + " nt=" + std::to_string(nt) + " n=" + std::to_string(n));
      }
  late.join();
  // Concurrent callers sharing the own pool.
  std::atomic<int64_t> total{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([&] {
      for (int r = 0; r < 50; ++r) fc::parallel_for(100, 3, [&](int64_t i, int) { total += i; });
    });
  for (auto& t : callers) t.join();
  check(total.load() == 4 * 50 * 4950, "parallel_for: concurrent callers on the own pool");
}

// CallScratch: the calling thread's buffer is kept for its next call up to the size limit; a
// larger request, or one made while the kept buffer is in use, gets its own.
static void test_call_scratch() {
  bool ok = true;
  std::thread([&] {
    const size_t keep = 1 << 20;
    const auto aligned = [](const float* p) { return reinterpret_cast<uintptr_t>(p) % 64 == 0; };
    const float* first;
    {
      const fc::detail::CallScratch a(100, keep);
      first = a.data();
      ok = ok && first != nullptr && aligned(first);
    }
    {
      const fc::detail::CallScratch b(50, keep);
      ok = ok && b.data() == first;  // kept
    }
    {
      const fc::detail::CallScratch grown(keep / sizeof(float), keep);  // grows the kept buffer
      float* g = grown.data();
      for (size_t i = 0; i < keep / sizeof(float); ++i) g[i] = float(i);
      ok = ok && aligned(g) && g[keep / sizeof(float) - 1] == float(keep / sizeof(float) - 1);
      const fc::detail::CallScratch nested(10, keep);  // the kept buffer is in use
      ok = ok && nested.data() != g && aligned(nested.data());
      const fc::detail::CallScratch big(keep / sizeof(float) + 1, keep);  // over the limit
      ok = ok && big.data() != g && big.data() != nested.data() && aligned(big.data());
      big.data()[keep / sizeof(float)] = 1.0f;
    }
  }).join();
  check(ok, "CallScratch: kept per thread up to its limit, own buffers beyond it and while in use");
}

// made_once (the forward's per-kv-head packing): the first asker makes; one that asks while it is
// being made gets false and goes without, never the half-made buffer; once made, every asker gets
// true and nothing is made twice.
static void test_made_once() {
  std::atomic<int> state{0};
  std::atomic<bool> inside{false}, release{false};
  std::atomic<int> makes{0};
  bool first = false;
  std::thread maker([&] {
    first = fc::detail::made_once(state, [&] {
      ++makes;
      inside = true;
      while (!release) std::this_thread::yield();
    });
  });
  while (!inside) std::this_thread::yield();
  const bool during = fc::detail::made_once(state, [&] { ++makes; });
  release = true;
  maker.join();
  const bool after = fc::detail::made_once(state, [&] { ++makes; });
  check(first && !during && after && makes.load() == 1,
        "made_once: made by the first asker only; false while being made, true once made");
}

// A forward and a backward called again take no fresh pages for their per-call
// buffers (packed K / V; row terms and packed q / dout): with glibc's mmap threshold
// fixed (as in a JAX process, whose allocations keep glibc from reusing freed
// pages) a buffer allocated per call faults once per 4 KiB page on every call.
// Shapes: S=512 D=64 (2 MiB of packed K / V and of packed q / dout), and H=64 S=256 D=128
// (16 MiB of each, the backward's row terms on top: the size of D=128 S=2048 H=8 in few flops).
template <int D>
static long faults_of_a_second_call(int64_t S, int64_t H) {
  long faults = -1;
  std::thread([&] {
    const int64_t n = S * H * D;
    const AttentionShape s{1, S, S, H, H, D};
    const AttentionAttrs a{float(1.0 / std::sqrt(double(D))), false, false};
    std::mt19937 rng(3);
    std::normal_distribution<float> nd;
    std::vector<float> q(n), k(n), v(n), o(n), dout(n), dq(n), dk(n), dv(n), lse(H * S);
    for (auto* x : {&q, &k, &v, &dout})
      for (float& e : *x) e = nd(rng);
    const auto minor_faults = [] {
      rusage u;
      getrusage(RUSAGE_THREAD, &u);
      return long(u.ru_minflt);
    };
    for (int pass = 0; pass < 2; ++pass) {  // the first pass maps the kept buffers
      const long before = minor_faults();
      fc::attention_fwd<float, D>(q.data(), k.data(), v.data(), o.data(), lse.data(), s, a, 1);
      fc::attention_bwd<float, D>(q.data(), k.data(), v.data(), o.data(), lse.data(), dout.data(), dq.data(),
                                  dk.data(), dv.data(), s, a, 1);
      faults = minor_faults() - before;
    }
  }).join();
  return faults;
}

static void test_calls_keep_their_buffers() {
#if defined(__GLIBC__) && defined(RUSAGE_THREAD)
  mallopt(M_MMAP_THRESHOLD, 256 << 10);
  const long small = faults_of_a_second_call<64>(512, 8), large = faults_of_a_second_call<128>(256, 64);
  std::printf("minor page faults of a forward + backward called again: S=512 D=64 %ld, H=64 S=256 D=128 %ld\n",
              small, large);
  check(small >= 0 && small < 64 && large >= 0 && large < 64,
        "a forward + backward called again takes no fresh pages for its buffers");
#endif
}

// The lane-wise exp2 and tanh (numerics.h) against the double library functions, every lane:
// exp2v within 4e-7 relative over [-126, 127] (measured 7.9e-8; its polynomial evaluated off its
// [-0.5, 0.5] range is 5.6e-6 off), tanhv within 1e-6 (measured 1.5e-7), and the special values
// the kernels rely on: exp2(-inf) = 0 (masked scores), exp2(+inf) = +inf, NaN stays NaN.
static void test_lane_math() {
  namespace d = fc::detail;
  const auto lanes = [](float start, float step) {
    d::vf v;
    for (int l = 0; l < d::W; ++l) v[l] = start + float(l) * step;
    return v;
  };
  double e2 = 0, th = 0;
  for (double x = -126.0; x <= 127.0; x += 1.0 / 1024 + 1e-7) {
    const d::vf v = lanes(float(x), 1.0f / 65536), y = d::exp2v(v);
    for (int l = 0; l < d::W; ++l) {
      const double want = std::exp2(double(v[l]));
      if (v[l] <= 127.0f) e2 = std::max(e2, std::fabs(y[l] - want) / want);
    }
  }
  for (double x = -20.0; x <= 20.0; x += 1.0 / 4096 + 1e-8) {
    const d::vf v = lanes(float(x), 1.0f / 131072), y = d::tanhv(v);
    for (int l = 0; l < d::W; ++l) {
      const double want = std::tanh(double(v[l]));
      if (want != 0.0) th = std::max(th, std::fabs(y[l] - want) / std::fabs(want));
    }
  }
  std::printf("lane math: exp2v max rel err %.2e, tanhv %.2e\n", e2, th);
  check(e2 <= 4e-7, "exp2v within 4e-7 relative over [-126, 127]");
  check(th <= 1e-6, "tanhv within 1e-6 relative over [-20, 20]");
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const d::vf ex = d::exp2v(d::splat(-inf)), ep = d::exp2v(d::splat(inf)), en = d::exp2v(d::splat(nan)),
              el = d::exp2v(d::splat(-150.0f)), tp = d::tanhv(d::splat(inf)), tn = d::tanhv(d::splat(-inf)),
              tq = d::tanhv(d::splat(nan));
  bool ok = true;
  for (int l = 0; l < d::W; ++l)
    ok = ok && ex[l] == 0.0f && ep[l] == inf && std::isnan(en[l]) && el[l] == 0.0f && tp[l] == 1.0f && tn[l] == -1.0f &&
         std::isnan(tq[l]);
  check(ok, "exp2v(-inf) = 0, exp2v(+inf) = +inf, exp2v(-150) = 0, tanhv(+-inf) = +-1, NaN stays NaN");
}

static void test_transpose() {
  std::mt19937 rng(7);
  bool ok = true;
  for (int64_t n : {1, 5, 16, 17, 40}) {
    for (int64_t ncols : {16, 32, 48}) {
      const int64_t npad = (n + 15) / 16 * 16, ld = ncols + 3, ldd = npad + 16;
      std::vector<uint32_t> src(size_t(n * ld)), dst(size_t(ncols * ldd), 0xdeadbeefu);
      for (auto& x : src) x = rng();
      fc::detail::transpose32(src.data(), ld, n, ncols, npad, dst.data(), ldd);
      for (int64_t c = 0; c < ncols; ++c) {
        for (int64_t i = 0; i < npad; ++i) ok = ok && dst[c * ldd + i] == (i < n ? src[i * ld + c] : 0u);
        for (int64_t i = npad; i < ldd; ++i) ok = ok && dst[c * ldd + i] == 0xdeadbeefu;
      }
    }
  }
  check(ok, "transpose32 (rows 1..40, 16..48 columns, zero padding, nothing past the padding)");
}

static const Cfg kCfgs[] = {
    {2, 129, 129, 2, 2, false, false},  // plain, multi-block
    {1, 129, 129, 4, 2, true, false},   // GQA causal
    {1, 17, 129, 2, 1, true, true},     // MQA, bottom-right, Sq < Sk
    {1, 17, 129, 2, 2, true, false},    // top-left, Sq < Sk
    {1, 129, 17, 4, 2, true, true},     // GQA bottom-right, Sk < Sq: fully masked rows
    {1, 129, 17, 4, 1, true, false},    // MQA top-left, Sk < Sq
    {1, 129, 17, 2, 2, false, true},    // non-causal Sq > Sk
    {2, 1, 1, 2, 1, true, true},        // length 1
    {1, 1, 129, 4, 4, true, true},      // one query sees every key
    {1, 1, 129, 2, 2, true, false},     // one query sees key 0 only
    {1, 129, 1, 2, 2, true, true},      // only the last query sees a key
    {1, 17, 17, 3, 1, false, true},     // MQA, 3 q heads
    {1, 200, 300, 2, 1, true, true},    // several blocks both ways, bottom-right
    {1, 300, 200, 2, 2, true, false},   // several blocks, top-left, Sk < Sq
    {1, 0, 17, 2, 1, true, true},       // empty q
    {1, 17, 0, 2, 2, false, false},     // empty k
    {1, 17, 0, 2, 2, true, true},       // empty k, causal
};

template <typename T, int D>
static void run_all_for(std::mt19937_64& rng) {
  for (const Cfg& c : kCfgs)
    for (int nt : {1, 2}) run_case<T, D>(c, nt, rng);
}

template <typename T>
static void run_type(std::mt19937_64& rng) {
  run_all_for<T, 32>(rng);
  run_all_for<T, 64>(rng);
  run_all_for<T, 96>(rng);
  run_all_for<T, 128>(rng);
  run_all_for<T, 160>(rng);
  run_all_for<T, 192>(rng);
  run_all_for<T, 224>(rng);
  run_all_for<T, 256>(rng);
  run_case<T, 64>({1, 129, 129, 3, 1, true, true}, 3, rng);  // 3 threads, MQA (chunked dq)
  run_case<T, 64>({3, 65, 70, 2, 1, false, false}, 3, rng);
  // Scores that grow along the keys: the forward's later key blocks raise the running max
  // beyond its slack (forward.h kExpSlack), so each is computed again the standard way.
  run_case<T, 64>({1, 100, 300, 2, 1, false, false, 0.05f}, 2, rng);
  // Blocks crossing the causal diagonal after the first take the epilogue's exponentials too
  // (fwd_tiles.h ExpAgainstCausal): an offset that is not a multiple of the micro-tile's 4 rows,
  // and a partial last q block at D=128.
  run_case<T, 64>({1, 200, 301, 2, 1, true, true}, 2, rng);
  run_case<T, 128>({1, 259, 258, 2, 2, true, false}, 1, rng);
  // Helpers that start late / never: the caller finishes the work alone.
  LateWorkers late;
  NoWorkers none;
  run_case<T, 64>({2, 200, 200, 4, 2, true, false}, 4, rng, &late);
  run_case<T, 64>({1, 129, 300, 2, 2, true, true}, 2, rng, &none);
  late.join();
}

// ---------------------------------------------------------------------------
// Variants: score extras (ALiBi, bias + dbias, mask, segment ids), sliding
// window and softcap, packed varlen, paged KV and split-KV, against one general
// double reference with the same tolerance model as above. The backward's mag
// for dbias is sum p (|dp| + |D|) over the summed terms.
// ---------------------------------------------------------------------------
struct Prob {
  int64_t B = 1, Sq = 0, Sk = 0, Hq = 1, Hkv = 1, D = 64;
  double scale = 0.125, softcap = 0.0;
  bool causal = false, br = false;
  int wl = -1, wr = -1;
  std::vector<double> q, k, v, dout, o;  // BSHD; o: the kernel's o (the backward's input)
  std::vector<double> alibi;             // empty: none; slope(b, h) = alibi[b * alibi_sb + h]
  int64_t alibi_sb = 0;
  std::vector<double> bias;  // empty: none; (b, h, i, j) at b * bias_sb + h * bias_sh + i * Sk + j
  int64_t bias_sb = 0, bias_sh = 0;
  std::vector<uint8_t> mask;  // empty: none; like bias
  int64_t mask_sb = 0, mask_sh = 0;
  std::vector<int32_t> qseg, kseg;  // empty: none; [B, Sq], [B, Sk]
};

struct RefOut {
  std::vector<double> o, mo, lse, dq, mdq, dk, mdk, dv, mdv, db, mdb;
};

static void reference(const Prob& p, RefOut& r, bool bwd, size_t db_elems) {
  const int64_t B = p.B, Sq = p.Sq, Sk = p.Sk, Hq = p.Hq, Hkv = p.Hkv, D = p.D, G = Hq / Hkv;
  const size_t nq = size_t(B * Sq * Hq * D), nk = size_t(B * Sk * Hkv * D);
  r.o.assign(nq, 0.0);
  r.mo.assign(nq, 0.0);
  r.lse.assign(size_t(B * Hq * Sq), -std::numeric_limits<double>::infinity());
  r.dq.assign(nq, 0.0);
  r.mdq.assign(nq, 0.0);
  r.dk.assign(nk, 0.0);
  r.mdk.assign(nk, 0.0);
  r.dv.assign(nk, 0.0);
  r.mdv.assign(nk, 0.0);
  r.db.assign(db_elems, 0.0);
  r.mdb.assign(db_elems, 0.0);
  const int64_t off = p.br ? Sk - Sq : 0;
  const double ninf = -std::numeric_limits<double>::infinity();
  std::vector<double> sc(size_t(std::max<int64_t>(Sk, 1))), pr(sc.size()), uu(sc.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / G;
      for (int64_t i = 0; i < Sq; ++i) {
        const int64_t base = ((b * Sq + i) * Hq + h) * D;
        double m = ninf;
        for (int64_t j = 0; j < Sk; ++j) {
          bool vis = true;
          if (p.causal && j > i + off) vis = false;
          if (p.wl >= 0 && j < i + off - p.wl) vis = false;
          if (!p.causal && p.wr >= 0 && j > i + off + p.wr) vis = false;
          if (!p.mask.empty() && !p.mask[size_t(b * p.mask_sb + h * p.mask_sh + i * Sk + j)]) vis = false;
          if (!p.qseg.empty() && p.qseg[size_t(b * Sq + i)] != p.kseg[size_t(b * Sk + j)]) vis = false;
          double s = ninf;
          if (vis) {
            const int64_t kb = ((b * Sk + j) * Hkv + hk) * D;
            double acc = 0;
            for (int64_t d = 0; d < D; ++d) acc += p.q[size_t(base + d)] * p.k[size_t(kb + d)];
            s = acc * p.scale;
            uu[size_t(j)] = 0.0;
            if (p.softcap > 0) {
              uu[size_t(j)] = std::tanh(s / p.softcap);
              s = p.softcap * uu[size_t(j)];
            }
            if (!p.bias.empty()) s += p.bias[size_t(b * p.bias_sb + h * p.bias_sh + i * Sk + j)];
            if (!p.alibi.empty()) s -= p.alibi[size_t(b * p.alibi_sb + h)] * std::fabs(double(i + off - j));
          }
          sc[size_t(j)] = s;
          m = std::max(m, s);
        }
        const int64_t li = (b * Hq + h) * Sq + i;
        if (m == ninf) continue;  // sees no key: o = 0, lse = -inf, no gradient
        double l = 0;
        for (int64_t j = 0; j < Sk; ++j) l += (pr[size_t(j)] = sc[size_t(j)] == ninf ? 0.0 : std::exp(sc[size_t(j)] - m));
        for (int64_t j = 0; j < Sk; ++j) pr[size_t(j)] /= l;
        r.lse[size_t(li)] = m + std::log(l);
        for (int64_t d = 0; d < D; ++d) {
          double acc = 0, mag = 0;
          for (int64_t j = 0; j < Sk; ++j) {
            const double vv = p.v[size_t(((b * Sk + j) * Hkv + hk) * D + d)];
            acc += pr[size_t(j)] * vv;
            mag += pr[size_t(j)] * std::fabs(vv);
          }
          r.o[size_t(base + d)] = acc;
          r.mo[size_t(base + d)] = mag;
        }
        if (!bwd) continue;
        double Di = 0, Dmag = 0;
        for (int64_t d = 0; d < D; ++d) {
          Di += p.dout[size_t(base + d)] * p.o[size_t(base + d)];
          Dmag += std::fabs(p.dout[size_t(base + d)] * p.o[size_t(base + d)]);
        }
        for (int64_t j = 0; j < Sk; ++j) {
          if (pr[size_t(j)] == 0.0 && sc[size_t(j)] == ninf) continue;
          const int64_t kb = ((b * Sk + j) * Hkv + hk) * D;
          double dp = 0, dpmag = 0;
          for (int64_t d = 0; d < D; ++d) {
            dp += p.dout[size_t(base + d)] * p.v[size_t(kb + d)];
            dpmag += std::fabs(p.dout[size_t(base + d)] * p.v[size_t(kb + d)]);
          }
          const double ds0 = pr[size_t(j)] * (dp - Di), ds0mag = pr[size_t(j)] * (dpmag + Dmag);
          if (db_elems) {
            const size_t bi = size_t(b * p.bias_sb + h * p.bias_sh + i * Sk + j);
            r.db[bi] += ds0;
            r.mdb[bi] += ds0mag;
          }
          const double f = p.scale * (p.softcap > 0 ? 1.0 - uu[size_t(j)] * uu[size_t(j)] : 1.0);
          const double ds = ds0 * f, dsmag = ds0mag * std::fabs(f);
          for (int64_t d = 0; d < D; ++d) {
            const double kd = p.k[size_t(kb + d)], qd = p.q[size_t(base + d)], dod = p.dout[size_t(base + d)];
            r.dq[size_t(base + d)] += ds * kd;
            r.mdq[size_t(base + d)] += dsmag * std::fabs(kd);
            r.dk[size_t(kb + d)] += ds * qd;
            r.mdk[size_t(kb + d)] += dsmag * std::fabs(qd);
            r.dv[size_t(kb + d)] += pr[size_t(j)] * dod;
            r.mdv[size_t(kb + d)] += pr[size_t(j)] * std::fabs(dod);
          }
        }
      }
    }
}

// Max abs errors per (variant family, dtype).
struct VarSummary {
  double o = 0, lse = 0, dq = 0, dk = 0, dv = 0, db = 0;
  int cases = 0;
};
static VarSummary g_var[3][3];  // [family: extras, varlen, paged][dtype]
static const char* kFamilies[3] = {"extras", "varlen", "paged"};
static VarSummary g_alibi[2][3];  // the ALiBi cases of [varlen, paged][dtype] (also in g_var)

template <typename T>
static std::vector<double> to_double(const std::vector<T>& x) {
  std::vector<double> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = Traits<T>::to(x[i]);
  return r;
}

template <typename T>
static std::vector<T> random_vec(size_t n, std::mt19937_64& rng, float lo = -2.0f, float hi = 2.0f) {
  std::uniform_real_distribution<float> U(lo, hi);
  std::vector<T> x(n);
  for (auto& e : x) e = Traits<T>::from(U(rng));
  return x;
}

static double mtol_for_products(bool bf16_path) { return bf16_path ? std::ldexp(1.0, -8) : 1e-5; }

struct VCase {
  const char* name;
  int64_t B, Sq, Sk, Hq, Hkv;
  bool causal, br;
  int wl, wr;
  float softcap;
  int alibi;            // 0 none, 1 [Hq], 2 [B, Hq]
  int bias;             // 0 none, 1 f32, 2 the q type
  bool bias_b, bias_h;  // the bias has a batch / head dim (else broadcast)
  bool bias_inf;        // some -inf bias entries (and a row of them)
  int mask;             // 0 none, 1 random with fully masked rows
  bool mask_b, mask_h;
  int segs;  // 0 none, 1 packed (sorted, a q segment without keys), 2 random ids
  int kv_splits;
};

// Packed segment ids for n positions in `parts` runs of random lengths; run
// `empty` (>= 0) gets length 0.
static std::vector<int32_t> packed_ids(int64_t n, int parts, int empty, std::mt19937_64& rng) {
  std::vector<int64_t> cuts;
  for (int s = 0; s < parts - 1; ++s) cuts.push_back(int64_t(rng() % uint64_t(n + 1)));
  std::sort(cuts.begin(), cuts.end());
  cuts.push_back(n);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  int64_t start = 0;
  for (int s = 0; s < parts; ++s) {
    int64_t end = cuts[size_t(s)];
    if (s == empty) end = start;  // nothing of segment s (its length goes to the next)
    for (int64_t i = start; i < end; ++i) ids[size_t(i)] = s;
    start = std::max(start, end);
  }
  return ids;
}

// The raw bytes of an array (for bit-for-bit comparisons).
template <typename T>
static std::string raw_bytes(const std::vector<T>& x) {
  return std::string(reinterpret_cast<const char*>(x.data()), x.size() * sizeof(T));
}

// bits (optional): receives the raw bytes of o, lse, dq, dk, dv and dbias.
template <typename T, int D>
static void run_variant(const VCase& c, int nt, std::mt19937_64& rng, std::vector<std::string>* bits = nullptr) {
  const int64_t B = c.B, Sq = c.Sq, Sk = c.Sk, Hq = c.Hq, Hkv = c.Hkv;
  AttentionShape s{B, Sq, Sk, Hq, Hkv, D};
  AttentionAttrs a{float(1.0 / std::sqrt(double(D))), c.causal, c.br, c.wl, c.wr, c.softcap};
  const size_t nq = size_t(B * Sq * Hq * D), nk = size_t(B * Sk * Hkv * D), nl = size_t(B * Hq * Sq);
  std::vector<T> q = random_vec<T>(nq, rng), k = random_vec<T>(nk, rng), v = random_vec<T>(nk, rng),
                 dout = random_vec<T>(nq, rng);
  std::vector<T> o(nq, Traits<T>::nan()), dq(nq, Traits<T>::nan()), dk(nk, Traits<T>::nan()),
      dv(nk, Traits<T>::nan());
  std::vector<float> lse(nl, std::numeric_limits<float>::quiet_NaN());

  Prob p;
  p.B = B, p.Sq = Sq, p.Sk = Sk, p.Hq = Hq, p.Hkv = Hkv, p.D = D;
  p.scale = a.scale, p.softcap = c.softcap, p.causal = c.causal, p.br = c.br, p.wl = c.wl, p.wr = c.wr;
  flashgen::ScoreExtras x;

  std::vector<float> alibi;
  if (c.alibi) {
    alibi.resize(size_t(c.alibi == 2 ? B * Hq : Hq));
    for (auto& e : alibi) e = std::ldexp(1.0f, -int(1 + rng() % 4)) * (0.5f + 0.5f * float(rng() % 1000) / 1000.0f);
    x.alibi = alibi.data();
    x.alibi_stride_b = c.alibi == 2 ? Hq : 0;
    p.alibi.assign(alibi.begin(), alibi.end());
    p.alibi_sb = x.alibi_stride_b;
  }
  // Bias (f32 or T) and dbias (poisoned).
  const int64_t Bd = c.bias_b ? B : 1, Hd = c.bias_h ? Hq : 1;
  const size_t nb = c.bias ? size_t(Bd * Hd * Sq * Sk) : 0;
  std::vector<float> biasf, dbiasf;
  std::vector<T> biast, dbiast;
  if (c.bias) {
    std::uniform_real_distribution<float> U(-2.0f, 2.0f);
    std::vector<float> vals(nb);
    for (auto& e : vals) e = U(rng);
    if (c.bias_inf) {
      for (auto& e : vals)
        if (rng() % 20 == 0) e = -std::numeric_limits<float>::infinity();
      if (Sq > 2)
        for (int64_t j = 0; j < Sk; ++j) vals[size_t(2 * Sk + j)] = -std::numeric_limits<float>::infinity();
    }
    p.bias.resize(nb);
    if (c.bias == 1) {
      biasf = vals;
      dbiasf.assign(nb, std::numeric_limits<float>::quiet_NaN());
      for (size_t i = 0; i < nb; ++i) p.bias[i] = biasf[i];
      x.bias = biasf.data();
      x.dbias = dbiasf.data();
      x.bias_type = flashgen::ElemType::F32;
    } else {
      biast.resize(nb);
      for (size_t i = 0; i < nb; ++i) biast[i] = Traits<T>::from(vals[i]), p.bias[i] = Traits<T>::to(biast[i]);
      dbiast.assign(nb, Traits<T>::nan());
      x.bias = biast.data();
      x.dbias = dbiast.data();
      x.bias_type = std::is_same<T, float>::value      ? flashgen::ElemType::F32
                    : std::is_same<T, fc::bf16>::value ? flashgen::ElemType::BF16
                                                       : flashgen::ElemType::F16;
    }
    x.bias_stride_q = Sk;  // one row per query (0 would be a key-only bias: attention.h)
    x.bias_stride_h = c.bias_h ? Sq * Sk : 0;
    x.bias_stride_b = c.bias_b ? Hd * Sq * Sk : 0;
    p.bias_sb = x.bias_stride_b;
    p.bias_sh = x.bias_stride_h;
  }
  std::vector<uint8_t> mask;
  if (c.mask) {
    const int64_t Bm = c.mask_b ? B : 1, Hm = c.mask_h ? Hq : 1;
    mask.resize(size_t(Bm * Hm * Sq * Sk));
    for (auto& e : mask) e = rng() % 4 != 0;
    for (int64_t sl = 0; sl < Bm * Hm; ++sl)  // fully masked rows: 1 and the last
      for (int64_t i : {int64_t(1), Sq - 1})
        if (i >= 0 && i < Sq)
          for (int64_t j = 0; j < Sk; ++j) mask[size_t((sl * Sq + i) * Sk + j)] = 0;
    x.mask = reinterpret_cast<const bool*>(mask.data());
    x.mask_stride_h = c.mask_h ? Sq * Sk : 0;
    x.mask_stride_b = c.mask_b ? Hm * Sq * Sk : 0;
    p.mask = mask;
    p.mask_sb = x.mask_stride_b;
    p.mask_sh = x.mask_stride_h;
  }
  std::vector<int32_t> qseg, kseg;
  if (c.segs) {
    for (int64_t b = 0; b < B; ++b) {
      std::vector<int32_t> qs, ks;
      if (c.segs == 1) {
        qs = packed_ids(Sq, 4, -1, rng);
        ks = packed_ids(Sk, 4, 2, rng);  // segment 2 has no keys
      } else {
        for (int64_t i = 0; i < Sq; ++i) qs.push_back(i % 7 == 3 ? 9 : int32_t(rng() % 3));  // id 9: no keys
        for (int64_t j = 0; j < Sk; ++j) ks.push_back(int32_t(rng() % 3));
      }
      qseg.insert(qseg.end(), qs.begin(), qs.end());
      kseg.insert(kseg.end(), ks.begin(), ks.end());
    }
    x.q_segment_ids = qseg.data();
    x.kv_segment_ids = kseg.data();
    p.qseg = qseg;
    p.kseg = kseg;
  }

  fc::attention_fwd<T, D>(q.data(), k.data(), v.data(), o.data(), lse.data(), s, a, x, nt, nullptr, c.kv_splits);
  fc::attention_bwd<T, D>(q.data(), k.data(), v.data(), o.data(), lse.data(), dout.data(), dq.data(), dk.data(),
                          dv.data(), s, a, x, nt);
  if (bits != nullptr)
    *bits = {raw_bytes(o), raw_bytes(lse), raw_bytes(dq), raw_bytes(dk), raw_bytes(dv),
             c.bias == 1 ? raw_bytes(dbiasf) : raw_bytes(dbiast)};

  p.q = to_double(q), p.k = to_double(k), p.v = to_double(v), p.dout = to_double(dout), p.o = to_double(o);
  RefOut r;
  reference(p, r, true, nb);
  const bool bf16_p = fc::detail::kBf16Dot && std::is_same<T, fc::bf16>::value;
  const double mtol = mtol_for_products(bf16_p);
  Err eo, el, edq, edk, edv, edb;
  compare(o, r.o, r.mo, eo, mtol);
  compare_lse(lse, r.lse, el);
  compare(dq, r.dq, r.mdq, edq, mtol);
  compare(dk, r.dk, r.mdk, edk, mtol);
  compare(dv, r.dv, r.mdv, edv, mtol);
  if (c.bias == 1) compare(dbiasf, r.db, r.mdb, edb);
  if (c.bias == 2) compare(dbiast, r.db, r.mdb, edb);
  const bool ok = eo.ok && el.ok && edq.ok && edk.ok && edv.ok && edb.ok;
  char buf[640];
  std::snprintf(buf, sizeof buf,
                "extras %-4s D=%-3d %-34s B=%lld Sq=%lld Sk=%lld Hq=%lld Hkv=%lld c=%d br=%d w=(%d,%d) cap=%g nt=%d "
                "| o=%.2e lse=%.2e dq=%.2e dk=%.2e dv=%.2e db=%.2e | worst err/tol %.2f",
                Traits<T>::name(), D, c.name, (long long)B, (long long)Sq, (long long)Sk, (long long)Hq,
                (long long)Hkv, int(c.causal), int(c.br), c.wl, c.wr, double(c.softcap), nt, eo.max_abs, el.max_abs,
                edq.max_abs, edk.max_abs, edv.max_abs, edb.max_abs,
                std::max({eo.worst_ratio, el.worst_ratio, edq.worst_ratio, edk.worst_ratio, edv.worst_ratio,
                          edb.worst_ratio}));
  check(ok, buf);
  VarSummary& sm = g_var[0][type_index<T>()];
  sm.o = std::max(sm.o, eo.max_abs), sm.lse = std::max(sm.lse, el.max_abs), sm.dq = std::max(sm.dq, edq.max_abs);
  sm.dk = std::max(sm.dk, edk.max_abs), sm.dv = std::max(sm.dv, edv.max_abs), sm.db = std::max(sm.db, edb.max_abs);
  sm.cases++;
}

//                 name                      B   Sq   Sk  Hq Hkv causal br   wl  wr cap  al bi bb bh inf mk mb mh sg split
static const VCase kVCases[] = {
    {"alibi[H] causal",                      2, 129, 129, 2, 1, true,  false, -1, -1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {"alibi[B,H] causal bottom-right",       2,  70, 150, 2, 2, true,  true,  -1, -1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {"alibi[H] non-causal bottom-right",     1,  90,  40, 4, 2, false, true,  -1, -1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {"alibi[B,H] non-causal",                2,  65, 100, 2, 1, false, false, -1, -1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {"bias f32 [B,H]",                       2,  77, 130, 2, 1, false, false, -1, -1, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0},
    {"bias f32 [1,H] causal",                2, 100, 100, 4, 2, true,  false, -1, -1, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0},
    {"bias f32 [B,1] GQA",                   2,  64, 129, 4, 1, false, false, -1, -1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0},
    {"bias f32 [1,1] causal br",             3,  50, 140, 2, 2, true,  true,  -1, -1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0},
    {"bias T [B,H] -inf entries",            2,  70,  90, 2, 2, false, false, -1, -1, 0, 0, 2, 1, 1, 1, 0, 0, 0, 0, 0},
    {"bias T [1,1] causal",                  2, 129, 129, 2, 1, true,  false, -1, -1, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0},
    {"bias T [1,H] window",                  1, 150, 150, 2, 1, false, false, 30, 20, 0, 0, 2, 0, 1, 0, 0, 0, 0, 0, 0},
    {"bias f32 [B,1] softcap",               2,  80,  80, 2, 2, false, false, -1, -1, 5, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0},
    {"mask [B,H] (masked rows)",             2,  60,  75, 2, 1, false, false, -1, -1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0},
    {"mask [1,1] causal",                    2, 129, 129, 4, 2, true,  false, -1, -1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0},
    {"mask [B,1] causal br",                 2,  40, 100, 2, 2, true,  true,  -1, -1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0},
    {"segments packed",                      2, 150, 150, 2, 1, false, false, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0},
    {"segments packed causal",               2, 200, 200, 2, 2, true,  false, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0},
    {"segments random GQA",                  1,  70, 120, 4, 2, false, false, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0},
    {"all extras causal window softcap",     2, 100, 130, 4, 2, true,  true,  50, -1, 8, 2, 1, 1, 0, 1, 1, 0, 1, 1, 0},
    {"all extras T bias GQA",                2,  90,  90, 4, 1, false, false, -1, -1, 0, 1, 2, 0, 1, 0, 1, 1, 0, 2, 0},
    {"window + softcap (no extras)",         2, 129, 160, 2, 1, false, true,  40, 10, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {"causal window (no extras)",            1, 200, 200, 2, 2, true,  false, 64, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {"split-KV x3 causal bias mask",         1, 129, 300, 2, 1, true,  false, -1, -1, 0, 1, 1, 0, 0, 0, 1, 0, 0, 0, 3},
    {"split-KV x4 (no extras)",              1,  40, 260, 2, 2, true,  true,  -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4},
    {"empty k with bias",                    1,  17,   0, 2, 1, false, false, -1, -1, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0},
    {"empty q with bias",                    1,   0,  17, 2, 1, false, false, -1, -1, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0},
};

// Packed varlen: per-sequence lengths and trailing padding rows.
struct LCase {
  const char* name;
  std::vector<int> lq, lk;
  int pad_q, pad_k;
  int64_t Hq, Hkv;
  bool causal, br;
  int wl, wr;
  float softcap;
  int alibi = 0;  // 0 none, 1 [Hq], 2 [B, Hq]
};

// n random ALiBi slopes (the dense variants' distribution).
static std::vector<float> random_slopes(int64_t n, std::mt19937_64& rng) {
  std::vector<float> al(static_cast<size_t>(n));
  for (auto& e : al) e = std::ldexp(1.0f, -int(1 + rng() % 4)) * (0.5f + 0.5f * float(rng() % 1000) / 1000.0f);
  return al;
}

// The slopes of problem b (Hq values) from slopes [Hq] (alibi == 1) or [B, Hq] (alibi == 2).
static std::vector<double> slopes_of(const std::vector<float>& al, int alibi, int64_t b, int64_t Hq) {
  if (!alibi) return {};
  const size_t o = alibi == 2 ? size_t(b * Hq) : 0;
  return std::vector<double>(al.begin() + o, al.begin() + o + size_t(Hq));
}

template <typename T, int D>
static void run_varlen(const LCase& c, int nt, std::mt19937_64& rng) {
  const int64_t B = int64_t(c.lq.size()), Hq = c.Hq, Hkv = c.Hkv;
  std::vector<int32_t> cq(size_t(B + 1), 0), ck(size_t(B + 1), 0);
  int32_t mq = 0, mk = 0;
  for (int64_t b = 0; b < B; ++b) {
    cq[size_t(b + 1)] = cq[size_t(b)] + c.lq[size_t(b)];
    ck[size_t(b + 1)] = ck[size_t(b)] + c.lk[size_t(b)];
    mq = std::max(mq, c.lq[size_t(b)]), mk = std::max(mk, c.lk[size_t(b)]);
  }
  const int64_t Tq = cq[size_t(B)] + c.pad_q, Tk = ck[size_t(B)] + c.pad_k;
  AttentionShape s{B, Tq, Tk, Hq, Hkv, D};
  AttentionAttrs a{float(1.0 / std::sqrt(double(D))), c.causal, c.br, c.wl, c.wr, c.softcap};
  const size_t nq = size_t(Tq * Hq * D), nk = size_t(Tk * Hkv * D), nl = size_t(Hq * Tq);
  std::vector<T> q = random_vec<T>(nq, rng), k = random_vec<T>(nk, rng), v = random_vec<T>(nk, rng),
                 dout = random_vec<T>(nq, rng);
  std::vector<T> o(nq, Traits<T>::nan()), dq(nq, Traits<T>::nan()), dk(nk, Traits<T>::nan()),
      dv(nk, Traits<T>::nan());
  std::vector<float> lse(nl, std::numeric_limits<float>::quiet_NaN());
  const flashgen::VarlenArgs va{cq.data(), ck.data(), mq, mk};
  std::vector<float> al;
  flashgen::ScoreExtras x;
  if (c.alibi) {
    al = random_slopes(c.alibi == 2 ? B * Hq : Hq, rng);
    x.alibi = al.data();
    x.alibi_stride_b = c.alibi == 2 ? Hq : 0;
    fc::attention_fwd_varlen<T, D>(q.data(), k.data(), v.data(), o.data(), lse.data(), s, va, a, x, nt);
    fc::attention_bwd_varlen<T, D>(q.data(), k.data(), v.data(), o.data(), lse.data(), dout.data(), dq.data(),
                                   dk.data(), dv.data(), s, va, a, x, nt);
  } else {
    fc::attention_fwd_varlen<T, D>(q.data(), k.data(), v.data(), o.data(), lse.data(), s, va, a, nt);
    fc::attention_bwd_varlen<T, D>(q.data(), k.data(), v.data(), o.data(), lse.data(), dout.data(), dq.data(),
                                   dk.data(), dv.data(), s, va, a, nt);
  }

  // Reference: each sequence as a dense problem; rows outside every sequence stay 0 / -inf.
  const std::vector<double> dq_ = to_double(q), dk_ = to_double(k), dv_ = to_double(v), ddo = to_double(dout),
                            dO = to_double(o);
  RefOut all;
  all.o.assign(nq, 0.0), all.mo.assign(nq, 0.0), all.dq.assign(nq, 0.0), all.mdq.assign(nq, 0.0);
  all.dk.assign(nk, 0.0), all.mdk.assign(nk, 0.0), all.dv.assign(nk, 0.0), all.mdv.assign(nk, 0.0);
  all.lse.assign(nl, -std::numeric_limits<double>::infinity());
  for (int64_t b = 0; b < B; ++b) {
    Prob p;
    p.B = 1, p.Sq = c.lq[size_t(b)], p.Sk = c.lk[size_t(b)], p.Hq = Hq, p.Hkv = Hkv, p.D = D;
    p.scale = a.scale, p.softcap = c.softcap, p.causal = c.causal, p.br = c.br, p.wl = c.wl, p.wr = c.wr;
    p.alibi = slopes_of(al, c.alibi, b, Hq);
    const size_t q0 = size_t(cq[size_t(b)] * Hq * D), qn = size_t(p.Sq * Hq * D);
    const size_t k0 = size_t(ck[size_t(b)] * Hkv * D), kn = size_t(p.Sk * Hkv * D);
    p.q.assign(dq_.begin() + q0, dq_.begin() + q0 + qn);
    p.dout.assign(ddo.begin() + q0, ddo.begin() + q0 + qn);
    p.o.assign(dO.begin() + q0, dO.begin() + q0 + qn);
    p.k.assign(dk_.begin() + k0, dk_.begin() + k0 + kn);
    p.v.assign(dv_.begin() + k0, dv_.begin() + k0 + kn);
    RefOut r;
    reference(p, r, true, 0);
    std::copy(r.o.begin(), r.o.end(), all.o.begin() + q0);
    std::copy(r.mo.begin(), r.mo.end(), all.mo.begin() + q0);
    std::copy(r.dq.begin(), r.dq.end(), all.dq.begin() + q0);
    std::copy(r.mdq.begin(), r.mdq.end(), all.mdq.begin() + q0);
    std::copy(r.dk.begin(), r.dk.end(), all.dk.begin() + k0);
    std::copy(r.mdk.begin(), r.mdk.end(), all.mdk.begin() + k0);
    std::copy(r.dv.begin(), r.dv.end(), all.dv.begin() + k0);
    std::copy(r.mdv.begin(), r.mdv.end(), all.mdv.begin() + k0);
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < p.Sq; ++i) all.lse[size_t(h * Tq + cq[size_t(b)] + i)] = r.lse[size_t(h * p.Sq + i)];
  }
  const bool bf16_p = fc::detail::kBf16Dot && std::is_same<T, fc::bf16>::value;
  const double mtol = mtol_for_products(bf16_p);
  Err eo, el, edq, edk, edv;
  compare(o, all.o, all.mo, eo, mtol);
  compare_lse(lse, all.lse, el);
  compare(dq, all.dq, all.mdq, edq, mtol);
  compare(dk, all.dk, all.mdk, edk, mtol);
  compare(dv, all.dv, all.mdv, edv, mtol);
  const bool ok = eo.ok && el.ok && edq.ok && edk.ok && edv.ok;
  std::string lens;
  for (int64_t b = 0; b < B; ++b)
    lens += (b ? "," : "") + std::to_string(c.lq[size_t(b)]) + "/" + std::to_string(c.lk[size_t(b)]);
  char buf[640];
  std::snprintf(buf, sizeof buf,
                "varlen %-4s D=%-3d %-30s q/k lens [%s] pad %d/%d Hq=%lld Hkv=%lld c=%d br=%d w=(%d,%d) cap=%g "
                "alibi=%d nt=%d | o=%.2e lse=%.2e dq=%.2e dk=%.2e dv=%.2e | worst err/tol %.2f",
                Traits<T>::name(), D, c.name, lens.c_str(), c.pad_q, c.pad_k, (long long)Hq, (long long)Hkv,
                int(c.causal), int(c.br), c.wl, c.wr, double(c.softcap), c.alibi, nt, eo.max_abs, el.max_abs, edq.max_abs,
                edk.max_abs, edv.max_abs,
                std::max({eo.worst_ratio, el.worst_ratio, edq.worst_ratio, edk.worst_ratio, edv.worst_ratio}));
  check(ok, buf);
  VarSummary& sm = g_var[1][type_index<T>()];
  sm.o = std::max(sm.o, eo.max_abs), sm.lse = std::max(sm.lse, el.max_abs), sm.dq = std::max(sm.dq, edq.max_abs);
  sm.dk = std::max(sm.dk, edk.max_abs), sm.dv = std::max(sm.dv, edv.max_abs);
  sm.cases++;
  if (c.alibi) {
    VarSummary& sa = g_alibi[0][type_index<T>()];
    sa.o = std::max(sa.o, eo.max_abs), sa.lse = std::max(sa.lse, el.max_abs), sa.dq = std::max(sa.dq, edq.max_abs);
    sa.dk = std::max(sa.dk, edk.max_abs), sa.dv = std::max(sa.dv, edv.max_abs);
    sa.cases++;
  }
}

static const LCase kLCases[] = {
    {"causal top-left", {5, 0, 130, 64, 1, 9}, {7, 3, 100, 64, 0, 9}, 3, 5, 2, 1, true, false, -1, -1, 0},
    {"causal bottom-right", {5, 0, 130, 64, 1, 20}, {7, 3, 100, 64, 0, 300}, 0, 2, 4, 2, true, true, -1, -1, 0},
    {"non-causal", {33, 1, 0, 200}, {1, 17, 0, 150}, 7, 0, 2, 2, false, false, -1, -1, 0},
    {"window softcap", {70, 129}, {90, 129}, 1, 1, 2, 1, false, true, 16, 8, 4},
    {"all empty", {0, 0}, {0, 4}, 3, 2, 2, 1, true, false, -1, -1, 0},
    {"alibi[H] causal top-left", {5, 0, 130, 64, 1, 9}, {7, 3, 100, 64, 0, 9}, 3, 5, 2, 1, true, false, -1, -1, 0, 1},
    {"alibi[B,H] causal bottom-right", {5, 0, 70, 1, 20}, {7, 3, 100, 0, 150}, 0, 2, 4, 2, true, true, -1, -1, 0, 2},
    {"alibi[B,H] non-causal br", {33, 1, 0, 90}, {1, 17, 0, 40}, 7, 0, 2, 2, false, true, -1, -1, 0, 2},
    {"alibi[H] non-causal", {40, 0, 65}, {60, 5, 30}, 2, 1, 4, 1, false, false, -1, -1, 0, 1},
    {"alibi[B,H] window softcap br", {70, 50}, {90, 129}, 1, 1, 2, 1, false, true, 16, 8, 4, 2},
    {"alibi[H] all empty", {0, 0}, {0, 4}, 3, 2, 2, 1, false, true, -1, -1, 0, 1},
};

// Paged KV forward.
struct PCase {
  const char* name;
  int64_t Sq, Hq, Hkv, BS, NB;
  std::vector<int> used;  // seqused_k per batch entry
  int64_t MB;             // block table width (>= blocks needed)
  bool causal, br;
  int wl;
  float softcap;
  int nt, kv_splits;
  int alibi = 0;  // 0 none, 1 [Hq], 2 [B, Hq]
};

template <typename T, int D>
static void run_paged(const PCase& c, std::mt19937_64& rng) {
  const int64_t B = int64_t(c.used.size()), Sq = c.Sq, Hq = c.Hq, Hkv = c.Hkv, BS = c.BS, NB = c.NB, MB = c.MB;
  // Block table: a shuffled set of distinct cache blocks; entries no key reaches are out of range.
  std::vector<int32_t> perm(static_cast<size_t>(NB));
  for (int64_t i = 0; i < NB; ++i) perm[size_t(i)] = int32_t(i);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> table(size_t(B * MB), -7);
  size_t next = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j * BS < c.used[size_t(b)]; ++j) table[size_t(b * MB + j)] = perm[next++ % perm.size()];
  std::vector<int32_t> used(c.used.begin(), c.used.end());
  const size_t nq = size_t(B * Sq * Hq * D), nc = size_t(NB * BS * Hkv * D), nl = size_t(B * Hq * Sq);
  std::vector<T> q = random_vec<T>(nq, rng), kc = random_vec<T>(nc, rng), vc = random_vec<T>(nc, rng);
  std::vector<T> o(nq, Traits<T>::nan());
  std::vector<float> lse(nl, std::numeric_limits<float>::quiet_NaN());
  AttentionShape s{B, Sq, MB * BS, Hq, Hkv, D};
  AttentionAttrs a{float(1.0 / std::sqrt(double(D))), c.causal, c.br, c.wl, -1, c.softcap};
  const flashgen::PagedArgs pa{table.data(), used.data(), NB, BS, MB};
  std::vector<float> al;
  if (c.alibi) {
    al = random_slopes(c.alibi == 2 ? B * Hq : Hq, rng);
    flashgen::ScoreExtras x;
    x.alibi = al.data();
    x.alibi_stride_b = c.alibi == 2 ? Hq : 0;
    fc::attention_fwd_paged<T, D>(q.data(), kc.data(), vc.data(), o.data(), lse.data(), s, pa, a, x, c.nt, nullptr,
                                  c.kv_splits);
  } else {
    fc::attention_fwd_paged<T, D>(q.data(), kc.data(), vc.data(), o.data(), lse.data(), s, pa, a, c.nt, nullptr,
                                  c.kv_splits);
  }

  const std::vector<double> qd = to_double(q), kd = to_double(kc), vd = to_double(vc);
  RefOut all;
  all.o.assign(nq, 0.0), all.mo.assign(nq, 0.0), all.lse.assign(nl, 0.0);
  for (int64_t b = 0; b < B; ++b) {
    Prob p;
    p.B = 1, p.Sq = Sq, p.Sk = used[size_t(b)], p.Hq = Hq, p.Hkv = Hkv, p.D = D;
    p.scale = a.scale, p.softcap = c.softcap, p.causal = c.causal, p.br = c.br, p.wl = c.wl;
    p.alibi = slopes_of(al, c.alibi, b, Hq);
    const size_t q0 = size_t(b * Sq * Hq * D), qn = size_t(Sq * Hq * D);
    p.q.assign(qd.begin() + q0, qd.begin() + q0 + qn);
    for (int64_t j = 0; j < p.Sk; ++j) {
      const size_t row = size_t((int64_t(table[size_t(b * MB + j / BS)]) * BS + j % BS) * Hkv * D);
      p.k.insert(p.k.end(), kd.begin() + row, kd.begin() + row + size_t(Hkv * D));
      p.v.insert(p.v.end(), vd.begin() + row, vd.begin() + row + size_t(Hkv * D));
    }
    RefOut r;
    reference(p, r, false, 0);
    std::copy(r.o.begin(), r.o.end(), all.o.begin() + q0);
    std::copy(r.mo.begin(), r.mo.end(), all.mo.begin() + q0);
    std::copy(r.lse.begin(), r.lse.end(), all.lse.begin() + size_t(b * Hq * Sq));
  }
  const bool bf16_p = fc::detail::kBf16Dot && std::is_same<T, fc::bf16>::value;
  Err eo, el;
  compare(o, all.o, all.mo, eo, mtol_for_products(bf16_p));
  compare_lse(lse, all.lse, el);
  std::string us;
  for (int64_t b = 0; b < B; ++b) us += (b ? "," : "") + std::to_string(used[size_t(b)]);
  char buf[640];
  std::snprintf(buf, sizeof buf,
                "paged  %-4s D=%-3d %-30s Sq=%lld Hq=%lld Hkv=%lld BS=%lld NB=%lld MB=%lld seqused [%s] c=%d br=%d "
                "wl=%d cap=%g alibi=%d nt=%d splits=%d | o=%.2e lse=%.2e | worst err/tol %.2f",
                Traits<T>::name(), D, c.name, (long long)Sq, (long long)Hq, (long long)Hkv, (long long)BS,
                (long long)NB, (long long)MB, us.c_str(), int(c.causal), int(c.br), c.wl, double(c.softcap), c.alibi, c.nt,
                c.kv_splits, eo.max_abs, el.max_abs, std::max(eo.worst_ratio, el.worst_ratio));
  check(eo.ok && el.ok, buf);
  VarSummary& sm = g_var[2][type_index<T>()];
  sm.o = std::max(sm.o, eo.max_abs), sm.lse = std::max(sm.lse, el.max_abs);
  sm.cases++;
  if (c.alibi) {
    VarSummary& sa = g_alibi[1][type_index<T>()];
    sa.o = std::max(sa.o, eo.max_abs), sa.lse = std::max(sa.lse, el.max_abs);
    sa.cases++;
  }
}

static const PCase kPCases[] = {
    // name                          Sq Hq Hkv  BS  NB  used           MB  causal br   wl cap nt splits
    {"decode BS=16",                 1, 4, 2,  16, 40, {0, 37, 300},  20, true,  true,  -1, 0, 2, 0},
    {"prefill chunk BS=16",         20, 2, 1,  16, 40, {100, 5, 250}, 17, true,  true,  -1, 0, 2, 0},
    {"BS=256",                       5, 2, 2, 256,  6, {600, 0, 256},  3, true,  true,  -1, 0, 2, 0},
    {"BS=48 (not a multiple of 64)", 3, 4, 1,  48, 30, {1, 200, 333},  8, false, false, -1, 0, 3, 0},
    {"BS=48 window softcap",         9, 2, 1,  48, 30, {77, 300, 9},   8, true,  true,  40, 5, 2, 0},
    {"seqused=0 only",               2, 2, 1,  16,  4, {0, 0},         2, true,  true,  -1, 0, 2, 0},
    {"split-KV decode, no split",    1, 4, 1,  16, 520, {8000},      510, true,  true,  -1, 0, 8, 1},
    {"split-KV decode, auto",        1, 4, 1,  16, 520, {8000},      510, true,  true,  -1, 0, 8, 0},
    {"split-KV decode, 7 splits",    1, 4, 1,  16, 520, {8000},      510, true,  true,  -1, 0, 8, 7},
    {"split-KV, short seq + empty",  2, 2, 2,  16, 100, {900, 0, 50}, 60, true,  true,  -1, 0, 8, 5},
    {"alibi[H] decode split-KV x4",  1, 4, 1,  16, 100, {900, 0, 50}, 60, true,  true,  -1, 0, 4, 4, 1},
    {"alibi[B,H] decode auto split", 1, 4, 2,  16, 520, {8000},      510, true,  true,  -1, 0, 8, 0, 2},
    {"alibi[B,H] decode no split",   1, 4, 2,  16, 260, {37, 4000},  255, true,  true,  -1, 0, 2, 1, 2},
    {"alibi[B,H] prefill br",       20, 2, 1,  16,  40, {100, 5, 250}, 17, true, true,  -1, 0, 2, 0, 2},
    {"alibi[H] Sq=7 split-KV x3",    7, 2, 2,  16, 100, {900, 30},    60, true,  true,  -1, 0, 2, 3, 1},
    {"alibi[H] non-causal br BS=48", 3, 4, 1,  48,  30, {1, 200, 333}, 8, false, true,  -1, 0, 3, 0, 1},
    {"alibi[B,H] window softcap",    9, 2, 1,  48,  30, {77, 300, 9},  8, true,  true,  40, 5, 2, 0, 2},
};

template <typename T>
static void run_variants_type(std::mt19937_64& rng) {
  int idx = 0;
  for (const VCase& c : kVCases) {
    // Alternate head dims and thread counts so every case runs a few configurations cheaply.
    const int nt = 1 + idx % 3;
    if (idx % 4 == 0)
      run_variant<T, 128>(c, nt, rng);
    else
      run_variant<T, 64>(c, nt, rng);
    if (idx % 5 == 0) run_variant<T, 32>(c, 4, rng);
    ++idx;
  }
  run_variant<T, 256>(kVCases[18], 2, rng);  // all extras, largest head dim
  idx = 0;
  for (const LCase& c : kLCases) {
    run_varlen<T, 64>(c, 1 + idx % 3, rng);
    if (idx < 2) run_varlen<T, 128>(c, 3, rng);
    ++idx;
  }
  for (const PCase& c : kPCases) {
    if (c.BS == 256)
      run_paged<T, 128>(c, rng);
    else
      run_paged<T, 64>(c, rng);
  }
}

// Determinism: the same inputs (same rng seed) through the forward and the
// backward with 1, 2, 3 and 7 threads, twice each, must give bit-identical o,
// lse, dq, dk, dv and dbias (besides passing the accuracy checks of
// run_variant). Broadcast biases whose dbias slots are shared by several
// (batch entry, kv head) pairs, and one that is not ([B,H]: there dq's key
// chunking follows num_threads, so dq is compared between runs with the same
// num_threads only). Then the machine's thread count (FLASHGEN_CPU_THREADS,
// which sets the shared-slot key chunking) is varied too: dbias, dk and dv
// must still be bit-identical (dq may differ in its last bits: its per-chunk
// partial sums are grouped differently).
//                 name                          B   Sq   Sk  Hq Hkv causal br   wl  wr cap al bi bb bh inf mk mb mh sg split
static const VCase kDetCases[] = {
    {"det bias f32 [1,1] causal",                2, 130, 300, 4, 2, true,  false, -1, -1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1},
    {"det bias f32 [1,H] (B=3)",                 3, 100, 260, 4, 2, false, false, -1, -1, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 1},
    {"det bias T [B,1] GQA mask",                2,  90, 330, 4, 2, false, false, -1, -1, 0, 0, 2, 1, 0, 0, 1, 1, 0, 0, 1},
    {"det bias T [1,1] window softcap MQA",      3, 120, 250, 4, 1, false, true,  60, 30, 5, 0, 2, 0, 0, 1, 0, 0, 0, 0, 1},
    {"det bias f32 [1,H] segments",              2, 150, 200, 2, 2, true,  true,  -1, -1, 0, 1, 1, 0, 1, 0, 0, 0, 0, 1, 1},
    {"det bias f32 [B,H] (not shared)",          2,  70, 200, 4, 2, false, false, -1, -1, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1},
};

template <typename T, int D>
static void test_determinism() {
  static const char* kNames[6] = {"o", "lse", "dq", "dk", "dv", "dbias"};
  const char* env = std::getenv("FLASHGEN_CPU_THREADS");
  const std::string saved = env != nullptr ? env : "";
  for (const VCase& c : kDetCases) {
    const bool shared = !(c.bias_b && c.bias_h);
    std::vector<std::string> first, same_nt, cur;
    std::string bad;
    int runs = 0;
    for (int nt : {1, 2, 3, 7})
      for (int rep = 0; rep < 2; ++rep, ++runs) {
        std::mt19937_64 rng(1234);
        run_variant<T, D>(c, nt, rng, runs == 0 ? &first : rep == 0 ? &same_nt : &cur);
        if (runs == 0) same_nt = first;
        if (rep == 0) continue;
        for (size_t f = 0; f < first.size(); ++f)
          if (cur[f] != same_nt[f] || (cur[f] != first[f] && (shared || f != 2)))
            bad += std::string(" ") + kNames[f] + "(nt=" + std::to_string(nt) + ")";
      }
    check(bad.empty(), std::string("determinism ") + Traits<T>::name() + " " + c.name + ": " +
                           std::to_string(runs) + " runs, nt 1/2/3/7, bit-identical o lse dq dk dv dbias" +
                           (shared ? "" : " (dq: per nt)") + (bad.empty() ? "" : " | differ:" + bad));
    // Other machine thread counts: the key chunking changes; dbias, dk, dv must not.
    bad.clear();
    for (const char* hw : {"1", "3", "8"}) {
      setenv("FLASHGEN_CPU_THREADS", hw, 1);
      std::mt19937_64 rng(1234);
      run_variant<T, D>(c, 3, rng, &cur);
      for (size_t f = 3; f < first.size(); ++f)
        if (cur[f] != first[f]) bad += std::string(" ") + kNames[f] + "(hw=" + hw + ")";
    }
    if (env != nullptr)
      setenv("FLASHGEN_CPU_THREADS", saved.c_str(), 1);
    else
      unsetenv("FLASHGEN_CPU_THREADS");
    check(bad.empty(), std::string("determinism ") + Traits<T>::name() + " " + c.name +
                           ": FLASHGEN_CPU_THREADS 1/3/8, bit-identical dk dv dbias" +
                           (bad.empty() ? "" : " | differ:" + bad));
  }
}

static void test_split_plan() {
  // The paged decode case "auto" below: one row block per head (4), 8000 keys, 8 threads.
  const flashgen::AttentionShape s{1, 1, 8000, 4, 1, 64};
  const flashgen::AttentionAttrs a{0.125f, true, true};
  const double flops = 4.0 * 4 * std::max(fc::detail::visible_pairs(s, a), 1.0) * 64;
  const auto sp = fc::detail::plan_splits(4, 8000, fc::detail::threads_for(8, flops), 0);
  check(sp.nsplit > 1, "split-KV plan: decode with B*Hq*q-blocks = 4 < useful threads splits into " +
                           std::to_string(sp.nsplit) + " ranges of " + std::to_string(sp.keys) + " keys");
  const auto none = fc::detail::plan_splits(64, 4000, 8, 0);
  check(none.nsplit == 1, "split-KV plan: no split with 64 row blocks on 8 threads");
}

// A running max that jumps far beyond the forward's slack (forward.h kExpSlack): q = 1, keys 0
// (scores 0) up to key `jump` - 1, then keys of 16s (scores 128, exact: 2^184.7 in the kernel's
// base-2 units against a max of 0). At 192, in a key block after the first, crossing the causal
// diagonal or not, against the settled max; at 8, within the first key block past the rows
// that seed its max (fwd_tiles.h kSeedRows; causal: q block 1's first block). The block must be
// computed again with the new max; exponentials against the old one overflow to inf.
template <typename T>
static void test_fwd_max_jump(std::mt19937_64& rng) {
  constexpr int D = 64;
  const int64_t S = 256, n = S * D;
  for (int64_t jump : {192, 8})
    for (bool causal : {true, false}) {
      std::vector<T> q(size_t(n), Traits<T>::from(1.0f)), k(size_t(n), Traits<T>::from(0.0f));
      const std::vector<T> v = random_vec<T>(size_t(n), rng);
      // Every 8th row's scores stay 0: the jump is in other rows than a vector's first lane (a
      // slack test reading one lane passes when all rows jump together).
      for (int64_t i = 0; i < S; i += 8)
        for (int d = 0; d < D; ++d) q[size_t(i * D + d)] = Traits<T>::from(0.0f);
      for (int64_t j = 0; j < S; ++j)
        for (int d = 0; d < D; ++d) k[size_t(j * D + d)] = Traits<T>::from(j >= jump ? 16.0f : 0.0f);
      std::vector<T> o(size_t(n), Traits<T>::nan());
      std::vector<float> lse(size_t(S), std::numeric_limits<float>::quiet_NaN());
      const AttentionShape s{1, S, S, 1, 1, D};
      const AttentionAttrs a{0.125f, causal, false};
      fc::attention_fwd<T, D>(q.data(), k.data(), v.data(), o.data(), lse.data(), s, a, 1);
      Prob p;
      p.Sq = p.Sk = S, p.D = D, p.scale = 0.125, p.causal = causal;
      p.q = to_double(q), p.k = to_double(k), p.v = to_double(v);
      RefOut r;
      reference(p, r, false, 0);
      Err eo, el;
      compare(o, r.o, r.mo, eo, mtol_for_products(fc::detail::kBf16Dot && std::is_same<T, fc::bf16>::value));
      compare_lse(lse, r.lse, el);
      check(eo.ok && el.ok, std::string("forward, the max jumping by 2^184 ") +
                                (jump == 192 ? "in a later key block: " : "within the first key block: ") +
                                Traits<T>::name() + (causal ? " causal" : " full"));
    }
}

static void run_all_variants(std::mt19937_64& rng) {
  test_split_plan();
  run_variants_type<float>(rng);
  run_variants_type<fc::bf16>(rng);
  run_variants_type<fc::f16>(rng);
  test_fwd_max_jump<float>(rng);
  test_fwd_max_jump<fc::bf16>(rng);
  test_fwd_max_jump<fc::f16>(rng);
  test_determinism<float, 64>();
  test_determinism<fc::bf16, 64>();
  test_determinism<fc::f16, 128>();
  const char* names[3] = {"f32", "bf16", "f16"};
  for (int f = 0; f < 3; ++f)
    for (int t = 0; t < 3; ++t) {
      const VarSummary& v = g_var[f][t];
      std::printf("max abs err %-6s %-4s (%2d cases): o %.2e  lse %.2e  dq %.2e  dk %.2e  dv %.2e  dbias %.2e\n",
                  kFamilies[f], names[t], v.cases, v.o, v.lse, v.dq, v.dk, v.dv, v.db);
    }
  for (int f = 0; f < 2; ++f)
    for (int t = 0; t < 3; ++t) {
      const VarSummary& v = g_alibi[f][t];
      std::printf("max abs err alibi %-6s %-4s (%2d cases): o %.2e  lse %.2e  dq %.2e  dk %.2e  dv %.2e\n",
                  kFamilies[f + 1], names[t], v.cases, v.o, v.lse, v.dq, v.dk, v.dv);
    }
}

int main() {
  const auto t0 = std::chrono::steady_clock::now();
  test_conversions();
  test_parallel_for();
  test_call_scratch();
  test_made_once();
  test_lane_math();
  test_transpose();
  std::printf("bf16 products on vdpbf16ps: %s\n", fc::detail::kBf16Dot ? "yes" : "no");
  std::mt19937_64 rng(42);
  run_type<float>(rng);
  run_type<fc::bf16>(rng);
  run_type<fc::f16>(rng);
  std::mt19937_64 rng2(7);
  run_all_variants(rng2);
  const char* names[3] = {"f32", "bf16", "f16"};
  for (int t = 0; t < 3; ++t)
    std::printf("max abs err %-4s: o %.2e  lse %.2e  dq %.2e  dk %.2e  dv %.2e\n", names[t], g_sum[t].o,
                g_sum[t].lse, g_sum[t].dq, g_sum[t].dk, g_sum[t].dv);
  test_calls_keep_their_buffers();  // last: it fixes glibc's mmap threshold for the process
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("elapsed %.1f s\n", secs);
  std::printf("%d passed, %d failed\n", g_pass, g_fail);
  return g_fail == 0 ? 0 : 1;
}
