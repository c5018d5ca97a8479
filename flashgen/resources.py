"""Where the templates and C++ headers are, installed or in a checkout.

`pip install .` copies templates/ and csrc/ into the package as
flashgen/_data/; a source checkout uses the top-level folders directly.
"""
from __future__ import annotations

import hashlib
import pathlib

_PKG = pathlib.Path(__file__).resolve().parent


def _find(name: str) -> pathlib.Path:
    for candidate in (_PKG / "_data" / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"flashgen installation is incomplete: no {name}/ directory found")


def templates_dir() -> pathlib.Path:
    return _find("templates")


def csrc_dir() -> pathlib.Path:
    return _find("csrc")


def tree_digest(root: pathlib.Path, skip: tuple[str, ...] = ()) -> str:
    """Content hash of every file under root (but the subtrees `skip` names, relative
    to root): part of every build's cache key."""
    h = hashlib.sha256()
    skipped = tuple(root / s for s in skip)
    for path in sorted(p for p in root.rglob("*")
                       if p.is_file() and not any(p.is_relative_to(s) for s in skipped)):
        h.update(str(path.relative_to(root)).encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()
