r"""Many explained positions of one causal forward pass at once (docs/llm.md, "One pass for every token").

A teacher-forced forward pass over prompt + generated tokens holds, at position P + k - 1,
the prediction of generated token k. The per-layer quantities of the decompositions (the
ALTI maps, the norm-based maps, the frozen layers of DecompX) do not depend on which
position is explained; only the last steps do. This module does those last steps for n
positions together, from the same per-layer tensors:

- :func:`rollout_rows_at`: n rows of the rollout (ALTI, GlobEnc), O(n L T^2).
- :func:`unscaled_logit_directions` and :func:`attention_logit_updates`: the logit of
  every layer's attention update at every explained position, split over source tokens,
  computed as the forward pass runs (the final norm's real scale, known only at the end,
  is divided out afterwards: the logit of a piece is linear in it).
- :func:`alti_logit_rows`: ALTI-Logit's terms for n positions (the single-position
  version is :func:`~captum_normattr.decompose.methods.alti_logit.alti_logit_terms`).
- :func:`multi_logit_outputs`: the n explained logits of DecompX's adjoint pass, one per
  position (through :func:`~captum_normattr.decompose.methods.decompx.readout.frozen_next_token_logit`).

Every function is exact: row k equals the single-position computation at position k up to
floating-point rounding (``tests/test_llm_attribution.py``).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from captum_normattr.decompose.primitives.channel_mixing import head_rows
from captum_normattr.decompose.methods.alti_logit import logit_terms
from captum_normattr.decompose.methods.decompx.readout import frozen_next_token_logit
from captum_normattr.decompose.primitives.layer_norm import norm_scale
from captum_normattr.decompose.primitives.mixing import row_normalize
from captum_normattr.decompose.records import LayerTensors, NormParams
from captum_normattr.decompose.primitives.rollout import LayerMapStore, carried_rows_times, check_convention, ldexp_exact, unscale


def _dense_layers(maps: Union[Tensor, LayerMapStore, Sequence[Tensor]]) -> List[Tensor]:
    if isinstance(maps, LayerMapStore):
        return [maps.layer(l) for l in range(maps.num_layers)]
    if isinstance(maps, Tensor):
        if maps.dim() != 4:
            raise ValueError(f"maps must be (B, L, T, T), got shape {tuple(maps.shape)}")
        return [maps[:, l] for l in range(maps.shape[1])]
    return list(maps)


def rollout_rows_at(
    maps: Union[Tensor, LayerMapStore, Sequence[Tensor]], positions: Tensor, convention: str = "raw"
) -> Tensor:
    r"""Rows ``positions`` of the rollout M_{L-1} ... M_0, all at once.

    Args:
        maps: (B, L, T, T), a :class:`~captum_normattr.decompose.primitives.rollout.LayerMapStore` or a
            list of L (B, T, T) maps (bottom layer first).
        positions: (n,) long, the explained rows (shared by the batch).
        convention: ``"raw"`` or ``"row_normalized"`` (as in
            :func:`~captum_normattr.decompose.primitives.rollout.rollout`).

    Returns:
        (B, n, T): row k is row ``positions[k]`` of the rollout.

    Examples::

        >>> from captum_normattr.decompose.primitives.rollout import rollout
        >>> m = torch.rand(1, 3, 5, 5)
        >>> torch.allclose(rollout_rows_at(m, torch.tensor([1, 4]))[0], rollout(m)[0, [1, 4]])
        True
    """
    rows, scale = rollout_rows_at_scaled(maps, positions, convention)
    return ldexp_exact(rows, scale)


def rollout_rows_at_scaled(
    maps: Union[Tensor, LayerMapStore, Sequence[Tensor]], positions: Tensor, convention: str = "raw"
) -> Tuple[Tensor, Tensor]:
    r""":func:`rollout_rows_at` carried with a power of two per row, so that it cannot overflow.

    As :func:`~captum_normattr.decompose.primitives.rollout.rollout_rows_scaled`, one exponent per
    explained row: the rows of the rollout = rows * 2**log2_scale[..., None].

    Args:
        maps, positions, convention: as in :func:`rollout_rows_at`.

    Returns:
        (rows (B, n, T), log2_scale (B, n) int64; 0 wherever a row fits the dtype).
    """
    check_convention(convention)
    layers = _dense_layers(maps)
    prep = row_normalize if convention == "row_normalized" else (lambda m: m)
    rows = prep(layers[-1])[:, positions]  # (B, n, T)
    scale = torch.zeros(rows.shape[:2], dtype=torch.int64, device=rows.device)
    for m in reversed(layers[:-1]):
        rows, scale = carried_rows_times(rows, scale, prep(m))
    return unscale(rows, scale)


def unscaled_logit_directions(final_params: NormParams, unembed: Tensor) -> Tensor:
    r"""c(gamma * u): the logit direction of :func:`~captum_normattr.decompose.methods.alti_logit.logit_direction`
    times the final norm's real scale s(x_{L,i}).

    A piece v of the final residual stream at position i has the logit
    v . c(gamma * u) / s(x_{L,i}); everything but the scale is known before the forward pass.

    Args:
        final_params: the final norm's parameters.
        unembed: (..., D) unembedding directions.

    Returns:
        (..., D).
    """
    w = unembed if final_params.weight is None else unembed * final_params.weight.to(unembed.dtype)
    if final_params.kind != "rmsnorm":
        w = w - w.mean(-1, keepdim=True)
    return w


def attention_logit_updates(layer: LayerTensors, positions: Tensor, directions: Tensor) -> Tensor:
    r"""Logit of layer l's attention update at every explained position, per source token.

    Entry [b, k, j] = (sum_h alpha^h_{i_k j} f^h(LN1(x_j))) . w_k with i_k = positions[k]:
    computed per head as alpha^h_{i_k j} (v^h_j . (W_O^h w_k)), so that no (n, T, D) tensor
    is formed.

    Args:
        layer: the layer's tensors (pre-LN).
        positions: (n,) long explained positions.
        directions: (B, n, D) the logit directions w_k (unscaled ones work the same: the
            result is linear in them).

    Returns:
        (B, n, T).
    """
    head_w = layer.head_out_weight()  # (H, Dh, D)
    through_out = torch.einsum("hed,bnd->bhen", head_w, directions)  # (B, H, Dh, n)
    value_logits = layer.values @ through_out  # (B, H, T, n)
    probs = head_rows(layer.probs, positions)  # (B, H, n, T)
    return torch.einsum("bhnt,bhtn->bnt", probs, value_logits)


def alti_logit_rows(
    logit_updates: Tensor,
    maps: Union[Tensor, LayerMapStore, Sequence[Tensor]],
    embedding: Tensor,
    ff_updates: Tensor,
    attention_biases: Tensor,
    final_params: NormParams,
    final_in: Tensor,
    final_out: Tensor,
    unembed: Tensor,
    unembed_bias: Tensor,
    valid: Tensor,
) -> Dict[str, Tensor]:
    r"""ALTI-Logit's terms at n explained positions, from one set of ALTI maps.

    The same decomposition as :func:`~captum_normattr.decompose.methods.alti_logit.alti_logit_terms`
    (Ferrando et al. 2023; docs/design.md, section 7), with an extra axis of explained
    positions: the logit of layer l's attention update at position i_k, split over source
    tokens j, is carried to the input tokens by the ALTI rollout R_{l-1} of the layers below
    (matrix products of the (n, T) rows down the maps), and the no-token terms are kept apart.

    Args:
        logit_updates: (B, L, n, T) :func:`attention_logit_updates` with the UNSCALED
            directions :func:`unscaled_logit_directions` (divided by the real scale here).
        maps: the ALTI maps (see :func:`rollout_rows_at`).
        embedding: (B, n, D) the first layer's input at the explained positions.
        ff_updates: (B, L, n, D) every layer's FF output there.
        attention_biases: (L, D) every layer's b_O (zeros if none).
        final_params: the final norm's parameters.
        final_in, final_out: (B, n, D) the real input and output of the final norm there.
        unembed: (B, n, D) the unembedding direction of each position; unembed_bias: (B, n).
        valid: (B, T) bool.

    Returns:
        dict with (B, n, ...) versions of the keys of ``alti_logit_terms``: ``scores``
        (B, n, T), ``layer_token_contributions`` (B, n, L, T), ``layer_logit_updates``
        (B, n, L, T), ``embedding`` (B, n), ``ff`` (B, n, L), ``attention_bias`` (B, n, L),
        ``final_bias`` (B, n), ``unattributed`` (B, n, L), ``logit``, ``reconstruction``,
        ``delta`` (B, n).
    """
    layers = _dense_layers(maps)
    n_layers = len(layers)
    scale = norm_scale(final_in, final_params)  # (B, n)
    w = unscaled_logit_directions(final_params, unembed) / scale.unsqueeze(-1)  # (B, n, D)
    vm = valid.to(w.dtype)
    upd = logit_updates / scale[:, None, :, None] * vm[:, None, None, :]  # (B, L, n, T)
    contributions = []
    for l in range(n_layers):
        v = upd[:, l]
        for m in range(l - 1, -1, -1):
            v = v @ layers[m]
        contributions.append(v)
    contrib = torch.stack(contributions, 2) * vm[:, None, None, :]  # (B, n, L, T)
    mass = vm.clone()
    lost = []
    for l in range(n_layers):
        if l > 0:
            mass = torch.einsum("bjk,bk->bj", layers[l - 1], mass)
        lost.append((upd[:, l] * (vm - mass).unsqueeze(1)).sum(-1))  # (B, n)
    unattributed = torch.stack(lost, -1)  # (B, n, L)
    final_bias = unembed_bias.to(w.dtype)
    if final_params.bias is not None:
        final_bias = final_bias + (unembed * final_params.bias.to(w.dtype)).sum(-1)
    emb = (embedding * w).sum(-1)
    ff_t = torch.einsum("blnd,bnd->bnl", ff_updates, w)
    bias_t = torch.einsum("ld,bnd->bnl", attention_biases.to(w.dtype), w)
    logit = (final_out * unembed).sum(-1) + unembed_bias.to(w.dtype)
    return logit_terms(contrib.sum(2), contrib, upd.transpose(1, 2), emb, ff_t, bias_t, final_bias, unattributed, logit)


def multi_logit_outputs(
    positions: Tensor,
    last_rows: Tensor,
    final_params: NormParams,
    final_in: Tensor,
    directions: Tensor,
    direction_bias: Optional[Tensor],
) -> Callable[[Tensor], List[Tensor]]:
    r"""The explained outputs of a DecompX adjoint pass with n positions: one logit per position.

    Args:
        positions: (n,) long explained positions.
        last_rows: (R,) sorted long rows of the last layer kept by the
            :class:`~captum_normattr.decompose.methods.decompx.adjoint.AdjointPass` (contains ``positions``).
        final_params: the final norm's parameters; final_in: (B, T, D) its real input.
        directions: (B, n, D) u per position; direction_bias: (B, n) or None.

    Returns:
        ``outputs(y)`` for :meth:`~captum_normattr.decompose.methods.decompx.adjoint.AdjointPass.backward`:
        y (B, R, D) -> n tensors (B,), the frozen logit of position k.
    """
    index = torch.searchsorted(last_rows.to(positions.device), positions)

    def outputs(y: Tensor) -> List[Tensor]:
        return [
            frozen_next_token_logit(
                y[:, int(index[k])], final_params, final_in[:, int(positions[k])], directions[:, k],
                None if direction_bias is None else direction_bias[:, k],
            )
            for k in range(positions.shape[0])
        ]

    return outputs


__all__ = [
    "alti_logit_rows",
    "attention_logit_updates",
    "multi_logit_outputs",
    "rollout_rows_at",
    "rollout_rows_at_scaled",
    "unscaled_logit_directions",
]
