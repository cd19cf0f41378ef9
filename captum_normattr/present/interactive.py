r"""A self-contained interactive HTML report: token maps, layer maps and information-flow routes.

:func:`interactive_report_html` returns one HTML page with inline CSS and JavaScript and its
data embedded as compact JSON (no network, no external file). Hover a token to see its row of
the selected map (the map's row r = the attributions of output/position r over the T
tokens), switch methods, step through layers of per-layer maps, and see a route graph
(:class:`~captum_normattr.attr.routes.RouteGraph`) drawn as SVG by the page's script
(:func:`routes_report_html`: the page of a graph alone).
Large maps are quantised (int8 per row, with the row's scale) and decoded one row at a time,
so a 2,000-token input stays usable: the page holds T token elements, never T^2. See
docs/interactive.md.
"""
from __future__ import annotations

import base64
import html
import json
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Sequence

import numpy as np

from captum_normattr.present.colours import JS_COLOURS, css_variables

if TYPE_CHECKING:  # the graph's type only: attribution never imports presentation, nor this module it
    from captum_normattr.attr.routes import RouteGraph

__all__ = ["HEAT_TABLE_CELLS", "HEAT_TABLE_COLUMNS", "QUANTISE_ABOVE", "encode_rows", "interactive_report_html", "routes_report_html", "write_interactive_report",
           "write_routes_report"]

#: Maps with more numbers than this are stored quantised (int8 per row with the row's max |value|).
QUANTISE_ABOVE = 65536
#: The heat table is an HTML table with a number in every cell up to this many numbers ...
HEAT_TABLE_CELLS = 12000
#: ... and this many tokens (columns); a larger map is drawn on a canvas, one pixel per number.
HEAT_TABLE_COLUMNS = 150


def _array(a: Any) -> np.ndarray:
    if hasattr(a, "detach"):
        a = a.detach().cpu().double().numpy()
    return np.asarray(a, dtype=np.float64)


def _display_token(tok: Any) -> str:
    r"""The token as shown: control characters made visible (newline, tab, \\xNN)."""
    out = []
    for ch in str(tok):
        o = ord(ch)
        if ch == "\n":
            out.append("\u21b5")
        elif ch == "\t":
            out.append("\u21e5")
        elif ch == "\r":
            out.append("\u240d")
        elif o < 32 or 127 <= o < 160 or 0xD800 <= o < 0xE000:
            out.append(f"\\x{o:02x}" if o < 256 else f"\\u{o:04x}")
        else:
            out.append(ch)
    return "".join(out)


def encode_rows(a: Any, t: int, name: str = "map") -> Dict[str, Any]:
    r"""A (..., R, T) array as the page's JSON: plain numbers, or int8 rows with per-row scales.

    Args:
        a: an array or tensor whose last dimension is the T tokens.
        t: T.
        name: used in error messages.

    Returns:
        dict ``rows`` (number of rows over all leading dimensions), ``signed``, and either
        ``values`` (flat list, 6 significant digits) or ``q`` (base64 int8) with ``scale``.
    """
    x = _array(a)
    if x.ndim < 1 or x.shape[-1] != t:
        raise ValueError(f"{name} has shape {tuple(x.shape)}; its last dimension must be the {t} tokens")
    rows = x.reshape(-1, t)
    bad = ~np.isfinite(rows)
    if bad.any():
        rows = np.where(bad, 0.0, rows)
    out: Dict[str, Any] = {"rows": int(rows.shape[0]), "signed": bool((rows < 0).any()), "nonfinite": int(bad.sum())}
    if rows.size <= QUANTISE_ABOVE:
        out["values"] = [float(f"{v:.6g}") for v in rows.ravel()]
    else:
        scale = np.abs(rows).max(-1)
        q = np.round(rows / np.where(scale > 0, scale, 1.0)[:, None] * 127).astype(np.int8)
        out["q"] = base64.b64encode(q.tobytes()).decode("ascii")
        out["scale"] = [float(f"{s:.6g}") for s in scale]
    return out


