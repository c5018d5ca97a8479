"""The one exception the emulator raises: the kernel did something we cannot or must not run."""
from __future__ import annotations

from flashgen.errors import FlashgenError


class EmulationError(FlashgenError):
    """Unsupported PTX, or unsafe kernel behaviour (bad access, race, divergence, deadlock).

    Raised with the kernel, block, warp, pc and instruction prepended by the machine, so a failure
    in CI points at the exact PTX line.
    """
