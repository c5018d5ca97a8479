"""flax's ``attention_fn`` hook, answered by flashgen's kernels.

flax's attention modules take the function that turns (query, key, value) into
the attended values as an argument::

    import flax.linen as nn
    from flax import nnx
    from flashgen.frontends.flax import attention_fn, make_attention_fn

    # linen: causality is a property of the function you hand over
    nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=make_attention_fn(causal=True))

    # nnx: MultiHeadAttention forwards its own is_causal= argument to attention_fn
    mha = nnx.MultiHeadAttention(num_heads=8, in_features=512, decode=False,
                                 attention_fn=attention_fn, rngs=nnx.Rngs(0))
    y = mha(x, is_causal=True)

The adapter maps flax's calling convention -- ``(query, key, value, bias, mask,
broadcast_dropout, dropout_rng, dropout_rate, deterministic, dtype, precision,
module, ...)``, arrays laid out ``[batch..., length, heads, head_dim]`` -- onto
:func:`flashgen.jax.flash_attention` (BSHD, ``causal``, ``scale``,
``bottom_right``), which is differentiable (the backward kernel runs under
``jax.grad``). The scale is flax's ``1/sqrt(head_dim)`` unless given.

What it refuses, with a ValueError or NotImplementedError that says so (never a
silently different result):

* ``bias`` (additive attention bias, e.g. ALiBi or relative positions);
* a ``mask`` that is not provably causal or all-true: flashgen's kernels take
  no mask tensor. A *concrete* mask (a numpy array or a constant closed over by
  the model) is inspected: the causal mask of ``nn.make_causal_mask`` (top-left
  aligned) or its bottom-right-aligned variant selects the causal kernel, an
  all-true mask the plain one. A mask computed inside ``jit`` is a traced value
  whose contents are unknown when the kernel is chosen, so it is refused: drop
  the mask and pass ``causal=True`` / ``is_causal=True`` instead. Padding masks
  are not supported;
* dropout on the attention probabilities (``dropout_rate > 0`` while not
  ``deterministic``);
* ``module`` (``sow_weights=True``): the probabilities are never materialized;
* custom einsums (``qk_attn_weights_einsum`` / ``attn_weights_value_einsum``).

``precision`` and ``force_fp32_for_softmax`` are accepted and ignored: the
kernels always accumulate and take the softmax in f32.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Optional

import numpy as np

__all__ = ["attention_fn", "make_attention_fn"]


def make_attention_fn(*, causal: bool = False, scale: Optional[float] = None,
                      bottom_right: bool = False):
    """An ``attention_fn`` with fixed causality/scale, for modules that do not pass ``is_causal``."""
    return functools.partial(attention_fn, is_causal=causal, scale=scale,
                             bottom_right=bottom_right)


def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                 dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = True,
                 dtype=None, precision=None, module=None, force_fp32_for_softmax: bool = False,
                 qk_attn_weights_einsum=None, attn_weights_value_einsum=None, *,
                 is_causal: bool = False, scale: Optional[float] = None,
                 bottom_right: bool = False):
    """flax ``dot_product_attention``-compatible attention on flashgen kernels (see module doc)."""
    import jax.numpy as jnp

    from flashgen.jax import flash_attention

    if bias is not None:
        raise NotImplementedError(
            "flashgen attention_fn: an attention bias is not supported (the kernels add no "
            "bias to the scores); use flax's dot_product_attention for this module")
    if module is not None:
        raise NotImplementedError(
            "flashgen attention_fn: sow_weights=True needs the attention probabilities, "
            "which flashgen never materializes")
    if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
        raise NotImplementedError("flashgen attention_fn: custom attention einsums "
                                  "(qk_attn_weights_einsum / attn_weights_value_einsum) "
                                  "are not supported")
    if dropout_rate > 0.0 and not deterministic:
        raise NotImplementedError(
            f"flashgen attention_fn: attention dropout (dropout_rate={dropout_rate}) is not "
            "supported; set deterministic=True or dropout_rate=0")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if np.ndim(x) < 3:
            raise ValueError(f"flashgen attention_fn: {name} must be [batch..., length, heads, "
                             f"head_dim], got shape {np.shape(x)}")

    causal = bool(is_causal)
    if mask is not None:
        causal, bottom_right = _causal_from_mask(mask, query.shape[-3], key.shape[-3],
                                                 causal, bottom_right)
    if dtype is not None:
        query, key, value = (x.astype(dtype) for x in (query, key, value))

    batch = query.shape[:-3]
    q = query.reshape((math.prod(batch), *query.shape[-3:]))
    k = key.reshape((math.prod(key.shape[:-3]), *key.shape[-3:]))
    v = value.reshape((math.prod(value.shape[:-3]), *value.shape[-3:]))
    out = flash_attention(q, k, v, causal=causal, scale=scale, bottom_right=bottom_right)
    return jnp.reshape(out, (*batch, *out.shape[1:]))


def _causal_from_mask(mask: Any, sq: int, sk: int, causal: bool, bottom_right: bool):
    """(causal, bottom_right) that a concrete boolean mask stands for, or ValueError."""
    try:
        m = np.asarray(mask)
    except Exception:  # noqa: BLE001 - a jax Tracer raises TracerArrayConversionError
        hint = ("the causal flag (is_causal=True, or make_attention_fn(causal=True)) already "
                "says so: drop the mask" if causal else
                "for a causal mask, drop the mask and pass is_causal=True "
                "(or make_attention_fn(causal=True))")
        raise ValueError(
            "flashgen attention_fn: got a mask computed at run time (a traced array); the "
            "kernel is chosen at trace time and takes no mask tensor, so its contents cannot "
            f"be checked -- {hint}. Padding masks are not supported.") from None
    if m.shape[-2:] != (sq, sk):
        raise ValueError(f"flashgen attention_fn: mask shape {m.shape} does not end in "
                         f"(q_length, kv_length) = ({sq}, {sk})")
    m = m.astype(bool)
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    candidates = {(True, False): j <= i, (True, True): j <= i + (sk - sq),
                  (False, False): np.ones((sq, sk), bool)}
    for (c, br), pattern in candidates.items():
        if np.array_equal(m, np.broadcast_to(pattern, m.shape)):
            if causal and not c:
                break  # is_causal=True with an all-true mask: contradictory
            return c, (br if c else bottom_right)
    raise ValueError(
        "flashgen attention_fn: only causal (top-left or bottom-right aligned) or all-true "
        "masks are supported; this mask is neither" +
        (" (and is_causal=True was also given)" if causal else "") +
        ". Padding and arbitrary masks need flax's dot_product_attention")
