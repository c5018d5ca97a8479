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


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def torch_sdpa_causal():
    import torch
    import torch.nn.functional as F

    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return torch_export(M(), *_torch_qkv())


@golden(rewritten=1, targets=[tname(32, "f32", False)], scale=0.3)
def torch_sdpa_scale():
    import torch
    import torch.nn.functional as F

    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, scale=0.3)
    return torch_export(M(), *_torch_qkv())


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, kv_heads=2)
def torch_sdpa_gqa():
    import torch
    import torch.nn.functional as F

    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return torch_export(M(), *_torch_qkv(hkv=2))


@golden(rewritten=1, targets=[tname(32, "bf16", False)])
def torch_sdpa_bf16():
    import torch
    import torch.nn.functional as F

    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)
    return torch_export(M(), *_torch_qkv(torch.bfloat16))


@golden(rewritten=1, targets=[tname(32, "f32", False)])
def torch_mha():
    import torch
    torch.manual_seed(0)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = torch.nn.MultiheadAttention(H * D, H, batch_first=True)

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]
    return torch_export(M().eval(), torch.randn(B, T, H * D))


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True)
def torch_mha_causal():
    import torch
    torch.manual_seed(0)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = torch.nn.MultiheadAttention(H * D, H, batch_first=True)

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False, is_causal=True,
                            attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(T))[0]
    return torch_export(M().eval(), torch.randn(B, T, H * D))


@golden(rejected=["probabilities"])
def neg_torch_mha_weights():
    import torch
    torch.manual_seed(0)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = torch.nn.MultiheadAttention(H * D, H, batch_first=True)

        def forward(self, x):
            return self.mha(x, x, x, need_weights=True)
    return torch_export(M().eval(), torch.randn(B, T, H * D))


@golden(rewritten=1, targets=[tname(32, "f32", False)], extras=["mask"])
def torch_sdpa_bool_mask():
    # SDPA turns a bool attn_mask into a 0 / -inf bias: read back as a mask
    import torch
    import torch.nn.functional as F

    class M(torch.nn.Module):
        def forward(self, q, k, v, m):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    m = torch.ones(B, 1, T, T, dtype=torch.bool)
    return torch_export(M(), *_torch_qkv(), m)


@golden(rewritten=1, targets=[tname(32, "f32", False)], extras=["bias"])
def torch_sdpa_float_mask():
    import torch
    import torch.nn.functional as F

    class M(torch.nn.Module):
        def forward(self, q, k, v, m):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    return torch_export(M(), *_torch_qkv(), torch.zeros(B, 1, 1, T))


@golden(rewritten=1, targets=[tname(32, "f32", False)], extras=["mask"])
def torch_mha_key_padding():
    import torch
    torch.manual_seed(0)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = torch.nn.MultiheadAttention(H * D, H, batch_first=True)

        def forward(self, x, pad):
            return self.mha(x, x, x, key_padding_mask=pad, need_weights=False)[0]
    return torch_export(M().eval(), torch.randn(B, T, H * D), torch.zeros(B, T, dtype=torch.bool))
