r"""The pre-LN layer kind (GPT-2, the Llama-like families, ViT, ...; docs/design.md, sections 2-6 and 8).

Its maps, ALTI map, FF scopes and completeness errors (below), DecompX's step, frozen layer and
transpose (:func:`pre_ln_layer_parts`, :func:`frozen_pre_ln_layer`, :func:`frozen_pre_ln_layer_vjp`)
and its capture recipe (:data:`PRE_LN_CAPTURE`); :class:`PreLNKind` answers for these layers. The
parallel and sandwich kinds reuse its residual helpers (which is why this module is about 700 lines: the
helpers stay with the pre-LN functions they generalise).

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

A vector the model adds to token t's stream right after the layer, a function of token t alone
(:attr:`LayerTensors.own_after`: Qwen3-VL's DeepStack features; docs/vlm.md, "Qwen3-VL (DeepStack)"), is token
t's own part: DecompX's step adds it to part t of row t (:func:`add_own_after`), ALTI's map and ``N_RES`` hold it
in the residual (:func:`own_after_view`), the ``RES2`` scope adds it to the own part; ``layer_out`` is the stream
after it, which every part sums to.

It is over 700 lines because the pre-LN kind is the one the parallel and sandwich kinds reuse: its maps, ALTI, FF scopes and DecompX step stay in one module.
"""
from __future__ import annotations

import copy
from typing import Callable, Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor

from captum_normattr.decompose.kinds.base import CaptureRecipe, LayerKind
from captum_normattr.decompose.methods.alti import alti_map, contributions_from_distances, l1_contributions
from captum_normattr.decompose.methods.decompx.frozen import attention_block_vjp, ff_branch_vjp, frozen_attention_block, frozen_ff_branch
from captum_normattr.decompose.methods.decompx.parts import two_branch_layer_parts
from captum_normattr.decompose.primitives.channel_mixing import channel_part_distances, head_mean, is_channel_mixing
from captum_normattr.decompose.primitives.chunking import rows_for_budget
from captum_normattr.decompose.primitives.feed_forward import CONTRIBUTIONS
from captum_normattr.decompose.primitives.guards import relative_difference
from captum_normattr.decompose.primitives.attention import (
    attention_context,
    attention_parts_rows,
    heads_through_out,
    norm_maps_and_ratios,
    project_values,
)
from captum_normattr.decompose.primitives.layer_norm import NormLinearMap, apply_norm_to_parts, norm_bias_part, norm_scale
from captum_normattr.decompose.primitives.mixing import fixed_residual, pair_mask, row_normalize
from captum_normattr.decompose.records import LayerTensors

__all__ = [
    "add_own_after",
    "own_after_view",
    "PRE_LN_CAPTURE",
    "PRE_LN_DEFAULT_MAP",
    "PRE_LN_MAPS",
    "PRE_LN_NORM_MAPS",
    "PRE_LN_SCOPES",
    "PRE_LN_SCOPE_OUTPUTS",
    "PreLNKind",
    "attention_update_sum",
    "block_example_completeness_error",
    "check_pre_ln_map",
    "ff_preactivation_parts",
    "ff_preactivation_setup",
    "finish_scope_maps",
    "frozen_pre_ln_layer",
    "frozen_pre_ln_layer_vjp",
    "output_bias",
    "pre_ln_alti_map",
    "pre_ln_completeness_error",
    "pre_ln_component_scope_maps",
    "pre_ln_example_completeness_error",
    "pre_ln_ff_parts",
    "pre_ln_layer_maps",
    "pre_ln_layer_parts",
    "pre_ln_norm_map_spec",
    "pre_ln_scope_outputs",
    "residual_alti_map",
    "residual_layer_maps",
    "residual_parts",
    "residual_parts_sum",
    "scope_chunk_rows",
    "scope_scorer",
]

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


def output_bias(layer: LayerTensors) -> Tensor:
    r"""b_O of the attention output, (D,): zeros where the layer has none."""
    return layer.out_bias if layer.out_bias is not None else torch.zeros_like(layer.hidden_in[0, 0])


