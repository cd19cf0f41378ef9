r"""Pictures of decomposition results (Captum's visualisation tools: :mod:`captum_normattr.present.captum_interop`).

Every function here is pure: it takes tensors (or numpy arrays), token lists and,
where convenient, a result (:class:`~captum_normattr.result.AttributionResult`: pads are
dropped by its per-example accessor ``example(i)``), and returns a
``matplotlib.figure.Figure`` (or a Captum object). Nothing is shown or kept in a
global figure registry; pass ``path=`` to save a PNG, SVG or PDF (the format comes
from the file suffix), or display the returned figure in a notebook.

matplotlib is an optional dependency (``pip install captum_normattr[viz]``), imported by
the functions that draw.

Functions:
    - :func:`plot_token_map`: token-to-token heat map of one (T, T) map.
    - :func:`plot_layer_grid`: a grid of all layer maps (L, T, T).
    - :func:`plot_rollout_row`: the attribution row as bars or as colored text.
    - :func:`plot_component_maps`: several named (T, T) maps side by side
      (e.g. the component scopes ATB, +FF, +RES2, +LN2 of the FF decomposition).
    - :func:`plot_method_comparison`: several methods' token scores on one sentence.
    - :func:`example_from_result`: one example of a result, pads removed.
    - :func:`plot_label`: how every label is drawn: literally (no mathtext: a ``$`` in a
      token is a dollar sign), control characters shown visibly.

Pass readable token labels (:func:`~captum_normattr.tokens.readable_tokens`: ``" keys"``
rather than ``Ġkeys``). Every score plot and map takes ``exclude_sink=True`` to leave the
first token (``[CLS]``, BOS: where decoders keep their attention sink) out of the picture
and of its color scale, without changing the scores.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from captum_normattr.present.figures import (  # noqa: F401 - MISSING_MATPLOTLIB_MESSAGE, plot_label, save_figure: public here
    MISSING_MATPLOTLIB_MESSAGE,
    ArrayLike,
    check_tokens,
    finish_figure,
    new_figure,
    plot_label,
    require_matplotlib,
    save_figure,
    short_label,
    tick_fontsize,
    to_numpy,
)
from captum_normattr.present.colours import colormap, score_hex, score_rgb, text_colour
from captum_normattr.result import AttributionResult
from captum_normattr.tokens import display_token

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "MISSING_MATPLOTLIB_MESSAGE",
    "example_from_result",
    "plot_label",
    "plot_component_maps",
    "plot_layer_grid",
    "plot_method_comparison",
    "plot_rollout_row",
    "plot_token_map",
    "require_map",
    "save_figure",
    "unpadded_tokens",
]

# --------------------------------------------------------------------------- helpers


def _is_result(obj: Any) -> bool:
    r"""True for a result of ``decompose`` (any :class:`~captum_normattr.result.AttributionResult`)."""
    return isinstance(obj, AttributionResult)


def unpadded_tokens(tokens: Optional[Sequence[str]], keep: Tensor, t_len: int) -> Optional[List[str]]:
    r"""Token labels of the real positions ``keep``, from padded (``t_len``) or unpadded labels.

    Args:
        tokens: labels of the padded length ``t_len`` or of the ``keep`` positions only, or None.
        keep: the kept (real) padded positions, long (n,).
        t_len: the padded length T.

    Returns:
        The n labels of the real positions (as str), or None without labels.

    Raises:
        ValueError: when ``tokens`` has neither length.
    """
    if tokens is None:
        return None
    tokens = [str(t) for t in tokens]
    if len(tokens) == keep.numel():
        return tokens
    if len(tokens) == t_len:
        return [tokens[i] for i in keep.tolist()]
    raise ValueError(f"got {len(tokens)} tokens; expected {t_len} (padded) or {keep.numel()} (unpadded)")


def _auto_cmap(values: np.ndarray, cmap: Optional[Any]) -> Tuple[Any, Optional[float], Optional[float]]:
    r"""The package's scale (:func:`~captum_normattr.present.colours.colormap`): diverging and
    centred at 0 for signed data, its positive half (white to red) for non-negative data."""
    finite = values[np.isfinite(values)]
    if finite.size and finite.min() < 0:
        m = float(np.abs(finite).max()) or 1.0
        return (cmap or colormap(True)), -m, m
    return (cmap or colormap(False)), 0.0, (float(finite.max()) if finite.size and finite.max() > 0 else 1.0)


def _cell_text_colour(v: float, lo: float, hi: float) -> str:
    r"""Black or white text on a cell of the package's scale (the larger contrast)."""
    m = max(abs(lo), abs(hi)) or 1.0
    return text_colour(score_rgb(v / m))


