r"""Security and data-loss cases of the command line, run as a user would: ``python -m captum_normattr`` in a
subprocess (issue 27, items 1, 4, 5, 6, 7; the usage errors of item 16 are in tests/test_cli.py).

Each case is one subprocess on a tiny random BERT saved to a temporary folder; the runs that
only prepare a state (a finished output, a crashed run) call :func:`captum_normattr.cli.main.main`
in this process, which is the same code and faster.
"""
from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from captum_normattr.cli import main as cli

from captum_normattr.cli import common as cli_common

from captum_normattr.cli.dataset import resume
from captum_normattr.cli.dataset import run as runs

REPO = Path(__file__).resolve().parents[2]
WORDS = ["the", "film", "was", "great", "bad", "a", "movie", "not", "fun", "plot", "very", "boring"]
TEXTS = ["the film was great", "a bad movie", "not fun", "the plot was very boring", "great fun", "a film"]


def _tokenizer():
    from transformers import BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    return BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import BertConfig, BertForSequenceClassification

    path = tmp_path_factory.mktemp("tiny_bert")
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=5 + len(WORDS), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32, num_labels=2)
    BertForSequenceClassification(cfg).eval().save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return str(path)


def _cli(*argv, stdin: str = "", **env) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", MPLBACKEND="Agg",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **env)
    return subprocess.run([sys.executable, "-m", "captum_normattr", *map(str, argv)], input=stdin,
                          capture_output=True, text=True, env=env, timeout=300)


def _one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("captum-normattr: error:")]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def _records(path) -> list:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").split("\n") if line]


def _evil_folder(root: Path, marker: Path) -> Path:
    r"""A model folder whose config.json's auto_map names its own Python file, which writes ``marker`` on import."""
    folder = root / "evil"
    folder.mkdir()
    (folder / "evil.py").write_text(
        "from pathlib import Path\n"
        f"Path({str(marker)!r}).write_text('the folder code ran')\n"
        "from transformers import BertConfig, BertModel, ViTConfig, ViTForImageClassification\n"
        "class EvilConfig(BertConfig):\n    model_type = 'evilbert'\n"
        "class EvilModel(BertModel):\n    config_class = EvilConfig\n"
        "class EvilVitConfig(ViTConfig):\n    model_type = 'evilbert'\n"
        "class EvilVit(ViTForImageClassification):\n    config_class = EvilVitConfig\n"
    )
    cfg = {"model_type": "evilbert", "architectures": ["EvilModel"],
           "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel",
                        "AutoModelForImageClassification": "evil.EvilVit"},
           "vocab_size": 5 + len(WORDS), "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
           "intermediate_size": 16, "max_position_embeddings": 32}
    (folder / "config.json").write_text(json.dumps(cfg))
    _tokenizer().save_pretrained(folder)
    return folder


# ----------------------------------------------------------------- 1: no code runs without consent


def test_folder_code_never_runs_without_trust_remote_code_even_with_yes_on_stdin(tmp_path):
    marker = tmp_path / "MARKER"
    folder = _evil_folder(tmp_path, marker)
    proc = _cli("--model", folder, "the film", stdin="y\n" * 50)  # what `yes | captum-normattr ...` feeds a prompt
    assert not marker.exists()
    _one_line_error(proc, "--trust-remote-code", "auto_map")
    assert "[y/N]" not in proc.stdout + proc.stderr  # transformers never asked


def test_generate_never_runs_folder_code_without_trust_remote_code(tmp_path):
    r"""``captum-normattr generate`` loads models as the main command does: the folder's code stays unrun."""
    marker = tmp_path / "MARKER"
    folder = _evil_folder(tmp_path, marker)
    proc = _cli("generate", "--model", folder, "the film", "--max-new-tokens", "2", stdin="y\n" * 50)
    assert not marker.exists()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("captum-normattr generate: error:")]
    assert len(lines) == 1 and "--trust-remote-code" in lines[0] and "auto_map" in lines[0], proc.stderr
    assert "[y/N]" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("mode", ["jsonl", "image"])
def test_folder_code_never_runs_in_jsonl_and_image_runs(mode, tmp_path, monkeypatch, capsys):
    import io

    marker = tmp_path / "MARKER"
    folder = _evil_folder(tmp_path, marker)
    if mode == "jsonl":
        args = ["the film", "--format", "jsonl", "-o", str(tmp_path / "out.jsonl")]
    else:
        from PIL import Image

        Image.new("RGB", (8, 8)).save(tmp_path / "x.png")
        args = ["--image", str(tmp_path / "x.png")]
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 50))
    try:
        code = cli.main(["--model", str(folder), *args])
    except Exception as err:  # noqa: BLE001 - whatever the folder's code did, the marker tells whether it ran
        code = err
    assert not marker.exists()
    assert code == 2 and "--trust-remote-code" in capsys.readouterr().err


