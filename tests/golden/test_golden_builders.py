"""The golden builders (tests/golden/cases) register exactly the committed cases, each with
the entry its manifest records, so a renamed builder or an edited expectation cannot wait
for the next regeneration to show. Only the registry is read: no builder runs."""
from __future__ import annotations

import json
import pathlib

from cases.registry import golden, load_sections, training_golden

GOLDEN = pathlib.Path(__file__).parent


def test_builders_match_the_manifests():
    load_sections()
    for goldens, manifest in ((golden, "cases.json"), (training_golden, "train_cases.json")):
        committed = json.loads((GOLDEN / manifest).read_text())
        registered = {name: dict(file=f"inputs/{name}.{meta['fmt']}", format=meta["fmt"],
                                 **meta["expect"])
                      for name, meta in goldens.items()}
        assert registered == committed, manifest
        assert all((GOLDEN / case["file"]).exists() for case in committed.values())
