// A flashgen call, decoded and validated once for every backend.
//
// The FFI decodes a call's attributes into DenseAttrs / VarlenAttrs (struct attribute decoding,
// registered at the end of this file) and its buffers into the handler's arguments, in the
// order flashgen/contract.py's CALLS gives (the templates render each handler's binding from
// it). <Direction>Call::decode then checks every shape, dtype, attribute and extra operand
// here, before any kernel runs, and hands a backend what its kernels need; a backend's handler
// (cpu/ffi_cpu.h, cuda/ffi_cuda.cuh) only chooses and launches kernels.
// tests/test_contract_cxx.py checks the attribute structs and the decode signatures below
// against flashgen/contract.py.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "flashgen/ffi_common.h"

// XLA's FFI headers map no FP8 element type to a C++ one, so Buffer<F8E4M3FN> (the FP8 forward's
// q, k, v) would not compile: its elements are bytes.
namespace xla::ffi::internal {
template <>
struct DataTypeToNative<DataType::F8E4M3FN> {
  using type = uint8_t;
};
}  // namespace xla::ffi::internal

namespace flashgen {

// The attributes of fwd, bwd and fwd_paged, in contract.CALLS order with ATTRIBUTES' C++ types.
struct DenseAttrs {
  bool causal;
  float scale;
  bool bottom_right;
  int32_t window_left;
  int32_t window_right;
  float softcap;
  std::string_view extras;

  AttentionAttrs kernel() const { return {scale, causal, bottom_right, window_left, window_right, softcap}; }
};

// The attributes of fwd_varlen and bwd_varlen: the dense ones, then the longest sequences.
struct VarlenAttrs : DenseAttrs {
  int32_t max_seqlen_q;
  int32_t max_seqlen_k;
};

// The attributes of bwd: the dense ones, then whether its accumulations run in a fixed order.
struct BwdAttrs : DenseAttrs {
  bool deterministic;
};

// The attributes of bwd_varlen: the varlen ones, then deterministic as in bwd.
struct BwdVarlenAttrs : VarlenAttrs {
  bool deterministic;
};

// The handler a call reached.
struct Callee {
  const char* target;  // its symbol, for messages
  int64_t head_dim;    // what its kernels are specialized for: q and k's last dim
  int64_t head_dim_v;  // v, o, do and dv's last dim
  bool causal;
  bool host_operands;  // operands are host memory (CPU): their values are checked too
};

// A result buffer: where a kernel writes and how many bytes (for FLASHGEN_POISON). Each call's
// results() lists its own.
struct Out {
  void* data = nullptr;
  size_t bytes = 0;
};

template <ffi::DataType T>
Out as_out(ffi::ResultBuffer<T>& r) {
  return {r->untyped_data(), r->size_bytes()};
}

// What every call decodes: the problem's shape, the kernel's attributes and the extras.
struct Decoded {
  AttentionShape s{};
  AttentionAttrs attrs{};
  ScoreExtras x;
};

// The extras (dense: any; varlen, paged: alibi only) and the attributes of a call whose shape
// is known. `dbias`: the backward's results after dq, dk, dv; null in the forward.
inline ffi::Error decode_scores(const Callee& c, const DenseAttrs& a, const ffi::RemainingArgs& args,
                                ffi::DataType q_type, bool packed, const ffi::RemainingRets* dbias, Decoded* d) {
  auto xs = packed ? decode_packed_extras(c.target, a.extras, args, d->s, q_type)
                   : decode_extras(c.target, a.extras, args, d->s, q_type, dbias);
  if (xs.has_error()) return xs.error();
  d->x = xs.value();
  d->attrs = a.kernel();
  return check_attrs(c.target, c.causal, d->attrs, d->x.alibi != nullptr);
}

// Varlen and paged calls have kernels only for equal query/key and value head dims.
inline ffi::Error split_head_dims_refused(const Callee& c) {
  return invalid(c.target, "the varlen and paged calls need the value head dim (" + std::to_string(c.head_dim_v) +
                               ") to equal the query/key head dim (" + std::to_string(c.head_dim) +
                               "); only the dense fwd and bwd take different ones");
}

#define FLASHGEN_RETURN_IF_ERROR(expr)                                                    \
  if (ffi::Error flashgen_error_ = (expr); flashgen_error_.failure()) {                    \
    return ffi::Unexpected<ffi::Error>(flashgen_error_);                                  \
  }

// The buffers of a forward: q, k, v (paged: the caches) -> o, lse.
struct FwdBuffers {
  const void *q, *k, *v;
  Out o, lse;
  std::array<Out, 2> results() const { return {o, lse}; }

