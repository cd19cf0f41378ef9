r"""Bare decoders of the frontier mechanisms (issue #34), shaped like the Llama config of the benchmarks.

:func:`frontier_model` builds, from transformers configs (random weights, seeded, float32, no hub), the bare
``*Model`` of one of :data:`FRONTIER_FAMILIES` at the width, heads and FF width of a Llama config (e.g. the small
shape of ``memory_engine.py``'s depth section: hidden 256, 8 heads, 4 key/value heads, FF 704, vocab 1000):

- ``gpt_oss``: learned attention sinks (drawn at std 1, so that they take a visible share), q/k/v/o biases,
  every other layer sliding (window 128), the model's own eager attention (GPT-OSS has no sdpa); 4 clamped
  SwiGLU experts with biases, top-2, each of half the Llama FF width, a router with a bias, ``swiglu_limit`` 7
  (its default);
- ``deepseek_v3``: multi-head latent attention (q_lora_rank hidden/2, kv_lora_rank hidden/4, a 16-wide rotary
  key part, 32-wide no-rope query/key and value heads, as many key/value heads as heads), layer 0 dense (the
  Llama FF), then 4 routed experts (sigmoid, group-limited top-2 over 2 groups, a correction bias, a routed
  scale 2.5) of half the FF width beside one shared expert of half the width; sdpa;
- ``llama4_text``: chunked local attention (chunks of 256 tokens, every layer but the NoPE ones) with L2 q/k
  norms, every 2nd layer NoPE (no rotary, no temperature tuning); 4 input-scaled experts (sigmoid top-1) of
  half the FF width beside a shared expert of half the width on every layer; sdpa;
- ``granitemoe``: Mixtral's experts block (4 experts, top-2, half the FF width) with the residual, embedding
  and attention multipliers of Granite; sdpa;
- ``qwen3_5_text``: Qwen3.5's hybrid, three Gated DeltaNet layers per gated full-attention layer (transformers'
  default ``full_attention_interval`` 4); the DeltaNet with half as many key heads as the Llama's heads and as
  many value heads, both of the Llama's head size (its value channels span the width), kernel 4; the Llama FF as
  a SwiGLU; sdpa. Its delta-rule kernel runs transformers' torch fallback (no flash-linear-attention).
- ``granitemoehybrid`` (Granite 4, dense): Mamba-2 layers (as many heads as the attention, expand 2, one group,
  state 64, kernel 4, chunk 64, no convolution bias) and attention layers alternating, the shared MLP of the Llama
  FF width, Granite's multipliers; the Mamba-2 torch path, sdpa;
- ``kimi_linear`` (Kimi Linear, dense): Kimi delta attention layers and multi-head latent attention layers
  alternating (delta attention first: 2 layers are one of each; Kimi Linear's own ratio is 3:1); the delta
  attention with as many heads as the Llama's, of its head size (``linear_num_heads`` heads x ``linear_head_dim``
  = the width), kernel 4; the latent attention shaped as ``deepseek_v3``'s but without low-rank queries (Kimi's
  ``q_lora_rank`` None) and NoPE (Kimi applies no rotary); every FF the dense Llama SwiGLU (``mlp_layer_types``
  all ``"dense"``: no experts, so that the mixers alone differ from Llama); the delta rule runs transformers'
  torch path (``chunk_kimi_delta_attention``; no flash-linear-attention), in float32;
- ``lfm2`` (LFM2): gated short-convolution layers (``"conv"``, kernel ``conv_L_cache`` 3, no bias) and
  grouped-query attention layers (q/k norms) alternating, convolution first (LFM2's own ratio is about 10:6); the
  Llama FF width as a SwiGLU (``block_auto_adjust_ff_dim`` off); the convolution's torch path (``F.conv1d``), sdpa.

The experts run transformers' default kernel (``grouped_mm`` where the family has it), as the Mixtral figures
of ``_bench.family_model``; routers are drawn at std 1 so that tokens choose different experts.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from _bench import DECODER_FAMILIES, family_model

__all__ = ["ALL_FAMILIES", "FRONTIER_FAMILIES", "any_family_model", "frontier_model"]

#: the frontier families :func:`frontier_model` builds (one per new mechanism of issue #34)
FRONTIER_FAMILIES = ("gpt_oss", "deepseek_v3", "llama4_text", "granitemoe", "qwen3_5_text", "granitemoehybrid",
                     "kimi_linear", "lfm2")
#: every family the decoder benchmarks build: ``_bench.DECODER_FAMILIES`` and :data:`FRONTIER_FAMILIES`
ALL_FAMILIES = DECODER_FAMILIES + FRONTIER_FAMILIES


def any_family_model(family: str, config: Mapping[str, Any], layers: Optional[int] = None, seed: int = 0):
    r"""``_bench.family_model`` for its families, :func:`frontier_model` for the frontier ones.

    Args:
        family (str): one of :data:`ALL_FAMILIES`.
        config (Mapping[str, Any]): ``LlamaConfig`` keyword arguments.
        layers (int, optional): ``num_hidden_layers`` instead of the config's. Default: None.
        seed (int, optional): the weights' seed. Default: 0.

    Returns:
        The bare model, float32, on the CPU.
    """
    if family in FRONTIER_FAMILIES:
        return frontier_model(family, config, layers, seed)
    return family_model(family, config, layers, seed)


def frontier_model(family: str, config: Mapping[str, Any], layers: Optional[int] = None, seed: int = 0):
    r"""A bare decoder of a frontier ``family`` shaped like the Llama ``config``, random weights, eval mode.

    Args:
        family (str): one of :data:`FRONTIER_FAMILIES` (see the module docstring for each shape).
        config (Mapping[str, Any]): ``LlamaConfig`` keyword arguments (hidden, heads, key/value heads, FF width,
            vocabulary, positions).
        layers (int, optional): ``num_hidden_layers`` instead of the config's. Default: None.
        seed (int, optional): ``torch.manual_seed`` before the weights are drawn. Default: 0.

    Returns:
        The bare model, float32, on the CPU.

    Raises:
        ValueError: for a family not in :data:`FRONTIER_FAMILIES`.

    Examples::

        >>> m = frontier_model("granitemoe", dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        ...                    intermediate_size=64, vocab_size=100), layers=2)  # doctest: +SKIP
        >>> type(m).__name__  # doctest: +SKIP
        'GraniteMoeModel'
    """
    import transformers as tf

    cfg = {**config, **({} if layers is None else {"num_hidden_layers": layers})}
    n_layers = int(cfg.get("num_hidden_layers", 2))
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads", heads))
    ff = int(cfg["intermediate_size"])
    half = ff // 2
    common = dict(hidden_size=hidden, num_hidden_layers=n_layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, vocab_size=int(cfg["vocab_size"]),
                  max_position_embeddings=int(cfg.get("max_position_embeddings", 16384)),
                  router_aux_loss_coef=0.0, tie_word_embeddings=True)
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    attn = "sdpa"
    if family == "gpt_oss":
        config_obj = tf.GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=2, intermediate_size=half,
                                     head_dim=hidden // heads, sliding_window=128, layer_types=alternating)
        cls, attn = tf.GptOssModel, "eager"
    elif family == "deepseek_v3":
        common["num_key_value_heads"] = heads
        config_obj = tf.DeepseekV3Config(
            **common, intermediate_size=ff, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=half,
            n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, q_lora_rank=hidden // 2, kv_lora_rank=hidden // 4, qk_rope_head_dim=16,
            qk_nope_head_dim=32, v_head_dim=32)
        cls = tf.DeepseekV3Model
    elif family == "llama4_text":
        config_obj = tf.Llama4TextConfig(
            **common, head_dim=hidden // heads, num_local_experts=4, num_experts_per_tok=1, intermediate_size=half,
            intermediate_size_mlp=ff, moe_layers=list(range(n_layers)), no_rope_layer_interval=2,
            attention_chunk_size=256, attn_temperature_tuning=False)
        cls = tf.Llama4TextModel
    elif family == "granitemoe":
        config_obj = tf.GraniteMoeConfig(**common, num_local_experts=4, num_experts_per_tok=2, intermediate_size=half,
                                         residual_multiplier=0.6, embedding_multiplier=3.0, attention_multiplier=0.1)
        cls = tf.GraniteMoeModel
    elif family == "qwen3_5_text":
        dh = hidden // heads
        config_obj = tf.Qwen3_5TextConfig(
            **common, head_dim=dh, intermediate_size=ff, linear_num_key_heads=max(1, heads // 2),
            linear_num_value_heads=heads, linear_key_head_dim=dh, linear_value_head_dim=dh, linear_conv_kernel_dim=4,
            layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n_layers)])
        cls = tf.Qwen3_5TextModel
    elif family == "granitemoehybrid":
        common.pop("router_aux_loss_coef")
        config_obj = tf.GraniteMoeHybridConfig(
            **common, intermediate_size=ff, shared_intermediate_size=ff, num_local_experts=0, num_experts_per_tok=0,
            layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)],
            mamba_n_heads=heads, mamba_d_head=2 * hidden // heads, mamba_n_groups=1, mamba_d_state=64,
            mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64, mamba_conv_bias=False, mamba_proj_bias=False,
            residual_multiplier=0.6, embedding_multiplier=3.0, attention_multiplier=0.1,
            position_embedding_type="rope")
        cls = tf.GraniteMoeHybridModel
    elif family == "kimi_linear":
        common.pop("router_aux_loss_coef")
        common["num_key_value_heads"] = heads
        config_obj = tf.KimiLinearConfig(
            **common, intermediate_size=ff, moe_intermediate_size=half, num_local_experts=4, num_experts_per_tok=2,
            mlp_layer_types=["dense"] * n_layers, kv_lora_rank=hidden // 4, q_lora_rank=None, qk_rope_head_dim=16,
            qk_nope_head_dim=32, v_head_dim=32, linear_num_heads=heads, linear_head_dim=hidden // heads,
            linear_conv_kernel_dim=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)])
        cls = tf.KimiLinearModel
    elif family == "lfm2":
        common.pop("router_aux_loss_coef")
        config_obj = tf.Lfm2Config(
            **common, intermediate_size=ff, block_auto_adjust_ff_dim=False, conv_L_cache=3, conv_bias=False,
            layer_types=["conv" if i % 2 == 0 else "full_attention" for i in range(n_layers)])
        cls = tf.Lfm2Model
    else:
        raise ValueError(f"unknown frontier family {family!r}; choose from {FRONTIER_FAMILIES}")
    torch.manual_seed(seed)
    config_obj._attn_implementation = attn
    model = cls(config_obj).eval()
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight", "block_sparse_moe.router.weight",
                              "feed_forward.router.weight", "self_attn.sinks")):  # routers and sink logits
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
        for name, b in model.named_buffers():  # the sigmoid routers' correction biases change the choice only
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g, dtype=b.dtype))
    return model
