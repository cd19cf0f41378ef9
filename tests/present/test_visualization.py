r"""Plots and Captum interop of captum_normattr.present.visualization, on tiny plain tensors.

Results are real :class:`~captum_normattr.result.DecompositionResult`\ s built from
random tensors, so these tests do not depend on the decomposition engine; the
per-example accessor of every result type is checked on tiny real models at the end.
"""
from __future__ import annotations

import sys

import pytest
import torch

import matplotlib  # the `test` extra installs it: run or fail, never skip  # noqa: E402
matplotlib.use("Agg")

from captum_normattr.present import captum_interop as CI  # noqa: E402
from captum_normattr.present import visualization as V  # noqa: E402

TOKENS = ["[CLS]", "the", "film", "was", "great", "[SEP]"]


from captum_normattr.result import DecompositionResult  # noqa: E402


def make_result(lengths=(6, 4), t=6, n_layers=3, left_pad=False, seed=0) -> DecompositionResult:
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    mask = torch.zeros(b, t, dtype=torch.long)
    for i, n in enumerate(lengths):
        if left_pad:
            mask[i, t - n:] = 1
        else:
            mask[i, :n] = 1
    valid = mask.bool()
    pair = (valid[:, :, None] & valid[:, None, :]).unsqueeze(1)
    maps = torch.rand(b, n_layers, t, t, generator=g) * pair
    roll = maps[:, 0]
    for l in range(1, n_layers):
        roll = maps[:, l] @ roll
    pos = (t - torch.tensor(lengths)) if left_pad else torch.zeros(b, dtype=torch.long)
    scores = roll[torch.arange(b), pos]
    return DecompositionResult(method="Fake (N_ENC)", scores=scores, attention_mask=mask,
                               explained_position=pos.long(), layer_maps=maps, rollout=roll)


@pytest.fixture
def out(tmp_path):
    return tmp_path


# ----------------------------------------------------------------- plots


def test_plot_token_map_png_and_svg(out):
    m = torch.rand(6, 6)
    fig = V.plot_token_map(m, TOKENS, title="layer 1", path=out / "map.png")
    assert (out / "map.png").stat().st_size > 0
    V.save_figure(fig, out / "map.svg")
    assert (out / "map.svg").read_text().lstrip().startswith(("<?xml", "<svg"))
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels == TOKENS


def test_plot_token_map_signed_uses_diverging_scale(out):
    m = torch.randn(4, 4)
    fig = V.plot_token_map(m, TOKENS[:4], path=out / "signed.png")
    lo, hi = fig.axes[0].images[0].get_clim()
    assert lo == pytest.approx(-hi)


def test_plot_token_map_into_given_axes(out):
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.add_subplot(1, 2, 1)
    got = V.plot_token_map(torch.eye(3), ["a", "b", "c"], ax=ax, colorbar=False)
    assert got is fig and ax.images


def test_plot_layer_grid_tensor_and_result(out):
    V.plot_layer_grid(torch.rand(5, 6, 6), TOKENS, path=out / "grid.png")
    res = make_result()
    fig = V.plot_layer_grid(res, TOKENS, b=1, share_scale=True, path=out / "grid.svg")
    assert (out / "grid.png").stat().st_size > 0 and (out / "grid.svg").stat().st_size > 0
    panels = [a for a in fig.axes if a.images]
    assert len(panels) == 3
    assert panels[0].images[0].get_array().shape == (4, 4)  # pads removed
    assert [t.get_text() for t in panels[0].get_xticklabels()] == TOKENS[:4]


@pytest.mark.parametrize("kind", ["bar", "text"])
def test_plot_rollout_row(out, kind):
    V.plot_rollout_row(torch.tensor([0.3, 0.1, -0.2, 0.05, 0.5, 0.1]), TOKENS, kind=kind,
                       explained_position=0, title="GlobEnc", path=out / f"row_{kind}.png")
    assert (out / f"row_{kind}.png").stat().st_size > 0


def test_plot_rollout_row_text_wraps_long_inputs(out):
    toks = [f"token{i}" for i in range(80)]
    fig = V.plot_rollout_row(torch.rand(80), toks, kind="text", path=out / "long.svg")
    heights = {round(t.get_position()[1], 6) for t in fig.axes[0].texts}
    assert len(heights) > 2  # several lines
    assert fig.get_size_inches()[1] > 1.0