  template <ffi::DataType T, ffi::DataType TO = T>  // TO: o's type (an FP8 call's is bf16)
  ffi::Error take(const Callee& c, const AttentionShape& s, bool packed, ffi::Buffer<T>& q_in, ffi::Buffer<T>& k_in,
                  ffi::Buffer<T>& v_in, ffi::ResultBuffer<TO>& o_out, ffi::ResultBuffer<ffi::F32>& lse_out) {
    if (auto e = packed ? expect_dims(c.target, "o", o_out->dimensions(), {s.seqlen_q, s.heads_q, c.head_dim_v})
                        : expect_dims(c.target, "o", o_out->dimensions(), {s.batch, s.seqlen_q, s.heads_q, c.head_dim_v});
        e.failure())
      return e;
    if (auto e = packed ? expect_dims(c.target, "lse", lse_out->dimensions(), {s.heads_q, s.seqlen_q})
                        : expect_dims(c.target, "lse", lse_out->dimensions(), {s.batch, s.heads_q, s.seqlen_q});
        e.failure())
      return e;
    q = q_in.untyped_data(), k = k_in.untyped_data(), v = v_in.untyped_data();
    o = as_out(o_out), lse = as_out(lse_out);
    return ffi::Error::Success();
  }
};

// The buffers of a backward: q, k, v, o, lse, do -> dq, dk, dv; `packed`: varlen's rank-3 tokens.
struct BwdBuffers {
  const void *q, *k, *v, *o;
  const float* lse;
  const void* dout;
  Out dq, dk, dv;

  template <ffi::DataType T>
  ffi::Error take(const Callee& c, const AttentionShape& s, bool packed, ffi::Buffer<T>& q_in, ffi::Buffer<T>& k_in,
                  ffi::Buffer<T>& v_in, ffi::Buffer<T>& o_in, ffi::Buffer<ffi::F32>& lse_in, ffi::Buffer<T>& dout_in,
                  ffi::ResultBuffer<T>& dq_out, ffi::ResultBuffer<T>& dk_out, ffi::ResultBuffer<T>& dv_out) {
    const int64_t B = s.batch, Sq = s.seqlen_q, Sk = s.seqlen_k, Hq = s.heads_q, Hkv = s.heads_kv;
    auto rows = [&](const char* name, Dims d, int64_t seq, int64_t heads, int64_t D) {
      return packed ? expect_dims(c.target, name, d, {seq, heads, D}) : expect_dims(c.target, name, d, {B, seq, heads, D});
    };
    if (auto e = rows("o", o_in.dimensions(), Sq, Hq, c.head_dim_v); e.failure()) return e;
    if (auto e = packed ? expect_dims(c.target, "lse", lse_in.dimensions(), {Hq, Sq})
                        : expect_dims(c.target, "lse", lse_in.dimensions(), {B, Hq, Sq});
        e.failure())
      return e;
    if (auto e = rows("do", dout_in.dimensions(), Sq, Hq, c.head_dim_v); e.failure()) return e;
    if (auto e = rows("dq", dq_out->dimensions(), Sq, Hq, c.head_dim); e.failure()) return e;
    if (auto e = rows("dk", dk_out->dimensions(), Sk, Hkv, c.head_dim); e.failure()) return e;
    if (auto e = rows("dv", dv_out->dimensions(), Sk, Hkv, c.head_dim_v); e.failure()) return e;
    q = q_in.untyped_data(), k = k_in.untyped_data(), v = v_in.untyped_data(), o = o_in.untyped_data();
    lse = lse_in.typed_data(), dout = dout_in.untyped_data();
    dq = as_out(dq_out), dk = as_out(dk_out), dv = as_out(dv_out);
    return ffi::Error::Success();
  }
};

// fwd: q, k, v [B, S, H, D] (+ extras) -> o [B, Sq, Hq, D], lse [B, Hq, Sq].
struct FwdCall : Decoded, FwdBuffers {
  template <ffi::DataType T>
  static ffi::ErrorOr<FwdCall> decode(const Callee& c, ffi::Buffer<T> q, ffi::Buffer<T> k, ffi::Buffer<T> v,
                                      ffi::RemainingArgs extra_args, ffi::ResultBuffer<T> o,
                                      ffi::ResultBuffer<ffi::F32> lse, DenseAttrs a) {
    FwdCall call;
    auto shape = shape_from_qkv(c.target, c.head_dim, c.head_dim_v, q.dimensions(), k.dimensions(), v.dimensions());
    if (shape.has_error()) return ffi::Unexpected<ffi::Error>(shape.error());
    call.s = shape.value();
    FLASHGEN_RETURN_IF_ERROR(decode_scores(c, a, extra_args, T, false, nullptr, &call));
    FLASHGEN_RETURN_IF_ERROR(call.take(c, call.s, false, q, k, v, o, lse));
    return call;
  }
};

// fwd of an FP8 spec: q, k, v [B, S, H, D] e4m3, q_descale, k_descale, v_descale f32 [1] -> o
// [B, Sq, Hq, D] bf16, lse [B, Hq, Sq]; no extras, no softcap (contract.FP8_CALLS).
struct FwdFp8Call : Decoded, FwdBuffers {
  const float *q_descale, *k_descale, *v_descale;  // device (or host) memory, one value each

