// A run of plain integer, f32 and predicate instructions (add ... setp, selp, mov, cvt between
// integers) over every lane of an emulator gang, one instruction after the other, part of the
// emulator's native module (emu_native.h; flashgen/emulate/semantics/alu.py encodes the run and
// says which forms it takes). Each form computes what the numpy handlers of semantics/arith.py
// and data.py compute, bit for bit (tests/test_emulator_native.py runs both on the same lanes):
// integers wrap at their width, shift amounts clamp to it, f32 add/sub/mul round once, fma is an
// exact double product plus the addend rounded once, .ftz flushes f32 subnormal inputs and
// results, ordered comparisons are false on NaN.
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <type_traits>
#include <vector>

#include "flashgen/emulate/native/emu_native.h"

#pragma GCC optimize("O3")  // the lane loops below are what vectorizes; -O2 leaves them scalar

namespace {

using Row = FlashgenEmuAluInstruction;

template <typename T>
inline T flush(T x) {  // .ftz on an f32 value (the sign kept); other types pass
  if constexpr (std::is_same_v<T, float>) return std::fabs(x) < 1.17549435e-38f ? x * 0.0f : x;
  return x;
}

// The executing lanes of a chunk as all-ones or all-zero elements of each width: a blend of whole
// elements vectorizes where a bool test per lane does not (5x slower).
struct Masks {
  uint8_t m8[256];
  uint32_t m32[256];
  uint64_t m64[256];
  void set(const bool* mask, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t all = mask[i] ? ~uint64_t(0) : 0;
      m8[i] = static_cast<uint8_t>(all), m32[i] = static_cast<uint32_t>(all), m64[i] = all;
    }
  }
  const uint8_t* of(uint8_t) const { return m8; }
  const uint32_t* of(uint32_t) const { return m32; }
  const uint64_t* of(uint64_t) const { return m64; }
};

template <size_t N> struct Bits;
template <> struct Bits<1> { using type = uint8_t; };
template <> struct Bits<4> { using type = uint32_t; };
template <> struct Bits<8> { using type = uint64_t; };

// d[i] = f(i) for the executing lanes (every lane when `masks` is null). f reads its sources at
// lane i only, so d may be one of them.
template <typename T, typename F>
inline void each(T* d, int64_t n, const Masks* masks, F f) {
  if (!masks) {
    for (int64_t i = 0; i < n; ++i) d[i] = f(i);
    return;
  }
  using B = typename Bits<sizeof(T)>::type;
  const B* m = masks->of(B());
  for (int64_t i = 0; i < n; ++i) {
    const T r = f(i);
    B rb, db;
    std::memcpy(&rb, &r, sizeof r);
    std::memcpy(&db, d + i, sizeof db);
    db = (rb & m[i]) | (db & ~m[i]);
    std::memcpy(d + i, &db, sizeof db);
  }
}

template <typename T>
struct Signed;
template <> struct Signed<uint32_t> { using type = int32_t; };
template <> struct Signed<uint64_t> { using type = int64_t; };

