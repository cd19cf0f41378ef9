r"""The interactive report's image panel (captum_normattr.present.interactive_images): the data it embeds
(grids round-trip exactly, the image itself, limits) and its escaping. The browser side is in
tests/present/test_interactive_browser.py."""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from captum_normattr.present import interactive_images as II
from captum_normattr.present.interactive import interactive_report_html

EVIL = "</script><script>alert(1)</script>&<!--"
TOKENS = ["<s>", "<image>", "<image>", " a", " </script>", " b"]


def _data(page: str, element: str) -> dict:
    text = page.split(f'id="{element}">')[1].split("</script>")[0]
    assert "<" not in text and ">" not in text and "&" not in text  # nothing in it can close the element
    return json.loads(text)


def _decode(enc: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(enc["f32"]), dtype="<f4").reshape(enc["n"], enc["rows"], enc["cols"])


def _image(h=12, w=20, seed=0) -> np.ndarray:
    return (np.random.RandomState(seed).rand(h, w, 3) * 255).astype(np.uint8)


def test_grids_round_trip_exactly_and_the_image_is_embedded():
    g = np.random.default_rng(0)
    rows = g.normal(size=(3, len(TOKENS)))
    grid = g.normal(size=(3, 4, 5)) * 1e-3
    grid[0, 0, 0] = np.nan  # a patch without a score
    img = _image()
    page = II.interactive_image_report_html(TOKENS, {"m": rows}, img, {"m": grid}, box=(1, 2, 10, 16))
    data = _data(page, "image-data")
    enc = data["grids"]["m"]
    assert (enc["n"], enc["rows"], enc["cols"], enc["pooled"], enc["signed"]) == (3, 4, 5, 1, True)
    back = _decode(enc)
    assert np.array_equal(back, grid.astype(np.float32), equal_nan=True)
    assert np.isnan(back[0, 0, 0]) and not np.isnan(back[0, 0, 1])
    assert data["box"] == [1.0, 2.0, 10.0, 16.0] and data["orig"] == [12, 20] and data["shown"] == [12, 20]
    assert data["src"].startswith("data:image/png;base64,")
    shown = np.asarray(Image.open(io.BytesIO(base64.b64decode(data["src"].split(",", 1)[1]))).convert("RGB"))
    assert np.array_equal(shown, img)  # lossless, not downsampled at this size
    # the report's own data is untouched, and nothing outside the page is referenced
    assert _data(page, "report-data") == _data(interactive_report_html(TOKENS, {"m": rows}), "report-data")
    assert "src=" not in page and not any("http" in part for part in (II._PANEL, II._STYLE, II._SCRIPT))


def test_the_panel_only_adds_to_the_page():
    rows = np.ones((2, len(TOKENS)))
    plain = interactive_report_html(TOKENS, {"m": rows}, title="t")
    page = II.add_image_panel(plain, _image(), {"m": np.ones((2, 2, 2))})
    assert page != plain
    stripped = (page.replace(II._STYLE, "", 1).replace(II._PANEL, "", 1)
                .split('<script type="application/json" id="image-data">')[0] + "</body></html>\n")
    assert stripped == plain
    assert page.count('id="image-canvas"') == 1 and page.count('id="image-img"') == 1


def test_escaping_of_names_and_caption():
    rows = np.ones((1, len(TOKENS)))
    page = II.interactive_image_report_html(TOKENS, {EVIL: rows}, _image(), {EVIL: np.ones((1, 2, 2))},
                                            caption=EVIL, title=EVIL)
    data = _data(page, "image-data")
    assert data["caption"] == EVIL and list(data["grids"]) == [EVIL]
    # the page's script elements: the report's data and script, the panel's data and script, nothing more
    assert page.count("<script") == 4 and page.count("</script>") == 4
    assert "<script>alert(1)" not in page and "<!--" not in page.split("<body>")[1]


def test_pooling_downsampling_and_refusals(monkeypatch):
    rows = np.ones((1, len(TOKENS)))
    big = np.random.default_rng(1).random((1, 100, 90))
    page = II.interactive_image_report_html(TOKENS, {"m": rows}, _image(1000, 500), {"m": big})
    data = _data(page, "image-data")
    enc = data["grids"]["m"]
    assert enc["pooled"] == 2 and (enc["rows"], enc["cols"]) == (50, 45) and enc["rows"] * enc["cols"] <= II.GRID_MAX_CELLS
    assert _decode(enc).sum() == pytest.approx(big.sum(), rel=1e-5)  # block sums keep the total
    assert enc["signed"] is False
    assert data["orig"] == [1000, 500] and data["shown"] == [II.IMAGE_MAX_SIDE, II.IMAGE_MAX_SIDE // 2]
    assert II.pool_grid(np.array([[[1.0, np.nan, 2.0]]]), 2).tolist() == [[[1.0, 2.0]]]
    assert np.isnan(II.pool_grid(np.full((1, 2, 2), np.nan), 2)).all()
    with pytest.raises(ValueError, match="2 explained tokens; the map has 1 rows"):
        II.interactive_image_report_html(TOKENS, {"m": rows}, _image(), {"m": np.ones((2, 2, 2))})
    with pytest.raises(ValueError, match="no map of that name"):
        II.interactive_image_report_html(TOKENS, {"m": rows}, _image(), {"other": np.ones((1, 2, 2))})
    with pytest.raises(ValueError, match="box"):
        II.interactive_image_report_html(TOKENS, {"m": rows}, _image(), {"m": np.ones((1, 2, 2))}, box=(0, 0, 0, 4))
    with pytest.raises(ValueError, match="not an interactive report"):
        II.add_image_panel("<html><body></body></html>", _image(), {})
    monkeypatch.setattr(II, "IMAGE_MAX_NUMBERS", 7)
    with pytest.raises(ValueError, match="at most 7"):
        II.interactive_image_report_html(TOKENS, {"m": rows}, _image(), {"m": np.ones((1, 2, 4))})
