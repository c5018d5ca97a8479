// One-instruction micro-kernels for the emulator's self-checks (tests/test_emulator.py).
// Each exercises one conversion / approximate-math / warp form the flashgen kernels use, through
// the same helpers (common.cuh) or CUDA intrinsics, so nvcc emits exactly the kernels' PTX forms.
#include "flashgen/cuda/common.cuh"

using namespace flashgen::cuda;

// cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32: .x (low half) = a, .y (high half) = b.
extern "C" __global__ void cvt_bf16x2(const float* a, const float* b, __nv_bfloat162* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __floats2bfloat162_rn(a[i], b[i]);
}
extern "C" __global__ void cvt_f16x2(const float* a, const float* b, __half2* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __floats2half2_rn(a[i], b[i]);
}
extern "C" __global__ void cvt_bf16(const float* a, __nv_bfloat16* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = from_float<__nv_bfloat16>(a[i]);
}
extern "C" __global__ void cvt_tf32(const float* a, uint32_t* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = to_tf32(a[i]);
}
extern "C" __global__ void exp2_approx(const float* a, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = fast_exp2(a[i]);
}
extern "C" __global__ void reciprocal(const float* a, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = 1.0f / a[i];
}
extern "C" __global__ void copy_sign(const float* a, const float* b, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = copysignf(a[i], b[i]);
}
extern "C" __global__ void tanh_f32(const float* a, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = tanhf(a[i]);
}
// shfl.sync.bfly through the kernels' quad reductions plus a full butterfly with lane mask m.
extern "C" __global__ void shuffle_xor(const float* a, float* out, int m) {
  const float x = a[threadIdx.x];
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, x, m);
  out[32 + threadIdx.x] = quad_sum(x);
  out[64 + threadIdx.x] = quad_max(x);
}
// atom.global.add.f32 (scalar and the float2 vector form): every thread adds into idx[i].
extern "C" __global__ void atomic_add(const float* a, const int* idx, float* acc, float* old, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) old[i] = atomicAdd(acc + idx[i], a[i]);
}
// One warp computes D = A B + C with mma.m16n8k16 (bf16) fed by ldmatrix from row-major tiles.
extern "C" __global__ void mma_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, float* d) {
  __shared__ alignas(16) __nv_bfloat16 sa[16 * 16], sb[8 * 16];  // A [16][16], B^T [8][16]
  const int l = threadIdx.x;
  for (int i = l; i < 256; i += 32) sa[i] = a[i];
  for (int i = l; i < 128; i += 32) sb[i] = b[i];
  __syncwarp();
  uint32_t ra[4], rb[4];
  ldsm_x4(ra, smem_addr(&sa[(l % 16) * 16 + (l / 16) * 8]));
  ldsm_x4(rb, smem_addr(&sb[(l % 8) * 16 + ((l / 8) % 2) * 8]));
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  mma_16816_bf16(c, ra, rb);
  const int g = l >> 2, t = l & 3;
  d[g * 8 + 2 * t] = c[0];
  d[g * 8 + 2 * t + 1] = c[1];
  d[(g + 8) * 8 + 2 * t] = c[2];
  d[(g + 8) * 8 + 2 * t + 1] = c[3];
}

// ---- kernels that must make the emulator fail ----------------------------------------------
extern "C" __global__ void bad_opcode(const unsigned* a, unsigned* out) { out[threadIdx.x] = __brev(a[threadIdx.x]); }
extern "C" __global__ void bad_diverged_barrier(float* out) {
  if (threadIdx.x % 2) __syncthreads();   // undefined: half a warp at a CTA barrier
  out[threadIdx.x] = 1.f;
}
extern "C" __global__ void bad_diverged_ldmatrix(float* out) {
  __shared__ alignas(16) __nv_bfloat16 s[16 * 16];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) s[i] = __float2bfloat16(1.f);
  __syncthreads();
  uint32_t r[4] = {0, 0, 0, 0};
  if (threadIdx.x < 16) ldsm_x4(r, smem_addr(&s[(threadIdx.x % 16) * 16]));
  out[threadIdx.x] = __uint_as_float(r[0]);
}
extern "C" __global__ void bad_oob_load(const float* a, float* out, int n) { out[threadIdx.x] = a[threadIdx.x + n]; }
extern "C" __global__ void bad_misaligned_load(const float* a, float* out) {
  out[threadIdx.x] = *reinterpret_cast<const float*>(reinterpret_cast<const char*>(a + threadIdx.x) + 2);
}
// Reads the cp.async destination without cp.async.wait_group; `wait` = 1 is the correct kernel.
extern "C" __global__ void cp_async_read(const float4* a, float4* out, int wait) {
  __shared__ alignas(16) float4 s[32];
  cp_async_16(&s[threadIdx.x], &a[threadIdx.x], true);
  cp_async_commit();
  if (wait) cp_async_wait<0>();
  out[threadIdx.x] = s[threadIdx.x];
}
// Warp 1 reads what warp 0 wrote; `sync` = 1 puts the barrier between them (the correct kernel).
extern "C" __global__ void cross_warp_read(const float* a, float* out, int sync) {
  __shared__ float s[64];
  s[threadIdx.x] = a[threadIdx.x];
  if (sync) __syncthreads();
  out[threadIdx.x] = s[(threadIdx.x + 32) % 64];
}
// Dynamic shared memory: the launch decides whether it fits the architecture.
extern "C" __global__ void dynamic_smem(float* out) {
  extern __shared__ float dyn[];
  dyn[threadIdx.x] = 1.f;
  __syncthreads();
  out[threadIdx.x] = dyn[(threadIdx.x + 1) % blockDim.x];
}
// Per-lane control flow: data-dependent trip counts and an early exit inside the loop.
extern "C" __global__ void divergent_loop(const int* trips, float* out) {
  float acc = 0.f;
  for (int j = 0; j < trips[threadIdx.x]; ++j) {
    if (j == 7 && (threadIdx.x & 1)) break;
    acc += static_cast<float>(j + threadIdx.x);
  }
  out[threadIdx.x] = acc;
}
// The backward's dQ accumulation: a float2 atomic on sm_90 (atom.global.v2.f32.add), two scalar
// atomics before.
extern "C" __global__ void atomic_add_pairs(const float2* a, const int* idx, float* acc, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float* dst = acc + 2 * idx[i];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), a[i]);
#else
  atomicAdd(dst, a[i].x);
  atomicAdd(dst + 1, a[i].y);
