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
#include <string>
#include <string_view>

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

// A kernel stopped by cancel_flag() (cancel.h) left its outputs unfinished: fail the call.
inline ffi::Error finished(const char* target) {
  if (cancel_requested()) return ffi::Error(ffi::ErrorCode::kCancelled, std::string(target) + ": interrupted");
  return ffi::Error::Success();
}

template <typename... Results>
void poison(Results&... results) {
  if (poison_outputs()) (std::memset(results->untyped_data(), poison_byte(), results->size_bytes()), ...);
}

// Poisons an extra result (dbias) when FLASHGEN_POISON is set.
inline void poison_raw(void* data, size_t bytes) {
  if (poison_outputs() && data != nullptr) std::memset(data, poison_byte(), bytes);
}

template <ffi::DataType T, int D, bool Causal>
ffi::Error fwd(const char* target, ffi::ThreadPool pool, ffi::Buffer<T> q, ffi::Buffer<T> k, ffi::Buffer<T> v,
               ffi::RemainingArgs extra_args, ffi::ResultBuffer<T> o, ffi::ResultBuffer<ffi::F32> lse, bool causal,
               float scale, bool bottom_right, int32_t window_left, int32_t window_right, float softcap,
               std::string_view extras) {
  auto shape = shape_from_qkv(target, D, q.dimensions(), k.dimensions(), v.dimensions());
  if (shape.has_error()) return shape.error();
  const AttentionShape& s = shape.value();
  auto xs = decode_extras(target, extras, extra_args, s, T, nullptr);
  if (xs.has_error()) return xs.error();
  const ScoreExtras& x = xs.value();
  AttentionAttrs attrs{scale, causal, bottom_right, window_left, window_right, softcap};
  if (auto e = check_attrs(target, Causal, attrs, x.alibi != nullptr); e.failure()) return e;
  if (auto e = expect_dims(target, "o", o->dimensions(), {s.batch, s.seqlen_q, s.heads_q, D}); e.failure())
    return e;
  if (auto e = expect_dims(target, "lse", lse->dimensions(), {s.batch, s.heads_q, s.seqlen_q}); e.failure())
    return e;
  poison(o, lse);
  with_threads(pool, [&](int threads, Workers* workers) {
    attention_fwd<typename Storage<T>::type, D>(in(q), in(k), in(v), out(o), lse->typed_data(), s, attrs, x, threads,
                                                workers);
  });
  return finished(target);
}

template <ffi::DataType T, int D, bool Causal>
ffi::Error bwd(const char* target, ffi::ThreadPool pool, ffi::Buffer<T> q, ffi::Buffer<T> k, ffi::Buffer<T> v,
               ffi::Buffer<T> o, ffi::Buffer<ffi::F32> lse, ffi::Buffer<T> dout, ffi::RemainingArgs extra_args,
               ffi::ResultBuffer<T> dq, ffi::ResultBuffer<T> dk, ffi::ResultBuffer<T> dv,
               ffi::RemainingRets extra_rets, bool causal, float scale, bool bottom_right, int32_t window_left,
               int32_t window_right, float softcap, std::string_view extras) {
  auto shape = shape_from_qkv(target, D, q.dimensions(), k.dimensions(), v.dimensions());
  if (shape.has_error()) return shape.error();
  const AttentionShape& s = shape.value();
  auto xs = decode_extras(target, extras, extra_args, s, T, &extra_rets);
  if (xs.has_error()) return xs.error();
  const ScoreExtras& x = xs.value();
  AttentionAttrs attrs{scale, causal, bottom_right, window_left, window_right, softcap};
  if (auto e = check_attrs(target, Causal, attrs, x.alibi != nullptr); e.failure()) return e;
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
  if (x.dbias != nullptr) {
    auto db = extra_rets.get<ffi::AnyBuffer>(0);
    if (db.has_error()) return invalid(target, "dbias is not a buffer");
    poison_raw(x.dbias, (*db.value()).size_bytes());
  }
  with_threads(pool, [&](int threads, Workers* workers) {
    attention_bwd<typename Storage<T>::type, D>(in(q), in(k), in(v), in(o), lse.typed_data(), in(dout), out(dq),
                                                out(dk), out(dv), s, attrs, x, threads, workers);
  });
  return finished(target);
}

