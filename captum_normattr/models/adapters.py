r"""Declarative architecture adapters: where each model family keeps its parts.

All architecture knowledge sits here. Paths are dotted attribute paths: ``layers`` from
the base model (``model.base_model``), the others from one layer module. Adding a family
is one :class:`ArchitectureAdapter` entry in :data:`ADAPTERS`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from torch import Tensor, nn

from captum_normattr.models.weights import module_tensor, weight_and_bias


@dataclass(frozen=True)
class ArchitectureAdapter:
    r"""Where one model family keeps the pieces the decompositions need.

    Attributes:
        family: readable family name.
        model_types: the ``config.model_type`` values it serves.
        layers: path of the layer list, from the base model.
        attention: path of the self-attention module (the one that calls the attention
            function), from a layer.
        attn_out: the attention output projection W_O.
        ln1: the first norm (post-LN: after attention + residual; pre-LN: before attention).
        ff_in: the first feed-forward projection W1.
        ff_act: the activation callable (attribute path).
        ff_out: the second feed-forward projection W2 (its output is FF(u), before the residual).
        ln2: the second norm.
        ff_gate: the gate projection of a gated FF, or None.
        pre_ln: True for pre-LN layers.
        norm_kind: ``"layernorm"`` or ``"rmsnorm"``.
        final_norm: path of the final norm from the base model (pre-LN), or None.
        transposed_weights: True where projections are GPT-2 ``Conv1D`` ([in, out] weights).
        max_positions_offset: positions the model reserves (RoBERTa: padding_idx + 1).
        attn_value: the value projection W_V (with b_V), from a layer, or None where no
            method needs it (DecompX propagates parts through it).
        causal: True for decoders (causal self-attention; position ids are computed from
            the attention mask so that a left-padded example gets the positions it has alone).
        lm_head: path of the unembedding (LM head) from the top model, or None.
        attn_value_slice: (index, count) where ``attn_value`` is a fused projection (GPT-2's
            ``c_attn`` computes [q, k, v]): the value projection is output slice ``index`` of
            ``count`` equal slices (see :func:`value_projection`); None for a plain projection.
        attn_scale: path of a per-channel layer scale after the attention (DINOv2's
            ``layer_scale1``), from a layer, or None. It is folded into W_O and b_O when the
            weights are read (:func:`layer_scale`), so the decompositions see it exactly.
        ff_scale: the same after the FF (``layer_scale2``): folded into W_out and b_out, and
            the recorded FF output is the scale module's output.
        modality: ``"text"`` (token ids) or ``"image"`` (pixel values; see
            :mod:`captum_normattr.attr.images`).
    """

    family: str
    model_types: Tuple[str, ...]
    layers: str
    attention: str
    attn_out: str
    ln1: str
    ff_in: str
    ff_act: str
    ff_out: str
    ln2: str
    ff_gate: Optional[str] = None
    pre_ln: bool = False
    norm_kind: str = "layernorm"
    final_norm: Optional[str] = None
    transposed_weights: bool = False
    max_positions_offset: int = 0
    attn_value: Optional[str] = None
    causal: bool = False
    lm_head: Optional[str] = None
    attn_value_slice: Optional[Tuple[int, int]] = None
    attn_scale: Optional[str] = None
    ff_scale: Optional[str] = None
    modality: str = "text"


_BERT_LIKE = dict(
    layers="encoder.layer",
    attention="attention.self",
    attn_value="attention.self.value",
    attn_out="attention.output.dense",
    ln1="attention.output.LayerNorm",
    ff_in="intermediate.dense",
    ff_act="intermediate.intermediate_act_fn",
    ff_out="output.dense",
    ln2="output.LayerNorm",
)

ADAPTERS: Dict[str, ArchitectureAdapter] = {
    "bert": ArchitectureAdapter(family="BERT", model_types=("bert",), **_BERT_LIKE),
    "roberta": ArchitectureAdapter(
        family="RoBERTa", model_types=("roberta", "xlm-roberta", "camembert"), max_positions_offset=-1, **_BERT_LIKE
    ),
    "electra": ArchitectureAdapter(family="ELECTRA", model_types=("electra",), **_BERT_LIKE),
    "distilbert": ArchitectureAdapter(
        family="DistilBERT",
        model_types=("distilbert",),
        layers="transformer.layer",
        attention="attention",
        attn_value="attention.v_lin",
        attn_out="attention.out_lin",
        ln1="sa_layer_norm",
        ff_in="ffn.lin1",
        ff_act="ffn.activation",
        ff_out="ffn.lin2",
        ln2="output_layer_norm",
    ),
    "gpt2": ArchitectureAdapter(
        family="GPT-2",
        model_types=("gpt2",),
        layers="h",
        attention="attn",
        attn_out="attn.c_proj",
        attn_value="attn.c_attn",
        attn_value_slice=(2, 3),
        ln1="ln_1",
        ff_in="mlp.c_fc",
        ff_act="mlp.act",
        ff_out="mlp.c_proj",
        ln2="ln_2",
        pre_ln=True,
        final_norm="ln_f",
        transposed_weights=True,
        causal=True,
        lm_head="lm_head",
    ),
}

#: Llama-family decoders: RMSNorm, rotary positions, grouped-query attention, SwiGLU FF.
_LLAMA_LIKE = dict(
    layers="layers",
    attention="self_attn",
    attn_value="self_attn.v_proj",
    attn_out="self_attn.o_proj",
    ln1="input_layernorm",
    ff_in="mlp.up_proj",
    ff_gate="mlp.gate_proj",
    ff_act="mlp.act_fn",
    ff_out="mlp.down_proj",
    ln2="post_attention_layernorm",
    pre_ln=True,
    norm_kind="rmsnorm",
    final_norm="norm",
    causal=True,
    lm_head="lm_head",
)
ADAPTERS["llama"] = ArchitectureAdapter(family="Llama", model_types=("llama",), **_LLAMA_LIKE)
ADAPTERS["mistral"] = ArchitectureAdapter(family="Mistral", model_types=("mistral",), **_LLAMA_LIKE)
ADAPTERS["qwen2"] = ArchitectureAdapter(family="Qwen2", model_types=("qwen2",), **_LLAMA_LIKE)


#: Vision Transformers: pre-LN, bidirectional, biases everywhere, a final LayerNorm.
_VIT_LIKE = dict(
    layers="layers",
    attention="attention",
    attn_value="attention.v_proj",
    attn_out="attention.o_proj",
    ln1="layernorm_before",
    ff_in="mlp.fc1",
    ff_act="mlp.activation_fn",
    ff_out="mlp.fc2",
    ln2="layernorm_after",
    pre_ln=True,
    final_norm="layernorm",
    modality="image",
)
ADAPTERS["vit"] = ArchitectureAdapter(family="ViT", model_types=("vit",), **_VIT_LIKE)
ADAPTERS["deit"] = ArchitectureAdapter(family="DeiT", model_types=("deit",), **_VIT_LIKE)
_DINOV2_LIKE = dict(_VIT_LIKE, layers="encoder.layer", ln1="norm1", ln2="norm2", attn_scale="layer_scale1", ff_scale="layer_scale2")
ADAPTERS["dinov2"] = ArchitectureAdapter(family="DINOv2", model_types=("dinov2",), **_DINOV2_LIKE)
ADAPTERS["dinov2_with_registers"] = ArchitectureAdapter(
    family="DINOv2 with registers", model_types=("dinov2_with_registers",), **_DINOV2_LIKE
)
#: DINOv2 with ``use_swiglu_ffn=True`` (the giant models): a gated SiLU FF.
_SWIGLU_FF = dict(ff_in="mlp.up_proj", ff_gate="mlp.gate_proj", ff_act="mlp.act_fn", ff_out="mlp.down_proj")
_CONFIG_VARIANTS = {
    ("dinov2", "use_swiglu_ffn"): ArchitectureAdapter(family="DINOv2", model_types=("dinov2",), **dict(_DINOV2_LIKE, **_SWIGLU_FF)),
    ("dinov2_with_registers", "use_swiglu_ffn"): ArchitectureAdapter(
        family="DINOv2 with registers", model_types=("dinov2_with_registers",), **dict(_DINOV2_LIKE, **_SWIGLU_FF)
    ),
}


def layer_scale(layer: nn.Module, path: Optional[str]) -> Optional[Tensor]:
    r"""The per-channel scale (D,) of a layer-scale module (DINOv2's ``lambda1``), or None without one.

    Read through :func:`~captum_normattr.models.weights.module_tensor` like every other
    weight, so a layer offloaded by accelerate (its parameters on ``meta``) gives the
    values its hook holds.

    Raises:
        WeightsNotReachableError: the scale is on ``meta`` and no accelerate hook holds it.
        ValueError: the module has no scale parameter.
    """
    if path is None:
        return None
    module = get_path(layer, path)
    for name in ("lambda1", "gamma", "scale", "weight"):
        value = module_tensor(module, name, path)
        if value is not None:
            return value
    raise ValueError(f"cannot find the scale parameter of layer-scale module {type(module).__name__} ({path})")


def supported_families() -> str:
    r"""Readable list of the supported families and their model types."""
    return ", ".join(f"{a.family} ({'/'.join(a.model_types)})" for a in ADAPTERS.values())


class UnsupportedModelError(ValueError):
    r"""Raised for a model whose architecture has no adapter."""


def unwrap_model(model: nn.Module) -> nn.Module:
    r"""The ``transformers`` model inside the wrappers that do not change what it computes.

    - ``torch.compile(model)`` (an ``OptimizedModule``): its ``_orig_mod``. The package's
      hooks run on the eager module; the numbers are those of the eager model.
    - a peft ``PeftModel`` with LoRA-type adapters (``get_peft_model``,
      ``PeftModel.from_pretrained``): ``get_base_model()``, the transformers model whose
      projections peft replaced by tuner layers; their effective weights are read by
      :func:`~captum_normattr.models.weights.module_tensor`.

    Args:
        model: any model.

    Returns:
        The innermost model (``model`` itself when it is not wrapped).

    Raises:
        UnsupportedModelError: a peft model with prompt-learning adapters (prefix / prompt /
            p-tuning), whose virtual tokens live outside the transformers model.

    Examples::

        >>> unwrap_model(torch.compile(get_peft_model(model, LoraConfig(...)))) is model
        True
    """
    for _ in range(8):  # wrappers of wrappers, bounded
        inner = model
        orig = getattr(model, "_orig_mod", None)
        if isinstance(orig, nn.Module):
            inner = orig
        elif type(model).__module__.startswith("peft.") and callable(getattr(model, "get_base_model", None)):
            config = getattr(model, "peft_config", {}).get(getattr(model, "active_adapter", None))
            if config is not None and getattr(config, "is_prompt_learning", False):
                raise UnsupportedModelError(
                    f"the peft adapter {model.active_adapter!r} is {type(config).__name__} (prompt learning: virtual "
                    "tokens added outside the transformers model), which captum_normattr cannot attribute; LoRA-type "
                    "adapters are supported"
                )
            inner = model.get_base_model()
        elif type(model).__module__.startswith("peft.tuners") and isinstance(getattr(model, "model", None), nn.Module):
            inner = model.model  # a tuner model (LoraModel, PeftModel.base_model): the transformers model it wraps
        if inner is model:
            return model
        model = inner
    return model


def get_adapter(model: nn.Module) -> ArchitectureAdapter:
    r"""The adapter for a Hugging Face model, from its ``config.model_type``.

    Args:
        model: a ``transformers`` model (base model or a model with a head), also inside a
            ``PeftModel`` or ``torch.compile`` wrapper (:func:`unwrap_model`).

    Returns:
        The matching :class:`ArchitectureAdapter`.

    Raises:
        UnsupportedModelError: naming the supported families.
    """
    model = unwrap_model(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    for adapter in ADAPTERS.values():
        if model_type in adapter.model_types:
            for (variant_type, flag), variant in _CONFIG_VARIANTS.items():
                if variant_type == model_type and getattr(config, flag, False):
                    return variant
            return adapter
    vision = ""
    if getattr(config, "patch_size", None) is not None or getattr(config, "image_size", None) is not None:
        names = ", ".join(a.family for a in ADAPTERS.values() if a.modality == "image")
        vision = f" Supported vision families: {names} (pre-LN, absolute positions; Swin, BEiT and other models with relative position biases or windowed attention are not supported)."
    raise UnsupportedModelError(
        f"captum_normattr does not support model type {model_type!r} ({type(model).__name__}). "
        f"Supported families: {supported_families()}.{vision}"
    )


def get_path(root: nn.Module, path: str):
    r"""Follow a dotted attribute path (integers index module lists)."""
    obj = root
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def base_model(model: nn.Module) -> nn.Module:
    r"""The bare Transformer inside a model with a head (``model.base_model``), wrappers removed (:func:`unwrap_model`)."""
    model = unwrap_model(model)
    return getattr(model, "base_model", model)


def layer_modules(model: nn.Module, adapter: ArchitectureAdapter):
    r"""The list of layer modules."""
    return list(get_path(base_model(model), adapter.layers))


def linear_params(module: nn.Module, transposed: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    r"""Weight as a right-multiplied (in, out) matrix, and bias.

    Args:
        module: ``nn.Linear`` (weight [out, in]) or GPT-2 ``Conv1D`` (weight [in, out]).
        transposed: True for ``Conv1D``.

    Returns:
        (W (in, out), b (out,) or None) so that module(x) = x @ W + b. The tensors are read
        wherever they live (:func:`~captum_normattr.models.weights.weight_and_bias`: also
        from the hook of a module offloaded by accelerate) and left on that device.

    Raises:
        WeightsNotReachableError: a weight on ``meta`` that no accelerate hook holds.
    """
    w, b = weight_and_bias(module)
    w = w if transposed else w.T
    return w, b


def value_projection(layer: nn.Module, adapter: ArchitectureAdapter) -> Tuple[Tensor, Optional[Tensor]]:
    r"""The value projection W_V of one layer as a right-multiplied matrix, and b_V.

    Args:
        layer: one layer module.
        adapter: its adapter (``attn_value`` must be set).

    Returns:
        (W_V (D, H_kv * Dh), b_V (H_kv * Dh,) or None); with grouped-query attention the
        columns are the key/value heads (each serves several query heads).
    """
    if adapter.attn_value is None:
        raise ValueError(f"the {adapter.family} adapter does not name the value projection (attn_value)")
    w, b = linear_params(get_path(layer, adapter.attn_value), adapter.transposed_weights)
    if adapter.attn_value_slice is not None:
        index, count = adapter.attn_value_slice
        size = w.shape[1] // count
        w = w[:, index * size : (index + 1) * size]
        b = None if b is None else b[index * size : (index + 1) * size]
    return w, b


def max_positions(model: nn.Module, adapter: ArchitectureAdapter) -> Optional[int]:
    r"""The longest input the model's position embeddings allow, or None if unbounded."""
    config = model.config
    n = getattr(config, "max_position_embeddings", None)
    if n is None:
        n = getattr(config, "n_positions", None)
    if n is None or getattr(config, "position_embedding_type", "absolute") not in ("absolute", None):
        return n
    if adapter.max_positions_offset:
        pad = getattr(config, "pad_token_id", 1) or 0
        n = n - pad - 1
    return n
