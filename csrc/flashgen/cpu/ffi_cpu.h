// XLA FFI handler bodies for the CPU backend. The generated file for a spec
// only binds these templates to symbols; everything that can go wrong with a
// call is checked here before a kernel touches memory.
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

template <typename... Results>
void poison(Results&... results) {
  if (poison_outputs()) (std::memset(results->untyped_data(), 0xFF, results->size_bytes()), ...);
}

template <ffi::DataType T, int D, bool Causal>
ffi::Error fwd(const char* target, ffi::Buffer<T> q, ffi::Buffer<T> k, ffi::Buffer<T> v,
               ffi::ResultBuffer<T> o, ffi::ResultBuffer<ffi::F32> lse, bool causal, float scale,
               bool bottom_right) {
  auto shape = shape_from_qkv(target, D, q.dimensions(), k.dimensions(), v.dimensions());
  if (shape.has_error()) return shape.error();
  const AttentionShape& s = shape.value();
  AttentionAttrs attrs{scale, causal, bottom_right};
  if (auto e = check_attrs(target, Causal, attrs); e.failure()) return e;
  if (auto e = expect_dims(target, "o", o->dimensions(), {s.batch, s.seqlen_q, s.heads_q, D}); e.failure())
    return e;
  if (auto e = expect_dims(target, "lse", lse->dimensions(), {s.batch, s.heads_q, s.seqlen_q}); e.failure())
    return e;
  poison(o, lse);
  attention_fwd<typename Storage<T>::type, D>(in(q), in(k), in(v), out(o), lse->typed_data(), s, attrs,
                                              default_num_threads());
  return ffi::Error::Success();
}

template <ffi::DataType T, int D, bool Causal>
ffi::Error bwd(const char* target, ffi::Buffer<T> q, ffi::Buffer<T> k, ffi::Buffer<T> v,
               ffi::Buffer<T> o, ffi::Buffer<ffi::F32> lse, ffi::Buffer<T> dout, ffi::ResultBuffer<T> dq,
               ffi::ResultBuffer<T> dk, ffi::ResultBuffer<T> dv, bool causal, float scale,
               bool bottom_right) {
  auto shape = shape_from_qkv(target, D, q.dimensions(), k.dimensions(), v.dimensions());
  if (shape.has_error()) return shape.error();
  const AttentionShape& s = shape.value();
  AttentionAttrs attrs{scale, causal, bottom_right};
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
  attention_bwd<typename Storage<T>::type, D>(in(q), in(k), in(v), in(o), lse.typed_data(), in(dout),
                                              out(dq), out(dk), out(dv), s, attrs, default_num_threads());
  return ffi::Error::Success();
}

}  // namespace flashgen::cpu
