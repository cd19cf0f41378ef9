r"""Interop with Captum's visualisation tools: scores for ``visualize_text``, an ``LLMAttributionResult``.

- :func:`normalize_scores`: scores scaled into [-1, 1] (max-abs per row; NaN stays NaN).
- :func:`to_visualization_records`: Captum ``VisualizationDataRecord``\ s for
  ``captum.attr.visualization.visualize_text`` (tokens and labels HTML-escaped).
- :func:`to_llm_attribution_result`: a ``captum.attr.LLMAttributionResult``
  (``plot_token_attr`` / ``plot_seq_attr``) from a decoder's rollout.

They need no matplotlib; Captum's visualisation module is imported by the functions that use it.
The pictures are :mod:`captum_normattr.present.visualization`.
"""
from __future__ import annotations

import html
from dataclasses import replace
from typing import Any, List, Optional, Sequence, Union

import torch
from torch import Tensor

from captum_normattr.present.figures import ArrayLike, to_numpy
from captum_normattr.tokens import visible_text
from captum_normattr.present.visualization import example_from_result, require_map, unpadded_tokens
from captum_normattr.result import AttributionResult

__all__ = ["normalize_scores", "to_llm_attribution_result", "to_visualization_records"]


def normalize_scores(scores: ArrayLike, mask: Optional[ArrayLike] = None, *, exclude_sink: bool = False) -> Tensor:
    r"""Scale scores into [-1, 1] by dividing by their maximum absolute value.

    Captum's ``visualize_text`` clips word attributions to [-1, 1], so raw
    norm-based scores (which can exceed 1, or be all tiny) must be normalised first.
    Works per row for a batch (B, T). Masked-out positions are set to 0 and ignored
    for the maximum. All-zero rows stay zero. The maximum is taken over the finite
    values only: NaN stays NaN (a score that could not be computed is never shown as a
    number) and +-inf become +-1.

    Args:
        scores: (T,) or (B, T) scores.
        mask: optional (T,) or (B, T) attention mask (nonzero = real token).
        exclude_sink: take the maximum over the real tokens but the first of each row
            (``[CLS]``, BOS, the first prompt token: where decoders keep their attention
            sink), so that a large first score does not wash out the others; the first
            token's value is clipped to [-1, 1]. Rows with a single real token are
            normalised as usual.

    Returns:
        A float tensor of the same shape with values in [-1, 1].

    Examples:
        >>> normalize_scores([2.0, -4.0, 1.0]).tolist()
        [0.5, -1.0, 0.25]
        >>> normalize_scores([float("nan"), 1.0, 2.0]).tolist()
        [nan, 0.5, 1.0]
        >>> normalize_scores([8.0, 1.0, 2.0], exclude_sink=True).tolist()
        [1.0, 0.5, 1.0]
    """
    s = torch.as_tensor(to_numpy(scores))
    squeeze = s.dim() == 1
    if squeeze:
        s = s.unsqueeze(0)
    m = (torch.as_tensor(to_numpy(mask)).reshape(s.shape) != 0) if mask is not None else torch.ones(s.shape, dtype=torch.bool)
    if mask is not None:
        s = torch.where(m, s, torch.zeros_like(s))
    counted = torch.isfinite(s) & m
    if exclude_sink:
        first = m.long().argmax(dim=1, keepdim=True)  # the first real token of every row
        sink = torch.zeros_like(m).scatter_(1, first, True)
        several = m.sum(1, keepdim=True) > 1
        counted = counted & ~(sink & several)
    denom = torch.where(counted, s.abs(), torch.zeros_like(s)).amax(dim=1, keepdim=True)
    out = s / torch.where(denom > 0, denom, torch.ones_like(denom))
    out = out.clamp(-1.0, 1.0).float()
    return out[0] if squeeze else out


