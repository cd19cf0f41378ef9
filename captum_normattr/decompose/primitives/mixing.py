r"""Mixing ratios and fixed-residual corrections of layer maps (docs/design.md, section 4, norm maps)."""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["fixed_residual", "mixing_ratio", "pair_mask", "ratio_residual", "row_normalize"]


def mixing_ratio(total_parts: Tensor, own_part: Tensor) -> Tensor:
    r"""Kobayashi et al. 2021 context-mixing ratio per receiving token.

    r_i = |sum_{j != i} part_ij| / (|sum_{j != i} part_ij| + |part_ii|).

    Args:
        total_parts: (B, T, D) the sum of all token parts of token i (bias excluded).
        own_part: (B, T, D) part_ii.

    Returns:
        (B, T) ratios in [0, 1] (0 where both norms vanish).
    """
    others = (total_parts - own_part).norm(dim=-1)
    own = own_part.norm(dim=-1)
    denom = others + own
    return torch.where(denom > 0, others / denom.clamp_min(torch.finfo(denom.dtype).tiny), torch.zeros_like(denom))


def pair_mask(valid: Tensor, dtype: torch.dtype, causal: bool = False) -> Tensor:
    r"""(B, T, T) mask of the (receiving i, source j) pairs of real tokens, and j <= i if ``causal``.

    Args:
        valid: (B, T) bool, real tokens.
        dtype: the dtype of the mask.
        causal: also drop the pairs j > i (causal attention).

    Returns:
        (B, T, T) of 0 and 1.
    """
    m = valid.unsqueeze(-1) & valid.unsqueeze(-2)
    if causal:
        m = m.tril()
    return m.to(dtype)


def row_normalize(maps: Tensor, inplace: bool = False) -> Tensor:
    r"""Divide every row by its sum (rows summing to 0 stay 0).

    Args:
        maps: (..., T, T).
        inplace: divide ``maps`` itself (the same numbers; no second T x T tensor, for a caller
            that owns ``maps``).

    Returns:
        Same shape, rows summing to 1 where they were non-zero.
    """
    sums = maps.sum(-1, keepdim=True)
    positive = sums > 0
    divisor = torch.where(positive, sums, torch.ones_like(sums))
    out = maps.div_(divisor) if inplace else maps / divisor
    return out.masked_fill_(~positive, 0.0)


def _eye_like(maps: Tensor, valid: Tensor) -> Tensor:
    t = maps.shape[-1]
    eye = torch.eye(t, dtype=maps.dtype, device=maps.device)
    return eye * valid.to(maps.dtype).unsqueeze(-1)


def fixed_residual(maps: Tensor, valid: Tensor, residual_weight: float = 0.5) -> Tensor:
    r"""Abnar and Zuidema's fixed residual: (1 - w) * row-normalised map + w * I.

    Args:
        maps: (B, T, T) one layer's map.
        valid: (B, T) bool, non-pad tokens.
        residual_weight: w, 0.5 in the papers.

    Returns:
        (B, T, T) with pad rows and columns 0.
    """
    return (1.0 - residual_weight) * row_normalize(maps) + residual_weight * _eye_like(maps, valid)


def ratio_residual(maps: Tensor, ratio: Tensor, valid: Tensor) -> Tensor:
    r"""A map with its diagonal removed, rows renormalised, mixed with I by a per-token ratio.

    Entry (i, j) = r_i * M_ij / sum_{k != i} M_ik for j != i, and 1 - r_i on the diagonal.

    Args:
        maps: (B, T, T).
        ratio: (B, T) mixing ratios r_i (the share of context).
        valid: (B, T) bool.

    Returns:
        (B, T, T).
    """
    t = maps.shape[-1]
    eye = torch.eye(t, dtype=torch.bool, device=maps.device)
    off = row_normalize(maps.masked_fill(eye, 0.0))
    r = ratio.unsqueeze(-1).to(maps.dtype)
    return r * off + (1.0 - r) * _eye_like(maps, valid)