// add sub mul(.lo) mad(.lo) min max and or xor not neg shl shr on U (uint32_t / uint64_t bits),
// `is_signed` from the instruction type: the unsigned arithmetic wraps as numpy's does.
template <typename U>
void integer(const Row& r, void* const* p, int64_t n, const Masks* mask) {
  using S = typename Signed<U>::type;
  constexpr unsigned bits = 8 * sizeof(U);
  U* d = static_cast<U*>(p[0]);
  const U* a = static_cast<const U*>(p[1]);
  const U* b = static_cast<const U*>(p[2]);
  const U* c = static_cast<const U*>(p[3]);
  const bool s = r.is_signed;
  switch (r.op) {
    case kAluAdd: return each(d, n, mask, [&](int64_t i) { return U(a[i] + b[i]); });
    case kAluSub: return each(d, n, mask, [&](int64_t i) { return U(a[i] - b[i]); });
    case kAluMul: return each(d, n, mask, [&](int64_t i) { return U(a[i] * b[i]); });
    case kAluMad: return each(d, n, mask, [&](int64_t i) { return U(a[i] * b[i] + c[i]); });
    case kAluAnd: return each(d, n, mask, [&](int64_t i) { return U(a[i] & b[i]); });
    case kAluOr: return each(d, n, mask, [&](int64_t i) { return U(a[i] | b[i]); });
    case kAluXor: return each(d, n, mask, [&](int64_t i) { return U(a[i] ^ b[i]); });
    case kAluNot: return each(d, n, mask, [&](int64_t i) { return U(~a[i]); });
    case kAluNeg: return each(d, n, mask, [&](int64_t i) { return U(U(0) - a[i]); });
    case kAluMin:
      if (s) return each(d, n, mask, [&](int64_t i) { return S(a[i]) < S(b[i]) ? a[i] : b[i]; });
      return each(d, n, mask, [&](int64_t i) { return a[i] < b[i] ? a[i] : b[i]; });
    case kAluMax:
      if (s) return each(d, n, mask, [&](int64_t i) { return S(a[i]) > S(b[i]) ? a[i] : b[i]; });
      return each(d, n, mask, [&](int64_t i) { return a[i] > b[i] ? a[i] : b[i]; });
    case kAluShl: {  // amounts (u32) of the width or more give 0
      const uint32_t* k = static_cast<const uint32_t*>(p[2]);
      return each(d, n, mask, [&](int64_t i) { return k[i] >= bits ? U(0) : U(a[i] << k[i]); });
    }
    case kAluShr: {  // signed: arithmetic, the amount clamped to width - 1
      const uint32_t* k = static_cast<const uint32_t*>(p[2]);
      if (s) return each(d, n, mask, [&](int64_t i) { return U(S(a[i]) >> (k[i] >= bits ? bits - 1 : k[i])); });
      return each(d, n, mask, [&](int64_t i) { return k[i] >= bits ? U(0) : U(a[i] >> k[i]); });
    }
  }
}

// add sub mul fma min max neg on f32 (.rn; .ftz flushes inputs and the result)
template <bool Ftz>
void f32(const Row& r, void* const* p, int64_t n, const Masks* mask) {
  float* d = static_cast<float*>(p[0]);
  const float* a = static_cast<const float*>(p[1]);
  const float* b = static_cast<const float*>(p[2]);
  const float* c = static_cast<const float*>(p[3]);
  auto in = [](float x) { return Ftz ? flush(x) : x; };
  auto out = [](float x) { return Ftz ? flush(x) : x; };
  switch (r.op) {
    case kAluAdd: return each(d, n, mask, [&](int64_t i) { return out(in(a[i]) + in(b[i])); });
    case kAluSub: return each(d, n, mask, [&](int64_t i) { return out(in(a[i]) - in(b[i])); });
    case kAluMul: return each(d, n, mask, [&](int64_t i) { return out(in(a[i]) * in(b[i])); });
    case kAluMad:
      return each(d, n, mask, [&](int64_t i) {
        return out(float(double(in(a[i])) * double(in(b[i])) + double(in(c[i]))));
      });
    case kAluNeg: return each(d, n, mask, [&](int64_t i) { return -in(a[i]); });
    // PTX min/max return the non-NaN operand (NaN only when both are); -0 orders below +0
    case kAluMin:
      return each(d, n, mask, [&](int64_t i) {
        const float x = in(a[i]), y = in(b[i]);
        return std::isnan(x) ? y : std::isnan(y) ? x : (x < y || (x == y && std::signbit(x))) ? x : y;
      });
    case kAluMax:
      return each(d, n, mask, [&](int64_t i) {
        const float x = in(a[i]), y = in(b[i]);
        return std::isnan(x) ? y : std::isnan(y) ? x : (x > y || (x == y && !std::signbit(x))) ? x : y;
      });
  }
}

