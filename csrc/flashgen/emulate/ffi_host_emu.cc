// A minimal XLA FFI host: builds the call frame XLA would build for one
// custom call (buffers, attributes sorted by name, the execute stage) and
// provides the API functions a flashgen CUDA handler uses: errors, the stream
// (cudart_emu.cc's one stream), and the scratch allocator (emulated device
// memory; an optional byte limit lets a test refuse scratch as XLA may).
// flashgen/emulate/host.py calls flashgen_emu_call through ctypes.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "flashgen/emulate/emu_runtime.h"
#include "xla/ffi/api/c_api.h"

struct XLA_FFI_Error {
  XLA_FFI_Error_Code code;
  std::string message;
};

// The execution context of one call.
struct XLA_FFI_ExecutionContext {
  int64_t scratch_limit;  // bytes; < 0: unlimited
  int64_t scratch_bytes;  // allocated so far (what the handler asked for)
  int64_t scratch_live;   // allocations not yet freed
};

namespace {

XLA_FFI_Error* make_error(XLA_FFI_Error_Code code, std::string message) {
  return new XLA_FFI_Error{code, std::move(message)};
}

XLA_FFI_Error* unsupported(const char* what) {
  return make_error(XLA_FFI_Error_Code_UNIMPLEMENTED, std::string(what) + " is not provided by the emulated host");
}

XLA_FFI_Error* error_create(XLA_FFI_Error_Create_Args* a) {
  return make_error(a->errc, a->message != nullptr ? a->message : "");
}
void error_get_message(XLA_FFI_Error_GetMessage_Args* a) { a->message = a->error->message.c_str(); }
void error_destroy(XLA_FFI_Error_Destroy_Args* a) { delete a->error; }
XLA_FFI_Error* handler_register(XLA_FFI_Handler_Register_Args*) { return unsupported("handler registration"); }
XLA_FFI_Error* type_register(XLA_FFI_Type_Register_Args*) { return unsupported("type registration"); }
XLA_FFI_Error* context_get(XLA_FFI_ExecutionContext_Get_Args*) { return unsupported("user data"); }
XLA_FFI_Error* state_set(XLA_FFI_State_Set_Args*) { return unsupported("handler state"); }
XLA_FFI_Error* state_get(XLA_FFI_State_Get_Args*) { return unsupported("handler state"); }
XLA_FFI_Error* thread_pool_schedule(XLA_FFI_ThreadPool_Schedule_Args*) { return unsupported("the thread pool"); }
XLA_FFI_Error* thread_pool_threads(XLA_FFI_ThreadPool_NumThreads_Args*) { return unsupported("the thread pool"); }
XLA_FFI_Error* future_create(XLA_FFI_Future_Create_Args*) { return unsupported("futures"); }
XLA_FFI_Error* future_available(XLA_FFI_Future_SetAvailable_Args*) { return unsupported("futures"); }
XLA_FFI_Error* future_error(XLA_FFI_Future_SetError_Args*) { return unsupported("futures"); }

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
  XLA_FFI_Api api;
  std::memset(&api, 0, sizeof(api));
  api.struct_size = XLA_FFI_Api_STRUCT_SIZE;
  api.api_version = {XLA_FFI_Api_Version_STRUCT_SIZE, nullptr, XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR};
  api.XLA_FFI_Error_Create = error_create;
  api.XLA_FFI_Error_GetMessage = error_get_message;
  api.XLA_FFI_Error_Destroy = error_destroy;
  api.XLA_FFI_Handler_Register = handler_register;
  api.XLA_FFI_Stream_Get = stream_get;
  api.XLA_FFI_Type_Register = type_register;
  api.XLA_FFI_ExecutionContext_Get = context_get;
  api.XLA_FFI_State_Set = state_set;
  api.XLA_FFI_State_Get = state_get;
  api.XLA_FFI_DeviceMemory_Allocate = memory_allocate;
  api.XLA_FFI_DeviceMemory_Free = memory_free;
  api.XLA_FFI_ThreadPool_Schedule = thread_pool_schedule;
  api.XLA_FFI_ThreadPool_NumThreads = thread_pool_threads;
  api.XLA_FFI_Future_Create = future_create;
  api.XLA_FFI_Future_SetAvailable = future_available;
  api.XLA_FFI_Future_SetError = future_error;
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
  std::vector<XLA_FFI_Buffer> arg_bufs(num_args), ret_bufs(num_rets);
  std::vector<void*> arg_ptrs(num_args), ret_ptrs(num_rets);
  std::vector<XLA_FFI_ArgType> arg_types(num_args, XLA_FFI_ArgType_BUFFER);
  std::vector<XLA_FFI_RetType> ret_types(num_rets, XLA_FFI_RetType_BUFFER);
  auto fill = [](const FlashgenEmuBuffer& in, XLA_FFI_Buffer& out) {
    out = XLA_FFI_Buffer{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, static_cast<XLA_FFI_DataType>(in.dtype), in.data,
                         in.rank, in.dims};
  };
  for (int64_t i = 0; i < num_args; ++i) {
    fill(args[i], arg_bufs[i]);
    arg_ptrs[i] = &arg_bufs[i];
  }
  for (int64_t i = 0; i < num_rets; ++i) {
    fill(rets[i], ret_bufs[i]);
    ret_ptrs[i] = &ret_bufs[i];
  }

