r"""Tiny-model builders of the moe family group (merged into ``zoo.BUILDERS``; see tests/zoo.py).

``BUILDERS``: registry key -> builder(head="lm" or "cls", seed=0, **config_overrides) returning a
float64 (float32 where the family's kernels refuse float64) model with perturbed weights.
Import zoo's helpers inside the builders (``from zoo import _finish``): zoo imports this module.

Mixtures of experts: 4 experts, top-2, hidden size 24, 2 layers, GQA 4/2. transformers' default
experts kernel (``grouped_mm``) refuses float64, so the float64 models run the ``eager`` experts
(the same arithmetic, one expert at a time); ``build_moe(key, dtype=torch.float32,
experts_implementation="grouped_mm")`` gives the model with its default kernel. Besides the zoo's
perturbation (2-D weights x10, norm gains, embeddings) the 3-D expert weights are scaled to the
same std 0.2 and the router weights drawn at std 1, so that tokens choose different experts
(Qwen's routers start at zero: every token would tie).
"""
from __future__ import annotations

from typing import Callable, Dict

import torch
import transformers as tf

#: model_type -> (config class, bare, causal LM, sequence classifier, config keywords)
_MOE = {
    "mixtral": (tf.MixtralConfig, tf.MixtralModel, tf.MixtralForCausalLM, tf.MixtralForSequenceClassification,
                dict(num_local_experts=4, intermediate_size=16)),
    "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeModel, tf.Qwen2MoeForCausalLM, tf.Qwen2MoeForSequenceClassification,
                  dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=20,
                       intermediate_size=40, qkv_bias=True, norm_topk_prob=False, use_sliding_window=False)),
    "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeModel, tf.Qwen3MoeForCausalLM, tf.Qwen3MoeForSequenceClassification,
                  dict(num_experts=4, moe_intermediate_size=16, intermediate_size=40, norm_topk_prob=True,
                       head_dim=6, use_sliding_window=False)),
}


def build_moe(key: str, head: str = "lm", seed: int = 0, dtype: torch.dtype = torch.float64, **extra) -> torch.nn.Module:
    r"""A tiny mixture-of-experts model (see the module docstring); ``extra`` overrides config keywords."""
    from decoder_models import VOCAB, _exact_rms_norms
    from zoo import _finish

    cfg_cls, bare, lm, cls, kw = _MOE[key]
    torch.manual_seed(seed)
    config = dict(vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  pad_token_id=0, hidden_act="silu", router_aux_loss_coef=0.0, experts_implementation="eager", **kw)
    config.update(extra)
    cfg = cfg_cls(**config)
    cfg._attn_implementation = "sdpa"
    if head == "cls":
        cfg.num_labels = 3
    model = _finish({"bare": bare, "lm": lm, "cls": cls}[head](cfg), seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif name.endswith("mlp.gate.weight"):  # the router
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    _exact_rms_norms(model)  # their RMSNorms compute in float32: made exact in float64
    return model.to(dtype)


BUILDERS: Dict[str, Callable[..., torch.nn.Module]] = {
    k: (lambda k: lambda head="lm", seed=0, **extra: build_moe(k, head, seed, **extra))(k) for k in _MOE
}
