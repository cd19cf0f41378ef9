r"""Pictures for Vision Transformers (ViT, DeiT, DINOv2); the command line is :mod:`captum_normattr.cli.images`.

- :func:`patch_heatmap`: the patch scores of one image as a heat map blended over the image.
- :func:`layer_patch_rows`: the per-layer maps of one token's row (which patches it takes
  from, layer by layer) as patch grids.

Matplotlib is needed for the pictures (``pip install matplotlib``).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

from torch import Tensor

from captum_normattr.present.colours import colormap

__all__ = ["image_for_display", "layer_patch_rows", "patch_heatmap"]


def image_for_display(pixel_values: Tensor) -> Tensor:
    r"""(C, H, W) pixel values (any normalisation) -> (H, W, C) in [0, 1], min-max scaled per image."""
    x = pixel_values.detach().float().cpu()
    x = (x - x.min()) / (x.max() - x.min()).clamp_min(1e-12)
    x = x.permute(1, 2, 0)
    return x.expand(-1, -1, 3) if x.shape[-1] == 1 else x


def patch_heatmap(
    pixel_values: Tensor,
    patch_grid: Tensor,
    ax: Any = None,
    alpha: float = 0.5,
    cmap: Optional[str] = None,
    title: Optional[str] = None,
):
    r"""The patch scores of one image as a heat map blended over the image.

    Args:
        pixel_values: (C, H, W) the image as the model saw it.
        patch_grid: (H/p, W/p) patch scores (``result.extras["patch_grid"][b]``).
        ax: a matplotlib axis (a new figure if None).
        alpha: opacity of the heat map.
        cmap: colormap; default: the package's scale (:func:`~captum_normattr.present.colours.colormap`),
            blue-white-red centred at 0 for signed scores, white to red otherwise.
        title: axis title.

    Returns:
        The matplotlib figure.

    Examples::

        >>> res = DecompXAttribution(model).decompose(pixel_values)
        >>> fig = patch_heatmap(pixel_values[0], res.extras["patch_grid"][0], title="DecompX")
    """
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=(4, 4))
    fig = ax.figure
    img = image_for_display(pixel_values)
    g = patch_grid.detach().float().cpu()
    h, w = img.shape[:2]
    signed = bool((g < 0).any())
    lim = float(g.abs().max()) or 1.0
    ax.imshow(img.numpy())
    im = ax.imshow(
        g.numpy(), cmap=cmap or colormap(signed), alpha=alpha, extent=(0, w, h, 0),
        interpolation="nearest", vmin=-lim if signed else min(0.0, float(g.min())), vmax=lim,
    )
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    ax.set_axis_off()
    if title:
        ax.set_title(title)
    return fig


def layer_patch_rows(
    layer_maps: Tensor, row: int, grid: Tuple[int, int], num_prefix: int, cmap: Optional[str] = None,
    title: Optional[str] = None
):
    r"""The per-layer maps of one token's row as patch grids, one panel per layer.

    Args:
        layer_maps: (L, T, T) one example's layer maps (``result.layer_maps[b]``).
        row: the receiving token (0 = [CLS]; patch (r, c) is ``num_prefix + r * W/p + c``).
        grid: (H/p, W/p).
        num_prefix: tokens before the first patch (``result.extras["num_prefix_tokens"]``).
        cmap: colormap (default: the package's scale, white to red; one colour scale for all panels).
        title: figure title.

    Returns:
        The matplotlib figure; the panel titles give the share of the row's total that goes
        to the prefix tokens ([CLS], distillation, registers), which the grids do not show.
    """
    import matplotlib.pyplot as plt

    maps = layer_maps.detach().float().cpu()
    n = maps.shape[0]
    cols = min(n, 6)
    rows_ = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows_, cols, figsize=(2.2 * cols, 2.3 * rows_), squeeze=False)
    patches = maps[:, row, num_prefix:]
    lo, hi = float(patches.min()), float(patches.abs().max()) or 1.0
    for l in range(rows_ * cols):
        ax = axes[l // cols][l % cols]
        ax.set_axis_off()
        if l >= n:
            continue
        r = maps[l, row]
        ax.imshow(r[num_prefix:].reshape(grid).numpy(), cmap=cmap or colormap(lo < 0), interpolation="nearest",
                  vmin=0.0 if lo >= 0 else -hi, vmax=hi)
        total = float(r.sum())
        share = float(r[:num_prefix].sum()) / total if total else 0.0
        ax.set_title(f"layer {l + 1} (prefix {share:.0%})", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
