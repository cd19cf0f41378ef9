r"""The streaming engine: one recorded forward pass, every layer handed over as it is produced.

:func:`streamed_forward` runs the model once under
:func:`~captum_normattr.models.capture.session.recording` and gives every layer's
:class:`~captum_normattr.decompose.records.LayerTensors` to a callback the moment the forward
pass has produced it, so that the memory of a call does not grow with depth: the methods turn
each layer into its contribution (:class:`LayerContribution`, kept by a :class:`MapCollector`)
and forget it. Every layer is judged by a
:class:`~captum_normattr.models.guard.ConsistencyGuard` and checked for NaN and infinities
(:func:`layer_finite`); :func:`mark_non_finite` then sets the examples whose forward pass was
not finite to NaN in the result.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, TypeVar

import torch
from torch import Tensor, nn

from captum_normattr.models.prepared import PreparedInputs
from captum_normattr.decompose.primitives.rollout import LayerMapStore
from captum_normattr.decompose.records import LayerTensors
from captum_normattr.models.adapters import base_model
from captum_normattr.models.capture.recorder import RecordedTensorModifiedError, Recorder
from captum_normattr.models.capture.session import recording
from captum_normattr.models.guard import ConsistencyGuard

__all__ = [
    "LayerContribution",
    "MapCollector",
    "compute_dtype",
    "layer_finite",
    "mark_non_finite",
    "streamed_forward",
]

R = TypeVar("R")  # an AttributionResult (captum_normattr.result); typed loosely: results sit on a higher floor


def compute_dtype(model: nn.Module) -> torch.dtype:
    r"""float64 for float64 models, float32 otherwise (half-precision models are decomposed in float32)."""
    return torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32


def layer_finite(layer: LayerTensors, valid: Tensor, input_checked: bool = False) -> Tensor:
    r"""(B,) bool: True where the layer's input and output are finite at the real tokens.

    That covers every recorded tensor of the layer: a NaN or an infinity in the value
    states of a real key, in the attention rows of a real query or in the feed-forward
    output reaches the layer output of the real queries (a product with a NaN or an
    infinity is never finite again, not even times an exactly zero probability; a norm of
    a non-finite vector is NaN), so checking them as well only re-reads memory.
    ``input_checked``: the input is a tensor already checked (the previous layer's output).
    """
    v = valid.to(layer.hidden_in.device)
    ok = torch.ones(v.shape[0], dtype=torch.bool, device=v.device)
    for x in (layer.layer_out,) if input_checked else (layer.hidden_in, layer.layer_out):
        ok &= (torch.isfinite(x).all(-1) | ~v).all(-1)
    return ok


#: result fields that are the model's own values or indices, never overwritten with NaN
_KEEP_FIELDS = ("attention_mask", "explained_position", "target", "foil", "logits")


def mark_non_finite(result: R, finite: Optional[Tensor]) -> R:
    r"""NaN for every per-example number of the examples whose forward pass was not finite.

    An example is non-finite when its inputs or any recorded layer tensor held a NaN or an
    infinity at a real token (``finite`` False, see :func:`layer_finite`), or when any of its
    scores at a real token is not finite. Its scores (pads included), delta and every other
    per-example float tensor of the result (layer maps, rollout, class scores, ...) become
    NaN, so that no finite number is ever reported for it; the other examples are untouched.
    The model's own logits are kept as they are. A warning names the examples.

    Args:
        result: an :class:`~captum_normattr.result.AttributionResult`.
        finite: (B,) bool from :class:`~captum_normattr.attr.inputs.PreparedInputs`, or None.

    Returns:
        ``result``, or a copy with those examples set to NaN.
    """
    scores = result.scores
    real = result.attention_mask.to(scores.device).bool()
    overflow = ~(torch.isfinite(scores) | ~real).all(-1)
    forward = torch.zeros_like(overflow) if finite is None else ~finite.to(overflow.device)
    bad = overflow | forward
    if not bool(bad.any()):
        return result
    b = bad.shape[0]
    overflow = overflow & ~forward
    messages = []
    if bool(forward.any()):
        messages.append(f"example(s) {forward.nonzero().flatten().tolist()} hold NaN or infinite values in their "
                        "inputs or forward pass")
    if bool(overflow.any()):
        messages.append(
            f"the scores of example(s) {overflow.nonzero().flatten().tolist()} overflowed although their inputs and "
            "forward pass were finite: the method's own arithmetic left the dtype's range inside a layer (rollouts "
            "are carried with a power of two and do not overflow); run the model in float64")
    warnings.warn("; ".join(messages) + "; their scores are NaN", RuntimeWarning, stacklevel=3)
    updates = {}
    for f in fields(result):
        value = getattr(result, f.name)
        if f.name in _KEEP_FIELDS or not isinstance(value, Tensor) or not value.is_floating_point():
            continue
        if value.dim() == 0 or value.shape[0] != b:
            continue
        rows = bad.to(value.device).view(b, *([1] * (value.dim() - 1)))
        updates[f.name] = value.masked_fill(rows, float("nan"))
    return replace(result, **updates)


@contextlib.contextmanager
def streamed_forward(
    model: nn.Module,
    adapter,
    prepared: PreparedInputs,
    on_layer: Callable[[LayerTensors], None],
    top_model: bool = False,
    keep_calls: bool = False,
    guard: Optional[ConsistencyGuard] = None,
    probabilities: bool = True,
) -> Iterator[Tuple[Recorder, Any]]:
    r"""Run one recorded forward pass, handing every layer to ``on_layer`` as it is produced.

    Args:
        model: the user's model.
        adapter: its adapter.
        prepared: validated inputs (``prepared.two_way``: the layers are recorded as not causal).
        on_layer: callback receiving each layer's :class:`LayerTensors`. Before it runs,
            ``prepared.finite`` is updated with the layer's finiteness (:func:`layer_finite`).
        top_model: run the whole model (heads included) instead of the bare Transformer.
        keep_calls: allow :meth:`Recorder.rerun_layer` inside the block.
        guard: judges every layer's consistency checks before ``on_layer`` runs, and warns
            (once) when the block ends; None: a non-strict :class:`ConsistencyGuard`.
        probabilities: False: the layers' attention runs the model's own implementation
            (sdpa, ...) and the handed-over layers carry no probabilities (``probs=None``);
            reruns (``keep_calls``) still record them (:func:`~captum_normattr.models.capture.session.recording`).

    A forward pass that changes a recorded tensor in place before any layer was handed over
    (:class:`~captum_normattr.models.capture.recorder.RecordedTensorModifiedError`) is run once more,
    with those tensors recorded as copies.

    Yields:
        (recorder, model output). The hooks stay in place until the block ends, so that
        layers can be recomputed there.
    """
    # the last layer output checked, kept alive: while it lives, no other tensor can have its
    # memory, so the same address, shape, strides and dtype mean the same elements
    checked: List[Optional[Tensor]] = [None]
    guard = ConsistencyGuard(adapter.family) if guard is None else guard

    def checked_on_layer(layer: LayerTensors) -> None:
        guard.check(layer)
        if prepared.finite is not None:
            last, x = checked[0], layer.hidden_in
            same_input = last is not None and (x.data_ptr(), x.shape, x.stride(), x.dtype, x.device) == (
                last.data_ptr(), last.shape, last.stride(), last.dtype, last.device)
            prepared.finite = prepared.finite & layer_finite(layer, prepared.valid, input_checked=same_input)
            checked[0] = layer.layer_out
        on_layer(layer)

    for attempt in range(2):
        with torch.no_grad(), recording(model, adapter, checked_on_layer, compute_dtype(model), keep_calls,
                                        probabilities, prepared.two_way) as rec:
            try:
                out = (model if top_model else base_model(model))(**prepared.forward_kwargs())
            except RecordedTensorModifiedError as e:
                if attempt or not e.retry:
                    raise
                continue  # the changed tensors are recorded as copies in the next pass
            rec.check_complete()
            yield rec, out
            guard.finish()
            return


@dataclass
class LayerContribution:
    r"""What one layer contributes to a decomposition.

    Attributes:
        map: (B, T, T) the layer map.
        mixing_ratio: (B, T) or None.
        errors: per-layer numbers (scalars or (B,) tensors), stacked over layers at the end.
        maps: further (B, T, T) maps kept with the layer maps (e.g. every FF scope).
    """

    map: Tensor
    mixing_ratio: Optional[Tensor] = None
    errors: Dict[str, Tensor] = field(default_factory=dict)
    maps: Dict[str, Tensor] = field(default_factory=dict)


class MapCollector:
    r"""Keeps what the layers contribute: the maps (a :class:`LayerMapStore`) and small per-layer numbers.

    Args:
        num_layers: the model's number of layers.
        causal: the maps are lower triangular (a decoder).
        keep_maps: keep every layer's dense map (and the further maps of :attr:`LayerContribution.maps`);
            False: only what the explained rows' rollout needs.
    """

    def __init__(self, num_layers: int, causal: bool, keep_maps: bool) -> None:
        self.keep_maps = keep_maps
        self.store = LayerMapStore(num_layers, causal, dense=keep_maps)
        self.extra_maps: Dict[str, Tensor] = {}
        self.ratios: List[Optional[Tensor]] = []
        self.errors: Dict[str, List[Tensor]] = {}

    def add(self, index: int, c: LayerContribution) -> None:
        r"""Keep layer ``index``'s contribution ``c``."""
        self.store.put(index, c.map)
        if self.keep_maps:
            for name, m in c.maps.items():
                if name not in self.extra_maps:
                    b, t, _ = m.shape
                    self.extra_maps[name] = m.new_zeros(b, self.store.num_layers, t, t)
                self.extra_maps[name][:, index] = m
        self.ratios.append(c.mixing_ratio)
        for name, e in c.errors.items():
            self.errors.setdefault(name, []).append(e)

    def stacked_errors(self) -> Dict[str, Tensor]:
        r"""Every per-layer number stacked over the layers (scalars to (L,), (B,) tensors to (B, L))."""
        return {k: torch.stack(v, dim=min(1, v[0].dim())) for k, v in self.errors.items()}

    def mixing(self) -> Optional[Tensor]:
        r"""(B, L, T) the layers' mixing ratios, or None when a layer has none."""
        if not self.ratios or any(r is None for r in self.ratios):
            return None
        return torch.stack(self.ratios, 1)
