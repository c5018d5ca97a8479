// A stand-in for libcudart under which a flashgen CUDA library's host code runs
// unmodified on a machine without a GPU (flashgen/emulate/host.py loads it).
//
// Device memory is host memory: an allocation is 256-byte aligned host memory
// filled with 0xFF (fresh device memory holds garbage, and NaN bytes make a
// read of it visible), and every range is registered with the emulator's
// GlobalMemory through the memory callback so that kernels may touch it and
// nothing else. Every launch goes to the launch callback, which runs the
// kernel's PTX in the emulator; "asynchronous" work is done at once, in
// stream order. The checks a real runtime makes at those points are made here
// too (launch configuration, dynamic shared memory against the function's
// attribute, the stream, the address range of a memset/memcpy), so a handler
// bug that a GPU would report is reported, not papered over.
//
// Device figures (multiprocessor count, opt-in shared memory per block, compute
// capability) are set by the emulator from its own table (flashgen.emulate.machine).
#include <cuda.h>  // cuTensorMapEncodeTiled
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "flashgen/emulate/emu_runtime.h"

namespace {

struct DeviceFigures {
  int major = 8, minor = 0;
  int multiprocessors = 0;       // 0 until flashgen_emu_set_device: the handlers must not run before
  int smem_per_block_optin = 0;  // bytes
};

constexpr int kDefaultDynamicSmem = 48 * 1024;  // without cudaFuncSetAttribute

struct Kernel {
  std::string device_name;
  int max_dynamic_smem = kDefaultDynamicSmem;
};

struct LaunchConfig {
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
};

struct Runtime {
  DeviceFigures device;
  flashgen_emu_launch_fn launch = nullptr;
  flashgen_emu_memory_fn memory = nullptr;
  std::unordered_map<const void*, std::unique_ptr<Kernel>> kernels;  // by host stub address
  std::vector<LaunchConfig> configs;  // <<<...>>> pushes, the launch stub pops
  cudaError_t last_error = cudaSuccess;
  cudaError_t sticky_error = cudaSuccess;  // a failed kernel poisons the context, as on a GPU
  std::unordered_map<void*, size_t> allocations;
  int stream_token = 0;  // its address is the one stream this runtime knows
};

Runtime& rt() {
  static Runtime r;
  return r;
}

cudaError_t fail(cudaError_t e) {
  rt().last_error = e;
  return e;
}

bool known_stream(cudaStream_t s) {
  return s == nullptr || s == reinterpret_cast<cudaStream_t>(&rt().stream_token);
}

// A host-side access to device memory (memset, memcpy) must lie inside one
// registered range, as it must lie inside one allocation on a GPU.
bool device_range(const void* p, size_t bytes, const char* what) {
  if (bytes == 0) return true;
  return rt().memory != nullptr &&
         rt().memory(FLASHGEN_EMU_CHECK, reinterpret_cast<uintptr_t>(p), bytes, what) == 0;
}

cudaError_t launch(const void* fun, dim3 grid, dim3 block, void** args, size_t smem, cudaStream_t stream) {
  Runtime& r = rt();
  if (r.sticky_error != cudaSuccess) return fail(r.sticky_error);
  auto it = r.kernels.find(fun);
  if (it == r.kernels.end()) return fail(cudaErrorInvalidDeviceFunction);
  if (!known_stream(stream)) return fail(cudaErrorInvalidResourceHandle);
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || threads == 0 || threads > 1024 || block.z > 64 ||
      grid.y > 65535 || grid.z > 65535 || grid.x > 0x7fffffffu)
    return fail(cudaErrorInvalidConfiguration);
  if (smem > static_cast<size_t>(it->second->max_dynamic_smem)) return fail(cudaErrorInvalidValue);
  if (r.launch == nullptr) return fail(cudaErrorNotSupported);
  const unsigned g[3] = {grid.x, grid.y, grid.z};
  const unsigned b[3] = {block.x, block.y, block.z};
  if (r.launch(it->second->device_name.c_str(), g, b, smem, args) != 0) {
    r.sticky_error = cudaErrorLaunchFailure;
    return fail(cudaErrorLaunchFailure);
  }
  return cudaSuccess;
}

}  // namespace

