"""torch modules exported through torch.export and torchax: scaled_dot_product_attention and
nn.MultiheadAttention, with their masks.
"""

from .common import B, T, H, D, tname, torch_export
from .registry import golden


def _torch_qkv(dtype=None, hkv=H, d=D, t=T):
    import torch
    g = torch.Generator().manual_seed(0)
    dtype = dtype or torch.float32
    return (torch.randn(B, H, t, d, generator=g, dtype=dtype),
            torch.randn(B, hkv, t, d, generator=g, dtype=dtype),
            torch.randn(B, hkv, t, d, generator=g, dtype=dtype))


def _sdpa(*inputs, **options):
    """F.scaled_dot_product_attention(q, k, v[, attn_mask], **options) as a module, exported
    for ``inputs``."""
    import torch
    import torch.nn.functional as F

    class M(torch.nn.Module):
        def forward(self, q, k, v, *mask):
            return F.scaled_dot_product_attention(q, k, v, *mask, **options)
    return torch_export(M(), *inputs)


def _mha(call, *extra):
    """nn.MultiheadAttention(H·D, H, batch_first) with seeded weights, called as
    ``call(mha, x, *extra)``, exported for a random x [B, T, H·D] and ``extra``."""
    import torch
    torch.manual_seed(0)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = torch.nn.MultiheadAttention(H * D, H, batch_first=True)

        def forward(self, x, *e):
            return call(self.mha, x, *e)
    return torch_export(M().eval(), torch.randn(B, T, H * D), *extra)


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def torch_sdpa_causal():
    return _sdpa(*_torch_qkv(), is_causal=True)


@golden(rewritten=1, targets=[tname(32, "f32", False)], scale=0.3)
def torch_sdpa_scale():
    return _sdpa(*_torch_qkv(), scale=0.3)


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, kv_heads=2)
def torch_sdpa_gqa():
    return _sdpa(*_torch_qkv(hkv=2), is_causal=True, enable_gqa=True)


@golden(rewritten=1, targets=[tname(32, "bf16", False)])
def torch_sdpa_bf16():
    import torch
    return _sdpa(*_torch_qkv(torch.bfloat16))


@golden(rewritten=1, targets=[tname(32, "f32", False)])
def torch_mha():
    return _mha(lambda mha, x: mha(x, x, x, need_weights=False)[0])


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def torch_mha_causal():
    import torch
    return _mha(lambda mha, x: mha(
        x, x, x, need_weights=False, is_causal=True,
        attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(T))[0])


@golden(rejected=["probabilities"])
def neg_torch_mha_weights():
    return _mha(lambda mha, x: mha(x, x, x, need_weights=True))


@golden(rewritten=1, targets=[tname(32, "f32", False)], extras=["mask"])
def torch_sdpa_bool_mask():
    # SDPA turns a bool attn_mask into a 0 / -inf bias: read back as a mask
    import torch
    return _sdpa(*_torch_qkv(), torch.ones(B, 1, T, T, dtype=torch.bool))


@golden(rewritten=1, targets=[tname(32, "f32", False)], extras=["bias"])
def torch_sdpa_float_mask():
    import torch
    return _sdpa(*_torch_qkv(), torch.zeros(B, 1, 1, T))


@golden(rewritten=1, targets=[tname(32, "f32", False)], extras=["mask"])
def torch_mha_key_padding():
    import torch
    return _mha(lambda mha, x, pad: mha(x, x, x, key_padding_mask=pad, need_weights=False)[0],
                torch.zeros(B, T, dtype=torch.bool))
