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
// Also checks the scalar bf16/f16 conversions against an exact reference, the
// 32-bit transpose, and parallel_for on the own pool and on Workers whose
// helpers start late, run inline, or never start.
#include "flashgen/cpu/flash_cpu.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <thread>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
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
  for (auto& x : k) x = Traits<T>::from(U(rng));
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
  // Helpers that start late / never: the caller finishes the work alone.
  LateWorkers late;
  NoWorkers none;
  run_case<T, 64>({2, 200, 200, 4, 2, true, false}, 4, rng, &late);
  run_case<T, 64>({1, 129, 300, 2, 2, true, true}, 2, rng, &none);
  late.join();
}

int main() {
  const auto t0 = std::chrono::steady_clock::now();
  test_conversions();
  test_parallel_for();
  test_transpose();
  std::printf("bf16 products on vdpbf16ps: %s\n", fc::detail::kBf16Dot ? "yes" : "no");
  std::mt19937_64 rng(42);
  run_type<float>(rng);
  run_type<fc::bf16>(rng);
  run_type<fc::f16>(rng);
  const char* names[3] = {"f32", "bf16", "f16"};
  for (int t = 0; t < 3; ++t)
    std::printf("max abs err %-4s: o %.2e  lse %.2e  dq %.2e  dk %.2e  dv %.2e\n", names[t], g_sum[t].o,
                g_sum[t].lse, g_sum[t].dq, g_sum[t].dk, g_sum[t].dv);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("elapsed %.1f s\n", secs);
  std::printf("%d passed, %d failed\n", g_pass, g_fail);
  return g_fail == 0 ? 0 : 1;
}
