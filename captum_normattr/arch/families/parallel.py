r"""Family descriptions of the parallel group (see :mod:`captum_normattr.arch.families.base` for the format).

Decoders whose layers run attention and feed-forward side by side on the layer input,
y = x + Attn(N1(x)) + FF(N2(x)) (the ``parallel`` layer kind, as GPT-NeoX):

- Phi-2 (``phi``): one LayerNorm feeding both branches, q/k/v projections with biases,
  partial rotary positions, optional per-head q/k LayerNorms (inside the attention: the
  recorded probabilities include them), an LM head with a bias.
- GPT-J (``gptj``): one LayerNorm (``ln_1``) feeding both branches, no biases on q/k/v/out,
  rotary positions on part of each head (recorded), an LM head with a bias.
- Falcon (``falcon``): one fused ``query_key_value`` whose layout depends on the config:
  the new decoder architecture (Falcon-40B/180B, Falcon 2) groups it per key/value head
  [q_1 .. q_g | k | v] and has two norms (``ln_attn``, ``ln_mlp``) or, with
  ``num_ln_in_parallel_attn=1``, one; the original one is multi-query ([q | k | v] with one
  key/value head, Falcon-7B) or per head [q_h | k_h | v_h] (``multi_query=False``), with
  parallel branches on one norm or, with ``parallel_attn=False`` (Falcon-RW), a sequential
  pre-LN layer. ALiBi models add their position bias to the attention mask, which the
  recording attention adds as the model does. The layer adds the attention output to the FF
  output in place (``mlp_output += attention_output``); the recorder sees that through the
  version counter and records the FF output as a copy.
- Cohere (``cohere``): one LayerNorm without bias feeding both branches, a gated FF, optional
  q/k LayerNorms (recorded), tied embeddings, logits multiplied by ``logit_scale`` (folded
  into the explained direction: the explained logit is the model's own output logit).

``BUILTIN`` lists them by registry key; :mod:`captum_normattr.arch.registry` registers them after
the text families of :mod:`captum_normattr.arch.families.base` and before the vision ones.
"""
from __future__ import annotations

from typing import Tuple

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

__all__ = ["BUILTIN", "COHERE", "FALCON", "GPTJ", "PHI"]

# --- Phi-2 --------------------------------------------------------------------------------
_PHI_NORM = Norm("input_layernorm")
PHI = ArchitectureSpec(
    family="Phi-2", model_types=("phi",), layers="layers", causal=True,
    layer=Layer(
        attention=Attention("self_attn", out="self_attn.dense", value=ValueProjection("self_attn.v_proj"),
                            pre_norm=_PHI_NORM),
        ff=FeedForward(up="mlp.fc1", act="mlp.activation_fn", down="mlp.fc2", pre_norm=_PHI_NORM),
        parallel=True,
    ),
    head=Head(final_norm=Norm("final_layernorm"), lm_head="lm_head"),
    notes="Phi-1, Phi-1.5, Phi-2; one norm for both branches; partial rotary; q/k LayerNorms (qk_layernorm) recorded",
)

# --- GPT-J --------------------------------------------------------------------------------
_GPTJ_NORM = Norm("ln_1")
GPTJ = ArchitectureSpec(
    family="GPT-J", model_types=("gptj",), layers="h", causal=True,
    layer=Layer(
        attention=Attention("attn", out="attn.out_proj", value=ValueProjection("attn.v_proj"), pre_norm=_GPTJ_NORM),
        ff=FeedForward(up="mlp.fc_in", act="mlp.act", down="mlp.fc_out", pre_norm=_GPTJ_NORM),
        parallel=True,
    ),
    head=Head(final_norm=Norm("ln_f"), lm_head="lm_head"),
    inputs=Inputs(token_types="word_embeddings"),
    notes="one norm for both branches; rotary on rotary_dim channels of each head (interleaved pairs), recorded",
)

# --- Falcon -------------------------------------------------------------------------------
_FALCON_FF = dict(up="mlp.dense_h_to_4h", act="mlp.act", down="mlp.dense_4h_to_h")
_FALCON_HEAD = Head(final_norm=Norm("ln_f"), lm_head="lm_head")
_FALCON_QKV = "self_attention.query_key_value"


