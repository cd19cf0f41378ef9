r"""DecompX's bias policy and the part helpers every layer kind's step is built from (docs/design.md, section 8).

DecompX (Modarressi et al., ACL 2023) carries per-input-token parts through every layer: the
input of layer 1 (the embedding output e) is written as parts x_{i<-k} = [i = k] e_i plus a
bias part 0 (:func:`initial_parts`), and every layer maps parts to parts with its nonlinear
quantities frozen at their REAL values (attention probabilities, per-token norm scales, the
FF and head activation slopes), so that the parts of every layer output, and finally the
scores, sum exactly to the model's real tensors.

Bias handling (``bias_mode``, :data:`BIAS_MODES`):

- ``"separate"`` (default): every bias travels in its own part; exact, and the token
  scores do not depend on any bias.
- ``"spread"``: as in the official DecompX code, every bias is distributed over the source
  tokens in proportion to |<part_k, bias>| (:func:`spread_weights`, :func:`absorb_bias`);
  the bias part stays 0. The attention biases: in layer 0 b_V stays inside each token's own
  value vector (the attention mixes it with the token), and b_O, and from layer 1 on
  W_O b_V + b_O, are spread over the attention-plus-residual parts AFTER the residual is
  added. LN betas, FF biases and the head's biases are spread where they enter.
- ``"spread_per_key"``: as ``"spread"``, except that b_V is spread over the parts of each
  key token j by |<x_{j<-k} W_V, b_V>| before the attention mixes them, and b_O over the
  attention parts before the residual (the package's rule before version 2).
  (In both, if every dot product is 0 the bias goes to the receiving token itself.)

All modes are complete: parts (+ bias part) sum to the real tensors.

Every layer kind's step (``LayerKind.decompx_step``, in its module of
:mod:`captum_normattr.decompose.kinds`) is made of these pieces: a layer whose norms sit
inside its branches is :func:`two_branch_layer_parts`, the attention block
(:func:`attention_block_parts`: x_i + Attn(N1(x))_i) and the FF branch
(:func:`ff_branch_parts`: FF(N2(z)) through the frozen per-neuron coefficients of
:func:`ff_coefficients`). The other halves of DecompX: :mod:`.propagation` (the forward
algorithm), :mod:`.frozen` and :mod:`.adjoint` (the adjoint algorithm), :mod:`.readout` (the
heads and the next-token logit).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from captum_normattr.decompose.primitives.channel_mixing import head_rows
from captum_normattr.decompose.primitives.chunking import rows_for_budget
from captum_normattr.decompose.primitives.feed_forward import ig_closed_form
from captum_normattr.decompose.primitives.gated_feed_forward import DEFAULT_NODES, gate_integrals
from captum_normattr.decompose.primitives.layer_norm import apply_norm_to_parts, norm_bias_part
from captum_normattr.decompose.records import LayerTensors

__all__ = [
    "BIAS_MODES",
    "SPREAD_MODES",
    "absorb_bias",
    "activation_slopes",
    "attention_block_parts",
    "check_bias_mode",
    "ff_branch_parts",
    "ff_coefficients",
    "frozen_ff_parts",
    "initial_parts",
    "spread_weights",
    "two_branch_layer_parts",
    "value_bias_weights",
    "value_heads",
]

BIAS_MODES: Tuple[str, ...] = ("separate", "spread", "spread_per_key")


#: The bias modes that spread every bias over the token parts (the forward algorithm only).
SPREAD_MODES: Tuple[str, ...] = ("spread", "spread_per_key")


def check_bias_mode(bias_mode: str) -> None:
    r"""Raise a ValueError naming the valid bias modes."""
    if bias_mode not in BIAS_MODES:
        raise ValueError(f"bias_mode must be one of {BIAS_MODES}, got {bias_mode!r}")


def spread_weights(dots: Tensor, fallback: Tensor) -> Tensor:
    r"""Weights over source tokens proportional to |dots|, summing to 1 over the last dim.

    Args:
        dots: (B, R, K) dot products <part_{r<-k}, bias_r>.
        fallback: (R,) long (or (B, R), one per example): the source token that receives
            the whole bias of a row whose dot products are all 0.

    Returns:
        (B, R, K).
    """
    a = dots.abs()
    total = a.sum(-1, keepdim=True)
    own = torch.zeros_like(a)
    fallback = fallback.to(a.device)
    if fallback.dim() == 2:
        own.scatter_(-1, fallback.unsqueeze(-1), 1.0)
    else:
        own[:, torch.arange(a.shape[1], device=a.device), fallback] = 1.0
    return torch.where(total > 0, a / torch.where(total > 0, total, torch.ones_like(total)), own)


def absorb_bias(parts: Tensor, bias: Tensor, fallback: Tensor) -> Tuple[Tensor, Tensor]:
    r"""Spread a bias part over the parts in proportion to |<part, bias>| (the spread modes).

    Args:
        parts: (B, R, K, D).
        bias: (B, R, D).
        fallback: (R,) long, see :func:`spread_weights`.

    Returns:
        (parts + w * bias, zeros like bias); the sum over K plus the bias is unchanged.
    """
    w = spread_weights(torch.einsum("brkd,brd->brk", parts, bias), fallback)
    return parts + w.unsqueeze(-1) * bias.unsqueeze(2), torch.zeros_like(bias)


def initial_parts(embeddings: Tensor) -> Tuple[Tensor, Tensor]:
    r"""Parts of the layer-1 input: the embedding output of token i is all token i's.

    Args:
        embeddings: (B, T, D) the real input of the first layer.

    Returns:
        (parts (B, T, T, D) with parts[b, i, k] = [i = k] e_i, bias part zeros (B, T, D)).
    """
    t = embeddings.shape[1]
    eye = torch.eye(t, dtype=embeddings.dtype, device=embeddings.device)
    return embeddings.unsqueeze(2) * eye[None, :, :, None], torch.zeros_like(embeddings)


def value_bias_weights(
    parts: Tensor, v_bias: Tensor, value_weight: Tensor, bias_mode: str, layer_index: int
) -> Optional[Tensor]:
    r"""How a spread mode shares the value bias part v_bias_j (B, T, HDh) among the parts of key token j.

    Returns (B, T, K) weights that the attention then mixes together with the parts, or None
    when the value bias is not shared among the key token's parts (``"separate"``, and
    ``"spread"`` after layer 0, where it joins b_O after the residual):

    - ``"spread_per_key"``: |<x_{j<-k} W_V, v_bias_j>|, normalised over k
      (:func:`spread_weights`; all 0: token j itself);
    - ``"spread"`` in layer 0 (the official code: b_V stays in each token's own value
      vector): all to k = j. The layer-0 parts of x_j are token j's alone, so this is
      also what ``"spread_per_key"`` gives there.
    """
    b, t = parts.shape[:2]
    own = torch.arange(t, device=parts.device)
    if bias_mode == "spread_per_key":  # <x_{j<-k} W_V, vb_j> = <x_{j<-k}, vb_j W_V^T>
        return spread_weights(torch.einsum("btkd,btd->btk", parts, v_bias @ value_weight.T), own)
    if bias_mode == "spread" and layer_index == 0:
        w = parts.new_zeros(b, t, parts.shape[2])
        w[:, own, own] = 1.0
        return w
    return None


def ff_coefficients(
    layer: LayerTensors, nodes: int = DEFAULT_NODES, preactivations: Optional[Tuple[Tensor, Tensor]] = None
) -> Dict[str, Tensor]:
    r"""The frozen per-neuron FF coefficients of one layer, at the REAL FF input.

    The FF input is the record's ``ff_input`` (what its layer kind declares and the capture
    fills: LN1's output for a post-LN layer, the second norm's output for the others).
    Every FF part is linear in its input part through these coefficients:

    - elementwise g (BERT, GPT-2): ``{"slope": (g(p) - g(0)) / p}`` at the real
      pre-activation p (the exact closed form of integrated gradients); part k of the
      pre-activation p_k maps to p_k * slope.
    - gated (SwiGLU, Llama family), phi(a, b) = g(a) b per neuron with a = u W_gate + b_gate,
      b = u W_up + b_up: integrated gradients along t * (a, b) gives part k
      a_k * b * I1(a) + b_k * I2(a), I1 = int_0^1 t g'(t a) dt, I2 = int_0^1 g(t a) dt
      (Gauss-Legendre, :func:`~captum_normattr.decompose.primitives.gated_feed_forward.gate_integrals`):
      ``{"gate": b * I1, "up": I2, "quadrature_error": (B, T) max over neurons of
      |b (a I1 + I2) - b g(a)|}`` — the completeness error that the quadrature leaves.
    - experts (``FFParams.hidden_scale`` r, the frozen routing weights per hidden neuron):
      the gated form with b = r (u W_up + b_up), i.e. ``"gate"`` r b I1 and ``"up"`` r I2.

    Args:
        layer: the layer's real tensors.
        nodes: Gauss-Legendre nodes (gated FF only).
        preactivations: gated FF only: the real (a, b) (B, T, F) if already at hand (the
            outputs of the gate and up projections that a rerun of the layer computed;
            read, not modified), instead of recomputing them from the FF input.

    Returns:
        dict of (B, T, F) tensors (and the (B, T) quadrature error for a gated FF).
    """
    f = layer.ff
    u = layer.ff_input
    if f.w_gate is not None and preactivations is not None:
        a, pre = preactivations
    else:
        pre = u @ f.w_in
        if f.b_in is not None:
            pre += f.b_in
        if f.w_gate is None:
            return {"slope": activation_slopes(pre, f.act)}
        a = u @ f.w_gate
        if f.b_gate is not None:
            a += f.b_gate
    if f.hidden_scale is not None:  # experts: b = r (u W_up), r the frozen routing weight of the neuron's expert
        pre = pre * f.hidden_scale
    if f.gate_scale is not None:  # input-scaled experts (Llama 4): a = q (u W_gate), part k of a is q a_k
        a = a * f.gate_scale
    i1, i2 = gate_integrals(a, f.act, nodes)
    # |b (a I1 + I2) - b g(a)| = |b| |a I1 + I2 - g(a)|, in place
    err = torch.mul(a, i1).add_(i2).sub_(f.act(a)).mul_(pre).abs_().amax(-1)
    up = i2 if f.hidden_scale is None else i2.mul_(f.hidden_scale)  # part k of b is r b_k
    gate = i1.mul_(pre) if f.gate_scale is None else i1.mul_(pre).mul_(f.gate_scale)
    return {"gate": gate, "up": up, "quadrature_error": err}


def activation_slopes(real_pre: Tensor, act: Callable) -> Tensor:
    r"""(g(p) - g(0)) / p at the real pre-activation (g'(0) where p ~ 0), via ig_closed_form."""
    return ig_closed_form(torch.ones_like(real_pre).unsqueeze(-2), real_pre, act).squeeze(-2)


def value_heads(v: Tensor, kv_heads: int, groups: int) -> Tensor:
    r"""(..., H_kv * Dh) -> (..., H, Dh), each key/value head repeated for the ``groups`` query heads it serves."""
    v = v.reshape(v.shape[:-1] + (kv_heads, v.shape[-1] // kv_heads))
    return v if groups == 1 else v.repeat_interleave(groups, dim=-2)


def _spread_into(parts: Tensor, bias: Tensor, weight: Tensor, fallback: Tensor, spread: bool) -> Tuple[Tensor, Tensor]:
    r"""``"spread"``: give parts their |<part W, bias>| share of a bias living after the matrix W.

    parts: (B, R, K, D) input parts; bias: (B, R, F) a bias part in the output space of W (D, F).
    Returns (parts W + shares, bias or zeros).
    """
    out = parts @ weight
    if not spread:
        return out, bias
    w = spread_weights(torch.einsum("brkd,brd->brk", parts, bias @ weight.T), fallback)
    return out + w.unsqueeze(-1) * bias.unsqueeze(2), torch.zeros_like(bias)


def frozen_ff_parts(
    z: Tensor, z_b: Tensor, ff: Dict[str, object], coefs: Dict[str, Tensor], spread: bool, fallback: Tensor
) -> Tuple[Tensor, Tensor]:
    r"""FF-output parts from FF-input parts with frozen coefficients (:func:`ff_coefficients`).

    Args:
        z: (B, R, K, D) input parts; z_b: (B, R, D) their bias part.
        ff: the layer's FF parameters (``LayerTensors.ff``).
        coefs: the coefficients at these R rows, (B, R, F) each.
        spread: ``"spread"`` bias mode (every bias entering here is spread over the parts).
        fallback: (R,) long, the source token taking a bias whose dot products are all 0.

    Returns:
        (parts (B, R, K, D), bias part (B, R, D)).
    """
    f = ff
    w1, b1, w2, b2, act = f.w_in, f.b_in, f.w_out, f.b_out, f.act
    pre_b = z_b @ w1 + (b1 if b1 is not None else 0.0)
    pre, pre_b = _spread_into(z, pre_b, w1, fallback, spread)
    if f.w_gate is None:
        slope = coefs["slope"]
        ig = pre.mul_(slope.unsqueeze(-2))
        ig_b = pre_b * slope + act(torch.zeros((), dtype=z.dtype, device=z.device))
    else:
        gate_b = z_b @ f.w_gate + (f.b_gate if f.b_gate is not None else 0.0)
        gate, gate_b = _spread_into(z, gate_b, f.w_gate, fallback, spread)
        ig = gate.mul_(coefs["gate"].unsqueeze(-2)).add_(pre.mul_(coefs["up"].unsqueeze(-2)))
        ig_b = gate_b * coefs["gate"] + pre_b * coefs["up"]
    del pre
    out = ig @ w2
    out_b = ig_b @ w2
    if b2 is not None:
        out_b = out_b + b2
    return out, out_b


def attention_block_parts(
    parts: Tensor,
    bias: Tensor,
    layer: LayerTensors,
    value_weight: Tensor,
    value_bias: Optional[Tensor],
    bias_mode: str = "separate",
    rows: Optional[Tensor] = None,
    memory_budget_mb: float = 256.0,
) -> Tuple[Tensor, Tensor]:
    r"""Parts of x_i + Attn(N1(x))_i from the parts of the layer input x (pre-LN and parallel layers).

    h_{i<-k} = x_{i<-k} + sum_h (sum_j alpha^h_ij N1(x)_{j<-k} W_V^h) W_O^h   (bias part + b_V mixed, + b_O)

    N1 uses the real per-token scale (RMSNorm: no centering, no beta); grouped-query values
    are repeated per query head; rotary embeddings never touch values. In the spread modes
    the attention biases are spread as :func:`~captum_normattr.decompose.kinds.pre_ln.pre_ln_layer_parts` says.

    Args:
        parts, bias, layer, value_weight, value_bias, bias_mode, rows, memory_budget_mb: as in
            :func:`~captum_normattr.decompose.kinds.pre_ln.pre_ln_layer_parts`.

    Returns:
        (parts (B, R, K, D), bias part (B, R, D)) at ``rows``.
    """
    check_bias_mode(bias_mode)
    spread = bias_mode in SPREAD_MODES
    b, t, k, d = parts.shape
    dev, dtype = parts.device, parts.dtype
    all_rows = torch.arange(t, device=dev)
    rows = all_rows if rows is None else rows.to(dev)
    r = rows.shape[0]
    h = layer.num_heads
    hd = layer.out_weight.shape[0]
    dh = hd // h
    kv_heads = value_weight.shape[1] // dh
    groups = h // kv_heads
    # the one chunk rule (as in the post-LN step, captum_normattr.decompose.kinds.post_ln.post_ln_layer_parts)
    k_chunk = rows_for_budget(b, t, max(d, hd), parts.element_size(), memory_budget_mb, temporaries=3)
    probs = head_rows(layer.probs, rows)  # (B, H, R, T)
    b_o = layer.out_bias if layer.out_bias is not None else torch.zeros(d, dtype=dtype, device=dev)

    # --- LN1 (one token alone), values, mixing per head, W_O --------------------------
    u = apply_norm_to_parts(parts, layer.ln1_in, layer.ln1)
    u_b = norm_bias_part(bias, layer.ln1_in, layer.ln1)
    if spread:
        u, u_b = absorb_bias(u, u_b, all_rows)
    v_b = u_b @ value_weight + (value_bias if value_bias is not None else 0.0)  # (B, T, H_kv Dh)
    if not torch.is_tensor(v_b):
        v_b = u.new_zeros(b, t, value_weight.shape[1])
    v_weights = value_bias_weights(u, v_b, value_weight, bias_mode, layer.index)
    a = parts.new_empty(b, r, k, d)
    for start in range(0, k, k_chunk):
        kc = slice(start, min(k, start + k_chunk))
        v = u[:, :, kc] @ value_weight
        if v_weights is not None:
            v = v + v_weights[:, :, kc, None] * v_b[:, :, None, :]
        v = value_heads(v, kv_heads, groups)  # (B, T, kc, H, Dh)
        mixed = torch.einsum("bhij,bjkhe->bikhe", probs, v).reshape(b, r, v.shape[2], hd)
        a[:, :, kc] = mixed @ layer.out_weight
        del v, mixed
    del u
    if bias_mode == "spread_per_key":
        a, a_b = absorb_bias(a, b_o.expand(b, r, d), rows)
    else:  # "separate", and "spread" (which spreads it after the residual, below)
        v_mix = v_b if v_weights is None else torch.zeros_like(v_b)
        mixed_b = torch.einsum("bhij,bjhe->bihe", probs, value_heads(v_mix, kv_heads, groups)).reshape(b, r, hd)
        a_b = mixed_b @ layer.out_weight + b_o

    # --- residual (no norm) -------------------------------------------------------------
    a += parts[:, rows]
    a_b = a_b + bias[:, rows]
    if bias_mode == "spread":  # as the official post-LN rule: W_O b_V + b_O over the attention-plus-residual parts
        a, a_b = absorb_bias(a, a_b, rows)
    return a, a_b


def ff_branch_parts(
    z_in: Tensor,
    z_in_b: Tensor,
    real_in: Tensor,
    layer: LayerTensors,
    coefs: Dict[str, Tensor],
    rows: Tensor,
    bias_mode: str = "separate",
    memory_budget_mb: float = 256.0,
    out: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    r"""Parts of FF(N2(z)) from the parts of the second norm's input z, added into ``out``.

    N2 is frozen at its real scale (``real_in``, its real input at ``rows``), the FF through
    :func:`ff_coefficients` (``coefs`` for the whole layer; read at ``rows``). Row chunks keep
    the FF-wide temporaries within ``memory_budget_mb``.

    Args:
        z_in: (B, R, K, D) parts of the norm input at ``rows``; z_in_b: (B, R, D) its bias part.
        real_in: (B, R, D) the norm's real input at ``rows``.
        layer: the layer's tensors (``ln2``, ``ff``).
        coefs: :func:`ff_coefficients` of the layer (all T rows).
        rows: (R,) long, the rows.
        bias_mode: one of :data:`BIAS_MODES`.
        memory_budget_mb: bound on the temporaries.
        out: (B, R, K, D) the tensor the FF parts are added to (in place; pre-LN: ``z_in``
            itself), or None (a new one).

    Returns:
        (``out`` + FF parts, the FF output's bias part (B, R, D)).
    """
    spread = bias_mode in SPREAD_MODES
    b, r, _, _ = z_in.shape
    t = layer.hidden_in.shape[1]
    ff_dim = layer.ff.w_out.shape[0]
    r_chunk = min(r, rows_for_budget(b, t, 2 * ff_dim, z_in.element_size(), memory_budget_mb, temporaries=3))
    c_rows = {key: val[:, rows] for key, val in coefs.items() if key != "quadrature_error"}
    out = torch.zeros_like(z_in) if out is None else out
    out_b = torch.empty_like(z_in_b)
    for start in range(0, r, r_chunk):
        rc = slice(start, min(r, start + r_chunk))
        z = apply_norm_to_parts(z_in[:, rc], real_in[:, rc], layer.ln2)
        z_b = norm_bias_part(z_in_b[:, rc], real_in[:, rc], layer.ln2)
        if spread:
            z, z_b = absorb_bias(z, z_b, rows[rc])
        ff, ff_b = frozen_ff_parts(z, z_b, layer.ff, {key: val[:, rc] for key, val in c_rows.items()}, spread, rows[rc])
        del z
        if spread:
            ff, ff_b = absorb_bias(ff, ff_b, rows[rc])
        out[:, rc] += ff
        out_b[:, rc] = ff_b
        del ff
    return out, out_b


def two_branch_layer_parts(
    parts: Tensor,
    bias: Tensor,
    layer: LayerTensors,
    value_weight: Tensor,
    value_bias: Optional[Tensor],
    bias_mode: str,
    rows: Optional[Tensor],
    memory_budget_mb: float,
    coefs: Optional[Dict[str, Tensor]],
    ff_reads_block: bool,
) -> Tuple[Tensor, Tensor]:
    r"""DecompX's step of x + Attn(N1(x)) + FF(N2(z)): :func:`attention_block_parts`, then :func:`ff_branch_parts`.

    The FF branch reads z = h = x + Attn(N1(x)) (``ff_reads_block``: pre-LN) or z = x
    (parallel), N2 frozen at its real input ``ln2_in``; its parts are added to those of h.

    Args:
        parts, bias, layer, value_weight, value_bias, bias_mode, rows, memory_budget_mb, coefs:
            as in :func:`~captum_normattr.decompose.kinds.pre_ln.pre_ln_layer_parts`.
        ff_reads_block: the FF input is the attention block's output (else the layer input).

    Returns:
        (parts (B, R, K, D), bias part (B, R, D)) of the layer output at ``rows``.
    """
    rows = torch.arange(parts.shape[1], device=parts.device) if rows is None else rows.to(parts.device)
    coefs = ff_coefficients(layer) if coefs is None else coefs
    a, a_b = attention_block_parts(parts, bias, layer, value_weight, value_bias, bias_mode, rows, memory_budget_mb)
    z, z_b = (a, a_b) if ff_reads_block else (parts[:, rows], bias[:, rows])
    out, ff_b = ff_branch_parts(z, z_b, layer.ln2_in[:, rows], layer, coefs, rows, bias_mode, memory_budget_mb, out=a)
    return out, a_b + ff_b