// varlen_shape (ffi_common.h) plus the values of cu_seqlens and max_seqlen:
// CPU buffers are host memory. Returns {B, Tq, Tk, Hq, Hkv, D}.
inline ffi::ErrorOr<AttentionShape> checked_varlen_shape(const char* target, int64_t head_dim, Dims q, Dims k,
                                                         Dims v, const ffi::Buffer<ffi::S32>& cu_q,
                                                         const ffi::Buffer<ffi::S32>& cu_k, int32_t max_seqlen_q,
                                                         int32_t max_seqlen_k) {
  auto shape = varlen_shape(target, head_dim, q, k, v, cu_q.dimensions(), cu_k.dimensions());
  if (shape.has_error()) return shape;
  const int64_t batch = shape.value().batch;
  if (max_seqlen_q < 0 || max_seqlen_k < 0)
    return ffi::Unexpected<ffi::Error>(invalid(target, "max_seqlen_q / max_seqlen_k must be >= 0, got (" +
                                                           std::to_string(max_seqlen_q) + ", " +
                                                           std::to_string(max_seqlen_k) + ")"));
  if (auto e = check_cu_seqlens(target, "cu_seqlens_q", cu_q.typed_data(), batch, q[0], max_seqlen_q); e.failure())
    return ffi::Unexpected<ffi::Error>(e);
  if (auto e = check_cu_seqlens(target, "cu_seqlens_k", cu_k.typed_data(), batch, k[0], max_seqlen_k); e.failure())
    return ffi::Unexpected<ffi::Error>(e);
  return shape;
}

// What both varlen handlers decode and check before their own outputs: the
// shape (checked_varlen_shape), the extras (decode_packed_extras) and the
// attributes.
struct VarlenCall {
  AttentionShape s;
  ScoreExtras x;
  AttentionAttrs attrs;
};

inline ffi::ErrorOr<VarlenCall> varlen_call(const char* target, int64_t head_dim, bool spec_causal, Dims q,
                                            Dims k, Dims v, const ffi::Buffer<ffi::S32>& cu_q,
                                            const ffi::Buffer<ffi::S32>& cu_k, const ffi::RemainingArgs& extra_args,
                                            ffi::DataType q_type, const AttentionAttrs& attrs,
                                            int32_t max_seqlen_q, int32_t max_seqlen_k, std::string_view extras) {
  auto shape = checked_varlen_shape(target, head_dim, q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k);
  if (shape.has_error()) return ffi::Unexpected<ffi::Error>(shape.error());
  auto xs = decode_packed_extras(target, extras, extra_args, shape.value(), q_type);
  if (xs.has_error()) return ffi::Unexpected<ffi::Error>(xs.error());
  if (auto e = check_attrs(target, spec_causal, attrs, xs.value().alibi != nullptr); e.failure())
    return ffi::Unexpected<ffi::Error>(e);
  return VarlenCall{shape.value(), xs.value(), attrs};
}

