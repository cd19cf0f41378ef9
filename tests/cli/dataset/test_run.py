r"""Dataset runs: JSON Lines records, inputs of every kind, resume, broken inputs, accelerate launch."""
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

from captum_normattr.cli.dataset import inputs as dataset_inputs
from captum_normattr.cli.dataset import run as runs
from captum_normattr.cli.main import main
from captum_normattr.models.loading import default_model_path

TEXTS = ["the film was a delight", "boring and far too long", "a gripping, funny film", "ok",
         "I would not watch it again, ever", "what a waste of a good cast"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    r"""A tiny BERT classifier with the packaged MiniLM tokenizer, saved as a model folder."""
    path = tmp_path_factory.mktemp("tiny_model")
    tok = AutoTokenizer.from_pretrained(default_model_path())
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=40, max_position_embeddings=64, num_labels=2)
    BertForSequenceClassification(cfg).eval().save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _cli(model_dir, *args):
    return main(["--model", model_dir, "-q", "-b", "2", *map(str, args)])


def _same(a, b, tol=1e-5):
    assert [r["id"] for r in a] == [r["id"] for r in b]
    for ra, rb in zip(a, b):
        assert ra["tokens"] == rb["tokens"] and ra["text"] == rb["text"]
        assert ra["methods"].keys() == rb["methods"].keys()
        for m in ra["methods"]:
            x, y = torch.tensor(ra["methods"][m]["scores"]), torch.tensor(rb["methods"][m]["scores"])
            assert x.shape == y.shape and (x - y).abs().max() <= tol * (1 + x.abs().max()), m


def test_records_hold_tokens_scores_and_completeness_per_method(model_dir, tmp_path):
    (tmp_path / "texts.txt").write_text("\n".join(TEXTS[:3]) + "\n\n" + TEXTS[3] + "\n")
    out = tmp_path / "out.jsonl"
    assert _cli(model_dir, "-m", "alti", "decompx", "--file", tmp_path / "texts.txt", "-o", out) == 0
    recs = _records(out)
    assert [r["id"] for r in recs] == [1, 2, 3, 5]  # line numbers, blank line skipped, input order
    for r, text in zip(recs, TEXTS[:4]):
        assert r["text"] == text and r["tokens"][0] == "[CLS]" and r["tokens"][-1] == "[SEP]"
        alti, dx = r["methods"]["alti"], r["methods"]["decompx"]
        assert len(alti["scores"]) == len(r["tokens"]) == len(dx["scores"])  # pads dropped
        assert alti["completeness_error"] < 1e-4 and dx["completeness_error"] < 1e-4
        assert alti["explained_position"] == 0 and isinstance(dx["target"], int)
        for entry in (alti, dx):  # the first token's share of the absolute scores, the scores unchanged
            total = sum(abs(v) for v in entry["scores"])
            assert entry["sink_share"] == pytest.approx(abs(entry["scores"][0]) / total, rel=1e-12)
    # a batch of one text gives the same record as the batch it ran in
    alone = runs.explain_dataset([TEXTS[2]], *_load(model_dir), methods=["alti", "decompx"], progress=False)
    _same([dict(recs[2], id=1)], alone)


def _load(model_dir):
    from captum_normattr.cli.common import load_model

    model, tok, _ = load_model(model_dir, "cpu")
    return model, tok


@pytest.mark.parametrize("kind", ["jsonl", "csv", "tsv", "dataset"])
def test_inputs_of_every_kind(kind, tmp_path, monkeypatch):
    rows = [{"key": f"r{i}", "review": t} for i, t in enumerate(TEXTS[:3])]
    if kind == "jsonl":
        path = tmp_path / "in.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind in ("csv", "tsv"):
        sep = "," if kind == "csv" else "\t"
        path = tmp_path / f"in.{kind}"
        path.write_text("key" + sep + "review\n" + "".join(f"{r['key']}{sep}\"{r['review']}\"\n" for r in rows))
    else:
        path = tmp_path / "saved_dataset"
        path.mkdir()

        class FakeDataset:  # what load_from_disk returns: columns by name
            column_names = ["key", "review"]

            def __getitem__(self, name):
                return [r[name] for r in rows]

        monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_from_disk=lambda p: FakeDataset()))
    items = dataset_inputs.read_inputs(path, column="review", id_column="key")
    assert [(it.id, it.text) for it in items] == [(r["key"], r["review"]) for r in rows]
    if kind == "dataset":
        monkeypatch.setitem(sys.modules, "datasets", None)  # not installed: a message saying what to do
        with pytest.raises(dataset_inputs.InputError, match="pip install datasets"):
            dataset_inputs.read_inputs(path, column="review")


