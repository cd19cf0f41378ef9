r"""Feed-forward decomposition by integrated gradients (Kobayashi et al. 2023; docs/design.md, section 6).

FF(u) = W2 g(W1 u + b1) + b2 with g elementwise. For input parts u = sum_j u_j + u_bias
the pre-activation parts are p_j = u_j W1 and p_bias = u_bias W1 + b1. Integrated
gradients of g along t * p (zero baseline) has the exact closed form
IG_j = p_j (g(p) - g(0)) / p, so the FF part of j is IG_j W2 and the bias part is
(IG_bias + g(0)) W2 + b2; the parts sum to the real FF output.

Every part is a per-neuron coefficient times p_j (closed form: (g(p) - g(0)) / p; numerical
IG: the mean of g' along the path), so the whole post-LN layer is decomposed one chunk of
receiving tokens (query rows) at a time: memory is bounded by ``memory_budget_mb``.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from captum_normattr.decompose.methods.alti import l1_contributions
from captum_normattr.decompose.primitives.chunking import rows_for_budget
from captum_normattr.decompose.primitives.gated_feed_forward import local_autograd
from captum_normattr.decompose.primitives.attention import attention_parts_rows, project_values
from captum_normattr.decompose.primitives.layer_norm import apply_norm_to_parts, norm_bias_part, norm_linear_map, norm_scale
from captum_normattr.decompose.primitives.mixing import row_normalize
from captum_normattr.decompose.records import LayerTensors, NormParams

__all__ = [
    "CONTRIBUTIONS",
    "IG_METHODS",
    "LN_SCOPES",
    "SCOPES",
    "act_derivative_at_zero",
    "component_scope_maps",
    "contextualization_change",
    "ff_parts",
    "ff_parts_from_pre",
    "ff_rows_per_chunk",
    "ig_closed_form",
    "ig_coefficients",
    "ig_riemann",
    "low_gamma_keep",
    "scope_outputs",
]

SCOPES = ("ATB", "FF", "RES2", "LN2")
#: How a layer map is made from explicit parts: ``"norm"`` (L2 norm of each part, GlobEnc-style)
#: or ``"alti"`` (ALTI's L1 contribution against the real output of the scope, rows normalised).
CONTRIBUTIONS = ("norm", "alti")
#: Scopes whose parts are LayerNorm outputs (the ones the low-gamma ablation acts on).
LN_SCOPES = ("ATB", "LN2")
IG_METHODS = ("closed_form", "riemann")


def act_derivative_at_zero(act: Callable) -> float:
    r"""g'(0) by a float64 central difference (robust for non-differentiable g such as ReLU)."""
    h = 1e-6
    x = torch.tensor([-h, h], dtype=torch.float64)
    y = act(x)
    return float((y[1] - y[0]) / (2 * h))


def ig_coefficients(pre_total: Tensor, act: Callable, method: str = "closed_form", steps: int = 50) -> Tensor:
    r"""Per-neuron IG coefficient c such that IG_j = p_j * c for every part p_j of p.

    Args:
        pre_total: (..., F) the full pre-activation p (bias part included).
        act: the elementwise activation g.
        method: ``"closed_form"``: c = (g(p) - g(0)) / p, and g'(0) where |p| is tiny (exact);
            ``"riemann"``: c = mean_k g'(t_k p) at the midpoints t_k = (k + 1/2) / steps (autograd).
        steps: Riemann steps.

    Returns:
        (..., F).
    """
    if method == "closed_form":
        zero = act(torch.zeros((), dtype=pre_total.dtype, device=pre_total.device))
        tiny = pre_total.abs() < (1e-12 if pre_total.dtype == torch.float64 else 1e-6)
        safe = torch.where(tiny, torch.ones_like(pre_total), pre_total)
        ratio = (act(pre_total) - zero) / safe
        return torch.where(tiny, torch.full_like(pre_total, act_derivative_at_zero(act)), ratio)
    if method == "riemann":
        grad_sum = torch.zeros_like(pre_total)
        for k in range(steps):
            t = (k + 0.5) / steps
            with local_autograd():
                x = (t * pre_total).detach().requires_grad_(True)
                (g,) = torch.autograd.grad(act(x).sum(), x)
            grad_sum = grad_sum + g
        return grad_sum / steps
    raise ValueError(f"method must be one of {IG_METHODS}, got {method!r}")


