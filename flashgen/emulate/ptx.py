"""Parse the PTX text nvcc emits into kernels of typed, pre-split instructions.

Only the subset our kernels use is accepted; anything else (device functions, calls, generic
address space, unknown directives inside a body) raises EmulationError at parse or compile time,
never at a silently wrong run. Operands are parsed once here so the interpreter never touches text.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re

from flashgen.emulate.errors import EmulationError
from flashgen.emulate.heap import collector_paused

# Widths in bytes of the PTX fundamental types the kernels use.
TYPE_SIZES = {
    "pred": 1, "b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2,
    "b32": 4, "u32": 4, "s32": 4, "f32": 4, "f16x2": 4, "bf16x2": 4, "tf32": 4, "e4m3x2": 2,
    "b64": 8, "u64": 8, "s64": 8, "f64": 8,
}


# ---------------------------------------------------------------------------------------------
# Operands
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Reg:
    name: str          # unique within the kernel (scoped inline-asm registers are renamed)


@dataclasses.dataclass(frozen=True)
class Special:
    name: str          # tid, ntid, ctaid, nctaid, laneid, warpid
    axis: int          # 0..2 (x, y, z); 0 for scalars


@dataclasses.dataclass(frozen=True)
class Imm:
    text: str          # decoded per instruction type at compile time (0f.. hex floats, ints)


@dataclasses.dataclass(frozen=True)
class Sym:
    name: str          # a shared variable or parameter name used as a value (its address)


@dataclasses.dataclass(frozen=True)
class Addr:
    base: Reg | Sym | Imm
    offset: int


@dataclasses.dataclass(frozen=True)
class TensorAddr:
    base: Reg | Sym | Imm   # `[tensorMap, {c0, ...}]` (cp.async.bulk.tensor): the map's address
    coords: "Vec"


@dataclasses.dataclass(frozen=True)
class Vec:
    items: tuple       # of Reg / Imm / None (the `_` sink)


@dataclasses.dataclass(frozen=True)
class RegPair:
    first: Reg         # `d|p`: value and predicate outputs (setp, shfl)
    second: Reg


@dataclasses.dataclass(frozen=True)
class Label:
    name: str


# ---------------------------------------------------------------------------------------------
# Instructions and kernels
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Instruction:
    opcode: str                    # "mma", "ld", ...
    mods: tuple[str, ...]          # ("sync", "aligned", "m16n8k16", ...)
    operands: tuple
    pred: str | None = None        # guard predicate register name
    pred_negated: bool = False
    text: str = ""
    line: int = 0
    form: str = dataclasses.field(init=False)       # "mma.sync.aligned...": opcode and modifiers

    def __post_init__(self):
        # set once here: a functools.cached_property costs ~2 us on first access (its lock), and
        # every launch's opcode counts read it
        self.form = ".".join((self.opcode, *self.mods))

    def type(self) -> str:
        """The last type modifier (the instruction's operand type)."""
        for m in reversed(self.mods):
            if m in TYPE_SIZES:
                return m
        raise EmulationError(f"{self.form}: no operand type")


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    ptx_type: str      # "u64", "b8" (byte array), ...
    size: int          # bytes
    align: int


@dataclasses.dataclass(frozen=True)
class SharedVar:
    name: str
    align: int
    size: int          # 0 for `.extern .shared name[]` (the dynamic shared memory)
    extern: bool


@dataclasses.dataclass
class Kernel:
    name: str
    params: list[Param]
    registers: dict[str, str]              # register name -> declared PTX type
    instructions: list[Instruction]
    labels: dict[str, int]
    shared: list[SharedVar]                # module-level and kernel-level shared variables
    max_threads: tuple[int, ...] | None = None
    compiled: object = None                # filled by the machine on first launch

    @property
    def param_offsets(self) -> list[int]:
        offs, off = [], 0
        for p in self.params:
            off = -(-off // p.align) * p.align
            offs.append(off)
            off += p.size
        return offs

    @property
    def static_smem(self) -> int:
        return shared_layout(self.shared)[1]


def shared_layout(shared: list[SharedVar]) -> tuple[dict[str, int], int, int]:
    """(symbol -> shared offset, static bytes, dynamic base): static variables first, then the
    dynamic (extern) region at the largest extern alignment, as the hardware lays them out."""
    addr, off = {}, 0
    for v in shared:
        if not v.extern:
            off = -(-off // v.align) * v.align
            addr[v.name] = off
            off += v.size
    static = off
    ext_align = max([v.align for v in shared if v.extern], default=16)
    dyn = -(-static // ext_align) * ext_align
    for v in shared:
        if v.extern:
            addr[v.name] = dyn
    return addr, static, dyn


@dataclasses.dataclass
class PtxModule:
    version: str
    target: str
    kernels: dict[str, Kernel]

    @classmethod
    def parse(cls, text: str) -> "PtxModule":
        with collector_paused():
            return _Parser(text).module()

    def kernel(self, name: str) -> Kernel:
        k = self.kernels.get(name)
        if k is None:
            near = [n for n in self.kernels if name in n]
            if len(near) == 1:
                return self.kernels[near[0]]
            raise EmulationError(f"no kernel {name!r} in the PTX module ({len(near)} partial matches; "
                                 f"entries: {', '.join(sorted(self.kernels))})")
        return k


def load_ptx(path) -> PtxModule:
    return PtxModule.parse(pathlib.Path(path).read_text())


# ---------------------------------------------------------------------------------------------
# The parser
# ---------------------------------------------------------------------------------------------
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_ENTRY = re.compile(r"\.(visible\s+|weak\s+)?(entry|func)\s+")
_PARAM = re.compile(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+([\w$]+)(?:\[(\d+)\])?")
_SHARED = re.compile(r"(\.extern\s+)?\.shared\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+([\w$]+)(?:\[(\d*)\])?")
_REGDECL = re.compile(r"\.reg\s+\.(\w+)\s+(.*)")
_SPECIAL = re.compile(r"%(tid|ntid|ctaid|nctaid|laneid|warpid|nwarpid)(?:\.([xyz]))?$")
_LABEL = re.compile(r"([$\w]+)\s*:")
_BRACE = re.compile(r"[{}]")
_ONLY_LABELS = re.compile(r"(\s*[$\w]+\s*:)*\s*")
_GUARD = re.compile(r"@(!?)(%?[\w$]+)\s+")


_TOP_COMMA = re.compile(r",(?![^{\[]*[}\]])")    # a comma not inside {...} or [...] (never nested)


def _split_top(s: str) -> list[str]:
    """Split operands on commas outside braces/brackets."""
    if "[" in s and "{" in s:          # brackets around braces (a tensor address): count the depth
        parts, depth, start = [], 0, 0
        for i, ch in enumerate(s):
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
            elif ch == "," and depth == 0:
                parts.append(s[start:i])
                start = i + 1
        return [x.strip() for x in parts + [s[start:]] if x.strip()]
    return [x.strip() for x in _TOP_COMMA.split(s) if x.strip()]


class _Parser:
    def __init__(self, text: str):
        self.text = _COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), text)

    def module(self) -> PtxModule:
        t = self.text
        version = (re.search(r"\.version\s+([\d.]+)", t) or [None, "?"])[1]
        target = (re.search(r"\.target\s+([\w,\s]+?)\s*$", t, re.M) or [None, "?"])[1]
        module_shared = []
        kernels = {}
        pos = 0
        while True:
            m = _ENTRY.search(t, pos)
            # module-level shared declarations between entries
            chunk = t[pos:m.start() if m else len(t)]
            for sm in _SHARED.finditer(chunk):
                module_shared.append(self._shared_var(sm))
            if not m:
                break
            if m.group(2) == "func":
                raise EmulationError("PTX device functions (.func) are not supported: the kernels are "
                                     "expected to be fully inlined")
            head_end = t.index("{", m.end())
            body_end = self._match_brace(t, head_end)
            kernels_head = t[m.end():head_end]
            k = self._kernel(kernels_head, t[head_end + 1:body_end], t.count("\n", 0, head_end) + 1)
            kernels[k.name] = k
            pos = body_end + 1
        for k in kernels.values():
            k.shared = module_shared + k.shared
        return PtxModule(version, target, kernels)

    @staticmethod
    def _match_brace(t: str, i: int) -> int:
        depth = 0
        for m in _BRACE.finditer(t, i):
            depth += 1 if m.group() == "{" else -1
            if depth == 0:
                return m.start()
        raise EmulationError("unbalanced braces in PTX")

    @staticmethod
    def _shared_var(sm) -> SharedVar:
        extern, align, ty, name, count = sm.groups()
        n = int(count) if count else (0 if extern else 1)
        return SharedVar(name, int(align or TYPE_SIZES.get(ty, 1)), n * TYPE_SIZES[ty], bool(extern))

    def _kernel(self, head: str, body: str, line0: int) -> Kernel:
        name = re.match(r"\s*([\w$]+)", head).group(1)
        plist = head[head.index("(") + 1:head.rindex(")")] if "(" in head else ""
        params = []
        for pm in _PARAM.finditer(plist):
            align, ty, pname, count = pm.groups()
            size = TYPE_SIZES[ty] * (int(count) if count else 1)
            params.append(Param(pname, ty, size, int(align) if align else TYPE_SIZES[ty]))
        tail = head[head.rindex(")") + 1:] if ")" in head else ""
        maxnt = re.search(r"\.maxntid\s+([\d,\s]+)", tail)
        kernel = Kernel(name, params, {}, [], {}, [],
                        tuple(int(x) for x in maxnt.group(1).split(",")) if maxnt else None)
        self._body(kernel, body, line0)
        return kernel

    def _body(self, k: Kernel, body: str, line0: int) -> None:
        scopes: list[dict[str, str]] = [{}]   # register renaming per brace scope
        counter = [0]
        # Statements end at ';'. A brace opens/closes a scope (inline asm) only where a statement
        # could start; elsewhere it belongs to a vector operand.
        pending, buf, ln = [], "", line0
        for tok in re.split(r"([;{}])", body):
            if tok == ";":
                pending.append((buf, ln))
                buf = ""
            elif tok in ("{", "}") and _ONLY_LABELS.fullmatch(buf):
                pending.append((buf, ln))
                pending.append((tok, ln))
                buf = ""
            else:
                buf += tok
                ln += tok.count("\n")
        pending.append((buf, ln))
        scope_labels = iter(self._scope_labels(pending, counter))
        for s, ln in pending:
            if s == "{":
                scopes.append(next(scope_labels))
                continue
            if s == "}":
                scopes.pop()
                continue
            if s == ";":
                continue
            s = s.strip()
            while True:
                lm = _LABEL.match(s)
                if not lm:
                    break
                name = self._reg_name(lm.group(1), scopes)
                k.labels[name.name if isinstance(name, Label) else name] = len(k.instructions)
                s = s[lm.end():].strip()
            if not s:
                continue
            if s.startswith("."):
                self._directive(k, s, scopes, counter)
                continue
            k.instructions.append(self._instruction(s, scopes, ln))

    @staticmethod
    def _scope_labels(pending, counter) -> list[dict]:
        """Per brace scope, in the order they open: its labels renamed apart (inline asm such as
        CUTLASS's wait loops repeats `LAB_WAIT:` / `DONE:` in every copy), as Label operands, so
        that a branch can name a label its scope defines further down."""
        scopes, stack = [], []
        for s, _ in pending:
            if s == "{":
                scopes.append({})
                stack.append(scopes[-1])
            elif s == "}":
                stack.pop()
            elif stack:
                s = s.strip()
                while lm := _LABEL.match(s):
                    counter[0] += 1
                    stack[-1][lm.group(1)] = Label(f"{lm.group(1)}${counter[0]}")
                    s = s[lm.end():].strip()
        return scopes

    def _directive(self, k, s, scopes, counter):
        rm = _REGDECL.match(s)
        if rm:
            ty, names = rm.groups()
            for item in _split_top(names):
                item = item.strip()
                mm = re.match(r"(%?[\w$]+)<(\d+)>$", item)
                if mm:
                    for j in range(int(mm.group(2))):
                        k.registers[f"{mm.group(1)}{j}"] = ty
                    continue
                if len(scopes) > 1:       # inline-asm scope: rename so it cannot clash
                    counter[0] += 1
                    unique = f"{item}${counter[0]}"
                    scopes[-1][item] = unique
                    k.registers[unique] = ty
                else:
                    k.registers[item] = ty
            return
        sm = _SHARED.match(s)
        if sm:
            k.shared.append(self._shared_var(sm))
            return
        if s.startswith((".pragma", ".loc", ".file")):
            return
        raise EmulationError(f"unsupported directive in kernel {k.name}: {s[:80]}")

    def _instruction(self, s: str, scopes, line: int) -> Instruction:
        text = " ".join(s.split())
        pred, neg = None, False
        gm = _GUARD.match(s)
        if gm:
            neg, pred = gm.group(1) == "!", self._reg_name(gm.group(2), scopes)
            s = s[gm.end():]
        om = re.match(r"([a-z][\w.:]*)\s*(.*)$", s, re.S)
        if not om:
            raise EmulationError(f"cannot parse PTX statement: {text}")
        parts = om.group(1).split(".")
        ops = tuple(self._operand(a, scopes) for a in _split_top(om.group(2).replace("\n", " ")))
        return Instruction(parts[0], tuple(parts[1:]), ops, pred, neg, text, line)

    @staticmethod
    def _reg_name(name: str, scopes) -> str:
        for sc in reversed(scopes):
            if name in sc:
                return sc[name]
        return name

    def _operand(self, a: str, scopes):
        a = a.strip()
        if a.startswith("{"):
            return Vec(tuple(None if x.strip() == "_" else self._operand(x, scopes)
                             for x in _split_top(a[1:-1])))
        if a.startswith("[") and "{" in a:
            base, coords = _split_top(a[1:-1])
            return TensorAddr(self._operand(base, scopes), self._operand(coords, scopes))
        if a.startswith("["):
            inner = a[1:-1].strip()
            m = re.match(r"(.+?)\s*(?:\+\s*(-?(?:0x[0-9a-fA-F]+|\d+)))?$", inner)
            base, off = m.group(1).strip(), int(m.group(2) or "0", 0)
            if base.startswith("%"):
                b = self._operand(base, scopes)
            elif re.match(r"-?\d", base):
                b = Imm(base)
            else:
                b = Sym(base)
            return Addr(b, off)
        if "|" in a:
            x, y = a.split("|")
            return RegPair(self._operand(x, scopes), self._operand(y, scopes))
        if not a.startswith("%") and any(a in sc for sc in scopes[1:]):
            name = self._reg_name(a, scopes)             # inline asm may name registers without %,
            return name if isinstance(name, Label) else Reg(name)    # and its labels without $
        if a.startswith("%"):
            sm = _SPECIAL.match(a)
            if sm:
                return Special(sm.group(1), "xyz".index(sm.group(2)) if sm.group(2) else 0)
            return Reg(self._reg_name(a, scopes))
        if a.startswith("!"):
            raise EmulationError(f"negated predicate operand {a!r} is not supported")
        if re.match(r"[-+]?(0[fFdD][0-9a-fA-F]+|0[xX][0-9a-fA-F]+U?|\d+U?)$", a):
            return Imm(a)
        if a.startswith("$"):
            return Label(a)
        return Sym(a)