template <ffi::DataType T, int D, bool Causal>
ffi::Error fwd_varlen(const char* target, ffi::ThreadPool pool, ffi::Buffer<T> q, ffi::Buffer<T> k,
                      ffi::Buffer<T> v, ffi::Buffer<ffi::S32> cu_q, ffi::Buffer<ffi::S32> cu_k,
                      ffi::RemainingArgs extra_args, ffi::ResultBuffer<T> o, ffi::ResultBuffer<ffi::F32> lse,
                      bool causal, float scale, bool bottom_right, int32_t window_left, int32_t window_right,
                      float softcap, int32_t max_seqlen_q, int32_t max_seqlen_k, std::string_view extras) {
  auto call = varlen_call(target, D, Causal, q.dimensions(), k.dimensions(), v.dimensions(), cu_q, cu_k,
                          extra_args, T, {scale, causal, bottom_right, window_left, window_right, softcap},
                          max_seqlen_q, max_seqlen_k, extras);
  if (call.has_error()) return call.error();
  const AttentionShape& s = call.value().s;
  const ScoreExtras& x = call.value().x;
  const AttentionAttrs& attrs = call.value().attrs;
  if (auto e = expect_dims(target, "o", o->dimensions(), {s.seqlen_q, s.heads_q, D}); e.failure()) return e;
  if (auto e = expect_dims(target, "lse", lse->dimensions(), {s.heads_q, s.seqlen_q}); e.failure()) return e;
  poison(o, lse);
  const VarlenArgs va{cu_q.typed_data(), cu_k.typed_data(), max_seqlen_q, max_seqlen_k};
  with_threads(pool, [&](int threads, Workers* workers) {
    attention_fwd_varlen<typename Storage<T>::type, D>(in(q), in(k), in(v), out(o), lse->typed_data(), s, va, attrs,
                                                       x, threads, workers);
  });
  return finished(target);
}

template <ffi::DataType T, int D, bool Causal>
ffi::Error bwd_varlen(const char* target, ffi::ThreadPool pool, ffi::Buffer<T> q, ffi::Buffer<T> k,
                      ffi::Buffer<T> v, ffi::Buffer<T> o, ffi::Buffer<ffi::F32> lse, ffi::Buffer<T> dout,
                      ffi::Buffer<ffi::S32> cu_q, ffi::Buffer<ffi::S32> cu_k, ffi::RemainingArgs extra_args,
                      ffi::ResultBuffer<T> dq, ffi::ResultBuffer<T> dk, ffi::ResultBuffer<T> dv, bool causal,
                      float scale, bool bottom_right, int32_t window_left, int32_t window_right, float softcap,
                      int32_t max_seqlen_q, int32_t max_seqlen_k, std::string_view extras) {
  auto call = varlen_call(target, D, Causal, q.dimensions(), k.dimensions(), v.dimensions(), cu_q, cu_k,
                          extra_args, T, {scale, causal, bottom_right, window_left, window_right, softcap},
                          max_seqlen_q, max_seqlen_k, extras);
  if (call.has_error()) return call.error();
  const AttentionShape& s = call.value().s;
  const ScoreExtras& x = call.value().x;
  const AttentionAttrs& attrs = call.value().attrs;
  if (auto e = expect_dims(target, "o", o.dimensions(), {s.seqlen_q, s.heads_q, D}); e.failure()) return e;
  if (auto e = expect_dims(target, "lse", lse.dimensions(), {s.heads_q, s.seqlen_q}); e.failure()) return e;
  if (auto e = expect_dims(target, "do", dout.dimensions(), {s.seqlen_q, s.heads_q, D}); e.failure()) return e;
  if (auto e = expect_dims(target, "dq", dq->dimensions(), {s.seqlen_q, s.heads_q, D}); e.failure()) return e;
  if (auto e = expect_dims(target, "dk", dk->dimensions(), {s.seqlen_k, s.heads_kv, D}); e.failure()) return e;
  if (auto e = expect_dims(target, "dv", dv->dimensions(), {s.seqlen_k, s.heads_kv, D}); e.failure()) return e;
  poison(dq, dk, dv);
  const VarlenArgs va{cu_q.typed_data(), cu_k.typed_data(), max_seqlen_q, max_seqlen_k};
  with_threads(pool, [&](int threads, Workers* workers) {
    attention_bwd_varlen<typename Storage<T>::type, D>(in(q), in(k), in(v), in(o), lse.typed_data(), in(dout),
                                                       out(dq), out(dk), out(dv), s, va, attrs, x, threads,
                                                       workers);
  });
  return finished(target);
}