// ---------------------------------------------------------------------------
// The emulator's side (flashgen/emulate/host.py)
// ---------------------------------------------------------------------------
extern "C" {

FLASHGEN_EMU_EXPORT void flashgen_emu_set_callbacks(flashgen_emu_launch_fn launch_fn,
                                                    flashgen_emu_memory_fn memory_fn) {
  rt().launch = launch_fn;
  rt().memory = memory_fn;
}

FLASHGEN_EMU_EXPORT void flashgen_emu_set_device(int major, int minor, int multiprocessors,
                                                 int smem_per_block_optin) {
  rt().device = DeviceFigures{major, minor, multiprocessors, smem_per_block_optin};
}

// Forget a failed launch (the next handler call starts from a fresh context).
FLASHGEN_EMU_EXPORT void flashgen_emu_reset_errors() {
  rt().sticky_error = cudaSuccess;
  rt().last_error = cudaSuccess;
  rt().configs.clear();
}

FLASHGEN_EMU_EXPORT void* flashgen_emu_stream() { return &rt().stream_token; }

FLASHGEN_EMU_EXPORT void* flashgen_emu_device_alloc(size_t bytes, size_t alignment, const char* what) {
  if (alignment < 256) alignment = 256;
  if ((alignment & (alignment - 1)) != 0) return nullptr;
  const size_t rounded = (bytes + alignment - 1) / alignment * alignment;
  void* p = std::aligned_alloc(alignment, rounded == 0 ? alignment : rounded);
  if (p == nullptr) return nullptr;
  std::memset(p, 0xFF, rounded == 0 ? alignment : rounded);
  // The registered range is what was asked for: a kernel reading past it fails.
  if (rt().memory == nullptr ||
      rt().memory(FLASHGEN_EMU_MAP, reinterpret_cast<uintptr_t>(p), bytes == 0 ? 1 : bytes, what) != 0) {
    std::free(p);
    return nullptr;
  }
  rt().allocations[p] = bytes;
  return p;
}

FLASHGEN_EMU_EXPORT int flashgen_emu_device_free(void* p) {
  if (p == nullptr) return 0;
  auto it = rt().allocations.find(p);
  if (it == rt().allocations.end()) return -1;
  rt().allocations.erase(it);
  if (rt().memory != nullptr) rt().memory(FLASHGEN_EMU_UNMAP, reinterpret_cast<uintptr_t>(p), 0, "free");
  std::free(p);
  return 0;
}

FLASHGEN_EMU_EXPORT size_t flashgen_emu_live_allocations() { return rt().allocations.size(); }

// ---------------------------------------------------------------------------
// What nvcc's generated host code calls
// ---------------------------------------------------------------------------
void** __cudaRegisterFatBinary(void* fat_cubin) {
  // The fat binary's code is not used: the emulator runs the PTX kept from
  // the same compile. The handle only has to be unique.
  return static_cast<void**>(fat_cubin);
}

void __cudaRegisterFatBinaryEnd(void**) {}

void __cudaUnregisterFatBinary(void**) {}

void __cudaRegisterFunction(void**, const char* host_fun, char*, const char* device_name, int, uint3*, uint3*,
                            dim3*, dim3*, int*) {
  auto k = std::make_unique<Kernel>();
  k->device_name = device_name;
  rt().kernels[host_fun] = std::move(k);
}

void __cudaRegisterVar(void**, char*, char*, const char*, int, size_t, int, int) {}

unsigned __cudaPushCallConfiguration(dim3 grid, dim3 block, size_t smem, struct CUstream_st* stream) {
  rt().configs.push_back({grid, block, smem, stream});
  return 0;
}

cudaError_t __cudaPopCallConfiguration(dim3* grid, dim3* block, size_t* smem, void* stream) {
  Runtime& r = rt();
  if (r.configs.empty()) return fail(cudaErrorInvalidConfiguration);
  const LaunchConfig c = r.configs.back();
  r.configs.pop_back();
  *grid = c.grid;
  *block = c.block;
  *smem = c.smem;
  *static_cast<cudaStream_t*>(stream) = c.stream;
  return cudaSuccess;
}

cudaError_t __cudaGetKernel(cudaKernel_t* kernel, const void* fun) {
  if (rt().kernels.count(fun) == 0) return fail(cudaErrorInvalidDeviceFunction);
  *kernel = reinterpret_cast<cudaKernel_t>(const_cast<void*>(fun));
  return cudaSuccess;
}

cudaError_t __cudaLaunchKernel(cudaKernel_t kernel, dim3 grid, dim3 block, void** args, size_t smem,
                               cudaStream_t stream) {
  return launch(reinterpret_cast<const void*>(kernel), grid, block, args, smem, stream);
}

cudaError_t __cudaLaunchKernel_ptsz(cudaKernel_t kernel, dim3 grid, dim3 block, void** args, size_t smem,
                                    cudaStream_t stream) {
  return launch(reinterpret_cast<const void*>(kernel), grid, block, args, smem, stream);
}

cudaError_t cudaLaunchKernel(const void* fun, dim3 grid, dim3 block, void** args, size_t smem,
                             cudaStream_t stream) {
  return launch(fun, grid, block, args, smem, stream);
}

cudaError_t cudaFuncSetAttribute(const void* fun, enum cudaFuncAttribute attr, int value) {
  auto it = rt().kernels.find(fun);
  if (it == rt().kernels.end()) return fail(cudaErrorInvalidDeviceFunction);
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return fail(cudaErrorNotSupported);
  if (value < 0 || value > rt().device.smem_per_block_optin) return fail(cudaErrorInvalidValue);
  it->second->max_dynamic_smem = value;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
  if (device != 0) return fail(cudaErrorInvalidDevice);
  const DeviceFigures& d = rt().device;
  if (d.multiprocessors == 0) return fail(cudaErrorNoDevice);
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = d.multiprocessors; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = d.smem_per_block_optin; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = kDefaultDynamicSmem; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor: *value = d.major; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor: *value = d.minor; return cudaSuccess;
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; return cudaSuccess;
    case cudaDevAttrWarpSize: *value = 32; return cudaSuccess;
    case cudaDevAttrMaxGridDimX: *value = 0x7fffffff; return cudaSuccess;
    case cudaDevAttrMaxGridDimY:
    case cudaDevAttrMaxGridDimZ: *value = 65535; return cudaSuccess;
    default: return fail(cudaErrorNotSupported);
  }
}

