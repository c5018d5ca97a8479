"""The emulator's native module (csrc/flashgen/emulate/native) called directly: mma.sync over a gang
of warps against float64, and the argument checks that keep a wrong call from writing out of
bounds; and its helpers against memory.py's numpy path they stand in for (global bookkeeping,
ldmatrix)."""
import re

import ml_dtypes
import numpy as np
import pytest

from conftest import needs_nvcc
from flashgen.emulate import native, numerics
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


@pytest.mark.parametrize("atype,k", [("bf16", 16), ("f16", 16), ("tf32", 8)])
def test_mma_of_every_element_type_against_float64(atype, k, rng):
    """Fragments built from warpops.py's own tables (an element's slot in [register][lane][element]),
    so each type and k reaches the arithmetic: two warps of different data, D against A @ B + C in
    float64 (products of these types are exact; the f64 sums round far below f32's ulp)."""
    g, per_reg = 2, 32 if atype == "tf32" else 64
    a_src, b_src, c_src, d_of = _mma_tables(k, atype)
    element = {"bf16": ml_dtypes.bfloat16, "f16": np.float16}.get(atype)
    ab, c, want = [np.empty(32 * g, np.uint32) for _ in range(6)], [np.empty(32 * g, np.float32) for _ in range(4)], []
    for w in range(g):
        a, b, cm = rng.standard_normal((16, k)), rng.standard_normal((k, 8)), rng.standard_normal((16, 8))
        if element is None:      # tf32: the tensor core reads an f32's top 19 bits
            bits = lambda x: x.astype(np.float32).view(np.uint32) & np.uint32(0xFFFFE000)
            a, b = (bits(x).view(np.float32).astype(np.float64) for x in (a, b))
            fragment = np.zeros(6 * per_reg, np.uint32)
        else:
            bits = lambda x: x.astype(element).view(np.uint16)
            a, b = (x.astype(element).astype(np.float64) for x in (a, b))
            fragment = np.zeros(6 * per_reg, np.uint16)
        fragment[a_src] = bits(a).reshape(-1)
        fragment[4 * per_reg + b_src] = bits(b).reshape(-1)
        rows = fragment.view(np.uint32).reshape(6, 32)
        for r in range(6):
            ab[r][32 * w:32 * w + 32] = rows[r]
        flat = np.zeros(128, np.float32)
        flat[c_src] = cm.astype(np.float32).reshape(-1)
        for r in range(4):
            c[r][32 * w:32 * w + 32] = flat[32 * r:32 * r + 32]
        want.append((a @ b + cm.astype(np.float32)).reshape(-1)[d_of].reshape(4, 32))
    d = [np.full(32 * g, np.nan, np.float32) for _ in range(4)]
    native.module().mma(g, k, {"bf16": 0, "f16": 1, "tf32": 2}[atype], None, *ab, *c, *d, *_mma_tables(k, atype))
    for w in range(g):
        got = np.stack([x[32 * w:32 * w + 32] for x in d])
        np.testing.assert_allclose(got, want[w], rtol=1e-6, atol=1e-6)


def _specials_f32(rng, n):
    """f32 values that test a conversion: zeros, infinities, NaNs with payloads, the largest finite
    (which rounds up to bf16's infinity), bf16 ties both ways, subnormals, then random bit patterns."""
    edge = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7F7FFFFF,
                     0x7F7F8000, 0x3F808000, 0x3F818000, 0x00000001, 0x00008000, 0x807FFFFF, 0x00800000],
                    np.uint32)
    return np.concatenate([edge, rng.integers(0, 2**32, n, dtype=np.uint32)]).view(np.float32)


def _same_bits_or_both_nan(got, want):
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])