def ig_closed_form(pre_parts: Tensor, pre_total: Tensor, act: Callable) -> Tensor:
    r"""Closed-form integrated gradients of an elementwise g with a zero baseline.

    Args:
        pre_parts: (..., P, F) pre-activation parts p_j.
        pre_total: (..., F) their sum p (bias part included).
        act: the elementwise activation g.

    Returns:
        (..., P, F): IG_j = p_j (g(p) - g(0)) / p; where |p| is tiny, p_j g'(0).
    """
    return pre_parts * ig_coefficients(pre_total, act, "closed_form").unsqueeze(-2)


def ig_riemann(pre_parts: Tensor, pre_total: Tensor, act: Callable, steps: int = 50) -> Tensor:
    r"""Numerical IG by the midpoint rule along t * p: IG_j = p_j mean_k g'(t_k p) (autograd)."""
    return pre_parts * ig_coefficients(pre_total, act, "riemann", steps).unsqueeze(-2)


def ff_parts(
    input_parts: Tensor,
    input_bias: Tensor,
    w_in: Tensor,
    b_in: Optional[Tensor],
    act: Callable,
    w_out: Tensor,
    b_out: Optional[Tensor],
    method: str = "closed_form",
    steps: int = 50,
) -> Tuple[Tensor, Tensor]:
    r"""Parts of the FF output from parts of its input.

    Args:
        input_parts: (B, T, P, D) parts u_j.
        input_bias: (B, T, D) bias part u_bias.
        w_in, b_in: (D, F), (F,) or None.
        act: elementwise activation.
        w_out, b_out: (F, D), (D,) or None.
        method: ``"closed_form"`` (exact) or ``"riemann"`` (midpoint rule, ``steps``).

    Returns:
        (parts (B, T, P, D), bias_part (B, T, D)), summing to FF(u).
    """
    if method not in IG_METHODS:
        raise ValueError(f"method must be one of {IG_METHODS}, got {method!r}")
    pre_bias = input_bias @ w_in
    if b_in is not None:
        pre_bias = pre_bias + b_in
    return ff_parts_from_pre(input_parts @ w_in, pre_bias, act, w_out, b_out, method, steps)


def ff_parts_from_pre(
    pre_parts: Tensor,
    pre_bias: Tensor,
    act: Callable,
    w_out: Tensor,
    b_out: Optional[Tensor],
    method: str = "closed_form",
    steps: int = 50,
) -> Tuple[Tensor, Tensor]:
    r"""Parts of the FF output from the pre-activation parts (the second half of :func:`ff_parts`).

    Args:
        pre_parts: (B, T, P, F) p_j = u_j W1; OVERWRITTEN (multiplied in place by the IG
            coefficients) to keep one F-wide temporary.
        pre_bias: (B, T, F) p_bias = u_bias W1 + b1.
        act, w_out, b_out, method, steps: as in :func:`ff_parts`.

    Returns:
        (parts (B, T, P, D), bias_part (B, T, D)).
    """
    coef = ig_coefficients(pre_parts.sum(-2) + pre_bias, act, method, steps)  # (B, T, F)
    zero = act(torch.zeros((), dtype=coef.dtype, device=coef.device))
    parts = pre_parts.mul_(coef.unsqueeze(-2)) @ w_out
    bias = (pre_bias * coef + zero) @ w_out
    if b_out is not None:
        bias = bias + b_out
    return parts, bias


def _ln1_parts_rows(layer: LayerTensors, projected: Tensor, rows: slice) -> Tensor:
    a = attention_parts_rows(layer.probs, projected, rows)  # (B, R, T, D)
    r = torch.arange(rows.start, rows.stop, device=a.device)
    a[:, r - rows.start, r] += layer.hidden_in[:, rows]
    return apply_norm_to_parts(a, layer.ln1_in[:, rows], layer.ln1)