def _falcon(value: ValueProjection, attn_norm: str, ff_norm: str, parallel: bool = True,
            variants: Tuple[Variant, ...] = (), notes: str = "") -> ArchitectureSpec:
    return ArchitectureSpec(
        family="Falcon", model_types=("falcon",), layers="h", causal=True,
        layer=Layer(
            attention=Attention("self_attention", out="self_attention.dense", value=value, pre_norm=Norm(attn_norm)),
            ff=FeedForward(pre_norm=Norm(ff_norm), **_FALCON_FF),
            parallel=parallel,
        ),
        head=_FALCON_HEAD, variants=variants, notes=notes,
    )


#: the original architecture's value layouts: multi-query [q (H Dh) | k (Dh) | v (Dh)], or per head [q_h | k_h | v_h]
_FALCON_MQA = ValueProjection(_FALCON_QKV, "fused_gqa", 2, 3)
_FALCON_PER_HEAD = ValueProjection(_FALCON_QKV, "interleaved", 2, 3)
#: the new decoder architecture: per key/value head, its query heads, its key and its value
_FALCON_GROUPED = ValueProjection(_FALCON_QKV, "grouped", 2, 3)

FALCON = _falcon(
    _FALCON_MQA, "input_layernorm", "input_layernorm",
    variants=(
        # Falcon-40B/180B, Falcon 2: grouped fused QKV, two norms (ln_attn, ln_mlp) or one (num_ln_in_parallel_attn=1);
        # the layer is parallel whatever parallel_attn says (transformers' Falcon code)
        Variant("new_decoder_architecture", True, _falcon(
            _FALCON_GROUPED, "ln_attn", "ln_mlp",
            variants=(Variant("num_ln_in_parallel_attn", 1, _falcon(_FALCON_GROUPED, "input_layernorm", "input_layernorm")),),
        )),
        # the original architecture without multi-query: per-head interleaved QKV; sequential with parallel_attn=False
        Variant("multi_query", False, _falcon(
            _FALCON_PER_HEAD, "input_layernorm", "input_layernorm",
            variants=(Variant("parallel_attn", False, _falcon(
                _FALCON_PER_HEAD, "input_layernorm", "post_attention_layernorm", parallel=False)),),
        )),
        # multi-query, sequential (parallel_attn=False): a pre-LN layer
        Variant("parallel_attn", False, _falcon(_FALCON_MQA, "input_layernorm", "post_attention_layernorm", parallel=False)),
    ),
    notes="config variants: new_decoder_architecture (QKV grouped per key/value head, ln_attn/ln_mlp or one norm), "
          "multi_query (one key/value head) or per-head QKV, parallel_attn=False (Falcon-RW: pre-LN kind); ALiBi "
          "through the mask, recorded; the in-place `mlp_output += attention_output` is recorded as a copy",
)

# --- Cohere -------------------------------------------------------------------------------
_COHERE_NORM = Norm("input_layernorm")
COHERE = ArchitectureSpec(
    family="Cohere", model_types=("cohere",), layers="layers", causal=True,
    layer=Layer(
        attention=Attention("self_attn", out="self_attn.o_proj", value=ValueProjection("self_attn.v_proj"),
                            pre_norm=_COHERE_NORM),
        ff=FeedForward(up="mlp.up_proj", gate="mlp.gate_proj", act="mlp.act_fn", down="mlp.down_proj",
                       pre_norm=_COHERE_NORM),
        parallel=True,
    ),
    head=Head(final_norm=Norm("norm"), lm_head="lm_head", logit_multiplier="logit_scale"),
    notes="Command R; LayerNorm without bias (computed in float32 by the model); q/k LayerNorms (use_qk_norm) "
          "recorded; logits times logit_scale",
)

BUILTIN: Tuple[Tuple[str, ArchitectureSpec], ...] = (
    ("phi", PHI), ("gptj", GPTJ), ("falcon", FALCON), ("cohere", COHERE),
)
