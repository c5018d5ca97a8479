"""The native runs of plain instructions (semantics/alu.py, alu_emu.cc) against the numpy handlers
they stand in for: random programs of every form alu.py takes, over random register bits (NaN,
infinities, signed zeros, subnormals and integer extremes among them), all lanes or a mask of them,
both ways; every register must come out with the same bits. And the checks that refuse a bad
program before it writes."""
import numpy as np
import pytest

from flashgen.emulate import native
from flashgen.emulate.machine import _Compiled, _Registers, _RegisterView
from flashgen.emulate.ptx import PtxModule
from flashgen.emulate.semantics import alu

CMP_INT = ("eq", "ne", "lt", "le", "gt", "ge", "lo", "ls", "hi", "hs")
CMP_F32 = ("eq", "ne", "lt", "le", "gt", "ge", "equ", "neu", "ltu", "leu", "gtu", "geu", "num", "nan")
SPECIAL_F32 = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-41, 3.4e38, 1.0, -2.5], np.float32)
SPECIAL_INT = np.array([0, 1, 0xFFFFFFFF, 0x80000000, 0x7FFFFFFF, 31, 32, 33, 63, 64, 200], np.uint64)


def _forms(rng):
    """One random instruction of each form alu.py takes (the templates' {r} {rd} {f} {p} {ri} {fi}
    {s} filled at random). No f32 register is read as an integer: when both operands of an f32
    op are NaN, which one's payload the result carries is the C compiler's choice (the hardware's
    result is the canonical NaN, neither engine's), so NaNs compare as equal, not bit for bit."""
    forms = [
        *(f"{op}.{t} {{r}}, {{r}}, {{ri}}" for op in ("add", "sub", "min", "max") for t in ("s32", "u32")),
        *(f"{op}.{t} {{rd}}, {{rd}}, {{rd}}" for op in ("add", "sub", "min", "max") for t in ("s64", "u64")),
        "mul.lo.s32 {r}, {r}, {ri}", "mul.lo.u64 {rd}, {rd}, {rd}", "mad.lo.s32 {r}, {r}, {r}, {ri}",
        "mad.lo.u32 {r}, {r}, {ri}, {r}", "mad.lo.s64 {rd}, {rd}, {rd}, {rd}",
        "mul.wide.s32 {rd}, {r}, {ri}", "mul.wide.u32 {rd}, {r}, {r}",
        *(f"{op}.b32 {{r}}, {{r}}, {{ri}}" for op in ("and", "or", "xor")), "xor.b64 {rd}, {rd}, {rd}",
        "not.b32 {r}, {r}", "not.b64 {rd}, {rd}", "neg.s32 {r}, {r}", "neg.s64 {rd}, {rd}",
        *(f"{op}.{t} {{r}}, {{r}}, {{s}}" for op in ("shl", "shr") for t in ("b32", "u32", "s32")),
        *(f"{op}.{t} {{rd}}, {{rd}}, {{s}}" for op in ("shl", "shr") for t in ("b64", "u64", "s64")),
        *(f"{op}{m}.f32 {{f}}, {{f}}, {{fi}}" for op in ("add", "sub", "mul") for m in ("", ".rn", ".ftz", ".rn.ftz")),
        "fma.rn.f32 {f}, {f}, {f}, {fi}", "fma.rn.ftz.f32 {f}, {f}, {fi}, {f}", "mad.rn.f32 {f}, {f}, {f}, {f}",
        "neg.f32 {f}, {f}", "neg.ftz.f32 {f}, {f}",
        "mov.b32 {r}, {ri}", "mov.b32 {f}, {ri}", "mov.f32 {f}, {fi}", "mov.b64 {rd}, {rd}", "mov.pred {p}, {p}",
        "selp.b32 {r}, {r}, {ri}, {p}", "selp.f32 {f}, {f}, {fi}, {p}", "selp.u64 {rd}, {rd}, {rd}, {p}",
        "cvt.s64.s32 {rd}, {r}", "cvt.u64.u32 {rd}, {r}", "cvt.u32.u64 {r}, {rd}", "cvt.s32.s64 {r}, {rd}",
        "cvt.u32.s32 {r}, {r}", "cvta.to.global.u64 {rd}, {rd}",
        *(f"{op}.pred {{p}}, {{p}}, {{p}}" for op in ("and", "or", "xor")), "not.pred {p}, {p}",
        *(f"setp.{c}.{t} {{p}}, {{r}}, {{ri}}" for c in CMP_INT for t in ("s32", "u32", "b32")),
        *(f"setp.{c}.{t} {{p}}, {{rd}}, {{rd}}" for c in ("lt", "hs", "ne") for t in ("s64", "u64")),
        *(f"setp.{c}{m}.f32 {{p}}, {{f}}, {{fi}}" for c in CMP_F32 for m in ("", ".ftz")),
        "setp.lt.and.s32 {p}|{q}, {r}, {r}, {c}", "setp.gtu.or.f32 {p}|{q}, {f}, {f}, {c}",
        "setp.ne.xor.u32 {p}, {r}, {ri}, {c}", "setp.ge.s32 {p}|{q}, {r}, {r}",
    ]
    pick = lambda names: names[int(rng.integers(len(names)))]
    regs = {"r": [f"%r{i}" for i in range(8)], "rd": [f"%rd{i}" for i in range(6)], "f": [f"%f{i}" for i in range(8)]}

    def fill(form):
        p, q, c = (f"%p{i}" for i in rng.permutation(8)[:3])     # a setp writes none of its sources
        imm32 = int(rng.choice([0, 1, 7, 31, 32, 0x7FFFFFFF, -1, -200]))
        out = form.replace("{p}|{q}", f"{p}|{q}").replace("{c}", c)
        out = out.replace("{p}", p) if form.startswith("setp") else out.replace("{p}", pick([p, c]))
        for key, choices in (("{ri}", regs["r"] + [str(imm32)]), ("{rd}", regs["rd"]), ("{r}", regs["r"]),
                             ("{fi}", regs["f"] + ["0f3F800000", "0fFF800000", "0f00000001", "0d3FF0000000000000"]),
                             ("{f}", regs["f"]), ("{s}", regs["r"] + ["3", "31", "32", "40", "63"])):
            while key in out:
                out = out.replace(key, pick(choices), 1)
        return out
    return [fill(f) for f in forms]


