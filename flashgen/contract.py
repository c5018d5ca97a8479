"""The call contract: every flashgen custom call's attributes, operands and results, said once.

A flashgen call is `stablehlo.custom_call @flashgen_<direction>_d<D>[v<Dv>]_<dtype>[_causal]` (spec.target_name)
with the operands CALLS[direction] lists, then the operands its `extras` attribute names (EXTRAS), and a
typed attribute dictionary (ATTRIBUTES, each passed on every call: an XLA FFI handler rejects missing or
extra ones). Everything that builds, binds, checks, partitions or renders a call reads these tables:
emit (to MLIR), the JAX primitive, the sharding rules, the contract checker, the emulator's standard
cases and codegen (the C++ handlers' bindings and the NIF face's tables).

Window and softcap are runtime attributes, not KernelSpec fields: they change which blocks are visited
and one elementwise step, not the kernel's shape, so one compiled specialization serves every value.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Attribute:
    """One attribute of a call: its MLIR type, the C++ type its handler decodes, its default."""
    name: str
    mlir: str        # "i1" | "i32" | "f32" | "string"
    cxx: str         # the C++ type of the decoded value
    default: object  # None: no default, every caller gives it
    meaning: str


ATTRIBUTES = {a.name: a for a in (
    Attribute("causal", "i1", "bool", None, "must equal the spec's causal flag"),
    Attribute("scale", "f32", "float", None, "softmax scale; finite, positive, normal"),
    Attribute("bottom_right", "i1", "bool", False,
              "align the causal diagonal and window to the last key (off = Sk - Sq), not the first (off = 0)"),
    Attribute("window_left", "i32", "int32_t", -1,
              "key j visible to query i iff j >= i + off - left (-1 = unbounded)"),
    Attribute("window_right", "i32", "int32_t", -1,
              "key j visible to query i iff j <= i + off + right (-1 = unbounded; causal => 0)"),
    Attribute("softcap", "f32", "float", 0.0, "scaled scores x -> softcap * tanh(x / softcap); 0 = off"),
    Attribute("max_seqlen_q", "i32", "int32_t", None, "the longest query sequence of a varlen batch"),
    Attribute("max_seqlen_k", "i32", "int32_t", None, "the longest key sequence of a varlen batch"),
    Attribute("extras", "string", "std::string_view", "",
              "the optional operands after the fixed ones, by name, comma-separated, in EXTRAS order"),
    Attribute("deterministic", "i1", "bool", False,
              "backward: accumulate dq (and GQA dk/dv, dbias) in a fixed order, the same bits on every run"),
)}


@dataclasses.dataclass(frozen=True)
class Operand:
    """One operand or result. `shape` names dims symbolically ("1|B": 1 or B, a broadcast dim);
    `other_shape`, if any, is a second accepted shape; `dtype` "T" is the spec's dtype, "T|f32"
    the spec's dtype or f32, otherwise a fixed MLIR element type."""
    name: str
    shape: tuple[str, ...]
    dtype: str = "T"
    other_shape: tuple[str, ...] = ()

    def shapes(self, dims: dict[str, int]) -> list[list[int]]:
        """Every concrete shape this operand may take, given the symbolic dims' sizes."""
        out = []
        for shape in filter(None, (self.shape, self.other_shape)):
            options = [sorted({1 if s == "1" else dims[s] for s in d.split("|")}) for d in shape]
            out += [list(c) for c in itertools.product(*options) if list(c) not in out]
        return out

    def full_shape(self, dims: dict[str, int]) -> list[int]:
        """The shape without broadcasting: each "1|X" taken as X."""
        return [dims[d.split("|")[-1]] for d in self.shape]

    def dtypes(self, spec_dtype: str) -> list[str]:
        """The MLIR element types this operand may have, for a spec of dtype `spec_dtype`."""
        return sorted({spec_dtype if t == "T" else t for t in self.dtype.split("|")})

    def full_dtype(self, spec_dtype: str) -> str:
        """The widest element type it accepts ("T|f32": f32)."""
        t = self.dtype.split("|")[-1]
        return spec_dtype if t == "T" else t


