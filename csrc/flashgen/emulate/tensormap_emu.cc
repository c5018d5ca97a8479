// A stand-in for the driver's cuTensorMapEncodeTiled, part of the emulation runtime
// (libflashgen_emu, loaded with RTLD_GLOBAL before an emulated library, so the library's calls
// land here). The real CUtensorMap is 128 opaque bytes; this one records the arguments, checked
// as cuda.h documents them, in the layout flashgen/emulate/tensormap.py decodes for the TMA
// instructions (flashgen/emulate/semantics/tma.py). flashgen.emulate.tensormap.encode_tiled
// calls it too, so the rules live here only.
#include <cuda.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace {

constexpr uint64_t kMagic = 0x313050414D544746ull;  // "FGTMAP01", little-endian

struct Recorded {  // tensormap.py's _FORMAT
  uint64_t magic;
  uint8_t data_type, rank, interleave, swizzle, l2_promotion, oob_fill, pad[2];
  uint64_t address;
  uint64_t dims[5];
  uint64_t strides[4];
  uint32_t box[5];
  uint8_t element_strides[5], pad2[7];
};
static_assert(sizeof(Recorded) == sizeof(CUtensorMap), "the recorded map must fill a CUtensorMap");

thread_local std::string last_error;

CUresult fail(const std::string& why) {
  last_error = "cuTensorMapEncodeTiled: " + why;
  return CUDA_ERROR_INVALID_VALUE;
}

// CUtensorMapDataType -> bytes per element (the byte-sized types; the packed 4/6-bit ones are
// not modelled); 0 for anything else
int element_bytes(int type) {
  static const int bytes[] = {1, 2, 4, 4, 8, 8, 2, 4, 8, 2, 4, 4, 4};
  return type >= 0 && type < 13 ? bytes[type] : 0;
}

bool is_float(int type) { return type >= CU_TENSOR_MAP_DATA_TYPE_FLOAT16 && type <= CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ; }

std::string list(const uint64_t* xs, uint32_t n) {
  std::string s = "(";
  for (uint32_t i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(xs[i]);
  return s + ")";
}

}  // namespace

extern "C" CUresult CUDAAPI cuTensorMapEncodeTiled(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank,
                                                   void* address, const cuuint64_t* dims,
                                                   const cuuint64_t* strides, const cuuint32_t* box,
                                                   const cuuint32_t* element_strides, CUtensorMapInterleave interleave,
                                                   CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2,
                                                   CUtensorMapFloatOOBfill oob) {
  const int elem = element_bytes(type);
  const auto addr = reinterpret_cast<uintptr_t>(address);
  if (map == nullptr || reinterpret_cast<uintptr_t>(map) % 64) return fail("the map is not 64-byte aligned");
  if (!elem) return fail("data type " + std::to_string(type) + " is not modelled (only the byte-sized types 0-12)");
  if (rank < 1 || rank > 5) return fail("rank " + std::to_string(rank) + " (must be 1 to 5)");
  if (interleave != CU_TENSOR_MAP_INTERLEAVE_NONE) {
    return fail("interleaved layouts are not modelled (CU_TENSOR_MAP_INTERLEAVE_NONE only)");
  }
  if (swizzle > CU_TENSOR_MAP_SWIZZLE_128B) {
    return fail("swizzle mode " + std::to_string(swizzle) + " is not modelled (NONE, 32B, 64B, 128B)");
  }
  if (oob > CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA || (oob && !is_float(type))) {
    return fail("OOB fill " + std::to_string(oob) + " for data type " + std::to_string(type) +
                " (NaN fill needs a floating-point type)");
  }
  if (l2 > CU_TENSOR_MAP_L2_PROMOTION_L2_256B) return fail("L2 promotion " + std::to_string(l2));
  if (addr % 16) return fail("global address is not 16-byte aligned");
  for (uint32_t i = 0; i < rank; ++i) {
    if (dims[i] == 0 || dims[i] > (1ull << 32)) return fail("global dims " + list(dims, rank) + " (each must be in (0, 2^32])");
    if (box[i] == 0 || box[i] > 256) return fail("box dims: " + std::to_string(box[i]) + " (each must be in (0, 256])");
    if (element_strides[i] == 0 || element_strides[i] > 8) {
      return fail("element strides: " + std::to_string(element_strides[i]) + " (each must be in (0, 8])");
    }
  }
  for (uint32_t i = 0; i + 1 < rank; ++i) {
    if (strides[i] % 16 || strides[i] == 0 || strides[i] >= (1ull << 40)) {
      return fail("global strides " + list(strides, rank - 1) + " (each a positive multiple of 16 below 2^40)");
    }
  }
  if (rank > 1 && strides[0] < dims[0] * elem) {
    return fail("global stride " + std::to_string(strides[0]) + " is less than a row of " + std::to_string(dims[0]) +
                " elements");
  }
  const uint64_t inner = uint64_t(box[0]) * elem;
  if (inner % 16) return fail("box inner dimension of " + std::to_string(inner) + " bytes is not a multiple of 16");
  if (element_strides[0] != 1) return fail("element stride of dimension 0 must be 1 (TMA ignores it; say so explicitly)");
  const uint64_t span = swizzle ? 16u << swizzle : 0;  // 32, 64, 128 bytes
  if (swizzle && inner != span) {
    return fail("box inner dimension of " + std::to_string(inner) + " bytes with a " + std::to_string(span) +
                "-byte swizzle: only a box row of exactly the swizzle span is modelled (the driver allows narrower)");
  }
  Recorded r{};
  r.magic = kMagic;
  r.data_type = uint8_t(type);
  r.rank = uint8_t(rank);
  r.interleave = uint8_t(interleave);
  r.swizzle = uint8_t(swizzle);
  r.l2_promotion = uint8_t(l2);
  r.oob_fill = uint8_t(oob);
  r.address = addr;
  for (uint32_t i = 0; i < rank; ++i) {
    r.dims[i] = dims[i];
    r.box[i] = box[i];
    r.element_strides[i] = uint8_t(element_strides[i]);
    if (i + 1 < rank) r.strides[i] = strides[i];
  }
  std::memcpy(map, &r, sizeof r);
  return CUDA_SUCCESS;
}

// The message of this thread's last failed cuTensorMapEncodeTiled (for flashgen.emulate.tensormap).
extern "C" const char* flashgen_emu_tensormap_error() { return last_error.c_str(); }