def test_native_numerics_are_the_numpy_definitions_bit_for_bit(rng):
    """numerics_emu.cc's bf16 pair packing and ex2.approx (.ftz or not) against the numpy functions
    they stand in for (numerics.py's rounding, f64 exp2 rounded once), then their argument checks."""
    m = native.module()
    hi, lo = _specials_f32(rng, 4000), _specials_f32(rng, 4000)[::-1].copy()
    got = np.full(hi.size, 0xDEADBEEF, np.uint32)
    m.pack_bf16x2(hi, lo, got)
    want = numerics.f32_to_bf16_rn(hi).astype(np.uint32) << 16 | numerics.f32_to_bf16_rn(lo)
    np.testing.assert_array_equal(got, want)
    assert (want[:15] >> 16).tolist()[2:9] == [0x7F80, 0xFF80, 0x7FFF, 0x7FFF, 0x7FFF, 0x7F80, 0x7F80]
    x = np.concatenate([_specials_f32(rng, 0), rng.uniform(-160, 130, 4000).astype(np.float32),
                        np.float32([-126.5, -149.0, -150.0, 127.9, 128.0])])
    for ftz in (0, 1):
        flush = numerics.ftz if ftz else (lambda v: v)
        out = np.full(x.size, np.nan, np.float32)
        m.ex2(x, ftz, out)
        with np.errstate(all="ignore"):
            _same_bits_or_both_nan(out, flush(np.exp2(flush(x).astype(np.float64)).astype(np.float32)))
        assert (np.abs(out[-5:-2]) == 0).all() == bool(ftz)        # subnormal results flush under .ftz
    inplace = x.copy()
    m.ex2(inplace, 1, inplace)                                     # out may be the input register
    _same_bits_or_both_nan(inplace, out)
    with pytest.raises(ValueError, match="hi"):
        m.pack_bf16x2(hi[:10], lo, np.empty(11, np.uint32))
    with pytest.raises(ValueError, match="x"):
        m.ex2(x.view(np.uint32).astype(np.float64), 0, np.empty(x.size, np.float32))
    with pytest.raises(ValueError, match="out"):
        m.ex2(x, 0, np.empty(3, np.float64))
    with pytest.raises(TypeError, match="takes 3 arguments"):
        m.ex2(x, out)


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
    for i, bound in enumerate((256, 128, 128, 128)):     # a table entry past the fragment it indexes
        for bad in (-1, bound):
            planted = [t.copy() for t in tables]
            planted[i][3] = bad
            with pytest.raises(ValueError, match=f"{('a_src', 'b_src', 'c_src', 'd_of')[i]}\\[3\\] = {bad} is outside"):
                m.mma(2, 16, 0, None, *regs, *planted)
    memory = np.zeros(256, np.uint32)
    with pytest.raises(ValueError, match="out"):
        m.shared_load(np.arange(4, dtype=np.int64) * 16, 16, 0, None, 1024, 1024, 0, 0, 0, None, None, memory,
                      np.empty(15, np.uint32))
    # an offset past the slot's bytes, or a slot past the memory, declines (memory.py names it)
    out = np.empty(16, np.uint32)
    assert m.shared_load(np.array([1024], np.int64), 16, 0, None, 1024, 1024, 0, 0, 0, None, None, memory, out) == 1
    assert m.shared_load(np.array([0], np.int64), 16, 1, None, 1024, 1024, 0, 0, 0, None, None, memory, out) == 1
    # ldmatrix.x4 of one warp: 4 destinations of 32 lanes, a gather table of 256 halves
    # (with the identity table, register j of lane l is word 32 j + l of the rows loaded)
    addr, table = np.arange(32, dtype=np.uint32) * 16, np.arange(256, dtype=np.int32)
    words = (np.arange(256, dtype=np.uint64) * 2654435761 % 2**32).astype(np.uint32)
    dests = [np.zeros(32, np.uint32) for _ in range(4)]
    ldsm = lambda *args: m.ldmatrix(addr, 0, 4, None, 0, None, 1024, 1024, 0, 0, 0, None, words, *args)
    assert ldsm(table, *dests) == 0
    assert all((d == words[32 * j:32 * j + 32]).all() for j, d in enumerate(dests))
    with pytest.raises(ValueError, match="dest register"):
        ldsm(table, *dests[:3], np.zeros(31, np.uint32))
    with pytest.raises(ValueError, match="nmat 4 with 17"):
        ldsm(table, *dests[:3])
    with pytest.raises(ValueError, match="addr of 32 lanes of 2 bytes"):     # would read past 2-byte lanes
        m.ldmatrix(addr.astype(np.uint16), 0, 4, None, 0, None, 1024, 1024, 0, 0, 0, None, words, table, *dests)
    with pytest.raises(ValueError, match="gather index 256"):
        ldsm(np.where(table == 5, 256, table).astype(np.int32), *dests)
    assert m.ldmatrix(addr + 1024, 0, 4, None, 0, None, 1024, 1024, 0, 0, 0, None, words, table, *dests) == 1
    a = np.arange(8, dtype=np.int64)
    with pytest.raises(IndexError, match="index 8 of 8"):
        m.add_each(a, np.array([1, 8], np.int64), 5)
    assert (a == np.arange(8)).all(), "a refused add_each changed the array"
    m.add_each(a, np.array([1, 1, 7], np.int64), 5)
    assert a.tolist() == [0, 11, 2, 3, 4, 5, 6, 12]


