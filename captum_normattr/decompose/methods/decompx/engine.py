r"""DecompX (Modarressi et al., ACL 2023): per-input-token parts carried through every layer and the head.

The input of layer 1 (the embedding output e) is written as parts x_{i<-k} = [i = k] e_i
plus a bias part 0. Every layer maps parts to parts with its nonlinear quantities frozen
at their REAL values (attention probabilities, per-token norm scales, the FF and head
activation slopes), so the parts of every layer output, and finally the per-class
scores, sum exactly to the model's real tensors:

post-LN layer (BERT, RoBERTa, ELECTRA, DistilBERT), per head h (never an (H, T, T, D) tensor):
  v^h_{j<-k} = x_{j<-k} W_V^h                (bias part: x_bias W_V^h + b_V^h)
  a_{i<-k}   = sum_h (sum_j alpha^h_ij v^h_{j<-k}) W_O^h      (bias part + b_O)
  z_{i<-k}   = a_{i<-k} + x_{i<-k};  zt = gamma1 c(z_{i<-k}) / s(z_i)      (bias part + beta1)
  FF_{i<-k}  = (zt_{i<-k} W1 * (g(p_i) - g(0)) / p_i) W2  with p_i the REAL pre-activation
               (DecompX's "zero-origin slope"; the closed form of
               :func:`captum_normattr.decompose.primitives.feed_forward.ig_closed_form`)
  y_{i<-k}   = gamma2 c(zt_{i<-k} + FF_{i<-k}) / s(zt_i + FF_i)             (bias part + beta2)
classification head on token 0: the same closed form through its elementwise activation
(a head with norms, ModernBERT's N(act(P(h) W_d + b_d)) W_c + b_c: the final norm P and the
head norm N at the real per-example scales; its mean pooling: every last-layer row through P
at its own scale, then averaged over the real tokens, :func:`pool_head_parts`).

Bias handling (``bias_mode``):
- ``"separate"`` (default): every bias travels in its own part; exact, and the token
  scores do not depend on any bias.
- ``"spread"``: as in the official DecompX code, every bias is distributed over the source
  tokens in proportion to |<part_k, bias>|; the bias part stays 0. The attention biases:
  in layer 0 b_V stays inside each token's own value vector (the attention mixes it with
  the token), and b_O, and from layer 1 on W_O b_V + b_O, are spread over the
  attention-plus-residual parts AFTER the residual is added. LN betas, FF biases and the
  head's biases are spread where they enter.
- ``"spread_per_key"``: as ``"spread"``, except that b_V is spread over the parts of each
  key token j by |<x_{j<-k} W_V, b_V>| before the attention mixes them, and b_O over the
  attention parts before the residual (the package's rule before version 2).
  (In both, if every dot product is 0 the bias goes to the receiving token itself.)
All modes are complete: parts (+ bias part) sum to the real tensors.

Two algorithms. The forward one (:class:`PartsPropagation`, :func:`head_scores`) carries all
T parts, a (B, T, T, D) tensor, through every layer (cost about T forward passes; it
yields per-layer parts; needed for ``"spread"``, whose weights depend on the parts). The
adjoint one (:class:`AdjointPass`, ``"separate"`` only) uses that the frozen network is
affine in the embedding output: token k's score is <dF_c/dx_k, e_k>, one vector-Jacobian
product per class (cost a few forward passes). Both agree to rounding. Both run layer by
layer as the recorded forward pass produces the layers, so that no more than one layer's
attention probabilities exist at a time: the forward one keeps the current parts and small
per-layer results; the adjoint one keeps each layer's input (B, T, D) and, walking the
layers top-down, reruns each layer on it for its local vector-Jacobian product.
:func:`propagate_parts` runs the forward one over a list of captured layers.

Layer kinds are one function each (:data:`LAYER_STEPS`).

pre-LN layer (GPT-2, the Llama-like families; :func:`pre_ln_layer_parts`):
  u_{j<-k}   = gamma1 c(x_{j<-k}) / s(x_j)       (RMSNorm: no centering, no beta; bias part + beta1)
  h_{i<-k}   = x_{i<-k} + sum_h (sum_j alpha^h_ij u_{j<-k} W_V^h) W_O^h   (bias part: b_V mixed, + b_O)
               (grouped-query attention: each key/value head's values repeated per query head)
  out_{i<-k} = h_{i<-k} + FF_{i<-k}(gamma2 c(h_{i<-k}) / s(h_i))           (no norm after the residual)
  FF: elementwise (GPT-2) by the closed form; gated (SwiGLU) by the per-neuron integrated
  gradients along t (a, b): part k gets a_k b I1(a) + b_k I2(a) (Gauss-Legendre,
  :func:`ff_coefficients`; the completeness error is the quadrature error, reported).
then the final norm (real scale) and the LM-head row of the target token
(:func:`logit_scores`; adjoint: :func:`adjoint_next_token_scores` with :func:`frozen_pre_ln_layer`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from captum_normattr.decompose.primitives.chunking import rows_for_budget
from captum_normattr.decompose.primitives.feed_forward import ig_closed_form
from captum_normattr.decompose.primitives.gated_feed_forward import DEFAULT_NODES, gate_integrals, local_autograd
from captum_normattr.decompose.primitives.guards import rebuild_norm
from captum_normattr.decompose.primitives.layer_norm import apply_norm_to_parts, norm_bias_part, norm_scale
from captum_normattr.decompose.records import LayerTensors, NormParams

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


def _value_bias_weights(
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


def post_ln_layer_parts(
    parts: Tensor,
    bias: Tensor,
    layer: LayerTensors,
    value_weight: Tensor,
    value_bias: Optional[Tensor],
    bias_mode: str = "separate",
    rows: Optional[Tensor] = None,
    memory_budget_mb: float = 256.0,
) -> Tuple[Tensor, Tensor]:
    r"""Map parts of a post-LN layer's input to parts of its output.

    Args:
        parts: (B, T, K, D) parts of the layer input, entry [b, j, k] = x_{j<-k}.
        bias: (B, T, D) the bias part of the layer input.
        layer: the layer's real tensors (probabilities, norm inputs, FF parameters).
        value_weight: (D, H * Dh) W_V as a right-multiplied matrix (heads concatenated).
        value_bias: (H * Dh,) b_V or None.
        bias_mode: one of :data:`BIAS_MODES`.
        rows: (R,) long, the output rows to produce (default: all T). Rows never mix
            after the attention, so the last layer can stop at the explained row.
        memory_budget_mb: bound on the temporary tensors (chunking over K, then over rows).

    Returns:
        (parts (B, R, K, D), bias part (B, R, D)): summing over K plus the bias part gives
        the real layer output at ``rows``.
    """
    check_bias_mode(bias_mode)
    spread = bias_mode in SPREAD_MODES
    per_key = bias_mode == "spread_per_key"
    b, t, k, d = parts.shape
    dev, dtype = parts.device, parts.dtype
    rows = torch.arange(t, device=dev) if rows is None else rows.to(dev)
    r = rows.shape[0]
    h = layer.num_heads
    hd = value_weight.shape[1]
    f = layer.ff
    ff_dim = f.w_in.shape[1]
    # the one chunk rule: 3 temporaries (B, T, chunk, width) per attention chunk of source tokens, per FF chunk of rows
    k_chunk = rows_for_budget(b, t, max(d, hd), parts.element_size(), memory_budget_mb, temporaries=3)
    r_chunk = min(r, rows_for_budget(b, t, ff_dim, parts.element_size(), memory_budget_mb, temporaries=3))
    probs = layer.probs[:, :, rows]  # (B, H, R, T)
    w_o = layer.out_weight
    zeros_d = torch.zeros(d, dtype=dtype, device=dev)
    b_o = layer.out_bias if layer.out_bias is not None else zeros_d
    b_v = value_bias if value_bias is not None else torch.zeros(hd, dtype=dtype, device=dev)

    # --- attention: values, mixed over keys per head, then W_O ---------------------
    v_bias = bias @ value_weight + b_v  # (B, T, HDh)
    v_weights = _value_bias_weights(parts, v_bias, value_weight, bias_mode, layer.index)
    a = parts.new_empty(b, r, k, d)
    for start in range(0, k, k_chunk):
        kc = slice(start, min(k, start + k_chunk))
        v = parts[:, :, kc] @ value_weight  # (B, T, kc, HDh)
        if v_weights is not None:
            v = v + v_weights[:, :, kc, None] * v_bias[:, :, None, :]
        v = v.view(b, t, v.shape[2], h, hd // h)
        mixed = torch.einsum("bhij,bjkhe->bikhe", probs, v).reshape(b, r, v.shape[2], hd)
        a[:, :, kc] = mixed @ w_o
        del v, mixed
    if per_key:
        a_bias = torch.zeros(b, r, d, dtype=dtype, device=dev)
        a, _ = absorb_bias(a, b_o.expand(b, r, d), rows)
    else:  # "separate", and "spread" (which spreads it after the residual, below)
        v_mix = v_bias if v_weights is None else torch.zeros_like(v_bias)
        mixed_b = torch.einsum("bhij,bjhe->bihe", probs, v_mix.view(b, t, h, hd // h)).reshape(b, r, hd)
        a_bias = mixed_b @ w_o + b_o

    # --- residual and LN1 ----------------------------------------------------------
    a += parts[:, rows]
    a_bias = a_bias + bias[:, rows]
    if bias_mode == "spread":  # the official rule: W_O b_V + b_O over the attention-plus-residual parts
        a, a_bias = absorb_bias(a, a_bias, rows)
    ln1_in = layer.ln1_in[:, rows]
    zt = apply_norm_to_parts(a, ln1_in, layer.ln1)
    del a
    zt_b = norm_bias_part(a_bias, ln1_in, layer.ln1)
    if spread:
        zt, zt_b = absorb_bias(zt, zt_b, rows)

    # --- feed-forward (closed form at the real pre-activation), residual, LN2 -------
    w1, b1, w2, b2, act = f.w_in, f.b_in, f.w_out, f.b_out, f.act
    real_pre = layer.ln1_out[:, rows] @ w1
    if b1 is not None:
        real_pre = real_pre + b1
    g0 = act(torch.zeros((), dtype=dtype, device=dev))
    res = torch.empty_like(zt)
    res_b = torch.empty_like(zt_b)
    for start in range(0, r, r_chunk):
        rc = slice(start, min(r, start + r_chunk))
        z_c, zb_c = zt[:, rc], zt_b[:, rc]
        pre = z_c @ w1  # (B, rc, K, F)
        pre_b = zb_c @ w1 + (b1 if b1 is not None else 0.0)
        if spread:  # <zt_k W1, pb> = <zt_k, pb W1^T>
            w = spread_weights(torch.einsum("brkd,brd->brk", z_c, pre_b @ w1.T), rows[rc])
            pre = pre + w.unsqueeze(-1) * pre_b.unsqueeze(2)
            pre_b = torch.zeros_like(pre_b)
        ig = ig_closed_form(pre, real_pre[:, rc], act)
        del pre
        ig_b = ig_closed_form(pre_b.unsqueeze(-2), real_pre[:, rc], act).squeeze(-2)
        ff = ig @ w2
        del ig
        ff_b = (ig_b + g0) @ w2
        if b2 is not None:
            ff_b = ff_b + b2
        if spread:
            ff, ff_b = absorb_bias(ff, ff_b, rows[rc])
        res[:, rc] = z_c + ff
        res_b[:, rc] = zb_c + ff_b
        del ff
    del zt
    ln2_in = layer.ln2_in[:, rows]
    y = apply_norm_to_parts(res, ln2_in, layer.ln2)
    del res
    y_b = norm_bias_part(res_b, ln2_in, layer.ln2)
    if spread:
        y, y_b = absorb_bias(y, y_b, rows)
    return y, y_b


def ff_coefficients(
    layer: LayerTensors, nodes: int = DEFAULT_NODES, preactivations: Optional[Tuple[Tensor, Tensor]] = None
) -> Dict[str, Tensor]:
    r"""The frozen per-neuron FF coefficients of one layer, at the REAL FF input.

    The FF input is LN1's output for a post-LN layer and LN2's output for a pre-LN one.
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
            return {"slope": _slopes(pre, f.act)}
        a = u @ f.w_gate
        if f.b_gate is not None:
            a += f.b_gate
    if f.hidden_scale is not None:  # experts: b = r (u W_up), r the frozen routing weight of the neuron's expert
        pre = pre * f.hidden_scale
    i1, i2 = gate_integrals(a, f.act, nodes)
    # |b (a I1 + I2) - b g(a)| = |b| |a I1 + I2 - g(a)|, in place
    err = torch.mul(a, i1).add_(i2).sub_(f.act(a)).mul_(pre).abs_().amax(-1)
    up = i2 if f.hidden_scale is None else i2.mul_(f.hidden_scale)  # part k of b is r b_k
    return {"gate": i1.mul_(pre), "up": up, "quadrature_error": err}


