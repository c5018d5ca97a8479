// The Python face of a generated flashgen library: handlers as PyCapsules
// ready for jax.ffi.register_ffi_target, plus the library's spec metadata.
// Compiled as its own object so the handlers themselves stay free of Python.
#pragma once
#include <pybind11/pybind11.h>

#include "flashgen/cancel.h"
#include "flashgen/library.h"

namespace py = pybind11;

namespace flashgen {

// Each library gets its own module name (CPython caches extension modules by
// name), so the generated file only names the module and calls this.
inline void define_python_face(py::module_& m) {
  m.doc() = "A flashgen-generated FlashAttention library";
  m.def("handlers", [] {
    size_t n = 0;
    const flashgen::HandlerEntry* table = flashgen_handlers(&n);
    py::list out;
    for (size_t i = 0; i < n; ++i) {
      // An unnamed capsule is what jax.ffi.pycapsule produces and what
      // register_ffi_target accepts.
      py::capsule cap(reinterpret_cast<void*>(table[i].handler), static_cast<const char*>(nullptr),
                      static_cast<PyCapsule_Destructor>(nullptr));
      out.append(py::make_tuple(table[i].name, table[i].platform, cap));
    }
    return out;
  }, "List of (target name, platform, PyCapsule) for every handler.");
  m.def("info", [] { return std::string(flashgen_library_info()); }, "JSON description of the library.");
  m.def("cancel", [](bool on) { cancel_flag().store(on); },
        "Set (True) or clear (False) the flag that stops this library's running kernels.");
}

}  // namespace flashgen