template <ffi::DataType T, int D, bool Causal>
ffi::Error fwd_paged(const char* target, ffi::ThreadPool pool, ffi::Buffer<T> q, ffi::Buffer<T> k_cache,
                     ffi::Buffer<T> v_cache, ffi::Buffer<ffi::S32> block_table, ffi::Buffer<ffi::S32> seqused_k,
                     ffi::RemainingArgs extra_args, ffi::ResultBuffer<T> o, ffi::ResultBuffer<ffi::F32> lse,
                     bool causal, float scale, bool bottom_right, int32_t window_left, int32_t window_right,
                     float softcap, std::string_view extras) {
  const Dims qd = q.dimensions(), kd = k_cache.dimensions(), vd = v_cache.dimensions();
  if (qd.size() != 4)
    return invalid(target, "q must be rank 4 [batch, seq, heads, head_dim], got " + dims_str(qd));
  if (kd.size() != 4)
    return invalid(target, "k_cache must be rank 4 [num_blocks, block_size, kv_heads, head_dim], got " +
                               dims_str(kd));
  if (qd[3] != D || kd[3] != D)
    return invalid(target, "head_dim of q " + dims_str(qd) + " / k_cache " + dims_str(kd) +
                               " does not match this kernel's " + std::to_string(D));
  if (auto e = expect_dims(target, "v_cache", vd, {kd[0], kd[1], kd[2], kd[3]}); e.failure()) return e;
  if (kd[2] <= 0 || qd[2] % kd[2] != 0)
    return invalid(target, "kv heads (" + std::to_string(kd[2]) + ") must divide q heads (" +
                               std::to_string(qd[2]) + ")");
  if (kd[1] <= 0) return invalid(target, "block_size (k_cache dim 1) must be > 0, got " + dims_str(kd));
  const int64_t B = qd[0], NB = kd[0], BS = kd[1];
  const Dims bt = block_table.dimensions();
  if (bt.size() != 2 || bt[0] != B)
    return invalid(target, "block_table has shape " + dims_str(bt) + ", expected [" + std::to_string(B) +
                               ", max_blocks]");
  const int64_t MB = bt[1];
  if (auto e = expect_dims(target, "seqused_k", seqused_k.dimensions(), {B}); e.failure()) return e;
  const int32_t* table = block_table.typed_data();
  const int32_t* used = seqused_k.typed_data();
  for (int64_t b = 0; b < B; ++b) {
    if (used[b] < 0 || int64_t(used[b]) > MB * BS)
      return invalid(target, "seqused_k[" + std::to_string(b) + "] = " + std::to_string(used[b]) +
                                 " is outside [0, max_blocks * block_size = " + std::to_string(MB * BS) + "]");
    const int64_t nblk = (int64_t(used[b]) + BS - 1) / BS;
    for (int64_t j = 0; j < nblk; ++j) {
      const int32_t id = table[b * MB + j];
      if (id < 0 || id >= NB)
        return invalid(target, "block_table[" + std::to_string(b) + ", " + std::to_string(j) + "] = " +
                                   std::to_string(id) + " is outside [0, num_blocks = " + std::to_string(NB) +
                                   ") but seqused_k[" + std::to_string(b) + "] = " + std::to_string(used[b]) +
                                   " uses it");
    }
  }
  const AttentionShape s{B, qd[1], MB * BS, qd[2], kd[2], D};
  auto xs = decode_packed_extras(target, extras, extra_args, s, T);
  if (xs.has_error()) return xs.error();
  const ScoreExtras& x = xs.value();
  AttentionAttrs attrs{scale, causal, bottom_right, window_left, window_right, softcap};
  if (auto e = check_attrs(target, Causal, attrs, x.alibi != nullptr); e.failure()) return e;
  if (auto e = expect_dims(target, "o", o->dimensions(), {B, s.seqlen_q, s.heads_q, D}); e.failure()) return e;
  if (auto e = expect_dims(target, "lse", lse->dimensions(), {B, s.heads_q, s.seqlen_q}); e.failure()) return e;
  poison(o, lse);
  const PagedArgs pa{table, used, NB, BS, MB};
  with_threads(pool, [&](int threads, Workers* workers) {
    attention_fwd_paged<typename Storage<T>::type, D>(in(q), in(k_cache), in(v_cache), out(o), lse->typed_data(), s,
                                                      pa, attrs, x, threads, workers);
  });
  return finished(target);
}

}  // namespace flashgen::cpu
