r"""Sandwich layers (Gemma 2, Gemma 3, OLMo 2): norms after each branch, and before it (docs/design.md, "Sandwich layers").

Sandwich layer:  h = x + P1(Attn(N1(x))),  y = h + P2(FF(N2(h))),  P1, P2 RMSNorms (Gemma: gain
1 + w, folded into :class:`~captum_normattr.decompose.records.NormParams` by the capture).
A layer without pre-norms (OLMo 2: h = x + P1(Attn(x)), y = h + P2(FF(h))) has N1 and N2 the
``identity`` norm (scale 1, no gain, no centering): the value path reads the raw stream and
every formula below holds as written.

Every method freezes a post-norm at the REAL per-token scale of its input: with
r1_i = rms(a_i) of the real attention output a_i (the recorded ``attn_post_in``) and
r2_i = rms(f_i) of the real FF output f_i (``ff_post_in``), P1 and P2 are linear on parts:

    a_{i<-j}  = sum_h alpha^h_ij v^h_j W_O^h         ->  P1 part  gamma1 * a_{i<-j} / r1_i
    FF_{i<-j} (the FF parts of the pre-LN kind)       ->  P2 part  gamma2 * FF_{i<-j} / r2_i

(bias parts likewise: gamma2 * FF bias part / r2_i). So a sandwich layer is a pre-LN layer
whose attention probabilities carry the query-row factor 1/r1_i and whose output projection
carries gamma1 (:func:`pre_ln_form`), and whose FF output parts carry gamma2 / r2_i. The
pre-LN functions of :mod:`~captum_normattr.decompose.kinds.pre_ln` then give every norm map,
ALTI, the FF scopes and ALTI-Logit's pieces; the ``W`` maps read the REAL probabilities.
DecompX's steps fold gamma2 into W_down and 1/r2_i into the frozen per-neuron FF
coefficients (a per-row factor on a linear map of the coefficients), and reuse the pre-LN
steps (:func:`sandwich_layer_parts`, :func:`frozen_sandwich_layer`,
:func:`frozen_sandwich_layer_vjp`). :class:`SandwichKind` also declares what the capture
records of these layers and checks (:data:`SANDWICH_CAPTURE`).

A per-token bias (an attention output bias b_O, which P1 turns into gamma1 b_O / r1_i; an FF
output bias or an elementwise activation with g(0) != 0 in DecompX) is not handled yet and
is refused with :class:`~captum_normattr.arch.spec.UnsupportedModelError` (Gemma 2 and 3 have
neither).

Routes (docs/routes.md, "Sandwich layers"): the edges into m_{l,i} = h_i are the residual x_i and,
per head and source, P1's frozen part gamma1 alpha^h_ij v^h_j W_O^h / r1_i (:func:`pre_ln_form`);
the edges into the layer output y_i are h_i (residual, from m_{l,i}) and P2's real output (the FF
branch as it joins the stream, from m_{l,i} through the FF node).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor

from captum_normattr.arch.spec import UnsupportedModelError
from captum_normattr.decompose.kinds import pre_ln as decoder
from captum_normattr.decompose.methods.decompx.parts import ff_coefficients
from captum_normattr.decompose.kinds.base import KIND_METHODS, CaptureRecipe
from captum_normattr.decompose.primitives.guards import norm_rebuild_error, relative_difference
from captum_normattr.decompose.primitives.layer_norm import norm_scale
from captum_normattr.decompose.primitives.mixing import fixed_residual, pair_mask
from captum_normattr.decompose.primitives.channel_mixing import head_mean
from captum_normattr.decompose.records import FFParams, LayerTensors, NormParams

__all__ = [
    "SANDWICH_CAPTURE",
    "SandwichKind",
    "attention_post_scale",
    "ff_post_scale",
    "frozen_sandwich_layer",
    "frozen_form",
    "frozen_sandwich_layer_vjp",
    "pre_ln_form",
    "sandwich_alti_map",
    "sandwich_completeness_error",
    "sandwich_component_scope_maps",
    "sandwich_layer_maps",
    "sandwich_layer_parts",
]

#: The maps that read the attention probabilities themselves (the real ones, never the folded ones).
WEIGHT_MAPS: Tuple[str, ...] = ("W", "W_FIXEDRES")


def _gain(params: NormParams, like: Tensor) -> Tensor:
    return params.weight.to(like.dtype) if params.weight is not None else torch.ones_like(like[0, 0])


def attention_post_scale(layer: LayerTensors) -> Tensor:
    r"""(B, T) r1_i: the attention post-norm's per-token scale at its real input (the attention output)."""
    return norm_scale(layer.attn_post_in, layer.attn_post)


