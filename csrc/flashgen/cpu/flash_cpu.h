// FlashAttention for the CPU: header-only, fp32 accumulation, O(S*D) extra memory.
//
// Layout and masking follow flashgen/attention.h (BSHD, GQA/MQA, causal with a
// top-left or bottom-right offset; a row that sees no key gives o = 0,
// lse = -inf and no gradient).
//
// Forward, per work item (batch, q head, block of BQ query rows):
//   Qt = the q block transposed (loaded once per item; 16x16 register
//   transposes where AVX-512 is available);
//   for each visible key block of BK keys:
//     St = K_blk * Qt            [BK][BQ] fp32, lanes run over query rows,
//     online softmax over the key axis (row max / row sum are lane-wise, no
//     horizontal reductions), exponentials in base 2 with the scale folded in,
//     O = diag(alpha) O + P V    (P read transposed from St).
//   Key blocks that are fully masked (causal) are skipped; in blocks that cross
//   the diagonal the products skip the masked micro-tiles (a key-row group
//   starts at its first visible query vector, a query-row group stops at its
//   last visible key) and the remaining elements get a per-element mask.
//   Sliding window: only key blocks inside the window band are visited; blocks
//   crossing a window edge get full products and a per-element band mask.
//   Softcap: St = c * tanh(St * scale / c) (vectorized tanh) before masking;
//   the backward multiplies dS by 1 - tanh^2.
// Backward (FlashAttention-2), per work item (batch, kv head, key chunk):
//   for each key block of the chunk (Kt, Vt transposed once per block):
//     for each q head of the group and each q block that sees the key block:
//       S = Q Kt, P = exp2(S*scale*log2e - lse*log2e), dP = dO Vt,
//       dS = scale * P o (dP - Drow), dV += P^T dO, dK += dS^T Q, dQ += dS K.
//   dQ accumulates in fp32: in dq itself (T = float and one chunk per kv head)
//   or in a [chunks][B][Sq][Hq][D] buffer reduced at the end; every accumulator
//   region belongs to exactly one work item and is summed in a fixed order, so
//   there are no races and every gradient is the same on every run.
//
//
// Variants (README "Variants"; attention.h ScoreExtras / VarlenArgs / PagedArgs):
//   Score extras (dense targets): ALiBi, an additive bias (f32 or the q type,
//   broadcast over batch / heads by strides), a boolean mask and segment ids.
//   Forward: per key block an extras tile Xt [BK][BQ] (bias transposed, minus
//   slope * |i + off - j|, times log2(e); -inf where mask / segments hide the
//   pair) is added to the base-2 scores after scale, softcap and the band mask.
//   Backward: the same terms per query row, along the key lanes; dS' = P o (dP -
//   Drow) is dbias's share, dS = dS' * scale (* (1 - tanh^2) with softcap).
//   dbias accumulates in fp32 (dbias itself when f32), each element in one
//   work item and in a fixed order (bit-reproducible, no locks): an item
//   (batch, kv head, key chunk) that owns its slots writes them directly; when
//   slots are shared (bias broadcast over the batch or over kv-head groups),
//   the items are (group of pairs sharing slots, key chunk), running the
//   group's (batch, kv head) pairs in order for each key block. Key blocks whose
//   segment-id range is disjoint from the q block's are skipped; everything
//   else is masked per element. Without extras the code path is the one above.
//   Packed varlen: every work item is a (sequence, head, q block) forward or
//   (sequence, kv head, key chunk) backward of a dense problem with its own
//   base pointers and lengths (lse [Hq][Tq]); rows outside every sequence get
//   o = 0, lse = -inf and zero gradients.
//   Paged KV (forward): key rows come through a row accessor (block table) into
//   the same contiguous block buffers; batch entry b has seqused_k[b] keys.
//   Varlen and paged take ALiBi only (the slopes of ScoreExtras; per sequence /
//   batch entry b, with that problem's own Sq, Sk for the offset); it goes
//   through the same extras path as the dense targets (a constant in the
//   backward: no slope gradient).
//   Split-KV (dense and paged forward): when there are fewer row blocks than
//   useful threads, each row block's keys are split into ranges processed by
//   different items, each writing fp32 partial (o, lse); a log-sum-exp merge
//   combines them (partials with lse = -inf contribute nothing).
//
// Matrix products go through one register-blocked micro-kernel written with
// GCC/Clang vector extensions (AVX-512, AVX2/FMA, or SSE2 depending on the
// target flags), so the header compiles with and without -march=native.
// bf16 with AVX512_BF16 (compiled for a host that has it, e.g. -march=native on
// Zen 4/5 or Sapphire Rapids): every product runs on vdpbf16ps (pairs of bf16,
// fp32 accumulation). Q K^T and dO V^T take bf16 inputs only and are exact up
// to fp32 accumulation; P (forward and backward) and dS are rounded to bf16
// before the products that take them (P V, P^T dO, dS^T Q, dS K), as GPU
// FlashAttention does: each such product is off by at most 2^-9 of the sum of
// the absolute values of its terms. Softmax statistics, lse and every
// accumulator stay fp32. f32 and f16, and bf16 on other hosts, compute in fp32
// (FLASHGEN_CPU_NO_BF16_DOT forces that for bf16 too).
//
// Threads: parallel_for hands items to helper workers that run on a Workers
// pool (XLA's intra-op pool through the FFI, or a persistent pool of this
// header's own) while the calling thread works too; per-thread workspaces are
// cached, so a small call allocates nothing big and starts no thread.
// Not supported: -ffast-math / -ffinite-math-only (masking relies on infinities).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <new>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#include <sched.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "flashgen/attention.h"

namespace flashgen {
namespace cpu {

// Storage types; layout-compatible with uint16_t.
struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};
static_assert(sizeof(bf16) == 2 && std::is_standard_layout<bf16>::value, "bf16 layout");
static_assert(sizeof(f16) == 2 && std::is_standard_layout<f16>::value, "f16 layout");

// ---------------------------------------------------------------------------
// Threads.
// ---------------------------------------------------------------------------

// FLASHGEN_CPU_THREADS if set to a number > 0 (capped at 4096), else 0.
inline int env_num_threads() {
  if (const char* e = std::getenv("FLASHGEN_CPU_THREADS")) {
    char* end = nullptr;
    long n = std::strtol(e, &end, 10);
    if (end != e && n > 0) return n > 4096 ? 4096 : static_cast<int>(n);
  }
  return 0;
}

// CPUs this process may run on (its affinity mask, e.g. under taskset), else
// the hardware concurrency; at least 1.
inline int available_cpus() {
#if defined(__linux__) && defined(CPU_COUNT)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
#endif
  const unsigned hc = std::thread::hardware_concurrency();
  return hc > 0 ? static_cast<int>(hc) : 1;
}

// Threads to use when the caller gives no pool: FLASHGEN_CPU_THREADS if set,
// else the CPUs this process may run on.
inline int default_num_threads() {
  const int e = env_num_threads();
  return e > 0 ? e : available_cpus();
}

// Where parallel_for's helper workers run. spawn() asks for `count` calls of
// task(arg) on other threads and returns how many it scheduled; a scheduled
// call may start late, after parallel_for returned, or run inline: the caller
// of parallel_for works through the items too and does every item no helper
// took, so progress never waits for a helper to start.
class Workers {
 public:
  virtual int spawn(int count, void (*task)(void*), void* arg) noexcept = 0;

 protected:
  ~Workers() = default;
};

namespace detail {

// A persistent pool: threads start on first use (as many as the largest
// request so far, up to 4096), wait on a condition variable between calls, and
// live until the process exits. After fork() the child gets a fresh pool.
class OwnPool final : public Workers {
 public:
  int spawn(int count, void (*task)(void*), void* arg) noexcept override {
    int scheduled = 0;
    {
      std::lock_guard<std::mutex> lock(m_);
      try {
        for (; scheduled < count; ++scheduled) queue_.emplace_back(task, arg);
      } catch (...) {  // out of memory: the caller does the rest
      }
      while (started_ < std::min(scheduled, 4096)) {
        try {
          std::thread(&OwnPool::loop, this).detach();
          ++started_;
        } catch (...) {  // could not start a thread: the started ones (or the caller) do the work
          break;
        }
      }
    }
    if (scheduled == 1)
      cv_.notify_one();
    else if (scheduled > 1)
      cv_.notify_all();
    return scheduled;
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(m_);
    for (;;) {
      cv_.wait(lock, [this] { return !queue_.empty(); });
      const auto t = queue_.front();
      queue_.pop_front();
      lock.unlock();
      t.first(t.second);
      lock.lock();
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::pair<void (*)(void*), void*>> queue_;
  int started_ = 0;
};

inline std::atomic<OwnPool*>& own_pool_slot() {
  static std::atomic<OwnPool*> slot{nullptr};
  return slot;
}

}  // namespace detail

// The process-wide pool used when no Workers are given (never destroyed).
inline Workers& own_pool() {
  auto& slot = detail::own_pool_slot();
#if defined(__unix__) || defined(__APPLE__)
  // In a forked child the pool's threads are gone (and its mutex may be held):
  // forget it, leaking it, and start a new one on next use.
  static const bool registered = [] {
    return pthread_atfork(nullptr, nullptr, [] { detail::own_pool_slot().store(nullptr); }) == 0;
  }();
  (void)registered;
#endif
  detail::OwnPool* p = slot.load(std::memory_order_acquire);
  if (p == nullptr) {
    auto* fresh = new detail::OwnPool();
    if (slot.compare_exchange_strong(p, fresh, std::memory_order_acq_rel))
      p = fresh;
    else
      delete fresh;  // another thread installed one first (fresh started no thread)
  }
  return *p;
}

namespace detail {

// Shared state of one parallel_for, reference-counted so that a helper that
// starts after parallel_for returned finds no work and frees it safely.
struct Job {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<int> refs{1};
  std::atomic<int> workers{1};  // worker indices handed out (the caller is 0)
  int64_t n = 0;
  int max_workers = 1;
  void (*call)(void* fn, int64_t i, int w) = nullptr;
  void* fn = nullptr;
  std::mutex m;
  std::condition_variable cv;
};

inline void job_release(Job* j) {
  if (j->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete j;
}

// Takes items until none is left. fn is touched only for a claimed item, and
// parallel_for returns only after every claimed item is done.
inline void job_work(Job* j, int w) {
  for (;;) {
    const int64_t i = j->next.fetch_add(1, std::memory_order_relaxed);
    if (i >= j->n) break;
    j->call(j->fn, i, w);
    if (j->done.fetch_add(1, std::memory_order_acq_rel) + 1 == j->n) {
      std::lock_guard<std::mutex> lock(j->m);
      j->cv.notify_all();
    }
  }
}

inline void job_helper(void* p) {
  Job* j = static_cast<Job*>(p);
  if (j->next.load(std::memory_order_relaxed) < j->n) {
    const int w = j->workers.fetch_add(1, std::memory_order_relaxed);
    if (w < j->max_workers) job_work(j, w);
  }
  job_release(j);
}

}  // namespace detail

// Runs fn(i, worker) for i in [0, n) on at most min(num_threads, n) workers:
// the calling thread (worker 0) and helpers on `workers` (the own pool when
// null); worker < that count. Items are handed out dynamically in increasing
// order. num_threads <= 1 runs everything inline. fn must not throw.
template <typename F>
void parallel_for(int64_t n, int num_threads, F&& fn, Workers* workers = nullptr) {
  if (n <= 0) return;
  const int nt = static_cast<int>(std::min<int64_t>(std::max(num_threads, 1), n));
  if (nt <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  using Fn = typename std::remove_reference<F>::type;
  detail::Job* j = new detail::Job();
  j->n = n;
  j->max_workers = nt;
  j->call = [](void* f, int64_t i, int w) { (*static_cast<Fn*>(f))(i, w); };
  j->fn = const_cast<void*>(static_cast<const void*>(&fn));
  j->refs.store(nt, std::memory_order_relaxed);
  Workers& pool = workers ? *workers : own_pool();
  const int scheduled = pool.spawn(nt - 1, detail::job_helper, j);
  for (int s = scheduled; s < nt - 1; ++s) detail::job_release(j);  // refs of helpers never scheduled
  detail::job_work(j, 0);
  if (j->done.load(std::memory_order_acquire) < n) {
    // The items left are running on helpers: wait (briefly spinning first).
    for (int spin = 0; spin < 2000 && j->done.load(std::memory_order_acquire) < n; ++spin) {
#if defined(__x86_64__) || defined(__i386__)
      _mm_pause();
#endif
    }
    std::unique_lock<std::mutex> lock(j->m);
    j->cv.wait(lock, [&] { return j->done.load(std::memory_order_acquire) >= n; });
  }
  detail::job_release(j);
}

namespace detail {

#define FLASHGEN_CPU_INLINE inline __attribute__((always_inline))

// ---------------------------------------------------------------------------
// Scalar conversions (round-to-nearest-even, NaN and infinity preserving).
// ---------------------------------------------------------------------------
FLASHGEN_CPU_INLINE float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
FLASHGEN_CPU_INLINE uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

FLASHGEN_CPU_INLINE float bf16_bits_to_f32(uint16_t h) { return bits_to_f32(uint32_t(h) << 16); }

FLASHGEN_CPU_INLINE uint16_t f32_to_bf16_bits(float f) {
  const uint32_t u = f32_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);  // quiet NaN, keep sign/payload
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

FLASHGEN_CPU_INLINE float f16_bits_to_f32_soft(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  uint32_t u;
  if (em >= 0x7c00u) {
    u = 0x7f800000u | ((em & 0x3ffu) << 13);  // inf / NaN (payload kept)
  } else if (em >= 0x0400u) {
    u = (em << 13) + (uint32_t(127 - 15) << 23);  // normal
  } else {
    u = f32_to_bits(float(em) * 5.9604644775390625e-8f);  // subnormal / zero: em * 2^-24, exact
  }
  return bits_to_f32(u | sign);
}

FLASHGEN_CPU_INLINE uint16_t f32_to_f16_bits_soft(float f) {
  uint32_t u = f32_to_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  uint16_t o;
  if (u >= 0x7f800000u) {
    o = u > 0x7f800000u ? uint16_t(0x7e00u | ((u >> 13) & 0x3ffu)) : uint16_t(0x7c00u);
  } else if (u >= 0x477ff000u) {  // >= 65520: rounds to infinity
    o = 0x7c00u;
  } else if (u >= 0x38800000u) {  // >= 2^-14: normal half
    const uint32_t r = u + 0x0fffu + ((u >> 13) & 1u);
    o = uint16_t((r >> 13) - (uint32_t(127 - 15) << 10));
  } else {  // half subnormal or zero: add 0.5 so the f32 ulp is 2^-24 and let the FPU round
    volatile float a = bits_to_f32(u);  // volatile: keep the rounding add as written
    const float s = a + 0.5f;
    o = uint16_t(f32_to_bits(s) - 0x3f000000u);
  }
  return uint16_t(o | sign);
}

FLASHGEN_CPU_INLINE float f16_bits_to_f32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return f16_bits_to_f32_soft(h);
#endif
}
FLASHGEN_CPU_INLINE uint16_t f32_to_f16_bits(float f) {
#if defined(__F16C__)
  return uint16_t(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
  return f32_to_f16_bits_soft(f);
#endif
}

FLASHGEN_CPU_INLINE float to_f32(float x) { return x; }
FLASHGEN_CPU_INLINE float to_f32(bf16 x) { return bf16_bits_to_f32(x.bits); }
FLASHGEN_CPU_INLINE float to_f32(f16 x) { return f16_bits_to_f32(x.bits); }

template <typename T>
FLASHGEN_CPU_INLINE T from_f32(float x);
template <>
FLASHGEN_CPU_INLINE float from_f32<float>(float x) {
  return x;
}
template <>
FLASHGEN_CPU_INLINE bf16 from_f32<bf16>(float x) {
  return bf16{f32_to_bf16_bits(x)};
}
template <>
FLASHGEN_CPU_INLINE f16 from_f32<f16>(float x) {
  return f16{f32_to_f16_bits(x)};
}

// Bulk conversions of n contiguous elements.
template <typename T>
inline void load_f32(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f32(src[i]);
}
template <>
inline void load_f32<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, size_t(n) * sizeof(float));
}
template <>
inline void load_f32<bf16>(const bf16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = uint32_t(s[i]) << 16;
    std::memcpy(dst + i, &u, 4);
  }
}
#if defined(__F16C__)
template <>
inline void load_f32<f16>(const f16* src, float* dst, int64_t n) {
  const int64_t n8 = n & ~int64_t(7);
  for (int64_t i = 0; i < n8; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (int64_t i = n8; i < n; ++i) dst[i] = f16_bits_to_f32(src[i].bits);
}
#endif

template <typename T>
inline void store_from_f32(const float* src, T* dst, int64_t n, float mul) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_f32<T>(src[i] * mul);
}
template <>
inline void store_from_f32<bf16>(const float* src, bf16* dst, int64_t n, float mul) {
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = f32_to_bits(src[i] * mul);
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t q = (u >> 16) | 0x0040u;
    d[i] = uint16_t((u & 0x7fffffffu) > 0x7f800000u ? q : r);
  }
}
#if defined(__F16C__)
template <>
inline void store_from_f32<f16>(const float* src, f16* dst, int64_t n, float mul) {
  const int64_t n8 = n & ~int64_t(7);
  const __m256 m = _mm256_set1_ps(mul);
  for (int64_t i = 0; i < n8; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(src + i), m), _MM_FROUND_TO_NEAREST_INT));
  for (int64_t i = n8; i < n; ++i) dst[i] = f16{f32_to_f16_bits(src[i] * mul)};
}
#endif

