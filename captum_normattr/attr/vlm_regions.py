r"""Image-token scores mapped back to the image: a vision-language model's patch grid, and heat maps over pixels.

A decomposition of a vision-language model's language model (``docs/vlm.md``) gives every token of
the merged sequence a score, the image tokens included. Each image token is one feature of the
vision tower (after the projector), and the tower's features lie on its patch grid. This module
finds the image tokens (``config.image_token_id``), splits them into images, lays each image's
scores on its grid and spreads every patch's score over that patch's pixels (nearest: each pixel
gets its patch's score), giving a heat map over the image the tower saw (the processor's resized
image: ``vision_config.image_size`` square for LLaVA 1.5).

The geometry is the family's description's (:class:`~captum_normattr.arch.families.vlm.VisionLanguage`):

- ``"patch_grid"`` (LLaVA): the tower's sequence is [CLS] (CLIP; none for SigLIP) then the
  (H / p) x (W / p) patches row by row; ``vision_feature_select_strategy="default"`` drops the
  sequence's first feature (CLIP's [CLS]; with SigLIP, the first patch, whose pixels then get NaN),
  ``"full"`` keeps it (CLIP's [CLS] score is returned apart, :attr:`ImageScores.leading`). With
  ``image_sizes`` (a Pixtral-like tower of any size) each image's grid is its own (h / p) x (w / p).
- ``"merged_grid"`` (Qwen2-VL): each image's ``image_grid_thw`` (1, h, w) patches, every m x m block
  (``spatial_merge_size``) merged into one token, the tokens row by row over (h / m) x (w / m); a
  token covers (p m) x (p m) pixels.
- ``"shuffled_grid"`` (Idefics3, SmolVLM): the tower's square (S / p) x (S / p) patch grid, every s x s
  block (``config.scale_factor``) shuffled into one token, the tokens row by row over
  (S / p / s) x (S / p / s); each sub-image the processor makes (with image splitting: the tiles row
  by row, then the global image) is one grid over its own S x S input, in that order.
- ``"merged_sizes"`` (Mistral 3): each image's ``image_sizes`` (h, w), every m x m block of its
  (h / p) x (w / p) patches (``config.spatial_merge_size``) one token, row by row over
  (h / p / m) x (w / p / m); the row-break and image-end tokens between rows are text tokens.
- ``"pooled_grid"`` (Gemma 3): the tower's square (S / p) x (S / p) patch grid average-pooled to
  n x n tokens (n^2 = ``mm_tokens_per_image``), row by row, each token S / n x S / n pixels.
- ``"tiled_grid"`` (Llama 4): every tile (and the global view) is the tower's square (S / p) x (S / p) patch
  grid, every 1/r x 1/r block (``vision_config.pixel_shuffle_ratio`` r) shuffled into one token, row by row; one
  grid per sub-image here, the tiles stitched onto the image by :mod:`captum_normattr.attr.vlm_tiles` (as are
  Idefics3's split images).
- ``"anyres_tiles"`` (LLaVA-NeXT, LLaVA-OneVision): a base view then any-resolution tiles, unpadded, with a
  newline token after every row, mapped onto the ORIGINAL image's pixels
  (:mod:`captum_normattr.attr.vlm_anyres`).
- ``"pooled_sizes"`` (Gemma 4): each image's ``image_sizes`` (h, w) of the processor's resized image
  (:func:`~captum_normattr.arch.families.vlm_gemma4.gemma4_image_sizes` reads them from ``image_position_ids``),
  every k x k block of its (h / p) x (w / p) patches (``vision_config.pooling_kernel_size``) pooled into one
  token, row by row over (h / p / k) x (w / p / k).

PaliGemma's is ``"patch_grid"`` with a SigLIP tower and no feature strategy: every patch is a token.
Qwen2-VL's and Qwen2.5-VL's videos (frame groups of merged grids) are mapped by :mod:`captum_normattr.attr.vlm_video`.
:func:`two_way_pairs` says which pairs above the diagonal a call's ``token_type_ids`` open (Gemma 3's
image spans, PaliGemma's prefix: docs/vlm.md, "Two-way spans").

The pure functions (:func:`grid_scores`, :func:`patches_to_pixels`) take the geometry as numbers
and are what the synthetic-grid tests check; :func:`image_scores` and :func:`image_heatmaps` read
it from the model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from captum_normattr.arch.families.vlm import TWO_WAY
from captum_normattr.attr.image_tokens import split_images
from captum_normattr.attr.vlm_anyres import anyres_geometry, anyres_heatmaps, anyres_scores
from captum_normattr.arch.families.vlm_gemma4 import gemma4_image_sizes
from captum_normattr.models.adapters import unwrap_model, vision_language

__all__ = [
    "ImageGeometry",
    "ImageScores",
    "grid_scores",
    "image_geometry",
    "image_heatmaps",
    "image_scores",
    "image_token_mask",
    "patches_to_pixels",
    "result_scores",
    "two_way_pairs",
]


@dataclass(frozen=True)
class ImageGeometry:
    r"""How one model's image tokens lie over its images.

    Attributes:
        image_token_id: the id of the image placeholder token.
        patch: (pixels per patch row, per patch column).
        grids: (rows, cols) per image; one entry serves every image (a fixed-size tower).
        class_token: the tower's sequence starts with a [CLS] feature.
        dropped: features dropped from the front of the tower's sequence (1 for ``"default"``).
    """

    image_token_id: int
    patch: Tuple[int, int]
    grids: Tuple[Tuple[int, int], ...]
    class_token: bool = False
    dropped: int = 0

    def grid(self, image: int) -> Tuple[int, int]:
        r"""(rows, cols) of image ``image``."""
        return self.grids[0] if len(self.grids) == 1 else self.grids[image]

    def tokens(self, image: int) -> int:
        r"""Image tokens of image ``image``: the tower's features ([CLS] and patches) less the dropped ones."""
        rows, cols = self.grid(image)
        return int(self.class_token) + rows * cols - self.dropped