#endif
}
// Never terminates: the launch's instruction budget must stop it.
extern "C" __global__ void spin(volatile int* flag) {
  while (*flag == 0) {
  }
}
// Every CTA writes the same elements: a write-write race between CTAs of one grid.
extern "C" __global__ void same_slot_store(float* out) { out[threadIdx.x] = static_cast<float>(blockIdx.x); }
// Every CTA reads a, then CTA 1 overwrites it: a race whichever CTA runs first.
extern "C" __global__ void read_then_other_writes(float* a, float* out) {
  const float v = a[threadIdx.x];
  if (blockIdx.x == 1) a[threadIdx.x] = 1.0f;
  out[blockIdx.x * 32 + threadIdx.x] = v;
}
// Integer semantics of C (truncating division, arithmetic shifts, high products, 64-bit ops)
// and the float min/max/fma forms, through whatever instructions nvcc picks for them.
extern "C" __global__ void int_ops(const int* a, const int* b, const long long* c, const long long* d, int* o32,
                                   long long* o64, unsigned* ou) {
  const int i = threadIdx.x;
  const int x = a[i], y = b[i];  // y != 0
  o32[8 * i + 0] = x / y;
  o32[8 * i + 1] = x % y;
  o32[8 * i + 2] = x / 7;
  o32[8 * i + 3] = x % 7;
  o32[8 * i + 4] = x >> (y & 31);
  o32[8 * i + 5] = min(x, y);
  o32[8 * i + 6] = __mulhi(x, y);
  o32[8 * i + 7] = abs(x) - max(x, y);
  o64[4 * i + 0] = c[i] / d[i];
  o64[4 * i + 1] = c[i] % d[i];
  o64[4 * i + 2] = static_cast<long long>(x) * y;
  o64[4 * i + 3] = c[i] >> (y & 63);
  const unsigned ux = static_cast<unsigned>(x), uy = static_cast<unsigned>(y);
  ou[4 * i + 0] = ux / uy;
  ou[4 * i + 1] = ux >> (uy & 31);
  ou[4 * i + 2] = __umulhi(ux, uy);
  ou[4 * i + 3] = (ux << (uy & 15)) | (ux >> 3);
}
extern "C" __global__ void float_ops(const float* a, const float* b, const float* c, float* out) {
  const int i = threadIdx.x;
  out[4 * i + 0] = fminf(a[i], b[i]);
  out[4 * i + 1] = fmaxf(a[i], b[i]);
  out[4 * i + 2] = fmaf(a[i], b[i], c[i]);
  out[4 * i + 3] = sqrtf(fabsf(a[i])) - a[i] * b[i];
}
// Two warps store to the same shared words in the same instruction (a race even in lockstep).
extern "C" __global__ void same_smem_slot(float* out) {
  __shared__ float s[32];
  s[threadIdx.x % 32] = static_cast<float>(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = s[threadIdx.x % 32];
}
// Lane i reads what lane i ^ 1 stored; `sync` = 1 puts __syncwarp between them (the correct kernel).
extern "C" __global__ void lane_exchange(const float* a, float* out, int sync) {
  __shared__ float s[32];
  s[threadIdx.x] = a[threadIdx.x];
  if (sync) __syncwarp();
  out[threadIdx.x] = s[threadIdx.x ^ 1];
}