def _value_heads(v: Tensor, kv_heads: int, groups: int) -> Tensor:
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
    the attention biases are spread as :func:`pre_ln_layer_parts` says.

    Args:
        parts, bias, layer, value_weight, value_bias, bias_mode, rows, memory_budget_mb: as in
            :func:`pre_ln_layer_parts`.

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
    # the one chunk rule (as in post_ln_layer_parts)
    k_chunk = rows_for_budget(b, t, max(d, hd), parts.element_size(), memory_budget_mb, temporaries=3)
    probs = layer.probs[:, :, rows]  # (B, H, R, T)
    b_o = layer.out_bias if layer.out_bias is not None else torch.zeros(d, dtype=dtype, device=dev)

    # --- LN1 (one token alone), values, mixing per head, W_O --------------------------
    u = apply_norm_to_parts(parts, layer.ln1_in, layer.ln1)
    u_b = norm_bias_part(bias, layer.ln1_in, layer.ln1)
    if spread:
        u, u_b = absorb_bias(u, u_b, all_rows)
    v_b = u_b @ value_weight + (value_bias if value_bias is not None else 0.0)  # (B, T, H_kv Dh)
    if not torch.is_tensor(v_b):
        v_b = u.new_zeros(b, t, value_weight.shape[1])
    v_weights = _value_bias_weights(u, v_b, value_weight, bias_mode, layer.index)
    a = parts.new_empty(b, r, k, d)
    for start in range(0, k, k_chunk):
        kc = slice(start, min(k, start + k_chunk))
        v = u[:, :, kc] @ value_weight
        if v_weights is not None:
            v = v + v_weights[:, :, kc, None] * v_b[:, :, None, :]
        v = _value_heads(v, kv_heads, groups)  # (B, T, kc, H, Dh)
        mixed = torch.einsum("bhij,bjkhe->bikhe", probs, v).reshape(b, r, v.shape[2], hd)
        a[:, :, kc] = mixed @ layer.out_weight
        del v, mixed
    del u
    if bias_mode == "spread_per_key":
        a, a_b = absorb_bias(a, b_o.expand(b, r, d), rows)
    else:  # "separate", and "spread" (which spreads it after the residual, below)
        v_mix = v_b if v_weights is None else torch.zeros_like(v_b)
        mixed_b = torch.einsum("bhij,bjhe->bihe", probs, _value_heads(v_mix, kv_heads, groups)).reshape(b, r, hd)
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


