r"""Rendering explanations as a terminal table, JSON, or a self-contained HTML report.

The unit is :class:`TextExplanation`: one text, its tokens, and the token scores of
one or more methods. :func:`explanations_from_results` builds them from
:class:`~captum_normattr.result.AttributionResult`\ s (any method's result, read through
its per-example accessor ``example(i)``, which drops the pads) or plain (B, T) score tensors;
:func:`render_table`, :func:`render_json` and :func:`render_html` turn a list of
them into a string. No dependency beyond the standard library and torch.

Examples:
    >>> ex = TextExplanation(text="a fine film", tokens=["[CLS]", "a", "fine", "film", "[SEP]"],
    ...                      scores={"ALTI": [0.4, 0.1, 0.3, 0.1, 0.1]}, explained_position=0)
    >>> print(render_table([ex], ascii_only=True).splitlines()[0])
    [1] a fine film
"""
from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
from torch import Tensor

from captum_normattr.present.colours import SINK_GREY, css_variables, score_css, score_rgb, text_colour
from captum_normattr.result import AttributionResult
from captum_normattr.tokens import display_token, visible_text

__all__ = [
    "LOGIT_ERROR",
    "TextExplanation",
    "delta_caption",
    "explanations_from_results",
    "first_token_share",
    "render_html",
    "render_json",
    "render_table",
    "score_color",
]


@dataclass
class TextExplanation:
    r"""The token attributions of one text under one or more methods.

    Attributes:
        text: the input text.
        tokens: its tokens, pads removed (special tokens included).
        scores: method name -> one score per token, in the order of ``tokens``.
        explained_position: index (into ``tokens``) of the explained row, or None.
        prediction: a readable prediction of the model (e.g. ``"POSITIVE (0.93)"`` or
            the predicted next token), or None.
        extras: more JSON-serialisable information per text (e.g. completeness error).
        figures: name -> an image for the HTML report: a ``data:`` URI or an inline
            ``<svg>`` string. Figures named after a method (``"ALTI"`` or
            ``"ALTI ..."``) are shown under that method. Not written to JSON.
        signed: method name -> whether its scores carry a sign (default False).
        row_totals: method name -> the sum of its token scores over the text (default:
            the sum of ``scores``; an aggregated explanation keeps the totals of its
            tokens). The table shows unsigned scores as shares of it.
        raw_tokens: the tokenizer's own token strings (``Ġkeys``), when ``tokens`` are
            readable labels (``" keys"``, :func:`~captum_normattr.tokens.readable_tokens`);
            JSON writes them under ``"tokens"`` and the labels under ``"token_text"``.
            Default: taken from ``tokens.raw`` when ``tokens`` is a
            :class:`~captum_normattr.tokens.ReadableTokens`, else None.
        sink_share: method name -> the share of the first token (position 0: ``[CLS]``,
            BOS, or the first word of a decoder prompt, where attention sinks sit):
            ``|score_0| / sum_t |score_t|`` over the real tokens (NaN when all scores are
            0). Default: computed from ``scores``; an aggregated explanation keeps the
            value of its tokens.
    """

    text: str
    tokens: List[str]
    scores: Dict[str, List[float]]
    explained_position: Optional[int] = None
    prediction: Optional[str] = None
    extras: Dict[str, Any] = field(default_factory=dict)
    figures: Dict[str, str] = field(default_factory=dict)
    signed: Dict[str, bool] = field(default_factory=dict)
    row_totals: Dict[str, float] = field(default_factory=dict)
    raw_tokens: Optional[List[str]] = None
    sink_share: Dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.raw_tokens is None and getattr(self.tokens, "raw", None) is not None:
            self.raw_tokens = [str(t) for t in self.tokens.raw]  # type: ignore[attr-defined]
        self.tokens = [str(t) for t in self.tokens]
        if self.raw_tokens is not None and len(self.raw_tokens) != len(self.tokens):
            raise ValueError(f"{len(self.raw_tokens)} raw tokens for {len(self.tokens)} tokens")
        for name, vals in self.scores.items():
            if len(vals) != len(self.tokens):
                raise ValueError(
                    f"method {name!r}: {len(vals)} scores for {len(self.tokens)} tokens"
                )
            if name not in self.row_totals:
                self.row_totals[name] = float(sum(float(v) for v in vals if math.isfinite(float(v))))
            if name not in self.sink_share:
                self.sink_share[name] = first_token_share(vals)

    def aggregated(self, spans: Sequence[Any], reduce: str = "sum", unit: str = "word") -> "TextExplanation":
        r"""The same explanation over spans of tokens (words, sentences ...).

        Args:
            spans: :class:`~captum_normattr.aggregation.Span`\ s whose ``tokens`` index
                ``self.tokens`` (pads removed).
            reduce: ``"sum"``, ``"mean"`` or ``"max"`` (see :mod:`captum_normattr.aggregation`).
            unit: what a span is, for the ``extras`` note (``"word"``, ``"sentence"``).

        Returns:
            A new :class:`TextExplanation` whose ``tokens`` are the span labels; the
            explained position is the span that holds the explained token (None when
            that token was dropped); ``row_totals`` and ``signed`` are kept.
        """
        from captum_normattr.aggregation import aggregate_scores

        scores = {
            name: aggregate_scores(torch.tensor(vals, dtype=torch.float64), spans, reduce).tolist()
            for name, vals in self.scores.items()
        }
        pos = None
        if self.explained_position is not None:
            pos = next((k for k, sp in enumerate(spans) if self.explained_position in sp.tokens), None)
        extras = dict(self.extras)
        extras["aggregated"] = f"{unit}s ({reduce} of their token scores)"
        if pos is None and self.explained_position is not None:
            extras["explained token"] = self.tokens[self.explained_position]
        return TextExplanation(
            text=self.text, tokens=[sp.label for sp in spans], scores=scores, explained_position=pos,
            prediction=self.prediction, extras=extras, figures=dict(self.figures), signed=dict(self.signed),
            row_totals=dict(self.row_totals), sink_share=dict(self.sink_share),
        )

    def to_dict(self) -> Dict[str, Any]:
        r"""JSON-ready dict (figures left out; NaN/inf become None).

        Returns:
            dict with ``text``, ``tokens`` (the tokenizer's own token strings when known,
            else the labels), ``token_text`` (the readable labels shown in tables and
            HTML), ``explained_position``, ``prediction``, ``attributions`` (method ->
            list of float, the raw scores), ``row_totals`` (method -> the sum of its
            token scores), ``sink_share`` (method -> the first token's share of the
            absolute scores) and ``extras``.
        """
        return {
            "text": self.text,
            "tokens": list(self.raw_tokens if self.raw_tokens is not None else self.tokens),
            "token_text": list(self.tokens),
            "explained_position": self.explained_position,
            "prediction": self.prediction,
            "attributions": {k: [_finite(v) for v in vals] for k, vals in self.scores.items()},
            "row_totals": {k: _finite(v) for k, v in self.row_totals.items()},
            "sink_share": {k: _finite(v) for k, v in self.sink_share.items()},
            "extras": _jsonable(self.extras),
        }


