"""The `flashgen cache list|verify|clean` subcommands (the cache itself: cache.py)."""
from __future__ import annotations

import sys

from flashgen import cache


def register(subparsers) -> None:
    c = subparsers.add_parser(
        "cache", help="list, verify or clean the kernel cache",
        description="The kernel cache ($FLASHGEN_CACHE_DIR, else $XDG_CACHE_HOME/flashgen, else "
                    "~/.cache/flashgen): every library, object (with its PTX) and emulation "
                    "runtime is verified against its recorded size and sha256.")
    sub = c.add_subparsers(dest="action", metavar="ACTION", required=True)
    sub.add_parser("list", help="every library (specs, target, size), the objects and runtimes"
                   ).set_defaults(func=cmd_list)
    sub.add_parser("verify", help="check every entry against its records; exit 1 if any is "
                   "damaged").set_defaults(func=cmd_verify)
    k = sub.add_parser("clean", help="remove damaged entries and what interrupted builds left "
                       "(--all: everything not in use)")
    k.add_argument("--all", action="store_true", help="remove every entry no build is using")
    k.set_defaults(func=cmd_clean)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def cmd_list(args) -> int:
    root = cache.root()
    entries = cache.survey(root)
    print(f"cache: {root}")
    libs = [e for e in entries if e.kind == "library"]
    for e in libs:
        if e.problem:
            print(f"  {e.key}  {'outdated' if e.outdated else 'DAMAGED'}: {e.problem}")
            continue
        m = e.manifest
        stems = ", ".join(f"d{s['head_dim']}_{s['dtype']}{'_causal' if s['causal'] else ''}"
                          for s in m["specs"])
        print(f"  {e.key}  {m['target']:<5} {m['host']:<6} {_size(e.size):>10}  {stems}")
    objects = [e for e in entries if e.kind == "object"]
    runtimes = [e for e in entries if e.kind == "runtime"]
    staging = [e for e in entries if e.kind == "staging"]
    bad = sum(1 for e in entries if e.problem and not e.outdated)
    old = sum(1 for e in entries if e.outdated)
    print(f"{len(libs)} libraries, {len(objects)} objects ({_size(sum(e.size for e in objects))})"
          f", {len(runtimes)} runtimes ({_size(sum(e.size for e in runtimes))})"
          f", {len(staging)} staging, {bad} damaged, {old} outdated")
    return 0


def cmd_verify(args) -> int:
    root = cache.root()
    entries = cache.survey(root)
    bad = [e for e in entries if e.problem and not e.outdated]
    for e in bad:
        print(f"damaged {e.kind} {e.path}: {e.problem}")
    checked = sum(1 for e in entries if e.kind != "staging" and not e.outdated)
    old = sum(1 for e in entries if e.outdated)
    note = f"; {old} outdated entries (never used) can go: flashgen cache clean" if old else ""
    print(f"{checked} entries verified in {root}: "
          + (f"{len(bad)} damaged (flashgen cache clean removes them)" if bad else "all intact")
          + note, file=sys.stderr if bad else sys.stdout)
    return 1 if bad else 0


def cmd_clean(args) -> int:
    removed = cache.clean(cache.root(), everything=args.all)
    for e in removed:
        print(f"removed {e.kind} {e.path}" + (f" ({e.problem})" if e.problem else ""))
    print(f"{len(removed)} entries removed")
    return 0
