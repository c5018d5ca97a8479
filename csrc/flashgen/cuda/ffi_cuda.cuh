// XLA FFI handler implementations for the CUDA kernels, as templates on
// (dtype, head dim, causal). The generated spec TU (templates/cuda/spec.cu.j2)
// binds them with XLA_FFI_DEFINE_HANDLER_SYMBOL.
//
// Contract: every operand and result shape and every attribute is validated
// (ffi_common.h) before anything runs; work is enqueued on the given stream
// only (no host synchronization, no cudaMalloc: workspaces come from
// ffi::ScratchAllocator); every CUDA return code is checked and turned into
// ffi::Error::Internal with cudaGetErrorString.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "flashgen/attention.h"
#include "flashgen/cuda/bwd.cuh"
#include "flashgen/cuda/fwd.cuh"
#include "flashgen/ffi_common.h"
#include "xla/ffi/api/ffi.h"

namespace flashgen {
namespace cuda {
namespace {

namespace ffi = xla::ffi;

template <ffi::DataType DT>
struct ElemOf;
template <>
struct ElemOf<ffi::DataType::F16> {
  using type = __half;
};
template <>
struct ElemOf<ffi::DataType::BF16> {
  using type = __nv_bfloat16;
};
template <>
struct ElemOf<ffi::DataType::F32> {
  using type = float;
};

inline ffi::Error cuda_failure(const char* target, const std::string& what, cudaError_t err) {
  return ffi::Error::Internal(std::string(target) + ": " + what + " failed: " + cudaGetErrorName(err) + ": " +
                              cudaGetErrorString(err));
}

// Kernels index sequence positions with int and launch heads / batch on grid
// dimensions y / z; refuse what does not fit instead of overflowing.
inline ffi::Error check_limits(const char* target, const AttentionShape& s) {
  constexpr int64_t kMaxSeq = int64_t{1} << 30;
  constexpr int64_t kMaxGridYZ = 65535;
  if (s.seqlen_q > kMaxSeq || s.seqlen_k > kMaxSeq)
    return invalid(target, "sequence lengths above 2^30 are not supported (seqlen_q=" +
                               std::to_string(s.seqlen_q) + ", seqlen_k=" + std::to_string(s.seqlen_k) + ")");
  if (s.heads_q > kMaxGridYZ || s.batch > kMaxGridYZ)
    return invalid(target, "batch and heads must be <= 65535 (batch=" + std::to_string(s.batch) +
                               ", heads_q=" + std::to_string(s.heads_q) + ")");
  return ffi::Error::Success();
}

// cp.async and the vector stores need 16-byte aligned tensors (XLA's buffers
// always are; a sliced buffer from a hand-written module might not be).
inline ffi::Error check_aligned(const char* target, const char* name, const void* ptr) {
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0)
    return invalid(target, std::string(name) + " is not 16-byte aligned");
  return ffi::Error::Success();
}

// The visible band (attention.h) clamped to +-(2^30 + 1): after check_limits
// every j - i lies strictly inside, so the clamp changes no mask and fits int.
template <class Params>
inline void set_band(Params& p, const AttentionShape& s, const AttentionAttrs& a) {
  constexpr int64_t kLim = (int64_t{1} << 30) + 1;
  const VisibleBand band = visible_band(s, a);
  p.band_lo = static_cast<int>(band.lo < -kLim ? -kLim : (band.lo > kLim ? kLim : band.lo));
  p.band_hi = static_cast<int>(band.hi < -kLim ? -kLim : (band.hi > kLim ? kLim : band.hi));
  p.masked = band_masks_anything(s, band) ? 1 : 0;
  p.softcap = a.softcap;
  p.cap_in = a.softcap > 0.f ? a.scale / a.softcap : 0.f;
}

inline void set_cap_out(BwdParams& p) { p.cap_out = p.softcap > 0.f ? 1.f / (p.softcap * kLog2e) : 0.f; }

inline ffi::Error memset_async(const char* target, const char* name, void* ptr, size_t bytes,
                               cudaStream_t stream, int value = 0) {
  if (bytes == 0) return ffi::Error::Success();
  cudaError_t err = cudaMemsetAsync(ptr, value, bytes, stream);
  if (err != cudaSuccess) return cuda_failure(target, std::string("cudaMemsetAsync(") + name + ")", err);
  return ffi::Error::Success();
}

// FLASHGEN_POISON=1 (tests): fill the outputs with 0xFF bytes (NaN) before the
// kernels run, so that an element a kernel forgets to write shows up.
template <class... Results>
ffi::Error poison_async(const char* target, cudaStream_t stream, Results&... results) {
  if (!poison_outputs()) return ffi::Error::Success();
  ffi::Error err = ffi::Error::Success();
  ((err.success() ? (void)(err = memset_async(target, "poison", results->untyped_data(), results->size_bytes(),
                                               stream, 0xFF))
                  : (void)0),
   ...);
  return err;
}

template <class Kernel>
ffi::Error set_smem(const char* target, Kernel kernel, size_t bytes) {
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err != cudaSuccess)
    return cuda_failure(target, "cudaFuncSetAttribute(MaxDynamicSharedMemorySize=" + std::to_string(bytes) + ")",
                        err);
  return ffi::Error::Success();
}

inline ffi::Error check_launch(const char* target, const char* kernel) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return cuda_failure(target, std::string("launch of ") + kernel, err);
  return ffi::Error::Success();
}

