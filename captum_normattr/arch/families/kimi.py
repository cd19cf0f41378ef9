r"""Family description of Kimi Linear (``kimi_linear``): Kimi Delta Attention beside multi-head latent attention.

Kimi Linear picks each layer's mixer from ``config.layer_types`` (:attr:`~captum_normattr.arch.spec.Layer.mixers`):

- ``"linear_attention"``: Kimi Delta Attention (``self_attn``, ``Attention(mixer="kimi_delta")``): causal
  depthwise convolutions and SiLUs on q, k and v, a gated delta rule whose decay is per key channel
  (``forget_gate``), writing strengths sigmoid(``b_proj``), a sigmoid-gated RMSNorm per head (``o_norm``) and
  ``o_proj``; with those coefficients recorded from the real forward pass, a per-channel mixing tensor applied to
  the value projection's output before its convolution, recorded as attention with one head per channel and head
  size 1 (:mod:`captum_normattr.models.capture.kimi_delta`; ``docs/linear_mixers.md``, "Kimi Delta Attention");
- ``"full_attention"``: multi-head latent attention without rotary positions (NoPE: the keys' decoupled part is
  shared across heads, not rotated), its values from the RMS-normalised latent
  (``ValueProjection(layout="latent")``, DeepSeek-V3's), the probabilities recorded.

Pre-LN with RMSNorms ``input_layernorm`` and ``post_attention_layernorm``; the feed-forward is chosen by
``config.mlp_layer_types``: a dense SwiGLU (``mlp.gate_proj``, ``mlp.up_proj``, ``mlp.down_proj``) or
DeepSeek-V3's experts block (fused experts ``mlp.experts``, an ungated shared expert ``mlp.shared_experts``,
sigmoid group-limited routing with a correction bias held fixed); final norm ``norm``, an untied ``lm_head``.

``BUILTIN`` lists the description by registry key; :mod:`captum_normattr.arch.registry` registers it.
"""
from __future__ import annotations

from typing import Tuple

from captum_normattr.arch.families.frontier import DEEPSEEK_V3
from captum_normattr.arch.spec import ArchitectureSpec, Attention, Head, Layer, Norm, ValueProjection

__all__ = ["BUILTIN", "KIMI_DELTA_ATTENTION", "KIMI_LINEAR"]

_INPUT_NORM = Norm("input_layernorm", "rmsnorm")

#: Kimi Delta Attention: [q | k | v] projections -> depthwise conv + SiLU -> per-channel-decay delta rule ->
#: sigmoid-gated RMSNorm -> o_proj; the values are v_proj's output before the convolution.
KIMI_DELTA_ATTENTION = Attention("self_attn", out="self_attn.o_proj", value=ValueProjection("self_attn.v_proj"),
                                 pre_norm=_INPUT_NORM, mixer="kimi_delta", conv="self_attn.conv1d")

KIMI_LINEAR = ArchitectureSpec(
    family="Kimi Linear", model_types=("kimi_linear",), layers="layers", causal=True,
    layer=Layer(
        attention=DEEPSEEK_V3.layer.attention,
        ff=DEEPSEEK_V3.layer.ff,
        mixers=(("linear_attention", KIMI_DELTA_ATTENTION),), mixer_types="layer_types",
    ),
    head=Head(final_norm=Norm("norm", "rmsnorm"), lm_head="lm_head"),
    notes="hybrid: Kimi delta attention layers (per-key-channel decays, convolutions, beta and the gated output norm "
          "recorded, one head of size 1 per channel) and NoPE multi-head latent attention layers (latent values, "
          "their norm scale recorded), chosen by layer_types; dense SwiGLU or DeepSeek-V3's experts (ungated shared "
          "expert, sigmoid group-limited routing held fixed) by mlp_layer_types",
)

BUILTIN: Tuple[Tuple[str, ArchitectureSpec], ...] = (("kimi_linear", KIMI_LINEAR),)
