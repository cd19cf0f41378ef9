r"""Pictures of ALTI+ results (encoder-decoders), and interop with Captum's ``LLMAttributionResult``.

Every function is pure: it takes an :class:`~captum_normattr.attr.alti_plus.ALTIPlusResult`
(pads of both sides are dropped through its ``example(i)``) or plain tensors, and returns a
``matplotlib.figure.Figure`` outside pyplot's registry; pass ``path=`` to save it (PNG, SVG
or PDF from the suffix). matplotlib is an optional dependency.

Functions:
    - :func:`plot_contribution_matrix`: the [source | target prefix] contributions of every
      decoder position, one heat map.
    - :func:`plot_source_share`: the source share along the decoder positions.
    - :func:`generation_to_llm_attribution_result`: a ``captum.attr.LLMAttributionResult``
      (source tokens x generated tokens) from :func:`~captum_normattr.attr.alti_plus.explain_generation`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np
from torch import Tensor

from captum_normattr.present.colours import colormap, score_hex, score_rgb, text_colour
from captum_normattr.present.figures import check_tokens, finish_figure, new_figure, plot_label, short_label, tick_fontsize, to_numpy

__all__ = ["generation_to_llm_attribution_result", "plot_contribution_matrix", "plot_source_share"]


def _matrices(source: Any, index: int) -> Tuple[np.ndarray, np.ndarray]:
    from captum_normattr.attr.alti_plus import ALTIPlusResult, GeneratedTokenExplanation

    if isinstance(source, ALTIPlusResult):
        ex = source.example(index)
        return to_numpy(ex["source_contributions"]), to_numpy(ex["target_contributions"])
    if isinstance(source, GeneratedTokenExplanation):
        return to_numpy(source.source), to_numpy(source.prefix)
    if isinstance(source, (tuple, list)) and len(source) == 2:
        src, tgt = to_numpy(source[0]), to_numpy(source[1])
        if src.ndim != 2 or tgt.ndim != 2 or src.shape[0] != tgt.shape[0] or tgt.shape[0] != tgt.shape[1]:
            raise ValueError(f"expected (T, S) and (T, T) matrices, got shapes {src.shape} and {tgt.shape}")
        return src, tgt
    raise TypeError(
        "expected an ALTIPlusResult, a GeneratedTokenExplanation or a pair (source (T, S), target (T, T)); "
        f"got {type(source).__name__}"
    )


def plot_contribution_matrix(
    source: Any,
    index: int = 0,
    source_tokens: Optional[Sequence[str]] = None,
    target_tokens: Optional[Sequence[str]] = None,
    *,
    row_labels: Optional[Sequence[str]] = None,
    cmap: Optional[str] = None,
    title: Optional[str] = "ALTI+ contributions",
    annotate: Optional[bool] = None,
    path: Optional[Union[str, Path]] = None,
):
    r"""Heat map of every decoder position's contributions: source tokens | target prefix.

    Args:
        source: an ``ALTIPlusResult`` (example ``index``, pads removed), a
            ``GeneratedTokenExplanation``, or a pair (source (T, S), target (T, T)).
        index: the example of a result.
        source_tokens: the S source labels (padded or unpadded; default 0..S-1).
        target_tokens: the T decoder-input labels (columns of the target block).
        row_labels: labels of the rows (default: the target tokens; for a generation, give
            the generated tokens, the ones each row predicts).
        cmap: colormap (values lie in [0, 1]; default: the package's scale, white to red,
            :func:`~captum_normattr.present.colours.colormap`).
        title: figure title.
        annotate: write the values in the cells (default: when the matrix is small).
        path: save the figure there as well.

    Returns:
        ``matplotlib.figure.Figure``.

    Examples:
        >>> fig = plot_contribution_matrix(res, 0, src_tokens, tgt_tokens)  # doctest: +SKIP
    """
    src, tgt = _matrices(source, index)
    t, s = src.shape
    from captum_normattr.attr.alti_plus import ALTIPlusResult

    if isinstance(source, ALTIPlusResult):
        src_keep = source.attention_mask[index].bool()
        tgt_keep = source.target_attention_mask[index].bool()
        source_tokens = _real(source_tokens, src_keep)
        target_tokens = _real(target_tokens, tgt_keep)
    src_labels = check_tokens(source_tokens, s)
    tgt_labels = check_tokens(target_tokens, t)
    rows = check_tokens(row_labels, t) if row_labels is not None else tgt_labels
    data = np.concatenate([src, tgt], axis=1)
    fig = new_figure((max(4.0, 0.45 * (s + t) + 2.0), max(3.0, 0.4 * t + 1.5)))
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(data, cmap=cmap or colormap(False), vmin=0.0, vmax=max(float(np.nanmax(data)) if data.size else 1.0, 1e-12), aspect="auto")
    ax.axvline(s - 0.5, color="black", linewidth=1.5)
    fs = tick_fontsize(s + t)
    ax.set_xticks(range(s + t))
    ax.set_xticklabels([short_label(x) for x in src_labels + tgt_labels], rotation=90, fontsize=fs)
    ax.set_yticks(range(t))
    ax.set_yticklabels([short_label(x) for x in rows], fontsize=fs)
    ax.set_xlabel("source tokens | target prefix")
    ax.set_ylabel("decoder position")
    if annotate is None:
        annotate = (s + t) * t <= 200
    if annotate:
        top = float(np.nanmax(np.abs(data))) or 1.0
        for i in range(t):
            for j in range(s + t):
                ax.text(j, i, f"{data[i, j]:.2f}", ha="center", va="center", fontsize=max(5.0, fs - 2),
                        color=text_colour(score_rgb(data[i, j] / top)))
    if title:
        ax.set_title(plot_label(title))
    fig.colorbar(im, ax=ax, fraction=0.04)
    return finish_figure(fig, path)


def _real(tokens: Optional[Sequence[str]], keep: Tensor) -> Optional[List[str]]:
    if tokens is None:
        return None
    tokens = [str(x) for x in tokens]
    if len(tokens) == keep.numel():
        return [tokens[i] for i in keep.nonzero().flatten().tolist()]
    return tokens


def plot_source_share(
    source: Any,
    index: Optional[int] = None,
    target_tokens: Optional[Sequence[str]] = None,
    *,
    skip_first: bool = False,
    title: Optional[str] = "Source share by decoder position",
    path: Optional[Union[str, Path]] = None,
):
    r"""The source share (sum of the source contributions) of every decoder position.

    Args:
        source: an ``ALTIPlusResult``, a ``GeneratedTokenExplanation``, a (T,) share or a
            list of such shares (several lines).
        index: one example of a result (bars, with ``target_tokens`` as labels); None: every
            example of the result as a line over its real positions.
        target_tokens: labels of the positions of the one plotted sequence.
        skip_first: leave position 0 out (the official ALTI+ sentence average does).
        title: figure title.
        path: save the figure there as well.

    Returns:
        ``matplotlib.figure.Figure``; the y axis spans [0, 1] (the rest of each row is the
        target prefix's share).
    """
    from captum_normattr.attr.alti_plus import ALTIPlusResult, GeneratedTokenExplanation

    if isinstance(source, ALTIPlusResult):
        idx = range(source.source_share.shape[0]) if index is None else [index]
        series = [to_numpy(source.example(i)["source_share"]) for i in idx]
        if index is not None and target_tokens is not None:
            target_tokens = _real(target_tokens, source.target_attention_mask[index].bool())
    elif isinstance(source, GeneratedTokenExplanation):
        series = [to_numpy(source.source_share)]
    elif isinstance(source, (list, tuple)) and source and not np.isscalar(source[0]) and np.ndim(to_numpy(source[0])) == 1:
        series = [to_numpy(x) for x in source]
    else:
        series = [to_numpy(source)]
    if any(x.ndim != 1 for x in series):
        raise ValueError("source shares must be 1-D (one value per decoder position)")
    start = 1 if skip_first else 0
    fig = new_figure((max(4.0, 0.35 * max(len(x) for x in series) + 2.0), 3.2))
    ax = fig.add_subplot(1, 1, 1)
    if len(series) == 1:
        values = series[0][start:]
        labels = check_tokens(target_tokens, len(series[0]))[start:] if target_tokens is not None else None
        ax.bar(range(start, start + len(values)), values, color=score_hex(0.8))
        if labels is not None:
            ax.set_xticks(range(start, start + len(values)))
            ax.set_xticklabels([short_label(x) for x in labels], rotation=90, fontsize=tick_fontsize(len(values)))
    else:
        for k, x in enumerate(series):
            ax.plot(range(start, len(x)), x[start:], marker="o", markersize=3, label=f"example {k}")
        ax.legend(fontsize=7)
    ax.set_ylim(0.0, 1.0)
    ax.set_xlabel("decoder position")
    ax.set_ylabel("source share")
    if title:
        ax.set_title(plot_label(title))
    return finish_figure(fig, path)


def generation_to_llm_attribution_result(
    explanation: Any,
    source_tokens: Sequence[str],
    output_tokens: Optional[Sequence[str]] = None,
) -> Any:
    r"""A Captum ``LLMAttributionResult`` over the source tokens, from one generated sequence.

    Args:
        explanation: a ``GeneratedTokenExplanation`` (from ``explain_generation``).
        source_tokens: the labels of its S real source tokens.
        output_tokens: the labels of its n generated tokens (default: their ids).

    Returns:
        ``captum.attr.LLMAttributionResult`` with ``token_attr`` (n, S) the source rows and
        ``seq_attr`` (S,) their sum; use ``plot_token_attr()`` / ``plot_seq_attr()``.
    """
    from captum.attr import LLMAttributionResult

    token_attr = explanation.source.detach().float().cpu()
    n, s = token_attr.shape
    inputs = [str(t) for t in source_tokens]
    if len(inputs) != s:
        raise ValueError(f"got {len(inputs)} source tokens for {s} real source positions")
    outs = [str(t) for t in output_tokens] if output_tokens is not None else [str(int(t)) for t in explanation.tokens]
    if len(outs) != n:
        raise ValueError(f"got {len(outs)} output tokens for {n} generated tokens")
    return LLMAttributionResult(input_tokens=inputs, output_tokens=outs, seq_attr=token_attr.sum(0), token_attr=token_attr)
