// The BEAM face of a generated flashgen library (`flashgen build --for nif`):
// erl_nif functions that call the library's own XLA FFI handlers -- the same
// kernels, checks and call contract as under XLA -- through host_call.h's frame.
//
// call(Target, Args, Results, Attrs) -> {ok, [binary()]} | {error, binary()}
//   Target  <<"flashgen_fwd_d64_f32">>, one of targets()
//   Args    [{Type, Shape, binary()}]   operands in the target's order (README)
//   Results [{Type, Shape}]             results to allocate
//   Attrs   #{atom() => term()}         exactly the target's attributes
//   Type    f32 | bf16 | f16 | i32 | pred; Shape a tuple of non-negative integers
// Every term is checked here (types, ranks, sizes against the binaries, the
// attribute set and each value's range) before the handler runs; the handler
// then checks shapes and values as it does under XLA. Any problem is
// {error, Message}, never an exception or a crash.
//
// Scheduling: a dense forward or backward call whose work (B*Sq*Sk*Hq*D, twice
// that for a backward) is at most Contract::inline_work -- about 100 us of
// kernel on one core -- runs on the calling process's normal scheduler, as the
// BEAM's guidelines allow a NIF of well under 1 ms; any other call is handed to
// a dirty CPU scheduler (enif_schedule_nif), so a long call never blocks the
// normal schedulers (the ones a 60 FPS loop's processes run on). The kernels
// run inline on the thread that runs the call (Threads = 1, the default) or on
// the kernels' own pool of one thread per CPU (Threads = 0).
#pragma once
#include <erl_nif.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "flashgen/host_call.h"
#include "flashgen/library.h"

struct XLA_FFI_ExecutionContext {
  int64_t threads;  // what the thread pool reports: 1 = inline, 0 = no pool (the kernels' own)
};