def example_from_result(
    result: AttributionResult, b: int = 0, tokens: Optional[Sequence[str]] = None
) -> Dict[str, Any]:
    r"""One example of a result, pads removed, on the CPU.

    A thin layer over :meth:`~captum_normattr.result.AttributionResult.example` (which
    drops the pads of every token-indexed field; padding may be on either side): float
    tensors become float64 on the CPU, and the token labels are matched.

    Args:
        result: any result of ``decompose`` (a
            :class:`~captum_normattr.result.AttributionResult`).
        b: index of the example in the batch.
        tokens: optional token labels, either for the padded length T (pads are
            dropped) or already without pads.

    Returns:
        ``result.example(b)`` (``scores`` (n,), ``delta``, and per class its other
        fields: ``layer_maps`` (L, n, n) and ``rollout`` (n, n) of a
        DecompositionResult, None when not computed), plus ``keep`` (the kept padded
        positions, long (n,)), ``explained_position`` (an int in unpadded indexing, or
        None), ``method`` (str) and ``tokens`` (list of n str, or None).

    Examples:
        >>> from captum_normattr.tokens import readable_tokens
        >>> ex = example_from_result(res, 0, readable_tokens(tokenizer, ids[0]))  # doctest: +SKIP
        >>> plot_layer_grid(ex["layer_maps"], ex["tokens"])  # doctest: +SKIP
    """
    if not _is_result(result):
        raise TypeError(f"expected a result of decompose (AttributionResult), got {type(result).__name__}")
    keep = result.real_tokens(b).cpu()
    out: Dict[str, Any] = {"layer_maps": None, "rollout": None}
    for name, value in result.example(b).items():
        if isinstance(value, Tensor):
            value = value.detach().to("cpu", torch.float64 if value.is_floating_point() else value.dtype)
        out[name] = value
    out["keep"] = keep
    out["method"] = str(out.get("method") or "")
    out["tokens"] = unpadded_tokens(tokens, keep, result.attention_mask.shape[-1])
    return out


def require_map(ex: Dict[str, Any], name: str, what: str) -> Tensor:
    r"""The map ``name`` of an :func:`example_from_result` dict, or a ValueError saying how to compute it.

    Args:
        ex: an :func:`example_from_result` dict.
        name: ``"layer_maps"`` or ``"rollout"``.
        what: how the message names it (``"layer maps"``, ``"full rollout"``).

    Returns:
        The map.

    Raises:
        ValueError: when the result holds no such map.
    """
    if ex.get(name) is None:
        raise ValueError(
            f"the {ex['method'] or 'result'} result has no {what}; pass a result of decompose(..., "
            "return_layer_maps=True, return_rollout=True) of a layer-map method"
        )
    return ex[name]


def _scores_and_tokens(
    scores: Any, tokens: Optional[Sequence[str]], b: int
) -> Tuple[np.ndarray, List[str], Optional[int], str]:
    if _is_result(scores):
        ex = example_from_result(scores, b, tokens)
        vals = ex["scores"].numpy()
        return vals, check_tokens(ex["tokens"], len(vals)), ex["explained_position"], ex["method"]
    vals = to_numpy(scores)
    if vals.ndim != 1:
        raise ValueError(f"expected a 1-D score vector (T,), got shape {tuple(vals.shape)}")
    return vals, check_tokens(tokens, len(vals)), None, ""


# --------------------------------------------------------------------------- maps


def _draw_map(
    ax: "Axes",
    matrix: np.ndarray,
    tokens: List[str],
    *,
    cmap: Optional[str],
    vmin: Optional[float],
    vmax: Optional[float],
    annotate: Optional[bool],
    labels: bool = True,
    ylabels: bool = True,
) -> Any:
    cm, lo, hi = _auto_cmap(matrix, cmap)
    lo = lo if vmin is None else vmin
    hi = hi if vmax is None else vmax
    im = ax.imshow(matrix, cmap=cm, vmin=lo, vmax=hi, aspect="equal", interpolation="nearest")
    n = len(tokens)
    fs = tick_fontsize(n)
    short = [short_label(t) for t in tokens]
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.set_xticklabels(short if labels else [], rotation=90, fontsize=fs)
    ax.set_yticklabels(short if (labels and ylabels) else [], fontsize=fs)
    ax.tick_params(length=0)
    if annotate is None:
        annotate = n <= 10
    if annotate:
        for i in range(matrix.shape[0]):
            for j in range(matrix.shape[1]):
                v = matrix[i, j]
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=max(fs - 2, 5),
                        color=_cell_text_colour(v, lo, hi))
    return im


