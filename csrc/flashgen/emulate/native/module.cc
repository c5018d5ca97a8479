// flashgen.emulate's native module: the C helpers of emu_native.h as Python functions taking numpy
// arrays (any C-contiguous buffer) and ints. Each argument's element size and length are checked
// against what the helper will touch, so a wrong call raises ValueError instead of writing
// out of bounds. Plain CPython (METH_FASTCALL, the buffer protocol): the emulator calls these
// thousands of times per launch, and pybind11's argument conversion would cost more than the work.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "flashgen/emulate/native/emu_native.h"

namespace {

// A C-contiguous buffer argument, released when it goes out of scope; `data` stays null for None
// where None is allowed.
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (held_) PyBuffer_Release(&view_);
  }

  // False (with a Python exception set) unless `obj` is a buffer of at least `count` elements of
  // `itemsize` bytes (or None, when `optional`).
  bool get(PyObject* obj, const char* name, Py_ssize_t itemsize, Py_ssize_t count, bool writable,
           bool optional = false) {
    if (optional && obj == Py_None) return true;
    const int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &view_, flags) < 0) return false;
    held_ = true;
    if (itemsize == 0 && view_.itemsize > 0) itemsize = view_.itemsize;  // 0: any element size
    if (view_.itemsize != itemsize || view_.len < count * itemsize) {
      PyErr_Format(PyExc_ValueError, "%s: %zd bytes of %zd-byte elements, need %zd of %zd bytes", name, view_.len,
                   view_.itemsize, count, itemsize);
      return false;
    }
    data = view_.buf;
    return true;
  }
  Py_ssize_t len() const { return view_.len; }
  Py_ssize_t itemsize() const { return view_.itemsize; }
  // Whether the elements are signed integers (the struct format's code, after any byte order, is
  // one of b h i l q; numpy's unsigned ones are upper case).
  bool is_signed() const {
    const char* f = view_.format ? view_.format : "B";
    while (*f && std::strchr("@=<>!", *f)) ++f;
    return *f && std::strchr("bhilq", *f);
  }
  // The length of dimension `axis`, for a buffer of at least axis + 1 dimensions; else -1.
  Py_ssize_t dim(int axis) const { return view_.ndim > axis ? view_.shape[axis] : -1; }

  void* data = nullptr;

 private:
  Py_buffer view_{};
  bool held_ = false;
};

bool int_at(PyObject* const* args, Py_ssize_t i, int64_t* out) {
  *out = PyLong_AsLongLong(args[i]);
  return !(*out == -1 && PyErr_Occurred());
}

// args[first], ... args[first + N - 1] into `out`.
template <size_t N>
bool ints(PyObject* const* args, Py_ssize_t first, int64_t (&out)[N]) {
  for (size_t i = 0; i < N; ++i)
    if (!int_at(args, first + i, &out[i])) return false;
  return true;
}

bool arity(const char* name, Py_ssize_t nargs, Py_ssize_t want) {
  if (nargs == want) return true;
  PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, want, nargs);
  return false;
}

template <typename T>
T* at(const Buffer& b) {
  return static_cast<T*>(b.data);
}

// shared_words(offs, nbytes, slot, slots | None, size, stride, pending_address | 0, words) -> int
PyObject* shared_words(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t n[2], place[3];  // nbytes, slot; size, stride, pending
  Buffer offs, slots, words;
  if (!arity("shared_words", nargs, 8) || !ints(args, 1, n) || !ints(args, 4, place) ||
      !offs.get(args[0], "offs", 8, 0, false))
    return nullptr;
  const Py_ssize_t rows = offs.dim(0);
  if (n[0] != 4 && n[0] != 8 && n[0] != 16) return PyErr_Format(PyExc_ValueError, "nbytes %lld", (long long)n[0]);
  if (!slots.get(args[3], "slots", 8, rows, false, true) || !words.get(args[7], "words", 8, rows * n[0] / 4, true))
    return nullptr;
  return PyLong_FromLongLong(flashgen_emu_shared_words(at<int64_t>(offs), rows, n[0], n[1], at<int64_t>(slots),
                                                       place[0], place[1],
                                                       reinterpret_cast<const int64_t*>(place[2]),
                                                       at<int64_t>(words)));
}

