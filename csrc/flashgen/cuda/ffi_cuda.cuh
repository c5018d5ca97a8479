// XLA FFI handlers of the CUDA kernels, as templates on (dtype, head dim,
// causal). The generated spec TU (templates/cuda/spec.cu.j2) binds Handler to
// each call's symbol; call.h decodes and validates the call; launch() here
// chooses the kernels: dense (no extras -> the unchanged fast-path kernels,
// else the extras kernels), varlen (packed batches) and paged (paged KV cache
// with split-KV), the last two with "" or "alibi" extras.
//
// Contract: work is enqueued on the given stream only (no host
// synchronization, no cudaMalloc: workspaces come from ffi::ScratchAllocator);
// every CUDA return code is checked and turned into ffi::Error::Internal with
// cudaGetErrorString.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "flashgen/attention.h"
#include "flashgen/cuda/bwd.cuh"
#include "flashgen/cuda/fwd.cuh"
#ifdef FLASHGEN_WGMMA_KERNELS
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include "flashgen/cuda/hopper/bwd.cuh"
#include "flashgen/cuda/hopper/fwd.cuh"
#endif
#include "flashgen/call.h"
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
template <>
struct ElemOf<ffi::DataType::F8E4M3FN> {
  using type = __nv_fp8_e4m3;
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
template <class Outs>
ffi::Error poison_async(const char* target, cudaStream_t stream, const Outs& outs) {
  if (!poison_outputs()) return ffi::Error::Success();
  for (const Out& r : outs)
    if (auto e = memset_async(target, "poison", r.data, r.bytes, stream, poison_byte()); e.failure()) return e;
  return ffi::Error::Success();
}

// The forward's launch preconditions: check_limits, 16-byte aligned q and o
// (and k, v when there are keys to read), then the poison fill of o and lse.
inline ffi::Error check_fwd_buffers(const char* target, cudaStream_t stream, const AttentionShape& s, const void* q,
                                    const void* k, const void* v, bool has_keys, const Out& o, const Out& lse,
                                    const char* k_name = "k", const char* v_name = "v") {
  if (auto e = check_limits(target, s); e.failure()) return e;
  if (auto e = check_aligned(target, "q", q); e.failure()) return e;
  if (auto e = check_aligned(target, "o", o.data); e.failure()) return e;
  if (has_keys) {
    if (auto e = check_aligned(target, k_name, k); e.failure()) return e;
    if (auto e = check_aligned(target, v_name, v); e.failure()) return e;
  }
  return poison_async(target, stream, std::array<Out, 2>{o, lse});
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

// Kernel-parameter form of the decoded extras.
inline ExtrasParams extras_params(const ScoreExtras& x, const AttentionShape& s, bool bottom_right) {
  ExtrasParams e{};
  e.alibi = x.alibi;
  e.alibi_stride_b = x.alibi_stride_b;
  e.bias = x.bias;
  e.bias_f32 = x.bias_type == ElemType::F32 ? 1 : 0;
  e.bias_stride_b = x.bias_stride_b;
  e.bias_stride_h = x.bias_stride_h;
  e.bias_stride_q = x.bias_stride_q;
  e.mask = x.mask;
  e.mask_stride_b = x.mask_stride_b;
  e.mask_stride_h = x.mask_stride_h;
  e.q_seg = x.q_segment_ids;
  e.kv_seg = x.kv_segment_ids;
  e.dbias_acc = nullptr;
  e.dbias_stride_b = x.bias_stride_b;
  e.dbias_stride_h = x.bias_stride_h;
  e.alibi_off = bottom_right ? static_cast<int>(s.seqlen_k - s.seqlen_q) : 0;
  return e;
}

template <class Params>
inline void set_raw_attrs(Params& p, const AttentionAttrs& a) {
  p.causal = a.causal ? 1 : 0;
  p.bottom_right = a.bottom_right ? 1 : 0;
  p.window_left = a.window_left;
  p.window_right = a.window_right;
}

inline ffi::Error alloc_scratch(const char* target, ffi::ScratchAllocator& scratch, size_t bytes, const char* what,
                                char** out) {
  *out = nullptr;
  if (bytes == 0) return ffi::Error::Success();
  auto ws = scratch.Allocate(bytes, 256);
  if (!ws.has_value() || *ws == nullptr)
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, std::string(target) + ": could not allocate " +
                                                              std::to_string(bytes) + " bytes of scratch memory for " +
                                                              what);
  *out = static_cast<char*>(*ws);
  return ffi::Error::Success();
}

inline size_t round_up256(size_t x) { return (x + 255) / 256 * 256; }

// ---------------------------------------------------------------------------
// forward (dense, dense + extras, varlen, paged) -- the launch
// ---------------------------------------------------------------------------
template <class T, int D>
inline void fill_fwd_params(FwdVarParams& p, const AttentionShape& s, const AttentionAttrs& attrs, const void* q,
                            const void* k, const void* v, void* o, float* lse) {
  p = FwdVarParams{};
  p.q = q;
  p.k = k;
  p.v = v;
  p.o = o;
  p.lse = lse;
  p.batch = static_cast<int>(s.batch);
  p.seqlen_q = static_cast<int>(s.seqlen_q);
  p.seqlen_k = static_cast<int>(s.seqlen_k);
  p.heads_q = static_cast<int>(s.heads_q);
  p.heads_kv = static_cast<int>(s.heads_kv);
  p.group = static_cast<int>(s.heads_q / s.heads_kv);
  set_band(p, s, attrs);
  set_raw_attrs(p, attrs);
  p.scale = attrs.scale;
  p.scale_log2 = attrs.scale * kLog2e;
  p.nsplit = 1;
}

template <class T, int D, bool CAUSAL, int MODE, int DV = D>
ffi::Error launch_fwd(const char* target, cudaStream_t stream, const FwdVarParams& vp, dim3 grid) {
  const FwdParamsT<MODE>& p = vp;  // the dense kernel takes the base part only
  using Cfg = FwdConfig<T, D, DV>;
  constexpr size_t kSmem = fwd_smem_bytes<T, D, DV, MODE>();
  auto kernel = flash_fwd_kernel<T, D, DV, CAUSAL, MODE>;
  if (auto e = set_smem(target, kernel, kSmem); e.failure()) return e;
  kernel<<<grid, Cfg::kThreads, kSmem, stream>>>(p);
  return check_launch(target, "flash_fwd_kernel");
}

#ifdef FLASHGEN_WGMMA_KERNELS
// The driver's cuTensorMapEncodeTiled, reached through the runtime (the library links no libcuda).
inline ffi::Error tensor_map_encoder(const char* target, PFN_cuTensorMapEncodeTiled_v12000* encode) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err =
      cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
  if (err != cudaSuccess) return cuda_failure(target, "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)", err);
  if (found != cudaDriverEntryPointSuccess || fn == nullptr)
    return ffi::Error::Internal(std::string(target) + ": the CUDA driver has no cuTensorMapEncodeTiled (query result " +
                                std::to_string(static_cast<int>(found)) + "; TMA needs a 12.0+ driver)");
  *encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  return ffi::Error::Success();
}

