// The checks call.h composes into each call's validation. A handler must never
// trust the shapes it is handed: a hand-written module can call any target with
// any buffers, and the answer to a mismatch is an ffi::Error, never a crash.
#pragma once
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <string_view>

#include "flashgen/attention.h"
#include "xla/ffi/api/ffi.h"

namespace flashgen {
namespace ffi = xla::ffi;

using Dims = ffi::AnyBuffer::Dimensions;

inline std::string dims_str(Dims d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(d[i]);
  }
  return s + "]";
}

inline ffi::Error invalid(const char* target, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + what);
}

// Reads B, Sq, Sk, Hq, Hkv from q/k/v and checks everything the kernel relies on; v's last dim
// is head_dim_v (the value head dim), q's and k's head_dim.
inline ffi::ErrorOr<AttentionShape> shape_from_qkv(const char* target, int64_t head_dim, int64_t head_dim_v,
                                                   Dims q, Dims k, Dims v) {
  auto fail = [&](const std::string& what) { return ffi::Unexpected<ffi::Error>(invalid(target, what)); };
  const char* names[3] = {"q", "k", "v"};
  Dims all[3] = {q, k, v};
  for (int i = 0; i < 3; ++i) {
    if (all[i].size() != 4)
      return fail(std::string(names[i]) + " must be rank 4 [batch, seq, heads, head_dim], got " +
                  dims_str(all[i]));
    const int64_t want = i == 2 ? head_dim_v : head_dim;
    if (all[i][3] != want)
      return fail(std::string(names[i]) + " head_dim is " + std::to_string(all[i][3]) +
                  " but this kernel is specialized for " + std::to_string(want));
  }
  if (k[0] != q[0] || v[0] != q[0])
    return fail("batch sizes differ: q " + dims_str(q) + ", k " + dims_str(k) + ", v " + dims_str(v));
  if (v[1] != k[1] || v[2] != k[2])
    return fail("k and v shapes differ in sequence or heads: k " + dims_str(k) + ", v " + dims_str(v));
  if (k[2] <= 0 || q[2] % k[2] != 0)
    return fail("kv heads (" + std::to_string(k[2]) + ") must divide q heads (" + std::to_string(q[2]) + ")");
  return AttentionShape{q[0], q[1], k[1], q[2], k[2], head_dim};
}

inline ffi::Error expect_dims(const char* target, const char* name, Dims got,
                              std::initializer_list<int64_t> want) {
  bool same = got.size() == want.size();
  size_t i = 0;
  for (int64_t w : want) same = same && got[i++] == w;
  if (same) return ffi::Error::Success();
  std::string w = "[";
  i = 0;
  for (int64_t x : want) w += (i++ ? ", " : "") + std::to_string(x);
  return invalid(target, std::string(name) + " has shape " + dims_str(got) + ", expected " + w + "]");
}

inline bool is_subnormal(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return (u & 0x7f800000u) == 0 && (u & 0x007fffffu) != 0;
}

