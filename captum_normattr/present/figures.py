r"""Matplotlib helpers shared by :mod:`captum_normattr.present.visualization` and
:mod:`captum_normattr.present.visualization_seq2seq`: figures outside pyplot, literal labels, saving.

Matplotlib is imported only when a figure is made (:func:`require_matplotlib` says how to
install it when it is missing).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from captum_normattr.tokens import display_token, visible_text

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

ArrayLike = Union[Tensor, np.ndarray, Sequence[float], Sequence[Sequence[float]]]

__all__ = ["MISSING_MATPLOTLIB_MESSAGE", "SAVE_FORMATS", "ArrayLike", "check_tokens", "finish_figure", "new_figure",
           "plot_label", "require_matplotlib", "save_figure", "short_label", "tick_fontsize", "to_numpy"]

MISSING_MATPLOTLIB_MESSAGE = (
    "captum_normattr's plots need matplotlib, which is not installed. "
    "Install it with `pip install matplotlib` or `pip install captum_normattr[viz]`."
)

SAVE_FORMATS = ("png", "svg", "pdf")


def require_matplotlib() -> Any:
    r"""Import matplotlib lazily, with a clear message when it is missing.

    Returns:
        The ``matplotlib`` module.

    Raises:
        ImportError: with installation instructions when matplotlib is missing.
    """
    try:
        import matplotlib
    except ImportError as err:  # pragma: no cover - exercised with matplotlib absent
        raise ImportError(MISSING_MATPLOTLIB_MESSAGE) from err
    return matplotlib


def new_figure(figsize: Tuple[float, float], layout: Optional[str] = "constrained") -> "Figure":
    r"""A figure outside pyplot's registry, with an Agg canvas (for text measurement)."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def to_numpy(x: ArrayLike) -> np.ndarray:
    r"""Tensor / array / nested list -> float64 numpy array on the CPU."""
    if isinstance(x, Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def check_tokens(tokens: Optional[Sequence[str]], n: int) -> List[str]:
    r"""Default token labels ``0..n-1``; otherwise check that there are ``n`` of them."""
    if tokens is None:
        return [str(i) for i in range(n)]
    tokens = [str(t) for t in tokens]
    if len(tokens) != n:
        raise ValueError(f"got {len(tokens)} tokens for data of length {n}")
    return tokens


def plot_label(text: Any) -> str:
    r"""A string for a matplotlib label, drawn literally.

    Control and format characters are shown visibly
    (:func:`~captum_normattr.tokens.visible_text`) and every ``$`` is escaped, so that
    matplotlib never reads the text as mathtext (a token ``$x`` or ``a$b$c`` would
    otherwise be typeset as a formula, or crash the drawing with a parse error).

    Examples:
        >>> plot_label("5$")
        '5\\$'
    """
    return visible_text(text).replace("$", "\\$")


def short_label(token: str, width: int = 14) -> str:
    r"""A tick label: the token as shown (:func:`~captum_normattr.tokens.display_token`), cut to ``width``, ``$`` escaped."""
    token = display_token(token)
    short = token if len(token) <= width else token[: width - 1] + "\u2026"
    return short.replace("$", "\\$")


def tick_fontsize(n: int) -> float:
    r"""A tick font size for ``n`` labels (10 for few, down to 5 for many)."""
    return float(np.clip(11 - 0.12 * n, 5, 10))


def save_figure(fig: "Figure", path: Union[str, Path], dpi: int = 150) -> Path:
    r"""Save a figure as PNG, SVG or PDF; the format comes from the suffix of ``path``.

    Args:
        fig: the matplotlib figure.
        path: output file, ending in ``.png``, ``.svg`` or ``.pdf``. Parent folders
            are created.
        dpi: resolution for PNG.

    Returns:
        The path written, as a ``Path``.

    Raises:
        ValueError: for another suffix.

    Examples:
        >>> fig = plot_rollout_row([0.1, 0.7, 0.2], ["[CLS]", "hi", "[SEP]"])
        >>> save_figure(fig, "row.svg")  # doctest: +SKIP
    """
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in SAVE_FORMATS:
        raise ValueError(f"cannot save a figure as {path.name!r}: use one of .png, .svg, .pdf")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format=fmt, dpi=dpi, bbox_inches="tight", facecolor="white")
    return path


def finish_figure(fig: "Figure", path: Optional[Union[str, Path]]) -> "Figure":
    r"""Save ``fig`` to ``path`` (:func:`save_figure`) when one is given; return it."""
    if path is not None:
        save_figure(fig, path)
    return fig