// The TMA map of a [batch][seq][heads][D] tensor of T moved in boxes of 64 columns x `box_rows`
// rows of one head (hopper/fwd.cuh's swizzled panels: 128-byte rows of 16-bit T, 64-byte rows of
// e4m3); rows past `seq` load as zeros and are not stored.
template <class T, int D>
ffi::Error encode_rows_map(const char* target, PFN_cuTensorMapEncodeTiled_v12000 encode, CUtensorMap* map,
                           const char* name, const void* data, int64_t batch, int64_t seq, int64_t heads,
                           int box_rows) {
  constexpr CUtensorMapDataType kType = std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                        : sizeof(T) == 1                ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                                                        : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  constexpr CUtensorMapSwizzle kSwizzle = sizeof(T) == 1 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B;
  const cuuint64_t dims[4] = {D, static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(seq),
                              static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {D * sizeof(T), heads * D * sizeof(T), seq * heads * D * sizeof(T)};
  const cuuint32_t box[4] = {sm90::kPanelCols, 1, static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, kType, 4, const_cast<void*>(data), dims, strides, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, kSwizzle,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return ffi::Error::Internal(std::string(target) + ": cuTensorMapEncodeTiled(" + name + ") failed with CUresult " +
                                std::to_string(static_cast<int>(r)));
  return ffi::Error::Success();
}

// Varlen: the maps hold the packed totals as one batch; `rows` = the longest sequence's rows (the
// grid's), blockIdx.z the sequence. Dense: rows = Sq. FP8: v and o get no map (the kernel moves
// them with plain loads and stores).
template <class T, int D, bool CAUSAL, bool VARLEN>
ffi::Error launch_hopper_fwd(const char* target, cudaStream_t stream, const HopperFwdParams<T, VARLEN>& p,
                             const AttentionShape& s, int64_t rows) {
  using Cfg = HopperFwdConfig;
  constexpr bool kMapsVO = !HopperFwdElem<T>::kFp8;
  constexpr size_t kSmem = Cfg::smem_bytes<T>(D);
  PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (auto e = tensor_map_encoder(target, &encode); e.failure()) return e;
  CUtensorMap map_q{}, map_k{}, map_v{}, map_o{};  // Sk == 0: no CTA loads a key block, k / v get no map
  auto rows_map = [&](CUtensorMap* map, const char* name, const void* data, int64_t seq, int64_t heads) {
    return encode_rows_map<T, D>(target, encode, map, name, data, VARLEN ? 1 : s.batch, seq, heads, Cfg::BC);  // BC == BM
  };
  ffi::Error e = rows_map(&map_q, "q", p.q, s.seqlen_q, s.heads_q);
  if (!e.failure() && kMapsVO) e = rows_map(&map_o, "o", p.o, s.seqlen_q, s.heads_q);
  if (!e.failure() && s.seqlen_k > 0) e = rows_map(&map_k, "k", p.k, s.seqlen_k, s.heads_kv);
  if (!e.failure() && s.seqlen_k > 0 && kMapsVO) e = rows_map(&map_v, "v", p.v, s.seqlen_k, s.heads_kv);
  if (e.failure()) return e;
  const dim3 grid(static_cast<unsigned>((rows + Cfg::BR - 1) / Cfg::BR), static_cast<unsigned>(s.heads_q),
                  static_cast<unsigned>(s.batch));
  auto kernel = hopper_fwd_kernel<T, D, CAUSAL, VARLEN>;
  if (e = set_smem(target, kernel, kSmem); e.failure()) return e;
  kernel<<<grid, Cfg::kThreads, kSmem, stream>>>(p, map_q, map_k, map_v, map_o);
  return check_launch(target, "hopper_fwd_kernel");
}

// key_rows: the longest sequence's keys (varlen; blockIdx.z the sequence), else Sk. DET: the
// deterministic kernel (Params = BwdVarParams with bwd_run's turn counters).
template <class T, int D, bool VARLEN, bool DET, class Params>
ffi::Error launch_hopper_bwd(const char* target, cudaStream_t stream, const Params& p, const AttentionShape& s,
                             int64_t key_rows) {
  using Cfg = HopperBwdConfig;
  constexpr size_t kSmem = Cfg::smem_bytes(D);
  const dim3 grid(static_cast<unsigned>((key_rows + Cfg::BC - 1) / Cfg::BC * Cfg::nsplit(D)),
                  static_cast<unsigned>(s.heads_q), static_cast<unsigned>(s.batch));
  auto kernel =
      p.softcap > 0.f ? hopper_bwd_kernel<T, D, true, VARLEN, DET> : hopper_bwd_kernel<T, D, false, VARLEN, DET>;
  if (auto e = set_smem(target, kernel, kSmem); e.failure()) return e;
  kernel<<<grid, Cfg::kThreads, kSmem, stream>>>(p);
  return check_launch(target, "hopper_bwd_kernel");
}
#endif

// ---------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------
template <ffi::DataType DT, int D, int DV, bool CAUSAL>
ffi::Error launch(const char* target, cudaStream_t stream, ffi::ScratchAllocator&, const FwdCall& c) {
  using T = typename ElemOf<DT>::type;
  using Cfg = FwdConfig<T, D, DV>;
  const AttentionShape& s = c.s;

  // Nothing to write when o / lse are empty. (seqlen_k == 0 with rows present
  // is handled by the kernel: o = 0, lse = -inf.)
  if (s.batch == 0 || s.seqlen_q == 0 || s.heads_q == 0) return ffi::Error::Success();
  if (auto e = check_fwd_buffers(target, stream, s, c.q, c.k, c.v, s.seqlen_k > 0, c.o, c.lse); e.failure()) return e;

  FwdVarParams p;
  fill_fwd_params<T, D>(p, s, c.attrs, c.q, c.k, c.v, c.o.data, static_cast<float*>(c.lse.data));
  const dim3 grid(static_cast<unsigned>((s.seqlen_q + Cfg::BR - 1) / Cfg::BR), static_cast<unsigned>(s.heads_q),
                  static_cast<unsigned>(s.batch));
#ifdef FLASHGEN_WGMMA_KERNELS
  if constexpr (kHopperFwdCompiles<T, D> && D == DV) {  // the wgmma kernel has one head dim
    if (hopper_fwd_supports(c))
      return launch_hopper_fwd<T, D, CAUSAL, false>(target, stream, static_cast<const FwdParams&>(p), s, s.seqlen_q);
  }
#endif
  if (!c.x.any()) return launch_fwd<T, D, CAUSAL, kFwdDense, DV>(target, stream, p, grid);
  p.x = extras_params(c.x, s, c.attrs.bottom_right);
  return launch_fwd<T, D, CAUSAL, kFwdExtras, DV>(target, stream, p, grid);
}

// ---------------------------------------------------------------------------
// forward, FP8 (e4m3 q, k, v; bf16 o): the Hopper kernel (hopper/fwd.cuh) alone
// ---------------------------------------------------------------------------
template <ffi::DataType DT, int D, bool CAUSAL>
ffi::Error launch(const char* target, cudaStream_t stream, ffi::ScratchAllocator&, const FwdFp8Call& c) {
  const AttentionShape& s = c.s;
  if (s.batch == 0 || s.seqlen_q == 0 || s.heads_q == 0) return ffi::Error::Success();
  if (auto e = check_fwd_buffers(target, stream, s, c.q, c.k, c.v, s.seqlen_k > 0, c.o, c.lse); e.failure()) return e;
#ifdef FLASHGEN_WGMMA_KERNELS
  if constexpr (kHopperFwdCompiles<__nv_fp8_e4m3, D>) {
    Fp8FwdParams p{};
    FwdVarParams vp;
    fill_fwd_params<__nv_fp8_e4m3, D>(vp, s, c.attrs, c.q, c.k, c.v, c.o.data, static_cast<float*>(c.lse.data));
    static_cast<FwdParams&>(p) = vp;
    p.q_descale = c.q_descale, p.k_descale = c.k_descale, p.v_descale = c.v_descale;
    return launch_hopper_fwd<__nv_fp8_e4m3, D, CAUSAL, false>(target, stream, p, s, s.seqlen_q);
  }
#endif
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    std::string(target) + ": no FP8 kernel for this target and head dim (sm90a, head dims 64-256 "
                                          "in steps of 64)");
}

// ---------------------------------------------------------------------------
// forward, packed variable-length batch
// ---------------------------------------------------------------------------
template <ffi::DataType DT, int D, bool CAUSAL>
ffi::Error launch(const char* target, cudaStream_t stream, ffi::ScratchAllocator&, const FwdVarlenCall& c) {
  using T = typename ElemOf<DT>::type;
  using Cfg = FwdConfig<T, D>;
  const AttentionShape& s = c.s;
  const VarlenArgs& va = c.varlen;

  if (s.seqlen_q == 0 || s.heads_q == 0) return ffi::Error::Success();
  if (auto e = check_fwd_buffers(target, stream, s, c.q, c.k, c.v, s.seqlen_k > 0, c.o, c.lse); e.failure()) return e;

  // Rows no sequence computes: o = 0, lse = -inf.
  flash_fwd_varlen_fill_kernel<T, D><<<grid_for(s.seqlen_q, 8), 256, 0, stream>>>(
      va.cu_seqlens_q, static_cast<int>(s.batch), static_cast<int>(s.seqlen_q), va.max_seqlen_q,
      static_cast<int>(s.heads_q), static_cast<T*>(c.o.data), static_cast<float*>(c.lse.data));
  if (auto e = check_launch(target, "flash_fwd_varlen_fill_kernel"); e.failure()) return e;

  // No sequence is longer than the packed total (the kernel clamps), so the
  // grid needs at most min(max_seqlen_q, Tq) rows.
  const int64_t rows = std::min<int64_t>(va.max_seqlen_q, s.seqlen_q);
  if (s.batch == 0 || rows == 0) return ffi::Error::Success();
  FwdVarParams p;
  fill_fwd_params<T, D>(p, s, c.attrs, c.q, c.k, c.v, c.o.data, static_cast<float*>(c.lse.data));
  p.cu_q = va.cu_seqlens_q;
  p.cu_k = va.cu_seqlens_k;
  p.max_seqlen_q = va.max_seqlen_q;
  p.max_seqlen_k = va.max_seqlen_k;
#ifdef FLASHGEN_WGMMA_KERNELS
  if constexpr (kHopperFwdCompiles<T, D>) {
    if (hopper_fwd_supports(c)) return launch_hopper_fwd<T, D, CAUSAL, true>(target, stream, p, s, rows);
  }
#endif
  const dim3 grid(static_cast<unsigned>((rows + Cfg::BR - 1) / Cfg::BR), static_cast<unsigned>(s.heads_q),
                  static_cast<unsigned>(s.batch));
  if (c.x.alibi == nullptr) return launch_fwd<T, D, CAUSAL, kFwdVarlen>(target, stream, p, grid);
  p.x = extras_params(c.x, s, c.attrs.bottom_right);  // the kernel reads alibi / alibi_stride_b only
  return launch_fwd<T, D, CAUSAL, kFwdVarlenAlibi>(target, stream, p, grid);
}

// ---------------------------------------------------------------------------
// forward, paged KV cache (decode), with split-KV for small grids
// ---------------------------------------------------------------------------
inline ffi::Error sm_count(const char* target, int* sms) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return cuda_failure(target, "cudaGetDevice", err);
  err = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess) return cuda_failure(target, "cudaDeviceGetAttribute(MultiProcessorCount)", err);
  return ffi::Error::Success();
}