def first_token_share(scores: Sequence[float]) -> float:
    r"""The share of the first token in the absolute scores of one text: ``|s_0| / sum_t |s_t|``.

    Non-finite scores are left out of the sum; NaN when there is no token or all are 0.

    Examples:
        >>> first_token_share([3.0, -1.0, 0.0])
        0.75
    """
    vals = [abs(float(v)) for v in scores]
    total = sum(v for v in vals if math.isfinite(v))
    if not vals or not math.isfinite(vals[0]) or total <= 0:
        return float("nan")
    return vals[0] / total


def _finite(v: float) -> Optional[float]:
    v = float(v)
    return v if math.isfinite(v) else None


def _jsonable(x: Any) -> Any:
    if isinstance(x, Tensor):
        x = x.detach().cpu()
        return _finite(x.item()) if x.dim() == 0 else [_jsonable(v) for v in x.tolist()]
    if isinstance(x, float):
        return _finite(x)
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def explanations_from_results(
    texts: Sequence[str],
    tokens: Sequence[Sequence[str]],
    results: Mapping[str, Any],
    *,
    attention_mask: Optional[Tensor] = None,
    explained_position: Optional[Tensor] = None,
    predictions: Optional[Sequence[Optional[str]]] = None,
) -> List[TextExplanation]:
    r"""Build :class:`TextExplanation`\ s of a batch from several methods' results.

    Args:
        texts: the B texts.
        tokens: the tokens of each text, padded length T (pads are removed with the
            attention mask) or already without pads; readable labels
            (:func:`~captum_normattr.tokens.readable_tokens`) keep their raw tokens.
        results: method name -> an :class:`~captum_normattr.result.AttributionResult`
            (its per-example ``example(i)`` gives the unpadded scores; its
            ``attention_mask`` and ``explained_position`` are the defaults of the two
            arguments below) or a (B, T) score tensor (then ``attention_mask`` must be
            given, or come from a result, when there is padding).
        attention_mask: (B, T) mask for plain score tensors and the token labels.
        explained_position: (B,) explained positions (padded indexing); default: those
            of the first result that has them.
        predictions: optional readable prediction per text.

    Returns:
        A list of B :class:`TextExplanation`.

    Examples:
        >>> exps = explanations_from_results(["hi"], [["[CLS]", "hi", "[SEP]"]],
        ...                                  {"IG": torch.tensor([[0.25, 0.5, 0.25]])})
        >>> exps[0].scores["IG"]
        [0.25, 0.5, 0.25]
    """
    b = len(texts)
    found = [r for r in results.values() if isinstance(r, AttributionResult)]
    mask = attention_mask if attention_mask is not None else (found[0].attention_mask if found else None)
    pos = explained_position
    if pos is None:
        pos = next((r.explained_position for r in found if r.explained_position is not None), None)
    batch: Dict[str, AttributionResult] = {}
    for name, res in results.items():
        scores = res.scores if isinstance(res, AttributionResult) else res
        if scores.dim() != 2 or scores.shape[0] != b:
            raise ValueError(f"method {name!r}: expected scores of shape ({b}, T), got {tuple(scores.shape)}")
        if mask is None:
            mask = torch.ones(scores.shape, dtype=torch.long)
        if not isinstance(res, AttributionResult):  # plain scores: read through a bare result
            res = AttributionResult(method=name, scores=scores.detach(), attention_mask=mask.to(scores.device))
        batch[name] = res
    if mask is None:
        mask = torch.ones(b, max((len(t) for t in tokens), default=0), dtype=torch.long)
    # the rows all methods share (token labels, explained position), read with the same accessor
    shared = AttributionResult(method="", scores=torch.zeros(mask.shape), attention_mask=mask.detach().cpu(),
                               explained_position=None if pos is None else torch.as_tensor(pos).cpu())
    t_len = mask.shape[-1]
    out = []
    for i in range(b):
        keep = shared.real_tokens(i)
        toks = list(tokens[i])
        raw = getattr(tokens[i], "raw", None)
        raw = None if raw is None else list(raw)
        if len(toks) == t_len and len(toks) != keep.numel():
            toks = [toks[j] for j in keep.tolist()]
            raw = None if raw is None else [raw[j] for j in keep.tolist()]
        if len(toks) != keep.numel():
            raise ValueError(f"text {i}: {len(toks)} tokens for {keep.numel()} real positions")
        p: Optional[int] = None
        if pos is not None and bool(shared.attention_mask[i, int(pos[i])]):  # a pad explains nothing
            p = shared.example(i)["explained_position"]
        out.append(TextExplanation(
            text=str(texts[i]),
            tokens=[str(t) for t in toks],
            raw_tokens=None if raw is None else [str(t) for t in raw],
            scores={k: r.example(i)["scores"].detach().to("cpu", torch.float64).tolist() for k, r in batch.items()},
            explained_position=p,
            prediction=None if predictions is None else predictions[i],
            signed={k: bool(r.signed) for k, r in batch.items() if isinstance(results[k], AttributionResult)},
        ))
    return out


