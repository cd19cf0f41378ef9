r"""``captum-normattr generate``: table, JSON and HTML of every generated token, on a tiny saved model."""
import json

import pytest
import torch

from captum_normattr import ALTILogitAttribution

from captum_normattr.cli import main as cli
from captum_normattr.cli.generate import ranked_positions, render_html, render_table, simple_html_table
from decoder_models import make_decoder
from llm_tiny import tiny_tokenizer


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny_llama_lm")
    model = make_decoder("llama", layers=2, seed=5, exact_norms=False)
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 1, 2, 0
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_rows_match_the_direct_call(capsys, tiny_lm):
    from transformers import AutoModelForCausalLM

    code, out, err = run(capsys, "generate", "--model", tiny_lm, "the cat sat", "--max-new-tokens", "3",
                         "-m", "alti-logit", "alti", "--format", "json")
    assert code == 0, err
    rec = json.loads(out)
    assert rec["prompt_length"] == 4 and len(rec["generated_ids"]) == 3
    m = rec["methods"]["ALTI-Logit"]
    assert len(m["token_attr"]) == 3 and len(m["token_attr"][0]) == 4 and len(m["rows"][0]) == 7
    model = AutoModelForCausalLM.from_pretrained(tiny_lm).eval()
    ids = torch.tensor(tiny_tokenizer().encode("the cat sat") + rec["generated_ids"])
    expect = ALTILogitAttribution(model, explained_position=4).attribute(ids[None], target=rec["generated_ids"][1])[0]
    assert torch.allclose(torch.tensor(m["rows"][1], dtype=expect.dtype), expect, rtol=1e-6, atol=1e-8)
    assert max(abs(d) for d in m["delta"]) < 1e-3 * max(abs(x) for x in m["explained"])
    assert "ALTI" in rec["methods"] and rec["methods"]["ALTI"]["explained"] is None


def test_table_teacher_forcing_and_html(capsys, tiny_lm, tmp_path):
    code, out, err = run(capsys, "generate", "--model", tiny_lm, "the cat sat", "--target-text", "on the mat",
                         "-m", "decompx", "--top", "2", "--exclude-sink")
    assert code == 0, err
    lines = [l for l in out.splitlines() if l.strip()]
    assert lines[0].startswith("DecompX: explains the logit")
    rows = lines[2:5]
    assert [r.split()[1] for r in rows] == ["on", "the", "mat"]
    assert all("<s>" not in r.split("  ", 3)[-1].split("top contributors")[-1] for r in rows)  # sink left out
    assert all(" @" not in r and "*" in r for r in rows[1:])  # earlier generated tokens ranked, marked
    legend = "\n".join(lines[5:])
    assert "legend: score = " in legend and "sink = the share of the first token" in legend
    assert "(--exclude-sink)" in legend
    html_path = tmp_path / "r.html"
    code, _, err = run(capsys, "generate", "--model", tiny_lm, "the cat", "--max-new-tokens", "2", "--format", "html",
                       "-o", html_path)
    assert code == 0, err
    page = html_path.read_text(encoding="utf-8")
    assert "<html" in page.lower()
    loaded = page.replace("http://www.w3.org/2000/svg", "")  # the SVG namespace is a name, not a download
    assert "http://" not in loaded and "https://" not in loaded  # self-contained
    assert "interactive report module is not installed" not in page  # the interactive report, not the fallback


