r"""DecompX's readouts: what the last layer's parts become (docs/design.md, section 8).

Classifiers: the classification head act(h W_d + b_d) W_c + b_c on token 0, through the
closed form of integrated gradients at its real pre-activation (:func:`head_scores`); a head
with norms (ModernBERT's N(act(P(h) W_d + b_d)) W_c + b_c: the final norm P and the head norm
N at the real per-example scales); mean pooling (every last-layer row through P at its own
scale, then averaged over the real tokens, :func:`pool_head_parts`). Decoders: the final
norm at the real scale of the explained row and one LM-head direction u = W_U[target] (or
W_U[target] - W_U[foil]): the explained logit <FinalNorm(x_{L,i}), u> + u_bias is linear in
the parts (:func:`logit_scores`). Each readout has its frozen form for the adjoint algorithm
(:func:`frozen_head`, :func:`frozen_next_token_logit`) and the backward phase that explains
it (:func:`adjoint_head_scores`, :func:`adjoint_next_token_scores`). Vision heads:
:mod:`.vision_head`.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from captum_normattr.decompose.methods.decompx.adjoint import AdjointPass, FrozenStep
from captum_normattr.decompose.methods.decompx.parts import SPREAD_MODES, absorb_bias, activation_slopes, check_bias_mode
from captum_normattr.decompose.primitives.feed_forward import ig_closed_form
from captum_normattr.decompose.primitives.guards import rebuild_norm
from captum_normattr.decompose.primitives.layer_norm import apply_norm_to_parts, norm_bias_part
from captum_normattr.decompose.records import NormParams

__all__ = [
    "adjoint_head_scores",
    "adjoint_next_token_cotangent",
    "adjoint_next_token_scores",
    "frozen_head",
    "frozen_next_token_logit",
    "head_real_tensors",
    "head_scores",
    "head_slope",
    "logit_scores",
    "mean_pool_weights",
    "pool_frozen_rows",
    "pool_head_parts",
]


def head_scores(
    parts: Tensor,
    bias: Tensor,
    real_input: Tensor,
    w_dense: Tensor,
    b_dense: Optional[Tensor],
    act: Callable[[Tensor], Tensor],
    w_cls: Tensor,
    b_cls: Optional[Tensor],
    bias_mode: str = "separate",
    fallback: int = 0,
    pre_norm: Optional[NormParams] = None,
    norm: Optional[NormParams] = None,
) -> Tuple[Tensor, Tensor]:
    r"""Per-source-token class scores through a head act(h W_d + b_d) W_c + b_c.

    With norms (a pre-LN encoder's head, ModernBERT's): N(act(P(h) W_d + b_d)) W_c + b_c, the
    final norm P and the head norm N frozen at the per-example scale of their real inputs
    (their betas go to the bias part; spread modes: spread where they enter).

    Args:
        parts: (B, K, D) parts of the pooled vector h (last layer output at the head's token).
        bias: (B, D) its bias part.
        real_input: (B, D) the real pooled vector (fixes the activation slopes).
        w_dense, b_dense: (D, D2), (D2,) or None.
        act: the elementwise activation.
        w_cls, b_cls: (D2, C), (C,) or None.
        bias_mode: one of :data:`BIAS_MODES`.
        fallback: the source token that takes a bias whose dot products are all 0.
        pre_norm: the final norm before the head (``real_input`` is then its real input), or None.
        norm: the norm after the activation, or None.

    Returns:
        (scores (B, K, C), bias scores (B, C)) with scores.sum(1) + bias = the logits.
    """
    check_bias_mode(bias_mode)
    spread = bias_mode in SPREAD_MODES
    fb = torch.tensor([fallback], device=parts.device)
    if pre_norm is not None or norm is not None:
        return _normed_head_scores(parts, bias, real_input, w_dense, b_dense, act, w_cls, b_cls, spread, fb, pre_norm, norm)
    u = parts @ w_dense
    u_b = bias @ w_dense
    real = real_input @ w_dense
    if b_dense is not None:
        u_b = u_b + b_dense
        real = real + b_dense
    if spread:
        u, u_b = absorb_bias(u.unsqueeze(1), u_b.unsqueeze(1), fb)
        u, u_b = u.squeeze(1), u_b.squeeze(1)
    g0 = act(torch.zeros((), dtype=parts.dtype, device=parts.device))
    ig = ig_closed_form(u, real, act)
    ig_b = ig_closed_form(u_b.unsqueeze(-2), real, act).squeeze(-2)
    s = ig @ w_cls
    s_b = (ig_b + g0) @ w_cls
    if b_cls is not None:
        s_b = s_b + b_cls
    if spread:
        s, s_b = absorb_bias(s.unsqueeze(1), s_b.unsqueeze(1), fb)
        s, s_b = s.squeeze(1), s_b.squeeze(1)
    return s, s_b


def _frozen_norm(parts: Tensor, bias: Tensor, real: Tensor, params: NormParams, spread: bool, fb: Tensor):
    r"""A norm at the real scale of ``real`` (B, D) on parts (B, K, D) and a bias part (B, D); its beta spread if asked."""
    y = apply_norm_to_parts(parts.unsqueeze(1), real.unsqueeze(1), params)  # (B, 1, K, D)
    y_b = norm_bias_part(bias.unsqueeze(1), real.unsqueeze(1), params)  # (B, 1, D)
    if spread:
        y, y_b = absorb_bias(y, y_b, fb)
    return y.squeeze(1), y_b.squeeze(1)


def head_real_tensors(real_input: Tensor, head: "object") -> Tuple[Tensor, Tensor, Tensor]:
    r"""(pooled, pre-activation, activation output), each (B, .), of a head at its real input (see :func:`head_scores`)."""
    pooled = real_input if head.pre_norm is None else rebuild_norm(real_input, head.pre_norm)
    pre = pooled @ head.w_dense
    if head.b_dense is not None:
        pre = pre + head.b_dense
    return pooled, pre, head.act(pre)


def mean_pool_weights(valid: Tensor, dtype: torch.dtype) -> Tensor:
    r"""(B, T) weights of a mean over the real tokens: valid / (number of real tokens)."""
    v = valid.to(dtype)
    return v / v.sum(-1, keepdim=True).clamp_min(1.0)


def pool_head_parts(
    parts: Tensor, bias: Tensor, real: Tensor, weights: Tensor, pre_norm: Optional[NormParams], bias_mode: str = "separate",
) -> Tuple[Tensor, Tensor, Tensor]:
    r"""Parts of a head input that is a weighted mean of (final-norm) rows (ModernBERT's mean pooling).

    h = sum_r w_r P(x_r): each row's final norm P at the real scale of that row, then the mean.

    Args:
        parts: (B, R, K, D) parts of the last layer's output rows; bias: (B, R, D) their bias parts.
        real: (B, R, D) the rows' real values (the final norm's real inputs).
        weights: (B, R) the pooling weights (0 at pads).
        pre_norm: the final norm, or None.
        bias_mode: one of :data:`BIAS_MODES` (spread: the final norm's beta is spread over
            each row's parts, the row itself taking it when every dot product is 0).

    Returns:
        (pooled parts (B, K, D), pooled bias part (B, D), real pooled vector (B, D)).
    """
    if pre_norm is not None:
        parts, bias = apply_norm_to_parts(parts, real, pre_norm), norm_bias_part(bias, real, pre_norm)
        if bias_mode in SPREAD_MODES:
            parts, bias = absorb_bias(parts, bias, torch.arange(parts.shape[1], device=parts.device))
        real = rebuild_norm(real, pre_norm)
    w = weights.to(parts.dtype)
    return torch.einsum("brkd,br->bkd", parts, w), torch.einsum("brd,br->bd", bias, w), torch.einsum("brd,br->bd", real, w)


def pool_frozen_rows(y: Tensor, real: Tensor, weights: Tensor, pre_norm: Optional[NormParams], with_bias: bool) -> Tensor:
    r"""The frozen mean pooling of :func:`pool_head_parts` applied to rows ``y`` (B, R, D) (linear without biases)."""
    if pre_norm is not None:
        y = norm_bias_part(y, real, pre_norm) if with_bias else apply_norm_to_parts(y, real, pre_norm)
    return torch.einsum("brd,br->bd", y, weights.to(y.dtype))


def _normed_head_scores(parts, bias, real_input, w_dense, b_dense, act, w_cls, b_cls, spread, fb, pre_norm, norm):
    r""":func:`head_scores` through a head with a final norm before it and/or a norm after its activation."""
    real = real_input
    if pre_norm is not None:
        parts, bias = _frozen_norm(parts, bias, real_input, pre_norm, spread, fb)
        real = rebuild_norm(real_input, pre_norm)
    u, u_b, real = parts @ w_dense, bias @ w_dense, real @ w_dense
    if b_dense is not None:
        u_b, real = u_b + b_dense, real + b_dense
    if spread:
        u, u_b = absorb_bias(u.unsqueeze(1), u_b.unsqueeze(1), fb)
        u, u_b = u.squeeze(1), u_b.squeeze(1)
    g0 = act(torch.zeros((), dtype=parts.dtype, device=parts.device))
    h = ig_closed_form(u, real, act)
    h_b = ig_closed_form(u_b.unsqueeze(-2), real, act).squeeze(-2) + g0
    if norm is not None:
        h, h_b = _frozen_norm(h, h_b, act(real), norm, spread, fb)
    s, s_b = h @ w_cls, h_b @ w_cls
    if b_cls is not None:
        s_b = s_b + b_cls
    if spread:
        s, s_b = absorb_bias(s.unsqueeze(1), s_b.unsqueeze(1), fb)
        s, s_b = s.squeeze(1), s_b.squeeze(1)
    return s, s_b


def head_slope(real_input: Tensor, head: "object") -> Tensor:
    r"""The frozen activation slope (B, D2) of a classification head at its real input.

    Args:
        real_input: (B, D) the last layer's real output at the head's token.
        head: a :class:`~captum_normattr.models.heads.HeadParams`.
    """
    if getattr(head, "pre_norm", None) is not None:
        return activation_slopes(head_real_tensors(real_input, head)[1], head.act)
    u = real_input @ head.w_dense
    if head.b_dense is not None:
        u = u + head.b_dense
    return activation_slopes(u, head.act)


def frozen_head(pooled: Tensor, head: "object", slope: Tensor, with_bias: bool, real_input: Optional[Tensor] = None) -> Tensor:
    r"""Logits (B, C) of the classification head with its activation frozen (linear in ``pooled`` without biases).

    Args:
        pooled: (B, D) the (frozen) last-layer output at the head's token.
        head: a :class:`~captum_normattr.models.heads.HeadParams`.
        slope: (B, D2) :func:`head_slope`.
        with_bias: include the biases (b_d, g(0) W_c, b_c).
        real_input: (B, D) the head's real input; needed (and used) only by a head with norms
            (:func:`head_scores`), whose scales it fixes.
    """
    if getattr(head, "pre_norm", None) is not None or getattr(head, "norm", None) is not None:
        return _frozen_normed_head(pooled, head, slope, with_bias, real_input)
    u = pooled @ head.w_dense
    if with_bias and head.b_dense is not None:
        u = u + head.b_dense
    out = (u * slope) @ head.w_cls
    if with_bias:
        out = out + head.act(torch.zeros((), dtype=pooled.dtype, device=pooled.device)) * head.w_cls.sum(0)
        if head.b_cls is not None:
            out = out + head.b_cls
    return out


def _frozen_normed_head(pooled: Tensor, head: "object", slope: Tensor, with_bias: bool,
                        real_input: Optional[Tensor]) -> Tensor:
    if real_input is None:
        raise ValueError("a classification head with norms is frozen at its real input: pass real_input")

    def norm(u: Tensor, real: Tensor, params: NormParams) -> Tensor:
        u, real = u.unsqueeze(1), real.unsqueeze(1)
        return (norm_bias_part(u, real, params) if with_bias else apply_norm_to_parts(u, real, params)).squeeze(1)

    _, _, act_real = head_real_tensors(real_input, head)
    if head.pre_norm is not None:
        pooled = norm(pooled, real_input, head.pre_norm)
    u = pooled @ head.w_dense
    if with_bias and head.b_dense is not None:
        u = u + head.b_dense
    h = u * slope
    if with_bias:
        h = h + head.act(torch.zeros((), dtype=pooled.dtype, device=pooled.device))
    if head.norm is not None:
        h = norm(h, act_real, head.norm)
    out = h @ head.w_cls
    if with_bias and head.b_cls is not None:
        out = out + head.b_cls
    return out


def adjoint_head_scores(
    adj: AdjointPass,
    frozen_at: Callable[[int, Tensor], FrozenStep],
    head: "object",
    slope: Tensor,
    target: Optional[Tensor] = None,
    real_input: Optional[Tensor] = None,
    pool: Optional[Callable[[Tensor], Tensor]] = None,
) -> Tuple[Tensor, Tensor]:
    r"""Class scores of a streamed adjoint pass through a classification head (its backward phase).

    Args:
        adj: an :class:`~captum_normattr.decompose.methods.decompx.adjoint.AdjointPass` whose forward phase has seen every layer (``last_rows``
            = the head's token).
        frozen_at: as in :meth:`~captum_normattr.decompose.methods.decompx.adjoint.AdjointPass.backward`.
        head: a :class:`~captum_normattr.models.heads.HeadParams`; slope: :func:`head_slope`.
        target: (B,) long: compute only these classes (one product in all); None: all classes.
        real_input: (B, D) the head's real input (a head with norms: :func:`frozen_head`).
        pool: maps the frozen last-layer rows (B, R, D) to the head's input (B, D), with the
            biases (:func:`pool_frozen_rows`); None: the first row (the head's token).

    Returns:
        Without ``target``: (scores (B, T, C), bias scores (B, C)); with it: (scores (B, T),
        bias scores (B,)). The bias score is the frozen network's constant F(0), so that
        F(e) = sum of the scores + bias score.
    """
    pool = (lambda y: y[:, 0]) if pool is None else pool
    if target is not None:
        pick = lambda out: out.gather(1, target.view(-1, 1)).squeeze(1)
        (g,) = adj.backward(frozen_at, lambda y: [pick(frozen_head(pool(y), head, slope, True, real_input))])
        return adj.token_scores([g])[0].detach(), adj.constants[0]
    grads = adj.backward(frozen_at, lambda y: list(frozen_head(pool(y), head, slope, True, real_input).unbind(-1)))
    scores = torch.stack(adj.token_scores(grads), -1)
    return scores.detach(), torch.stack(adj.constants, -1)


def logit_scores(
    parts: Tensor,
    bias: Tensor,
    final_params: NormParams,
    final_input: Tensor,
    direction: Tensor,
    direction_bias: Optional[Tensor] = None,
    bias_mode: str = "separate",
    fallback: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    r"""Per-source-token scores of one logit through the final norm and an LM-head row.

    Args:
        parts: (B, K, D) parts of the last layer's output at the explained position i.
        bias: (B, D) its bias part.
        final_params: the final norm's parameters.
        final_input: (B, D) the real input of the final norm at i (fixes its scale).
        direction: (B, D) the unembedding direction u.
        direction_bias: (B,) the LM-head bias along u, or None.
        bias_mode: one of :data:`BIAS_MODES`.
        fallback: (B,) long, the token that takes a bias whose dot products are all 0
            (default: the last source token).

    Returns:
        (scores (B, K), bias scores (B,)) with scores.sum(1) + bias = the logit (given
        parts that sum to the real final-norm input).
    """
    check_bias_mode(bias_mode)
    spread = bias_mode in SPREAD_MODES
    b, k, _ = parts.shape
    fb = (torch.full((b,), k - 1, device=parts.device) if fallback is None else fallback.to(parts.device)).view(b, 1)
    y = apply_norm_to_parts(parts.unsqueeze(1), final_input.unsqueeze(1), final_params)  # (B, 1, K, D)
    y_b = norm_bias_part(bias.unsqueeze(1), final_input.unsqueeze(1), final_params)  # (B, 1, D)
    if spread:
        y, y_b = absorb_bias(y, y_b, fb)
    s = torch.einsum("brkd,bd->brk", y, direction).unsqueeze(-1)  # (B, 1, K, 1)
    s_b = (y_b * direction.unsqueeze(1)).sum(-1, keepdim=True)  # (B, 1, 1)
    if direction_bias is not None:
        s_b = s_b + direction_bias.view(b, 1, 1).to(s_b.dtype)
    if spread:
        s, s_b = absorb_bias(s, s_b, fb)
    return s.view(b, k), s_b.view(b)


def frozen_next_token_logit(
    last: Tensor, final_params: NormParams, final_input: Tensor, direction: Tensor, direction_bias: Optional[Tensor]
) -> Tensor:
    r"""<FinalNorm(last), u> + u_bias with the final norm at its real scale: (B,).

    Args:
        last: (B, D) the (frozen) last-layer output at the explained positions.
        final_params: the final norm's parameters; final_input: (B, D) its real input there.
        direction: (B, D) u; direction_bias: (B,) or None.
    """
    out = (norm_bias_part(last.unsqueeze(1), final_input.unsqueeze(1), final_params).squeeze(1) * direction).sum(-1)
    if direction_bias is not None:
        out = out + direction_bias
    return out


def adjoint_next_token_cotangent(
    adj: AdjointPass,
    frozen_at: Callable[[int, Tensor], FrozenStep],
    final_params: NormParams,
    final_input: Tensor,
    direction: Tensor,
    direction_bias: Optional[Tensor],
    position: Tensor,
) -> Tuple[Tensor, Tensor]:
    r"""The cotangent of the explained next-token logit at the decoder's input, by a streamed adjoint pass.

    With every nonlinear quantity frozen the logit is affine in the input embeddings,
    F(e) = sum_k g_k . e_k + c; this returns g (the gradient of the frozen network) and c.
    Token k's DecompX score ("separate" bias mode) is g_k . e_k (:func:`adjoint_next_token_scores`).

    Args:
        adj, frozen_at, final_params, final_input, direction, direction_bias, position: as in
            :func:`adjoint_next_token_scores`.

    Returns:
        (g (B, T, D), c (B,)): the cotangent at every input embedding and the frozen network's constant.
    """
    ar = torch.arange(adj.embeddings.shape[0], device=adj.embeddings.device)
    row_index = torch.searchsorted(adj.last_rows, position)
    f_in = final_input[ar, position]
    (g,) = adj.backward(
        frozen_at, lambda y: [frozen_next_token_logit(y[ar, row_index], final_params, f_in, direction, direction_bias)]
    )
    return g.detach(), adj.constants[0]


def adjoint_next_token_scores(
    adj: AdjointPass,
    frozen_at: Callable[[int, Tensor], FrozenStep],
    final_params: NormParams,
    final_input: Tensor,
    direction: Tensor,
    direction_bias: Optional[Tensor],
    position: Tensor,
) -> Tuple[Tensor, Tensor]:
    r"""Decoder scores of a streamed adjoint pass (its backward phase).

    Args:
        adj: an :class:`~captum_normattr.decompose.methods.decompx.adjoint.AdjointPass` whose forward phase has seen every layer, with
            ``last_rows = torch.unique(position)``.
        frozen_at: as in :meth:`~captum_normattr.decompose.methods.decompx.adjoint.AdjointPass.backward`.
        final_params: the final norm's parameters; final_input: (B, T, D) its real input.
        direction: (B, D) u; direction_bias: (B,) or None; position: (B,) explained positions.

    Returns:
        (scores (B, T), bias scores (B,)): the bias score is F(e) - sum of the scores.
    """
    g, c = adjoint_next_token_cotangent(adj, frozen_at, final_params, final_input, direction, direction_bias, position)
    return adj.token_scores([g])[0].detach(), c

