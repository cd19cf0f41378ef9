r"""DecompX end to end through a SigLIP tower and its projector: PaliGemma (1 and 2), Gemma 3, Idefics3 and SmolVLM.

These families run a SigLIP vision model (no [CLS]: every patch is a token) to its last layer and its
``post_layernorm``, then a projector into the decoder's width:

- PaliGemma (``PaliGemmaForConditionalGeneration``; PaliGemma 2 is the same model with a Gemma 2 decoder): one
  ``Linear`` per patch, so that every patch is an image token;
- Gemma 3 (``Gemma3ForConditionalGeneration``): ``Gemma3MultiModalProjector``, the (S / p) x (S / p) patch grid
  average-pooled in k x k blocks to ``mm_tokens_per_image`` tokens, an RMSNorm (gain 1 + w) and a bias-free
  projection;
- Idefics3 / SmolVLM (``Idefics3ForConditionalGeneration``, ``SmolVLMForConditionalGeneration``): every image or
  sub-image (the processor's tiles and the global view, each at the tower's size) through the tower (SigLIP's
  layers, position ids read from the patch mask), then the connector's pixel shuffle (the features of each s x s
  block of patches concatenated into one token: a permutation) and a bias-free linear projection.

This module carries DecompX from the decoder's input to the patches (``docs/vlm_end_to_end.md``): the tower's
layers by the LLaVA route's forward algorithm (:func:`~captum_normattr.attr.vlm_end_to_end.vision_tower_parts`:
each patch its own patch embedding, the position embeddings and the convolution's bias no-token sources), the
post-layernorm and the projector's RMSNorm frozen at their real per-token scales (their shifts join the tower's
bias part), the average pooling and the linear maps exactly linear, and the language model's cotangents
(:meth:`~captum_normattr.attr.decompx.DecompXAttribution.input_cotangents`, with ``token_type_ids`` where the model
reads them: PaliGemma's two-way prefix, Gemma 3's two-way image spans) dotted with each image token's parts
(:func:`~captum_normattr.attr.vlm_end_to_end.image_token_contributions`).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from captum.log import log_usage
from torch import Tensor, nn

from captum_normattr.arch.spec import Norm, UnsupportedModelError
from captum_normattr.attr.decompx import DecompXAttribution
from captum_normattr.attr.vlm_end_to_end import (PatchContributions, TowerParts, cotangents_and_projector_input,
                                                 image_token_contributions, image_token_id, relative_difference,
                                                 vision_tower_parts)
from captum_normattr.decompose.primitives.gated_feed_forward import DEFAULT_NODES
from captum_normattr.decompose.primitives.layer_norm import apply_norm_to_parts, norm_bias_part
from captum_normattr.models.adapters import unwrap_model
from captum_normattr.models.capture.record import norm_params
from captum_normattr.models.engine import compute_dtype

__all__ = ["FAMILIES", "real_images", "siglip_patch_contributions", "siglip_token_parts"]

#: The families carried end to end here: ``config.model_type`` -> (family name, the projector class it must have,
#: the tower's and the projector's attribute names under ``model.model``).
FAMILIES: Dict[str, Tuple[str, str, str, str]] = {
    "paligemma": ("PaliGemma", "PaliGemmaMultiModalProjector", "vision_tower", "multi_modal_projector"),
    "gemma3": ("Gemma 3", "Gemma3MultiModalProjector", "vision_tower", "multi_modal_projector"),
    "idefics3": ("Idefics3", "Idefics3Connector", "vision_model", "connector"),
    "smolvlm": ("SmolVLM", "SmolVLMConnector", "vision_model", "connector"),
}
_SHUFFLED = ("idefics3", "smolvlm")

#: Relative tolerance of the rebuild checks, by the tower's dtype (a half-precision tower is rebuilt in float32).
_CHECK = {torch.float64: 1e-9, torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def _model_parts(model: nn.Module) -> Tuple[str, nn.Module, nn.Module, nn.Module]:
    r"""(model_type, the base model, its SigLIP tower, its projector); refuses what this module does not carry."""
    kind = getattr(model.config, "model_type", None)
    if kind not in FAMILIES:
        raise UnsupportedModelError(
            f"siglip_patch_contributions carries {', '.join(f[0] for f in FAMILIES.values())} to the patches; "
            f"{type(model).__name__} ({kind!r}) is not one of them. LLaVA: vlm_end_to_end.patch_contributions; "
            "Qwen2-VL / Qwen2.5-VL: vlm_end_to_end_qwen.merged_patch_contributions; docs/vlm_end_to_end.md says which "
            "families stop at the language model's input and why")
    base = model.model
    tower, projector = getattr(base, FAMILIES[kind][2]), getattr(base, FAMILIES[kind][3])
    if type(projector).__name__ != FAMILIES[kind][1]:
        raise UnsupportedModelError(f"{FAMILIES[kind][0]}'s projector is {type(projector).__name__}, not the "
                                    f"{FAMILIES[kind][1]} this module decomposes")
    if not isinstance(getattr(tower, "post_layernorm", None), nn.LayerNorm):
        raise UnsupportedModelError(f"the vision tower {type(tower).__name__} has no post_layernorm LayerNorm: not the "
                                    "SigLIP vision model this module decomposes")
    return kind, base, tower, projector


def _pooled(x: Tensor, side: int, k: int) -> Tensor:
    r"""Gemma 3's average pooling of (n, side * side, ..., D) patch-major tensors to (n, (side / k)^2, ..., D)."""
    n, rest = x.shape[0], x.shape[2:]
    t = side // k
    x = x.reshape(n, t, k, t, k, *rest)
    return x.mean(dim=(2, 4)).reshape(n, t * t, *rest)