template <ffi::DataType DT, int D, bool CAUSAL>
ffi::Error launch(const char* target, cudaStream_t stream, ffi::ScratchAllocator& scratch, const FwdPagedCall& c) {
  using T = typename ElemOf<DT>::type;
  using Cfg = FwdConfig<T, D>;
  const AttentionShape& s = c.s;
  const int64_t num_blocks = c.paged.num_blocks, block_size = c.paged.block_size, max_blocks = c.paged.max_blocks;
  const int64_t max_keys = s.seqlen_k;

  if (s.batch == 0 || s.seqlen_q == 0 || s.heads_q == 0) return ffi::Error::Success();
  if (max_blocks > (int64_t{1} << 30) || block_size > (int64_t{1} << 30) ||
      num_blocks * block_size > int64_t{0x7fffffff})
    return invalid(target, "paged cache too large: num_blocks * block_size must be < 2^31 and max_blocks * "
                           "block_size <= 2^30, got num_blocks " + std::to_string(num_blocks) + ", block_size " +
                           std::to_string(block_size) + ", max_blocks " + std::to_string(max_blocks));
  // (check_limits there: max_blocks * block_size <= 2^30)
  if (auto e = check_fwd_buffers(target, stream, s, c.q, c.k, c.v, num_blocks > 0 && block_size > 0, c.o,
                                 c.lse, "k_cache", "v_cache");
      e.failure())
    return e;

  FwdVarParams p;
  fill_fwd_params<T, D>(p, s, c.attrs, c.q, c.k, c.v, c.o.data, static_cast<float*>(c.lse.data));
  p.block_table = c.paged.block_table;
  p.seqused_k = c.paged.seqused_k;
  p.num_blocks = num_blocks;
  p.block_size = static_cast<int>(block_size);
  p.max_blocks = static_cast<int>(max_blocks);

  // Split-KV when the grid would leave most SMs idle (decode).
  const int64_t m_blocks = (s.seqlen_q + Cfg::BR - 1) / Cfg::BR;
  const int64_t ctas = m_blocks * s.heads_q * s.batch;
  int sms = 0;
  if (auto e = sm_count(target, &sms); e.failure()) return e;
  int nsplit = choose_nsplit(ctas, (max_keys + Cfg::BC - 1) / Cfg::BC, sms, Cfg::kMinBlocks);
  while (nsplit > 1 && s.batch * nsplit > 65535) --nsplit;
  if (nsplit > 1) {
    const size_t rows = static_cast<size_t>(s.batch * s.heads_q * s.seqlen_q);
    const size_t o_bytes = round_up256(static_cast<size_t>(nsplit) * rows * D * sizeof(float));
    const size_t l_bytes = round_up256(static_cast<size_t>(nsplit) * rows * sizeof(float));
    char* ws = nullptr;
    if (alloc_scratch(target, scratch, o_bytes + l_bytes, "the split-KV partials", &ws).success() && ws != nullptr) {
      p.nsplit = nsplit;
      p.o_part = reinterpret_cast<float*>(ws);
      p.lse_part = reinterpret_cast<float*>(ws + o_bytes);
    } else {
      nsplit = 1;  // no workspace: run unsplit
    }
  }
  const dim3 grid(static_cast<unsigned>(m_blocks), static_cast<unsigned>(s.heads_q),
                  static_cast<unsigned>(s.batch * nsplit));
  if (c.x.alibi == nullptr) {
    if (auto e = launch_fwd<T, D, CAUSAL, kFwdPaged>(target, stream, p, grid); e.failure()) return e;
  } else {
    p.x = extras_params(c.x, s, c.attrs.bottom_right);  // the kernel reads alibi / alibi_stride_b only
    if (auto e = launch_fwd<T, D, CAUSAL, kFwdPagedAlibi>(target, stream, p, grid); e.failure()) return e;
  }
  if (nsplit > 1) {
    flash_fwd_combine_kernel<T, D><<<grid_for(s.batch * s.heads_q * s.seqlen_q, 8), 256, 0, stream>>>(
        p.o_part, p.lse_part, static_cast<T*>(c.o.data), static_cast<float*>(c.lse.data), nsplit,
        static_cast<int>(s.batch), static_cast<int>(s.heads_q), static_cast<int>(s.seqlen_q));
    if (auto e = check_launch(target, "flash_fwd_combine_kernel"); e.failure()) return e;
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// backward (shared by dense, dense + extras and varlen)
// ---------------------------------------------------------------------------

// s: the dense shape, or for varlen {B, Tq, Tk, Hq, Hkv, D} (then `varlen` is set
// and lse / dsum are [Hq, Tq]). x: extras (dense; varlen: alibi only, or null);
// dbias / dbias_elems: the dbias result when x has a bias (dense only). DV: v, o, do and dv's
// last dim (dense only may differ from D). attrs.deterministic: the kBwdDeterministic kernels.
template <class T, int D, int DV, bool CAUSAL>
ffi::Error bwd_run(const char* target, cudaStream_t stream, ffi::ScratchAllocator& scratch, const BwdBuffers& buf,
                   const AttentionShape& s, const AttentionAttrs& attrs, const ScoreExtras* x, void* dbias,
                   size_t dbias_elems, const VarlenArgs* varlen) {
  const bool deterministic = attrs.deterministic;
  using Cfg = BwdConfig<T, D, DV>;
  constexpr bool kF32 = std::is_same<T, float>::value;
  const bool is_varlen = varlen != nullptr;
  // Rows of q (all batches): dense B*Sq, varlen Tq.
  const int64_t q_rows = is_varlen ? s.seqlen_q : s.batch * s.seqlen_q;
  const int64_t k_rows = is_varlen ? s.seqlen_k : s.batch * s.seqlen_k;
  const size_t q_elems = static_cast<size_t>(q_rows * s.heads_q * s.head_dim);
  const size_t kv_elems = static_cast<size_t>(k_rows * s.heads_kv * D);  // of k / dk
  const size_t v_elems = static_cast<size_t>(k_rows * s.heads_kv * DV);  // of v / dv
  const bool has_dbias = dbias != nullptr;
  const bool dbias_f32 = has_dbias && x->bias_type == ElemType::F32;

  // Degenerate shapes: no (query, key) pair exists, every gradient is 0.
  const bool no_work = q_elems == 0 || kv_elems == 0 || s.batch == 0 ||
                       (is_varlen && (varlen->max_seqlen_q == 0 || varlen->max_seqlen_k == 0));
  if (no_work) {
    if (auto e = memset_async(target, "dq", buf.dq.data, q_elems * sizeof(T), stream); e.failure()) return e;
    if (auto e = memset_async(target, "dk", buf.dk.data, kv_elems * sizeof(T), stream); e.failure()) return e;
    if (auto e = memset_async(target, "dv", buf.dv.data, v_elems * sizeof(T), stream); e.failure()) return e;
    if (has_dbias)
      return memset_async(target, "dbias", dbias, dbias_elems * (dbias_f32 ? 4 : sizeof(T)), stream);
    return ffi::Error::Success();
  }
  if (auto e = check_limits(target, s); e.failure()) return e;
  {
    const char* names[] = {"q", "k", "v", "o", "do", "dq", "dk", "dv"};
    const void* ptrs[] = {buf.q, buf.k, buf.v, buf.o, buf.dout, buf.dq.data, buf.dk.data, buf.dv.data};
    for (int i = 0; i < 8; ++i)
      if (auto e = check_aligned(target, names[i], ptrs[i]); e.failure()) return e;
  }

  const int group = static_cast<int>(s.heads_q / s.heads_kv);
  const bool atomic_kv = group > 1;
  const size_t rows_q = static_cast<size_t>(q_rows * s.heads_q);

  // Workspace: Dsum [B,Hq,Sq] f32; for f16/bf16 also dQ f32 [B,Sq,Hq,D] and,
  // under GQA, dK/dV f32 [B,Sk,Hkv,D]; dbias f32 unless the bias is f32. For
  // f32 the outputs themselves are the accumulators.
  const size_t dsum_bytes = round_up256(rows_q * sizeof(float));
  const size_t dq_ws_bytes = kF32 ? 0 : round_up256(q_elems * sizeof(float));
  const size_t kv_ws_bytes = (kF32 || !atomic_kv) ? 0 : round_up256(kv_elems * sizeof(float));
  const size_t v_ws_bytes = (kF32 || !atomic_kv) ? 0 : round_up256(v_elems * sizeof(float));
  const size_t db_ws_bytes = (has_dbias && !dbias_f32) ? round_up256(dbias_elems * sizeof(float)) : 0;
  // Deterministic: the turn counters of the kernel (BwdVarParams), zeroed.
  const int64_t key_rows = is_varlen ? std::min<int64_t>(varlen->max_seqlen_k, s.seqlen_k) : s.seqlen_k;
  const int64_t q_blocks = ((is_varlen ? std::min<int64_t>(varlen->max_seqlen_q, s.seqlen_q) : s.seqlen_q) +
                            Cfg::BR - 1) / Cfg::BR;
  const int64_t grid_x = (key_rows + Cfg::BC - 1) / Cfg::BC * Cfg::NSPLIT;
  const int64_t dq_turns = s.batch * s.heads_q * q_blocks * Cfg::NSPLIT;
  const int64_t kv_turns = atomic_kv ? s.batch * s.heads_kv * grid_x : 0;
  const int64_t dbias_turns = has_dbias ? s.batch * s.heads_q * (grid_x / Cfg::NSPLIT) : 0;
  const size_t turn_bytes =
      deterministic ? round_up256(static_cast<size_t>(1 + dq_turns + kv_turns + dbias_turns) * sizeof(unsigned)) : 0;
  char* wsp = nullptr;
  if (auto e = alloc_scratch(target, scratch,
                             dsum_bytes + dq_ws_bytes + kv_ws_bytes + v_ws_bytes + db_ws_bytes + turn_bytes,
                             "the backward workspace", &wsp);
      e.failure())
    return e;
  unsigned* turns = reinterpret_cast<unsigned*>(wsp + dsum_bytes + dq_ws_bytes + kv_ws_bytes + v_ws_bytes + db_ws_bytes);
  if (auto e = memset_async(target, "turn counters", turns, turn_bytes, stream); e.failure()) return e;
  float* dsum = reinterpret_cast<float*>(wsp);
  float* dq_acc = kF32 ? reinterpret_cast<float*>(buf.dq.data) : reinterpret_cast<float*>(wsp + dsum_bytes);
  float* dk_acc = nullptr;
  float* dv_acc = nullptr;
  if (atomic_kv) {
    dk_acc = kF32 ? reinterpret_cast<float*>(buf.dk.data) : reinterpret_cast<float*>(wsp + dsum_bytes + dq_ws_bytes);
    dv_acc = kF32 ? reinterpret_cast<float*>(buf.dv.data)
                  : reinterpret_cast<float*>(wsp + dsum_bytes + dq_ws_bytes + kv_ws_bytes);
  }
  float* dbias_acc = nullptr;
  if (has_dbias)
    dbias_acc = dbias_f32 ? static_cast<float*>(dbias)
                          : reinterpret_cast<float*>(wsp + dsum_bytes + dq_ws_bytes + kv_ws_bytes + v_ws_bytes);

  if (auto e = memset_async(target, "dq accumulator", dq_acc, q_elems * sizeof(float), stream); e.failure())
    return e;
  if (atomic_kv) {
    if (auto e = memset_async(target, "dk accumulator", dk_acc, kv_elems * sizeof(float), stream); e.failure())
      return e;
    if (auto e = memset_async(target, "dv accumulator", dv_acc, v_elems * sizeof(float), stream); e.failure())
      return e;
  } else if (is_varlen) {
    // Key rows no sequence covers are never visited: they read 0.
    if (auto e = memset_async(target, "dk", buf.dk.data, kv_elems * sizeof(T), stream); e.failure()) return e;
    if (auto e = memset_async(target, "dv", buf.dv.data, v_elems * sizeof(T), stream); e.failure()) return e;
  }
  if (has_dbias) {
    if (auto e = memset_async(target, "dbias accumulator", dbias_acc, dbias_elems * sizeof(float), stream);
        e.failure())
      return e;
  }

  // 1. Dsum = rowsum(dO * O); row (b * Sq + i) * Hq + h -> dsum[(b * Hq + h) * Sq + i]
  //    (varlen: one "batch" of Tq rows -> dsum [Hq, Tq], like lse).
  {
    const int64_t rows = static_cast<int64_t>(rows_q);
    constexpr int kCpr = DV * static_cast<int>(sizeof(T)) / 16;
    constexpr int kLanes = kCpr >= 32 ? 32 : (kCpr >= 16 ? 16 : (kCpr >= 8 ? 8 : 4));
    const int rows_per_block = 256 / kLanes;
    flash_bwd_pre_kernel<T, DV><<<grid_for(rows, rows_per_block), 256, 0, stream>>>(
        static_cast<const T*>(buf.o), static_cast<const T*>(buf.dout), dsum, rows,
        static_cast<int>(s.seqlen_q), static_cast<int>(s.heads_q));
    if (auto e = check_launch(target, "flash_bwd_pre_kernel"); e.failure()) return e;
  }

  // 2. main kernel
  {
    BwdVarParams p{};
    p.q = buf.q;
    p.k = buf.k;
    p.v = buf.v;
    p.dout = buf.dout;
    p.lse = buf.lse;
    p.dsum = dsum;
    p.dq_acc = dq_acc;
    p.dk_acc = dk_acc;
    p.dv_acc = dv_acc;
    p.dk = buf.dk.data;
    p.dv = buf.dv.data;
    p.batch = static_cast<int>(s.batch);
    p.seqlen_q = static_cast<int>(s.seqlen_q);
    p.seqlen_k = static_cast<int>(s.seqlen_k);
    p.heads_q = static_cast<int>(s.heads_q);
    p.heads_kv = static_cast<int>(s.heads_kv);
    p.group = group;
    set_band(p, s, attrs);
    set_cap_out(p);
    set_raw_attrs(p, attrs);
    p.scale = attrs.scale;
    p.scale_log2 = attrs.scale * kLog2e;
    p.atomic_kv = atomic_kv ? 1 : 0;
    p.ticket = turns;
    p.dq_turn = turns + 1;
    p.kv_turn = p.dq_turn + dq_turns;
    p.dbias_turn = p.kv_turn + kv_turns;
    p.q_blocks = static_cast<int>(q_blocks);

    if (is_varlen) {
      p.cu_q = varlen->cu_seqlens_q;
      p.cu_k = varlen->cu_seqlens_k;
      p.max_seqlen_q = varlen->max_seqlen_q;
      p.max_seqlen_k = varlen->max_seqlen_k;
    }
    const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(s.heads_q), static_cast<unsigned>(s.batch));
    auto launch = [&](auto kernel, const auto& params) -> ffi::Error {
      if (auto e = set_smem(target, kernel, Cfg::kSmem); e.failure()) return e;
      kernel<<<grid, Cfg::kThreads, Cfg::kSmem, stream>>>(params);
      return check_launch(target, "flash_bwd_kernel");
    };
    // One variant (BwdMode), or its kBwdDeterministic form.
    auto launch_mode = [&](auto mode) -> ffi::Error {
      constexpr int kMode = decltype(mode)::value;
      constexpr int kDV = kMode == kBwdDense || kMode == kBwdExtras ? DV : D;  // varlen: DV == D
      if (deterministic) return launch(flash_bwd_kernel<T, D, kDV, CAUSAL, kMode | kBwdDeterministic>, p);
      if constexpr (kMode == kBwdDense)
        return launch(flash_bwd_kernel<T, D, DV, CAUSAL, kBwdDense>, static_cast<const BwdParams&>(p));
      else
        return launch(flash_bwd_kernel<T, D, kDV, CAUSAL, kMode>, p);
    };
    // The wgmma kernel where it serves the call (hopper/bwd.cuh), else the sm80 family's variant.
    auto run_main = [&]() -> ffi::Error {
#ifdef FLASHGEN_WGMMA_KERNELS
      if constexpr (kHopperBwdCompiles<T, D> && D == DV) {  // the wgmma kernel has one head dim
        static_assert(HopperBwdConfig::BR == Cfg::BR && HopperBwdConfig::BC == Cfg::BC &&
                          HopperBwdConfig::nsplit(D) == Cfg::NSPLIT,
                      "the turn counters above are sized by the sm80 kernel's blocks");
        if (hopper_bwd_supports(x)) {
          if (is_varlen)
            return deterministic ? launch_hopper_bwd<T, D, true, true>(target, stream, p, s, key_rows)
                                 : launch_hopper_bwd<T, D, true, false>(target, stream, p, s, key_rows);
          return deterministic ? launch_hopper_bwd<T, D, false, true>(target, stream, p, s, key_rows)
                               : launch_hopper_bwd<T, D, false, false>(
                                     target, stream, static_cast<const BwdParams&>(p), s, key_rows);
        }
      }
#endif
      if (is_varlen) {
        if (x == nullptr || x->alibi == nullptr) return launch_mode(std::integral_constant<int, kBwdVarlen>{});
        p.x = extras_params(*x, s, attrs.bottom_right);  // the kernel reads alibi / alibi_stride_b only
        return launch_mode(std::integral_constant<int, kBwdVarlenAlibi>{});
      }
      if (x == nullptr || !x->any()) return launch_mode(std::integral_constant<int, kBwdDense>{});
      p.x = extras_params(*x, s, attrs.bottom_right);
      p.x.dbias_acc = dbias_acc;
      return launch_mode(std::integral_constant<int, kBwdExtras>{});
    };
    if (auto e = run_main(); e.failure()) return e;
  }

  // 3. f32 accumulators -> output dtype
  auto convert = [&](const float* src, void* dst, size_t n, const char* what) -> ffi::Error {
    flash_bwd_convert_kernel<T><<<grid_for(static_cast<int64_t>(n / 4), 256), 256, 0, stream>>>(
        src, static_cast<T*>(dst), static_cast<int64_t>(n));
    return check_launch(target, what);
  };
  if constexpr (!kF32) {
    if (auto e = convert(dq_acc, buf.dq.data, q_elems, "flash_bwd_convert_kernel(dq)"); e.failure()) return e;
    if (atomic_kv) {
      if (auto e = convert(dk_acc, buf.dk.data, kv_elems, "flash_bwd_convert_kernel(dk)"); e.failure()) return e;
      if (auto e = convert(dv_acc, buf.dv.data, v_elems, "flash_bwd_convert_kernel(dv)"); e.failure()) return e;
    }
    if (has_dbias && !dbias_f32) {
      if (auto e = convert(dbias_acc, dbias, dbias_elems, "flash_bwd_convert_kernel(dbias)"); e.failure())
        return e;
    }
  }
  return ffi::Error::Success();
}

template <ffi::DataType DT, int D, int DV, bool CAUSAL>
ffi::Error launch(const char* target, cudaStream_t stream, ffi::ScratchAllocator& scratch, const BwdCall& c) {
  using T = typename ElemOf<DT>::type;
  if (auto e = poison_async(target, stream, c.results()); e.failure()) return e;
  const size_t dbias_elems = c.dbias.bytes / (c.x.bias_type == ElemType::F32 ? sizeof(float) : sizeof(T));
  return bwd_run<T, D, DV, CAUSAL>(target, stream, scratch, c, c.s, c.attrs, &c.x, c.x.dbias, dbias_elems, nullptr);
}

template <ffi::DataType DT, int D, bool CAUSAL>
ffi::Error launch(const char* target, cudaStream_t stream, ffi::ScratchAllocator& scratch, const BwdVarlenCall& c) {
  using T = typename ElemOf<DT>::type;
  if (auto e = poison_async(target, stream, c.results()); e.failure()) return e;
  return bwd_run<T, D, D, CAUSAL>(target, stream, scratch, c, c.s, c.attrs, c.x.alibi != nullptr ? &c.x : nullptr,
                               nullptr, 0, &c.varlen);
}

// The handler of one call (templates/cuda/spec.cu.j2 binds it): Call (call.h) decodes and
// validates the FFI's arguments -- shapes only: the operands live in device memory -- then
// launch enqueues the kernels on the stream. SplitHandler: a spec whose value head dim DV
// differs from its query/key head dim D (dense fwd / bwd only: decode refuses the others).
template <ffi::DataType DT, int D, int DV, bool CAUSAL, class Call>
struct SplitHandler {
  const char* target;

  template <class... Args>
  ffi::Error operator()(cudaStream_t stream, ffi::ScratchAllocator scratch, Args... args) const {
    const Callee callee{target, D, DV, CAUSAL, /*host_operands=*/false};
    auto call = Call::decode(callee, std::move(args)...);
    if (call.has_error()) return call.error();
    if constexpr (std::is_same_v<Call, FwdCall> || std::is_same_v<Call, BwdCall>)
      return launch<DT, D, DV, CAUSAL>(target, stream, scratch, call.value());
    else if constexpr (DV == D)
      return launch<DT, D, CAUSAL>(target, stream, scratch, call.value());
    else
      return split_head_dims_refused(callee);
  }
};

template <ffi::DataType DT, int D, bool CAUSAL, class Call>
using Handler = SplitHandler<DT, D, D, CAUSAL, Call>;

}  // namespace
}  // namespace cuda
}  // namespace flashgen
