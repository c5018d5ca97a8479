// The emulator's C helpers (shared_memory_emu.cc, global_memory_emu.cc, mma_emu.cc, numerics_emu.cc), which module.cc hands to Python as
// the extension module flashgen.emulate.native loads: memory.py and semantics/warpops.py call them
// once or more per emulated instruction, where a ctypes call cost 4 us and this one 0.1-0.3 us.
#pragma once
#include <cstdint>

struct FlashgenEmuRaceState {  // memory.py's _RaceState: SharedMemory's arrays, one per granule
  int64_t* w_stamp;            // of the last writer
  int64_t* r_stamp;            // of the readers in the writer's epoch or later
  int8_t* w_lane;              // the writer's lane, -1 for the whole warp
  int64_t* w_wsync;            // the writer warp's __syncwarp count then
  const int64_t* warp_syncs;   // [CTA slot][warp]: __syncwarp counts
  const int64_t* epochs;       // [CTA slot]: barrier epochs
  int64_t granule, stride;     // bytes per granule; bytes per CTA slot
};

int64_t flashgen_emu_shared_words(const int64_t* offs, int64_t rows, int64_t nbytes, int64_t slot,
                                  const int64_t* slots, int64_t size, int64_t stride, const int64_t* pending,
                                  int64_t* words);
int64_t flashgen_emu_shared_load(const int64_t* offs, int64_t rows, int64_t nbytes, int64_t slot,
                                 const int64_t* slots, int64_t size, int64_t stride, const int64_t* pending,
                                 const FlashgenEmuRaceState* race, int64_t warp, const int64_t* warps,
                                 const int64_t* lanes, const uint32_t* memory, int64_t memory_words, uint32_t* out);
int64_t flashgen_emu_race_read(const FlashgenEmuRaceState* s, const int64_t* idx, int64_t rows, int64_t cols,
                               int64_t warp, const int64_t* warps, const int64_t* lanes, uint8_t* verdict);
int64_t flashgen_emu_race_write(const FlashgenEmuRaceState* s, const int64_t* idx, int64_t rows, int64_t cols,
                                int64_t warp, const int64_t* warps, const int64_t* lanes, uint8_t* verdict,
                                int64_t check);
int64_t flashgen_emu_global_load(const uint8_t* bytes, int64_t size, int64_t start, const int32_t* owners,
                                 int32_t* readers, int64_t readers_size, int64_t granule, const int64_t* off,
                                 int64_t rows, int64_t nbytes, int64_t cta, const int64_t* ctas, uint8_t* out);
int64_t flashgen_emu_global_atomic(int32_t* owners, int64_t size, int64_t start, const int32_t* readers4,
                                   int64_t readers4_size, const int32_t* readers1, int64_t readers1_size,
                                   const int64_t* off, int64_t rows, int64_t nbytes, int64_t cta,
                                   const int64_t* ctas);
int64_t flashgen_emu_ldmatrix(const void* addr, int64_t addr_size, int64_t addr_signed, int64_t offset, int64_t g,
                              int64_t nmat, const bool* executing, int64_t slot, const int64_t* slots, int64_t size,
                              int64_t stride, const int64_t* pending, const FlashgenEmuRaceState* race, int64_t warp,
                              const int64_t* warps, const uint32_t* memory, int64_t memory_words,
                              const int32_t* gather, uint32_t* const* dests);
void flashgen_emu_mma(int64_t g, int64_t k, int64_t type, const uint32_t* const* ab, const float* const* c,
                      float* const* d, const bool* executing, const int32_t* a_src, const int32_t* b_src,
                      const int32_t* c_src, const int32_t* d_of);
void flashgen_emu_pack_bf16x2(const float* hi, const float* lo, int64_t n, uint32_t* out);
void flashgen_emu_ex2(const float* x, int64_t n, int64_t ftz, float* out);