def _shuffled(x: Tensor, connector: nn.Module) -> Tensor:
    r"""Idefics3's pixel shuffle (the connector's own) of (n, P, ..., D) tensors: (n, P / s^2, ..., s^2 D)."""
    n, seq, d = x.shape[0], x.shape[1], x.shape[-1]
    rest = x.shape[2:-1]
    y = x.movedim(1, -2).reshape(-1, seq, d)
    y = connector.pixel_shuffle(y, connector.scale_factor)
    return y.reshape(n, *rest, y.shape[1], y.shape[2]).movedim(-2, 1)


def real_images(pixel_values: Tensor, pixel_attention_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    r"""Idefics3 / SmolVLM: the images the tower reads, (n, C, H, W), and the example of each, (n,).

    The model drops the padding images (all pixels 0) of its (B, N, C, H, W) ``pixel_values``; the rest, in order,
    are the tiles and global views whose tokens fill the image tokens in order.

    Raises:
        UnsupportedModelError: padded pixels within a real image (``pixel_attention_mask`` not all 1 there).
    """
    if pixel_values.dim() != 5:
        raise ValueError(f"Idefics3 / SmolVLM take pixel_values (B, N, C, H, W); got {tuple(pixel_values.shape)}")
    b, n = pixel_values.shape[:2]
    flat = pixel_values.reshape(b * n, *pixel_values.shape[2:])
    real = (flat != 0).flatten(1).any(1)
    if pixel_attention_mask is not None and not bool(pixel_attention_mask.reshape(b * n, -1)[real].bool().all()):
        raise UnsupportedModelError(
            "an image with padded pixels (pixel_attention_mask 0 inside a real image): the end-to-end route reads "
            "every image at the tower's full size (the processor's tiles and global views are)")
    example = torch.arange(b, device=flat.device).repeat_interleave(n)[real]
    return flat[real], example


def siglip_token_parts(model: nn.Module, pixel_values: Tensor, memory_budget_mb: float = 256.0,
                       pixel_attention_mask: Optional[Tensor] = None
                       ) -> Tuple[Tuple[Tensor, Tensor, Tensor], TowerParts, Tensor]:
    r"""The image tokens' embeddings of a PaliGemma, Gemma 3, Idefics3 or SmolVLM model as sums of per-patch parts.

    Args:
        model: a ``PaliGemmaForConditionalGeneration``, ``Gemma3ForConditionalGeneration``,
            ``Idefics3ForConditionalGeneration`` or ``SmolVLMForConditionalGeneration`` (:data:`FAMILIES`).
        pixel_values: (n_images, C, H, W) at the tower's image size; Idefics3 / SmolVLM: (B, N, C, H, W), padding
            images all 0 (:func:`real_images`).
        memory_budget_mb: bound on one tower layer step's temporaries.
        pixel_attention_mask: Idefics3 / SmolVLM: the processor's (B, N, H, W) mask, or None.

    Returns:
        ((parts (n_images, N, P + S, D): each image token's part from each patch and each of the tower's S
        no-token sources, the tower's bias part (n_images, N, D), the projector's constant (n_images, N, D)),
        the tower's :class:`~captum_normattr.attr.vlm_end_to_end.TowerParts` at its last layer (before the
        post-layernorm), the post-layernorm's real output (n_images, P, D_v): what the projector reads).

    Raises:
        UnsupportedModelError: another family or projector; ValueError: a tower that is not SigLIP, interpolated
            positions, a patch grid that is not the projector's.

    Examples::

        >>> (parts, bias, const), tp, features = siglip_token_parts(paligemma, pixel_values)
        >>> parts.sum(2) + bias + const   # == the model's get_image_features(pixel_values).pooler_output
    """
    with torch.no_grad():
        model = unwrap_model(model)
        kind, _, tower, projector = _model_parts(model)
        dtype = compute_dtype(model)
        if kind in _SHUFFLED:
            pixel_values, _ = real_images(pixel_values, pixel_attention_mask)
        tp = vision_tower_parts(tower, pixel_values, [-1], dtype, 0, memory_budget_mb)
        post = norm_params(tower.post_layernorm, "layernorm", dtype)
        parts = apply_norm_to_parts(tp.parts, tp.features, post)
        bias = norm_bias_part(tp.bias, tp.features, post)
        features = parts.sum(2) + bias  # checked against what the projector reads by the caller
        if kind == "paligemma":
            w, b = projector.linear.weight.to(dtype), projector.linear.bias
            out, out_bias = parts @ w.T, bias @ w.T
            const = torch.zeros_like(out_bias) + (0 if b is None else b.to(dtype))
            return (out, out_bias, const), tp, features
        if kind in _SHUFFLED:
            s = int(projector.scale_factor)
            if tp.grid[0] != tp.grid[1] or tp.grid[0] % s:
                raise ValueError(f"the pixel shuffle takes a square patch grid in {s} x {s} blocks; the tower gave "
                                 f"{tp.grid[0]} x {tp.grid[1]} patches")
            lin = projector.modality_projection.proj
            w, b = lin.weight.to(dtype), lin.bias
            out, out_bias = _shuffled(parts, projector) @ w.T, _shuffled(bias, projector) @ w.T
            const = torch.zeros_like(out_bias) + (0 if b is None else b.to(dtype))
            return (out, out_bias, const), tp, features
        side, k = int(projector.patches_per_image), int(projector.kernel_size)
        if tuple(tp.grid) != (side, side) or side % k:
            raise ValueError(f"Gemma 3's projector pools a {side} x {side} patch grid in {k} x {k} blocks; the tower "
                             f"gave {tp.grid[0]} x {tp.grid[1]} patches")
        pooled, pooled_bias, pooled_real = _pooled(parts, side, k), _pooled(bias, side, k), _pooled(features, side, k)
        rms = norm_params(projector.mm_soft_emb_norm, Norm("mm_soft_emb_norm", "rmsnorm", weight_offset=1.0), dtype)
        normed = apply_norm_to_parts(pooled, pooled_real, rms)
        normed_bias = norm_bias_part(pooled_bias, pooled_real, rms)
        w = projector.mm_input_projection_weight.to(dtype)  # (D_v, D), right-multiplied
        out, out_bias = normed @ w, normed_bias @ w
        return (out, out_bias, torch.zeros_like(out_bias)), tp, features


@log_usage()
@torch.no_grad()
def siglip_patch_contributions(
    model: nn.Module,
    input_ids: Tensor,
    pixel_values: Tensor,
    target: Any = None,
    attention_mask: Optional[Tensor] = None,
    token_type_ids: Optional[Tensor] = None,
    pixel_attention_mask: Optional[Tensor] = None,
    explained_position: Any = None,
    foil: Any = None,
    nodes: int = DEFAULT_NODES,
    memory_budget_mb: float = 256.0,
    strict: bool = False,
) -> PatchContributions:
    r"""DecompX of a PaliGemma, Gemma 3, Idefics3 or SmolVLM model's next-token logit, end to end: every patch's score.

    The language model's DecompX cotangent at each image token (adjoint algorithm) is dotted with the token's
    embedding split over the SigLIP tower's sources (:func:`siglip_token_parts`); ``docs/vlm_end_to_end.md`` gives
    the equations.

    Args:
        model: a ``PaliGemmaForConditionalGeneration`` (PaliGemma, PaliGemma 2), a ``Gemma3ForConditionalGeneration``
            with images, an ``Idefics3ForConditionalGeneration`` or a ``SmolVLMForConditionalGeneration``
            (:data:`FAMILIES`).
        input_ids: (B, T) ids with the image tokens (``config.image_token_id``), padded left or right.
        pixel_values: (n_images, C, H, W), the images in the order the model reads them; Idefics3 / SmolVLM:
            (B, N, C, H, W) as the processor gives them (tiles and the global view; padding images all 0).
        target: the explained token id(s) (None: the predicted next token), as for DecompX.
        attention_mask: (B, T), or None (all ones).
        token_type_ids: (B, T) the processor's token types (PaliGemma: 0 on the two-way prefix; Gemma 3: 1 on the
            image tokens, two-way within each image), or None (the model's causal mask).
        pixel_attention_mask: Idefics3 / SmolVLM: the processor's (B, N, H, W) mask, or None; it must be 1 on
            every real image (the processor's tiles and global views fill the tower's size).
        explained_position: ``"last"`` (default), an int or a (B,) tensor, as for DecompX.
        foil: token id(s) whose logit is subtracted, as for DecompX.
        nodes: Gauss-Legendre nodes of a gated decoder FF's integrals.
        memory_budget_mb: bound on one tower layer step's temporaries.
        strict: raise instead of warning where DecompX's guards find a mismatch.

    Returns:
        :class:`~captum_normattr.attr.vlm_end_to_end.PatchContributions`: ``patch_scores`` on each image's
        (S / p) x (S / p) patch grid (Idefics3 / SmolVLM: each real sub-image in the model's order, its example in
        ``image_example``); the no-token terms ``"position_embeddings"``, ``"patch_embedding_bias"``,
        ``"tower_biases"`` (the tower's biases and norm shifts), ``"projector_biases"`` (PaliGemma's projector bias;
        0 for Gemma 3's bias-free projector), ``"language_model_biases"``; ``checks``: the relative differences of
        the rebuilt tower features (``"features"``) and image-token embeddings (``"embeddings"``) from the model's.

    Raises:
        UnsupportedModelError: another family, padded pixels inside an Idefics3 image.
        ValueError: a tower that is not SigLIP, interpolated positions, image tokens that do not match the images,
            or rebuilt features or embeddings that differ from the model's by more than the dtype's tolerance (1e-9
            relative in float64: Gemma 3's own RMSNorm computes in float32 and fails it in a float64 model).

    Examples::

        >>> batch = processor(images=image, text=prompt, return_tensors="pt")
        >>> res = siglip_patch_contributions(paligemma, batch["input_ids"], batch["pixel_values"],
        ...                                  attention_mask=batch["attention_mask"],
        ...                                  token_type_ids=batch["token_type_ids"])
        >>> res.patch_scores.shape   # (n_images, 16, 16) for a 224-pixel tower with 14-pixel patches
    """
    model = unwrap_model(model)
    _, _, tower, projector = _model_parts(model)
    token_parts, tp, features = siglip_token_parts(model, pixel_values, memory_budget_mb, pixel_attention_mask)
    tol = _CHECK.get(next(tower.parameters()).dtype, 1e-3)
    if tp.error > tol * float(tp.features.abs().max().clamp(min=1.0)):
        raise ValueError(f"the tower's parts do not rebuild its last layer's output (largest error {tp.error:.3g})")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    extra: Dict[str, Tensor] = {"attention_mask": mask, "pixel_values": pixel_values}
    if token_type_ids is not None:
        extra["token_type_ids"] = token_type_ids
    if pixel_attention_mask is not None:
        extra["pixel_attention_mask"] = pixel_attention_mask
    attr = DecompXAttribution(model, algorithm="adjoint", explained_position=explained_position, nodes=nodes,
                              strict=strict)
    cot, real = cotangents_and_projector_input(attr, projector, input_ids, target, extra, foil)
    checks = {"features": relative_difference(features, real)}
    return image_token_contributions(cot, input_ids, mask, image_token_id(model.config), token_parts, tp.grid,
                                     tp.no_token, checks, tol)