template <typename T>
bool compare(int64_t cmp, T x, T y) {
  switch (cmp) {
    case kCmpEq: return x == y;
    case kCmpNe: return x != y && x == x && y == y;  // ordered: false on NaN (integers: x != y)
    case kCmpLt: return x < y;
    case kCmpLe: return x <= y;
    case kCmpGt: return x > y;
    case kCmpGe: return x >= y;
    case kCmpEqu: return x == y || x != x || y != y;
    case kCmpNeu: return x != y;
    case kCmpLtu: return !(x >= y);
    case kCmpLeu: return !(x > y);
    case kCmpGtu: return !(x <= y);
    case kCmpGeu: return !(x < y);
    case kCmpNum: return x == x && y == y;
    case kCmpNan: return x != x || y != y;
  }
  return false;
}

// setp.cmp[.bool].T p[|q], a, b[, c]: p = t BOOL c, q = !t BOOL c (t and !t without .bool)
template <typename T>
void setp(const Row& r, void* const* p, int64_t n, const Masks* mask) {
  bool* pd = static_cast<bool*>(p[0]);
  bool* qd = static_cast<bool*>(p[4]);
  const T* a = static_cast<const T*>(p[1]);
  const T* b = static_cast<const T*>(p[2]);
  const bool* c = static_cast<const bool*>(p[3]);
  const int64_t cmp = r.aux;
  // (alu.py takes no setp whose p or q is also a source: the two writes' order does not matter)
  auto t = [&](int64_t i) {
    T x = a[i], y = b[i];
    if (r.ftz) x = flush(x), y = flush(y);
    return compare(cmp, x, y);
  };
  auto with = [&](bool v, int64_t i) {
    return r.boolop == kBoolAnd ? (v && c[i]) : r.boolop == kBoolOr ? (v || c[i]) : r.boolop == kBoolXor ? (v != c[i]) : v;
  };
  if (qd) each(qd, n, mask, [&](int64_t i) { return with(!t(i), i); });
  each(pd, n, mask, [&](int64_t i) { return with(t(i), i); });
}

template <typename T>
void move(const Row& r, void* const* p, int64_t n, const Masks* mask) {
  T* d = static_cast<T*>(p[0]);
  const T* a = static_cast<const T*>(p[1]);
  const T* b = static_cast<const T*>(p[2]);
  const bool* c = static_cast<const bool*>(p[3]);
  if (r.op == kAluSelp) return each(d, n, mask, [&](int64_t i) { return c[i] ? a[i] : b[i]; });
  each(d, n, mask, [&](int64_t i) { return a[i]; });
}

// cvt between integers (truncating, or extending by the source's signedness) and mul.wide
void widen(const Row& r, void* const* p, int64_t n, const Masks* mask) {
  const int64_t ds = r.sizes[0], ss = r.sizes[1];
  if (r.op == kAluMulWide) {
    uint64_t* d = static_cast<uint64_t*>(p[0]);
    const uint32_t* a = static_cast<const uint32_t*>(p[1]);
    const uint32_t* b = static_cast<const uint32_t*>(p[2]);
    if (r.is_signed) return each(d, n, mask, [&](int64_t i) { return uint64_t(int64_t(int32_t(a[i])) * int32_t(b[i])); });
    return each(d, n, mask, [&](int64_t i) { return uint64_t(a[i]) * b[i]; });
  }
  if (ds == 4 && ss == 8) {
    const uint64_t* a = static_cast<const uint64_t*>(p[1]);
    return each(static_cast<uint32_t*>(p[0]), n, mask, [&](int64_t i) { return uint32_t(a[i]); });
  }
  if (ds == 8 && ss == 4) {
    const uint32_t* a = static_cast<const uint32_t*>(p[1]);
    if (r.is_signed) return each(static_cast<uint64_t*>(p[0]), n, mask, [&](int64_t i) { return uint64_t(int64_t(int32_t(a[i]))); });
    return each(static_cast<uint64_t*>(p[0]), n, mask, [&](int64_t i) { return uint64_t(a[i]); });
  }
  if (ds == 4) return move<uint32_t>(r, p, n, mask);
  move<uint64_t>(r, p, n, mask);
}