  // XLA passes attributes sorted by name; the handler's decoder relies on it.
  std::vector<const FlashgenEmuAttr*> sorted(num_attrs);
  for (int64_t i = 0; i < num_attrs; ++i) sorted[i] = &attrs[i];
  std::sort(sorted.begin(), sorted.end(),
            [](const FlashgenEmuAttr* a, const FlashgenEmuAttr* b) { return std::strcmp(a->name, b->name) < 0; });
  std::vector<XLA_FFI_ByteSpan> names(num_attrs), strings(num_attrs);
  std::vector<XLA_FFI_ByteSpan*> name_ptrs(num_attrs);
  std::vector<XLA_FFI_Scalar> scalars(num_attrs);
  std::vector<uint8_t> bools(num_attrs);
  std::vector<XLA_FFI_AttrType> attr_types(num_attrs);
  std::vector<void*> attr_ptrs(num_attrs);
  for (int64_t i = 0; i < num_attrs; ++i) {
    const FlashgenEmuAttr& a = *sorted[i];
    names[i] = XLA_FFI_ByteSpan{a.name, std::strlen(a.name)};
    name_ptrs[i] = &names[i];
    switch (a.kind) {
      case FLASHGEN_EMU_BOOL:
        bools[i] = a.i32 != 0;
        scalars[i] = XLA_FFI_Scalar{XLA_FFI_DataType_PRED, &bools[i]};
        break;
      case FLASHGEN_EMU_I32:
        scalars[i] = XLA_FFI_Scalar{XLA_FFI_DataType_S32, const_cast<int32_t*>(&a.i32)};
        break;
      case FLASHGEN_EMU_F32:
        scalars[i] = XLA_FFI_Scalar{XLA_FFI_DataType_F32, const_cast<float*>(&a.f32)};
        break;
      case FLASHGEN_EMU_STRING:
        strings[i] = XLA_FFI_ByteSpan{a.str, a.str_len};
        break;
      default:
        copy_message("attribute " + std::string(a.name) + " has an unknown kind", message, message_len);
        return XLA_FFI_Error_Code_INVALID_ARGUMENT;
    }
    attr_types[i] = a.kind == FLASHGEN_EMU_STRING ? XLA_FFI_AttrType_STRING : XLA_FFI_AttrType_SCALAR;
    attr_ptrs[i] = a.kind == FLASHGEN_EMU_STRING ? static_cast<void*>(&strings[i]) : static_cast<void*>(&scalars[i]);
  }

  XLA_FFI_ExecutionContext ctx{scratch_limit, 0, 0};
  XLA_FFI_CallFrame frame;
  std::memset(&frame, 0, sizeof(frame));
  frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  frame.api = api();
  frame.ctx = &ctx;
  frame.stage = XLA_FFI_ExecutionStage_EXECUTE;
  frame.args = XLA_FFI_Args{XLA_FFI_Args_STRUCT_SIZE, nullptr, num_args, arg_types.data(), arg_ptrs.data()};
  frame.rets = XLA_FFI_Rets{XLA_FFI_Rets_STRUCT_SIZE, nullptr, num_rets, ret_types.data(), ret_ptrs.data()};
  frame.attrs = XLA_FFI_Attrs{XLA_FFI_Attrs_STRUCT_SIZE, nullptr, num_attrs, attr_types.data(), name_ptrs.data(),
                              attr_ptrs.data()};

  XLA_FFI_Error* err = handler(&frame);
  if (scratch_bytes != nullptr) *scratch_bytes = ctx.scratch_bytes;
  if (err == nullptr && ctx.scratch_live != 0) {
    copy_message("the handler returned with " + std::to_string(ctx.scratch_live) + " scratch allocations live",
                 message, message_len);
    return XLA_FFI_Error_Code_INTERNAL;
  }
  if (err == nullptr) return XLA_FFI_Error_Code_OK;
  const int code = err->code;
  copy_message(err->message, message, message_len);
  delete err;
  return code;
}

}  // extern "C"
