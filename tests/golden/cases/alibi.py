"""ALiBi spellings (a bias linear in the query-key distance, an extra operand of the call as
in README "Variants") and a near miss.
"""

import math

import numpy as np

from .common import B, D, T, H, jax_modules, qkv, softmax_attention, tname
from .registry import golden


def alibi_slopes(h):
    """The ALiBi paper's slopes for h heads (a power of two): 2^(-8/h), 2^(-16/h), ..."""
    return np.array([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], np.float32)


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, scale=1 / math.sqrt(32),
        extras=["alibi"])
def alibi_bloom():
    # BLOOM's spelling: slopes·j (equal to -slopes·(i - j) up to a per-row constant) + causal
    _, jnp, _ = jax_modules()
    slopes = alibi_slopes(H)

    def scores(q, k):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (1 / math.sqrt(32))
        s = s + slopes[None, :, None, None] * jnp.arange(T, dtype=jnp.float32)
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        return jnp.where(j <= i, s, jnp.finfo(jnp.float32).min)
    return softmax_attention(scores)


@golden(rewritten=1, targets=[tname(32, "f32", False)], causal=False, bottom_right=False,
        extras=["alibi"])
def alibi_symmetric():
    # -slope·|i - j| without a mask (encoder-style ALiBi)
    _, jnp, _ = jax_modules()
    slopes = alibi_slopes(H)

    def scores(q, k):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        dist = jnp.abs(jnp.arange(T)[:, None] - jnp.arange(T)[None, :]).astype(jnp.float32)
        return s - slopes[:, None, None] * dist
    return softmax_attention(scores)


@golden(rewritten=1, targets=[tname(32, "f32", False)], causal=False, bottom_right=True,
        extras=["alibi"])
def alibi_bottom_right():
    # 4 new queries against 8 keys, distances measured from the last key (offset Sk - Sq)
    _, jnp, _ = jax_modules()
    slopes = alibi_slopes(H)

    def scores(q, k):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        i, j = jnp.arange(4)[:, None] + (T - 4), jnp.arange(T)[None, :]
        return s + (-slopes)[:, None, None] * jnp.abs(i - j).astype(jnp.float32)
    return softmax_attention(scores, inputs=qkv(t=4, s=T))


@golden(rewritten=1, targets=[tname(32, "f32", False)], causal=False, extras=["bias"])
def alibi_like_sqrt():
    # near miss: -slope·sqrt|i - j| is no ALiBi (not linear in |i - j|): a constant bias
    _, jnp, _ = jax_modules()
    slopes = alibi_slopes(H)

    def scores(q, k):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        dist = jnp.abs(jnp.arange(T)[:, None] - jnp.arange(T)[None, :]).astype(jnp.float32)
        return s - slopes[:, None, None] * jnp.sqrt(dist)
    return softmax_attention(scores)


# ALiBi from a padded batch's positions (issue 23 item 3): slope_h · ((cumsum(mask) - 1) · mask)
# depends on the key only; it stays a [B, H, 1, T] bias (O(T)), causal is the attribute and
# the padding key-padding segment ids. The kernel's own ALiBi would be exact only for
# contiguous real tokens, and Falcon rounds slopes · positions to bf16.
def _hf_alibi_export(model_cls, config, dtype="float32", holes=False):
    import torch
    from .common import torch_export
    torch.manual_seed(0)
    model = model_cls(config).eval().to(getattr(torch, dtype))

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, ids, mask):
            return self.m(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    ids = torch.randint(0, 64, (B, T))
    mask = torch.ones(B, T, dtype=torch.int64)
    mask[0, :3] = 0                      # left padding
    if holes:
        mask[1, 4:6] = 0                 # padding in the middle: positions are not j - const
    return torch_export(M(), ids, mask)


# Falcon computes its rotary table even with ALiBi (unused): with SDPA its matmul is a near miss
_ROTARY_NEAR_MISS = "scaled by a value known only at run time"


def _bloom(attn="eager", **kw):
    from transformers import BloomConfig, BloomModel
    cfg = BloomConfig(vocab_size=64, hidden_size=H * D, n_layer=1, n_head=H,
                      attn_implementation=attn)
    return _hf_alibi_export(BloomModel, cfg, **kw)


def _falcon(attn, **kw):
    from transformers import FalconConfig, FalconModel
    cfg = FalconConfig(vocab_size=64, hidden_size=H * D, num_hidden_layers=1,
                       num_attention_heads=H, alibi=True, new_decoder_architecture=False,
                       multi_query=False, parallel_attn=False, bias=True,
                       attn_implementation=attn)
    return _hf_alibi_export(FalconModel, cfg, **kw)


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True,
        extras=["bias", "segment_ids"])
def hf_bloom_alibi_left_padded():
    return _bloom()


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True,
        extras=["bias", "segment_ids"])
def hf_bloom_alibi_padding_holes():
    return _bloom(holes=True)


@golden(rewritten=1, targets=[tname(32, "bf16", True)], causal=True,
        extras=["bias", "segment_ids"])
def hf_bloom_alibi_left_padded_bf16():
    return _bloom(dtype="bfloat16")


@golden(rewritten=1, rejected=[_ROTARY_NEAR_MISS], targets=[tname(32, "f32", True)],
        causal=True, extras=["bias", "segment_ids"])
def hf_falcon_alibi_eager_left_padded():
    return _falcon("eager", holes=True)


@golden(rewritten=1, rejected=[_ROTARY_NEAR_MISS], targets=[tname(32, "f32", True)],
        causal=True, extras=["bias", "segment_ids"])
def hf_falcon_alibi_sdpa_left_padded():
    return _falcon("sdpa", holes=True)


@golden(rewritten=1, rejected=[_ROTARY_NEAR_MISS], targets=[tname(32, "bf16", True)],
        causal=True, extras=["bias", "segment_ids"])
def hf_falcon_alibi_sdpa_left_padded_bf16():
    return _falcon("sdpa", dtype="bfloat16")


def _keras_hub_alibi(backbone_cls, **kw):
    from .common import export_fn, spec
    from .keras_layers import _keras
    keras = _keras()
    import keras_hub
    keras.utils.set_random_seed(0)
    backbone = getattr(keras_hub.models, backbone_cls)(vocabulary_size=64, num_layers=1,
                                                       hidden_dim=H * D,
                                                       intermediate_dim=2 * H * D, **kw)
    return export_fn(lambda ids, pad: backbone({"token_ids": ids, "padding_mask": pad}),
                     spec((B, T), "int32"), spec((B, T), "bool"))


# keras_hub's Falcon builds its ALiBi from the padding mask's cumsum as transformers does; its
# unused rotary matmul is a near miss
@golden(rewritten=1, rejected=["depends on the scores"], targets=[tname(32, "f32", True)],
        causal=True, extras=["bias", "segment_ids"])
def keras_hub_falcon_alibi_padding():
    return _keras_hub_alibi("FalconBackbone", num_attention_heads=H)


# keras_hub's Bloom builds its ALiBi from an arange (not the mask): constant slopes
@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True,
        extras=["alibi", "segment_ids"])
def keras_hub_bloom_alibi_padding():
    return _keras_hub_alibi("BloomBackbone", num_heads=H, max_sequence_length=16)
