r"""ALTI-Logit (Ferrando et al. 2023): signed logit contributions of the input tokens (docs/design.md, section 7).

The logit of a decoder is u . FinalNorm(x_{L,i}) + bias_u; the final residual stream is the
embedding plus every layer's attention update (split over source tokens), attention bias
and FF update. Each piece maps to its logit through :func:`logit_direction` (the final norm
at its real scale), and the attention updates are carried to the input tokens by the ALTI
rollout of the layers below (:func:`alti_logit_terms`). A layer kind gives the per-layer
pieces in its pre-LN form (``LayerKind.logit_form``); the many-position version is
:func:`~captum_normattr.decompose.primitives.multi_position.alti_logit_rows`.

The rows of an ALTI map sum to 1 whatever the kernel that computed them (the native or
compiled one of :mod:`~captum_normattr.decompose.methods.alti`), so a wrong map moves logit
between tokens without changing the completeness delta. :func:`alti_map_check` recomputes
the first rows of a causal layer's map with the torch path (the map of the layer's first
tokens, :func:`token_prefix`) and returns the largest difference, which ALTI-Logit's
consistency guard judges (docs/reliability.md, "Consistency guards").
"""
from __future__ import annotations

import copy
import math
from typing import Any, Dict, Optional

import torch
from torch import Tensor

from captum_normattr.decompose.primitives.channel_mixing import channel_parts_rows, is_channel_mixing
from captum_normattr.decompose.methods.alti import COMPILE_MIN_EXAMPLE_ELEMENTS
from captum_normattr.decompose.primitives.attention import project_values
from captum_normattr.decompose.primitives.layer_norm import norm_scale
from captum_normattr.decompose.primitives.rollout import LayerMapStore
from captum_normattr.decompose.records import LayerTensors

__all__ = [
    "ALTI_CHECK_ROWS",
    "ALTI_MAP_CHECK",
    "alti_logit_terms",
    "alti_map_check",
    "attention_update_at",
    "logit_direction",
    "logit_terms",
    "token_prefix",
]

#: Query rows of a causal layer's ALTI map that :func:`alti_map_check` recomputes (at most; fewer
#: where the layer is wide, so that the recomputation stays below the compiled kernels' size).
ALTI_CHECK_ROWS = 16
#: The name of the check in the consistency guard's message.
ALTI_MAP_CHECK = "ALTI map's first rows recomputed with the torch path"
#: The fields of a :class:`~captum_normattr.decompose.records.LayerTensors` whose second axis is the token axis.
_TOKEN_FIELDS = (
    "hidden_in", "ln1_in", "ln1_out", "ln2_in", "ln2_out", "ff_out", "layer_out", "context", "attn_post_in",
    "attn_post_out", "ff_post_in", "ff_post_out", "attn_branch_out", "own_after",
)


def logit_direction(params, real_input: Tensor, unembed: Tensor) -> Tensor:
    r"""The vector w_i that maps a piece v of the final residual stream to its logit, v . w_i.

    The final norm is linearised at the REAL scale of x_{L,i}: a piece v maps to
    gamma * c(v) / s(x_{L,i}) (c = centering for LayerNorm, identity for RMSNorm), whose logit
    is u . gamma c(v) / s = v . c(gamma * u) / s (centering is symmetric).

    Args:
        params: the final norm's :class:`~captum_normattr.decompose.records.NormParams`.
        real_input: (B, D) the real input x_{L,i} of the final norm at the explained positions.
        unembed: (B, D) the unembedding direction u (W_U[target], or W_U[target] - W_U[foil]).

    Returns:
        (B, D).
    """
    w = unembed if params.weight is None else unembed * params.weight
    if params.kind == "layernorm":
        w = w - w.mean(-1, keepdim=True)
    return w / norm_scale(real_input, params).unsqueeze(-1)


