// Shared-memory bookkeeping for one access, part of the emulator's native module
// (emu_native.h; flashgen/emulate/memory.py, SharedMemory, states the rules and calls these): its word indices, and the race
// detector's checks and stamp updates.
//
// An access to the race detector is `rows` x `cols` granule indices, row r issued by warp
// `warps[r]` (or `warp` for all rows) of the CTA whose slot holds the row's first granule. A granule's stamp is `epoch << 8 | warp` of
// its last writer, and of its readers in the current epoch (warp kMany for several).
//
// Each function checks the access against the stamps as they were before it: on a possible race
// it writes a verdict per granule and returns nonzero, and memory.py judges the verdicts (Hopper's
// mbarriers may order them) and names the race. A write changes no stamp then, and memory.py
// calls again with `check` 0 if no race remains; otherwise the stamps are updated, granule by
// granule in row order. One pass in C instead of a dozen numpy passes over the access.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "flashgen/emulate/native/emu_native.h"

namespace {

constexpr int64_t kMany = 255;

}  // namespace


namespace {

struct Row {
  int64_t slot, base, mine, warp;
};

Row row_of(const FlashgenEmuRaceState* s, const int64_t* idx, int64_t cols, int64_t r, int64_t warp,
           const int64_t* warps) {
  Row row;
  row.warp = warps ? warps[r] : warp;
  row.slot = idx[r * cols] * s->granule / s->stride;
  row.base = s->epochs[row.slot] << 8;
  row.mine = row.base | row.warp;
  return row;
}

}  // namespace

// The words [rows][nbytes / 4] of an access of `nbytes` (4, 8 or 16) at CTA offsets `offs`, in the
// CTA slot `slots[r]` (or `slot` for all rows) of `stride` bytes each: 0, or 1 (nothing decided)
// when an offset is misaligned or out of the CTA's `size` bytes or a word has a byte an issued
// cp.async has not delivered (`pending`: per word, null when none is in flight), for memory.py's
// byte path to name.
int64_t flashgen_emu_shared_words(const int64_t* offs, int64_t rows, int64_t nbytes, int64_t slot,
                                  const int64_t* slots, int64_t size, int64_t stride, const int64_t* pending,
                                  int64_t* words) {
  const int64_t cols = nbytes / 4;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t o = offs[r];
    if ((o & (nbytes - 1)) || o < 0 || o + nbytes > size) return 1;
    const int64_t first = (o + (slots ? slots[r] : slot) * stride) >> 2;
    for (int64_t c = 0; c < cols; ++c) {
      if (pending && pending[first + c]) return 1;
      words[r * cols + c] = first + c;
    }
  }
  return 0;
}

// Verdicts: 1 written in this epoch by another warp; 2 written by another lane of this warp (any
// lane when `lanes` is null: the warp reads on its own behalf, ldmatrix) since its last __syncwarp.
// The readers' stamps are updated in the same pass (the verdicts depend on the writers' only, and
// an update done twice gives the same stamps).
int64_t flashgen_emu_race_read(const FlashgenEmuRaceState* s, const int64_t* idx, int64_t rows, int64_t cols,
                               int64_t warp, const int64_t* warps, const int64_t* lanes, uint8_t* verdict) {
  uint8_t found = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const Row row = row_of(s, idx, cols, r, warp, warps);
    const int64_t synced = s->warp_syncs[row.slot * 32 + row.warp];
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t g = idx[r * cols + c], ws = s->w_stamp[g], rs = s->r_stamp[g];
      uint8_t v = 0;
      if (ws >= row.base) {
        if (ws != row.mine)
          v = 1;
        else if (s->w_wsync[g] == synced && (!lanes || s->w_lane[g] != lanes[r]))
          v = 2;
      }
      verdict[r * cols + c] = v;
      found |= v;
      s->r_stamp[g] = rs >= row.base && rs != row.mine ? (row.base | kMany) : row.mine;
    }
  }
  return found ? 1 : 0;
}

// Verdicts (bits): 1 written, 2 read, in this epoch by another warp. Returns 2 with verdict 4 on
// the granules that rows of two warps of this access both write (the stamps are then updated).
int64_t flashgen_emu_race_write(const FlashgenEmuRaceState* s, const int64_t* idx, int64_t rows, int64_t cols,
                                int64_t warp, const int64_t* warps, const int64_t* lanes, uint8_t* verdict,
                                int64_t check) {
  if (check) {
    uint8_t found = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const Row row = row_of(s, idx, cols, r, warp, warps);
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t g = idx[r * cols + c], ws = s->w_stamp[g], rs = s->r_stamp[g];
        const uint8_t v = (ws >= row.base && ws != row.mine ? 1 : 0) | (rs >= row.base && rs != row.mine ? 2 : 0);
        verdict[r * cols + c] = v;
        found |= v;
      }
    }
    if (found) return 1;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t mine = row_of(s, idx, cols, r, warp, warps).mine;
    for (int64_t c = 0; c < cols; ++c) s->w_stamp[idx[r * cols + c]] = mine;
  }
  if (warps) {  // rows of several warps: does a granule now hold another row's stamp?
    uint8_t clash = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t mine = row_of(s, idx, cols, r, warp, warps).mine;
      for (int64_t c = 0; c < cols; ++c) {
        const uint8_t v = s->w_stamp[idx[r * cols + c]] != mine ? 4 : 0;
        verdict[r * cols + c] = v;
        clash |= v;
      }
    }
    if (clash) return 2;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const Row row = row_of(s, idx, cols, r, warp, warps);
    const int64_t synced = s->warp_syncs[row.slot * 32 + row.warp];
    const int8_t lane = lanes ? static_cast<int8_t>(lanes[r]) : -1;
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t g = idx[r * cols + c];
      s->w_lane[g] = lane;
      s->w_wsync[g] = synced;
    }
  }
  return 0;
}

