r"""Aggregation of layer maps over depth (DESIGN section 6)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from captum_normattr.decompose.mixing import row_normalize

ROLLOUT_CONVENTIONS = ("raw", "row_normalized")


def rollout(layer_maps: Tensor, convention: str = "raw") -> Tensor:
    r"""Roll layer maps out over depth: A_1 = M_1, A_l = M_l A_{l-1}.

    Args:
        layer_maps: (B, L, T, T), entry [b, l, i, j] = contribution of token j to token i
            in layer l.
        convention: ``"raw"`` multiplies the maps as they are (what the GlobEnc and ALTI
            reference code ran for every published figure; the default), or
            ``"row_normalized"`` divides each map by its row sums first (what the GlobEnc
            paper's text describes).

    Returns:
        (B, T, T): entry [b, i, j] = contribution of input token j to the last layer's
        output at token i.

    Examples::

        >>> maps = torch.rand(2, 3, 5, 5)
        >>> rollout(maps).shape
        torch.Size([2, 5, 5])
    """
    if convention not in ROLLOUT_CONVENTIONS:
        raise ValueError(f"rollout convention must be one of {ROLLOUT_CONVENTIONS}, got {convention!r}")
    if layer_maps.dim() != 4 or layer_maps.shape[-1] != layer_maps.shape[-2]:
        raise ValueError(f"layer_maps must be (B, L, T, T), got shape {tuple(layer_maps.shape)}")
    maps = row_normalize(layer_maps) if convention == "row_normalized" else layer_maps
    joint = maps[:, 0]
    for layer in range(1, maps.shape[1]):
        joint = maps[:, layer] @ joint
    return joint


def rollout_layers(layer_maps: Tensor, convention: str = "raw") -> Tensor:
    r"""Rollout after every layer: (B, L, T, T) where [:, l] is the product up to layer l.

    Args:
        layer_maps: (B, L, T, T).
        convention: as in :func:`rollout`.

    Returns:
        (B, L, T, T).
    """
    if convention not in ROLLOUT_CONVENTIONS:
        raise ValueError(f"rollout convention must be one of {ROLLOUT_CONVENTIONS}, got {convention!r}")
    maps = row_normalize(layer_maps) if convention == "row_normalized" else layer_maps
    out = [maps[:, 0]]
    for layer in range(1, maps.shape[1]):
        out.append(maps[:, layer] @ out[-1])
    return torch.stack(out, dim=1)
