r"""The command line for encoder-decoders (``-m alti-plus``, ``--source``, pairs files) end to end.

A tiny float64 Marian model with perturbed weights and a word-level tokenizer (the
``tokenizers`` library wrapped in ``PreTrainedTokenizerFast``, offline) are saved to a
temporary folder and passed with ``--model PATH``, as a user would. Every number the CLI
prints is checked against ``ALTIPlusAttribution.decompose`` (and ``explain_generation``)
on the same ids.
"""
from __future__ import annotations

import json

import pytest
import torch

from captum_normattr.cli import common as cli_common
from captum_normattr.cli import main as cli
from captum_normattr.attr.alti_plus import ALTIPlusAttribution, explain_generation
from seq2seq_models import perturb as _perturb  # away from the near-zero init, so the shares are far from 0 and 1
from cli_models import WORDS, save_tiny as _save_tiny  # the tiny BERT / GPT-2 folders of the text CLI's tests

SRC_WORDS = "the cat dog sat ran on a mat".split()
TGT_WORDS = "le chat chien est court sur un tapis".split()
PAIRS = [("the cat sat on a mat", "le chat est sur un tapis"), ("a dog ran", "un chien court")]


@pytest.fixture(scope="module")
def marian(tmp_path_factory) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import MarianConfig, MarianMTModel, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "<unk>"] + SRC_WORDS + TGT_WORDS)}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    config = MarianConfig(vocab_size=len(vocab), decoder_vocab_size=len(vocab), d_model=16, encoder_layers=2,
                          decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                          decoder_ffn_dim=32, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
                          decoder_start_token_id=0, forced_eos_token_id=1)
    torch.manual_seed(0)
    model = MarianMTModel(config).double().eval()
    _perturb(model)
    with torch.no_grad():  # end-of-sequence unlikely: generation runs to --max-new-tokens (then forced_eos)
        model.final_logits_bias[0, config.eos_token_id] = -30.0
    folder = tmp_path_factory.mktemp("tiny_marian")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def loaded(marian):
    model, tok, _ = cli_common.load_model(marian, torch.device("cpu"))
    assert model.dtype == torch.float64
    return model, tok


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _reference(model, tok, source, target=None, max_new_tokens=6):
    r"""Source (T, S), target (T, T) and share (T,) straight from the API on one unpadded pair."""
    src = tok([source], return_tensors="pt")
    if target is not None:
        labels = tok(text_target=[target], return_tensors="pt")["input_ids"]
        start = torch.full((1, 1), model.config.decoder_start_token_id)
        dec = torch.cat([start, labels[:, :-1]], 1)  # shift right, as the model does for labels
        res = ALTIPlusAttribution(model).decompose((src["input_ids"], dec), additional_forward_args=src["attention_mask"])
        return res.source_contributions[0], res.target_contributions[0], res.source_share[0], labels[0]
    gen = model.generate(**src, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1)
    step = explain_generation(model, src["input_ids"], gen, src["attention_mask"])[0]
    return step.source, step.prefix, step.source_share, step.tokens


def _check_record(rec, model, tok, max_new_tokens=6):
    src_c = torch.tensor(rec["source_contributions"], dtype=torch.float64)
    tgt_c = torch.tensor(rec["target_contributions"], dtype=torch.float64)
    share = torch.tensor(rec["source_share"], dtype=torch.float64)
    rows = torch.cat([src_c, tgt_c], 1).sum(1)
    torch.testing.assert_close(rows, torch.ones_like(rows), atol=1e-12, rtol=0)
    assert torch.equal(tgt_c, tgt_c.tril())  # no contribution from later decoder inputs
    ref_src, ref_tgt, ref_share, ref_tokens = _reference(
        model, tok, rec["source"], rec["target"] if rec["mode"] == "teacher-forced" else None, max_new_tokens)
    torch.testing.assert_close(src_c, ref_src, atol=1e-12, rtol=0)
    torch.testing.assert_close(tgt_c, ref_tgt, atol=1e-12, rtol=0)
    torch.testing.assert_close(share, ref_share, atol=1e-12, rtol=0)
    assert rec["target_tokens"] == tok.convert_ids_to_tokens(ref_tokens.tolist())
    assert rec["source_tokens"] == tok.convert_ids_to_tokens(tok(rec["source"])["input_ids"])
    assert rec["decoder_input_tokens"][0] == "<pad>"  # Marian's decoder start token
    assert rec["decoder_input_tokens"][1:] == rec["target_tokens"][:-1]
    assert 0 <= rec["completeness_error"] < 1e-10
    assert 0.05 < float(share.mean()) < 0.95  # a non-trivial split between source and prefix


# ----------------------------------------------------------------- outputs


