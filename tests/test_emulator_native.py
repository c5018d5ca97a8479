"""The emulator's native module (csrc/flashgen/emulate/native) called directly: mma.sync over a gang
of warps against float64, and the argument checks that keep a wrong call from writing out of
bounds."""
import ml_dtypes
import numpy as np
import pytest

from flashgen.emulate import native
from flashgen.emulate.semantics.warpops import _mma_tables, mma_a_table, mma_b_table, mma_c_table


def _bits(x):
    return x.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)


def _registers(a, b, c):
    """One warp's mma.m16n8k16.bf16 registers for A (16x16), B (16x8), C (16x8) by the PTX ISA's
    fragment tables: A's 4 and B's 2 as u32 [reg][lane], C's 4 as f32 [reg][lane]."""
    (ar, ac), (bk, bn), (cr, cc) = mma_a_table(16, "bf16"), mma_b_table(16, "bf16"), mma_c_table()
    pack = lambda m, r, col: (_bits(m[r[..., 0], col[..., 0]]) | _bits(m[r[..., 1], col[..., 1]]) << 16).T
    return pack(a, ar, ac), pack(b, bk, bn), c[cr, cc].T.astype(np.float32)


def test_mma_of_a_gang_computes_the_executing_warps_only(rng):
    g, executing = 3, np.repeat([True, False, True], 32)
    mats = [(rng.standard_normal((16, 16)), rng.standard_normal((16, 8)), rng.standard_normal((16, 8)))
            for _ in range(g)]
    regs = [_registers(*m) for m in mats]
    ab = [np.ascontiguousarray(np.concatenate([r[0][i] if i < 4 else r[1][i - 4] for r in regs])) for i in range(6)]
    c = [np.ascontiguousarray(np.concatenate([r[2][i] for r in regs])) for i in range(4)]
    d = [np.full(32 * g, np.nan, np.float32) for _ in range(4)]
    native.module().mma(g, 16, 0, executing, *ab, *c, *d, *_mma_tables(16, "bf16"))
    cr, cc = mma_c_table()
    for w, (a, b, cm) in enumerate(mats):
        got = np.stack([x[32 * w:32 * w + 32] for x in d])                     # [reg][lane]
        if not executing[32 * w]:
            assert np.isnan(got).all(), "a warp that does not execute kept its D registers"
            continue
        want = (a.astype(ml_dtypes.bfloat16).astype(np.float64) @ b.astype(ml_dtypes.bfloat16).astype(np.float64)
                + cm.astype(np.float32))[cr, cc].T
        assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
    # D in C's registers (what nvcc emits): each warp reads its C before writing its D
    alias = [x.copy() for x in c]
    native.module().mma(g, 16, 0, None, *ab, *alias, *alias, *_mma_tables(16, "bf16"))
    separate = [np.empty_like(x) for x in c]
    native.module().mma(g, 16, 0, None, *ab, *c, *separate, *_mma_tables(16, "bf16"))
    assert all((x.view(np.uint32) == y.view(np.uint32)).all() for x, y in zip(alias, separate))


def test_native_helpers_refuse_what_they_would_overrun():
    m = native.module()
    tables = _mma_tables(16, "bf16")
    regs = [np.zeros(64, np.uint32) for _ in range(10)] + [np.zeros(64, np.float32) for _ in range(4)]
    m.mma(2, 16, 0, None, *regs, *tables)
    with pytest.raises(ValueError, match="D register"):
        m.mma(2, 16, 0, None, *regs[:13], np.zeros(63, np.float32), *tables)
    with pytest.raises(ValueError, match="A/B register"):
        m.mma(2, 16, 0, None, np.zeros(64, np.float64), *regs[1:], *tables)
    with pytest.raises(ValueError, match="mma: g 2, k 12"):
        m.mma(2, 12, 0, None, *regs, *tables)
    with pytest.raises(TypeError, match="takes 22 arguments"):
        m.mma(2, 16, 0, None, *regs, *tables[:3])
    memory = np.zeros(256, np.uint32)
    with pytest.raises(ValueError, match="out"):
        m.shared_load(np.arange(4, dtype=np.int64) * 16, 16, 0, None, 1024, 1024, 0, 0, 0, None, None, memory,
                      np.empty(15, np.uint32))
    # an offset past the slot's bytes, or a slot past the memory, declines (memory.py names it)
    out = np.empty(16, np.uint32)
    assert m.shared_load(np.array([1024], np.int64), 16, 0, None, 1024, 1024, 0, 0, 0, None, None, memory, out) == 1
    assert m.shared_load(np.array([0], np.int64), 16, 1, None, 1024, 1024, 0, 0, 0, None, None, memory, out) == 1
    a = np.arange(8, dtype=np.int64)
    with pytest.raises(IndexError, match="index 8 of 8"):
        m.add_each(a, np.array([1, 8], np.int64), 5)
    assert (a == np.arange(8)).all(), "a refused add_each changed the array"
    m.add_each(a, np.array([1, 1, 7], np.int64), 5)
    assert a.tolist() == [0, 11, 2, 3, 4, 5, 6, 12]
