r"""Gemma 4 with images (``Gemma4ForConditionalGeneration``, ``model_type`` ``"gemma4"``): what its description says, and why.

What the model does with an image (transformers' ``Gemma4Model.forward``) and what the description says:

- **Soft tokens.** The processor patchifies every image itself (``pixel_values`` (n_images, max_patches,
  3 p^2), the patches' (x, y) positions in ``image_position_ids`` (n_images, max_patches, 2), (-1, -1) on
  padding). The vision tower's outputs are average-pooled over k x k blocks of patches by position
  (``vision_config.pooling_kernel_size`` k), the padding blocks dropped, and projected (an RMSNorm without
  gain, a linear map) into the text model's width; these soft tokens are written into the embeddings of
  the image tokens (``config.image_token_id``) in order. The decompositions start at the merged
  embeddings: an image token is a per-token input like a word (:mod:`captum_normattr.arch.families.vlm`).
- **Per-layer inputs.** The per-layer input of an image token is computed from the pad token's per-layer
  embedding and a projection of the token's own merged embedding (its soft token): a function of that token
  alone, so the per-layer-input branch stays each token's own part (docs/frontier.md, "Gemma 4").
- **Attention over image spans.** With ``text_config.use_bidirectional_attention == "vision"`` and the
  processor's ``mm_token_type_ids`` (1 on image tokens), each maximal run of image tokens attends to itself
  two-way on the SLIDING-window layers; the full-attention layers stay causal (unlike Gemma 3, two-way on
  every layer). Such a call is decomposed as a two-way call (full maps; the recorded probabilities carry the
  model's own mask, so the full layers' maps stay lower triangular and the sliding layers' open exactly
  the image spans). Without ``mm_token_type_ids``, or with ``use_bidirectional_attention`` None, the
  model is causal and so is the decomposition.
- **Geometry** (``"pooled_sizes"``): the processor resizes each image, keeping its aspect ratio, to
  h x w pixels with h and w multiples of p k (variable resolution, at most ``max_soft_tokens`` tokens);
  the tokens lie row by row over its (h / p / k) x (w / p / k) grid, each covering p k x p k pixels of the
  resized image. :func:`gemma4_image_sizes` reads (h, w) from ``image_position_ids``, which
  :func:`~captum_normattr.attr.vlm_regions.image_scores`, :func:`~captum_normattr.attr.vlm_regions.image_heatmaps`
  and the ``ImageMaskInput`` route take as they are. The heat maps are over the resized image
  (the processor's resize is a plain aspect-preserving one: scale them by the original size over
  (h, w) to lay them over the original).
- **Refused inputs.** Audio (``input_features``, ``input_features_mask``: the audio tower's soft tokens)
  and video (``pixel_values_videos``) inputs are refused: their soft tokens would be per-token inputs too,
  but neither their token types nor their geometry are checked by the package yet.

:data:`~captum_normattr.arch.families.vlm.GEMMA4` is the description (data, with the others in
:mod:`captum_normattr.arch.families.vlm`); this module holds what it needs beyond data.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["gemma4_image_sizes"]


def gemma4_image_sizes(image_position_ids: Tensor, patch_size: int) -> Tensor:
    r"""Each image's (h, w) in pixels as the tower saw it (the processor's resized image), from its patch positions.

    Args:
        image_position_ids: (n_images, max_patches, 2) the processor's (x, y) patch positions, (-1, -1) on padding.
        patch_size: ``vision_config.patch_size`` p.

    Returns:
        (n_images, 2) long: ((max y + 1) p, (max x + 1) p) per image.

    Raises:
        ValueError: an image without patches, or positions that do not fill a rectangle.

    Examples::

        >>> gemma4_image_sizes(inputs["image_position_ids"], model.config.vision_config.patch_size)
        tensor([[ 40, 104]])
    """
    pos = torch.as_tensor(image_position_ids)
    if pos.dim() != 3 or pos.shape[-1] != 2:
        raise ValueError(f"image_position_ids must be (n_images, max_patches, 2); got {tuple(pos.shape)}")
    sizes = []
    for n, p in enumerate(pos):
        real = p[(p >= 0).all(-1)]
        if real.numel() == 0:
            raise ValueError(f"image {n} has no patches (every position is padding)")
        cols, rows = int(real[:, 0].max()) + 1, int(real[:, 1].max()) + 1
        if real.shape[0] != rows * cols:
            raise ValueError(f"image {n}'s {real.shape[0]} patches do not fill its {rows} x {cols} grid")
        sizes.append((rows * patch_size, cols * patch_size))
    return torch.tensor(sizes, dtype=torch.long)