@dataclass
class ImageScores:
    r"""Per-image scores of the image tokens.

    Attributes:
        grids: one (..., rows, cols) tensor per image, in the order the model reads the images
            (example by example, left to right); a patch without a token (dropped) holds NaN.
        leading: (n_images, ...) the [CLS] feature's score where the tokens keep it, else None.
        example: (n_images,) the example each image belongs to.
    """

    grids: List[Tensor]
    leading: Optional[Tensor]
    example: Tensor


def _as_int(value: Any, what: str) -> int:
    if value is None:
        raise ValueError(f"the model's config has no {what}")
    return int(value)


def image_geometry(model: nn.Module, image_sizes: Optional[Tensor] = None,
                   image_grid_thw: Optional[Tensor] = None, image_position_ids: Optional[Tensor] = None) -> ImageGeometry:
    r"""The image-token geometry of a vision-language model, from its config and its family's description.

    Args:
        model: a vision-language model the package describes (:mod:`captum_normattr.arch.families.vlm`).
        image_sizes: (n_images, 2) heights and widths in pixels, for a tower whose grid follows the
            image (the ``image_sizes`` the processor gives; Mistral 3 needs them); None: the tower's
            square ``vision_config.image_size``.
        image_grid_thw: (n_images, 3) Qwen2-VL's patches per image (frames, rows, columns), as the
            processor gives them (the ``"merged_grid"`` geometry needs them).
        image_position_ids: (n_images, max_patches, 2) Gemma 4's patch positions, as the processor gives them
            (the ``"pooled_sizes"`` geometry reads each image's size from them where ``image_sizes`` is None).

    Returns:
        :class:`ImageGeometry`; for LLaVA-NeXT / OneVision (``"anyres_tiles"``) an
        :class:`~captum_normattr.attr.vlm_anyres.AnyresGeometry` (``image_sizes`` needed).

    Raises:
        ValueError: not a described vision-language model, or a config without the grid's numbers.

    Examples::

        >>> image_geometry(llava).grids  # a 336 x 336 CLIP tower with 14-pixel patches
        ((24, 24),)
    """
    model = unwrap_model(model)
    description = vision_language(model)
    if description is None:
        raise ValueError(f"{type(model).__name__} is not a vision-language model the package describes (docs/vlm.md)")
    if description.geometry == "anyres_tiles":  # LLaVA-NeXT / OneVision: captum_normattr.attr.vlm_anyres
        return anyres_geometry(model, image_sizes)  # type: ignore[return-value]
    config = model.config
    token = next((getattr(config, n) for n in description.image_token if getattr(config, n, None) is not None), None)
    vision = getattr(config, description.vision_config, None)
    p = _as_int(getattr(vision, "patch_size", None), f"{description.vision_config}.patch_size")
    token = _as_int(token, "image token id")
    if description.geometry == "merged_grid":  # Qwen2-VL: m x m patches merged into one token, no [CLS]
        if image_grid_thw is None:
            raise ValueError(f"{description.family}'s image grids are per image: pass image_grid_thw (the processor's)")
        m = _as_int(getattr(vision, "spatial_merge_size", None), f"{description.vision_config}.spatial_merge_size")
        thw = torch.as_tensor(image_grid_thw).reshape(-1, 3).tolist()
        if any(int(t) != 1 for t, _, _ in thw):
            raise ValueError("image_grid_thw with several frames (a video) has no single image grid")
        return ImageGeometry(token, (p * m, p * m), tuple((int(h) // m, int(w) // m) for _, h, w in thw))
    if description.geometry == "shuffled_grid":  # Idefics3 / SmolVLM: s x s patches shuffled into one token
        s = _as_int(getattr(config, "scale_factor", None), "scale_factor")
        side = _as_int(getattr(vision, "image_size", None), f"{description.vision_config}.image_size") // p // s
        return ImageGeometry(token, (p * s, p * s), ((side, side),))
    if description.geometry == "tiled_grid":  # Llama 4: each tile's patches pixel-shuffled, 1/r x 1/r per token
        ratio = float(getattr(vision, "pixel_shuffle_ratio", 0.0) or 0.0)
        k = int(round(1.0 / ratio)) if ratio > 0 else 0
        side = _as_int(getattr(vision, "image_size", None), f"{description.vision_config}.image_size") // p
        if k < 1 or abs(k * ratio - 1.0) > 1e-9 or side % k:
            raise ValueError(f"pixel_shuffle_ratio {getattr(vision, 'pixel_shuffle_ratio', None)} does not shuffle "
                             f"the {side} x {side} patch grid into whole blocks")
        return ImageGeometry(token, (p * k, p * k), ((side // k, side // k),))  # tiles: attr.vlm_tiles
    if description.geometry == "pooled_sizes" and image_sizes is None and image_position_ids is not None:
        image_sizes = gemma4_image_sizes(image_position_ids, p)
    if description.geometry in ("merged_sizes", "pooled_sizes"):  # Mistral 3 (merged), Gemma 4 (pooled): m x m
        if image_sizes is None:  # patches per token, row by row over each image's grid
            raise ValueError(f"{description.family}'s image grids are per image: pass image_sizes (the processor's; "
                             "Gemma 4: image_position_ids)")
        m = (_as_int(getattr(vision, "pooling_kernel_size", None), f"{description.vision_config}.pooling_kernel_size")
             if description.geometry == "pooled_sizes" else
             _as_int(getattr(config, "spatial_merge_size", None), "spatial_merge_size"))
        sizes = torch.as_tensor(image_sizes).reshape(-1, 2).tolist()
        return ImageGeometry(token, (p * m, p * m), tuple((int(h) // (p * m), int(w) // (p * m)) for h, w in sizes))
    if description.geometry == "pooled_grid":  # Gemma 3: the patch grid average-pooled to a square token grid
        side = int(round(_as_int(getattr(config, "mm_tokens_per_image", None), "mm_tokens_per_image") ** 0.5))
        size = _as_int(getattr(vision, "image_size", None), f"{description.vision_config}.image_size")
        if side * side != int(config.mm_tokens_per_image) or (size // p) % side:
            raise ValueError(f"mm_tokens_per_image {config.mm_tokens_per_image} is not a square that divides the "
                             f"{size // p} x {size // p} patch grid")
        return ImageGeometry(token, (size // side, size // side), ((side, side),))
    strategy = "full" if description.strategy is None else getattr(config, description.strategy, "default")
    class_token = getattr(vision, "model_type", None) in description.class_token_towers
    if image_sizes is not None:
        sizes = torch.as_tensor(image_sizes).reshape(-1, 2).tolist()
        grids = tuple((int(h) // p, int(w) // p) for h, w in sizes)
    else:
        size = _as_int(getattr(vision, "image_size", None), f"{description.vision_config}.image_size")
        grids = ((size // p, size // p),)
    return ImageGeometry(token, (p, p), grids, class_token, int(strategy == "default"))


def image_token_mask(input_ids: Tensor, geometry: Union[ImageGeometry, int]) -> Tensor:
    r"""(B, T) bool: where the image tokens are.

    Args:
        input_ids: (B, T) token ids.
        geometry: an :class:`ImageGeometry`, or the image token's id.
    """
    token = int(getattr(geometry, "image_token_id", geometry))
    return input_ids == token


def grid_scores(scores: Tensor, image_mask: Tensor, geometry: ImageGeometry) -> ImageScores:
    r"""Split every example's image-token scores into images and lay each on its patch grid.

    Args:
        scores: (B, T) or (B, ..., T) per-token scores (a result's ``scores``; the middle axes,
            e.g. several explained tokens, are kept).
        image_mask: (B, T) bool, the image tokens (:func:`image_token_mask`).
        geometry: the :class:`ImageGeometry`.

    Returns:
        :class:`ImageScores`: one (..., rows, cols) grid per image.

    Raises:
        ValueError: an example's image tokens do not split into whole images.

    Examples:
        >>> g = ImageGeometry(9, (2, 2), ((2, 3),))
        >>> ids = torch.tensor([[1, 9, 9, 9, 9, 9, 9, 5]])
        >>> grid_scores(torch.arange(8.0)[None], ids == 9, g).grids[0]
        tensor([[1., 2., 3.],
                [4., 5., 6.]])
    """
    grids: List[Tensor] = []
    leading: List[Tensor] = []
    example: List[int] = []
    found = split_images(scores, image_mask, geometry.tokens, lambda image: (
        f"grid {geometry.grid(image)}, [CLS] {geometry.class_token}, {geometry.dropped} dropped"))
    for image, (b, part) in enumerate(found):
        rows, cols = geometry.grid(image)
        full = torch.full((*part.shape[:-1], int(geometry.class_token) + rows * cols), float("nan"),
                          dtype=part.dtype, device=part.device)
        full[..., geometry.dropped:] = part  # the tower's sequence, dropped features as NaN
        if geometry.class_token:
            leading.append(full[..., 0])
            full = full[..., 1:]
        grids.append(full.reshape(*full.shape[:-1], rows, cols))
        example.append(b)
    kept_class = geometry.class_token and geometry.dropped == 0
    return ImageScores(grids, torch.stack(leading) if kept_class and leading else None,
                       torch.tensor(example, dtype=torch.long))


def patches_to_pixels(grid: Tensor, patch: Tuple[int, int], size: Optional[Tuple[int, int]] = None) -> Tensor:
    r"""A (..., rows, cols) patch grid as a (..., H, W) heat map: each patch's pixels get its score.

    Args:
        grid: (..., rows, cols) scores.
        patch: (pixels per patch row, per patch column).
        size: (H, W) of the image, when it is not rows x patch by cols x patch (pixels past the
            last whole patch, which the tower does not see, get NaN); default the grid's extent.

    Returns:
        (..., H, W).

    Examples:
        >>> patches_to_pixels(torch.tensor([[1.0, 2.0]]), (2, 2))
        tensor([[1., 1., 2., 2.],
                [1., 1., 2., 2.]])
    """
    ph, pw = int(patch[0]), int(patch[1])
    pixels = grid.repeat_interleave(ph, dim=-2).repeat_interleave(pw, dim=-1)
    if size is None:
        return pixels
    h, w = int(size[0]), int(size[1])
    out = torch.full((*grid.shape[:-2], h, w), float("nan"), dtype=grid.dtype, device=grid.device)
    hh, ww = min(h, pixels.shape[-2]), min(w, pixels.shape[-1])
    out[..., :hh, :ww] = pixels[..., :hh, :ww]
    return out


def result_scores(result: Any) -> Tensor:
    r"""The per-token scores of a result of the package (its ``scores``), or the scores tensor itself."""
    scores = getattr(result, "scores", result)
    if isinstance(scores, tuple) and len(scores) == 1:
        scores = scores[0]
    if not isinstance(scores, Tensor):
        raise TypeError(f"expected per-token scores (a tensor, or a result with .scores); got {type(result).__name__}")
    return scores


def image_scores(result: Any, input_ids: Tensor, model: nn.Module, image_sizes: Optional[Tensor] = None,
                 image_grid_thw: Optional[Tensor] = None, image_position_ids: Optional[Tensor] = None) -> ImageScores:
    r"""The image tokens' scores of a result, one patch grid per image.

    Args:
        result: a result of the package (its ``scores`` (B, T) or (B, ..., T)) or the scores themselves.
        input_ids: (B, T) the token ids the result explains.
        model: the vision-language model.
        image_sizes, image_grid_thw, image_position_ids: as in :func:`image_geometry`.

    Returns:
        :class:`ImageScores`; for LLaVA-NeXT / OneVision an :class:`~captum_normattr.attr.vlm_anyres.AnyresScores`
        (base grids, tile grids and newline scores apart).
    """
    geometry = image_geometry(model, image_sizes, image_grid_thw, image_position_ids)
    scores = result_scores(result)
    if not isinstance(geometry, ImageGeometry):  # any-resolution tiles: their base views, tiles and newlines apart
        return anyres_scores(scores, image_token_mask(input_ids, geometry).to(scores.device), geometry)
    return grid_scores(scores, image_token_mask(input_ids, geometry).to(scores.device), geometry)


def image_heatmaps(result: Any, input_ids: Tensor, model: nn.Module, image_sizes: Optional[Tensor] = None,
                   sizes: Optional[Sequence[Tuple[int, int]]] = None,
                   image_grid_thw: Optional[Tensor] = None, image_position_ids: Optional[Tensor] = None
                   ) -> List[Tensor]:
    r"""Heat maps over the images' pixels: every image token's score spread over its patch.

    Args:
        result: a result (its ``scores``) or per-token scores, (B, T) or (B, ..., T).
        input_ids: (B, T) token ids.
        model: the vision-language model (:mod:`captum_normattr.arch.families.vlm`).
        image_sizes, image_grid_thw, image_position_ids: as in :func:`image_geometry`.
        sizes: (H, W) per image, when the images are larger than their whole patches; default
            each grid's extent (the tower's input size).

    Returns:
        One (..., H, W) tensor per image, in the model's order of images; NaN where no token
        covers a pixel. LLaVA-NeXT / OneVision: over the original image's pixels (``image_sizes``), the base view's
        and the tiles' scores summed (:func:`~captum_normattr.attr.vlm_anyres.anyres_heatmaps`; ``sizes`` unused).

    Examples::

        >>> res = ALTILogitAttribution(llava).decompose(ids, target=t,
        ...     additional_forward_args={"attention_mask": mask, "pixel_values": pixels})
        >>> heat = image_heatmaps(res, ids, llava)[0]  # (336, 336) for LLaVA 1.5
    """
    geometry = image_geometry(model, image_sizes, image_grid_thw, image_position_ids)
    scores = result_scores(result)
    if not isinstance(geometry, ImageGeometry):  # any-resolution tiles: the sum of both views over the original image
        return anyres_heatmaps(scores, input_ids, model, image_sizes)
    found = grid_scores(scores, image_token_mask(input_ids, geometry).to(scores.device), geometry)
    return [patches_to_pixels(g, geometry.patch, None if sizes is None else sizes[i]) for i, g in enumerate(found.grids)]


def two_way_pairs(two_way: str, token_type_ids: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
    r"""The (receiving i, source j > i) pairs that ``token_type_ids`` open above the diagonal.

    What the model's own mask adds to the causal one (Gemma 3's ``get_block_sequence_ids_for_mask``,
    PaliGemma's prefix); a decomposition of such a call is non-zero above the diagonal at these
    pairs only.

    Args:
        two_way: :attr:`VisionLanguage.two_way` (:data:`TWO_WAY`).
        token_type_ids: (B, T) integer.
        attention_mask: (B, T) 0/1, or None (every token real): pairs with a pad are dropped.

    Returns:
        (B, T, T) bool, True at the pairs (i, j), j > i, that attend two-way.

    Examples::

        >>> two_way_pairs("image_spans", torch.tensor([[0, 1, 1, 0]]))[0].nonzero().tolist()
        [[1, 2]]
    """
    if two_way not in TWO_WAY:
        raise ValueError(f"two_way must be one of {TWO_WAY}, got {two_way!r}")
    if two_way == "prefix":
        group = torch.where(token_type_ids == 0, 0, -1)
    else:
        image = token_type_ids == 1
        start = image & ~torch.nn.functional.pad(image, (1, 0))[:, :-1]
        group = torch.where(image, start.long().cumsum(-1), -1)
    t = group.shape[-1]
    pairs = (group[:, :, None] == group[:, None, :]) & (group[:, :, None] >= 0)
    pairs &= torch.ones(t, t, dtype=torch.bool, device=group.device).triu(1)
    if attention_mask is not None:
        real = attention_mask.bool()
        pairs &= real[:, :, None] & real[:, None, :]
    return pairs
