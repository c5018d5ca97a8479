// Thread plumbing of the CPU kernels: a persistent worker pool (or the host's,
// through Workers), parallel_for, thread counts worth using, per-thread scratch.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <new>
#include <thread>
#include <type_traits>
#include <utility>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#include <sched.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "flashgen/cancel.h"

namespace flashgen {
namespace cpu {

// ---------------------------------------------------------------------------
// Threads.
// ---------------------------------------------------------------------------

// The environment variable `name` if set to a number > 0 (capped at 4096), else 0.
inline int env_count(const char* name) {
  if (const char* e = std::getenv(name)) {
    char* end = nullptr;
    long n = std::strtol(e, &end, 10);
    if (end != e && n > 0) return n > 4096 ? 4096 : static_cast<int>(n);
  }
  return 0;
}

inline int env_num_threads() { return env_count("FLASHGEN_CPU_THREADS"); }

// FLASHGEN_CPU_KV_SPLITS=N forces N split-KV key ranges per row block in the dense and
// paged forward (the split and its merge are otherwise taken only when row blocks are
// fewer than useful threads, which the tests' small shapes on few cores never reach).
inline int env_kv_splits() { return env_count("FLASHGEN_CPU_KV_SPLITS"); }

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
    if (cancel_requested()) {  // claim every item left, unrun, so that the waiter returns
      const int64_t first = j->next.exchange(j->n, std::memory_order_relaxed);
      if (first < j->n && j->done.fetch_add(j->n - first, std::memory_order_acq_rel) + (j->n - first) == j->n) {
        std::lock_guard<std::mutex> lock(j->m);
        j->cv.notify_all();
      }
      break;
    }
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
    for (int64_t i = 0; i < n && !cancel_requested(); ++i) fn(i, 0);
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

// ---------------------------------------------------------------------------
// Workspace.
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

// A buffer kept between uses that only grows (the old one is freed before the
// new one is mapped).
struct GrowingFloats {
  AlignedFloats buf;
  size_t cap = 0;
  float* at_least(size_t n) {
    if (cap < n) {
      buf = AlignedFloats();
      buf = AlignedFloats(n);
      cap = n;
    }
    return buf.p;
  }
};

// This thread's scratch space of at least n floats, 64-byte aligned, kept for
// the next call.
inline float* thread_workspace(size_t n) {
  thread_local GrowingFloats buf;
  return buf.at_least(n);
}

// 32 MiB: the f32 calls at D=128 S=2048 with 8 heads (16 MiB of packed K / V forward; packed
// q / dout and the row terms backward, just over 16 MiB), and the forward at D=128 S=4096 (32 MiB).
#ifndef FLASHGEN_CPU_KEEP_BYTES
#define FLASHGEN_CPU_KEEP_BYTES (32 << 20)
#endif

// Scratch of n floats for one call, 64-byte aligned. Up to keep_bytes it is a
// buffer of the calling thread kept for its next call: a freshly mapped one takes a page fault
// per 4 KiB on first touch (the f32 forward's 8 MiB of packed K / V at S=2048: ~3.5 ms of its
// 88 in a JAX process, whose allocations keep glibc from reusing the pages); larger ones, whose
// faults weigh less against the call's O(S^2) work, are the call's own, so that a thread keeps
// at most keep_bytes.
class CallScratch {
 public:
  explicit CallScratch(size_t n, size_t keep_bytes = FLASHGEN_CPU_KEEP_BYTES) {
    thread_local GrowingFloats kept;
    thread_local bool busy = false;  // a call made from inside a call gets its own
    if (n == 0) return;
    if (n * sizeof(float) > keep_bytes || busy) {
      own_ = AlignedFloats(n);
      p_ = own_.p;
      return;
    }
    p_ = kept.at_least(n);
    busy_ = &busy;
    busy = true;
  }
  CallScratch(const CallScratch&) = delete;
  CallScratch& operator=(const CallScratch&) = delete;
  ~CallScratch() {
    if (busy_) *busy_ = false;
  }
  float* data() const { return p_; }

 private:
  AlignedFloats own_;
  float* p_ = nullptr;
  bool* busy_ = nullptr;
};

// Whether what `state` guards (0: not made, 1: being made, 2: made) is ready:
// the first thread to ask makes it; one that asks while another is making it
// gets false and goes without (e.g. the forward reads K / V rows where they are
// instead of packed) rather than waiting.
template <typename Make>
bool made_once(std::atomic<int>& state, Make&& make) {
  int seen = state.load(std::memory_order_acquire);
  if (seen == 0 && state.compare_exchange_strong(seen, 1, std::memory_order_acquire)) {
    make();
    state.store(2, std::memory_order_release);
    return true;
  }
  return seen == 2;
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

}  // namespace detail

}  // namespace cpu
}  // namespace flashgen