def _json_for_script(data: Any) -> str:
    r"""JSON safe inside a <script> element: no '<', '>', '&' or line separators left as such."""
    s = json.dumps(data, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def interactive_report_html(
    tokens: Sequence[str],
    methods: Mapping[str, Any],
    *,
    layer_maps: Optional[Mapping[str, Any]] = None,
    routes: Optional[Dict[str, Any]] = None,
    title: str = "",
    sink_index: Optional[int] = None,
    exclude_sink: Optional[bool] = None,
    model_name: Optional[str] = None,
    first_generated: Optional[int] = None,
    explained_row: Optional[int] = None,
) -> str:
    r"""One self-contained interactive HTML page (inline JS/CSS, no network).

    The page opens on the whole picture, coloured before any hover: the model's name, a
    colour bar (the scale's end values and how the sink is treated), a short summary of the
    top contributors, and a heat table of the selected map (explained rows x input tokens,
    numbers in the cells; a canvas, one pixel per number, when the map is larger than
    :data:`HEAT_TABLE_CELLS` numbers or :data:`HEAT_TABLE_COLUMNS` tokens). Under it the
    tokens, coloured by the selected row (hover a token or a row of the table to select
    it), the method selector, the layer slider and the route graph (column labels kept
    visible at the top). Colours: :mod:`captum_normattr.present.colours`.

    Args:
        tokens: the T tokens as strings (any characters; they are escaped and shown with
            control characters made visible).
        methods: name -> (R, T) array or tensor: row r = the attributions of output/position r
            over the T tokens. With R = T, row r belongs to token r; with R < T (one row per
            generated token), the rows belong to the last R tokens. A (T,) vector is one row.
        layer_maps: optional name -> (L, T, T) per-layer maps, stepped through with a slider.
        routes: optional route graph as JSON (:meth:`RouteGraph.to_json`), drawn as SVG.
        title: the page title.
        sink_index: the attention sink's token (e.g. 0 for BOS): marked, and (by a checkbox)
            left out of the colour scale.
        exclude_sink: the checkbox's initial state (default: on where there is a sink);
            the colour bar states the rule.
        model_name: the model's readable name, shown under the title
            (:func:`~captum_normattr.present.labels.model_display_name`: never an absolute path).
        first_generated: index of the first generated token: columns from here on are
            marked as generated.
        explained_row: the row selected when the page opens (default: the last row).

    Returns:
        The HTML text.

    Examples::

        >>> page = interactive_report_html(["a", "b"], {"alti": [[1, 0], [0.4, 0.6]]}, title="demo")
        >>> page.startswith("<!DOCTYPE html>")
        True
    """
    t = len(tokens)
    if t == 0:
        raise ValueError("tokens is empty")
    if sink_index is not None and not (-t <= int(sink_index) < t):
        raise ValueError(f"sink_index {sink_index} is outside the {t} tokens")
    if first_generated is not None and not (0 <= int(first_generated) <= t):
        raise ValueError(f"first_generated {first_generated} is outside 0..{t}")
    sink = None if sink_index is None else int(sink_index) % t
    data: Dict[str, Any] = {"tokens": [_display_token(x) for x in tokens], "sink": sink, "methods": {}, "layers": {},
                            "routes": routes, "exclude_sink": bool(sink is not None if exclude_sink is None else exclude_sink),
                            "model": None if model_name is None else str(model_name),
                            "gen": None if first_generated is None else int(first_generated),
                            "row0": None if explained_row is None else int(explained_row),
                            "heat_cells": HEAT_TABLE_CELLS, "heat_cols": HEAT_TABLE_COLUMNS}
    for name, m in methods.items():
        arr = _array(m)
        if arr.ndim == 1:
            arr = arr[None]
        if arr.ndim != 2 or arr.shape[0] > t:
            raise ValueError(f"method {name!r} has shape {tuple(arr.shape)}; expected (R, {t}) with R <= {t}")
        data["methods"][str(name)] = encode_rows(arr, t, f"method {name!r}")
    for name, m in (layer_maps or {}).items():
        arr = _array(m)
        if arr.ndim != 3 or arr.shape[1:] != (t, t):
            raise ValueError(f"layer map {name!r} has shape {tuple(arr.shape)}; expected (L, {t}, {t})")
        enc = encode_rows(arr, t, f"layer map {name!r}")
        enc["layers"] = int(arr.shape[0])
        data["layers"][str(name)] = enc
    if routes is not None and not isinstance(routes, dict):
        raise TypeError("routes must be a RouteGraph JSON dict (RouteGraph.to_json())")
    page_title = html.escape(title or "captum_normattr report", quote=True)
    model_line = "" if model_name is None else f"model: {html.escape(_display_token(model_name), quote=True)} \u00b7 "
    return (_PAGE.replace("@@TITLE@@", page_title).replace("@@MODEL@@", model_line)
            .replace("@@DATA@@", _json_for_script(data)).replace("@@SCRIPT@@", JS_COLOURS + _SCRIPT)
            .replace("@@STYLE@@", css_variables() + _STYLE))


def write_interactive_report(path: str, tokens: Sequence[str], methods: Mapping[str, Any], **kwargs: Any) -> str:
    r"""Write :func:`interactive_report_html` to ``path`` (UTF-8) and return the path.

    Args:
        path: the output file.
        tokens, methods, kwargs: as for :func:`interactive_report_html`.

    Returns:
        ``path``.
    """
    page = interactive_report_html(tokens, methods, **kwargs)
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return path



def routes_report_html(graph: "RouteGraph", title: str = "") -> str:
    r"""The interactive page of a route graph alone: the graph as SVG, and the flow to the input tokens.

    The flow reaching each input token (:meth:`~captum_normattr.attr.routes.RouteGraph.token_flow`)
    is shown as the explained token's row; the page's rows belong to the last tokens, so it is
    shown where the explained token is the last one.

    Args:
        graph: a :class:`~captum_normattr.attr.routes.RouteGraph` (its tokens, or their indices
            where it has none).
        title: the page title (default "Information-flow routes").

    Returns:
        The HTML text (:func:`interactive_report_html`; self-contained, SVG drawn by inline JS).

    Examples::

        >>> g = InformationFlowRoutes(model).attribute(ids, tokens=toks)
        >>> page = routes_report_html(g, title="routes")
    """
    n = int(graph.meta.get("seq_len", graph.position + 1))
    toks = graph.tokens if graph.tokens is not None else [str(i) for i in range(n)]
    methods = {"route flow": graph.token_flow()[None]} if graph.position == len(toks) - 1 else {}
    return interactive_report_html(toks, methods, routes=graph.to_json(), title=title or "Information-flow routes")


def write_routes_report(path: str, graph: "RouteGraph", title: str = "") -> str:
    r"""Write :func:`routes_report_html` to ``path`` (UTF-8) and return the path.

    Args:
        path: the output file.
        graph, title: as for :func:`routes_report_html`.

    Returns:
        ``path``.
    """
    with open(path, "w", encoding="utf-8") as f:
        f.write(routes_report_html(graph, title))
    return path


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:">
<link rel="icon" href="data:,">
<title>@@TITLE@@</title>
<style>@@STYLE@@</style>
</head><body>
<h1 id="title">@@TITLE@@</h1>
<div id="meta">@@MODEL@@<span id="meta-counts"></span></div>
<div id="controls">
  <label>map <select id="method"></select></label>
  <span id="layer-box" hidden><label>layer <input type="range" id="layer" min="0" max="0" value="0"></label>
    <span id="layer-label"></span></span>
  <label>colours scaled to <select id="scale"><option value="map">the whole map</option>
    <option value="row">each row</option></select></label>
  <label id="sink-box" hidden><input type="checkbox" id="sink"> leave the sink out of the colour scale</label>
</div>
<div id="bar-box"><div id="bar"></div><div id="bar-ticks"><span id="bar-lo"></span><span id="bar-mid"></span>
  <span id="bar-hi"></span></div><div id="legend"></div></div>
<div id="summary" aria-label="top contributors"></div>
<div id="heat-box"><div id="heat-info"></div><div id="heat"></div></div>
<h2>Tokens <span id="row-label"></span></h2>
<div id="tokens" aria-label="tokens"></div>
<div id="routes-box" hidden><h2>Information-flow routes</h2><div id="routes-info"></div><div id="routes"></div></div>
<script type="application/json" id="report-data">@@DATA@@</script>
<script>@@SCRIPT@@</script>
</body></html>
"""

_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:1em 2em;color:#222}
h1{font-size:1.3em;margin-bottom:.1em}h2{font-size:1.05em;margin:.9em 0 .3em}
#meta{color:#555;font-size:13px;margin-bottom:.6em}
#controls{display:flex;gap:1.2em;align-items:center;flex-wrap:wrap;margin-bottom:.6em;font-size:14px}
#row-label{font-family:ui-monospace,monospace;font-weight:normal;font-size:13px;color:#444}
#bar-box{display:inline-block;min-width:22em;max-width:46em;font-size:12px;margin-bottom:.5em}
#bar{height:14px;border:1px solid #888;background:var(--na-signed-bar)}
#bar.unsigned{background:var(--na-unsigned-bar)}
#bar-ticks{display:flex;justify-content:space-between;font-family:ui-monospace,monospace}
#legend{color:#444;margin-top:.2em}
#summary{font-size:13px;margin:.3em 0 .6em;line-height:1.5}
#summary b{font-weight:600}
#summary .chip{font-family:ui-monospace,monospace;padding:0 .3em;border-radius:3px;white-space:pre}
#heat-info{font-size:12px;color:#555;margin-bottom:.2em}
#heat{max-height:62vh;overflow:auto;border:1px solid #ddd;display:inline-block;max-width:100%}
table.heat{border-collapse:collapse;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:11px}
table.heat th,table.heat td{border:1px solid #f0f0f0;padding:1px 3px}
table.heat td{text-align:right;min-width:2.6em;font-variant-numeric:tabular-nums}
table.heat thead th{position:sticky;top:0;background:#fff;z-index:2;vertical-align:bottom}
table.heat thead th.col div{writing-mode:vertical-rl;transform:rotate(180deg);max-height:9em;overflow:hidden;
 white-space:pre;text-align:left}
table.heat th.rowh{position:sticky;left:0;background:#fff;z-index:1;text-align:right;white-space:pre;font-weight:normal}
table.heat thead th.corner{left:0;z-index:3;font-weight:normal;color:#777}
table.heat th.gen{color:#7a3b00;font-style:italic}
table.heat th.sink{text-decoration:underline dotted}
table.heat tr.current th.rowh{outline:2px solid #000;font-weight:bold}
canvas#heat-canvas{image-rendering:pixelated;display:block;cursor:crosshair}
#tokens{line-height:1.9;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:13px;max-height:40vh;overflow:auto;
 border:1px solid #ddd;padding:.5em}
#tokens span.tok{white-space:pre;padding:1px 1px;margin:0 1px;border-radius:2px;cursor:pointer}
#tokens span.tok.current{outline:2px solid #000}
#tokens span.tok.sink{text-decoration:underline dotted}
#tokens span.tok.gen{font-style:italic}
#tokens span.tok.norow{color:#767676}
#routes-info{font-size:12px;color:#444;margin-bottom:.3em}
#routes{overflow:auto;border:1px solid #ddd;max-height:80vh;position:relative}
#routes .route-cols{position:sticky;top:0;background:rgba(255,255,255,.95);z-index:2;border-bottom:1px solid #ddd}
#routes svg{display:block}
#routes svg text{font-family:ui-monospace,monospace;font-size:11px}
"""

_SCRIPT = r"""
(function(){
"use strict";
var D = JSON.parse(document.getElementById("report-data").textContent);
var T = D.tokens.length;
var tokBox = document.getElementById("tokens");
var sel = document.getElementById("method");
var scaleSel = document.getElementById("scale");
var layerIn = document.getElementById("layer");
var layerBox = document.getElementById("layer-box");
var sinkIn = document.getElementById("sink");
var rowLabel = document.getElementById("row-label");
var heat = document.getElementById("heat");
var spans = [];
var cache = {}, maxCache = {};
var state = {key: null, row: -1, layer: 0, mode: "map", heat: null};
var cells = null, rowEls = null, canvas = null;
sinkIn.checked = !!D.exclude_sink;
function visible(s){  // control characters made visible, as the report's own tokens
  return s.replace(/[\u0000-\u001f\u007f-\u009f]/g, function(c){
    if (c === "\n") { return "\u21b5"; } if (c === "\t") { return "\u21e5"; } if (c === "\r") { return "\u240d"; }
    var h = c.charCodeAt(0).toString(16); return "\\x" + (h.length < 2 ? "0" + h : h); });
}
function decode(enc){
  if (enc.values) { return {get: function(r){ return enc.values.slice(r*T, (r+1)*T); }}; }
  var bin = atob(enc.q), n = bin.length, bytes = new Int8Array(n);
  for (var i = 0; i < n; i++) { var c = bin.charCodeAt(i); bytes[i] = c > 127 ? c - 256 : c; }
  return {get: function(r){
    var s = enc.scale[r] / 127, out = new Array(T), o = r*T;
    for (var j = 0; j < T; j++) { out[j] = bytes[o + j] * s; }
    return out; }};
}
function source(key){
  if (!(key in cache)) {
    var kind = key.charAt(0), name = key.slice(2);
    var enc = kind === "m" ? D.methods[name] : D.layers[name];
    cache[key] = {enc: enc, dec: decode(enc)};
  }
  return cache[key];
}
function rowsOf(key){ var s = source(key); return key.charAt(0) === "m" ? s.enc.rows : T; }
function rowForToken(key, i){ var R = rowsOf(key); var off = T - R; return i - off; }
function rowVals(key, r){ if (key.charAt(0) === "l") { r = state.layer * T + r; } return source(key).dec.get(r); }
function skipCol(){ return (D.sink !== null && sinkIn.checked) ? D.sink : -1; }
function isGen(j){ return D.gen !== null && j >= D.gen; }
function label(j){ return "\u201c" + D.tokens[j] + "\u201d" + (isGen(j) ? " (gen @" + j + ")" : "") + (j === D.sink ? " (sink)" : ""); }
function maxima(key){  // the map's and every row's largest |value|, the sink left out when asked
  var ck = key + "|" + state.layer + "|" + skipCol();
  if (ck in maxCache) { return maxCache[ck]; }
  var R = rowsOf(key), sk = skipCol(), all = 0, rows = new Array(R), colAbs = new Array(T), best = null;
  for (var j0 = 0; j0 < T; j0++) { colAbs[j0] = 0; }
  for (var r = 0; r < R; r++) {
    var v = rowVals(key, r), m = 0;
    for (var j = 0; j < T; j++) {
      if (j === sk) { continue; }
      var a = Math.abs(v[j]); colAbs[j] += a;
      if (a > m) { m = a; }
      if (best === null || a > best.a) { best = {a: a, r: r, j: j, v: v[j]}; }
    }
    rows[r] = m; if (m > all) { all = m; }
  }
  maxCache[ck] = {all: all, rows: rows, colAbs: colAbs, best: best};
  return maxCache[ck];
}
function scaleOf(r){ var mx = maxima(state.key); return state.mode === "row" ? mx.rows[r] : mx.all; }
function decimals(m){ return m >= 1e4 ? -1 : (m >= 100 ? 0 : (m >= 10 ? 1 : (m >= 1 ? 2 : 3))); }
function fmt(v, d){ return d < 0 ? v.toExponential(1) : v.toFixed(d); }
function paint(el, v, m, j){  // background and readable text colour of one cell or token
  if (j === skipCol()) { el.style.background = "var(--na-sink)"; el.style.color = "#000000"; return; }
  if (!(m > 0) || Math.abs(v) / m < 0.004) { el.style.background = ""; el.style.color = ""; return; }
  var c = naRgb(v / m);
  el.style.background = "rgb(" + c[0] + ", " + c[1] + ", " + c[2] + ")"; el.style.color = naText(c);
}

Object.keys(D.methods).forEach(function(n){ var o = document.createElement("option"); o.value = "m:" + n; o.textContent = n; sel.appendChild(o); });
Object.keys(D.layers).forEach(function(n){ var o = document.createElement("option"); o.value = "l:" + n; o.textContent = n + " (per layer)"; sel.appendChild(o); });
if (D.sink !== null) { document.getElementById("sink-box").hidden = false; }
document.getElementById("meta-counts").textContent = T + " tokens" + (D.gen !== null ? " (" + (T - D.gen) + " generated, in italics)" : "") +
  " \u00b7 " + sel.options.length + " map(s)";

var frag = document.createDocumentFragment();
for (var i = 0; i < T; i++) {
  var sp = document.createElement("span");
  sp.className = "tok"; sp.textContent = D.tokens[i]; sp.dataset.i = String(i);
  if (i === D.sink) { sp.classList.add("sink"); }
  if (isGen(i)) { sp.classList.add("gen"); }
  spans.push(sp); frag.appendChild(sp); frag.appendChild(document.createTextNode(" "));
}
tokBox.appendChild(frag);

// --- the heat table: explained rows x input tokens ------------------------------
function buildHeat(){
  var key = state.key; heat.textContent = ""; cells = null; rowEls = null; canvas = null;
  if (!key) { return; }
  var R = rowsOf(key), off = T - R;
  if (R * T <= D.heat_cells && T <= D.heat_cols) {
    state.heat = "table";
    var tbl = document.createElement("table"); tbl.className = "heat"; tbl.id = "heat-table";
    var thead = document.createElement("thead"), hr = document.createElement("tr");
    var corner = document.createElement("th"); corner.className = "corner rowh"; corner.textContent = "row \u2190 input";
    hr.appendChild(corner);
    for (var j = 0; j < T; j++) {
      var th = document.createElement("th"); th.className = "col" + (isGen(j) ? " gen" : "") + (j === D.sink ? " sink" : "");
      var dv = document.createElement("div"); dv.textContent = D.tokens[j]; th.appendChild(dv);
      th.title = j + ": " + D.tokens[j] + (isGen(j) ? " (generated)" : "") + (j === D.sink ? " (sink)" : "");
      hr.appendChild(th);
    }
    thead.appendChild(hr); tbl.appendChild(thead);
    var tb = document.createElement("tbody"); cells = []; rowEls = [];
    for (var r = 0; r < R; r++) {
      var tr = document.createElement("tr"); tr.dataset.r = String(r);
      var rh = document.createElement("th"); rh.className = "rowh" + (isGen(off + r) ? " gen" : "");
      rh.textContent = D.tokens[off + r]; rh.title = "row " + r + ": token " + (off + r); tr.appendChild(rh);
      var rowCells = [];
      for (var j2 = 0; j2 < T; j2++) { var td = document.createElement("td"); tr.appendChild(td); rowCells.push(td); }
      cells.push(rowCells); rowEls.push(tr); tb.appendChild(tr);
    }
    tbl.appendChild(tb); heat.appendChild(tbl);
    tb.addEventListener("mouseover", function(ev){
      var tr = ev.target.closest ? ev.target.closest("tr") : null;
      if (tr && tr.dataset.r !== undefined) { var rr = parseInt(tr.dataset.r, 10); if (rr !== state.row) { state.row = rr; render(); } }
    });
  } else {
    state.heat = "canvas";
    canvas = document.createElement("canvas"); canvas.id = "heat-canvas"; canvas.width = T; canvas.height = R;
    var w = Math.min(Math.max(heat.parentNode.clientWidth - 4, 300), 1400);
    canvas.style.width = w + "px"; canvas.style.height = Math.max(40, Math.min(600, Math.round(w * R / T))) + "px";
    heat.appendChild(canvas);
    canvas.addEventListener("mousemove", function(ev){
      var b = canvas.getBoundingClientRect();
      var c = Math.floor((ev.clientX - b.left) / b.width * T), rr = Math.floor((ev.clientY - b.top) / b.height * R);
      if (rr < 0 || rr >= R || c < 0 || c >= T) { return; }
      var v = rowVals(state.key, rr)[c];
      canvas.title = "row " + D.tokens[off + rr] + " \u2190 " + D.tokens[c] + ": " + v.toPrecision(4);
      if (rr !== state.row) { state.row = rr; render(); }
    });
  }
}
function paintHeat(){
  var key = state.key; if (!key) { return; }
  var R = rowsOf(key), off = T - R, mx = maxima(key), d = decimals(mx.all);
  document.getElementById("heat-info").textContent = (state.heat === "table" ?
    "Heat table: one row per explained token (rows: " + (off > 0 ? "the last " + R + " tokens" : "every token") +
    "), one column per input token; the number is the column token's contribution to the row." :
    "Heat map (" + R + " x " + T + ", one pixel per number): hover it to select a row; the rows are " +
    (off > 0 ? "the last " + R + " tokens" : "the tokens") + ", the columns the input tokens.");
  if (state.heat === "table") {
    for (var r = 0; r < R; r++) {
      var v = rowVals(key, r), m = scaleOf(r);
      for (var j = 0; j < T; j++) {
        var td = cells[r][j]; td.textContent = fmt(v[j], d);
        td.title = D.tokens[off + r] + " \u2190 " + D.tokens[j] + ": " + v[j].toPrecision(4);
        paint(td, v[j], m, j);
      }
    }
  } else if (canvas) {
    var ctx = canvas.getContext("2d"), img = ctx.createImageData(T, R), px = img.data, sk = skipCol();
    for (var r2 = 0; r2 < R; r2++) {
      var v2 = rowVals(key, r2), m2 = scaleOf(r2), o = r2 * T * 4;
      for (var j2 = 0; j2 < T; j2++) {
        var c = j2 === sk ? [224, 224, 224] : (m2 > 0 ? naRgb(v2[j2] / m2) : [255, 255, 255]);
        px[o] = c[0]; px[o + 1] = c[1]; px[o + 2] = c[2]; px[o + 3] = 255; o += 4;
      }
    }
    ctx.putImageData(img, 0, 0);
  }
}
function paintBar(){
  var key = state.key; if (!key) { return; }
  var enc = source(key).enc, mx = maxima(key), bar = document.getElementById("bar");
  bar.className = enc.signed ? "" : "unsigned";
  var m = state.mode === "row" ? "1 \u00d7 row max" : mx.all.toPrecision(3);
  document.getElementById("bar-lo").textContent = enc.signed ? "\u2212" + m : "0";
  document.getElementById("bar-mid").textContent = enc.signed ? "0" : "";
  document.getElementById("bar-hi").textContent = "+" + m;
  var sinkRule = D.sink === null ? "no sink marked: every token is in the scale" :
    (sinkIn.checked ? "sink: the first token " + label(D.sink) + " is left out of the scale (grey; its numbers unchanged)" :
     "sink: the first token " + label(D.sink) + " is in the scale");
  document.getElementById("legend").textContent = (enc.signed ? "blue: negative, white: 0, red: positive" :
    "white: 0, red: larger (no negative values)") + "; scaled to the largest |value| of " +
    (state.mode === "row" ? "each row" : "the whole map") + ". " + sinkRule +
    (enc.nonfinite ? "; " + enc.nonfinite + " non-finite values shown as 0" : "");
}
function chip(j, v, m){
  var s = document.createElement("span"); s.className = "chip"; s.textContent = D.tokens[j] + (isGen(j) ? " (gen @" + j + ")" : "") + " " + (v >= 0 ? "+" : "") + v.toPrecision(3);
  paint(s, v, m, -2); return s;
}
function paintSummary(){
  var box = document.getElementById("summary"); box.textContent = ""; var key = state.key; if (!key) { return; }
  var R = rowsOf(key), off = T - R, mx = maxima(key), sk = skipCol();
  var order = []; for (var j = 0; j < T; j++) { if (j !== sk) { order.push(j); } }
  var line1 = document.createElement("div"), b1 = document.createElement("b");
  if (state.row >= 0) {
    var v = rowVals(key, state.row), m = scaleOf(state.row);
    var top = order.slice().sort(function(a, b){ return Math.abs(v[b]) - Math.abs(v[a]); }).slice(0, 5);
    b1.textContent = "Top contributors to " + label(off + state.row) + ": "; line1.appendChild(b1);
    top.forEach(function(j){ line1.appendChild(chip(j, v[j], m)); line1.appendChild(document.createTextNode(" ")); });
    box.appendChild(line1);
  }
  if (R > 1) {
    var line2 = document.createElement("div"), b2 = document.createElement("b");
    var tot = order.slice().sort(function(a, b){ return mx.colAbs[b] - mx.colAbs[a]; }).slice(0, 5);
    b2.textContent = "Over all " + R + " rows (sum of |value|): "; line2.appendChild(b2);
    line2.appendChild(document.createTextNode(tot.map(function(j){ return label(j) + " " + mx.colAbs[j].toPrecision(3); }).join(", ")));
    if (mx.best) { line2.appendChild(document.createTextNode("; largest single value: " + label(off + mx.best.r) + " \u2190 " + label(mx.best.j) + " " + mx.best.v.toPrecision(3))); }
    box.appendChild(line2);
  }
}
function render(){
  var key = state.key; if (!key) { return; }
  spans.forEach(function(s){ s.style.background = ""; s.style.color = ""; s.classList.remove("current"); s.title = ""; });
  var R = rowsOf(key), off = T - R;
  for (var k = 0; k < off; k++) { spans[k].classList.add("norow"); }
  for (var k2 = off; k2 < T; k2++) { spans[k2].classList.remove("norow"); }
  if (rowEls) { rowEls.forEach(function(e, r){ e.classList.toggle("current", r === state.row); }); }
  paintSummary();
  if (state.row < 0) { rowLabel.textContent = "hover a token or a row"; return; }
  var vals = rowVals(key, state.row), m = scaleOf(state.row);
  for (var j2 = 0; j2 < T; j2++) {
    paint(spans[j2], vals[j2], m, j2);
    spans[j2].title = D.tokens[j2] + ": " + vals[j2].toPrecision(4);
  }
  var tok = off + state.row;
  spans[tok].classList.add("current");
  rowLabel.textContent = "coloured by row " + state.row + " \u2190 token " + tok + " " + label(tok) + " (row max " + maxima(key).rows[state.row].toPrecision(3) + ")";
}
function repaint(){ paintBar(); paintHeat(); render(); }
function choose(){
  var old = state.key;
  state.key = sel.value || null;
  var isLayer = state.key && state.key.charAt(0) === "l";
  layerBox.hidden = !isLayer;
  if (isLayer) {
    var L = D.layers[state.key.slice(2)].layers;
    layerIn.max = String(L - 1);
    if (state.layer > L - 1) { state.layer = L - 1; layerIn.value = String(state.layer); }
    document.getElementById("layer-label").textContent = (state.layer + 1) + " / " + L;
  }
  if (state.key) {
    var R = rowsOf(state.key);
    if (state.row < 0 || old === null) { state.row = (D.row0 !== null && D.row0 >= 0 && D.row0 < R) ? D.row0 : R - 1; }
    if (state.row >= R) { state.row = R - 1; }
  }
  buildHeat(); repaint();
}
tokBox.addEventListener("mouseover", function(ev){
  var t = ev.target; if (!t || !t.dataset || t.dataset.i === undefined || !state.key) { return; }
  var r = rowForToken(state.key, parseInt(t.dataset.i, 10));
  if (r < 0 || r === state.row) { return; }
  state.row = r; render();
});
sel.addEventListener("change", choose);
scaleSel.addEventListener("change", function(){ state.mode = scaleSel.value; repaint(); });
layerIn.addEventListener("input", function(){ state.layer = parseInt(layerIn.value, 10); choose(); });
sinkIn.addEventListener("change", repaint);
choose();

// --- routes -----------------------------------------------------------------
var G = D.routes;
if (G) {
  document.getElementById("routes-box").hidden = false;
  var NS = "http://www.w3.org/2000/svg";
  var svgEl = function(name, attrs){ var e = document.createElementNS(NS, name); for (var k in attrs) { e.setAttribute(k, attrs[k]); } return e; };
  var posSet = {};
  G.nodes.forEach(function(n){ posSet[n.position] = true; });
  var positions = Object.keys(posSet).map(Number).sort(function(a, b){ return a - b; });
  var col = {}; positions.forEach(function(p, k){ col[p] = k; });
  var L = G.num_layers, dx = 90, dy = 34, left = 60, top = 14;
  var height = top + (2 * L + 1) * dy, width = left + positions.length * dx + 40;
  var yOf = function(kind, layer){ var lvl = kind === "x" ? 2 * layer : 2 * layer + 1; return top + (2 * L - lvl) * dy; };
  var xOf = function(p){ return left + col[p] * dx + dx / 2; };
  // the column labels: a strip of their own, kept at the top of the scrolling box
  var head = svgEl("svg", {width: width, height: 36, id: "routes-cols-svg"});
  var headBox = document.createElement("div"); headBox.className = "route-cols"; headBox.appendChild(head);
  positions.forEach(function(p){
    var txt = svgEl("text", {x: xOf(p), y: 14, "text-anchor": "middle", "class": "route-col"});
    var s = (G.tokens && G.tokens[p] !== undefined && G.tokens[p] !== null) ? visible(String(G.tokens[p])) : (p < T ? D.tokens[p] : String(p));
    txt.textContent = s.length > 12 ? s.slice(0, 11) + "\u2026" : s;
    head.appendChild(txt);
    var num = svgEl("text", {x: xOf(p), y: 29, "text-anchor": "middle", fill: "#767676"}); num.textContent = String(p); head.appendChild(num);
  });
  var hl = svgEl("text", {x: 4, y: 14, fill: "#767676"}); hl.textContent = "token"; head.appendChild(hl);
  var svg = svgEl("svg", {width: width, height: height, viewBox: "0 0 " + width + " " + height, id: "routes-svg"});
  for (var l = 0; l <= L; l++) {
    var lab = svgEl("text", {x: 4, y: yOf("x", l) + 4}); lab.textContent = l === 0 ? "emb" : (l === L ? "out" : "x" + l); svg.appendChild(lab);
    if (l < L) { var la = svgEl("text", {x: 4, y: yOf("m", l) + 4, fill: "#767676"}); la.textContent = "L" + l + " attn"; svg.appendChild(la); }
  }
  var H = Math.max(1, G.num_heads);
  G.edges.forEach(function(e){
    var sp = e.source_position, tp = e.target_position;
    var sk = e.source.charAt(0), tk = e.target.charAt(0);
    var layerOf = function(id){ return Number(id.slice(1).split("_")[0]); };  // a shared-value head edge skips layers
    var sl = layerOf(e.source), tl = layerOf(e.target);
    var x1 = xOf(sp), y1 = yOf(sk, sl), x2 = xOf(tp), y2 = yOf(tk, tl);
    var colr = e.kind === "head" ? "hsl(" + Math.round(360 * e.head / H) + ",70%,45%)" : (e.kind === "ff" ? "#e08a00" : (e.kind === "attention" ? "#2457c5" : "#888"));
    if (e.kind === "ff") { x1 += 12; x2 += 12; }
    var line = svgEl("line", {x1: x1, y1: y1, x2: x2, y2: y2, stroke: colr, "stroke-width": (0.6 + 7 * e.importance).toFixed(2),
      "stroke-opacity": (0.35 + 0.6 * e.importance).toFixed(2), "class": "edge edge-" + e.kind});
    var tt = svgEl("title", {});
    tt.textContent = e.kind + (e.head !== null && e.head !== undefined ? " head " + e.head : "") + ", layer " + e.layer +
      ": " + sp + " \u2192 " + tp + ", importance " + e.importance.toFixed(3);
    line.appendChild(tt); svg.appendChild(line);
    if (e.kind === "ff") { svg.appendChild(svgEl("rect", {x: x1 - 4, y: (y1 + y2) / 2 - 4, width: 8, height: 8, fill: "#e08a00"})); }
  });
  G.nodes.forEach(function(n){
    if (n.kind === "f") { return; }
    var c = svgEl("circle", {cx: xOf(n.position), cy: yOf(n.kind, n.layer), r: n.kind === "x" ? 5 : 3.5,
      fill: n.kind === "x" ? "#333" : "#fff", stroke: "#333", "class": "node"});
    var tt = svgEl("title", {}); tt.textContent = n.id; c.appendChild(tt); svg.appendChild(c);
  });
  var box = document.getElementById("routes");
  box.appendChild(headBox); box.appendChild(svg);
  document.getElementById("routes-info").textContent = "prediction at position " + G.position + ", threshold " + G.threshold +
    ": " + G.nodes.length + " nodes, " + G.edges.length + " edges (grey: residual, orange: FF, blue: attention (heads summed), other colours: heads; width: importance); the final state is at the top, the embeddings at the bottom";
}
window.__report = {state: state, rows: function(){ return state.key ? rowsOf(state.key) : 0; },
                   scale: function(){ return state.key ? maxima(state.key).all : 0; }};
})();
"""