  template <ffi::DataType T>
  static ffi::ErrorOr<FwdFp8Call> decode(const Callee& c, ffi::Buffer<T> q, ffi::Buffer<T> k, ffi::Buffer<T> v,
                                         ffi::Buffer<ffi::F32> q_descale, ffi::Buffer<ffi::F32> k_descale,
                                         ffi::Buffer<ffi::F32> v_descale, ffi::RemainingArgs extra_args,
                                         ffi::ResultBuffer<ffi::BF16> o, ffi::ResultBuffer<ffi::F32> lse, DenseAttrs a) {
    FwdFp8Call call;
    auto shape = shape_from_qkv(c.target, c.head_dim, c.head_dim_v, q.dimensions(), k.dimensions(), v.dimensions());
    if (shape.has_error()) return ffi::Unexpected<ffi::Error>(shape.error());
    call.s = shape.value();
    if (!a.extras.empty())
      return ffi::Unexpected<ffi::Error>(invalid(c.target, "the FP8 forward takes no extras, got \"" +
                                                               std::string(a.extras) + "\""));
    if (a.softcap != 0.f)
      return ffi::Unexpected<ffi::Error>(invalid(c.target, "the FP8 forward has no softcap (softcap must be 0)"));
    FLASHGEN_RETURN_IF_ERROR(expect_dims(c.target, "q_descale", q_descale.dimensions(), {1}));
    FLASHGEN_RETURN_IF_ERROR(expect_dims(c.target, "k_descale", k_descale.dimensions(), {1}));
    FLASHGEN_RETURN_IF_ERROR(expect_dims(c.target, "v_descale", v_descale.dimensions(), {1}));
    FLASHGEN_RETURN_IF_ERROR(decode_scores(c, a, extra_args, T, false, nullptr, &call));
    FLASHGEN_RETURN_IF_ERROR(call.take(c, call.s, false, q, k, v, o, lse));
    call.q_descale = q_descale.typed_data(), call.k_descale = k_descale.typed_data();
    call.v_descale = v_descale.typed_data();
    return call;
  }
};

// bwd: q, k, v, o, lse, do (+ extras) -> dq, dk, dv (+ dbias, optional, iff a bias).
struct BwdCall : Decoded, BwdBuffers {
  Out dbias;  // dbias.data == x.dbias
  std::array<Out, 4> results() const { return {dq, dk, dv, dbias}; }