namespace flashgen::nif {

// Rendered from flashgen.contract (CALLS, ATTRIBUTES, EXTRAS) by templates/common/nif_face.cc.j2.
struct AttrSpec {
  const char* name;
  XLA_FFI_DataType type;  // PRED, S32, F32; INVALID = string
};
struct Direction {
  const char* name;  // "fwd", "bwd", ...
  const AttrSpec* attrs;
  size_t num_attrs;
};
struct Extra {
  const char* name;
  const char* const* operands;
  size_t num_operands;
};
struct Contract {
  const Direction* directions;
  size_t num_directions;
  const Extra* extras;
  size_t num_extras;
  uint64_t inline_work;  // the most work a call may do on a normal scheduler (see above)
};

constexpr int kMaxRank = 8;
constexpr unsigned kMaxBuffers = 16;

struct TypeName {
  const char* name;
  XLA_FFI_DataType type;
  size_t bytes;
};
constexpr TypeName kTypes[] = {{"f32", XLA_FFI_DataType_F32, 4},
                               {"bf16", XLA_FFI_DataType_BF16, 2},
                               {"f16", XLA_FFI_DataType_F16, 2},
                               {"i32", XLA_FFI_DataType_S32, 4},
                               {"pred", XLA_FFI_DataType_PRED, 1}};

inline const char* attr_type_name(XLA_FFI_DataType t) {
  return t == XLA_FFI_DataType_PRED ? "i1" : t == XLA_FFI_DataType_S32 ? "i32" : t == XLA_FFI_DataType_F32 ? "f32"
                                                                                                          : "string";
}

inline ERL_NIF_TERM binary_term(ErlNifEnv* env, std::string_view text) {
  ERL_NIF_TERM t;
  unsigned char* p = enif_make_new_binary(env, text.size(), &t);
  if (!text.empty()) std::memcpy(p, text.data(), text.size());
  return t;
}

// {error, Message}, on one line (the FFI's decoding errors come with a "Diagnostics:" line).
inline ERL_NIF_TERM error(ErlNifEnv* env, std::string message) {
  for (size_t at; (at = message.find('\n')) != std::string::npos;) message.replace(at, 1, "; ");
  return enif_make_tuple2(env, enif_make_atom(env, "error"), binary_term(env, message));
}

inline std::string term_text(ERL_NIF_TERM t) {
  char buf[96];
  const int n = enif_snprintf(buf, sizeof(buf), "%T", t);
  std::string s(buf, n > 0 ? std::min<size_t>(size_t(n), sizeof(buf) - 1) : 0);
  return n >= int(sizeof(buf)) ? s + "..." : s;
}

// One operand or result: its type, shape and byte count, checked.
struct Shaped {
  XLA_FFI_DataType type;
  size_t elem_bytes;
  int64_t rank;
  int64_t dims[kMaxRank];
  size_t bytes;
};

// Decodes {Type, Shape} from the first two elements of `elems`; "" or what is wrong.
inline std::string decode_shaped(ErlNifEnv* env, const ERL_NIF_TERM* elems, Shaped* out) {
  char atom[16];
  const TypeName* tn = nullptr;
  if (enif_get_atom(env, elems[0], atom, sizeof(atom), ERL_NIF_LATIN1) > 0)
    for (const TypeName& t : kTypes)
      if (std::strcmp(atom, t.name) == 0) tn = &t;
  if (tn == nullptr) return "type " + term_text(elems[0]) + " is not one of f32, bf16, f16, i32, pred";
  int arity = 0;
  const ERL_NIF_TERM* dims;
  if (!enif_get_tuple(env, elems[1], &arity, &dims) || arity > kMaxRank)
    return "shape " + term_text(elems[1]) + " is not a tuple of at most " + std::to_string(kMaxRank) +
           " non-negative integers";
  size_t elements = 1;
  for (int i = 0; i < arity; ++i) {
    ErlNifSInt64 d;
    if (!enif_get_int64(env, dims[i], &d) || d < 0)
      return "shape " + term_text(elems[1]) + " has a dimension that is not a non-negative integer";
    if (__builtin_mul_overflow(elements, uint64_t(d), &elements))
      return "shape " + term_text(elems[1]) + " has more elements than memory can hold";
    out->dims[i] = d;
  }
  if (__builtin_mul_overflow(elements, tn->bytes, &out->bytes) ||
      out->bytes > size_t(std::numeric_limits<int64_t>::max()))
    return "shape " + term_text(elems[1]) + " has more elements than memory can hold";
  out->type = tn->type;
  out->elem_bytes = tn->bytes;
  out->rank = arity;
  return "";
}

// Everything one handler call needs, decoded from the terms and owned here.
struct DecodedCall {
  const HandlerEntry* handler = nullptr;
  std::vector<Shaped> args, rets;
  std::vector<host::Buffer> arg_bufs, ret_bufs;
  std::vector<std::vector<unsigned char>> realigned;  // copies of operands not aligned to their element size
  std::vector<host::Attr> attrs;
  std::vector<ErlNifBinary> results;  // allocated; released unless handed to the caller
  int64_t threads = 1;

