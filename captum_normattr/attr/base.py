r"""Shared machinery of the decomposition attributions: validate, stream the layers, roll out.

Every class here turns each layer into its contribution (a (B, T, T) map, a mixing ratio,
completeness errors) the moment the forward pass has produced that layer
(:func:`~captum_normattr.models.capture.recording`), so that the memory of a call does not
grow with depth: only the per-layer maps and a few per-layer numbers are kept.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from captum.attr import Attribution
from captum.log import log_usage
from torch import Tensor, nn

from captum_normattr.attr.images import image_extras, pixel_attributions
from captum_normattr.attr.inputs import PreparedInputs, explained_positions, prepare_inputs
from captum_normattr.decompose.layer_kinds import LayerKind, layer_kind
from captum_normattr.decompose.records import LayerTensors
from captum_normattr.decompose.rollout import LayerMapStore, check_convention, rollout
from captum_normattr.models.adapters import base_model, get_adapter, layer_modules
from captum_normattr.models.capture import Recorder, recording
from captum_normattr.result import DecompositionResult


def format_output(inputs: Any, scores: Tensor, delta: Optional[Tensor] = None, return_convergence_delta: bool = False):
    r"""Captum's output convention: tuple in, tuple out; ``(scores, delta)`` when the delta is asked for.

    Args:
        inputs: what the caller passed as ``inputs`` (a tensor or a 1-tuple).
        scores: (B, T) token scores.
        delta: (B,) completeness error, needed when ``return_convergence_delta``.
        return_convergence_delta: append ``delta``.

    Returns:
        ``scores``, ``(scores,)``, or either of them paired with ``delta``.
    """
    out = (scores,) if isinstance(inputs, tuple) else scores
    return (out, delta) if return_convergence_delta else out


def compute_dtype(model: nn.Module) -> torch.dtype:
    r"""float64 for float64 models, float32 otherwise (half-precision models are decomposed in float32)."""
    return torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32


def check_memory_budget(memory_budget_mb: float) -> float:
    r"""The memory budget as a float, or a ValueError if it is not a positive number of MB."""
    if isinstance(memory_budget_mb, bool) or not isinstance(memory_budget_mb, (int, float)) or not memory_budget_mb > 0:
        raise ValueError(f"memory_budget_mb must be a positive number of MB, got {memory_budget_mb!r}")
    return float(memory_budget_mb)


@contextlib.contextmanager
def streamed_forward(
    model: nn.Module,
    adapter,
    prepared: PreparedInputs,
    on_layer: Callable[[LayerTensors], None],
    top_model: bool = False,
    keep_calls: bool = False,
) -> Iterator[Tuple[Recorder, Any]]:
    r"""Run one recorded forward pass, handing every layer to ``on_layer`` as it is produced.

    Args:
        model: the user's model.
        adapter: its adapter.
        prepared: validated inputs.
        on_layer: callback receiving each layer's :class:`LayerTensors`.
        top_model: run the whole model (heads included) instead of the bare Transformer.
        keep_calls: allow :meth:`Recorder.rerun_layer` inside the block.

    Yields:
        (recorder, model output). The hooks stay in place until the block ends, so that
        layers can be recomputed there.
    """
    with torch.no_grad(), recording(model, adapter, on_layer, compute_dtype(model), keep_calls) as rec:
        out = (model if top_model else base_model(model))(**prepared.forward_kwargs())
        if rec.layers_done != len(rec.layers):
            raise RuntimeError(
                f"the forward pass reached {rec.layers_done} of {len(rec.layers)} layers; the model's structure does not "
                f"match the {adapter.family} adapter"
            )
        yield rec, out


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


class _MapCollector:
    r"""Keeps what the layers contribute: the maps (a :class:`LayerMapStore`) and small per-layer numbers."""

    def __init__(self, num_layers: int, causal: bool, keep_maps: bool):
        self.keep_maps = keep_maps
        self.store = LayerMapStore(num_layers, causal, dense=keep_maps)
        self.extra_maps: Dict[str, Tensor] = {}
        self.ratios: List[Optional[Tensor]] = []
        self.errors: Dict[str, List[Tensor]] = {}

    def add(self, index: int, c: LayerContribution) -> None:
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
        return {k: torch.stack(v, dim=min(1, v[0].dim())) for k, v in self.errors.items()}

    def mixing(self) -> Optional[Tensor]:
        if not self.ratios or any(r is None for r in self.ratios):
            return None
        return torch.stack(self.ratios, 1)


class LayerDecompositionAttribution(Attribution):
    r"""Base class: per-layer token-to-token maps rolled out into token attributions.

    Subclasses implement :meth:`layer_contribution` (one layer's map, from its tensors).

    Args:
        model: a supported Hugging Face model (``*Model``, ``*ForSequenceClassification`` or
            ``*ForCausalLM``).
        explained_position: the explained row of the rollout: an int, ``"last"`` (the last
            real token) or a (B,) tensor. None (default): 0 ([CLS]) for encoders, ``"last"``
            for decoders.
        rollout: ``"raw"`` (default; the convention of the published figures) or
            ``"row_normalized"``.
    """

    method_name = "decomposition"

    def __init__(
        self, model: nn.Module, explained_position: Union[int, str, Tensor, None] = None, rollout: str = "raw"
    ) -> None:
        self.adapter = get_adapter(model)
        self.kind: LayerKind = layer_kind(self.adapter.pre_ln)
        if explained_position is None:
            explained_position = "last" if self.adapter.causal else 0
        if rollout not in ("raw", "row_normalized"):
            raise ValueError(f"rollout must be one of ('raw', 'row_normalized'), got {rollout!r}")
        check_convention(rollout)
        Attribution.__init__(self, model)
        self.model = model
        self.explained_position = explained_position
        self.rollout_convention = rollout

    # --- to implement -------------------------------------------------------------
    def layer_contribution(self, layer: LayerTensors, valid: Tensor, keep_maps: bool) -> LayerContribution:
        r"""One layer's contribution; ``keep_maps``: the caller keeps further per-layer maps."""
        raise NotImplementedError

    def finish_extras(self, errors: Dict[str, Tensor]) -> Dict[str, Tensor]:
        r"""The result's extras from the stacked per-layer errors (override to derive more)."""
        return errors

    # --- shared -------------------------------------------------------------------
    def decompose(
        self,
        inputs: Union[Tensor, Tuple[Tensor]],
        additional_forward_args: Any = None,
        return_layer_maps: bool = True,
        return_rollout: bool = True,
    ) -> DecompositionResult:
        r"""Decompose every layer as the forward pass reaches it, and roll the maps out.

        Args:
            inputs: token ids (B, T) (or word embeddings (B, T, D)), or a 1-tuple.
            additional_forward_args: attention_mask (B, T) or (attention_mask, token_type_ids).
            return_layer_maps: keep the (B, L, T, T) layer maps (and, for the FF
                decomposition, every scope's maps) in the result.
            return_rollout: also form the full (B, T, T) rollout, O(L T^3); without it only
                the explained rows are rolled out (O(L T^2)). Switch both off for long inputs.

        Returns:
            :class:`~captum_normattr.DecompositionResult`.
        """
        prepared = prepare_inputs(self.model, self.adapter, inputs, additional_forward_args)
        valid = prepared.valid
        pos = explained_positions(self.explained_position, valid)
        collector = _MapCollector(len(layer_modules(self.model, self.adapter)), self.adapter.causal, return_layer_maps or return_rollout)

        def on_layer(layer: LayerTensors) -> None:
            collector.add(layer.index, self.layer_contribution(layer, valid, return_layer_maps))

        with streamed_forward(self.model, self.adapter, prepared, on_layer):
            pass
        with torch.no_grad():
            maps = collector.store.dense()
            scores = collector.store.rollout_rows(pos, self.rollout_convention)
            scores = scores * valid.to(scores.dtype)
            joint = rollout(maps, self.rollout_convention) if return_rollout else None
            extras = self.finish_extras(collector.stacked_errors())
            extras.update(image_extras(prepared, scores))
            for name, m in collector.extra_maps.items():
                extras[name] = m
        return DecompositionResult(
            method=self.get_name(),
            scores=scores,
            attention_mask=prepared.attention_mask,
            explained_position=pos,
            delta=extras.get("example_completeness_error"),
            extras=extras,
            layer_maps=maps if return_layer_maps else None,
            rollout=joint,
            rollout_convention=self.rollout_convention,
            mixing_ratio=collector.mixing(),
        )

    @log_usage()
    def attribute(
        self,
        inputs: Union[Tensor, Tuple[Tensor]],
        target: Any = None,
        additional_forward_args: Any = None,
    ) -> Union[Tensor, Tuple[Tensor]]:
        r"""Token attributions: the explained row of the rolled-out layer maps.

        Args:
            inputs: token ids (B, T) (or word embeddings (B, T, D)), or a 1-tuple of them.
            target: accepted for Captum compatibility and ignored (the maps are class-agnostic).
            additional_forward_args: attention_mask (B, T) or (attention_mask, token_type_ids).

        Returns:
            (B, T) scores (a 1-tuple for tuple inputs); pad positions are exactly 0.
        """
        res = self.decompose(inputs, additional_forward_args, return_layer_maps=False, return_rollout=False)
        return format_output(inputs, pixel_attributions(inputs, res))

    def has_convergence_delta(self) -> bool:
        return False

    def get_name(self) -> str:
        return self.method_name