def ff_post_scale(layer: LayerTensors) -> Tensor:
    r"""(B, T) r2_i: the feed-forward post-norm's per-token scale at its real input (the FF output)."""
    return norm_scale(layer.ff_post_in, layer.ff_post)


def _check_record(layer: LayerTensors) -> None:
    if layer.attn_post is None or layer.attn_post_in is None or layer.ff_post is None or layer.ff_post_in is None:
        raise ValueError(f"layer {layer.index}: a sandwich layer record needs its post-norms (attn_post, ff_post) and "
                         "their recorded inputs")
    for name, params in (("attention", layer.attn_post), ("feed-forward", layer.ff_post)):
        if params.kind != "rmsnorm" or params.bias is not None:
            raise UnsupportedModelError(
                f"layer {layer.index}: the {name} post-norm is a {params.kind}; sandwich layers are decomposed with "
                "RMSNorm post-norms (no centering, no bias) only")
    if layer.out_bias is not None:
        raise UnsupportedModelError(
            f"layer {layer.index}: a sandwich layer with an attention output bias (the post-norm makes it a per-token "
            "bias gamma1 b_O / r1_i) is not decomposed yet; Gemma 2 and 3 have none (attention_bias=False)")


def pre_ln_form(layer: LayerTensors) -> LayerTensors:
    r"""The sandwich layer as a pre-LN record with the same parts (see the module docstring).

    probs'[b, h, i, j] = alpha^h_ij / r1_i, the recorded context likewise per query row,
    W_O' = W_O diag(gamma1), ``ff_out`` the FF branch as it joins the residual (P2's real
    output); the norms N1, N2, the residual stream (``hidden_in``, ``ln2_in``,
    ``layer_out``) and the FF weights are the real ones. Its attention parts sum to P1's
    real output, so ``hidden_in`` + parts = h_i (the pre-LN completeness error measures it).

    Args:
        layer: a sandwich layer's record (``topology == "sandwich"``).

    Returns:
        a :class:`LayerTensors` of topology ``"pre_ln"``.

    Raises:
        UnsupportedModelError: for an attention output bias (see the module docstring).
    """
    _check_record(layer)
    r1 = attention_post_scale(layer)
    probs = layer.probs / r1[:, None, :, None]
    context = None if layer.context is None else layer.context / r1[:, :, None, None]
    out_weight = layer.out_weight * _gain(layer.attn_post, layer.out_weight)
    return dataclasses.replace(
        layer, probs=probs, context=context, out_weight=out_weight, ff_out=layer.ff_post_out, topology="pre_ln",
        attn_post=None, attn_post_in=None, attn_post_out=None, ff_post=None, ff_post_in=None,
        ff_post_out=None, checks=layer.checks,
    )


def sandwich_completeness_error(layer: LayerTensors, valid: Tensor) -> Tensor:
    r"""Largest |x_i + sum_j P1 parts - h_i| over real tokens, h_i the model's real second-norm input."""
    return decoder.pre_ln_completeness_error(pre_ln_form(layer), valid)


