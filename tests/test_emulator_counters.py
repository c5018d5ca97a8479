"""Emulated counters (flashgen.emulate.counters) on hand-written PTX micro-kernels (no nvcc):
each expected count is derived in a comment from the bank model of counters.py's docstring
(32 banks of 4-byte words; wavefronts of a warp phase = most distinct words in one bank)."""
from __future__ import annotations

import collections
import struct

import numpy as np
import pytest

from flashgen.emulate import GlobalMemory, PtxModule, launch
from flashgen.emulate import counters
from flashgen.emulate.counters import tensor_core

# Each lane (lane = %tid.x % 32) first loads 4 bytes of global memory (`src[tid]`), then reads
# shared memory at buf + lane * stride (bytes, the second parameter): one 4-byte load (`load4`),
# one 8-byte load (`load8`), one ldmatrix.x4 (`ldsm`: lane i gives row i % 8 of matrix i // 8);
# `mma` runs one mma.sync m16n8k16 on zeros instead.
ACCESS = {
    "load4": "ld.shared.u32 %r6, [%r5];",
    "load8": "ld.shared.v2.u32 {%r6, %r7}, [%r5];",
    "ldsm": "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r8, %r9, %r10, %r11}, [%r5];",
    "mma": "mov.b32 %r0, 0;\n\tmov.f32 %f4, 0f00000000;\n\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
           "{%f0, %f1, %f2, %f3}, {%r0, %r0, %r0, %r0}, {%r0, %r0}, {%f4, %f4, %f4, %f4};",
}


def _entry(name: str, access: str) -> str:
    return f"""
.visible .entry {name}(.param .u64 {name}_param_0, .param .u32 {name}_param_1)
{{
	.reg .b32 %r<12>;
	.reg .f32 %f<8>;
	.reg .b64 %rd<4>;
	.shared .align 16 .b8 buf[8192];
	ld.param.u64 %rd1, [{name}_param_0];
	ld.param.u32 %r1, [{name}_param_1];
	mov.u32 %r2, %tid.x;
	mul.wide.u32 %rd2, %r2, 4;
	add.s64 %rd3, %rd1, %rd2;
	ld.global.u32 %r7, [%rd3];
	and.b32 %r2, %r2, 31;
	mul.lo.u32 %r3, %r2, %r1;
	mov.u32 %r4, buf;
	add.u32 %r5, %r4, %r3;
	{access}
	ret;
}}
"""


PTX = ".version 7.8\n.target sm_80\n.address_size 64\n" + "".join(_entry(n, a) for n, a in ACCESS.items())


@pytest.fixture(scope="module")
def module():
    return PtxModule.parse(PTX)


@pytest.fixture(autouse=True)
def counting(monkeypatch):
    monkeypatch.setenv(counters.ENV, "1")


def run(module, name, stride, threads=32):
    src = np.arange(threads, dtype=np.uint32)
    memory = GlobalMemory()
    memory.add(src.ctypes.data, src.nbytes, "src")
    params = [struct.pack("<Q", src.ctypes.data), struct.pack("<I", stride)]
    return launch(module, name, (1, 1, 1), (threads, 1, 1), 0, params, memory, arch="sm80", seed=0)


