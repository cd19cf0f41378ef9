r"""Layer maps of pre-LN decoder layers (GPT-2, Llama, Mistral, Qwen2; DESIGN sections 2-4).

Pre-LN layer: h_i = x_i + sum_h sum_j alpha^h_ij f^h(LN1(x_j)) + b_O, out_i = h_i + FF(LN2(h_i)).
LN1 acts on one token alone, so the whole value path f^h(LN1(x_j)) (the recorded value
states, bias b_V inside, rotary embeddings never touch them) belongs to token j:

    h_{i<-j} = [i = j] x_i + sum_h alpha^h_ij f^h(LN1(x_j)),   bias part b_O.

How the names of the GlobEnc table read on a pre-LN layer (:data:`PRE_LN_MAPS`):

=============  ==================================================================
``W``          mean over heads of alpha^h_ij (as for encoders)
``W_FIXEDRES`` 0.5 * row-normalised W + 0.5 * I
``N``          |sum_h alpha^h_ij f^h(LN1(x_j))| (attention only, Attn-N)
``N_FIXEDRES`` 0.5 * row-normalised N + 0.5 * I
``N_RES``      |h_{i<-j}| (attention + residual, AttnRes-N; the ATB scope)
``N_RESLN``    |gamma2 * c(h_{i<-j}) / s(h_i)|: the parts of the LN2 output, i.e. the
               input of the feed-forward block (AttnResLn-N; the LN2 scope)
=============  ==================================================================

``N_ENC`` (GlobEnc) and ``W_RES`` (which uses the N_ENC mixing ratio) have no pre-LN
meaning: in a post-LN layer the second LayerNorm closes the layer; in a pre-LN layer no
norm follows the feed-forward residual. Asking for them raises a ValueError that names
the valid maps. Causal attention makes every map lower-triangular: entries (i, j > i)
are exactly 0.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor

from captum_normattr.decompose.alti import alti_map
from captum_normattr.decompose.attention import attention_parts_rows, diagonal_attention_parts, part_norms_gram, project_values
from captum_normattr.decompose.layer_norm import apply_norm_to_parts, norm_bias_part, norm_linear_map, norm_scale
from captum_normattr.decompose.mixing import fixed_residual, mixing_ratio
from captum_normattr.decompose.records import LayerTensors

#: The GlobEnc-table maps that have a pre-LN meaning (see the module docstring).
PRE_LN_MAPS: Tuple[str, ...] = ("W", "W_FIXEDRES", "N", "N_FIXEDRES", "N_RES", "N_RESLN")
#: Norm maps of pre-LN layers (a mixing ratio is defined for them).
PRE_LN_NORM_MAPS: Tuple[str, ...] = ("N", "N_RES", "N_RESLN")
#: The map of pre-LN layers used when none is named (GlobEncAttribution's default for decoders).
PRE_LN_DEFAULT_MAP = "N_RESLN"


def check_pre_ln_map(name: str) -> None:
    r"""Raise a ValueError naming the valid pre-LN maps if ``name`` has no pre-LN meaning."""
    if name not in PRE_LN_MAPS:
        why = (
            " (N_ENC and W_RES need the LayerNorm that closes a post-LN layer; a pre-LN layer has none after its "
            "feed-forward residual)"
            if name in ("N_ENC", "W_RES")
            else ""
        )
        raise ValueError(f"map {name!r} is not defined for pre-LN decoder layers{why}; choose from {PRE_LN_MAPS}")


def causal_mask2d(valid: Tensor, dtype: torch.dtype, causal: bool = True) -> Tensor:
    r"""(B, T, T) mask: both tokens real and, if ``causal``, j <= i."""
    m = valid.unsqueeze(-1) & valid.unsqueeze(-2)
    if causal:
        t = valid.shape[-1]
        m = m & torch.ones(t, t, dtype=torch.bool, device=valid.device).tril()
    return m.to(dtype)


def _out_bias(layer: LayerTensors) -> Tensor:
    return layer.out_bias if layer.out_bias is not None else torch.zeros_like(layer.hidden_in[0, 0])


def attention_update_sum(layer: LayerTensors) -> Tensor:
    r"""sum_j sum_h alpha^h_ij f^h(LN1(x_j)) from probabilities and values (no bias), (B, T, D)."""
    mixed = torch.einsum("bhij,bhjk->bhik", layer.probs, layer.values)
    return torch.einsum("bhik,hkd->bid", mixed, layer.head_out_weight())


def residual_parts_sum(layer: LayerTensors) -> Tensor:
    r"""x_i + sum_j attention parts + b_O: the reconstruction of the real h_i (= the LN2 input)."""
    return layer.hidden_in + attention_update_sum(layer) + _out_bias(layer)


def pre_ln_completeness_error(layer: LayerTensors, valid: Tensor) -> Tensor:
    r"""Largest |sum_j h_{i<-j} + b_O - h_i| over real tokens, h_i the model's real LN2 input."""
    err = (residual_parts_sum(layer) - layer.ln2_in).abs().amax(-1)
    return (err * valid.to(err.dtype)).max()