# The optional operands of a call, in the order they follow the fixed operands: extra -> its operands.
# Bias and mask broadcast over batch and heads (a dim of 1); a bias also over the queries
# (a key-only bias, e.g. ALiBi from a padded batch's positions: O(Sk), not O(Sq·Sk)).
EXTRAS = {
    "alibi": (Operand("alibi_slopes", ("Hq",), "f32", other_shape=("B", "Hq")),),
    "bias": (Operand("bias", ("1|B", "1|Hq", "1|Sq", "Sk"), "T|f32"),),
    "mask": (Operand("mask", ("1|B", "1|Hq", "Sq", "Sk"), "i1"),),
    "segment_ids": (Operand("q_segment_ids", ("B", "Sq"), "i32"), Operand("kv_segment_ids", ("B", "Sk"), "i32")),
}


@dataclasses.dataclass(frozen=True)
class Call:
    """One direction of a spec: its fixed operands, results, attributes and the extras it takes."""
    direction: str
    operands: tuple[Operand, ...]
    results: tuple[Operand, ...]
    attributes: tuple[str, ...]
    extras: tuple[str, ...]          # the EXTRAS this call accepts
    dbias: bool = False              # with a bias, one more result (optional): dbias, like the bias

    def extra_operands(self, extras, call_name: str | None = None) -> tuple[Operand, ...]:
        """The operands that follow the fixed ones for `extras` (normalized, EXTRAS order);
        ValueError naming the call (`call_name`, its target) if it does not take one of them."""
        extras = normalize_extras(extras)
        if not set(extras) <= set(self.extras):
            raise ValueError(f"{call_name or f'a {self.direction} call'} takes only the extras "
                             f"{', '.join(self.extras)}, got {', '.join(extras)}")
        return tuple(o for e in extras for o in EXTRAS[e])

    def operand_names(self, extras=()) -> list[str]:
        return [o.name for o in self.operands + self.extra_operands(extras)]


# D: the query/key head dim; Dv: the value head dim (KernelSpec.head_dim_v), the last dim of V and
# of everything V's rows are summed into. Only the dense calls take a Dv other than D.
_Q, _K, _V = Operand("q", ("B", "Sq", "Hq", "D")), Operand("k", ("B", "Sk", "Hkv", "D")), \
    Operand("v", ("B", "Sk", "Hkv", "Dv"))
_O, _LSE = Operand("o", ("B", "Sq", "Hq", "Dv")), Operand("lse", ("B", "Hq", "Sq"), "f32")
_DO = Operand("do", ("B", "Sq", "Hq", "Dv"))
_PQ, _PK, _PV = Operand("q", ("Tq", "Hq", "D")), Operand("k", ("Tk", "Hkv", "D")), Operand("v", ("Tk", "Hkv", "D"))
_PO, _PLSE, _PDO = Operand("o", ("Tq", "Hq", "D")), Operand("lse", ("Hq", "Tq"), "f32"), Operand("do", ("Tq", "Hq", "D"))
_CU = (Operand("cu_seqlens_q", ("B+1",), "i32"), Operand("cu_seqlens_k", ("B+1",), "i32"))
_BASE = ("causal", "scale", "bottom_right", "window_left", "window_right", "softcap")
_DENSE = _BASE + ("extras",)
_VARLEN = _DENSE + ("max_seqlen_q", "max_seqlen_k")
_BWD = ("deterministic",)  # what the backward calls take after their direction's attributes
_PACKED_EXTRAS = ("alibi",)

