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

- Qwen3-Next (``qwen3_next``), Qwen3.5 (``qwen3_5_text``) and Qwen3.5-MoE (``qwen3_5_moe_text``):
  ``config.layer_types`` says per layer ``"linear_attention"`` (a Gated DeltaNet,
  ``Attention(mixer="gated_delta_net")``: with its coefficients recorded, a per-channel mixing tensor
  applied to the value channels of its input projection, Qwen3-Next's per-key-head grouped
  ``in_proj_qkvz`` (layout ``delta_grouped``) or Qwen3.5's ``in_proj_qkv`` (``delta_split``);
  ``docs/linear_mixers.md``) or ``"full_attention"`` (grouped-query attention with per-head q/k norms
  whose output is gated per channel by sigmoid of a gate from ``q_proj``, ``Attention(output_gate=...)``,
  recorded with one head of size 1 per channel); pre-LN with ``1 + w`` RMSNorms; the feed-forward is
  Qwen2-MoE's experts block (routed experts beside a sigmoid-gated shared expert, dense layers in
  ``mlp_only_layers``) for Qwen3-Next and Qwen3.5-MoE, a SwiGLU for Qwen3.5. The multimodal
  composites (``qwen3_5``, ``qwen3_5_moe``) stay refused: their text models are these.

``BUILTIN`` lists the descriptions by registry key; :mod:`captum_normattr.arch.registry` registers them.
"""
from __future__ import annotations

from typing import Tuple

from captum_normattr.arch.spec import (
    ArchitectureSpec,
    Attention,
    Experts,
    FeedForward,
    Head,
    Layer,
    Norm,
    ValueProjection,
)

__all__ = ["BUILTIN", "LFM2", "LFM2_SHORT_CONV", "QWEN3_5", "QWEN3_5_MOE", "QWEN3_NEXT", "QWEN3_NEXT_DELTA_NET"]

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

# --- Qwen3-Next / Qwen3.5: Gated DeltaNet layers beside gated attention layers -------------------------
_QWEN_NORM = dict(kind="rmsnorm", weight_offset=1.0)
_QWEN_PRE = Norm("input_layernorm", **_QWEN_NORM)
#: the full-attention layers: GQA with per-head q/k norms (recorded), the output gated per channel by q_proj's gate half
_GATED_ATTENTION = Attention("self_attn", out="self_attn.o_proj", value=ValueProjection("self_attn.v_proj"),
                             pre_norm=_QWEN_PRE, output_gate="self_attn.q_proj")
#: Qwen3-Next's Gated DeltaNet: in_proj_qkvz grouped per key head [q | k | v | z], in_proj_ba, conv1d, gated norm
QWEN3_NEXT_DELTA_NET = Attention("linear_attn", out="linear_attn.out_proj", pre_norm=_QWEN_PRE,
                                 value=ValueProjection("linear_attn.in_proj_qkvz", "delta_grouped", index=2, count=4),
                                 mixer="gated_delta_net", conv="linear_attn.conv1d")
_QWEN3_5_DELTA_NET = Attention("linear_attn", out="linear_attn.out_proj", pre_norm=_QWEN_PRE,
                               value=ValueProjection("linear_attn.in_proj_qkv", "delta_split", index=2, count=3),
                               mixer="gated_delta_net", conv="linear_attn.conv1d")
_QWEN_FF_NORM = Norm("post_attention_layernorm", **_QWEN_NORM)
_QWEN_DENSE = FeedForward(up="mlp.up_proj", gate="mlp.gate_proj", act="mlp.act_fn", down="mlp.down_proj")
_QWEN_MOE = FeedForward(up="mlp", act="mlp.experts.act_fn", down="mlp", pre_norm=_QWEN_FF_NORM, experts=Experts(
    "mlp.experts", shared=FeedForward(up="mlp.shared_expert.up_proj", gate="mlp.shared_expert.gate_proj",
                                      act="mlp.shared_expert.act_fn", down="mlp.shared_expert.down_proj"),
    shared_gate="mlp.shared_expert_gate", dense=_QWEN_DENSE))
_QWEN_HEAD = Head(final_norm=Norm("norm", **_QWEN_NORM), lm_head="lm_head")
_QWEN_NOTES = ("hybrid: Gated DeltaNet layers (coefficients recorded, one head of size 1 per value channel) and "
               "grouped-query attention layers with q/k norms whose output is gated per channel (one head of size 1 "
               "per channel), chosen by layer_types; 1 + w RMSNorms; ")


def _qwen_hybrid(family: str, model_type: str, delta_net: Attention, ff: FeedForward, notes: str) -> ArchitectureSpec:
    return ArchitectureSpec(
        family=family, model_types=(model_type,), layers="layers", causal=True,
        layer=Layer(attention=_GATED_ATTENTION, ff=ff, mixers=(("linear_attention", delta_net),),
                    mixer_types="layer_types"),
        head=_QWEN_HEAD, notes=_QWEN_NOTES + notes)


QWEN3_NEXT = _qwen_hybrid("Qwen3-Next", "qwen3_next", QWEN3_NEXT_DELTA_NET, _QWEN_MOE,
                          "routed experts beside a sigmoid-gated shared expert (routing held fixed), dense "
                          "mlp_only_layers")
QWEN3_5 = _qwen_hybrid("Qwen3.5", "qwen3_5_text", _QWEN3_5_DELTA_NET,
                       FeedForward(up="mlp.up_proj", gate="mlp.gate_proj", act="mlp.act_fn", down="mlp.down_proj",
                                   pre_norm=_QWEN_FF_NORM),
                       "separate q/k/v, z, b, a projections of the Gated DeltaNet; SwiGLU FF")
QWEN3_5_MOE = _qwen_hybrid("Qwen3.5-MoE", "qwen3_5_moe_text", _QWEN3_5_DELTA_NET, _QWEN_MOE,
                           "separate q/k/v, z, b, a projections of the Gated DeltaNet; routed experts beside a "
                           "sigmoid-gated shared expert (routing held fixed)")

BUILTIN: Tuple[Tuple[str, ArchitectureSpec], ...] = (
    ("lfm2", LFM2), ("qwen3_next", QWEN3_NEXT), ("qwen3_5_text", QWEN3_5), ("qwen3_5_moe_text", QWEN3_5_MOE),
)
