r"""DecompX end to end through a vision-language model: the generated token's logit shared out over image patches.

A LLaVA model (``LlavaForConditionalGeneration``) runs its vision tower on ``pixel_values``, takes the
tower's hidden states of ``config.vision_feature_layer`` (the [CLS] feature dropped under the
``"default"`` strategy), maps each through the projector (Linear, activation, Linear) and writes the
results into the embeddings of the image tokens. DecompX decomposes the language model at its input
(``docs/vlm.md``); this module carries the decomposition on, through the projector and the tower, to
the image patches (``docs/vlm_end_to_end.md``):

1. the tower: every patch's own patch embedding (its pixels through the patch convolution) is one
   source; the class embedding, the position embeddings and the convolution's bias are no-token
   sources; DecompX's forward algorithm carries them through the tower's layers (the package's
   recording of the tower: attention probabilities, norm scales and activation slopes at their real
   values) up to the selected layer: each selected feature is the sum of its sources' parts plus a
   bias part;
2. the projector: each part through ``linear_1``, the activation frozen at its real per-unit slope
   (g(u) - g(0)) / u (DecompX's frozen elementwise feed-forward rule), ``linear_2``; its own biases
   (and g(0)) are a further no-token source;
3. the language model: DecompX's adjoint (:meth:`~captum_normattr.attr.decompx.DecompXAttribution.input_cotangents`)
   gives the cotangent g_k (a (D,) vector) at every input
   embedding e_k, and token k's DecompX score is g_k . e_k ("separate" bias mode); an image token's
   embedding being the sum of its parts, each part's share is g_k . part.

Everything is exact: patch scores + text-token scores + every no-token term == the model's logit
(up to the Gauss-Legendre quadrature of a gated decoder FF, as for DecompX itself).

Towers: CLIP (``clip_vision_model``) and SigLIP (``siglip_vision_model``) vision models, whose layers
are pre-LN ViT layers. Others are refused (:data:`TOWERS`). Qwen2-VL and Qwen2.5-VL (a packed tower and a
patch merger) go end to end by :func:`captum_normattr.attr.vlm_end_to_end_qwen.merged_patch_contributions`,
which shares this module's frozen MLP rule (:func:`frozen_mlp_parts`); PaliGemma, Gemma 3, Idefics3 and SmolVLM
(SigLIP towers) by :func:`captum_normattr.attr.vlm_end_to_end_siglip.siglip_patch_contributions`, which shares the
tower's parts (:func:`vision_tower_parts`) and the cotangent readout (:func:`image_token_contributions`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from captum.log import log_usage
from torch import Tensor, nn

from captum_normattr.arch.spec import ArchitectureSpec, Attention, FeedForward, Layer, Norm, ValueProjection
from captum_normattr.attr.decompx import DecompXAttribution
from captum_normattr.decompose.kinds.registry import layer_kind
from captum_normattr.decompose.methods.decompx.parts import activation_slopes, ff_coefficients
from captum_normattr.decompose.primitives.gated_feed_forward import DEFAULT_NODES
from captum_normattr.decompose.records import LayerTensors
from captum_normattr.models.adapters import layer_modules, unwrap_model, value_projection, vision_language
from captum_normattr.models.capture.session import recording
from captum_normattr.models.engine import compute_dtype

__all__ = ["TOWERS", "PatchContributions", "TowerParts", "cotangents_and_projector_input", "frozen_mlp_parts",
           "image_token_contributions", "image_token_id",
           "patch_contributions", "projector_parts", "relative_difference", "tower_description", "tower_parts",
           "vision_tower_parts"]

#: The vision towers decomposed end to end: ``config.model_type`` -> the tower's layer description
#: (all are pre-LN ViT layers: ``layer_norm1``, ``self_attn``, ``layer_norm2``, ``mlp``; Idefics3's and SmolVLM's
#: are SigLIP's with position ids read from the patch mask).
_TOWER_LAYER = Layer(
    attention=Attention("self_attn", out="self_attn.out_proj", value=ValueProjection("self_attn.v_proj"),
                        pre_norm=Norm("layer_norm1")),
    ff=FeedForward(up="mlp.fc1", act="mlp.activation_fn", down="mlp.fc2", pre_norm=Norm("layer_norm2")),
)
TOWERS: Dict[str, ArchitectureSpec] = {
    t: ArchitectureSpec(family=f"{name} vision tower", model_types=(t,), layers="encoder.layers", layer=_TOWER_LAYER,
                        modality="image")
    for t, name in (("clip_vision_model", "CLIP"), ("siglip_vision_model", "SigLIP"),
                    ("idefics3_vision", "Idefics3 (SigLIP)"), ("smolvlm_vision", "SmolVLM (SigLIP)"))
}

#: Relative tolerance of the checks of the rebuilt features and embeddings against the model's own.
_CHECK = {torch.float64: 1e-9, torch.float32: 1e-3}


@dataclass
class TowerParts:
    r"""The selected tower features of every image as sums of per-source parts.

    Attributes:
        parts: (n_images, N, S, D_v) the part of each selected feature (N per image) from each
            source: the P patches (row-major), then :attr:`no_token` sources.
        bias: (n_images, N, D_v) the tower's bias part (its layers' biases, norm shifts).
        grid: (rows, cols) of the patch grid.
        no_token: names of the no-token sources after the patches (``"class_embedding"``,
            ``"position_embeddings"``, ``"patch_embedding_bias"``: those the tower has).
        features: (n_images, N, D_v) the real selected features (what the projector reads).
        error: the largest |parts + bias - features|.
    """

    parts: Tensor
    bias: Tensor
    grid: Tuple[int, int]
    no_token: Tuple[str, ...]
    features: Tensor
    error: float


@dataclass
class PatchContributions:
    r"""The explained logit of a LLaVA model shared out over image patches, text tokens and no-token terms.

    ``patch_scores.sum() + text_scores.sum() + sum(no_token.values())`` equals ``logit`` per example
    (:attr:`delta`).

    Attributes:
        patch_scores: (n_images, rows, cols) every patch's score (images in the model's order).
        image_example: (n_images,) the example each image belongs to.
        text_scores: (B, T) the scores of the other tokens (image tokens and pads: 0).
        image_token_scores: (B, T) DecompX's scores of the image tokens at the language model's input
            (g_k . e_k; other tokens 0): each is the sum of its row of :attr:`token_sources`.
        token_sources: (n_images, N, S + 2) each image token's score from each source: the patches,
            the tower's no-token sources, the tower's biases, the projector's biases (:attr:`source_names`).
        source_names: the S + 2 names: ``"(r,c)"`` per patch, then the no-token names.
        no_token: (B,) per no-token term: the tower's embedding sources (``"class_embedding"``,
            ``"position_embeddings"``, ``"patch_embedding_bias"`` where present), ``"tower_biases"``,
            ``"projector_biases"``, ``"language_model_biases"`` (DecompX's bias score).
        logit: (B,) the explained logit (the model's own).
        delta: (B,) |sum of all scores and no-token terms - logit|.
        target: (B,) the explained token ids; explained_position: (B,) their positions.
        checks: the largest relative differences of the rebuilt tower features and image-token
            embeddings from the model's own (``"features"``, ``"embeddings"``).
    """

    patch_scores: Tensor
    image_example: Tensor
    text_scores: Tensor
    image_token_scores: Tensor
    token_sources: Tensor
    source_names: Tuple[str, ...]
    no_token: Dict[str, Tensor]
    logit: Tensor
    delta: Tensor
    target: Tensor
    explained_position: Tensor
    checks: Dict[str, float] = field(default_factory=dict)


def _tower_and_description(model: nn.Module) -> Tuple[nn.Module, nn.Module, ArchitectureSpec]:
    r"""(the LLaVA base model, its vision tower, the tower's description); refuses what is not decomposed."""
    model = unwrap_model(model)
    description = vision_language(model)
    if description is None or description.family != "LLaVA":
        raise ValueError(
            f"patch_contributions carries LLaVA (LlavaForConditionalGeneration) to the patches; {type(model).__name__} "
            "is not one. Qwen2-VL and Qwen2.5-VL: vlm_end_to_end_qwen.merged_patch_contributions (their images come "
            "with image_grid_thw); PaliGemma, Gemma 3, Idefics3, SmolVLM: "
            "vlm_end_to_end_siglip.siglip_patch_contributions; docs/vlm_end_to_end.md says which families stop at the "
            "language model's input and why")
    base = model.model
    tower = base.vision_tower
    spec = tower_description(tower)
    if not isinstance(model.config.vision_feature_layer, (int, list, tuple)):
        raise ValueError(f"unsupported vision_feature_layer {model.config.vision_feature_layer!r}")
    return base, tower, spec


def tower_description(tower: nn.Module) -> ArchitectureSpec:
    r"""The layer description of a vision tower the package decomposes end to end (:data:`TOWERS`).

    Args:
        tower: a vision model (``CLIPVisionModel``, ``SiglipVisionModel``).

    Returns:
        its :class:`~captum_normattr.arch.spec.ArchitectureSpec`.

    Raises:
        ValueError: a tower that is not described, naming those that are.
    """
    kind = getattr(getattr(tower, "config", None), "model_type", None)
    if kind not in TOWERS:
        raise ValueError(
            f"the vision tower {type(tower).__name__} ({kind!r}) is not one the package decomposes end to end; "
            f"decomposed towers: {sorted(TOWERS)} (docs/vlm_end_to_end.md). Its image tokens' scores at the "
            "language model's input are available from DecompXAttribution (docs/vlm.md)")
    return TOWERS[kind]


def _frozen_layernorm_parts(x_real: Tensor, norm: nn.LayerNorm, parts: Tensor) -> Tensor:
    r"""Parts (..., T, S, D) through a LayerNorm frozen at the real per-token scale of ``x_real`` (..., T, D), no shift."""
    sigma = torch.sqrt(x_real.var(-1, unbiased=False, keepdim=True) + norm.eps).unsqueeze(-2)
    centred = parts - parts.mean(-1, keepdim=True)
    w = norm.weight.to(parts.dtype) if norm.weight is not None else 1.0
    return centred / sigma * w


def _embedding_sources(tower: nn.Module, pixel_values: Tensor, dtype: torch.dtype,
                       positions: Optional[Tensor] = None) -> Tuple[Tensor, Tuple[str, ...], Tuple[int, int]]:
    r"""(sources (n, T, S, D) of the tower's embedding output, the no-token source names, the patch grid): each patch its
    own patch embedding, then the class embedding (CLIP), the position embeddings and the patch bias.

    ``positions``: (1 or n, T, D) what the tower's position embedding gave in its own forward (Idefics3 / SmolVLM
    derive the position ids from the patch mask); None: its weight, one row per token."""
    emb = tower.embeddings
    conv = emb.patch_embedding
    w = conv.weight.to(dtype)
    patches = torch.nn.functional.conv2d(pixel_values.to(dtype), w, None, stride=conv.stride, padding=conv.padding)
    grid = tuple(patches.shape[-2:])
    patches = patches.flatten(2).transpose(1, 2)  # (n, P, D)
    n, p, d = patches.shape
    lead = int(hasattr(emb, "class_embedding"))
    t = lead + p
    positions = emb.position_embedding.weight.to(dtype) if positions is None else positions.to(dtype)
    if positions.shape[-2] != t:
        raise ValueError(f"the tower has {positions.shape[-2]} position embeddings for {t} tokens: images of another "
                         "size (interpolated positions) are not supported end to end")
    names: List[str] = []
    extra: List[Tensor] = []
    if lead:
        cls = torch.zeros(t, d, dtype=dtype, device=patches.device)
        cls[0] = emb.class_embedding.to(dtype)
        extra.append(cls)
        names.append("class_embedding")
    extra.append(positions)
    names.append("position_embeddings")
    if conv.bias is not None:
        b = torch.zeros(t, d, dtype=dtype, device=patches.device)
        b[lead:] = conv.bias.to(dtype)
        extra.append(b)
        names.append("patch_embedding_bias")
    src = patches.new_zeros(n, t, p + len(extra), d)
    idx = torch.arange(p, device=patches.device)
    src[:, lead + idx, idx] = patches
    for j, e in enumerate(extra):
        src[:, :, p + j] = e.expand(n, t, d) if e.dim() == 3 else e
    return src, tuple(names), grid


def tower_parts(model: nn.Module, pixel_values: Tensor, memory_budget_mb: float = 256.0) -> TowerParts:
    r"""The selected features of a LLaVA model's vision tower as sums of per-patch parts (DecompX's forward algorithm).

    Args:
        model: a ``LlavaForConditionalGeneration`` with a CLIP or SigLIP tower (:data:`TOWERS`).
        pixel_values: (n_images, C, H, W) at the tower's image size.
        memory_budget_mb: bound on the temporary tensors of one layer step.

    Returns:
        :class:`TowerParts` of the features the projector reads (``vision_feature_layer``; several
        layers concatenated along the width; the first feature dropped under ``"default"``).

    Raises:
        ValueError: not LLaVA, a tower the package does not decompose, interpolated positions.

    Examples::

        >>> tp = tower_parts(llava, pixel_values)
        >>> (tp.parts.sum(2) + tp.bias - tp.features).abs().max()  # rounding
    """
    with torch.no_grad():
        return _tower_parts(model, pixel_values, memory_budget_mb)


def _tower_parts(model: nn.Module, pixel_values: Tensor, memory_budget_mb: float) -> TowerParts:
    model = unwrap_model(model)
    _, tower, _ = _tower_and_description(model)
    layers_wanted = model.config.vision_feature_layer
    layers_wanted = [layers_wanted] if isinstance(layers_wanted, int) else list(layers_wanted)
    drop = int(model.config.vision_feature_select_strategy == "default")
    return vision_tower_parts(tower, pixel_values, layers_wanted, compute_dtype(model), drop, memory_budget_mb)


def vision_tower_parts(tower: nn.Module, pixel_values: Tensor, hidden_states: Sequence[int], dtype: torch.dtype,
                       drop: int = 0, memory_budget_mb: float = 256.0) -> TowerParts:
    r"""Hidden states of a CLIP or SigLIP vision tower as sums of per-patch parts (DecompX's forward algorithm).

    Shared by every family whose tower is a described ViT (:data:`TOWERS`): LLaVA (:func:`tower_parts`),
    PaliGemma and Gemma 3 (:mod:`captum_normattr.attr.vlm_end_to_end_siglip`).

    Args:
        tower: the vision model (:func:`tower_description` must know it).
        pixel_values: (n_images, C, H, W) at the tower's image size.
        hidden_states: the hidden-state indices wanted (0: the first layer's input; negative from the end,
            ``-1``: the last layer's output, before any post-layernorm); several are concatenated along the width.
        dtype: the dtype of the parts (the model's compute dtype).
        drop: leading tower tokens dropped (LLaVA's ``"default"``: 1).
        memory_budget_mb: bound on the temporary tensors of one layer step.

    Returns:
        :class:`TowerParts`.

    Raises:
        ValueError: a tower that is not described, interpolated positions.
    """
    spec = tower_description(tower)
    layers_wanted = list(hidden_states)
    mods = layer_modules(tower, spec)
    n_layers = len(mods)
    wanted = [h % (n_layers + 1) for h in layers_wanted]  # hidden-state index: 0 = the first layer's input
    top = max(wanted)
    kept: Dict[int, Tuple[Tensor, Tensor, Tensor]] = {}
    state: Dict[str, Any] = {}

    def keep(h: int, parts: Tensor, bias: Tensor, real: Tensor) -> None:
        if h in wanted:
            kept[h] = (parts, bias, real)

    def start(x0: Tensor) -> None:
        # the sources, once the embeddings ran (their position embeddings as the tower computed them)
        src, state["names"], state["grid"] = _embedding_sources(tower, pixel_values, dtype, state.get("positions"))
        pre = getattr(tower, "pre_layrnorm", None)  # CLIP: a LayerNorm between the embeddings and the layers
        if pre is not None:
            parts = _frozen_layernorm_parts(state["embeddings"], pre, src)
            bias = (pre.bias.to(dtype) if pre.bias is not None else torch.zeros_like(x0[0, 0])).expand_as(x0).clone()
        else:
            parts, bias = src, torch.zeros_like(x0)
        state["parts"], state["bias"] = parts, bias
        keep(0, parts, bias, x0)

    def on_layer(layer: LayerTensors) -> None:
        l = layer.index
        if l == 0:
            start(layer.hidden_in)
        if l >= top:
            return
        w, b = value_projection(mods[l], spec)
        dev = layer.hidden_in.device
        parts, bias = layer_kind(layer.topology).decompx_step(
            state["parts"], state["bias"], layer, w.detach().to(dev, dtype), None if b is None else b.detach().to(dev, dtype),
            "separate", rows=torch.arange(layer.hidden_in.shape[1], device=dev), memory_budget_mb=memory_budget_mb,
            coefs=ff_coefficients(layer))
        state["parts"], state["bias"] = parts, bias
        keep(l + 1, parts, bias, layer.layer_out)

    def embeddings_hook(module, args, output):
        state["embeddings"] = output.detach().to(dtype)

    def positions_hook(module, args, output):
        state["positions"] = output.detach()

    handles = [tower.embeddings.register_forward_hook(embeddings_hook),
               tower.embeddings.position_embedding.register_forward_hook(positions_hook)]
    try:
        with torch.inference_mode(False), torch.no_grad(), recording(tower, spec, on_layer, dtype):
            tower(pixel_values.to(tower.dtype))
    finally:
        for handle in handles:
            handle.remove()
    if n_layers == 0:  # a tower without layers: its embeddings are its hidden state 0
        start(state["embeddings"])
    names, grid = state["names"], state["grid"]
    parts = torch.cat([kept[h][0][:, drop:] for h in wanted], -1)
    bias = torch.cat([kept[h][1][:, drop:] for h in wanted], -1)
    real = torch.cat([kept[h][2][:, drop:] for h in wanted], -1)
    error = float((parts.sum(2) + bias - real).abs().max().detach())
    return TowerParts(parts, bias, grid, names, real, error)


def projector_parts(projector: nn.Module, parts: Tensor, bias: Tensor, features: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    r"""Parts of the projector's outputs: ``linear_1``, the activation frozen at its real slope, ``linear_2``.

    With u = f W_1 + b_1 the real pre-activation of feature f and s = (g(u) - g(0)) / u per unit
    (DecompX's frozen elementwise feed-forward rule, :func:`~captum_normattr.decompose.methods.decompx.parts.activation_slopes`),
    part k maps to ((part_k W_1) * s) W_2, and the projector's own constant is (b_1 * s + g(0)) W_2 + b_2.

    Args:
        projector: LLaVA's ``multi_modal_projector``.
        parts: (..., S, D_v) the parts of each feature; bias: (..., D_v) the bias part.
        features: (..., D_v) the real features (the slopes' point).

    Returns:
        (parts (..., S, D), the bias part carried through (..., D), the projector's constant (..., D)).
    """
    with torch.no_grad():
        return _projector_parts(projector, parts, bias, features)


def _projector_parts(projector: nn.Module, parts: Tensor, bias: Tensor, features: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    return frozen_mlp_parts(projector.linear_1, projector.act, projector.linear_2, parts, bias, features)


def frozen_mlp_parts(linear_1: nn.Linear, act: Any, linear_2: nn.Linear, parts: Tensor, bias: Tensor,
                     features: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    r"""Parts through Linear -> activation -> Linear, the activation frozen at its real per-unit slope.

    With u = f W_1 + b_1 the real pre-activation of input f and s = (g(u) - g(0)) / u per unit
    (DecompX's frozen elementwise feed-forward rule), part k maps to ((part_k W_1) * s) W_2, the
    bias part to ((bias W_1) * s) W_2, and the block's own constant is (b_1 * s + g(0)) W_2 + b_2.
    LLaVA's projector (:func:`projector_parts`) and Qwen2-VL's patch merger
    (:mod:`captum_normattr.attr.vlm_end_to_end_qwen`) are such blocks.

    Args:
        linear_1, act, linear_2: the block's modules (``act``: an elementwise activation).
        parts: (..., S, D_in) the parts of each input; bias: (..., D_in) the bias part.
        features: (..., D_in) the real inputs (the slopes' point).

    Returns:
        (parts (..., S, D_out), the bias part carried through (..., D_out), the block's constant (..., D_out)).
    """
    dtype = parts.dtype
    w1, b1 = linear_1.weight.to(dtype), linear_1.bias
    w2, b2 = linear_2.weight.to(dtype), linear_2.bias
    u = features @ w1.T + (0 if b1 is None else b1.to(dtype))
    slope = activation_slopes(u, act)
    g0 = act(torch.zeros((), dtype=dtype, device=u.device))
    out = ((parts @ w1.T) * slope.unsqueeze(-2)) @ w2.T
    out_bias = ((bias @ w1.T) * slope) @ w2.T
    const = ((0 if b1 is None else b1.to(dtype)) * slope + g0) @ w2.T + (0 if b2 is None else b2.to(dtype))
    return out, out_bias, const.expand_as(out_bias)


def relative_difference(a: Tensor, b: Tensor) -> float:
    r"""The largest |a - b| over the largest |b| (0 for empty tensors): the end-to-end routes' rebuild checks."""
    a, b = a.detach(), b.detach().to(a.dtype)
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) if b.numel() else 0.0


@log_usage()
@torch.no_grad()
def patch_contributions(
    model: nn.Module,
    input_ids: Tensor,
    pixel_values: Tensor,
    target: Any = None,
    attention_mask: Optional[Tensor] = None,
    explained_position: Any = None,
    foil: Any = None,
    nodes: int = DEFAULT_NODES,
    memory_budget_mb: float = 256.0,
    strict: bool = False,
) -> PatchContributions:
    r"""DecompX of a LLaVA model's next-token logit, end to end: every image patch's score, exact.

    The language model's DecompX cotangent at each image token (adjoint algorithm) is dotted with the
    token's embedding split over the tower's sources (:func:`tower_parts`, :func:`projector_parts`);
    ``docs/vlm_end_to_end.md`` gives the equations and what stops at the language model's input.

    Args:
        model: a ``LlavaForConditionalGeneration`` with a CLIP or SigLIP vision tower (:data:`TOWERS`).
        input_ids: (B, T) ids with the image tokens (``config.image_token_id``), padded left or right.
        pixel_values: (n_images, C, H, W), the images in the order the model reads them.
        target: the explained token id(s) (None: the predicted next token), as for DecompX.
        attention_mask: (B, T), or None (all ones).
        explained_position: ``"last"`` (default), an int or a (B,) tensor, as for DecompX.
        foil: token id(s) whose logit is subtracted, as for DecompX.
        nodes: Gauss-Legendre nodes of a gated decoder FF's integrals.
        memory_budget_mb: bound on one tower layer step's temporaries.
        strict: raise instead of warning where DecompX's guards find a mismatch.

    Returns:
        :class:`PatchContributions`.

    Raises:
        ValueError: not LLaVA, a tower the package does not decompose (:data:`TOWERS`), ``image_sizes``
            towers, image tokens that do not match the images, or rebuilt features or embeddings that
            differ from the model's own.

    Examples::

        >>> res = patch_contributions(llava, ids, pixel_values, attention_mask=mask)
        >>> res.patch_scores.shape   # (n_images, 24, 24) for a 336-pixel CLIP tower with 14-pixel patches
        >>> total = res.patch_scores.flatten(1).sum(1) + res.text_scores.sum(1) + sum(res.no_token.values())
        >>> (total - res.logit).abs().max()  # rounding
    """
    model = unwrap_model(model)
    base, tower, _ = _tower_and_description(model)
    tp = tower_parts(model, pixel_values, memory_budget_mb)
    tol = _CHECK.get(tp.parts.dtype, 1e-3)
    if tp.error > tol * float(tp.features.abs().max().clamp(min=1.0)):
        raise ValueError(f"the tower's parts do not rebuild its selected features (largest error {tp.error:.3g})")
    parts, pbias, pconst = projector_parts(base.multi_modal_projector, tp.parts, tp.bias, tp.features)

    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    attr = DecompXAttribution(model, algorithm="adjoint", explained_position=explained_position, nodes=nodes,
                              strict=strict)
    cot, real = cotangents_and_projector_input(attr, base.multi_modal_projector, input_ids, target,
                                               {"attention_mask": mask, "pixel_values": pixel_values}, foil)
    checks = {"features": relative_difference(tp.features, real)}
    return image_token_contributions(cot, input_ids, mask, image_token_id(model.config), (parts, pbias, pconst),
                                     tp.grid, tp.no_token, checks, tol)


def image_token_id(config: Any) -> int:
    r"""The image token's id of a vision-language model's config (``image_token_id`` or ``image_token_index``)."""
    names = ("image_token_id", "image_token_index")
    return next(getattr(config, n) for n in names if getattr(config, n, None) is not None)


def cotangents_and_projector_input(attr: DecompXAttribution, projector: nn.Module, input_ids: Tensor, target: Any,
                                   inputs: Dict[str, Any], foil: Any) -> Tuple[Any, Tensor]:
    r"""DecompX's input cotangents of a vision-language model, and what its projector read in the same forward.

    Args:
        attr: a ``DecompXAttribution`` of the model (adjoint algorithm).
        projector: the module whose first input is the tower's features (LLaVA's ``multi_modal_projector``,
            Idefics3's ``connector``).
        input_ids, target, foil: as for :meth:`~captum_normattr.attr.decompx.DecompXAttribution.input_cotangents`.
        inputs: the model's further inputs by keyword (``attention_mask``, ``pixel_values``, ...).

    Returns:
        (the :class:`~captum_normattr.attr.decompx_readouts.InputCotangents`, the projector's real input).
    """
    real: Dict[str, Tensor] = {}

    def projector_hook(module, args):
        real["x"] = args[0].detach()

    handle = projector.register_forward_pre_hook(projector_hook)
    try:
        cot = attr.input_cotangents(input_ids, target, inputs, foil)
    finally:
        handle.remove()
    return cot, real["x"]


def image_token_contributions(cot: Any, input_ids: Tensor, mask: Tensor, image_token_id: int,
                              token_parts: Tuple[Tensor, Tensor, Tensor], grid: Tuple[int, int],
                              tower_no_token: Tuple[str, ...], checks: Dict[str, float],
                              tol: float) -> PatchContributions:
    r"""The language model's cotangents dotted with the image tokens' per-patch parts: the end-to-end readout.

    Shared by the end-to-end routes whose image tokens are each a sum of parts over one image's patch grid
    (LLaVA: :func:`patch_contributions`; PaliGemma, Gemma 3: :mod:`captum_normattr.attr.vlm_end_to_end_siglip`).
    Checks that the rebuilt image-token embeddings equal the decoder's input (``checks["embeddings"]``) and raises
    if any check exceeds ``tol``.

    Args:
        cot: :meth:`~captum_normattr.attr.decompx.DecompXAttribution.input_cotangents`' result on ``input_ids``.
        input_ids, mask: (B, T) the ids and the attention mask.
        image_token_id: the image token's id (its tokens in order take the images' tokens in order).
        token_parts: (parts (n_images, N, P + S, D): each image token's part from each patch (row-major) and each
            of the tower's ``S`` no-token sources, the tower's bias part (n_images, N, D), the projector's constant
            (n_images, N, D)).
        grid: (rows, cols) of the patch grid (P = rows * cols).
        tower_no_token: the tower's S no-token source names.
        checks: the caller's rebuild checks (relative differences), extended here.
        tol: the largest relative difference accepted.

    Returns:
        :class:`PatchContributions`.

    Raises:
        ValueError: image tokens that do not match the images, or a check above ``tol``.
    """
    parts, pbias, pconst = token_parts
    g, e, dx = cot.cotangent, cot.embeddings, cot.result
    dtype = parts.dtype
    ids = input_ids
    image = (ids == image_token_id) & (mask > 0)
    n_images, n_feat = parts.shape[:2]
    if int(image.sum()) != n_images * n_feat:
        raise ValueError(f"{int(image.sum())} image tokens for {n_images} images of {n_feat} tokens each")
    g_img = g[image].view(n_images, n_feat, -1).to(dtype)
    rebuilt = parts.sum(2) + pbias + pconst
    checks["embeddings"] = relative_difference(rebuilt, e[image].view(n_images, n_feat, -1))
    worst = max(checks.values())
    if worst > tol:
        raise ValueError(f"the image tokens' embeddings rebuilt through the tower and the projector differ from the "
                         f"model's by {worst:.3g} (relative): {checks}")
    sources = torch.cat([torch.einsum("nfsd,nfd->nfs", parts, g_img),
                         (g_img * pbias).sum(-1, keepdim=True), (g_img * pconst).sum(-1, keepdim=True)], -1)
    per_image = sources.sum(1)  # (n_images, S + 2)
    b = ids.shape[0]
    example = image.nonzero()[:, 0].view(n_images, n_feat)[:, 0]
    rows, cols = grid
    p = rows * cols
    names = tuple(f"({r},{c})" for r in range(rows) for c in range(cols)) + tuple(tower_no_token) + (
        "tower_biases", "projector_biases")
    no_token: Dict[str, Tensor] = {}
    for j, name in enumerate(names[p:]):
        no_token[name] = torch.zeros(b, dtype=dtype, device=g.device).index_add_(0, example, per_image[:, p + j])
    no_token["language_model_biases"] = dx.bias_scores[:, 0]
    scores = dx.scores
    text = torch.where(image, torch.zeros_like(scores), scores)
    image_scores = torch.where(image, scores, torch.zeros_like(scores))
    patch = per_image[:, :p].reshape(n_images, rows, cols)
    total = torch.zeros(b, dtype=dtype, device=g.device).index_add_(0, example, patch.flatten(1).sum(1))
    total = total + text.sum(1) + sum(no_token.values())
    logit = dx.logits[:, 0]
    return PatchContributions(
        patch_scores=patch, image_example=example, text_scores=text, image_token_scores=image_scores,
        token_sources=sources, source_names=names, no_token=no_token, logit=logit, delta=(total - logit).abs(),
        target=dx.target, explained_position=dx.explained_position, checks=checks,
    )
