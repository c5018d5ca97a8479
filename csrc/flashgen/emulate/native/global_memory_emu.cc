// Global-memory bookkeeping for one access to one registered range, part of the emulator's native
// module (emu_native.h; flashgen/emulate/memory.py, GlobalMemory, states the rules and has the
// same checks in numpy). Within a launch a range keeps, per byte, the CTA that wrote it (owners:
// -1 none, kAtomic for atomics) and, per 4-byte word or per byte, the CTA that read it (readers:
// -1 none, kSeveral for more than one). Each function checks the whole access first and returns
// 1, changing nothing, when memory.py has a race to name (it runs its own path then); else it
// updates the marks and returns 0. One pass in C instead of a dozen numpy passes.
#include <cstdint>
#include <cstring>

#include "flashgen/emulate/native/emu_native.h"

namespace {

constexpr int32_t kAtomic = -2, kSeveral = -3;  // memory.py's GlobalMemory.ATOMIC, .SEVERAL

int64_t cta_of(int64_t r, int64_t cta, const int64_t* ctas) { return ctas ? ctas[r] : cta; }

// The reader granule g of byte offset `o` (granule 4: words numbered from the range's first).
int64_t granule_of(int64_t start, int64_t o, int64_t granule) {
  return granule == 4 ? ((start + o) >> 2) - (start >> 2) : o;
}

}  // namespace

int64_t flashgen_emu_global_load(const uint8_t* bytes, int64_t size, int64_t start, const int32_t* owners,
                                 int32_t* readers, int64_t readers_size, int64_t granule, const int64_t* off,
                                 int64_t rows, int64_t nbytes, int64_t cta, const int64_t* ctas, uint8_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    if (off[r] < 0 || off[r] + nbytes > size || granule_of(start, off[r] + nbytes - 1, granule) >= readers_size)
      return 1;
    const int64_t me = cta_of(r, cta, ctas);
    if (owners)
      for (int64_t c = 0; c < nbytes; ++c) {
        const int32_t o = owners[off[r] + c];
        if (o != -1 && o != me) return 1;  // written by another CTA (or by atomics) in this launch
      }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t me = static_cast<int32_t>(cta_of(r, cta, ctas));
    for (int64_t g = granule_of(start, off[r], granule), end = granule_of(start, off[r] + nbytes - 1, granule);
         g <= end; ++g)
      readers[g] = readers[g] == -1 || readers[g] == me ? me : kSeveral;
    std::memcpy(out + r * nbytes, bytes + off[r], nbytes);
  }
  return 0;
}

int64_t flashgen_emu_global_atomic(int32_t* owners, int64_t size, int64_t start, const int32_t* readers4,
                                   int64_t readers4_size, const int32_t* readers1, int64_t readers1_size,
                                   const int64_t* off, int64_t rows, int64_t nbytes, int64_t cta,
                                   const int64_t* ctas) {
  for (int64_t r = 0; r < rows; ++r) {
    if (off[r] < 0 || off[r] + nbytes > size) return 1;
    const int64_t me = cta_of(r, cta, ctas);
    for (int64_t c = 0; c < nbytes; ++c) {
      const int64_t o = off[r] + c, w = granule_of(start, o, 4);
      if (owners[o] >= 0 && owners[o] != me) return 1;  // written by another CTA
      if (readers1 && (o >= readers1_size || (readers1[o] != -1 && readers1[o] != me))) return 1;
      if (readers4 && (w >= readers4_size || (readers4[w] != -1 && readers4[w] != me))) return 1;
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < nbytes; ++c) owners[off[r] + c] = kAtomic;
  return 0;
}