  template <ffi::DataType T>
  static ffi::ErrorOr<BwdCall> decode(const Callee& c, ffi::Buffer<T> q, ffi::Buffer<T> k, ffi::Buffer<T> v,
                                      ffi::Buffer<T> o, ffi::Buffer<ffi::F32> lse, ffi::Buffer<T> dout,
                                      ffi::RemainingArgs extra_args, ffi::ResultBuffer<T> dq,
                                      ffi::ResultBuffer<T> dk, ffi::ResultBuffer<T> dv,
                                      ffi::RemainingRets extra_rets, BwdAttrs a) {
    BwdCall call;
    auto shape = shape_from_qkv(c.target, c.head_dim, c.head_dim_v, q.dimensions(), k.dimensions(), v.dimensions());
    if (shape.has_error()) return ffi::Unexpected<ffi::Error>(shape.error());
    call.s = shape.value();
    FLASHGEN_RETURN_IF_ERROR(decode_scores(c, a, extra_args, T, false, &extra_rets, &call));
    call.attrs.deterministic = a.deterministic;
    FLASHGEN_RETURN_IF_ERROR(call.take(c, call.s, false, q, k, v, o, lse, dout, dq, dk, dv));
    if (call.x.dbias != nullptr) call.dbias = {call.x.dbias, (*extra_rets.get<ffi::AnyBuffer>(0).value()).size_bytes()};
    return call;
  }
};

// What both varlen directions decode first: the packed shape (varlen_shape), max_seqlen and, in
// host memory, the cu_seqlens values; then the alibi extra and the attributes.
struct VarlenDecoded : Decoded {
  VarlenArgs varlen{};

  template <ffi::DataType T>
  ffi::Error decode_varlen(const Callee& c, Dims q, Dims k, Dims v, const ffi::Buffer<ffi::S32>& cu_q,
                           const ffi::Buffer<ffi::S32>& cu_k, const ffi::RemainingArgs& extra_args,
                           const VarlenAttrs& a) {
    if (c.head_dim_v != c.head_dim) return split_head_dims_refused(c);
    auto shape = varlen_shape(c.target, c.head_dim, q, k, v, cu_q.dimensions(), cu_k.dimensions());
    if (shape.has_error()) return shape.error();
    s = shape.value();
    if (a.max_seqlen_q < 0 || a.max_seqlen_k < 0)
      return invalid(c.target, "max_seqlen_q / max_seqlen_k must be >= 0, got (" + std::to_string(a.max_seqlen_q) +
                                   ", " + std::to_string(a.max_seqlen_k) + ")");
    if (c.host_operands) {
      if (auto e = check_cu_seqlens(c.target, "cu_seqlens_q", cu_q.typed_data(), s.batch, q[0], a.max_seqlen_q);
          e.failure())
        return e;
      if (auto e = check_cu_seqlens(c.target, "cu_seqlens_k", cu_k.typed_data(), s.batch, k[0], a.max_seqlen_k);
          e.failure())
        return e;
    }
    varlen = {cu_q.typed_data(), cu_k.typed_data(), a.max_seqlen_q, a.max_seqlen_k};
    return decode_scores(c, a, extra_args, T, true, nullptr, this);
  }
};

// fwd_varlen: q [Tq, Hq, D], k, v [Tk, Hkv, D], cu_seqlens_q, cu_seqlens_k [B + 1] (+ alibi)
// -> o [Tq, Hq, D], lse [Hq, Tq].
struct FwdVarlenCall : VarlenDecoded, FwdBuffers {
  template <ffi::DataType T>
  static ffi::ErrorOr<FwdVarlenCall> decode(const Callee& c, ffi::Buffer<T> q, ffi::Buffer<T> k, ffi::Buffer<T> v,
                                            ffi::Buffer<ffi::S32> cu_seqlens_q, ffi::Buffer<ffi::S32> cu_seqlens_k,
                                            ffi::RemainingArgs extra_args, ffi::ResultBuffer<T> o,
                                            ffi::ResultBuffer<ffi::F32> lse, VarlenAttrs a) {
    FwdVarlenCall call;
    FLASHGEN_RETURN_IF_ERROR(call.decode_varlen<T>(c, q.dimensions(), k.dimensions(), v.dimensions(), cu_seqlens_q,
                                                   cu_seqlens_k, extra_args, a));
    FLASHGEN_RETURN_IF_ERROR(call.take(c, call.s, true, q, k, v, o, lse));
    return call;
  }
};

// bwd_varlen: q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k (+ alibi) -> dq, dk, dv.
struct BwdVarlenCall : VarlenDecoded, BwdBuffers {
  std::array<Out, 3> results() const { return {dq, dk, dv}; }