inline ffi::Error check_attrs(const char* target, bool spec_causal, const AttentionAttrs& a,
                              bool has_alibi = false) {
  if (a.causal != spec_causal)
    return invalid(target, std::string("attribute causal=") + (a.causal ? "true" : "false") +
                               " does not match this kernel (causal=" + (spec_causal ? "true" : "false") + ")");
  // Subnormal scale / softcap: XLA's CPU threads flush them to zero (softcap would be
  // off, every score 0), so refuse them; tested on the bits, which no flush mode changes.
  if (is_subnormal(a.scale) || is_subnormal(a.softcap))
    return invalid(target, std::string(is_subnormal(a.scale) ? "scale" : "softcap") +
                               " is a subnormal f32 (below 1.1754944e-38); use a normal value" +
                               (is_subnormal(a.scale) ? "" : " or 0 for no softcap"));
  if (!(a.scale > 0.0f) || a.scale != a.scale || a.scale == 1.0f / 0.0f)
    return invalid(target, "scale must be a finite positive f32, got " + std::to_string(a.scale));
  if (a.window_left < -1 || a.window_right < -1)
    return invalid(target, "window_left / window_right must be >= -1 (-1 = unbounded), got (" +
                               std::to_string(a.window_left) + ", " + std::to_string(a.window_right) + ")");
  if (!(a.softcap >= 0.0f) || a.softcap == 1.0f / 0.0f)
    return invalid(target, "softcap must be a finite f32 >= 0 (0 = off), got " + std::to_string(a.softcap));
  if (a.bottom_right && !a.causal && a.window_left < 0 && a.window_right < 0 && !has_alibi)
    return invalid(target, "bottom_right=true needs causal=true, a sliding window or alibi");
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// The `extras` attribute of the dense targets and the operands it names.
// ---------------------------------------------------------------------------
struct ExtraNames {
  bool alibi = false, bias = false, mask = false, segment_ids = false;
  size_t operands() const { return alibi + bias + mask + 2 * segment_ids; }
};

// Parses "alibi,bias,mask,segment_ids" (any subset, this order, "" = none).
inline ffi::ErrorOr<ExtraNames> parse_extras(const char* target, std::string_view text) {
  ExtraNames n;
  const char* order[4] = {"alibi", "bias", "mask", "segment_ids"};
  bool* flags[4] = {&n.alibi, &n.bias, &n.mask, &n.segment_ids};
  int next = 0;
  while (!text.empty()) {
    const size_t comma = text.find(',');
    const std::string_view name = text.substr(0, comma);
    int i = next;
    while (i < 4 && name != order[i]) ++i;
    if (i == 4)
      return ffi::Unexpected<ffi::Error>(invalid(
          target, "extras=\"" + std::string(name) +
                      "\" is unknown, repeated or out of order (allowed, in this order: alibi,bias,mask,segment_ids)"));
    *flags[i] = true;
    next = i + 1;
    if (comma == std::string_view::npos) break;
    text.remove_prefix(comma + 1);
    if (text.empty()) return ffi::Unexpected<ffi::Error>(invalid(target, "extras ends with a comma"));
  }
  return n;
}

inline const char* dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "f32";
    case ffi::DataType::BF16: return "bf16";
    case ffi::DataType::F16: return "f16";
    case ffi::DataType::PRED: return "i1";
    case ffi::DataType::S32: return "i32";
    default: return "an unsupported type";
  }
}

// Strides of a [1|B, 1|H, Sq, Sk] operand (0 on broadcast dims), or an error. With
// `stride_q` (the bias) the query dim may broadcast too: [1|B, 1|H, 1|Sq, Sk].
inline ffi::Error broadcast_strides(const char* target, const char* name, Dims d, const AttentionShape& s,
                                   int64_t* stride_b, int64_t* stride_h, int64_t* stride_q = nullptr) {
  const bool q_ok = d.size() == 4 && (d[2] == s.seqlen_q || (stride_q != nullptr && d[2] == 1));
  if (d.size() != 4 || (d[0] != 1 && d[0] != s.batch) || (d[1] != 1 && d[1] != s.heads_q) || !q_ok ||
      d[3] != s.seqlen_k)
    return invalid(target, std::string(name) + " has shape " + dims_str(d) + ", expected [1|" +
                               std::to_string(s.batch) + ", 1|" + std::to_string(s.heads_q) + ", " +
                               (stride_q != nullptr ? "1|" : "") + std::to_string(s.seqlen_q) + ", " +
                               std::to_string(s.seqlen_k) + "]");
  if (stride_q != nullptr) *stride_q = d[2] == 1 ? 0 : s.seqlen_k;
  *stride_h = d[1] == 1 ? 0 : d[2] * s.seqlen_k;
  *stride_b = d[0] == 1 ? 0 : d[1] * d[2] * s.seqlen_k;
  return ffi::Error::Success();
}

