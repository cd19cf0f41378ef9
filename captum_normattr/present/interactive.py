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

if TYPE_CHECKING:  # the graph's type only: attribution never imports presentation, nor this module it
    from captum_normattr.attr.routes import RouteGraph

__all__ = ["QUANTISE_ABOVE", "encode_rows", "interactive_report_html", "routes_report_html", "write_interactive_report",
           "write_routes_report"]

#: Maps with more numbers than this are stored quantised (int8 per row with the row's max |value|).
QUANTISE_ABOVE = 65536


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
) -> str:
    r"""One self-contained interactive HTML page (inline JS/CSS, no network).

    Args:
        tokens: the T tokens as strings (any characters; they are escaped and shown with
            control characters made visible).
        methods: name -> (R, T) array or tensor: row r = the attributions of output/position r
            over the T tokens. With R = T, row r belongs to token r; with R < T (one row per
            generated token), the rows belong to the last R tokens. A (T,) vector is one row.
        layer_maps: optional name -> (L, T, T) per-layer maps, stepped through with a slider.
        routes: optional route graph as JSON (:meth:`RouteGraph.to_json`), drawn as SVG.
        title: the page title.
        sink_index: the attention sink's token (e.g. 0 for BOS): marked, and (by a checkbox,
            on by default) left out of each row's colour normalisation.

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
    sink = None if sink_index is None else int(sink_index) % t
    data: Dict[str, Any] = {"tokens": [_display_token(x) for x in tokens], "sink": sink, "methods": {}, "layers": {},
                            "routes": routes}
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
    return _PAGE.replace("@@TITLE@@", page_title).replace("@@DATA@@", _json_for_script(data)).replace(
        "@@SCRIPT@@", _SCRIPT).replace("@@STYLE@@", _STYLE)


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
<div id="controls">
  <label>map <select id="method"></select></label>
  <span id="layer-box" hidden><label>layer <input type="range" id="layer" min="0" max="0" value="0"></label>
    <span id="layer-label"></span></span>
  <label id="sink-box" hidden><input type="checkbox" id="sink" checked> leave the sink out of the colours</label>
  <span id="row-label">hover a token</span>
</div>
<div id="legend"></div>
<div id="tokens" aria-label="tokens"></div>
<div id="routes-box" hidden><h2>Information-flow routes</h2><div id="routes-info"></div><div id="routes"></div></div>
<script type="application/json" id="report-data">@@DATA@@</script>
<script>@@SCRIPT@@</script>
</body></html>
"""

_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:1em 2em;color:#222}
h1{font-size:1.3em}h2{font-size:1.1em}
#controls{display:flex;gap:1.2em;align-items:center;flex-wrap:wrap;margin-bottom:.6em}
#row-label{font-family:monospace;color:#555}
#tokens{line-height:1.9;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:13px;max-height:60vh;overflow:auto;
 border:1px solid #ddd;padding:.5em}
