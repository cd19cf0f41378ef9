r"""The one colour convention of every page and plot of the package.

Scores are drawn on one colour-blind-safe diverging scale, ColorBrewer's RdBu (11 classes,
reversed): **blue = negative, white = 0, red = positive**, darker = larger |score|. Unsigned
maps (rollouts, GlobEnc, ALTI: no negative entry) use its positive half, white to red, so
the largest contribution has the same colour on a signed and an unsigned page. A cell's
text is black on light colours and white on dark ones (whichever has the larger WCAG
contrast ratio). Non-finite values and a sink left out of the scale are grey.

Every HTML page (the encoder report :func:`~captum_normattr.present.report.render_html`, the
interactive report and the route graph page of :mod:`captum_normattr.present.interactive`,
the ``generate`` page) reads its colours from :data:`RAMP` through :func:`css_variables`
and :data:`JS_COLOURS`, and every matplotlib plot through :func:`colormap`. See
docs/visualization.md ("Colours").

Examples:
    >>> score_hex(1.0), score_hex(0.0), score_hex(-1.0)
    ('#67001f', '#ffffff', '#053061')
    >>> text_colour(score_rgb(1.0)), text_colour(score_rgb(0.1))
    ('#ffffff', '#000000')
"""
from __future__ import annotations

import html
import math
from typing import Any, Sequence, Tuple

__all__ = [
    "JS_COLOURS",
    "NEGATIVE_MAX",
    "NONFINITE",
    "POSITIVE_MAX",
    "RAMP",
    "SINK_GREY",
    "ZERO",
    "colormap",
    "colour_bar_html",
    "css_gradient",
    "css_variables",
    "score_css",
    "score_hex",
    "score_rgb",
    "text_colour",
]

#: ColorBrewer RdBu, 11 classes, from -1 (dark blue) through 0 (white) to +1 (dark red);
#: the middle class is pure white so that 0 is no colour at all.
RAMP: Tuple[str, ...] = ("#053061", "#2166ac", "#4393c3", "#92c5de", "#d1e5f0", "#ffffff",
                         "#fddbc7", "#f4a582", "#d6604d", "#b2182b", "#67001f")
NEGATIVE_MAX = RAMP[0]
ZERO = RAMP[5]
POSITIVE_MAX = RAMP[-1]
#: non-finite values
NONFINITE = "#bdbdbd"
#: a sink left out of the colour scale
SINK_GREY = "#e0e0e0"


def _rgb(hex_colour: str) -> Tuple[int, int, int]:
    h = hex_colour.lstrip("#")
    return int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16)


_RAMP_RGB = tuple(_rgb(c) for c in RAMP)


def score_rgb(v: float) -> Tuple[int, int, int]:
    r"""The colour of a normalised score (``score / max |score|``, clipped to [-1, 1]), as 0-255 RGB.

    Linear interpolation between the classes of :data:`RAMP`; a non-finite ``v`` is
    :data:`NONFINITE`.

    Args:
        v: the normalised score.

    Returns:
        ``(r, g, b)``.

    Examples:
        >>> score_rgb(0.0)
        (255, 255, 255)
    """
    v = float(v)
    if not math.isfinite(v):
        return _rgb(NONFINITE)
    x = (max(-1.0, min(1.0, v)) + 1.0) * 5.0  # 0 .. 10
    k = min(int(x), 9)
    f = x - k
    a, b = _RAMP_RGB[k], _RAMP_RGB[k + 1]
    return tuple(int(round(a[i] + (b[i] - a[i]) * f)) for i in range(3))  # type: ignore[return-value]


def score_hex(v: float) -> str:
    r""":func:`score_rgb` as ``#rrggbb``."""
    return "#%02x%02x%02x" % score_rgb(v)


def score_css(v: float) -> str:
    r""":func:`score_rgb` as CSS ``rgb(r, g, b)`` (what a browser reports as an element's colour)."""
    return "rgb(%d, %d, %d)" % score_rgb(v)


