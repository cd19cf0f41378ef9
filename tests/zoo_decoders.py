r"""Tiny-model builders of the decoders family group (merged into ``zoo.BUILDERS``; see tests/zoo.py).

``BUILDERS``: registry key -> builder(head="lm", "cls" or "bare", seed=0, **config_overrides) returning a
float64 model with perturbed weights: OLMo 2, Gemma 3 (text), BLOOM, OPT. Norms that compute in
float32 even in a float64 model (OLMo 2's and Gemma 3's RMSNorms, q/k norms included) are replaced by
exact float64 ones, so that completeness is tested to 1e-10 relative.
Import zoo's helpers inside the builders (``from zoo import _finish``): zoo imports this module.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch
import transformers as tf

class _Float64Softmax:
    r"""``torch.nn.functional`` for BLOOM's modeling module, with the softmax kept in float64 for float64 inputs.

    BloomAttention computes ``F.softmax(scores, dtype=torch.float32)`` itself (not through the attention
    interface): in a float64 model the additive mask's float64 minimum overflows to -inf in float32, so a
    fully masked pad row (left padding) becomes NaN and spreads to the real tokens through the pads' values
    (probability 0 times NaN). The zoo's float64 BLOOM takes that softmax in float64 (as the zoo's other
    families take their norms): the module still computes its own probabilities, ALiBi included.
    Float32 inputs are untouched.
    """

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    @staticmethod
    def softmax(x, dim=None, dtype=None, **kwargs):
        if x.dtype == torch.float64:
            dtype = None
        return torch.nn.functional.softmax(x, dim=dim, dtype=dtype, **kwargs)


def _float64_bloom_softmax() -> None:
    from transformers.models.bloom import modeling_bloom

    if not isinstance(modeling_bloom.F, _Float64Softmax):
        modeling_bloom.F = _Float64Softmax()


_COMMON = dict(vocab_size=50, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0)
#: key -> (config class, bare, causal LM, sequence classifier, config)
_FAMILIES = {
    "olmo2": (tf.Olmo2Config, tf.Olmo2Model, tf.Olmo2ForCausalLM, tf.Olmo2ForSequenceClassification,
              dict(_COMMON, num_key_value_heads=2, rms_norm_eps=1e-6, attention_bias=False, bos_token_id=1, eos_token_id=2)),
    # layer 0 sliding (window 3), layer 1 global; head_dim 6 != hidden / heads; GQA 4/2
    "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3TextModel, tf.Gemma3ForCausalLM, tf.Gemma3TextForSequenceClassification,
                    dict(_COMMON, num_key_value_heads=2, head_dim=6, rms_norm_eps=1e-6, sliding_window=3,
                         layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=8,
                         hidden_activation="gelu_pytorch_tanh")),
    # 4 heads of 6; apply_residual_connection_post_layernorm=False (the default; True is refused)
    "bloom": (tf.BloomConfig, tf.BloomModel, tf.BloomForCausalLM, tf.BloomForSequenceClassification,
              dict(vocab_size=50, hidden_size=24, n_layer=2, n_head=4, tie_word_embeddings=True, pad_token_id=0,
                   layer_norm_epsilon=1e-5)),
    # pre-LN (do_layer_norm_before=True, the 125m..); ReLU FF, biases everywhere
    "opt": (tf.OPTConfig, tf.OPTModel, tf.OPTForCausalLM, tf.OPTForSequenceClassification,
            dict(vocab_size=50, hidden_size=24, ffn_dim=40, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=64, word_embed_proj_dim=24, do_layer_norm_before=True, enable_bias=True,
                 activation_function="relu", pad_token_id=0, tie_word_embeddings=True)),
}


def _build(key: str, head: str = "lm", seed: int = 0, **extra) -> torch.nn.Module:
    from zoo import _finish, exact_offset_norms
    from decoder_models import _exact_rms_norms

    cfg_cls, bare, lm, cls, kw = _FAMILIES[key]
    if key == "bloom":
        _float64_bloom_softmax()
    torch.manual_seed(seed)
    cfg = cfg_cls(**{**kw, **extra})
    cfg._attn_implementation = "eager" if key == "bloom" else "sdpa"  # BLOOM computes its own attention
    if head == "cls":
        cfg.num_labels = 3
    model = _finish({"bare": bare, "lm": lm, "cls": cls}[head](cfg), seed)
    if key == "gemma3_text":
        exact_offset_norms(model)  # x_hat * (1 + w), also the q/k norms
    elif key == "olmo2":
        _exact_rms_norms(model)  # the branch-output norms, the final norm and the q/k norms over whole projections
    return model


BUILDERS: Dict[str, Callable[..., torch.nn.Module]] = {
    k: (lambda k: lambda head="lm", seed=0, **extra: _build(k, head, seed, **extra))(k) for k in _FAMILIES
}
