r"""Family description of Gemma 4's text model (``gemma4_text``; see :mod:`captum_normattr.arch.families.base`).

Gemma 4's text layer (``Gemma4TextDecoderLayer``) is Gemma 3's sandwich layer with RMSNorm gain
``w`` (not ``1 + w``) and per-layer inputs (:attr:`~captum_normattr.arch.spec.Layer.per_layer_input`,
topology ``sandwich_per_layer_input``): a third residual branch on a per-layer embedding of the
token, a learned scalar on the layer's output, values normalised per head, keys and values shared
across the last layers, keys used as values on full-attention layers, experts beside the dense
feed-forward. The attention block is recorded as a sandwich layer's; the layer kind
(:mod:`captum_normattr.decompose.kinds.sandwich_per_layer_input`) adds the rest
(``docs/frontier.md``, "Gemma 4"). DecompX, ALTI-Logit, GlobEnc, ALTI and the FF component scopes
(FFIntegratedDecomposition; the whole-layer scope with the per-layer-input branch as each token's own
part and the layer scalar on every part) decompose it exactly, and the routes run on it (a layer reusing
keys and values has its head edges from the input of the layer that computed them).

``BUILTIN`` lists the description by registry key; :mod:`captum_normattr.arch.registry` registers it.
The multimodal ``gemma4`` (``Gemma4ForConditionalGeneration``) is a vision-language model
(:mod:`captum_normattr.arch.families.vlm_gemma4`); ``REFUSED`` is empty.
"""
from __future__ import annotations

from typing import Dict, Tuple

from captum_normattr.arch.spec import ArchitectureSpec, Attention, FeedForward, Head, Inputs, Layer, Norm, ValueProjection

__all__ = ["BUILTIN", "GEMMA4_TEXT", "REFUSED"]

_RMS = dict(kind="rmsnorm")  # Gemma 4's RMSNorm: w * u / rms(u), gain w (Gemma 2 and 3: 1 + w)

GEMMA4_TEXT = ArchitectureSpec(
    family="Gemma 4", model_types=("gemma4_text",), layers="layers", causal=True,
    layer=Layer(
        attention=Attention("self_attn", out="self_attn.o_proj", value=ValueProjection("self_attn.v_proj"),
                            pre_norm=Norm("input_layernorm", **_RMS), post_norm=Norm("post_attention_layernorm", **_RMS)),
        ff=FeedForward(up="mlp.up_proj", gate="mlp.gate_proj", act="mlp.act_fn", down="mlp.down_proj",
                       pre_norm=Norm("pre_feedforward_layernorm", **_RMS),
                       post_norm=Norm("post_feedforward_layernorm", **_RMS)),
        per_layer_input="hidden_size_per_layer_input",
    ),
    head=Head(final_norm=Norm("norm", **_RMS), lm_head="lm_head", final_softcap="final_logit_softcapping"),
    inputs=Inputs(embedding_scale="sqrt(hidden_size)"),
    refused_configs=(
        ("attention_bias", ..., "the post-attention norm makes an attention output bias a per-token bias, which the "
                                "per-layer-input kind does not decompose (Gemma 4's checkpoints have none)"),
        ("use_bidirectional_attention", "all", "its attention is bidirectional, while the description is causal "
                                               "(causal positions and maps)"),
    ),
    notes="sandwich layers with gain-w RMSNorms plus per-layer inputs (a third residual branch to each token's own "
          "part), a layer scalar, per-head value norms, shared keys/values, keys as values and experts beside the "
          "dense FF (enable_moe_block, routing held fixed); sliding-window and global layers recorded; DecompX runs "
          "its forward propagation; routes with a shared value's head edges from the layer that computed it",
)

BUILTIN: Tuple[Tuple[str, ArchitectureSpec], ...] = (("gemma4_text", GEMMA4_TEXT),)

#: ``config.model_type`` -> (family, why it is not supported)
REFUSED: Dict[str, Tuple[str, str]] = {}  # the multimodal ``gemma4``: a vision-language model (vlm_gemma4.py)
