r"""The post-LN layer kind (BERT-like encoders): its maps, ALTI, completeness, DecompX steps and capture recipe.

Post-LN layer: z_i = x_i + a_i, zt_i = LN1(z_i), y_i = LN2(zt_i + FF(zt_i)).
Every map is computed from the parts of docs/design.md, section 3, by the Gram algorithm of
:mod:`captum_normattr.decompose.primitives.attention`. DecompX's step
(:func:`post_ln_layer_parts`), frozen layer (:func:`frozen_post_ln_layer`) and its transpose
(:func:`frozen_post_ln_layer_vjp`): docs/design.md, section 8. :class:`PostLNKind` answers for
these layers; ALTI-Logit (the stream norms rescale the residual updates token by token) and
routes are not implemented for it.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor

from captum_normattr.decompose.kinds.base import KIND_METHODS, CaptureRecipe, LayerKind
from captum_normattr.decompose.methods.alti import alti_map
from captum_normattr.decompose.methods.decompx import frozen
from captum_normattr.decompose.methods.decompx.parts import (
    SPREAD_MODES,
    absorb_bias,
    check_bias_mode,
    spread_weights,
    value_bias_weights,
)
from captum_normattr.decompose.primitives.attention import attention_context, heads_through_out, norm_maps_and_ratios, project_values
from captum_normattr.decompose.primitives.chunking import rows_for_budget, token_blocks
from captum_normattr.decompose.primitives.feed_forward import component_scope_maps, ig_closed_form
from captum_normattr.decompose.primitives.guards import relative_difference
from captum_normattr.decompose.primitives.layer_norm import NormLinearMap, apply_norm_to_parts, norm_bias_part, norm_scale
from captum_normattr.decompose.primitives.mixing import fixed_residual, pair_mask, ratio_residual
from captum_normattr.decompose.records import LayerTensors

__all__ = [
    "GLOBENC_MAPS",
    "NORM_MAPS",
    "POST_LN_CAPTURE",
    "PostLNKind",
    "frozen_post_ln_layer",
    "frozen_post_ln_layer_vjp",
    "norm_map_spec",
    "post_ln_alti_map",
    "post_ln_completeness_error",
    "post_ln_example_completeness_error",
    "post_ln_layer_maps",
    "post_ln_layer_parts",
    "post_ln_ln1_parts_sum",
]

#: Every layer map of the GlobEnc table, in the paper's order.
GLOBENC_MAPS: Tuple[str, ...] = ("W", "W_FIXEDRES", "W_RES", "N", "N_FIXEDRES", "N_RES", "N_RESLN", "N_ENC")
#: Maps built from norms of parts, for which a mixing ratio is defined.
NORM_MAPS: Tuple[str, ...] = ("N", "N_RES", "N_RESLN", "N_ENC")


def norm_map_spec(layer: LayerTensors, name: str) -> Tuple[Optional[Tensor], Optional[Tensor], bool]:
    r"""The linear map A, per-row scale and residual flag that define a norm map.

    Args:
        layer: the layer's tensors.
        name: one of :data:`NORM_MAPS`.

    Returns:
        (A or None, row_scale (B, T) or None, with_residual); A is a
        :class:`~captum_normattr.decompose.primitives.layer_norm.NormLinearMap` (``x @ A`` in O(D)).
    """
    d = layer.hidden_in.shape[-1]
    dtype, device = layer.hidden_in.dtype, layer.hidden_in.device
    if name == "N":
        return None, None, False
    if name == "N_RES":
        return None, None, True
    s1 = norm_scale(layer.ln1_in, layer.ln1)
    if name == "N_RESLN":
        return NormLinearMap(layer.ln1, dim=d, dtype=dtype, device=device), s1, True
    if name == "N_ENC":
        s2 = norm_scale(layer.ln2_in, layer.ln2)
        return NormLinearMap(layer.ln1, layer.ln2, dim=d, dtype=dtype, device=device), s1 * s2, True
    raise ValueError(f"unknown norm map {name!r}; choose from {NORM_MAPS}")


def post_ln_layer_maps(
    layer: LayerTensors, valid: Tensor, names: Iterable[str] = GLOBENC_MAPS
) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    r"""The GlobEnc-table maps and mixing ratios of one post-LN layer.

    Args:
        layer: the layer's captured tensors.
        valid: (B, T) bool, non-pad tokens.
        names: which maps to compute (any of :data:`GLOBENC_MAPS`).

    Returns:
        (maps, ratios): maps name -> (B, T, T) with pad rows/columns exactly 0;
        ratios name -> (B, T) mixing ratio for the norm maps that were needed.
    """
    names = tuple(names)
    unknown = [n for n in names if n not in GLOBENC_MAPS]
    if unknown:
        raise ValueError(f"unknown map(s) {unknown}; choose from {GLOBENC_MAPS}")
    dtype = layer.hidden_in.dtype
    mask2d = pair_mask(valid, dtype)
    head_w = layer.head_out_weight()
    # sum_j a_{i<-j} + x_i is the real LN1 input less the bias b_O (subtracted block by block)

    needed = set(n for n in names if n in NORM_MAPS)
    if "N_FIXEDRES" in names:
        needed.add("N")
    if "W_RES" in names:
        needed.add("N_ENC")

    maps, ratios = norm_maps_and_ratios(
        layer.probs, layer.values, head_w, layer.hidden_in, layer.ln1_in,
        [n for n in NORM_MAPS if n in needed], lambda name: norm_map_spec(layer, name), mask2d, valid,
        total_bias=layer.out_bias,
    )

    if any(n.startswith("W") for n in names):
        maps["W"] = layer.probs.mean(1) * mask2d
    if "W_FIXEDRES" in names:
        maps["W_FIXEDRES"] = fixed_residual(maps["W"], valid) * mask2d
    if "W_RES" in names:
        maps["W_RES"] = ratio_residual(maps["W"], ratios["N_ENC"], valid) * mask2d
    if "N_FIXEDRES" in names:
        maps["N_FIXEDRES"] = fixed_residual(maps["N"], valid) * mask2d
    return {n: maps[n] for n in names}, ratios


def post_ln_alti_map(layer: LayerTensors, valid: Tensor, chunk_rows: Optional[int] = None) -> Tensor:
    r"""ALTI map of one post-LN layer: parts of the LN1 output zt_i.

    T_i(x_j) = gamma1 * c(a_{i<-j} + [i = j] x_i) / s(z_i); y_i = zt_i (real, with bias).

    Args:
        layer: the layer's captured tensors.
        valid: (B, T) bool.
        chunk_rows: query rows per chunk.

    Returns:
        (B, T, T), valid rows summing to 1.
    """
    d = layer.hidden_in.shape[-1]
    ln1_map = NormLinearMap(layer.ln1, dim=d, dtype=layer.hidden_in.dtype, device=layer.hidden_in.device)
    projected = project_values(layer.values, layer.head_out_weight(), ln1_map, token_major=True)
    residual = layer.hidden_in @ ln1_map
    scale = norm_scale(layer.ln1_in, layer.ln1)
    return alti_map(layer.probs, projected, residual, layer.ln1_out, valid, scale, chunk_rows)


def post_ln_ln1_parts_sum(layer: LayerTensors) -> Tensor:
    r"""Sum over source tokens of the LN1-output parts plus the bias part, from probs and values.

    Reconstructs zt_i = sum_j gamma1 c(a_{i<-j} + [i=j] x_i) / s(z_i) + gamma1 c(b_O) / s(z_i) + beta1
    independently of the real LN1 tensors (except its scale), for completeness checks.

    Args:
        layer: the layer's tensors.

    Returns:
        (B, T, D).
    """
    if layer.context is not None:  # the product the recording attention already computed
        attn = layer.attention_sum()
    else:
        attn = heads_through_out(attention_context(layer.probs, layer.values), layer.head_out_weight())
    parts_sum = apply_norm_to_parts(attn + layer.hidden_in, layer.ln1_in, layer.ln1)
    return parts_sum + norm_bias_part(layer.out_bias, layer.ln1_in, layer.ln1)


def post_ln_completeness_error(layer: LayerTensors, valid: Tensor) -> Tensor:
    r"""Largest absolute error of parts + bias part against the real LN1 output (valid tokens; 0-dim).

    The largest of :func:`post_ln_example_completeness_error` over the examples.
    """
    return post_ln_example_completeness_error(layer, valid).max()


def post_ln_example_completeness_error(layer: LayerTensors, valid: Tensor) -> Tensor:
    r"""Per example (B,): largest absolute error of parts + bias part against the real LN1 output.

    The parts' sum is :func:`post_ln_ln1_parts_sum`, worked out block by block of tokens
    (one product through W_O per block, the residual and b_O added into it, the norm's
    fixed linear map with the real scale): each block's temporaries stay in the CPU cache.
    """
    if layer.context is None:
        err = (post_ln_ln1_parts_sum(layer) - layer.ln1_out).abs().amax(-1)
        return (err * valid.to(err.dtype)).amax(-1)
    b, t, d = layer.hidden_in.shape
    ctx = layer.context.reshape(b * t, -1)
    x, real_in, real_out = (u.reshape(b * t, d) for u in (layer.hidden_in, layer.ln1_in, layer.ln1_out))
    beta = layer.ln1.bias.to(x.dtype) if layer.ln1.bias is not None else None
    err = x.new_empty(b * t)
    for rows in token_blocks(b * t, d * x.element_size()):
        z = torch.addmm(x[rows], ctx[rows], layer.out_weight)  # sum_j a_{i<-j} + x_i
        if layer.out_bias is not None:
            z += layer.out_bias  # the bias part, through the same fixed map
        z = apply_norm_to_parts(z[None], real_in[rows][None], layer.ln1)[0]  # (1, n, D): n tokens
        if beta is not None:
            z += beta
        err[rows] = z.sub_(real_out[rows]).abs_().amax(-1)
    return (err.view(b, t) * valid.to(err.dtype)).amax(-1)


# --- DecompX ------------------------------------------------------------------------------
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
    v_weights = value_bias_weights(parts, v_bias, value_weight, bias_mode, layer.index)
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
        ff_slope: (B, T, F), the ``"slope"`` of :func:`~captum_normattr.decompose.methods.decompx.parts.ff_coefficients`.
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


def frozen_post_ln_layer_vjp(
    g: Tensor, layer: LayerTensors, value_weight: Tensor, ff_slope: Tensor, rows: Optional[Tensor] = None
) -> Tensor:
    r"""The transpose of :func:`frozen_post_ln_layer`'s linear part (``with_bias=False``): J^T g.

    Args:
        g: (B, R, D) cotangent of the layer output at ``rows`` (all T rows if None), or a
            stack (..., B, R, D) of such cotangents (one call for all, as in
            :func:`~captum_normattr.decompose.kinds.pre_ln.frozen_pre_ln_layer_vjp`).
        layer, value_weight, ff_slope, rows: as in :func:`frozen_post_ln_layer`.

    Returns:
        (..., B, T, D) the cotangent of the layer input.
    """
    t = layer.hidden_in.shape[1]
    h = layer.num_heads
    hd = value_weight.shape[1]
    sel = (lambda z: z) if rows is None else (lambda z: z[:, rows])
    f = layer.ff
    g_r = frozen.norm_transpose(g, sel(layer.ln2_in), layer.ln2)  # LN2 input: zt + FF(zt)
    g_zt = g_r + ((g_r @ f.w_out.T).mul_(sel(ff_slope))) @ f.w_in.T
    g_ax = frozen.norm_transpose(g_zt, sel(layer.ln1_in), layer.ln1)  # LN1 input: attention + x
    probs = layer.probs if rows is None else layer.probs[:, :, rows]
    g_mixed = (g_ax @ layer.out_weight.T).view(*g_ax.shape[:-1], h, hd // h)
    return (frozen.mix_transpose(g_mixed, probs, h) @ value_weight.T).add_(frozen.scatter_rows(g_ax, t, rows))



# --- capture ------------------------------------------------------------------------------
#: What the capture records of a post-LN layer: the common keys; the attention reads the layer
#: input, the FF the first norm's output; the layer output is the second norm's, and the residual
#: joins after the attention at the first norm's input.
POST_LN_CAPTURE = CaptureRecipe(
    attention_input="hidden_in",
    attention_input_name="the layer input",
    ff_input="ln1_out",
    ff_input_name="the first norm's output",
    identity_checks=(("layer output vs the second norm's output", "layer_out", "ln2_out"),),
    attention_join="ln1_in",
    stream_norms=True,
)


class PostLNKind(LayerKind):
    r"""Post-LN encoder layers (BERT family)."""

    name = "post_ln"
    #: ALTI-Logit splits the logit over additive residual updates, which the stream norms of post-LN
    #: layers rescale token by token, and routes follow those updates: neither is decomposed (the other methods are)
    methods = frozenset(m for m in KIND_METHODS if m not in ("alti_logit", "routes"))
    globenc_maps = GLOBENC_MAPS
    default_map = "N_ENC"
    whole_layer_scope = "LN2"
    capture = POST_LN_CAPTURE

    def check_map(self, name: str) -> None:
        if name not in self.globenc_maps:
            raise ValueError(f"unknown map_name {name!r}; choose from {self.globenc_maps}")

    def norm_maps(self, layer, valid, names):
        return post_ln_layer_maps(layer, valid, names)

    def mixing_ratio_name(self, map_name):
        if map_name in NORM_MAPS:
            return map_name
        return "N_ENC" if map_name == "W_RES" else None

    def alti_map(self, layer, valid, memory_budget_mb):
        return post_ln_alti_map(layer, valid, self.alti_chunk_rows(layer, memory_budget_mb))

    def completeness_error(self, layer, valid):
        return post_ln_completeness_error(layer, valid)

    def example_completeness_error(self, layer, valid):
        return post_ln_example_completeness_error(layer, valid)

    def attention_block_output(self, layer):
        return layer.ln1_out

    def scope_maps(self, layer, valid, options):
        return component_scope_maps(
            layer, valid, options.chunk_rows, options.method, options.steps, options.contribution,
            options.ignore_low_gamma, options.memory_budget_mb,
        )

    def decompx_step(self, parts, bias, layer, value_weight, value_bias, bias_mode="separate", rows=None,
                     memory_budget_mb=256.0, coefs=None):
        # the FF slopes come from the real pre-activation inside the step: ``coefs`` is not needed
        return post_ln_layer_parts(parts, bias, layer, value_weight, value_bias, bias_mode, rows, memory_budget_mb)

    def frozen_layer(self, x, layer, value_weight, value_bias, with_bias, coefs, rows=None):
        return frozen_post_ln_layer(x, layer, value_weight, value_bias, with_bias, coefs["slope"], rows)

    def frozen_layer_vjp(self, g, layer, value_weight, coefs, rows=None, valid=None):
        return frozen_post_ln_layer_vjp(g, layer, value_weight, coefs["slope"], rows)

    def join_checks(self, layer):
        return {"second norm input vs the first norm's output plus the feed-forward output": relative_difference(
            layer.ln2_in, layer.ln1_out + layer.ff_out, temporary=True)}