#: How a signed method's convergence delta is captioned: the error of its sum against the explained logit.
LOGIT_ERROR = "completeness error |sum - logit|"


def delta_caption(label: str, signed: bool) -> str:
    r"""The caption of a method's convergence delta in the reports.

    A signed method (DecompX, ALTI-Logit: :attr:`~captum_normattr.attr.methods.MethodSpec.signed`)
    explains a logit: its delta is ``|sum of the scores - the logit|``. A class-agnostic method
    (GlobEnc, ALTI, Value Zeroing) explains no logit: its delta is the largest reconstruction
    error of its layers' parts (the parts re-summed against the layer's real output, over
    layers and tokens; docs/methods.md), which says how exact the maps are, not how well a
    prediction is explained.

    Args:
        label: the method's label in the report.
        signed: whether the method explains a logit.

    Returns:
        The caption: ``<label>: completeness error |sum - logit|`` for a signed method, else
        ``<label>: layer reconstruction error (...; class-agnostic, no logit explained)``.

    Examples:
        >>> delta_caption("ALTI", False)
        'ALTI: layer reconstruction error (max over layers and tokens; class-agnostic, no logit explained)'
    """
    if signed:
        return f"{label}: {LOGIT_ERROR}"
    return f"{label}: layer reconstruction error (max over layers and tokens; class-agnostic, no logit explained)"


