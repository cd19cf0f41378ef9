r"""Video-token scores mapped back to the video: the Qwen families' frame groups, rows and columns.

Qwen2-VL and Qwen2.5-VL take videos besides images (``pixel_values_videos``, ``video_grid_thw``; Qwen2.5-VL also
``second_per_grid_ts``, the seconds between two frame groups, which spaces the temporal M-RoPE positions). The
video tokens (``config.video_token_id``) go into the decoder like the image tokens, so every decomposition of the
language model (``docs/vlm.md``) gives each video token its share of the explained logit. This module lays those
shares back on the video.

The geometry (the processor's and the tower's, ``docs/vlm.md``, "Videos"): a video of F frames of H x W pixels
(the processor's resized frames; F padded up to a multiple of ``temporal_patch_size`` tp by repeating the last
frame) is cut into ``video_grid_thw`` (t, h, w) patches: t = F / tp frame groups, each patch tp frames x p x p
pixels (``vision_config.patch_size`` p). Every m x m block of patches of one frame group
(``vision_config.spatial_merge_size`` m) is one token, and the tokens run frame group by frame group, each group
row by row over (h / m) x (w / m): token k of a video lies at

    group k // (h/m * w/m),   row (k // (w/m)) % (h/m),   column k % (w/m),

covering frames tp g ... tp g + tp - 1 and (p m) x (p m) pixels. :func:`video_heatmaps` returns one
(..., t, H, W) map per video (a frame group's score on its pixels), or with ``frames=True`` one
(..., t tp, H, W) map (every frame of a group gets the group's score).

Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE take the same inputs (no ``second_per_grid_ts``) but write a video
frame group by frame group, each group its own ``<vision_start> ... <vision_end>`` span after its timestamp text; the
model splits ``video_grid_thw`` per group for its M-RoPE positions. The video tokens, read in order across the spans,
keep the order above, so the same maps hold (the timestamps are text tokens). LLaVA-OneVision's pooled frames are
mapped by :mod:`captum_normattr.attr.vlm_video_pooled`.

The videos are found in the order the model reads them (example by example, left to right), as
``video_grid_thw`` lists them. Images in the same prompt keep their own tokens and their own map
(:func:`captum_normattr.attr.vlm_regions.image_heatmaps` with ``image_grid_thw``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from captum_normattr.arch.families.vlm import VISION_LANGUAGE
from captum_normattr.arch.spec import UnsupportedModelError
from captum_normattr.attr.vlm_regions import ImageGeometry, grid_scores, patches_to_pixels, result_scores
from captum_normattr.models.adapters import unwrap_model, vision_language

__all__ = [
    "VideoGeometry",
    "VideoScores",
    "video_geometry",
    "video_grid_scores",
    "video_heatmaps",
    "video_scores",
    "video_token_mask",
]


@dataclass(frozen=True)
class VideoGeometry:
    r"""How one model's video tokens lie over its videos.

    Attributes:
        video_token_id: the id of the video placeholder token.
        patch: (pixels per token row, per token column): p m each.
        frames_per_group: frames of one frame group (``temporal_patch_size``).
        grids: (frame groups, rows, cols) of tokens per video, in the model's order of videos.
    """

    video_token_id: int
    patch: Tuple[int, int]
    frames_per_group: int
    grids: Tuple[Tuple[int, int, int], ...]

    def tokens(self, video: int) -> int:
        r"""Video tokens of video ``video``: groups x rows x cols."""
        t, rows, cols = self.grids[video]
        return t * rows * cols


@dataclass
class VideoScores:
    r"""Per-video scores of the video tokens.

    Attributes:
        grids: one (..., groups, rows, cols) tensor per video, in the order the model reads the videos.
        example: (n_videos,) the example each video belongs to.
    """

    grids: List[Tensor]
    example: Tensor


def _video_families() -> str:
    return ", ".join(sorted({d.family for d in VISION_LANGUAGE.values()
                             if d.video_token and d.geometry == "merged_grid"}))


def video_geometry(model: nn.Module, video_grid_thw: Tensor) -> VideoGeometry:
    r"""The video-token geometry of a vision-language model that takes videos.

    Args:
        model: Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE) or Qwen3.5(-MoE) (a ``"merged_grid"`` description with
            :attr:`~captum_normattr.arch.families.vlm.VisionLanguage.video_token`).
        video_grid_thw: (n_videos, 3) the processor's patches per video: frame groups t, patch rows h, patch
            columns w.

    Returns:
        :class:`VideoGeometry`: (t, h / m, w / m) tokens per video, each token (p m) x (p m) pixels of
        ``temporal_patch_size`` frames.

    Raises:
        UnsupportedModelError: a model whose family takes no videos (naming those that do), or LLaVA-OneVision
            (:mod:`captum_normattr.attr.vlm_video_pooled`).
        ValueError: a config without the numbers, or a grid the merge does not divide.

    Examples::

        >>> g = video_geometry(qwen2_vl, torch.tensor([[2, 4, 6]]))  # 4 frames of 8 x 12 pixels, 2-pixel patches
        >>> g.grids, g.patch, g.frames_per_group
        (((2, 2, 3),), (4, 4), 2)
    """
    model = unwrap_model(model)
    description = vision_language(model)
    if description is None or not description.video_token:
        name = type(model).__name__ if description is None else description.family
        raise UnsupportedModelError(f"captum_normattr maps video tokens of {_video_families()} only; {name} takes no "
                                    "videos the package describes (docs/vlm.md, 'Videos')")
    if description.geometry != "merged_grid":  # LLaVA-OneVision: pooled frames and a newline
        raise UnsupportedModelError(f"{description.family}'s video tokens are pooled frames, not frame groups of "
                                    "merged patches: map them with captum_normattr.attr.vlm_video_pooled "
                                    "(docs/vlm.md, 'Videos')")
    config = model.config
    token = next((getattr(config, n) for n in description.video_token if getattr(config, n, None) is not None), None)
    if token is None:
        raise ValueError(f"the {description.family} config has no {' or '.join(description.video_token)}")
    vision = getattr(config, description.vision_config, None)
    numbers = {k: getattr(vision, k, None) for k in ("patch_size", "spatial_merge_size", "temporal_patch_size")}
    missing = [k for k, v in numbers.items() if v is None]
    if missing:
        raise ValueError(f"the model's {description.vision_config} has no {missing}")
    p, m, tp = (int(numbers[k]) for k in ("patch_size", "spatial_merge_size", "temporal_patch_size"))
    thw = torch.as_tensor(video_grid_thw).reshape(-1, 3).tolist()
    if any(int(h) % m or int(w) % m for _, h, w in thw):
        raise ValueError(f"video_grid_thw {thw}: every video's patch rows and columns must be multiples of the "
                         f"spatial merge size {m}")
    return VideoGeometry(int(token), (p * m, p * m), tp, tuple((int(t), int(h) // m, int(w) // m) for t, h, w in thw))


def video_token_mask(input_ids: Tensor, geometry: VideoGeometry) -> Tensor:
    r"""(B, T) bool: where the video tokens are."""
    return input_ids == geometry.video_token_id


def video_grid_scores(scores: Tensor, video_mask: Tensor, geometry: VideoGeometry) -> VideoScores:
    r"""Split every example's video-token scores into videos and lay each on its (groups, rows, cols) grid.

    Args:
        scores: (B, T) or (B, ..., T) per-token scores (middle axes, e.g. several explained tokens, kept).
        video_mask: (B, T) bool, the video tokens (:func:`video_token_mask`).
        geometry: the :class:`VideoGeometry`.

    Returns:
        :class:`VideoScores`: one (..., groups, rows, cols) grid per video.

    Raises:
        ValueError: an example's video tokens do not split into whole videos of the geometry, or the grids
            name more or fewer videos than the ids hold.

    Examples:
        >>> g = VideoGeometry(7, (4, 4), 2, ((2, 1, 2),))
        >>> ids = torch.tensor([[1, 7, 7, 7, 7, 5]])
        >>> video_grid_scores(torch.arange(6.0)[None], ids == 7, g).grids[0]
        tensor([[[1., 2.]],
        <BLANKLINE>
                [[3., 4.]]])
    """
    # a video's tokens run group-major, then row by row: a (t rows) x cols image grid, reshaped
    flat = ImageGeometry(geometry.video_token_id, geometry.patch, tuple((t * r, c) for t, r, c in geometry.grids))
    if not geometry.grids:
        if bool(video_mask.any()):
            raise ValueError("the ids hold video tokens but video_grid_thw lists no video")
        return VideoScores([], torch.zeros(0, dtype=torch.long))
    try:
        found = grid_scores(scores, video_mask, flat)
    except IndexError:
        raise ValueError(f"the ids hold more videos than video_grid_thw lists ({len(geometry.grids)})") from None
    if len(found.grids) != len(geometry.grids):
        raise ValueError(f"the ids hold {len(found.grids)} videos but video_grid_thw lists {len(geometry.grids)}")
    grids = [g.reshape(*g.shape[:-2], *geometry.grids[i]) for i, g in enumerate(found.grids)]
    return VideoScores(grids, found.example)


def video_scores(result: Any, input_ids: Tensor, model: nn.Module, video_grid_thw: Tensor) -> VideoScores:
    r"""The video tokens' scores of a result, one (..., groups, rows, cols) grid per video.

    Args:
        result: a result of the package (its ``scores`` (B, T) or (B, ..., T)) or the scores themselves.
        input_ids: (B, T) the token ids the result explains.
        model: Qwen2-VL or Qwen2.5-VL.
        video_grid_thw: (n_videos, 3) as the processor gives it.

    Returns:
        :class:`VideoScores`.
    """
    geometry = video_geometry(model, video_grid_thw)
    scores = result_scores(result)
    return video_grid_scores(scores, video_token_mask(input_ids, geometry).to(scores.device), geometry)


def video_heatmaps(result: Any, input_ids: Tensor, model: nn.Module, video_grid_thw: Tensor, frames: bool = False,
                   sizes: Optional[Sequence[Tuple[int, int]]] = None) -> List[Tensor]:
    r"""Heat maps over the videos' frames: every video token's score spread over its pixels.

    Args:
        result: a result (its ``scores``) or per-token scores, (B, T) or (B, ..., T).
        input_ids: (B, T) token ids.
        model: Qwen2-VL or Qwen2.5-VL.
        video_grid_thw: (n_videos, 3) as the processor gives it.
        frames: False: one map per frame group, (..., t, H, W); True: one per frame, (..., t tp, H, W), each
            frame holding its group's score (the processor's padding frames, repeats of the last frame, included).
        sizes: (H, W) per video where the frames are larger than their whole tokens (pixels past them get NaN);
            default each grid's extent (the processor's resized frame).

    Returns:
        One tensor per video, in the model's order of videos.

    Examples::

        >>> res = ALTILogitAttribution(qwen2_vl).decompose(ids, target=t, additional_forward_args={
        ...     "attention_mask": mask, "pixel_values_videos": pv, "video_grid_thw": thw, "mm_token_type_ids": types})
        >>> heat = video_heatmaps(res, ids, qwen2_vl, thw)[0]  # (t, H, W)
    """
    geometry = video_geometry(model, video_grid_thw)
    scores = result_scores(result)
    found = video_grid_scores(scores, video_token_mask(input_ids, geometry).to(scores.device), geometry)
    maps = [patches_to_pixels(g, geometry.patch, None if sizes is None else sizes[i])
            for i, g in enumerate(found.grids)]
    if frames:
        maps = [m.repeat_interleave(geometry.frames_per_group, dim=-3) for m in maps]
    return maps
