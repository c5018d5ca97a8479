"""The emulator's pace, this engine against another checkout's, side by side in one run.

    python3 -m flashgen.emulate.pace --baseline /tmp/emu_base [--repeat 3]

runs `flashgen check --emulate`'s standard cases (d64 bf16 causal, sm80: the handlers' own
launches, the same inputs and schedule seed in both): one case per kernel family (dense, extras,
varlen, paged) alone in a child process, and all eight together in one ("standard": a user's whole
check, each kernel compiled once and its pace also split by family). Each engine runs them after
the other, alternating which goes first, and the table gives warp-instructions per second: the
median over the repeats, and the ratio. Both engines must execute the same number of
warp-instructions per case (else the comparison is refused). The machine's load average is printed
with the table: other processes slow both engines alike only when interleaved.
`--clock cpu` times each launch by the child's CPU time instead of the wall clock: on a machine
whose load exceeds its CPUs the wall clock measures mostly the waits for a CPU. A case is timed on
its first run in a fresh process (its kernels compiled in it, as a one-off check sees it), or with
`--warm` on its second (as the later cases of a test suite see it).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

# Run in a child whose flashgen is the engine under test (PYTHONPATH): prints one JSON line, each
# case's seconds and warp-instructions.
_CHILD = r"""
import json, sys
import numpy as np
import flashgen
from flashgen.build import build
from flashgen.emulate.check import Checker
from flashgen.emulate.host import EmulatedLibrary
from flashgen.spec import KernelSpec

spec = KernelSpec(64, "bf16", True, "sm80")
lib = EmulatedLibrary(build(spec, host="emulate"))
# `flashgen check --emulate`'s standard cases for this spec as of 8cc42da (the baseline's own list;
# today's adds cases the old checker cannot express), run in the order argv[1] lists their indices
# with one Checker, each kernel compiled on its first launch in this process.
STANDARD = [
    lambda c: c.dense(seqlen_q=77, seqlen_k=129, heads_q=2, heads_kv=1, bottom_right=True),
    lambda c: c.dense(seqlen_q=70, seqlen_k=90, window=(16, 0), softcap=3.0),
    lambda c: c.dense(seqlen_q=300, seqlen_k=260, window=(40, 0), bottom_right=True),
    lambda c: c.dense(seqlen_q=260, seqlen_k=300, window=(40, 0), backward=False),
    lambda c: c.dense(batch=2, seqlen_q=33, seqlen_k=40, heads_q=6, heads_kv=3, bottom_right=True,
                      softcap=2.0, alibi="BH", bias=(1, 6), mask=(2, 1), segment_ids=True),
    lambda c: c.varlen(seqlens_q=(17, 0, 40), seqlens_k=(23, 5, 31), heads_q=9, heads_kv=3,
                       bottom_right=True, alibi="BH", softcap=3.0),
    lambda c: c.paged(seqused_k=(300, 0, 41), block_size=16, heads_q=9, heads_kv=3, softcap=2.0),
    lambda c: c.paged(seqused_k=(70, 33), seqlen_q=3, block_size=48, heads_q=6, heads_kv=3, alibi="H"),
]
assert flashgen.__file__.startswith(sys.argv[2]), flashgen.__file__
if sys.argv[3] == "cpu":    # both engines time a handler call with host.py's time.perf_counter
    import time, types
    import flashgen.emulate.host as host
    host.time = types.SimpleNamespace(perf_counter=time.process_time)
cases = [STANDARD[int(i)] for i in sys.argv[1].split(",")]


def run():
    c = Checker(lib, spec, np.random.default_rng(0), seed=1)
    return [case(c).rows for case in cases]
if sys.argv[4] == "warm":   # an untimed run first: its kernels compiled, what a suite's later cases see
    run()
parts = []
for rows in run():
    calls = {r.call: (r.seconds, r.warp_instructions) for r in rows}
    parts.append({"ok": all(r.ok for r in rows), "seconds": sum(c[0] for c in calls.values()),
                  "warp_instructions": sum(c[1] for c in calls.values())})
