r"""Family descriptions of the state-space group: hybrids with Mamba-2 mixers (see :mod:`captum_normattr.arch.spec`).

A Mamba-2 mixer is linear in the x channels of its input projection once its scan coefficients
(time steps, A, B, C, D, the convolution's SiLU slope, the gated norm's per-target scale) are taken
from the real forward pass: the capture records its per-channel mixing tensor as attention with one
head of size 1 per channel (``Attention(mixer="mamba2")``, :mod:`captum_normattr.models.capture.mamba2`;
``docs/linear_mixers.md``), and the pre-LN layer kind decomposes it as any attention:

- Granite 4 (``granitemoehybrid``): ``config.layer_types`` says per layer ``"linear_attention"``
  (a Mamba-2 mixer, ``mamba``) or ``"full_attention"`` (Granite's attention, ``self_attn``, with
  ``attention_multiplier`` as its scaling, recorded); pre-LN with RMSNorms ``input_layernorm`` and
  ``post_attention_layernorm``; Granite's multipliers (embedding, residual on both branches, folded
  into W_O / W_down, and the logits divisor); the dense feed-forward is the shared MLP
  (``shared_mlp``: a fused [gate | up] ``input_linear``, ``output_linear``).

The convolution bias of the real checkpoints (``mamba_conv_bias=True``) is decomposed: the part
entering the scan at token s belongs to s (as attention's b_V), recorded as one more head of size 1
per channel (``docs/linear_mixers.md``, "The convolution bias").

Experts beside the shared MLP (``num_local_experts > 0``, granite-4.0-h-tiny and -small) are the
variant :data:`GRANITE4_MOE`: the layer adds ``block_sparse_moe(u)`` and ``shared_mlp(u)`` itself, so
the capture records both modules' outputs (``Experts.shared_beside``) and their sum is the FF output;
with the routing the experts module is called with held fixed, experts and shared MLP are one gated
FF (:mod:`captum_normattr.models.experts`), as DeepSeek-V3's ungated shared experts.

Refused (``refused_configs``), with its reason: an input-projection bias (``mamba_proj_bias=True``: a
padding token's projection bias reaches the real tokens through the convolution, so the model itself
is not the same padded and alone).

- Nemotron-H (``nemotron_h``): each layer is ONE branch behind its own RMSNorm ``norm``,
  y = x + B(norm(x)) (the single-branch layer kind, :mod:`captum_normattr.decompose.kinds.single_branch`),
  the branch ``mixer`` chosen by ``config.layers_block_type``: ``"linear_attention"`` (legacy
  ``"mamba"``) a Mamba-2 mixer (the one Granite 4's capture records; its gated norm works per group of
  ``intermediate_size // n_groups`` channels), ``"full_attention"`` (``"attention"``) grouped-query
  attention without positions, ``"mlp"`` a plain ReLU² FF (``up_proj``, ``down_proj``), ``"moe"``
  non-gated ReLU² experts (``Experts(kind="squared_relu")``, read as relu(a) * a) beside an ungated
  ReLU² shared expert (latent projections around the experts, ``moe_latent_size``, folded into
  them), the routing of the real forward pass held fixed; final norm ``norm_f``. The convolution
  bias (``use_conv_bias=True``, the config's default) is decomposed as Granite 4's; refused with the
  reason: projection biases (``use_bias=True``: the Mamba-2 input projection's, as Granite 4's
  ``mamba_proj_bias``).

``BUILTIN`` lists the descriptions by registry key; :mod:`captum_normattr.arch.registry` registers them.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Tuple

from captum_normattr.arch.families.base import GRANITE
from captum_normattr.arch.spec import (
    ArchitectureSpec,
    Attention,
    Experts,
    FeedForward,
    Head,
    Layer,
    Norm,
    ValueProjection,
    Variant,
)

__all__ = ["BUILTIN", "GRANITE4", "GRANITE4_MAMBA2", "GRANITE4_MOE", "NEMOTRON_H", "NEMOTRON_H_MAMBA2"]

_RMS = dict(kind="rmsnorm")
_INPUT_NORM = Norm("input_layernorm", **_RMS)

#: Granite 4's Mamba-2 mixer: in_proj -> [z | x | B | C | dt], conv1d over [x | B | C], the SSD scan, a gated
#: RMSNorm, out_proj; behind Granite's residual multiplier (folded into W_O).
GRANITE4_MAMBA2 = Attention("mamba", out="mamba.out_proj", value=ValueProjection("mamba.in_proj", "mamba2_x"),
                            pre_norm=_INPUT_NORM, multiplier="residual_multiplier", mixer="mamba2",
                            conv="mamba.conv1d")

_PROJ_BIAS = ("the Mamba-2 input projection's bias gives padding tokens (whose input the mixer zeroes) a non-zero "
              "value that the causal convolution carries into the real tokens, so a padded example is not the example "
              "alone, and the values of padding tokens would be attributed")

_SHARED_MLP = FeedForward(up="shared_mlp.input_linear", act="shared_mlp.activation", down="shared_mlp.output_linear",
                          kind="fused_gate_up")
_GRANITE4_DENSE = ArchitectureSpec(
    family="Granite 4", model_types=("granitemoehybrid",), layers="layers", causal=True,
    layer=Layer(
        attention=replace(GRANITE.layer.attention, pre_norm=_INPUT_NORM),
        ff=replace(_SHARED_MLP, pre_norm=Norm("post_attention_layernorm", **_RMS), multiplier="residual_multiplier"),
        mixers=(("linear_attention", GRANITE4_MAMBA2),), mixer_types="layer_types",
    ),
    head=GRANITE.head, inputs=GRANITE.inputs,
    refused_configs=(("mamba_proj_bias", True, _PROJ_BIAS),),
    notes="hybrid: Mamba-2 layers (scan coefficients, convolution slope and gated-norm scale recorded, one head of "
          "size 1 per channel, the convolution bias as one more head per channel) and Granite attention layers, "
          "chosen by layer_types; Granite's multipliers; the shared MLP as the dense FF, beside experts where "
          "num_local_experts > 0 (routing held fixed)",
)

#: Granite 4 with experts (``num_local_experts > 0``): the layer adds ``block_sparse_moe(u)`` (Mixtral's experts
#: block: softmax over the top-k router logits) and ``shared_mlp(u)`` itself; read as one gated FF, the experts'
#: neurons times their routing weights beside the shared MLP's (weight 1), Granite's multiplier in W_down.
GRANITE4_MOE = replace(_GRANITE4_DENSE, layer=replace(_GRANITE4_DENSE.layer, ff=FeedForward(
    up="block_sparse_moe", act="block_sparse_moe.experts.act_fn", down="block_sparse_moe",
    pre_norm=Norm("post_attention_layernorm", **_RMS), multiplier="residual_multiplier",
    experts=Experts("block_sparse_moe.experts", shared=_SHARED_MLP, shared_beside="shared_mlp"))))

GRANITE4 = replace(_GRANITE4_DENSE, variants=(Variant("num_local_experts", ..., GRANITE4_MOE),))

# --- Nemotron-H: one branch per layer ------------------------------------------------------------
_NEMOTRON_NORM = Norm("norm", **_RMS)
#: Nemotron-H's Mamba-2 mixer (Granite 4's, its gated norm per group of intermediate_size // n_groups channels)
NEMOTRON_H_MAMBA2 = Attention("mixer", out="mixer.out_proj", value=ValueProjection("mixer.in_proj", "mamba2_x"),
                              pre_norm=_NEMOTRON_NORM, mixer="mamba2", conv="mixer.conv1d")
_NEMOTRON_ATTENTION = Attention("mixer", out="mixer.o_proj", value=ValueProjection("mixer.v_proj"),
                                pre_norm=_NEMOTRON_NORM)
_NEMOTRON_MLP = FeedForward(up="mixer.up_proj", act="mixer.act_fn", down="mixer.down_proj", pre_norm=_NEMOTRON_NORM)
#: the experts block: non-gated ReLU² experts beside an ungated ReLU² shared expert, the routing held fixed
_NEMOTRON_MOE = FeedForward(up="mixer", act="mixer.experts.act_fn", down="mixer", pre_norm=_NEMOTRON_NORM,
                            experts=Experts("mixer.experts", kind="squared_relu", shared=FeedForward(
                                up="mixer.shared_experts.up_proj", act="mixer.shared_experts.act_fn",
                                down="mixer.shared_experts.down_proj"),
                                latent=("mixer.fc1_latent_proj", "mixer.fc2_latent_proj")))
_NEMOTRON_PROJ_BIAS = ("its projection biases include the Mamba-2 input projection's, which gives padding tokens (whose "
                       "input the mixer zeroes) a non-zero value that the causal convolution carries into the real "
                       "tokens, so a padded example is not the example alone, and the values of padding tokens would "
                       "be attributed")

NEMOTRON_H = ArchitectureSpec(
    family="Nemotron-H", model_types=("nemotron_h",), layers="layers", causal=True,
    layer=Layer(
        attention=_NEMOTRON_ATTENTION, ff=_NEMOTRON_MLP,
        single_branches=(("linear_attention", NEMOTRON_H_MAMBA2), ("mamba", NEMOTRON_H_MAMBA2),
                         ("full_attention", _NEMOTRON_ATTENTION), ("attention", _NEMOTRON_ATTENTION),
                         ("mlp", _NEMOTRON_MLP), ("moe", _NEMOTRON_MOE)),
        mixer_types="layers_block_type",
    ),
    head=Head(final_norm=Norm("norm_f", **_RMS), lm_head="lm_head"),
    refused_configs=(("use_bias", True, _NEMOTRON_PROJ_BIAS),),
    notes="one branch per layer behind its own RMSNorm, chosen by layers_block_type: Mamba-2 mixers (scan "
          "coefficients, convolution slope and the per-group gated-norm scale recorded, one head of size 1 per "
          "channel, the convolution bias as one more head per channel), grouped-query attention without positions, plain ReLU² FFs, non-gated ReLU² experts beside a "
          "shared expert (sigmoid group-limited routing with a correction bias held fixed)",
)

BUILTIN: Tuple[Tuple[str, ArchitectureSpec], ...] = (("granitemoehybrid", GRANITE4), ("nemotron_h", NEMOTRON_H))