inline unsigned grid_for(int64_t work_items, int per_block) {
  int64_t blocks = (work_items + per_block - 1) / per_block;
  if (blocks < 1) blocks = 1;
  if (blocks > 65535 * 16) blocks = 65535 * 16;  // grid-stride loops cover the rest
  return static_cast<unsigned>(blocks);
}

// ---------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------
template <ffi::DataType DT, int D, bool CAUSAL>
ffi::Error cuda_fwd(const char* target, cudaStream_t stream, ffi::Buffer<DT> q, ffi::Buffer<DT> k,
                    ffi::Buffer<DT> v, ffi::ResultBuffer<DT> o, ffi::ResultBuffer<ffi::F32> lse, bool causal,
                    float scale, bool bottom_right, int32_t window_left = -1, int32_t window_right = -1,
                    float softcap = 0.0f) {
  using T = typename ElemOf<DT>::type;
  using Cfg = FwdConfig<T, D>;

  auto shape_or = shape_from_qkv(target, D, q.dimensions(), k.dimensions(), v.dimensions());
  if (shape_or.has_error()) return shape_or.error();
  const AttentionShape s = shape_or.value();
  const AttentionAttrs attrs{scale, causal, bottom_right, window_left, window_right, softcap};
  if (auto e = check_attrs(target, CAUSAL, attrs); e.failure()) return e;
  if (auto e = expect_dims(target, "o", o->dimensions(), {s.batch, s.seqlen_q, s.heads_q, s.head_dim}); e.failure())
    return e;
  if (auto e = expect_dims(target, "lse", lse->dimensions(), {s.batch, s.heads_q, s.seqlen_q}); e.failure())
    return e;

  // Nothing to write when o / lse are empty. (seqlen_k == 0 with rows present
  // is handled by the kernel: o = 0, lse = -inf.)
  if (s.batch == 0 || s.seqlen_q == 0 || s.heads_q == 0) return ffi::Error::Success();
  if (auto e = check_limits(target, s); e.failure()) return e;
  if (auto e = check_aligned(target, "q", q.untyped_data()); e.failure()) return e;
  if (auto e = check_aligned(target, "o", o->untyped_data()); e.failure()) return e;
  if (s.seqlen_k > 0) {
    if (auto e = check_aligned(target, "k", k.untyped_data()); e.failure()) return e;
    if (auto e = check_aligned(target, "v", v.untyped_data()); e.failure()) return e;
  }
  if (auto e = poison_async(target, stream, o, lse); e.failure()) return e;

  FwdParams p;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.o = o->untyped_data();
  p.lse = lse->typed_data();
  p.batch = static_cast<int>(s.batch);
  p.seqlen_q = static_cast<int>(s.seqlen_q);
  p.seqlen_k = static_cast<int>(s.seqlen_k);
  p.heads_q = static_cast<int>(s.heads_q);
  p.heads_kv = static_cast<int>(s.heads_kv);
  p.group = static_cast<int>(s.heads_q / s.heads_kv);
  set_band(p, s, attrs);
  p.scale = scale;
  p.scale_log2 = scale * kLog2e;

  auto kernel = flash_fwd_kernel<T, D, CAUSAL>;
  if (auto e = set_smem(target, kernel, Cfg::kSmem); e.failure()) return e;
  const dim3 grid(static_cast<unsigned>((s.seqlen_q + Cfg::BR - 1) / Cfg::BR), static_cast<unsigned>(s.heads_q),
                  static_cast<unsigned>(s.batch));
  kernel<<<grid, Cfg::kThreads, Cfg::kSmem, stream>>>(p);
  return check_launch(target, "flash_fwd_kernel");
}

