r"""The interactive report's image panel: the image with a heat-map overlay per explained token.

A vision-language explanation scores the image's patches (or segments) for every explained
(generated) token. :func:`add_image_panel` puts, beside the tokens of a page made by
:func:`~captum_normattr.present.interactive.interactive_report_html`, the image (embedded as a
PNG data URI) and a canvas over it on which the page's script draws the selected token's grid of
image scores, scaled to the image, in the colours of the text (the same ramp: red positive, blue
negative, white 0). Hovering a token (or a heat-table row) switches the overlay to that token's
grid; a checkbox shows the sum over every explained token. Pages without images are untouched.

The data stay compact: one grid per explained token (never a per-pixel map), stored as base64
little-endian float32 (NaN: a patch without a score, drawn transparent). Limits:
:data:`IMAGE_MAX_SIDE` (the embedded image is downsampled beyond it; the overlay still covers the
original image's geometry), :data:`GRID_MAX_CELLS` (a larger grid is summed over k x k blocks,
stated on the page) and :data:`IMAGE_MAX_NUMBERS` (more grid numbers on one page are refused).
See docs/interactive.md ("Image panel") and docs/vlm.md.
"""
from __future__ import annotations

import base64
import io
import json
import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "GRID_MAX_CELLS",
    "IMAGE_MAX_NUMBERS",
    "IMAGE_MAX_SIDE",
    "add_image_panel",
    "encode_grids",
    "image_data_uri",
    "interactive_image_report_html",
    "pool_grid",
]

#: The embedded image's longest side, in pixels: a larger image is downsampled (aspect kept).
IMAGE_MAX_SIDE = 640
#: The most cells of one grid: a larger grid is summed over k x k blocks (k the smallest that fits).
GRID_MAX_CELLS = 4096
#: The most grid numbers on one page (explained tokens x cells, over all maps): more are refused.
IMAGE_MAX_NUMBERS = 1_000_000

Box = Tuple[float, float, float, float]


