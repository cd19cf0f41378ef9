r"""Family descriptions of the moe group (see :mod:`captum_normattr.arch.families.base` for the format).

Mixtures of experts: Llama-like pre-LN layers (RMSNorm, rotary positions, grouped-query
attention) whose feed-forward branch is a sparse block of gated experts with a top-k router
(transformers 5's fused ``*Experts``: 3-D ``gate_up_proj`` and ``down_proj``), decomposed
with the routing of the real forward pass held fixed (``docs/architectures.md``, "Mixtures
of experts"):

- Mixtral: ``mlp.experts`` routed by ``mlp.gate`` (softmax, top-k, renormalised);
- Qwen2-MoE: the same plus a shared expert ``mlp.shared_expert`` gated per token by
  ``sigmoid(mlp.shared_expert_gate(u))``; layers listed in ``mlp_only_layers`` (or off the
  ``decoder_sparse_step``) have a dense gated FF;
- Qwen3-MoE: routed experts without a shared expert, q/k norms inside the attention
  (recorded with the probabilities), dense layers as Qwen2-MoE.

``BUILTIN`` lists them by registry key; :mod:`captum_normattr.arch.registry` registers them after
the text families of :mod:`captum_normattr.arch.families.base` and before the vision ones.
"""
from __future__ import annotations

from typing import Optional, Tuple

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

__all__ = ["BUILTIN", "MIXTRAL", "QWEN2_MOE", "QWEN3_MOE"]

_ATTENTION = Attention("self_attn", out="self_attn.o_proj", value=ValueProjection("self_attn.v_proj"),
                       pre_norm=Norm("input_layernorm", "rmsnorm"))
_HEAD = Head(final_norm=Norm("norm", "rmsnorm"), lm_head="lm_head")
#: the dense gated FF of a Qwen-MoE layer without experts (and the form of the shared expert)
_DENSE = FeedForward(up="mlp.up_proj", gate="mlp.gate_proj", act="mlp.act_fn", down="mlp.down_proj")
_SHARED = FeedForward(up="mlp.shared_expert.up_proj", gate="mlp.shared_expert.gate_proj",
                      act="mlp.shared_expert.act_fn", down="mlp.shared_expert.down_proj")


def _moe(family: str, model_type: str, shared: Optional[FeedForward], shared_gate: Optional[str],
         dense: Optional[FeedForward], notes: str) -> ArchitectureSpec:
    ff = FeedForward(up="mlp", act="mlp.experts.act_fn", down="mlp",
                     experts=Experts("mlp.experts", shared=shared, shared_gate=shared_gate, dense=dense),
                     pre_norm=Norm("post_attention_layernorm", "rmsnorm"))
    return ArchitectureSpec(family=family, model_types=(model_type,), layers="layers", causal=True,
                            layer=Layer(attention=_ATTENTION, ff=ff), head=_HEAD, notes=notes)


MIXTRAL = _moe("Mixtral", "mixtral", None, None, None,
               "top-k routing of the real forward pass held fixed; sliding windows through the mask")
QWEN2_MOE = _moe("Qwen2-MoE", "qwen2_moe", _SHARED, "mlp.shared_expert_gate", _DENSE,
                 "qkv biases; shared expert gated by sigmoid(u w_s) per token, held fixed; dense mlp_only_layers")
QWEN3_MOE = _moe("Qwen3-MoE", "qwen3_moe", None, None, _DENSE,
                 "q/k norms inside the attention (recorded); dense mlp_only_layers")

BUILTIN: Tuple[Tuple[str, ArchitectureSpec], ...] = (
    ("mixtral", MIXTRAL),
    ("qwen2_moe", QWEN2_MOE),
    ("qwen3_moe", QWEN3_MOE),
)