def attention_update_at(layer: LayerTensors, position: Tensor) -> Tensor:
    r"""The attention update of layer l at the explained positions, split over source positions.

    Entry [b, j] is sum_h alpha^h_ij f^h(LN1(x_j)) for i = position[b]: the pieces whose
    logits ALTI-Logit carries to the input tokens (:func:`alti_logit_terms`).

    Args:
        layer: the layer's tensors (pre-LN).
        position: (B,) long explained positions.

    Returns:
        (B, T, D).
    """
    bidx = torch.arange(position.shape[0], device=position.device)
    if is_channel_mixing(layer.probs):  # a hybrid mixer: the one row of its factored mixing, no (N, T, D) projection
        return torch.cat([channel_parts_rows(layer.probs.select(slice(b, b + 1)), layer.values[b:b + 1],
                                             layer.head_out_weight(), int(p), int(p) + 1)[:, 0]
                          for b, p in enumerate(position.tolist())])
    projected = project_values(layer.values, layer.head_out_weight())  # (B, H, T, D)
    return torch.einsum("bht,bhtd->btd", layer.probs[bidx, :, position], projected)


def alti_logit_terms(
    updates: Tensor,
    alti_maps: LayerMapStore,
    embedding: Tensor,
    ff_updates: Tensor,
    attention_biases: Tensor,
    final_params,
    final_in: Tensor,
    final_out: Tensor,
    unembed: Tensor,
    unembed_bias: Tensor,
    valid: Tensor,
    position: Tensor,
) -> Dict[str, Tensor]:
    r"""ALTI-Logit (Ferrando et al. 2023): signed logit contributions of input tokens.

    logit = u . FinalNorm(x_{L,i}) + bias_u, with x_{L,i} = x_{0,i} + sum_l (sum_j attn_{l,i<-j}
    + b_O^l + FF_l(i)). Each piece maps to its logit through :func:`logit_direction`. The
    attention update of layer l splits over source positions j; its logit is carried to the
    input tokens k by row j of the ALTI rollout R_{l-1} of the layers below (R_{-1} = I, rows
    sum to 1):  contribution_k = sum_l sum_j logit(attn_{l,i<-j}) R_{l-1}[j, k], computed as
    matrix products down the stored maps (O(L^2 T^2) work reading each map once, no T x T x T
    product).
    The embedding at i, the FF updates, the attention output biases and the final norm's
    beta (with the LM head bias) belong to no token and are returned separately, and so is
    the logit that the rollout carries to no token: a real row of an ALTI map is all zero
    when every part of that token lies farther from the block's real output than the zero
    vector (the clamp max(0, .) removes them all; large attention biases do this), and the
    logit routed through it, sum_j logit(attn_{l,i<-j}) (1 - sum_k R_{l-1}[j, k]), is
    ``unattributed`` (docs/design.md, section 7, ALTI-Logit; docs/fidelity.md).

    Args:
        updates: (B, L, T, D) per layer, :func:`attention_update_at` (source position j).
        alti_maps: the ALTI maps of the layers (a
            :class:`~captum_normattr.decompose.primitives.rollout.LayerMapStore`); only layers 0 to L - 2 are
            read (the top layer's update is carried down by the maps below it).
        embedding: (B, D) the first layer's input x_{0,i} at the explained positions.
        ff_updates: (B, L, D) every layer's FF output at the explained positions.
        attention_biases: (L, D) every layer's attention output bias b_O (zeros if none).
        final_params: the final norm's parameters.
        final_in, final_out: (B, D) real input and output of the final norm at the explained positions.
        unembed: (B, D) unembedding direction per example.
        unembed_bias: (B,) the LM head bias along it (0 if none).
        valid: (B, T) bool.
        position: (B,) explained positions i.

    Returns:
        dict with ``scores`` (B, T) token contributions; ``layer_token_contributions``
        (B, L, T) (the same per layer, summing to ``scores``); ``layer_logit_updates``
        (B, L, T) logit of attn_{l,i<-j} per source position j (before the rollout);
        ``embedding`` (B,), ``ff`` (B, L), ``attention_bias`` (B, L), ``final_bias`` (B,),
        ``unattributed`` (B, L) (logit of layer l routed through empty ALTI rows): the
        no-token terms; ``logit`` (B,) the model's real logit (from the real final
        norm output); ``reconstruction`` (B,) tokens + no-token terms; ``delta`` (B,)
        logit - reconstruction.
    """
    w = logit_direction(final_params, final_in, unembed)  # (B, D)
    vm = valid.to(w.dtype)
    n_layers = updates.shape[1]
    logit_updates = torch.einsum("bltd,bd->blt", updates, w) * vm.unsqueeze(1)  # (B, L, T)
    # Row l times R_{l-1} = M_{l-1} ... M_0, all rows at once: going down the maps, M_m multiplies
    # the rows of every layer above it in one matrix product ((L - 1 - m) x T times T x T), so
    # each map is read once instead of once per layer above it (L - 1 products, not L (L - 1) / 2).
    contrib = logit_updates.clone()
    for m in range(n_layers - 2, -1, -1):
        contrib[:, m + 1 :] = alti_maps.rows_times_layer(contrib[:, m + 1 :], m)
    contrib = contrib * vm.unsqueeze(1)
    # Logit that reaches no input token: rows of R_{l-1} summing to less than 1 (an ALTI row is all
    # zero when every part lies farther from the block output than the zero vector, which large
    # biases cause). mass_l = R_{l-1} 1, by matrix-vector products up the maps.
    mass = vm.clone()
    lost = []
    for l in range(n_layers):
        if l > 0:
            mass = alti_maps.layer_times_column(mass, l - 1)
        lost.append((logit_updates[:, l] * (vm - mass)).sum(-1))
    unattributed = torch.stack(lost, 1)  # (B, L)
    final_bias = unembed_bias.to(w.dtype)
    if final_params.bias is not None:
        final_bias = final_bias + (unembed * final_params.bias).sum(-1)
    emb = (embedding * w).sum(-1)
    ff_t = torch.einsum("bld,bd->bl", ff_updates, w)
    bias_t = attention_biases @ w.T  # (L, B)
    bias_t = bias_t.T
    logit = (final_out * unembed).sum(-1) + unembed_bias.to(w.dtype)
    return logit_terms(contrib.sum(1), contrib, logit_updates, emb, ff_t, bias_t, final_bias, unattributed, logit)