def test_teacher_forced_json_equals_decompose(capsys, marian, loaded):
    argv = ["--model", marian, "-q", "--format", "json", "-b", "2"]
    for s, t in PAIRS:
        argv += ["--source", s, "--target-text", t]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["meta"]["method"] == "alti-plus" and doc["meta"]["pairs"] == 2
    assert [r["id"] for r in doc["pairs"]] == [1, 2]
    for rec, (s, t) in zip(doc["pairs"], PAIRS):  # a padded batch of two, checked against each pair alone
        assert rec["mode"] == "teacher-forced" and rec["source"] == s and rec["target"] == t
        assert rec["target_tokens"] == t.split() + ["</s>"]
        _check_record(rec, *loaded)


def test_generated_json_equals_explain_generation(capsys, marian, loaded):
    code, out, err = run(capsys, "--model", marian, "-m", "alti-plus", "-q", "--format", "json",
                         "--max-new-tokens", "6", PAIRS[0][0], PAIRS[1][0])
    assert code == 0, err
    doc = json.loads(out)
    assert doc["meta"]["max_new_tokens"] == 6
    for rec in doc["pairs"]:
        assert rec["mode"] == "generated" and len(rec["target_tokens"]) == 6 and rec["target_tokens"][-1] == "</s>"
        assert rec["target"] == " ".join(rec["target_tokens"][:-1])
        _check_record(rec, *loaded)


def test_table_output(capsys, marian, loaded):
    code, out, err = run(capsys, "--model", marian, "--source", PAIRS[0][0], "--target-text", PAIRS[0][1],
                         "--top", "2", "--ascii")
    assert code == 0, err
    assert "source: the cat sat on a mat" in out and "target (teacher-forced): le chat est sur un tapis" in out
    lines = [ln for ln in out.splitlines() if ln.strip()[:1].isdigit()]
    assert len(lines) == 7  # six words and </s>
    src_c, _, share, _ = _reference(*loaded, PAIRS[0][0], PAIRS[0][1])
    src_tokens = PAIRS[0][0].split() + ["</s>"]
    for k, line in enumerate(lines):
        cells = line.split()
        assert cells[0] == str(k) and float(cells[2]) == pytest.approx(float(share[k]), abs=0.006)
        top = src_c[k].argsort(descending=True)[:2].tolist()
        assert cells[4] == src_tokens[top[0]] and cells[6] == src_tokens[top[1]]
    assert "mean source share" in out


def test_pairs_file_jsonl_and_plots(capsys, marian, loaded, tmp_path):
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text(f"{PAIRS[0][0]}\t{PAIRS[0][1]}\n\n{PAIRS[1][0]}\n{PAIRS[1][0]}\t{PAIRS[1][1]}\n", encoding="utf-8")
    out_file, pics = tmp_path / "out" / "out.jsonl", tmp_path / "pics"
    code, out, err = run(capsys, "--model", marian, "-m", "alti-plus", "--file", pairs, "-o", out_file,
                         "--max-new-tokens", "6", "--plots", pics, "-b", "1")
    assert code == 0, err
    assert "wrote" in err and out == ""
    recs = [json.loads(line) for line in out_file.read_text(encoding="utf-8").splitlines()]
    assert [(r["id"], r["mode"]) for r in recs] == [(1, "teacher-forced"), (3, "generated"), (4, "teacher-forced")]
    for rec in recs:
        _check_record(rec, *loaded)
    names = sorted(p.name for p in pics.iterdir())
    assert names == sorted(f"pair{n:03d}_alti_plus_{kind}.png" for n in (1, 2, 3) for kind in ("matrix", "source_share"))
    assert all((pics / n).stat().st_size > 1000 for n in names)


def test_official_conventions_option(capsys, marian):
    outs = []
    for conv in ("default", "official"):
        code, out, err = run(capsys, "--model", marian, "--source", PAIRS[1][0], "--target-text", PAIRS[1][1],
                             "--format", "json", "--conventions", conv)
        assert code == 0, err
        outs.append(json.loads(out)["pairs"][0])
    assert outs[1]["conventions"] != outs[0]["conventions"]
    assert outs[0]["source_share"] != outs[1]["source_share"]


# ----------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def bert_and_gpt2(tmp_path_factory):
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

    bert = _save_tiny(tmp_path_factory.mktemp("s2s_bert"), BertModel,
                      BertConfig(vocab_size=5 + len(WORDS), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=32, max_position_embeddings=64))
    gpt2 = _save_tiny(tmp_path_factory.mktemp("s2s_gpt2"), GPT2LMHeadModel,
                      GPT2Config(vocab_size=5 + len(WORDS), n_embd=16, n_layer=1, n_head=2, n_positions=64,
                                 bos_token_id=2, eos_token_id=3, pad_token_id=0))
    return str(bert), str(gpt2)


def test_alti_plus_and_source_on_other_models(capsys, bert_and_gpt2):
    bert, gpt2 = bert_and_gpt2
    for path, kind in ((bert, "encoder-only"), (gpt2, "decoder-only")):
        code, out, err = run(capsys, "--model", path, "-m", "alti-plus", "the film")
        assert code == 2 and out == "" and "Traceback" not in err
        assert "-m alti-plus needs an encoder-decoder" in err and kind in err and "Marian" in err
    code, _, err = run(capsys, "--model", gpt2, "--source", "the film")
    assert code == 2 and "--source needs an encoder-decoder" in err and "alti-logit" in err