def test_resume_skips_finished_ids_and_a_crash_loses_nothing(model_dir, tmp_path, monkeypatch):
    path, out = tmp_path / "texts.txt", tmp_path / "out.jsonl"
    path.write_text("\n".join(TEXTS[:2]) + "\n")
    assert _cli(model_dir, "-m", "alti", "--file", path, "-o", out) == 0
    first = _records(out)
    path.write_text("\n".join(TEXTS) + "\n")  # four more texts
    from captum_normattr.cli import common as cli_common

    seen, real = [], cli_common.explain_batch

    def crash_on_second_batch(spec, attr, ids, mask, *a):
        seen.append(int(ids.shape[0]))
        if len(seen) == 2:
            raise KeyboardInterrupt  # the process dies mid-run
        return real(spec, attr, ids, mask, *a)

    monkeypatch.setattr(cli_common, "explain_batch", crash_on_second_batch)
    assert _cli(model_dir, "-m", "alti", "--file", path, "-o", out) == 130
    assert seen == [2, 2]  # only the four new texts were taken up
    assert _records(out) == first  # the output is untouched; the finished batch waits in a shard
    assert len(_records(str(out) + ".part-0")) == 2
    seen.clear()
    monkeypatch.setattr(cli_common, "explain_batch", lambda *a: (seen.append(int(a[2].shape[0])), real(*a))[1])
    assert _cli(model_dir, "-m", "alti", "--file", path, "-o", out) == 0
    assert seen == [2]  # only the last two texts ran
    recs = _records(out)
    assert [r["id"] for r in recs] == [1, 2, 3, 4, 5, 6] and recs[:2] == first
    assert not list(tmp_path.glob("out.jsonl.part-*"))
    fresh = tmp_path / "fresh.jsonl"
    assert _cli(model_dir, "-m", "alti", "--file", path, "-o", fresh, "-b", "8") == 0
    _same(recs, _records(fresh))


def test_a_broken_input_line_is_named_and_loses_no_records(model_dir, tmp_path, capsys):
    path, out = tmp_path / "texts.jsonl", tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:2]))
    assert _cli(model_dir, "-m", "alti", "--file", path, "--format", "jsonl", "-o", out) == 0
    before = out.read_text()
    path.write_text(path.read_text() + json.dumps({"text": TEXTS[2]}) + "\n" + '{"text": "unterminated\n')
    assert _cli(model_dir, "-m", "alti", "--file", path, "--format", "jsonl", "-o", out) == 2
    err = capsys.readouterr().err
    assert f"{path} line 4: not valid JSON" in err
    assert out.read_text() == before
    path.write_text(json.dumps({"text": TEXTS[0]}) + "\n" + json.dumps({"body": "x"}) + "\n")
    assert _cli(model_dir, "--file", path, "-o", out) == 2
    assert "line 2: no 'text' field" in capsys.readouterr().err


def test_accelerate_launch_two_processes_write_the_same_records_as_one(model_dir, tmp_path):
    path = tmp_path / "texts.txt"
    path.write_text("\n".join(TEXTS) + "\n")
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert _cli(model_dir, "-m", "alti", "--file", path, "--format", "jsonl", "-o", one) == 0
    launcher = Path(sys.executable).with_name("accelerate")
    # the documented command: accelerate's --cpu launcher starts one process (its multi-CPU launcher is
    # mpirun); the program sees that and starts the 2 processes itself (captum_normattr/cli/dataset/launch.py)
    cmd = [str(launcher), "launch", "--cpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no",
           "-m", "captum_normattr", "-m", "alti", "--file", str(path), "--format", "jsonl",
           "-o", str(two), "--model", model_dir, "-b", "2"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[3]), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "starting 2 CPU processes" in proc.stderr
    assert "(6 records, 2 processes: 3 + 3 explained now)" in proc.stderr  # each process took half of the texts
    _same(_records(one), _records(two))
    assert not list(tmp_path.glob("two.jsonl.part-*"))


