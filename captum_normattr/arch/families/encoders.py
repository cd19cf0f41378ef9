r"""Family descriptions of the encoders group (see :mod:`captum_normattr.arch.families.base` for the format).

- DeBERTa-v2 / DeBERTa-v3 (``deberta-v2``): post-LN layers like BERT's; the disentangled
  relative-position attention (content-to-position and position-to-content terms) is
  computed inside its own ``DisentangledSelfAttention``, which returns its probabilities when
  called with ``output_attentions=True``: they are recorded from there
  (``probabilities="module_output"``), never re-implemented. The classification head is
  DeBERTa's ``ContextPooler`` (dense and the ``pooler_hidden_act`` activation on the first
  token) and a linear classifier. The optional convolution after the first layer
  (``conv_kernel_size > 0``) is refused.
- ModernBERT (``modernbert``): pre-LN layers (the first layer's attention norm is an
  ``Identity``, read as the identity norm), a fused [q | k | v] projection, a GeGLU FF with
  one fused [input | gate] projection (``act(input) * gate``), rotary positions and
  alternating global / sliding-window layers (the window is in the attention mask, the
  probabilities are recorded), a final norm, then a head ``LayerNorm(act(dense(.)))`` and a
  linear classifier on the first token's (``classifier_pooling="cls"``) or the mean of the
  real tokens' final-norm outputs (``"mean"``); both are explained.

``BUILTIN`` lists them by registry key; :mod:`captum_normattr.arch.registry` registers them after
the text families of :mod:`captum_normattr.arch.families.base` and before the vision ones.
"""
from __future__ import annotations

from typing import Tuple

from captum_normattr.arch.spec import (
    ArchitectureSpec,
    Attention,
    ClassifierHead,
    FeedForward,
    Head,
    Layer,
    Norm,
    ValueProjection,
)

__all__ = ["BUILTIN", "DEBERTA_V2", "MODERNBERT"]

DEBERTA_V2 = ArchitectureSpec(
    family="DeBERTa-v2", model_types=("deberta-v2",), layers="encoder.layer",
    layer=Layer(
        attention=Attention("attention.self", out="attention.output.dense",
                            value=ValueProjection("attention.self.value_proj"), probabilities="module_output"),
        ff=FeedForward(up="intermediate.dense", act="intermediate.intermediate_act_fn", down="output.dense"),
        stream_norms=(Norm("attention.output.LayerNorm"), Norm("output.LayerNorm")),
    ),
    head=Head(classifier=ClassifierHead(dense="pooler.dense", activation_config="pooler_hidden_act",
                                        classifier="classifier")),
    refused_configs=(("conv_kernel_size", ..., "the convolution DeBERTa-v2 adds to the first layer's output "
                      "(ConvLayer: conv(x) masked, tanh, LayerNorm with the layer output) mixes neighbouring tokens "
                      "outside the attention, which none of the decompositions follows"),),
    notes="DeBERTa-v3; disentangled relative-position attention recorded from its module; conv layer refused",
)

MODERNBERT = ArchitectureSpec(
    family="ModernBERT", model_types=("modernbert",), layers="layers",
    layer=Layer(
        attention=Attention("attn", out="attn.Wo", value=ValueProjection("attn.Wqkv", "fused", 2, 3),
                            pre_norm=Norm("attn_norm")),
        ff=FeedForward(up="mlp.Wi", act="mlp.act", down="mlp.Wo", kind="fused_gate_up", gate_first=True,
                       pre_norm=Norm("mlp_norm")),
    ),
    head=Head(final_norm=Norm("final_norm"),
              classifier=ClassifierHead(dense="head.dense", activation="head.act", norm=Norm("head.norm"),
                                        classifier="classifier", pooling_config="classifier_pooling")),
    notes="first attention norm is an Identity; global and sliding-window layers (mask); rotary positions; "
          "head on the first token or the mean (classifier_pooling)",
)

BUILTIN: Tuple[Tuple[str, ArchitectureSpec], ...] = (("deberta-v2", DEBERTA_V2), ("modernbert", MODERNBERT))
