r"""DecompX through the final norm and a linear head over several tokens (Vision Transformer classifiers).

A Vision Transformer classifier reads the final-norm output y of a few rows r (ViT and DeiT:
[CLS]; the distilled DeiT: [CLS] and the distillation token, the two heads averaged;
DINOv2: [CLS] and every patch through the mean) with one linear map per row:

    logit_c = sum_r < y_r, U_{r,c} > + b_c,    y_r = FinalNorm(x_{L,r})

With the final norm at its real per-token scale, y_r is affine in the parts of x_{L,r}, so
each source token k gets score_{k,c} = sum_r < gamma c(x_{r<-k}) / s(x_r), U_{r,c} >, and the
bias score collects the norm's bias part (with beta) and b_c. Forward algorithm:
:func:`linear_head_scores`; adjoint: :func:`adjoint_linear_head_scores`. See
docs/design.md, section 8 (DecompX), "Vision Transformer heads".
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from captum_normattr.decompose.methods.decompx.adjoint import AdjointPass, FrozenStep

from captum_normattr.decompose.methods.decompx.parts import absorb_bias, check_bias_mode
from captum_normattr.decompose.primitives.layer_norm import apply_norm_to_parts, norm_bias_part
from captum_normattr.decompose.records import NormParams

__all__ = ["adjoint_linear_head_scores", "frozen_linear_head", "linear_head_scores"]


def linear_head_scores(
    parts: Tensor,
    bias: Tensor,
    final_params: NormParams,
    final_input: Tensor,
    rows: Tensor,
    weight: Tensor,
    head_bias: Optional[Tensor],
    bias_mode: str = "separate",
) -> Tuple[Tensor, Tensor]:
    r"""Per-source-token class scores through the final norm and a linear head on ``rows``.

    Args:
        parts: (B, R, K, D) parts of the last layer's output at the head's rows.
        bias: (B, R, D) their bias parts.
        final_params: the final norm's parameters.
        final_input: (B, R, D) the real final-norm input at the rows (fixes the scale).
        rows: (R,) long, the rows (the fallback tokens of ``"spread"`` mode).
        weight: (R, D, C) the head's per-row weights; head_bias: (C,) or None.
        bias_mode: ``"separate"`` or ``"spread"`` (the norm's bias part of row r is spread
            over the sources of row r, then each class's head bias over the sources, in
            proportion to |score|; fallback: row r itself, and the first row).

    Returns:
        (scores (B, K, C), bias scores (B, C)): scores.sum(1) + bias scores = the logits
        (given parts that sum to the real final-norm input).
    """
    check_bias_mode(bias_mode)
    y = apply_norm_to_parts(parts, final_input, final_params)  # (B, R, K, D)
    y_b = norm_bias_part(bias, final_input, final_params)  # (B, R, D)
    if bias_mode == "spread":
        y, y_b = absorb_bias(y, y_b, rows)
    s = torch.einsum("brkd,rdc->bkc", y, weight)
    s_b = torch.einsum("brd,rdc->bc", y_b, weight)
    if head_bias is not None:
        s_b = s_b + head_bias
    if bias_mode == "spread":
        b, k, c = s.shape
        fb = rows[:1].expand(c)
        sc, sb = absorb_bias(s.permute(0, 2, 1).unsqueeze(-1), s_b.unsqueeze(-1), fb)
        s, s_b = sc.squeeze(-1).permute(0, 2, 1), sb.squeeze(-1)
    return s, s_b


def frozen_linear_head(
    last: Tensor, final_params: NormParams, final_input: Tensor, weight: Tensor, head_bias: Optional[Tensor]
) -> Tensor:
    r"""The logits (B, C) of the frozen head: final norm at its real scale, then the linear head.

    Args:
        last: (B, R, D) the (frozen) last-layer output at the head's rows.
        final_params, final_input (B, R, D), weight (R, D, C), head_bias (C,): as in
            :func:`linear_head_scores`.
    """
    out = torch.einsum("brd,rdc->bc", norm_bias_part(last, final_input, final_params), weight)
    return out if head_bias is None else out + head_bias


def adjoint_linear_head_scores(
    adj: AdjointPass,
    frozen_at: Callable[[int, Tensor], FrozenStep],
    final_params: NormParams,
    final_input: Tensor,
    weight: Tensor,
    head_bias: Optional[Tensor],
    target: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    r"""Class scores of a streamed adjoint pass through the final norm and a linear head.

    Args:
        adj: an :class:`~captum_normattr.decompose.methods.decompx.adjoint.AdjointPass` whose forward phase
            has seen every layer, with ``last_rows`` = the head's rows.
        frozen_at: as in :meth:`AdjointPass.backward`.
        final_params, final_input (B, R, D), weight, head_bias: as in :func:`linear_head_scores`.
        target: (B,) long: only these classes (one vector-Jacobian product in all); None: all.

    Returns:
        Without ``target``: (scores (B, T, C), bias scores (B, C)); with it: (scores (B, T),
        bias scores (B,)). The bias score is the constant F(0) of the frozen affine network F,
        so F(e) = sum of the scores + bias score, and its distance to the real logit is the
        completeness error.
    """
    head = lambda y: frozen_linear_head(y, final_params, final_input, weight, head_bias)
    if target is not None:
        pick = lambda out: out.gather(1, target.view(-1, 1)).squeeze(1)
        (g,) = adj.backward(frozen_at, lambda y: [pick(head(y))])
        return adj.token_scores([g])[0].detach(), adj.constants[0]
    grads = adj.backward(frozen_at, lambda y: list(head(y).unbind(-1)))
    scores = torch.stack(adj.token_scores(grads), -1)
    return scores.detach(), torch.stack(adj.constants, -1)
