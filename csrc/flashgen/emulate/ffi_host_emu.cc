// A minimal XLA FFI host: the call frame XLA would build for one custom call
// (flashgen/host_call.h) and the API functions a flashgen CUDA handler uses:
// errors, the stream (cudart_emu.cc's one stream), and the scratch allocator
// (emulated device memory; an optional byte limit lets a test refuse scratch
// as XLA may).
// flashgen/emulate/host.py calls flashgen_emu_call through ctypes.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "flashgen/emulate/emu_runtime.h"
#include "flashgen/host_call.h"

// The execution context of one call.
struct XLA_FFI_ExecutionContext {
  int64_t scratch_limit;  // bytes; < 0: unlimited
  int64_t scratch_bytes;  // allocated so far (what the handler asked for)
  int64_t scratch_live;   // allocations not yet freed
};

namespace {

using flashgen::host::make_error;

XLA_FFI_Error* stream_get(XLA_FFI_Stream_Get_Args* a) {
  a->stream = flashgen_emu_stream();
  return nullptr;
}

XLA_FFI_Error* run_id_get(XLA_FFI_RunId_Get_Args* a) {
  a->run_id = 0;
  return nullptr;
}

XLA_FFI_Error* device_ordinal_get(XLA_FFI_DeviceOrdinal_Get_Args* a) {
  a->device_ordinal = 0;
  return nullptr;
}

XLA_FFI_Error* memory_allocate(XLA_FFI_DeviceMemory_Allocate_Args* a) {
  XLA_FFI_ExecutionContext* ctx = a->ctx;
  if (ctx->scratch_limit >= 0 && ctx->scratch_bytes + static_cast<int64_t>(a->size) > ctx->scratch_limit)
    return make_error(XLA_FFI_Error_Code_RESOURCE_EXHAUSTED,
                      "scratch limit of " + std::to_string(ctx->scratch_limit) + " bytes reached");
  a->data = flashgen_emu_device_alloc(a->size, a->alignment, "scratch");
  if (a->data == nullptr)
    return make_error(XLA_FFI_Error_Code_RESOURCE_EXHAUSTED,
                      "could not allocate " + std::to_string(a->size) + " bytes of scratch");
  ctx->scratch_bytes += static_cast<int64_t>(a->size);
  ctx->scratch_live += 1;
  return nullptr;
}

XLA_FFI_Error* memory_free(XLA_FFI_DeviceMemory_Free_Args* a) {
  if (flashgen_emu_device_free(a->data) != 0)
    return make_error(XLA_FFI_Error_Code_INVALID_ARGUMENT, "free of memory the host did not allocate");
  a->ctx->scratch_live -= 1;
  return nullptr;
}

XLA_FFI_Api make_api() {
  XLA_FFI_Api api = flashgen::host::base_api();
  api.XLA_FFI_Stream_Get = stream_get;
  api.XLA_FFI_DeviceMemory_Allocate = memory_allocate;
  api.XLA_FFI_DeviceMemory_Free = memory_free;
  api.XLA_FFI_RunId_Get = run_id_get;
  api.XLA_FFI_DeviceOrdinal_Get = device_ordinal_get;
  return api;
}

const XLA_FFI_Api* api() {
  static const XLA_FFI_Api a = make_api();
  return &a;
}

void copy_message(const std::string& text, char* out, size_t out_len) {
  if (out == nullptr || out_len == 0) return;
  const size_t n = std::min(text.size(), out_len - 1);
  std::memcpy(out, text.data(), n);
  out[n] = '\0';
}

}  // namespace

extern "C" {

// One operand or result.
struct FlashgenEmuBuffer {
  int32_t dtype;  // XLA_FFI_DataType
  void* data;
  int64_t rank;
  int64_t* dims;
};

enum FlashgenEmuAttrKind { FLASHGEN_EMU_BOOL = 0, FLASHGEN_EMU_I32 = 1, FLASHGEN_EMU_F32 = 2, FLASHGEN_EMU_STRING = 3 };

struct FlashgenEmuAttr {
  const char* name;
  int32_t kind;
  int32_t i32;  // BOOL (0/1) and I32
  float f32;
  const char* str;  // STRING, str_len bytes
  size_t str_len;
};

// Calls `handler` at the execute stage. Returns the XLA error code (0 = OK);
// on error, `message` receives the handler's message. `scratch_limit` < 0 is
// unlimited; `scratch_bytes` (if not null) receives what the handler allocated.
FLASHGEN_EMU_EXPORT int flashgen_emu_call(XLA_FFI_Handler* handler, FlashgenEmuBuffer* args, int64_t num_args,
                                          FlashgenEmuBuffer* rets, int64_t num_rets, const FlashgenEmuAttr* attrs,
                                          int64_t num_attrs, int64_t scratch_limit, int64_t* scratch_bytes,
                                          char* message, size_t message_len) {
  auto buffers = [](const FlashgenEmuBuffer* in, int64_t n) {
    std::vector<flashgen::host::Buffer> out(n);
    for (int64_t i = 0; i < n; ++i)
      out[i] = {static_cast<XLA_FFI_DataType>(in[i].dtype), in[i].data, in[i].rank, in[i].dims};
    return out;
  };
  const std::vector<flashgen::host::Buffer> arg_bufs = buffers(args, num_args), ret_bufs = buffers(rets, num_rets);
  std::vector<flashgen::host::Attr> host_attrs(num_attrs);
  for (int64_t i = 0; i < num_attrs; ++i) {
    const FlashgenEmuAttr& a = attrs[i];
    flashgen::host::Attr& h = host_attrs[i];
    h.name = a.name;
    switch (a.kind) {
      case FLASHGEN_EMU_BOOL: h.type = XLA_FFI_DataType_PRED; h.i32 = a.i32; break;
      case FLASHGEN_EMU_I32: h.type = XLA_FFI_DataType_S32; h.i32 = a.i32; break;
      case FLASHGEN_EMU_F32: h.type = XLA_FFI_DataType_F32; h.f32 = a.f32; break;
      case FLASHGEN_EMU_STRING: h.type = XLA_FFI_DataType_INVALID; h.str = std::string_view(a.str, a.str_len); break;
      default:
        copy_message("attribute " + std::string(a.name) + " has an unknown kind", message, message_len);
        return XLA_FFI_Error_Code_INVALID_ARGUMENT;
    }
  }

  XLA_FFI_ExecutionContext ctx{scratch_limit, 0, 0};
  flashgen::host::CallFrame frame(api(), &ctx, arg_bufs.data(), num_args, ret_bufs.data(), num_rets,
                                  host_attrs.data(), num_attrs);
  std::string error;
  const int code = flashgen::host::call(handler, frame, &error);
  if (scratch_bytes != nullptr) *scratch_bytes = ctx.scratch_bytes;
  if (code == XLA_FFI_Error_Code_OK && ctx.scratch_live != 0) {
    copy_message("the handler returned with " + std::to_string(ctx.scratch_live) + " scratch allocations live",
                 message, message_len);
    return XLA_FFI_Error_Code_INTERNAL;
  }
  if (code != XLA_FFI_Error_Code_OK) copy_message(error, message, message_len);
  return code;
}

}  // extern "C"
