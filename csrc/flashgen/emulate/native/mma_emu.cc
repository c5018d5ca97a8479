// mma.sync.m16n8k{16,8}.row.col with f32 accumulators for the warps of an emulator gang, part of
// the emulator's native module (emu_native.h; flashgen/emulate/semantics/warpops.py calls it). Which fragment element
// each matrix element is comes from warpops.py's fragment tables (checked against CuTe's), passed
// in as index tables; here is only the arithmetic: the products of bf16/f16/tf32 values are exact
// in double, and each result is rounded once to float.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "flashgen/emulate/native/emu_native.h"

namespace {

enum ElementType : int64_t { kBf16 = 0, kF16 = 1, kTf32 = 2 };

template <int64_t Type>
double from_bits(uint32_t bits) {
  if (Type == kF16) {
    const int exponent = (bits >> 10) & 31, mantissa = bits & 1023;
    const double v = exponent == 0    ? std::ldexp(mantissa, -24)
                     : exponent == 31 ? (mantissa ? NAN : INFINITY)
                                      : std::ldexp(mantissa | 1024, exponent - 25);
    return bits & 0x8000 ? -v : v;
  }
  bits = Type == kBf16 ? bits << 16 : bits & 0xFFFFE000u;  // tf32: the tensor core reads the top 19 bits
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One row of the 16 x 8 product: 8 doubles, one AVX-512 register (4 or 2 narrower ones elsewhere).
typedef double Row __attribute__((vector_size(64)));

// The 128 sums advance together (independent adds), each in k order. A product of two of the
// decoded values is exact, so a fused multiply-add rounds it the same as a multiply and an add.
template <int64_t K>
__attribute__((always_inline)) inline void product(const double* a, const double* b, double* out) {
  Row rows[16] = {};
  for (int64_t kk = 0; kk < K; ++kk) {
    Row brow;
    std::memcpy(&brow, b + kk * 8, sizeof brow);
    // unrolled, the 16 rows stay in registers: -O2 otherwise keeps them on the stack, and each
    // add waits on a store and a load (193 against 83 ns a product, measured)
#pragma GCC unroll 16
    for (int64_t i = 0; i < 16; ++i) rows[i] += a[i * K + kk] * brow;
  }
  std::memcpy(out, rows, sizeof rows);
}

__attribute__((target("avx512f"))) void product_avx512(int64_t k, const double* a, const double* b, double* out) {
  k == 16 ? product<16>(a, b, out) : product<8>(a, b, out);
}

void product_baseline(int64_t k, const double* a, const double* b, double* out) {
  k == 16 ? product<16>(a, b, out) : product<8>(a, b, out);
}

// AVX-512 is 4-5x the baseline x86-64 code here; the same bits either way
const auto product_of = __builtin_cpu_supports("avx512f") ? product_avx512 : product_baseline;

template <int64_t Type>
void mma(int64_t g, int64_t k, const uint32_t* const* ab, const float* const* c, float* const* d,
         const bool* executing, const int32_t* a_src, const int32_t* b_src, const int32_t* c_src,
         const int32_t* d_of) {
  using Element = std::conditional_t<Type == kTf32, uint32_t, uint16_t>;
  constexpr int64_t per_reg = Type == kTf32 ? 32 : 64;  // elements per register row of a warp
  // A's and B's registers are decoded in fragment order (a pass over each register row, which
  // the compiler vectorizes), then A's 16 x k and B's k x 8 gathered from those doubles: gathering
  // each element from its register and decoding it there took most of the time (0.44 us a warp)
  double fragment[6 * per_reg], a[16 * 16], b[16 * 8], acc[16 * 8];
  int64_t c_reg[16 * 8], c_at[16 * 8];
  for (int64_t p = 0; p < 16 * 8; ++p) c_reg[p] = c_src[p] / 32, c_at[p] = c_src[p] % 32;
  // Warp w's inputs are all read before its outputs are written, and it writes its own lanes
  // only: D may be C's registers (it mostly is).
  for (int64_t w = 0; w < g; ++w) {
    if (executing && !executing[w * 32]) continue;
    for (int64_t r = 0; r < 6; ++r) {
      const Element* row = reinterpret_cast<const Element*>(ab[r]) + w * per_reg;
      for (int64_t j = 0; j < per_reg; ++j) fragment[r * per_reg + j] = from_bits<Type>(row[j]);
    }
    for (int64_t p = 0; p < 16 * k; ++p) a[p] = fragment[a_src[p]];
    for (int64_t p = 0; p < 8 * k; ++p) b[p] = fragment[4 * per_reg + b_src[p]];
    product_of(k, a, b, acc);
    for (int64_t p = 0; p < 16 * 8; ++p) acc[p] += c[c_reg[p]][w * 32 + c_at[p]];
    for (int64_t reg = 0; reg < 4; ++reg)
      for (int64_t lane = 0; lane < 32; ++lane) d[reg][w * 32 + lane] = static_cast<float>(acc[d_of[reg * 32 + lane]]);
  }
}

}  // namespace

// `ab`: the gang's A and B registers (A's 4, then B's 2), each [g][32] u32; `c`: C's 4 registers,
// `d`: D's, written, each [g][32] f32; `executing`: per lane, null for all (a warp executes in full
// or not at all). A warp's fragment is [register][lane][element] (2 halves, or 1 tf32 word, per
// register of a lane). a_src[p]: where in the A fragment element p of the row-major 16 x k matrix
// A is; b_src the same for B (k x 8) in its 2 registers; c_src[p]: where in [register][lane]
// element p of the 16 x 8 C is; d_of[register * 32 + lane]: the element of D that it holds.
void flashgen_emu_mma(int64_t g, int64_t k, int64_t type, const uint32_t* const* ab, const float* const* c,
                      float* const* d, const bool* executing, const int32_t* a_src, const int32_t* b_src,
                      const int32_t* c_src, const int32_t* d_of) {
  if (type == kBf16) mma<kBf16>(g, k, ab, c, d, executing, a_src, b_src, c_src, d_of);
  if (type == kF16) mma<kF16>(g, k, ab, c, d, executing, a_src, b_src, c_src, d_of);
  if (type == kTf32) mma<kTf32>(g, k, ab, c, d, executing, a_src, b_src, c_src, d_of);
}
