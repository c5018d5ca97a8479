// FMA throughput probe for `flashgen bench --platform cpu`: the f32 peak that
// GFLOP/s figures are given as a fraction of.
//
//   c++ -std=c++17 -O2 -march=native -pthread fma_peak.cc -o fma_peak && ./fma_peak [--cpu-time] [threads...]
//
// Each thread runs independent chains of vector FMAs (enough to cover the FMA
// latency times the number of FMA pipes) on registers only; prints one JSON
// line per thread count: {"threads": t, "gflops": total, "vector_bits": b}.
// --cpu-time: each thread's time is its own CPU time, not the wall clock (the
// peak of a CPU the thread has to itself; for benches timed by CPU time on a
// shared machine).
#include <atomic>
#include <chrono>
#include <cstring>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
typedef __m512 V;
static inline V vset(float x) { return _mm512_set1_ps(x); }
static inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(V a) { return _mm512_reduce_add_ps(a); }
constexpr int kLanes = 16;
#elif defined(__AVX__) && defined(__FMA__)
typedef __m256 V;
static inline V vset(float x) { return _mm256_set1_ps(x); }
static inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(V a) {
  alignas(32) float t[8];
  _mm256_store_ps(t, a);
  float s = 0;
  for (float x : t) s += x;
  return s;
}
constexpr int kLanes = 8;
#else
typedef float V __attribute__((vector_size(16)));
static inline V vset(float x) { return V{x, x, x, x}; }
static inline V vfma(V a, V b, V c) { return a * b + c; }
static inline float vsum(V a) { return a[0] + a[1] + a[2] + a[3]; }
constexpr int kLanes = 4;
#endif

constexpr int kChains = 16;  // independent accumulators
static volatile float g_sink;
static bool g_cpu_time = false;

static double now() {
  if (!g_cpu_time) return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}  // keeps the (otherwise pure) probe from being optimized away

__attribute__((noinline)) static float run_fmas(long iters, float seed) {
  V acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = vset(seed + 0.001f * i);
  const V a = vset(0.9999999f), b = vset(1e-7f);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < kChains; ++i) acc[i] = vfma(acc[i], a, b);
  }
  V s = acc[0];
  for (int i = 1; i < kChains; ++i) s += acc[i];
  return vsum(s);
}

static double measure(int threads, double seconds) {
  // Calibrate the iteration count on one thread so a run lasts ~seconds.
  long iters = 1 << 16;
  for (;;) {
    auto t0 = std::chrono::steady_clock::now();
    g_sink = run_fmas(iters, 1.0f);
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (dt > seconds / 4) {
      iters = long(iters * seconds / dt);
      break;
    }
    iters *= 2;
  }
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<double> secs(threads);
  std::vector<float> sink(threads);
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load()) {
      }
      const double t0 = now();
      sink[t] = run_fmas(iters, 1.0f + t);
      secs[t] = now() - t0;
    });
  while (ready.load() < threads) {
  }
  go.store(true);
  for (auto& t : ts) t.join();
  double total = 0;
  for (int t = 0; t < threads; ++t) total += 2.0 * kLanes * kChains * double(iters) / secs[t];
  g_sink = sink[0];
  return total / 1e9;
}

int main(int argc, char** argv) {
  std::vector<int> counts;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--cpu-time") == 0)
      g_cpu_time = true;
    else
      counts.push_back(std::atoi(argv[i]));
  }
  if (counts.empty()) counts = {1, int(std::thread::hardware_concurrency())};
  for (int t : counts) {
    if (t < 1) continue;
    double best = 0;
    for (int rep = 0; rep < 5; ++rep) {
      double g = measure(t, 0.1);
      if (g > best) best = g;
    }
    std::printf("{\"threads\": %d, \"gflops\": %.1f, \"vector_bits\": %d}\n", t, best, kLanes * 32);
  }
  return 0;
}
