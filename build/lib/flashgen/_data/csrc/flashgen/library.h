// The C face of a generated flashgen library: a table of its FFI handlers and
// a JSON description of the specs it was built from.
#pragma once
#include <cstddef>

#include "xla/ffi/api/c_api.h"

#define FLASHGEN_EXPORT __attribute__((visibility("default")))

namespace flashgen {

struct HandlerEntry {
  const char* name;      // custom-call target name (== C symbol)
  const char* platform;  // "cpu" or "CUDA", as jax.ffi.register_ffi_target spells it
  XLA_FFI_Error* (*handler)(XLA_FFI_CallFrame*);
};

}  // namespace flashgen

extern "C" const flashgen::HandlerEntry* flashgen_handlers(size_t* count);
extern "C" const char* flashgen_library_info();