// ---------------------------------------------------------------------------
// Vector type and helpers.
// ---------------------------------------------------------------------------
#if defined(__AVX512F__)
#define FLASHGEN_CPU_VBYTES 64
#elif defined(__AVX__)
#define FLASHGEN_CPU_VBYTES 32
#else
#define FLASHGEN_CPU_VBYTES 16
#endif

typedef float vf __attribute__((vector_size(FLASHGEN_CPU_VBYTES)));
typedef int32_t vi __attribute__((vector_size(FLASHGEN_CPU_VBYTES)));
constexpr int W = FLASHGEN_CPU_VBYTES / 4;  // floats per vector

// Micro-kernel tile: RMAX rows x (NVMAX * W) columns of accumulators.
#if FLASHGEN_CPU_VBYTES == 64
constexpr int RMAX = 4, NVMAX = 4;  // 16 zmm accumulators of 32 (6x4 and 7x4 measured no faster)
#else
constexpr int RMAX = 4, NVMAX = 2;  // 8 accumulators of 16
#endif

// Broadcasts. (A lane-by-lane loop makes GCC emit one masked broadcast per lane.)
FLASHGEN_CPU_INLINE vf splat(float x) {
#if FLASHGEN_CPU_VBYTES == 64
  return (vf)_mm512_set1_ps(x);
#elif FLASHGEN_CPU_VBYTES == 32
  return (vf)_mm256_set1_ps(x);
#elif defined(__SSE__)
  return (vf)_mm_set1_ps(x);
#else
  return x - vf{};
#endif
}
FLASHGEN_CPU_INLINE vi splat_i(int32_t x) {
#if FLASHGEN_CPU_VBYTES == 64
  return (vi)_mm512_set1_epi32(x);
#elif FLASHGEN_CPU_VBYTES == 32
  return (vi)_mm256_set1_epi32(x);
#elif defined(__SSE2__)
  return (vi)_mm_set1_epi32(x);
#else
  return x + vi{};
#endif
}
FLASHGEN_CPU_INLINE vi iota_i() {
  vi v;
  for (int i = 0; i < W; ++i) v[i] = i;
  return v;
}
FLASHGEN_CPU_INLINE vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(vf));
  return v;
}
FLASHGEN_CPU_INLINE void storev(float* p, vf v) { std::memcpy(p, &v, sizeof(vf)); }

FLASHGEN_CPU_INLINE vf vfma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}
FLASHGEN_CPU_INLINE vf vmax(vf a, vf b) {
#if defined(__AVX512F__)
  // Masked forms: the unmasked intrinsics trip -Wmaybe-uninitialized in GCC 12.
  return (vf)_mm512_mask_max_ps((__m512)a, __mmask16(0xffff), (__m512)a, (__m512)b);
#else
  return a > b ? a : b;
#endif
}

// 2^x, ~2 ulp for x in [-126, 127]; x <= -127 (including -inf) gives 0.
FLASHGEN_CPU_INLINE vf exp2v(vf x) {
#if defined(__AVX512F__)
  x = vmax(x, splat(-150.0f));
  const vf n = (vf)_mm512_mask_roundscale_ps((__m512)x, __mmask16(0xffff), (__m512)x,
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const vf lo = splat(-127.0f), hi = splat(127.0f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // n = floor(x + 0.5) without relying on the rounding mode.
  const vf xr = x + splat(0.5f);
  vi ni = __builtin_convertvector(xr, vi);  // truncation toward zero
  ni += (vi)(__builtin_convertvector(ni, vf) > xr);  // -1 where truncation rounded up
  const vf n = __builtin_convertvector(ni, vf);
#endif
  const vf f = x - n;  // [-0.5, 0.5]
  // Cephes exp2f minimax polynomial on [-0.5, 0.5].
  vf p = splat(1.535336188319500e-4f);
  p = vfma(p, f, splat(1.339887440266574e-3f));
  p = vfma(p, f, splat(9.618437357674640e-3f));
  p = vfma(p, f, splat(5.550332471162809e-2f));
  p = vfma(p, f, splat(2.402264791363012e-1f));
  p = vfma(p, f, splat(6.931472028550421e-1f));
  p = vfma(p, f, splat(1.0f));
#if defined(__AVX512F__)
  return (vf)_mm512_mask_scalef_ps((__m512)p, __mmask16(0xffff), (__m512)p, (__m512)n);
#else
  return p * (vf)((ni + splat_i(127)) << 23);  // n = -127 gives the bit pattern 0, i.e. 0.0f
#endif
}


// ---------------------------------------------------------------------------
// GEMM: C[M][N] (=|+=) A[M][K] * B[K][N], N a multiple of W.
// A is read by scalar broadcasts at A[r*sar + k*sak] (any layout); B rows are
// contiguous with row stride ldb; C rows with stride ldc. With SCALE, C is
// first multiplied by rs[r] (row scale).
// Element type E: float (FMA), or uint32_t = a pair of bf16 (low half the
// even element) with K counting pairs: C += a.lo*b.lo + a.hi*b.hi (vdpbf16ps).
// ---------------------------------------------------------------------------
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__) && !defined(FLASHGEN_CPU_NO_BF16_DOT)
#define FLASHGEN_CPU_BF16_DOT 1
#else
#define FLASHGEN_CPU_BF16_DOT 0
#endif
constexpr bool kBf16Dot = FLASHGEN_CPU_BF16_DOT != 0;  // bf16 products on vdpbf16ps

template <typename E>
struct Mac;
template <>
struct Mac<float> {
  static FLASHGEN_CPU_INLINE vf bcast(const float* p) { return splat(*p); }
  static FLASHGEN_CPU_INLINE vf load(const float* p) { return loadv(p); }
  static FLASHGEN_CPU_INLINE vf mac(vf a, vf b, vf c) { return vfma(a, b, c); }
};
#if FLASHGEN_CPU_BF16_DOT
template <>
struct Mac<uint32_t> {
  static FLASHGEN_CPU_INLINE vf bcast(const uint32_t* p) { return (vf)_mm512_set1_epi32(static_cast<int>(*p)); }
  static FLASHGEN_CPU_INLINE vf load(const uint32_t* p) {
    vf v;
    std::memcpy(&v, p, sizeof(vf));
    return v;
  }
  static FLASHGEN_CPU_INLINE vf mac(vf a, vf b, vf c) {
    return (vf)_mm512_dpbf16_ps((__m512)c, (__m512bh)a, (__m512bh)b);
  }
};
#endif

template <typename E, int R, int NV, bool ACC, bool SCALE>
inline void micro_kernel(int64_t K, const E* __restrict A, int64_t sar, int64_t sak, const E* __restrict B,
                         int64_t ldb, float* __restrict C, int64_t ldc, const float* __restrict rs) {
  vf acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    vf sc = splat(SCALE ? rs[r] : 1.0f);
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      if (ACC) {
        acc[r][v] = loadv(C + r * ldc + v * W);
        if (SCALE) acc[r][v] *= sc;
      } else {
        acc[r][v] = splat(0.0f);
      }
    }
  }
  const E* ap[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) ap[r] = A + r * sar;
  for (int64_t k = 0; k < K; ++k) {
    vf bv[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) bv[v] = Mac<E>::load(B + v * W);
    B += ldb;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vf a = Mac<E>::bcast(ap[r]);
      ap[r] += sak;
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] = Mac<E>::mac(a, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) storev(C + r * ldc + v * W, acc[r][v]);
}

template <typename E, int R, bool ACC, bool SCALE>
inline void micro_rows(int nv, int64_t K, const E* A, int64_t sar, int64_t sak, const E* B, int64_t ldb, float* C,
                       int64_t ldc, const float* rs) {
  static_assert(NVMAX == 2 || NVMAX == 4, "NVMAX");
  switch (nv) {
    case 1: micro_kernel<E, R, 1, ACC, SCALE>(K, A, sar, sak, B, ldb, C, ldc, rs); break;
    case 2: micro_kernel<E, R, 2, ACC, SCALE>(K, A, sar, sak, B, ldb, C, ldc, rs); break;
#if FLASHGEN_CPU_VBYTES == 64
    case 3: micro_kernel<E, R, 3, ACC, SCALE>(K, A, sar, sak, B, ldb, C, ldc, rs); break;
    case 4: micro_kernel<E, R, 4, ACC, SCALE>(K, A, sar, sak, B, ldb, C, ldc, rs); break;
#endif
    default: break;
  }
}

template <typename E, bool ACC, bool SCALE>
FLASHGEN_CPU_INLINE void micro_any(int rows, int nv, int64_t K, const E* A, int64_t sar, int64_t sak, const E* B,
                                   int64_t ldb, float* C, int64_t ldc, const float* rs) {
  static_assert(RMAX == 4, "RMAX");
  switch (rows) {
    case 4: micro_rows<E, 4, ACC, SCALE>(nv, K, A, sar, sak, B, ldb, C, ldc, rs); break;
    case 3: micro_rows<E, 3, ACC, SCALE>(nv, K, A, sar, sak, B, ldb, C, ldc, rs); break;
    case 2: micro_rows<E, 2, ACC, SCALE>(nv, K, A, sar, sak, B, ldb, C, ldc, rs); break;
    case 1: micro_rows<E, 1, ACC, SCALE>(nv, K, A, sar, sak, B, ldb, C, ldc, rs); break;
    default: break;
  }
}

// Which micro-tiles a product needs: for the row group [r, r + rows), column
// vectors [vbegin, vend) and the first klen steps of K. Tiles outside are not
// written (callers skip only tiles they never read, or rows whose scale is 1).
struct FullTile {
  FLASHGEN_CPU_INLINE int64_t vbegin(int64_t) const { return 0; }
  FLASHGEN_CPU_INLINE int64_t vend(int64_t, int, int64_t nvt) const { return nvt; }
  FLASHGEN_CPU_INLINE int64_t klen(int64_t, int, int64_t K) const { return K; }
};

template <typename E, bool ACC, bool SCALE = false, typename Tiles = FullTile>
inline void gemm(int64_t M, int64_t N, int64_t K, const E* A, int64_t sar, int64_t sak, const E* B, int64_t ldb,
                 float* C, int64_t ldc, const float* rs = nullptr, const Tiles& tiles = Tiles()) {
  const int64_t nvt = N / W;
  for (int64_t v0 = 0; v0 < nvt; v0 += NVMAX) {
    const int64_t v1 = std::min<int64_t>(nvt, v0 + NVMAX);
    for (int64_t r = 0; r < M; r += RMAX) {
      const int rows = static_cast<int>(std::min<int64_t>(RMAX, M - r));
      const int64_t vb = std::max(v0, tiles.vbegin(r));
      const int64_t ve = std::min(v1, tiles.vend(r, rows, nvt));
      const int64_t kl = std::min(K, tiles.klen(r, rows, K));
      if (vb >= ve || kl <= 0) continue;
      micro_any<E, ACC, SCALE>(rows, static_cast<int>(ve - vb), kl, A + r * sar, sar, sak, B + vb * W, ldb,
                               C + r * ldc + vb * W, ldc, rs + (SCALE ? r : 0));
    }
  }
}

// ---------------------------------------------------------------------------
// Workspace, block sizes.
// ---------------------------------------------------------------------------
struct AlignedFloats {
  float* p = nullptr;
  AlignedFloats() = default;
  explicit AlignedFloats(size_t n) {
    p = static_cast<float*>(::operator new(std::max<size_t>(n, 1) * sizeof(float), std::align_val_t(64)));
  }
  AlignedFloats(const AlignedFloats&) = delete;
  AlignedFloats& operator=(const AlignedFloats&) = delete;
  AlignedFloats(AlignedFloats&& o) noexcept : p(o.p) { o.p = nullptr; }
  AlignedFloats& operator=(AlignedFloats&& o) noexcept {
    std::swap(p, o.p);
    return *this;
  }
  ~AlignedFloats() {
    if (p) ::operator delete(p, std::align_val_t(64));
  }
};

// This thread's scratch space of at least n floats, 64-byte aligned, kept for
// the next call (it only grows).
inline float* thread_workspace(size_t n) {
  thread_local AlignedFloats buf;
  thread_local size_t cap = 0;
  if (cap < n) {
    buf = AlignedFloats();
    buf = AlignedFloats(n);
    cap = n;
  }
  return buf.p;
}

constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Block sizes (tuning knobs; multiples of 16). Measured on Zen 5, D=64: fwd
// 128x64 and bwd 64x64 are at or near the best of {32,64,128,256} x {64,128}.
#ifndef FLASHGEN_CPU_FWD_BQ
#define FLASHGEN_CPU_FWD_BQ 128
#endif
#ifndef FLASHGEN_CPU_FWD_BK
#define FLASHGEN_CPU_FWD_BK 64
#endif
#ifndef FLASHGEN_CPU_BWD_BQ
#define FLASHGEN_CPU_BWD_BQ 64
#endif
#ifndef FLASHGEN_CPU_BWD_BK
#define FLASHGEN_CPU_BWD_BK 64
#endif
constexpr int kFwdBq = FLASHGEN_CPU_FWD_BQ, kFwdBk = FLASHGEN_CPU_FWD_BK;
constexpr int kBwdBq = FLASHGEN_CPU_BWD_BQ, kBwdBk = FLASHGEN_CPU_BWD_BK;
static_assert(kFwdBq % 16 == 0 && kFwdBk % 16 == 0 && kBwdBq % 16 == 0 && kBwdBk % 16 == 0,
              "block sizes must be multiples of 16");

// ---------------------------------------------------------------------------
// Loads.
// ---------------------------------------------------------------------------

// dst[c][i] = src[i][c] for 32-bit elements: n rows (stride ld) of ncols
// columns into a [ncols][ldd] matrix, columns [n, npad) zero-filled.
// ncols and npad are multiples of 16 where AVX-512 is used.
#if defined(__AVX512F__)
// Masked forms: the unmasked intrinsics trip -Wmaybe-uninitialized in GCC 12.
FLASHGEN_CPU_INLINE __m512 unpacklo32(__m512 a, __m512 b) { return _mm512_mask_unpacklo_ps(a, 0xffff, a, b); }
FLASHGEN_CPU_INLINE __m512 unpackhi32(__m512 a, __m512 b) { return _mm512_mask_unpackhi_ps(a, 0xffff, a, b); }
FLASHGEN_CPU_INLINE __m512 unpacklo64(__m512 a, __m512 b) {
  const __m512d x = _mm512_castps_pd(a);
  return _mm512_castpd_ps(_mm512_mask_unpacklo_pd(x, 0xff, x, _mm512_castps_pd(b)));
}
FLASHGEN_CPU_INLINE __m512 unpackhi64(__m512 a, __m512 b) {
  const __m512d x = _mm512_castps_pd(a);
  return _mm512_castpd_ps(_mm512_mask_unpackhi_pd(x, 0xff, x, _mm512_castps_pd(b)));
}
template <int IMM>
FLASHGEN_CPU_INLINE __m512 shuffle128(__m512 a, __m512 b) {
  return _mm512_mask_shuffle_f32x4(a, 0xffff, a, b, IMM);
}
#endif

template <typename U>
inline void transpose32(const U* src, int64_t ld, int64_t n, int64_t ncols, int64_t npad, U* dst, int64_t ldd) {
  static_assert(sizeof(U) == 4, "32-bit elements");
#if defined(__AVX512F__)
  if (ncols % 16 == 0 && npad % 16 == 0) {
    for (int64_t i0 = 0; i0 < npad; i0 += 16) {
      const int64_t rows = std::min<int64_t>(16, std::max<int64_t>(n - i0, 0));
      for (int64_t c0 = 0; c0 < ncols; c0 += 16) {
        __m512 r[16], t[16];
        for (int i = 0; i < 16; ++i)
          r[i] = i < rows ? _mm512_loadu_ps(reinterpret_cast<const float*>(src + (i0 + i) * ld + c0))
                          : _mm512_setzero_ps();
        for (int i = 0; i < 16; i += 2) {
          t[i] = unpacklo32(r[i], r[i + 1]);
          t[i + 1] = unpackhi32(r[i], r[i + 1]);
        }
        for (int i = 0; i < 16; i += 4) {  // r[i + k]: column 4L + k of rows i..i+3 in 128-bit lane L
          r[i] = unpacklo64(t[i], t[i + 2]);
          r[i + 1] = unpackhi64(t[i], t[i + 2]);
          r[i + 2] = unpacklo64(t[i + 1], t[i + 3]);
          r[i + 3] = unpackhi64(t[i + 1], t[i + 3]);
        }
        for (int k = 0; k < 4; ++k) {
          const __m512 x = shuffle128<0x88>(r[k], r[4 + k]), y = shuffle128<0xDD>(r[k], r[4 + k]);
          const __m512 x2 = shuffle128<0x88>(r[8 + k], r[12 + k]), y2 = shuffle128<0xDD>(r[8 + k], r[12 + k]);
          float* d = reinterpret_cast<float*>(dst + (c0 + k) * ldd + i0);
          _mm512_storeu_ps(d, shuffle128<0x88>(x, x2));
          _mm512_storeu_ps(d + 4 * ldd, shuffle128<0x88>(y, y2));
          _mm512_storeu_ps(d + 8 * ldd, shuffle128<0xDD>(x, x2));
          _mm512_storeu_ps(d + 12 * ldd, shuffle128<0xDD>(y, y2));
        }
      }
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < ncols; ++c) dst[c * ldd + i] = src[i * ld + c];
  for (int64_t c = 0; c < ncols; ++c)
    for (int64_t i = n; i < npad; ++i) dst[c * ldd + i] = U{};
}

// Copies n rows of D elements (row stride ld, in elements) to fp32 columns of
// a [D][ldt] matrix and zero-fills columns [n, npad). Non-float rows are
// converted through tmp ([n][D] floats).
template <typename T, int D>
inline void load_transposed(const T* src, int64_t ld, int64_t n, int64_t npad, float* dst, int64_t ldt,
                            float* tmp) {
  if (std::is_same<T, float>::value) {
    transpose32(reinterpret_cast<const float*>(src), ld, n, D, npad, dst, ldt);
  } else {
    for (int64_t i = 0; i < n; ++i) load_f32<T>(src + i * ld, tmp + i * D, D);
    transpose32(tmp, D, n, D, npad, dst, ldt);
  }
}

// Copies n rows (input row stride ld_in) to a contiguous fp32 [n][D] buffer and
// returns it with *ld = D. Also done for float: reading the strided input
// directly (stride Hkv*D, often a multiple of 2 KiB) thrashes L1 sets.
template <typename T, int D>
FLASHGEN_CPU_INLINE const float* rows_f32(const T* src, int64_t ld_in, int64_t n, float* buf, int64_t* ld) {
  for (int64_t i = 0; i < n; ++i) load_f32<T>(src + i * ld_in, buf + i * D, D);
  *ld = D;
  return buf;
}

// Copies n rows of D 16-bit elements to a contiguous [n][D] buffer, as bf16
// pairs (uint32, D / 2 per row).
template <typename T, int D>
FLASHGEN_CPU_INLINE const uint32_t* rows_pairs(const T* src, int64_t ld_in, int64_t n, float* buf) {
  static_assert(sizeof(T) == 2 && D % 2 == 0, "pairs of 16-bit elements");
  uint32_t* out = reinterpret_cast<uint32_t*>(buf);
  for (int64_t i = 0; i < n; ++i) std::memcpy(out + i * (D / 2), src + i * ld_in, D * sizeof(T));
  return out;
}

// Key / value row sources: the address of row j (a key index of one problem)
// for one kv head. Dense (and packed varlen) rows are ld elements apart; paged
// rows are looked up in the block table (PagedArgs).
template <typename T>
struct DenseRows {
  const T* base;  // row 0
  int64_t ld;
  FLASHGEN_CPU_INLINE const T* operator()(int64_t j) const { return base + j * ld; }
};
template <typename T>
struct PagedRows {
  const T* base;         // k_cache (or v_cache) + kv head * D
  const int32_t* table;  // this batch entry's row of the block table
  int64_t block_size;
  int64_t ld_block;  // elements per cache block (block_size * Hkv * D)
  int64_t ld;        // elements per row of a block (Hkv * D)
  FLASHGEN_CPU_INLINE const T* operator()(int64_t j) const {
    const int64_t blk = j / block_size;
    return base + int64_t(table[blk]) * ld_block + (j - blk * block_size) * ld;
  }
};

// Rows [j0, j0 + n) of a row source as contiguous fp32 [n][D].
template <typename T, int D, typename Rows>
FLASHGEN_CPU_INLINE const float* gather_f32(const Rows& r, int64_t j0, int64_t n, float* buf) {
  for (int64_t i = 0; i < n; ++i) load_f32<T>(r(j0 + i), buf + i * D, D);
  return buf;
}
// Rows [j0, j0 + n) of 16-bit elements as contiguous bf16 pairs [n][D / 2].
template <typename T, int D, typename Rows>
FLASHGEN_CPU_INLINE const uint32_t* gather_pairs(const Rows& r, int64_t j0, int64_t n, float* buf) {
  static_assert(sizeof(T) == 2 && D % 2 == 0, "pairs of 16-bit elements");
  uint32_t* out = reinterpret_cast<uint32_t*>(buf);
  for (int64_t i = 0; i < n; ++i) std::memcpy(out + i * (D / 2), r(j0 + i), D * sizeof(T));
  return out;
}

#if FLASHGEN_CPU_BF16_DOT
// Vp[jp][d] = (v[2jp][d], v[2jp+1][d]) for n rows of bf16 (stride ld), an odd
// last row paired with 0: the B operand of P V on vdpbf16ps. interleave_rows:
// the same for rows [j0, j0 + n) of a row source.
template <int D, typename Rows>
inline void interleave_rows(const Rows& rows, int64_t j0, int64_t n, uint32_t* dst) {
  static_assert(D % 32 == 0, "D multiple of 32");
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i il = _mm512_load_si512(lo_idx), ih = _mm512_load_si512(hi_idx);
  for (int64_t jp = 0; 2 * jp < n; ++jp) {
    const bool has1 = 2 * jp + 1 < n;
    const bf16* r0 = rows(j0 + 2 * jp);
    const bf16* r1 = has1 ? rows(j0 + 2 * jp + 1) : r0;
    uint32_t* out = dst + jp * D;
    for (int d = 0; d < D; d += 32) {
      const __m512i a = _mm512_loadu_si512(r0 + d);
      const __m512i b = has1 ? _mm512_loadu_si512(r1 + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + d, _mm512_permutex2var_epi16(a, il, b));
      _mm512_storeu_si512(out + d + 16, _mm512_permutex2var_epi16(a, ih, b));
    }
  }
}
template <int D>
inline void interleave_row_pairs(const bf16* src, int64_t ld, int64_t n, uint32_t* dst) {
  interleave_rows<D>([src, ld](int64_t j) { return src + j * ld; }, 0, n, dst);
}
// Dense rows: exactly the strided form.
template <int D>
inline void interleave_rows(const DenseRows<bf16>& rows, int64_t j0, int64_t n, uint32_t* dst) {
  interleave_row_pairs<D>(rows(j0), rows.ld, n, dst);
}

// Pb[jp][i] = bf16 pair (P[2jp][i], P[2jp+1][i]) (round to nearest even) for
// the rows [0, nk) of P [.][ld] over lanes [0, nlanes); an odd last row is
// paired with 0: the A operand of P V on vdpbf16ps.
inline void pack_p_pairs(const float* P, int64_t ld, int64_t nk, int64_t nlanes, uint32_t* dst, int64_t ldd) {
  alignas(64) static const uint16_t idx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                               8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i ix = _mm512_load_si512(idx);
  for (int64_t jp = 0; 2 * jp < nk; ++jp) {
    const float* r0 = P + 2 * jp * ld;
    const bool has1 = 2 * jp + 1 < nk;
    for (int64_t i = 0; i < nlanes; i += 16) {
      const __m512 a = _mm512_loadu_ps(r0 + i);
      const __m512 b = has1 ? _mm512_loadu_ps(r0 + ld + i) : _mm512_setzero_ps();
      const __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // a in the low 16 words, b in the high 16
      _mm512_storeu_si512(dst + jp * ldd + i, _mm512_permutexvar_epi16(ix, ab));
    }
  }
}

// dst row i = the bf16 (round to nearest even) of src row i, columns [0, ncols)
// (a multiple of 16), as pairs of adjacent columns: the A operand of dS K.
inline void rows_to_bf16_pairs(const float* src, int64_t ld, int64_t n, int64_t ncols, uint32_t* dst,
                               int64_t ldd) {
  for (int64_t i = 0; i < n; ++i) {
    const float* r = src + i * ld;
    uint32_t* o = dst + i * ldd;
    int64_t c = 0;
    for (; c + 32 <= ncols; c += 32)
      _mm512_storeu_si512(o + c / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(r + c + 16), _mm512_loadu_ps(r + c)));
    if (c < ncols) _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c / 2), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(r + c)));
  }
}
#endif

// ---------------------------------------------------------------------------
// Score extras (ALiBi, bias, mask, segment ids) of one (batch entry, q head).
// ---------------------------------------------------------------------------
struct HeadExtras {
  bool alibi = false;
  float slope = 0.0f;  // natural-log units
  const void* bias = nullptr;  // element (i, j) at i * ld + j
  ElemType bias_type = ElemType::F32;
  const bool* mask = nullptr;     // element (i, j) at i * ld + j
  const int32_t* qseg = nullptr;  // [Sq]
  const int32_t* kseg = nullptr;  // [Sk]
  float* dbias = nullptr;         // fp32 accumulator, element (i, j) at i * ld + j
  int64_t ld = 0;                 // Sk
};

inline HeadExtras head_extras(const ScoreExtras& x, int64_t b, int64_t h, int64_t Sq, int64_t Sk, float* dbacc) {
  HeadExtras e;
  e.ld = Sk;
  if (x.alibi != nullptr) {
    e.alibi = true;
    e.slope = x.alibi[b * x.alibi_stride_b + h];
  }
  if (x.bias != nullptr) {
    const int64_t off = b * x.bias_stride_b + h * x.bias_stride_h;
    e.bias_type = x.bias_type;
    e.bias = x.bias_type == ElemType::F32 ? static_cast<const void*>(static_cast<const float*>(x.bias) + off)
                                          : static_cast<const void*>(static_cast<const uint16_t*>(x.bias) + off);
    if (dbacc != nullptr) e.dbias = dbacc + off;
  }
  if (x.mask != nullptr) e.mask = x.mask + b * x.mask_stride_b + h * x.mask_stride_h;
  if (x.q_segment_ids != nullptr) {
    e.qseg = x.q_segment_ids + b * Sq;
    e.kseg = x.kv_segment_ids + b * Sk;
  }
  return e;
}

// n bias elements from element `idx` on, as fp32.
inline void bias_f32(const HeadExtras& e, int64_t idx, int64_t n, float* dst) {
  switch (e.bias_type) {
    case ElemType::F32:
      std::memcpy(dst, static_cast<const float*>(e.bias) + idx, size_t(n) * sizeof(float));
      break;
    case ElemType::BF16:
      load_f32<bf16>(static_cast<const bf16*>(e.bias) + idx, dst, n);
      break;
    default:
      load_f32<f16>(static_cast<const f16*>(e.bias) + idx, dst, n);
      break;
  }
}

FLASHGEN_CPU_INLINE vi loadvi(const int32_t* p) {
  vi v;
  std::memcpy(&v, p, sizeof(vi));
  return v;
}
FLASHGEN_CPU_INLINE vf absdist(vi d) { return __builtin_convertvector(d < 0 ? -d : d, vf); }

// Segment ids: [lo, hi] of ids[0, n); the segment ids of a query block and a key
// block whose ranges do not overlap are all different (the block is masked).
inline void id_range(const int32_t* ids, int64_t n, int32_t* lo, int32_t* hi) {
  int32_t a = std::numeric_limits<int32_t>::max(), b = std::numeric_limits<int32_t>::min();
  for (int64_t i = 0; i < n; ++i) a = std::min(a, ids[i]), b = std::max(b, ids[i]);
  *lo = a;
  *hi = b;
}