// shared_load(offs, nbytes, slot, slots | None, size, stride, pending_address | 0, race_address | 0,
//             warp, warps | None, lanes | None, memory, out) -> int
PyObject* shared_load(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t n[2], place[4], warp;  // nbytes, slot; size, stride, pending, race
  Buffer offs, slots, warps, lanes, memory, out;
  if (!arity("shared_load", nargs, 13) || !ints(args, 1, n) || !ints(args, 4, place) ||
      !int_at(args, 8, &warp) || !offs.get(args[0], "offs", 8, 0, false))
    return nullptr;
  const Py_ssize_t rows = offs.dim(0);
  if (n[0] != 4 && n[0] != 8 && n[0] != 16) return PyErr_Format(PyExc_ValueError, "nbytes %lld", (long long)n[0]);
  if (!slots.get(args[3], "slots", 8, rows, false, true) || !warps.get(args[9], "warps", 8, rows, false, true) ||
      !lanes.get(args[10], "lanes", 8, rows, false, true) || !memory.get(args[11], "memory", 4, 0, false) ||
      !out.get(args[12], "out", 4, rows * n[0] / 4, true))
    return nullptr;
  return PyLong_FromLongLong(flashgen_emu_shared_load(
      at<int64_t>(offs), rows, n[0], n[1], at<int64_t>(slots), place[0], place[1],
      reinterpret_cast<const int64_t*>(place[2]), reinterpret_cast<const FlashgenEmuRaceState*>(place[3]), warp,
      at<int64_t>(warps), at<int64_t>(lanes), at<uint32_t>(memory), memory.dim(0), at<uint32_t>(out)));
}

// add_each(array, idx, value) -> None: array[i] += value for each i of idx (int64 both; repeats
// add again). numpy's fancy `array[idx] += value` gathers and scatters (~20 ns an index).
PyObject* add_each(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t value;
  Buffer array, idx;
  if (!arity("add_each", nargs, 3) || !array.get(args[0], "array", 8, 0, true) || !idx.get(args[1], "idx", 8, 0, false) ||
      !int_at(args, 2, &value))
    return nullptr;
  const Py_ssize_t n = array.dim(0), count = idx.len() / 8;
  int64_t* a = at<int64_t>(array);
  const int64_t* i = at<int64_t>(idx);
  for (Py_ssize_t k = 0; k < count; ++k)
    if (i[k] < 0 || i[k] >= n) return PyErr_Format(PyExc_IndexError, "add_each: index %lld of %zd", (long long)i[k], n);
  for (Py_ssize_t k = 0; k < count; ++k) a[i[k]] += value;
  Py_RETURN_NONE;
}

// global_load(bytes, start, owners | None, readers, granule, off, nbytes, cta, ctas | None, out) -> int
PyObject* global_load(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t start, granule, n[2];  // nbytes, cta
  Buffer bytes, owners, readers, off, ctas, out;
  if (!arity("global_load", nargs, 10) || !int_at(args, 1, &start) || !int_at(args, 4, &granule) ||
      !ints(args, 6, n) || !bytes.get(args[0], "bytes", 1, 0, false) ||
      !readers.get(args[3], "readers", 4, 0, true) || !off.get(args[5], "off", 8, 0, false))
    return nullptr;
  const Py_ssize_t rows = off.dim(0);
  if (!owners.get(args[2], "owners", 4, bytes.dim(0), false, true) || !ctas.get(args[8], "ctas", 8, rows, false, true) ||
      !out.get(args[9], "out", 1, rows * n[0], true))
    return nullptr;
  if ((granule != 1 && granule != 4) || n[0] < 1)
    return PyErr_Format(PyExc_ValueError, "granule %lld, nbytes %lld", (long long)granule, (long long)n[0]);
  return PyLong_FromLongLong(flashgen_emu_global_load(at<uint8_t>(bytes), bytes.dim(0), start, at<int32_t>(owners),
                                                      at<int32_t>(readers), readers.dim(0), granule, at<int64_t>(off),
                                                      rows, n[0], n[1], at<int64_t>(ctas), at<uint8_t>(out)));
}

