// Two of numerics.py's conversions as one pass over a gang's lanes, part of the emulator's native
// module (emu_native.h): cvt.rn.bf16x2.f32's packing and ex2.approx.f32. On numpy each took ~11 us
// a call (five or six array passes and their temporaries); they are the same functions of the same
// bits: bf16 round-to-nearest-even with the canonical NaN 0x7fff, and ex2 as the f64 exp2 rounded
// once to f32, with .ftz flushing subnormal inputs and results to sign-preserving zero.
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "flashgen/emulate/native/emu_native.h"

namespace {

uint32_t bf16_rn(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
  return (bits + 0x7FFFu + ((bits >> 16) & 1)) >> 16;  // carries into the exponent where it rounds up to it
}

float flush(float value) { return std::fabs(value) < FLT_MIN ? value * 0.0f : value; }

}  // namespace

void flashgen_emu_pack_bf16x2(const float* hi, const float* lo, int64_t n, uint32_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_rn(hi[i]) << 16 | bf16_rn(lo[i]);
}

void flashgen_emu_ex2(const float* x, int64_t n, int64_t ftz, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = ftz ? flush(x[i]) : x[i];
    const float r = static_cast<float>(std::exp2(static_cast<double>(v)));
    out[i] = ftz ? flush(r) : r;
  }
}