print(json.dumps(parts), flush=True)
"""
# each kernel family's cases among the standard ones: a family alone runs its first case
GROUPS = {"dense": (0, 1, 2, 3), "extras": (4,), "varlen": (5,), "paged": (6, 7)}
FAMILIES = (*GROUPS, "standard")        # "standard": all eight cases in one process, a user's check


def _run(root: pathlib.Path, families, clock: str, warm: bool) -> dict:
    """Each case in a child process of its own: a case run after others in one process inherits
    their heap, and the cyclic collector's full passes (over every kernel compiled so far) land in
    whichever case comes next -- measured, one such pass took 88 ms of the paged case's 0.29 s."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    runs = {}
    for family in families:
        # cwd: `python3 -c` puts the working directory first on sys.path, before PYTHONPATH
        cases = [i for g in GROUPS.values() for i in g] if family == "standard" else GROUPS[family][:1]
        argv = [sys.executable, "-c", _CHILD, ",".join(map(str, cases)), str(root), clock,
                "warm" if warm else "cold"]
        out = subprocess.run(argv, env=env, cwd=root, check=True, capture_output=True, text=True).stdout
        runs[family] = json.loads(out)
    return runs


def table(runs: dict, families) -> list[tuple[str, int, dict]]:
    """(label, warp-instructions, {engine: median warp-instructions/s}) per family, and for the
    standard run its cases by family (each family's kernels' pace within a user's check)."""
    rows = [(f, f, None) for f in families]
    if "standard" in families:
        rows += [(f"standard: {f}", "standard", cases) for f, cases in GROUPS.items()]
    out = []
    for label, f, cases in rows:
        def part(run):
            picked = run[f] if cases is None else [run[f][i] for i in cases]
            return {key: sum(p[key] for p in picked) for key in ("seconds", "warp_instructions")}
        counts = {part(r)["warp_instructions"] for e in runs for r in runs[e]}
        if len(counts) != 1:
            raise SystemExit(f"{label}: the engines executed different warp-instruction counts {sorted(counts)}")
        if not all(p["ok"] for e in runs for r in runs[e] for p in r[f]):
            raise SystemExit(f"{f}: an engine's outputs failed the tolerance check")
        n = counts.pop()
        out.append((label, n, {e: statistics.median(n / part(r)["seconds"] for r in runs[e]) for e in runs}))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m flashgen.emulate.pace", description=__doc__.split("\n")[0])
    p.add_argument("--baseline", required=True, type=pathlib.Path,
                   help="root of another flashgen checkout (e.g. `git worktree add /tmp/emu_base <commit>`)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time launches by the wall clock or by the child's CPU time")
    p.add_argument("--warm", action="store_true",
                   help="time each case's second run in its process (its kernels compiled by the first)")
    args = p.parse_args(argv)
    engines = {"baseline": args.baseline.resolve(), "this": pathlib.Path(__file__).resolve().parents[2]}
    families = args.families.split(",")
    runs: dict = {e: [] for e in engines}
    load0 = os.getloadavg()
    for i in range(args.repeat):
        for engine in (list(engines) if i % 2 == 0 else list(engines)[::-1]):
            runs[engine].append(_run(engines[engine], families, args.clock, args.warm))
            print(f"repeat {i + 1}/{args.repeat}: {engine} done", file=sys.stderr, flush=True)
    load1 = os.getloadavg()
    print(f"{'family':<18} {'warp-instr':>10} {'baseline k/s':>13} {'this k/s':>10} {'ratio':>7}")
    for label, n, pace in table(runs, families):
        print(f"{label:<18} {n:>10,} {pace['baseline'] / 1e3:>13.0f} {pace['this'] / 1e3:>10.0f} "
              f"{pace['this'] / pace['baseline']:>6.1f}x")
    run = "second run in its process, its kernels compiled" if args.warm else "first run in its process"
    print(f"{args.clock} clock, each case's {run}, median of {args.repeat} interleaved runs each; "
          f"load average {load0[0]:.2f} at the start, {load1[0]:.2f} at the end, on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
