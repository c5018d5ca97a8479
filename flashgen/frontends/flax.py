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
``bottom_right``, ``window``, ``softcap``, ``bias``, ``mask``), which is
differentiable (the backward kernel runs under ``jax.grad``, the bias gets its
gradient). The scale is flax's ``1/sqrt(head_dim)`` unless given.

``bias`` and ``mask`` ([batch..., heads|1, q_length, kv_length]) go to the kernels
as operands. A *concrete* mask (a numpy array or a constant closed over by the
model) that is exactly causal (``nn.make_causal_mask``, top-left or bottom-right
aligned) or all-true selects the causal or plain kernel instead, with no mask
operand; a key-padding mask travels as segment ids (flash_attention).

What it refuses, with a NotImplementedError that says so (never a silently
different result):

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
                      bottom_right: bool = False, window=(-1, -1), softcap: float = 0.0):
    """An ``attention_fn`` with fixed causality/scale/window/softcap (flash_attention's
    meanings), for modules that do not pass ``is_causal``."""
    return functools.partial(attention_fn, is_causal=causal, scale=scale,
                             bottom_right=bottom_right, window=window, softcap=softcap)


def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                 dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = True,
                 dtype=None, precision=None, module=None, force_fp32_for_softmax: bool = False,
                 qk_attn_weights_einsum=None, attn_weights_value_einsum=None, *,
                 is_causal: bool = False, scale: Optional[float] = None,
                 bottom_right: bool = False, window=(-1, -1), softcap: float = 0.0):
    """flax ``dot_product_attention``-compatible attention on flashgen kernels (see module doc)."""
    import jax.numpy as jnp

    from flashgen.jax import flash_attention

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
    sq, sk = query.shape[-3], key.shape[-3]
    if mask is not None:
        kind = _causal_from_mask(mask, sq, sk) if np.shape(mask)[-2:] == (sq, sk) else None
        if kind is not None and (kind[0] or not causal):
            causal, bottom_right = kind[0] or causal, kind[1] if kind[0] else bottom_right
            mask = None
    if dtype is not None:
        query, key, value = (x.astype(dtype) for x in (query, key, value))

    batch = query.shape[:-3]
    q = query.reshape((math.prod(batch), *query.shape[-3:]))
    k = key.reshape((math.prod(key.shape[:-3]), *key.shape[-3:]))
    v = value.reshape((math.prod(value.shape[:-3]), *value.shape[-3:]))
    bias, mask = (None if x is None else _fold_batch(jnp.asarray(x), len(batch))
                  for x in (bias, mask))
    out = flash_attention(q, k, v, bias, mask, causal=causal, scale=scale,
                          bottom_right=bottom_right, window=window, softcap=softcap)
    return jnp.reshape(out, (*batch, *out.shape[1:]))


def _fold_batch(x, nbatch: int):
    """[batch..., heads|1, Sq, Sk] (batch dims possibly 1) -> [prod(batch)|1, heads|1, Sq, Sk]."""
    if x.ndim < nbatch + 3:
        return x  # lower rank: broadcast as jax.nn.dot_product_attention does
    lead = x.shape[:x.ndim - 3]
    folded = 1 if all(d == 1 for d in lead) else math.prod(lead)
    if folded != 1 and x.ndim - 3 != nbatch:
        raise ValueError(f"flashgen attention_fn: cannot fold bias/mask batch dims {lead}")
    return x.reshape((folded, *x.shape[-3:])) if folded != 1 or lead else x


def _causal_from_mask(mask: Any, sq: int, sk: int):
    """(causal, bottom_right) that a concrete mask stands for (all-true: (False, False)), or
    None when it is traced or anything else (then it goes to the kernel as an operand)."""
    try:
        m = np.asarray(mask)
    except Exception:  # noqa: BLE001 - a jax Tracer raises TracerArrayConversionError
        return None
    m = m.astype(bool)
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    candidates = {(True, False): j <= i, (True, True): j <= i + (sk - sq),
                  (False, False): np.ones((sq, sk), bool)}
    for kind, pattern in candidates.items():
        if np.array_equal(m, np.broadcast_to(pattern, m.shape)):
            return kind
    return None
