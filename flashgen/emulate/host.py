"""Run a flashgen CUDA library's FFI handlers on the CPU, host code and all.

A library built with `build(..., host="emulate")` is the very objects of a GPU build
linked without the CUDA runtime. Loaded after libflashgen_emu (csrc/flashgen/emulate:
a stand-in CUDA runtime and a minimal XLA FFI host), its handlers run unmodified:
shape and attribute checks, parameter structs, grid sizing, the split-KV choice,
scratch, poisoning and multi-kernel sequences all execute as compiled. Device memory
is host memory; each launch comes back here and runs the kernel's PTX (kept from
the same compile) in the emulator, checked against the ranges of this call's
buffers and scratch.

    lib = EmulatedLibrary(build(spec, "sm80", host="emulate"))
    out = lib.call("flashgen_fwd_d64_bf16", [q, k, v], [o_shape, lse_shape], causal=False, ...)
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import time

import ml_dtypes
import numpy as np

from flashgen import cache, targets
from flashgen.build import Library, emulation_runtime
from flashgen.emulate import heap, native
from flashgen.emulate.errors import EmulationError
from flashgen.emulate.machine import MAX_WARP_INSTRUCTIONS, LaunchStats, launch, short_name
from flashgen.emulate.memory import GlobalMemory
from flashgen.emulate.ptx import PtxModule
from flashgen.errors import FlashgenError
from flashgen.contract import ATTRIBUTE_TYPES
from flashgen.spec import parse_target_name

# XLA_FFI_DataType codes (xla/ffi/api/c_api.h).
_FFI_DTYPES = {np.dtype(np.bool_): 1, np.dtype(np.int32): 4, np.dtype(np.float16): 10,
               np.dtype(np.float32): 11, np.dtype(np.float64): 12, np.dtype(ml_dtypes.bfloat16): 16,
               np.dtype(ml_dtypes.float8_e4m3fn): 20}
_ATTR_KINDS = {"i1": 0, "i32": 1, "f32": 2, "string": 3}  # FlashgenEmuAttrKind
_XLA_CODES = {3: "INVALID_ARGUMENT", 8: "RESOURCE_EXHAUSTED", 12: "UNIMPLEMENTED", 13: "INTERNAL"}
_ALIGN = 256  # what XLA guarantees (and more than the handlers' 16-byte check)


class HandlerError(FlashgenError):
    """The handler returned an ffi::Error (bad arguments, a failed CUDA call)."""

    def __init__(self, code: int, message: str, record: "CallRecord"):
        super().__init__(f"{_XLA_CODES.get(code, code)}: {message}")
        self.code = code
        self.message = message
        self.record = record  # what ran before the error (a refused call: nothing)


@dataclasses.dataclass(frozen=True)
class Launch:
    entry: str                  # the PTX entry (mangled)
    kernel: str                 # its short_name, for people
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    stats: LaunchStats


@dataclasses.dataclass
class CallRecord:
    """What one handler call did."""
    launches: list[Launch] = dataclasses.field(default_factory=list)
    host_accesses: list[str] = dataclasses.field(default_factory=list)  # memsets / memcpys
    scratch_bytes: int = 0
    seconds: float = 0.0


# ---------------------------------------------------------------------------------------------
# ctypes face of libflashgen_emu (emu_runtime.h, ffi_host_emu.cc)
# ---------------------------------------------------------------------------------------------
class _Buffer(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int32), ("data", ctypes.c_void_p), ("rank", ctypes.c_int64),
                ("dims", ctypes.POINTER(ctypes.c_int64))]


class _Attr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("kind", ctypes.c_int32), ("i32", ctypes.c_int32),
                ("f32", ctypes.c_float), ("str", ctypes.c_char_p), ("str_len", ctypes.c_size_t)]


class _HandlerEntry(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("platform", ctypes.c_char_p), ("handler", ctypes.c_void_p)]


_LAUNCH_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint),
                              ctypes.POINTER(ctypes.c_uint), ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p))
_MEMORY_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_char_p)
_MAP, _UNMAP, _CHECK = 0, 1, 2


class _Call:
    """The state of the handler call in progress: its memory, library and record."""

    def __init__(self, library: "EmulatedLibrary", memory, record: CallRecord, seed, race_check, budget):
        self.library, self.memory, self.record = library, memory, record
        self.seed, self.race_check, self.budget = seed, race_check, budget
        self.error: BaseException | None = None   # the first failure inside a callback


_current: _Call | None = None


def _on_launch(name, grid, block, smem, args) -> int:
    call = _current
    if call is None or call.error is not None:
        return 1
    try:
        call.library._run_kernel(call, name.decode(), tuple(grid[:3]), tuple(block[:3]), int(smem), args)
        return 0
    except BaseException as e:  # noqa: BLE001 -- re-raised by EmulatedLibrary.call
        call.error = e
        return 1


def _on_memory(op, address, nbytes, what) -> int:
    call = _current
    if call is None or call.error is not None:
        return 1
    try:
        what = what.decode()
        if op == _MAP:
            call.memory.add(address, nbytes, what)
        elif op == _UNMAP:
            call.memory.remove(address)
        else:
            # Raises EmulationError unless [address, address + nbytes) lies in one range.
            call.memory.load(np.array([address], np.int64), nbytes, what)
            call.record.host_accesses.append(f"{what}({nbytes} bytes)")
        return 0
    except BaseException as e:  # noqa: BLE001
        call.error = e
        return 1


_CALLBACKS = (_LAUNCH_FN(_on_launch), _MEMORY_FN(_on_memory))  # alive as long as the module


@functools.cache
def _runtime() -> ctypes.CDLL:
    rt = ctypes.CDLL(str(emulation_runtime()), mode=ctypes.RTLD_GLOBAL)
    rt.flashgen_emu_set_callbacks(*_CALLBACKS)
    rt.flashgen_emu_call.argtypes = [
        ctypes.c_void_p, ctypes.POINTER(_Buffer), ctypes.c_int64, ctypes.POINTER(_Buffer), ctypes.c_int64,
        ctypes.POINTER(_Attr), ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64),
        ctypes.c_char_p, ctypes.c_size_t]
    rt.flashgen_emu_live_allocations.restype = ctypes.c_size_t
    return rt


_PARSED: dict = {}


def _parsed(sha256: str, path) -> PtxModule:
    """The PTX of `sha256` (checked against `path` just before), parsed once per process: every
    library with these bytes shares its kernels, and so the compiled form each keeps."""
    module = _PARSED.get(sha256)
    if module is None:
        module = _PARSED[sha256] = PtxModule.parse(path.read_text())
        heap.keep_forever()
    return module


def device_array(shape, dtype, fill: np.ndarray | None = None) -> np.ndarray:
    """A C-contiguous array at a 256-byte aligned address (as XLA's buffers are), holding
    `fill` or else 0xFF bytes (NaN for floats: what poisoning writes)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.full(nbytes + _ALIGN, 0xFF, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    out = raw[start:start + nbytes].view(dtype).reshape(shape)
    if fill is not None:
        out[...] = fill
    return out


class EmulatedLibrary:
    """A library built with host="emulate", its handlers callable with numpy buffers."""

    def __init__(self, library: Library):
        manifest = library.manifest
        if manifest.get("host") != "emulate":
            raise ValueError(f"{library.path} was built for host {manifest.get('host')!r}; "
                             "build it with host='emulate'")
        self.arch = manifest["target"]
        # Handlers poison their outputs under FLASHGEN_POISON (read once per process);
        # an emulated run is a check, so poisoning is on unless the caller said otherwise.
        os.environ.setdefault("FLASHGEN_POISON", "1")
        self._rt = _runtime()
        native.module()     # the emulator's C helpers load (or build) with the runtime, not in a first launch
        self._dll = ctypes.CDLL(str(library.path))
        table = self._dll.flashgen_handlers
        table.restype = ctypes.POINTER(_HandlerEntry)
        count = ctypes.c_size_t()
        entries = table(ctypes.byref(count))
        self.handlers = {entries[i].name.decode(): entries[i].handler for i in range(count.value)}
        for name in manifest["ptx"]:  # the PTX must be what this build kept, byte for byte
            cache.check_file(library.path.parent / name, manifest["files"].get(name))
        self.modules = [_parsed(manifest["files"][p]["sha256"], library.path.parent / p) for p in manifest["ptx"]]
        self.kernels = {name: (m, k) for m in self.modules for name, k in m.kernels.items()}
        self.library = library

    def _run_kernel(self, call: _Call, name: str, grid, block, smem: int, args) -> None:
        if name not in self.kernels:
            raise EmulationError(f"kernel {name} is not in this library's PTX")
        module, kernel = self.kernels[name]
        params = [ctypes.string_at(args[i], p.size) for i, p in enumerate(kernel.params)]
        stats = launch(module, name, grid, block, smem, params, call.memory, arch=self.arch,
                       seed=call.seed, race_check=call.race_check, max_warp_instructions=call.budget)
        call.record.launches.append(Launch(name, short_name(name), grid, block, smem, stats))

    def call(self, target: str, operands, results, *, seed: int | None = None, race_check: bool = True,
             scratch_limit: int | None = None, max_warp_instructions: int = MAX_WARP_INSTRUCTIONS,
             **attrs):
        """Run handler `target` on `operands` (numpy arrays) producing `results`
        ((shape, dtype) pairs, or arrays to fill in place); returns (results, CallRecord).

        Attributes are keywords, typed by the target's schema (contract.ATTRIBUTE_TYPES).
        `scratch_limit` (bytes) makes the host refuse larger scratch, as XLA may.
        `max_warp_instructions` bounds each launch (a kernel that spins forever, on a turn that
        never comes, fails when it runs out).
        Raises HandlerError when the handler returns an error, EmulationError when a
        kernel (or a host access to device memory) does something unsafe or unsupported."""
        global _current
        if target not in self.handlers:
            raise ValueError(f"{target} is not in this library (it has {', '.join(sorted(self.handlers))})")
        parsed = parse_target_name(target)
        schema = ATTRIBUTE_TYPES[parsed[0]] if parsed else {}
        unknown, missing = set(attrs) - set(schema), set(schema) - set(attrs)
        if unknown or missing:
            raise ValueError(f"{target}: attribute(s) {sorted(unknown | missing)} "
                             f"{'not taken' if unknown else 'missing'}; its attributes: {sorted(schema)}")

        memory = GlobalMemory()
        ops = [device_array(a.shape, a.dtype, a) for a in map(np.ascontiguousarray, operands)]
        outs = [r if isinstance(r, np.ndarray) and r.ctypes.data % _ALIGN == 0 else
                device_array(*((r.shape, r.dtype) if isinstance(r, np.ndarray) else r)) for r in results]
        keep = []  # ctypes dims arrays must outlive the call

        def buffers(arrays, kind):
            out = (_Buffer * max(len(arrays), 1))()
            for i, a in enumerate(arrays):
                if a.dtype not in _FFI_DTYPES:
                    raise ValueError(f"{kind} {i}: dtype {a.dtype} has no XLA FFI type here")
                dims = (ctypes.c_int64 * max(a.ndim, 1))(*a.shape)
                keep.append(dims)
                out[i] = _Buffer(_FFI_DTYPES[a.dtype], a.ctypes.data, a.ndim, dims)
                if a.nbytes:
                    memory.add(a.ctypes.data, a.nbytes, f"{kind} {i}")
            return out

        args, rets = buffers(ops, "operand"), buffers(outs, "result")
        attr_array = (_Attr * max(len(attrs), 1))()
        for i, (name, value) in enumerate(sorted(attrs.items())):
            kind = _ATTR_KINDS[schema[name]]
            text = value.encode() if kind == 3 else None
            keep.append(text)
            attr_array[i] = _Attr(name.encode(), kind, int(value) if kind in (0, 1) else 0,
                                  float(value) if kind == 2 else 0.0, text, len(text) if text else 0)

        record = CallRecord()
        message = ctypes.create_string_buffer(4096)
        scratch = ctypes.c_int64()
        gpu = targets.lookup(self.arch).gpu
        self._rt.flashgen_emu_set_device(*gpu.compute_capability, gpu.sm_count, gpu.smem_limit)
        self._rt.flashgen_emu_reset_errors()
        _current = _Call(self, memory, record, seed, race_check, max_warp_instructions)
        t0 = time.perf_counter()
        try:
            code = self._rt.flashgen_emu_call(
                self.handlers[target], args, len(ops), rets, len(outs), attr_array, len(attrs),
                -1 if scratch_limit is None else scratch_limit, ctypes.byref(scratch), message, len(message))
            error = _current.error
        finally:
            _current = None
        record.seconds = time.perf_counter() - t0
        record.scratch_bytes = scratch.value
        if error is not None:
            raise error
        if code != 0:
            raise HandlerError(code, message.value.decode(errors="replace"), record)
        return outs, record
