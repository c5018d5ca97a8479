"""jax.export with flashgen's custom calls allowed through the safety check."""
from __future__ import annotations

import jax

from flashgen.jax.sharding import all_target_names


def flashgen_custom_call_checks() -> list:
    """DisabledSafetyCheck entries for every flashgen target name."""
    return [jax.export.DisabledSafetyCheck.custom_call(name) for name in all_target_names()]


def export(fn, *args, platforms=None, **kwargs):
    """jax.export.export(jax.jit(fn))(*args, **kwargs), accepting flashgen targets.

    The result serializes and deserializes like any Exported; calling it needs
    the targets registered (flashgen.jax.load or a flash_attention call).
    """
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    exp = jax.export.export(jitted, platforms=platforms,
                            disabled_checks=flashgen_custom_call_checks())
    return exp(*args, **kwargs)
