r"""Parts of the attention block and their norms (DESIGN sections 2, 3 and 7).

Token j's part of the attention output of token i is
a_{i<-j} = sum_h alpha^h_ij f^h(x_j), with f^h(x_j) = v^h_j W_O^h (the value bias inside).
Nothing here builds a per-head (H, T, T, D) tensor: norms of linearly transformed
parts come from per-token H x H Gram matrices, and explicit parts are produced in row
chunks from per-head projected values (B, H, T, D).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def project_values(values: Tensor, head_weight: Tensor, lin_map: Optional[Tensor] = None) -> Tensor:
    r"""Project every head's values through its slice of W_O (and optionally a map A).

    Args:
        values: (B, H, T, Dh) value states (bias included).
        head_weight: (H, Dh, D) the output projection per head.
        lin_map: optional (D, D) right-multiplied linear map A applied after W_O.

    Returns:
        (B, H, T, D): f^h(x_j) A for every head h and token j.
    """
    w = head_weight if lin_map is None else head_weight @ lin_map
    return torch.einsum("bhtk,hkd->bhtd", values, w)


def diagonal_attention_parts(probs: Tensor, values: Tensor, head_weight: Tensor) -> Tensor:
    r"""Each token's own part of its attention output, a_{i<-i}.

    Args:
        probs: (B, H, T, T) attention probabilities.
        values: (B, H, T, Dh).
        head_weight: (H, Dh, D).

    Returns:
        (B, T, D): sum_h alpha^h_ii f^h(x_i).
    """
    diag = torch.diagonal(probs, dim1=-2, dim2=-1)  # (B, H, T)
    return torch.einsum("bht,bhtk,hkd->btd", diag, values, head_weight)


def attention_parts_rows(probs: Tensor, projected: Tensor, rows: slice) -> Tensor:
    r"""Explicit parts a_{i<-j} for a chunk of query rows.

    Args:
        probs: (B, H, T, T) attention probabilities.
        projected: (B, H, T, D) from :func:`project_values` (any linear map A applied).
        rows: the query rows i to produce.

    Returns:
        (B, R, T, D): entry [b, i, j] = sum_h alpha^h_ij projected[b, h, j].
    """
    return torch.einsum("bhij,bhjd->bijd", probs[:, :, rows], projected)


def part_norms_gram(
    probs: Tensor,
    values: Tensor,
    head_weight: Tensor,
    diagonal_parts: Tensor,
    lin_map: Optional[Tensor] = None,
    row_scale: Optional[Tensor] = None,
) -> Tensor:
    r"""L2 norms of the parts (sum_h alpha^h_ij f^h(x_j) + [i=j] delta_i) A / s_i.

    Off-diagonal entries are alpha_ij^T G_j alpha_ij with G_j the H x H Gram matrix of
    the vectors f^h(x_j) A; diagonal entries are taken from the explicit diagonal parts
    (which may hold a residual term). Cost O(T H Dh D + T H^2 D + T^2 H^2); no (T, T, D)
    tensor is formed.

    Args:
        probs: (B, H, T, T).
        values: (B, H, T, Dh).
        head_weight: (H, Dh, D).
        diagonal_parts: (B, T, D) the full part of token i in itself, before A.
        lin_map: optional (D, D) map A (centering and gamma scalings of the norms).
        row_scale: optional (B, T) divisor s_i per receiving token.

    Returns:
        (B, T, T) norms, entry [b, i, j].
    """
    t = values.shape[2]
    projected = project_values(values, head_weight, lin_map)  # (B, H, T, D): f^h(x_j) A
    gram = torch.einsum("bhtd,bgtd->bthg", projected, projected)  # (B, T, H, H) per source token j
    tmp = torch.einsum("bhij,bjhg->bijg", probs, gram)
    sq = torch.einsum("bijg,bgij->bij", tmp, probs)
    diag = diagonal_parts if lin_map is None else diagonal_parts @ lin_map
    diag_sq = diag.pow(2).sum(-1)
    idx = torch.arange(t, device=probs.device)
    sq[:, idx, idx] = diag_sq
    if row_scale is not None:
        sq = sq / row_scale.pow(2).unsqueeze(-1)
    return sq.clamp_min(0).sqrt()