def test_plot_rollout_row_from_result_left_padded(out):
    res = make_result(lengths=(6, 3), left_pad=True)
    fig = V.plot_rollout_row(res, TOKENS[:3], b=1, path=out / "row.png")
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == TOKENS[:3]


def test_plot_component_maps(out):
    maps = {name: torch.rand(6, 6) for name in ("ATB", "+FF", "+RES2", "+LN2")}
    fig = V.plot_component_maps(maps, TOKENS, path=out / "comp.png")
    V.plot_component_maps(maps, TOKENS, share_scale=True, title="layer 2", path=out / "comp.svg")
    assert [a.get_title() for a in fig.axes if a.images] == list(maps)
    assert (out / "comp.png").exists() and (out / "comp.svg").exists()


@pytest.mark.parametrize("kind", ["heatmap", "bar"])
def test_plot_method_comparison(out, kind):
    res = make_result()
    scores = {"GlobEnc": res, "ALTI": torch.rand(2, 6)[0], "IG": torch.randn(6)}
    fig = V.plot_method_comparison(scores, TOKENS, kind=kind, title="one sentence",
                                   path=out / f"cmp_{kind}.png")
    assert (out / f"cmp_{kind}.png").stat().st_size > 0
    if kind == "heatmap":
        data = fig.axes[0].images[0].get_array()
        assert data.shape == (3, 6)
        assert abs(data).max() <= 1.0 + 1e-9


def test_plot_errors():
    with pytest.raises(ValueError, match="tokens"):
        V.plot_token_map(torch.rand(3, 3), ["a", "b"])
    with pytest.raises(ValueError, match="square"):
        V.plot_token_map(torch.rand(3, 4))
    with pytest.raises(ValueError, match="same shape"):
        V.plot_component_maps({"a": torch.rand(3, 3), "b": torch.rand(4, 4)})
    with pytest.raises(ValueError, match="kind"):
        V.plot_rollout_row([1.0, 2.0], kind="pie")
    with pytest.raises(ValueError, match=r"\.png"):
        V.save_figure(V.plot_rollout_row([1.0, 2.0]), "x.jpg")


def test_missing_matplotlib_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install"):
        V.plot_rollout_row([1.0, 2.0])


def test_example_from_result_removes_pads():
    res = make_result(lengths=(6, 3), left_pad=True)
    ex = V.example_from_result(res, 1, TOKENS[:3])
    assert ex["layer_maps"].shape == (3, 3, 3)
    assert ex["rollout"].shape == (3, 3)
    assert ex["explained_position"] == 0
    assert ex["tokens"] == TOKENS[:3]
    torch.testing.assert_close(ex["scores"], res.scores[1, 3:].double())
    padded_tokens = ["[PAD]"] * 3 + TOKENS[:3]
    assert V.example_from_result(res, 1, padded_tokens)["tokens"] == TOKENS[:3]


# ----------------------------------------------------------------- Captum interop


def test_normalize_scores():
    s = CI.normalize_scores(torch.tensor([[2.0, -4.0, 1.0], [0.0, 0.0, 0.0]]))
    assert s.abs().max() <= 1.0
    assert s[0].tolist() == [0.5, -1.0, 0.25]
    assert s[1].tolist() == [0.0, 0.0, 0.0]
    m = CI.normalize_scores([5.0, 1.0, 100.0], mask=[1, 1, 0])
    assert m.tolist() == pytest.approx([1.0, 0.2, 0.0])


def test_visualization_records_and_visualize_text():
    import IPython  # noqa: F401 (the `test` extra installs ipython)
    from captum.attr import visualization as viz

    res = make_result(lengths=(6, 4))
    res.scores = res.scores * 7.0  # beyond [-1, 1]
    recs = CI.to_visualization_records(res, [TOKENS, TOKENS[:4]], pred_probs=[0.9, 0.6],
                                      pred_classes=["pos", "neg"], true_classes=["pos", "pos"])
    assert len(recs) == 2
    assert recs[0].raw_input_ids == TOKENS and recs[1].raw_input_ids == TOKENS[:4]
    for r in recs:
        assert r.word_attributions.abs().max() == pytest.approx(1.0)
        assert r.attr_class == "Fake (N_ENC)"
    assert recs[1].attr_score == pytest.approx(float(res.scores[1, :4].sum()))
    out = viz.visualize_text(recs)
    assert "great" in out.data