def sandwich_layer_maps(
    layer: LayerTensors, valid: Tensor, names: Iterable[str] = decoder.PRE_LN_MAPS
) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    r"""Maps and mixing ratios of one sandwich layer (the names of :data:`~captum_normattr.decompose.kinds.pre_ln.PRE_LN_MAPS`).

    ``N`` = |gamma1 a_{i<-j} / r1_i| (the attention branch after P1), ``N_RES`` = |h_{i<-j}|,
    ``N_RESLN`` the parts of N2's output, ``W`` the mean over heads of the REAL alpha^h_ij,
    ``*_FIXEDRES`` as for pre-LN layers.
    """
    names = tuple(names)
    for n in names:
        decoder.check_pre_ln_map(n)
    norm_names = [n for n in names if n not in WEIGHT_MAPS]
    maps, ratios = decoder.pre_ln_layer_maps(pre_ln_form(layer), valid, norm_names, layer.causal) if norm_names else ({}, {})
    if any(n in WEIGHT_MAPS for n in names):
        mask2d = pair_mask(valid, layer.hidden_in.dtype, layer.causal)
        maps["W"] = head_mean(layer.probs) * mask2d
        if "W_FIXEDRES" in names:
            maps["W_FIXEDRES"] = fixed_residual(maps["W"], valid) * mask2d
    return {n: maps[n] for n in names}, ratios


def sandwich_alti_map(layer: LayerTensors, valid: Tensor, chunk_rows: Optional[int] = None) -> Tensor:
    r"""ALTI map of the attention block: parts h_{i<-j} = [i = j] x_i + gamma1 a_{i<-j} / r1_i against the real h_i."""
    return decoder.pre_ln_alti_map(pre_ln_form(layer), valid, chunk_rows, layer.causal)


def sandwich_component_scope_maps(
    layer: LayerTensors,
    valid: Tensor,
    chunk_rows: Optional[int] = None,
    method: str = "closed_form",
    steps: int = 50,
    nodes: Optional[int] = None,
    memory_budget_mb: float = 128.0,
    contribution: str = "norm",
) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    r"""Maps of the FF component scopes of a sandwich layer (the pre-LN scopes ``ATB``, ``LN2``, ``FF``, ``RES2``).

    ``ATB``: h_{i<-j} (against the real h_i); ``LN2``: N2's parts (the FF input); ``FF``: the
    FF branch as it joins the residual, gamma2 FF_{i<-j} / r2_i (and bias part
    gamma2 FF_bias / r2_i), against P2's real output; ``RES2``: h_{i<-j} + that, against the
    real layer output. Arguments and returns as
    :func:`~captum_normattr.decompose.kinds.pre_ln.pre_ln_component_scope_maps`.
    """
    _check_record(layer)
    factor = _gain(layer.ff_post, layer.hidden_in) / ff_post_scale(layer).unsqueeze(-1)  # (B, T, D)

    def ff_parts(view: LayerTensors, rows: slice, *args, **kwargs) -> Tuple[Tensor, Tensor]:
        parts, bias = decoder.pre_ln_ff_parts(view, rows, *args, **kwargs)
        f = factor[:, rows]
        return parts.mul_(f.unsqueeze(2)), bias * f

    return decoder.pre_ln_component_scope_maps(
        pre_ln_form(layer), valid, chunk_rows, method, steps, nodes, layer.causal, memory_budget_mb, contribution,
        ff_parts=ff_parts,
    )


# --- DecompX ----------------------------------------------------------------------------

#: The frozen per-neuron FF coefficients that multiply the FF input parts (scaled by 1 / r2_i).
_LINEAR_COEFS = ("slope", "gate", "up")