def plot_token_map(
    matrix: ArrayLike,
    tokens: Optional[Sequence[str]] = None,
    *,
    title: Optional[str] = None,
    ax: Optional["Axes"] = None,
    cmap: Optional[str] = None,
    vmin: Optional[float] = None,
    vmax: Optional[float] = None,
    annotate: Optional[bool] = None,
    colorbar: bool = True,
    path: Optional[Union[str, Path]] = None,
    exclude_sink: bool = False,
) -> "Figure":
    r"""Token-to-token heat map of one layer map (or a rollout).

    Entry ``[i, j]`` (row i, column j) is how much token j contributes to token i.

    Args:
        matrix: (T, T) map; a tensor, array or nested list.
        tokens: T token labels (default ``0..T-1``).
        title: axes title.
        ax: draw into this axes instead of a new figure.
        cmap: matplotlib colormap; default: the package's scale
            (:func:`~captum_normattr.present.colours.colormap`), white to red for
            non-negative maps, blue-white-red centred at 0 when there are negative entries.
        vmin, vmax: color limits (default: from the data).
        annotate: write the values in the cells (default: when T <= 10).
        colorbar: add a colorbar.
        path: save the figure there (``.png``, ``.svg`` or ``.pdf``).
        exclude_sink: leave the first token (row and column 0) out of the picture and
            of its color scale; the data are unchanged.

    Returns:
        The matplotlib figure.

    Examples:
        >>> import torch
        >>> fig = plot_token_map(torch.eye(3), ["[CLS]", "hi", "[SEP]"], title="identity")
        >>> fig.axes[0].get_title()
        'identity'
    """
    m = to_numpy(matrix)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"expected a square (T, T) map, got shape {tuple(m.shape)}")
    toks = check_tokens(tokens, m.shape[0])
    if exclude_sink and len(toks) > 1:
        m, toks = m[1:, 1:], toks[1:]
    if ax is None:
        side = float(np.clip(0.35 * len(toks) + 2.0, 3.5, 14.0))
        fig = new_figure((side + (1.0 if colorbar else 0.0), side))
        ax = fig.add_subplot(1, 1, 1)
    else:
        fig = ax.figure
    im = _draw_map(ax, m, toks, cmap=cmap, vmin=vmin, vmax=vmax, annotate=annotate)
    ax.set_xlabel("contributing token j", fontsize=9)
    ax.set_ylabel("receiving token i", fontsize=9)
    if title:
        ax.set_title(plot_label(title), fontsize=10)
    if colorbar:
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    return finish_figure(fig, path)


def plot_layer_grid(
    layer_maps: Any,
    tokens: Optional[Sequence[str]] = None,
    *,
    b: int = 0,
    ncols: Optional[int] = None,
    layer_names: Optional[Sequence[str]] = None,
    share_scale: bool = False,
    cmap: Optional[str] = None,
    title: Optional[str] = None,
    path: Optional[Union[str, Path]] = None,
    exclude_sink: bool = False,
) -> "Figure":
    r"""A grid of all layer maps of one example.

    Args:
        layer_maps: (L, T, T) maps, or a DecompositionResult (example ``b`` is
            taken, pads removed).
        tokens: T token labels (for a result: padded or unpadded labels).
        b: example index when ``layer_maps`` is a result.
        ncols: columns of the grid (default: up to 4).
        layer_names: titles of the panels (default ``"layer 1"`` ...).
        share_scale: one color scale for all layers (default: one per layer).
        cmap: colormap (see :func:`plot_token_map`).
        title: figure title (default: the method name of a result).
        path: save the figure there.
        exclude_sink: leave the first token (row and column 0 of every layer) out of the
            pictures and their color scales.

    Returns:
        The matplotlib figure.

    Examples:
        >>> import torch
        >>> fig = plot_layer_grid(torch.rand(3, 4, 4).softmax(-1), list("abcd"))
        >>> len([a for a in fig.axes if a.images])
        3
    """
    method = ""
    if _is_result(layer_maps):
        ex = example_from_result(layer_maps, b, tokens)
        maps, tokens, method = require_map(ex, "layer_maps", "layer maps").numpy(), ex["tokens"], ex["method"]
    else:
        maps = to_numpy(layer_maps)
    if maps.ndim != 3 or maps.shape[1] != maps.shape[2]:
        raise ValueError(f"expected (L, T, T) layer maps, got shape {tuple(maps.shape)}")
    toks = check_tokens(tokens, maps.shape[1])
    if exclude_sink and len(toks) > 1:
        maps, toks = maps[:, 1:, 1:], toks[1:]
    n_layers, n = maps.shape[0], maps.shape[1]
    names = list(layer_names) if layer_names is not None else [f"layer {l + 1}" for l in range(n_layers)]
    if len(names) != n_layers:
        raise ValueError(f"got {len(names)} layer names for {n_layers} layers")
    ncols = ncols or min(4, n_layers)
    nrows = math.ceil(n_layers / ncols)
    side = float(np.clip(0.22 * n + 1.8, 2.6, 6.0))
    fig = new_figure((side * ncols + 0.8, side * nrows + 0.6))
    lo = hi = None
    if share_scale:
        _, lo, hi = _auto_cmap(maps, cmap)
    for l in range(n_layers):
        ax = fig.add_subplot(nrows, ncols, l + 1)
        im = _draw_map(ax, maps[l], toks, cmap=cmap, vmin=lo, vmax=hi, annotate=False,
                       labels=n <= 40, ylabels=l % ncols == 0)
        ax.set_title(plot_label(names[l]), fontsize=9)
        if not share_scale:
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04).ax.tick_params(labelsize=7)
    if share_scale:
        fig.colorbar(im, ax=fig.axes[:n_layers], fraction=0.02, pad=0.02)
    if title or method:
        fig.suptitle(plot_label(title or method), fontsize=11)
    return finish_figure(fig, path)


