"""Reading untrusted modules without risking the process.

jaxlib's MLIR reader and printer recurse once per nesting level (regions, attributes, types,
locations) on the C stack: input nested a few thousand deep overflows it and the process dies
with SIGSEGV, which no Python code can catch. Real exported programs nest fewer than ten
levels, so anything deeper than MAX_NESTING is refused with a LoadError before it can reach a
recursive C++ walk:

- text is pre-scanned: the deepest bracket nesting outside string literals, cheap and exact
  enough (an unmatched bracket can only over-count, i.e. refuse, never crash);
- binary formats (bytecode, portable artifacts, jax.export) cannot be scanned without parsing,
  so a child interpreter parses them first (the bytecode reader itself is iterative), measures
  the region nesting, then prints a shallow module and scans the text; if the child dies, the
  input is refused. A digest of each input that passed is remembered, so a
  module is probed once per process.
"""
from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys

from flashgen.errors import LoadError

MAX_NESTING = 512   # brackets deep; the reader overflows an 8 MiB stack near 4,000
PROBE_TIMEOUT_S = 600

_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|->|[\[\]{}()<>]')
_OPEN, _CLOSE = frozenset(b"{[(<"), frozenset(b"}])>")
_passed: set = set()


def nesting_depth(text: bytes) -> int:
    """The deepest nesting of {[(< outside string literals ('->' is an arrow, not a bracket)."""
    depth = deepest = 0
    for m in _TOKENS.finditer(text):
        c = m.group()
        if len(c) != 1:
            continue
        if c[0] in _OPEN:
            depth += 1
            if depth > deepest:
                deepest = depth
        elif depth:
            depth -= 1
    return deepest


def check(data: bytes, fmt: str) -> None:
    """LoadError unless ``data`` (in format ``fmt``) is safe to parse and print in-process."""
    if fmt == "mlir":
        _refuse_if_deep(nesting_depth(data))
        return
    key = hashlib.sha256(data).digest()
    if key in _passed:
        return
    _refuse_if_deep(_depth_in_child(data, fmt))
    _passed.add(key)


def _refuse_if_deep(depth: int) -> None:
    if depth > MAX_NESTING:
        raise LoadError(f"the module is nested {depth} deep (regions, attributes, types or "
                        f"locations); flashgen reads at most {MAX_NESTING} levels (MLIR's reader "
                        "would overflow its stack)")


def _depth_in_child(data: bytes, fmt: str) -> int:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p))
    try:
        proc = subprocess.run([sys.executable, "-m", "flashgen.rewrite.probe_child", fmt], input=data,
                              capture_output=True, env=env, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise LoadError(f"reading the input took over {PROBE_TIMEOUT_S} s in the probe process; "
                        "refused") from None
    if proc.returncode == 0:
        return int(proc.stdout.split()[-1])
    if proc.returncode == 3:  # the child's LoadError: the input is unreadable
        raise LoadError(proc.stderr.decode(errors="replace").strip().splitlines()[-1])
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        raise LoadError(f"the MLIR reader crashed ({name}) on this input in a probe process: "
                        f"the {fmt} data is corrupt or nested too deep; refused")
    tail = proc.stderr.decode(errors="replace").strip().splitlines()
    raise LoadError(f"the probe process could not read the input (exit {proc.returncode}): "
                    f"{tail[-1] if tail else 'no message'}")


def region_depth(op) -> int:
    """How deep regions nest inside ``op`` (an explicit stack: no recursion)."""
    deepest = 0
    stack = [(op, 0)]
    while stack:
        o, d = stack.pop()
        deepest = max(deepest, d)
        for region in o.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if len(inner.operation.regions):
                        stack.append((inner.operation, d + 1))
    return deepest

