r"""Aggregation of layer maps over depth (``docs/design.md``, "Rollout").

The full rollout multiplies the (T, T) maps, O(L T^3). When only the explained rows are
needed, :func:`rollout_rows` carries one row vector down the stored maps, O(L T^2).
"""
from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import Tensor

from captum_normattr.decompose.mixing import row_normalize

ROLLOUT_CONVENTIONS = ("raw", "row_normalized")


def check_convention(convention: str) -> None:
    r"""Raise a ValueError naming the rollout conventions."""
    if convention not in ROLLOUT_CONVENTIONS:
        raise ValueError(f"rollout convention must be one of {ROLLOUT_CONVENTIONS}, got {convention!r}")


def _layers(layer_maps: Union[Tensor, Sequence[Tensor]]):
    if isinstance(layer_maps, Tensor):
        if layer_maps.dim() != 4 or layer_maps.shape[-1] != layer_maps.shape[-2]:
            raise ValueError(f"layer_maps must be (B, L, T, T), got shape {tuple(layer_maps.shape)}")
        return [layer_maps[:, l] for l in range(layer_maps.shape[1])]
    return list(layer_maps)


def rollout(layer_maps: Union[Tensor, Sequence[Tensor]], convention: str = "raw") -> Tensor:
    r"""Roll layer maps out over depth: A_1 = M_1, A_l = M_l A_{l-1}.

    Args:
        layer_maps: (B, L, T, T) (or a list of L (B, T, T) maps), entry [b, l, i, j] =
            contribution of token j to token i in layer l.
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
    check_convention(convention)
    maps = _layers(layer_maps)
    prep = row_normalize if convention == "row_normalized" else (lambda m: m)
    joint = prep(maps[0])
    for m in maps[1:]:
        joint = prep(m) @ joint
    return joint


def rollout_rows(layer_maps: Union[Tensor, Sequence[Tensor]], positions: Tensor, convention: str = "raw") -> Tensor:
    r"""The rows ``positions`` of :func:`rollout`, by vector-matrix products down the maps.

    e_i^T M_L M_{L-1} ... M_1 is computed from the top layer down, O(L T^2) instead of
    the O(L T^3) of the full product.

    Args:
        layer_maps: (B, L, T, T) or a list of L (B, T, T) maps (bottom layer first).
        positions: (B,) long, the row of every example.
        convention: as in :func:`rollout`.

    Returns:
        (B, T): row ``positions[b]`` of the rollout of example b.

    Examples::

        >>> maps = torch.rand(2, 3, 5, 5)
        >>> pos = torch.tensor([0, 4])
        >>> torch.allclose(rollout_rows(maps, pos), rollout(maps)[torch.arange(2), pos])
        True
    """
    check_convention(convention)
    maps = _layers(layer_maps)
    prep = row_normalize if convention == "row_normalized" else (lambda m: m)
    ar = torch.arange(positions.shape[0], device=positions.device)
    row = prep(maps[-1])[ar, positions]
    for m in reversed(maps[:-1]):
        row = torch.einsum("bj,bjk->bk", row, prep(m))
    return row
