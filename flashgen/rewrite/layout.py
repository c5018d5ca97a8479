"""Which logical axes each dimension of a tensor holds.

Every dimension that the attention matcher tracks is described by *pieces*
of logical axes. A logical axis is a dimension of the first dot_general
(a batching dim, a free dim of either operand, a contracting dim) or a free
dim of the value operand. A piece ``(label, lo, size)`` is the index
component ``(i // lo) % size`` of that axis, so a dimension that merges
batch and heads (torch's ``[B*H, S, D]``) is ``(("B0", 4, 2), ("B0", 1, 4))``
or ``(("B0", 1, 8),)`` depending on how it was produced. Reshapes regroup
pieces (splitting one where needed); transposes permute dimensions.

A dimension can also be ``None`` (a wildcard): the value is constant
along it (it was broadcast). Wildcards only appear in row-wise terms such
as the broadcast row maximum of a softmax.
"""
from __future__ import annotations

from collections import deque
from math import prod
from typing import Optional

Piece = tuple  # (label: str, lo: int, size: int)
Dim = Optional[tuple]  # tuple[Piece, ...] | None
Layout = tuple  # tuple[Dim, ...]


def dim_size(dim) -> int:
    return prod(p[2] for p in dim)


def normalize_dim(pieces) -> tuple:
    """Drop unit pieces and merge adjacent pieces of the same axis."""
    out: list = []
    for p in pieces:
        if p[2] == 1:
            continue
        if out and out[-1][0] == p[0] and out[-1][1] == p[1] * p[2]:
            label, _, size = out.pop()
            p = (label, p[1], size * p[2])
        out.append(p)
    return tuple(out)


def whole(label: str, size: int) -> tuple:
    return normalize_dim([(label, 1, size)])


def regroup(layout: Layout, shape_out) -> Layout | None:
    """The layout after a reshape to ``shape_out``; None if it mixes axes or wildcards."""
    seq: deque = deque()
    for d in layout:
        if d is None:
            return None
        seq.extend(d)
    out = []
    for n in shape_out:
        acc, dim = 1, []
        while acc < n:
            if not seq or n % acc:
                return None
            label, lo, size = seq.popleft()
            if n % (acc * size) == 0:
                dim.append((label, lo, size))
                acc *= size
                continue
            need = n // acc
            if size % need:
                return None
            dim.append((label, lo * (size // need), need))
            seq.appendleft((label, lo, size // need))
            acc *= need
        if acc != n:
            return None
        out.append(normalize_dim(dim))
    if seq:
        return None
    return tuple(out)


def transpose(layout: Layout, perm) -> Layout:
    return tuple(layout[p] for p in perm)


def pieces(layout: Layout) -> list:
    return [p for d in layout if d for p in d]


def boundaries(layouts) -> dict | None:
    """Per axis, the sorted split points used by any piece of ``layouts``."""
    cuts: dict = {}
    for layout in layouts:
        for d in layout:
            for label, lo, size in d or ():
                cuts.setdefault(label, set()).update((lo, lo * size))
    out = {}
    for label, s in cuts.items():
        pts = sorted(s)
        for a, b in zip(pts, pts[1:]):
            if b % a:
                return None  # two incompatible factorizations of one axis
        out[label] = pts
    return out


def refine_dim(dim, cuts: dict):
    if dim is None:
        return None
    out = []
    for label, lo, size in dim:
        pts = [c for c in cuts.get(label, (lo, lo * size)) if lo <= c <= lo * size]
        for hi, low in zip(reversed(pts[1:]), reversed(pts[:-1])):
            out.append((label, low, hi // low))
    return tuple(out)


def refine(layout: Layout, cuts: dict) -> Layout:
    return tuple(refine_dim(d, cuts) for d in layout)


def common_refinement(*layouts) -> tuple | None:
    """The layouts re-expressed with the finest pieces any of them uses."""
    cuts = boundaries(layouts)
    if cuts is None:
        return None
    return tuple(refine(l, cuts) for l in layouts)


def describe(layout: Layout) -> str:
    """Short human form, e.g. '[B0, L0, (B1 R0)]'."""
    def one(d):
        if d is None:
            return "*"
        if not d:
            return "1"
        names = [p[0] if p[1] == 1 else f"{p[0]}/{p[1]}" for p in d]
        return names[0] if len(names) == 1 else "(" + " ".join(names) + ")"
    return "[" + ", ".join(one(d) for d in layout) + "]"
