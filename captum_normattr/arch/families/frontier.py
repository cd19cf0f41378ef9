r"""Family descriptions of the frontier group: 2025-2026 decoders (see :mod:`captum_normattr.arch.families.base`).

Each entry is an existing description's layer under the family's own model type, or one built
from the same parts (:mod:`captum_normattr.arch.spec`), and is registered only because its tiny
float64 model decomposes exactly (``tests/arch/test_frontier_families.py``; the measured errors
and every family's status are in ``docs/frontier.md``):

- Llama's layer: Seed-OSS (biases on q/k/v, o and the FF), ERNIE 4.5 (biases; rotary on
  interleaved pairs in float32, inside the attention), Ministral (sliding-window layers through
  the mask), Ministral 3 (position-dependent query scaling inside the attention), Hunyuan dense
  (per-head q/k norms inside the attention); the recorded probabilities include all of it;
- OLMo 2's layer (norms on the branch outputs only): EXAONE 4, OLMo 3;
- Cohere's parallel layer: Command R7B (``cohere2``; sliding-window layers with rotary positions,
  global layers without, both inside the attention);
- the Qwen-MoE experts block with the routing of the real forward pass held fixed (which router
  chose it, and how, does not enter the decomposition): OLMoE, ERNIE 4.5 MoE (an ungated shared
  expert ``shared_experts``, dense layers before ``moe_layer_start_index``), GLM-4.5 (the same
  block, sigmoid scores over expert groups; dense layers before ``first_k_dense_replace``),
  MiniMax-M2 (OLMoE's block, sigmoid scores with a correction bias), Phi-MoE (LayerNorm
  pre-norms, sparsemixer routing, an LM head with a bias);
- new arrangements of existing parts: Arcee (Llama's attention, a plain ReLU² FF), Apertus (a
  plain xIELU FF, norms named ``attention_layernorm`` / ``feedforward_layernorm``), nanochat
  (parameter-free RMSNorms, a plain ReLU² FF, a final-logit soft-cap), GLM-4 (four norms per
  layer: a sandwich layer with a fused [gate | up] FF), VaultGemma (Gemma's ``1 + w`` norms in a
  pre-LN layer with Gemma 2's soft-caps);
- new parts of softmax-attention layers (``docs/frontier.md``, "New mechanisms"): GPT-OSS (learned
  attention sinks, ``Attention.sinks``; clamped SwiGLU experts with biases,
  ``Experts(kind="clamped_swiglu")``), Granite-MoE (Mixtral's experts block behind Granite's residual
  multiplier, folded into the experts' W_down), Llama 4 text (experts on the routing-scaled input,
  ``Experts(kind="input_scaled")``), DeepSeek-V3 (multi-head latent attention,
  ``ValueProjection(layout="latent")``, with GLM-4.5's experts block).

``REFUSED`` names, per model type, the mechanism that no layer kind expresses yet, for the
families of the same generation that no description decomposes (the registry's
:func:`~captum_normattr.arch.registry.refusal` says it in the error). ``BUILTIN`` lists the
descriptions by registry key; :mod:`captum_normattr.arch.registry` registers both.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, Tuple

from captum_normattr.arch.families.base import GEMMA2, GRANITE, LLAMA
from captum_normattr.arch.families.decoders import OLMO2
from captum_normattr.arch.families.moe import QWEN3_MOE
from captum_normattr.arch.families.parallel import COHERE
from captum_normattr.arch.spec import (
    ArchitectureSpec,
    Attention,
    Experts,
    FeedForward,
    Head,
    Inputs,
    Layer,
    Norm,
    ValueProjection,
)

__all__ = [
    "APERTUS",
    "ARCEE",
    "BUILTIN",
    "COHERE2",
    "DEEPSEEK_V3",
    "ERNIE4_5",
    "ERNIE4_5_MOE",
    "EXAONE4",
    "GLM4",
    "GLM4_MOE",
    "GPT_OSS",
    "GRANITE_MOE",
    "LLAMA4_TEXT",
    "HUNYUAN_DENSE",
    "MINISTRAL",
    "MINIMAX_M2",
    "MINISTRAL3",
    "NANOCHAT",
    "OLMO3",
    "OLMOE",
    "PHIMOE",
    "REFUSED",
    "SEED_OSS",
    "VAULTGEMMA",
]


def _clone(spec: ArchitectureSpec, family: str, model_type: str, notes: str) -> ArchitectureSpec:
    r"""``spec`` (its layer, head, inputs, variants and refused configs) serving ``model_type`` as ``family``."""
    return replace(spec, family=family, model_types=(model_type,), notes=notes)


# --- Llama's layer ------------------------------------------------------------------------
SEED_OSS = _clone(LLAMA, "Seed-OSS", "seed_oss", "Llama's layer; biases on q/k/v, o (attention_out_bias) and the FF")
ERNIE4_5 = _clone(LLAMA, "ERNIE 4.5", "ernie4_5", "Llama's layer; biases (use_bias); rotary on interleaved pairs "
                  "in float32 (recorded)")
MINISTRAL = _clone(LLAMA, "Ministral", "ministral", "Llama's layer; sliding-window layers through the mask")
MINISTRAL3 = _clone(LLAMA, "Ministral 3", "ministral3", "Llama's layer; position-dependent query scaling "
                    "(llama_4_scaling_beta) inside the attention (recorded)")
HUNYUAN_DENSE = _clone(LLAMA, "Hunyuan dense", "hunyuan_v1_dense", "Llama's layer; per-head q/k norms "
                       "(query_layernorm, key_layernorm) recorded")

# --- OLMo 2's layer: norms on the branch outputs only -------------------------------------------
EXAONE4 = _clone(OLMO2, "EXAONE 4", "exaone4", "OLMo 2's layer; per-head q/k norms; sliding-window and global "
                 "layers (recorded)")
OLMO3 = _clone(OLMO2, "OLMo 3", "olmo3", "OLMo 2's layer; sliding-window and global layers (recorded)")

# --- Cohere's parallel layer ------------------------------------------------------------------
COHERE2 = _clone(COHERE, "Command R7B", "cohere2", "Cohere's parallel layer; sliding-window layers with rotary "
                 "positions, global layers without (recorded)")

# --- mixtures of experts, the routing held fixed ------------------------------------------------
_MOE_FF = QWEN3_MOE.layer.ff
OLMOE = _clone(replace(QWEN3_MOE, layer=replace(QWEN3_MOE.layer, ff=replace(_MOE_FF, experts=replace(
    _MOE_FF.experts, dense=None)))), "OLMoE", "olmoe", "Qwen3-MoE's layer without dense layers; q/k norms over "
               "the whole projections (recorded); routing held fixed")
_ERNIE_SHARED = FeedForward(up="mlp.shared_experts.up_proj", gate="mlp.shared_experts.gate_proj",
                            act="mlp.shared_experts.act_fn", down="mlp.shared_experts.down_proj")
ERNIE4_5_MOE = _clone(replace(QWEN3_MOE, layer=replace(QWEN3_MOE.layer, ff=replace(_MOE_FF, experts=replace(
    _MOE_FF.experts, shared=_ERNIE_SHARED)))), "ERNIE 4.5 MoE", "ernie4_5_moe",
    "an ungated shared expert (shared_experts); dense layers before moe_layer_start_index; routing (softmax with a "
    "correction bias) held fixed")
GLM4_MOE = _clone(ERNIE4_5_MOE, "GLM-4.5", "glm4_moe",
                  "an ungated shared expert (shared_experts); dense layers before first_k_dense_replace; sigmoid "
                  "routing over expert groups held fixed; per-head q/k norms (use_qk_norm) and partial rotary recorded")
MINIMAX_M2 = _clone(OLMOE, "MiniMax-M2", "minimax_m2", "OLMoE's layer; sigmoid routing with a correction bias held "
                    "fixed; q/k norms over the whole projections and partial rotary recorded")
PHIMOE = ArchitectureSpec(
    family="Phi-MoE", model_types=("phimoe",), layers="layers", causal=True,
    layer=Layer(
        attention=replace(QWEN3_MOE.layer.attention, pre_norm=Norm("input_layernorm")),
        ff=replace(_MOE_FF, pre_norm=Norm("post_attention_layernorm"), experts=replace(_MOE_FF.experts, dense=None)),
    ),
    head=Head(final_norm=Norm("norm"), lm_head="lm_head"),
    notes="LayerNorm pre-norms; qkv biases; sparsemixer routing held fixed; LM head with a bias",
)

# --- new arrangements of existing parts ---------------------------------------------------------
_RMS = dict(kind="rmsnorm")
_LLAMA_ATTENTION = LLAMA.layer.attention
ARCEE = ArchitectureSpec(
    family="Arcee", model_types=("arcee",), layers="layers", causal=True,
    layer=Layer(attention=_LLAMA_ATTENTION,
                ff=FeedForward(up="mlp.up_proj", act="mlp.act_fn", down="mlp.down_proj",
                               pre_norm=Norm("post_attention_layernorm", **_RMS))),
    head=LLAMA.head, notes="Llama's attention; a plain ReLU² FF (up_proj, down_proj)",
)
APERTUS = ArchitectureSpec(
    family="Apertus", model_types=("apertus",), layers="layers", causal=True,
    layer=Layer(attention=replace(_LLAMA_ATTENTION, pre_norm=Norm("attention_layernorm", **_RMS)),
                ff=FeedForward(up="mlp.up_proj", act="mlp.act_fn", down="mlp.down_proj",
                               pre_norm=Norm("feedforward_layernorm", **_RMS))),
    head=LLAMA.head, notes="a plain xIELU FF; per-head q/k norms (recorded)",
)
NANOCHAT = ArchitectureSpec(
    family="nanochat", model_types=("nanochat",), layers="layers", causal=True,
    layer=Layer(attention=_LLAMA_ATTENTION,
                ff=FeedForward(up="mlp.fc1", act="mlp.activation_fn", down="mlp.fc2",
                               pre_norm=Norm("post_attention_layernorm", **_RMS))),
    head=Head(final_norm=Norm("norm", **_RMS), lm_head="lm_head", final_softcap="final_logit_softcapping"),
    inputs=Inputs(embedding_norm="norm"),
    notes="RMSNorms without gain (the final one also normalises the embeddings); a plain ReLU² FF; "
          "parameter-free per-head q/k norms (recorded)",
)
GLM4 = ArchitectureSpec(
    family="GLM-4", model_types=("glm4",), layers="layers", causal=True,
    layer=Layer(
        attention=Attention("self_attn", out="self_attn.o_proj", value=ValueProjection("self_attn.v_proj"),
                            pre_norm=Norm("input_layernorm", **_RMS), post_norm=Norm("post_self_attn_layernorm", **_RMS)),
        ff=FeedForward(up="mlp.gate_up_proj", act="mlp.activation_fn", down="mlp.down_proj", kind="fused_gate_up",
                       pre_norm=Norm("post_attention_layernorm", **_RMS), post_norm=Norm("post_mlp_layernorm", **_RMS)),
    ),
    head=LLAMA.head, notes="four norms per layer (sandwich); fused gate-up FF, gate first; partial rotary (recorded)",
)
_GEMMA_NORM = dict(kind="rmsnorm", weight_offset=1.0)
VAULTGEMMA = ArchitectureSpec(
    family="VaultGemma", model_types=("vaultgemma",), layers="layers", causal=True,
    layer=Layer(
        attention=replace(GEMMA2.layer.attention, post_norm=None),
        ff=replace(GEMMA2.layer.ff, post_norm=None),
    ),
    head=GEMMA2.head, inputs=GEMMA2.inputs,
    notes="Gemma 2's soft-caps and 1 + w norms in a pre-LN layer (input_layernorm, pre_feedforward_layernorm)",
)

# --- softmax attention with new parts (docs/frontier.md, "New mechanisms") ---------------------------
GPT_OSS = ArchitectureSpec(
    family="GPT-OSS", model_types=("gpt_oss",), layers="layers", causal=True,
    layer=Layer(
        attention=replace(_LLAMA_ATTENTION, sinks="self_attn.sinks"),
        ff=FeedForward(up="mlp", act="mlp.experts", down="mlp", pre_norm=Norm("post_attention_layernorm", **_RMS),
                       experts=Experts("mlp.experts", kind="clamped_swiglu")),
    ),
    head=LLAMA.head,
    notes="learned attention sinks (probabilities summing to less than 1); clamped SwiGLU experts with biases, "
          "routing held fixed; sliding-window layers through the mask",
)

GRANITE_MOE = ArchitectureSpec(
    family="Granite-MoE", model_types=("granitemoe",), layers="layers", causal=True,
    layer=Layer(
        attention=GRANITE.layer.attention,
        ff=FeedForward(up="block_sparse_moe", act="block_sparse_moe.experts.act_fn", down="block_sparse_moe",
                       pre_norm=Norm("post_attention_layernorm", **_RMS), multiplier="residual_multiplier",
                       experts=Experts("block_sparse_moe.experts")),
    ),
    head=GRANITE.head, inputs=GRANITE.inputs,
    notes="Mixtral's experts block; Granite's residual multiplier on both branches (folded into W_O and the "
          "experts' W_down), attention_multiplier as the attention scaling (recorded), logits_scaling; routing held "
          "fixed",
)

DEEPSEEK_V3 = ArchitectureSpec(
    family="DeepSeek-V3", model_types=("deepseek_v3",), layers="layers", causal=True,
    layer=Layer(
        attention=Attention("self_attn", out="self_attn.o_proj", pre_norm=Norm("input_layernorm", **_RMS),
                            value=ValueProjection("self_attn.kv_a_proj_with_mqa", layout="latent",
                                                  latent_norm=Norm("self_attn.kv_a_layernorm", **_RMS),
                                                  latent_up="self_attn.kv_b_proj")),
        ff=GLM4_MOE.layer.ff,
    ),
    head=LLAMA.head,
    notes="multi-head latent attention (values from an RMS-normalised latent, its scale recorded; low-rank queries "
          "and the decoupled rotary key part inside the attention); GLM-4.5's experts block (ungated shared "
          "experts, dense layers before first_k_dense_replace), sigmoid group-limited routing held fixed",
)

_LLAMA4_FF = dict(act="feed_forward.activation_fn", down="feed_forward.down_proj")
LLAMA4_TEXT = ArchitectureSpec(
    family="Llama 4", model_types=("llama4_text",), layers="layers", causal=True,
    layer=Layer(
        attention=_LLAMA_ATTENTION,
        ff=FeedForward(up="feed_forward", act="feed_forward.experts.act_fn", down="feed_forward",
                       pre_norm=Norm("post_attention_layernorm", **_RMS),
                       experts=Experts("feed_forward.experts", kind="input_scaled", router="feed_forward.router",
                                       shared=FeedForward(up="feed_forward.shared_expert.up_proj",
                                                          gate="feed_forward.shared_expert.gate_proj",
                                                          act="feed_forward.shared_expert.activation_fn",
                                                          down="feed_forward.shared_expert.down_proj"),
                                       dense=FeedForward(up="feed_forward.up_proj", gate="feed_forward.gate_proj",
                                                         **_LLAMA4_FF))),
    ),
    head=LLAMA.head,
    notes="experts on the routing-scaled input (scores held fixed, in the gate and the up pre-activations) beside "
          "an ungated shared expert, dense layers outside moe_layers; chunked local attention (mask), NoPE layers "
          "with temperature-tuned queries and L2 q/k norms inside the attention (recorded)",
)

BUILTIN: Tuple[Tuple[str, ArchitectureSpec], ...] = (
    ("seed_oss", SEED_OSS), ("ernie4_5", ERNIE4_5), ("ministral", MINISTRAL), ("ministral3", MINISTRAL3),
    ("hunyuan_v1_dense", HUNYUAN_DENSE), ("exaone4", EXAONE4), ("olmo3", OLMO3), ("cohere2", COHERE2),
    ("olmoe", OLMOE), ("ernie4_5_moe", ERNIE4_5_MOE), ("glm4_moe", GLM4_MOE), ("minimax_m2", MINIMAX_M2), ("phimoe", PHIMOE), ("arcee", ARCEE), ("apertus", APERTUS),
    ("nanochat", NANOCHAT), ("glm4", GLM4), ("vaultgemma", VAULTGEMMA), ("gpt_oss", GPT_OSS),
    ("granitemoe", GRANITE_MOE), ("deepseek_v3", DEEPSEEK_V3),
    ("llama4_text", LLAMA4_TEXT),
)

# --- refused: a mechanism no layer kind expresses yet ------------------------------------------
#: ``config.model_type`` -> (family, the mechanism no layer kind expresses yet), for the error and the docs.
#: Empty: the multimodal Qwen3.5 (qwen3_5, qwen3_5_moe) and Llama 4 (llama4) are vision-language families
#: (arch.families.vlm, docs/vlm.md).
REFUSED: Dict[str, Tuple[str, str]] = {}