def _json_for_script(data: Any) -> str:
    r"""JSON safe inside a <script> element: no '<', '>', '&' left as such (as the report's own data)."""
    s = json.dumps(data, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _to_numpy(a: Any) -> np.ndarray:
    if hasattr(a, "detach"):
        a = a.detach().cpu().double().numpy()
    return np.asarray(a, dtype=np.float64)


def pool_grid(grid: np.ndarray, k: int) -> np.ndarray:
    r"""(n, rows, cols) summed over k x k blocks: (n, ceil(rows/k), ceil(cols/k)); NaN only where a block is all NaN.

    Args:
        grid: (n, rows, cols) scores (NaN: no score).
        k: the block side (1: unchanged).

    Returns:
        The pooled grid (float64); block sums keep the grid's total.

    Examples::

        >>> pool_grid(np.arange(8.0).reshape(1, 2, 4), 2).tolist()
        [[[10.0, 18.0]]]
    """
    if k <= 1:
        return grid
    n, rows, cols = grid.shape
    pr, pc = -(-rows // k), -(-cols // k)
    padded = np.full((n, pr * k, pc * k), np.nan)
    padded[:, :rows, :cols] = grid
    blocks = padded.reshape(n, pr, k, pc, k)
    empty = np.isnan(blocks).all(axis=(2, 4))
    return np.where(empty, np.nan, np.nansum(blocks, axis=(2, 4)))


def encode_grids(grids: Any, name: str = "grid") -> Dict[str, Any]:
    r"""(n, rows, cols) per-token grids as the page's JSON: base64 little-endian float32, NaN kept.

    Args:
        grids: an array or tensor, (n, rows, cols) (or (rows, cols): one token).
        name: used in error messages.

    Returns:
        dict ``n``, ``rows``, ``cols``, ``pooled`` (the block side k, 1 when not pooled),
        ``signed`` (any negative value) and ``f32`` (base64 of the n x rows x cols float32 values,
        row-major, little-endian: decoded exactly by ``np.frombuffer(..., "<f4")``).

    Examples::

        >>> enc = encode_grids(np.ones((2, 3, 4)))
        >>> enc["n"], enc["rows"], enc["cols"], enc["pooled"]
        (2, 3, 4, 1)
    """
    g = _to_numpy(grids)
    if g.ndim == 2:
        g = g[None]
    if g.ndim != 3 or 0 in g.shape:
        raise ValueError(f"image grid {name!r} has shape {tuple(g.shape)}; expected (explained tokens, rows, cols)")
    g = np.where(np.isinf(g), np.nan, g)
    cells = g.shape[1] * g.shape[2]
    k = 1 if cells <= GRID_MAX_CELLS else math.ceil(math.sqrt(cells / GRID_MAX_CELLS))
    while -(-g.shape[1] // k) * -(-g.shape[2] // k) > GRID_MAX_CELLS:
        k += 1
    g = pool_grid(g, k)
    return {"n": int(g.shape[0]), "rows": int(g.shape[1]), "cols": int(g.shape[2]), "pooled": int(k),
            "signed": bool(np.nan_to_num(g).min() < 0),
            "f32": base64.b64encode(g.astype("<f4").tobytes()).decode("ascii")}


def image_data_uri(image: Any, max_side: int = IMAGE_MAX_SIDE) -> Tuple[str, Tuple[int, int], Tuple[int, int]]:
    r"""The image as a PNG data URI, downsampled to ``max_side`` pixels on its longest side.

    Args:
        image: a ``PIL.Image``, an (H, W) or (H, W, 3|4) uint8 array, or PNG/JPEG bytes.
        max_side: the longest side kept (:data:`IMAGE_MAX_SIDE`).

    Returns:
        (the data URI, (H, W) of the original image, (h, w) of the embedded one).

    Examples::

        >>> uri, orig, shown = image_data_uri(np.zeros((4, 6, 3), dtype=np.uint8))
        >>> uri.startswith("data:image/png;base64,"), orig, shown
        (True, (4, 6), (4, 6))
    """
    from PIL import Image

    if isinstance(image, (bytes, bytearray)):
        with Image.open(io.BytesIO(bytes(image))) as im:
            im.load()
            pil = im.convert("RGBA" if im.mode in ("RGBA", "LA", "P") else "RGB")
    elif isinstance(image, Image.Image):
        pil = image if image.mode in ("RGB", "RGBA", "L") else image.convert("RGB")
    else:
        arr = np.asarray(image)
        if arr.dtype != np.uint8 or arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in (3, 4)):
            raise ValueError(f"image array must be uint8 (H, W) or (H, W, 3|4); got {arr.dtype} {arr.shape}")
        pil = Image.fromarray(arr)
    orig = (int(pil.size[1]), int(pil.size[0]))
    if max(orig) > max_side:
        scale = max_side / max(orig)
        pil = pil.resize((max(1, round(orig[1] * scale)), max(1, round(orig[0] * scale))), Image.BILINEAR)
    buf = io.BytesIO()
    pil.save(buf, format="PNG", optimize=True)
    return ("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii"), orig,
            (int(pil.size[1]), int(pil.size[0])))


def _report_rows(page: str) -> Dict[str, int]:
    r"""The maps' row counts, read from the page's own embedded data."""
    try:
        data = json.loads(page.split('id="report-data">', 1)[1].split("</script>", 1)[0])
    except (IndexError, ValueError):
        raise ValueError("the page is not an interactive report (interactive_report_html): no report data") from None
    return {str(n): int(m["rows"]) for n, m in data.get("methods", {}).items()}


def add_image_panel(
    page: str,
    image: Any,
    grids: Mapping[str, Any],
    *,
    box: Optional[Sequence[float]] = None,
    caption: str = "",
) -> str:
    r"""The interactive page with the image panel beside its tokens.

    Args:
        page: a page of :func:`~captum_normattr.present.interactive.interactive_report_html`.
        image: the image (:func:`image_data_uri`: PIL image, uint8 array or PNG/JPEG bytes).
        grids: map name -> (n, rows, cols) image scores per explained token (patch or segment
            grid; NaN: no score). The name is one of the page's maps and n its number of rows
            (row r of the map is grid r); maps without a grid show no overlay.
        box: ``(top, left, height, width)`` of the original image that the grid covers, in the
            original image's pixels (default: the whole image; e.g. LLaVA's centre crop,
            :attr:`~captum_normattr.attr.llm_images.ImageGenerationExplanation.box`).
        caption: a line under the image (plain text; escaped by the page).

    Returns:
        The HTML text: the panel, its data (one more JSON element, escaped as the report's own)
        and its script added; nothing else of the page changes.

    Raises:
        ValueError: a grid for a map the page lacks, a grid whose n is not the map's rows,
            more than :data:`IMAGE_MAX_NUMBERS` numbers, or a bad box.

    Examples::

        >>> page = interactive_report_html(["<img>", "a", "b"], {"m": np.ones((2, 3))})
        >>> page = add_image_panel(page, np.zeros((8, 8, 3), dtype=np.uint8), {"m": np.ones((2, 2, 2))})
        >>> 'id="image-data"' in page
        True
    """
    rows = _report_rows(page)
    enc: Dict[str, Any] = {}
    total = 0
    for name, g in grids.items():
        name = str(name)
        if name not in rows:
            raise ValueError(f"image grid {name!r}: the page has no map of that name (maps: {sorted(rows)})")
        e = encode_grids(g, name)
        if e["n"] != rows[name]:
            raise ValueError(f"image grid {name!r} has {e['n']} explained tokens; the map has {rows[name]} rows")
        total += e["n"] * e["rows"] * e["cols"]
        enc[name] = e
    if total > IMAGE_MAX_NUMBERS:
        raise ValueError(f"the image grids hold {total} numbers; the page keeps at most {IMAGE_MAX_NUMBERS} "
                         "(explain fewer tokens or fewer maps, or pool the grids)")
    uri, orig, shown = image_data_uri(image)
    b = (0.0, 0.0, float(orig[0]), float(orig[1])) if box is None else tuple(float(v) for v in box)
    if len(b) != 4 or not all(math.isfinite(v) for v in b) or b[2] <= 0 or b[3] <= 0:
        raise ValueError(f"box is (top, left, height, width) with positive height and width; got {box!r}")
    data = {"src": uri, "orig": list(orig), "shown": list(shown), "box": list(b), "grids": enc,
            "caption": str(caption), "max_side": IMAGE_MAX_SIDE, "max_cells": GRID_MAX_CELLS}
    anchor = '<h2>Tokens <span id="row-label">'
    if page.count(anchor) != 1 or "</style>" not in page or page.count("</body>") < 1:
        raise ValueError("the page is not an interactive report (interactive_report_html)")
    page = page.replace("</style>", _STYLE + "</style>", 1)
    page = page.replace(anchor, _PANEL + anchor, 1)
    at = page.rfind("</body>")
    block = f'<script type="application/json" id="image-data">{_json_for_script(data)}</script>\n<script>{_SCRIPT}</script>\n'
    return page[:at] + block + page[at:]


def interactive_image_report_html(tokens: Sequence[str], methods: Mapping[str, Any], image: Any,
                                  grids: Mapping[str, Any], *, box: Optional[Sequence[float]] = None,
                                  caption: str = "", **kwargs: Any) -> str:
    r""":func:`~captum_normattr.present.interactive.interactive_report_html` with :func:`add_image_panel`.

    Args:
        tokens, methods, kwargs: as for ``interactive_report_html``.
        image, grids, box, caption: as for :func:`add_image_panel`.

    Returns:
        The HTML text.

    Examples::

        >>> page = interactive_image_report_html(["<img>", "a"], {"m": [[0.5, 1.0]]}, np.zeros((4, 4), np.uint8),
        ...                                      {"m": np.ones((1, 2, 2))})
    """
    from captum_normattr.present.interactive import interactive_report_html

    return add_image_panel(interactive_report_html(tokens, methods, **kwargs), image, grids, box=box, caption=caption)


_PANEL = """<div id="image-box" aria-label="image"><div id="image-controls">
  <label><input type="checkbox" id="image-sum"> all explained tokens (sum)</label>
  <label>overlay scaled to <select id="image-scale"><option value="token">this grid</option>
    <option value="all">every token's grid</option><option value="text">the whole map (as the text)</option></select></label>
  <label>opacity <input type="range" id="image-alpha" min="0" max="100" value="65"></label></div>
<div id="image-stage"><img id="image-img" alt="the explained image"><canvas id="image-canvas"></canvas></div>
<div id="image-info"></div><div id="image-caption"></div></div>
"""

_STYLE = """
#image-box{float:right;width:min(42%,460px);margin:0 0 .6em 1.2em;font-size:12px;color:#444}
#image-controls{display:flex;flex-wrap:wrap;gap:.2em 1em;margin-bottom:.3em}
#image-stage{position:relative;line-height:0;border:1px solid #ddd}
#image-img{width:100%;height:auto;display:block;filter:grayscale(1)}
#image-canvas{position:absolute;left:0;top:0;width:100%;height:100%;image-rendering:pixelated;cursor:crosshair}
#image-info,#image-caption{margin-top:.3em;line-height:1.4}
"""

_SCRIPT = r"""
(function(){
"use strict";
var I = JSON.parse(document.getElementById("image-data").textContent);
var R = window.__report, img = document.getElementById("image-img"), cv = document.getElementById("image-canvas");
var sumIn = document.getElementById("image-sum"), scaleSel = document.getElementById("image-scale");
var alphaIn = document.getElementById("image-alpha"), info = document.getElementById("image-info");
var grids = {}, last = null;
img.src = I.src;
cv.width = I.shown[1]; cv.height = I.shown[0];
document.getElementById("image-caption").textContent = I.caption +
  (I.orig[0] !== I.shown[0] || I.orig[1] !== I.shown[1] ? (I.caption ? " \u00b7 " : "") + "image " + I.orig[1] + "\u00d7" + I.orig[0] +
   " shown at " + I.shown[1] + "\u00d7" + I.shown[0] + " (longest side at most " + I.max_side + ")" : "");
function grid(name){  // decoded once: Float32Array of n x rows x cols, and the sum over the n tokens
  if (!(name in grids)) {
    var e = I.grids[name], bin = atob(e.f32), bytes = new Uint8Array(bin.length);
    for (var i = 0; i < bin.length; i++) { bytes[i] = bin.charCodeAt(i); }
    var dv = new DataView(bytes.buffer), n = e.n * e.rows * e.cols, v = new Float32Array(n), c = e.rows * e.cols;
    for (var k = 0; k < n; k++) { v[k] = dv.getFloat32(4 * k, true); }
    var s = new Float32Array(c);
    for (var j = 0; j < c; j++) { var t = 0, any = false;
      for (var r = 0; r < e.n; r++) { var x = v[r * c + j]; if (x === x) { t += x; any = true; } }
      s[j] = any ? t : NaN; }
    var allMax = 0; for (var q = 0; q < n; q++) { if (Math.abs(v[q]) > allMax) { allMax = Math.abs(v[q]); } }
    grids[name] = {e: e, v: v, sum: s, cells: c, allMax: allMax};
  }
  return grids[name];
}
function current(){  // {g, vals, label} of the selected map and row, or null
  var key = R.state.key;
  if (!key || key.charAt(0) !== "m" || !(key.slice(2) in I.grids)) { return null; }
  var g = grid(key.slice(2));
  if (sumIn.checked) { return {g: g, vals: g.sum, label: "sum over the " + g.e.n + " explained tokens"}; }
  var r = R.state.row; if (r < 0 || r >= g.e.n) { return null; }
  var toks = document.querySelectorAll("#tokens span.tok"), rowTok = toks[toks.length - g.e.n + r];
  return {g: g, vals: g.v.subarray(r * g.cells, (r + 1) * g.cells), row: r,
          label: "explained token " + r + (rowTok ? " \u201c" + rowTok.textContent + "\u201d" : "")};
}
function draw(){
  var c = current(), ctx = cv.getContext("2d");
  ctx.clearRect(0, 0, cv.width, cv.height);
  cv.style.opacity = String(parseInt(alphaIn.value, 10) / 100);
  if (!c) { info.textContent = R.state.key ? "no image scores for this map" : ""; last = null; return; }
  var e = c.g.e, m = 0, vals = c.vals;
  if (scaleSel.value === "text") { m = R.scale(); }
  else if (scaleSel.value === "all" && !sumIn.checked) { m = c.g.allMax; }
  else { for (var j = 0; j < vals.length; j++) { if (Math.abs(vals[j]) > m) { m = Math.abs(vals[j]); } } }
  var sy = I.shown[0] / I.orig[0], sx = I.shown[1] / I.orig[1];
  var top = I.box[0] * sy, left = I.box[1] * sx, ch = I.box[2] * sy / e.rows, cw = I.box[3] * sx / e.cols;
  var sum = 0;
  for (var r = 0; r < e.rows; r++) {
    for (var k = 0; k < e.cols; k++) {
      var v = vals[r * e.cols + k]; if (v !== v) { continue; }
      sum += v;
      var col = m > 0 ? naRgb(v / m) : [255, 255, 255];
      ctx.fillStyle = "rgb(" + col[0] + "," + col[1] + "," + col[2] + ")";
      var x0 = Math.round(left + k * cw), y0 = Math.round(top + r * ch);
      ctx.fillRect(x0, y0, Math.max(1, Math.round(left + (k + 1) * cw) - x0), Math.max(1, Math.round(top + (r + 1) * ch) - y0));
    }
  }
  last = {c: c, m: m};
  info.textContent = "Image overlay: " + c.label + "; " + e.rows + "\u00d7" + e.cols + " grid" +
    (e.pooled > 1 ? " (patch scores summed over " + e.pooled + "\u00d7" + e.pooled + " blocks: the grid is larger than " + I.max_cells + " cells)" : "") +
    "; sum " + sum.toPrecision(3) + "; " + (e.signed ? "blue: negative, white: 0, red: positive" : "white: 0, red: larger") +
    ", scaled to \u00b1" + (m > 0 ? m.toPrecision(3) : "0") + " (" + scaleSel.options[scaleSel.selectedIndex].text + ")";
}
var seen = null;
function sync(){ var k = R.state.key + "|" + R.state.row + "|" + R.state.layer; if (k !== seen) { seen = k; draw(); } }
["mouseover", "mousemove", "change", "input"].forEach(function(t){ document.addEventListener(t, sync); });
// the report's own controls, directly: a script's change event (new Event("change")) does not bubble
[document.getElementById("method"), document.getElementById("layer")].forEach(function(el){
  el.addEventListener("change", sync); el.addEventListener("input", sync); });
[sumIn, scaleSel, alphaIn, document.getElementById("sink"), document.getElementById("scale")].forEach(function(el){
  el.addEventListener("change", draw); el.addEventListener("input", draw); });
cv.addEventListener("mousemove", function(ev){
  if (!last) { cv.title = ""; return; }
  var b = cv.getBoundingClientRect(), e = last.c.g.e;
  var y = (ev.clientY - b.top) / b.height * I.orig[0], x = (ev.clientX - b.left) / b.width * I.orig[1];
  var r = Math.floor((y - I.box[0]) / I.box[2] * e.rows), k = Math.floor((x - I.box[1]) / I.box[3] * e.cols);
  if (r < 0 || r >= e.rows || k < 0 || k >= e.cols) { cv.title = "outside the grid"; return; }
  var v = last.c.vals[r * e.cols + k];
  cv.title = "cell (" + r + ", " + k + "): " + (v === v ? v.toPrecision(4) : "no score");
});
window.__image = {draw: draw, current: function(){ var c = current(); return c ? {row: c.row === undefined ? -1 : c.row,
  label: c.label, scale: last ? last.m : 0} : null; }};
sync();
})();
"""