def attention_update_sum(layer: LayerTensors) -> Tensor:
    r"""sum_j sum_h alpha^h_ij f^h(LN1(x_j)) (no bias), (B, T, D): from the recorded attention
    context when there is one (no second product over the probabilities), else from
    probabilities and values."""
    if layer.context is not None:
        return layer.attention_sum()
    return heads_through_out(attention_context(layer.probs, layer.values, layer.causal), layer.head_out_weight())


def residual_parts_sum(layer: LayerTensors) -> Tensor:
    r"""x_i + sum_j attention parts + b_O: the reconstruction of the real h_i (= the LN2 input)."""
    return layer.hidden_in + attention_update_sum(layer) + output_bias(layer)


def block_example_completeness_error(layer: LayerTensors, block_output: Tensor, valid: Tensor) -> Tensor:
    r"""Per example (B,): largest |sum_j h_{i<-j} + b_O - real block output| over its real tokens.

    Args:
        layer: the layer's tensors.
        block_output: (B, T) the real output of the attention block with its residual, h_i.
        valid: (B, T) bool, real tokens.

    Returns:
        (B,) the largest error of each example (0 for one without real tokens).
    """
    err = (residual_parts_sum(layer) - block_output).abs().amax(-1)
    return (err * valid.to(err.dtype)).amax(-1)


def pre_ln_example_completeness_error(layer: LayerTensors, valid: Tensor) -> Tensor:
    r"""Per example (B,): largest |sum_j h_{i<-j} + b_O - h_i| over its real tokens, h_i the model's real LN2 input."""
    return block_example_completeness_error(layer, layer.ln2_in, valid)


def pre_ln_completeness_error(layer: LayerTensors, valid: Tensor) -> Tensor:
    r"""Largest |sum_j h_{i<-j} + b_O - h_i| over real tokens and examples (see :func:`pre_ln_example_completeness_error`)."""
    return pre_ln_example_completeness_error(layer, valid).max()


def pre_ln_norm_map_spec(layer: LayerTensors, name: str) -> Tuple[Optional[Tensor], Optional[Tensor], bool]:
    r"""(linear map A or None, row scale (B, T) or None, with residual) of a pre-LN norm map."""
    if name == "N":
        return None, None, False
    if name == "N_RES":
        return None, None, True
    if name == "N_RESLN":
        d = layer.hidden_in.shape[-1]
        lin = NormLinearMap(layer.ln2, dim=d, dtype=layer.hidden_in.dtype, device=layer.hidden_in.device)
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
    # block output sum_j h_{i<-j}: the real h less b_O
    return residual_layer_maps(layer, valid, names, layer.ln2_in, PRE_LN_NORM_MAPS,
                               lambda name: pre_ln_norm_map_spec(layer, name), causal)


