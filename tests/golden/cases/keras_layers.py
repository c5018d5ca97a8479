"""keras 3 and keras_hub layers (KERAS_BACKEND=jax): dropout at inference and in training,
padding masks merged with causal masks (keras' integer minimum).
"""

import numpy as np

from .common import B, T, H, D, export_fn, spec, tname
from .registry import golden


def _keras():
    import os
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras
    if keras.backend.backend() != "jax":
        raise RuntimeError("the keras goldens need KERAS_BACKEND=jax")
    return keras


def keras_export(layer_call, weights, *arg_specs):
    """Export a keras layer call with its weights as arguments (StatelessScope)."""
    keras = _keras()

    def f(ws, *args):
        with keras.StatelessScope(state_mapping=list(zip(weights, ws))):
            return layer_call(*args)
    return export_fn(f, [spec(w.shape, w.dtype) for w in weights], *arg_specs)


def _mha_dropout(training):
    """keras 3 MultiHeadAttention(dropout > 0) self-attention with a [B, T, T] mask, called
    with ``training``."""
    keras = _keras()
    layer = keras.layers.MultiHeadAttention(num_heads=H, key_dim=D, dropout=0.1, seed=0)
    layer(np.ones((B, T, H * D), np.float32), np.ones((B, T, H * D), np.float32),
          attention_mask=np.ones((B, T, T), bool))
    return keras_export(lambda x, m: layer(x, x, attention_mask=m, training=training),
                        layer.weights, spec((B, T, H * D)), spec((B, T, T), "bool"))


@golden(rewritten=1, targets=[tname(32, "f32", False)], extras=["mask"])
def keras_mha_dropout_inference():
    # at inference the masked Softmax applies the mask again after the softmax
    # (where(mask, probs, 0)); rows without a visible key are 0 in both
    return _mha_dropout(training=False)


@golden(rejected=["dropout"])
def neg_keras_mha_dropout_training():
    # the same layer in training: the probabilities meet a random dropout mask
    return _mha_dropout(training=True)


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, window=[-1, -1],
        extras=["segment_ids"])
def keras_hub_gpt2_padding():
    # keras_hub GPT2Backbone(dropout > 0) with a padding mask: causal AND padding merged as
    # minimum(int(padding), int(causal)) > 0, applied again after the softmax: causal
    # attribute + O(S) key padding
    _keras()
    import keras_hub
    model = keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=1, num_heads=H,
                                          hidden_dim=H * D, intermediate_dim=2 * H * D,
                                          max_sequence_length=16, dropout=0.1)
    return keras_export(
        lambda ids, pad: model({"token_ids": ids, "padding_mask": pad}, training=False),
        model.weights, spec((B, T), "int32"), spec((B, T), "bool"))


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, kv_heads=1, window=[-1, -1],
        extras=["segment_ids"])
def keras_hub_gemma_mqa_padding():
    # keras_hub GemmaBackbone (one kv head) with a padding mask: the 5-D einsum
    # btkgh,bskh->bkgts, the masked Softmax applying its mask (minimum(int(padding),
    # int(causal)) > 0) again after the softmax: causal attribute + O(S) key padding
    _keras()
    import keras_hub
    model = keras_hub.models.GemmaBackbone(vocabulary_size=64, num_layers=1, num_query_heads=H,
                                           num_key_value_heads=1, hidden_dim=H * D,
                                           intermediate_dim=2 * H * D, head_dim=D)
    return keras_export(
        lambda ids, pad: model({"token_ids": ids, "padding_mask": pad}, training=False),
        model.weights, spec((B, T), "int32"), spec((B, T), "bool"))


# a matmul that is not attention, correctly left alone: keras_hub's feed-forward gate
_FFN_GATE = "known only at run time"


def _keras_hub_llama(padding_dtype):
    keras = _keras()
    import keras_hub
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=64, num_layers=1, num_query_heads=H // 2, num_key_value_heads=H // 2,
        hidden_dim=H * D // 2, intermediate_dim=128, max_sequence_length=64)
    return export_fn(lambda ids, pad: backbone({"token_ids": ids, "padding_mask": pad}),
                     spec((B, T), "int32"), spec((B, T), padding_dtype))


@golden(rewritten=1, rejected=[_FFN_GATE], targets=[tname(32, "f32", True)], causal=True,
        window=[-1, -1], extras=["segment_ids"])
def keras_hub_llama_padding():
    # causal and a boolean padding mask merged as minimum(int(padding), int(causal)) != 0:
    # causal attribute + O(S) key padding
    return _keras_hub_llama("bool")


@golden(rewritten=1, rejected=[_FFN_GATE], targets=[tname(32, "f32", False)], causal=False,
        extras=["mask"])
def keras_hub_llama_int_padding():
    # the same with an int32 padding mask: minimum(p, causal) != 0 is no conjunction when p
    # may be negative (a negative entry shows masked keys), so the merged mask stays an operand
    return _keras_hub_llama("int32")


def _mha_two_axes(masked):
    """keras 3 MultiHeadAttention(attention_axes=(1, 2)) self-attention over a [B, 4, 3] grid:
    keras' Softmax over the two key axes, spelled exp(x - logsumexp(x))."""
    keras = _keras()
    layer = keras.layers.MultiHeadAttention(num_heads=H, key_dim=D, attention_axes=(1, 2))
    x = np.ones((B, 4, 3, H * D), np.float32)
    if not masked:
        layer(x, x)
        return keras_export(lambda q: layer(q, q), layer.weights, spec(x.shape))
    layer(x, x, attention_mask=np.ones((B, 4, 3, 4, 3), bool))
    return keras_export(lambda q, m: layer(q, q, attention_mask=m), layer.weights, spec(x.shape),
                        spec((B, 4, 3, 4, 3), "bool"))


@golden(rewritten=1, targets=[tname(32, "f32", False)], layout=None)
def keras_mha_attention_axes_2d():
    # the query axes and the key axes each flattened into one (12 = 4 x 3)
    return _mha_two_axes(masked=False)


@golden(rewritten=1, targets=[tname(32, "f32", False)], extras=["mask"])
def keras_mha_attention_axes_2d_masked():
    # a [B, 4, 3, 4, 3] mask flattened like the scores into a [B, 1, 12, 12] mask operand;
    # the numerics feed masks with rows that see no key (keras' finite fill: a uniform row)
    return _mha_two_axes(masked=True)