def test_other_methods_on_an_encoder_decoder_name_alti_plus(capsys, marian, tmp_path):
    for argv in (["-m", "alti", "the cat"], ["-m", "globenc", "--file", str(tmp_path / "t.txt"), "-o",
                                             str(tmp_path / "o.jsonl")]):
        (tmp_path / "t.txt").write_text("the cat\n", encoding="utf-8")
        code, out, err = run(capsys, "--model", marian, *argv)
        assert code == 2 and "Traceback" not in err
        assert "encoder-decoder" in err and "'alti-plus'" in err and "--source" in err
    code, _, err = run(capsys, "--model", marian, "-m", "alti", "--source", "the cat")
    assert code == 2 and "-m alti-plus" in err
    code, _, err = run(capsys, "--model", marian, "-m", "alti-plus,alti", "the cat")
    assert code == 2 and "runs alone" in err


@pytest.mark.parametrize(
    "content, message",
    [
        ("the cat\ta\tb\n", "line 1: 3 tab-separated columns"),
        ("the cat\tle chat\n\n\tle chat\n", "line 3: the source (first column) is empty"),
        ("the cat\t \n", "line 1: the target (second column) is empty"),
        (b"\xff\xfe\n", "not a UTF-8 text file"),
    ],
)
def test_broken_pairs_file(capsys, marian, tmp_path, content, message):
    path = tmp_path / "pairs.tsv"
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    code, out, err = run(capsys, "--model", marian, "-m", "alti-plus", "--file", path)
    assert code == 2 and out == "" and message in err and "Traceback" not in err
    if "line" in message:
        assert str(path) in err


def test_usage_errors(capsys, marian, tmp_path):
    (tmp_path / "p.jsonl").write_text('{"source": "a"}\n', encoding="utf-8")
    code, _, err = run(capsys, "--model", marian, "--source", "a", "--source", "b", "--target-text", "x")
    assert code == 2 and "--target-text was given 1 time(s) for 2 source(s)" in err
    code, _, err = run(capsys, "--model", marian, "-m", "alti-plus")
    assert code == 2 and "no source to explain" in err
    code, _, err = run(capsys, "--model", marian, "--source", "a", "--format", "html")
    assert code == 2 and "does not apply to alti-plus" in err
    code, _, err = run(capsys, "--model", marian, "-m", "alti-plus", "--file", tmp_path / "p.jsonl")
    assert code == 2 and "a pairs file is plain text" in err


def test_pairs_split_only_at_newlines_and_a_byte_order_mark_is_dropped(tmp_path, monkeypatch):
    from captum_normattr.cli.seq2seq import read_pairs

    path = tmp_path / "pairs.tsv"
    path.write_bytes("\ufeffein\u2028Haus\ta house\r\nzw\x85ei\ttw\x0co\n".encode("utf-8"))
    want = [(1, "ein\u2028Haus", "a house"), (2, "zw\x85ei", "tw\x0co")]
    assert [(p.id, p.source, p.target) for p in read_pairs([], None, str(path))] == want
    import io

    class Stdin(io.StringIO):
        buffer = io.BytesIO(path.read_bytes())

    monkeypatch.setattr("sys.stdin", Stdin())
    assert [(p.id, p.source, p.target) for p in read_pairs([], None, "-")] == want


def test_plots_label_tokens_with_their_readable_text(tmp_path, monkeypatch):
    r"""``--plots`` draws the readable labels (``source_token_text`` ...), not the tokenizer's ``\u2581le`` pieces."""
    from captum_normattr.cli import seq2seq as cli_seq2seq
    from captum_normattr.present import visualization_seq2seq as VS

    seen = {}

    def capture(name):
        def plot(*args, **kwargs):
            seen[name] = kwargs
            import matplotlib.pyplot as plt

            return plt.figure()
        return plot

    monkeypatch.setattr(VS, "plot_contribution_matrix", capture("matrix"))
    monkeypatch.setattr(VS, "plot_source_share", capture("share"))
    rec = {"source": "the cat", "mode": "teacher-forced", "source_share": [0.6, 0.5],
           "source_tokens": ["\u2581the", "\u2581cat"], "source_token_text": [" the", " cat"],
           "target_tokens": ["\u2581le", "</s>"], "target_token_text": [" le", "</s>"],
           "decoder_input_tokens": ["<pad>", "\u2581le"], "decoder_input_token_text": ["<pad>", " le"],
           "source_contributions": [[0.3, 0.3], [0.2, 0.3]], "target_contributions": [[0.4, 0.0], [0.2, 0.3]]}
    written = cli_seq2seq._save_seq2seq_plots([rec], tmp_path, "png")
    assert len(written) == 2
    assert seen["matrix"]["source_tokens"] == [" the", " cat"]
    assert seen["matrix"]["target_tokens"] == ["<pad>", " le"]
    assert seen["matrix"]["row_labels"] == [" le", "</s>"]
    assert seen["share"]["target_tokens"] == [" le", "</s>"]