def pre_ln_layer_parts(
    parts: Tensor,
    bias: Tensor,
    layer: LayerTensors,
    value_weight: Tensor,
    value_bias: Optional[Tensor],
    bias_mode: str = "separate",
    rows: Optional[Tensor] = None,
    memory_budget_mb: float = 256.0,
    coefs: Optional[Dict[str, Tensor]] = None,
) -> Tuple[Tensor, Tensor]:
    r"""Map parts of a pre-LN layer's input to parts of its output (GPT-2, Llama, Mistral, Qwen2).

    h_{i<-k} = x_{i<-k} + sum_h (sum_j alpha^h_ij LN1(x)_{j<-k} W_V^h) W_O^h   (bias part + b_V mixed, + b_O)
    out_{i<-k} = h_{i<-k} + FF_{i<-k}(LN2(h)_{i<-k})                          (no norm after the residual)

    LN1/LN2 use the real per-token scale (RMSNorm: no centering, no beta); grouped-query
    values are repeated per query head; rotary embeddings never touch values. The FF is
    linear in its input parts through :func:`ff_coefficients` (closed form for GPT-2's
    elementwise activation, Gauss-Legendre integrals for a gated FF). The two halves are
    :func:`attention_block_parts` and :func:`ff_branch_parts`.

    Args:
        parts, bias, layer, bias_mode, rows, memory_budget_mb: as in :func:`post_ln_layer_parts`.
        value_weight: (D, H_kv * Dh) W_V; value_bias: (H_kv * Dh,) or None.
        coefs: :func:`ff_coefficients` of this layer (computed if None).

    Returns:
        (parts (B, R, K, D), bias part (B, R, D)) of the layer output at ``rows``.
    """
    return two_branch_layer_parts(parts, bias, layer, value_weight, value_bias, bias_mode, rows, memory_budget_mb,
                                  coefs, ff_reads_block=True)


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
            as in :func:`pre_ln_layer_parts`.
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


#: One step function per layer kind.
#: The parts step of each topology: ``step(parts, bias, layer, value_weight, value_bias, bias_mode, rows=,
#: memory_budget_mb=[, coefs=])`` -> (parts, bias); a kind module adds its own (:func:`register_decompx_steps`).
LAYER_STEPS: Dict[str, Callable[..., Tuple[Tensor, Tensor]]] = {"post_ln": post_ln_layer_parts, "pre_ln": pre_ln_layer_parts}
#: The topologies whose parts step takes the FF coefficients (``coefs=``).
STEPS_WITH_COEFS = {"pre_ln"}
#: The frozen layer of each topology: ``frozen(x, layer, value_weight, value_bias, with_bias, coefs, rows)``.
FROZEN_LAYERS: Dict[str, Callable[..., Tensor]] = {}
#: The transpose of each frozen layer's linear part: ``vjp(g, layer, value_weight, coefs, rows, valid)``.
FROZEN_VJPS: Dict[str, Callable[..., Tensor]] = {}


def register_decompx_steps(topology: str, step: Callable[..., Tuple[Tensor, Tensor]], frozen: Callable[..., Tensor],
                           vjp: Callable[..., Tensor], with_coefs: bool = True) -> None:
    r"""Register DecompX's three steps of a topology (a layer kind module calls it once).

    Args:
        topology: one of :data:`captum_normattr.arch.spec.TOPOLOGIES`.
        step: the forward algorithm's parts step (see :data:`LAYER_STEPS`).
        frozen: the frozen layer (see :func:`frozen_layer`).
        vjp: its transpose (see :class:`FrozenLayer`).
        with_coefs: ``step`` takes the FF coefficients.
    """
    LAYER_STEPS[topology], FROZEN_LAYERS[topology], FROZEN_VJPS[topology] = step, frozen, vjp
    if with_coefs:
        STEPS_WITH_COEFS.add(topology)
    else:
        STEPS_WITH_COEFS.discard(topology)


#: ``form(layer, coefs) -> (pre-LN record, its FF coefficients)`` (see :func:`register_form_steps`).
PreLNForm = Callable[[LayerTensors, Dict[str, Tensor]], Tuple[LayerTensors, Dict[str, Tensor]]]


def register_form_steps(
    topology: str, form: PreLNForm
) -> Tuple[Callable[..., Tuple[Tensor, Tensor]], Callable[..., Tensor], Callable[..., Tensor]]:
    r"""Register DecompX's steps of a topology whose frozen layer is the frozen pre-LN layer of ``form``.

    Each step is the pre-LN one (:func:`pre_ln_layer_parts`, :func:`frozen_pre_ln_layer`,
    :func:`frozen_pre_ln_layer_vjp`) on ``form(layer, coefs)``; the parts step computes the
    coefficients of the real layer (:func:`ff_coefficients`) when none are given.

    Args:
        topology: one of :data:`captum_normattr.arch.spec.TOPOLOGIES`.
        form: the pre-LN record and FF coefficients whose frozen pre-LN layer is the
            topology's frozen layer (exactly, linear maps folded into the weights).

    Returns:
        (step, frozen, vjp), as registered (:func:`register_decompx_steps`).
    """

    def step(parts: Tensor, bias: Tensor, layer: LayerTensors, value_weight: Tensor, value_bias: Optional[Tensor],
             bias_mode: str = "separate", rows: Optional[Tensor] = None, memory_budget_mb: float = 256.0,
             coefs: Optional[Dict[str, Tensor]] = None) -> Tuple[Tensor, Tensor]:
        view, scaled = form(layer, ff_coefficients(layer) if coefs is None else coefs)
        return pre_ln_layer_parts(parts, bias, view, value_weight, value_bias, bias_mode, rows, memory_budget_mb,
                                  scaled)

    def frozen(x: Tensor, layer: LayerTensors, value_weight: Tensor, value_bias: Optional[Tensor], with_bias: bool,
               coefs: Dict[str, Tensor], rows: Optional[Tensor] = None) -> Tensor:
        view, scaled = form(layer, coefs)
        return frozen_pre_ln_layer(x, view, value_weight, value_bias, with_bias, scaled, rows)

    def vjp(g: Tensor, layer: LayerTensors, value_weight: Tensor, coefs: Dict[str, Tensor],
            rows: Optional[Tensor] = None, valid: Optional[Tensor] = None) -> Tensor:
        view, scaled = form(layer, coefs)
        return frozen_pre_ln_layer_vjp(g, view, value_weight, scaled, rows, valid)

    step.__doc__ = f"DecompX's parts step of a {topology} layer: :func:`pre_ln_layer_parts` on its pre-LN form."
    frozen.__doc__ = f"The frozen {topology} layer: :func:`frozen_pre_ln_layer` on its pre-LN form."
    vjp.__doc__ = (f"The transpose of the frozen {topology} layer's linear part: :func:`frozen_pre_ln_layer_vjp` "
                   "on its pre-LN form.")
    register_decompx_steps(topology, step, frozen, vjp)
    return step, frozen, vjp


def _steps(table: Dict[str, Callable], layer: LayerTensors) -> Callable:
    try:
        return table[layer.topology]
    except KeyError:
        raise NotImplementedError(f"DecompX has no steps for {layer.topology} layers; implemented: {sorted(table)}") from None