def frozen_form(layer: LayerTensors, coefs: Dict[str, Tensor]) -> Tuple[LayerTensors, Dict[str, Tensor]]:
    r"""The pre-LN record and FF coefficients whose frozen pre-LN layer is the frozen sandwich layer.

    :func:`pre_ln_form` with W_down' = W_down diag(gamma2); the coefficients ``slope`` /
    ``gate`` / ``up`` (:func:`~captum_normattr.decompose.methods.decompx.parts.ff_coefficients`, at the real
    FF input) divided by r2_i per row. Exact because the FF parts are linear in these
    coefficients and nothing else enters the FF output: an FF output bias, or an elementwise
    activation with g(0) != 0, would be a per-token bias and is refused.
    """
    view = pre_ln_form(layer)
    f = layer.ff
    if f.b_out is not None and bool(torch.any(f.b_out != 0)):
        raise UnsupportedModelError(f"layer {layer.index}: DecompX does not decompose a sandwich layer with a "
                                    "feed-forward output bias yet (P2 makes it a per-token bias)")
    if f.w_gate is None:
        zero = f.act(torch.zeros((), dtype=f.w_out.dtype, device=f.w_out.device))
        if bool(zero != 0):
            raise UnsupportedModelError(f"layer {layer.index}: DecompX does not decompose a sandwich layer whose "
                                        "elementwise activation has g(0) != 0 yet")
    view.ff = FFParams(f.w_in, f.b_in, f.w_out * _gain(layer.ff_post, f.w_out), None, f.act, f.w_gate, f.b_gate)
    inv = 1.0 / ff_post_scale(layer).unsqueeze(-1)  # (B, T, 1)
    scaled = {k: (v * inv.to(v.dtype) if k in _LINEAR_COEFS else v) for k, v in coefs.items()}
    return view, scaled


