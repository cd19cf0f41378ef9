r"""One colour convention: the scale, its text contrast, its matplotlib map, and every page and plot using it."""
import numpy as np
import pytest

from captum_normattr.present import colours
from captum_normattr.present.colours import RAMP, colormap, score_css, score_hex, score_rgb, text_colour
from captum_normattr.present.labels import model_display_name
from captum_normattr.present.report import TextExplanation, delta_caption, render_html, render_table, score_color


def _contrast(a, b):
    def lum(c):
        lin = [(v / 255) / 12.92 if v / 255 <= 0.04045 else ((v / 255 + 0.055) / 1.055) ** 2.4 for v in c]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    hi, lo = sorted([lum(a), lum(b)], reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_scale_is_blue_white_red_and_monotone():
    assert score_hex(-1.0) == RAMP[0] and score_hex(0.0) == "#ffffff" and score_hex(1.0) == RAMP[-1]
    r, g, b = score_rgb(-0.6)
    assert b > r and b > g  # negative: blue
    r, g, b = score_rgb(0.6)
    assert r > g and r > b  # positive: red
    assert score_rgb(5.0) == score_rgb(1.0) and score_rgb(-5.0) == score_rgb(-1.0)  # clipped
    assert score_hex(float("nan")) == colours.NONFINITE
    # darker with |score|, on both sides: the sum of the channels falls
    xs = np.linspace(0, 1, 21)
    for sign in (1, -1):
        light = [sum(score_rgb(sign * x)) for x in xs]
        assert all(a >= b for a, b in zip(light, light[1:])), sign


def test_text_colour_has_the_larger_contrast_and_is_readable():
    worst = 21.0
    for x in np.linspace(-1, 1, 81):
        bg = score_rgb(float(x))
        fg = (0, 0, 0) if text_colour(bg) == "#000000" else (255, 255, 255)
        other = (255, 255, 255) if fg == (0, 0, 0) else (0, 0, 0)
        assert _contrast(bg, fg) >= _contrast(bg, other)
        worst = min(worst, _contrast(bg, fg))
    assert worst >= 4.5  # WCAG AA for normal text, on every colour of the scale
    assert text_colour(score_rgb(1.0)) == "#ffffff" and text_colour(score_rgb(0.0)) == "#000000"


def test_matplotlib_map_is_the_same_ramp():
    pytest.importorskip("matplotlib")
    for signed in (True, False):
        cm = colormap(signed)
        lo, hi = (-1.0, 1.0) if signed else (0.0, 1.0)
        for x in np.linspace(lo, 1.0, 11):
            got = np.array(cm((x - lo) / (hi - lo))[:3]) * 255
            assert np.abs(got - np.array(score_rgb(float(x)))).max() <= 2.5, (signed, x)


def test_css_and_js_carry_the_ramp():
    css = colours.css_variables()
    assert f"--na-pos-max:{RAMP[-1]}" in css and f"--na-neg-max:{RAMP[0]}" in css
    for c in RAMP:
        r, g, b = int(c[1:3], 16), int(c[3:5], 16), int(c[5:7], 16)
        assert f"[{r},{g},{b}]" in colours.JS_COLOURS


def test_encoder_page_uses_the_scale_and_names_the_sink_rule():
    assert score_color(1.0) == score_css(1.0) and score_color(-1.0) == score_css(-1.0)
    ex = TextExplanation("a b", ["[CLS]", "a", "b"], {"DecompX": [4.0, 1.0, -1.0]}, 0, signed={"DecompX": True})
    page = render_html([ex], exclude_sink=True)
    assert f"background-color:{score_css(1.0)};color:#ffffff" in page  # "a": +max once the first token is out
    assert f"background-color:{score_css(-1.0)};color:#ffffff" in page
    assert f"background-color:{colours.SINK_GREY}" in page and "left out of the scale" in page
    assert "hsl(120" not in page and "green" not in page
    assert "is in the scale" in render_html([ex])


def test_class_agnostic_delta_is_not_a_logit_error():
    assert delta_caption("DecompX", True) == "DecompX: completeness error |sum - logit|"
    agnostic = delta_caption("ALTI", False)
    assert "logit" in agnostic and "no logit explained" in agnostic and "|sum - logit|" not in agnostic
    # an explanation built with the old caption still reads right in the table and the page
    ex = TextExplanation("a", ["[CLS]", "a"], {"ALTI": [0.5, 0.5], "DecompX": [0.2, 0.3]}, 0,
                         extras={"ALTI: completeness error |sum - logit|": 1e-6,
                                 "DecompX: completeness error |sum - logit|": 2e-6},
                         signed={"ALTI": False, "DecompX": True})
    for text in (render_table([ex]), render_html([ex])):
        assert "ALTI: completeness error" not in text and "ALTI: layer reconstruction error" in text
        assert "DecompX: completeness error |sum - logit|" in text


@pytest.mark.parametrize("name, shown", [
    ("/opt/hf/hub/models--HuggingFaceTB--SmolLM2-135M/snapshots/abc123", "HuggingFaceTB/SmolLM2-135M"),
    ("/srv/cache/captum_normattr/smollm2-135m-instruct", "smollm2-135m-instruct"),
    ("./checkpoints/minilm-sst2/", "minilm-sst2"),
    ("gpt2", "gpt2"),
    ("openai-community/gpt2", "openai-community/gpt2"),
    (None, "model"),
])
def test_model_display_name(name, shown):
    got = model_display_name(name_or_path=name)
    assert got == shown
    assert not got.startswith("/") and ".cache" not in got


def test_model_display_name_reads_the_config():
    class Cfg:
        _name_or_path = "/srv/models/models--Org--Name/snapshots/ff"

    class M:
        config = Cfg()

    assert model_display_name(M()) == "Org/Name"
