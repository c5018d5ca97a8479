"""A PTX emulator: runs the PTX nvcc emits for flashgen's CUDA kernels on the CPU (numpy).

Emulation establishes correctness, never speed. Entry points: PtxModule.parse / load_ptx,
GlobalMemory, launch (see machine.py for the execution model and memory.py for the checks).
"""
from flashgen.emulate.errors import EmulationError
from flashgen.emulate.machine import LaunchStats, launch
from flashgen.emulate.memory import GlobalMemory
from flashgen.emulate.ptx import Kernel, Param, PtxModule, load_ptx

__all__ = ["EmulationError", "GlobalMemory", "Kernel", "LaunchStats", "Param", "PtxModule", "launch", "load_ptx"]