def low_gamma_keep(params: NormParams, fraction: float, dim: int) -> Tensor:
    r"""Dimensions kept by the low-gamma ablation of Kobayashi et al. 2023.

    The k = round(fraction * D) dimensions with the lowest gamma values (signed; ties by
    index) are dropped; at least one when ``fraction > 0``.

    Args:
        params: the LayerNorm's parameters (gamma = ``params.weight``; None counts as all ones).
        fraction: share of dimensions to ignore, in [0, 1), e.g. 0.01.
        dim: D.

    Returns:
        (D,) long indices of the kept dimensions, ascending.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"ignore_low_gamma must be in [0, 1), got {fraction}")
    k = 0 if fraction == 0 else max(1, int(round(fraction * dim)))
    gamma = params.weight if params.weight is not None else torch.ones(dim)
    drop = torch.argsort(gamma.detach().double().cpu(), stable=True)[:k]
    keep = torch.ones(dim, dtype=torch.bool)
    keep[drop] = False
    device = params.weight.device if params.weight is not None else None
    return torch.nonzero(keep).flatten().to(device)


def ff_rows_per_chunk(layer: LayerTensors, memory_budget_mb: float) -> int:
    r"""Query rows per chunk so that one chunk's explicit parts fit ``memory_budget_mb``.

    A chunk holds about (F + 8 D) numbers per (receiving, source) pair: the F-wide
    pre-activation parts and a handful of D-wide parts (LN1 output, FF output, RES2, LN2
    output, temporaries of the norm).

    Returns:
        Rows per chunk, at least 1.
    """
    b, t, d = layer.hidden_in.shape
    f = layer.ff.w_in.shape[-1]
    return rows_for_budget(b, t, f + 8 * d, layer.hidden_in.element_size(), memory_budget_mb, temporaries=1)


def scope_outputs(layer: LayerTensors) -> Dict[str, Tensor]:
    r"""The real output of every scope, (B, T, D): what the scope's parts plus bias part sum to."""
    return {"ATB": layer.ln1_out, "FF": layer.ff_out, "RES2": layer.ln2_in, "LN2": layer.ln2_out}


