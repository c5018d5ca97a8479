"""Helpers for getting models from other frontends into flashgen.

    flashgen.frontends.flax            attention_fn adapter: flax attention -> flash_attention
    flashgen.frontends.torchax_compat  import torchax under torch releases it predates

Nothing here is imported by ``import flashgen``: each module imports its frontend
(flax, torch) only when it is itself imported.
"""