def _per_example(value: Any, n: int, default: Any) -> List[Any]:
    if value is None:
        return [default] * n
    if isinstance(value, Tensor):
        value = value.detach().cpu().reshape(-1).tolist()
    if isinstance(value, (str, int, float)):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"expected {n} values (one per example), got {len(value)}")
    return value


def _html_text(value: Any) -> Any:
    r"""A label for Captum's HTML: visible control characters, HTML-escaped (numbers pass)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    return html.escape(visible_text(value), quote=True)


def to_visualization_records(
    scores: Any,
    tokens: Union[Sequence[str], Sequence[Sequence[str]]],
    *,
    attention_mask: Optional[ArrayLike] = None,
    pred_probs: Any = None,
    pred_classes: Any = None,
    true_classes: Any = None,
    attr_classes: Any = None,
    convergence_scores: Any = None,
    normalize: bool = True,
    exclude_sink: bool = False,
) -> List[Any]:
    r"""Turn token scores into Captum ``VisualizationDataRecord``\ s for ``visualize_text``.

    Args:
        scores: (T,) or (B, T) scores, or a result of any method (its ``scores`` and
            ``attention_mask``; the method name becomes the default attribution label).
        tokens: the tokens of one example (list of str) or of each example (list of
            lists), padded length or with pads already removed.
        attention_mask: (B, T) mask to drop pads (taken from a result).
        pred_probs, pred_classes, true_classes, attr_classes, convergence_scores: one
            value for all examples or one per example. Defaults: ``nan`` probability,
            empty class labels, the method name as attribution label, ``nan``
            convergence score.
        normalize: scale each example's scores to [-1, 1] (max-abs), because
            ``visualize_text`` clips to that range. The ``attr_score`` column keeps
            the sum of the raw scores.
        exclude_sink: normalise by the largest |score| of the tokens but the first (see
            :func:`normalize_scores`).

    Returns:
        A list of ``captum.attr.visualization.VisualizationDataRecord``, one per example.
        Captum writes the tokens and the class labels into its HTML as they are, so
        they are HTML-escaped here (``<b>`` -> ``&lt;b&gt;``, quotes too) with control
        and format characters shown visibly: a token can never become live markup in
        a notebook. ``raw_input_ids`` holds these escaped tokens.

    Examples:
        >>> from captum.attr import visualization as viz
        >>> recs = to_visualization_records([0.1, 0.8, 0.1], ["[CLS]", "good", "[SEP]"])
        >>> float(recs[0].word_attributions.max())
        1.0
        >>> html = viz.visualize_text(recs)  # doctest: +SKIP
    """
    from captum.attr import visualization as _captum_viz

    VisualizationDataRecord = _captum_viz.VisualizationDataRecord

    if isinstance(scores, AttributionResult):
        result = scores if attention_mask is None else replace(
            scores, attention_mask=torch.as_tensor(to_numpy(attention_mask)).reshape(scores.attention_mask.shape))
    else:  # plain scores: the same per-example accessor, through a bare result
        s = torch.as_tensor(to_numpy(scores))
        if s.dim() == 1:
            s = s.unsqueeze(0)
        mask = (torch.as_tensor(to_numpy(attention_mask)).reshape(s.shape) if attention_mask is not None
                else torch.ones(s.shape, dtype=torch.long))
        result = AttributionResult(method="", scores=s, attention_mask=mask)
    method = result.method
    n_ex, t_len = result.scores.shape
    if tokens and isinstance(tokens[0], str):
        token_lists = [list(tokens)] * n_ex
    else:
        token_lists = [list(t) for t in tokens]  # type: ignore[arg-type]
    if len(token_lists) != n_ex:
        raise ValueError(f"got token lists for {len(token_lists)} examples, scores for {n_ex}")
    probs = _per_example(pred_probs, n_ex, float("nan"))
    preds = [_html_text(v) for v in _per_example(pred_classes, n_ex, "")]
    trues = [_html_text(v) for v in _per_example(true_classes, n_ex, "")]
    attrs = [_html_text(v) for v in _per_example(attr_classes, n_ex, method)]
    convs = _per_example(convergence_scores, n_ex, float("nan"))
    records = []
    for i in range(n_ex):
        row = result.example(i)["scores"].detach().to("cpu", torch.float64)
        try:
            toks = unpadded_tokens(token_lists[i], result.real_tokens(i).cpu(), t_len)
        except ValueError:
            raise ValueError(f"example {i}: {len(token_lists[i])} tokens for {row.numel()} scores") from None
        word_attr = normalize_scores(row, exclude_sink=exclude_sink) if normalize else row.float()
        records.append(VisualizationDataRecord(
            word_attr, float(probs[i]), preds[i], trues[i], attrs[i],
            float(row.sum()), [_html_text(t) for t in toks], float(convs[i]),
        ))
    return records


def to_llm_attribution_result(
    source: Any,
    tokens: Sequence[str],
    prompt_length: int,
    *,
    output_tokens: Optional[Sequence[str]] = None,
    b: int = 0,
    normalize: bool = False,
) -> Any:
    r"""A Captum ``LLMAttributionResult`` from a decoder's rollout.

    For a causal LM, output token k (at position ``P + k`` of the sequence, P the
    prompt length) is predicted from position ``P + k - 1``, so its attribution over
    the prompt is row ``P + k - 1`` of the rollout, columns ``0 .. P - 1``. The
    sequence attribution is the sum of those rows (the attribution of the whole
    output). The sequence may include or stop before the last output token.

    Args:
        source: a (T, T) rollout, or a DecompositionResult (example ``b``, pads
            removed).
        tokens: the tokens of the sequence (prompt followed by the generated tokens);
            at least ``P + K - 1`` of them, K the number of output tokens.
        prompt_length: P, the number of prompt (input) tokens.
        output_tokens: the K output tokens (default: ``tokens[P:]``; give them
            explicitly when the sequence stops before the last one, e.g. a single
            predicted next token with ``tokens`` = the prompt).
        b: example index for a result.
        normalize: divide ``token_attr`` by its max-abs so values lie in [-1, 1].

    Returns:
        ``captum.attr.LLMAttributionResult`` with ``seq_attr`` (P,) and
        ``token_attr`` (K, P); use its ``plot_token_attr()`` / ``plot_seq_attr()``.

    Examples:
        >>> import torch
        >>> r = to_llm_attribution_result(torch.eye(4), ["The", " cat", " sat", " down"], 2)
        >>> tuple(r.token_attr.shape)
        (2, 2)
    """
    from captum.attr import LLMAttributionResult

    if isinstance(source, AttributionResult):
        roll = require_map(example_from_result(source, b), "rollout", "full rollout")
    else:
        roll = torch.as_tensor(to_numpy(source))
    tokens = [str(t) for t in tokens]
    if roll.dim() != 2 or roll.shape[0] != roll.shape[1]:
        raise ValueError(f"expected a (T, T) rollout, got shape {tuple(roll.shape)}")
    if roll.shape[0] != len(tokens):
        raise ValueError(f"rollout has {roll.shape[0]} positions, but {len(tokens)} tokens were given")
    p = int(prompt_length)
    outs = [str(t) for t in output_tokens] if output_tokens is not None else tokens[p:]
    if p < 1 or not outs:
        raise ValueError("need a prompt of at least one token and at least one output token")
    rows = [p + k - 1 for k in range(len(outs))]
    if rows[-1] >= roll.shape[0]:
        raise ValueError(
            f"{len(outs)} output tokens need rollout rows up to {rows[-1]}, the sequence has {roll.shape[0]}"
        )
    token_attr = roll[rows][:, :p].float()
    if normalize:
        m = token_attr.abs().max()
        token_attr = token_attr / (m if m > 0 else 1.0)
    seq_attr = token_attr.sum(0)
    return LLMAttributionResult(
        input_tokens=tokens[:p], output_tokens=outs, seq_attr=seq_attr, token_attr=token_attr
    )
