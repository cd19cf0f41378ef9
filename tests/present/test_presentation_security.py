r"""Presentation safety (issue 27, items 2, 3 and 15): what the package hands to HTML, to a
terminal and to matplotlib can never become live markup, terminal control or mathtext."""
from __future__ import annotations

import html
import re

import torch

import matplotlib  # noqa: E402  (the `test` extra installs it)

matplotlib.use("Agg")

from captum_normattr.present import captum_interop as CI  # noqa: E402
from captum_normattr.present import visualization as V  # noqa: E402
from captum_normattr.present import visualization_seq2seq as VS  # noqa: E402
from captum_normattr.present.report import TextExplanation, render_html, render_json, render_table  # noqa: E402

EVIL_TAG = "a<img src=x onerror=alert(1)>"
EVIL_TOKENS = ["[CLS]", EVIL_TAG, "<script>alert(2)</script>", "\"'&", "[SEP]"]
ESC = "\x1b]0;pwned\x07\x1b[2J\x1b[31m"
BIDI = "\u202eevil\u202c \u2066x\u2069 \u200b\u061c"
DOLLARS = ["$", "a$b$c", "$x^2$", "\\$", "5$", "$\\frac{"]


def _no_live_tags(page: str) -> None:
    assert "<img" not in page and "<script" not in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page


# --------------------------------------------------------------------------- HTML (item 2)


def test_visualization_records_escape_tokens_for_captum_html():
    from captum.attr import visualization as captum_viz

    scores = torch.tensor([0.1, 0.5, 0.2, 0.1, 0.1])
    recs = CI.to_visualization_records(scores, EVIL_TOKENS, pred_classes="<b>pos</b>",
                                      true_classes="<i>", attr_classes="<u>x</u>")
    page = captum_viz.visualize_text(recs, legend=False).data
    assert "<img" not in page and "<script>" not in page and "<b>pos</b>" not in page and "<u>x</u>" not in page
    assert html.escape(EVIL_TAG) in page and "&lt;script&gt;" in page and "&lt;b&gt;pos&lt;/b&gt;" in page
    # the shown text is the token itself (a browser turns the entities back into these characters)
    assert [html.unescape(t) for t in recs[0].raw_input_ids] == EVIL_TOKENS


def test_visualization_records_of_a_result_escape_the_method_name():
    from captum_normattr.result import AttributionResult

    res = AttributionResult("<svg onload=alert(3)>", torch.tensor([[0.2, 0.8]]), torch.ones(1, 2))
    rec = CI.to_visualization_records(res, ["ok", EVIL_TAG])[0]
    assert rec.attr_class == "&lt;svg onload=alert(3)&gt;" and rec.raw_input_ids[1] == html.escape(EVIL_TAG)


def test_html_report_escapes_everything():
    ex = TextExplanation(text=EVIL_TAG + BIDI, tokens=EVIL_TOKENS, scores={"<b>m</b>": [0.1, 0.5, 0.2, 0.1, 0.1]},
                         explained_position=0, prediction="<i>p</i>", extras={"<x>": "<y>"})
    page = render_html([ex], {"model": "<script>alert(4)</script>"}, title="<t>")
    _no_live_tags(page)
    assert "<b>m</b>" not in page and "<i>p</i>" not in page and "<x>" not in page and "<t>" not in page
    for ch in "\u202e\u202c\u2066\u2069\u200b\u061c":  # no bidi override / invisible character reaches the page
        assert ch not in page
    assert "\\u202eevil" in page


def test_seq2seq_and_cli_tables_show_control_characters(tmp_path):
    from captum_normattr.cli.seq2seq import render_seq2seq_table

    rec = {"id": "1" + ESC, "source": "src" + ESC + BIDI, "target": "tgt\u202e", "mode": "generated",
           "method": "ALTI+", "conventions": "official", "completeness_error": 0.0,
           "source_tokens": ["a" + ESC, "b\u202e"], "target_tokens": ["x\x1b[1m", "y"],
           "source_share": [0.5, 0.25], "source_contributions": [[0.3, 0.2], [0.1, 0.15]]}
    out = render_seq2seq_table([rec])
    _assert_terminal_safe(out)
    assert "\\x1b]0;pwned\\x07" in out and "\\u202e" in out


# --------------------------------------------------------------------------- terminal (item 3)


def _assert_terminal_safe(out: str) -> None:
    for line in out.split("\n"):
        bad = [c for c in line if not (c.isprintable() or c == " ")]
        assert not bad, (line, bad)


