r"""The ``captum-normattr`` command line end to end on a tiny random BERT classifier,
and the report renderers (table, JSON, HTML).

The tiny model and its WordPiece tokenizer are written to a temporary folder once per
session and passed with ``--model PATH``, as a user would.
"""
from __future__ import annotations

import html
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from captum_normattr.cli import main as cli

from captum_normattr.present import report
from cli_models import WORDS, TEXTS, save_tiny as _save_tiny, tiny_model, run  # noqa: F401

REPO = Path(__file__).resolve().parents[2]







@pytest.fixture(scope="session")
def texts_file(tmp_path_factory) -> str:
    p = tmp_path_factory.mktemp("texts") / "texts.txt"
    p.write_text("\n".join(TEXTS[:3]) + "\n\n" + TEXTS[3] + "\n", encoding="utf-8")
    return str(p)




def tokens_of(model_dir: str, text: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok.convert_ids_to_tokens(tok(text)["input_ids"])


# ----------------------------------------------------------------- outputs


def test_table_output(capsys, tiny_model):
    code, out, err = run(capsys, TEXTS[0], "--model", tiny_model, "-m", "globenc", "alti")
    assert code == 0, err
    assert "[1] the film was great !" in out
    assert "prediction:" in out and ("POSITIVE" in out or "NEGATIVE" in out)
    assert "GlobEnc" in out and "ALTI" in out
    for t in tokens_of(tiny_model, TEXTS[0]):
        assert t in out
    assert "Traceback" not in err


def test_json_output_matches_direct_call(capsys, tiny_model, texts_file):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from captum_normattr import ALTIAttribution, GlobEncAttribution

    code, out, err = run(capsys, "--file", texts_file, "--model", tiny_model, "-m", "globenc,alti",
                         "--map", "n_res", "--format", "json", "-b", "3", "-q")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["meta"]["methods"] == ["globenc", "alti"]
    assert doc["meta"]["globenc_map"] == "N_RES"
    assert [r["text"] for r in doc["results"]] == TEXTS
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    for r in doc["results"]:
        assert r["tokens"] == tokens_of(tiny_model, r["text"])  # pads removed
        assert r["explained_position"] == 0
        assert list(r["attributions"]) == ["GlobEnc (N_RES)", "ALTI"]
        assert r["prediction"].split()[0] in ("POSITIVE", "NEGATIVE")
        enc = tok([r["text"]], return_tensors="pt")
        for attr, scores in zip((GlobEncAttribution(model, map_name="N_RES"), ALTIAttribution(model)),
                                r["attributions"].values()):
            direct = attr.attribute(enc["input_ids"], additional_forward_args=(enc["attention_mask"],))[0]
            assert len(scores) == len(r["tokens"])
            torch.testing.assert_close(torch.tensor(scores, dtype=torch.float64), direct.double(),
                                       rtol=1e-4, atol=1e-6)


def test_html_report_contains_every_token(capsys, tiny_model, texts_file, tmp_path):
    out_path = tmp_path / "report.html"
    code, out, err = run(capsys, "--file", texts_file, "--model", tiny_model, "-m", "alti", "globenc",
                         "-o", out_path, "-q")
    assert code == 0, err
    page = out_path.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<script" not in page and "http://" not in page and "https://" not in page
    for text in TEXTS:
        assert html.escape(text) in page
        for t in tokens_of(tiny_model, text):
            assert f">{html.escape(t)}</span>" in page
    assert "&lt;" in page and "&amp;" in page
    assert "<actors>" not in page  # escaped


def test_html_embedded_maps_and_plots(capsys, tiny_model, tmp_path):
    out_path = tmp_path / "r.html"
    plots = tmp_path / "plots"
    code, _, err = run(capsys, TEXTS[1], "--model", tiny_model, "-m", "globenc", "alti",
                       "--format", "html", "-o", out_path, "--html-maps",
                       "--plots", plots, "--plot-format", "svg")
    assert code == 0, err
    page = out_path.read_text(encoding="utf-8")
    assert page.count("data:image/png;base64,") == 4  # layer grid + rollout per method
    names = sorted(p.name for p in plots.iterdir())
    assert all(n.endswith(".svg") for n in names)
    assert any("comparison" in n for n in names)
    assert len(names) == 2 * 3 + 1
    assert "wrote 7 pictures" in err


def test_ff_method_scope_and_component_pictures(capsys, tiny_model, tmp_path):
    code, out, err = run(capsys, TEXTS[0], "--model", tiny_model, "-m", "ff", "globenc", "--scope", "atb",
                         "--map", "N_RESLN", "--format", "json", "--plots", tmp_path, "-q")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["meta"]["ff_scope"] == "ATB"
    attrs = doc["results"][0]["attributions"]
    assert list(attrs) == ["FF decomposition (ATB)", "GlobEnc (N_RESLN)"]
    # the ATB scope is the N_RESLN map (docs/design.md, section 6)
    torch.testing.assert_close(torch.tensor(attrs["FF decomposition (ATB)"]),
                               torch.tensor(attrs["GlobEnc (N_RESLN)"]), rtol=1e-4, atol=1e-6)
    assert (tmp_path / "text001_ff_decomposition_atb_components.png").stat().st_size > 0


def test_progress_bar_only_with_several_batches(capsys, tiny_model, texts_file):
    code, _, err = run(capsys, "--file", texts_file, "--model", tiny_model, "-m", "alti", "-b", "1")
    assert code == 0
    assert "batch" in err  # tqdm bar on stderr
    code, _, err = run(capsys, "--file", texts_file, "--model", tiny_model, "-m", "alti", "-b", "8")
    assert code == 0 and "batch" not in err
    code, _, err = run(capsys, "--file", texts_file, "--model", tiny_model, "-m", "alti", "-b", "1", "-q")
    assert code == 0 and "batch" not in err


def test_position_target_and_stdin(capsys, tiny_model, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO(TEXTS[0] + "\n"))
    code, out, err = run(capsys, "--file", "-", "--model", tiny_model, "-m", "alti", "--position", "last",
                         "--target", "1", "--format", "json")
    assert code == 0, err
    r = json.loads(out)["results"][0]
    assert r["explained_position"] == len(r["tokens"]) - 1
    code, out, err = run(capsys, TEXTS[0], "--model", tiny_model, "-m", "alti", "-p", "-2", "--format", "json")
    assert code == 0, err
    r = json.loads(out)["results"][0]
    assert r["explained_position"] == len(r["tokens"]) - 2


def test_default_model_works_offline(capsys):
    code, out, err = run(capsys, "a fine film", "-m", "globenc", "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert "MiniLM" in doc["meta"]["model"]
    assert doc["results"][0]["tokens"] == ["[CLS]", "a", "fine", "film", "[SEP]"]


def test_registered_method_with_attribute_only(capsys, tiny_model):
    from captum_normattr import GlobEncAttribution

    class ScoresOnly:
        def __init__(self, model, opts):
            self.inner = GlobEncAttribution(model, map_name="N", explained_position=opts.position)

        def attribute(self, inputs, additional_forward_args=None):
            return self.inner.attribute(inputs, additional_forward_args=additional_forward_args)

    cli.register_method("scores-only", ScoresOnly, "test entry")
    try:
        code, out, err = run(capsys, "--list-methods")
        assert code == 0 and "scores-only" in out and "globenc" in out and "alti" in out
        code, out, err = run(capsys, TEXTS[0], "--model", tiny_model, "-m", "scores-only", "--format", "json")
        assert code == 0, err
        r = json.loads(out)["results"][0]
        assert list(r["attributions"]) == ["scores-only"]
        assert len(r["attributions"]["scores-only"]) == len(r["tokens"])
        with pytest.raises(ValueError):
            cli.register_method("scores-only", ScoresOnly)
    finally:
        cli.METHODS.pop("scores-only", None)


# ----------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "argv, message",
    [
        (["hi", "-m", "nosuch"], "unknown method 'nosuch'"),
        (["--file", "/no/such/texts.txt"], "file not found"),
        (["hi", "--model", "./no/such/model"], "model folder not found"),
        (["hi", "--model", "/tmp"], "has no config.json"),
        ([], "no text to explain"),
        (["hi", "--device", "warp-drive"], "unknown device"),
        (["hi", "--format", "table", "--html-maps"], "--html-maps needs"),
        (["hi", "--batch-size", "0"], "positive integer"),
        (["hi", "--position", "first"], "integer or 'last'"),
        (["hi", "--map", "XYZ"], "invalid choice"),
        (["hi", "-m", "ff", "--scope", "ALL"], "invalid choice"),
    ],
)
def test_user_errors_exit_2_without_traceback(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err and out == ""


def test_cuda_unavailable_is_a_user_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    code, _, err = run(capsys, "hi", "--device", "cuda")
    assert code == 2 and "CUDA is not available" in err


def test_unsupported_architecture(capsys, tmp_path):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=5 + len(WORDS), d_model=16, d_kv=8, d_ff=32, num_layers=1,
                      num_heads=2, decoder_start_token_id=0)
    path = _save_tiny(tmp_path / "t5", T5EncoderModel, config)
    code, _, err = run(capsys, "hi", "--model", path, "-m", "alti")
    assert code == 2 and "Traceback" not in err
    assert "cannot explain this model" in err and "t5" in err


def test_help_and_module_entry_point(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "--method" in out and "--format" in out


def test_subprocess_exit_codes(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "captum_normattr.cli.main", "hi", "--model", "no-such-org/no-such-model-zz9"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "cannot load model 'no-such-org/no-such-model-zz9'" in proc.stderr
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------- renderers


def _explanation():
    return report.TextExplanation(
        text="a <b> & c", tokens=["[CLS]", "a", "<", "b", ">", "&", "c", "[SEP]"],
        scores={"M1": [0.5, 0.1, 0.2, -0.1, 0.0, float("nan"), 0.3, 0.1], "M2": [1.0] * 8},
        explained_position=0, prediction="POSITIVE (0.900)",
    )


def test_render_table_and_ascii():
    ex = _explanation()
    t = report.render_table([ex])
    assert "\u2588" in t and "\u2591" in t and "nan" in t
    a = report.render_table([ex], ascii_only=True)
    assert a.isascii() and "#" in a
    assert " *0" in a


def test_render_json_strict():
    doc = json.loads(report.render_json([_explanation()], {"model": "m", "x": torch.tensor(1.5)}))
    assert doc["meta"] == {"model": "m", "x": 1.5}
    assert doc["results"][0]["attributions"]["M1"][5] is None  # NaN -> null


def test_render_html_escapes():
    page = report.render_html([_explanation()], {"model": "<m>"})
    assert "&lt;m&gt;" in page and "<m>" not in page
    for tok in _explanation().tokens:
        assert f">{html.escape(tok)}</span>" in page


def test_explanations_from_results_remove_pads():
    scores = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    exps = report.explanations_from_results(["x", "y"], [["a", "b", "c"], ["d", "e", "[PAD]"]],
                                            {"S": scores}, attention_mask=mask,
                                            explained_position=torch.tensor([0, 1]))
    assert exps[1].tokens == ["d", "e"] and exps[1].scores["S"] == [0.5, 0.5]
    assert exps[1].explained_position == 1
    with pytest.raises(ValueError):
        report.TextExplanation("x", ["a"], {"S": [1.0, 2.0]})


# ----------------------------------------------------------------- signed methods and decoders


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=5 + len(WORDS), n_embd=16, n_layer=2, n_head=2, n_positions=64,
                        bos_token_id=2, eos_token_id=3, pad_token_id=0)
    return str(_save_tiny(tmp_path_factory.mktemp("tiny_gpt2"), GPT2LMHeadModel, config))


def test_decompx_json_matches_direct_call_and_target(capsys, tiny_model, texts_file, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from captum_normattr import DecompXAttribution

    model = AutoModelForSequenceClassification.from_pretrained(tiny_model).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    for target in (None, 1):
        extra = [] if target is None else ["-t", str(target)]
        code, out, err = run(capsys, "--file", texts_file, "--model", tiny_model, "-m", "decompx",
                             "--format", "json", "-b", "2", "-q", *extra)
        assert code == 0, err
        doc = json.loads(out)
        for r in doc["results"]:
            enc = tok([r["text"]], return_tensors="pt")
            direct, delta = DecompXAttribution(model).attribute(
                enc["input_ids"], target=target, additional_forward_args=(enc["attention_mask"],),
                return_convergence_delta=True)
            (scores,) = r["attributions"].values()
            torch.testing.assert_close(torch.tensor(scores, dtype=torch.float64), direct[0].double(),
                                       rtol=1e-4, atol=1e-6)
            assert float(delta.abs().max()) < 1e-4
    # signed scores in the table, and --bias-mode spread runs
    code, out, err = run(capsys, TEXTS[1], "--model", tiny_model, "-m", "decompx", "--bias-mode", "spread")
    assert code == 0, err
    assert "DecompX (spread bias)" in out and "completeness error" in out


def test_alti_logit_and_decoder_methods(capsys, tiny_gpt2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from captum_normattr import ALTILogitAttribution

    code, out, err = run(capsys, TEXTS[0], "--model", tiny_gpt2, "-m", "alti-logit", "globenc", "alti", "ff",
                         "--format", "json", "-q")
    assert code == 0, err
    r = json.loads(out)["results"][0]
    n = len(r["tokens"])
    assert r["explained_position"] == n - 1  # decoders explain the last token by default
    assert set(r["attributions"]) >= {"ALTI-Logit", "ALTI", "GlobEnc+FF"}
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2).eval()
    enc = AutoTokenizer.from_pretrained(tiny_gpt2)([TEXTS[0]], return_tensors="pt")
    direct = ALTILogitAttribution(model).attribute(enc["input_ids"], additional_forward_args=(enc["attention_mask"],))
    torch.testing.assert_close(torch.tensor(r["attributions"]["ALTI-Logit"], dtype=torch.float64),
                               direct[0].double(), rtol=1e-4, atol=1e-6)
    # an encoder is not a causal LM: a one-line usage error
    code, out, err = run(capsys, TEXTS[0], "-m", "alti-logit")
    assert code == 2 and "ALTILogitAttribution" in err and "Traceback" not in err


# ----------------------------------------------------------------- the method registry


def test_registry_lists_every_exported_attribution_class():
    import inspect

    from captum.attr import Attribution

    import captum_normattr
    from captum_normattr.attr import methods as registry

    exported = {getattr(captum_normattr, n) for n in captum_normattr.__all__}
    classes = {c for c in exported if isinstance(c, type) and issubclass(c, Attribution)}
    classes.discard(captum_normattr.DecompositionLLMAttribution)  # Captum's LLM API over the methods, not one of them
    assert classes == {s.cls for s in registry.METHODS.values() if s.cls is not None}
    for spec in registry.METHODS.values():
        if spec.cls is None:
            continue
        init = inspect.signature(spec.cls.__init__).parameters
        decompose = inspect.signature(spec.cls.decompose).parameters
        # Captum's order for every class; uses_target says whether the CLI's --target changes the scores
        assert list(decompose)[1:4] == ["inputs", "target", "additional_forward_args"], spec.key
        assert list(inspect.signature(spec.cls.attribute).parameters)[1:5] == [
            "inputs", "target", "additional_forward_args", "return_convergence_delta"], spec.key
        assert not spec.uses_target or spec.cls.uses_target, spec.key
        assert spec.maps == ("return_layer_maps" in decompose and "return_rollout" in decompose), spec.key
        assert set(spec.model_groups) <= set(registry.MODEL_GROUPS) and spec.description and spec.explains
        for opt in spec.options:  # every option is a constructor keyword with the same default
            assert opt.param in init, (spec.key, opt.param)
            assert opt.default is None or opt.default == init[opt.param].default, (spec.key, opt.param)
    table = registry.method_table_markdown().splitlines()
    assert len(table) == 2 + len(registry.METHODS)
    for key, row in zip(registry.METHODS, table[2:]):
        assert row.startswith(f"| `{key}` | `{registry.METHODS[key].class_name}` |")
    with pytest.raises(ValueError, match="unknown method 'nosuch'; available: globenc, alti"):
        registry.get_method("nosuch")


def test_cli_methods_and_options_are_the_registry(capsys):
    from captum_normattr.attr import methods as registry

    assert cli.METHODS is registry.METHODS and cli.register_method is registry.register_method
    actions = {a.dest: a for a in cli.build_parser()._actions}
    for key in registry.METHODS:
        assert key in actions["method"].help
    declared = {o.dest: o for s in registry.METHODS.values() for o in s.options}
    for dest, opt in declared.items():  # one argparse option per registry option, as declared
        a = actions[dest]
        assert tuple(a.option_strings) == opt.flags and a.default == opt.default
        assert (tuple(a.choices) if a.choices is not None else None) == opt.choices
    assert all(registry.METHODS[k].uses_target for k in ("decompx", "alti-logit"))
    code, out, _ = run(capsys, "--list-methods")
    assert code == 0
    assert [line.split()[0] for line in out.splitlines() if line[:1].strip()] == list(registry.METHODS)


def test_cli_asks_only_for_what_it_prints(tiny_model, monkeypatch):
    r"""Without pictures the map methods skip the layer maps and the full rollout."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from captum_normattr import GlobEncAttribution
    from captum_normattr.attr.methods import get_method

    seen = []
    original = GlobEncAttribution.decompose

    def spy(self, *args, **kwargs):
        res = original(self, *args, **kwargs)
        seen.append((kwargs.get("return_layer_maps"), kwargs.get("return_rollout"), res.layer_maps is None))
        return res

    monkeypatch.setattr(GlobEncAttribution, "decompose", spy)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    args = cli.build_parser().parse_args(["x", "-p", "0"])
    specs = [get_method("globenc")]
    exps, maps = cli.explain(TEXTS[:2], model, tok, specs, args, progress=False)
    assert seen == [(False, False, True)] and maps == [{}, {}]
    exps, maps = cli.explain(TEXTS[:2], model, tok, specs, args, progress=False, keep_maps=True)
    assert seen[-1] == (True, True, False)
    n = len(exps[1].tokens)  # the shorter text: its maps lose the pads
    assert n < len(exps[0].tokens)
    assert maps[1]["GlobEnc (N_ENC)"]["layer_maps"].shape == (2, n, n)
    assert maps[1]["GlobEnc (N_ENC)"]["rollout"].shape == (n, n)


# ----------------------------------------------------------------- issue 27: usage errors, tokenizers, lengths


@pytest.fixture(scope="module")
def no_tokenizer_model(tmp_path_factory) -> str:
    from transformers import BertConfig, BertForSequenceClassification

    path = tmp_path_factory.mktemp("no_tokenizer")
    config = BertConfig(vocab_size=5 + len(WORDS), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64)
    BertForSequenceClassification(config).save_pretrained(path)  # no tokenizer files
    return str(path)


def test_a_model_folder_without_tokenizer_files_is_refused(capsys, no_tokenizer_model, tmp_path):
    for extra in ([], ["--format", "jsonl", "-o", str(tmp_path / "out.jsonl")]):
        code, out, err = run(capsys, "the film", "--model", no_tokenizer_model, *extra)
        assert code == 2 and "has no tokenizer files" in err and "Traceback" not in err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--image", "x.png"], "--image needs --model DIR"),
        (["--image", "x.png", "--model", "./no/such/vit"], "model folder not found"),
        (["--image", "x.png", "--model", "MODEL"], "--image needs an image classifier"),  # a text model
        (["the film", "--format", "jsonl", "-o", "."], "is a directory"),
        (["the film", "--format", "jsonl", "-o", "plain/out.jsonl"], "is not a folder"),
        (["the film", "--format", "json", "-o", "plain/out.json"], "is not a folder"),
        (["the film", "--format", "jsonl", "-o", "o.jsonl", "--aggregate", "word"], "--aggregate word does not apply"),
        (["the film was great", "--max-length", "2"], "--max-length 2 leaves no room for text"),
        (["the film was great", "--max-length", "2", "--format", "jsonl", "-o", "o.jsonl"], "leaves no room"),
        (["the film was great", "--max-length", "65"], "give --max-length 64 or less"),
    ],
)
def test_usage_errors_of_paths_and_lengths(capsys, tiny_model, tmp_path, monkeypatch, extra, message):
    from PIL import Image

    monkeypatch.chdir(tmp_path)
    (tmp_path / "plain").write_text("")
    Image.new("RGB", (8, 8)).save(tmp_path / "x.png")
    argv = [tiny_model if a == "MODEL" else a for a in extra]
    if extra[0] != "--image":
        argv += ["--model", tiny_model]
    code, out, err = run(capsys, *argv)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o.jsonl").exists()


def test_every_from_pretrained_gets_trust_remote_code_explicitly(capsys, tiny_model, monkeypatch):
    import transformers

    calls = []
    for cls in (transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoModelForSequenceClassification):
        real = cls.from_pretrained

        def record(*a, _real=real, _name=cls.__name__, **k):
            calls.append((_name, k.get("trust_remote_code", "unset")))
            return _real(*a, **k)

        monkeypatch.setattr(cls, "from_pretrained", record)
    code, _, err = run(capsys, "the film", "--model", tiny_model)
    assert code == 0, err
    assert {name for name, _ in calls} == {"AutoConfig", "AutoModelForSequenceClassification", "AutoTokenizer"}
    assert all(value is False for _, value in calls), calls  # explicit False: transformers never prompts
    calls.clear()
    assert run(capsys, "the film", "--model", tiny_model, "--trust-remote-code")[0] == 0
    assert all(value is True for _, value in calls), calls

    def hub_refuses(*a, **k):  # what transformers raises for a Hub model with custom code and trust_remote_code=False
        raise ValueError("The repository org/custom contains custom code which must be executed to correctly load "
                         "the model. Please pass the argument `trust_remote_code=True` to allow custom code to be run.")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", hub_refuses)
    code, _, err = run(capsys, "the film", "--model", "org/custom")
    assert code == 2 and "--trust-remote-code" in err and "Traceback" not in err


# ----------------------------------------------------------------- the first token (attention sinks)


def _number_rows(table: str):
    r"""Per token row of a table: the token and its numbers (bars dropped)."""
    rows = []
    for line in table.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0].lstrip("*s").isdigit():
            nums = []
            for p in parts[2:]:
                try:
                    nums.append(float(p))
                except ValueError:
                    pass
            rows.append((parts[1], nums))
    return rows


def test_exclude_sink_changes_the_presentation_not_the_scores(capsys, tiny_model, tmp_path, monkeypatch):
    base = [TEXTS[0], "--model", tiny_model, "-m", "globenc", "alti", "-q"]
    code, plain, err = run(capsys, *base, "--raw")
    assert code == 0, err
    code, out, err = run(capsys, *base, "--raw", "--exclude-sink")
    assert code == 0, err
    assert _number_rows(out) == _number_rows(plain) and _number_rows(out)  # the same scores
    assert "s = the first token, left out of the bar scale" in out and "left out" not in plain
    assert out != plain  # the bars are scaled by the other tokens
    code, shares, _ = run(capsys, *base, "--exclude-sink")
    assert "over all tokens of the text but the first" in shares
    # JSON: the scores unchanged, every method's sink_share, the flag in meta
    code, js_plain, _ = run(capsys, *base, "--format", "json")
    code, js, _ = run(capsys, *base, "--format", "json", "--exclude-sink")
    doc, doc_plain = json.loads(js), json.loads(js_plain)
    assert doc["meta"]["exclude_sink"] is True and "exclude_sink" not in doc_plain["meta"]
    r = doc["results"][0]
    assert r["attributions"] == doc_plain["results"][0]["attributions"]
    for name, scores in r["attributions"].items():
        assert r["sink_share"][name] == pytest.approx(abs(scores[0]) / sum(abs(s) for s in scores), rel=1e-12)
    # HTML: the colours are scaled without the first token
    page_plain, page = tmp_path / "a.html", tmp_path / "b.html"
    assert run(capsys, *base, "-o", page_plain)[0] == 0 and run(capsys, *base, "-o", page, "--exclude-sink")[0] == 0
    assert page.read_text(encoding="utf-8") != page_plain.read_text(encoding="utf-8")
    # --plots and --html-maps: every picture leaves the first token out
    from captum_normattr.present import visualization as V

    calls = []
    for name in ("plot_layer_grid", "plot_token_map", "plot_rollout_row", "plot_component_maps",
                 "plot_method_comparison"):
        def spy(*a, _real=getattr(V, name), _name=name, **k):
            calls.append((_name, k.get("exclude_sink")))
            return _real(*a, **k)
        monkeypatch.setattr(V, name, spy)
    code, _, err = run(capsys, *base, "--exclude-sink", "--plots", tmp_path / "p", "--html-maps", "--format", "html",
                       "-o", tmp_path / "c.html")
    assert code == 0, err
    assert len(calls) == 2 * 3 + 1 + 2 * 2 and all(flag is True for _, flag in calls), calls


@pytest.mark.parametrize("extra, message", [
    (["--aggregate", "word"], "use one of them"),
    (["--format", "jsonl", "-o", "out.jsonl"], "does not apply to --format jsonl"),
    (["--source", "the film"], "does not apply to alti-plus"),
    (["--image", "x.png"], "does not apply to --image"),
])
def test_exclude_sink_where_it_does_not_apply(capsys, tiny_model, tmp_path, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "--model", tiny_model, "--exclude-sink", *extra, *([] if "--source" in extra or
                                                                                "--image" in extra else [TEXTS[0]]))
    assert code == 2 and message in err and "Traceback" not in err, err


def test_the_one_progress_bar(capsys):
    r"""captum_normattr.progress: what the CLI, dataset runs and the harness share."""
    from captum_normattr.progress import NullBar, progress_bar, progress_iter

    assert isinstance(progress_bar(5, enabled=False), NullBar)
    assert isinstance(progress_bar(1), NullBar)  # one batch: no bar (the CLI's rule)
    assert not isinstance(progress_bar(1, min_total=1), NullBar)
    bar = progress_bar(3, unit="text")
    bar.update(3)
    bar.close()
    assert "text" in capsys.readouterr().err
    it = progress_iter(range(4), 4, min_total=1)
    assert next(it) == 0
    it.close()  # a loop left early closes its bar
    assert list(progress_iter([1, 2], 2, enabled=False)) == [1, 2]


@pytest.mark.parametrize("fmt", ["json", "html", "table"])
def test_an_existing_output_file_is_refused_without_overwrite(capsys, tiny_model, tmp_path, fmt):
    path = tmp_path / f"out.{ {'table': 'txt'}.get(fmt, fmt) }"
    path.write_text("keep me")
    code, _, err = run(capsys, "the film was great !", "--model", tiny_model, "--format", fmt, "-o", path)
    assert code == 2 and "exists; pass --overwrite" in err and path.read_text() == "keep me"
    code, _, err = run(capsys, "the film was great !", "--model", tiny_model, "--format", fmt, "-o", path,
                       "--overwrite")
    assert code == 0, err
    assert path.read_text() != "keep me" and not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
