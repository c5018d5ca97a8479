"""Emulated counters of a launch: tensor-core work, shared-memory bank conflicts and global bytes
per FLOP. They rank tile choices and catch regressions between two builds of a kernel; they are
counts of what the emulated warps did, never a speed.

Shared-memory model (CUDA C++ Programming Guide, "Compute Capability 5.x > Shared Memory", which
the 6.x-9.0 sections refer to): 32 banks, successive 4-byte words in successive banks; a warp's
request is served in as many wavefronts as the most distinct words any one bank holds among
those its lanes touch (lanes reading the same word share it: a broadcast). Wider accesses are
split the way Nsight Compute counts their wavefronts (not spelled out in the guide for cc >= 5):
8-byte accesses in 2 half-warp phases (lanes 0-15, 16-31), 16-byte accesses in 4 quarter-warp
phases (8 lanes each), each phase counted as above; ldmatrix's 8 row addresses of a matrix are
one 16-byte phase. The ideal count is one wavefront per phase. Only the generic-proxy accesses
(ld/st.shared, ldmatrix, stmatrix, cp.async's shared side) are counted: TMA and wgmma read and
write shared memory through other paths (hopper_state) and are not.

FLOPs are those of the tensor-core instructions: 2*m*n*k per mma.sync; per wgmma.mma_async its
warpgroup's 2*m*n*k, a quarter of it on each of the 4 warps that execute (and are counted for) it.
Global bytes loaded: ld.global, cp.async and TMA sources (not the tensor maps' 128-byte reads).

Counting is opt-in (FLASHGEN_EMULATE_COUNTERS=1; `flashgen check --emulate --counters` sets it):
the bank model's sorts slowed the emulated sm80 forward by ~50% (d64 bf16 causal, 150 x 150),
the Hopper forward, whose shared traffic is TMA and wgmma, by ~2%.
"""
from __future__ import annotations

import dataclasses
import os
import re

import numpy as np

_SHAPE = re.compile(r"\.m(\d+)n(\d+)k(\d+)")
TENSOR_CORE = {"mma": 1, "wgmma": 4}       # opcode -> warps that share one instruction's FLOPs
ENV = "FLASHGEN_EMULATE_COUNTERS"


def enabled() -> bool:
    """Whether launches count (ENV=1)."""
    return os.environ.get(ENV) == "1"


@dataclasses.dataclass
class Counters:
    smem_wavefronts: int = 0
    smem_ideal_wavefronts: int = 0
    global_bytes_loaded: int = 0

    def shared_access(self, offs: np.ndarray, nbytes: int, who, lanes) -> None:
        """One shared-memory access: `offs` per executing row, `who` its warp (one id, or one per
        row, unique over the CTAs), `lanes` its lane ids."""
        if offs.size == 0:
            return
        words_per_row = max(nbytes // 4, 1)
        phase = np.asarray(lanes, np.int64) // (32 // min(words_per_row, 4)) if words_per_row > 1 else 0
        key = (who * 4 + phase) << 32
        words = np.asarray(offs, np.int64) // 4
        if words_per_row > 1:
            words = words[:, None] + np.arange(words_per_row)
            key = np.broadcast_to(np.asarray(key)[..., None] if np.ndim(key) else key, words.shape)
        distinct = np.unique((key + words).reshape(-1))                   # broadcasts collapse here
        bank_of_phase, per_bank = np.unique((distinct >> 32) * 32 + (distinct & 31), return_counts=True)
        phases = bank_of_phase >> 5
        starts = np.flatnonzero(np.r_[True, phases[1:] != phases[:-1]])
        self.smem_wavefronts += int(np.maximum.reduceat(per_bank, starts).sum())
        self.smem_ideal_wavefronts += int(starts.size)


def tensor_core(opcode_counts) -> tuple[int, int]:
    """(tensor-core warp-instructions, their FLOPs) of a launch's opcode counts (form -> count)."""
    instructions = flops = 0
    for form, n in opcode_counts.items():
        warps = TENSOR_CORE.get(form.split(".", 1)[0])
        shape = _SHAPE.search(form) if warps else None
        if shape:
            m, nn, k = (int(x) for x in shape.groups())
            instructions += n
            flops += n * 2 * m * nn * k // warps
    return instructions, flops


def summary(launches) -> dict:
    """The counters of launches' LaunchStats, summed, as plain numbers (bytes_per_flop: None
    without tensor-core work); {} when a launch did not count."""
    if any(stats.counters is None for stats in launches):
        return {}
    total = dict.fromkeys(("warp_instructions", "tensor_core_instructions", "tensor_core_flops", "smem_wavefronts",
                           "smem_ideal_wavefronts", "global_bytes_loaded"), 0)
    for stats in launches:
        tc, flops = tensor_core(stats.opcode_counts)
        c = stats.counters
        for key, n in (("warp_instructions", stats.warp_instructions), ("tensor_core_instructions", tc),
                       ("tensor_core_flops", flops), ("smem_wavefronts", c.smem_wavefronts),
                       ("smem_ideal_wavefronts", c.smem_ideal_wavefronts),
                       ("global_bytes_loaded", c.global_bytes_loaded)):
            total[key] += n
    flops = total["tensor_core_flops"]
    total["bytes_per_flop"] = total["global_bytes_loaded"] / flops if flops else None
    return total


def format_line(counts: dict) -> str:
    """One line of summary(): emulated counts, not speed."""
    bpf = counts["bytes_per_flop"]
    return (f"tensor-core {counts['tensor_core_instructions']:,}/{counts['warp_instructions']:,} warp-instructions, "
            f"smem wavefronts {counts['smem_wavefronts']:,} (ideal {counts['smem_ideal_wavefronts']:,}), "
            f"global bytes/FLOP {'-' if bpf is None else f'{bpf:.4f}'}")