@dataclass
class PropagatedParts:
    r"""What :func:`propagate_parts` returns.

    Attributes:
        parts: (B, R, T, D) parts of the last layer's output at the rows kept.
        bias: (B, R, D) its bias part.
        rows: (R,) long, the rows of the last layer that were produced.
        layer_part_norms: (B, L, T, T): entry [b, l, i, k] = |x^{(l)}_{i<-k}|, the norm of
            source token k's part of layer l's output at token i. Pad rows/columns are 0;
            rows of the last layer that were not produced are 0.
        layer_bias_norms: (B, L, T): the norm of the bias part (0 in ``"spread"`` mode).
        layer_errors: (B, L): max |sum of parts + bias part - real layer output| over the
            produced real rows.
    """

    parts: Tensor
    bias: Tensor
    rows: Tensor
    layer_part_norms: Tensor
    layer_bias_norms: Tensor
    layer_errors: Tensor


class PartsPropagation:
    r"""The forward algorithm streamed: the parts carried one layer at a time.

    Feed :meth:`step` every layer in order, as the recorded forward pass produces it
    (:func:`~captum_normattr.attr.base.streamed_forward`); only the current parts, a
    (B, T, T, D) tensor, and the small per-layer results (part norms (B, T, T), bias norms,
    errors) are kept, so that memory does not grow with depth beyond those.

    Args:
        num_layers: L.
        valid: (B, T) bool, real tokens.
        bias_mode: one of :data:`BIAS_MODES`.
        last_rows: (R,) long rows to produce in the last layer (default: all).
        memory_budget_mb: bound on the temporary tensors of one layer step.
    """

    def __init__(
        self,
        num_layers: int,
        valid: Tensor,
        bias_mode: str = "separate",
        last_rows: Optional[Tensor] = None,
        memory_budget_mb: float = 256.0,
    ) -> None:
        check_bias_mode(bias_mode)
        self.num_layers = num_layers
        self.valid = valid
        self.bias_mode = bias_mode
        self.last_rows = last_rows
        self.memory_budget_mb = memory_budget_mb
        self.done = 0
        self.parts: Optional[Tensor] = None
        self.bias: Optional[Tensor] = None
        self.rows: Optional[Tensor] = None
        self.norms: Optional[Tensor] = None
        self.bias_norms: Optional[Tensor] = None
        self.errors: Optional[Tensor] = None

    def step(
        self,
        layer: LayerTensors,
        value_weight: Tensor,
        value_bias: Optional[Tensor],
        coefs: Optional[Dict[str, Tensor]] = None,
    ) -> None:
        r"""Carry the parts through the next layer.

        Args:
            layer: the layer's real tensors (layer ``self.done`` of the stack).
            value_weight, value_bias: its W_V (D, H*Dh) and b_V (or None).
            coefs: a pre-LN layer's :func:`ff_coefficients` (computed with the default
                number of quadrature nodes if None); ignored for post-LN layers.
        """
        l, n = self.done, self.num_layers
        if l >= n:
            raise RuntimeError(f"all {n} layers have been propagated already")
        if l == 0:
            x = layer.hidden_in
            b, t, _ = x.shape
            self.parts, self.bias = initial_parts(x)
            self.norms = x.new_zeros(b, n, t, t)
            self.bias_norms = x.new_zeros(b, n, t)
            self.errors = x.new_zeros(b, n)
        b, t = self.parts.shape[:2]
        dev = self.parts.device
        step = _steps(LAYER_STEPS, layer)
        rows = torch.arange(t, device=dev) if (l < n - 1 or self.last_rows is None) else self.last_rows.to(dev)
        extra = {"coefs": coefs} if layer.topology in STEPS_WITH_COEFS else {}
        parts, bias = step(
            self.parts, self.bias, layer, value_weight, value_bias, self.bias_mode, rows=rows,
            memory_budget_mb=self.memory_budget_mb, **extra,
        )
        self.parts = self.bias = None  # release the input parts before the bookkeeping below
        vf = self.valid.to(parts.dtype)
        row_valid = vf[:, rows]
        self.norms[:, l, rows] = parts.norm(dim=-1) * row_valid.unsqueeze(-1) * vf.unsqueeze(1)
        self.bias_norms[:, l, rows] = bias.norm(dim=-1) * row_valid
        err = (parts.sum(2) + bias - layer.layer_out[:, rows]).abs().amax(-1)
        self.errors[:, l] = (err * row_valid).amax(-1)
        self.parts, self.bias, self.rows = parts, bias, rows
        self.done = l + 1

    def result(self) -> PropagatedParts:
        r"""The :class:`PropagatedParts` once every layer has been stepped through."""
        if self.done != self.num_layers:
            raise RuntimeError(f"{self.done} of {self.num_layers} layers were propagated")
        return PropagatedParts(self.parts, self.bias, self.rows, self.norms, self.bias_norms, self.errors)


def propagate_parts(
    layers: Sequence[LayerTensors],
    value_params: Sequence[Tuple[Tensor, Optional[Tensor]]],
    valid: Tensor,
    bias_mode: str = "separate",
    last_rows: Optional[Tensor] = None,
    memory_budget_mb: float = 256.0,
    ff_coefs: Optional[Sequence[Dict[str, Tensor]]] = None,
) -> PropagatedParts:
    r"""Carry per-input-token parts through every layer of a list (:class:`PartsPropagation` on each).

    Args:
        layers: the captured layers (their ``hidden_in`` of layer 0 is the embedding output).
        value_params: per layer (W_V (D, H*Dh), b_V (H*Dh,) or None).
        valid: (B, T) bool, real tokens.
        bias_mode: one of :data:`BIAS_MODES`.
        last_rows: (R,) long rows to produce in the last layer (default: all).
        memory_budget_mb: bound on the temporary tensors of one layer step.
        ff_coefs: per pre-LN layer its :func:`ff_coefficients` (computed with the default
            number of quadrature nodes if None); ignored for post-LN layers.

    Returns:
        :class:`PropagatedParts`.
    """
    if len(layers) != len(value_params):
        raise ValueError("one (W_V, b_V) per layer is needed")
    prop = PartsPropagation(len(layers), valid, bias_mode, last_rows, memory_budget_mb)
    for l, (layer, (w_v, b_v)) in enumerate(zip(layers, value_params)):
        prop.step(layer, w_v, b_v, None if ff_coefs is None else ff_coefs[l])
    return prop.result()


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


# --------------------------------------------------------------------------------------
# The adjoint algorithm ("separate" bias mode): with every nonlinear quantity frozen at its
# real value the network is affine in the embedding output, F(X) = sum_k L_k e_k + c, and
# token k's DecompX score of class c is the contribution L_k e_k = <dF_c/dx_k, e_k>. One
# vector-Jacobian product per explained class gives every token's score; the bias score is
# the constant F(0) = c (= F(e) - sum_k scores).
#
# Streamed (:class:`AdjointPass`): the forward phase keeps each layer's input (B, T, D) as a
# checkpoint, nothing else; the backward phase walks the layers top-down, recomputes each
# layer's tensors from its checkpoint, pushes the cotangents through that one frozen layer
# by its written-out transpose (:meth:`FrozenLayer.vjp`) and adds <cotangent, c_l> of the
# layer's constant c_l to c. The frozen layer is affine, so its transpose does not depend
# on any point; no layer's attention probabilities outlive its own step.
# --------------------------------------------------------------------------------------
def _slopes(real_pre: Tensor, act: Callable) -> Tensor:
    r"""(g(p) - g(0)) / p at the real pre-activation (g'(0) where p ~ 0), via ig_closed_form."""
    return ig_closed_form(torch.ones_like(real_pre).unsqueeze(-2), real_pre, act).squeeze(-2)


