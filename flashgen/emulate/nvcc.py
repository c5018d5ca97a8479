"""PTX for the emulator: compile CUDA source with the flags of the real build.

The library build uses `-gencode arch=compute_XX,code=...`; for PTX we pass `-arch=compute_XX`
with every other flag unchanged, so the front end (cicc) sees the same program and options.
"""
from __future__ import annotations

import pathlib
import tempfile

from flashgen import targets, toolchain


def ptx_flags(arch: str, include_first: str | None = None) -> list[str]:
    flags = toolchain.cuda_compile_flags(arch)
    i = flags.index("-gencode")
    flags[i:i + 2] = [f"-arch={targets.lookup(arch).gpu.ptx_arch}"]
    if include_first:          # e.g. a mutated copy of csrc/ that must shadow the real headers
        flags = ["-I", include_first, *flags]
    return flags


def compile_ptx(source: str | pathlib.Path, arch: str, *, include_first: str | None = None,
                name: str = "kernel.cu") -> str:
    """PTX text of CUDA `source` (a path, or the text itself)."""
    with tempfile.TemporaryDirectory(prefix="flashgen-ptx-") as tmp:
        src = pathlib.Path(source) if isinstance(source, pathlib.Path) else None
        if src is None:
            src = pathlib.Path(tmp) / name
            src.write_text(source)
        out = pathlib.Path(tmp) / "out.ptx"
        toolchain.run([toolchain.nvcc(), *ptx_flags(arch, include_first), "-ptx", str(src), "-o", str(out)],
                      f"nvcc -ptx {src.name}", nvcc_tmpdir=pathlib.Path(tmp))
        return out.read_text()
