// Validation shared by every flashgen FFI handler. A handler must never trust
// the shapes it is handed: a hand-written module can call any target with any
// buffers, and the answer to a mismatch is an ffi::Error, never a crash.
#pragma once
#include <cstdlib>
#include <initializer_list>
#include <string>

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

// Reads B, Sq, Sk, Hq, Hkv from q/k/v and checks everything the kernel relies on.
inline ffi::ErrorOr<AttentionShape> shape_from_qkv(const char* target, int64_t head_dim,
                                                   Dims q, Dims k, Dims v) {
  auto fail = [&](const std::string& what) { return ffi::Unexpected<ffi::Error>(invalid(target, what)); };
  const char* names[3] = {"q", "k", "v"};
  Dims all[3] = {q, k, v};
  for (int i = 0; i < 3; ++i) {
    if (all[i].size() != 4)
      return fail(std::string(names[i]) + " must be rank 4 [batch, seq, heads, head_dim], got " +
                  dims_str(all[i]));
    if (all[i][3] != head_dim)
      return fail(std::string(names[i]) + " head_dim is " + std::to_string(all[i][3]) +
                  " but this kernel is specialized for " + std::to_string(head_dim));
  }
  if (k[0] != q[0] || v[0] != q[0])
    return fail("batch sizes differ: q " + dims_str(q) + ", k " + dims_str(k) + ", v " + dims_str(v));
  if (v[1] != k[1] || v[2] != k[2]) return fail("k and v shapes differ: k " + dims_str(k) + ", v " + dims_str(v));
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

inline ffi::Error check_attrs(const char* target, bool spec_causal, const AttentionAttrs& a) {
  if (a.causal != spec_causal)
    return invalid(target, std::string("attribute causal=") + (a.causal ? "true" : "false") +
                               " does not match this kernel (causal=" + (spec_causal ? "true" : "false") + ")");
  if (!(a.scale > 0.0f) || a.scale != a.scale || a.scale == 1.0f / 0.0f)
    return invalid(target, "scale must be a finite positive f32, got " + std::to_string(a.scale));
  if (a.window_left < -1 || a.window_right < -1)
    return invalid(target, "window_left / window_right must be >= -1 (-1 = unbounded), got (" +
                               std::to_string(a.window_left) + ", " + std::to_string(a.window_right) + ")");
  if (!(a.softcap >= 0.0f) || a.softcap == 1.0f / 0.0f)
    return invalid(target, "softcap must be a finite f32 >= 0 (0 = off), got " + std::to_string(a.softcap));
  if (a.bottom_right && !a.causal && a.window_left < 0 && a.window_right < 0)
    return invalid(target, "bottom_right=true needs causal=true or a sliding window");
  return ffi::Error::Success();
}

// Everything a backward call must agree on, given the forward shape.
inline ffi::Error check_bwd_operands(const char* target, const AttentionShape& s, Dims o, Dims lse,
                                     Dims dout) {
  if (auto e = expect_dims(target, "o", o, {s.batch, s.seqlen_q, s.heads_q, s.head_dim}); e.failure()) return e;
  if (auto e = expect_dims(target, "lse", lse, {s.batch, s.heads_q, s.seqlen_q}); e.failure()) return e;
  return expect_dims(target, "do", dout, {s.batch, s.seqlen_q, s.heads_q, s.head_dim});
}

// FLASHGEN_POISON=1 makes handlers fill every output with NaN bytes (0xFF) before
// the kernels run, so a test catches any element a kernel forgets to write.
inline bool poison_outputs() {
  static const bool on = [] {
    const char* v = std::getenv("FLASHGEN_POISON");
    return v != nullptr && v[0] != '\0' && v[0] != '0';
  }();
  return on;
}

}  // namespace flashgen