def _record(exclude_sink=False):
    # prompt "<s> What is the" then generated " answer" " :" ; the ":" row's largest value is on " answer"
    rows = [[0.5, 1.2, -0.3, 0.8, 0.0, 0.0],
            [0.4, 0.9, 0.1, -1.1, 2.1, 0.0]]
    return {"model": "/abs/cache/models--Org--Tiny/snapshots/9f", "prompt": "What is the", "prompt_length": 4,
            "sink_index": 0, "exclude_sink": exclude_sink, "generated": [" answer", ":"],
            "tokens": ["<s>", "What", "\u0120is", "\u0120the", "\u0120answer", ":"],
            "token_text": ["<s>", "What", " is", " the", " answer", ":"],
            "methods": {"ALTI-Logit": {"key": "alti-logit", "signed": True, "quantity": "logit", "rows": rows,
                                       "token_attr": [r[:4] for r in rows], "input_features": ["<s>", "What", "is", "the"],
                                       "explained": [2.2, 26.0], "log_probs": [-0.1, -2.0], "sink_share": [0.18, 0.09]},
                        "ALTI": {"key": "alti", "signed": False, "quantity": "rollout", "explained": None,
                                 "rows": [[0.25, 0.25, 0.25, 0.25, 0, 0], [0.1, 0.1, 0.1, 0.1, 0.6, 0]],
                                 "token_attr": [[0.25] * 4, [0.1] * 4], "input_features": ["<s>", "What", "is", "the"],
                                 "log_probs": None, "sink_share": [0.25, 0.1]}}}


def test_table_ranks_earlier_generated_tokens_with_aligned_numbers():
    rec = _record()
    assert ranked_positions(rec, "ALTI-Logit", 1)[0] == (4, 2.1)  # the earlier generated " answer" comes first
    assert [j for j, _ in ranked_positions(rec, "ALTI-Logit", 0)] == [1, 3, 0, 2]  # the prompt only, by |score|
    assert 0 not in [j for j, _ in ranked_positions(rec, "ALTI-Logit", 1, exclude_sink=True)]
    text = render_table(rec, top=3)
    lines = text.splitlines()
    head, r0, r1 = lines[1], lines[2], lines[3]
    assert r1.endswith("answer@4* +2.10  the -1.10  What +0.90")
    assert r0.endswith("What +1.20  the +0.80  <s> +0.50")
    # the score column: same decimals, right-aligned under its header
    end = head.index("score") + len("score")
    assert r0[:end].endswith(" 2.20") and r1[:end].endswith("26.00")
    assert "p = the model's probability" in text and "sink = the share of the first token (<s>)" in text
    assert "@position* = generated" in text and "class-agnostic: no logit explained" in text
    alti = text.split("ALTI:")[1].splitlines()
    assert alti[2].split()[2] == "1.00" and alti[3].split()[2] == "1.00"  # a rollout row sums to 1 over the positions
    assert "<s>" not in render_table(_record(exclude_sink=True), top=5).split("ALTI:")[0].splitlines()[3]


def test_generate_page_names_the_model_not_its_path():
    page = render_html(_record())
    assert "model: Org/Tiny" in page and "/abs/cache" not in page and "snapshots" not in page
    assert '"gen":4' in page and '"exclude_sink":false' in page
    assert '"exclude_sink":true' in render_html(_record(exclude_sink=True))


def test_fallback_html_table_is_self_contained():
    rec = {"generated": ["x"], "methods": {"ALTI": {"token_attr": [[0.5, -0.25]], "input_features": ["<a>", "b"]}}}
    page = simple_html_table(rec, "t")
    assert "&lt;a&gt;" in page and "rgb(" in page and "<script" not in page


def test_usage_errors_exit_2(capsys, tiny_lm, tmp_path):
    code, _, err = run(capsys, "generate", "--model", str(tmp_path), "hi")
    assert code == 2 and "config.json" in err
    code, _, err = run(capsys, "generate", "--model", tiny_lm, "the cat", "--quantity", "logit-minus-foil",
                       "--target-text", "sat")
    assert code == 2 and "foil" in err
    code, _, err = run(capsys, "generate", "--model", tiny_lm, "the cat", "--max-new-tokens", "0")
    assert code == 2 and "at least 1" in err