  template <ffi::DataType T>
  static ffi::ErrorOr<BwdVarlenCall> decode(const Callee& c, ffi::Buffer<T> q, ffi::Buffer<T> k, ffi::Buffer<T> v,
                                            ffi::Buffer<T> o, ffi::Buffer<ffi::F32> lse, ffi::Buffer<T> dout,
                                            ffi::Buffer<ffi::S32> cu_seqlens_q, ffi::Buffer<ffi::S32> cu_seqlens_k,
                                            ffi::RemainingArgs extra_args, ffi::ResultBuffer<T> dq,
                                            ffi::ResultBuffer<T> dk, ffi::ResultBuffer<T> dv, BwdVarlenAttrs a) {
    BwdVarlenCall call;
    FLASHGEN_RETURN_IF_ERROR(call.decode_varlen<T>(c, q.dimensions(), k.dimensions(), v.dimensions(), cu_seqlens_q,
                                                   cu_seqlens_k, extra_args, a));
    call.attrs.deterministic = a.deterministic;
    FLASHGEN_RETURN_IF_ERROR(call.take(c, call.s, true, q, k, v, o, lse, dout, dq, dk, dv));
    return call;
  }
};

// fwd_paged: q [B, Sq, Hq, D], k_cache, v_cache [NB, BS, Hkv, D], block_table [B, MB],
// seqused_k [B] (+ alibi) -> o, lse as fwd. The shape's seqlen_k is MB * BS.
struct FwdPagedCall : Decoded, FwdBuffers {  // k, v: k_cache, v_cache
  PagedArgs paged{};

  template <ffi::DataType T>
  static ffi::ErrorOr<FwdPagedCall> decode(const Callee& c, ffi::Buffer<T> q, ffi::Buffer<T> k_cache,
                                           ffi::Buffer<T> v_cache, ffi::Buffer<ffi::S32> block_table,
                                           ffi::Buffer<ffi::S32> seqused_k, ffi::RemainingArgs extra_args,
                                           ffi::ResultBuffer<T> o, ffi::ResultBuffer<ffi::F32> lse, DenseAttrs a) {
    FwdPagedCall call;
    auto shape = paged_shape(c, q.dimensions(), k_cache.dimensions(), v_cache.dimensions(),
                             block_table.dimensions(), seqused_k.dimensions());
    if (shape.has_error()) return ffi::Unexpected<ffi::Error>(shape.error());
    const AttentionShape& s = call.s = shape.value();
    const Dims kd = k_cache.dimensions();
    call.paged = {block_table.typed_data(), seqused_k.typed_data(), kd[0], kd[1], block_table.dimensions()[1]};
    if (c.host_operands) FLASHGEN_RETURN_IF_ERROR(check_block_table(c.target, call.paged, s.batch));
    FLASHGEN_RETURN_IF_ERROR(decode_scores(c, a, extra_args, T, true, nullptr, &call));
    FLASHGEN_RETURN_IF_ERROR(call.take(c, s, false, q, k_cache, v_cache, o, lse));
    return call;
  }