@pytest.mark.parametrize("kernel, stride, threads, wavefronts, ideal", [
    # 4 bytes, stride 1 word: lane i -> bank i, 32 banks once each: 1 wavefront
    ("load4", 4, 32, 1, 1),
    # stride 2 words: lane i -> word 2i, bank 2i % 32: lanes i and i + 16 hit one bank in two words: 2
    ("load4", 8, 32, 2, 1),
    # stride 32 words: every lane in bank 0, 32 distinct words: 32
    ("load4", 128, 32, 32, 1),
    # stride 0: all lanes read one word, a broadcast: 1
    ("load4", 0, 32, 1, 1),
    # two warps (lane = tid % 32, so both read words 0-31): one conflict-free wavefront each,
    # counted per warp (one group of 64 rows would make it 2 words in each bank, 2 wavefronts, ideal 1)
    ("load4", 4, 64, 2, 2),
    # 8 bytes, contiguous: 2 half-warp phases, each 16 lanes x 2 words = words 0-31 (or 32-63) in
    # 32 banks once: 1 wavefront per phase, 2 in all
    ("load8", 8, 32, 2, 2),
    # 8 bytes at stride 16 bytes: in a half-warp lane i reads words 4i, 4i + 1; lanes i and i + 8
    # share banks (4i % 32) with distinct words: 2 per phase, 4 in all
    ("load8", 16, 32, 4, 2),
    # ldmatrix.x4 of contiguous 16-byte rows: a matrix's 8 rows are 128 bytes, 32 banks once:
    # 1 per matrix, 4 in all
    ("ldsm", 16, 32, 4, 4),
    # rows 128 bytes apart (an unpadded 64-column bf16 tile): the 8 rows of a matrix all sit in
    # banks 0-3, 8 distinct words each: 8 per matrix, 32 in all
    ("ldsm", 128, 32, 32, 4),
])
def test_shared_wavefronts(module, kernel, stride, threads, wavefronts, ideal):
    c = run(module, kernel, stride, threads).counters
    assert (c.smem_wavefronts, c.smem_ideal_wavefronts) == (wavefronts, ideal)
    assert c.global_bytes_loaded == 4 * threads        # each thread's one ld.global.u32


def test_tensor_core_flops(module):
    stats = run(module, "mma", 0, threads=64)
    # 2 warps x 1 mma.sync m16n8k16 = 2 tensor-core warp-instructions of 2*16*8*16 = 4096 FLOPs each;
    # no shared access; 64 threads x 4 bytes of global loads
    assert tensor_core(stats.opcode_counts) == (2, 8192)
    assert stats.counters.smem_wavefronts == 0
    assert stats.counters.global_bytes_loaded == 256
    assert stats.warp_instructions > 2


def test_wgmma_flops_are_shared_by_the_warpgroup():
    # one wgmma m64n64k16 on a warpgroup: 4 warp-instructions, 2*64*64*16 = 131072 FLOPs in all
    counts = collections.Counter({"wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16": 4, "add.f32": 10})
    assert tensor_core(counts) == (4, 131072)


def test_counting_is_opt_in(module, monkeypatch):
    monkeypatch.delenv(counters.ENV)
    stats = run(module, "load4", 128)
    assert stats.counters is None and counters.summary([stats]) == {}


def test_summary_sums_launches(module):
    stats = [run(module, "mma", 0), run(module, "load4", 128)]
    s = counters.summary(stats)
    # mma: 1 instruction (4096 FLOPs), 128 bytes; load4 at stride 32 words: 32 wavefronts, ideal 1, 128 bytes
    assert (s["tensor_core_instructions"], s["tensor_core_flops"], s["smem_wavefronts"], s["smem_ideal_wavefronts"],
            s["global_bytes_loaded"]) == (1, 4096, 32, 1, 256)
    assert s["bytes_per_flop"] == 256 / 4096
    assert s["warp_instructions"] == sum(x.warp_instructions for x in stats)
    assert counters.format_line(s).startswith("tensor-core 1/")


def test_check_prints_one_line_per_kernel_of_each_call(module):
    from flashgen.emulate.check import Row, format_counters
    counts = {"mma": counters.summary([run(module, "mma", 0)])}
    rows = [Row("dense", "d64_bf16", "sq=1", out, 0.0, 1.0, 0.1, 10, 1, "mma", counts) for out in ("o", "lse")]
    lines = format_counters(rows).splitlines()
    assert lines[0] == "emulated counts, not speed:"
    assert lines[1:] == ["  d64_bf16 dense sq=1 mma: " + counters.format_line(counts["mma"])]   # one call: one line
