"""`python3 -m flashgen.emulate.pace`, this engine against itself: the tool that measures the
emulator's speed runs both ways (cold and --warm), checks the engines' warp-instruction counts
agree and prints its table."""
import pathlib
import re

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