def residual_layer_maps(
    layer: LayerTensors,
    valid: Tensor,
    names: Tuple[str, ...],
    block_output: Tensor,
    norm_names: Tuple[str, ...],
    norm_spec: Callable[[str], Tuple[Optional[Tensor], Optional[Tensor], bool]],
    causal: bool = True,
) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    r"""The GlobEnc-table maps of an attention block whose residual adds the layer input x (names already checked).

    Args:
        layer: the layer's tensors.
        valid: (B, T) bool, real tokens.
        names: the maps (``W``, ``W_FIXEDRES``, ``N_FIXEDRES`` and the norm maps ``norm_names``).
        block_output: (B, T, D) the real x_i + attention output (b_O inside).
        norm_names: the norm maps the layer kind defines (a mixing ratio each).
        norm_spec: a norm map's (linear map or None, row scale or None, with residual).
        causal: zero the entries j > i.

    Returns:
        (maps name -> (B, T, T), ratios name -> (B, T)); pad rows and columns exactly 0.
    """
    mask2d = pair_mask(valid, layer.hidden_in.dtype, causal)
    needed = {n for n in names if n in norm_names}
    if "N_FIXEDRES" in names:
        needed.add("N")
    maps, ratios = norm_maps_and_ratios(
        layer.probs, layer.values, layer.head_out_weight(), layer.hidden_in, block_output,
        [n for n in norm_names if n in needed], norm_spec, mask2d, valid, causal, total_bias=layer.out_bias,
    )
    if "W" in names or "W_FIXEDRES" in names:
        maps["W"] = head_mean(layer.probs) * mask2d
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
        causal: the attention is causal: each chunk of rows works on the sources before its
            end only, and the entries j > i are 0.

    Returns:
        (B, T, T), real rows summing to 1.
    """
    return residual_alti_map(layer, layer.ln2_in, valid, chunk_rows, causal)


def residual_alti_map(
    layer: LayerTensors, block_output: Tensor, valid: Tensor, chunk_rows: Optional[int] = None, causal: bool = True
) -> Tensor:
    r"""ALTI map of an attention block whose residual adds the layer input: parts h_{i<-j} against ``block_output``.

    Args:
        layer: the layer's tensors.
        block_output: (B, T, D) the real x_i + attention output (b_O inside).
        valid: (B, T) bool.
        chunk_rows: query rows per chunk.
        causal: the attention is causal (see :func:`pre_ln_alti_map`).

    Returns:
        (B, T, T), real rows summing to 1.
    """
    if is_channel_mixing(layer.probs):  # a hybrid mixer: its parts in blocks of rows, no (N, T, D) projection
        dist = channel_part_distances(layer.probs, layer.values, layer.head_out_weight(), layer.hidden_in, block_output,
                                      causal)
        return contributions_from_distances(dist, block_output.abs().sum(-1), valid, None, causal)
    projected = project_values(layer.values, layer.head_out_weight(), token_major=True)
    return alti_map(layer.probs, projected, layer.hidden_in, block_output, valid, None, chunk_rows, causal)


def residual_parts(layer: LayerTensors, rows: Optional[slice] = None, cols: Optional[int] = None) -> Tensor:
    r"""Explicit parts h_{i<-j} for query rows ``rows`` (all by default): (B, R, C, D).

    ``cols``: only the source tokens j < cols (C = cols; all T by default). With causal
    attention, rows i < cols have no other non-zero part, so ``cols = rows.stop`` skips zeros.
    """
    t = layer.hidden_in.shape[1]
    rows = rows if rows is not None else slice(0, t)
    cols = t if cols is None else cols
    projected = project_values(layer.values[:, :, :cols], layer.head_out_weight())
    parts = attention_parts_rows(layer.probs[..., :cols], projected, rows)
    r = torch.arange(rows.start, rows.stop, device=parts.device)
    parts[:, r - rows.start, r] += layer.hidden_in[:, rows]
    return parts


def add_own_after(parts: Tensor, layer: LayerTensors, rows: Optional[object] = None) -> Tensor:
    r"""Add the token-own vectors the model adds after the layer (:attr:`LayerTensors.own_after`) to the own parts.

    The vector at position t is token t's own input (Qwen3-VL's DeepStack feature of image token t; docs/vlm.md,
    "Qwen3-VL (DeepStack)"), so it joins part t of row t, as the residual x_t does.

    Args:
        parts: (B, R, K, D) parts of output rows ``rows`` over source tokens k < K, changed in place.
        layer: the layer's tensors (nothing is added where ``own_after`` is None).
        rows: the rows, a slice or an (R,) long tensor (None: all T).

    Returns:
        ``parts``.
    """
    own = layer.own_after
    if own is None:
        return parts
    t = own.shape[1]
    if rows is None:
        rows = torch.arange(t, device=parts.device)
    elif isinstance(rows, slice):
        rows = torch.arange(rows.start or 0, t if rows.stop is None else rows.stop, device=parts.device)
    rows = rows.to(parts.device)
    r = torch.arange(rows.shape[0], device=parts.device)
    parts[:, r, rows] += own[:, rows].to(parts.dtype)
    return parts


def own_after_view(layer: LayerTensors) -> LayerTensors:
    r"""The layer with its token-own additions (:attr:`LayerTensors.own_after`) in the residual of its attention block.

    ALTI's map and the ``N_RES`` map read the block's parts h_{i<-j} = [i = j] x_i + attention parts against the
    block's output h_i. A vector D_t that the model adds to token t's stream after the layer is token t's own, like
    the residual, so the view's residual is x_i + D_i and its block output h_i + D_i (the feed-forward, which the
    maps leave out as position-wise, sits between them in the model). Without additions: ``layer`` itself.
    """
    if layer.own_after is None:
        return layer
    view = copy.copy(layer)
    view.hidden_in = layer.hidden_in + layer.own_after
    view.ln2_in = layer.ln2_in + layer.own_after
    view.own_after = None
    return view


#: Component scopes of a pre-LN layer, in the order of the layer (docs/design.md, section 6, feed-forward).
PRE_LN_SCOPES: Tuple[str, ...] = ("ATB", "LN2", "FF", "RES2")
#: The real tensor each pre-LN scope's parts (plus bias part) sum to, a :class:`LayerTensors` field:
#: what ALTI contributions of the scope are measured against.
PRE_LN_SCOPE_OUTPUTS: Dict[str, str] = {"ATB": "ln2_in", "LN2": "ln2_out", "FF": "ff_out", "RES2": "layer_out"}


def pre_ln_scope_outputs(layer: LayerTensors) -> Dict[str, Tensor]:
    r"""The real output of every pre-LN scope, (B, T, D) (see :data:`PRE_LN_SCOPE_OUTPUTS`)."""
    return {s: getattr(layer, field) for s, field in PRE_LN_SCOPE_OUTPUTS.items()}


def ff_preactivation_setup(layer: LayerTensors, weight: Tensor, bias: Optional[Tensor]) -> Dict[str, Tensor]:
    r"""Per-layer tensors for :func:`ff_preactivation_parts` (computed once, reused for every row chunk).

    Args:
        layer: the layer's tensors.
        weight: (D, F) the FF input (or gate) matrix; bias: (F,) or None.

    Returns:
        dict: ``projected`` (B, H, T, F) values through W_O^h A W, ``residual`` (B, T, F) x_i A W,
        ``scale`` (B, T) s(h_i), ``bias`` (B, T, F) ((gamma2 c(b_O) / s_i + beta2) W + b).
    """
    lin = weight if layer.ln2.weight is None else layer.ln2.weight.to(weight.dtype)[:, None] * weight
    if layer.ln2.kind == "layernorm":
        lin = lin - lin.mean(0, keepdim=True)  # C diag(gamma) W, C = I - 11^T / D: no (D, D) product
    pre_bias = norm_bias_part(output_bias(layer), layer.ln2_in, layer.ln2) @ weight
    if bias is not None:
        pre_bias = pre_bias + bias
    return {
        "projected": project_values(layer.values, layer.head_out_weight(), lin),
        "residual": layer.hidden_in @ lin,
        "scale": norm_scale(layer.ln2_in, layer.ln2),
        "bias": pre_bias,
    }


def ff_preactivation_parts(
    layer: LayerTensors, setup: Dict[str, Tensor], rows: slice, cols: Optional[int] = None
) -> Tuple[Tensor, Tensor]:
    r"""Parts of an FF pre-activation LN2(h_i) W + b, straight from the attention values.

    LN2's part of j is A(h_{i<-j}) / s_i with A the fixed linear map of the norm, so
    (A h_{i<-j} / s_i) W = (sum_h alpha^h_ij f^h_j (A W) + [i=j] x_i (A W)) / s_i: the values
    are projected once through (A W) per head (:func:`ff_preactivation_setup`) and mixed over
    heads, O(R T H F) instead of the O(R T D F) of multiplying explicit LN2 parts by W.

    Args:
        layer: the layer's tensors.
        setup: from :func:`ff_preactivation_setup`.
        rows: the query rows.
        cols: only source tokens j < cols (see :func:`residual_parts`).

    Returns:
        (parts (B, R, C, F), bias part (B, R, F)).
    """
    cols = layer.hidden_in.shape[1] if cols is None else cols
    parts = attention_parts_rows(layer.probs[..., :cols], setup["projected"][:, :, :cols], rows)
    r = torch.arange(rows.start, rows.stop, device=parts.device)
    parts[:, r - rows.start, r] += setup["residual"][:, rows]
    parts.div_(setup["scale"][:, rows, None, None])
    return parts, setup["bias"][:, rows]


def pre_ln_ff_parts(
    layer: LayerTensors,
    rows: slice,
    method: str = "closed_form",
    steps: int = 50,
    nodes: Optional[int] = None,
    cache: Optional[Dict[str, Dict[str, Tensor]]] = None,
    cols: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    r"""FF-output parts FF_{i<-j} of a pre-LN layer for query rows ``rows``.

    The FF input is LN2(h_i), split into the LN2 parts of h_{i<-j} and a bias part. A gated
    FF (Llama family) is integrated by Gauss-Legendre quadrature (``nodes``), an elementwise
    one (GPT-2) in closed form or by a Riemann sum (``method``, ``steps``), as in
    :mod:`~captum_normattr.decompose.primitives.feed_forward`. A mixture of experts is the gated FF of
    its experts side by side, the up pre-activation of each hidden neuron times the token's
    frozen routing weight (``FFParams.hidden_scale``): each chosen expert's parts weighted
    by its routing weight, the other experts' exactly 0.

    Args:
        layer: the layer's tensors (``layer.ff`` holds the weights and activation).
        rows: the query rows.
        method, steps: elementwise integration.
        nodes: Gauss-Legendre nodes for a gated FF (None: the default).
        cache: a dict kept across the row chunks of one layer (per-layer projections).
        cols: only source tokens j < cols (see :func:`residual_parts`).

    Returns:
        (parts (B, R, T, D), bias part (B, R, D)), summing to the FF output.
    """
    from captum_normattr.decompose.primitives.feed_forward import ig_closed_form, ig_riemann
    from captum_normattr.decompose.primitives.gated_feed_forward import DEFAULT_NODES, gated_ff_parts_from_preactivations

    f = layer.ff
    cache = {} if cache is None else cache
    for key, (w, b) in {"in": (f.w_in, f.b_in), "gate": (f.w_gate, f.b_gate)}.items():
        if w is not None and key not in cache:
            cache[key] = ff_preactivation_setup(layer, w, b)
    if f.w_gate is not None:
        a, a_b = ff_preactivation_parts(layer, cache["gate"], rows, cols)
        b, b_b = ff_preactivation_parts(layer, cache["in"], rows, cols)
        if f.hidden_scale is not None:  # experts: each hidden neuron times its token's frozen routing weight
            scale = f.hidden_scale[:, rows]
            b.mul_(scale.unsqueeze(-2))
            b_b = b_b * scale
        if f.gate_scale is not None:  # input-scaled experts (Llama 4): the gate reads r (u W_gate)
            gs = f.gate_scale[:, rows]
            a.mul_(gs.unsqueeze(-2))
            a_b = a_b * gs
        return gated_ff_parts_from_preactivations(a, a_b, b, b_b, f.act, f.w_out, f.b_out, nodes or DEFAULT_NODES)
    pre, pre_b = ff_preactivation_parts(layer, cache["in"], rows, cols)
    allp = torch.cat([pre, pre_b.unsqueeze(-2)], -2)
    del pre
    total = allp.sum(-2)
    if method == "closed_form":
        ig = ig_closed_form(allp, total, f.act)
    elif method == "riemann":
        ig = ig_riemann(allp, total, f.act, steps)
    else:
        raise ValueError(f"method must be 'closed_form' or 'riemann', got {method!r}")
    del allp
    zero = f.act(torch.zeros((), dtype=total.dtype, device=total.device))
    out = ig @ f.w_out
    parts, bias = out[..., :-1, :], out[..., -1, :] + zero * f.w_out.sum(0)
    if f.b_out is not None:
        bias = bias + f.b_out
    return parts, bias


def pre_ln_component_scope_maps(
    layer: LayerTensors,
    valid: Tensor,
    chunk_rows: Optional[int] = None,
    method: str = "closed_form",
    steps: int = 50,
    nodes: Optional[int] = None,
    causal: bool = True,
    memory_budget_mb: float = 128.0,
    contribution: str = "norm",
    ff_parts: Optional[Callable[..., Tuple[Tensor, Tensor]]] = None,
) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    r"""Maps of the component scopes of a pre-LN layer, built in chunks of query rows.

    Scope parts of token j in token i: ``ATB`` h_{i<-j} (attention block with its residual),
    ``LN2`` the LN2 parts (the FF input), ``FF`` FF_{i<-j} (FF output parts), ``RES2``
    h_{i<-j} + FF_{i<-j} (the whole layer output out_i = h_i + FF(LN2(h_i))). Each map entry
    is the L2 norm of the part (``contribution="norm"``) or ALTI's L1 contribution
    max(0, |y_i|_1 - |y_i - part_{i<-j}|_1) against the real output y_i of the scope
    (:data:`PRE_LN_SCOPE_OUTPUTS`: h_i, LN2(h_i), FF(LN2(h_i)), the real layer output), real
    rows normalised to sum to 1 after the pad and causal entries are zeroed, as for post-LN
    layers (:func:`~captum_normattr.decompose.primitives.feed_forward.component_scope_maps`). With
    ``"alti"``, ``ATB`` is the ALTI map (:func:`pre_ln_alti_map`) and ``RES2`` is ALTI+FF.

    Args:
        layer: the layer's tensors.
        valid: (B, T) bool.
        chunk_rows: query rows per chunk (None: from ``memory_budget_mb``).
        method, steps: elementwise FF integration (``"closed_form"`` or ``"riemann"``).
        nodes: Gauss-Legendre nodes for a gated FF.
        causal: the attention is causal: sources j > i (exactly zero parts) are skipped
            and their entries are 0.
        memory_budget_mb: budget of one chunk's explicit parts (about four (B, R, T, max(D, F))
            temporaries), in MB.
        contribution: ``"norm"`` (default) or ``"alti"`` (see above).
        ff_parts: the FF-output parts of a row chunk, called as :func:`pre_ln_ff_parts`
            (default); a layer kind whose FF branch is followed by a linear map (the sandwich
            kind's post-norm at its real scale) passes its own.

    Returns:
        (maps, errors): maps scope -> (B, T, T), pad rows and columns and (causal) the
        entries j > i exactly 0; errors ``"ff"`` (scalar, max over real
        tokens of |FF parts + bias - real FF output|), ``"layer"`` (the same against the
        real layer output) and ``"ff_per_example"`` (B,).
    """
    score = scope_scorer(contribution, pre_ln_scope_outputs(layer))
    b, t, _ = layer.hidden_in.shape
    chunk = scope_chunk_rows(layer, chunk_rows, memory_budget_mb, causal)
    maps = {s: layer.hidden_in.new_zeros(b, t, t) for s in PRE_LN_SCOPES}
    ff_err = layer.hidden_in.new_zeros(b, t)
    layer_err = layer.hidden_in.new_zeros(b, t)
    bias_o = output_bias(layer)
    cache: Dict[str, Dict[str, Tensor]] = {}

    for start in range(0, t, chunk):
        rows = slice(start, min(t, start + chunk))
        cols = rows.stop if causal else t  # causal: sources j > i have exactly zero parts
        h = residual_parts(layer, rows, cols)
        maps["ATB"][:, rows, :cols] = score("ATB", h, rows)
        maps["LN2"][:, rows, :cols] = score("LN2", apply_norm_to_parts(h, layer.ln2_in[:, rows], layer.ln2), rows)
        ffp, ff_b = (ff_parts or pre_ln_ff_parts)(layer, rows, method, steps, nodes, cache, cols)
        maps["FF"][:, rows, :cols] = score("FF", ffp, rows)
        ff_err[:, rows] = (ffp.sum(2) + ff_b - layer.ff_out[:, rows]).abs().amax(-1)
        h.add_(ffp)
        add_own_after(h, layer, rows)  # a token-own vector added after the layer (DeepStack): row i's own part
        maps["RES2"][:, rows, :cols] = score("RES2", h, rows)
        layer_err[:, rows] = (h.sum(2) + bias_o + ff_b - layer.layer_out[:, rows]).abs().amax(-1)
        del h, ffp
    return finish_scope_maps(maps, ff_err, layer_err, valid, causal, contribution)


def scope_scorer(contribution: str, outputs: Dict[str, Tensor]) -> Callable[[str, Tensor, slice], Tensor]:
    r"""The map entries of a scope's parts: ``score(scope, parts (B, R, C, D), rows) -> (B, R, C)``.

    Args:
        contribution: ``"norm"`` (L2 norms of the parts) or ``"alti"`` (L1 contributions
            against the scope's real output at ``rows``).
        outputs: scope -> (B, T, D) the real output of the scope.

    Returns:
        the scoring function.

    Raises:
        ValueError: for an unknown ``contribution``.
    """
    if contribution not in CONTRIBUTIONS:
        raise ValueError(f"contribution must be one of {CONTRIBUTIONS}, got {contribution!r}")

    def score(scope: str, parts: Tensor, rows: slice) -> Tensor:
        if contribution == "norm":
            return parts.norm(dim=-1)
        return l1_contributions(parts, outputs[scope][:, rows])

    return score


def scope_chunk_rows(layer: LayerTensors, chunk_rows: Optional[int], memory_budget_mb: float, causal: bool) -> int:
    r"""Query rows per chunk of the scope maps: ``chunk_rows``, or what four (B, R, T, max(D, F)) temporaries allow."""
    if chunk_rows is not None:
        return max(1, int(chunk_rows))
    b, t, d = layer.hidden_in.shape
    width = max(d, layer.ff.width)
    return rows_for_budget(b, t, width, layer.hidden_in.element_size(), memory_budget_mb, 4, causal)


def finish_scope_maps(
    maps: Dict[str, Tensor], ff_err: Tensor, layer_err: Tensor, valid: Tensor, causal: bool, contribution: str
) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    r"""Scope maps with pad (and causal) entries zeroed, rows normalised for ``"alti"``, and their errors.

    Args:
        maps: scope -> (B, T, T) raw map (zeroed in place).
        ff_err, layer_err: (B, T) per-token FF and whole-layer completeness errors.
        valid: (B, T) bool, real tokens.
        causal: zero the entries j > i.
        contribution: ``"norm"`` or ``"alti"``.

    Returns:
        (maps, errors ``"ff"``, ``"layer"`` (max over real tokens) and ``"ff_per_example"``,
        ``"layer_per_example"`` (B,)).
    """
    dtype = ff_err.dtype
    m2 = pair_mask(valid, dtype, causal)
    maps = {s: v.mul_(m2) for s, v in maps.items()}
    if contribution == "alti":
        maps = {s: row_normalize(v) for s, v in maps.items()}
    vm = valid.to(dtype)
    ff_ex = (ff_err * vm).amax(-1)
    layer_ex = (layer_err * vm).amax(-1)
    return maps, {"ff": ff_ex.max(), "layer": layer_ex.max(), "ff_per_example": ff_ex, "layer_per_example": layer_ex}


# --- DecompX ------------------------------------------------------------------------------
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
    linear in its input parts through :func:`~captum_normattr.decompose.methods.decompx.parts.ff_coefficients` (closed form for GPT-2's
    elementwise activation, Gauss-Legendre integrals for a gated FF). The two halves are
    :func:`~captum_normattr.decompose.methods.decompx.parts.attention_block_parts` and :func:`~captum_normattr.decompose.methods.decompx.parts.ff_branch_parts`.

    Args:
        parts, bias, layer, bias_mode, rows, memory_budget_mb: as in :func:`~captum_normattr.decompose.kinds.post_ln.post_ln_layer_parts`.
        value_weight: (D, H_kv * Dh) W_V; value_bias: (H_kv * Dh,) or None.
        coefs: :func:`~captum_normattr.decompose.methods.decompx.parts.ff_coefficients` of this layer (computed if None).

    Returns:
        (parts (B, R, K, D), bias part (B, R, D)) of the layer output at ``rows``.
    """
    return two_branch_layer_parts(parts, bias, layer, value_weight, value_bias, bias_mode, rows, memory_budget_mb,
                                  coefs, ff_reads_block=True)


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
        coefs: :func:`~captum_normattr.decompose.methods.decompx.parts.ff_coefficients` of this layer.
        rows: (R,) output rows to produce (default all).

    Returns:
        (B, R, D).
    """
    hcur = frozen_attention_block(x, layer, value_weight, value_bias, with_bias, rows)
    return hcur + frozen_ff_branch(hcur, layer.ln2_in if rows is None else layer.ln2_in[:, rows], layer, with_bias, coefs,
                                   rows)


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
    (and no graph) is needed; ``tests/decompose/methods/test_decompx_speed.py`` checks it against
    ``torch.autograd`` in float64. The map is linear in ``g``: several cotangents stacked
    along leading dimensions go through in one call (the weight products broadcast, the
    attention mixing serves them all in one product; ``tests/decompose/methods/test_decompx_multi.py``).

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



# --- capture ------------------------------------------------------------------------------
#: What the capture records of a pre-LN layer: the common keys; the attention reads the first
#: norm's output, the FF the second's; the residual joins after the attention at the second norm's input.
PRE_LN_CAPTURE = CaptureRecipe(attention_join="ln2_in")


class PreLNKind(LayerKind):
    r"""Pre-LN layers (GPT-2 and Llama families; causal or bidirectional by the layer record)."""

    name = "pre_ln"
    globenc_maps = PRE_LN_MAPS
    default_map = PRE_LN_DEFAULT_MAP
    whole_layer_scope = "RES2"

    def check_map(self, name: str) -> None:
        check_pre_ln_map(name)

    def norm_maps(self, layer, valid, names):
        names = tuple(names)
        if layer.own_after is None or "N_RES" not in names:
            return pre_ln_layer_maps(layer, valid, names, layer.causal)
        # N_RES holds the residual: the token-own additions after the layer join it (own_after_view); the others
        # (the attention alone, the feed-forward's input) do not contain them
        rest = tuple(n for n in names if n != "N_RES")
        maps, ratios = pre_ln_layer_maps(layer, valid, rest, layer.causal) if rest else ({}, {})
        res_maps, res_ratios = pre_ln_layer_maps(own_after_view(layer), valid, ("N_RES",), layer.causal)
        maps.update(res_maps)
        ratios.update(res_ratios)
        return {n: maps[n] for n in names}, ratios

    def mixing_ratio_name(self, map_name):
        return map_name if map_name in PRE_LN_NORM_MAPS else None

    def alti_map(self, layer, valid, memory_budget_mb):
        view = own_after_view(layer)  # token-own additions after the layer (DeepStack) in the own part, as the residual
        return pre_ln_alti_map(view, valid, self.alti_chunk_rows(layer, memory_budget_mb), layer.causal)

    def completeness_error(self, layer, valid):
        return pre_ln_completeness_error(layer, valid)

    def example_completeness_error(self, layer, valid):
        return pre_ln_example_completeness_error(layer, valid)

    def attention_block_output(self, layer):
        return layer.ln2_in

    def scope_maps(self, layer, valid, options):
        return pre_ln_component_scope_maps(
            layer, valid, options.chunk_rows, options.method, options.steps, options.nodes, layer.causal,
            options.memory_budget_mb, options.contribution,
        )

    def logit_form(self, layer):
        return layer

    def check_ff_options(self, options, family):
        if options.ignore_low_gamma:
            raise ValueError(
                f"{family} is a pre-LN model: ignore_low_gamma is not supported there. The LayerNorm-gamma "
                "ablation of Kobayashi et al. 2023 acts on the LayerNorms that close the attention block and the "
                "layer of a post-LN encoder; a pre-LN layer's norms sit before its blocks and no norm follows its "
                "residuals. Use ignore_low_gamma=0 (contribution='norm' or 'alti' both work)"
            )

    capture = PRE_LN_CAPTURE

    def decompx_step(self, parts, bias, layer, value_weight, value_bias, bias_mode="separate", rows=None,
                     memory_budget_mb=256.0, coefs=None):
        out, out_bias = pre_ln_layer_parts(parts, bias, layer, value_weight, value_bias, bias_mode, rows,
                                           memory_budget_mb, coefs)
        return add_own_after(out, layer, rows), out_bias  # DeepStack: token t's own vector into its own part

    def frozen_layer(self, x, layer, value_weight, value_bias, with_bias, coefs, rows=None):
        return frozen_pre_ln_layer(x, layer, value_weight, value_bias, with_bias, coefs, rows)

    def frozen_layer_vjp(self, g, layer, value_weight, coefs, rows=None, valid=None):
        return frozen_pre_ln_layer_vjp(g, layer, value_weight, coefs, rows, valid)

    def route_output_edges(self, layer):
        parts, kinds = super().route_output_edges(layer)
        if layer.own_after is None:
            return parts, kinds
        # DeepStack: token t's own vector, added after the layer, is an edge from the leaf p_{l,t} (docs/routes.md)
        return torch.cat([parts, layer.own_after.unsqueeze(-2)], -2), kinds + ("own_addition",)

    def join_checks(self, layer):
        stream = layer.ln2_in + layer.ff_out
        if layer.own_after is not None:  # the layer output recorded after the model's token-own additions (DeepStack)
            return {"layer output vs the residual stream plus the feed-forward output and the token-own additions":
                    relative_difference(layer.layer_out, stream + layer.own_after, temporary=True)}
        return {"layer output vs the residual stream plus the feed-forward output": relative_difference(
            layer.layer_out, stream, temporary=True)}