def test_visualization_records_plain_scores():
    recs = CI.to_visualization_records(torch.tensor([0.2, 0.4]), ["a", "b"], normalize=False)
    assert recs[0].word_attributions.tolist() == pytest.approx([0.2, 0.4])
    with pytest.raises(ValueError):
        CI.to_visualization_records(torch.rand(2, 3), [["a", "b", "c"]])


def test_llm_attribution_result_from_rollout():
    toks = ["The", " cat", " sat", " on", " the"]
    roll = torch.tril(torch.rand(5, 5))
    r = CI.to_llm_attribution_result(roll, toks, prompt_length=3)
    assert r.input_tokens == toks[:3] and r.output_tokens == toks[3:]
    assert tuple(r.token_attr.shape) == (2, 3)
    torch.testing.assert_close(r.token_attr[0], roll[2, :3].float())  # " on" predicted at row 2
    torch.testing.assert_close(r.token_attr[1], roll[3, :3].float())
    torch.testing.assert_close(r.seq_attr, r.token_attr.sum(0))
    # single predicted next token after the prompt
    r1 = CI.to_llm_attribution_result(roll[:3, :3], toks[:3], 3, output_tokens=[" on"])
    torch.testing.assert_close(r1.token_attr[0], roll[2, :3].float())
    import matplotlib.pyplot as plt

    fig, _ = r.plot_token_attr()
    fig2, _ = r.plot_seq_attr()
    plt.close(fig)
    plt.close(fig2)
    with pytest.raises(ValueError):
        CI.to_llm_attribution_result(roll, toks[:4], 2)


def test_llm_attribution_result_from_padded_result():
    res = make_result(lengths=(6, 4), left_pad=True)
    r = CI.to_llm_attribution_result(res, ["a", "b", "c", "d"], 2, b=1, normalize=True)
    ex = V.example_from_result(res, 1)
    expected = ex["rollout"][1:3, :2].float()
    torch.testing.assert_close(r.token_attr, expected / expected.abs().max())


# ----------------------------------------------------------------- example() of every result type


def _check_example_drops_pads(res, single, i):
    r"""``res.example(i)`` has n real tokens on every token axis and equals the unpadded single call."""
    from captum_normattr.result import AttributionResult

    assert isinstance(res, AttributionResult) and isinstance(single, AttributionResult)
    n = int(res.attention_mask[i].sum())
    ex, one = res.example(i), single.example(0)
    assert ex["method"] == res.method and ex["explained_position"] == one["explained_position"]
    for name, axes in type(res).TOKEN_AXES.items():
        if getattr(res, name) is None:
            continue
        assert all(ex[name].shape[a - 1] == n for a in axes), name
        torch.testing.assert_close(ex[name], one[name], rtol=1e-8, atol=1e-10, msg=name)
    if res.delta is not None:
        torch.testing.assert_close(ex["delta"], one["delta"], rtol=1e-6, atol=1e-8)
    viz = V.example_from_result(res, i)  # the visualisation's view is the same accessor
    assert viz["scores"].shape == (n,) and viz["keep"].tolist() == res.real_tokens(i).tolist()


def _run_examples(decompose, ids, mask, key):
    from captum_normattr.attr.methods import get_method

    res = decompose(ids, mask)
    assert res.signed == get_method(key).signed
    for i in range(ids.shape[0]):
        real = mask[i].bool()
        _check_example_drops_pads(res, decompose(ids[i : i + 1, real], mask[i : i + 1, real]), i)
    return res


