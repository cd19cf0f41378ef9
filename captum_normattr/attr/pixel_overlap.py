r"""Where a token grid lies over an image's pixels, and the share of each token's pixels in each segment.

The rule behind every image segment's score (``captum_normattr.attr.llm_images``) and every tiled heat map
(``captum_normattr.attr.vlm_tiles``): a pixel belongs to the grid cell under its centre; a segment's share of a
cell is the fraction of the cell's pixels inside the image that lie in the segment.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["pixel_patches", "segment_overlap"]


def pixel_patches(image_hw: Tuple[int, int], grid: Tuple[int, int], box: Tuple[float, float, float, float]) -> Tensor:
    r"""(H, W) long: the patch (row-major index over ``grid``) under every pixel's centre, -1 outside the box.

    Args:
        image_hw: (H, W) of the original image.
        grid: (rows, cols) of the patch grid.
        box: ``(top, left, height, width)`` that the grid covers (:func:`~captum_normattr.attr.llm_images.grid_box`).

    Examples::

        >>> pixel_patches((2, 4), (1, 2), (0, 0, 2, 4))
        tensor([[0, 0, 1, 1],
                [0, 0, 1, 1]])
    """
    h, w = int(image_hw[0]), int(image_hw[1])
    rows, cols = int(grid[0]), int(grid[1])
    top, left, bh, bw = box
    y = (torch.arange(h, dtype=torch.float64) + 0.5 - top) / bh * rows
    x = (torch.arange(w, dtype=torch.float64) + 0.5 - left) / bw * cols
    r, c = torch.floor(y).long(), torch.floor(x).long()
    r_in, c_in = (r >= 0) & (r < rows), (c >= 0) & (c < cols)
    idx = r.unsqueeze(1) * cols + c.unsqueeze(0)
    return torch.where(r_in.unsqueeze(1) & c_in.unsqueeze(0), idx, torch.full_like(idx, -1))


def segment_overlap(masks: Sequence[Tensor], patch_of_pixel: Tensor, n_patches: int) -> Tensor:
    r"""(S, n_patches) float64: the share of every patch's pixels that lie in every segment.

    Args:
        masks: S boolean (H, W) segment masks (Captum's ``ImageMaskInput.get_mask_list()``).
        patch_of_pixel: (H, W) the patch under each pixel, -1 for none (:func:`pixel_patches`).
        n_patches: rows x cols.

    Returns:
        (S, n_patches); a patch with no pixel (outside the image) has a zero column.
    """
    inside = patch_of_pixel >= 0
    total = torch.bincount(patch_of_pixel[inside], minlength=n_patches).to(torch.float64)
    out = torch.zeros(len(masks), n_patches, dtype=torch.float64)
    for s, m in enumerate(masks):
        m = torch.as_tensor(m).bool().cpu()
        if m.shape != patch_of_pixel.shape:
            raise ValueError(f"segment mask {s} has shape {tuple(m.shape)}; the image is {tuple(patch_of_pixel.shape)}")
        out[s] = torch.bincount(patch_of_pixel[m & inside], minlength=n_patches).to(torch.float64)
    return out / total.clamp_min(1.0)
