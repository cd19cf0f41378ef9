r"""Family descriptions of the decoders group (see :mod:`captum_normattr.arch.families.base` for the format).

OLMo 2 (sandwich layers without pre-norms), Gemma 3 text (sandwich norms like Gemma 2,
sliding-window and global layers), BLOOM (ALiBi computed inside its own attention module,
per-head interleaved QKV, an embedding LayerNorm) and OPT (pre- and post-LN variants,
learned positions with an offset, a feed-forward run on flattened tokens). The prose is in
``docs/architectures.md`` ("Decoders: OLMo 2, Gemma 3, BLOOM, OPT").

``BUILTIN`` lists them by registry key; :mod:`captum_normattr.arch.registry` registers them after
the text families of :mod:`captum_normattr.arch.families.base` and before the vision ones.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Tuple

from captum_normattr.arch.families.base import GEMMA2
from captum_normattr.arch.spec import (
    ArchitectureSpec,
    Attention,
    FeedForward,
    Head,
    Inputs,
    Layer,
    Norm,
    ValueProjection,
    Variant,
)

__all__ = ["BLOOM", "BUILTIN", "GEMMA3", "OLMO2", "OPT"]

_RMS = dict(kind="rmsnorm")

#: OLMo 2: RMSNorms on the branch OUTPUTS only, h = x + P1(Attn(x)), y = h + P2(FF(h)); the q/k
#: RMSNorms over the whole projections sit inside the attention (the recorded probabilities include them).
OLMO2 = ArchitectureSpec(
    family="OLMo 2", model_types=("olmo2",), layers="layers", causal=True,
    layer=Layer(
        attention=Attention("self_attn", out="self_attn.o_proj", value=ValueProjection("self_attn.v_proj"),
                            post_norm=Norm("post_attention_layernorm", **_RMS)),
        ff=FeedForward(up="mlp.up_proj", gate="mlp.gate_proj", act="mlp.act_fn", down="mlp.down_proj",
                       post_norm=Norm("post_feedforward_layernorm", **_RMS)),
    ),
    head=Head(final_norm=Norm("norm", **_RMS), lm_head="lm_head"),
    notes="norms on the branch outputs only; q/k norms over the whole projections (recorded)",
)

#: Gemma 3 (text): Gemma 2's sandwich layers with ``1 + w`` RMSNorms and per-head q/k norms;
#: sliding-window and global layers with their own rotary bases (through the mask and the
#: position embeddings: the recorded probabilities include both). Its attention passes no
#: soft-cap to the attention function (``attn_logit_softcapping`` is unused); the final-logit
#: soft-cap applies when ``final_logit_softcapping`` is set (None by default).
GEMMA3 = ArchitectureSpec(
    family="Gemma 3", model_types=("gemma3_text",), layers="layers", causal=True,
    layer=replace(GEMMA2.layer, attention=replace(GEMMA2.layer.attention, softcap=None)),
    head=GEMMA2.head,
    inputs=GEMMA2.inputs,
    refused_configs=(("use_bidirectional_attention", True,
                      "its attention is bidirectional, while the description is causal (causal positions and maps)"),),
    notes="text model (Gemma3ForCausalLM); sliding-window and global layers, q/k norms, recorded",
)

#: BLOOM: pre-LN LayerNorm layers; ALiBi biases added inside BloomAttention, which computes its
#: softmax itself and returns the probabilities (recorded from there); one projection laid out per
#: head [q_h | k_h | v_h]; a LayerNorm on the embeddings before the first layer.
BLOOM = ArchitectureSpec(
    family="BLOOM", model_types=("bloom",), layers="h", causal=True,
    layer=Layer(
        attention=Attention("self_attention", out="self_attention.dense",
                            value=ValueProjection("self_attention.query_key_value", "interleaved", 2, 3),
                            pre_norm=Norm("input_layernorm"), probabilities="returned"),
        ff=FeedForward(up="mlp.dense_h_to_4h", act="mlp.gelu_impl", down="mlp.dense_4h_to_h",
                       pre_norm=Norm("post_attention_layernorm")),
    ),
    head=Head(final_norm=Norm("ln_f"), lm_head="lm_head"),
    inputs=Inputs(embedding_norm="word_embeddings_layernorm"),
    refused_configs=(("apply_residual_connection_post_layernorm", True,
                      "its residual stream carries the norms' outputs (x' = N1(x) + Attn(N1(x))), a topology no "
                      "layer kind decomposes"),),
    notes="ALiBi inside its own attention module (the returned probabilities are recorded); embedding LayerNorm",
)

#: OPT: LayerNorm layers whose FF runs on the tokens flattened to (B * T, D) (recorded back as
#: (B, T, D)); learned positions with an offset of 2 (the table has max_position_embeddings + 2
#: rows: the limit is max_position_embeddings). ``do_layer_norm_before=False`` (opt-350m) is
#: post-LN: z = x + Attn(x), zt = LN1(z), y = LN2(zt + FF(zt)), no final norm (the LM head reads
#: the last layer's output). ``word_embed_proj_dim != hidden_size`` (opt-350m): ``project_in``
#: acts before the first layer (the decompositions start at its input), ``project_out`` is linear
#: after the last layer / final norm, folded into the unembedding (``Head.projection``).
_OPT_ATTENTION = Attention("self_attn", out="self_attn.out_proj", value=ValueProjection("self_attn.v_proj"))
_OPT_FF = FeedForward(up="fc1", act="activation_fn", down="fc2")
_OPT_REFUSED = (("_remove_final_layer_norm", True,
                 "a pre-LN OPT without its final LayerNorm (checkpoints fine-tuned before transformers 4.20.1) is not "
                 "described"),)
OPT = ArchitectureSpec(
    family="OPT", model_types=("opt",), layers="decoder.layers", causal=True,
    layer=Layer(attention=replace(_OPT_ATTENTION, pre_norm=Norm("self_attn_layer_norm")),
                ff=replace(_OPT_FF, pre_norm=Norm("final_layer_norm"))),
    head=Head(final_norm=Norm("decoder.final_layer_norm"), lm_head="lm_head", projection="decoder.project_out"),
    refused_configs=_OPT_REFUSED,
    variants=(Variant("do_layer_norm_before", False, ArchitectureSpec(
        family="OPT", model_types=("opt",), layers="decoder.layers", causal=True,
        layer=Layer(attention=_OPT_ATTENTION, ff=_OPT_FF,
                    stream_norms=(Norm("self_attn_layer_norm"), Norm("final_layer_norm"))),
        head=Head(lm_head="lm_head", projection="decoder.project_out"), refused_configs=_OPT_REFUSED)),),
    notes="learned positions offset by 2; FF on flattened tokens; do_layer_norm_before=False: post-LN",
)

BUILTIN: Tuple[Tuple[str, ArchitectureSpec], ...] = (
    ("olmo2", OLMO2), ("gemma3_text", GEMMA3), ("bloom", BLOOM), ("opt", OPT),
)
