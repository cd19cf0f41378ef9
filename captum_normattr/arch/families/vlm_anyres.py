r"""LLaVA-NeXT and LLaVA-OneVision: vision-language models whose images are a base view and any-resolution tiles.

Their language model is an ordinary registered decoder (LLaVA-NeXT: Llama, Mistral, Vicuna = Llama; LLaVA-OneVision:
Qwen2) under ``model.model.language_model``, decomposed over the merged sequence like LLaVA's
(:mod:`captum_normattr.arch.families.vlm`). What differs is where the image tokens lie (geometry
``"anyres_tiles"``, :mod:`captum_normattr.attr.vlm_anyres`): each image is the base view (the image resized to the
tower's square, one token per patch) followed by the tiles of the best ``image_grid_pinpoints`` resolution stitched
into one big patch grid, unpadded to the image's aspect ratio (OneVision: bilinearly downscaled past
``vision_aspect_ratio``'s ``anyres_max_N``), with the learned ``image_newline`` vector after every row. The newline
tokens are image tokens of the sequence (their id is the image token's) but map to no pixel.

OneVision's videos (``pixel_values_videos`` (V, F, 3, S, S)) are frames through the same tower, each frame's n x n
patch grid bilinearly halved to ceil(n / 2) x ceil(n / 2) tokens (``apply_pooling``), the frames' tokens in order and
one ``image_newline`` after the last (video geometry: :mod:`captum_normattr.attr.vlm_video_pooled`).
"""
from __future__ import annotations

from typing import Dict

from captum_normattr.arch.families.vlm import VisionLanguage

__all__ = ["ANYRES_VISION_LANGUAGE", "LLAVA_NEXT", "LLAVA_ONEVISION"]

LLAVA_NEXT = VisionLanguage(
    family="LLaVA-NeXT", model_types=("llava_next",), inputs=("pixel_values", "image_sizes"), geometry="anyres_tiles",
    text_families=("llama", "mistral"),
    notes="CLIP tower, MLP projector; each image a base view (the tower's square patch grid) then the any-resolution "
          "tiles stitched into one grid, unpadded to the image's aspect ratio, an image_newline after every row",
)

LLAVA_ONEVISION = VisionLanguage(
    family="LLaVA-OneVision", model_types=("llava_onevision",),
    inputs=("pixel_values", "image_sizes", "batch_num_images", "pixel_values_videos", "image_sizes_videos"),
    geometry="anyres_tiles", text_families=("qwen2",), video_token=("video_token_id", "video_token_index"),
    notes="SigLIP tower, MLP projector; LLaVA-NeXT's base view and unpadded tiles, the tile grid bilinearly "
          "downscaled past anyres_max_N, an image_newline after every row; several images per prompt: base views only; "
          "videos: every frame's patch grid bilinearly halved, the frames in order, one image_newline at the end",
)

#: ``config.model_type`` -> description, merged into :data:`~captum_normattr.arch.registry.VISION_LANGUAGE`.
ANYRES_VISION_LANGUAGE: Dict[str, VisionLanguage] = {
    t: d for d in (LLAVA_NEXT, LLAVA_ONEVISION) for t in d.model_types}