void run(const Row& r, void* const* p, int64_t n, const Masks* mask) {
  switch (r.kind) {
    case kKindInt32: return integer<uint32_t>(r, p, n, mask);
    case kKindInt64: return integer<uint64_t>(r, p, n, mask);
    case kKindF32: return r.ftz ? f32<true>(r, p, n, mask) : f32<false>(r, p, n, mask);
    case kKindSetp32: return r.is_signed ? setp<int32_t>(r, p, n, mask) : setp<uint32_t>(r, p, n, mask);
    case kKindSetp64: return r.is_signed ? setp<int64_t>(r, p, n, mask) : setp<uint64_t>(r, p, n, mask);
    case kKindSetpF32: return setp<float>(r, p, n, mask);
    case kKindMove: return r.sizes[0] == 1 ? move<bool>(r, p, n, mask) : r.sizes[0] == 4 ? move<uint32_t>(r, p, n, mask)
                                                                                       : move<uint64_t>(r, p, n, mask);
    case kKindPred:
      return each(static_cast<bool*>(p[0]), n, mask, [&](int64_t i) {
        const bool x = static_cast<const bool*>(p[1])[i];
        if (r.op == kAluNot) return !x;
        const bool y = static_cast<const bool*>(p[2])[i];
        return r.op == kAluAnd ? (x && y) : r.op == kAluOr ? (x || y) : (x != y);
      });
    case kKindWiden: return widen(r, p, n, mask);
  }
}

// What row r's operands must be (sizes in bytes, 0: none; q of a setp may be 0 or 1), or null if
// its kind does not take its op: a row that asks for anything else is refused before any runs.
const char* expected(const Row& r, int64_t (&size)[5], bool& q_optional) {
  auto is = [&](std::initializer_list<int64_t> ops) { return std::find(ops.begin(), ops.end(), r.op) != ops.end(); };
  q_optional = false;
  std::fill_n(size, 5, 0);
  switch (r.kind) {
    case kKindInt32:
    case kKindInt64: {
      if (!is({kAluAdd, kAluSub, kAluMul, kAluMad, kAluMin, kAluMax, kAluAnd, kAluOr, kAluXor, kAluNot, kAluNeg, kAluShl,
               kAluShr}))
        return "an integer row's op";
      const int64_t s = r.kind == kKindInt32 ? 4 : 8;
      size[0] = size[1] = s;
      size[2] = is({kAluNot, kAluNeg}) ? 0 : is({kAluShl, kAluShr}) ? 4 : s;
      size[3] = r.op == kAluMad ? s : 0;
      return nullptr;
    }
    case kKindF32:
      if (!is({kAluAdd, kAluSub, kAluMul, kAluMad, kAluMin, kAluMax, kAluNeg})) return "an f32 row's op";
      size[0] = size[1] = 4, size[2] = r.op == kAluNeg ? 0 : 4, size[3] = r.op == kAluMad ? 4 : 0;
      return nullptr;
    case kKindSetp32:
    case kKindSetp64:
    case kKindSetpF32:
      if (r.op != kAluSetp || r.aux < kCmpEq || r.aux > kCmpNan || r.boolop < kBoolNone || r.boolop > kBoolXor)
        return "a setp row's op, comparison or boolean op";
      size[0] = 1, size[1] = size[2] = r.kind == kKindSetp64 ? 8 : 4, size[3] = r.boolop == kBoolNone ? 0 : 1;
      size[4] = 1, q_optional = true;
      return nullptr;
    case kKindMove:
      if (!is({kAluMov, kAluSelp})) return "a move row's op";
      size[0] = size[1] = r.sizes[0];  // any of 1, 4, 8 (checked with every size)
      if (r.op == kAluSelp) size[2] = r.sizes[0], size[3] = 1;
      return nullptr;
    case kKindPred:
      if (!is({kAluAnd, kAluOr, kAluXor, kAluNot})) return "a predicate row's op";
      size[0] = size[1] = 1, size[2] = r.op == kAluNot ? 0 : 1;
      return nullptr;
    case kKindWiden:
      if (r.op == kAluMulWide) {
        size[0] = 8, size[1] = size[2] = 4;
        return nullptr;
      }
      if (r.op != kAluCvt || (r.sizes[0] != 4 && r.sizes[0] != 8) || (r.sizes[1] != 4 && r.sizes[1] != 8))
        return "a widening row's op or sizes";
      size[0] = r.sizes[0], size[1] = r.sizes[1];
      return nullptr;
  }
  return "a row's kind";
}

}  // namespace