def plot_component_maps(
    maps: Mapping[str, ArrayLike],
    tokens: Optional[Sequence[str]] = None,
    *,
    share_scale: bool = False,
    cmap: Optional[str] = None,
    title: Optional[str] = None,
    path: Optional[Union[str, Path]] = None,
    exclude_sink: bool = False,
) -> "Figure":
    r"""Several named (T, T) maps side by side.

    Meant for the component scopes of the feed-forward decomposition
    (``{"ATB": ..., "+FF": ..., "+RES2": ..., "+LN2": ...}``), but any maps of the
    same size work (e.g. one layer under several GlobEnc maps).

    Args:
        maps: ordered mapping name -> (T, T) map.
        tokens: T token labels.
        share_scale: one color scale for all panels.
        cmap: colormap (see :func:`plot_token_map`).
        title: figure title.
        path: save the figure there.
        exclude_sink: leave the first token (row and column 0) out of every panel.

    Returns:
        The matplotlib figure.

    Examples:
        >>> import torch
        >>> fig = plot_component_maps({"ATB": torch.eye(3), "+FF": torch.ones(3, 3)}, list("abc"))
        >>> [a.get_title() for a in fig.axes if a.images]
        ['ATB', '+FF']
    """
    if not maps:
        raise ValueError("no maps to plot")
    arrays = {str(k): to_numpy(v) for k, v in maps.items()}
    shapes = {a.shape for a in arrays.values()}
    if len(shapes) != 1:
        raise ValueError(f"all maps must have the same shape, got {sorted(shapes)}")
    shape = shapes.pop()
    if len(shape) != 2 or shape[0] != shape[1]:
        raise ValueError(f"expected square (T, T) maps, got shape {shape}")
    toks = check_tokens(tokens, shape[0])
    if exclude_sink and len(toks) > 1:
        arrays = {name: a[1:, 1:] for name, a in arrays.items()}
        shape, toks = (shape[0] - 1, shape[1] - 1), toks[1:]
    k = len(arrays)
    side = float(np.clip(0.3 * shape[0] + 1.8, 3.0, 7.0))
    fig = new_figure((side * k + 0.8, side + 0.6))
    lo = hi = None
    if share_scale:
        _, lo, hi = _auto_cmap(np.stack(list(arrays.values())), cmap)
    axes = []
    for idx, (name, m) in enumerate(arrays.items()):
        ax = fig.add_subplot(1, k, idx + 1)
        axes.append(ax)
        im = _draw_map(ax, m, toks, cmap=cmap, vmin=lo, vmax=hi, annotate=None,
                       ylabels=idx == 0)
        ax.set_title(plot_label(name), fontsize=10)
        if not share_scale:
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04).ax.tick_params(labelsize=7)
    if share_scale:
        fig.colorbar(im, ax=axes, fraction=0.02, pad=0.02)
    if title:
        fig.suptitle(plot_label(title), fontsize=11)
    return finish_figure(fig, path)


