"""transformers models exported through torchax. Their mask builders make causal and
sliding-window masks from position ids gathered out of an iota and cumsum-based
packed-sequence checks (issue 14 gap 2): all must become causal/window attributes, with no
S x S operand left in the rewritten module.
"""

from .common import B, T, H, D, tname, torch_export
from .registry import golden


# Padding leaves query rows whose keys are all masked; with a finite fill the original gives
# the mean of V there (flashgen.rewrite.empty_rows). The numerics test feeds masks with such
# rows (flashgen.rewrite.verify.mask_rows), so these compare every row.
@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, extras=["segment_ids"])
def hf_gpt2_eager_left_padded():
    # transformers 5 GPT-2, eager attention, an attention_mask argument (left padding):
    # where(causal & padding, 0, finfo.min) added to the scores
    import torch
    from transformers import GPT2Config, GPT2Model
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_head=H, n_embd=H * D, vocab_size=64, n_positions=32,
                     bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    model = GPT2Model(cfg).eval()

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids, mask):
            return self.model(input_ids=ids, attention_mask=mask).last_hidden_state
    ids = torch.randint(0, 64, (B, T))
    mask = torch.ones(B, T, dtype=torch.int64)
    mask[0, :3] = 0
    return torch_export(M(), ids, mask)


def _hf_config(config_cls, **extra):
    import transformers
    return getattr(transformers, config_cls)(
        vocab_size=64, hidden_size=H * D // 2, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=H // 2, max_position_embeddings=64, **extra)


def _hf_export(config, model_cls, **inputs):
    """A small transformers model (eager attention, no attention_mask) via torchax, called
    with ``inputs`` (default: input_ids [1, T]); returns its last hidden state."""
    import torch
    import transformers
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(config).eval()
    inputs = inputs or {"input_ids": torch.randint(0, 4, (1, T))}
    names = list(inputs)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, *args):
            return self.m(**dict(zip(names, args)), use_cache=False).last_hidden_state
    return torch_export(M(), *inputs.values())


# a matmul that is not attention, correctly left alone: the rotary embedding (inv_freq x
# positions, then cos/sin)
_ROTARY = "depends on the scores"


@golden(rewritten=1, rejected=[_ROTARY], targets=[tname(32, "f32", True)], causal=True,
        window=[-1, -1], extras=[])
def hf_llama_causal():
    return _hf_export(_hf_config("LlamaConfig", num_key_value_heads=H // 2), "LlamaModel")


@golden(rewritten=1, rejected=[_ROTARY], targets=[tname(32, "f32", True)], causal=True,
        window=[3, -1], extras=[])
def hf_mistral_sliding_window():
    # sliding_window = 4: a query sees itself and the 3 keys before it
    return _hf_export(_hf_config("MistralConfig", num_key_value_heads=H // 2, sliding_window=4),
                      "MistralModel")


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, window=[-1, -1], extras=[])
def hf_gpt2_causal():
    import transformers
    return _hf_export(transformers.GPT2Config(vocab_size=64, n_embd=H * D // 2, n_layer=1,
                                              n_head=H // 2, n_positions=64, bos_token_id=0,
                                              eos_token_id=0), "GPT2Model")


@golden(rewritten=1, rejected=[_ROTARY], targets=[tname(32, "f32", True)], causal=True,
        window=[-1, -1], extras=[])
def hf_qwen2_causal():
    return _hf_export(_hf_config("Qwen2Config", num_key_value_heads=H // 2), "Qwen2Model")


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, window=[-1, -1], extras=[])
def hf_phi_causal():
    return _hf_export(_hf_config("PhiConfig"), "PhiModel")


@golden(rewritten=2, targets=[tname(32, "f32", True)], causal=True, softcap=50.0, extras=[])
def hf_gemma2_window_softcap():
    # two layers: the first with a sliding window of 4, the second global; logits softcapped
    config = _hf_config("Gemma2Config", num_key_value_heads=H // 2, head_dim=D,
                        sliding_window=4)
    config.num_hidden_layers = 2
    config.layer_types = ["sliding_attention", "full_attention"]
    return _hf_export(config, "Gemma2Model")


@golden(rewritten=3, rejected=["known only at run time"],
        targets=[tname(32, "f32", False), tname(32, "f32", True)], extras=[])
def hf_whisper():
    # encoder self-attention (no mask), decoder causal self-attention, cross-attention; the
    # two feed-forward matmuls (fc1, then GELU) are candidates correctly left alone
    import torch
    import transformers
    config = transformers.WhisperConfig(
        vocab_size=64, d_model=H * D // 2, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=H // 2, decoder_attention_heads=H // 2, encoder_ffn_dim=128,
        decoder_ffn_dim=128, num_mel_bins=8, max_source_positions=T, max_target_positions=64,
        pad_token_id=1, decoder_start_token_id=2, bos_token_id=2, eos_token_id=3)
    g = torch.Generator().manual_seed(0)
    return _hf_export(config, "WhisperModel",
                      input_features=torch.randn(1, 8, 2 * T, generator=g),
                      decoder_input_ids=torch.randint(0, 4, (1, T), generator=g))
