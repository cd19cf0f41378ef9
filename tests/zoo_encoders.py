r"""Tiny-model builders of the encoders family group (merged into ``zoo.BUILDERS``; see tests/zoo.py).

``BUILDERS``: registry key -> builder(head="cls" or "bare", seed=0, **config_overrides) returning a
float64 model with perturbed weights (norm gains, biases, embeddings).
Import zoo's helpers inside the builders (``from zoo import _finish``): zoo imports this module.

- ``deberta-v2``: DeBERTa-v3-like (relative attention with c2p and p2c terms, shared attention
  keys, log-bucketed positions, LayerNorm on the relative embeddings, no absolute positions).
- ``modernbert``: alternating global / sliding-window layers (window 4), GeGLU, biases everywhere,
  sdpa attention (exact in float64; the eager one takes its softmax in float32).
"""
from __future__ import annotations

from typing import Callable, Dict

import torch
import transformers as tf

VOCAB = 50  # decoder_models.VOCAB: the zoo's batches (decoder_batch) draw ids below it


def _perturb_encoder(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    r"""Weights std ~0.2, biases 0.3 N(0, 1), every norm gain 1 + 0.3 N(0, 1), embeddings N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            owner = name.rsplit(".", 1)[0].lower()
            if "embeddings" in owner and p.dim() == 2 and "rel_embeddings" not in owner:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif "norm" in owner and p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif p.dim() == 2:
                p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def deberta_config(**extra) -> tf.DebertaV2Config:
    kw = dict(vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=4,
              max_relative_positions=16, share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False,
              type_vocab_size=0, hidden_act="gelu", pooler_hidden_size=24, pooler_hidden_act="gelu", pad_token_id=0,
              num_labels=3, layer_norm_eps=1e-7)
    kw.update(extra)
    return tf.DebertaV2Config(**kw)


def build_deberta(head: str = "cls", seed: int = 0, **extra) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = deberta_config(**extra)
    cls = {"cls": tf.DebertaV2ForSequenceClassification, "bare": tf.DebertaV2Model}.get(head)
    if cls is None:
        raise NotImplementedError(f"no {head} builder for deberta-v2 (cls or bare)")
    return _perturb_encoder(cls(cfg).double().eval(), seed)


def modernbert_config(**extra) -> tf.ModernBertConfig:
    kw = dict(vocab_size=VOCAB, hidden_size=24, intermediate_size=20, num_hidden_layers=3, num_attention_heads=4,
              max_position_embeddings=64, layer_types=["full_attention", "sliding_attention", "full_attention"],
              local_attention=4, norm_bias=True, mlp_bias=True, attention_bias=True, classifier_bias=True,
              hidden_activation="gelu", classifier_activation="gelu", classifier_pooling="cls", pad_token_id=0,
              bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, num_labels=3, norm_eps=1e-5)
    kw.update(extra)
    return tf.ModernBertConfig(**kw)


def build_modernbert(head: str = "cls", seed: int = 0, **extra) -> torch.nn.Module:
    torch.manual_seed(seed)
    attn = extra.pop("attn_implementation", "sdpa")
    cfg = modernbert_config(**extra)
    cfg._attn_implementation = attn
    cls = {"cls": tf.ModernBertForSequenceClassification, "bare": tf.ModernBertModel}.get(head)
    if cls is None:
        raise NotImplementedError(f"no {head} builder for modernbert (cls or bare)")
    return _perturb_encoder(cls(cfg).double().eval(), seed)


BUILDERS: Dict[str, Callable[..., torch.nn.Module]] = {
    "deberta-v2": build_deberta,
    "modernbert": build_modernbert,
}