// global_atomic(owners, start, readers4 | None, readers1 | None, off, nbytes, cta, ctas | None) -> int
PyObject* global_atomic(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t start, n[2];  // nbytes, cta
  Buffer owners, readers4, readers1, off, ctas;
  if (!arity("global_atomic", nargs, 8) || !int_at(args, 1, &start) || !ints(args, 5, n) ||
      !owners.get(args[0], "owners", 4, 0, true) || !readers4.get(args[2], "readers4", 4, 0, false, true) ||
      !readers1.get(args[3], "readers1", 4, 0, false, true) || !off.get(args[4], "off", 8, 0, false))
    return nullptr;
  const Py_ssize_t rows = off.dim(0);
  if (!ctas.get(args[7], "ctas", 8, rows, false, true)) return nullptr;
  if (n[0] < 1) return PyErr_Format(PyExc_ValueError, "nbytes %lld", (long long)n[0]);
  return PyLong_FromLongLong(flashgen_emu_global_atomic(at<int32_t>(owners), owners.dim(0), start, at<int32_t>(readers4),
                                                        readers4.data ? readers4.dim(0) : 0, at<int32_t>(readers1),
                                                        readers1.data ? readers1.dim(0) : 0, at<int64_t>(off), rows,
                                                        n[0], n[1], at<int64_t>(ctas)));
}

// The race helpers' common arguments: (state_address, idx [rows, cols], warp, warps | None,
// lanes | None, verdict [rows * cols]).
struct RaceAccess {
  int64_t state, warp;
  Buffer idx, warps, lanes, verdict;
  Py_ssize_t rows, cols;

  bool get(PyObject* const* args) {
    if (!int_at(args, 0, &state) || !int_at(args, 2, &warp) || !idx.get(args[1], "idx", 8, 0, false)) return false;
    rows = idx.dim(0), cols = idx.dim(1);
    if (rows < 0 || cols < 0) {
      PyErr_SetString(PyExc_ValueError, "idx: need [rows, granules]");
      return false;
    }
    return warps.get(args[3], "warps", 8, rows, false, true) && lanes.get(args[4], "lanes", 8, rows, false, true) &&
           verdict.get(args[5], "verdict", 1, rows * cols, true);
  }
  const FlashgenEmuRaceState* race_state() const { return reinterpret_cast<const FlashgenEmuRaceState*>(state); }
};

PyObject* race_read(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  RaceAccess a;
  if (!arity("race_read", nargs, 6) || !a.get(args)) return nullptr;
  return PyLong_FromLongLong(flashgen_emu_race_read(a.race_state(), at<int64_t>(a.idx), a.rows, a.cols, a.warp,
                                                    at<int64_t>(a.warps), at<int64_t>(a.lanes),
                                                    at<uint8_t>(a.verdict)));
}

// race_write(..., check) -> int
PyObject* race_write(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  RaceAccess a;
  int64_t check;
  if (!arity("race_write", nargs, 7) || !a.get(args) || !int_at(args, 6, &check)) return nullptr;
  return PyLong_FromLongLong(flashgen_emu_race_write(a.race_state(), at<int64_t>(a.idx), a.rows, a.cols, a.warp,
                                                     at<int64_t>(a.warps), at<int64_t>(a.lanes),
                                                     at<uint8_t>(a.verdict), check));
}