// A load of whole words by the rules of flashgen_emu_shared_words and, when `race` is not null,
// flashgen_emu_race_read: `out` [rows][nbytes / 4] receives the words of `memory` (`memory_words`
// long). 0, or 1 when shared_words declines, 2 when the race detector has a verdict (for memory.py
// to name: a second race_read over the same access gives the same verdicts and stamps).
int64_t flashgen_emu_shared_load(const int64_t* offs, int64_t rows, int64_t nbytes, int64_t slot,
                                 const int64_t* slots, int64_t size, int64_t stride, const int64_t* pending,
                                 const FlashgenEmuRaceState* race, int64_t warp, const int64_t* warps,
                                 const int64_t* lanes, const uint32_t* memory, int64_t memory_words, uint32_t* out) {
  thread_local std::vector<int64_t> words;
  thread_local std::vector<uint8_t> verdict;
  const int64_t n = rows * (nbytes / 4);
  words.resize(n);
  if (flashgen_emu_shared_words(offs, rows, nbytes, slot, slots, size, stride, pending, words.data())) return 1;
  for (int64_t i = 0; i < n; ++i)
    if (words[i] >= memory_words) return 1;  // a slot past the wave's
  if (race) {
    verdict.resize(n);
    if (flashgen_emu_race_read(race, words.data(), rows, nbytes / 4, warp, warps, lanes, verdict.data())) return 2;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = memory[words[i]];
  return 0;
}

// ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16 for the executing warps of a gang: row r
// of matrix r / 8 from the address lane r of the warp holds (its address register, + offset), the
// rows loaded and checked as one shared_load, then each lane's registers filled from them by
// `gather` (semantics/warpops.py's table: for register j, lane l, half h, which of the warp's
// loaded halves). Returns shared_load's nonzero code, with nothing written, where it declines.
int64_t flashgen_emu_ldmatrix(const void* addr, int64_t addr_size, int64_t addr_signed, int64_t offset, int64_t g,
                              int64_t nmat, const bool* executing, int64_t slot, const int64_t* slots, int64_t size,
                              int64_t stride, const int64_t* pending, const FlashgenEmuRaceState* race, int64_t warp,
                              const int64_t* warps, const uint32_t* memory, int64_t memory_words,
                              const int32_t* gather, uint32_t* const* dests) {
  thread_local std::vector<int64_t> offs, row_slots, row_warps, who;
  thread_local std::vector<uint32_t> out;
  const int64_t per_warp = 8 * nmat;
  offs.clear(), row_slots.clear(), row_warps.clear(), who.clear();
  for (int64_t w = 0; w < g; ++w) {
    if (executing && !executing[w * 32]) continue;
    who.push_back(w);
    for (int64_t l = 0; l < per_warp; ++l) {
      const int64_t i = w * 32 + l;
      int64_t a;
      if (addr_size == 8) {
        a = static_cast<const int64_t*>(addr)[i];
      } else {
        const uint32_t u = static_cast<const uint32_t*>(addr)[i];
        a = addr_signed ? static_cast<int64_t>(static_cast<int32_t>(u)) : static_cast<int64_t>(u);
      }
      offs.push_back(a + offset);
      if (slots) row_slots.push_back(slots[i]);
      if (warps) row_warps.push_back(warps[i]);
    }
  }
  const int64_t rows = static_cast<int64_t>(offs.size());
  if (rows == 0) return 0;
  out.resize(rows * 4);
  if (const int64_t code = flashgen_emu_shared_load(offs.data(), rows, 16, slot, slots ? row_slots.data() : nullptr,
                                                    size, stride, pending, race, warp,
                                                    warps ? row_warps.data() : nullptr, nullptr, memory,
                                                    memory_words, out.data()))
    return code;
  const uint16_t* halves = reinterpret_cast<const uint16_t*>(out.data());
  for (std::size_t k = 0; k < who.size(); ++k) {
    const uint16_t* mine = halves + k * per_warp * 8;
    for (int64_t j = 0; j < nmat; ++j)
      for (int64_t lane = 0; lane < 32; ++lane) {
        const int32_t* at = gather + (j * 32 + lane) * 2;
        dests[j][who[k] * 32 + lane] = uint32_t(mine[at[0]]) | uint32_t(mine[at[1]]) << 16;
      }
  }
  return 0;
}