def logit_terms(
    scores: Tensor,
    contributions: Tensor,
    logit_updates: Tensor,
    embedding: Tensor,
    ff: Tensor,
    attention_bias: Tensor,
    final_bias: Tensor,
    unattributed: Tensor,
    logit: Tensor,
) -> Dict[str, Tensor]:
    r"""ALTI-Logit's terms as one record, with the reconstruction and its completeness error.

    The reconstruction is the token scores plus every no-token term (embedding, FF updates,
    attention biases, final bias, unattributed mass); ``delta`` = ``logit`` - reconstruction.
    The per-layer terms (``ff``, ``attention_bias``, ``unattributed``) and ``scores`` carry
    their layer / token axis last. Shared by :func:`alti_logit_terms` (one position) and
    :func:`~captum_normattr.decompose.primitives.multi_position.alti_logit_rows` (n positions).
    """
    recon = scores.sum(-1) + embedding + ff.sum(-1) + attention_bias.sum(-1) + final_bias + unattributed.sum(-1)
    return {
        "scores": scores,
        "layer_token_contributions": contributions,
        "layer_logit_updates": logit_updates,
        "embedding": embedding,
        "ff": ff,
        "attention_bias": attention_bias,
        "final_bias": final_bias,
        "unattributed": unattributed,
        "logit": logit,
        "reconstruction": recon,
        "delta": logit - recon,
    }