// ---------------------------------------------------------------------------
// Forward work item: one (problem, q head, q block), where a problem is a
// batch entry (dense, paged) or a packed sequence (varlen).
// ---------------------------------------------------------------------------
template <int D>
constexpr size_t fwd_ws_floats() {
  // Qt [D][BQ], St [BK][BQ], Oacc [BQ][D], Kc, Vc [BK][D], Pb [BK/2][BQ], m, l, alpha [BQ];
  // extras: Xt [BK][BQ], Xc [BQ][BK], q segment ids [BQ]
  return size_t(D) * kFwdBq + size_t(kFwdBk) * kFwdBq + size_t(kFwdBq) * D + 2 * size_t(kFwdBk) * D +
         size_t(kFwdBk / 2) * kFwdBq + 3 * size_t(kFwdBq) + 2 * size_t(kFwdBk) * kFwdBq + size_t(kFwdBq);
}

// tanh, lane-wise (softcap): Cephes' odd polynomial below |x| = 0.625, else
// 1 - 2 / (exp(2|x|) + 1) with the sign restored; ~1e-7 relative error.
FLASHGEN_CPU_INLINE vf tanhv(vf x) {
  const vf zero = splat(0.0f), one = splat(1.0f);
  const vf ax = x < zero ? -x : x;
  const vf e = exp2v(ax * splat(2.0f * kLog2e));
  const vf big = one - splat(2.0f) / (e + one);
  const vf z = x * x;
  vf p = splat(-5.70498872745e-3f);
  p = vfma(p, z, splat(2.06390887954e-2f));
  p = vfma(p, z, splat(-5.37397155531e-2f));
  p = vfma(p, z, splat(1.33314422036e-1f));
  p = vfma(p, z, splat(-3.33332819422e-1f));
  const vf small = vfma(p * z, x, x);
  const vf large = x < zero ? -big : big;
  return ax < splat(0.625f) ? small : large;
}

// Causal tiles of St = K Qt in a block crossing the diagonal: key row r sees
// the local query columns >= r + c.
struct ScoreTiles {
  int64_t c;
  FLASHGEN_CPU_INLINE int64_t vbegin(int64_t r) const { return r + c <= 0 ? 0 : (r + c) / W; }
  FLASHGEN_CPU_INLINE int64_t vend(int64_t, int, int64_t nvt) const { return nvt; }
  FLASHGEN_CPU_INLINE int64_t klen(int64_t, int, int64_t K) const { return K; }
};
// Causal tiles of O += P V: query row r sees the local keys <= r + e (K steps
// of `per` keys).
template <int per>
struct ValueTiles {
  int64_t e;
  FLASHGEN_CPU_INLINE int64_t vbegin(int64_t) const { return 0; }
  FLASHGEN_CPU_INLINE int64_t vend(int64_t, int, int64_t nvt) const { return nvt; }
  FLASHGEN_CPU_INLINE int64_t klen(int64_t r, int rows, int64_t) const {
    const int64_t keys = r + rows + e;  // keys [0, r + rows - 1 + e] are visible to some row of the group
    return keys <= 0 ? 0 : (keys + per - 1) / per;
  }
};

// Xt[j][i] = the extras' score term of query q0 + i and key k0 + j in base-2
// units (log2(e) * (bias - slope * |i + aoff - j|)), -inf where masked; lanes
// [nq, nqp) stay finite or -inf. qsegb: the block's q segment ids, padded to nqp.
__attribute__((noinline)) inline void fwd_extras_tile(const HeadExtras& e, int64_t q0, int64_t nq, int64_t nqp, int64_t k0, int64_t nk,
                            int64_t aoff, const int32_t* qsegb, float* Xt, float* Xc) {
  constexpr int BQ = kFwdBq, BK = kFwdBk;
  const int nv = static_cast<int>(nqp / W);
  const float ninf = -std::numeric_limits<float>::infinity();
  if (e.bias != nullptr) {
    if (e.bias_type == ElemType::F32) {
      transpose32(reinterpret_cast<const uint32_t*>(static_cast<const float*>(e.bias) + q0 * e.ld + k0), e.ld, nq,
                  nk, nqp, reinterpret_cast<uint32_t*>(Xt), BQ);
    } else {
      for (int64_t i = 0; i < nq; ++i) bias_f32(e, (q0 + i) * e.ld + k0, nk, Xc + i * BK);
      transpose32(Xc, BK, nq, nk, nqp, Xt, BQ);
    }
  }
  const vf l2 = splat(kLog2e), sl = splat(e.slope * kLog2e), ninfv = splat(ninf), zero = splat(0.0f);
  const vi iota = iota_i();
  for (int64_t j = 0; j < nk; ++j) {
    float* xr = Xt + j * BQ;
    const int32_t d0 = static_cast<int32_t>(q0 + aoff - (k0 + j));  // i + aoff - j for local row i = 0
    const vi kv = splat_i(e.kseg != nullptr ? e.kseg[k0 + j] : 0);
    for (int t = 0; t < nv; ++t) {
      vf x = e.bias != nullptr ? loadv(xr + t * W) * l2 : zero;
      if (e.alibi) x = x - sl * absdist(iota + splat_i(t * W + d0));
      if (e.qseg != nullptr) x = loadvi(qsegb + t * W) == kv ? x : ninfv;
      storev(xr + t * W, x);
    }
  }
  if (e.mask != nullptr)
    for (int64_t i = 0; i < nq; ++i) {
      const bool* m = e.mask + (q0 + i) * e.ld + k0;
      for (int64_t j = 0; j < nk; ++j)
        if (!m[j]) Xt[j * BQ + i] = ninf;
    }
}

// Scores with extras: St[j][i] = St * cv, -inf outside the band when `masked`
// (query i sees key j iff band.lo <= j + dk - i <= band.hi, dk = k0 - q0), plus
// Xt; mx = the lane-wise max over j.
__attribute__((noinline)) inline void fwd_extras_scores(float* St, const float* Xt, int64_t nk, int nv, vf cv,
                                                        bool masked, int64_t dk, VisibleBand band, vf* mx) {
  constexpr int BQ = kFwdBq;
  const vf ninfv = splat(-std::numeric_limits<float>::infinity());
  const vi iota = iota_i();
  for (int64_t j = 0; j < nk; ++j) {
    float* sr = St + j * BQ;
    int64_t ilo = -1, ihi = BQ;
    if (masked) {
      ilo = std::min<int64_t>(std::max<int64_t>(j + dk - band.hi, -1), BQ);
      ihi = std::min<int64_t>(std::max<int64_t>(j + dk - band.lo, -1), BQ);
    }
    const vi ilov = splat_i(static_cast<int32_t>(ilo)), ihiv = splat_i(static_cast<int32_t>(ihi));
    const float* xr = Xt + j * BQ;
    for (int t = 0; t < nv; ++t) {
      vf y = loadv(sr + t * W) * cv;
      const vi idx = iota + splat_i(t * W);
      y = ((idx >= ilov) & (idx <= ihiv)) ? y : ninfv;
      y = y + loadv(xr + t * W);
      storev(sr + t * W, y);
      mx[t] = vmax(mx[t], y);
    }
  }
}

// One forward problem at one q head. Rows of q / o are Hq * D elements apart,
// lse rows are contiguous. With opart set, the item writes its normalized o in
// fp32 to opart and its lse to lpart (same layouts; split-KV partials) instead.
template <typename T>
struct FwdProblem {
  const T* q = nullptr;  // row 0 of this q head
  T* o = nullptr;
  float* lse = nullptr;
  float* opart = nullptr;
  float* lpart = nullptr;
  int64_t Sq = 0, Sk = 0;      // this problem's lengths (alignment, masks)
  int64_t kmin = 0, kmax = 0;  // keys this item may visit: [kmin, kmax)
  const HeadExtras* x = nullptr;
};

template <typename T, int D, typename Rows>
void fwd_item(const FwdProblem<T>& p, const Rows& krows, const Rows& vrows, int64_t Hq, const AttentionAttrs& a,
              int64_t qb, float* ws) {
  constexpr int BQ = kFwdBq, BK = kFwdBk;
  constexpr bool BF = kBf16Dot && std::is_same<T, bf16>::value;
  using E = typename std::conditional<BF, uint32_t, float>::type;  // product element: bf16 pair or float
  constexpr int KD = BF ? D / 2 : D;                                 // K steps of Q K^T
  const int64_t Sq = p.Sq, Sk = p.Sk;
  const AttentionShape s{1, Sq, Sk, 1, 1, D};
  const int64_t q0 = qb * BQ;
  const int64_t nq = std::min<int64_t>(BQ, Sq - q0);
  const int64_t nqp = round_up(nq, W);
  const int nv = static_cast<int>(nqp / W);
  const int64_t off = a.causal ? causal_offset(s, a) : 0;

  float* Qt = ws;                      // [D][BQ] floats or [D/2][BQ] bf16 pairs
  float* St = Qt + D * BQ;             // [BK][BQ]
  float* Oacc = St + BK * BQ;          // [BQ][D]
  float* Kc = Oacc + BQ * D;           // [BK][D]
  float* Vc = Kc + BK * D;             // [BK][D]
  float* Pbuf = Vc + BK * D;           // [BK/2][BQ] bf16 pairs
  float* mrow = Pbuf + (BK / 2) * BQ;  // [BQ]
  float* lrow = mrow + BQ;             // [BQ]
  float* alpha = lrow + BQ;            // [BQ]
  float* Xt = alpha + BQ;              // [BK][BQ] extras' score terms
  float* Xc = Xt + BK * BQ;            // [BQ][BK] bias rows (scratch)
  int32_t* qsegb = reinterpret_cast<int32_t*>(Xc + BQ * BK);  // [BQ]
  E* Qe = reinterpret_cast<E*>(Qt);

  const int64_t ldq = Hq * D;
  const T* qblk = p.q + q0 * ldq;
  if constexpr (BF) {
    transpose32(reinterpret_cast<const uint32_t*>(qblk), ldq / 2, nq, D / 2, nqp, reinterpret_cast<uint32_t*>(Qt),
                BQ);
  } else {
    load_transposed<T, D>(qblk, ldq, nq, nqp, Qt, BQ, Oacc);  // Oacc: scratch for converted rows
  }
  std::memset(Oacc, 0, sizeof(float) * size_t(nq) * D);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < nqp; ++i) {
    mrow[i] = ninf;
    lrow[i] = 0.0f;
  }

  int64_t kend = Sk;
  if (a.causal) kend = std::max<int64_t>(0, std::min<int64_t>(Sk, q0 + nq + off));
  // Sliding window: keys [kbeg, kend) are visible to some row of the block; blocks
  // crossing a window edge get a per-element mask (the causal-only path keeps its
  // diagonal tiles). band.hi already includes causal.
  const VisibleBand band = visible_band(s, a);
  const bool windowed = a.window_left >= 0 || (!a.causal && a.window_right >= 0);
  int64_t kbeg = 0;
  if (windowed) {
    kbeg = std::min<int64_t>(Sk, std::max<int64_t>(0, q0 + band.lo));
    kend = std::min<int64_t>(Sk, std::max<int64_t>(0, q0 + nq + band.hi));
  }
  kbeg = std::max(kbeg, p.kmin);
  kend = std::min(kend, p.kmax);
  // Softcap: S = c * tanh(S * scale / c), after which the softmax scale is 1.
  const bool capped = a.softcap > 0.0f;
  const float cap_in = capped ? a.scale / a.softcap : 0.0f;
  const vf cv = splat(capped ? kLog2e : a.scale * kLog2e);
  const vf ninfv = splat(ninf), zero = splat(0.0f);
  const vi iota = iota_i();
  vf mx[BQ / W], msub[BQ / W], lacc[BQ / W];

  // Extras: the ALiBi offset (as causal's, even without causal) and the q block's segment ids.
  const HeadExtras* x = p.x;
  const int64_t aoff = causal_offset(s, a);
  int32_t qseg_lo = 0, qseg_hi = 0;
  if (x != nullptr && x->qseg != nullptr && nq > 0) {
    for (int64_t i = 0; i < nqp; ++i) qsegb[i] = x->qseg[q0 + std::min<int64_t>(i, nq - 1)];
    id_range(qsegb, nq, &qseg_lo, &qseg_hi);
  }

  for (int64_t k0 = kbeg; k0 < kend; k0 += BK) {
    const int64_t nk = std::min<int64_t>(BK, kend - k0);
    if (x != nullptr && x->kseg != nullptr) {
      int32_t lo, hi;
      id_range(x->kseg + k0, nk, &lo, &hi);
      if (hi < qseg_lo || lo > qseg_hi) continue;  // no key of the block shares a query's segment
    }
    const bool diag = !windowed && a.causal && (k0 + nk - 1 > q0 + off);
    const bool edge = windowed && (k0 - (q0 + nq - 1) < band.lo || k0 + nk - 1 - q0 > band.hi);

    // St = K * Qt : scores, one key per row, query rows along the lanes.
    const E* Kp;
    if constexpr (BF) {
      Kp = gather_pairs<T, D>(krows, k0, nk, Kc);
    } else {
      Kp = gather_f32<T, D>(krows, k0, nk, Kc);
    }
    if (diag)
      gemm<E, false>(nk, nqp, KD, Kp, KD, 1, Qe, BQ, St, BQ, nullptr, ScoreTiles{k0 - off - q0});
    else
      gemm<E, false>(nk, nqp, KD, Kp, KD, 1, Qe, BQ, St, BQ);

    if (capped) {
      const vf capv = splat(a.softcap), cinv = splat(cap_in);
      for (int64_t j = 0; j < nk; ++j)
        for (int t = 0; t < nv; ++t) {
          float* p = St + j * BQ + t * W;
          storev(p, capv * tanhv(loadv(p) * cinv));
        }
    }
    if (x != nullptr) fwd_extras_tile(*x, q0, nq, nqp, k0, nk, aoff, qsegb, Xt, Xc);

    // Online softmax (base 2), lane-wise over query rows.
    for (int t = 0; t < nv; ++t) mx[t] = ninfv;
    if (x != nullptr) fwd_extras_scores(St, Xt, nk, nv, cv, edge || diag, k0 - q0, band, mx);
    else for (int64_t j = 0; j < nk; ++j) {
      float* sr = St + j * BQ;
      if (edge) {
        // Query row i (local) sees key k0+j iff k0+j-q0-hi <= i <= k0+j-q0-lo.
        const int64_t ilo = std::min<int64_t>(std::max<int64_t>(k0 + j - q0 - band.hi, -1), BQ);
        const int64_t ihi = std::min<int64_t>(std::max<int64_t>(k0 + j - q0 - band.lo, -1), BQ);
        const vi ilov = splat_i(static_cast<int32_t>(ilo)), ihiv = splat_i(static_cast<int32_t>(ihi));
        for (int t = 0; t < nv; ++t) {
          vf y = loadv(sr + t * W) * cv;
          const vi idx = iota + splat_i(t * W);
          y = ((idx >= ilov) & (idx <= ihiv)) ? y : ninfv;
          storev(sr + t * W, y);
          mx[t] = vmax(mx[t], y);
        }
      } else if (diag) {
        // Query row i (local) sees key k0+j iff i >= k0 + j - off - q0.
        const int64_t lo = std::min<int64_t>(std::max<int64_t>(k0 + j - off - q0, -1), BQ);
        const vi lov = splat_i(static_cast<int32_t>(lo));
        for (int t = 0; t < nv; ++t) {
          vf y = loadv(sr + t * W) * cv;
          y = (iota + splat_i(t * W)) >= lov ? y : ninfv;
          storev(sr + t * W, y);
          mx[t] = vmax(mx[t], y);
        }
      } else {
        for (int t = 0; t < nv; ++t) {
          const vf y = loadv(sr + t * W) * cv;
          storev(sr + t * W, y);
          mx[t] = vmax(mx[t], y);
        }
      }
    }
    for (int t = 0; t < nv; ++t) {
      const vf mold = loadv(mrow + t * W);
      const vf mnew = vmax(mold, mx[t]);
      const vf muse = mnew == ninfv ? zero : mnew;
      storev(alpha + t * W, exp2v(mold - muse));
      storev(mrow + t * W, mnew);
      msub[t] = muse;
      lacc[t] = zero;
    }
    for (int64_t j = 0; j < nk; ++j) {
      float* sr = St + j * BQ;
      for (int t = 0; t < nv; ++t) {
        const vf pv = exp2v(loadv(sr + t * W) - msub[t]);
        storev(sr + t * W, pv);
        lacc[t] += pv;
      }
    }
    for (int t = 0; t < nv; ++t) storev(lrow + t * W, loadv(lrow + t * W) * loadv(alpha + t * W) + lacc[t]);

    // O = diag(alpha) O + P V; in a diagonal block a row group stops at its
    // last visible key, and rows that see nothing of the block (alpha = 1) are
    // skipped.
    if constexpr (BF) {
#if FLASHGEN_CPU_BF16_DOT
      uint32_t* Vp = reinterpret_cast<uint32_t*>(Vc);
      uint32_t* Pb = reinterpret_cast<uint32_t*>(Pbuf);
      interleave_rows<D>(vrows, k0, nk, Vp);
      pack_p_pairs(St, BQ, nk, nqp, Pb, BQ);
      const int64_t kp = (nk + 1) / 2;
      if (diag)
        gemm<uint32_t, true, true>(nq, D, kp, Pb, 1, BQ, Vp, D, Oacc, D, alpha, ValueTiles<2>{off + q0 - k0});
      else
        gemm<uint32_t, true, true>(nq, D, kp, Pb, 1, BQ, Vp, D, Oacc, D, alpha);
#endif
    } else {
      const float* Vp = gather_f32<T, D>(vrows, k0, nk, Vc);
      if (diag)
        gemm<float, true, true>(nq, D, nk, St, 1, BQ, Vp, D, Oacc, D, alpha, ValueTiles<1>{off + q0 - k0});
      else
        gemm<float, true, true>(nq, D, nk, St, 1, BQ, Vp, D, Oacc, D, alpha);
    }
  }

  // Normalize and write o, lse (or the fp32 partials).
  for (int64_t i = 0; i < nq; ++i) {
    const float l = lrow[i];
    if (p.opart != nullptr) {
      float* orow = p.opart + (q0 + i) * ldq;
      const float r = l > 0.0f ? 1.0f / l : 0.0f;
      for (int d = 0; d < D; ++d) orow[d] = l > 0.0f ? Oacc[i * D + d] * r : 0.0f;
      p.lpart[q0 + i] = l > 0.0f ? mrow[i] * kLn2 + std::log(l) : ninf;
      continue;
    }
    T* orow = p.o + (q0 + i) * ldq;
    float* lrow_out = p.lse + q0 + i;
    if (l > 0.0f) {
      store_from_f32<T>(Oacc + i * D, orow, D, 1.0f / l);
      *lrow_out = mrow[i] * kLn2 + std::log(l);
    } else {
      for (int d = 0; d < D; ++d) orow[d] = from_f32<T>(0.0f);
      *lrow_out = ninf;
    }
  }
}