def test_trust_remote_code_is_what_lets_the_folder_code_run(tmp_path):
    r"""The control: the same folder does run its code with the flag (so the tests above can fail)."""
    marker = tmp_path / "MARKER"
    folder = _evil_folder(tmp_path, marker)
    _cli("--model", folder, "the film", "--trust-remote-code", "-q", HF_MODULES_CACHE=str(tmp_path / "modules"))
    assert marker.exists()


# ----------------------------------------------------------------- 4: the output never replaces an input


def test_an_output_that_is_an_input_is_refused_through_symlinks(model_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:2]))
    before = data.read_bytes()
    (tmp_path / "link.jsonl").symlink_to(data)
    proc = _cli("--model", model_dir, "--file", data, "-o", tmp_path / "link.jsonl", "-q")
    _one_line_error(proc, "is the input file", "another output path")
    assert data.read_bytes() == before
    code = cli.main(["--model", model_dir, "--file", str(data), "-o", str(data), "--format", "json", "-q"])
    assert code == 2 and data.read_bytes() == before
    with pytest.raises(resume.OutputError, match="is the input"):  # the Python form too
        runs.explain_dataset(str(data), output=tmp_path / "link.jsonl", progress=False)
    assert data.read_bytes() == before


# ----------------------------------------------------------------- 5: a torn shard loses no record


def test_resume_after_a_torn_last_line_loses_no_record(model_dir, tmp_path, capsys):
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXTS) + "\n")
    ref = tmp_path / "ref.jsonl"
    assert cli.main(["--model", model_dir, "--file", str(texts), "-o", str(ref), "-m", "alti", "-b", "2", "-q"]) == 0
    out = tmp_path / "out.jsonl"
    assert cli.main(["--model", model_dir, "--file", str(texts), "-o", str(out), "-m", "alti", "-b", "2", "-q"]) == 0
    capsys.readouterr()
    lines = out.read_text(encoding="utf-8").split("\n")[:-1]
    out.unlink()  # as if the run died while writing its shard: 3 records and half of the 4th
    Path(str(out) + ".part-0").write_text("\n".join(lines[:3]) + "\n" + lines[3][: len(lines[3]) // 2],
                                          encoding="utf-8")
    proc = _cli("--model", model_dir, "--file", texts, "-o", out, "-m", "alti", "-b", "2", "-q")
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = _records(out)
    assert [r["id"] for r in recs] == [1, 2, 3, 4, 5, 6]  # none glued onto the fragment and lost
    assert "incomplete last line" in proc.stderr
    for a, b in zip(recs, _records(ref)):
        assert a["text"] == b["text"] and a["tokens"] == b["tokens"]
        x, y = torch.tensor(a["methods"]["alti"]["scores"]), torch.tensor(b["methods"]["alti"]["scores"])
        assert (x - y).abs().max() <= 1e-6 * (1 + y.abs().max())


# ----------------------------------------------------------------- 6: one writer per output


def test_a_second_writer_is_refused_and_the_lock_is_released(model_dir, tmp_path, capsys, monkeypatch):
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXTS[:3]) + "\n")
    out = tmp_path / "out.jsonl"
    lock = tmp_path / "out.jsonl.lock"  # documented: <output>.lock
    with open(lock, "w") as held:  # another run holds the output (deterministic: the lock is taken first)
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = _cli("--model", model_dir, "--file", texts, "-o", out, "-q")
        _one_line_error(proc, "being written by another run", "another -o")
        with pytest.raises(resume.OutputError, match="another run"):
            runs.explain_dataset(str(texts), *_load(model_dir), methods=["alti"], output=out, progress=False)
        assert not out.exists() and not list(tmp_path.glob("out.jsonl.part-*"))
    lock.unlink()
    assert cli.main(["--model", model_dir, "--file", str(texts), "-o", str(out), "-q"]) == 0
    assert not lock.exists() and len(_records(out)) == 3  # released after a run

    def crash(*a, **k):
        raise ValueError("boom")

    monkeypatch.setattr(cli_common, "explain_batch", crash)
    assert cli.main(["--model", model_dir, "--file", str(texts), "-o", str(out), "-q", "--overwrite"]) == 2
    capsys.readouterr()
    assert not lock.exists()  # released after an error
    with open(lock, "w") as probe:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody holds it