// mma(g, k, type, executing | None, A's 4 and B's 2 registers, C's 4, D's 4, a_src, b_src, c_src,
// d_of) -> None: each register an array of the gang's g * 32 lanes (4-byte elements).
PyObject* mma(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t n[3];  // g, k, type
  Buffer executing, regs[14], a_src, b_src, c_src, d_of;
  if (!arity("mma", nargs, 22) || !ints(args, 0, n)) return nullptr;
  const int64_t g = n[0], k = n[1];
  if (g < 1 || (k != 8 && k != 16) || n[2] < 0 || n[2] > 2)
    return PyErr_Format(PyExc_ValueError, "mma: g %lld, k %lld, type %lld", (long long)g, (long long)k,
                        (long long)n[2]);
  if (!executing.get(args[3], "executing", 1, 32 * g, false, true)) return nullptr;
  for (int i = 0; i < 14; ++i)
    if (!regs[i].get(args[4 + i], i < 6 ? "A/B register" : i < 10 ? "C register" : "D register", 4, 32 * g, i >= 10))
      return nullptr;
  if (!a_src.get(args[18], "a_src", 4, 16 * k, false) || !b_src.get(args[19], "b_src", 4, 8 * k, false) ||
      !c_src.get(args[20], "c_src", 4, 128, false) || !d_of.get(args[21], "d_of", 4, 128, false))
    return nullptr;
  // the tables' entries index a warp's fragment (elements per register row: 32 tf32, 64 halves)
  const int64_t per_reg = n[2] == 2 ? 32 : 64;
  const struct { const Buffer& table; int64_t count, bound; const char* name; } tables[] = {
      {a_src, 16 * k, 4 * per_reg, "a_src"}, {b_src, 8 * k, 2 * per_reg, "b_src"}, {c_src, 128, 128, "c_src"},
      {d_of, 128, 128, "d_of"}};
  for (const auto& t : tables)
    for (int64_t i = 0; i < t.count; ++i)
      if (at<int32_t>(t.table)[i] < 0 || at<int32_t>(t.table)[i] >= t.bound)
        return PyErr_Format(PyExc_ValueError, "mma: %s[%lld] = %d is outside 0..%lld", t.name, (long long)i,
                            at<int32_t>(t.table)[i], (long long)(t.bound - 1));
  const uint32_t* ab[6];
  const float* c[4];
  float* d[4];
  for (int i = 0; i < 6; ++i) ab[i] = at<uint32_t>(regs[i]);
  for (int i = 0; i < 4; ++i) c[i] = at<float>(regs[6 + i]), d[i] = at<float>(regs[10 + i]);
  flashgen_emu_mma(g, k, n[2], ab, c, d, at<bool>(executing), at<int32_t>(a_src), at<int32_t>(b_src),
                   at<int32_t>(c_src), at<int32_t>(d_of));
  Py_RETURN_NONE;
}

// pack_bf16x2(hi, lo, out) -> None: out[i] = bf16(hi[i]) << 16 | bf16(lo[i]); f32 in, u32 out, one
// length. ex2(x, ftz, out) -> None: out[i] = ex2.approx(x[i]) (f32 both, one length; out may be x).
PyObject* pack_bf16x2(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  Buffer hi, lo, out;
  if (!arity("pack_bf16x2", nargs, 3) || !out.get(args[2], "out", 4, 0, true)) return nullptr;
  const Py_ssize_t n = out.len() / 4;
  if (!hi.get(args[0], "hi", 4, n, false) || !lo.get(args[1], "lo", 4, n, false)) return nullptr;
  flashgen_emu_pack_bf16x2(at<float>(hi), at<float>(lo), n, at<uint32_t>(out));
  Py_RETURN_NONE;
}

PyObject* ex2(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t ftz;
  Buffer x, out;
  if (!arity("ex2", nargs, 3) || !int_at(args, 1, &ftz) || !out.get(args[2], "out", 4, 0, true)) return nullptr;
  const Py_ssize_t n = out.len() / 4;
  if (!x.get(args[0], "x", 4, n, false)) return nullptr;
  flashgen_emu_ex2(at<float>(x), n, ftz, at<float>(out));
  Py_RETURN_NONE;
}