// ---------------------------------------------------------------------------
// Backward.
// ---------------------------------------------------------------------------
template <int D>
constexpr size_t bwd_ws_floats() {
  // Kt, Vt [D][BK]; Kc, dKa, dVa [BK][D]; Qc, dOc [BQ][D]; P, dS [BQ][BK];
  // Qb, dOb [BQ][D/2] bf16 pairs; tmp [BK][D]; Pp, dSp [BQ/2][BK] and dSb [BQ][BK/2] bf16 pairs;
  // extras: xrow [BK], kv segment ids [BK]
  return 2 * size_t(D) * kBwdBk + 3 * size_t(kBwdBk) * D + 2 * size_t(kBwdBq) * D + 2 * size_t(kBwdBq) * kBwdBk +
         size_t(kBwdBq) * D + size_t(kBwdBk) * D + 2 * size_t(kBwdBq) * kBwdBk + 2 * size_t(kBwdBk);
}

// xr[t] (t < nkp) = the extras' score term of query i and key k0 + t in base-2
// units, -inf where masked (lanes [nk, nkp) finite or -inf). ksegb: the key
// block's segment ids, padded to nkp.
inline void bwd_extras_row(const HeadExtras& e, int64_t i, int64_t k0, int64_t nk, int64_t nkp, int64_t aoff,
                           const int32_t* ksegb, float* xr) {
  const float ninf = -std::numeric_limits<float>::infinity();
  if (e.bias != nullptr) {
    bias_f32(e, i * e.ld + k0, nk, xr);
    for (int64_t t = nk; t < nkp; ++t) xr[t] = 0.0f;
  }
  const vf l2 = splat(kLog2e), sl = splat(e.slope * kLog2e), ninfv = splat(ninf), zero = splat(0.0f);
  const vi iota = iota_i();
  const int32_t d0 = static_cast<int32_t>(i + aoff - k0);  // i + aoff - j for local key 0
  const vi qv = splat_i(e.qseg != nullptr ? e.qseg[i] : 0);
  for (int64_t t = 0; t < nkp; t += W) {
    vf y = e.bias != nullptr ? loadv(xr + t) * l2 : zero;
    if (e.alibi) y = y - sl * absdist(splat_i(d0 - static_cast<int32_t>(t)) - iota);
    if (e.qseg != nullptr) y = loadvi(ksegb + t) == qv ? y : ninfv;
    storev(xr + t, y);
  }
  if (e.mask != nullptr) {
    const bool* m = e.mask + i * e.ld + k0;
    for (int64_t t = 0; t < nk; ++t)
      if (!m[t]) xr[t] = ninf;
  }
}

// One row of the backward with extras: prow (S) becomes P, dr (dP) becomes dS.
// s' = softcap(scale * S) + extras; dS' = P o (dP - Drow) is dbias's share (added
// to e.dbias); dS = dS' * scale (* (1 - u^2) with softcap). Keys outside [lo, hi]
// (band) get P = 0.
__attribute__((noinline)) inline void bwd_extras_p_ds(const HeadExtras& e, const AttentionAttrs& a, int64_t i,
                                                      int64_t k0, int64_t nk, int64_t nkp, int64_t aoff, int64_t lo,
                                                      int64_t hi, float lse2, float drow, const int32_t* ksegb,
                                                      float* xrow, float* prow, float* dr) {
  constexpr int BK = kBwdBk;
  bwd_extras_row(e, i, k0, nk, nkp, aoff, ksegb, xrow);
  const bool capped = a.softcap > 0.0f;
  const vf zero = splat(0.0f), scv = splat(a.scale), Lv = splat(-lse2), Dv = splat(drow);
  const vi iota = iota_i(), lov = splat_i(static_cast<int32_t>(lo)), hiv = splat_i(static_cast<int32_t>(hi));
  alignas(64) float du[BK];
  vf cx = splat(a.scale * kLog2e);
  if (capped) {
    const vf capv = splat(a.softcap), cinv = splat(a.scale / a.softcap), one = splat(1.0f);
    for (int64_t t = 0; t < nkp; t += W) {
      const vf u = tanhv(loadv(prow + t) * cinv);
      storev(prow + t, capv * u);
      storev(du + t, one - u * u);
    }
    cx = splat(kLog2e);
  }
  float* dbr = e.dbias != nullptr ? e.dbias + i * e.ld + k0 : nullptr;
  for (int64_t t = 0; t < nkp; t += W) {
    const vi idx = iota + splat_i(static_cast<int32_t>(t));
    vf pv = exp2v(vfma(loadv(prow + t), cx, Lv) + loadv(xrow + t));
    pv = ((idx >= lov) & (idx <= hiv)) ? pv : zero;
    storev(prow + t, pv);
    const vf ds0 = pv * (loadv(dr + t) - Dv);
    if (dbr != nullptr) {
      if (t + W <= nk) {
        storev(dbr + t, loadv(dbr + t) + ds0);
      } else {
        for (int64_t l = 0; l < nk - t; ++l) dbr[t + l] += ds0[l];
      }
    }
    vf ds = ds0 * scv;
    if (capped) ds *= loadv(du + t);
    storev(dr + t, ds);
  }
}

// One backward problem (a batch entry or a packed sequence). q, dout and the
// dq accumulator: row 0 of head 0, rows Hq * D apart; k, v, dk, dv: row 0 of
// head 0, rows Hkv * D apart; lse2, Drow: row 0 of head 0, heads lse_hs apart.
template <typename T>
struct BwdProblem {
  const T* q = nullptr;
  const T* dout = nullptr;
  const T* k = nullptr;
  const T* v = nullptr;
  T* dk = nullptr;
  T* dv = nullptr;
  float* dqacc = nullptr;
  const float* lse2 = nullptr;
  const float* Drow = nullptr;
  int64_t lse_hs = 0;
  int64_t Sq = 0, Sk = 0;
};