@pytest.mark.parametrize("key", ["globenc", "alti", "ff"])
def test_example_drops_pads_map_methods_encoder(key):
    from conftest import make_model, random_batch

    from captum_normattr.attr.methods import get_method

    attr = get_method(key).build(make_model("bert"))
    ids, mask = random_batch([6, 3, 5])
    res = _run_examples(lambda i, m: attr.decompose(i, additional_forward_args=(m,)), ids, mask, key)
    fig = V.plot_layer_grid(res, b=1)
    assert [a for a in fig.axes if a.images][0].images[0].get_array().shape == (3, 3)


def test_example_drops_pads_ff_decoder_left_padded():
    from decoder_models import decoder_batch, make_decoder

    from captum_normattr.attr.methods import get_method

    attr = get_method("ff").build(make_decoder("gpt2"))
    ids, mask = decoder_batch([5, 2, 4])
    res = _run_examples(lambda i, m: attr.decompose(i, additional_forward_args=(m,)), ids, mask, "ff")
    assert res.example(1)["explained_position"] == 1  # the last real token


def test_example_drops_pads_alti_logit():
    from decoder_models import decoder_batch, make_decoder

    from captum_normattr import ALTILogitResult
    from captum_normattr.attr.methods import get_method

    attr = get_method("alti-logit").build(make_decoder("llama"))
    ids, mask = decoder_batch([5, 2, 4])
    res = _run_examples(lambda i, m: attr.decompose(i, target=7, additional_forward_args=(m,)), ids, mask,
                        "alti-logit")
    assert isinstance(res, ALTILogitResult)
    assert res.example(1)["layer_token_contributions"].shape == (2, 2)
    fig = V.plot_rollout_row(res, b=1)  # signed scores of any result type plot the same way
    assert len(fig.axes[0].patches) == 2
    with pytest.raises(ValueError, match="no layer maps"):
        V.plot_layer_grid(res)


def test_example_drops_pads_decompx():
    from conftest import make_model, random_batch

    from captum_normattr import DecompXResult
    from captum_normattr.attr.methods import get_method

    attr = get_method("decompx").build(make_model("roberta"))
    ids, mask = random_batch([6, 3, 5])
    res = _run_examples(lambda i, m: attr.decompose(i, target=1, additional_forward_args=(m,), layer_parts=True),
                        ids, mask, "decompx")
    assert isinstance(res, DecompXResult)
    assert res.example(1)["class_scores"].shape == (3, 2)


# ----------------------------------------------------------------- attention sink (issue 25, item 3)


def _sink_result():
    from captum_normattr.result import LogitDecompositionResult

    scores = torch.tensor([[0.0, 8.0, 1.0, -3.0, 2.0], [9.0, 1.0, 4.0, 0.5, 0.0]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])  # left pad in row 0, right pad in row 1
    return LogitDecompositionResult(method="ALTI-Logit", scores=scores, attention_mask=mask,
                                    explained_position=torch.tensor([4, 3]))


def test_sink_share_and_rankings_leave_the_first_token_out_on_request():
    res = _sink_result()
    before = res.scores.clone()
    assert res.sink_position().tolist() == [1, 0]
    assert res.sink_share().tolist() == pytest.approx([8 / 14, 9 / 14.5])
    assert [t.tolist() for t in res.top_k(2)] == [[0, 3], [0, 2]]  # positions over the real tokens
    assert [t.tolist() for t in res.top_k(2, exclude_sink=True)] == [[3, 1], [2, 1]]
    assert [t.tolist() for t in res.top_k(2, exclude_sink=True, absolute=True)] == [[2, 3], [2, 1]]
    assert res.ranking(0, exclude_sink=True).tolist() == [3, 1, 2]
    assert torch.equal(res.scores, before)  # the scores are never changed


def test_normalisation_and_visualization_records_without_the_sink():
    res = _sink_result()
    n = CI.normalize_scores(res.scores, res.attention_mask, exclude_sink=True)
    assert n[0].tolist() == pytest.approx([0.0, 1.0, 1 / 3, -1.0, 2 / 3])  # max over |1|, |-3|, |2|; sink clipped
    assert n[1].tolist() == pytest.approx([1.0, 0.25, 1.0, 0.125, 0.0])
    assert CI.normalize_scores([5.0], exclude_sink=True).tolist() == [1.0]  # one token: nothing to leave out
    recs = CI.to_visualization_records(res, [["a", "b", "c", "d"], ["e", "f", "g", "h"]], exclude_sink=True)
    assert recs[0].word_attributions.tolist() == pytest.approx([1.0, 1 / 3, -1.0, 2 / 3])
    assert recs[0].attr_score == pytest.approx(8.0)  # raw sum kept


