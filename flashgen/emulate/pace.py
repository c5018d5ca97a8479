"""The emulator's pace, this engine against another checkout's, side by side in one run.

    python3 -m flashgen.emulate.pace --baseline /tmp/emu_base [--repeat 3]

runs the dense, extras, varlen and paged cases of `flashgen check --emulate` (d64 bf16 causal,
sm80: the handlers' own launches, the same inputs and schedule seed in both), each in a child
process of its own, one engine after the other, alternating which goes first, and prints
warp-instructions per second per kernel family: the median over the repeats, and the ratio. Both
engines must execute the same number of warp-instructions per case (else the comparison is
refused). The machine's load average is printed with the table: other processes slow both engines
alike only when interleaved.
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

# Run in a child whose flashgen is the engine under test (PYTHONPATH): prints one JSON line per case.
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
CASES = {
    "dense": lambda c: c.dense(seqlen_q=77, seqlen_k=129, heads_q=2, heads_kv=1, bottom_right=True),
    "extras": lambda c: c.dense(batch=2, seqlen_q=33, seqlen_k=40, heads_q=6, heads_kv=3, bottom_right=True,
                                softcap=2.0, alibi="BH", bias=(1, 6), mask=(2, 1), segment_ids=True),
    "varlen": lambda c: c.varlen(seqlens_q=(17, 0, 40), seqlens_k=(23, 5, 31), heads_q=9, heads_kv=3,
                                 bottom_right=True, alibi="BH", softcap=3.0),
    "paged": lambda c: c.paged(seqused_k=(300, 0, 41), block_size=16, heads_q=9, heads_kv=3, softcap=2.0),
}
assert flashgen.__file__.startswith(sys.argv[2]), flashgen.__file__
if sys.argv[3] == "cpu":    # both engines time a handler call with host.py's time.perf_counter
    import time, types
    import flashgen.emulate.host as host
    host.time = types.SimpleNamespace(perf_counter=time.process_time)
name = sys.argv[1]
if sys.argv[4] == "warm":   # an untimed run first: its kernels compiled, what a suite's later cases see
    CASES[name](Checker(lib, spec, np.random.default_rng(0), seed=1))
result = CASES[name](Checker(lib, spec, np.random.default_rng(0), seed=1))
calls = {r.call: (r.seconds, r.warp_instructions) for r in result.rows}
print(json.dumps({"case": name, "ok": all(r.ok for r in result.rows),
                  "seconds": sum(c[0] for c in calls.values()),
                  "warp_instructions": sum(c[1] for c in calls.values())}), flush=True)
"""
FAMILIES = ("dense", "extras", "varlen", "paged")


def _run(root: pathlib.Path, families, clock: str, warm: bool) -> dict:
    """Each case in a child process of its own: a case run after others in one process inherits
    their heap, and the cyclic collector's full passes (over every kernel compiled so far) land in
    whichever case comes next -- measured, one such pass took 88 ms of the paged case's 0.29 s."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    runs = {}
    for family in families:
        # cwd: `python3 -c` puts the working directory first on sys.path, before PYTHONPATH
        argv = [sys.executable, "-c", _CHILD, family, str(root), clock, "warm" if warm else "cold"]
        out = subprocess.run(argv, env=env, cwd=root, check=True, capture_output=True, text=True).stdout
        runs[family] = json.loads(out)
    return runs


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
    print(f"{'family':<8} {'warp-instr':>10} {'baseline k/s':>13} {'this k/s':>10} {'ratio':>7}")
    for f in families:
        counts = {r[f]["warp_instructions"] for e in engines for r in runs[e]}
        if len(counts) != 1:
            raise SystemExit(f"{f}: the engines executed different warp-instruction counts {sorted(counts)}")
        if not all(r[f]["ok"] for e in engines for r in runs[e]):
            raise SystemExit(f"{f}: an engine's outputs failed the tolerance check")
        n = counts.pop()
        pace = {e: statistics.median(n / r[f]["seconds"] for r in runs[e]) for e in engines}
        print(f"{f:<8} {n:>10,} {pace['baseline'] / 1e3:>13.0f} {pace['this'] / 1e3:>10.0f} "
              f"{pace['this'] / pace['baseline']:>6.1f}x")
    run = "second run in its process, its kernels compiled" if args.warm else "first run in its process"
    print(f"{args.clock} clock, each case's {run}, median of {args.repeat} interleaved runs each; "
          f"load average {load0[0]:.2f} at the start, {load1[0]:.2f} at the end, on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