def head_slope(real_input: Tensor, head: "object") -> Tensor:
    r"""The frozen activation slope (B, D2) of a classification head at its real input.

    Args:
        real_input: (B, D) the last layer's real output at the head's token.
        head: a :class:`~captum_normattr.models.heads.HeadParams`.
    """
    if getattr(head, "pre_norm", None) is not None:
        return _slopes(head_real_tensors(real_input, head)[1], head.act)
    u = real_input @ head.w_dense
    if head.b_dense is not None:
        u = u + head.b_dense
    return _slopes(u, head.act)


def frozen_post_ln_layer(
    x: Tensor,
    layer: LayerTensors,
    value_weight: Tensor,
    value_bias: Optional[Tensor],
    with_bias: bool,
    ff_slope: Tensor,
    rows: Optional[Tensor] = None,
) -> Tensor:
    r"""A post-LN layer with its nonlinear quantities frozen at the real values.

    Linear in ``x`` when ``with_bias`` is False (the map of :func:`post_ln_layer_parts`
    applied to one part); with ``with_bias`` and the real input it reproduces the real output.

    Args:
        x: (B, T, D).
        layer: the layer's real tensors.
        value_weight, value_bias: W_V (D, H*Dh) and b_V.
        with_bias: add every bias (b_V, b_O, beta1, b1, g(0) W2 + b2, beta2).
        ff_slope: (B, T, F), the ``"slope"`` of :func:`ff_coefficients`.
        rows: (R,) output rows to produce (default all).

    Returns:
        (B, R, D).
    """
    b, t, _ = x.shape
    h = layer.num_heads
    hd = value_weight.shape[1]
    probs = layer.probs if rows is None else layer.probs[:, :, rows]
    sel = (lambda u: u) if rows is None else (lambda u: u[:, rows])
    v = x @ value_weight
    if with_bias and value_bias is not None:
        v = v + value_bias
    mixed = torch.einsum("bhij,bjhe->bihe", probs, v.view(b, t, h, hd // h))
    a = mixed.reshape(mixed.shape[0], mixed.shape[1], hd) @ layer.out_weight
    if with_bias and layer.out_bias is not None:
        a = a + layer.out_bias

    def norm(u: Tensor, real: Tensor, params) -> Tensor:
        return norm_bias_part(u, real, params) if with_bias else apply_norm_to_parts(u, real, params)

    zt = norm(a + sel(x), sel(layer.ln1_in), layer.ln1)
    f = layer.ff
    w1, b1, w2, b2, act = f.w_in, f.b_in, f.w_out, f.b_out, f.act
    p = zt @ w1
    if with_bias and b1 is not None:
        p = p + b1
    ff = (p * sel(ff_slope)) @ w2
    if with_bias:
        ff = ff + act(torch.zeros((), dtype=x.dtype, device=x.device)) * w2.sum(0)
        if b2 is not None:
            ff = ff + b2
    return norm(zt + ff, sel(layer.ln2_in), layer.ln2)


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


def frozen_layer(
    x: Tensor,
    layer: LayerTensors,
    value_weight: Tensor,
    value_bias: Optional[Tensor],
    with_bias: bool,
    coefs: Dict[str, Tensor],
    rows: Optional[Tensor] = None,
) -> Tensor:
    r"""One frozen layer, by its topology (:data:`FROZEN_LAYERS`: :func:`frozen_pre_ln_layer`, :func:`frozen_post_ln_layer`, ...).

    ``coefs`` are the layer's :func:`ff_coefficients` (a post-LN layer uses its ``"slope"``).
    """
    return _steps(FROZEN_LAYERS, layer)(x, layer, value_weight, value_bias, with_bias, coefs, rows)


def _norm_transpose(w: Tensor, real: Tensor, params: NormParams) -> Tensor:
    r"""The transpose of a norm's frozen linear map x -> gamma c(x) / s(real) applied to ``w`` (..., D).

    The centering c (LayerNorm) is a symmetric projection, so the transpose is
    c(gamma w / s); RMSNorm: gamma w / s.
    """
    scale = norm_scale(real, params).unsqueeze(-1)
    out = w * params.weight.to(w.dtype) if params.weight is not None else w
    out = out / scale
    return out if params.kind != "layernorm" else out - out.mean(-1, keepdim=True)


#: Query blocks of the causal transpose in :func:`_mix_transpose` (the blocks above the diagonal are skipped).
CAUSAL_BLOCKS = 8


def _mix_transpose(g_mixed: Tensor, probs: Tensor, kv_heads: int, causal: bool = False) -> Tensor:
    r"""The transpose of the frozen attention mixing: (..., B, R, H, Dh) -> (..., B, T, H_kv * Dh).

    mixed_i^h = sum_j alpha^h_ij v_j^{h // groups}: the value cotangent of key j is
    sum_i alpha^h_ij g_i^h, summed over the query heads that share a key/value head.
    ``causal`` (all T rows, and alpha_ij = 0 for j > i wherever g_i is not 0): query block
    [i0, i1) reaches keys j < i1 only, so most of the all-zero triangle is skipped.
    Leading stack dimensions (several cotangents of the same layer) are folded into the
    free last dimension, (B, R, H, n Dh), so that one product with the probabilities serves all.
    """
    lead = g_mixed.shape[:-4]
    b, r, h, dh = g_mixed.shape[-4:]
    n = 1
    for k in lead:
        n *= k
    if lead:  # (n, B, R, H, Dh) -> (B, R, H, n Dh)
        g_mixed = g_mixed.reshape(n, b, r, h, dh).permute(1, 2, 3, 0, 4).reshape(b, r, h, n * dh)
    e = n * dh
    t = probs.shape[-1]
    if causal and r == t and t >= 2 * CAUSAL_BLOCKS:
        gh = g_mixed.permute(0, 2, 1, 3)  # (B, H, T, n Dh)
        g_v = g_mixed.new_zeros(b, h, t, e)
        size = -(-t // CAUSAL_BLOCKS)
        for i0 in range(0, t, size):
            i1 = min(t, i0 + size)
            g_v[:, :, :i1] += probs[:, :, i0:i1, :i1].transpose(-1, -2) @ gh[:, :, i0:i1]
        g_v = g_v.permute(0, 2, 1, 3)  # (B, T, H, n Dh)
    else:
        g_v = torch.einsum("bhij,bihe->bjhe", probs, g_mixed)  # (B, T, H, n Dh)
    if kv_heads != h:
        g_v = g_v.reshape(b, t, kv_heads, h // kv_heads, e).sum(3)
    if not lead:
        return g_v.reshape(b, t, kv_heads * dh)
    g_v = g_v.reshape(b, t, kv_heads, n, dh).permute(3, 0, 1, 2, 4)  # (n, B, T, H_kv, Dh)
    return g_v.reshape(*lead, b, t, kv_heads * dh)


def _scatter_rows(g_rows: Tensor, t: int, rows: Optional[Tensor]) -> Tensor:
    r"""(..., B, R, D) at ``rows`` into a zero (..., B, T, D) (itself when ``rows`` is None)."""
    if rows is None:
        return g_rows
    out = g_rows.new_zeros(*g_rows.shape[:-2], t, g_rows.shape[-1])
    out[..., rows, :] = g_rows
    return out


def _causal_rows(layer: LayerTensors, g_rows: Tensor, rows: Optional[Tensor], valid: Optional[Tensor]) -> bool:
    r"""Whether alpha_ij = 0 for j > i at every row i where ``g_rows`` (..., B, T, D) is not 0.

    True for a causal layer (all rows) when the cotangent vanishes at the pad rows: a fully
    masked pad query row attends uniformly to every key, later ones included.
    """
    if not layer.causal or rows is not None or valid is None:
        return False
    pads = ~valid.to(device=g_rows.device, dtype=torch.bool)
    if not bool(pads.any()):
        return True
    stacked = g_rows.reshape(-1, *g_rows.shape[-3:])  # (n, B, T, D)
    return not bool(stacked[:, pads].any())


def _gated_ff_transpose(g_ig: Tensor, coefs: Dict[str, Tensor], sel: Callable[[Tensor], Tensor], f: "object") -> Tensor:
    r"""The transpose of ig = (z W_gate) * gate + (z W_up) * up at ``g_ig`` (..., B, R, F): (..., B, R, D)."""
    width = g_ig.shape[-1]
    br = g_ig.shape[-3] * g_ig.shape[-2]
    flat = g_ig.reshape(-1, br, width)  # (n, B R, F)
    gate = sel(coefs["gate"]).reshape(br, width)
    up = sel(coefs["up"]).reshape(br, width)
    g_z = torch.mm((flat * gate).view(-1, width), f.w_gate.T)
    g_z.addmm_(flat.mul_(up).view(-1, width), f.w_in.T)
    return g_z.view(*g_ig.shape[:-1], f.w_gate.shape[0])


def frozen_pre_ln_layer_vjp(
    g: Tensor,
    layer: LayerTensors,
    value_weight: Tensor,
    coefs: Dict[str, Tensor],
    rows: Optional[Tensor] = None,
    valid: Optional[Tensor] = None,
) -> Tensor:
    r"""The transpose of :func:`frozen_pre_ln_layer`'s linear part (``with_bias=False``): J^T g.

    Written out instead of taken by autograd, so that no forward pass of the frozen layer
    (and no graph) is needed; ``tests/test_decompx_speed.py`` checks it against
    ``torch.autograd`` in float64. The map is linear in ``g``: several cotangents stacked
    along leading dimensions go through in one call (the weight products broadcast, the
    attention mixing serves them all in one product; ``tests/test_decompx_multi.py``).

    Args:
        g: (B, R, D) cotangent of the layer output at ``rows`` (all T rows if None), or a
            stack (..., B, R, D) of such cotangents.
        layer, value_weight, coefs, rows: as in :func:`frozen_pre_ln_layer`.
        valid: (B, T) bool, the real tokens, or None. Given for a causal layer, the all-zero
            triangle of the attention is skipped when ``g`` is 0 at the pad rows (as in the
            adjoint pass, where no real row reads a pad row).

    Returns:
        (..., B, T, D) the cotangent of the layer input.
    """
    g_h = g + ff_branch_vjp(g, layer.ln2_in if rows is None else layer.ln2_in[:, rows], layer, coefs, rows)
    return attention_block_vjp(g_h, layer, value_weight, rows, valid)  # residual + LN2 and the FF, then the block


def ff_branch_vjp(
    g: Tensor, real_in: Tensor, layer: LayerTensors, coefs: Dict[str, Tensor], rows: Optional[Tensor] = None
) -> Tensor:
    r"""The transpose of the frozen z -> FF(N2(z)) (no biases; :func:`frozen_ff_branch`) at ``g``.

    Args:
        g: (..., B, R, D) cotangent of the FF output at ``rows`` (all T rows if None).
        real_in: (B, R, D) the second norm's real input at ``rows``.
        layer: the layer's tensors (``ln2``, ``ff``); coefs: its :func:`ff_coefficients`.
        rows: (R,) long or None.

    Returns:
        (..., B, R, D) the cotangent of the norm input z at ``rows``.
    """
    sel = (lambda z: z) if rows is None else (lambda z: z[:, rows])
    f = layer.ff
    g_ig = g @ f.w_out.T  # (..., B, R, F)
    if f.w_gate is None:
        g_z = g_ig.mul_(sel(coefs["slope"])) @ f.w_in.T
    else:  # ig = (z W_gate) * gate + (z W_up) * up
        g_z = _gated_ff_transpose(g_ig, coefs, sel, f)
    del g_ig
    return _norm_transpose(g_z, real_in, layer.ln2)


def attention_block_vjp(
    g_h: Tensor, layer: LayerTensors, value_weight: Tensor, rows: Optional[Tensor] = None, valid: Optional[Tensor] = None
) -> Tensor:
    r"""The transpose of the frozen x -> x + Attn(N1(x)) (no biases; :func:`frozen_attention_block`) at ``g_h``.

    Args:
        g_h: (..., B, R, D) cotangent of x + Attn(N1(x)) at ``rows`` (all T rows if None).
        layer, value_weight, rows, valid: as in :func:`frozen_pre_ln_layer_vjp`.

    Returns:
        (..., B, T, D) the cotangent of the layer input x.
    """
    t = layer.hidden_in.shape[1]
    h = layer.num_heads
    hd = layer.out_weight.shape[0]
    kv_heads = value_weight.shape[1] // (hd // h)
    probs = layer.probs if rows is None else layer.probs[:, :, rows]
    g_mixed = (g_h @ layer.out_weight.T).view(*g_h.shape[:-1], h, hd // h)
    g_u = _mix_transpose(g_mixed, probs, kv_heads, _causal_rows(layer, g_h, rows, valid)) @ value_weight.T
    return _norm_transpose(g_u, layer.ln1_in, layer.ln1).add_(_scatter_rows(g_h, t, rows))


def frozen_post_ln_layer_vjp(
    g: Tensor, layer: LayerTensors, value_weight: Tensor, ff_slope: Tensor, rows: Optional[Tensor] = None
) -> Tensor:
    r"""The transpose of :func:`frozen_post_ln_layer`'s linear part (``with_bias=False``): J^T g.

    Args:
        g: (B, R, D) cotangent of the layer output at ``rows`` (all T rows if None), or a
            stack (..., B, R, D) of such cotangents (one call for all, as in
            :func:`frozen_pre_ln_layer_vjp`).
        layer, value_weight, ff_slope, rows: as in :func:`frozen_post_ln_layer`.

    Returns:
        (..., B, T, D) the cotangent of the layer input.
    """
    t = layer.hidden_in.shape[1]
    h = layer.num_heads
    hd = value_weight.shape[1]
    sel = (lambda z: z) if rows is None else (lambda z: z[:, rows])
    f = layer.ff
    g_r = _norm_transpose(g, sel(layer.ln2_in), layer.ln2)  # LN2 input: zt + FF(zt)
    g_zt = g_r + ((g_r @ f.w_out.T).mul_(sel(ff_slope))) @ f.w_in.T
    g_ax = _norm_transpose(g_zt, sel(layer.ln1_in), layer.ln1)  # LN1 input: attention + x
    probs = layer.probs if rows is None else layer.probs[:, :, rows]
    g_mixed = (g_ax @ layer.out_weight.T).view(*g_ax.shape[:-1], h, hd // h)
    return (_mix_transpose(g_mixed, probs, h) @ value_weight.T).add_(_scatter_rows(g_ax, t, rows))


def _is_zero(t: Optional[Tensor]) -> bool:
    return t is None or not bool(torch.any(t != 0))


class FrozenLayer:
    r"""One layer with its nonlinear quantities frozen at the real values: an affine map J x + c.

    Calling it applies the map with its biases (:func:`frozen_layer`, a :data:`FrozenStep`);
    :meth:`vjp` applies J^T (:func:`frozen_pre_ln_layer_vjp`, :func:`frozen_post_ln_layer_vjp`)
    and :meth:`constant` gives c (None when the layer adds no bias at all, e.g. Llama).
    It holds the layer's tensors while it lives.

    Args:
        layer: the layer's real tensors.
        value_weight, value_bias: its W_V and b_V.
        coefs: its :func:`ff_coefficients`.
        valid: (B, T) bool, the real tokens (lets :meth:`vjp` skip a causal layer's zero triangle), or None.
    """

    def __init__(
        self,
        layer: LayerTensors,
        value_weight: Tensor,
        value_bias: Optional[Tensor],
        coefs: Dict[str, Tensor],
        valid: Optional[Tensor] = None,
    ) -> None:
        self.layer, self.value_weight, self.value_bias, self.coefs = layer, value_weight, value_bias, coefs
        self.valid = valid

    def __call__(self, x: Tensor, rows: Optional[Tensor] = None) -> Tensor:
        return frozen_layer(x, self.layer, self.value_weight, self.value_bias, True, self.coefs, rows)

    def vjp(self, g: Tensor, rows: Optional[Tensor] = None) -> Tensor:
        r"""J^T g: (..., B, R, D) cotangent(s) at ``rows`` -> (..., B, T, D), a stack in one call."""
        return _steps(FROZEN_VJPS, self.layer)(g, self.layer, self.value_weight, self.coefs, rows, self.valid)

    def has_constant(self) -> bool:
        r"""Whether c can be nonzero: some bias, beta or (elementwise FF) g(0) W_out is present."""
        layer, f = self.layer, self.layer.ff
        tensors = [self.value_bias, layer.out_bias, layer.ln1.bias, layer.ln2.bias, f.b_in, f.b_out, f.b_gate]
        if not all(_is_zero(t) for t in tensors):
            return True
        if f.w_gate is None:  # the frozen elementwise FF maps 0 to g(0) W_out
            return not _is_zero(f.act(torch.zeros((), dtype=self.value_weight.dtype, device=self.value_weight.device)))
        return False

    def constant(self, rows: Optional[Tensor] = None) -> Optional[Tensor]:
        r"""c = the frozen layer applied to 0, (B, R, D); None when :meth:`has_constant` is False."""
        if not self.has_constant():
            return None
        return self(torch.zeros_like(self.layer.hidden_in), rows)


#: Bytes of the widest stacked intermediate, n x (B, T, max(D, F)) with F the feed-forward width, that
#: :meth:`AdjointPass.backward` lets one call of a layer's transpose hold; more outputs go in chunks.
STACK_BYTES = 256 * 2**20


def _stack_chunks(stacks: List[Tensor], step: FrozenLayer) -> List[Tensor]:
    r"""Stacked cotangents (k, B, R, D) regrouped (as views where they fit) into chunks small enough
    for ``step`` (:data:`STACK_BYTES`, the layer's widest intermediate (B, T, max(D, F)) per output)."""
    if not stacks:
        return stacks
    b, t = step.layer.hidden_in.shape[:2]
    width = max(int(step.layer.hidden_in.shape[2]), int(step.layer.ff.w_out.shape[0]))
    size = max(1, STACK_BYTES // max(1, b * t * width * stacks[0].element_size()))
    if all(st.shape[0] <= size for st in stacks):
        return stacks
    return list((torch.cat(stacks) if len(stacks) > 1 else stacks[0]).split(size))


#: A frozen layer with its biases, as a function of its input: (x (B, T, D), rows or None) -> (B, R, D).
FrozenStep = Callable[[Tensor, Optional[Tensor]], Tensor]


class AdjointPass:
    r"""The adjoint algorithm streamed over the layers (``"separate"`` bias mode).

    Forward phase: :meth:`forward` once per layer, in order, as the forward pass produces
    it: it keeps the layer input (B, T, D) as the layer's checkpoint. Nothing else is
    computed there (the layer itself is not kept, except the frozen last layer if it is
    handed over: it is the first one the backward phase needs).

    Backward phase: :meth:`backward` walks l = L-1, ..., 0. ``frozen_at(l, checkpoint_l)``
    recomputes layer l's :class:`FrozenLayer` (the attribution reruns the real layer on its
    checkpoint: :meth:`~captum_normattr.models.capture.recorder.Recorder.rerun_layer`), and the
    cotangents are pushed through it by its written-out transpose (:meth:`FrozenLayer.vjp`);
    the layer's tensors (its attention probabilities) are released before the next layer is
    recomputed. The frozen network is affine, F(x) = J x + c, and its constant
    <u, c> = sum_l <g_(l+1), c_l> + (the output's own constant) is accumulated on the way
    (c_l the constant of layer l, g_(l+1) the cotangent of its output), so that F(e) is
    never formed: the bias score is that constant, and F(e) = scores + bias score.
    Memory: L checkpoints (B, T, D) plus one layer's tensors.

    Args:
        num_layers: L.
        last_rows: (R,) long rows of the last layer that the explained output reads.
    """

    def __init__(self, num_layers: int, last_rows: Tensor) -> None:
        self.num_layers = num_layers
        self.last_rows = last_rows
        self.checkpoints: List[Optional[Tensor]] = []
        self.last_step: Optional[FrozenLayer] = None
        #: After :meth:`backward`: per explained output, its constant (B,) (the bias score).
        self.constants: List[Tensor] = []

    @property
    def embeddings(self) -> Tensor:
        r"""(B, T, D) e, the input of the first layer."""
        return self.checkpoints[0]

    def forward(self, layer_input: Tensor, last_step: Optional[FrozenLayer] = None) -> None:
        r"""Checkpoint the next layer's input.

        Args:
            layer_input: (B, T, D) its real input.
            last_step: the last layer only: its :class:`FrozenLayer`, kept for the backward
                phase instead of being recomputed (ignored for the other layers).
        """
        l = len(self.checkpoints)
        if l >= self.num_layers:
            raise RuntimeError(f"all {self.num_layers} layers have been seen already")
        self.checkpoints.append(layer_input.detach())
        if l == self.num_layers - 1:
            self.last_step = last_step

    def backward(
        self, frozen_at: Callable[[int, Tensor], FrozenLayer], outputs: Callable[[Tensor], Sequence[Tensor]]
    ) -> List[Tensor]:
        r"""The gradients of the explained outputs with respect to e, one layer at a time.

        Args:
            frozen_at: ``(l, checkpoint_l) -> FrozenLayer`` of layer l.
            outputs: maps the frozen last-layer output at ``last_rows`` (B, R, D) to the
                explained outputs, (B,) each (e.g. one class logit per example); affine in its input.

        Returns:
            One (B, T, D) gradient per output; :attr:`constants` holds each output's constant (B,).
        """
        n = self.num_layers
        if len(self.checkpoints) != n:
            raise RuntimeError(f"the forward phase saw {len(self.checkpoints)} of {n} layers")
        x_last = self.checkpoints[-1]
        with local_autograd():  # the explained outputs are affine: gradient and value at 0
            y = x_last.new_zeros(x_last.shape[0], self.last_rows.shape[0], x_last.shape[2]).requires_grad_(True)
            roots = list(outputs(y))
            last = len(roots) - 1
            cots = [torch.autograd.grad(r.sum(), y, retain_graph=j < last)[0].detach() for j, r in enumerate(roots)]
            consts = [r.detach().clone() for r in roots]
            del roots, y
        # all the cotangents go through each layer in one call (J^T is linear in them), stacked
        # (k, B, R, D) in chunks (STACK_BYTES)
        stacks = [torch.stack(cots)] if cots else []
        del cots
        for l in range(n - 1, -1, -1):
            rows = self.last_rows if l == n - 1 else None
            step = self.last_step if (l == n - 1 and self.last_step is not None) else frozen_at(l, self.checkpoints[l])
            self.last_step = None
            c = step.constant(rows)
            if c is not None:
                gs = [g for st in stacks for g in st.unbind(0)]
                consts = [k + (g * c).sum((1, 2)) for k, g in zip(consts, gs)]
                del gs
            del c
            stacks = [step.vjp(st, rows) for st in _stack_chunks(stacks, step)]
            del step  # the layer's tensors go here
            if l > 0:
                self.checkpoints[l] = None
        cots = [g for st in stacks for g in st.unbind(0)]
        self.constants = consts
        return cots


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
        adj: an :class:`AdjointPass` whose forward phase has seen every layer (``last_rows``
            = the head's token).
        frozen_at: as in :meth:`AdjointPass.backward`.
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
    e = adj.embeddings
    pool = (lambda y: y[:, 0]) if pool is None else pool
    if target is not None:
        pick = lambda out: out.gather(1, target.view(-1, 1)).squeeze(1)
        (g,) = adj.backward(frozen_at, lambda y: [pick(frozen_head(pool(y), head, slope, True, real_input))])
        return (g * e).sum(-1).detach(), adj.constants[0]
    grads = adj.backward(frozen_at, lambda y: list(frozen_head(pool(y), head, slope, True, real_input).unbind(-1)))
    scores = torch.stack([(g * e).sum(-1) for g in grads], -1)
    return scores.detach(), torch.stack(adj.constants, -1)


# --------------------------------------------------------------------------------------
# Decoders: after the last layer the final norm
# (real per-token scale) and one row of the LM head, u = W_U[target] (or W_U[target] -
# W_U[foil]): the explained logit is <FinalNorm(x_{L,i}), u> + u_bias, linear in the parts.
# --------------------------------------------------------------------------------------
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


def frozen_pre_ln_layer(
    x: Tensor,
    layer: LayerTensors,
    value_weight: Tensor,
    value_bias: Optional[Tensor],
    with_bias: bool,
    coefs: Dict[str, Tensor],
    rows: Optional[Tensor] = None,
) -> Tensor:
    r"""A pre-LN layer with its nonlinear quantities frozen at the real values.

    Linear in ``x`` when ``with_bias`` is False (the map of :func:`pre_ln_layer_parts`
    applied to one part); with ``with_bias`` and the real input it reproduces the real
    output (up to the quadrature error of a gated FF).

    Args:
        x: (B, T, D).
        layer: the layer's real tensors.
        value_weight, value_bias: W_V (D, H_kv Dh) and b_V.
        with_bias: add every bias (beta1, b_V, b_O, beta2, FF biases, g(0) W2).
        coefs: :func:`ff_coefficients` of this layer.
        rows: (R,) output rows to produce (default all).

    Returns:
        (B, R, D).
    """
    hcur = frozen_attention_block(x, layer, value_weight, value_bias, with_bias, rows)
    return hcur + frozen_ff_branch(hcur, layer.ln2_in if rows is None else layer.ln2_in[:, rows], layer, with_bias, coefs,
                                   rows)


def frozen_attention_block(
    x: Tensor,
    layer: LayerTensors,
    value_weight: Tensor,
    value_bias: Optional[Tensor],
    with_bias: bool,
    rows: Optional[Tensor] = None,
) -> Tensor:
    r"""x_i + Attn(N1(x))_i with the probabilities and N1's scale frozen at their real values: (B, R, D).

    Args: as in :func:`frozen_pre_ln_layer` (``with_bias``: beta1, b_V and b_O).
    """
    b, t, _ = x.shape
    h = layer.num_heads
    hd = layer.out_weight.shape[0]
    kv_heads = value_weight.shape[1] // (hd // h)
    sel = (lambda z: z) if rows is None else (lambda z: z[:, rows])
    probs = sel(layer.probs.transpose(1, 2)).transpose(1, 2)
    u = norm_bias_part(x, layer.ln1_in, layer.ln1) if with_bias else apply_norm_to_parts(x, layer.ln1_in, layer.ln1)
    v = u @ value_weight
    if with_bias and value_bias is not None:
        v = v + value_bias
    mixed = torch.einsum("bhij,bjhe->bihe", probs, _value_heads(v, kv_heads, h // kv_heads))
    hcur = mixed.reshape(b, mixed.shape[1], hd) @ layer.out_weight + sel(x)
    if with_bias and layer.out_bias is not None:
        hcur = hcur + layer.out_bias
    return hcur


def frozen_ff_branch(
    u: Tensor, real_in: Tensor, layer: LayerTensors, with_bias: bool, coefs: Dict[str, Tensor],
    rows: Optional[Tensor] = None,
) -> Tensor:
    r"""FF(N2(u)) with N2's scale and the FF coefficients frozen at their real values: (B, R, D).

    Args:
        u: (B, R, D) the norm input at ``rows``; real_in: (B, R, D) its real value there.
        layer: the layer's tensors; with_bias: add beta2, the FF biases and g(0) W2.
        coefs: :func:`ff_coefficients` of the layer (all T rows); rows: (R,) long or None.
    """
    sel = (lambda z: z) if rows is None else (lambda z: z[:, rows])
    z = norm_bias_part(u, real_in, layer.ln2) if with_bias else apply_norm_to_parts(u, real_in, layer.ln2)
    f = layer.ff

    def lin(w: Tensor, bb: Optional[Tensor]) -> Tensor:
        return z @ w + bb if (with_bias and bb is not None) else z @ w

    if f.w_gate is None:
        ig = lin(f.w_in, f.b_in) * sel(coefs["slope"])
        if with_bias:
            ig = ig + f.act(torch.zeros((), dtype=u.dtype, device=u.device))
    else:
        ig = lin(f.w_gate, f.b_gate) * sel(coefs["gate"]) + lin(f.w_in, f.b_in) * sel(coefs["up"])
    ff = ig @ f.w_out
    if with_bias and f.b_out is not None:
        ff = ff + f.b_out
    return ff


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
        adj: an :class:`AdjointPass` whose forward phase has seen every layer, with
            ``last_rows = torch.unique(position)``.
        frozen_at: as in :meth:`AdjointPass.backward`.
        final_params: the final norm's parameters; final_input: (B, T, D) its real input.
        direction: (B, D) u; direction_bias: (B,) or None; position: (B,) explained positions.

    Returns:
        (scores (B, T), bias scores (B,)): the bias score is F(e) - sum of the scores.
    """
    e = adj.embeddings
    ar = torch.arange(e.shape[0], device=e.device)
    row_index = torch.searchsorted(adj.last_rows, position)
    f_in = final_input[ar, position]
    (g,) = adj.backward(
        frozen_at, lambda y: [frozen_next_token_logit(y[ar, row_index], final_params, f_in, direction, direction_bias)]
    )
    return (g * e).sum(-1).detach(), adj.constants[0]


FROZEN_LAYERS["post_ln"] = lambda x, layer, vw, vb, with_bias, coefs, rows: frozen_post_ln_layer(
    x, layer, vw, vb, with_bias, coefs["slope"], rows)
FROZEN_LAYERS["pre_ln"] = frozen_pre_ln_layer
FROZEN_VJPS["post_ln"] = lambda g, layer, vw, coefs, rows, valid: frozen_post_ln_layer_vjp(g, layer, vw, coefs["slope"], rows)
FROZEN_VJPS["pre_ln"] = frozen_pre_ln_layer_vjp
