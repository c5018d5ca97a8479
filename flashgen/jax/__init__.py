"""JAX integration: flashgen kernels as a differentiable, vmappable JAX function."""
from flashgen.jax.attention import flash_attention, flash_attention_paged, flash_attention_varlen
from flashgen.jax.export import export, flashgen_custom_call_checks
from flashgen.jax.ring import ring_attention
from flashgen.call_contract import check_module as check_calls
from flashgen.runtime import load

__all__ = ["flash_attention", "flash_attention_varlen", "flash_attention_paged", "ring_attention", "export", "load", "flashgen_custom_call_checks", "check_calls"]