#tokens span.tok{white-space:pre;padding:1px 1px;margin:0 1px;border-radius:2px;cursor:pointer}
#tokens span.tok.current{outline:2px solid #000}
#tokens span.tok.sink{text-decoration:underline dotted}
#tokens span.tok.norow{color:#999}
#legend{font-size:12px;color:#555;margin-bottom:.3em}
#routes{overflow:auto;border:1px solid #ddd;max-height:80vh}
#routes svg text{font-family:ui-monospace,monospace;font-size:11px}
"""

_SCRIPT = r"""
(function(){
"use strict";
var D = JSON.parse(document.getElementById("report-data").textContent);
var T = D.tokens.length;
var tokBox = document.getElementById("tokens");
var sel = document.getElementById("method");
var layerIn = document.getElementById("layer");
var layerBox = document.getElementById("layer-box");
var sinkIn = document.getElementById("sink");
var rowLabel = document.getElementById("row-label");
var spans = [];
var cache = {};
var state = {key: null, row: -1, layer: 0};
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

Object.keys(D.methods).forEach(function(n){ var o = document.createElement("option"); o.value = "m:" + n; o.textContent = n; sel.appendChild(o); });
Object.keys(D.layers).forEach(function(n){ var o = document.createElement("option"); o.value = "l:" + n; o.textContent = n + " (per layer)"; sel.appendChild(o); });
if (D.sink !== null) { document.getElementById("sink-box").hidden = false; }

var frag = document.createDocumentFragment();
for (var i = 0; i < T; i++) {
  var sp = document.createElement("span");
  sp.className = "tok"; sp.textContent = D.tokens[i]; sp.dataset.i = String(i);
  if (i === D.sink) { sp.classList.add("sink"); }
  spans.push(sp); frag.appendChild(sp); frag.appendChild(document.createTextNode(" "));
}
tokBox.appendChild(frag);

function colour(v, m, signed){
  if (!(m > 0)) { return ""; }
  var a = Math.min(1, Math.abs(v) / m);
  if (a < 0.004) { return ""; }
  return (signed && v < 0) ? "rgba(40,90,220," + a.toFixed(3) + ")" : "rgba(220,40,40," + a.toFixed(3) + ")";
}
function render(){
  var key = state.key; if (!key) { return; }
  spans.forEach(function(s){ s.style.background = ""; s.classList.remove("current"); s.title = ""; });
  var R = rowsOf(key), off = T - R;
  for (var k = 0; k < off; k++) { spans[k].classList.add("norow"); }
  for (var k2 = off; k2 < T; k2++) { spans[k2].classList.remove("norow"); }
  if (state.row < 0) { rowLabel.textContent = "hover a token"; return; }
  var src = source(key), r = state.row;
  if (key.charAt(0) === "l") { r = state.layer * T + state.row; }
  var vals = src.dec.get(r), m = 0, skip = (D.sink !== null && sinkIn.checked) ? D.sink : -1;
  for (var j = 0; j < T; j++) { if (j !== skip) { m = Math.max(m, Math.abs(vals[j])); } }
  for (var j2 = 0; j2 < T; j2++) {
    spans[j2].style.background = j2 === skip ? "#eee" : colour(vals[j2], m, src.enc.signed);
    spans[j2].title = D.tokens[j2] + ": " + vals[j2].toPrecision(4);
  }
  var tok = off + state.row;
  spans[tok].classList.add("current");
  rowLabel.textContent = "row " + state.row + " \u2190 token " + tok + " \u201c" + D.tokens[tok] + "\u201d (max " + m.toPrecision(3) + ")";
}
function choose(){
  state.key = sel.value || null;
  var isLayer = state.key && state.key.charAt(0) === "l";
  layerBox.hidden = !isLayer;
  if (isLayer) {
    var L = D.layers[state.key.slice(2)].layers;
    layerIn.max = String(L - 1);
    if (state.layer > L - 1) { state.layer = L - 1; layerIn.value = String(state.layer); }
    document.getElementById("layer-label").textContent = (state.layer + 1) + " / " + L;
  }
  if (state.key && state.row >= rowsOf(state.key)) { state.row = rowsOf(state.key) - 1; }
  document.getElementById("legend").textContent = state.key ?
    (source(state.key).enc.signed ? "red: positive, blue: negative" : "red: larger") +
    "; colours scaled to the row's largest |value|" + (source(state.key).enc.nonfinite ? "; " + source(state.key).enc.nonfinite + " non-finite values shown as 0" : "") : "";
  render();
}
tokBox.addEventListener("mouseover", function(ev){
  var t = ev.target; if (!t || !t.dataset || t.dataset.i === undefined || !state.key) { return; }
  var r = rowForToken(state.key, parseInt(t.dataset.i, 10));
  if (r < 0 || r === state.row) { return; }
  state.row = r; render();
});
sel.addEventListener("change", choose);
layerIn.addEventListener("input", function(){ state.layer = parseInt(layerIn.value, 10); choose(); });
sinkIn.addEventListener("change", render);
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
  var L = G.num_layers, dx = 90, dy = 34, left = 60, top = 20;
  var height = top + (2 * L + 1) * dy + 60, width = left + positions.length * dx + 40;
  var yOf = function(kind, layer){ var lvl = kind === "x" ? 2 * layer : 2 * layer + 1; return top + (2 * L - lvl) * dy; };
  var xOf = function(p){ return left + col[p] * dx + dx / 2; };
  var svg = svgEl("svg", {width: width, height: height, viewBox: "0 0 " + width + " " + height, id: "routes-svg"});
  for (var l = 0; l <= L; l++) {
    var lab = svgEl("text", {x: 4, y: yOf("x", l) + 4}); lab.textContent = l === 0 ? "emb" : (l === L ? "out" : "x" + l); svg.appendChild(lab);
    if (l < L) { var la = svgEl("text", {x: 4, y: yOf("m", l) + 4, fill: "#999"}); la.textContent = "L" + l + " attn"; svg.appendChild(la); }
  }
  var H = Math.max(1, G.num_heads);
  G.edges.forEach(function(e){
    var sp = e.source_position, tp = e.target_position;
    var sk = e.source.charAt(0), tk = e.target.charAt(0);
    var sl = sk === "x" ? e.layer : e.layer, tl = tk === "x" ? e.layer + 1 : e.layer;
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
  positions.forEach(function(p){
    var txt = svgEl("text", {x: xOf(p), y: height - 30, "text-anchor": "middle"});
    var s = (G.tokens && G.tokens[p] !== undefined && G.tokens[p] !== null) ? visible(String(G.tokens[p])) : (p < T ? D.tokens[p] : String(p));
    txt.textContent = s.length > 12 ? s.slice(0, 11) + "\u2026" : s;
    svg.appendChild(txt);
    var num = svgEl("text", {x: xOf(p), y: height - 14, "text-anchor": "middle", fill: "#888"}); num.textContent = String(p); svg.appendChild(num);
  });
  document.getElementById("routes").appendChild(svg);
  document.getElementById("routes-info").textContent = "prediction at position " + G.position + ", threshold " + G.threshold +
    ": " + G.nodes.length + " nodes, " + G.edges.length + " edges (grey: residual, orange: FF, blue: attention (heads summed), other colours: heads; width: importance)";
}
window.__report = {state: state, rows: function(){ return state.key ? rowsOf(state.key) : 0; }};
})();
"""
