// XLA FFI handlers of the CPU backend. The generated file for a spec binds
// Handler to each call's symbol; call.h checks everything that can go wrong
// with a call before a kernel touches memory; this file runs the kernels.
//
// Threads: the handlers receive XLA's intra-op thread pool (Ctx<ThreadPool>)
// and run the kernels' helper workers on it, as many as it has threads (the
// calling thread works too), so flashgen follows XLA's CPU threading settings
// and starts no thread of its own. A pool of one thread means inline. Without a
// pool (a host that passes none) the kernels use their own persistent pool
// sized to the CPUs available. FLASHGEN_CPU_THREADS=N overrides both: N
// threads on the own pool (1: inline). FLASHGEN_CPU_KV_SPLITS: parallel.h.
#pragma once
#include <cstring>
#include <string>

#include "flashgen/cpu/flash_cpu.h"
#include "flashgen/call.h"

namespace flashgen::cpu {

template <ffi::DataType T>
struct Storage;
template <>
struct Storage<ffi::DataType::F32> { using type = float; };
template <>
struct Storage<ffi::DataType::BF16> { using type = bf16; };
template <>
struct Storage<ffi::DataType::F16> { using type = f16; };

// ffi::ThreadPool as the kernels' Workers.
class XlaWorkers final : public Workers {
 public:
  explicit XlaWorkers(ffi::ThreadPool& pool) : pool_(pool) {}
  int spawn(int count, void (*task)(void*), void* arg) noexcept override {
    int scheduled = 0;
    try {
      for (; scheduled < count; ++scheduled) pool_.Schedule([task, arg] { task(arg); });
    } catch (...) {  // out of memory: the calling thread does the rest
    }
    return scheduled;
  }

 private:
  ffi::ThreadPool& pool_;
};

// Runs kernel(num_threads, workers) with the threads chosen as described above.
template <typename Kernel>
void with_threads(ffi::ThreadPool& pool, Kernel&& kernel) {
  if (const int env = env_num_threads(); env > 0) return kernel(env, static_cast<Workers*>(nullptr));
  const int64_t n = pool.num_threads();
  if (n <= 0) return kernel(available_cpus(), static_cast<Workers*>(nullptr));  // the host has no pool
  if (n == 1) return kernel(1, static_cast<Workers*>(nullptr));
  XlaWorkers workers(pool);
  kernel(static_cast<int>(std::min<int64_t>(n, 4096)), static_cast<Workers*>(&workers));
}

// A kernel stopped by cancel_flag() (cancel.h) left its outputs unfinished: fail the call.
inline ffi::Error finished(const char* target) {
  if (cancel_requested()) return ffi::Error(ffi::ErrorCode::kCancelled, std::string(target) + ": interrupted");
  return ffi::Error::Success();
}

// FLASHGEN_POISON: fill the call's results before the kernels run (ffi_common.h poison_byte).
template <class Call>
void poison(const Call& call) {
  if (!poison_outputs()) return;
  for (const Out& r : call.results())
    if (r.data != nullptr) std::memset(r.data, poison_byte(), r.bytes);
}

template <ffi::DataType T>
const typename Storage<T>::type* in(const void* data) {
  return static_cast<const typename Storage<T>::type*>(data);
}
template <ffi::DataType T>
typename Storage<T>::type* out(const Out& o) {
  return static_cast<typename Storage<T>::type*>(o.data);
}

// The kernels of each call (call.h decoded and validated it). D: q and k's head dim; DV: v, o,
// do and dv's (call.h refuses a varlen or paged call whose DV is not D, so those run only then).
template <ffi::DataType T, int D, int DV>
void run(const FwdCall& c, int threads, Workers* workers) {
  attention_fwd<typename Storage<T>::type, D, DV>(in<T>(c.q), in<T>(c.k), in<T>(c.v), out<T>(c.o),
                                                  static_cast<float*>(c.lse.data), c.s, c.attrs, c.x, threads,
                                                  workers, env_kv_splits());
}

template <ffi::DataType T, int D, int DV>
void run(const BwdCall& c, int threads, Workers* workers) {
  attention_bwd<typename Storage<T>::type, D, DV>(in<T>(c.q), in<T>(c.k), in<T>(c.v), in<T>(c.o), c.lse,
                                                  in<T>(c.dout), out<T>(c.dq), out<T>(c.dk), out<T>(c.dv), c.s,
                                                  c.attrs, c.x, threads, workers);
}

template <ffi::DataType T, int D, int DV>
void run(const FwdVarlenCall& c, int threads, Workers* workers) {
  if constexpr (D == DV)
    attention_fwd_varlen<typename Storage<T>::type, D>(in<T>(c.q), in<T>(c.k), in<T>(c.v), out<T>(c.o),
                                                       static_cast<float*>(c.lse.data), c.s, c.varlen, c.attrs,
                                                       c.x, threads, workers);
}

template <ffi::DataType T, int D, int DV>
void run(const BwdVarlenCall& c, int threads, Workers* workers) {
  if constexpr (D == DV)
    attention_bwd_varlen<typename Storage<T>::type, D>(in<T>(c.q), in<T>(c.k), in<T>(c.v), in<T>(c.o), c.lse,
                                                       in<T>(c.dout), out<T>(c.dq), out<T>(c.dk), out<T>(c.dv), c.s,
                                                       c.varlen, c.attrs, c.x, threads, workers);
}

template <ffi::DataType T, int D, int DV>
void run(const FwdPagedCall& c, int threads, Workers* workers) {
  if constexpr (D == DV)
    attention_fwd_paged<typename Storage<T>::type, D>(in<T>(c.q), in<T>(c.k), in<T>(c.v), out<T>(c.o),
                                                      static_cast<float*>(c.lse.data), c.s, c.paged, c.attrs, c.x,
                                                      threads, workers, env_kv_splits());
}

// The handler of one call (templates/cpu/spec.cc.j2 binds it): Call (call.h) decodes and
// validates the FFI's arguments, then the kernels run on XLA's thread pool. SplitHandler: a
// spec whose value head dim DV differs from its query/key head dim D.
template <ffi::DataType T, int D, int DV, bool Causal, class Call>
struct SplitHandler {
  const char* target;

  template <class... Args>
  ffi::Error operator()(ffi::ThreadPool pool, Args... args) const {
    auto call = Call::decode(Callee{target, D, DV, Causal, /*host_operands=*/true}, std::move(args)...);
    if (call.has_error()) return call.error();
    poison(call.value());
    with_threads(pool, [&](int threads, Workers* workers) { run<T, D, DV>(call.value(), threads, workers); });
    return finished(target);
  }
};

template <ffi::DataType T, int D, bool Causal, class Call>
using Handler = SplitHandler<T, D, D, Causal, Call>;

}  // namespace flashgen::cpu