def component_scope_maps(
    layer: LayerTensors,
    valid: Tensor,
    chunk_rows: Optional[int] = None,
    method: str = "closed_form",
    steps: int = 50,
    contribution: str = "norm",
    ignore_low_gamma: float = 0.0,
    memory_budget_mb: Optional[float] = None,
) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    r"""Maps of every component scope of a post-LN layer, built in chunks of query rows.

    Scope parts of token j in token i: ATB zt_{i<-j} (LN1 output), FF FF_{i<-j}, RES2
    zt_{i<-j} + FF_{i<-j}, LN2 yt_{i<-j} (the whole layer).

    Args:
        layer: the layer's tensors (post-LN).
        valid: (B, T) bool, non-pad tokens.
        chunk_rows: query rows per chunk; None: from ``memory_budget_mb`` (all rows if both None).
        method, steps: IG of the activation, as in :func:`ff_parts`.
        contribution: ``"norm"``: entry (i, j) = ||part_{i<-j}||_2; ``"alti"``: ALTI's
            max(0, |y_i|_1 - |y_i - part_{i<-j}|_1) against the real scope output y_i
            (:func:`scope_outputs`), valid rows normalised to sum to 1.
        ignore_low_gamma: if > 0 (``"norm"`` only), ALSO return ``"ATB_ablated"`` and
            ``"LN2_ablated"``: the norms of the LN1 / LN2 output parts over the dimensions that
            remain after dropping this share of dimensions with the lowest gamma of that
            LayerNorm (:func:`low_gamma_keep`).
        memory_budget_mb: budget for one chunk's explicit parts.

    Returns:
        (maps, errors): maps ``"ATB"``, ``"FF"``, ``"RES2"``, ``"LN2"`` (and the ablated ones),
        each (B, T, T) with pad rows and columns 0; errors ``"ff"`` and ``"layer"`` (scalars):
        max |parts + bias - real| of the FF output / the layer output over valid tokens, and
        ``"ff_per_example"``, ``"layer_per_example"`` (B,).
    """
    if contribution not in CONTRIBUTIONS:
        raise ValueError(f"contribution must be one of {CONTRIBUTIONS}, got {contribution!r}")
    if method not in IG_METHODS:
        raise ValueError(f"method must be one of {IG_METHODS}, got {method!r}")
    if ignore_low_gamma and contribution != "norm":
        raise ValueError("ignore_low_gamma acts on the norms of LayerNorm-output parts: use contribution='norm'")
    b, t, d = layer.hidden_in.shape
    if chunk_rows is None:
        chunk_rows = t if memory_budget_mb is None else ff_rows_per_chunk(layer, memory_budget_mb)
    chunk = max(1, int(chunk_rows))
    keep = {}
    if ignore_low_gamma:
        keep = {"ATB_ablated": low_gamma_keep(layer.ln1, ignore_low_gamma, d),
                "LN2_ablated": low_gamma_keep(layer.ln2, ignore_low_gamma, d)}
    names = SCOPES + tuple(keep)
    maps = {n: layer.hidden_in.new_zeros(b, t, t) for n in names}
    outputs = scope_outputs(layer)
    f = layer.ff
    head_w = layer.head_out_weight()
    projected = project_values(layer.values, head_w)
    zt_b = norm_bias_part(layer.out_bias, layer.ln1_in, layer.ln1)
    pre_b = zt_b @ f.w_in
    if f.b_in is not None:
        pre_b = pre_b + f.b_in
    # Pre-activation parts zt_{i<-j} W1 = (sum_h alpha^h_ij v^h_j W_O^h + [i=j] x_i) A1 W1 / s1_i with
    # A1 the linear part of LN1: project values straight to the F neurons per head (H x F per
    # pair instead of D x F).
    a1w1 = norm_linear_map(layer.ln1, d, layer.hidden_in.dtype, layer.hidden_in.device) @ f.w_in
    pre_values = project_values(layer.values, head_w, a1w1)  # (B, H, T, F)
    pre_res = layer.hidden_in @ a1w1  # (B, T, F)
    s1 = norm_scale(layer.ln1_in, layer.ln1)
    ff_err = layer.hidden_in.new_zeros(b, t)
    layer_err = layer.hidden_in.new_zeros(b, t)
    for start in range(0, t, chunk):
        rows = slice(start, min(start + chunk, t))
        zt = _ln1_parts_rows(layer, projected, rows)
        r = torch.arange(rows.start, rows.stop, device=zt.device)
        pre = attention_parts_rows(layer.probs, pre_values, rows)  # (B, R, T, F)
        pre[:, r - rows.start, r] += pre_res[:, rows]
        pre.div_(s1[:, rows, None, None])
        ffp, ff_b = ff_parts_from_pre(pre, pre_b[:, rows], f.act, f.w_out, f.b_out, method, steps)
        del pre
        ff_err[:, rows] = (ffp.sum(2) + ff_b - layer.ff_out[:, rows]).abs().amax(-1)
        res2 = zt + ffp
        yt = apply_norm_to_parts(res2, layer.ln2_in[:, rows], layer.ln2)
        yt_b = norm_bias_part(zt_b[:, rows] + ff_b, layer.ln2_in[:, rows], layer.ln2)
        layer_err[:, rows] = (yt.sum(2) + yt_b - layer.ln2_out[:, rows]).abs().amax(-1)
        parts = {"ATB": zt, "FF": ffp, "RES2": res2, "LN2": yt}
        for s in SCOPES:
            if contribution == "norm":
                maps[s][:, rows] = parts[s].norm(dim=-1)
            else:
                maps[s][:, rows] = l1_contributions(parts[s], outputs[s][:, rows])
        for n, idx in keep.items():
            maps[n][:, rows] = parts[n.split("_")[0]].index_select(-1, idx).norm(dim=-1)
        del zt, ffp, res2, yt, parts
    m = valid.to(layer.hidden_in.dtype)
    m2 = m[:, :, None] * m[:, None, :]
    maps = {n: v.mul_(m2) for n, v in maps.items()}
    if contribution == "alti":
        maps = {n: row_normalize(v) for n, v in maps.items()}
    ff_ex, layer_ex = (ff_err * m).amax(-1), (layer_err * m).amax(-1)
    errors = {"ff": ff_ex.max(), "layer": layer_ex.max(), "ff_per_example": ff_ex, "layer_per_example": layer_ex}
    return maps, errors


def contextualization_change(map_a: Tensor, map_b: Tensor, valid: Tensor) -> Tensor:
    r"""1 - Spearman rho of the flattened valid entries of two (B, T, T) maps, per example (B,)."""
    from scipy.stats import spearmanr

    out = []
    for b in range(map_a.shape[0]):
        v = valid[b].bool()
        a = map_a[b][v][:, v].flatten().detach().cpu().double().numpy()
        c = map_b[b][v][:, v].flatten().detach().cpu().double().numpy()
        out.append(1.0 - float(spearmanr(a, c).correlation))
    return torch.tensor(out, dtype=map_a.dtype)
