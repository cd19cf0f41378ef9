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

import torch
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

    def sink_position(self) -> Tensor:
        r"""(B,) long: the padded position of every example's first real token (its sink:
        ``[CLS]``, BOS, or the first prompt token of a decoder; left padding moves it)."""
        return self.attention_mask.bool().long().argmax(dim=-1)

    def sink_share(self) -> Tensor:
        r"""The share of the first real token in every example's absolute scores.

        Decoders park attention on their first token (the attention sink), and the
        norm-based methods and logit decompositions give it a large score: report it apart
        and read the ranking of the other tokens with ``exclude_sink=True``.

        Returns:
            (B,) float64: ``|s_first| / sum_t |s_t|`` over the real tokens (non-finite
            scores left out of the sum), NaN where all scores are 0.

        Examples:
            >>> import torch
            >>> r = AttributionResult("x", torch.tensor([[3.0, -1.0, 0.0]]), torch.ones(1, 3))
            >>> r.sink_share().tolist()
            [0.75]
        """
        s = self.scores.detach().to(torch.float64).abs()
        m = self.attention_mask.bool().to(s.device)
        s = torch.where(m & torch.isfinite(s), s, torch.zeros_like(s))
        first = s.gather(-1, self.sink_position().to(s.device)[:, None]).squeeze(-1)
        total = s.sum(-1)
        return torch.where(total > 0, first / torch.where(total > 0, total, torch.ones_like(total)),
                           torch.full_like(total, float("nan")))

    def ranking(self, index: int, *, exclude_sink: bool = False, absolute: bool = False) -> Tensor:
        r"""Example ``index``'s real tokens, most important first.

        Args:
            index: the example.
            exclude_sink: leave the first real token out of the ranking (the scores are
                unchanged).
            absolute: rank by ``|score|`` (default: by the score itself, so that the
                tokens of a signed method that speak *for* the output come first).

        Returns:
            (n,) long positions counted over the real tokens (the indexing of
            :meth:`example`); ties keep the earlier token first, NaN scores come last.
        """
        s = self.example(index)["scores"].detach().to("cpu", torch.float64)
        key = s.abs() if absolute else s
        key = torch.where(torch.isnan(key), torch.full_like(key, -float("inf")), key)
        order = torch.sort(key, descending=True, stable=True).indices
        if exclude_sink and order.numel() > 1:
            order = order[order != 0]
        return order

    def top_k(self, k: int, *, exclude_sink: bool = False, absolute: bool = False) -> List[Tensor]:
        r"""The ``k`` most important real tokens of every example (:meth:`ranking`).

        Args:
            k: how many (fewer where an example has fewer tokens).
            exclude_sink: leave the first real token out (see :meth:`sink_share`).
            absolute: rank by ``|score|``.

        Returns:
            per example a (min(k, n),) long tensor of positions over its real tokens.

        Examples:
            >>> import torch
            >>> r = AttributionResult("x", torch.tensor([[5.0, 1.0, 3.0]]), torch.ones(1, 3))
            >>> [t.tolist() for t in r.top_k(1)], [t.tolist() for t in r.top_k(1, exclude_sink=True)]
            ([[0]], [[2]])
        """
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        return [self.ranking(i, exclude_sink=exclude_sink, absolute=absolute)[:k]
                for i in range(self.scores.shape[0])]

    def aggregate(
        self,
        encoding: Any,
        level: Any = "word",
        reduce: str = "sum",
        *,
        keep_special: bool = False,
        texts: Optional[Any] = None,
        tokenizer: Optional[Any] = None,
    ) -> List[Tuple[List[str], Tensor]]:
        r"""The scores aggregated to words, sentences or character spans, per example.

        Args:
            encoding: the fast tokenizer's ``BatchEncoding`` of the inputs.
            level: ``"word"``, ``"sentence"`` (needs ``texts``) or, per example, a list
                of ``(start, end, label)`` character ranges (e.g. the role spans of
                :func:`~captum_normattr.aggregation.chat_role_char_spans`).
            reduce: ``"sum"`` (default, signs kept), ``"mean"`` or ``"max"``.
            keep_special: keep special tokens as spans of their own.
            texts: the tokenized texts (exact word labels; needed for sentences). They
                are checked against the encoding's offsets: a ``ValueError`` says so
                when they are not the texts that were tokenized.
            tokenizer: the tokenizer, for readable word labels without ``texts``
                (decoded from the word's ids; default: rebuilt from the token strings).

        Returns:
            per example ``(labels, (S,) scores)``; see :mod:`captum_normattr.aggregation`.
        """
        from captum_normattr.aggregation import aggregate_scores, spans_for

        out = []
        for i in range(self.scores.shape[0]):
            spans = spans_for(level, encoding, i, keep_special=keep_special, texts=texts, tokenizer=tokenizer)
            out.append(([sp.label for sp in spans], aggregate_scores(self.scores[i], spans, reduce)))
        return out

    def words(self, encoding: Any, reduce: str = "sum", *, keep_special: bool = False,
              texts: Optional[Any] = None, tokenizer: Optional[Any] = None) -> List[Tuple[List[str], Tensor]]:
        r"""The scores summed (``reduce``) over the pieces of every word: ``aggregate(encoding, "word", ...)``."""
        return self.aggregate(encoding, "word", reduce, keep_special=keep_special, texts=texts, tokenizer=tokenizer)


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
