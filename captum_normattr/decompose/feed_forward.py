r"""Feed-forward decomposition by integrated gradients (Kobayashi et al. 2023; DESIGN section 5).

FF(u) = W2 g(W1 u + b1) + b2 with g elementwise. For input parts u = sum_j u_j + u_bias
the pre-activation parts are p_j = u_j W1 and p_bias = u_bias W1 + b1. Integrated
gradients of g along t * p (zero baseline) has the exact closed form
IG_j = p_j (g(p) - g(0)) / p, so the FF part of j is IG_j W2 and the bias part is
(IG_bias + g(0)) W2 + b2; the parts sum to the real FF output.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from captum_normattr.decompose.attention import attention_parts_rows, project_values
from captum_normattr.decompose.layer_norm import apply_norm_to_parts, norm_bias_part, norm_scale
from captum_normattr.decompose.records import LayerTensors

SCOPES = ("ATB", "FF", "RES2", "LN2")


def act_derivative_at_zero(act: Callable) -> float:
    r"""g'(0) by a float64 central difference (robust for non-differentiable g such as ReLU)."""
    h = 1e-6
    x = torch.tensor([-h, h], dtype=torch.float64)
    y = act(x)
    return float((y[1] - y[0]) / (2 * h))


def ig_closed_form(pre_parts: Tensor, pre_total: Tensor, act: Callable) -> Tensor:
    r"""Closed-form integrated gradients of an elementwise g with a zero baseline.

    Args:
        pre_parts: (..., P, F) pre-activation parts p_j.
        pre_total: (..., F) their sum p (bias part included).
        act: the elementwise activation g.

    Returns:
        (..., P, F): IG_j = p_j (g(p) - g(0)) / p; where |p| is tiny, p_j g'(0).
    """
    zero = act(torch.zeros((), dtype=pre_total.dtype, device=pre_total.device))
    tiny = pre_total.abs() < (1e-12 if pre_total.dtype == torch.float64 else 1e-6)
    safe = torch.where(tiny, torch.ones_like(pre_total), pre_total)
    ratio = (act(pre_total) - zero) / safe
    ratio = torch.where(tiny, torch.full_like(pre_total, act_derivative_at_zero(act)), ratio)
    return pre_parts * ratio.unsqueeze(-2)


def ig_riemann(pre_parts: Tensor, pre_total: Tensor, act: Callable, steps: int = 50) -> Tensor:
    r"""Numerical IG by the midpoint rule along t * p: IG_j = p_j mean_k g'(t_k p) (autograd)."""
    grad_sum = torch.zeros_like(pre_total)
    for k in range(steps):
        t = (k + 0.5) / steps
        with torch.enable_grad():
            x = (t * pre_total).detach().requires_grad_(True)
            (g,) = torch.autograd.grad(act(x).sum(), x)
        grad_sum = grad_sum + g
    return pre_parts * (grad_sum / steps).unsqueeze(-2)


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
    pre = input_parts @ w_in  # (B, T, P, F)
    pre_bias = input_bias @ w_in
    if b_in is not None:
        pre_bias = pre_bias + b_in
    allp = torch.cat([pre, pre_bias.unsqueeze(-2)], -2)
    total = allp.sum(-2)
    if method == "closed_form":
        ig = ig_closed_form(allp, total, act)
    elif method == "riemann":
        ig = ig_riemann(allp, total, act, steps)
    else:
        raise ValueError(f"method must be 'closed_form' or 'riemann', got {method!r}")
    zero = act(torch.zeros((), dtype=total.dtype, device=total.device))
    out = ig @ w_out
    parts, bias = out[..., :-1, :], out[..., -1, :] + zero * w_out.sum(0)
    if b_out is not None:
        bias = bias + b_out
    return parts, bias


def ln1_output_parts(layer: LayerTensors, chunk_rows: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    r"""Explicit parts zt_{i<-j} = gamma1 c(a_{i<-j} + [i=j] x_i) / s(z_i) and the bias part.

    Returns:
        ((B, T, T, D), (B, T, D)).
    """
    b, t, d = layer.hidden_in.shape
    projected = project_values(layer.values, layer.head_out_weight())
    chunk = chunk_rows or t
    out = []
    idx = torch.arange(t, device=layer.hidden_in.device)
    for start in range(0, t, chunk):
        rows = slice(start, min(start + chunk, t))
        a = attention_parts_rows(layer.probs, projected, rows)  # (B, R, T, D)
        r = idx[rows]
        a[:, torch.arange(len(r)), r] += layer.hidden_in[:, rows]
        out.append(apply_norm_to_parts(a, layer.ln1_in[:, rows], layer.ln1))
    parts = torch.cat(out, 1)
    return parts, norm_bias_part(layer.out_bias, layer.ln1_in, layer.ln1)


def _ff(layer: LayerTensors, zt_parts: Tensor, zt_bias: Tensor, method: str, steps: int):
    f = layer.ff
    return ff_parts(zt_parts, zt_bias, f["w_in"], f.get("b_in"), f["act"], f["w_out"], f.get("b_out"), method, steps)


def post_ln_whole_layer_parts(
    layer: LayerTensors, chunk_rows: Optional[int] = None, method: str = "closed_form", steps: int = 50
) -> Tuple[Tensor, Tensor]:
    r"""Parts of the post-LN layer output: yt_{i<-j} = gamma2 c(zt_{i<-j} + FF_{i<-j}) / s(ln2_in_i).

    Returns:
        (parts (B, T, T, D), bias (B, T, D)), summing to the real LN2 output.
    """
    zt, zt_b = ln1_output_parts(layer, chunk_rows)
    ffp, ff_b = _ff(layer, zt, zt_b, method, steps)
    parts = apply_norm_to_parts(zt + ffp, layer.ln2_in, layer.ln2)
    return parts, norm_bias_part(zt_b + ff_b, layer.ln2_in, layer.ln2)


def component_scope_maps(
    layer: LayerTensors, valid: Tensor, chunk_rows: Optional[int] = None, method: str = "closed_form", steps: int = 50
) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    r"""Norm maps of every component scope of a post-LN layer.

    Returns:
        (maps, errors): maps "ATB", "FF", "RES2", "LN2", each (B, T, T) with pad rows and
        columns 0; errors "ff" and "layer" (scalars): max |parts + bias - real| over valid tokens.
    """
    zt, zt_b = ln1_output_parts(layer, chunk_rows)
    ffp, ff_b = _ff(layer, zt, zt_b, method, steps)
    res2 = zt + ffp
    yt = apply_norm_to_parts(res2, layer.ln2_in, layer.ln2)
    yt_b = norm_bias_part(zt_b + ff_b, layer.ln2_in, layer.ln2)
    m = valid.to(zt.dtype)
    m2 = m[:, :, None] * m[:, None, :]
    maps = {"ATB": zt.norm(dim=-1) * m2, "FF": ffp.norm(dim=-1) * m2, "RES2": res2.norm(dim=-1) * m2, "LN2": yt.norm(dim=-1) * m2}
    ff_err = ((ffp.sum(2) + ff_b - layer.ff_out).abs().amax(-1) * m).max()
    layer_err = ((yt.sum(2) + yt_b - layer.ln2_out).abs().amax(-1) * m).max()
    return maps, {"ff": ff_err, "layer": layer_err, "ff_per_example": (ffp.sum(2) + ff_b - layer.ff_out).abs().amax(-1).mul(m).amax(-1)}


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
