"""Argparse helpers shared by `flashgen`'s subcommands (cli.py and the plugins it loads)."""
from __future__ import annotations

import argparse

from flashgen.spec import DTYPES, FP8_DTYPES, HEAD_DIMS


def csv_ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def csv(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def add_spec_args(p: argparse.ArgumentParser, multi: bool) -> None:
    p.add_argument("--hdim", type=csv_ints if multi else int, required=True,
                   help=f"head dim{'s (comma-separated)' if multi else ''}: {', '.join(map(str, HEAD_DIMS))}")
    p.add_argument("--hdim-v", type=int, default=None,
                   help="the value head dim (KernelSpec.head_dim_v), if it differs from --hdim (cpu only)")
    p.add_argument("--dtype", type=csv if multi else str, default=["bf16"] if multi else "bf16",
                   help=f"element type{'s (comma-separated)' if multi else ''}: {', '.join(DTYPES)}; "
                        f"{', '.join(FP8_DTYPES)} (FP8 forward only, sm90a)")