def token_prefix(layer: LayerTensors, rows: int) -> LayerTensors:
    r"""The record of a causal layer restricted to its first ``rows`` tokens.

    With causal attention, token i depends on the tokens j <= i only, so the restricted record
    is exactly the layer run on the prefix: every map of it equals the first ``rows`` rows
    (and columns) of the full layer's map. Tensors are views (no copy); ``checks`` are empty.

    Args:
        layer: a causal layer's tensors.
        rows: the number of leading tokens kept (1 <= rows <= T).

    Returns:
        A new :class:`~captum_normattr.decompose.records.LayerTensors` sharing the weights.

    Examples::

        >>> first = token_prefix(layer, 8)   # first.probs: (B, H, 8, 8)
    """
    if not layer.causal:
        raise ValueError("token_prefix needs causal attention: the first tokens of a bidirectional layer see the rest")
    b, t = layer.hidden_in.shape[:2]
    if not 1 <= rows <= t:
        raise ValueError(f"rows must be between 1 and the {t} tokens of the layer, got {rows}")
    view = copy.copy(layer)
    for name in _TOKEN_FIELDS:
        value = getattr(layer, name, None)
        if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[:2] == (b, t):
            setattr(view, name, value[:, :rows])
    view.probs = layer.probs.truncate(rows) if is_channel_mixing(layer.probs) else layer.probs[:, :, :rows, :rows]
    view.values = layer.values[:, :, :rows]
    scale = None if layer.ff is None else layer.ff.hidden_scale
    if isinstance(scale, Tensor) and scale.dim() >= 2 and scale.shape[:2] == (b, t):
        view.ff = copy.copy(layer.ff)
        view.ff.hidden_scale = scale[:, :rows]
    view.checks = {}
    return view


def alti_map_check(kind: Any, layer: LayerTensors, valid: Tensor, alti_map: Tensor, memory_budget_mb: float,
                   rows: Optional[int] = None) -> Optional[Tensor]:
    r"""Largest |difference| between the first rows of a causal layer's ALTI map and the same rows recomputed.

    The rows are recomputed by the layer kind's own ``alti_map`` on the layer's first tokens
    (:func:`token_prefix`), a problem small enough (``rows`` x ``rows`` x D below
    :data:`~captum_normattr.decompose.methods.alti.COMPILE_MIN_EXAMPLE_ELEMENTS`) that the
    default kernel choice runs the plain torch (eager) path on it: a native or compiled
    kernel that returned wrong rows for the full map is caught, although the rows of both
    sum to 1 (so the completeness delta cannot see it). Cost: ``rows``^2 / T^2 of the map.
    With the compiled kernels forced on at every size (``use_compiled_kernel(True)``) both
    runs use the same kernel and the check compares it with itself.

    Args:
        kind: the layer's kind (:func:`~captum_normattr.decompose.kinds.registry.layer_kind`).
        layer: the layer's tensors (causal).
        valid: (B, T) bool.
        alti_map: (B, T, T) the layer's ALTI map (``kind.alti_map(layer, valid, ...)``).
        memory_budget_mb: as for ``kind.alti_map``.
        rows: the rows recomputed (None: :data:`ALTI_CHECK_ROWS`, fewer for a wide layer).

    Returns:
        A 0-dim tensor (map entries lie in [0, 1], so the difference is relative), or None
        where nothing independent can be checked: a bidirectional layer, or a sequence no
        longer than the rows (its whole map was computed on the same path).

    Examples::

        >>> err = alti_map_check(kind, layer, valid, kind.alti_map(layer, valid, 128.0), 128.0)
    """
    t, d = layer.hidden_in.shape[1], layer.hidden_in.shape[-1]
    if rows is None:
        rows = min(ALTI_CHECK_ROWS, math.isqrt(max(0, COMPILE_MIN_EXAMPLE_ELEMENTS - 1) // max(1, d)))
    rows = min(int(rows), t)
    if not layer.causal or rows < 1 or rows >= t:
        return None
    again = kind.alti_map(token_prefix(layer, rows), valid[:, :rows], memory_budget_mb)
    return (alti_map[:, :rows, :rows] - again.to(alti_map.dtype)).abs().amax()
