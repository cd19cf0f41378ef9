r"""DecompX's forward algorithm: per-input-token parts carried through every layer (docs/design.md, section 8).

The forward algorithm (:class:`PartsPropagation`) carries all T parts, a (B, T, T, D)
tensor, through every layer (cost about T forward passes); it yields per-layer parts and
part norms, and it is the algorithm of the spread bias modes, whose weights depend on the
parts. It runs layer by layer as the recorded forward pass produces the layers, so that no
more than one layer's attention probabilities exist at a time: it keeps the current parts
and small per-layer results. Each layer's step is its kind's
(``LayerKind.decompx_step``, :func:`~captum_normattr.decompose.kinds.registry.layer_kind`).
:func:`propagate_parts` runs it over a list of captured layers. The head and the next-token
logit read the last layer's parts: :mod:`.readout`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from captum_normattr.decompose.kinds.registry import layer_kind
from captum_normattr.decompose.methods.decompx.parts import check_bias_mode, initial_parts
from captum_normattr.decompose.records import LayerTensors

__all__ = ["PartsPropagation", "PropagatedParts", "propagate_parts"]


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
            coefs: a pre-LN layer's :func:`~captum_normattr.decompose.methods.decompx.parts.ff_coefficients` (computed with the default
                number of quadrature nodes if None); ignored by a kind whose step does not use them (post-LN).
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
        kind = layer_kind(layer.topology)
        rows = torch.arange(t, device=dev) if (l < n - 1 or self.last_rows is None) else self.last_rows.to(dev)
        parts, bias = kind.decompx_step(
            self.parts, self.bias, layer, value_weight, value_bias, self.bias_mode, rows=rows,
            memory_budget_mb=self.memory_budget_mb, coefs=coefs,
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
        ff_coefs: per pre-LN layer its :func:`~captum_normattr.decompose.methods.decompx.parts.ff_coefficients` (computed with the default
            number of quadrature nodes if None); ignored by a kind whose step does not use them (post-LN).

    Returns:
        :class:`PropagatedParts`.
    """
    if len(layers) != len(value_params):
        raise ValueError("one (W_V, b_V) per layer is needed")
    prop = PartsPropagation(len(layers), valid, bias_mode, last_rows, memory_budget_mb)
    for l, (layer, (w_v, b_v)) in enumerate(zip(layers, value_params)):
        prop.step(layer, w_v, b_v, None if ff_coefs is None else ff_coefs[l])
    return prop.result()