def test_plots_leave_the_sink_out_on_request():
    res = _sink_result()
    toks = ["<s>", "The", "keys", "are", "[pad]"]
    fig = V.plot_rollout_row(res, toks, b=1, exclude_sink=True)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["The", "keys", "are"]
    assert [p.get_height() for p in fig.axes[0].patches] == pytest.approx([1.0, 4.0, 0.5])
    fig = V.plot_method_comparison({"a": res, "b": res}, toks, b=1, exclude_sink=True)
    assert fig.axes[0].images[0].get_array().shape == (2, 3)
    assert float(abs(fig.axes[0].images[0].get_array()).max()) == pytest.approx(1.0)
    m = torch.rand(4, 4)
    fig = V.plot_token_map(m, toks[:4], exclude_sink=True)
    assert fig.axes[0].images[0].get_array().shape == (3, 3)
    fig = V.plot_layer_grid(torch.rand(2, 4, 4), toks[:4], exclude_sink=True)
    assert all(a.images[0].get_array().shape == (3, 3) for a in fig.axes if a.images)
    fig = V.plot_component_maps({"ATB": m, "+FF": m}, toks[:4], exclude_sink=True)
    assert all(a.images[0].get_array().shape == (3, 3) for a in fig.axes if a.images)
    assert res.scores[1, 0] == 9.0


def test_table_html_and_json_report_the_sink_share():
    import json

    from captum_normattr.present.report import TextExplanation, explanations_from_results, render_html, render_json, render_table
    from captum_normattr.tokens import ReadableTokens

    res = _sink_result()
    toks = [ReadableTokens(["pad", "The", "keys", "are", "here"], ["<pad>", "The", "\u0120keys", "\u0120are", "\u0120here"]),
            ReadableTokens(["<s>", "a", "b", "c", "pad"], ["<s>", "a", "\u0120b", "\u0120c", "<pad>"])]
    exps = explanations_from_results(["The keys are here", "a b c"], toks, {"ALTI-Logit": res})
    assert exps[0].sink_share["ALTI-Logit"] == pytest.approx(8 / 14)
    assert exps[0].tokens == ["The", "keys", "are", "here"] and exps[0].raw_tokens[1] == "\u0120keys"
    table = render_table(exps)
    assert "sink share (first token 'The', |s_0| / sum |s|): ALTI-Logit 0.571" in table
    assert "sink share (first token '<s>', |s_0| / sum |s|): ALTI-Logit 0.621" in table
    # without the sink, the bars are scaled by the largest other score: "-3" fills its bar in row 0
    plain = render_table(exps[:1], ascii_only=True)
    no_sink = render_table(exps[:1], ascii_only=True, exclude_sink=True)
    assert [ln.split()[-1] for ln in no_sink.splitlines() if "-3.0000" in ln] == ["-" * 12]
    assert [ln.split()[-1] for ln in plain.splitlines() if "-3.0000" in ln] == ["-" * 4]
    assert "s = the first token" in no_sink
    page = render_html(exps)
    assert "sink share (first token &#x27;The&#x27;" in page
    doc = json.loads(render_json(exps))["results"][0]
    assert doc["tokens"] == ["The", "\u0120keys", "\u0120are", "\u0120here"]  # raw, as before
    assert doc["token_text"] == ["The", "keys", "are", "here"]
    assert doc["sink_share"]["ALTI-Logit"] == pytest.approx(8 / 14)
    # an aggregated explanation keeps the token-level share
    from captum_normattr.aggregation import Span

    agg = exps[0].aggregated([Span("The keys", (0, 1)), Span("are here", (2, 3))])
    assert agg.sink_share == exps[0].sink_share and agg.raw_tokens is None
    assert TextExplanation("x", ["a", "b"], {"m": [0.0, 0.0]}).sink_share["m"] != 0.0  # NaN: no mass at all