def _kernel(lines):
    text = "\n".join([".version 8.0", ".target sm_80", ".address_size 64", ".visible .entry k()", "{",
                      ".reg .pred %p<8>;", ".reg .b32 %r<8>;", ".reg .b64 %rd<6>;", ".reg .f32 %f<8>;",
                      *(line + ";" for line in lines), "ret;", "}"])
    return PtxModule.parse(text).kernel("k")


def _files(kernel, n, rng):
    """Two register files of n lanes with the same random bits."""
    files = [_Registers(kernel.registers, n) for _ in range(2)]
    for name, ty in kernel.registers.items():
        if ty == "pred":
            bits = rng.random(n) < 0.5
        elif ty == "f32":
            bits = np.where(rng.random(n) < 0.4, rng.choice(SPECIAL_F32, n),
                            (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)).view(np.uint32)
        else:
            wide = rng.integers(0, 2**63, n, dtype=np.uint64) * np.uint64(2) + rng.integers(0, 2, n, dtype=np.uint64)
            bits = np.where(rng.random(n) < 0.3, rng.choice(SPECIAL_INT, n), wide)
            bits = bits.astype(np.uint32 if ty == "b32" else np.uint64)
        for f in files:
            f.array(name)[...] = bits.view(f.array(name).dtype) if ty != "pred" else bits
    return files


class _Lanes:
    def __init__(self, file, n):
        self.regs, self.nlanes = _RegisterView(file, 0, n), n


@pytest.mark.parametrize("n", [32, 96, 600])
def test_native_runs_compute_what_the_handlers_do(rng, n):
    for trial in range(12):
        lines = list(rng.permutation(_forms(rng)))
        kernel = _kernel(lines)
        program = _Compiled(kernel)
        seg = alu.segment(kernel, program._ops, 0, len(lines))
        assert seg is not None and seg.end == len(lines), \
            f"alu.py no longer takes {lines[seg.end if seg else 0]}"
        mask = None if trial % 3 == 0 else rng.random(n) < 0.6
        by_handlers, by_native = _files(kernel, n, rng)
        with np.errstate(all="ignore"):
            for fn in program.fns[:len(lines)]:
                fn(_Lanes(by_handlers, n), mask)
        seg.run(_Lanes(by_native, n), mask, 0, len(lines))
        for name in kernel.registers:
            a, b = by_handlers.array(name), by_native.array(name)
            if a.dtype == np.float32:       # NaNs' payloads: the hardware's are canonical, neither engine's is
                differ = np.flatnonzero((a.view(np.uint32) != b.view(np.uint32)) & ~(np.isnan(a) & np.isnan(b)))
            else:
                differ = np.flatnonzero(a != b)
            assert differ.size == 0, (f"{name} differs at lanes {differ[:5]}: handlers {a[differ[:5]]}, "
                                      f"native {b[differ[:5]]}; program:\n" + "\n".join(lines))


def test_native_runs_refuse_a_bad_program():
    mod = native.module()
    c = mod.alu_codes()
    regs = [np.zeros(64, np.uint32) for _ in range(3)]
    add = [c["kAluAdd"], c["kKindInt32"], c["kCmpEq"], 1, 0, c["kBoolNone"], 0, 1, 2, 0, 0, 4, 4, 4, 0, 0]
    none = np.zeros(0, np.uint64)
    mod.alu(np.array([add], np.int64), none, None, 0, 64, *regs)         # well formed: runs
    bad = {
        "an operand's size does not fit": dict(zip(range(11, 16), (4, 4, 0, 0, 0))),     # add without b
        "register size differs": {11: 8, 12: 8, 13: 8, 1: c["kKindInt64"]},               # 64-bit add on u32 arrays
        "operand out of range": {8: 3},                                                   # a fourth register
        "an integer row's op": {0: c["kAluSetp"]},
        "a row's kind": {1: 99},
    }
    for message, change in bad.items():
        row = list(add)
        for k, v in change.items():
            row[k] = v
        before = [r.copy() for r in regs]
        with pytest.raises(ValueError, match=message):
            mod.alu(np.array([row], np.int64), none, None, 0, 64, *regs)
        assert all((r == b).all() for r, b in zip(regs, before))
    with pytest.raises(ValueError, match="register"):                   # lanes past a register's end
        mod.alu(np.array([add], np.int64), none, None, 32, 64, *regs)
    with pytest.raises(ValueError, match="mask"):
        mod.alu(np.array([add], np.int64), none, np.ones(10, bool), 0, 64, *regs)