 private:
  static ffi::ErrorOr<AttentionShape> paged_shape(const Callee& c, Dims q, Dims k, Dims v, Dims table, Dims used) {
    auto fail = [&](const std::string& what) { return ffi::Unexpected<ffi::Error>(invalid(c.target, what)); };
    if (c.head_dim_v != c.head_dim) return ffi::Unexpected<ffi::Error>(split_head_dims_refused(c));
    if (q.size() != 4) return fail("q must be rank 4 [batch, seq, heads, head_dim], got " + dims_str(q));
    if (k.size() != 4)
      return fail("k_cache must be rank 4 [num_blocks, block_size, kv_heads, head_dim], got " + dims_str(k));
    if (q[3] != c.head_dim || k[3] != c.head_dim)
      return fail("head_dim of q " + dims_str(q) + " / k_cache " + dims_str(k) + " does not match this kernel's " +
                  std::to_string(c.head_dim));
    if (v.size() != 4 || v[0] != k[0] || v[1] != k[1] || v[2] != k[2] || v[3] != k[3])
      return fail("k_cache and v_cache shapes differ: k_cache " + dims_str(k) + ", v_cache " + dims_str(v));
    if (k[2] <= 0 || q[2] % k[2] != 0)
      return fail("kv heads (" + std::to_string(k[2]) + ") must divide q heads (" + std::to_string(q[2]) + ")");
    if (k[1] <= 0) return fail("block_size (k_cache dim 1) must be > 0, got " + dims_str(k));
    if (table.size() != 2 || table[0] != q[0])
      return fail("block_table must be [" + std::to_string(q[0]) + ", max_blocks], got " + dims_str(table));
    if (auto e = expect_dims(c.target, "seqused_k", used, {q[0]}); e.failure()) return ffi::Unexpected<ffi::Error>(e);
    return AttentionShape{q[0], q[1], table[1] * k[1], q[2], k[2], c.head_dim};
  }

  // Host-side check of the table's values: each seqused_k[b] in [0, MB * BS], and every block
  // it uses in [0, NB).
  static ffi::Error check_block_table(const char* target, const PagedArgs& p, int64_t batch) {
    const int64_t MB = p.max_blocks, BS = p.block_size, NB = p.num_blocks;
    for (int64_t b = 0; b < batch; ++b) {
      const int32_t used = p.seqused_k[b];
      if (used < 0 || int64_t(used) > MB * BS)
        return invalid(target, "seqused_k[" + std::to_string(b) + "] = " + std::to_string(used) +
                                   " is outside [0, max_blocks * block_size = " + std::to_string(MB * BS) + "]");
      for (int64_t j = 0; j < (int64_t(used) + BS - 1) / BS; ++j) {
        const int32_t id = p.block_table[b * MB + j];
        if (id < 0 || id >= NB)
          return invalid(target, "block_table[" + std::to_string(b) + ", " + std::to_string(j) + "] = " +
                                     std::to_string(id) + " is outside [0, num_blocks = " + std::to_string(NB) +
                                     ") but seqused_k[" + std::to_string(b) + "] = " + std::to_string(used) +
                                     " uses it");
      }
    }
    return ffi::Error::Success();
  }
};

#undef FLASHGEN_RETURN_IF_ERROR

}  // namespace flashgen

// The FFI's decoding of the attribute structs above: member by member, by name.
#define FLASHGEN_DENSE_ATTRS                                                                             \
  ::xla::ffi::StructMember<bool>("causal"), ::xla::ffi::StructMember<float>("scale"),                     \
      ::xla::ffi::StructMember<bool>("bottom_right"), ::xla::ffi::StructMember<int32_t>("window_left"),   \
      ::xla::ffi::StructMember<int32_t>("window_right"), ::xla::ffi::StructMember<float>("softcap"),      \
      ::xla::ffi::StructMember<std::string_view>("extras")
#define FLASHGEN_MAX_SEQLENS \
  ::xla::ffi::StructMember<int32_t>("max_seqlen_q"), ::xla::ffi::StructMember<int32_t>("max_seqlen_k")
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(flashgen::DenseAttrs, FLASHGEN_DENSE_ATTRS);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(flashgen::VarlenAttrs, FLASHGEN_DENSE_ATTRS, FLASHGEN_MAX_SEQLENS);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(flashgen::BwdAttrs, FLASHGEN_DENSE_ATTRS,
                                      ::xla::ffi::StructMember<bool>("deterministic"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(flashgen::BwdVarlenAttrs, FLASHGEN_DENSE_ATTRS, FLASHGEN_MAX_SEQLENS,
                                      ::xla::ffi::StructMember<bool>("deterministic"));
#undef FLASHGEN_MAX_SEQLENS
#undef FLASHGEN_DENSE_ATTRS