def test_accelerate_launch_command_lines_are_recognised(monkeypatch):
    from captum_normattr.cli.dataset.launch import launch_arguments, requested_cpu_processes

    assert launch_arguments(["/venv/bin/python", "/venv/bin/accelerate", "launch", "--cpu", "-m", "x"]) == ["--cpu", "-m", "x"]
    assert launch_arguments(["python", "-m", "accelerate.commands.launch", "--cpu", "s.py"]) == ["--cpu", "s.py"]
    assert launch_arguments(["/venv/bin/accelerate-launch", "s.py"]) == ["s.py"]
    assert launch_arguments(["python", "-m", "pytest", "-q"]) is None
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    cli = ["/venv/bin/accelerate", "launch", "--cpu", "--num_processes", "3", "-m", "captum_normattr", "-m", "alti"]
    assert requested_cpu_processes(cli) == 3
    assert requested_cpu_processes(cli[:4] + ["1"] + cli[5:]) == 1  # one process asked for
    assert requested_cpu_processes(cli[:2] + ["--num_machines", "2"] + cli[2:]) == 1  # several machines: mpirun's job
    assert requested_cpu_processes(cli[:2] + ["--mpirun_hostfile", "hosts"] + cli[2:]) == 1
    assert requested_cpu_processes(["python", "-m", "captum_normattr"]) == 1  # not accelerate launch
    monkeypatch.setenv("WORLD_SIZE", "3")  # already one of the N processes
    assert requested_cpu_processes(cli) == 1


def test_close_process_group_tears_down_a_started_group(tmp_path):
    import torch.distributed as dist

    from captum_normattr.cli.dataset.launch import close_process_group

    close_process_group()  # no group: nothing happens
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    assert dist.is_initialized()
    close_process_group()
    assert not dist.is_initialized()


def test_lines_split_only_at_newlines_and_a_byte_order_mark_is_dropped(tmp_path):
    odd = ["a\u2028b", "c\x85d", "e\x0cf", "g\rh"]  # str.splitlines() splits each of these
    (tmp_path / "t.txt").write_bytes(("\ufeff" + "\r\n".join(odd) + "\r\n").encode("utf-8"))
    items = dataset_inputs.read_inputs(tmp_path / "t.txt")
    assert [(it.id, it.text) for it in items] == list(enumerate(odd, start=1))
    (tmp_path / "t.jsonl").write_bytes(("\ufeff" + "\n".join(json.dumps({"text": t}, ensure_ascii=False)
                                                             for t in odd) + "\n").encode("utf-8"))
    assert [(it.id, it.text) for it in dataset_inputs.read_inputs(tmp_path / "t.jsonl")] == list(enumerate(odd, start=1))
    (tmp_path / "t.csv").write_bytes("\ufefftext,id\r\nfirst,7\r\nsecond,8\r\n".encode("utf-8"))
    items = dataset_inputs.read_inputs(tmp_path / "t.csv", id_column="id")
    assert [(it.id, it.text) for it in items] == [("7", "first"), ("8", "second")]


def test_truncated_texts_warn_and_flag_their_records(model_dir, tmp_path, capsys):
    long = " ".join(["boring"] * 30)
    (tmp_path / "t.txt").write_text(f"{TEXTS[0]}\n{long}\n")
    out = tmp_path / "out.jsonl"
    assert _cli(model_dir, "--file", tmp_path / "t.txt", "-o", out, "--max-length", "8") == 0
    err = capsys.readouterr().err
    assert "line 2 (id 2) has 32 tokens but the limit is 8: its last 24 token(s) were cut" in err
    short, cut = _records(out)
    assert short["truncated"] is False and "tokens_cut" not in short
    assert cut["truncated"] is True and cut["tokens_cut"] == 24 and len(cut["tokens"]) == 8
    with pytest.warns(UserWarning, match="were cut"):
        recs = runs.explain_dataset([long], *_load(model_dir), max_length=8, progress=False)
    assert recs[0]["truncated"] is True