def sandwich_layer_parts(
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
    r"""DecompX's step of a sandwich layer: the pre-LN step on :func:`frozen_form`.

    h_{i<-k} = x_{i<-k} + gamma1 (sum_h (sum_j alpha^h_ij N1(x)_{j<-k} W_V^h) W_O^h) / r1_i,
    out_{i<-k} = h_{i<-k} + gamma2 FF_{i<-k}(N2(h)_{i<-k}) / r2_i, the probabilities, the four
    norm scales and the FF coefficients frozen at their real values.

    Args:
        parts, bias, layer, value_weight, value_bias, bias_mode, rows, memory_budget_mb: as in
            :func:`~captum_normattr.decompose.kinds.pre_ln.pre_ln_layer_parts`.
        coefs: the REAL layer's :func:`~captum_normattr.decompose.methods.decompx.parts.ff_coefficients`
            (computed if None).

    Returns:
        (parts (B, R, K, D), bias part (B, R, D)) of the layer output at ``rows``.
    """
    view, scaled = frozen_form(layer, ff_coefficients(layer) if coefs is None else coefs)
    return decoder.pre_ln_layer_parts(parts, bias, view, value_weight, value_bias, bias_mode, rows, memory_budget_mb,
                                      scaled)


def frozen_sandwich_layer(
    x: Tensor,
    layer: LayerTensors,
    value_weight: Tensor,
    value_bias: Optional[Tensor],
    with_bias: bool,
    coefs: Dict[str, Tensor],
    rows: Optional[Tensor] = None,
) -> Tensor:
    r"""The frozen sandwich layer, (B, R, D): :func:`~captum_normattr.decompose.kinds.pre_ln.frozen_pre_ln_layer` on :func:`frozen_form`."""
    view, scaled = frozen_form(layer, coefs)
    return decoder.frozen_pre_ln_layer(x, view, value_weight, value_bias, with_bias, scaled, rows)


def frozen_sandwich_layer_vjp(
    g: Tensor,
    layer: LayerTensors,
    value_weight: Tensor,
    coefs: Dict[str, Tensor],
    rows: Optional[Tensor] = None,
    valid: Optional[Tensor] = None,
) -> Tensor:
    r"""The transpose of :func:`frozen_sandwich_layer`'s linear part: the pre-LN transpose on :func:`frozen_form`.

    Returns:
        (..., B, T, D) the cotangent of the layer input.
    """
    view, scaled = frozen_form(layer, coefs)
    return decoder.frozen_pre_ln_layer_vjp(g, view, value_weight, scaled, rows, valid)


# --- capture ------------------------------------------------------------------------------
#: What the capture records of a sandwich layer: the pre-LN keys, and the inputs and outputs of
#: the norms on both branch outputs (their parameters from the description's post-norms); the FF
#: post-norm reads the FF output; the residual joins are checked through the post-norms' outputs.
SANDWICH_CAPTURE = CaptureRecipe(
    extra_keys=("attn_post_in", "attn_post_out", "ff_post_in", "ff_post_out"),
    identity_checks=decoder.PRE_LN_CAPTURE.identity_checks + (
        ("feed-forward post-norm input vs the feed-forward output", "ff_post_in", "ff_out"),),
    post_norms=("attn_post", "ff_post"),
)


class SandwichKind(decoder.PreLNKind):
    r"""Sandwich layers (Gemma 2, Gemma 3; OLMo 2 with identity pre-norms): post-norms on both branches (see the module docstring).

    The pre-LN kind's maps, scopes and block output (h_i, the second norm's real input), each
    computed on :func:`pre_ln_form`.
    """

    name = "sandwich"
    methods = frozenset(KIND_METHODS)
    capture = SANDWICH_CAPTURE

    def route_form(self, layer):
        r""":func:`pre_ln_form`: P1's scale 1 / r1_i on the probabilities' rows, its gain on W_O, so the head edges
        gamma1 alpha^h_ij v^h_j W_O^h / r1_i sum to P1's real output and, with the residual x_i, to h_i."""
        return pre_ln_form(layer)

    def route_output_edges(self, layer):
        r"""h_i (``"residual"``) and P2's real output P2(FF(N2(h)))_i (``"ff"``), summing to the layer output."""
        return torch.stack([layer.ln2_in, layer.ff_post_out], -2), ("residual", "ff")

    def norm_maps(self, layer, valid, names):
        return sandwich_layer_maps(layer, valid, names)

    def alti_map(self, layer, valid, memory_budget_mb):
        return sandwich_alti_map(layer, valid, self.alti_chunk_rows(layer, memory_budget_mb))

    def completeness_error(self, layer, valid):
        return sandwich_completeness_error(layer, valid)

    def example_completeness_error(self, layer, valid):
        return decoder.pre_ln_example_completeness_error(pre_ln_form(layer), valid)

    def scope_maps(self, layer, valid, options):
        return sandwich_component_scope_maps(
            layer, valid, options.chunk_rows, options.method, options.steps, options.nodes, options.memory_budget_mb,
            options.contribution,
        )

    def check_ff_options(self, options, family):
        if options.ignore_low_gamma:
            raise ValueError(
                f"{family} has sandwich layers: ignore_low_gamma is not supported there (the LayerNorm-gamma ablation "
                "of Kobayashi et al. 2023 acts on the norms that close a post-LN encoder's blocks). Use ignore_low_gamma=0"
            )

    def logit_form(self, layer):
        return pre_ln_form(layer)

    def decompx_step(self, parts, bias, layer, value_weight, value_bias, bias_mode="separate", rows=None,
                     memory_budget_mb=256.0, coefs=None):
        return sandwich_layer_parts(parts, bias, layer, value_weight, value_bias, bias_mode, rows, memory_budget_mb,
                                    coefs)

    def frozen_layer(self, x, layer, value_weight, value_bias, with_bias, coefs, rows=None):
        return frozen_sandwich_layer(x, layer, value_weight, value_bias, with_bias, coefs, rows)

    def frozen_layer_vjp(self, g, layer, value_weight, coefs, rows=None, valid=None):
        return frozen_sandwich_layer_vjp(g, layer, value_weight, coefs, rows, valid)

    def post_norm_checks(self, layer):
        r"""The checks of the two post-norms and of the stream between them (also the per-layer-input kind's)."""
        return {
            "attention post-norm rebuilt from its input": norm_rebuild_error(
                layer.attn_post_in, layer.attn_post_out, layer.attn_post),
            "feed-forward post-norm rebuilt from its input": norm_rebuild_error(
                layer.ff_post_in, layer.ff_post_out, layer.ff_post),
            "second norm input vs the layer input plus the attention post-norm output": relative_difference(
                layer.ln2_in, layer.hidden_in + layer.attn_post_out, temporary=True),
        }

    def join_checks(self, layer):
        return {
            **self.post_norm_checks(layer),
            "layer output vs the residual stream plus the feed-forward post-norm output": relative_difference(
                layer.layer_out, layer.ln2_in + layer.ff_post_out, temporary=True),
        }
