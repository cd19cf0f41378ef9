r"""Readable tokens (issue 25, item 2) for the three tokenizer families, and printable text."""
from __future__ import annotations

import pytest

from captum_normattr.tokens import ReadableTokens, byte_level_decode, readable_tokens, tokens_text, visible_text

from tiny_tokenizers import byte_level_bpe, sentencepiece_bpe

TEXT = "The keys are\nhere. caf\u00e9 \U0001f600 unbelievably"


@pytest.fixture(scope="module")
def wordpiece():
    from transformers import AutoTokenizer

    from captum_normattr.models.loading import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


def _markers(labels):
    return [t for t in labels if any(m in t for m in ("\u0120", "\u010a", "\u2581", "##", "\u00c3"))]


def test_byte_level_bpe_labels_are_text():
    tok = byte_level_bpe()
    ids = tok(TEXT)["input_ids"]
    labels = readable_tokens(tok, ids)
    assert isinstance(labels, ReadableTokens) and len(labels) == len(ids)
    assert labels.raw == tok.convert_ids_to_tokens(ids)
    assert any("\u0120" in t for t in labels.raw) and not _markers(labels)
    assert labels[labels.raw.index("\u0120are")] == "are" and "\n" in labels  # Ġare -> "are", Ċ -> newline
    assert " " in labels  # a token of white space only keeps it
    assert "caf" in labels and "\u00e9" in labels  # Ã© (2 bytes, one token) -> é
    # the emoji is 4 byte tokens: each shows the byte it holds, nothing is lost or invented
    assert [t for t in labels if t.startswith("\\x")] == ["\\xf0", "\\x9f", "\\x98", "\\x80"]
    # with the word spaces of the raw tokens put back, the labels concatenate to the text
    joined = "".join((" " if r.startswith("\u0120") and lab != " " else "") + lab for r, lab in zip(labels.raw, labels))
    assert joined.replace("\\xf0\\x9f\\x98\\x80", "\U0001f600") == tok.decode(ids) == TEXT


def test_sentencepiece_labels_keep_the_leading_space_and_decode_bytes():
    tok = sentencepiece_bpe()
    ids = tok(TEXT)["input_ids"]
    labels = readable_tokens(tok, ids)
    raw = labels.raw
    assert raw[0] == "<s>" and labels[0] == "<s>"  # special tokens keep their spelling
    assert labels[raw.index("\u2581The")] == "The" and labels[raw.index("\u2581keys")] == "keys"
    assert not _markers(labels) and "<0x0A>" in raw and "\n" in labels
    assert labels[raw.index("<0xC3>")] == "\\xc3"  # one byte of é
    joined = "".join((" " if r.startswith("\u2581") and lab != " " else "") + lab for r, lab in zip(raw[1:], labels[1:]))
    joined = joined.replace("\\xc3\\xa9", "\u00e9").replace("\\xf0\\x9f\\x98\\x80", "\U0001f600")
    assert joined == " " + TEXT


def test_wordpiece_labels_glue_continuations(wordpiece):
    ids = wordpiece("An unbelievably good film.")["input_ids"]
    labels = readable_tokens(wordpiece, ids)
    assert labels.raw[2:4] == ["un", "##bel"]
    assert labels[0] == "[CLS]" and labels[-1] == "[SEP]"
    assert labels[1:-1] == ["an", "un", "bel", "ie", "va", "bly", "good", "film", "."]


def test_readable_tokens_accepts_tensors_and_refuses_batches(wordpiece):
    enc = wordpiece(["a film"], return_tensors="pt")
    assert readable_tokens(wordpiece, enc["input_ids"][0]) == readable_tokens(wordpiece, enc["input_ids"][0].tolist())
    with pytest.raises(ValueError, match="1-D"):
        readable_tokens(wordpiece, enc["input_ids"].tolist())


def test_tokens_text_joins_split_characters():
    tok = byte_level_bpe()
    ids = tok(" \U0001f600")["input_ids"]
    assert tokens_text(tok, ids) == "\U0001f600"
    assert byte_level_decode("\u0120keys") == " keys" and byte_level_decode("\u00c3") == "\\xc3"


@pytest.mark.parametrize("ch", ["\x1b", "\x07", "\x00", "\x7f", "\x85", "\x9b", "\u202a", "\u202b", "\u202c",
                                "\u202d", "\u202e", "\u2066", "\u2067", "\u2068", "\u2069", "\u200b", "\u200e",
                                "\u200f", "\ufeff", "\u2028", "\u2029", "\u00ad", "\u061c", "\n", "\r", "\t"])
def test_visible_text_neutralises_every_control_and_format_character(ch):
    out = visible_text(f"a{ch}b")
    assert ch not in out and out.isprintable() and out.startswith("a\\") and out.endswith("b")


def test_visible_text_keeps_ordinary_text():
    for s in ["plain", "caf\u00e9 na\u00efve", "\u65e5\u672c\u8a9e", "\u0645\u0631\u062d\u0628\u0627",
              "\U0001f600", "a\\x1b literal"]:
        assert visible_text(s) == s
    assert visible_text("\x1b[31mred") == "\\x1b[31mred" and visible_text("\u202e") == "\\u202e"
    assert visible_text(3.5) == "3.5"


def test_display_token_never_shows_nothing():
    from captum_normattr.tokens import display_token

    assert display_token(" ") == "\u2423" and display_token("  ") == "\u2423\u2423"
    assert display_token(" ", ascii_only=True) == "' '" and display_token("\x1b") == "\\x1b"
    assert display_token("keys") == "keys"


def test_cli_table_and_json_show_readable_byte_level_tokens(tmp_path, capsys):
    r"""The command line on a byte-level BPE decoder: the table shows text, JSON keeps both."""
    import json

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from captum_normattr.cli import main as cli

    tok = byte_level_bpe()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=32, n_embd=16, n_layer=1, n_head=2,
                                       bos_token_id=0, eos_token_id=0)).eval()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    text = "The keys are caf\u00e9"
    assert cli.main(["--model", str(tmp_path), "-m", "alti-logit", text, "-q"]) == 0
    table = capsys.readouterr().out
    rows = [ln.split()[1] for ln in table.splitlines() if ln[:4].strip().lstrip("*").isdigit()]
    assert rows == ["The", "\u2423", "keys", "are", "\u2423", "caf", "\u00e9"]
    assert "\u0120" not in table and "\u00c3" not in table
    assert cli.main(["--model", str(tmp_path), "-m", "alti-logit", text, "-q", "--format", "json"]) == 0
    rec = json.loads(capsys.readouterr().out)["results"][0]
    assert rec["tokens"] == tok.convert_ids_to_tokens(tok(text)["input_ids"])  # raw, as before
    assert rec["token_text"] == ["The", " ", "keys", "are", " ", "caf", "\u00e9"]
