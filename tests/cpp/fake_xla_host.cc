// A stand-in for EXLA's XLA: exports XLA_FFI_GetApi (as EXLA's process does), dlopens a
// flashgen library built with `--for exla` the way EXLA.NIF.load_dylib does (RTLD_GLOBAL), and
// prints every handler the library's static initializers registered: "name platform".
// Build: c++ -std=c++17 -rdynamic -I<jax ffi include> fake_xla_host.cc -o host -ldl
#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "xla/ffi/api/c_api.h"

static XLA_FFI_Error* record(XLA_FFI_Handler_Register_Args* args) {
  std::printf("%.*s %.*s %s\n", static_cast<int>(args->name.len), args->name.ptr,
              static_cast<int>(args->platform.len), args->platform.ptr,
              args->bundle.execute != nullptr ? "execute" : "none");
  return nullptr;
}

static XLA_FFI_Api make_api() {
  XLA_FFI_Api api;
  std::memset(&api, 0, sizeof(api));
  api.struct_size = XLA_FFI_Api_STRUCT_SIZE;
  api.XLA_FFI_Handler_Register = record;
  return api;
}

extern "C" __attribute__((visibility("default"))) const XLA_FFI_Api* XLA_FFI_GetApi() {
  static XLA_FFI_Api api = make_api();
  return &api;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s LIBRARY\n", argv[0]);
    return 2;
  }
  void* handle = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) {
    std::fprintf(stderr, "dlopen failed: %s\n", dlerror());
    return 1;
  }
  return 0;
}
