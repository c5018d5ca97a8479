"""A small FileCheck: enough of LLVM's directives for the golden rewrite tests.

Supported: CHECK, CHECK-LABEL, CHECK-NEXT, CHECK-SAME, CHECK-NOT, CHECK-DAG,
CHECK-COUNT-<n>. Patterns are literal text; ``{{regex}}`` embeds a regular
expression. Lines are matched in order, as FileCheck does (CHECK-NOT between
two positive matches checks the lines in between; CHECK-DAG directives in a
row match in any order).
"""
from __future__ import annotations

import re

_DIRECTIVE = re.compile(r"//\s*CHECK(?:-(LABEL|NEXT|SAME|NOT|DAG|COUNT-(\d+)))?:\s?(.*)$")


class CheckError(AssertionError):
    pass


def _compile(pattern: str) -> re.Pattern:
    pattern = pattern.strip()
    out, pos = [], 0
    for m in re.finditer(r"\{\{(.*?)\}\}", pattern):
        out.append(re.escape(pattern[pos:m.start()]))
        out.append(f"(?:{m.group(1)})")
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    return re.compile("".join(out))


def parse(check_text: str) -> list[tuple[str, re.Pattern, str]]:
    directives = []
    for line in check_text.splitlines():
        m = _DIRECTIVE.search(line)
        if not m:
            continue
        kind = m.group(1) or "CHECK"
        if kind.startswith("COUNT"):
            for _ in range(int(m.group(2))):
                directives.append(("CHECK", _compile(m.group(3)), m.group(3)))
            continue
        directives.append((kind, _compile(m.group(3)), m.group(3)))
    return directives


def check(output: str, check_text: str) -> None:
    """Raise CheckError naming the first directive that fails."""
    lines = output.splitlines()
    directives = parse(check_text)
    if not directives:
        raise CheckError("no CHECK directives")
    pos = 0            # next line to search
    last = -1          # line of the last positive match
    col = 0            # end column of the last match on `last`
    pending_not: list = []
    i = 0
    while i < len(directives):
        kind, pat, text = directives[i]
        if kind == "NOT":
            pending_not.append((pat, text))
            i += 1
            continue
        if kind == "DAG":
            group = []
            while i < len(directives) and directives[i][0] == "DAG":
                group.append(directives[i])
                i += 1
            used, hi = set(), pos
            for _, p, t in group:
                found = next((n for n in range(pos, len(lines)) if n not in used and p.search(lines[n])), None)
                if found is None:
                    raise CheckError(f"CHECK-DAG: {t!r} not found after line {pos + 1}")
                used.add(found)
                hi = max(hi, found)
            _no(lines, pending_not, pos, min(used))
            pending_not, last, pos, col = [], hi, hi + 1, 0
            continue
        if kind == "SAME":
            if last < 0:
                raise CheckError(f"CHECK-SAME: {text!r} with no previous match")
            m = pat.search(lines[last], col)
            if not m:
                raise CheckError(f"CHECK-SAME: {text!r} not on line {last + 1}: {lines[last]!r}")
            col = m.end()
            i += 1
            continue
        if kind == "NEXT":
            n = last + 1
            if n >= len(lines) or not pat.search(lines[n]):
                raise CheckError(f"CHECK-NEXT: {text!r} not on line {n + 1}")
            found = n
        else:
            found = next((n for n in range(pos, len(lines)) if pat.search(lines[n])), None)
            if found is None:
                raise CheckError(f"CHECK{'-LABEL' if kind == 'LABEL' else ''}: {text!r} "
                                 f"not found after line {pos + 1}")
        _no(lines, pending_not, pos, found)
        pending_not = []
        m = pat.search(lines[found])
        last, pos, col = found, found + 1, m.end()
        i += 1
    _no(lines, pending_not, pos, len(lines))


def _no(lines, nots, start, end) -> None:
    for pat, text in nots:
        for n in range(start, end):
            if pat.search(lines[n]):
                raise CheckError(f"CHECK-NOT: {text!r} found on line {n + 1}: {lines[n].strip()!r}")