def test_trust_remote_code_only_when_asked(monkeypatch, tiny_lm):
    import transformers

    from captum_normattr.cli import generate as cli_generate

    seen = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*a, **kw):
        seen.append(kw.get("trust_remote_code"))
        return real(*a, **kw)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    cli_generate.load_causal_lm(tiny_lm)
    cli_generate.load_causal_lm(tiny_lm, trust_remote_code=True)
    assert seen == [False, True]  # explicit False: left unset, transformers would prompt and read stdin


def test_feature_labels_are_readable_text():
    r"""The table's and report's input features read as text (``Ġcat`` -> ``cat``), for byte-level
    BPE and SentencePiece; a feature that is no single token (a template value) is kept."""
    from captum_normattr.cli.generate import feature_text
    from captum_normattr.tokens import readable_tokens
    from tiny_tokenizers import byte_level_bpe, sentencepiece_bpe

    def readable_tokens_of(tok, toks):
        return list(readable_tokens(tok, tok.convert_tokens_to_ids(toks)))

    for tok in (byte_level_bpe(), sentencepiece_bpe()):
        raw = tok.convert_ids_to_tokens(tok("the cat sat")["input_ids"])
        assert any(t.startswith(("Ġ", "▁")) for t in raw), raw
        got = feature_text(tok, raw + ["a whole value"])
        assert not any(g.startswith(("Ġ", "▁")) for g in got), got
        assert got[-1] == "a whole value" and got[:-1] != raw
        assert [g.strip() for g in got[:-1]] == [g.strip() for g in readable_tokens_of(tok, raw)]


def test_methods_and_signedness_come_from_the_registry(capsys, tiny_lm):
    r"""``-m`` takes the registry's LLM methods (:func:`llm_methods`), each signed as its registry entry says."""
    from captum_normattr.attr.methods import get_method
    from captum_normattr.cli.generate import llm_methods

    keys = llm_methods()
    assert {"alti-logit", "decompx", "alti", "globenc"} <= set(keys) and "alti-plus" not in keys
    code, out, err = run(capsys, "generate", "--model", tiny_lm, "the cat", "--max-new-tokens", "2", "-m", *keys,
                         "--quantity", "logit-minus-mean", "--format", "json")
    assert code == 0, err
    methods = json.loads(out)["methods"]
    assert sorted(m["key"] for m in methods.values()) == sorted(keys)
    for m in methods.values():
        assert m["signed"] is get_method(m["key"]).signed
        assert m["quantity"] == ("logit_minus_mean" if m["signed"] else "rollout")
    code, _, err = run(capsys, "generate", "--model", tiny_lm, "the cat", "-m", "alti-plus")
    assert code == 2 and "invalid choice" in err


def test_max_new_tokens_checked_against_the_models_positions_before_generating(capsys, tiny_lm, monkeypatch):
    from transformers import LlamaForCausalLM

    called = []
    monkeypatch.setattr(LlamaForCausalLM, "generate", lambda *a, **k: called.append(1))
    code, out, err = run(capsys, "generate", "--model", tiny_lm, "the cat sat", "--max-new-tokens", "1000000000")
    assert code == 2 and not called  # refused up front, nothing generated
    assert "--max-new-tokens 1000000000 plus the prompt's 4 tokens exceed the model's" in err
    assert "give --max-new-tokens" in err and "Traceback" not in err


def test_an_existing_output_needs_overwrite_and_the_write_is_announced(capsys, tiny_lm, tmp_path):
    path = tmp_path / "r.json"
    path.write_text("keep me")
    code, _, err = run(capsys, "generate", "--model", tiny_lm, "the cat", "--max-new-tokens", "2", "--format", "json",
                       "-m", "alti-logit", "-o", path)
    assert code == 2 and "exists; pass --overwrite" in err and path.read_text() == "keep me"
    code, _, err = run(capsys, "generate", "--model", tiny_lm, "the cat", "--max-new-tokens", "2", "--format", "json",
                       "-m", "alti-logit", "-o", path, "--overwrite")
    assert code == 0, err
    assert json.loads(path.read_text())["methods"] and f"wrote json for 1 method(s) to {path}" in err
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temporary file left