def pre_ln_norm_map_spec(layer: LayerTensors, name: str) -> Tuple[Optional[Tensor], Optional[Tensor], bool]:
    r"""(linear map A or None, row scale (B, T) or None, with residual) of a pre-LN norm map."""
    if name == "N":
        return None, None, False
    if name == "N_RES":
        return None, None, True
    if name == "N_RESLN":
        d = layer.hidden_in.shape[-1]
        lin = norm_linear_map(layer.ln2, d, layer.hidden_in.dtype, layer.hidden_in.device)
        return lin, norm_scale(layer.ln2_in, layer.ln2), True
    check_pre_ln_map(name)
    raise ValueError(f"map {name!r} is not a norm map; choose from {PRE_LN_NORM_MAPS}")


def pre_ln_layer_maps(
    layer: LayerTensors, valid: Tensor, names: Iterable[str] = PRE_LN_MAPS, causal: bool = True
) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    r"""Maps and mixing ratios of one pre-LN layer, by the Gram algorithm (no (T, T, D) tensor).

    Args:
        layer: the layer's captured tensors (``pre_ln`` True).
        valid: (B, T) bool, real tokens.
        names: maps to compute, any of :data:`PRE_LN_MAPS`.
        causal: zero the entries j > i (the causal attention already gives them exactly 0
            probability; this keeps rounding in the fixed-residual maps out).

    Returns:
        (maps name -> (B, T, T), ratios name -> (B, T)); pad rows and columns exactly 0.
    """
    names = tuple(names)
    for n in names:
        check_pre_ln_map(n)
    dtype = layer.hidden_in.dtype
    mask2d = causal_mask2d(valid, dtype, causal)
    head_w = layer.head_out_weight()
    attn_diag = diagonal_attention_parts(layer.probs, layer.values, head_w)
    total_with_res = layer.ln2_in - _out_bias(layer)  # sum_j h_{i<-j}, from the real h
    needed = {n for n in names if n in PRE_LN_NORM_MAPS}
    if "N_FIXEDRES" in names:
        needed.add("N")
    maps: Dict[str, Tensor] = {}
    ratios: Dict[str, Tensor] = {}
    for name in PRE_LN_NORM_MAPS:
        if name not in needed:
            continue
        lin, scale, with_res = pre_ln_norm_map_spec(layer, name)
        own = attn_diag + layer.hidden_in if with_res else attn_diag
        total = total_with_res if with_res else total_with_res - layer.hidden_in
        maps[name] = part_norms_gram(layer.probs, layer.values, head_w, own, lin, scale) * mask2d
        own_m, total_m = (own, total) if lin is None else (own @ lin, total @ lin)
        ratios[name] = mixing_ratio(total_m, own_m) * valid.to(dtype)
    if "W" in names or "W_FIXEDRES" in names:
        maps["W"] = layer.probs.mean(1) * mask2d
    if "W_FIXEDRES" in names:
        maps["W_FIXEDRES"] = fixed_residual(maps["W"], valid) * mask2d
    if "N_FIXEDRES" in names:
        maps["N_FIXEDRES"] = fixed_residual(maps["N"], valid) * mask2d
    return {n: maps[n] for n in names}, ratios


def pre_ln_alti_map(layer: LayerTensors, valid: Tensor, chunk_rows: Optional[int] = None, causal: bool = True) -> Tensor:
    r"""ALTI map of one pre-LN layer: parts h_{i<-j}, block output y_i = h_i (real, b_O inside).

    Args:
        layer: the layer's tensors.
        valid: (B, T) bool.
        chunk_rows: query rows per chunk.
        causal: zero the entries j > i (exactly 0 already up to the last bit of the L1 sums).

    Returns:
        (B, T, T), real rows summing to 1.
    """
    projected = project_values(layer.values, layer.head_out_weight())
    out = alti_map(layer.probs, projected, layer.hidden_in, layer.ln2_in, valid, None, chunk_rows)
    if causal:
        out = out * causal_mask2d(valid, out.dtype, True)
    return out


def residual_parts(layer: LayerTensors, rows: Optional[slice] = None) -> Tensor:
    r"""Explicit parts h_{i<-j} for query rows ``rows`` (all by default): (B, R, T, D)."""
    t = layer.hidden_in.shape[1]
    rows = rows if rows is not None else slice(0, t)
    projected = project_values(layer.values, layer.head_out_weight())
    parts = attention_parts_rows(layer.probs, projected, rows)
    r = torch.arange(rows.start, rows.stop, device=parts.device)
    parts[:, r - rows.start, r] += layer.hidden_in[:, rows]
    return parts


def ln2_parts(layer: LayerTensors, rows: Optional[slice] = None) -> Tuple[Tensor, Tensor]:
    r"""Parts of the LN2 output (the FF input) gamma2 c(h_{i<-j}) / s(h_i), and the bias part.

    The bias part is gamma2 c(b_O) / s(h_i) + beta2. With an exact norm the parts sum to the
    real LN2 output.

    Args:
        layer: the layer's tensors.
        rows: query rows (all by default).

    Returns:
        ((B, R, T, D), (B, R, D)).
    """
    t = layer.hidden_in.shape[1]
    rows = rows if rows is not None else slice(0, t)
    h = layer.ln2_in[:, rows]
    parts = apply_norm_to_parts(residual_parts(layer, rows), h, layer.ln2)
    return parts, norm_bias_part(_out_bias(layer), h, layer.ln2)