def _extra_caption(ex: "TextExplanation", key: str) -> str:
    r"""An ``extras`` key as shown: a class-agnostic method's delta never reads as a logit error."""
    suffix = ": " + LOGIT_ERROR
    if key.endswith(suffix):
        label = key[: -len(suffix)]
        if ex.signed.get(label) is False:
            return delta_caption(label, False)
    return key


# --------------------------------------------------------------------------- table

_BLOCKS = " \u258f\u258e\u258d\u258c\u258b\u258a\u2589\u2588"


def _bar(v: float, vmax: float, width: int, ascii_only: bool) -> str:
    if not math.isfinite(v) or vmax <= 0:
        return " " * width
    frac = min(abs(v) / vmax, 1.0) * width
    if ascii_only:
        n = int(round(frac))
        return ("#" if v >= 0 else "-") * n + " " * (width - n)
    if v < 0:
        n = int(round(frac))
        return "\u2591" * n + " " * (width - n)
    full = int(frac)
    rest = int(round((frac - full) * 8))
    if rest == 8:
        full, rest = full + 1, 0
    s = "\u2588" * full + (_BLOCKS[rest] if rest and full < width else "")
    return s + " " * (width - len(s))


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return "nan"
    return f"{v:.4f}" if v == 0 or 1e-3 <= abs(v) < 1e4 else f"{v:.3g}"


def _sink_line(ex: TextExplanation) -> Optional[str]:
    r"""``first-token share ...`` for one text, or None when no method has a finite share."""
    shown = [f"{nm} {ex.sink_share[nm]:.3f}" for nm in ex.scores
             if nm in ex.sink_share and math.isfinite(ex.sink_share[nm])]
    if not shown:
        return None
    which = "first token" if "aggregated" in ex.extras or not ex.tokens else f"first token {ex.tokens[0]!r}"
    return f"sink share ({which}, |s_0| / sum |s|): " + ", ".join(shown)