CALLS = {c.direction: c for c in (
    Call("fwd", (_Q, _K, _V), (_O, _LSE), _DENSE, tuple(EXTRAS)),
    Call("bwd", (_Q, _K, _V, _O, _LSE, _DO),
         (Operand("dq", _Q.shape), Operand("dk", _K.shape), Operand("dv", _V.shape)), _DENSE + _BWD, tuple(EXTRAS),
         dbias=True),
    Call("fwd_varlen", (_PQ, _PK, _PV, *_CU), (_PO, _PLSE), _VARLEN, _PACKED_EXTRAS),
    Call("bwd_varlen", (_PQ, _PK, _PV, _PO, _PLSE, _PDO, *_CU),
         (Operand("dq", _PQ.shape), Operand("dk", _PK.shape), Operand("dv", _PV.shape)), _VARLEN + _BWD,
         _PACKED_EXTRAS),
    Call("fwd_paged", (_Q, Operand("k_cache", ("NB", "BS", "Hkv", "D")), Operand("v_cache", ("NB", "BS", "Hkv", "D")),
                       Operand("block_table", ("B", "MB"), "i32"), Operand("seqused_k", ("B",), "i32")),
         (Operand("o", _Q.shape), _LSE), _DENSE, _PACKED_EXTRAS),
)}
DIRECTIONS = tuple(CALLS)

# The FP8 spec (dtype e4m3) has one call, the dense forward: q, k, v hold e4m3 values whose real
# values are stored · descale, one f32 factor per tensor (a [1] operand each, in device memory: an
# amax-based scale computed on the device needs no host round trip). o is bf16: a dequantized
# result of any magnitude, with f32's range and more than e4m3's 3 mantissa bits for the next
# layer (FlashAttention-3's FP8 forward returns bf16 too). No extras and no softcap (the kernel
# has neither); window and causal alignment as every forward.
_DESCALES = tuple(Operand(f"{t}_descale", ("1",), "f32") for t in "qkv")
FP8_CALLS = {"fwd": Call("fwd", (_Q, _K, _V, *_DESCALES), (Operand("o", _O.shape, "bf16"), _LSE), _DENSE, ())}
FP8_DTYPES = ("e4m3",)


def calls(dtype: str) -> dict[str, Call]:
    """The calls of a spec of element type `dtype`: every direction, or the FP8 forward alone."""
    return FP8_CALLS if dtype in FP8_DTYPES else CALLS

# name -> MLIR type of every attribute a direction's call carries (the build manifest's schema).
ATTRIBUTE_TYPES = {d: {n: ATTRIBUTES[n].mlir for n in c.attributes} for d, c in CALLS.items()}


def signature(direction: str, dtype: str = "bf16") -> dict[str, list[str]]:
    """A direction's operands and results as text, e.g. "lse[B,Hq,Sq]:f32" (the build manifest's),
    for a spec of element type `dtype`."""
    def text(o: Operand) -> str:
        return f"{o.name}[{','.join(o.shape)}]" + ("" if o.dtype == "T" else f":{o.dtype}")
    call = calls(dtype)[direction]
    results = [text(o) for o in call.results]
    if call.dbias:
        results.append("dbias (optional, only with extras bias)")
    return {"operands": [text(o) for o in call.operands] + ["*extras"], "results": results}


# ----------------------------------------------------------------------------------------
# Validation of attribute values (Python side; csrc validates the same on the C++ side).

