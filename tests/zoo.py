r"""One tiny-model zoo built from the architecture registry: a float64 builder per registered text family.

``build(key, head)`` returns a tiny random model of the family registered under ``key``
(``captum_normattr.arch.ARCHITECTURES``) with perturbed weights (norm gains, biases), in
float64, with its norms made exact in float64 where the family's own norm computes in
float32 (so that completeness can be tested to 1e-10). ``head``: ``"lm"`` (decoders, a
``*ForCausalLM``), ``"cls"`` (a ``*ForSequenceClassification``) or ``"bare"`` (``*Model``).
Every registered text family must have a builder here (``tests/test_zoo.py`` checks it),
so that a new family gets every invariant test.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch
import transformers as tf
from transformers import masking_utils
from conftest import make_model
from decoder_models import VOCAB, _exact_rms_norms, _perturb, make_decoder


class ExactOffsetRMSNorm(torch.nn.Module):
    r"""``x / rms(x) * (offset + w)`` computed in the input's dtype (Gemma's norm computes in float32)."""

    def __init__(self, weight: torch.Tensor, eps: float, offset: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().clone())
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (self.offset + self.weight)


def exact_offset_norms(model: torch.nn.Module, offset: float = 1.0) -> torch.nn.Module:
    r"""Replace every ``*RMSNorm`` module (Gemma's ``1 + w`` kind) by :class:`ExactOffsetRMSNorm`."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RMSNorm") and not isinstance(child, ExactOffsetRMSNorm):
                with torch.no_grad():
                    setattr(parent, name, ExactOffsetRMSNorm(child.weight, child.eps, offset))
    return model


def exact_eager_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    r"""transformers' eager attention (soft-capping included) with the softmax in the input's dtype.

    Gemma 2's eager code takes the softmax in float32 even for a float64 model, so its own
    logits carry float32 rounding (~1e-7); the zoo's models compute it in float64.
    """
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = torch.matmul(query, key.transpose(2, 3)) * (module.head_dim ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None and attention_mask.dtype == torch.bool:  # the sdpa-style mask (True: attend)
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    elif attention_mask is not None:
        scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


EXACT_ATTENTION = "zoo_exact_eager"
tf.AttentionInterface.register(EXACT_ATTENTION, exact_eager_attention)
tf.AttentionMaskInterface.register(EXACT_ATTENTION, masking_utils.eager_mask)  # additive masks, as for "eager"


class ExactLayerNorm(torch.nn.Module):
    r"""OLMo's parameter-free LayerNorm (``eps = 1e-5``) computed in the input's dtype (OLMo's computes in float32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, x.shape[-1:], None, None, eps=1e-5)


def exact_olmo_norms(model: torch.nn.Module) -> torch.nn.Module:
    r"""Replace every ``OlmoLayerNorm`` by :class:`ExactLayerNorm` (no parameters, no ``eps`` attribute, like OLMo's)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ == "OlmoLayerNorm":
                setattr(parent, name, ExactLayerNorm())
    return model


def _finish(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    model = model.double().eval()
    _perturb(model, seed)
    return model


_DECODER = dict(vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0)
_CLASSES = {  # model_type -> (config class, bare, causal LM, sequence classifier)
    "qwen3": (tf.Qwen3Config, tf.Qwen3Model, tf.Qwen3ForCausalLM, tf.Qwen3ForSequenceClassification),
    "gemma": (tf.GemmaConfig, tf.GemmaModel, tf.GemmaForCausalLM, tf.GemmaForSequenceClassification),
    "gemma2": (tf.Gemma2Config, tf.Gemma2Model, tf.Gemma2ForCausalLM, tf.Gemma2ForSequenceClassification),
    "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXModel, tf.GPTNeoXForCausalLM, tf.GPTNeoXForSequenceClassification),
    "smollm3": (tf.SmolLM3Config, tf.SmolLM3Model, tf.SmolLM3ForCausalLM, tf.SmolLM3ForSequenceClassification),
    "stablelm": (tf.StableLmConfig, tf.StableLmModel, tf.StableLmForCausalLM, tf.StableLmForSequenceClassification),
    "granite": (tf.GraniteConfig, tf.GraniteModel, tf.GraniteForCausalLM, None),  # no classifier in transformers
    "phi3": (tf.Phi3Config, tf.Phi3Model, tf.Phi3ForCausalLM, tf.Phi3ForSequenceClassification),
    "olmo": (tf.OlmoConfig, tf.OlmoModel, tf.OlmoForCausalLM, tf.OlmoForSequenceClassification),
}
#: the RMSNorm families whose norms compute in float32 (made exact in float64 by _exact_rms_norms)
_FLOAT32_RMS = ("qwen3", "smollm3", "granite", "phi3")


def _config(key: str, **extra):
    cfg_cls = _CLASSES[key][0]
    kw = dict(_DECODER)
    if key == "qwen3":
        kw.update(num_key_value_heads=2, head_dim=6, rms_norm_eps=1e-6, use_sliding_window=False)
    elif key == "gemma":
        kw.update(num_key_value_heads=2, head_dim=6, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh")
    elif key == "gemma2":
        kw.update(num_key_value_heads=2, head_dim=6, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                  attn_logit_softcapping=5.0, final_logit_softcapping=30.0, sliding_window=4, query_pre_attn_scalar=8)
    elif key == "gpt_neox":
        kw = dict(vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, rotary_pct=0.5, use_parallel_residual=True, tie_word_embeddings=False,
                  hidden_act="gelu", pad_token_id=0, attention_bias=True)
    elif key == "smollm3":  # layer 1 without rotary positions
        kw.update(num_key_value_heads=2, rms_norm_eps=1e-6, no_rope_layers=[1, 0], use_sliding_window=False)
    elif key == "stablelm":  # LayerNorm with biases, partial rotary, per-head q/k LayerNorms, qkv biases
        kw.update(num_key_value_heads=2, layer_norm_eps=1e-5, qk_layernorm=True, use_qkv_bias=True,
                  use_parallel_residual=False, hidden_size=32,  # head size 8: rotary on 4 of 8 channels
                  rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))
    elif key == "granite":  # every multiplier away from 1
        kw.update(num_key_value_heads=2, rms_norm_eps=1e-6, embedding_multiplier=3.0, attention_multiplier=0.3,
                  residual_multiplier=0.4, logits_scaling=4.0, attention_bias=True)
    elif key == "phi3":  # GQA 4/2 in the fused qkv_proj, fused gate_up_proj, partial rotary
        kw.update(num_key_value_heads=2, rms_norm_eps=1e-6, hidden_act="silu", hidden_size=32,
                  rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))
    elif key == "olmo":
        kw.update(num_key_value_heads=2, attention_bias=False)
    kw.update(extra)
    return cfg_cls(**kw)


def _build_new(key: str, head: str, seed: int = 0, **extra) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = _config(key, **extra)
    cfg._attn_implementation = "sdpa" if key != "gemma2" else EXACT_ATTENTION  # sdpa has no soft-capping
    if head == "cls":
        cfg.num_labels = 3
    _, bare, lm, cls = _CLASSES[key]
    if {"bare": bare, "lm": lm, "cls": cls}[head] is None:
        raise NotImplementedError(f"transformers has no {head} model of {key}")
    model = _finish({"bare": bare, "lm": lm, "cls": cls}[head](cfg), seed)
    if key in ("gemma", "gemma2"):
        exact_offset_norms(model)
    elif key in _FLOAT32_RMS:
        _exact_rms_norms(model)
    elif key == "olmo":
        exact_olmo_norms(model)
    return model


def _existing_decoder(key: str) -> Callable[..., torch.nn.Module]:
    def build(head: str = "lm", seed: int = 0) -> torch.nn.Module:
        if head == "cls":
            raise NotImplementedError(f"no classifier builder for {key}")
        return make_decoder(key, seed=seed, lm_head=head == "lm")

    return build


def _existing_encoder(key: str) -> Callable[..., torch.nn.Module]:
    def build(head: str = "cls", seed: int = 0) -> torch.nn.Module:
        if head != "cls":
            raise NotImplementedError(f"only the classifier builder for {key}")
        return make_model(key, seed=seed)

    return build


#: registry key -> builder(head, seed)
BUILDERS: Dict[str, Callable[..., torch.nn.Module]] = {
    **{k: _existing_encoder(k) for k in ("bert", "roberta", "electra", "distilbert")},
    **{k: _existing_decoder(k) for k in ("gpt2", "llama", "mistral", "qwen2")},
    **{k: (lambda k: lambda head="lm", seed=0, **extra: _build_new(k, head, seed, **extra))(k) for k in _CLASSES},
}


import zoo_decoders, zoo_encoders, zoo_moe, zoo_parallel  # noqa: E402  (the family groups' builders)

for _group in (zoo_parallel, zoo_moe, zoo_decoders, zoo_encoders):
    BUILDERS.update(_group.BUILDERS)


def build(key: str, head: str = "lm", seed: int = 0, **extra) -> torch.nn.Module:
    r"""A tiny float64 model of the family registered under ``key`` (see the module docstring)."""
    return BUILDERS[key](head, seed, **extra) if extra else BUILDERS[key](head, seed)