def render_table(
    explanations: Sequence[TextExplanation],
    *,
    bar_width: int = 12,
    ascii_only: bool = False,
    max_token_width: int = 18,
    shares: bool = False,
    exclude_sink: bool = False,
) -> str:
    r"""A readable plain-text table per text: one row per token, a column per method.

    Each method column shows the score and a bar scaled by that method's largest
    absolute score in the text (negative scores: a light-shaded bar, or ``-`` in
    ASCII). The explained row is marked with ``*``. With ``shares=True`` the scores of
    unsigned methods are shown as shares of their row (score / ``row_totals``; a raw
    GlobEnc rollout row sums to numbers like 1e5), and their column header says
    ``(share)``; signed methods keep their raw numbers. Every text reports the share of
    its first token in each method's absolute scores (``sink_share``: where decoders put
    their attention sink).

    Everything printed passes through :func:`~captum_normattr.tokens.visible_text`:
    control characters (escape sequences, carriage returns, newlines) and right-to-left
    overrides in a text, a token, a method name or a prediction are shown as ``\x1b``,
    ``\u202e``, never sent to the terminal.

    Args:
        explanations: the texts to show.
        bar_width: characters per bar (0 for no bars).
        ascii_only: use ``#``/``-`` bars instead of Unicode blocks (for terminals that
            cannot print them).
        max_token_width: longer tokens are shortened.
        shares: show unsigned scores as shares of their row.
        exclude_sink: leave the first token out of the scaling: the bars are scaled by
            the largest score of the other tokens (the first token's bar is clipped, its
            row marked ``s``) and shares divide by the total of the other tokens. The
            scores themselves are unchanged.

    Returns:
        The table as one string (lines separated by ``\n``, no trailing newline).

    Examples:
        >>> ex = TextExplanation("ok", ["[CLS]", "ok", "[SEP]"], {"ALTI": [0.5, 0.3, 0.2]}, 0)
        >>> "ok" in render_table([ex])
        True
    """
    vis = visible_text
    blocks = []
    for n, ex in enumerate(explanations, start=1):
        lines = [f"[{n}] {vis(ex.text)}"]
        if ex.prediction is not None:
            lines.append(f"    prediction: {vis(ex.prediction)}")
        for key, val in ex.extras.items():
            key = _extra_caption(ex, key)
            if isinstance(val, float):
                lines.append(f"    {vis(key)}: {val:.2g}")
            elif isinstance(val, (int, str)):
                lines.append(f"    {vis(key)}: {vis(val)}")
        sink = _sink_line(ex)
        if sink is not None:
            lines.append("    " + vis(sink))
        shown = [display_token(t, ascii_only) for t in ex.tokens]
        toks = [t if len(t) <= max_token_width else t[: max_token_width - 1] + "~" for t in shown]
        tw = max([5] + [len(t) for t in toks])
        iw = max(1, len(str(len(toks) - 1)))
        names = list(ex.scores)
        skip = 1 if exclude_sink and len(toks) > 1 else 0
        scale = {nm: 1.0 for nm in names}
        if shares:
            for nm in names:
                total = ex.row_totals.get(nm, 0.0)
                if skip:
                    first = float(ex.scores[nm][0]) if ex.scores[nm] else 0.0
                    total = total - (first if math.isfinite(first) else 0.0)
                if not ex.signed.get(nm, False) and math.isfinite(total) and total > 0:
                    scale[nm] = 1.0 / total
        heads = [vis(nm) + (" (share)" if scale[nm] != 1.0 else "") for nm in names]
        if any(scale[nm] != 1.0 for nm in names):
            lines.append("    (share) = score / sum of the method's scores over all tokens of the text"
                         + (" but the first" if skip else "") + " (raw numbers: --format json)")
        if skip:
            lines.append("    s = the first token, left out of the bar scale")
        col_w = [max(len(hd), 10 + (bar_width + 1 if bar_width else 0)) for hd in heads]
        header = f"  {'#'.rjust(iw)}  {'token'.ljust(tw)}" + "".join(
            f"  {hd.ljust(w)}" for hd, w in zip(heads, col_w)
        )
        lines.append(header.rstrip())
        lines.append("  " + "-" * (len(header) - 2))
        vmax = {nm: max([abs(v) * scale[nm] for v in ex.scores[nm][skip:] if math.isfinite(v)] + [0.0])
                for nm in names}
        for i, tok in enumerate(toks):
            mark = "*" if i == ex.explained_position else ("s" if skip and i == 0 else " ")
            row = f" {mark}{str(i).rjust(iw)}  {tok.ljust(tw)}"
            for nm, w in zip(names, col_w):
                v = float(ex.scores[nm][i]) * scale[nm]
                cell = _fmt(v).rjust(10)
                if bar_width:
                    cell += " " + _bar(v, vmax[nm], bar_width, ascii_only)
                row += "  " + cell.ljust(w)
            lines.append(row.rstrip())
        if ex.explained_position is not None:
            lines.append(f"  * explained position {ex.explained_position}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


# --------------------------------------------------------------------------- JSON


def render_json(
    explanations: Sequence[TextExplanation],
    meta: Optional[Mapping[str, Any]] = None,
    *,
    indent: Optional[int] = 2,
) -> str:
    r"""The explanations as a JSON document.

    Layout: ``{"meta": {...}, "results": [{"text", "tokens", "token_text",
    "explained_position", "prediction", "attributions": {method: [float, ...]},
    "row_totals", "sink_share", "extras"}, ...]}`` (:meth:`TextExplanation.to_dict`:
    ``tokens`` are the tokenizer's own strings, ``token_text`` the readable labels).
    Non-finite numbers become ``null`` so the output is strict JSON. Texts and tokens are
    written as they are (JSON escapes control characters itself).

    Args:
        explanations: the texts.
        meta: run information (model, methods, options ...).
        indent: JSON indentation (None for one line).

    Returns:
        The JSON string.

    Examples:
        >>> ex = TextExplanation("ok", ["ok"], {"ALTI": [1.0]})
        >>> json.loads(render_json([ex]))["results"][0]["attributions"]
        {'ALTI': [1.0]}
    """
    doc = {"meta": _jsonable(dict(meta or {})), "results": [e.to_dict() for e in explanations]}
    return json.dumps(doc, indent=indent, ensure_ascii=False, allow_nan=False)


# --------------------------------------------------------------------------- HTML


def score_color(v: float) -> str:
    r"""Background colour of a normalised score in [-1, 1]: the package's one scale
    (:mod:`captum_normattr.present.colours`: blue negative, white 0, red positive).

    Args:
        v: the normalised score (clipped to [-1, 1]; non-finite: grey).

    Returns:
        A CSS ``rgb(...)`` colour.

    Examples:
        >>> score_color(0.0), score_color(1.0)
        ('rgb(255, 255, 255)', 'rgb(103, 0, 31)')
    """
    return score_css(v)


_CSS = css_variables() + """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em;color:#222;max-width:72em}
h1{font-size:1.4em} h2{font-size:1.1em;margin-top:1.8em;border-bottom:1px solid #ddd;padding-bottom:.2em}
.meta{font-size:.85em;color:#555} .meta td{padding:0 1em 0 0}
.pred{color:#444;font-size:.9em;margin:.3em 0}
.method{margin:.6em 0} .mname{font-weight:600;font-size:.9em;margin-bottom:.2em}
.tokens{line-height:2.1em;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:.95em}
.tok{padding:.15em .3em;margin:0 .08em;border-radius:.25em;white-space:pre}
.tok.explained{outline:2px solid #36c}
table.scores{border-collapse:collapse;font-size:.8em;margin:.5em 0}
table.scores td,table.scores th{border:1px solid #ddd;padding:.15em .5em;text-align:right}
table.scores td.t{text-align:left;font-family:ui-monospace,Menlo,Consolas,monospace}
.legend{font-size:.85em;color:#444} .legend .bar{display:inline-block;width:16em;height:.9em;border:1px solid #999;
 vertical-align:middle;margin:0 .4em;background:var(--na-signed-bar)}
figure{margin:.5em 0} figure img,figure svg{max-width:100%;height:auto}
details summary{cursor:pointer;font-size:.85em;color:#36c}
"""


def _esc(value: Any) -> str:
    r"""Text for HTML: control and format characters shown visibly, then HTML-escaped (quotes too)."""
    return html.escape(visible_text(value), quote=True)


def _token_spans(ex: TextExplanation, name: str, exclude_sink: bool = False) -> str:
    vals = [float(v) for v in ex.scores[name]]
    skip = 1 if exclude_sink and len(vals) > 1 else 0
    m = max([abs(v) for v in vals[skip:] if math.isfinite(v)] + [0.0]) or 1.0
    spans = []
    for i, (tok, v) in enumerate(zip(ex.tokens, vals)):
        cls = "tok explained" if i == ex.explained_position else "tok"
        rgb = (224, 224, 224) if (skip and i == 0) else score_rgb(v / m)
        back = SINK_GREY if (skip and i == 0) else score_css(v / m)
        spans.append(
            f'<span class="{cls}" style="background-color:{back};color:{text_colour(rgb)}" '
            f'title="{_esc(tok)}: {_fmt(v)}">{html.escape(display_token(tok), quote=True)}</span>'
        )
    return "".join(spans)


def _figure_html(src: str) -> str:
    if src.lstrip().startswith("<svg") or src.lstrip().startswith("<?xml"):
        body = src[src.index("<svg"):]
        return f"<figure>{body}</figure>"
    return f'<figure><img alt="figure" src="{html.escape(src, quote=True)}"></figure>'


def render_html(
    explanations: Sequence[TextExplanation],
    meta: Optional[Mapping[str, Any]] = None,
    *,
    title: str = "captum_normattr report",
    exclude_sink: bool = False,
) -> str:
    r"""A self-contained HTML report (inline CSS, no scripts, no external files).

    For every text: the prediction (if any), the tokens coloured by each method's
    scores on the package's one scale (:mod:`captum_normattr.present.colours`: blue
    negative, white 0, red positive, intensity = |score| / max |score| of that method in
    that text, black or white text for contrast; hover for the value; the explained token
    is outlined), a
    table of the numbers, and the figures attached to the explanation.

    Args:
        explanations: the texts.
        meta: run information shown at the top (model, methods, options ...).
        title: page title.
        exclude_sink: scale each method's colours by its largest |score| over the tokens
            but the first (the first token is drawn grey); the scores are unchanged.

    Returns:
        The HTML document as a string. Every text, token, label and value appears
        HTML-escaped, with control and format characters (right-to-left overrides ...)
        shown visibly (:func:`~captum_normattr.tokens.visible_text`). Every text reports
        the first token's share of each method's absolute scores (``sink_share``).

    Examples:
        >>> ex = TextExplanation("<b>", ["[CLS]", "<b>", "[SEP]"], {"ALTI": [0.2, 0.7, 0.1]}, 0)
        >>> "&lt;b&gt;" in render_html([ex])
        True
    """
    esc = _esc
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
    ]
    if meta:
        rows = "".join(
            f"<tr><td>{esc(k)}</td><td>{esc(json.dumps(_jsonable(v), ensure_ascii=False) if not isinstance(v, str) else v)}</td></tr>"
            for k, v in meta.items()
        )
        parts.append(f'<table class="meta">{rows}</table>')
    sink_rule = ("the first token is left out of the scale (grey; its score unchanged)" if exclude_sink
                 else "the first token (sink) is in the scale; --exclude-sink leaves it out")
    parts.append(
        '<p class="legend">Colours: \u2212max<span class="bar"></span>+max '
        "(blue: negative, white: 0, red: positive; unsigned methods: white to red; per method, scaled by its "
        "largest |score| in the text; "
        f"hover a token for its value). Sink: {sink_rule}.</p>"
    )
    for n, ex in enumerate(explanations, start=1):
        parts.append(f'<section class="text"><h2>[{n}] {esc(ex.text)}</h2>')
        if ex.prediction is not None:
            parts.append(f'<div class="pred">prediction: {esc(ex.prediction)}</div>')
        for key, val in ex.extras.items():
            shown = f"{val:.2g}" if isinstance(val, float) else json.dumps(_jsonable(val))
            parts.append(f'<div class="pred">{esc(_extra_caption(ex, key))}: {esc(shown)}</div>')
        sink = _sink_line(ex)
        if sink is not None:
            parts.append(f'<div class="pred">{esc(sink)}</div>')
        placed = set()
        for name in ex.scores:
            parts.append(
                f'<div class="method"><div class="mname">{esc(name)}</div>'
                f'<div class="tokens">{_token_spans(ex, name, exclude_sink)}</div></div>'
            )
            for key, src in ex.figures.items():  # this method's figures: "name" or "name ..."
                if key not in placed and (key == name or key.startswith(name + " ")):
                    parts.append(_figure_html(src))
                    placed.add(key)
        for key, src in ex.figures.items():
            if key not in placed:
                parts.append(f'<div class="mname">{esc(key)}</div>' + _figure_html(src))
        head = "".join(f"<th>{esc(nm)}</th>" for nm in ex.scores)
        body = []
        for i, tok in enumerate(ex.tokens):
            mark = " *" if i == ex.explained_position else ""
            cells = "".join(f"<td>{_fmt(float(ex.scores[nm][i]))}</td>" for nm in ex.scores)
            body.append(f'<tr><td>{i}{mark}</td><td class="t">{html.escape(display_token(tok), quote=True)}</td>{cells}</tr>')
        parts.append(
            "<details><summary>scores</summary>"
            f'<table class="scores"><tr><th>#</th><th>token</th>{head}</tr>{"".join(body)}</table>'
            "</details></section>"
        )
    parts.append("</body></html>")
    return "\n".join(parts)


def figure_to_data_uri(fig: Any, fmt: str = "png", dpi: int = 90) -> str:
    r"""Encode a matplotlib figure for :attr:`TextExplanation.figures`.

    Args:
        fig: a matplotlib figure.
        fmt: ``"png"`` (a base64 ``data:`` URI) or ``"svg"`` (the inline SVG markup).
        dpi: resolution for PNG.

    Returns:
        A ``data:image/png;base64,...`` URI or an ``<svg ...>`` string.

    Examples:
        >>> from captum_normattr.present.visualization import plot_rollout_row
        >>> figure_to_data_uri(plot_rollout_row([1.0, 2.0], ["a", "b"])).startswith("data:image/png")
        True
    """
    import base64
    import io

    buf = io.BytesIO()
    if fmt == "svg":
        fig.savefig(buf, format="svg", bbox_inches="tight", facecolor="white")
        text = buf.getvalue().decode("utf-8")
        return text[text.index("<svg"):]
    if fmt != "png":
        raise ValueError(f"fmt must be 'png' or 'svg', got {fmt!r}")
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight", facecolor="white")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
