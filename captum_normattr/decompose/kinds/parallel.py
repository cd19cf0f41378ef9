r"""The parallel layer kind (GPT-NeoX/Pythia; the same kind serves GPT-J, Phi-2, Falcon, Cohere).

Parallel layer: both branches read the layer input x,

    y_i = x_i + Attn(N1(x))_i + FF(N2(x_i)),   Attn(N1(x))_i = sum_h sum_j alpha^h_ij f^h(N1(x_j)) + b_O.

N1 and N2 may be one module (GPT-J, Phi-2, Falcon: one shared norm); nothing here assumes
they differ. Layer-locally (x_i belongs to token i) the parts are (docs/design.md,
"Parallel layers"):

    h_{i<-j}  = [i = j] x_i + sum_h alpha^h_ij f^h(N1(x_j))      (bias part b_O)
    FF_{i<-j} = [i = j] FF(N2(x_i))                              (N2 acts on token i alone)
    y_{i<-j}  = h_{i<-j} + FF_{i<-j}

The model never forms h_i = x_i + Attn(N1(x))_i, but x_i plus the recorded attention branch
output (:attr:`~captum_normattr.decompose.records.LayerTensors.attn_branch_out`) is its real
value: the ALTI map, the AttnRes-N map and the completeness error are measured against that
(:func:`attention_block_output`), never against a tensor rebuilt from the parts.

GlobEnc-table maps (:data:`PARALLEL_MAPS`): ``W``, ``W_FIXEDRES``, ``N``, ``N_FIXEDRES`` and
``N_RES`` (|h_{i<-j}|, the default) read as for pre-LN layers. ``N_RESLN`` has no meaning
(N2 acts on x, not on x + attention, so no norm follows the attention residual), nor do
``N_ENC`` and ``W_RES``. FF scopes (:data:`PARALLEL_SCOPES`): ``ATB`` the parts h_{i<-j},
``LN2`` the FF input N2(x_i) and ``FF`` the FF output (both token i's alone: diagonal maps,
the FF output split by integrated gradients into token i's part and a bias part), ``RES2``
the whole layer y_{i<-j} (GlobEnc+FF / ALTI+FF). DecompX propagates the parts of x through
N1 -> attention and through N2 -> FF (both linearised at their real values, as in the pre-LN
step, but the FF on the parts of x, not of h) and adds them to the residual.

Routes (docs/routes.md, "Parallel layers"): the route graph keeps the pre-LN shape with m_{l,i} =
h_i = x_i + Attn(N1(x))_i, the real value of :func:`attention_block_output` (b_O inside, no edge):
into m_{l,i} the residual x_i and the head parts alpha^h_ij f^h(N1(x_j)); into y_i the residual h_i
(from m_{l,i}) and the real FF output FF(N2(x_i)), whose edge comes from x_{l,i} through the FF node
(the FF block reads the layer input, :attr:`ParallelKind.route_ff_reads_input`), not from m_{l,i}.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor

from captum_normattr.decompose.kinds.base import KIND_METHODS, CaptureRecipe, LayerKind
from captum_normattr.decompose.methods.decompx.frozen import attention_block_vjp, ff_branch_vjp, frozen_attention_block, frozen_ff_branch
from captum_normattr.decompose.methods.decompx.parts import two_branch_layer_parts
from captum_normattr.decompose.kinds.pre_ln import (
    PRE_LN_CAPTURE,
    block_example_completeness_error,
    finish_scope_maps,
    output_bias,
    residual_alti_map,
    residual_layer_maps,
    residual_parts,
    scope_chunk_rows,
    scope_scorer,
)
from captum_normattr.decompose.primitives.feed_forward import ff_parts
from captum_normattr.decompose.primitives.gated_feed_forward import DEFAULT_NODES, gated_ff_parts
from captum_normattr.decompose.primitives.guards import relative_difference
from captum_normattr.decompose.primitives.layer_norm import apply_norm_to_parts, norm_bias_part
from captum_normattr.decompose.records import LayerTensors

__all__ = [
    "PARALLEL_CAPTURE",
    "PARALLEL_DEFAULT_MAP",
    "PARALLEL_MAPS",
    "PARALLEL_NORM_MAPS",
    "PARALLEL_SCOPES",
    "ParallelKind",
    "attention_block_output",
    "check_parallel_map",
    "frozen_parallel_layer",
    "frozen_parallel_layer_vjp",
    "parallel_alti_map",
    "parallel_completeness_error",
    "parallel_component_scope_maps",
    "parallel_example_completeness_error",
    "parallel_ff_parts",
    "parallel_layer_maps",
    "parallel_layer_parts",
]

#: The GlobEnc-table maps that have a meaning on a parallel layer (see the module docstring).
PARALLEL_MAPS: Tuple[str, ...] = ("W", "W_FIXEDRES", "N", "N_FIXEDRES", "N_RES")
#: Norm maps of parallel layers (a mixing ratio is defined for them).
PARALLEL_NORM_MAPS: Tuple[str, ...] = ("N", "N_RES")
#: The map used when none is named.
PARALLEL_DEFAULT_MAP = "N_RES"
#: Component scopes of a parallel layer (docs/design.md, "Parallel layers").
PARALLEL_SCOPES: Tuple[str, ...] = ("ATB", "LN2", "FF", "RES2")


def check_parallel_map(name: str) -> None:
    r"""Raise a ValueError naming the valid maps if ``name`` has no meaning on a parallel layer."""
    if name not in PARALLEL_MAPS:
        why = {
            "N_RESLN": " (the second norm of a parallel layer acts on the layer input x, not on x + attention: no "
                       "norm follows the attention residual)",
            "N_ENC": " (N_ENC needs the LayerNorm that closes a post-LN layer)",
            "W_RES": " (W_RES uses the mixing ratio of N_ENC, which needs the LayerNorm that closes a post-LN layer)",
        }.get(name, "")
        raise ValueError(f"map {name!r} is not defined for parallel layers{why}; choose from {PARALLEL_MAPS}")


def attention_block_output(layer: LayerTensors) -> Tensor:
    r"""The real x_i + Attn(N1(x))_i, (B, T, D): the layer input plus the recorded attention branch output."""
    if layer.attn_branch_out is None:
        raise ValueError(
            f"layer {layer.index}: a parallel layer's record needs the attention branch output (attn_branch_out); "
            "record it with the package's Recorder"
        )
    return layer.hidden_in + layer.attn_branch_out


def parallel_example_completeness_error(layer: LayerTensors, valid: Tensor) -> Tensor:
    r"""Per example (B,): largest |sum_j h_{i<-j} + b_O - (x_i + attn_branch_out_i)| over real tokens."""
    return block_example_completeness_error(layer, attention_block_output(layer), valid)


def parallel_completeness_error(layer: LayerTensors, valid: Tensor) -> Tensor:
    r"""Largest |parts + b_O - real x + attention| of the attention block over real tokens (0-dim)."""
    return parallel_example_completeness_error(layer, valid).max()


def parallel_layer_maps(
    layer: LayerTensors, valid: Tensor, names: Iterable[str] = PARALLEL_MAPS, causal: bool = True
) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    r"""Maps and mixing ratios of one parallel layer, by the Gram algorithm (no (T, T, D) tensor).

    Args:
        layer: the layer's captured tensors (``topology`` ``"parallel"``).
        valid: (B, T) bool, real tokens.
        names: maps to compute, any of :data:`PARALLEL_MAPS`.
        causal: zero the entries j > i.

    Returns:
        (maps name -> (B, T, T), ratios name -> (B, T)); pad rows and columns exactly 0.
    """
    names = tuple(names)
    for n in names:
        check_parallel_map(n)
    return residual_layer_maps(layer, valid, names, attention_block_output(layer), PARALLEL_NORM_MAPS,
                               lambda name: (None, None, name == "N_RES"), causal)


def parallel_alti_map(layer: LayerTensors, valid: Tensor, chunk_rows: Optional[int] = None, causal: bool = True) -> Tensor:
    r"""ALTI map of x -> x + Attn(N1(x)): parts h_{i<-j}, block output the real x_i + attn_branch_out_i.

    Returns:
        (B, T, T), real rows summing to 1.
    """
    return residual_alti_map(layer, attention_block_output(layer), valid, chunk_rows, causal)


def parallel_ff_parts(
    layer: LayerTensors, rows: slice, method: str = "closed_form", steps: int = 50, nodes: Optional[int] = None
) -> Tuple[Tensor, Tensor]:
    r"""FF(N2(x_i)) split into token i's own part and a bias part, for the rows ``rows``.

    N2's input is token i's alone: its output is gamma c(x_i) / s(x_i) (token i) plus beta
    (bias part); the FF is integrated along that split as for pre-LN layers (closed form or a
    Riemann sum for an elementwise activation, Gauss-Legendre for a gated FF).

    Returns:
        (own part (B, R, 1, D), bias part (B, R, D)), summing to the FF output.
    """
    real = layer.ln2_in[:, rows]  # the real N2 input (the layer input; the recorder checks it)
    u = apply_norm_to_parts(real.unsqueeze(2), real, layer.ln2)
    u_b = norm_bias_part(None, real, layer.ln2)
    f = layer.ff
    if f.w_gate is not None:
        return gated_ff_parts(u, u_b, f.w_gate, f.b_gate, f.w_in, f.b_in, f.act, f.w_out, f.b_out, nodes or DEFAULT_NODES)
    return ff_parts(u, u_b, f.w_in, f.b_in, f.act, f.w_out, f.b_out, method, steps)


def parallel_component_scope_maps(
    layer: LayerTensors,
    valid: Tensor,
    chunk_rows: Optional[int] = None,
    method: str = "closed_form",
    steps: int = 50,
    nodes: Optional[int] = None,
    causal: bool = True,
    memory_budget_mb: float = 128.0,
    contribution: str = "norm",
) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    r"""Maps of the component scopes of a parallel layer, built in chunks of query rows.

    Scope parts of token j in token i: ``ATB`` h_{i<-j}; ``LN2`` [i = j] N2(x_i) less beta (the
    FF input); ``FF`` [i = j] token i's part of FF(N2(x_i)); ``RES2`` h_{i<-j} + FF_{i<-j}, the
    whole layer (real output y_i). Entries: L2 norms (``"norm"``) or ALTI's L1 contributions
    against the scope's real output (``"alti"``: x_i + attn_branch_out_i, N2(x_i), FF(N2(x_i)),
    y_i; rows then normalised to 1), pad rows and columns and (causal) j > i exactly 0.

    Returns:
        (maps, errors) as :func:`~captum_normattr.decompose.kinds.pre_ln.pre_ln_component_scope_maps`:
        ``"ff"`` / ``"layer"`` (max over real tokens of |FF parts + bias - real FF output| and
        |layer parts + biases - real layer output|) and their ``*_per_example`` (B,).
    """
    score = scope_scorer(
        contribution,
        {"ATB": attention_block_output(layer), "LN2": layer.ln2_out, "FF": layer.ff_out, "RES2": layer.layer_out},
    )
    b, t, _ = layer.hidden_in.shape
    chunk = scope_chunk_rows(layer, chunk_rows, memory_budget_mb, causal)
    maps = {s: layer.hidden_in.new_zeros(b, t, t) for s in PARALLEL_SCOPES}
    ff_err = layer.hidden_in.new_zeros(b, t)
    layer_err = layer.hidden_in.new_zeros(b, t)
    bias_o = output_bias(layer)

    for start in range(0, t, chunk):
        rows = slice(start, min(t, start + chunk))
        r = torch.arange(rows.start, rows.stop, device=layer.hidden_in.device)
        cols = rows.stop if causal else t  # causal: sources j > i have exactly zero parts
        h = residual_parts(layer, rows, cols)
        maps["ATB"][:, rows, :cols] = score("ATB", h, rows)
        real = layer.ln2_in[:, rows]
        maps["LN2"][:, r, r] = score("LN2", apply_norm_to_parts(real.unsqueeze(2), real, layer.ln2), rows)[..., 0]
        own, ff_b = parallel_ff_parts(layer, rows, method, steps, nodes)
        maps["FF"][:, r, r] = score("FF", own, rows)[..., 0]
        ff_err[:, rows] = (own[:, :, 0] + ff_b - layer.ff_out[:, rows]).abs().amax(-1)
        h[:, r - rows.start, r] += own[:, :, 0]
        maps["RES2"][:, rows, :cols] = score("RES2", h, rows)
        layer_err[:, rows] = (h.sum(2) + bias_o + ff_b - layer.layer_out[:, rows]).abs().amax(-1)
        del h, own
    return finish_scope_maps(maps, ff_err, layer_err, valid, causal, contribution)


# --- DecompX ------------------------------------------------------------------------------
def parallel_layer_parts(
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
    r"""DecompX's step of a parallel layer: parts of the layer input x to parts of its output.

    y_{i<-k} = x_{i<-k} + sum_h (sum_j alpha^h_ij N1(x)_{j<-k} W_V^h) W_O^h + FF_{i<-k}(N2(x)_{i<-k})

    Both norms at their real scale, the FF linear in its input parts through
    :func:`~captum_normattr.decompose.methods.decompx.parts.ff_coefficients` at the real N2(x) (its parts
    are those of x, not of x + attention). Biases as in the pre-LN step (in ``"spread"``,
    W_O b_V + b_O over the attention-plus-residual parts, beta2 and the FF biases over the
    FF's parts).

    Args:
        parts, bias, layer, value_weight, value_bias, bias_mode, rows, memory_budget_mb, coefs:
            as in :func:`~captum_normattr.decompose.kinds.pre_ln.pre_ln_layer_parts`.

    Returns:
        (parts (B, R, K, D), bias part (B, R, D)) of the layer output at ``rows``.
    """
    return two_branch_layer_parts(parts, bias, layer, value_weight, value_bias, bias_mode, rows,
                                          memory_budget_mb, coefs, ff_reads_block=False)


def frozen_parallel_layer(
    x: Tensor,
    layer: LayerTensors,
    value_weight: Tensor,
    value_bias: Optional[Tensor],
    with_bias: bool,
    coefs: Dict[str, Tensor],
    rows: Optional[Tensor] = None,
) -> Tensor:
    r"""A parallel layer with its nonlinear quantities frozen at the real values: (B, R, D).

    x + Attn(N1(x)) + FF(N2(x)), linear in ``x`` without ``with_bias`` (the map of
    :func:`parallel_layer_parts` applied to one part); arguments as in
    :func:`~captum_normattr.decompose.kinds.pre_ln.frozen_pre_ln_layer`.
    """
    hcur = frozen_attention_block(x, layer, value_weight, value_bias, with_bias, rows)
    sel = (lambda z: z) if rows is None else (lambda z: z[:, rows])
    return hcur + frozen_ff_branch(sel(x), sel(layer.ln2_in), layer, with_bias, coefs, rows)


def frozen_parallel_layer_vjp(
    g: Tensor,
    layer: LayerTensors,
    value_weight: Tensor,
    coefs: Dict[str, Tensor],
    rows: Optional[Tensor] = None,
    valid: Optional[Tensor] = None,
) -> Tensor:
    r"""The transpose of :func:`frozen_parallel_layer`'s linear part: J^T g = (I + A^T) g + N2^T F^T g.

    Args:
        g: (..., B, R, D) cotangent(s) of the layer output at ``rows`` (all T rows if None).
        layer, value_weight, coefs, rows, valid: as in
            :func:`~captum_normattr.decompose.kinds.pre_ln.frozen_pre_ln_layer_vjp`.

    Returns:
        (..., B, T, D) the cotangent of the layer input.
    """
    g_x = attention_block_vjp(g, layer, value_weight, rows, valid)
    g_ff = ff_branch_vjp(g, layer.ln2_in if rows is None else layer.ln2_in[:, rows], layer, coefs, rows)
    if rows is None:
        return g_x.add_(g_ff)
    return g_x.index_add_(g_x.dim() - 2, rows.to(g_x.device), g_ff)


# --- capture ------------------------------------------------------------------------------
#: What the capture records of a parallel layer: the pre-LN keys and the attention branch output
#: as it joins the stream (the model never forms x + Attn); both norms read the layer input.
PARALLEL_CAPTURE = CaptureRecipe(
    extra_keys=("attn_branch_out",),
    identity_checks=PRE_LN_CAPTURE.identity_checks + (
        ("second norm input vs the layer input (parallel branches)", "ln2_in", "hidden_in"),),
    branch_output="attn_branch_out",
)


class ParallelKind(LayerKind):
    r"""Parallel attention + FF layers (GPT-NeoX/Pythia; see the module docstring)."""

    name = "parallel"
    methods = frozenset(KIND_METHODS)
    #: the FF block reads the layer input: its route edge runs x_{l,i} -> f_{l,i} -> x_{l+1,i}
    route_ff_reads_input = True
    globenc_maps = PARALLEL_MAPS
    default_map = PARALLEL_DEFAULT_MAP
    whole_layer_scope = "RES2"
    capture = PARALLEL_CAPTURE

    def check_map(self, name: str) -> None:
        check_parallel_map(name)

    def norm_maps(self, layer, valid, names):
        return parallel_layer_maps(layer, valid, names, layer.causal)

    def mixing_ratio_name(self, map_name):
        return map_name if map_name in PARALLEL_NORM_MAPS else None

    def alti_map(self, layer, valid, memory_budget_mb):
        return parallel_alti_map(layer, valid, self.alti_chunk_rows(layer, memory_budget_mb), layer.causal)

    def completeness_error(self, layer, valid):
        return parallel_completeness_error(layer, valid)

    def example_completeness_error(self, layer, valid):
        return parallel_example_completeness_error(layer, valid)

    def attention_block_output(self, layer):
        return attention_block_output(layer)

    def route_form(self, layer):
        r"""The record with ``ln2_in`` the real h_i = x_i + Attn(N1(x))_i (:func:`attention_block_output`), the
        total of the head edges and the residual x_i."""
        return dataclasses.replace(layer, ln2_in=attention_block_output(layer))

    def route_output_edges(self, layer):
        r"""h_i (``"residual"``, from m_{l,i}) and the real FF output FF(N2(x_i)) (``"ff"``, from x_{l,i})."""
        return torch.stack([attention_block_output(layer), layer.ff_out], -2), ("residual", "ff")

    def logit_form(self, layer):
        # both branches write to the stream directly: the attention parts and the FF output are already
        # what ALTI-Logit reads (the layer's own completeness error is the kind's)
        return layer

    def scope_maps(self, layer, valid, options):
        return parallel_component_scope_maps(
            layer, valid, options.chunk_rows, options.method, options.steps, options.nodes, layer.causal,
            options.memory_budget_mb, options.contribution,
        )

    def check_ff_options(self, options, family):
        if options.ignore_low_gamma:
            raise ValueError(
                f"{family} has parallel layers: ignore_low_gamma is not supported there. The LayerNorm-gamma ablation "
                "of Kobayashi et al. 2023 acts on the LayerNorms that close the attention block and the layer of a "
                "post-LN encoder; a parallel layer's norms sit before its branches. Use ignore_low_gamma=0"
            )

    def decompx_step(self, parts, bias, layer, value_weight, value_bias, bias_mode="separate", rows=None,
                     memory_budget_mb=256.0, coefs=None):
        return parallel_layer_parts(parts, bias, layer, value_weight, value_bias, bias_mode, rows, memory_budget_mb,
                                    coefs)

    def frozen_layer(self, x, layer, value_weight, value_bias, with_bias, coefs, rows=None):
        return frozen_parallel_layer(x, layer, value_weight, value_bias, with_bias, coefs, rows)

    def frozen_layer_vjp(self, g, layer, value_weight, coefs, rows=None, valid=None):
        return frozen_parallel_layer_vjp(g, layer, value_weight, coefs, rows, valid)

    def join_checks(self, layer):
        return {"layer output vs the layer input plus both branch outputs": relative_difference(
            layer.layer_out, layer.hidden_in + layer.attn_branch_out + layer.ff_out, temporary=True)}