// Decodes the operands `extras` names from `args` (exactly those, in order) and
// checks their types and shapes. `dbias` (backward): the results after dq, dk, dv:
// with a bias, none (the bias is not differentiated: no dbias work) or one buffer
// like the bias; without, none. Null in the forward.
inline ffi::ErrorOr<ScoreExtras> decode_extras(const char* target, std::string_view extras,
                                               const ffi::RemainingArgs& args, const AttentionShape& s,
                                               ffi::DataType q_type, const ffi::RemainingRets* dbias) {
  auto fail = [&](const std::string& what) { return ffi::Unexpected<ffi::Error>(invalid(target, what)); };
  auto names = parse_extras(target, extras);
  if (names.has_error()) return ffi::Unexpected<ffi::Error>(names.error());
  const ExtraNames n = names.value();
  if (args.size() != n.operands())
    return fail("extras=\"" + std::string(extras) + "\" names " + std::to_string(n.operands()) +
                " extra operand(s) but the call passes " + std::to_string(args.size()));
  ScoreExtras x;
  size_t i = 0;
  auto next = [&](const char* name, ffi::DataType want, ffi::DataType alt) -> ffi::ErrorOr<ffi::AnyBuffer> {
    auto b = args.get<ffi::AnyBuffer>(i++);
    if (b.has_error()) return ffi::Unexpected<ffi::Error>(invalid(target, std::string(name) + " is not a buffer"));
    const ffi::DataType t = b.value().element_type();
    if (t != want && t != alt)
      return ffi::Unexpected<ffi::Error>(invalid(target, std::string(name) + " must be " + dtype_name(want) +
                                                             (alt != want ? std::string(" or ") + dtype_name(alt) : "") +
                                                             ", got " + dtype_name(t)));
    return b.value();
  };
  if (n.alibi) {
    auto b = next("alibi_slopes", ffi::DataType::F32, ffi::DataType::F32);
    if (b.has_error()) return ffi::Unexpected<ffi::Error>(b.error());
    Dims d = b.value().dimensions();
    if (!((d.size() == 1 && d[0] == s.heads_q) || (d.size() == 2 && d[0] == s.batch && d[1] == s.heads_q)))
      return fail("alibi_slopes has shape " + dims_str(d) + ", expected [" + std::to_string(s.heads_q) + "] or [" +
                  std::to_string(s.batch) + ", " + std::to_string(s.heads_q) + "]");
    x.alibi = static_cast<const float*>(b.value().untyped_data());
    x.alibi_stride_b = d.size() == 2 ? s.heads_q : 0;
  }
  ffi::DataType bias_type = ffi::DataType::F32;
  Dims bias_dims;
  if (n.bias) {
    auto b = next("bias", ffi::DataType::F32, q_type);
    if (b.has_error()) return ffi::Unexpected<ffi::Error>(b.error());
    bias_dims = b.value().dimensions();
    if (auto e = broadcast_strides(target, "bias", bias_dims, s, &x.bias_stride_b, &x.bias_stride_h,
                                   &x.bias_stride_q); e.failure())
      return ffi::Unexpected<ffi::Error>(e);
    bias_type = b.value().element_type();
    x.bias = b.value().untyped_data();
    x.bias_type = bias_type == ffi::DataType::F32 ? ElemType::F32
                  : bias_type == ffi::DataType::BF16 ? ElemType::BF16 : ElemType::F16;
  }
  if (n.mask) {
    auto b = next("mask", ffi::DataType::PRED, ffi::DataType::PRED);
    if (b.has_error()) return ffi::Unexpected<ffi::Error>(b.error());
    if (auto e = broadcast_strides(target, "mask", b.value().dimensions(), s, &x.mask_stride_b, &x.mask_stride_h);
        e.failure())
      return ffi::Unexpected<ffi::Error>(e);
    x.mask = static_cast<const bool*>(b.value().untyped_data());
  }
  if (n.segment_ids) {
    auto bq = next("q_segment_ids", ffi::DataType::S32, ffi::DataType::S32);
    if (bq.has_error()) return ffi::Unexpected<ffi::Error>(bq.error());
    auto bk = next("kv_segment_ids", ffi::DataType::S32, ffi::DataType::S32);
    if (bk.has_error()) return ffi::Unexpected<ffi::Error>(bk.error());
    if (auto e = expect_dims(target, "q_segment_ids", bq.value().dimensions(), {s.batch, s.seqlen_q}); e.failure())
      return ffi::Unexpected<ffi::Error>(e);
    if (auto e = expect_dims(target, "kv_segment_ids", bk.value().dimensions(), {s.batch, s.seqlen_k}); e.failure())
      return ffi::Unexpected<ffi::Error>(e);
    x.q_segment_ids = static_cast<const int32_t*>(bq.value().untyped_data());
    x.kv_segment_ids = static_cast<const int32_t*>(bk.value().untyped_data());
  }
  if (dbias != nullptr) {
    if (dbias->size() > (n.bias ? 1u : 0u))
      return fail(std::string("the backward returns dq, dk, dv") + (n.bias ? " and optionally dbias" : "") +
                  " but the call has " + std::to_string(3 + dbias->size()) + " results");
    if (n.bias && dbias->size() == 1) {
      auto r = dbias->get<ffi::AnyBuffer>(0);
      if (r.has_error()) return fail("dbias is not a buffer");
      ffi::AnyBuffer db = *r.value();
      if (db.element_type() != bias_type)
        return fail(std::string("dbias must have the bias's type ") + dtype_name(bias_type) + ", got " +
                    dtype_name(db.element_type()));
      Dims d = db.dimensions();
      if (d.size() != 4 || d[0] != bias_dims[0] || d[1] != bias_dims[1] || d[2] != bias_dims[2] ||
          d[3] != bias_dims[3])
        return fail("dbias has shape " + dims_str(d) + ", expected the bias's " + dims_str(bias_dims));
      x.dbias = db.untyped_data();
    }
  }
  return x;
}

