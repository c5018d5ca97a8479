// XLA FFI handler bodies for the CPU backend. The generated file for a spec
// only binds these templates to symbols; everything that can go wrong with a
// call is checked here before a kernel touches memory.
//
// Threads: the handlers receive XLA's intra-op thread pool (Ctx<ThreadPool>)
// and run the kernels' helper workers on it, as many as it has threads (the
// calling thread works too), so flashgen follows XLA's CPU threading settings
// and starts no thread of its own. A pool of one thread means inline. Without a
// pool (a host that passes none) the kernels use their own persistent pool
// sized to the CPUs available. FLASHGEN_CPU_THREADS=N overrides both: N
// threads on the own pool (1: inline).
#pragma once
#include <cstring>

#include "flashgen/cpu/flash_cpu.h"
#include "flashgen/ffi_common.h"

namespace flashgen::cpu {

template <ffi::DataType T>
struct Storage;
template <>
struct Storage<ffi::DataType::F32> { using type = float; };
template <>
struct Storage<ffi::DataType::BF16> { using type = bf16; };
template <>
struct Storage<ffi::DataType::F16> { using type = f16; };

template <ffi::DataType T>
const typename Storage<T>::type* in(const ffi::Buffer<T>& b) {
  return reinterpret_cast<const typename Storage<T>::type*>(b.typed_data());
}
template <ffi::DataType T>
typename Storage<T>::type* out(ffi::ResultBuffer<T>& b) {
  return reinterpret_cast<typename Storage<T>::type*>(b->typed_data());
}

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

template <typename... Results>
void poison(Results&... results) {
  if (poison_outputs()) (std::memset(results->untyped_data(), 0xFF, results->size_bytes()), ...);
}

template <ffi::DataType T, int D, bool Causal>
ffi::Error fwd(const char* target, ffi::ThreadPool pool, ffi::Buffer<T> q, ffi::Buffer<T> k, ffi::Buffer<T> v,
               ffi::ResultBuffer<T> o, ffi::ResultBuffer<ffi::F32> lse, bool causal, float scale,
               bool bottom_right, int32_t window_left, int32_t window_right, float softcap) {
  auto shape = shape_from_qkv(target, D, q.dimensions(), k.dimensions(), v.dimensions());
  if (shape.has_error()) return shape.error();
  const AttentionShape& s = shape.value();
  AttentionAttrs attrs{scale, causal, bottom_right, window_left, window_right, softcap};
  if (auto e = check_attrs(target, Causal, attrs); e.failure()) return e;
  if (auto e = expect_dims(target, "o", o->dimensions(), {s.batch, s.seqlen_q, s.heads_q, D}); e.failure())
    return e;
  if (auto e = expect_dims(target, "lse", lse->dimensions(), {s.batch, s.heads_q, s.seqlen_q}); e.failure())
    return e;
  poison(o, lse);
  with_threads(pool, [&](int threads, Workers* workers) {
    attention_fwd<typename Storage<T>::type, D>(in(q), in(k), in(v), out(o), lse->typed_data(), s, attrs, threads,
                                                workers);
  });
  return ffi::Error::Success();
}

template <ffi::DataType T, int D, bool Causal>
ffi::Error bwd(const char* target, ffi::ThreadPool pool, ffi::Buffer<T> q, ffi::Buffer<T> k, ffi::Buffer<T> v,
               ffi::Buffer<T> o, ffi::Buffer<ffi::F32> lse, ffi::Buffer<T> dout, ffi::ResultBuffer<T> dq,
               ffi::ResultBuffer<T> dk, ffi::ResultBuffer<T> dv, bool causal, float scale,
               bool bottom_right, int32_t window_left, int32_t window_right, float softcap) {
  auto shape = shape_from_qkv(target, D, q.dimensions(), k.dimensions(), v.dimensions());
  if (shape.has_error()) return shape.error();
  const AttentionShape& s = shape.value();
  AttentionAttrs attrs{scale, causal, bottom_right, window_left, window_right, softcap};
  if (auto e = check_attrs(target, Causal, attrs); e.failure()) return e;
  if (auto e = check_bwd_operands(target, s, o.dimensions(), lse.dimensions(), dout.dimensions());
      e.failure())
    return e;
  if (auto e = expect_dims(target, "dq", dq->dimensions(), {s.batch, s.seqlen_q, s.heads_q, D}); e.failure())
    return e;
  if (auto e = expect_dims(target, "dk", dk->dimensions(), {s.batch, s.seqlen_k, s.heads_kv, D}); e.failure())
    return e;
  if (auto e = expect_dims(target, "dv", dv->dimensions(), {s.batch, s.seqlen_k, s.heads_kv, D}); e.failure())
    return e;
  poison(dq, dk, dv);
  with_threads(pool, [&](int threads, Workers* workers) {
    attention_bwd<typename Storage<T>::type, D>(in(q), in(k), in(v), in(o), lse.typed_data(), in(dout), out(dq),
                                                out(dk), out(dv), s, attrs, threads, workers);
  });
  return ffi::Error::Success();
}

}  // namespace flashgen::cpu