def _load(model_dir):
    model, tok, _ = cli_common.load_model(model_dir, "cpu")
    return model, tok


# ----------------------------------------------------------------- 7: resume only the same job


def test_resume_refuses_another_job_or_other_texts_and_says_which(model_dir, tmp_path, capsys):
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXTS[:3]) + "\n")
    out = tmp_path / "out.jsonl"
    base = ["--model", model_dir, "--file", str(texts), "-o", str(out), "-q"]
    assert cli.main(base + ["-m", "alti"]) == 0
    before = out.read_text()
    proc = _cli(*base, "-m", "globenc")
    _one_line_error(proc, "another job", "methods: alti there, globenc now", "--overwrite")
    for extra, needle in ((["-m", "alti", "--position", "1"], "explained_position: 0 there, 1 now"),
                          (["-m", "alti", "--max-length", "5"], "max_length: 32 there, 5 now")):
        assert cli.main(base + extra) == 2
        assert needle in capsys.readouterr().err
    texts.write_text("an inserted line\n" + "\n".join(TEXTS[:4]) + "\n")  # every id now names another text
    assert cli.main(base + ["-m", "alti"]) == 2
    err = capsys.readouterr().err
    assert "3 record(s)" in err and "other texts" in err and "id 1" in err
    assert out.read_text() == before
    assert cli.main(base + ["-m", "alti", "--overwrite"]) == 0
    assert [r["text"] for r in _records(out)] == ["an inserted line"] + TEXTS[:4]


def test_resume_after_a_targeted_weight_edit_is_refused(model_dir, tmp_path, capsys):
    r"""A head or neuron ablation saved under the same folder (rows 8-15 of one projection zeroed, one FF row
    scaled; neither touches the first or last 16 values) changes the fingerprint: the resume refuses instead of mixing two models in one file."""
    import shutil

    from transformers import BertForSequenceClassification

    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXTS[:4]) + "\n")
    out = tmp_path / "out.jsonl"
    base = ["--model", str(folder), "--file", str(texts), "-o", str(out), "-q", "-m", "alti"]
    assert cli.main(base) == 0
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:2]) + "\n")  # as if interrupted after two records
    model = BertForSequenceClassification.from_pretrained(folder)
    with torch.no_grad():
        model.bert.encoder.layer[0].attention.output.dense.weight[8:15] = 0  # not the first or last 16 values
        model.bert.encoder.layer[0].output.dense.weight[3] *= 1.5
    model.save_pretrained(folder)
    assert cli.main(base) == 2
    assert "another job" in capsys.readouterr().err


ESC, RLO = "\x1b[31m", "\u202e"  # an escape sequence (red) and a right-to-left override


def _clean(stream: str) -> None:
    assert "\x1b" not in stream and RLO not in stream, stream[-2000:]


def test_messages_echo_names_and_texts_neutralised(model_dir, tmp_path, capsys):
    r"""Usage errors, argparse errors, warnings and notes show escape codes and overrides, never send them."""
    assert cli.main(["--model", model_dir, "--file", f"no{ESC}such{RLO}.txt"]) == 2
    err = capsys.readouterr().err
    _clean(err)
    assert "no\\x1b[31msuch\\u202e.txt" in err
    assert cli.main(["--model", model_dir, f"--bogus{ESC}"]) == 2  # argparse's own message
    _clean(capsys.readouterr().err)
    src = tmp_path / f"in{RLO}.txt"
    src.write_text("the film was great great great great\n", encoding="utf-8")
    out = tmp_path / f"out{ESC}.jsonl"
    assert cli.main(["--model", model_dir, "--file", str(src), "-o", str(out), "--max-length", "4"]) == 0
    err = capsys.readouterr().err  # the truncation warning names the file; "wrote ..." names the output
    _clean(err)
    assert "in\\u202e.txt line 1" in err and "out\\x1b[31m.jsonl" in err


def test_json_on_stdout_escapes_overrides_and_keeps_the_data(model_dir, capsys):
    text = f"the film {RLO}was great"
    assert cli.main(["--model", model_dir, "--format", "json", "-q", text]) == 0
    out = capsys.readouterr().out
    _clean(out)
    assert json.loads(out)["results"][0]["text"] == text
    assert cli.main(["--model", model_dir, "--format", "html", "-q", text]) == 0
    page = capsys.readouterr().out
    _clean(page)  # the HTML report shows such characters visibly already (report.render_html)