# --------------------------------------------------------------------------- rows


def _text_colors(values: np.ndarray) -> List[Tuple[float, float, float, float]]:
    r"""Background colours for coloured text: the package's scale (blue negative, white 0, red positive)."""
    m = float(np.abs(values).max()) or 1.0
    return [tuple(c / 255.0 for c in score_rgb(v / m)) + (1.0,) for v in values]  # type: ignore[misc]


def plot_rollout_row(
    scores: Any,
    tokens: Optional[Sequence[str]] = None,
    *,
    b: int = 0,
    kind: str = "bar",
    explained_position: Optional[int] = None,
    title: Optional[str] = None,
    ax: Optional["Axes"] = None,
    path: Optional[Union[str, Path]] = None,
    exclude_sink: bool = False,
) -> "Figure":
    r"""The attribution row (the explained row of the rollout) as bars or colored text.

    Args:
        scores: (T,) token scores, or a result of any method (its ``scores`` of
            example ``b``, pads removed).
        tokens: T token labels.
        b: example index when ``scores`` is a result.
        kind: ``"bar"`` (one bar per token) or ``"text"`` (the tokens written with a
            background colour on the package's scale: blue negative, white 0, red positive,
            intensity = |score| / max).
        explained_position: token index to mark as the explained one (taken from the
            result when not given).
        title: axes title (default: the method name of a result).
        ax: draw into this axes.
        path: save the figure there.
        exclude_sink: leave the first token out of the bars (or the colored text) and
            of their scale; the scores are unchanged.

    Returns:
        The matplotlib figure.

    Examples:
        >>> fig = plot_rollout_row([0.2, 0.5, 0.3], ["[CLS]", "great", "[SEP]"], kind="text")
    """
    vals, toks, pos, method = _scores_and_tokens(scores, tokens, b)
    pos = explained_position if explained_position is not None else pos
    title = title if title is not None else (method or None)
    if exclude_sink and len(vals) > 1:
        vals, toks = vals[1:], toks[1:]
        pos = None if pos is None or pos < 1 else pos - 1
    if kind not in ("bar", "text"):
        raise ValueError(f"kind must be 'bar' or 'text', got {kind!r}")
    n = len(vals)
    if kind == "bar":
        if ax is None:
            fig = new_figure((float(np.clip(0.45 * n + 1.5, 4.0, 18.0)), 3.2))
            ax = fig.add_subplot(1, 1, 1)
        else:
            fig = ax.figure
        colors = [score_hex(0.8) if v >= 0 else score_hex(-0.8) for v in vals]
        ax.bar(range(n), vals, color=colors)
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set_xticks(range(n))
        ax.set_xticklabels([short_label(t) for t in toks], rotation=90, fontsize=tick_fontsize(n))
        ax.set_xlim(-0.6, n - 0.4)
        ax.set_ylabel("attribution")
        if pos is not None and 0 <= pos < n:
            ax.get_xticklabels()[pos].set_fontweight("bold")
            ax.get_xticklabels()[pos].set_color("tab:blue")
        if title:
            ax.set_title(plot_label(title), fontsize=10)
        return finish_figure(fig, path)

    # colored text, wrapped into lines; widths measured with the Agg renderer, then
    # placed in axes coordinates (the axes spans the whole figure when we make it).
    own = ax is None
    if own:
        fig = new_figure((8.0, 1.0), layout=None)
        ax = fig.add_axes((0.0, 0.0, 1.0, 1.0))
    else:
        fig = ax.figure
    ax.set_axis_off()
    renderer = fig.canvas.get_renderer()
    colors = _text_colors(vals)
    fs = 12.0
    pad_px = 6.0
    ax_w_px = ax.get_window_extent(renderer).width
    line_h_px = fs * 2.0 * fig.dpi / 72.0
    x_px, line = pad_px, 0
    placed = []
    for i, (tok, col) in enumerate(zip(toks, colors)):
        t = ax.text(0, 0, plot_label(display_token(tok)), fontsize=fs, family="monospace", va="center",
                    fontweight="bold" if i == pos else "normal",
                    bbox=dict(boxstyle="round,pad=0.25", facecolor=col, edgecolor="none"),
                    transform=ax.transAxes)
        w = t.get_window_extent(renderer).width + 10.0
        if x_px + w > ax_w_px - pad_px and x_px > pad_px:
            x_px, line = pad_px, line + 1
        placed.append((t, x_px, line))
        x_px += w
    head = 1 if title else 0
    if own:
        fig.set_size_inches(8.0, (line + 1 + head + 0.5) * line_h_px / fig.dpi)
    ax_h_px = ax.get_window_extent(renderer).height
    for t, x, ln in placed:
        t.set_position((x / ax_w_px, 1.0 - (head + ln + 0.75) * line_h_px / ax_h_px))
    if title:
        ax.text(pad_px / ax_w_px, 1.0 - 0.6 * line_h_px / ax_h_px, plot_label(title), fontsize=10,
                va="center", transform=ax.transAxes)
    return finish_figure(fig, path)