// Key block kb of kv head hk: writes its dK, dV rows and adds its dQ terms to
// the dq accumulator rows of the group's q heads. x, b: the dense targets'
// extras and batch entry. With a bias, dS' is added to the fp32 dbias
// accumulator dbacc (bias layout), q head by q head (ascending), q block by q
// block (ascending).
template <typename T, int D>
void bwd_block(const BwdProblem<T>& pr, int64_t Hq, int64_t Hkv, const AttentionAttrs& a, int64_t hk, int64_t kb,
               const ScoreExtras* x, int64_t b, float* dbacc, float* ws) {
  constexpr int BQ = kBwdBq, BK = kBwdBk;
  constexpr bool BF = kBf16Dot && std::is_same<T, bf16>::value;
  const int64_t Sq = pr.Sq, Sk = pr.Sk;
  const AttentionShape s{1, Sq, Sk, Hq, Hkv, D};
  const int64_t G = Hq / Hkv;
  const int64_t ldq = Hq * D, ldkv = Hkv * D;

  float* Kt = ws;                // [D][BK] (or [D/2][BK] bf16 pairs)
  float* Vt = Kt + D * BK;       // [D][BK] (or pairs)
  float* Kc = Vt + D * BK;       // [BK][D]
  float* dKa = Kc + BK * D;      // [BK][D]
  float* dVa = dKa + BK * D;     // [BK][D]
  float* Qc = dVa + BK * D;      // [BQ][D]
  float* dOc = Qc + BQ * D;      // [BQ][D]
  float* P = dOc + BQ * D;       // [BQ][BK]
  float* dS = P + BQ * BK;       // [BQ][BK]
  float* QdOb = dS + BQ * BK;    // [BQ][D/2] + [BQ][D/2] bf16 pairs
  float* tmp = QdOb + BQ * D;    // [BK][D]
  float* PdSp = tmp + BK * D;    // [BQ/2][BK] + [BQ/2][BK] bf16 pairs along the query axis
  [[maybe_unused]] float* dSbuf = PdSp + BQ * BK;  // [BQ][BK/2] bf16 pairs along the key axis
  float* xrow = PdSp + 2 * BQ * BK;                // [BK] extras' terms of one row
  int32_t* ksegb = reinterpret_cast<int32_t*>(xrow + BK);  // [BK]

  const float c = a.scale * kLog2e;
  const vf cv = splat(c), scv = splat(a.scale), zero = splat(0.0f);
  // Causal and sliding window as one band lo <= j - i <= hi (attention.h).
  const VisibleBand band = visible_band(s, a);
  const bool banded = band_masks_anything(s, band);
  const bool capped = a.softcap > 0.0f;
  const float cap_in = capped ? a.scale / a.softcap : 0.0f;
  const vi iota = iota_i();
  const int64_t aoff = causal_offset(s, a);

  const int64_t k0 = kb * BK;
  const int64_t nk = std::min<int64_t>(BK, Sk - k0);
  const int64_t nkp = round_up(nk, W);
  const T* kblk = pr.k + (k0 * Hkv + hk) * D;
  const T* vblk = pr.v + (k0 * Hkv + hk) * D;
  if constexpr (BF) {
    transpose32(reinterpret_cast<const uint32_t*>(kblk), ldkv / 2, nk, D / 2, nkp, reinterpret_cast<uint32_t*>(Kt),
                BK);
    transpose32(reinterpret_cast<const uint32_t*>(vblk), ldkv / 2, nk, D / 2, nkp, reinterpret_cast<uint32_t*>(Vt),
                BK);
  } else {
    load_transposed<T, D>(kblk, ldkv, nk, nkp, Kt, BK, tmp);
    load_transposed<T, D>(vblk, ldkv, nk, nkp, Vt, BK, tmp);
  }
  int64_t ldk = D;
  const float* Kp = Kc;
  if constexpr (BF) {
#if FLASHGEN_CPU_BF16_DOT
    interleave_row_pairs<D>(reinterpret_cast<const bf16*>(kblk), ldkv, nk, reinterpret_cast<uint32_t*>(Kc));
#endif
  } else {
    Kp = rows_f32<T, D>(kblk, ldkv, nk, Kc, &ldk);
  }
  std::memset(dKa, 0, sizeof(float) * size_t(nk) * D);
  std::memset(dVa, 0, sizeof(float) * size_t(nk) * D);

  // Rows that see some key of the block: [qstart, qend).
  const int64_t qstart = banded ? std::min<int64_t>(Sq, std::max<int64_t>(0, k0 - band.hi)) : 0;
  const int64_t qend = banded ? std::min<int64_t>(Sq, std::max<int64_t>(0, k0 + nk - band.lo)) : Sq;
  const int64_t qbend = qend > qstart ? (qend + BQ - 1) / BQ : 0;
  // Segment ids of the key block.
  int32_t kseg_lo = 0, kseg_hi = 0;
  const bool segs = x != nullptr && x->q_segment_ids != nullptr;
  if (segs) {
    const int32_t* ks = x->kv_segment_ids + b * Sk + k0;
    for (int64_t t = 0; t < nkp; ++t) ksegb[t] = ks[std::min<int64_t>(t, nk - 1)];
    id_range(ksegb, nk, &kseg_lo, &kseg_hi);
  }
  for (int64_t g = 0; g < G && qstart < qend; ++g) {
    const int64_t h = hk * G + g;
    HeadExtras e;
    if (x != nullptr) e = head_extras(*x, b, h, Sq, Sk, dbacc);
    for (int64_t qb = qstart / BQ; qb < qbend; ++qb) {
      const int64_t q0 = qb * BQ;
      const int64_t nq = std::min<int64_t>(BQ, Sq - q0);
      if (segs) {
        int32_t lo, hi;
        id_range(e.qseg + q0, nq, &lo, &hi);
        if (hi < kseg_lo || lo > kseg_hi) continue;  // no query of the block shares a key's segment
      }
      const T* qrows = pr.q + (q0 * Hq + h) * D;
      const T* dorows = pr.dout + (q0 * Hq + h) * D;
      int64_t ldqf = D, lddo = D;
      const float* Qp = Qc;
      const float* dOp = dOc;
      if constexpr (!BF) {
        Qp = rows_f32<T, D>(qrows, ldq, nq, Qc, &ldqf);
        dOp = rows_f32<T, D>(dorows, ldq, nq, dOc, &lddo);
      }

      if constexpr (BF) {
#if FLASHGEN_CPU_BF16_DOT
        const uint32_t* Qb = rows_pairs<T, D>(qrows, ldq, nq, QdOb);
        const uint32_t* dOb = rows_pairs<T, D>(dorows, ldq, nq, QdOb + BQ * D / 2);
        gemm<uint32_t, false>(nq, nkp, D / 2, Qb, D / 2, 1, reinterpret_cast<const uint32_t*>(Kt), BK, P, BK);
        gemm<uint32_t, false>(nq, nkp, D / 2, dOb, D / 2, 1, reinterpret_cast<const uint32_t*>(Vt), BK, dS, BK);
#endif
      } else {
        gemm<float, false>(nq, nkp, D, Qp, ldqf, 1, Kt, BK, P, BK);    // S
        gemm<float, false>(nq, nkp, D, dOp, lddo, 1, Vt, BK, dS, BK);  // dP
      }

      const bool diag = banded && (k0 - (q0 + nq - 1) < band.lo || k0 + nk - 1 - q0 > band.hi);
      const float* L = pr.lse2 + h * pr.lse_hs + q0;
      const float* Dr = pr.Drow + h * pr.lse_hs + q0;
      for (int64_t i = 0; i < nq; ++i) {
        int64_t lo = 0, hi = nk - 1;  // visible local keys [lo, hi]
        if (diag) {
          lo = std::min<int64_t>(std::max<int64_t>(q0 + i + band.lo - k0, 0), nk);
          hi = std::min<int64_t>(std::max<int64_t>(q0 + i + band.hi - k0, -1), nk - 1);
        }
        const vi lov = splat_i(static_cast<int32_t>(lo)), hiv = splat_i(static_cast<int32_t>(hi));
        const vf Lv = splat(-L[i]), Dv = splat(Dr[i]);
        float* prow = P + i * BK;
        float* dr = dS + i * BK;
        if (x != nullptr) {
          bwd_extras_p_ds(e, a, q0 + i, k0, nk, nkp, aoff, lo, hi, L[i], Dr[i], ksegb, xrow, prow, dr);
          continue;
        }
        if (capped) {
          // u = tanh(S * scale / c); P = exp2(c * u * log2e - lse2); dS *= 1 - u^2.
          alignas(64) float du[BK];
          const vf capv = splat(a.softcap), cinv = splat(cap_in), one = splat(1.0f);
          for (int64_t t = 0; t < nkp; t += W) {
            const vf u = tanhv(loadv(prow + t) * cinv);
            storev(prow + t, capv * u);
            storev(du + t, one - u * u);
          }
          const vf lv2 = splat(kLog2e);
          for (int64_t t = 0; t < nkp; t += W) {
            const vi idx = iota + splat_i(static_cast<int32_t>(t));
            vf pv = exp2v(vfma(loadv(prow + t), lv2, Lv));
            pv = ((idx >= lov) & (idx <= hiv)) ? pv : zero;
            storev(prow + t, pv);
            storev(dr + t, pv * (loadv(dr + t) - Dv) * scv * loadv(du + t));
          }
          continue;
        }
        for (int64_t t = 0; t < nkp; t += W) {
          const vi idx = iota + splat_i(static_cast<int32_t>(t));
          vf pv = exp2v(vfma(loadv(prow + t), cv, Lv));
          pv = ((idx >= lov) & (idx <= hiv)) ? pv : zero;
          storev(prow + t, pv);
          storev(dr + t, pv * (loadv(dr + t) - Dv) * scv);
        }
      }
      float* dq_rows = pr.dqacc + (q0 * Hq + h) * D;
      if constexpr (BF) {
#if FLASHGEN_CPU_BF16_DOT
        // P, dS rounded to bf16 (as GPU FlashAttention-2 does); Q, dO, K are bf16 inputs.
        uint32_t* Qi = reinterpret_cast<uint32_t*>(Qc);    // Q pairs along the query axis [BQ/2][D]
        uint32_t* dOi = reinterpret_cast<uint32_t*>(dOc);  // dO pairs along the query axis
        uint32_t* Pp = reinterpret_cast<uint32_t*>(PdSp);
        uint32_t* dSp = Pp + (BQ / 2) * BK;
        uint32_t* dSb = reinterpret_cast<uint32_t*>(dSbuf);
        interleave_row_pairs<D>(reinterpret_cast<const bf16*>(qrows), ldq, nq, Qi);
        interleave_row_pairs<D>(reinterpret_cast<const bf16*>(dorows), ldq, nq, dOi);
        pack_p_pairs(P, BK, nq, nkp, Pp, BK);
        pack_p_pairs(dS, BK, nq, nkp, dSp, BK);
        rows_to_bf16_pairs(dS, BK, nq, nkp, dSb, BK / 2);
        const int64_t qp = (nq + 1) / 2, kp = (nk + 1) / 2;
        gemm<uint32_t, true>(nk, D, qp, Pp, 1, BK, dOi, D, dVa, D);  // dV += P^T dO
        gemm<uint32_t, true>(nk, D, qp, dSp, 1, BK, Qi, D, dKa, D);  // dK += dS^T Q
        gemm<uint32_t, true>(nq, D, kp, dSb, BK / 2, 1, reinterpret_cast<const uint32_t*>(Kc), D, dq_rows,
                             ldq);                                   // dQ += dS K
#endif
      } else {
        gemm<float, true>(nk, D, nq, P, 1, BK, dOp, lddo, dVa, D);       // dV += P^T dO
        gemm<float, true>(nk, D, nq, dS, 1, BK, Qp, ldqf, dKa, D);       // dK += dS^T Q
        gemm<float, true>(nq, D, nk, dS, BK, 1, Kp, ldk, dq_rows, ldq);  // dQ += dS K
      }
    }
  }
  for (int64_t j = 0; j < nk; ++j) {
    store_from_f32<T>(dKa + j * D, pr.dk + ((k0 + j) * Hkv + hk) * D, D, 1.0f);
    store_from_f32<T>(dVa + j * D, pr.dv + ((k0 + j) * Hkv + hk) * D, D, 1.0f);
  }
}

#ifndef FLASHGEN_CPU_FLOPS_PER_THREAD
#define FLASHGEN_CPU_FLOPS_PER_THREAD 2e6
#endif

// Threads worth using for `flops` of work: waking a pooled helper costs a few
// microseconds, so each helper needs about FLASHGEN_CPU_FLOPS_PER_THREAD flops
// (tens of microseconds of kernel time) to pay off.
inline int threads_for(int num_threads, double flops) {
  const double cap = 1.0 + flops / double(FLASHGEN_CPU_FLOPS_PER_THREAD);
  return cap < double(num_threads) ? std::max(1, static_cast<int>(cap)) : std::max(1, num_threads);
}

// (query, key) pairs that attend (causal: the visible triangle / band).
inline double visible_pairs(const AttentionShape& s, const AttentionAttrs& a) {
  const int64_t Sq = s.seqlen_q, Sk = s.seqlen_k;
  if (!a.causal) return double(Sq) * double(Sk);
  const int64_t off = causal_offset(s, a);
  // Rows [0, i0) see no key, rows [i0, i1) see i + off + 1 keys, rows [i1, Sq) see all Sk.
  const int64_t i0 = std::min<int64_t>(std::max<int64_t>(-off, 0), Sq);
  const int64_t i1 = std::min<int64_t>(std::max<int64_t>(Sk - off - 1, i0), Sq);
  const double n = double(i1 - i0);
  return n * (double(i0 + i1 - 1) / 2.0 + double(off + 1)) + double(Sq - i1) * double(Sk);
}

// Number of interleaved key-block chunks per (batch, kv head) in the backward:
// the smallest count that keeps nt threads >= 95% busy (or the best one found).
inline int64_t pick_chunks(int64_t nbh, int64_t nkb, int nt) {
  if (nt <= 1 || nkb <= 1) return 1;
  int64_t best = 1;
  double best_eff = 0.0;
  const int64_t cmax = std::min<int64_t>(nkb, 4 * int64_t(nt));
  for (int64_t c = 1; c <= cmax; ++c) {
    const int64_t items = nbh * c;
    const double eff = double(items) / double((items + nt - 1) / nt * nt);
    if (eff > best_eff + 0.02) best = c, best_eff = eff;
    if (eff >= 0.95) break;
  }
  return best;
}

// Split-KV: the number of key ranges per row block when `items` row blocks
// cannot keep `want` threads busy (each range at least two key blocks), or
// `forced` (> 0) ranges; at most one per key block.
inline int64_t pick_splits(int64_t items, int64_t nkb, int want, int forced) {
  if (nkb <= 1 || items <= 0) return 1;
  if (forced > 0) return std::min<int64_t>(forced, nkb);
  if (items >= want) return 1;
  return std::max<int64_t>(1, std::min<int64_t>((want + items - 1) / items, nkb / 2));
}

template <typename T>
FLASHGEN_CPU_INLINE constexpr bool valid_head_dim(int D) {
  return D == 32 || D == 64 || D == 96 || D == 128 || D == 160 || D == 192 || D == 224 || D == 256;
}

// o, lse = the log-sum-exp merge of nsplit partials (o in fp32 laid out like o,
// lse like lse, parts o_elems / l_elems apart) for B x Sq x Hq rows. A partial
// whose lse is -inf contributes nothing; rows without any give o = 0, lse = -inf.
template <typename T, int D>
void merge_splits(const float* opart, const float* lpart, int64_t nsplit, int64_t B, int64_t Sq, int64_t Hq, T* o,
                  float* lse, int num_threads, Workers* workers) {
  const int64_t o_elems = B * Sq * Hq * D, l_elems = B * Hq * Sq;
  const int nt = threads_for(num_threads, 4.0 * double(nsplit) * double(o_elems));
  parallel_for(
      B * Sq, nt,
      [&](int64_t r, int) {
        const int64_t b = r / Sq, i = r % Sq;
        alignas(64) float acc[D];
        for (int64_t h = 0; h < Hq; ++h) {
          const int64_t li = (b * Hq + h) * Sq + i, oi = (r * Hq + h) * D;
          float m = -std::numeric_limits<float>::infinity();
          for (int64_t c = 0; c < nsplit; ++c) m = std::max(m, lpart[c * l_elems + li]);
          if (m == -std::numeric_limits<float>::infinity()) {
            for (int d = 0; d < D; ++d) o[oi + d] = from_f32<T>(0.0f);
            lse[li] = m;
            continue;
          }
          float sum = 0.0f;
          for (int d = 0; d < D; ++d) acc[d] = 0.0f;
          for (int64_t c = 0; c < nsplit; ++c) {
            const float l = lpart[c * l_elems + li];
            if (l == -std::numeric_limits<float>::infinity()) continue;
            const float w = std::exp(l - m);
            sum += w;
            const float* src = opart + c * o_elems + oi;
            for (int d = 0; d < D; ++d) acc[d] += w * src[d];
          }
          store_from_f32<T>(acc, o + oi, D, 1.0f / sum);
          lse[li] = m + std::log(sum);
        }
      },
      workers);
}

// lse2 = lse * log2(e) (+inf for rows that see no key) and Drow = rowsum(dO o O)
// for B x Hq x Sq rows (lse [B][Hq][Sq]; o, dout [B][Sq][Hq][D]).
template <typename T, int D>
void bwd_row_terms(const T* o, const T* dout, const float* lse, int64_t B, int64_t Sq, int64_t Hq, float* lse2,
                   float* Drow, int nt, Workers* workers) {
  if (Sq <= 0) return;
  parallel_for(
      B * Hq, nt,
      [&](int64_t bh, int) {
        const int64_t b = bh / Hq, h = bh % Hq;
        alignas(64) float to[D], td[D];
        for (int64_t i = 0; i < Sq; ++i) {
          const int64_t r = bh * Sq + i;
          const float l = lse[r];
          lse2[r] = l == -std::numeric_limits<float>::infinity() ? std::numeric_limits<float>::infinity() : l * kLog2e;
          const int64_t off = ((b * Sq + i) * Hq + h) * D;
          load_f32<T>(o + off, to, D);
          load_f32<T>(dout + off, td, D);
          vf acc = splat(0.0f);
          for (int d = 0; d < D; d += W) acc = vfma(loadv(to + d), loadv(td + d), acc);
          float sum = 0.0f;
          for (int t = 0; t < W; ++t) sum += acc[t];
          Drow[r] = sum;
        }
      },
      workers);
}

// dq (rows x rowlen) = the sum of nchunks fp32 accumulators (elems apart), converted.
template <typename T>
void reduce_dq(float* dqacc, int64_t nchunks, int64_t elems, int64_t rows, int64_t rowlen, T* dq, int nt,
               Workers* workers) {
  if (rows <= 0) return;
  const int64_t per = std::max<int64_t>(1, 16384 / std::max<int64_t>(rowlen, 1));
  const int64_t nitems = (rows + per - 1) / per;
  parallel_for(
      nitems, nt,
      [&](int64_t it, int) {
        const int64_t r0 = it * per, r1 = std::min(rows, r0 + per);
        float* base = dqacc + r0 * rowlen;
        const int64_t len = (r1 - r0) * rowlen;
        for (int64_t c = 1; c < nchunks; ++c) {
          const float* src = base + c * elems;
          for (int64_t e = 0; e < len; ++e) base[e] += src[e];
        }
        store_from_f32<T>(base, dq + r0 * rowlen, len, 1.0f);
      },
      workers);
}

// Forward over `n` row blocks of B x Sq x Hq rows (o [B][Sq][Hq][D], lse
// [B][Hq][Sq]) with optional split-KV: setup(item, c, kmin, kmax) runs row block
// `item` over the keys [kmin, kmax) of split c, writing o / lse directly
// (nsplit == 1) or the partials it is handed (set in its FwdProblem by
// bind_split), which are merged afterwards.
struct SplitPlan {
  int64_t nsplit = 1;
  int64_t keys = 0;  // keys per split (a multiple of the key block)
};

inline SplitPlan plan_splits(int64_t items, int64_t max_keys, int want, int forced) {
  const int64_t nkb = (max_keys + kFwdBk - 1) / kFwdBk;
  SplitPlan sp;
  const int64_t ns = pick_splits(items, nkb, want, forced);
  const int64_t per = ns > 1 ? (nkb + ns - 1) / ns : std::max<int64_t>(nkb, 1);
  sp.nsplit = ns > 1 ? (nkb + per - 1) / per : 1;
  sp.keys = per * kFwdBk;
  return sp;
}