// The `extras` of the varlen and paged targets: "" or "alibi" only (slopes f32
// [Hq] or [B, Hq]); s.batch is the number of sequences (varlen) or q's batch.
inline ffi::ErrorOr<ScoreExtras> decode_packed_extras(const char* target, std::string_view extras,
                                                      const ffi::RemainingArgs& args, const AttentionShape& s,
                                                      ffi::DataType q_type) {
  if (!extras.empty() && extras != "alibi")
    return ffi::Unexpected<ffi::Error>(
        invalid(target, "varlen/paged calls take only the alibi extra, got extras=\"" + std::string(extras) + "\""));
  return decode_extras(target, extras, args, s, q_type, nullptr);
}

// Checks the varlen operands' shapes (not their contents: on a GPU they live in
// device memory; the CPU handler also checks the values, check_cu_seqlens).
inline ffi::Error check_varlen_dims(const char* target, Dims cu_q, Dims cu_k, int64_t* batch) {
  if (cu_q.size() != 1 || cu_q[0] < 1)
    return invalid(target, "cu_seqlens_q must be rank 1 [batch + 1], got " + dims_str(cu_q));
  if (auto e = expect_dims(target, "cu_seqlens_k", cu_k, {cu_q[0]}); e.failure()) return e;
  *batch = cu_q[0] - 1;
  return ffi::Error::Success();
}

// Shapes of the varlen operands: rank-3 packed operands q [Tq, Hq, D], k / v [Tk, Hkv, D] and cu_seqlens [B + 1].
inline ffi::ErrorOr<AttentionShape> varlen_shape(const char* target, int64_t head_dim, Dims q, Dims k, Dims v,
                                                 Dims cu_q, Dims cu_k) {
  auto fail = [&](const std::string& what) { return ffi::Unexpected<ffi::Error>(invalid(target, what)); };
  const char* names[3] = {"q", "k", "v"};
  Dims all[3] = {q, k, v};
  for (int i = 0; i < 3; ++i) {
    if (all[i].size() != 3)
      return fail(std::string(names[i]) + " must be rank 3 [total_tokens, heads, head_dim], got " +
                  dims_str(all[i]));
    if (all[i][2] != head_dim)
      return fail(std::string(names[i]) + " head_dim is " + std::to_string(all[i][2]) +
                  " but this kernel is specialized for " + std::to_string(head_dim));
  }
  if (v[0] != k[0] || v[1] != k[1]) return fail("k and v shapes differ: k " + dims_str(k) + ", v " + dims_str(v));
  if (k[1] <= 0 || q[1] % k[1] != 0)
    return fail("kv heads (" + std::to_string(k[1]) + ") must divide q heads (" + std::to_string(q[1]) + ")");
  int64_t batch = 0;
  if (auto e = check_varlen_dims(target, cu_q, cu_k, &batch); e.failure()) return ffi::Unexpected<ffi::Error>(e);
  return AttentionShape{batch, q[0], k[0], q[1], k[1], head_dim};
}

// Host-side check of cu_seqlens values: cu[0] == 0, non-decreasing, cu[B] <= total,
// each length <= max_len.
inline ffi::Error check_cu_seqlens(const char* target, const char* name, const int32_t* cu, int64_t batch,
                                   int64_t total, int32_t max_len) {
  if (cu[0] != 0) return invalid(target, std::string(name) + "[0] must be 0, got " + std::to_string(cu[0]));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = int64_t(cu[b + 1]) - cu[b];
    if (len < 0)
      return invalid(target, std::string(name) + " decreases at index " + std::to_string(b + 1));
    if (len > max_len)
      return invalid(target, std::string("sequence ") + std::to_string(b) + " has length " + std::to_string(len) +
                                 " > max_seqlen (" + std::to_string(max_len) + ") given for " + name);
  }
  if (cu[batch] > total)
    return invalid(target, std::string(name) + "[-1] = " + std::to_string(cu[batch]) + " exceeds the " +
                               std::to_string(total) + " rows passed");
  return ffi::Error::Success();
}

// FLASHGEN_POISON=1 makes handlers fill every output with NaN bytes (0xFF) before
// the kernels run, so a test catches any element a kernel forgets to write;
// FLASHGEN_POISON=finite fills 0x7B bytes (about 1.3e36 in f32, bf16 and f16 alike:
// finite), for tests whose expected outputs are NaN.
inline int poison_byte() {
  static const int byte = [] {
    const char* v = std::getenv("FLASHGEN_POISON");
    if (v == nullptr || v[0] == '\0' || v[0] == '0') return 0;
    return std::string_view(v) == "finite" ? 0x7B : 0xFF;
  }();
  return byte;
}
inline bool poison_outputs() { return poison_byte() != 0; }

}  // namespace flashgen
