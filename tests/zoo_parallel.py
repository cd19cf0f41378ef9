r"""Tiny-model builders of the parallel family group (merged into ``zoo.BUILDERS``; see tests/zoo.py).

``BUILDERS``: registry key -> builder(head="lm", "cls" or "bare", seed=0, **config_overrides) returning a
float64 model with perturbed weights (norm gains, biases), exact in float64:

- ``phi``: GQA 4/2, partial rotary (half of each head), per-head q/k LayerNorms, an LM head with a bias;
- ``gptj``: rotary on 4 of 8 channels per head, an LM head with a bias;
- ``falcon``: the new decoder architecture (QKV grouped per key/value head, GQA 4/2, two norms), with biases;
  the other variants through config overrides (``new_decoder_architecture=False, multi_query=...,
  parallel_attn=...``, ``num_ln_in_parallel_attn=1``, ``alibi=True``);
- ``cohere``: GQA 4/2, q/k LayerNorms, ``logit_scale`` 0.3, tied embeddings; its ``CohereLayerNorm``
  computes in float32 even in a float64 model, so the zoo replaces it by :class:`ExactCohereLayerNorm`
  (the same formula in the input's dtype) so that completeness can be tested to 1e-10.

Import zoo's helpers inside the builders (``from zoo import _finish``): zoo imports this module.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch


class ExactCohereLayerNorm(torch.nn.Module):
    r"""Cohere's LayerNorm without bias, ``w * (x - mean) / sqrt(var + eps)``, in the input's dtype."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().clone())
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        return self.weight * ((x - mean) * torch.rsqrt(var + self.variance_epsilon))


def exact_cohere_norms(model: torch.nn.Module) -> torch.nn.Module:
    r"""Replace every ``CohereLayerNorm`` (the q/k norms too) by :class:`ExactCohereLayerNorm`."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ == "CohereLayerNorm":
                setattr(parent, name, ExactCohereLayerNorm(child.weight, child.variance_epsilon))
    return model


def _classes(key: str):
    import transformers as tf  # noqa: PLC0415

    return {  # config, bare, causal LM, sequence classifier
        "phi": (tf.PhiConfig, tf.PhiModel, tf.PhiForCausalLM, tf.PhiForSequenceClassification),
        "gptj": (tf.GPTJConfig, tf.GPTJModel, tf.GPTJForCausalLM, tf.GPTJForSequenceClassification),
        "falcon": (tf.FalconConfig, tf.FalconModel, tf.FalconForCausalLM, tf.FalconForSequenceClassification),
        "cohere": (tf.CohereConfig, tf.CohereModel, tf.CohereForCausalLM, None),  # no classifier in transformers
    }[key]


def _config(key: str, **extra):
    from decoder_models import VOCAB  # noqa: PLC0415

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if key == "phi":
        kw = dict(common, intermediate_size=40, num_key_value_heads=2, qk_layernorm=True, hidden_act="gelu_new",
                  tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                  partial_rotary_factor=0.5))
    elif key == "gptj":
        kw = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_inner=40, n_positions=64, rotary_dim=4,
                  activation_function="gelu_new", tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    elif key == "falcon":
        kw = dict(common, ffn_hidden_size=40, num_kv_heads=2, new_decoder_architecture=True, bias=True,
                  activation="gelu", tie_word_embeddings=True)
    elif key == "cohere":
        kw = dict(common, intermediate_size=40, num_key_value_heads=2, use_qk_norm=True, logit_scale=0.3,
                  tie_word_embeddings=True, hidden_act="silu", attention_bias=False)
    else:
        raise KeyError(key)
    kw.update(extra)
    return _classes(key)[0](**kw)


def build_parallel(key: str, head: str = "lm", seed: int = 0, attn: str = "sdpa", **extra) -> torch.nn.Module:
    r"""A tiny float64 model of the parallel family ``key`` (see the module docstring)."""
    from zoo import _finish  # noqa: PLC0415

    torch.manual_seed(seed)
    cfg = _config(key, **extra)
    cfg._attn_implementation = attn
    if head == "cls":
        cfg.num_labels = 3
    _, bare, lm, cls = _classes(key)
    model_cls = {"bare": bare, "lm": lm, "cls": cls}[head]
    if model_cls is None:
        raise NotImplementedError(f"transformers has no {head} model of {key}")
    model = _finish(model_cls(cfg), seed)
    g = torch.Generator().manual_seed(seed + 101)
    with torch.no_grad():  # _perturb scales 2-D weights: give every norm gain (Cohere's (H, Dh) q/k gains too) 1 + noise
        for name, p in model.named_parameters():
            if any(k in name for k in ("layernorm", "norm.", "ln_")) and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    if key == "cohere":
        exact_cohere_norms(model)
    return model


BUILDERS: Dict[str, Callable[..., torch.nn.Module]] = {
    k: (lambda k: lambda head="lm", seed=0, **extra: build_parallel(k, head, seed, **extra))(k)
    for k in ("phi", "gptj", "falcon", "cohere")
}
