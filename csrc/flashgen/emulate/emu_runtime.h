// The C face of libflashgen_emu (cudart_emu.cc + ffi_host_emu.cc): what
// flashgen/emulate/host.py calls through ctypes, and the callbacks it installs.
#pragma once
#include <cstddef>
#include <cstdint>

#define FLASHGEN_EMU_EXPORT __attribute__((visibility("default")))

extern "C" {

// One kernel launch: the PTX entry name, grid and block, dynamic shared
// memory and cudaLaunchKernel's argument pointers (one per kernel parameter).
// Returns 0 when the kernel ran, nonzero when the emulator refused it (the
// Python side keeps the exception; the runtime reports cudaErrorLaunchFailure).
typedef int (*flashgen_emu_launch_fn)(const char* kernel, const unsigned* grid, const unsigned* block, size_t smem,
                                      void** args);

enum FlashgenEmuMemoryOp {
  FLASHGEN_EMU_MAP = 0,    // a new device allocation [addr, addr + bytes)
  FLASHGEN_EMU_UNMAP = 1,  // the allocation at addr is freed
  FLASHGEN_EMU_CHECK = 2,  // a host-side access (memset, memcpy): must lie in one mapped range
};
// Returns 0 on success, nonzero to refuse.
typedef int (*flashgen_emu_memory_fn)(int op, uintptr_t addr, size_t bytes, const char* what);

FLASHGEN_EMU_EXPORT void flashgen_emu_set_callbacks(flashgen_emu_launch_fn launch, flashgen_emu_memory_fn memory);
FLASHGEN_EMU_EXPORT void flashgen_emu_set_device(int major, int minor, int multiprocessors,
                                                 int smem_per_block_optin);
FLASHGEN_EMU_EXPORT void flashgen_emu_reset_errors();
FLASHGEN_EMU_EXPORT void* flashgen_emu_stream();
FLASHGEN_EMU_EXPORT void* flashgen_emu_device_alloc(size_t bytes, size_t alignment, const char* what);
FLASHGEN_EMU_EXPORT int flashgen_emu_device_free(void* p);
FLASHGEN_EMU_EXPORT size_t flashgen_emu_live_allocations();
}
