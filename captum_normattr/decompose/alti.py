r"""ALTI contributions (Ferrando et al. 2022; docs/design.md, section 5).

c_ij = max(0, |y_i|_1 - |y_i - T_i(x_j)|_1), rows normalised to sum to 1, where T_i(x_j)
is token j's part of the block output y_i (bias parts are inside y_i but belong to no
token). Parts are produced in chunks of query rows so that memory stays bounded.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from captum_normattr.decompose.mixing import row_normalize


def l1_contributions(parts: Tensor, output: Tensor) -> Tensor:
    r"""Unnormalised ALTI contributions of explicit parts.

    Args:
        parts: (B, R, T, D) part of source token j in receiving token i.
        output: (B, R, D) the real output y_i of the block at the receiving tokens.

    Returns:
        (B, R, T): max(0, |y_i|_1 - |y_i - part_ij|_1).
    """
    y_l1 = output.abs().sum(-1, keepdim=True)
    dist = (output.unsqueeze(2) - parts).abs().sum(-1)
    return (y_l1 - dist).clamp_min(0)


def alti_map(
    probs: Tensor,
    projected: Tensor,
    residual: Optional[Tensor],
    output: Tensor,
    valid: Tensor,
    row_scale: Optional[Tensor] = None,
    chunk_rows: Optional[int] = None,
    causal: bool = False,
) -> Tensor:
    r"""ALTI layer map from attention probabilities and per-head projected values.

    The part of token j in token i is
    (sum_h alpha^h_ij projected[h, j] + [i = j] residual_i) / row_scale_i.

    Args:
        probs: (B, H, T, T) attention probabilities.
        projected: (B, H, T, D) values through W_O and any linear map (see
            :func:`~captum_normattr.decompose.attention.project_values`).
        residual: (B, T, D) the residual term of token i (already mapped), or None.
        output: (B, T, D) real block output y_i (bias parts included).
        valid: (B, T) bool, non-pad tokens.
        row_scale: optional (B, T) divisor per receiving token (a norm's real scale).
        chunk_rows: query rows per chunk (None: all at once; see
            :func:`~captum_normattr.decompose.chunking.rows_for_budget`).
        causal: causal attention (decoders): row i has parts only from j <= i, so each chunk
            of rows works on the source tokens before its end only (entries j > i are 0).

    Returns:
        (B, T, T) contributions, valid rows summing to 1, pad rows and columns 0.
    """
    b, _, t, _ = projected.shape
    chunk = t if chunk_rows is None else max(1, int(chunk_rows))
    out = probs.new_zeros(b, t, t)
    # Source-token-major layout: one (R, H) @ (H, D) product per (example, source token).
    proj_j = projected.permute(0, 2, 1, 3).contiguous()  # (B, T_j, H, D)
    y_l1 = output.abs().sum(-1)  # (B, T)
    for start in range(0, t, chunk):
        rows = slice(start, min(t, start + chunk))
        cols = rows.stop if causal else t
        mix = probs[:, :, rows, :cols].permute(0, 3, 2, 1)  # (B, T_j, R, H)
        parts = torch.matmul(mix, proj_j[:, :cols])  # (B, T_j, R, D): unscaled part of j in i
        if residual is not None:
            r_idx = torch.arange(rows.start, rows.stop, device=parts.device)
            parts[:, r_idx, r_idx - rows.start] += residual[:, rows]
        # |y_i - part_ij / s_i|_1 = |s_i y_i - part_ij|_1 / s_i, computed in place
        target = output[:, rows] if row_scale is None else output[:, rows] * row_scale[:, rows, None]
        parts.sub_(target.unsqueeze(1)).abs_()
        dist = parts.sum(-1).transpose(1, 2)  # (B, R, T_j)
        if row_scale is not None:
            dist = dist / row_scale[:, rows, None]
        out[:, rows, :cols] = (y_l1[:, rows, None] - dist).clamp_min(0)
        del parts
    out.mul_((valid.unsqueeze(-1) & valid.unsqueeze(-2)).to(out.dtype))
    if causal:
        out.tril_()
    return row_normalize(out)