def normalize_extras(extras) -> tuple[str, ...]:
    """The extras as a tuple in canonical order; ValueError for unknown or repeated names."""
    if extras is None or extras == "":
        return ()
    names = extras.split(",") if isinstance(extras, str) else list(extras)
    unknown = [n for n in names if n not in EXTRAS]
    if unknown:
        raise ValueError(f"unknown extras {unknown}: supported are {', '.join(EXTRAS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"extras repeat a name: {names}")
    return tuple(n for n in EXTRAS if n in names)


def extra_operand_index(extras, name: str) -> int:
    """Where extra `name`'s first operand sits among the extra operands of a call whose
    (normalized) extras are `extras`."""
    return sum(len(EXTRAS[e]) for e in extras[:extras.index(name)])


def normalize_window(window) -> tuple[int, int]:
    """(left, right) as Python ints >= -1 (-1 = unbounded); None means unbounded on both sides."""
    if window is None:
        return ATTRIBUTES["window_left"].default, ATTRIBUTES["window_right"].default
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be a pair (left, right), got {window!r}") from None
    out = []
    for name, x in (("left", left), ("right", right)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise ValueError(f"window {name} must be a Python int (-1 = unbounded), got {x!r}")
        x = int(x)
        if not -1 <= x < 2**31:
            raise ValueError(f"window {name} must be in [-1, 2^31), got {x}")
        out.append(x)
    return out[0], out[1]


def normalize_scale(scale) -> float:
    """scale as a Python float that is exact in f32, finite, positive and normal."""
    s = float(np.float32(scale))
    if not (s > 0 and math.isfinite(s)):
        raise ValueError(f"scale must be a finite positive f32, got {scale}")
    if s < np.finfo(np.float32).tiny:  # flushed to zero by XLA's CPU threads, as softcap below
        raise ValueError(f"scale {scale} is below the smallest normal f32 "
                         f"({np.finfo(np.float32).tiny:.8g})")
    return s


def normalize_softcap(softcap) -> float:
    """softcap as a Python float that is exact in f32, finite and >= 0 (0 = off)."""
    if softcap is None:
        return ATTRIBUTES["softcap"].default
    if hasattr(softcap, "aval"):
        raise TypeError("softcap must be a Python number (a compile-time attribute), not a traced value")
    c = float(np.float32(softcap))
    if not (c >= 0 and math.isfinite(c)):
        raise ValueError(f"softcap must be finite and >= 0 (0 = off), got {softcap}")
    if 0 < c < np.finfo(np.float32).tiny:
        # XLA's CPU threads flush subnormals to zero: the kernels would see softcap = 0 (off).
        raise ValueError(f"softcap {softcap} is below the smallest normal f32 "
                         f"({np.finfo(np.float32).tiny:.8g}); use 0 for no softcap")
    return c


# ----------------------------------------------------------------------------------------
# One call's attribute values: built into the typed dictionary a handler decodes (to_mlir, or
# ffi_kwargs for jax.ffi), and read back from one (parse).

@dataclasses.dataclass(frozen=True)
class CallAttributes:
    """The attribute values of one flashgen call, normalized (ValueError for a bad one).
    `max_seqlen` = (max_seqlen_q, max_seqlen_k) is needed by, and only passed to, varlen calls;
    `deterministic` only to the backward calls."""
    causal: bool
    scale: float
    bottom_right: bool = ATTRIBUTES["bottom_right"].default
    window: tuple[int, int] = (ATTRIBUTES["window_left"].default, ATTRIBUTES["window_right"].default)
    softcap: float = ATTRIBUTES["softcap"].default
    extras: tuple[str, ...] = ()
    max_seqlen: tuple[int, int] | None = None
    deterministic: bool = ATTRIBUTES["deterministic"].default

    def __post_init__(self):
        fix = functools.partial(object.__setattr__, self)
        fix("causal", bool(self.causal))
        fix("scale", normalize_scale(self.scale))
        fix("bottom_right", bool(self.bottom_right))
        fix("window", normalize_window(self.window))
        fix("softcap", normalize_softcap(self.softcap))
        fix("extras", normalize_extras(self.extras))
        if not isinstance(self.deterministic, (bool, np.bool_)):
            raise ValueError(f"deterministic must be a bool, got {self.deterministic!r}")
        fix("deterministic", bool(self.deterministic))
        if self.max_seqlen is not None:
            for name, x in zip(("max_seqlen_q", "max_seqlen_k"), self.max_seqlen):
                if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or not 0 <= x < 2**31:
                    raise ValueError(f"{name} must be an int in [0, 2^31), got {x!r}")
            fix("max_seqlen", tuple(int(x) for x in self.max_seqlen))

    def values(self, direction: str) -> dict[str, object]:
        """name -> Python value of every attribute of CALLS[direction], in contract order."""
        call = _call(direction)
        call.extra_operands(self.extras)
        if "max_seqlen_q" in call.attributes and self.max_seqlen is None:
            raise ValueError("varlen calls need max_seqlen=(max_seqlen_q, max_seqlen_k)")

        def value(name):
            field, index = _FIELD_OF[name]
            x = getattr(self, field)
            return ",".join(x) if field == "extras" else x if index is None else x[index]
        return {n: value(n) for n in call.attributes}

    def to_mlir(self, direction: str):
        """The typed ir.DictAttr of a `direction` call (inside an MLIR context)."""
        from jaxlib.mlir import ir
        make = {"i1": ir.BoolAttr.get, "string": ir.StringAttr.get,
                "i32": lambda x: ir.IntegerAttr.get(ir.IntegerType.get_signless(32), x),
                "f32": lambda x: ir.FloatAttr.get(ir.F32Type.get(), x, loc=ir.Location.unknown())}
        return ir.DictAttr.get({n: make[ATTRIBUTES[n].mlir](x) for n, x in self.values(direction).items()})

    def ffi_kwargs(self, direction: str) -> dict[str, object]:
        """The attributes as jax.ffi's lowering takes them: numpy scalars carry the MLIR type."""
        make = {"i1": bool, "i32": np.int32, "f32": np.float32, "string": str}
        return {n: make[ATTRIBUTES[n].mlir](x) for n, x in self.values(direction).items()}

    @classmethod
    def parse(cls, source, direction: str) -> "CallAttributes":
        """The attributes of a `direction` call from its custom_call op, its backend_config
        ir.DictAttr, or that dictionary's text (what XLA hands a custom-call partitioner).
        ValueError naming the first attribute that is missing, extra, mistyped or invalid."""
        from jaxlib.mlir import ir
        call = _call(direction)
        if isinstance(source, (bytes, bytearray, memoryview)):
            source = bytes(source).decode()
        if isinstance(source, str):
            from flashgen.mlir_context import new_context
            with new_context():
                try:
                    config = ir.Attribute.parse(source)
                except ir.MLIRError as e:
                    raise ValueError(f"backend_config {source!r} is not an MLIR attribute: "
                                     f"{str(e).splitlines()[0]}") from None
                return cls._from_dict(config, call)
        if not isinstance(source, ir.Attribute):
            attrs = source.operation.attributes
            source = next((attrs[k] for k in ("mhlo.backend_config", "backend_config") if k in attrs), None)
        return cls._from_dict(source, call)

    @classmethod
    def _from_dict(cls, config, call: Call) -> "CallAttributes":
        from jaxlib.mlir import ir
        if not isinstance(config, ir.DictAttr):
            raise ValueError("its backend_config is not a dictionary of typed attributes "
                             "(flashgen emit shows the form)")
        given = {config[i].name: config[i].attr for i in range(len(config))}
        for name in call.attributes:
            want = ATTRIBUTES[name].mlir
            if name not in given:
                raise ValueError(f"attribute {name} is missing (expected {want})")
            got = _mlir_type(given[name])
            if got != want:
                raise ValueError(f"attribute {name} is {got}, expected {want}")
        unexpected = sorted(set(given) - set(call.attributes))
        if unexpected:
            raise ValueError(f"unexpected attribute {unexpected[0]}")
        fields: dict = {}
        for name in call.attributes:
            field, index = _FIELD_OF[name]
            if index is None:
                fields[field] = given[name].value
            else:
                fields.setdefault(field, [None, None])[index] = given[name].value
        attrs = cls(**{f: tuple(x) if isinstance(x, list) else x for f, x in fields.items()})
        attrs.values(call.direction)  # the extras this call takes
        return attrs


# attribute name -> (the CallAttributes field that holds it, its index in that field's pair or
# None): values() reads attributes through it, _from_dict fills fields through it.
_FIELD_OF = {"causal": ("causal", None), "scale": ("scale", None), "bottom_right": ("bottom_right", None),
             "window_left": ("window", 0), "window_right": ("window", 1), "softcap": ("softcap", None),
             "extras": ("extras", None), "max_seqlen_q": ("max_seqlen", 0), "max_seqlen_k": ("max_seqlen", 1),
             "deterministic": ("deterministic", None)}


def _call(direction: str) -> Call:
    if direction not in CALLS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    return CALLS[direction]


def _mlir_type(attr) -> str:
    """An attribute's type in ATTRIBUTES' spelling: "i1", "i32", "f32", "string" (or its text)."""
    from jaxlib.mlir import ir
    if isinstance(attr, ir.BoolAttr):
        return "i1"
    if isinstance(attr, (ir.IntegerAttr, ir.FloatAttr)):
        return str(attr.type)
    if isinstance(attr, ir.StringAttr):
        return "string"
    return str(attr)