  ~DecodedCall() {
    for (ErlNifBinary& b : results) enif_release_binary(&b);
  }
};

inline const Direction* direction_of(const Contract& c, std::string_view target) {
  for (size_t i = 0; i < c.num_directions; ++i) {
    const std::string prefix = std::string("flashgen_") + c.directions[i].name + "_d";
    if (target.substr(0, prefix.size()) == prefix) return &c.directions[i];
  }
  return nullptr;
}

inline std::string decode_target(ErlNifEnv* env, ERL_NIF_TERM term, DecodedCall* call) {
  ErlNifBinary name;
  if (!enif_inspect_binary(env, term, &name)) return "the target must be a binary, got " + term_text(term);
  size_t n = 0;
  const HandlerEntry* table = flashgen_handlers(&n);
  const std::string_view want(reinterpret_cast<const char*>(name.data), name.size);
  for (size_t i = 0; i < n; ++i)
    if (want == table[i].name) call->handler = &table[i];
  if (call->handler != nullptr) return "";
  std::string have;
  for (size_t i = 0; i < n; ++i) have += std::string(i ? ", " : "") + table[i].name;
  return "unknown target \"" + std::string(want.substr(0, 80)) + "\"; this library has " + have;
}

// Calls each(i, elements) on every element of `list`, each a tuple of `arity` terms written
// `form`; "" or what is wrong with the first bad one ("operand 2: ...").
template <typename Each>
std::string decode_tuples(ErlNifEnv* env, ERL_NIF_TERM list, const char* what, int arity, const char* form,
                          Each each) {
  unsigned len;
  if (!enif_get_list_length(env, list, &len) || len > kMaxBuffers)
    return std::string(what) + "s must be a list of at most " + std::to_string(kMaxBuffers) + " " + form +
           " tuples, got " + term_text(list);
  ERL_NIF_TERM head, tail = list;
  for (unsigned i = 0; enif_get_list_cell(env, tail, &head, &tail); ++i) {
    int n;
    const ERL_NIF_TERM* e;
    std::string why = !enif_get_tuple(env, head, &n, &e) || n != arity
                          ? std::string("expected ") + form + ", got " + term_text(head)
                          : each(i, e);
    if (!why.empty()) return std::string(what) + " " + std::to_string(i) + ": " + why;
  }
  return "";
}

inline std::string decode_args(ErlNifEnv* env, ERL_NIF_TERM list, DecodedCall* call) {
  unsigned len = 0;
  enif_get_list_length(env, list, &len);
  call->args.resize(std::min(len, kMaxBuffers));
  call->arg_bufs.resize(call->args.size());
  return decode_tuples(env, list, "operand", 3, "{Type, Shape, Binary}", [&](unsigned i, const ERL_NIF_TERM* e) {
    Shaped& s = call->args[i];
    if (std::string why = decode_shaped(env, e, &s); !why.empty()) return why;
    ErlNifBinary bin;
    if (!enif_inspect_binary(env, e[2], &bin)) return "data must be a binary, got " + term_text(e[2]);
    if (bin.size != s.bytes)
      return "the binary has " + std::to_string(bin.size) + " bytes but shape " + term_text(e[1]) + " of " +
             term_text(e[0]) + " needs " + std::to_string(s.bytes);
    void* data = bin.data;
    if (reinterpret_cast<uintptr_t>(data) % s.elem_bytes != 0) {  // a sub-binary at an odd offset
      call->realigned.emplace_back(bin.data, bin.data + bin.size);
      data = call->realigned.back().data();
    }
    call->arg_bufs[i] = host::Buffer{s.type, data, s.rank, s.dims};
    return std::string();
  });
}

inline std::string decode_rets(ErlNifEnv* env, ERL_NIF_TERM list, DecodedCall* call) {
  unsigned len = 0;
  enif_get_list_length(env, list, &len);
  call->rets.resize(std::min(len, kMaxBuffers));
  return decode_tuples(env, list, "result", 2, "{Type, Shape}", [&](unsigned i, const ERL_NIF_TERM* e) {
    return decode_shaped(env, e, &call->rets[i]);
  });
}

// Exactly the attributes of the target's direction, each of its type.
inline std::string decode_attrs(ErlNifEnv* env, ERL_NIF_TERM map, const Direction& dir, DecodedCall* call) {
  size_t size;
  if (!enif_get_map_size(env, map, &size)) return "attributes must be a map, got " + term_text(map);
  auto names = [&] {
    std::string s;
    for (size_t i = 0; i < dir.num_attrs; ++i)
      s += std::string(i ? ", " : "") + dir.attrs[i].name + " (" + attr_type_name(dir.attrs[i].type) + ")";
    return s;
  };
  for (size_t i = 0; i < dir.num_attrs; ++i) {
    const AttrSpec& spec = dir.attrs[i];
    ERL_NIF_TERM v;
    if (!enif_get_map_value(env, map, enif_make_atom(env, spec.name), &v))
      return "attribute " + std::string(spec.name) + " is missing; " + dir.name + " takes " + names();
    host::Attr a;
    a.name = spec.name;
    a.type = spec.type;
    auto bad = [&](const char* what) {
      return "attribute " + std::string(spec.name) + " must be " + attr_type_name(spec.type) + " (" + what +
             "), got " + term_text(v);
    };
    if (spec.type == XLA_FFI_DataType_PRED) {
      if (enif_is_identical(v, enif_make_atom(env, "true")))
        a.i32 = 1;
      else if (!enif_is_identical(v, enif_make_atom(env, "false")))
        return bad("true or false");
    } else if (spec.type == XLA_FFI_DataType_S32) {
      int value;
      if (!enif_get_int(env, v, &value)) return bad("an integer in the int32 range");
      a.i32 = value;
    } else if (spec.type == XLA_FFI_DataType_F32) {
      double d;
      ErlNifSInt64 i;
      if (enif_get_double(env, v, &d)) {
      } else if (enif_get_int64(env, v, &i)) {
        d = double(i);
      } else {
        return bad("a number");
      }
      if (std::fabs(d) > double(std::numeric_limits<float>::max())) return bad("a number within the f32 range");
      a.f32 = float(d);
    } else {
      ErlNifBinary text;
      if (!enif_inspect_binary(env, v, &text)) return bad("a binary");
      a.str = std::string_view(reinterpret_cast<const char*>(text.data), text.size);
    }
    call->attrs.push_back(a);
  }
  if (size != dir.num_attrs) return "attributes have keys that " + std::string(dir.name) + " does not take; it takes " + names();
  return "";
}

// The decoded call, or the reason it cannot be made.
inline std::string decode_call(ErlNifEnv* env, const Contract& c, const ERL_NIF_TERM argv[], DecodedCall* call) {
  if (std::string why = decode_target(env, argv[0], call); !why.empty()) return why;
  const Direction* dir = direction_of(c, call->handler->name);
  if (dir == nullptr) return std::string("no attribute table for ") + call->handler->name;
  std::string why = decode_args(env, argv[1], call);
  if (why.empty()) why = decode_rets(env, argv[2], call);
  if (why.empty()) why = decode_attrs(env, argv[3], *dir, call);
  if (!why.empty()) return std::string(call->handler->name) + ": " + why;
  call->results.reserve(call->rets.size());
  call->ret_bufs.reserve(call->rets.size());
  for (Shaped& s : call->rets) {
    ErlNifBinary b;
    if (!enif_alloc_binary(s.bytes, &b))
      return std::string(call->handler->name) + ": cannot allocate " + std::to_string(s.bytes) +
             " bytes for result " + std::to_string(call->results.size());
    call->results.push_back(b);
    call->ret_bufs.push_back(host::Buffer{s.type, b.data, s.rank, s.dims});
  }
  return "";
}

inline const XLA_FFI_Api* api() {
  static const XLA_FFI_Api a = [] {
    XLA_FFI_Api x = host::base_api();
    x.XLA_FFI_ThreadPool_NumThreads = [](XLA_FFI_ThreadPool_NumThreads_Args* args) -> XLA_FFI_Error* {
      *args->num_threads = args->ctx->threads;
      return nullptr;
    };
    return x;
  }();
  return &a;
}

// Runs the decoded call's handler; "" or the handler's error.
inline std::string run(DecodedCall& call) {
  XLA_FFI_ExecutionContext ctx{call.threads};
  host::CallFrame frame(api(), &ctx, call.arg_bufs.data(), int64_t(call.arg_bufs.size()), call.ret_bufs.data(),
                        int64_t(call.ret_bufs.size()), call.attrs.data(), int64_t(call.attrs.size()));
  std::string message;
  if (host::call(call.handler->handler, frame, &message) != XLA_FFI_Error_Code_OK) return message;
  return "";
}

inline ERL_NIF_TERM call_nif(ErlNifEnv* env, const Contract& c, const ERL_NIF_TERM argv[], int64_t threads) {
  try {
    DecodedCall call;
    call.threads = threads;
    if (std::string why = decode_call(env, c, argv, &call); !why.empty()) return error(env, why);
    if (std::string why = run(call); !why.empty()) return error(env, why);
    ERL_NIF_TERM list = enif_make_list(env, 0);
    for (size_t i = call.results.size(); i-- > 0;) list = enif_make_list_cell(env, enif_make_binary(env, &call.results[i]), list);
    call.results.clear();  // owned by the terms now
    return enif_make_tuple2(env, enif_make_atom(env, "ok"), list);
  } catch (const std::exception& e) {
    return error(env, std::string("flashgen NIF: ") + e.what());
  }
}

// The call's threads: 1 (call/4) or call/5's last argument; -1 when that is not 0 or 1.
inline int64_t threads_of(ErlNifEnv* env, int argc, const ERL_NIF_TERM argv[]) {
  int threads = 1;
  if (argc == 5 && (!enif_get_int(env, argv[4], &threads) || (threads != 0 && threads != 1))) return -1;
  return threads;
}

// The work of a dense forward / backward call from its first two operands' shapes, without
// decoding the call; UINT64_MAX when it is another kind of call or the terms are not as expected.
inline uint64_t work_of(ErlNifEnv* env, const ERL_NIF_TERM argv[]) {
  constexpr uint64_t unknown = std::numeric_limits<uint64_t>::max();
  ErlNifBinary name;
  if (!enif_inspect_binary(env, argv[0], &name)) return unknown;
  const std::string_view target(reinterpret_cast<const char*>(name.data), name.size);
  const uint64_t per_pair = target.rfind("flashgen_fwd_d", 0) == 0 ? 1 : target.rfind("flashgen_bwd_d", 0) == 0 ? 2 : 0;
  ERL_NIF_TERM q, k, rest;
  int n;
  const ERL_NIF_TERM *qt, *kt, *qd, *kd;
  if (per_pair == 0 || !enif_get_list_cell(env, argv[1], &q, &rest) || !enif_get_list_cell(env, rest, &k, &rest) ||
      !enif_get_tuple(env, q, &n, &qt) || n != 3 || !enif_get_tuple(env, k, &n, &kt) || n != 3 ||
      !enif_get_tuple(env, qt[1], &n, &qd) || n != 4 || !enif_get_tuple(env, kt[1], &n, &kd) || n != 4)
    return unknown;
  uint64_t work = per_pair;
  for (const ERL_NIF_TERM d : {qd[0], qd[1], qd[2], qd[3], kd[1]}) {
    ErlNifUInt64 x;
    if (!enif_get_uint64(env, d, &x) || __builtin_mul_overflow(work, x, &work)) return unknown;
  }
  return work;
}

template <const Contract& C>
ERL_NIF_TERM call_dirty(ErlNifEnv* env, int argc, const ERL_NIF_TERM argv[]) {
  return call_nif(env, C, argv, threads_of(env, argc, argv));
}

// call(Target, Args, Results, Attrs[, Threads]): Threads = 1 inline (the default), 0 = one
// worker per CPU; on this normal scheduler when the work is small, else on a dirty one.
template <const Contract& C>
ERL_NIF_TERM call(ErlNifEnv* env, int argc, const ERL_NIF_TERM argv[]) {
  const int64_t threads = threads_of(env, argc, argv);
  if (threads < 0)
    return error(env, "threads must be 1 (inline) or 0 (one worker per CPU), got " + term_text(argv[4]));
  if (work_of(env, argv) <= C.inline_work) return call_nif(env, C, argv, threads);
  return enif_schedule_nif(env, "call", ERL_NIF_DIRTY_JOB_CPU_BOUND, call_dirty<C>, argc, argv);
}

// time_in_c(Target, Args, Results, Attrs, N) -> {ok, [Nanoseconds]}: N calls of the handler
// from C on one decoded call (no term decoding, no allocation, no scheduling): the kernel's
// own time, against which call/4's time from Elixir measures the NIF boundary.
template <const Contract& C>
ERL_NIF_TERM time_in_c(ErlNifEnv* env, int, const ERL_NIF_TERM argv[]) {
  int n;
  if (!enif_get_int(env, argv[4], &n) || n < 1 || n > 1000000)
    return error(env, "the call count must be an integer in [1, 1000000], got " + term_text(argv[4]));
  try {
    DecodedCall call;
    if (std::string why = decode_call(env, C, argv, &call); !why.empty()) return error(env, why);
    XLA_FFI_ExecutionContext ctx{1};
    host::CallFrame frame(api(), &ctx, call.arg_bufs.data(), int64_t(call.arg_bufs.size()), call.ret_bufs.data(),
                          int64_t(call.ret_bufs.size()), call.attrs.data(), int64_t(call.attrs.size()));
    std::vector<int64_t> ns(n);
    std::string message;
    for (int i = 0; i < n; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      if (host::call(call.handler->handler, frame, &message) != XLA_FFI_Error_Code_OK) return error(env, message);
      ns[i] = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    }
    ERL_NIF_TERM list = enif_make_list(env, 0);
    for (int i = n; i-- > 0;) list = enif_make_list_cell(env, enif_make_int64(env, ns[i]), list);
    return enif_make_tuple2(env, enif_make_atom(env, "ok"), list);
  } catch (const std::exception& e) {
    return error(env, std::string("flashgen NIF: ") + e.what());
  }
}

inline ERL_NIF_TERM string_list(ErlNifEnv* env, const char* const* items, size_t n) {
  ERL_NIF_TERM list = enif_make_list(env, 0);
  for (size_t i = n; i-- > 0;) list = enif_make_list_cell(env, binary_term(env, items[i]), list);
  return list;
}

// targets() -> [binary()]: the handlers this library has.
inline ERL_NIF_TERM targets(ErlNifEnv* env, int, const ERL_NIF_TERM[]) {
  size_t n = 0;
  const HandlerEntry* table = flashgen_handlers(&n);
  std::vector<const char*> names(n);
  for (size_t i = 0; i < n; ++i) names[i] = table[i].name;
  return string_list(env, names.data(), n);
}

// info() -> binary(): the library's JSON description (specs, attributes, target).
inline ERL_NIF_TERM info(ErlNifEnv* env, int, const ERL_NIF_TERM[]) {
  return binary_term(env, flashgen_library_info());
}

// contract() -> #{attributes => #{Direction => [{Name, Type}]}, extras => [{Name, [Operand]}],
// inline_work => integer()}: flashgen.contract's CALLS' attributes and EXTRAS, as this library was built
// with them, and the most work a call runs on a normal scheduler.
template <const Contract& C>
ERL_NIF_TERM contract(ErlNifEnv* env, int, const ERL_NIF_TERM[]) {
  ERL_NIF_TERM attrs = enif_make_new_map(env);
  for (size_t i = 0; i < C.num_directions; ++i) {
    const Direction& d = C.directions[i];
    ERL_NIF_TERM list = enif_make_list(env, 0);
    for (size_t j = d.num_attrs; j-- > 0;)
      list = enif_make_list_cell(env, enif_make_tuple2(env, binary_term(env, d.attrs[j].name),
                                                       binary_term(env, attr_type_name(d.attrs[j].type))), list);
    enif_make_map_put(env, attrs, binary_term(env, d.name), list, &attrs);
  }
  ERL_NIF_TERM extras = enif_make_list(env, 0);
  for (size_t i = C.num_extras; i-- > 0;) {
    const Extra& x = C.extras[i];
    extras = enif_make_list_cell(
        env, enif_make_tuple2(env, binary_term(env, x.name), string_list(env, x.operands, x.num_operands)), extras);
  }
  ERL_NIF_TERM out = enif_make_new_map(env);
  enif_make_map_put(env, out, enif_make_atom(env, "attributes"), attrs, &out);
  enif_make_map_put(env, out, enif_make_atom(env, "extras"), extras, &out);
  enif_make_map_put(env, out, enif_make_atom(env, "inline_work"), enif_make_uint64(env, C.inline_work), &out);
  return out;
}

}  // namespace flashgen::nif
