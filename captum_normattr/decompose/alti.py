r"""ALTI contributions (Ferrando et al. 2022; docs/design.md, section 5).

c_ij = max(0, |y_i|_1 - |y_i - T_i(x_j)|_1), rows normalised to sum to 1, where T_i(x_j)
is token j's part of the block output y_i (bias parts are inside y_i but belong to no
token). Parts are produced in cache-sized tiles (examples x query rows x source tokens,
:func:`~captum_normattr.decompose.chunking.tile_for_cache`) into one reused buffer, so that
memory stays bounded and the L1 passes run on data still in cache.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from captum_normattr.decompose.chunking import CACHE_TILE_BYTES, tile_for_cache
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
    tile_bytes: Optional[int] = None,
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
        chunk_rows: at most this many query rows per tile (the memory-budget chunk of
            :func:`~captum_normattr.decompose.chunking.rows_for_budget`; None: no cap). The
            tiles are smaller still, sized for the cache.
        causal: causal attention (decoders): row i has parts only from j <= i, so each chunk
            of rows works on the source tokens before its end only (entries j > i are 0).

    Returns:
        (B, T, T) contributions, valid rows summing to 1, pad rows and columns 0.
    """
    b, _, t, d = projected.shape
    nb, nr, nc = tile_for_cache(b, t, d, projected.element_size(), chunk_rows, tile_bytes or CACHE_TILE_BYTES)
    out = probs.new_zeros(b, t, t)
    # Source-token-major layout: one (R, H) @ (H, D) product per (example, source token).
    proj_j = projected.permute(0, 2, 1, 3).contiguous()  # (B, T_j, H, D)
    y_l1 = output.abs().sum(-1)  # (B, T)
    # |y_i - part_ij / s_i|_1 = |s_i y_i - part_ij|_1 / s_i
    target = output if row_scale is None else output * row_scale[..., None]
    # One cache-sized buffer reused by every tile: no page faults, and the passes of
    # sub/abs/sum read what the product has just written while it is still in cache.
    buf = projected.new_empty(nb * nr * nc * d)
    for b0 in range(0, b, nb):
        bs = slice(b0, min(b, b0 + nb))
        n_b = bs.stop - bs.start
        for r0 in range(0, t, nr):
            r1 = min(t, r0 + nr)
            tgt = target[bs, r0:r1].unsqueeze(1)  # (b, 1, R, D)
            last = r1 if causal else t  # causal: sources j < r1 only (entries j > i are 0)
            for c0 in range(0, last, nc):
                c1 = min(last, c0 + nc)
                parts = buf[: n_b * (c1 - c0) * (r1 - r0) * d].view(n_b, c1 - c0, r1 - r0, d)
                mix = probs[bs, :, r0:r1, c0:c1].permute(0, 3, 2, 1)  # (b, C, R, H)
                torch.matmul(mix, proj_j[bs, c0:c1], out=parts)  # unscaled part of j in i
                lo, hi = max(r0, c0), min(r1, c1)
                if residual is not None and lo < hi:
                    r_idx = torch.arange(lo, hi, device=parts.device)
                    parts[:, r_idx - c0, r_idx - r0] += residual[bs, lo:hi]
                dist = parts.sub_(tgt).abs_().sum(-1).transpose(1, 2)  # (b, R, C)
                if row_scale is not None:
                    dist.div_(row_scale[bs, r0:r1, None])
                out[bs, r0:r1, c0:c1] = torch.sub(y_l1[bs, r0:r1, None], dist).clamp_min_(0)
    del buf
    out.mul_((valid.unsqueeze(-1) & valid.unsqueeze(-2)).to(out.dtype))
    if causal:
        out.tril_()
    return row_normalize(out)
