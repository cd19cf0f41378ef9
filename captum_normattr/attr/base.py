r"""Shared machinery of the decomposition attributions: validate, capture, map, roll out."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from captum.attr import Attribution
from captum.log import log_usage
from torch import Tensor, nn

from captum_normattr.attr.inputs import PreparedInputs, explained_positions, prepare_inputs
from captum_normattr.decompose.records import LayerTensors
from captum_normattr.decompose.rollout import ROLLOUT_CONVENTIONS, rollout
from captum_normattr.models.adapters import base_model, get_adapter
from captum_normattr.models.capture import recording
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


class LayerDecompositionAttribution(Attribution):
    r"""Base class: per-layer token-to-token maps rolled out into token attributions.

    Subclasses implement :meth:`_layer_maps`.

    Args:
        model: a supported Hugging Face model (``*Model`` or ``*ForSequenceClassification``).
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
        if explained_position is None:
            explained_position = "last" if self.adapter.causal else 0
        if rollout not in ROLLOUT_CONVENTIONS:
            raise ValueError(f"rollout must be one of {ROLLOUT_CONVENTIONS}, got {rollout!r}")
        Attribution.__init__(self, model)
        self.model = model
        self.explained_position = explained_position
        self.rollout_convention = rollout

    # --- to implement -------------------------------------------------------------
    def _layer_maps(self, layers: List[LayerTensors], valid: Tensor) -> Tuple[Tensor, Optional[Tensor], Dict[str, Tensor]]:
        raise NotImplementedError

    # --- shared -------------------------------------------------------------------
    def capture(self, prepared: PreparedInputs) -> List[LayerTensors]:
        r"""Run one recorded forward pass of the base model and return its layer tensors."""
        return self.capture_full(prepared)[0]

    def capture_full(self, prepared: PreparedInputs):
        r"""One recorded forward pass: (layer tensors, final norm (params, input, output) or None).

        The final norm is recorded for pre-LN models (GPT-2, Llama family); None otherwise.
        """
        with torch.no_grad(), recording(self.model, self.adapter) as rec:
            base_model(self.model)(**prepared.forward_kwargs())
        dtype = compute_dtype(self.model)
        final = rec.final_norm_tensors(dtype) if self.adapter.final_norm is not None else None
        return rec.layer_tensors(dtype), final

    def decompose(self, inputs: Union[Tensor, Tuple[Tensor]], additional_forward_args: Any = None) -> DecompositionResult:
        r"""Decompose every layer and roll the maps out.

        Args:
            inputs: token ids (B, T) (or word embeddings (B, T, D)), or a 1-tuple.
            additional_forward_args: attention_mask (B, T) or (attention_mask, token_type_ids).

        Returns:
            :class:`~captum_normattr.DecompositionResult`.
        """
        prepared = prepare_inputs(self.model, self.adapter, inputs, additional_forward_args)
        valid = prepared.valid
        pos = explained_positions(self.explained_position, valid)
        with torch.no_grad():
            layers = self.capture(prepared)
            maps, mixing, extras = self._layer_maps(layers, valid)
            joint = rollout(maps, self.rollout_convention)
            scores = joint[torch.arange(joint.shape[0], device=joint.device), pos]
            scores = scores * valid.to(scores.dtype)
        return DecompositionResult(
            method=self.get_name(),
            layer_maps=maps,
            rollout=joint,
            scores=scores,
            attention_mask=prepared.attention_mask,
            explained_position=pos,
            rollout_convention=self.rollout_convention,
            mixing_ratio=mixing,
            extras=extras,
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
        return self._attribute(inputs, additional_forward_args)

    def _attribute(self, inputs, additional_forward_args):
        res = self.decompose(inputs, additional_forward_args)
        scores = res.scores
        return format_output(inputs, scores)

    def has_convergence_delta(self) -> bool:
        return False

    def get_name(self) -> str:
        return self.method_name
