r"""Layer maps of post-LN encoder layers (the ``post_ln`` kind: BERT-like encoders).

Post-LN layer: z_i = x_i + a_i, zt_i = LN1(z_i), y_i = LN2(zt_i + FF(zt_i)).
Every map is computed from the parts of docs/design.md, section 3, by the Gram algorithm of
:mod:`captum_normattr.decompose.primitives.attention`.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor

from captum_normattr.decompose.methods.alti import alti_map
from captum_normattr.decompose.primitives.attention import attention_context, heads_through_out, norm_maps_and_ratios, project_values
from captum_normattr.decompose.primitives.chunking import token_blocks
from captum_normattr.decompose.primitives.layer_norm import NormLinearMap, apply_norm_to_parts, norm_scale
from captum_normattr.decompose.primitives.mixing import fixed_residual, pair_mask, ratio_residual
from captum_normattr.decompose.records import LayerTensors

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
    from captum_normattr.decompose.primitives.layer_norm import norm_bias_part

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
