r"""Family descriptions of the hybrid group: layers with different token mixers (see :mod:`captum_normattr.arch.spec`).

A hybrid model picks each layer's mixer from its config (:attr:`~captum_normattr.arch.spec.Layer.mixers`
and :attr:`~captum_normattr.arch.spec.Layer.mixer_types`); the norms and the feed-forward are the
same in every layer, so one layer kind decomposes them all:

- LFM2 (``lfm2``): ``config.layer_types`` says per layer ``"conv"`` (a gated short convolution,
  ``Attention(mixer="short_conv")``: with its gates recorded, a per-channel mixing tensor applied
  to the value slice of its input projection; ``docs/frontier.md``, "Short-convolution mixers") or
  ``"full_attention"`` (grouped-query attention with per-head q/k norms, recorded); pre-LN with
  RMSNorms ``operator_norm`` and ``ffn_norm``, a SwiGLU feed-forward (``w1`` gate, ``w3`` up,
  ``w2`` down) and the final norm ``embedding_norm``. A convolution bias (``conv_bias=True``) adds
  C_t * b per target, a no-token term no layer kind expresses yet: refused.

``BUILTIN`` lists the descriptions by registry key; :mod:`captum_normattr.arch.registry` registers them.
"""
from __future__ import annotations

from typing import Tuple

from captum_normattr.arch.spec import ArchitectureSpec, Attention, FeedForward, Head, Layer, Norm, ValueProjection

__all__ = ["BUILTIN", "LFM2", "LFM2_SHORT_CONV"]

_RMS = dict(kind="rmsnorm")
_OPERATOR_NORM = Norm("operator_norm", **_RMS)

#: LFM2's gated short-convolution mixer: in_proj -> [B | C | x], conv over B * x, C * conv(.), out_proj.
LFM2_SHORT_CONV = Attention("conv", out="conv.out_proj", value=ValueProjection("conv.in_proj", "fused", index=2, count=3),
                            pre_norm=_OPERATOR_NORM, mixer="short_conv", conv="conv.conv")

LFM2 = ArchitectureSpec(
    family="LFM2", model_types=("lfm2",), layers="layers", causal=True,
    layer=Layer(
        attention=Attention("self_attn", out="self_attn.out_proj", value=ValueProjection("self_attn.v_proj"),
                            pre_norm=_OPERATOR_NORM),
        ff=FeedForward(up="feed_forward.w3", gate="feed_forward.w1", act="torch.nn.functional.silu", down="feed_forward.w2",
                       pre_norm=Norm("ffn_norm", **_RMS)),
        mixers=(("conv", LFM2_SHORT_CONV),), mixer_types="layer_types",
    ),
    head=Head(final_norm=Norm("embedding_norm", **_RMS), lm_head="lm_head"),
    refused_configs=(("conv_bias", True, "the short convolution's bias adds C_t * b to every target, a no-token term "
                                         "that depends on the target, which no layer kind expresses yet"),),
    notes="hybrid: gated short-convolution layers (gates recorded, one head of size 1 per channel) and grouped-query "
          "attention layers with q/k norms (recorded), chosen by layer_types; SwiGLU FF (w1, w3, w2)",
)

BUILTIN: Tuple[Tuple[str, ArchitectureSpec], ...] = (("lfm2", LFM2),)