// ---------------------------------------------------------------------------
// backward
// ---------------------------------------------------------------------------
template <ffi::DataType DT, int D, bool CAUSAL>
ffi::Error cuda_bwd(const char* target, cudaStream_t stream, ffi::ScratchAllocator& scratch, ffi::Buffer<DT> q,
                    ffi::Buffer<DT> k, ffi::Buffer<DT> v, ffi::Buffer<DT> o, ffi::Buffer<ffi::F32> lse,
                    ffi::Buffer<DT> dout, ffi::ResultBuffer<DT> dq, ffi::ResultBuffer<DT> dk,
                    ffi::ResultBuffer<DT> dv, bool causal, float scale, bool bottom_right, int32_t window_left = -1,
                    int32_t window_right = -1, float softcap = 0.0f) {
  using T = typename ElemOf<DT>::type;
  using Cfg = BwdConfig<T, D>;
  constexpr bool kF32 = std::is_same<T, float>::value;

  auto shape_or = shape_from_qkv(target, D, q.dimensions(), k.dimensions(), v.dimensions());
  if (shape_or.has_error()) return shape_or.error();
  const AttentionShape s = shape_or.value();
  const AttentionAttrs attrs{scale, causal, bottom_right, window_left, window_right, softcap};
  if (auto e = check_attrs(target, CAUSAL, attrs); e.failure()) return e;
  if (auto e = check_bwd_operands(target, s, o.dimensions(), lse.dimensions(), dout.dimensions()); e.failure())
    return e;
  if (auto e = expect_dims(target, "dq", dq->dimensions(), {s.batch, s.seqlen_q, s.heads_q, s.head_dim});
      e.failure())
    return e;
  if (auto e = expect_dims(target, "dk", dk->dimensions(), {s.batch, s.seqlen_k, s.heads_kv, s.head_dim});
      e.failure())
    return e;
  if (auto e = expect_dims(target, "dv", dv->dimensions(), {s.batch, s.seqlen_k, s.heads_kv, s.head_dim});
      e.failure())
    return e;

  const size_t q_elems = static_cast<size_t>(s.batch * s.seqlen_q * s.heads_q * s.head_dim);
  const size_t kv_elems = static_cast<size_t>(s.batch * s.seqlen_k * s.heads_kv * s.head_dim);

  if (auto e = poison_async(target, stream, dq, dk, dv); e.failure()) return e;

  // Degenerate shapes: no (query, key) pair exists, every gradient is 0.
  if (q_elems == 0 || kv_elems == 0) {
    if (auto e = memset_async(target, "dq", dq->untyped_data(), q_elems * sizeof(T), stream); e.failure()) return e;
    if (auto e = memset_async(target, "dk", dk->untyped_data(), kv_elems * sizeof(T), stream); e.failure())
      return e;
    return memset_async(target, "dv", dv->untyped_data(), kv_elems * sizeof(T), stream);
  }
  if (auto e = check_limits(target, s); e.failure()) return e;
  {
    const char* names[] = {"q", "k", "v", "o", "do", "dq", "dk", "dv"};
    const void* ptrs[] = {q.untyped_data(),  k.untyped_data(),   v.untyped_data(),   o.untyped_data(),
                          dout.untyped_data(), dq->untyped_data(), dk->untyped_data(), dv->untyped_data()};
    for (int i = 0; i < 8; ++i)
      if (auto e = check_aligned(target, names[i], ptrs[i]); e.failure()) return e;
  }

  const int group = static_cast<int>(s.heads_q / s.heads_kv);
  const bool atomic_kv = group > 1;
  const size_t rows_q = static_cast<size_t>(s.batch * s.heads_q * s.seqlen_q);

  // Workspace: Dsum [B,Hq,Sq] f32; for f16/bf16 also dQ f32 [B,Sq,Hq,D] and,
  // under GQA, dK/dV f32 [B,Sk,Hkv,D]. For f32 the outputs themselves are the
  // accumulators.
  auto round_up = [](size_t x) { return (x + 255) / 256 * 256; };
  const size_t dsum_bytes = round_up(rows_q * sizeof(float));
  const size_t dq_ws_bytes = kF32 ? 0 : round_up(q_elems * sizeof(float));
  const size_t kv_ws_bytes = (kF32 || !atomic_kv) ? 0 : round_up(kv_elems * sizeof(float));
  const size_t ws_bytes = dsum_bytes + dq_ws_bytes + 2 * kv_ws_bytes;
  auto ws = scratch.Allocate(ws_bytes, 256);
  if (!ws.has_value() || *ws == nullptr)
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      std::string(target) + ": could not allocate " + std::to_string(ws_bytes) +
                          " bytes of scratch memory for the backward workspace");
  char* wsp = static_cast<char*>(*ws);
  float* dsum = reinterpret_cast<float*>(wsp);
  float* dq_acc = kF32 ? reinterpret_cast<float*>(dq->untyped_data()) : reinterpret_cast<float*>(wsp + dsum_bytes);
  float* dk_acc = nullptr;
  float* dv_acc = nullptr;
  if (atomic_kv) {
    dk_acc = kF32 ? reinterpret_cast<float*>(dk->untyped_data())
                  : reinterpret_cast<float*>(wsp + dsum_bytes + dq_ws_bytes);
    dv_acc = kF32 ? reinterpret_cast<float*>(dv->untyped_data())
                  : reinterpret_cast<float*>(wsp + dsum_bytes + dq_ws_bytes + kv_ws_bytes);
  }

  if (auto e = memset_async(target, "dq accumulator", dq_acc, q_elems * sizeof(float), stream); e.failure())
    return e;
  if (atomic_kv) {
    if (auto e = memset_async(target, "dk accumulator", dk_acc, kv_elems * sizeof(float), stream); e.failure())
      return e;
    if (auto e = memset_async(target, "dv accumulator", dv_acc, kv_elems * sizeof(float), stream); e.failure())
      return e;
  }

  // 1. Dsum = rowsum(dO * O)
  {
    const int64_t rows = static_cast<int64_t>(rows_q);
    constexpr int kCpr = D * static_cast<int>(sizeof(T)) / 16;
    constexpr int kLanes = kCpr >= 32 ? 32 : (kCpr >= 16 ? 16 : (kCpr >= 8 ? 8 : 4));
    const int rows_per_block = 256 / kLanes;
    flash_bwd_pre_kernel<T, D><<<grid_for(rows, rows_per_block), 256, 0, stream>>>(
        static_cast<const T*>(o.untyped_data()), static_cast<const T*>(dout.untyped_data()), dsum, rows,
        static_cast<int>(s.seqlen_q), static_cast<int>(s.heads_q));
    if (auto e = check_launch(target, "flash_bwd_pre_kernel"); e.failure()) return e;
  }

  // 2. main kernel
  {
    BwdParams p;
    p.q = q.untyped_data();
    p.k = k.untyped_data();
    p.v = v.untyped_data();
    p.dout = dout.untyped_data();
    p.lse = lse.typed_data();
    p.dsum = dsum;
    p.dq_acc = dq_acc;
    p.dk_acc = dk_acc;
    p.dv_acc = dv_acc;
    p.dk = dk->untyped_data();
    p.dv = dv->untyped_data();
    p.batch = static_cast<int>(s.batch);
    p.seqlen_q = static_cast<int>(s.seqlen_q);
    p.seqlen_k = static_cast<int>(s.seqlen_k);
    p.heads_q = static_cast<int>(s.heads_q);
    p.heads_kv = static_cast<int>(s.heads_kv);
    p.group = group;
    set_band(p, s, attrs);
    set_cap_out(p);
    p.scale = scale;
    p.scale_log2 = scale * kLog2e;
    p.atomic_kv = atomic_kv ? 1 : 0;

    auto kernel = flash_bwd_kernel<T, D, CAUSAL>;
    if (auto e = set_smem(target, kernel, Cfg::kSmem); e.failure()) return e;
    const dim3 grid(static_cast<unsigned>((s.seqlen_k + Cfg::BC - 1) / Cfg::BC * Cfg::NSPLIT),
                    static_cast<unsigned>(s.heads_q), static_cast<unsigned>(s.batch));
    kernel<<<grid, Cfg::kThreads, Cfg::kSmem, stream>>>(p);
    if (auto e = check_launch(target, "flash_bwd_kernel"); e.failure()) return e;
  }

  // 3. f32 accumulators -> output dtype
  if constexpr (!kF32) {
    auto convert = [&](const float* src, void* dst, size_t n, const char* what) -> ffi::Error {
      flash_bwd_convert_kernel<T><<<grid_for(static_cast<int64_t>(n / 4), 256), 256, 0, stream>>>(
          src, static_cast<T*>(dst), static_cast<int64_t>(n));
      return check_launch(target, what);
    };
    if (auto e = convert(dq_acc, dq->untyped_data(), q_elems, "flash_bwd_convert_kernel(dq)"); e.failure())
      return e;
    if (atomic_kv) {
      if (auto e = convert(dk_acc, dk->untyped_data(), kv_elems, "flash_bwd_convert_kernel(dk)"); e.failure())
        return e;
      if (auto e = convert(dv_acc, dv->untyped_data(), kv_elems, "flash_bwd_convert_kernel(dv)"); e.failure())
        return e;
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cuda
}  // namespace flashgen