// The extras varlen / paged honor: ALiBi only (null when absent).
inline const ScoreExtras* alibi_only(const ScoreExtras& x, ScoreExtras* keep) {
  if (x.alibi == nullptr) return nullptr;
  *keep = ScoreExtras{};
  keep->alibi = x.alibi;
  keep->alibi_stride_b = x.alibi_stride_b;
  return keep;
}

// Dense forward (extras optional) and paged forward share this driver: `run`
// is called as run(b, h, qb, FwdProblem&) with q / o / lse / extras of (b, h)
// to fill in the kv rows and call fwd_item; Sk_of(b) gives the problem's keys.
template <typename T, int D, typename SkOf, typename Run>
void fwd_batched(T* o, float* lse, int64_t B, int64_t Sq, int64_t Hq, const AttentionAttrs& a, int num_threads,
                 Workers* workers, int kv_splits, double flops, SkOf&& Sk_of, Run&& run) {
  const int64_t nqb = (Sq + kFwdBq - 1) / kFwdBq;
  const int64_t nbh = B * Hq;
  const int64_t n = nbh * nqb;
  const int want = threads_for(num_threads, flops);
  int64_t max_keys = 0;
  for (int64_t b = 0; b < B; ++b) max_keys = std::max<int64_t>(max_keys, Sk_of(b));
  const SplitPlan sp = plan_splits(n, max_keys, want, kv_splits);
  const int64_t ns = sp.nsplit;
  const int64_t o_elems = B * Sq * Hq * D, l_elems = B * Hq * Sq;
  AlignedFloats opart(ns > 1 ? size_t(ns * o_elems) : 0), lpart(ns > 1 ? size_t(ns * l_elems) : 0);
  const int nt = static_cast<int>(std::min<int64_t>(want, n * ns));
  (void)a;
  // Last (for causal: most expensive) q blocks first.
  parallel_for(
      n * ns, nt,
      [&](int64_t item, int) {
        const int64_t c = item / n, r = item % n;
        const int64_t qb = nqb - 1 - r / nbh;
        const int64_t bh = r % nbh;
        const int64_t b = bh / Hq, h = bh % Hq;
        FwdProblem<T> p;
        p.Sq = Sq;
        p.Sk = Sk_of(b);
        p.o = o + (b * Sq * Hq + h) * D;
        p.lse = lse + bh * Sq;
        p.kmin = 0;
        p.kmax = p.Sk;
        if (ns > 1) {
          p.opart = opart.p + c * o_elems + (b * Sq * Hq + h) * D;
          p.lpart = lpart.p + c * l_elems + bh * Sq;
          p.kmin = std::min(p.Sk, c * sp.keys);
          p.kmax = std::min(p.Sk, (c + 1) * sp.keys);
        }
        run(b, h, qb, p);
      },
      workers);
  if (ns > 1) merge_splits<T, D>(opart.p, lpart.p, ns, B, Sq, Hq, o, lse, num_threads, workers);
}

template <typename T, int D>
void fwd_dense(const T* q, const T* k, const T* v, T* o, float* lse, const AttentionShape& s,
               const AttentionAttrs& a, const ScoreExtras* x, int num_threads, Workers* workers, int kv_splits) {
  const int64_t B = s.batch, Sq = s.seqlen_q, Sk = s.seqlen_k, Hq = s.heads_q, Hkv = s.heads_kv;
  const int64_t G = Hq / Hkv;
  const double flops = 4.0 * double(B * Hq) * std::max(visible_pairs(s, a), double(Sq)) * D;
  fwd_batched<T, D>(
      o, lse, B, Sq, Hq, a, num_threads, workers, kv_splits, flops, [&](int64_t) { return Sk; },
      [&](int64_t b, int64_t h, int64_t qb, FwdProblem<T>& p) {
        const int64_t hk = h / G;
        p.q = q + (b * Sq * Hq + h) * D;
        HeadExtras e;
        if (x != nullptr) {
          e = head_extras(*x, b, h, Sq, Sk, nullptr);
          p.x = &e;
        }
        const DenseRows<T> kr{k + (b * Sk * Hkv + hk) * D, Hkv * D}, vr{v + (b * Sk * Hkv + hk) * D, Hkv * D};
        fwd_item<T, D>(p, kr, vr, Hq, a, qb, thread_workspace(fwd_ws_floats<D>()));
      });
}

// Dense backward; x (optional) may carry a bias and its dbias.
template <typename T, int D>
void bwd_dense(const T* q, const T* k, const T* v, const T* o, const float* lse, const T* dout, T* dq, T* dk, T* dv,
               const AttentionShape& s, const AttentionAttrs& a, const ScoreExtras* x, int num_threads,
               Workers* workers) {
  const int64_t B = s.batch, Sq = s.seqlen_q, Sk = s.seqlen_k, Hq = s.heads_q, Hkv = s.heads_kv;
  const int64_t G = Hq / Hkv;
  const double bwd_flops = 10.0 * double(B * Hq) * std::max(visible_pairs(s, a), double(std::max(Sq, Sk))) * D;
  const int nthreads = threads_for(num_threads, bwd_flops);
  const int light_threads = threads_for(nthreads, 8.0 * double(B * Hq) * double(std::max<int64_t>(Sq, Sk)) * D);

  AlignedFloats lse2(size_t(B * Hq * Sq)), Drow(size_t(B * Hq * Sq));
  bwd_row_terms<T, D>(o, dout, lse, B, Sq, Hq, lse2.p, Drow.p, light_threads, workers);

  // dbias: fp32 accumulator (dbias itself when f32), bias layout. When no two
  // (batch entry, kv head) pairs share a dbias slot, the work items are
  // (batch entry, kv head, key chunk) and each owns its slots' columns of its
  // key blocks: it zeroes them, then adds dS' into them directly. When the
  // bias broadcasts over the batch or over kv-head groups ("shared slots"),
  // the pairs that share slots form a group and the items are (group, key
  // chunk): per key block, the item zeroes the group's slot columns, then runs
  // the group's pairs in a fixed order (batch entry, then kv head). Every dbias
  // element is accumulated by one item in one order, whatever the threads: no
  // locks, and bit-reproducible.
  const bool has_db = x != nullptr && x->bias != nullptr && x->dbias != nullptr;
  const int64_t sb = has_db ? x->bias_stride_b : 0, sh = has_db ? x->bias_stride_h : 0;
  const bool db_shared = has_db && ((sb == 0 && B > 1) || (sh == 0 && Hkv > 1));
  const size_t db_elems = has_db ? size_t((sb ? B : 1) * (sh ? Hq : 1) * Sq * Sk) : 0;
  const bool db_direct = has_db && x->bias_type == ElemType::F32;
  AlignedFloats dbbuf(has_db && !db_direct ? db_elems : 0);
  float* dbacc = !has_db ? nullptr : db_direct ? static_cast<float*>(x->dbias) : dbbuf.p;

  // Split each (batch, kv head)'s (or each shared-slot group's) key blocks into
  // interleaved chunks when there are too few of them to keep the threads
  // busy; dq then accumulates per chunk and the chunks are summed in order at
  // the end. With shared slots the chunk count follows the threads of the
  // machine (default_num_threads()), not num_threads, so dq too is the same
  // for every num_threads.
  const int64_t nkb = (Sk + kBwdBk - 1) / kBwdBk;
  const int64_t gB = db_shared && sb != 0 ? B : 1, gH = db_shared && sh != 0 ? Hkv : 1;  // groups: gB x gH
  const int64_t pB = db_shared ? B / gB : 1, pH = db_shared ? Hkv / gH : 1;              // pairs per group
  const int64_t nbh = db_shared ? gB * gH : B * Hkv;
  const int64_t nchunks = pick_chunks(nbh, nkb, db_shared ? threads_for(default_num_threads(), bwd_flops) : nthreads);
  const bool direct = std::is_same<T, float>::value && nchunks == 1;
  const size_t dq_elems = size_t(B * Sq * Hq * D);
  AlignedFloats dqbuf(direct ? 0 : dq_elems * nchunks);
  float* dqacc = direct ? reinterpret_cast<float*>(dq) : dqbuf.p;

  auto problem = [&](int64_t b, float* slab) {
    BwdProblem<T> p;
    p.q = q + b * Sq * Hq * D;
    p.dout = dout + b * Sq * Hq * D;
    p.k = k + b * Sk * Hkv * D;
    p.v = v + b * Sk * Hkv * D;
    p.dk = dk + b * Sk * Hkv * D;
    p.dv = dv + b * Sk * Hkv * D;
    p.dqacc = slab + b * Sq * Hq * D;
    p.lse2 = lse2.p + b * Hq * Sq;
    p.Drow = Drow.p + b * Hq * Sq;
    p.lse_hs = Sq;
    p.Sq = Sq;
    p.Sk = Sk;
    return p;
  };
  auto zero_dq = [&](float* slab, int64_t b, int64_t hk) {
    for (int64_t i = 0; i < Sq; ++i)
      std::memset(slab + ((b * Sq + i) * Hq + hk * G) * D, 0, sizeof(float) * size_t(G * D));
  };
  // Zeroes columns [k0, k0 + nk) of the slots of batch entry b, q heads [h0, h1).
  auto zero_db = [&](int64_t b, int64_t h0, int64_t h1, int64_t k0, int64_t nk) {
    for (int64_t h = h0; h < h1; ++h) {
      float* base = dbacc + b * sb + h * sh + k0;
      for (int64_t i = 0; i < Sq; ++i) std::memset(base + i * Sk, 0, sizeof(float) * size_t(nk));
    }
  };

  const int64_t n = nbh * nchunks;
  const int nt = static_cast<int>(std::min<int64_t>(nthreads, n));
  parallel_for(
      n, nt,
      [&](int64_t item, int) {
        const int64_t c = item % nchunks, bh = item / nchunks;
        float* slab = dqacc + c * dq_elems;
        float* ws = thread_workspace(bwd_ws_floats<D>());
        if (db_shared) {
          // Group (gb, gh): batch entries [b0, b0 + pB) x kv heads [h0, h0 + pH).
          const int64_t b0 = (bh / gH) * pB, h0 = (bh % gH) * pH;
          for (int64_t b = b0; b < b0 + pB; ++b)
            for (int64_t hk = h0; hk < h0 + pH; ++hk) zero_dq(slab, b, hk);
          for (int64_t kb = c; kb < nkb; kb += nchunks) {
            const int64_t k0 = kb * kBwdBk, nk = std::min<int64_t>(kBwdBk, Sk - k0);
            // The group's slots: batch entry b0 (sb != 0) or 0, q heads of [h0, h0 + pH) (sh != 0) or head 0.
            zero_db(b0, h0 * G, sh ? (h0 + pH) * G : 1, k0, nk);
            for (int64_t b = b0; b < b0 + pB; ++b) {
              const BwdProblem<T> p = problem(b, slab);
              for (int64_t hk = h0; hk < h0 + pH; ++hk) bwd_block<T, D>(p, Hq, Hkv, a, hk, kb, x, b, dbacc, ws);
            }
          }
          return;
        }
        const int64_t b = bh / Hkv, hk = bh % Hkv;
        zero_dq(slab, b, hk);
        const BwdProblem<T> p = problem(b, slab);
        for (int64_t kb = c; kb < nkb; kb += nchunks) {
          const int64_t k0 = kb * kBwdBk, nk = std::min<int64_t>(kBwdBk, Sk - k0);
          // This item owns the slots of (b, heads of hk): zero the block's columns.
          if (dbacc != nullptr) zero_db(b, hk * G, sh ? (hk + 1) * G : hk * G + 1, k0, nk);
          bwd_block<T, D>(p, Hq, Hkv, a, hk, kb, x, b, dbacc, ws);
        }
      },
      workers);

  if (!direct) reduce_dq<T>(dqacc, nchunks, int64_t(dq_elems), B * Sq, Hq * D, dq, light_threads, workers);
  if (has_db && !db_direct) {
    const int64_t per = 16384, nitems = (int64_t(db_elems) + per - 1) / per;
    parallel_for(
        nitems, light_threads,
        [&](int64_t it, int) {
          const int64_t e0 = it * per, len = std::min<int64_t>(per, int64_t(db_elems) - e0);
          if (x->bias_type == ElemType::BF16)
            store_from_f32<bf16>(dbbuf.p + e0, static_cast<bf16*>(x->dbias) + e0, len, 1.0f);
          else
            store_from_f32<f16>(dbbuf.p + e0, static_cast<f16*>(x->dbias) + e0, len, 1.0f);
        },
        workers);
  }
}

}  // namespace detail

// ---------------------------------------------------------------------------
// Public entry points. Preconditions: s.head_dim == D, heads_kv > 0 divides
// heads_q, all sizes >= 0, buffers contiguous BSHD (lse [B][Hq][Sq]).
// num_threads: the most threads to use (the calling thread included); helpers
// run on `workers` (the own pool when null). Small problems use fewer threads.
// kv_splits (forward): split-KV ranges per row block; 0 = automatic (split
// only when there are fewer row blocks than useful threads), 1 = never.
// ---------------------------------------------------------------------------
template <typename T, int D>
void attention_fwd(const T* q, const T* k, const T* v, T* o, float* lse, const AttentionShape& s,
                   const AttentionAttrs& a, const ScoreExtras& x, int num_threads, Workers* workers = nullptr,
                   int kv_splits = 0) {
  static_assert(std::is_same<T, float>::value || std::is_same<T, bf16>::value || std::is_same<T, f16>::value,
                "T must be float, bf16 or f16");
  static_assert(detail::valid_head_dim<T>(D), "unsupported head_dim");
  if (s.batch <= 0 || s.heads_q <= 0 || s.heads_kv <= 0 || s.seqlen_q <= 0) return;
  if (s.head_dim != D || s.heads_q % s.heads_kv != 0 || s.seqlen_k < 0) return;  // precondition violated
  detail::fwd_dense<T, D>(q, k, v, o, lse, s, a, x.any() ? &x : nullptr, num_threads, workers, kv_splits);
}

template <typename T, int D>
void attention_fwd(const T* q, const T* k, const T* v, T* o, float* lse, const AttentionShape& s,
                   const AttentionAttrs& a, int num_threads, Workers* workers = nullptr) {
  attention_fwd<T, D>(q, k, v, o, lse, s, a, ScoreExtras{}, num_threads, workers, 0);
}

// x.dbias (with x.bias): receives dS summed over the bias's broadcast dims,
// every element written.
template <typename T, int D>
void attention_bwd(const T* q, const T* k, const T* v, const T* o, const float* lse, const T* dout, T* dq, T* dk,
                   T* dv, const AttentionShape& s, const AttentionAttrs& a, const ScoreExtras& x, int num_threads,
                   Workers* workers = nullptr) {
  static_assert(std::is_same<T, float>::value || std::is_same<T, bf16>::value || std::is_same<T, f16>::value,
                "T must be float, bf16 or f16");
  static_assert(detail::valid_head_dim<T>(D), "unsupported head_dim");
  const int64_t B = s.batch, Sq = s.seqlen_q, Sk = s.seqlen_k, Hq = s.heads_q, Hkv = s.heads_kv;
  if (B <= 0 || Hq <= 0 || Hkv <= 0 || Sq < 0 || Sk < 0) return;
  if (s.head_dim != D || Hq % Hkv != 0) return;  // precondition violated
  if (Sq == 0 && Sk == 0) return;
  detail::bwd_dense<T, D>(q, k, v, o, lse, dout, dq, dk, dv, s, a, x.any() ? &x : nullptr, num_threads, workers);
}

