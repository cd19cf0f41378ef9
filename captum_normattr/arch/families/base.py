r"""The built-in family descriptions (one :class:`~captum_normattr.arch.spec.ArchitectureSpec` each).

Grouped by shape: BERT-like post-LN encoders, GPT-2, Llama-like decoders (RMSNorm, rotary
positions, grouped-query attention, gated FF), the Gemma decoders (``1 + w`` RMSNorm,
GeGLU, embedding scale; Gemma 2 adds sandwich norms and soft-capping), the other pre-LN
decoders (SmolLM3, StableLM's LayerNorm, Granite's multipliers and logit scaling, Phi-3's
fused projections, OLMo's parameter-free LayerNorm), GPT-NeoX (parallel residual, per-head
interleaved QKV) and Vision Transformers. ``BUILTIN`` lists them in
the order of the docs' table; :mod:`captum_normattr.arch.registry` registers them.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, Tuple

from captum_normattr.arch.spec import (
    ArchitectureSpec,
    Attention,
    ClassifierHead,
    FeedForward,
    Head,
    ImageClassifierHead,
    Inputs,
    Layer,
    Norm,
    ValueProjection,
    Variant,
)

__all__ = [
    "BERT", "BUILTIN", "DEIT", "DINOV2", "DINOV2_REGISTERS", "DISTILBERT", "ELECTRA", "GEMMA", "GEMMA2", "GPT2",
    "GPT_NEOX", "GRANITE", "LLAMA", "MISTRAL", "OLMO", "PHI3", "QWEN2", "QWEN3", "REFUSED", "ROBERTA", "SMOLLM3",
    "STABLELM", "VIT",
]

# --- post-LN encoders -------------------------------------------------------------------
_BERT_LAYER = Layer(
    attention=Attention("attention.self", out="attention.output.dense", value=ValueProjection("attention.self.value")),
    ff=FeedForward(up="intermediate.dense", act="intermediate.intermediate_act_fn", down="output.dense"),
    stream_norms=(Norm("attention.output.LayerNorm"), Norm("output.LayerNorm")),
)
BERT = ArchitectureSpec(
    family="BERT", model_types=("bert",), layers="encoder.layer", layer=_BERT_LAYER,
    head=Head(classifier=ClassifierHead(dense="base_model.pooler.dense", activation="base_model.pooler.activation",
                                        classifier="classifier")),
)
ROBERTA = ArchitectureSpec(
    family="RoBERTa", model_types=("roberta", "xlm-roberta", "camembert"), layers="encoder.layer", layer=_BERT_LAYER,
    head=Head(classifier=ClassifierHead(dense="classifier.dense", activation_fn="tanh",
                                        classifier="classifier.out_proj")),
    inputs=Inputs(max_positions_offset=-1), notes="positions offset by padding_idx + 1",
)
ELECTRA = ArchitectureSpec(
    family="ELECTRA", model_types=("electra",), layers="encoder.layer", layer=_BERT_LAYER,
    head=Head(classifier=ClassifierHead(dense="classifier.dense", activation="classifier.activation",
                                        classifier="classifier.out_proj")),
)
DISTILBERT = ArchitectureSpec(
    family="DistilBERT", model_types=("distilbert",), layers="transformer.layer",
    layer=Layer(
        attention=Attention("attention", out="attention.out_lin", value=ValueProjection("attention.v_lin")),
        ff=FeedForward(up="ffn.lin1", act="ffn.activation", down="ffn.lin2"),
        stream_norms=(Norm("sa_layer_norm"), Norm("output_layer_norm")),
    ),
    head=Head(classifier=ClassifierHead(dense="pre_classifier", activation_fn="relu", classifier="classifier")),
)

# --- decoders ---------------------------------------------------------------------------
GPT2 = ArchitectureSpec(
    family="GPT-2", model_types=("gpt2",), layers="h", causal=True, transposed_weights=True,
    layer=Layer(
        attention=Attention("attn", out="attn.c_proj", value=ValueProjection("attn.c_attn", "fused", 2, 3),
                            pre_norm=Norm("ln_1")),
        ff=FeedForward(up="mlp.c_fc", act="mlp.act", down="mlp.c_proj", pre_norm=Norm("ln_2")),
    ),
    head=Head(final_norm=Norm("ln_f"), lm_head="lm_head"),
    inputs=Inputs(token_types="word_embeddings"),
    notes="Conv1D weights, one fused q, k, v projection",
)

#: Llama-like decoder layers: RMSNorm pre-norms, rotary positions, GQA, SwiGLU FF.
_LLAMA_LAYER = Layer(
    attention=Attention("self_attn", out="self_attn.o_proj", value=ValueProjection("self_attn.v_proj"),
                        pre_norm=Norm("input_layernorm", "rmsnorm")),
    ff=FeedForward(up="mlp.up_proj", gate="mlp.gate_proj", act="mlp.act_fn", down="mlp.down_proj",
                   pre_norm=Norm("post_attention_layernorm", "rmsnorm")),
)
_LLAMA_HEAD = Head(final_norm=Norm("norm", "rmsnorm"), lm_head="lm_head")


def _llama_like(family: str, model_type: str, notes: str = "") -> ArchitectureSpec:
    return ArchitectureSpec(family=family, model_types=(model_type,), layers="layers", layer=_LLAMA_LAYER, causal=True,
                            head=_LLAMA_HEAD, notes=notes)


LLAMA = _llama_like("Llama", "llama", "SmolLM2 and other Llama checkpoints")
MISTRAL = _llama_like("Mistral", "mistral")
QWEN2 = _llama_like("Qwen2", "qwen2", "qkv biases")
QWEN3 = _llama_like("Qwen3", "qwen3", "q/k norms inside the attention (the recorded probabilities include them)")

#: Gemma: RMSNorm computing x_hat * (1 + w), GeGLU (gated FF with a tanh-GELU), sqrt(D) embedding scale.
_GEMMA_NORM = dict(kind="rmsnorm", weight_offset=1.0)
GEMMA = ArchitectureSpec(
    family="Gemma", model_types=("gemma",), layers="layers", causal=True,
    layer=Layer(
        attention=Attention("self_attn", out="self_attn.o_proj", value=ValueProjection("self_attn.v_proj"),
                            pre_norm=Norm("input_layernorm", **_GEMMA_NORM)),
        ff=FeedForward(up="mlp.up_proj", gate="mlp.gate_proj", act="mlp.act_fn", down="mlp.down_proj",
                       pre_norm=Norm("post_attention_layernorm", **_GEMMA_NORM)),
    ),
    head=Head(final_norm=Norm("norm", **_GEMMA_NORM), lm_head="lm_head"),
    inputs=Inputs(embedding_scale="sqrt(hidden_size)"),
)
#: Gemma 2: sandwich norms (pre- and post-norms on both branches), attention and final-logit soft-capping.
GEMMA2 = ArchitectureSpec(
    family="Gemma 2", model_types=("gemma2",), layers="layers", causal=True,
    layer=Layer(
        attention=Attention("self_attn", out="self_attn.o_proj", value=ValueProjection("self_attn.v_proj"),
                            pre_norm=Norm("input_layernorm", **_GEMMA_NORM),
                            post_norm=Norm("post_attention_layernorm", **_GEMMA_NORM),
                            softcap="attn_logit_softcapping"),
        ff=FeedForward(up="mlp.up_proj", gate="mlp.gate_proj", act="mlp.act_fn", down="mlp.down_proj",
                       pre_norm=Norm("pre_feedforward_layernorm", **_GEMMA_NORM),
                       post_norm=Norm("post_feedforward_layernorm", **_GEMMA_NORM)),
    ),
    head=Head(final_norm=Norm("norm", **_GEMMA_NORM), lm_head="lm_head", final_softcap="final_logit_softcapping"),
    inputs=Inputs(embedding_scale="sqrt(hidden_size)"),
    notes="sliding-window layers through the mask",
)

#: SmolLM3: Llama-like; some layers run without rotary positions (``no_rope_layers``), inside the
#: attention module, so the recorded probabilities include it.
SMOLLM3 = _llama_like("SmolLM3", "smollm3", "layers without rotary positions (no_rope_layers), recorded")

#: StableLM: LayerNorm pre-norms with biases, partial rotary positions, optional per-head q/k
#: LayerNorms (``qk_layernorm``, inside the attention: recorded); ``use_parallel_residual=True``
#: runs both branches on the one input norm (the parallel kind).
_STABLELM_ATTENTION = Attention("self_attn", out="self_attn.o_proj", value=ValueProjection("self_attn.v_proj"),
                                pre_norm=Norm("input_layernorm"))
_STABLELM_FF = FeedForward(up="mlp.up_proj", gate="mlp.gate_proj", act="mlp.act_fn", down="mlp.down_proj",
                           pre_norm=Norm("post_attention_layernorm"))
_STABLELM_HEAD = Head(final_norm=Norm("norm"), lm_head="lm_head")
STABLELM = ArchitectureSpec(
    family="StableLM", model_types=("stablelm",), layers="layers", causal=True,
    layer=Layer(attention=_STABLELM_ATTENTION, ff=_STABLELM_FF), head=_STABLELM_HEAD,
    variants=(Variant("use_parallel_residual", True, ArchitectureSpec(
        family="StableLM", model_types=("stablelm",), layers="layers", causal=True,
        layer=Layer(attention=_STABLELM_ATTENTION, ff=replace(_STABLELM_FF, pre_norm=Norm("input_layernorm")),
                    parallel=True),
        head=_STABLELM_HEAD)),),
    notes="partial rotary positions; q/k LayerNorms (qk_layernorm) recorded; use_parallel_residual: parallel kind",
)

#: Granite: Llama-like layers whose branch outputs are scaled by ``residual_multiplier`` (folded
#: into W_O and W_down), attention scaled by ``attention_multiplier`` (recorded), embeddings by
#: ``embedding_multiplier`` (before the first layer) and logits divided by ``logits_scaling``.
GRANITE = ArchitectureSpec(
    family="Granite", model_types=("granite",), layers="layers", causal=True,
    layer=Layer(
        attention=replace(_LLAMA_LAYER.attention, multiplier="residual_multiplier"),
        ff=replace(_LLAMA_LAYER.ff, multiplier="residual_multiplier"),
    ),
    head=replace(_LLAMA_HEAD, logit_divisor="logits_scaling"),
    inputs=Inputs(embedding_scale="embedding_multiplier"),
    notes="attention_multiplier as the attention scaling (recorded)",
)

#: Phi-3 (Phi-4, Phi-4-mini): one fused [q | k | v] projection with grouped-query attention and
#: one fused [gate | up] projection.
PHI3 = ArchitectureSpec(
    family="Phi-3", model_types=("phi3",), layers="layers", causal=True,
    layer=Layer(
        attention=Attention("self_attn", out="self_attn.o_proj",
                            value=ValueProjection("self_attn.qkv_proj", "fused_gqa", 2, 3),
                            pre_norm=Norm("input_layernorm", "rmsnorm")),
        ff=FeedForward(up="mlp.gate_up_proj", act="mlp.activation_fn", down="mlp.down_proj", kind="fused_gate_up",
                       pre_norm=Norm("post_attention_layernorm", "rmsnorm")),
    ),
    head=_LLAMA_HEAD,
    notes="Phi-4 checkpoints (model type phi3); partial rotary positions",
)

#: OLMo: LayerNorms without gain or bias, whose code fixes eps = 1e-5 (the module keeps none).
_OLMO_NORM = dict(kind="layernorm", eps=1e-5)
OLMO = ArchitectureSpec(
    family="OLMo", model_types=("olmo",), layers="layers", causal=True,
    layer=Layer(
        attention=replace(_LLAMA_LAYER.attention, pre_norm=Norm("input_layernorm", **_OLMO_NORM)),
        ff=replace(_LLAMA_LAYER.ff, pre_norm=Norm("post_attention_layernorm", **_OLMO_NORM)),
    ),
    head=Head(final_norm=Norm("norm", **_OLMO_NORM), lm_head="lm_head"),
    notes="LayerNorm without parameters (OLMo 2: its own entry)",
)

#: GPT-NeoX (Pythia): LayerNorm pre-norms, one fused projection laid out per head [q_h | k_h | v_h],
#: and by default parallel branches (``use_parallel_residual``).
_NEOX_ATTENTION = Attention("attention", out="attention.dense",
                            value=ValueProjection("attention.query_key_value", "interleaved", 2, 3),
                            pre_norm=Norm("input_layernorm"))
_NEOX_FF = FeedForward(up="mlp.dense_h_to_4h", act="mlp.act", down="mlp.dense_4h_to_h", pre_norm=Norm("post_attention_layernorm"))
_NEOX_HEAD = Head(final_norm=Norm("final_layer_norm"), lm_head="lm_head")  # transformers 5 (4.x: embed_out)
GPT_NEOX = ArchitectureSpec(
    family="GPT-NeoX", model_types=("gpt_neox",), layers="layers", causal=True,
    layer=Layer(attention=_NEOX_ATTENTION, ff=_NEOX_FF, parallel=True), head=_NEOX_HEAD,
    variants=(Variant("use_parallel_residual", False, ArchitectureSpec(
        family="GPT-NeoX", model_types=("gpt_neox",), layers="layers", causal=True,
        layer=Layer(attention=_NEOX_ATTENTION, ff=_NEOX_FF), head=_NEOX_HEAD)),),
    notes="Pythia; partial rotary positions",
)

# --- Vision Transformers ----------------------------------------------------------------
_VIT_LAYER = Layer(
    attention=Attention("attention", out="attention.o_proj", value=ValueProjection("attention.v_proj"),
                        pre_norm=Norm("layernorm_before")),
    ff=FeedForward(up="mlp.fc1", act="mlp.activation_fn", down="mlp.fc2", pre_norm=Norm("layernorm_after")),
)
_CLS_HEAD = "logits = W y_[CLS] + b"
_VIT_HEAD = Head(final_norm=Norm("layernorm"), image_classifiers=(
    ImageClassifierHead("ViTForImageClassification", ("classifier",), "cls", _CLS_HEAD),))
_DEIT_HEAD = Head(final_norm=Norm("layernorm"), image_classifiers=(
    ImageClassifierHead("DeiTForImageClassification", ("classifier",), "cls", _CLS_HEAD),
    ImageClassifierHead("DeiTForImageClassificationWithTeacher", ("cls_classifier", "distillation_classifier"),
                        "mean_of_heads", "logits = (W_cls y_[CLS] + b_cls + W_dist y_[DIST] + b_dist) / 2 "
                                         "(the mean of the two heads)"),
))
VIT = ArchitectureSpec(family="ViT", model_types=("vit",), layers="layers", layer=_VIT_LAYER, modality="image", head=_VIT_HEAD)
DEIT = ArchitectureSpec(
    family="DeiT", model_types=("deit",), layers="layers", layer=_VIT_LAYER, modality="image", head=_DEIT_HEAD,
    inputs=Inputs(prefix_tokens=2, prefix_names=("[CLS]", "[DIST]")), notes="a distillation token",
)
_DINOV2_LAYER = Layer(
    attention=replace(_VIT_LAYER.attention, pre_norm=Norm("norm1"), scale="layer_scale1"),
    ff=replace(_VIT_LAYER.ff, pre_norm=Norm("norm2"), scale="layer_scale2"),
)
#: DINOv2 with ``use_swiglu_ffn=True`` (the giant models): a gated SiLU FF.
_DINOV2_SWIGLU_LAYER = replace(
    _DINOV2_LAYER, ff=FeedForward(up="mlp.up_proj", gate="mlp.gate_proj", act="mlp.act_fn", down="mlp.down_proj",
                                  pre_norm=Norm("norm2"), scale="layer_scale2"),
)


def _dinov2(family: str, model_type: str, model_class: str, description: str) -> ArchitectureSpec:
    head = Head(final_norm=Norm("layernorm"), image_classifiers=(
        ImageClassifierHead(model_class, ("classifier",), "cls_and_patch_mean", description),))
    kw = dict(family=family, model_types=(model_type,), layers="encoder.layer", modality="image", head=head,
              inputs=Inputs(interpolates_positions="always"))
    return ArchitectureSpec(layer=_DINOV2_LAYER, notes="layer scale; registers", variants=(
        Variant("use_swiglu_ffn", True, ArchitectureSpec(layer=_DINOV2_SWIGLU_LAYER, **kw)),), **kw)


DINOV2 = _dinov2("DINOv2", "dinov2", "Dinov2ForImageClassification",
                 "logits = W [y_[CLS]; mean of the patch outputs] + b")
DINOV2_REGISTERS = _dinov2("DINOv2 with registers", "dinov2_with_registers", "Dinov2WithRegistersForImageClassification",
                           "logits = W [y_[CLS]; mean of the patch outputs (registers excluded)] + b")

#: Every built-in description, by registry key, in the order of the docs' table.
BUILTIN: Tuple[Tuple[str, ArchitectureSpec], ...] = (
    ("bert", BERT), ("roberta", ROBERTA), ("electra", ELECTRA), ("distilbert", DISTILBERT),
    ("gpt2", GPT2), ("llama", LLAMA), ("mistral", MISTRAL), ("qwen2", QWEN2), ("qwen3", QWEN3),
    ("gemma", GEMMA), ("gemma2", GEMMA2), ("smollm3", SMOLLM3), ("stablelm", STABLELM), ("granite", GRANITE),
    ("phi3", PHI3), ("olmo", OLMO), ("gpt_neox", GPT_NEOX),
    ("vit", VIT), ("deit", DEIT), ("dinov2", DINOV2), ("dinov2_with_registers", DINOV2_REGISTERS),
)

# --- refused on purpose -------------------------------------------------------------------
_NOT_ATTENTION = ("not an attention model: a state-space / recurrent model mixes tokens through its recurrence, not "
                  "through attention probabilities, so there are no attention maps to decompose")
_HYBRID = ("a hybrid of recurrent (state-space) and attention layers: the recurrent layers mix tokens without attention "
           "probabilities, which none of the methods can decompose")
#: ``config.model_type`` -> (family, why it is not supported), for the error message and the docs.
REFUSED: Dict[str, Tuple[str, str]] = {
    "mamba": ("Mamba", _NOT_ATTENTION), "mamba2": ("Mamba-2", _NOT_ATTENTION),
    "falcon_mamba": ("Falcon Mamba", _NOT_ATTENTION), "rwkv": ("RWKV", _NOT_ATTENTION),
    "xlstm": ("xLSTM", _NOT_ATTENTION),
    "recurrent_gemma": ("RecurrentGemma", _HYBRID), "jamba": ("Jamba", _HYBRID), "zamba": ("Zamba", _HYBRID),
    "bamba": ("Bamba", _HYBRID), "falcon_h1": ("Falcon-H1", _HYBRID), "lfm2": ("LFM2", _HYBRID),
    "swin": ("Swin", "shifted-window attention with patch merging between stages: the set of tokens changes inside the "
                     "model, so a token's contribution has no row to flow through"),
    "swinv2": ("Swin V2", "shifted-window attention with patch merging between stages (as Swin)"),
    "donut-swin": ("Donut Swin", "shifted-window attention with patch merging between stages (as Swin)"),
    "funnel": ("Funnel Transformer", "pools the sequence between blocks: tokens are merged inside the model, so a "
                                     "token's contribution has no row to flow through"),
    "albert": ("ALBERT", "one layer's weights are shared by every layer (the layer module runs several times per "
                         "forward pass), which the layer-by-layer recording does not support"),
}