def plot_method_comparison(
    scores: Mapping[str, Any],
    tokens: Optional[Sequence[str]] = None,
    *,
    b: int = 0,
    kind: str = "heatmap",
    normalize: bool = True,
    title: Optional[str] = None,
    path: Optional[Union[str, Path]] = None,
    exclude_sink: bool = False,
) -> "Figure":
    r"""Compare several methods' token scores on one sentence.

    Args:
        scores: ordered mapping method name -> (T,) scores or a result of any method
            (example ``b``, pads removed). All must have the same length.
        tokens: T token labels (for results: padded or unpadded labels).
        b: example index for results.
        kind: ``"heatmap"`` (methods x tokens, values written in the cells) or
            ``"bar"`` (grouped bars).
        normalize: divide each method's scores by its maximum absolute value so
            that methods on different scales can be compared (default True).
        title: figure title.
        path: save the figure there.
        exclude_sink: leave the first token out of the picture and of the
            normalisation (each method is divided by its largest |score| over the
            other tokens).

    Returns:
        The matplotlib figure.

    Examples:
        >>> fig = plot_method_comparison({"GlobEnc": [0.2, 0.6, 0.2], "IG": [0.1, -0.4, 0.3]},
        ...                              ["[CLS]", "bad", "[SEP]"])
    """
    if not scores:
        raise ValueError("no methods to compare")
    rows, toks = [], None
    for name, s in scores.items():
        v, t, _, _ = _scores_and_tokens(s, tokens, b)
        if rows and len(v) != len(rows[0][1]):
            raise ValueError(f"method {name!r} has {len(v)} scores, expected {len(rows[0][1])}")
        rows.append((str(name), v))
        toks = t
    assert toks is not None
    names = [r[0] for r in rows]
    data = np.stack([r[1] for r in rows])
    if exclude_sink and data.shape[1] > 1:
        data, toks = data[:, 1:], toks[1:]
    if normalize:
        data = data / np.where(np.abs(data).max(1, keepdims=True) > 0, np.abs(data).max(1, keepdims=True), 1.0)
    n, k = data.shape[1], data.shape[0]
    if kind not in ("heatmap", "bar"):
        raise ValueError(f"kind must be 'heatmap' or 'bar', got {kind!r}")
    fig = new_figure((float(np.clip(0.55 * n + 2.5, 5.0, 20.0)), (0.5 * k + 1.8) if kind == "heatmap" else 3.6))
    ax = fig.add_subplot(1, 1, 1)
    short = [short_label(t) for t in toks]
    if kind == "heatmap":
        cm, lo, hi = _auto_cmap(data, None)
        im = ax.imshow(data, cmap=cm, vmin=lo, vmax=hi, aspect="auto", interpolation="nearest")
        ax.set_yticks(range(k))
        ax.set_yticklabels([plot_label(nm) for nm in names], fontsize=9)
        ax.set_xticks(range(n))
        ax.set_xticklabels(short, rotation=90, fontsize=tick_fontsize(n))
        ax.tick_params(length=0)
        if n <= 40:
            for i in range(k):
                for j in range(n):
                    v = data[i, j]
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                            color=_cell_text_colour(v, lo, hi))
        fig.colorbar(im, ax=ax, fraction=0.03, pad=0.02)
    else:
        width = 0.8 / k
        x = np.arange(n)
        for i, name in enumerate(names):
            ax.bar(x - 0.4 + width * (i + 0.5), data[i], width=width, label=plot_label(name))
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set_xticks(x)
        ax.set_xticklabels(short, rotation=90, fontsize=tick_fontsize(n))
        ax.set_xlim(-0.6, n - 0.4)
        ax.set_ylabel("attribution" + (" / max |attribution|" if normalize else ""))
        ax.legend(fontsize=8)
    if title:
        ax.set_title(plot_label(title), fontsize=10)
    return finish_figure(fig, path)
