"""Produce the golden rewrite inputs from the real frontends.

    python tests/golden/generate.py [case ...]   # needs jax, flax, torch 2.13.0 (CPU), torchax

Writes tests/golden/inputs/<case>.<fmt> and tests/golden/cases.json (what each case
must rewrite or reject, and why); with case names, only those. The outputs are committed so
that CI needs neither torch nor flax. The builders are the functions of
tests/golden/cases/<section>.py, each named after the case it builds and registered by its
``@golden(...)`` decorator (tests/golden/cases/registry.py). FileCheck directives live in
tests/golden/checks/<case>.check (written here for new cases; edit by hand if a case needs
more specific checks). The keras goldens need keras and keras_hub, the hf_* ones transformers,
equinox_vmap_mha equinox.
"""
from __future__ import annotations

import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
INPUTS = HERE / "inputs"
CHECKS = HERE / "checks"
sys.path.insert(0, str(HERE.parents[1]))   # flashgen from this checkout
from cases.registry import golden, load_sections  # noqa: E402


def write(name: str, meta: dict) -> pathlib.Path:
    exported = meta["fn"]()
    fmt = meta["fmt"]
    if fmt == "mlir":
        path = INPUTS / f"{name}.mlir"
        path.write_text(exported.mlir_module())
    elif fmt == "mlirbc":
        path = INPUTS / f"{name}.mlirbc"
        path.write_bytes(exported.mlir_module_serialized)  # a StableHLO portable artifact
    else:
        path = INPUTS / f"{name}.jax_exported"
        path.write_bytes(bytes(exported.serialize()))
    return path


def default_checks(expect: dict) -> str:
    lines = ["// CHECK-LABEL: func.func public @main"]
    if expect["rewritten"] and len(expect["targets"]) == 1:
        (t,) = expect["targets"]
        causal = "true" if t.endswith("_causal") else "false"
        br = "true" if expect["bottom_right"] else "false"
        lines += [f"// CHECK: stablehlo.custom_call @{t}(",
                  "// CHECK-SAME: api_version = 4 : i32",
                  f"// CHECK-SAME: backend_config = {{bottom_right = {br}, causal = {causal}, "
                  f"extras = \"{','.join(expect.get('extras') or [])}\", scale = "]
    elif expect["rewritten"]:
        lines += [f"// CHECK-DAG: stablehlo.custom_call @{t}(" for t in expect["targets"]]
    else:
        lines.append("// CHECK-NOT: @flashgen_")
    if expect["rewritten"] and not expect["rejected"]:
        lines.append("// CHECK-NOT: stablehlo.exponential")
    return "\n".join(lines) + "\n"


def write_cases(cases: dict, manifest_path: pathlib.Path, checks, argv: list[str]) -> int:
    """Write the inputs of ``cases`` (every one, or those named in ``argv``), their entries in
    the manifest and, for a case without one, a FileCheck file ``checks(expect)``."""
    INPUTS.mkdir(parents=True, exist_ok=True)
    CHECKS.mkdir(parents=True, exist_ok=True)
    only = set(argv)
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    for name, meta in cases.items():
        if only and name not in only:
            continue
        path = write(name, meta)
        manifest[name] = dict(file=f"inputs/{path.name}", format=meta["fmt"], **meta["expect"])
        check = CHECKS / f"{name}.check"
        if not check.exists():
            check.write_text(checks(meta["expect"]))
        print(f"{name}: {path.relative_to(HERE)}")
    manifest_path.write_text(json.dumps(dict(sorted(manifest.items())), indent=1) + "\n")
    return 0


def main(argv: list[str]) -> int:
    load_sections()
    return write_cases(golden, HERE / "cases.json", default_checks, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
