"""Golden training graphs: gradients of small transformers (forward + backward attention).

    python tests/golden/generate_train.py [case ...]   # needs jax; the torch cases torchax

Writes tests/golden/inputs/train_*.mlir and tests/golden/train_cases.json (what each
case must rewrite or reject, and why); FileCheck directives live in
tests/golden/checks/train_*.check. The builders are the ``@training_golden(...)`` functions
of tests/golden/cases/training*.py, each named after the case it builds; each module is
``jax.grad`` of a loss of a small transformer, exported for CPU;
tests/test_rewrite_backward.py rewrites and runs them.
"""
from __future__ import annotations

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from generate import write_cases  # noqa: E402  (puts flashgen from this checkout on the path)

from cases.registry import load_sections, training_golden  # noqa: E402


def default_checks(expect: dict) -> str:
    lines = ["// CHECK-LABEL: func.func public @main"]
    if expect["sites"]:
        # the backward call reads the forward call's o and lse
        lines += [f"// CHECK: {{{{%[0-9]+}}}}:2 = stablehlo.custom_call @{expect['fwd'][-1]}(",
                  f"// CHECK: stablehlo.custom_call @{expect['bwd'][0]}("
                  "{{[^)]*}}#0, %{{[0-9]+}}#1, ",
                  "// CHECK-NOT: stablehlo.exponential"]
    else:
        lines.append("// CHECK-NOT: @flashgen_bwd")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    load_sections()
    return write_cases(training_golden, HERE / "train_cases.json", default_checks, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