def test_terminal_table_neutralises_escapes_and_bidi_everywhere():
    ex = TextExplanation(text="hello " + ESC + BIDI + "\r\nfake line", tokens=["[CLS]", "ok" + ESC, "\u202ex", "[SEP]"],
                         scores={"ALTI" + ESC: [0.4, 0.3, 0.2, 0.1]}, explained_position=0,
                         prediction="POS\x1b[8m", extras={"note\x07": "v\x1b[0m"})
    out = render_table([ex])
    _assert_terminal_safe(out)
    assert "\x1b" not in out and "\r" not in out and "\u202e" not in out and "\u2066" not in out
    head = out.split("\n")[0]
    assert head.startswith("[1] hello \\x1b]0;pwned\\x07\\x1b[2J") and "\\r\\nfake line" in head
    assert "ok\\x1b]0;pwned" in out and "\\u202ex" in out and "POS\\x1b[8m" in out and "note\\x07" in out


def test_cli_table_subprocess_neutralises_a_hostile_text(tmp_path):
    r"""The command line, as a user runs it, on a text with escape codes and a bidi override."""
    import subprocess
    import sys

    from conftest import make_model

    folder = tmp_path / "model"
    model = make_model("bert")
    model.save_pretrained(folder)
    _wordpiece_tokenizer().save_pretrained(folder)
    src = tmp_path / "texts.txt"
    src.write_text("good " + ESC + " film \u202eevil\n", encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "captum_normattr.cli.main", "--model", str(folder), "-m", "alti",
                           "--file", str(src), "-q"], capture_output=True, text=True, encoding="utf-8", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout and "\u202e" not in proc.stdout
    assert "\\x1b]0;pwned" in proc.stdout and "\\u202eevil" in proc.stdout


def _wordpiece_tokenizer():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "film", "evil",
                                         "]", "0", ";", "pw", "##ned", "[", "2", "##j", "31", "##m", "e", "##vil"])}
    t = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    t.normalizer = normalizers.BertNormalizer(lowercase=True)
    t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    from tokenizers import processors

    t.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def test_json_keeps_the_text_as_it_is():
    ex = TextExplanation(text=ESC, tokens=["a\x1b"], scores={"m": [1.0]})
    assert "\\u001b" in render_json([ex])  # JSON escapes control characters by itself, and keeps them


# --------------------------------------------------------------------------- matplotlib (item 15)


def _draw(fig) -> None:
    fig.canvas.draw()  # mathtext is parsed at draw time: a bad "$...$" raises here


def _labels(fig):
    out = []
    for t in fig.findobj(matplotlib.text.Text):
        s = t.get_text()
        if s:
            out.append(s)
    return out


def test_every_plot_draws_dollar_tokens_literally():
    n = len(DOLLARS)
    toks = DOLLARS
    scores = torch.linspace(0.1, 1.0, n)
    m = torch.rand(n, n)
    figs = [
        V.plot_token_map(m, toks, title="$t$"),
        V.plot_layer_grid(torch.rand(2, n, n), toks, layer_names=["$l1", "l$2"], title="$x"),
        V.plot_component_maps({"$ATB": m, "+FF$": m}, toks, title="$"),
        V.plot_rollout_row(scores, toks, title="$a$"),
        V.plot_rollout_row(scores, toks, kind="text", title="$a$"),
        V.plot_method_comparison({"$IG$": scores, "A$": -scores}, toks, title="$c"),
        V.plot_method_comparison({"$IG$": scores, "A$": -scores}, toks, kind="bar"),
        VS.plot_contribution_matrix((torch.rand(n, n), torch.rand(n, n).tril()), source_tokens=toks,
                                    target_tokens=toks, title="$s$"),
        VS.plot_source_share(torch.rand(n), target_tokens=toks, title="$share"),
    ]
    for fig in figs:
        _draw(fig)
        for s in _labels(fig):  # every "$" is escaped: matplotlib shows it as a dollar sign
            assert not re.search(r"(?<!\\)\$", s), s


def test_plot_labels_render_the_dollar_sign():
    fig = V.plot_rollout_row([1.0, 2.0], ["$x$", "y"])
    _draw(fig)
    label = fig.axes[0].get_xticklabels()[0]
    assert label.get_text() == "\\$x\\$"
    # matplotlib reads "\$" as a literal dollar outside math mode: the drawn text is "$x$"
    assert not label._preprocess_math(label.get_text())[1]
    assert label._preprocess_math(label.get_text())[0] == "$x$"


def test_cli_plots_and_html_maps_with_dollar_tokens(tmp_path):
    r"""``--plots`` on a text whose tokens hold dollar signs (it crashed; ``--html-maps`` draws the same
    layer-grid and rollout pictures, tested above)."""
    from conftest import make_model

    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "model"
    make_model("bert").save_pretrained(folder)
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "$", "^", "a", "b", "c"])}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    t.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]").save_pretrained(folder)
    src = tmp_path / "texts.txt"
    src.write_text("a $ ^ ^ $ b c\n", encoding="utf-8")  # "$ ^ ^ $": a mathtext syntax error
    from captum_normattr.cli import main as cli

    code = cli.main(["--model", str(folder), "-m", "alti", "globenc", "--file", str(src), "-q",
                     "--plots", str(tmp_path / "plots"), "--plot-format", "svg"])
    assert code == 0
    assert len(list((tmp_path / "plots").iterdir())) >= 4
