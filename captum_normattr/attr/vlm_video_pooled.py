r"""LLaVA-OneVision's video tokens mapped back to the video: frames, pooled rows and columns, and the newline.

LLaVA-OneVision takes videos as ``pixel_values_videos`` (V, F, 3, S, S): V videos of F frames each, every frame
resized by the processor to the tower's S x S square (``vision_config.image_size``). The model
(``get_video_features``) runs every frame through the tower and the projector (n x n tokens, n = S / p,
``vision_config.patch_size`` p), pools each frame's grid bilinearly to o x o with o = ceil(n / 2)
(``apply_pooling``: ``interpolate(..., mode="bilinear")``), lays the frames' tokens one after the other and appends the
learned ``image_newline`` once. The processor writes F o^2 + 1 video tokens (``config.video_token_id``) per video, so
token k < F o^2 of a video lies at

    frame k // o^2,   row (k // o) % o,   column k % o,

and the last token is the newline: it gets a score of its own but covers no pixel.

Pooled token (r, c) of a frame covers the pixels of the S x S frame whose centre (y + 1/2, x + 1/2) has
``floor((y + 1/2) o / S) = r`` and ``floor((x + 1/2) o / S) = c``: the box of patches it stands for, whose centre its
bilinear sample is. Where n is even this is exactly the 2 x 2 block of patches the token averages (2p x 2p pixels);
where n is odd (OneVision's 384-pixel frames in 14-pixel patches: n = 27, o = 14) a token's bilinear weights also
reach a quarter into the neighbouring patches, and the box is the token's share of the frame, not its exact receptive
field.

:func:`pooled_video_heatmaps` gives one (..., F, S, S) map per video, :func:`pooled_video_scores` the (..., F, o, o)
grids and the newline tokens' scores. Images in the same prompt keep their own tokens and maps
(:func:`captum_normattr.attr.vlm_anyres.anyres_heatmaps`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List

import torch
from torch import Tensor, nn

from captum_normattr.arch.spec import UnsupportedModelError
from captum_normattr.attr.image_tokens import split_images
from captum_normattr.attr.vlm_regions import result_scores
from captum_normattr.models.adapters import unwrap_model, vision_language

__all__ = [
    "PooledVideoGeometry",
    "PooledVideoScores",
    "pooled_video_geometry",
    "pooled_video_heatmaps",
    "pooled_video_scores",
]

#: the geometry of the families whose videos this module maps
POOLED_VIDEO_GEOMETRIES = ("anyres_tiles",)


@dataclass(frozen=True)
class PooledVideoGeometry:
    r"""How LLaVA-OneVision's video tokens lie over its videos.

    Attributes:
        video_token_id: the id of the video placeholder token.
        videos: the number of videos V.
        frames: frames per video F.
        grid: o, the pooled tokens per frame row and column.
        size: S, the frames' side in pixels.
    """

    video_token_id: int
    videos: int
    frames: int
    grid: int
    size: int

    @property
    def tokens(self) -> int:
        r"""Video tokens per video: F o^2 pooled tokens and the newline."""
        return self.frames * self.grid * self.grid + 1

    def pixel_tokens(self) -> Tensor:
        r"""(S,) long: the pooled row (or column) whose box holds each pixel row (or column)."""
        centres = torch.arange(self.size, dtype=torch.float64) + 0.5
        return torch.floor(centres * self.grid / self.size).long().clamp(max=self.grid - 1)


@dataclass
class PooledVideoScores:
    r"""Per-video scores of the video tokens.

    Attributes:
        grids: one (..., F, o, o) tensor per video, in the order the model reads the videos.
        newline: one (...) tensor per video, its newline token's score.
        example: (V,) the example each video belongs to.
    """

    grids: List[Tensor]
    newline: List[Tensor]
    example: Tensor


def pooled_video_geometry(model: nn.Module, pixel_values_videos: Any) -> PooledVideoGeometry:
    r"""The video-token geometry of LLaVA-OneVision.

    Args:
        model: LLaVA-OneVision.
        pixel_values_videos: (V, F, 3, S, S) the videos as the model takes them, or their shape.

    Returns:
        :class:`PooledVideoGeometry`.

    Raises:
        UnsupportedModelError: another family (Qwen2-VL's and the Qwen3 families' videos:
            :mod:`captum_normattr.attr.vlm_video`).
        ValueError: frames of another side than the tower's, or a config without the numbers.

    Examples::

        >>> g = pooled_video_geometry(onevision, torch.zeros(1, 3, 3, 8, 8))  # 2-pixel patches: 4 x 4 -> 2 x 2
        >>> g.frames, g.grid, g.tokens
        (3, 2, 13)
    """
    model = unwrap_model(model)
    description = vision_language(model)
    if description is None or not description.video_token or description.geometry not in POOLED_VIDEO_GEOMETRIES:
        name = type(model).__name__ if description is None else description.family
        raise UnsupportedModelError(f"captum_normattr.attr.vlm_video_pooled maps LLaVA-OneVision's video tokens only; "
                                    f"{name}'s videos, where it takes them, are mapped by "
                                    "captum_normattr.attr.vlm_video (docs/vlm.md, 'Videos')")
    config = model.config
    token = next((getattr(config, n) for n in description.video_token if getattr(config, n, None) is not None), None)
    vision = getattr(config, description.vision_config, None)
    side, patch = getattr(vision, "image_size", None), getattr(vision, "patch_size", None)
    if token is None or side is None or patch is None:
        raise ValueError(f"the {description.family} config has no video token id, or its vision config no image_size "
                         "or patch_size")
    shape = tuple(pixel_values_videos.shape if isinstance(pixel_values_videos, Tensor) else pixel_values_videos)
    if len(shape) != 5 or shape[-1] != shape[-2] or shape[-1] != int(side):
        raise ValueError(f"pixel_values_videos must be (videos, frames, channels, {side}, {side}) (the frames resized "
                         f"to the tower's side); got {shape}")
    return PooledVideoGeometry(int(token), int(shape[0]), int(shape[1]), math.ceil(int(side) // int(patch) / 2),
                               int(side))


def pooled_video_scores(result: Any, input_ids: Tensor, model: nn.Module,
                        pixel_values_videos: Any) -> PooledVideoScores:
    r"""The video tokens' scores of a result: one (..., F, o, o) grid and one newline score per video.

    Args:
        result: a result of the package (its ``scores`` (B, T) or (B, ..., T)) or the scores themselves.
        input_ids: (B, T) the token ids the result explains.
        model: LLaVA-OneVision.
        pixel_values_videos: (V, F, 3, S, S) as the model took them (or their shape).

    Returns:
        :class:`PooledVideoScores`.

    Raises:
        ValueError: the ids' video tokens are not V whole videos of the geometry.
    """
    return _split(result_scores(result), input_ids, pooled_video_geometry(model, pixel_values_videos))


def _split(scores: Tensor, input_ids: Tensor, geometry: PooledVideoGeometry) -> PooledVideoScores:
    mask = (input_ids == geometry.video_token_id).to(scores.device)
    if int(mask.sum()) != geometry.videos * geometry.tokens:
        raise ValueError(f"the ids hold {int(mask.sum())} video tokens; {geometry.videos} videos of {geometry.frames} "
                         f"frames need {geometry.videos} x ({geometry.frames} x {geometry.grid}^2 + 1 newline)")
    found = split_images(scores, mask, lambda _: geometry.tokens, lambda _: f"{geometry.frames} frames")
    o, f = geometry.grid, geometry.frames
    grids = [part[..., :-1].reshape(*part.shape[:-1], f, o, o) for _, part in found]
    return PooledVideoScores(grids, [part[..., -1] for _, part in found],
                             torch.tensor([b for b, _ in found], dtype=torch.long))


def pooled_video_heatmaps(result: Any, input_ids: Tensor, model: nn.Module, pixel_values_videos: Any) -> List[Tensor]:
    r"""Heat maps over LLaVA-OneVision's video frames: every pooled token's score on the pixels of its box.

    Args:
        result: a result (its ``scores``) or per-token scores, (B, T) or (B, ..., T).
        input_ids: (B, T) token ids.
        model: LLaVA-OneVision.
        pixel_values_videos: (V, F, 3, S, S) as the model took them (or their shape).

    Returns:
        One (..., F, S, S) tensor per video, in the model's order (the newline's score, on no pixel, is in
        :func:`pooled_video_scores`).

    Examples::

        >>> res = ALTILogitAttribution(onevision).decompose(ids, target=t, additional_forward_args={
        ...     "attention_mask": mask, "pixel_values_videos": pv})
        >>> heat = pooled_video_heatmaps(res, ids, onevision, pv)[0]  # (F, S, S)
    """
    geometry = pooled_video_geometry(model, pixel_values_videos)
    scores = result_scores(result)
    index = geometry.pixel_tokens().to(scores.device)
    return [g.index_select(-2, index).index_select(-1, index) for g in _split(scores, input_ids, geometry).grids]

