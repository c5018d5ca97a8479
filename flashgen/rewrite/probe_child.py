"""The probe's child process (flashgen.rewrite.probe): parses untrusted input where a crash
of the MLIR reader costs only this process. Kept apart from probe so that probe, which
flashgen.rewrite.modules uses, never imports modules back."""
from __future__ import annotations

import sys

from flashgen.errors import LoadError
from flashgen.mlir_context import new_context
from flashgen.rewrite import modules, probe


def main(fmt: str) -> int:
    """Parse stdin as ``fmt``, print it, and write the printed text's nesting depth."""
    data = sys.stdin.buffer.read()
    try:
        with new_context():
            module, _, _ = modules.parse(data, fmt)
            # regions first, without recursion: printing costs depth squared in indentation
            depth = probe.region_depth(module.operation)
            if depth <= probe.MAX_NESTING:  # then attributes, types and locations, from the text
                depth = probe.nesting_depth(modules.module_text(module, True).encode())
    except LoadError as e:
        print(e, file=sys.stderr)
        return 3
    print(depth)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