def _bookkeeping_run(ops, native_helpers: bool, monkeypatch):
    """Run `ops` (loads, atomics and stores of several CTAs on one range) on a fresh GlobalMemory:
    each op's outcome, then the owner and reader marks."""
    from flashgen.emulate import memory
    real = native.module()

    class Declining:      # the numpy path everywhere: the native global helpers decline each access
        def __getattr__(self, name):
            return (lambda *a: 1) if name.startswith("global_") else getattr(real, name)
    with monkeypatch.context() as m:
        if not native_helpers:
            m.setattr(memory.native, "module", lambda: Declining())
        buf = np.arange(256, dtype=np.float32)
        gm = memory.GlobalMemory()
        gm.add(buf.ctypes.data, buf.nbytes, "buf")
        gm.start_launch(track_writers=True, atomic_order=np.random.default_rng(7))
        outcomes = []
        for kind, offs, cta, nbytes in ops:
            addrs = buf.ctypes.data + offs
            try:
                with np.errstate(all="ignore"):
                    if kind == "load":
                        got = gm.load(addrs, nbytes, cta=cta).tobytes()
                    elif kind == "atomic":
                        gm.atomic_add(addrs, np.ones(offs.size, np.float32), cta=cta, returns=False)
                        got = buf.tobytes()
                    else:
                        gm.store(addrs, np.full((offs.size, nbytes), 7, np.uint8), cta=cta)
                        got = buf.tobytes()
                outcomes.append(got)
            except memory.EmulationError as e:
                base = buf.ctypes.data     # addresses as offsets: the two runs' buffers differ
                outcomes.append(re.sub(r"0x[0-9a-f]+", lambda a: f"+{int(a.group(), 16) - base}", str(e)))
                break
        marks = {k: v.copy() for k, v in gm._owners.items()}, {k: v.copy() for k, v in gm._readers.items()}
        return outcomes, (len(marks[0]), [a.tolist() for a in marks[0].values()],
                          sorted((k[1], v.tolist()) for k, v in marks[1].items()))


def test_native_global_bookkeeping_equals_the_numpy_path(rng, monkeypatch):
    """Random accesses of 3 CTAs (one CTA or one per row): the same data, races (message for
    message) and marks with the native helpers as with memory.py's numpy path."""
    for trial in range(150):
        ops = []
        for _ in range(int(rng.integers(1, 12))):
            kind = str(rng.choice(["load", "load", "atomic", "store"]))
            nbytes = 4 if kind != "load" else int(rng.choice([1, 2, 4, 8]))
            rows = int(rng.integers(1, 6))
            offs = rng.integers(0, 1024 // nbytes - 1, rows) * nbytes
            cta = int(rng.integers(3)) if rng.integers(2) else rng.integers(0, 3, rows)
            ops.append((kind, offs, cta, nbytes))
        assert _bookkeeping_run(ops, True, monkeypatch) == _bookkeeping_run(ops, False, monkeypatch), trial


@needs_nvcc
@pytest.mark.parametrize("causal", [False, True])
def test_native_ldmatrix_loads_what_the_numpy_path_does(rng, monkeypatch, causal):
    """The dense forward and backward (their ldmatrix.x4 and .x4.trans of gangs all or some of
    whose warps execute) under one schedule seed: the same bits with SharedMemory.ldmatrix as
    with it declining every call (the numpy path), and the native path taken."""
    from emulated_dense import run_dense_backward, run_dense_forward, spec_module
    from flashgen.emulate import memory
    module = spec_module(64, "bf16", causal)
    q, k, v, do = (rng.standard_normal((1, n, 2, 64)).astype(ml_dtypes.bfloat16) for n in (70, 97, 97, 70))
    taken = []
    native_load = memory.SharedMemory.ldmatrix

    def counted(*args):
        taken.append(native_load(*args))
        return taken[-1]
    monkeypatch.setattr(memory.SharedMemory, "ldmatrix", counted)
    seed = int(rng.integers(2**31))
    outputs = []
    for path in ("native", "numpy"):
        if path == "numpy":
            monkeypatch.setattr(memory.SharedMemory, "ldmatrix", lambda *args: False)
        o, lse, _ = run_dense_forward(module, q, k, v, causal=causal, dtype="bf16", seed=seed)
        grads, _ = run_dense_backward(module, q, k, v, do, causal=causal, dtype="bf16", seed=seed)
        outputs.append([o, lse, *grads])
    assert taken and all(taken), "the native ldmatrix declined a clean dense launch"
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), *outputs):
        assert np.array_equal(a, b, equal_nan=True), name