template <typename T, int D>
void attention_bwd(const T* q, const T* k, const T* v, const T* o, const float* lse, const T* dout, T* dq, T* dk,
                   T* dv, const AttentionShape& s, const AttentionAttrs& a, int num_threads,
                   Workers* workers = nullptr) {
  attention_bwd<T, D>(q, k, v, o, lse, dout, dq, dk, dv, s, a, ScoreExtras{}, num_threads, workers);
}

// Paged KV forward (PagedArgs): q, o [B][Sq][Hq][D], lse [B][Hq][Sq]; k_cache,
// v_cache [num_blocks][block_size][Hkv][D]; batch entry b sees its first
// seqused_k[b] keys (alignment uses that length). s.seqlen_k is unused.
// Preconditions (the handler checks them): 0 <= seqused_k[b] <= max_blocks *
// block_size and every block id a used key reaches is in [0, num_blocks).
// x: only its ALiBi slopes are used (slope(b, h); offset from seqused_k[b]).
template <typename T, int D>
void attention_fwd_paged(const T* q, const T* k_cache, const T* v_cache, T* o, float* lse, const AttentionShape& s,
                         const PagedArgs& pa, const AttentionAttrs& a, const ScoreExtras& x, int num_threads,
                         Workers* workers = nullptr, int kv_splits = 0) {
  static_assert(std::is_same<T, float>::value || std::is_same<T, bf16>::value || std::is_same<T, f16>::value,
                "T must be float, bf16 or f16");
  static_assert(detail::valid_head_dim<T>(D), "unsupported head_dim");
  using namespace detail;
  const int64_t B = s.batch, Sq = s.seqlen_q, Hq = s.heads_q, Hkv = s.heads_kv;
  if (B <= 0 || Hq <= 0 || Hkv <= 0 || Sq <= 0) return;
  if (s.head_dim != D || Hq % Hkv != 0 || pa.block_size <= 0) return;  // precondition violated
  const int64_t G = Hq / Hkv, BS = pa.block_size, MB = pa.max_blocks;
  ScoreExtras keep;
  const ScoreExtras* xa = alibi_only(x, &keep);
  double flops = 0.0;
  for (int64_t b = 0; b < B; ++b) {
    const AttentionShape sb{1, Sq, pa.seqused_k[b], Hq, Hkv, D};
    flops += 4.0 * double(Hq) * std::max(visible_pairs(sb, a), double(Sq)) * D;
  }
  fwd_batched<T, D>(
      o, lse, B, Sq, Hq, a, num_threads, workers, kv_splits, flops,
      [&](int64_t b) { return int64_t(pa.seqused_k[b]); },
      [&](int64_t b, int64_t h, int64_t qb, FwdProblem<T>& p) {
        const int64_t hk = h / G;
        p.q = q + (b * Sq * Hq + h) * D;
        HeadExtras e;
        if (xa != nullptr) {
          e = head_extras(*xa, b, h, Sq, p.Sk, nullptr);
          p.x = &e;
        }
        const PagedRows<T> kr{k_cache + hk * D, pa.block_table + b * MB, BS, BS * Hkv * D, Hkv * D};
        const PagedRows<T> vr{v_cache + hk * D, pa.block_table + b * MB, BS, BS * Hkv * D, Hkv * D};
        fwd_item<T, D>(p, kr, vr, Hq, a, qb, thread_workspace(fwd_ws_floats<D>()));
      });
}

template <typename T, int D>
void attention_fwd_paged(const T* q, const T* k_cache, const T* v_cache, T* o, float* lse, const AttentionShape& s,
                         const PagedArgs& pa, const AttentionAttrs& a, int num_threads, Workers* workers = nullptr,
                         int kv_splits = 0) {
  attention_fwd_paged<T, D>(q, k_cache, v_cache, o, lse, s, pa, a, ScoreExtras{}, num_threads, workers, kv_splits);
}

// Packed varlen forward (VarlenArgs): q, o [Tq][Hq][D], k, v [Tk][Hkv][D], lse
// [Hq][Tq], s = {B, Tq, Tk, Hq, Hkv, D}. Rows past cu_seqlens_q[B] get o = 0,
// lse = -inf. Preconditions (the handler checks them): cu_seqlens start at 0,
// do not decrease and end within Tq / Tk. x: only its ALiBi slopes are used
// (slope(b, h) for sequence b, offset from that sequence's lengths).
template <typename T, int D>
void attention_fwd_varlen(const T* q, const T* k, const T* v, T* o, float* lse, const AttentionShape& s,
                          const VarlenArgs& va, const AttentionAttrs& a, const ScoreExtras& x, int num_threads,
                          Workers* workers = nullptr) {
  static_assert(std::is_same<T, float>::value || std::is_same<T, bf16>::value || std::is_same<T, f16>::value,
                "T must be float, bf16 or f16");
  static_assert(detail::valid_head_dim<T>(D), "unsupported head_dim");
  using namespace detail;
  const int64_t B = s.batch, Tq = s.seqlen_q, Hq = s.heads_q, Hkv = s.heads_kv;
  if (B < 0 || Hq <= 0 || Hkv <= 0 || Tq <= 0) return;
  if (s.head_dim != D || Hq % Hkv != 0) return;  // precondition violated
  const int64_t G = Hq / Hkv;
  const int32_t* cq = va.cu_seqlens_q;
  const int32_t* ck = va.cu_seqlens_k;
  ScoreExtras keep;
  const ScoreExtras* xa = alibi_only(x, &keep);
  // Rows outside every sequence.
  const int64_t used = B > 0 ? cq[B] : 0;
  for (int64_t i = used; i < Tq; ++i) {
    std::memset(static_cast<void*>(o + i * Hq * D), 0, sizeof(T) * size_t(Hq * D));
    for (int64_t h = 0; h < Hq; ++h) lse[h * Tq + i] = -std::numeric_limits<float>::infinity();
  }
  // Row blocks (sequence, q block), most keys first.
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (sequence, q block)
  std::vector<double> cost;
  double flops = 0.0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t sq = cq[b + 1] - cq[b], sk = ck[b + 1] - ck[b];
    const AttentionShape sb{1, sq, sk, Hq, Hkv, D};
    flops += 4.0 * double(Hq) * std::max(visible_pairs(sb, a), double(sq)) * D;
    for (int64_t qb = 0; qb * kFwdBq < sq; ++qb) blocks.emplace_back(b, qb);
  }
  if (blocks.empty()) return;
  for (const auto& bl : blocks) {
    const int64_t sq = cq[bl.first + 1] - cq[bl.first], sk = ck[bl.first + 1] - ck[bl.first];
    const int64_t last = std::min<int64_t>(sq, (bl.second + 1) * kFwdBq) - 1;
    const int64_t off = a.bottom_right ? sk - sq : 0;
    cost.push_back(a.causal ? double(std::max<int64_t>(0, std::min<int64_t>(sk, last + off + 1))) : double(sk));
  }
  std::vector<size_t> order(blocks.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return cost[x] > cost[y]; });
  const int64_t n = int64_t(blocks.size()) * Hq;
  const int nt = static_cast<int>(std::min<int64_t>(threads_for(num_threads, flops), n));
  parallel_for(
      n, nt,
      [&](int64_t item, int) {
        const auto& bl = blocks[order[size_t(item / Hq)]];
        const int64_t h = item % Hq, hk = h / G, b = bl.first;
        FwdProblem<T> p;
        p.Sq = cq[b + 1] - cq[b];
        p.Sk = ck[b + 1] - ck[b];
        p.kmax = p.Sk;
        p.q = q + (int64_t(cq[b]) * Hq + h) * D;
        p.o = o + (int64_t(cq[b]) * Hq + h) * D;
        p.lse = lse + h * Tq + cq[b];
        HeadExtras e;
        if (xa != nullptr) {
          e = head_extras(*xa, b, h, p.Sq, p.Sk, nullptr);
          p.x = &e;
        }
        const DenseRows<T> kr{k + (int64_t(ck[b]) * Hkv + hk) * D, Hkv * D};
        const DenseRows<T> vr{v + (int64_t(ck[b]) * Hkv + hk) * D, Hkv * D};
        fwd_item<T, D>(p, kr, vr, Hq, a, bl.second, thread_workspace(fwd_ws_floats<D>()));
      },
      workers);
}

template <typename T, int D>
void attention_fwd_varlen(const T* q, const T* k, const T* v, T* o, float* lse, const AttentionShape& s,
                          const VarlenArgs& va, const AttentionAttrs& a, int num_threads,
                          Workers* workers = nullptr) {
  attention_fwd_varlen<T, D>(q, k, v, o, lse, s, va, a, ScoreExtras{}, num_threads, workers);
}

// Packed varlen backward: q, o, dout, dq [Tq][Hq][D]; k, v, dk, dv [Tk][Hkv][D];
// lse [Hq][Tq]. Rows outside every sequence get zero gradients. x: only its
// ALiBi slopes are used (a constant: no slope gradient).
template <typename T, int D>
void attention_bwd_varlen(const T* q, const T* k, const T* v, const T* o, const float* lse, const T* dout, T* dq,
                          T* dk, T* dv, const AttentionShape& s, const VarlenArgs& va, const AttentionAttrs& a,
                          const ScoreExtras& x, int num_threads, Workers* workers = nullptr) {
  static_assert(std::is_same<T, float>::value || std::is_same<T, bf16>::value || std::is_same<T, f16>::value,
                "T must be float, bf16 or f16");
  static_assert(detail::valid_head_dim<T>(D), "unsupported head_dim");
  using namespace detail;
  const int64_t B = s.batch, Tq = s.seqlen_q, Tk = s.seqlen_k, Hq = s.heads_q, Hkv = s.heads_kv;
  if (B < 0 || Hq <= 0 || Hkv <= 0 || Tq < 0 || Tk < 0) return;
  if (s.head_dim != D || Hq % Hkv != 0) return;  // precondition violated
  const int64_t G = Hq / Hkv;
  const int32_t* cq = va.cu_seqlens_q;
  const int32_t* ck = va.cu_seqlens_k;
  const int64_t used_q = B > 0 ? cq[B] : 0, used_k = B > 0 ? ck[B] : 0;
  ScoreExtras keep;
  const ScoreExtras* xa = alibi_only(x, &keep);
  // Keys outside every sequence.
  if (Tk > used_k) {
    std::memset(static_cast<void*>(dk + used_k * Hkv * D), 0, sizeof(T) * size_t((Tk - used_k) * Hkv * D));
    std::memset(static_cast<void*>(dv + used_k * Hkv * D), 0, sizeof(T) * size_t((Tk - used_k) * Hkv * D));
  }
  if (Tq <= 0) return;
  double pairs = 0.0;
  int64_t nkb = 0;
  std::vector<int64_t> order;
  std::vector<double> cost(size_t(std::max<int64_t>(B, 0)));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t sq = cq[b + 1] - cq[b], sk = ck[b + 1] - ck[b];
    const AttentionShape sb{1, sq, sk, Hq, Hkv, D};
    cost[size_t(b)] = std::max(visible_pairs(sb, a), double(std::max(sq, sk)));
    pairs += cost[size_t(b)];
    nkb = std::max<int64_t>(nkb, (sk + kBwdBk - 1) / kBwdBk);
    order.push_back(b);
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return cost[size_t(x)] > cost[size_t(y)]; });
  const int nthreads = threads_for(num_threads, 10.0 * double(Hq) * pairs * D);
  const int light_threads = threads_for(nthreads, 8.0 * double(Hq) * double(std::max(Tq, Tk)) * D);

  AlignedFloats lse2(size_t(Hq * Tq)), Drow(size_t(Hq * Tq));
  bwd_row_terms<T, D>(o, dout, lse, 1, Tq, Hq, lse2.p, Drow.p, light_threads, workers);

  const int64_t nown = B * Hkv;
  const int64_t nchunks = pick_chunks(std::max<int64_t>(nown, 1), nkb, nthreads);
  const bool direct = std::is_same<T, float>::value && nchunks == 1;
  const size_t dq_elems = size_t(Tq * Hq * D);
  AlignedFloats dqbuf(direct ? 0 : dq_elems * nchunks);
  float* dqacc = direct ? reinterpret_cast<float*>(dq) : dqbuf.p;
  // Rows outside every sequence.
  for (int64_t c = 0; c < nchunks; ++c)
    if (Tq > used_q)
      std::memset(dqacc + c * dq_elems + used_q * Hq * D, 0, sizeof(float) * size_t((Tq - used_q) * Hq * D));

  const int64_t n = nown * nchunks;
  const int nt = static_cast<int>(std::min<int64_t>(nthreads, std::max<int64_t>(n, 1)));
  parallel_for(
      n, nt,
      [&](int64_t item, int) {
        const int64_t c = item % nchunks, own = item / nchunks;
        const int64_t b = order[size_t(own / Hkv)], hk = own % Hkv;
        BwdProblem<T> p;
        p.Sq = cq[b + 1] - cq[b];
        p.Sk = ck[b + 1] - ck[b];
        p.q = q + int64_t(cq[b]) * Hq * D;
        p.dout = dout + int64_t(cq[b]) * Hq * D;
        p.k = k + int64_t(ck[b]) * Hkv * D;
        p.v = v + int64_t(ck[b]) * Hkv * D;
        p.dk = dk + int64_t(ck[b]) * Hkv * D;
        p.dv = dv + int64_t(ck[b]) * Hkv * D;
        p.dqacc = dqacc + c * dq_elems + int64_t(cq[b]) * Hq * D;
        p.lse2 = lse2.p + cq[b];
        p.Drow = Drow.p + cq[b];
        p.lse_hs = Tq;
        for (int64_t i = 0; i < p.Sq; ++i)
          std::memset(p.dqacc + (i * Hq + hk * G) * D, 0, sizeof(float) * size_t(G * D));
        float* ws = thread_workspace(bwd_ws_floats<D>());
        const int64_t nkb_b = (p.Sk + kBwdBk - 1) / kBwdBk;
        for (int64_t kb = c; kb < nkb_b; kb += nchunks)
          bwd_block<T, D>(p, Hq, Hkv, a, hk, kb, xa, b, nullptr, ws);
      },
      workers);
  if (!direct) reduce_dq<T>(dqacc, nchunks, int64_t(dq_elems), Tq, Hq * D, dq, light_threads, workers);
}

template <typename T, int D>
void attention_bwd_varlen(const T* q, const T* k, const T* v, const T* o, const float* lse, const T* dout, T* dq,
                          T* dk, T* dv, const AttentionShape& s, const VarlenArgs& va, const AttentionAttrs& a,
                          int num_threads, Workers* workers = nullptr) {
  attention_bwd_varlen<T, D>(q, k, v, o, lse, dout, dq, dk, dv, s, va, a, ScoreExtras{}, num_threads, workers);
}

}  // namespace cpu
}  // namespace flashgen
