// Calling flashgen's XLA FFI handlers without XLA: the call frame XLA would
// build for one custom call (buffers, attributes sorted by name, the execute
// stage) and the part of the XLA FFI API every such host provides alike
// (errors; everything else refused until the host fills it in). Hosts: the
// emulator's (flashgen/emulate/ffi_host_emu.cc) and the BEAM's (nif_face.h).
// Each host defines its own struct XLA_FFI_ExecutionContext.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "xla/ffi/api/c_api.h"

struct XLA_FFI_Error {
  XLA_FFI_Error_Code code;
  std::string message;
};

namespace flashgen::host {

inline XLA_FFI_Error* make_error(XLA_FFI_Error_Code code, std::string message) {
  return new XLA_FFI_Error{code, std::move(message)};
}

namespace detail {
inline XLA_FFI_Error* unsupported(const char* what) {
  return make_error(XLA_FFI_Error_Code_UNIMPLEMENTED, std::string(what) + " is not provided by this host");
}
inline XLA_FFI_Error* error_create(XLA_FFI_Error_Create_Args* a) {
  return make_error(a->errc, a->message != nullptr ? a->message : "");
}
inline void error_get_message(XLA_FFI_Error_GetMessage_Args* a) { a->message = a->error->message.c_str(); }
inline void error_destroy(XLA_FFI_Error_Destroy_Args* a) { delete a->error; }
}  // namespace detail

// Errors work; every other entry refuses with UNIMPLEMENTED (a host sets the ones it has).
inline XLA_FFI_Api base_api() {
  using detail::unsupported;
  XLA_FFI_Api api;
  std::memset(&api, 0, sizeof(api));
  api.struct_size = XLA_FFI_Api_STRUCT_SIZE;
  api.api_version = {XLA_FFI_Api_Version_STRUCT_SIZE, nullptr, XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR};
  api.XLA_FFI_Error_Create = detail::error_create;
  api.XLA_FFI_Error_GetMessage = detail::error_get_message;
  api.XLA_FFI_Error_Destroy = detail::error_destroy;
  api.XLA_FFI_Handler_Register = [](XLA_FFI_Handler_Register_Args*) { return unsupported("handler registration"); };
  api.XLA_FFI_Stream_Get = [](XLA_FFI_Stream_Get_Args*) { return unsupported("a stream"); };
  api.XLA_FFI_Type_Register = [](XLA_FFI_Type_Register_Args*) { return unsupported("type registration"); };
  api.XLA_FFI_ExecutionContext_Get = [](XLA_FFI_ExecutionContext_Get_Args*) { return unsupported("user data"); };
  api.XLA_FFI_State_Set = [](XLA_FFI_State_Set_Args*) { return unsupported("handler state"); };
  api.XLA_FFI_State_Get = [](XLA_FFI_State_Get_Args*) { return unsupported("handler state"); };
  api.XLA_FFI_DeviceMemory_Allocate = [](XLA_FFI_DeviceMemory_Allocate_Args*) { return unsupported("scratch memory"); };
  api.XLA_FFI_DeviceMemory_Free = [](XLA_FFI_DeviceMemory_Free_Args*) { return unsupported("scratch memory"); };
  api.XLA_FFI_ThreadPool_Schedule = [](XLA_FFI_ThreadPool_Schedule_Args*) { return unsupported("the thread pool"); };
  api.XLA_FFI_ThreadPool_NumThreads = [](XLA_FFI_ThreadPool_NumThreads_Args*) {
    return unsupported("the thread pool");
  };
  api.XLA_FFI_Future_Create = [](XLA_FFI_Future_Create_Args*) { return unsupported("futures"); };
  api.XLA_FFI_Future_SetAvailable = [](XLA_FFI_Future_SetAvailable_Args*) { return unsupported("futures"); };
  api.XLA_FFI_Future_SetError = [](XLA_FFI_Future_SetError_Args*) { return unsupported("futures"); };
  api.XLA_FFI_RunId_Get = [](XLA_FFI_RunId_Get_Args*) { return unsupported("the run id"); };
  api.XLA_FFI_DeviceOrdinal_Get = [](XLA_FFI_DeviceOrdinal_Get_Args*) { return unsupported("the device ordinal"); };
  return api;
}

// One operand or result.
struct Buffer {
  XLA_FFI_DataType dtype;
  void* data;
  int64_t rank;
  int64_t* dims;
};

// One attribute: a scalar (PRED, S32 or F32) or a string.
struct Attr {
  std::string_view name;
  XLA_FFI_DataType type;  // PRED, S32, F32, or XLA_FFI_DataType_INVALID for a string
  int32_t i32 = 0;        // PRED (0/1) and S32
  float f32 = 0.0f;
  std::string_view str;
};

// The frame of one call and everything it points into; valid while this object lives.
class CallFrame {
 public:
  CallFrame(const XLA_FFI_Api* api, XLA_FFI_ExecutionContext* ctx, const Buffer* args, int64_t num_args,
            const Buffer* rets, int64_t num_rets, const Attr* attrs, int64_t num_attrs)
      : arg_bufs_(num_args), ret_bufs_(num_rets), arg_ptrs_(num_args), ret_ptrs_(num_rets),
        arg_types_(num_args, XLA_FFI_ArgType_BUFFER), ret_types_(num_rets, XLA_FFI_RetType_BUFFER),
        attrs_(attrs, attrs + num_attrs), names_(num_attrs), strings_(num_attrs), name_ptrs_(num_attrs),
        scalars_(num_attrs), bools_(num_attrs), attr_types_(num_attrs), attr_ptrs_(num_attrs) {
    auto fill = [](const Buffer& in, XLA_FFI_Buffer& out) {
      out = XLA_FFI_Buffer{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, in.dtype, in.data, in.rank, in.dims};
    };
    for (int64_t i = 0; i < num_args; ++i) {
      fill(args[i], arg_bufs_[i]);
      arg_ptrs_[i] = &arg_bufs_[i];
    }
    for (int64_t i = 0; i < num_rets; ++i) {
      fill(rets[i], ret_bufs_[i]);
      ret_ptrs_[i] = &ret_bufs_[i];
    }
    // XLA passes attributes sorted by name; the handler's decoder relies on it.
    std::sort(attrs_.begin(), attrs_.end(), [](const Attr& a, const Attr& b) { return a.name < b.name; });
    for (int64_t i = 0; i < num_attrs; ++i) {
      Attr& a = attrs_[i];
      names_[i] = XLA_FFI_ByteSpan{a.name.data(), a.name.size()};
      name_ptrs_[i] = &names_[i];
      if (a.type == XLA_FFI_DataType_INVALID) {
        strings_[i] = XLA_FFI_ByteSpan{a.str.data(), a.str.size()};
        attr_types_[i] = XLA_FFI_AttrType_STRING;
        attr_ptrs_[i] = &strings_[i];
        continue;
      }
      bools_[i] = a.i32 != 0;
      void* value = a.type == XLA_FFI_DataType_PRED  ? static_cast<void*>(&bools_[i])
                    : a.type == XLA_FFI_DataType_S32 ? static_cast<void*>(&a.i32)
                                                     : static_cast<void*>(&a.f32);
      scalars_[i] = XLA_FFI_Scalar{a.type, value};
      attr_types_[i] = XLA_FFI_AttrType_SCALAR;
      attr_ptrs_[i] = &scalars_[i];
    }
    std::memset(&frame_, 0, sizeof(frame_));
    frame_.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
    frame_.api = api;
    frame_.ctx = ctx;
    frame_.stage = XLA_FFI_ExecutionStage_EXECUTE;
    frame_.args = XLA_FFI_Args{XLA_FFI_Args_STRUCT_SIZE, nullptr, num_args, arg_types_.data(), arg_ptrs_.data()};
    frame_.rets = XLA_FFI_Rets{XLA_FFI_Rets_STRUCT_SIZE, nullptr, num_rets, ret_types_.data(), ret_ptrs_.data()};
    frame_.attrs = XLA_FFI_Attrs{XLA_FFI_Attrs_STRUCT_SIZE, nullptr, num_attrs, attr_types_.data(),
                                 name_ptrs_.data(), attr_ptrs_.data()};
  }
  CallFrame(const CallFrame&) = delete;
  CallFrame& operator=(const CallFrame&) = delete;

  XLA_FFI_CallFrame* get() { return &frame_; }

 private:
  std::vector<XLA_FFI_Buffer> arg_bufs_, ret_bufs_;
  std::vector<void*> arg_ptrs_, ret_ptrs_;
  std::vector<XLA_FFI_ArgType> arg_types_;
  std::vector<XLA_FFI_RetType> ret_types_;
  std::vector<Attr> attrs_;
  std::vector<XLA_FFI_ByteSpan> names_, strings_;
  std::vector<XLA_FFI_ByteSpan*> name_ptrs_;
  std::vector<XLA_FFI_Scalar> scalars_;
  std::vector<uint8_t> bools_;
  std::vector<XLA_FFI_AttrType> attr_types_;
  std::vector<void*> attr_ptrs_;
  XLA_FFI_CallFrame frame_;
};

// Runs `handler` on a frame; returns the XLA error code (0 = OK) and, on error, its message.
inline int call(XLA_FFI_Handler* handler, CallFrame& frame, std::string* message) {
  XLA_FFI_Error* err = handler(frame.get());
  if (err == nullptr) return XLA_FFI_Error_Code_OK;
  const int code = err->code;
  *message = std::move(err->message);
  delete err;
  return code;
}

}  // namespace flashgen::host