def _luminance(rgb: Sequence[float]) -> float:
    def lin(c: float) -> float:
        c = c / 255.0
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = (lin(float(c)) for c in rgb[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def text_colour(rgb: Sequence[float]) -> str:
    r"""Black or white text for a background, whichever has the larger WCAG contrast ratio.

    Args:
        rgb: the background as 0-255 ``(r, g, b)``.

    Returns:
        ``"#000000"`` or ``"#ffffff"``.
    """
    lum = _luminance(rgb)
    return "#000000" if (lum + 0.05) / 0.05 >= 1.05 / (lum + 0.05) else "#ffffff"


def css_gradient(signed: bool = True) -> str:
    r"""A CSS ``linear-gradient`` of the scale, left to right (signed: -max .. +max; else 0 .. +max)."""
    stops = RAMP if signed else RAMP[5:]
    return "linear-gradient(to right, " + ", ".join(stops) + ")"


def css_variables() -> str:
    r"""CSS custom properties every page declares: ``--na-neg-max``, ``--na-zero``, ``--na-pos-max``,
    ``--na-nonfinite``, ``--na-sink``, ``--na-signed-bar`` and ``--na-unsigned-bar``.

    Examples:
        >>> "--na-pos-max:#67001f" in css_variables()
        True
    """
    return (f":root{{--na-neg-max:{NEGATIVE_MAX};--na-zero:{ZERO};--na-pos-max:{POSITIVE_MAX};"
            f"--na-nonfinite:{NONFINITE};--na-sink:{SINK_GREY};"
            f"--na-signed-bar:{css_gradient(True)};--na-unsigned-bar:{css_gradient(False)}}}")


#: The same scale in JavaScript, for the interactive pages: ``naRgb(x)`` (``x`` the score
#: divided by the largest absolute score, clipped to [-1, 1]) gives ``[r, g, b]``; ``naCss(x)``
#: gives ``"rgb(r, g, b)"``; ``naText(rgb)`` gives ``"#000000"`` or ``"#ffffff"`` (the larger
#: contrast ratio), as :func:`score_rgb` and :func:`text_colour`.
JS_COLOURS = r"""
var NA_RAMP = @@RAMP@@;
function naRgb(x){
  if (!isFinite(x)) { return @@NONFINITE@@; }
  x = (Math.max(-1, Math.min(1, x)) + 1) * 5; var k = Math.min(Math.floor(x), 9), f = x - k;
  var a = NA_RAMP[k], b = NA_RAMP[k + 1];
  return [Math.round(a[0] + (b[0] - a[0]) * f), Math.round(a[1] + (b[1] - a[1]) * f), Math.round(a[2] + (b[2] - a[2]) * f)];
}
function naCss(x){ var c = naRgb(x); return "rgb(" + c[0] + ", " + c[1] + ", " + c[2] + ")"; }
function naText(c){
  var l = [c[0], c[1], c[2]].map(function(v){ v = v / 255; return v <= 0.04045 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); });
  var lum = 0.2126 * l[0] + 0.7152 * l[1] + 0.0722 * l[2];
  return (lum + 0.05) / 0.05 >= 1.05 / (lum + 0.05) ? "#000000" : "#ffffff";
}
""".replace("@@RAMP@@", "[" + ",".join("[%d,%d,%d]" % c for c in _RAMP_RGB) + "]").replace(
    "@@NONFINITE@@", "[%d,%d,%d]" % _rgb(NONFINITE))


def colour_bar_html(vmax: float, signed: bool, sink_note: str = "", unit: str = "") -> str:
    r"""A static colour bar: the gradient with its end values, and the sink rule under it.

    Args:
        vmax: the largest |score| the colours are scaled to (the bar's ends).
        signed: a diverging bar (-vmax .. 0 .. +vmax) or the positive half (0 .. vmax).
        sink_note: how the first token is treated (e.g. "first token left out of the scale"; plain text).
        unit: appended to the end values (e.g. " (share)").

    Returns:
        HTML (a ``div.colour-bar``), styled by the page's own CSS or inline.
    """
    lo = f"{-vmax:.3g}" if signed else "0"
    mid = '<span style="flex:1;text-align:center">0</span>' if signed else '<span style="flex:1"></span>'
    note = (f'<div class="sink-rule" style="font-size:12px;color:#444">{html.escape(sink_note, quote=True)}</div>'
            if sink_note else "")
    unit = html.escape(unit, quote=True)
    return ('<div class="colour-bar" style="display:inline-block;min-width:18em;font-size:12px">'
            f'<div class="bar" style="height:12px;border:1px solid #999;background:{css_gradient(signed)}"></div>'
            f'<div style="display:flex"><span>{lo}{unit}</span>{mid}<span>{vmax:.3g}{unit}</span></div>'
            f"{note}</div>")


def colormap(signed: bool = True) -> Any:
    r"""The scale as a matplotlib colormap (matplotlib imported here, only when a plot is made).

    Args:
        signed: the diverging map (use with ``vmin=-m, vmax=m``) or its positive half
            (``vmin=0``), white to red.

    Returns:
        A ``matplotlib.colors.LinearSegmentedColormap`` named ``"normattr"`` or
        ``"normattr_positive"``; NaN drawn :data:`NONFINITE`.
    """
    from matplotlib.colors import LinearSegmentedColormap

    stops = RAMP if signed else RAMP[5:]
    cm = LinearSegmentedColormap.from_list("normattr" if signed else "normattr_positive", list(stops), N=256)
    return cm.with_extremes(bad=NONFINITE)