cudaError_t cudaGetLastError() {
  const cudaError_t e = rt().last_error;
  rt().last_error = rt().sticky_error;
  return e;
}

cudaError_t cudaPeekAtLastError() { return rt().last_error; }

cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream) {
  if (rt().sticky_error != cudaSuccess) return fail(rt().sticky_error);
  if (!known_stream(stream)) return fail(cudaErrorInvalidResourceHandle);
  if (!device_range(p, bytes, "cudaMemsetAsync")) return fail(cudaErrorInvalidValue);
  std::memset(p, value, bytes);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, enum cudaMemcpyKind kind,
                            cudaStream_t stream) {
  if (rt().sticky_error != cudaSuccess) return fail(rt().sticky_error);
  if (!known_stream(stream)) return fail(cudaErrorInvalidResourceHandle);
  const bool dst_dev = kind == cudaMemcpyDeviceToDevice || kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDefault;
  const bool src_dev = kind == cudaMemcpyDeviceToDevice || kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDefault;
  if ((dst_dev && !device_range(dst, bytes, "cudaMemcpyAsync(dst)")) ||
      (src_dev && !device_range(src, bytes, "cudaMemcpyAsync(src)")))
    return fail(cudaErrorInvalidValue);
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** p, size_t bytes) {
  *p = flashgen_emu_device_alloc(bytes, 256, "cudaMalloc");
  return *p != nullptr ? cudaSuccess : fail(cudaErrorMemoryAllocation);
}

cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t stream) {
  if (!known_stream(stream)) return fail(cudaErrorInvalidResourceHandle);
  return cudaMalloc(p, bytes);
}

cudaError_t cudaFree(void* p) { return flashgen_emu_device_free(p) == 0 ? cudaSuccess : fail(cudaErrorInvalidValue); }

cudaError_t cudaFreeAsync(void* p, cudaStream_t stream) {
  if (!known_stream(stream)) return fail(cudaErrorInvalidResourceHandle);
  return cudaFree(p);
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  if (!known_stream(stream)) return fail(cudaErrorInvalidResourceHandle);
  return rt().sticky_error;
}

cudaError_t cudaDeviceSynchronize() { return rt().sticky_error; }

// The driver entry points this runtime stands in for: cuTensorMapEncodeTiled (tensormap_emu.cc).
cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned int version,
                                             unsigned long long flags, cudaDriverEntryPointQueryResult* status) {
  if (symbol == nullptr || fn == nullptr || flags != cudaEnableDefault) return fail(cudaErrorInvalidValue);
  const bool known = std::strcmp(symbol, "cuTensorMapEncodeTiled") == 0;
  *fn = known && version >= 12000 ? reinterpret_cast<void*>(&cuTensorMapEncodeTiled) : nullptr;
  if (status != nullptr) {
    *status = !known ? cudaDriverEntryPointSymbolNotFound
                     : *fn ? cudaDriverEntryPointSuccess : cudaDriverEntryPointVersionNotSufficent;
  }
  return cudaSuccess;
}

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    default: return "cudaErrorUnknown";
  }
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNoDevice: return "no device figures set (flashgen_emu_set_device)";
    case cudaErrorInvalidDeviceFunction: return "invalid device function";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorLaunchFailure: return "unspecified launch failure (the emulator reported the kernel's error)";
    case cudaErrorNotSupported: return "operation not supported (by the emulated runtime)";
    default: return "unknown error";
  }
}

}  // extern "C"