// ldmatrix(addr, offset, nmat, executing | None, slot, slots | None, size, stride, pending_address | 0,
//          race_address | 0, warp, warps | None, memory, gather, *dests) -> int: addr, executing,
// slots and warps one element per lane of the gang's g warps; `nmat` dests of g * 32 u32 each.
PyObject* ldmatrix(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t offset, nmat, slot, layout[4], warp;  // layout: size, stride, pending, race
  Buffer addr, executing, slots, warps, memory, gather, dests[4];
  if (nargs < 15) return PyErr_Format(PyExc_TypeError, "ldmatrix takes 14 + nmat arguments, got %zd", nargs);
  if (!int_at(args, 1, &offset) || !int_at(args, 2, &nmat) || !int_at(args, 4, &slot) || !ints(args, 6, layout) ||
      !int_at(args, 10, &warp))
    return nullptr;
  if ((nmat != 1 && nmat != 2 && nmat != 4) || nargs != 14 + nmat)
    return PyErr_Format(PyExc_ValueError, "ldmatrix: nmat %lld with %zd arguments", (long long)nmat, nargs);
  if (!addr.get(args[0], "addr", 0, 0, false)) return nullptr;
  const Py_ssize_t lanes = addr.len() / addr.itemsize();
  if ((addr.itemsize() != 4 && addr.itemsize() != 8) || lanes % 32)
    return PyErr_Format(PyExc_ValueError, "ldmatrix: addr of %zd lanes of %zd bytes (need 4 or 8, 32 per warp)", lanes,
                        addr.itemsize());
  if (!executing.get(args[3], "executing", 1, lanes, false, true) || !slots.get(args[5], "slots", 8, lanes, false, true) ||
      !warps.get(args[11], "warps", 8, lanes, false, true) || !memory.get(args[12], "memory", 4, 0, false) ||
      !gather.get(args[13], "gather", 4, nmat * 64, false))
    return nullptr;
  for (int64_t i = 0; i < 64 * nmat; ++i) {
    const int32_t index = at<int32_t>(gather)[i];
    if (index < 0 || index >= 64 * nmat) return PyErr_Format(PyExc_ValueError, "ldmatrix: gather index %d", index);
  }
  uint32_t* d[4];
  for (int64_t j = 0; j < nmat; ++j) {
    if (!dests[j].get(args[14 + j], "dest register", 4, lanes, true)) return nullptr;
    d[j] = at<uint32_t>(dests[j]);
  }
  return PyLong_FromLongLong(flashgen_emu_ldmatrix(
      addr.data, addr.itemsize(), addr.is_signed(), offset, lanes / 32, nmat, at<bool>(executing), slot,
      at<int64_t>(slots), layout[0], layout[1], reinterpret_cast<const int64_t*>(layout[2]),
      reinterpret_cast<const FlashgenEmuRaceState*>(layout[3]), warp, at<int64_t>(warps), at<uint32_t>(memory),
      memory.dim(0), at<int32_t>(gather), d));
}

#define FASTCALL(f) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f)), METH_FASTCALL
PyMethodDef methods[] = {
    {"shared_words", FASTCALL(shared_words), "shared_memory_emu.cc's flashgen_emu_shared_words"},
    {"shared_load", FASTCALL(shared_load), "shared_memory_emu.cc's flashgen_emu_shared_load"},
    {"global_load", FASTCALL(global_load), "global_memory_emu.cc's flashgen_emu_global_load"},
    {"global_atomic", FASTCALL(global_atomic), "global_memory_emu.cc's flashgen_emu_global_atomic"},
    {"add_each", FASTCALL(add_each), "array[i] += value for each i of idx"},
    {"race_read", FASTCALL(race_read), "shared_memory_emu.cc's flashgen_emu_race_read"},
    {"race_write", FASTCALL(race_write), "shared_memory_emu.cc's flashgen_emu_race_write"},
    {"mma", FASTCALL(mma), "mma_emu.cc's flashgen_emu_mma"},
    {"ldmatrix", FASTCALL(ldmatrix), "shared_memory_emu.cc's flashgen_emu_ldmatrix"},
    {"pack_bf16x2", FASTCALL(pack_bf16x2), "numerics_emu.cc's flashgen_emu_pack_bf16x2"},
    {"ex2", FASTCALL(ex2), "numerics_emu.cc's flashgen_emu_ex2"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "flashgen_emu_native", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_flashgen_emu_native() { return PyModule_Create(&module); }
