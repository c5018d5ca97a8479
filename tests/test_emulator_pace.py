"""`python3 -m flashgen.emulate.pace`, this engine against itself: the tool that measures the
emulator's speed runs both ways (cold and --warm), checks the engines' warp-instruction counts
agree and prints its table."""
import pathlib
import re

import pytest

from conftest import needs_nvcc
from flashgen.emulate import pace

ROOT = pathlib.Path(__file__).resolve().parents[1]


@needs_nvcc
def test_pace_compares_an_engine_with_itself(capsys):
    for warm in ([], ["--warm"]):
        assert pace.main(["--baseline", str(ROOT), "--families", "dense", "--repeat", "1", "--clock", "cpu",
                          *warm]) == 0
        out = capsys.readouterr().out
        row = re.search(r"^dense\s+([\d,]+)\s+(\d+)\s+(\d+)\s+([\d.]+)x$", out, re.M)
        assert row and int(row[1].replace(",", "")) > 10_000, out
        assert ("second run in its process" in out) == bool(warm), out


def test_pace_splits_the_standard_run_by_family_and_refuses_unequal_work():
    def run(seconds):   # one engine's run of the standard cases: case i did 1000 * (i + 1) warp-instructions
        return {"standard": [{"ok": True, "seconds": seconds, "warp_instructions": 1000 * (i + 1)}
                             for i in range(8)]}
    runs = {"baseline": [run(2.0), run(4.0)], "this": [run(0.2), run(0.1)]}
    rows = {label: (n, p) for label, n, p in pace.table(runs, ["standard"])}
    assert rows["standard"][0] == 36_000
    # the median over runs of each run's pace: the 8 cases took 8 x seconds in each run
    assert rows["standard"][1] == pytest.approx({"baseline": (36_000 / 16 + 36_000 / 32) / 2,
                                                 "this": (36_000 / 1.6 + 36_000 / 0.8) / 2})
    assert rows["standard: dense"][0] == 10_000                   # cases 0-3
    assert rows["standard: paged"][0] == 15_000                   # cases 6 and 7
    assert rows["standard: paged"][1] == pytest.approx({"baseline": (15_000 / 4 + 15_000 / 8) / 2,
                                                        "this": (15_000 / 0.4 + 15_000 / 0.2) / 2})
    runs["this"][1]["standard"][5]["warp_instructions"] += 1      # the same total, not the same cases
    runs["this"][1]["standard"][6]["warp_instructions"] -= 1
    with pytest.raises(SystemExit, match="standard: varlen: the engines executed different"):
        pace.table(runs, ["standard"])
