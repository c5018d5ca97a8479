"""What the rewriter found: one record per attention site, rewritten or not.

``AttentionSite`` is a site that matched completely (and, after the driver
ran, was rewritten); ``Rejection`` is a candidate that looked like attention
but was left untouched, with the reason. Both serialize to the same JSON
shape (``status`` tells them apart) and print readably for ``--explain``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Optional

from flashgen.rewrite.variants import DESCRIBED


@dataclasses.dataclass
class AttentionSite:
    location: str                # the MLIR location of the Q·K dot_general
    function: str                # the func.func holding it
    op: str                      # e.g. "%25 = stablehlo.dot_general"
    q_shape: tuple
    k_shape: tuple
    v_shape: tuple
    out_shape: tuple
    layout: str                  # the query's layout in kernel roles, e.g. "BSHD", "(BH)SD"
    dtype: str                   # kernel dtype: f16 | bf16 | f32
    batch: int
    seq_q: int
    seq_k: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    bottom_right: bool
    scale: float
    target: str                  # the custom-call target the site calls
    spec: dict                   # KernelSpec.to_json()
    status: str = "matched"      # matched -> rewritten (or rejected if the rewrite failed)
    reason: Optional[str] = None
    notes: list = dataclasses.field(default_factory=list)
    plan: Any = dataclasses.field(default=None, repr=False, compare=False)
    window: list = dataclasses.field(default_factory=lambda: [-1, -1])  # (left, right), -1 = unbounded
    softcap: float = 0.0         # 0 = none
    extras: list = dataclasses.field(default_factory=list)         # e.g. ["alibi", "mask"]
    extras_detail: list = dataclasses.field(default_factory=list)  # one text per extra
    empty_rows: str = "none"     # rows whose keys are all masked: none | zero | mean | nan
    backward_target: str = ""    # a training site: the flashgen_bwd_* call of its VJP

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "plan"}
        for k in ("q_shape", "k_shape", "v_shape", "out_shape"):
            d[k] = list(d[k])
        return d

    def explain(self) -> str:
        gqa = f", {self.kv_heads} kv heads" if self.kv_heads != self.heads else ""
        lines = [
            f"{self.status.upper()}: attention at {short_loc(self.location)} "
            f"(@{self.function}, {self.op})",
            f"  q {_shape(self.q_shape)}  k {_shape(self.k_shape)}  v {_shape(self.v_shape)}"
            f" -> out {_shape(self.out_shape)}  [{self.dtype}]",
            f"  layout {self.layout}: batch {self.batch}, {self.heads} heads{gqa}, "
            f"seq {self.seq_q}x{self.seq_k}, head dim {self.head_dim}",
            "  " + "".join(v.describe(self) for v in DESCRIBED),
            *([f"  extras: {'; '.join(self.extras_detail or self.extras)}"] if self.extras else []),
            f"  -> {self.target}" + (f" + {self.backward_target}" if self.backward_target else "")
            if self.status != "rejected" else f"  reason: {self.reason}",
        ]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclasses.dataclass
class Rejection:
    location: str
    function: str
    op: str
    reason: str
    matched: list = dataclasses.field(default_factory=list)  # what did match, in order
    details: dict = dataclasses.field(default_factory=dict)
    status: str = "rejected"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def explain(self) -> str:
        lines = [f"REJECTED: candidate at {short_loc(self.location)} (@{self.function}, {self.op})",
                 f"  reason: {self.reason}"]
        if self.matched:
            lines.append(f"  matched so far: {', '.join(self.matched)}")
        for k, v in self.details.items():
            lines.append(f"  {k}: {v}")
        return "\n".join(lines)


_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"(:\d+)?')


def short_loc(location: str) -> str:
    """'jit(f)/dot_general (model.py:12)' from a full MLIR location; the JSON keeps it all."""
    name, where = None, None
    for m in _QUOTED.finditer(location):
        if m.group(2):  # "file":line
            where = f"{os.path.basename(m.group(1))}{m.group(2)}"
            if name is None:
                continue
            break
        if name is None:
            name = m.group(1)
    if name and where:
        return f"{name} ({where})"
    return name or where or location


def _shape(s) -> str:
    return "[" + ",".join(str(x) for x in s) + "]"


@dataclasses.dataclass
class Report:
    input: Optional[str]
    output: Optional[str]
    format: str
    sites: list
    seconds: float = 0.0
    specs: list = dataclasses.field(default_factory=list)     # KernelSpec.to_json() of rewritten sites
    library: Optional[str] = None                              # --build: the library, absolute
    manifest: Optional[str] = None                             # --build: its manifest, absolute (flashgen.jax.load)
    verified: Optional[dict] = None                            # --verify: max errors per output
    notes: list = dataclasses.field(default_factory=list)

    @property
    def rewritten(self) -> list:
        return [s for s in self.sites if s.status == "rewritten"]

    @property
    def rejected(self) -> list:
        return [s for s in self.sites if s.status == "rejected"]

    def to_json(self) -> dict:
        return {
            "input": self.input, "output": self.output, "format": self.format,
            "seconds": round(self.seconds, 4),
            "summary": {"rewritten": len(self.rewritten), "rejected": len(self.rejected)},
            "targets": sorted({s.target for s in self.rewritten}),
            "specs": self.specs, "library": self.library, "manifest": self.manifest,
            "verified": self.verified, "notes": self.notes,
            "sites": [s.to_json() for s in self.sites],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n"

    def explain(self) -> str:
        head = (f"{len(self.rewritten)} attention site(s) rewritten, "
                f"{len(self.rejected)} candidate(s) left untouched")
        if not self.sites:
            head = "no attention candidates found"
        parts = [head] + [s.explain() for s in self.sites]
        if self.specs:
            parts.append("kernels needed: " + ", ".join(
                f"d{s['head_dim']}{'v%d' % s['head_dim_v'] if 'head_dim_v' in s else ''} {s['dtype']}"
                f"{' causal' if s['causal'] else ''}" for s in self.specs))
        if self.manifest:
            parts.append(f"library manifest: {self.manifest} (register with flashgen.jax.load)")
        parts += [f"note: {n}" for n in self.notes]
        return "\n".join(parts)
