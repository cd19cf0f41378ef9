r"""The result types returned by ``decompose``: one base type, one subclass per kind of output.

Every result carries ``method``, ``scores`` (B, T), ``attention_mask`` (B, T),
``explained_position`` (B,), a ``delta`` (B,) or None and ``extras``. The per-example
accessor :meth:`AttributionResult.example` drops the pad positions of every
token-indexed tensor in one place: each class lists its token axes in ``TOKEN_AXES``.
Visualisation, the HTML/JSON report and the command line read results through this type.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Dict, List, Optional, Tuple

from torch import Tensor


def _move(value: Any, device) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _move(v, device) for k, v in value.items()}
    return value


@dataclass
class AttributionResult:
    r"""What every decomposition method returns for one batch.

    Attributes:
        method: readable method name, e.g. ``"GlobEnc (N_ENC)"``, ``"ALTI"``, ``"DecompX"``.
        scores: (B, T) the attribution of every input token; pads exactly 0.
        attention_mask: (B, T), 1 for real tokens.
        explained_position: (B,) long, the explained position of every example (the row
            of the rollout, the position of the explained logit), or None where the
            model's head fixes it.
        delta: (B,) the convergence delta (completeness error) of every example, or None
            for the class-agnostic maps, whose completeness errors are per layer in
            ``extras["completeness_error"]``.
        extras: method-specific tensors.
    """

    #: field name -> the token axes of the batched tensor (pads are dropped along them)
    TOKEN_AXES: ClassVar[Dict[str, Tuple[int, ...]]] = {"scores": (1,)}
    #: the axis kind (a key of :meth:`kept_positions`) over which ``explained_position`` counts
    EXPLAINED_AXES: ClassVar[str] = "TOKEN_AXES"
    #: fields that :meth:`example` leaves out
    NOT_PER_EXAMPLE: ClassVar[Tuple[str, ...]] = ("method", "attention_mask", "extras", "explained_position")

    method: str
    scores: Tensor
    attention_mask: Tensor
    explained_position: Optional[Tensor] = None
    delta: Optional[Tensor] = None
    extras: Dict[str, Tensor] = field(default_factory=dict)

    @property
    def signed(self) -> bool:
        r"""True when scores carry a sign (logit decompositions)."""
        return False

    def to(self, device) -> "AttributionResult":
        r"""A copy with every tensor moved to ``device``."""
        return replace(self, **{f.name: _move(getattr(self, f.name), device) for f in fields(self)})

    def real_tokens(self, index: int) -> Tensor:
        r"""(n,) long: the positions of the real (non-pad) tokens of example ``index``."""
        return self.attention_mask[index].bool().nonzero().squeeze(-1)

    def example(self, index: int) -> Dict[str, Any]:
        r"""One example's values with the pad positions removed.

        Args:
            index: the example in the batch.

        Returns:
            dict: every tensor field indexed at ``index`` (token axes keep the n real
            tokens only; tensors without a batch axis as they are), ``method``, and
            ``explained_position`` as an int counted over the real tokens (or None).
        """
        kept = self.kept_positions(index)
        out: Dict[str, Any] = {"method": self.method}
        for f in fields(self):
            name = f.name
            if name in self.NOT_PER_EXAMPLE:
                continue
            value = getattr(self, name)
            if not isinstance(value, Tensor) or value.dim() == 0:
                out[name] = value
                continue
            value = value[index]
            for axes, idx in kept.items():
                for axis in getattr(self, axes).get(name, ()):
                    value = value.index_select(axis - 1, self.axis_positions(name, axis, idx).to(value.device))
            out[name] = value
        pos = self.explained_position
        idx = kept[self.EXPLAINED_AXES]
        out["explained_position"] = None if pos is None else int((idx < int(pos[index])).sum())
        return out

    def kept_positions(self, index: int) -> Dict[str, Tensor]:
        r"""Example ``index``'s real positions per axis kind: the name of a class attribute
        mapping fields to axes (``"TOKEN_AXES"``) -> (n,) long positions kept along them."""
        return {"TOKEN_AXES": self.real_tokens(index)}

    def axis_positions(self, name: str, axis: int, positions: Tensor) -> Tensor:
        r"""The positions kept along ``axis`` (of the batched tensor) of field ``name``: by
        default the real positions themselves (a subclass may keep extra columns)."""
        return positions

    def aggregate(
        self,
        encoding: Any,
        level: Any = "word",
        reduce: str = "sum",
        *,
        keep_special: bool = False,
        texts: Optional[Any] = None,
    ) -> List[Tuple[List[str], Tensor]]:
        r"""The scores aggregated to words, sentences or character spans, per example.

        Args:
            encoding: the fast tokenizer's ``BatchEncoding`` of the inputs.
            level: ``"word"``, ``"sentence"`` (needs ``texts``) or, per example, a list
                of ``(start, end, label)`` character ranges (e.g. the role spans of
                :func:`~captum_normattr.aggregation.chat_role_char_spans`).
            reduce: ``"sum"`` (default, signs kept), ``"mean"`` or ``"max"``.
            keep_special: keep special tokens as spans of their own.
            texts: the tokenized texts (exact word labels; needed for sentences).

        Returns:
            per example ``(labels, (S,) scores)``; see :mod:`captum_normattr.aggregation`.
        """
        from captum_normattr.aggregation import aggregate_scores, spans_for

        out = []
        for i in range(self.scores.shape[0]):
            spans = spans_for(level, encoding, i, keep_special=keep_special, texts=texts)
            out.append(([sp.label for sp in spans], aggregate_scores(self.scores[i], spans, reduce)))
        return out

    def words(self, encoding: Any, reduce: str = "sum", *, keep_special: bool = False,
              texts: Optional[Any] = None) -> List[Tuple[List[str], Tensor]]:
        r"""The scores summed (``reduce``) over the pieces of every word: ``aggregate(encoding, "word", ...)``."""
        return self.aggregate(encoding, "word", reduce, keep_special=keep_special, texts=texts)


@dataclass
class DecompositionResult(AttributionResult):
    r"""Layer maps, their rollout and the token attributions of one batch (class-agnostic methods).

    Attributes:
        layer_maps: (B, L, T, T); entry [b, l, i, j] = how much token j contributes to
            token i in layer l. Pad rows and columns are exactly 0. None when the call
            asked not to keep them (long inputs).
        rollout: (B, T, T), the product of the layer maps (``rollout_convention``), or
            None when the call asked only for the explained rows.
        rollout_convention: ``"raw"`` or ``"row_normalized"``.
        mixing_ratio: (B, L, T) context-mixing ratio per layer and token, or None.
        extras: e.g. ``"completeness_error"`` (L,): the largest absolute error of parts +
            bias parts against the model's real tensors.
    """

    TOKEN_AXES: ClassVar[Dict[str, Tuple[int, ...]]] = {
        "scores": (1,), "layer_maps": (2, 3), "rollout": (1, 2), "mixing_ratio": (2,),
    }

    layer_maps: Optional[Tensor] = None
    rollout: Optional[Tensor] = None
    rollout_convention: str = "raw"
    mixing_ratio: Optional[Tensor] = None

    @property
    def num_layers(self) -> Optional[int]:
        return None if self.layer_maps is None else self.layer_maps.shape[1]


@dataclass
class LogitDecompositionResult(AttributionResult):
    r"""Signed scores of one explained output per example: a class logit or a next-token logit.

    Attributes:
        target: (B,) long: the explained class (encoders) or token id (decoders).
        foil: (B,) long foil token ids (the output explained is target minus foil), or None.
        logits: the model's real explained logits: (B,) for ALTI-Logit, (B, C) for DecompX.
    """

    target: Optional[Tensor] = None
    foil: Optional[Tensor] = None
    logits: Optional[Tensor] = None

    @property
    def signed(self) -> bool:
        return True


def strip_pads(values: Tensor, attention_mask: Tensor, index: int) -> Tensor:
    r"""The (T, ...) tensor ``values[index]`` restricted to the real tokens of example ``index``."""
    idx = attention_mask[index].bool().nonzero().squeeze(-1)
    return values[index].index_select(0, idx.to(values.device))


__all__ = ["AttributionResult", "DecompositionResult", "LogitDecompositionResult", "strip_pads"]