const char* flashgen_emu_alu(const FlashgenEmuAluInstruction* rows, int64_t count, const uint64_t* immediates,
                             int64_t nimm, void* const* regs, const int64_t* reg_sizes, int64_t nregs, int64_t n,
                             const bool* mask) {
  // checked before anything runs: a bad program writes nothing. Immediate i is an array of its
  // value (its low bytes: little-endian), one element per lane, of the size its operand reads.
  std::vector<int64_t> imm_size(static_cast<size_t>(nimm), 0);
  for (int64_t k = 0; k < count; ++k) {
    int64_t want[5];
    bool q_optional;
    if (const char* what = expected(rows[k], want, q_optional)) return what;
    for (int j = 0; j < 5; ++j) {
      const int64_t o = rows[k].operands[j], size = rows[k].sizes[j];
      if (size != want[j] && !(j == 4 && q_optional && size == 0)) return "an operand's size does not fit the row's form";
      if (size == 0) continue;
      if (size != 1 && size != 4 && size != 8) return "operand size";
      if (o >= nregs || (o < 0 && (j == 0 || j == 4 || -o - 1 >= nimm))) return "operand out of range";
      if (o >= 0 && reg_sizes[o] != size) return "register size differs from the operand's";
      if (o < 0 && imm_size[-o - 1] && imm_size[-o - 1] != size) return "immediate read at two sizes";
      if (o < 0) imm_size[-o - 1] = size;
    }
  }
  // Lanes go in chunks that keep a chunk's registers in L1 from one instruction to the next; an
  // immediate is a chunk-long array of its value.
  constexpr int64_t kChunk = 256;
  static thread_local std::vector<uint64_t> broadcast;
  broadcast.resize(static_cast<size_t>(nimm * kChunk));
  for (int64_t j = 0; j < nimm; ++j) {
    void* b = broadcast.data() + j * kChunk;
    const uint64_t v = immediates[j];
    if (imm_size[j] == 8) std::fill_n(static_cast<uint64_t*>(b), kChunk, v);
    if (imm_size[j] == 4) std::fill_n(static_cast<uint32_t*>(b), kChunk, static_cast<uint32_t>(v));
    if (imm_size[j] == 1) std::fill_n(static_cast<bool*>(b), kChunk, v != 0);
  }
  static thread_local Masks masks;
  for (int64_t lo = 0; lo < n; lo += kChunk) {
    const int64_t m = std::min(kChunk, n - lo);
    if (mask) masks.set(mask + lo, m);
    for (int64_t k = 0; k < count; ++k) {
      void* p[5] = {};
      for (int j = 0; j < 5; ++j) {
        const int64_t o = rows[k].operands[j], size = rows[k].sizes[j];
        if (size) p[j] = o >= 0 ? static_cast<void*>(static_cast<char*>(regs[o]) + lo * size)
                                : static_cast<void*>(broadcast.data() + (-o - 1) * kChunk);
      }
      run(rows[k], p, m, mask ? &masks : nullptr);
    }
  }
  return nullptr;
}
