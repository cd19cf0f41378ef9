r"""``captum-normattr evaluate`` on a tiny saved decoder with a JSONL task (evaluate_main called directly)."""
import json

import pytest

from decoder_models import make_decoder
from llm_tiny import tiny_tokenizer

from cli_models import TEXTS, tiny_model  # noqa: F401  (the session fixture)
from captum_normattr.cli.evaluate import build_parser, evaluate_main

ITEMS = [
    {"prompt": "the cat sat on the mat and", "target": "he", "foil": "she", "evidence": ["cat"]},
    {"prompt": "the dog ran home today and", "target": "she", "foil": "he", "evidence": [1, "home"]},
    {"prompt": "a big red house in the sun", "target": "is", "foil": "was", "evidence": ["house"]},
    {"prompt": "they said hello world to you", "target": "good", "foil": None, "evidence": ["hello world"]},
]


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama")
    make_decoder("llama", attn="eager", exact_norms=False).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def items_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("items") / "items.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ITEMS) + "\n\n", encoding="utf-8")
    return str(path)


def test_module_level_imports_are_light(capsys):
    r"""Only the standard library at module level (the package's own __init__ imports torch, the command does not)."""
    import ast
    import captum_normattr.cli.evaluate as mod

    tree = ast.parse(open(mod.__file__, encoding="utf-8").read())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {a.name.split(".")[0] for n in top if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in top if isinstance(n, ast.ImportFrom)}
    assert names <= {"argparse", "sys", "typing", "__future__"}, names
    assert evaluate_main(["--help"]) == 0
    assert "--exclude-sink" in capsys.readouterr().out


def test_jsonl_task_writes_json_markdown_and_plot(tiny_lm, items_file, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="needs matplotlib: the [viz] extra (pip install captum-normattr[viz])")
    out, md, png = tmp_path / "out.json", tmp_path / "table.md", tmp_path / "curves.png"
    code = evaluate_main(["--model", tiny_lm, "--task", "jsonl", "--data", items_file, "--no-filter",
                          "--methods", "alti-logit,decompx,ig:4,saliency,attention,random", "--reference", "Random",
                          "--seed", "3", "-o", str(out), "--markdown", str(md), "--plot", str(png)])
    err = capsys.readouterr().err
    assert code == 0, err
    res = json.loads(out.read_text())
    task = res["tasks"]["jsonl"]
    assert task["evaluated"] == 4 and res["meta"]["seed"] == 3
    assert list(task["methods"]) == ["ALTI-Logit", "DecompX", "IG-4", "Saliency", "Attention (last layer)", "Random"]
    for m, rec in task["methods"].items():
        for k in ("deletion_aopc_no_sink", "abpc_no_sink", "abpc_with_sink", "insertion_aopc_with_sink", "mrr_no_sink"):
            assert rec[k]["n"] == 4, (m, k)
    assert len(task["per_item"]["ALTI-Logit"]["abpc_no_sink"]) == 4
    assert task["items"][3]["foil"] is None and task["items"][1]["evidence"] == [1, 3]
    text = md.read_text()
    assert "ABPC (no sink)" in text and "Paired differences against Random" in text and "| ALTI-Logit |" in text
    assert png.stat().st_size > 1000


def test_exclude_sink_report_and_printed_markdown(tiny_lm, items_file, capsys):
    code = evaluate_main(["--model", tiny_lm, "--task", "jsonl", "--data", items_file, "--no-filter", "--items", "2",
                          "--methods", "ixg,random", "--exclude-sink", "--markdown", "-"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "ABPC (no sink)" in out and "sink removable" not in out and "2 items" in out


@pytest.mark.parametrize("argv, message", [
    (["--task", "jsonl"], "needs --data"),
    (["--task", "nope"], "unknown task"),
    (["--task", "sst2,sva", "--data", "x"], "runs alone"),
    (["--task", "jsonl", "--data", "MISSING.jsonl"], "MISSING.jsonl"),
    (["--task", "jsonl", "--methods", "nope"], "unknown method"),
])
def test_usage_errors(tiny_lm, items_file, argv, message, capsys):
    argv = list(argv)
    if argv[:2] == ["--task", "jsonl"] and "--data" not in argv and len(argv) > 2:
        argv += ["--data", items_file]
    code = evaluate_main(["--model", tiny_lm, *argv])
    assert code == 2
    assert message in capsys.readouterr().err


def test_bad_jsonl_line_is_named(tiny_lm, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "the cat sat", "target": "is", "evidence": ["zebra"]}) + "\n")
    assert evaluate_main(["--model", tiny_lm, "--task", "jsonl", "--data", str(path)]) == 2
    err = capsys.readouterr().err
    assert "item 1" in err and "zebra" in err


def test_sst2_runs_the_classifier_harness(tiny_model, tmp_path, capsys):
    data = tmp_path / "dev.tsv"
    data.write_text("sentence\tlabel\n" + "".join(f"{s} \t{i % 2}\n" for i, s in enumerate(TEXTS)), encoding="utf-8")
    out = tmp_path / "sst2.json"
    code = evaluate_main(["--model", tiny_model, "--task", "sst2", "--data", str(data), "--items", "3",
                          "--methods", "globenc,saliency", "-o", str(out), "--markdown", "-"])
    printed, err = capsys.readouterr()
    assert code == 0, err
    res = json.loads(out.read_text())
    assert "eraser" in printed.lower() and "GlobEnc" in printed
    assert res  # the HarnessResult's JSON
    assert evaluate_main(["--model", tiny_model, "--task", "sst2", "--data", str(data), "--methods", "nope"]) == 2
    assert "unknown method" in capsys.readouterr().err
