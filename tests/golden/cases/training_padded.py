"""Padded fine-tuning steps: the gradient of a loss through library models called with a
key-padding mask, exported for CPU. transformers adds its mask to the scores as finfo.min (a
row without a visible key then gets a uniform softmax's gradient through the add:
flashgen.rewrite.empty_rows.emit_added_fill_grads); flax and equinox select a finite fill.
tests/test_rewrite_backward.py feeds integer masks with a fully padded sequence and a
left-padded one, and boolean masks with a fully padded and a right-padded one, and runs
--verify's own inputs on each case.
"""

import functools

from .common import export_fn, jax_modules, spec, torch_modules
from .registry import training_golden
from .train_model import B, T, H, D, target

E = H * D


def f32_and_bf16(name, build, sites, **expect):
    """Register ``build(dtype)`` as two training goldens, ``name`` (f32) and ``name``_bf16."""
    for dtype, suffix, kdt in (("float32", "", "f32"), ("bfloat16", "_bf16", "bf16")):
        case = functools.partial(build, dtype)
        case.__name__ = name + suffix
        training_golden(sites=sites, fwd=[target("fwd", dt=kdt)], bwd=[target("bwd", dt=kdt)],
                        **expect)(case)


def mean_square_grad(apply, params, *args, argnums=(0, 1)):
    """Export grad over ``argnums`` of mean(apply(params, *args)²), the square taken in f32;
    ``params`` and ``args``: arrays or specs (a pytree of them)."""
    jax, jnp, _ = jax_modules()

    def loss(p, *a):
        return jnp.mean(apply(p, *a).astype(jnp.float32) ** 2)
    return export_fn(jax.grad(loss, argnums=argnums),
                     jax.tree.map(lambda a: spec(a.shape, a.dtype), params), *args)


def hf_padded_step(config_cls, model_cls, dtype="float32", impl="eager", *, batch=B, seq=T,
                   hidden=E, heads=H, layers=2, **config):
    """grad over (parameters, inputs_embeds) of mean(h²) of a transformers model
    (``model_cls``) called with ``inputs_embeds`` [batch, seq, hidden] and an int
    attention_mask [batch, seq], traced by torchax (loss.backward() as torchax runs it:
    jax.grad of the traced model)."""
    torch, torchax = torch_modules()
    import transformers
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(
        vocab_size=64, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        max_position_embeddings=max(seq, 64), **config)
    cfg._attn_implementation = impl
    model = getattr(transformers, model_cls)(cfg)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x, mask):
            return self.m(inputs_embeds=x, attention_mask=mask, use_cache=False).last_hidden_state
    params, fn = torchax.extract_jax(Step())
    return mean_square_grad(lambda p, x, mask: fn(p, (x, mask)), params,
                            spec((batch, seq, hidden), dtype), spec((batch, seq), "int32"))


def _neox(dtype):
    return hf_padded_step("GPTNeoXConfig", "GPTNeoXModel", dtype, intermediate_size=128)


# GPT-NeoX's MLP: a product whose "scores" are multiplied (GELU), correctly left alone
_GELU = "the scores pass through stablehlo.multiply before any softmax"


f32_and_bf16("train_padded_hf_gpt_neox", _neox, sites=2, rejected=[_GELU])


@training_golden(sites=2, fwd=[target("fwd")], bwd=[target("bwd")])
def train_padded_hf_opt():
    return hf_padded_step("OPTConfig", "OPTModel", ffn_dim=128, word_embed_proj_dim=E)


def flax_padded_step(dtype="float32"):
    """grad over (parameters, x) of a flax linen causal self-attention layer with a boolean
    key-padding mask [B, T] (make_attention_mask & make_causal_mask: a select fill)."""
    jax, jnp, _ = jax_modules()
    import flax.linen as nn

    class M(nn.Module):
        @nn.compact
        def __call__(self, x, pad):
            mask = nn.combine_masks(nn.make_attention_mask(pad, pad), nn.make_causal_mask(pad))
            # no projection biases: Q's bias gets a gradient that is ~0 in exact arithmetic,
            # bf16 rounding noise in both programs that the harness cannot judge
            return nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=E, use_bias=False,
                                                   dtype=jnp.dtype(dtype))(x, mask=mask)
    m = M()
    params = m.init(jax.random.key(0), jnp.ones((B, T, E), dtype), jnp.ones((B, T), bool))
    return mean_square_grad(m.apply, params, spec((B, T, E), dtype), spec((B, T), "bool"))


f32_and_bf16("train_padded_flax", flax_padded_step, sites=1)


@training_golden(sites=1, fwd=[target("fwd", causal=False)], bwd=[target("bwd", causal=False)])
def train_padded_equinox():
    # equinox MultiheadAttention under jax.vmap with a key-padding mask [T, T] per example
    jax, jnp, _ = jax_modules()
    import equinox as eqx
    m = eqx.nn.MultiheadAttention(num_heads=H, query_size=E, key=jax.random.PRNGKey(0))
    params, static = eqx.partition(m, eqx.is_array)

    def apply(p, x, pad):
        mm = eqx.combine(p, static)
        return jax.vmap(lambda xx, pp: mm(xx, xx, xx, mask=jnp.broadcast_to(pp, (T, T))))(x, pad)
    return mean_square_grad(apply, params, spec((B, T, E)), spec((B, T), "bool"))


def keras_hub_padded_step(backbone_cls, dtype="float32", **config):
    """grad over the trainable weights of mean(h²) of a keras_hub backbone called with
    token ids and a boolean padding_mask [B, T] (keras' masked Softmax: causal AND padding,
    the probabilities masked again after it)."""
    from .keras_layers import _keras
    keras = _keras()
    import keras_hub
    keras.utils.set_random_seed(0)
    model = getattr(keras_hub.models, backbone_cls)(vocabulary_size=64, num_layers=2, dtype=dtype,
                                                    **config)
    weights = model.weights

    def apply(ws, ids, pad):
        with keras.StatelessScope(state_mapping=list(zip(weights, ws))):
            return model({"token_ids": ids, "padding_mask": pad}, training=False)
    return mean_square_grad(apply, weights, spec((B, T), "int32"), spec((B, T), "bool"),
                            argnums=0)


# the backward's dP = dO·Vᵀ masked again (where(mask, dP, 0)): a candidate seen before the
# cluster is replaced, left alone as no forward
_REMASKED_DP = "the mask fill value 0 is not a large negative number"


def _gpt2(dtype):
    return keras_hub_padded_step("GPT2Backbone", dtype, num_heads=H, hidden_dim=E,
                                 intermediate_dim=2 * E, max_sequence_length=T)


f32_and_bf16("train_padded_keras_hub_gpt2", _gpt2, sites=2, rejected=[_REMASKED_DP])
