r"""The decoder harness's results (JSON, Markdown, paired differences, plot) and the item loaders (JSONL, SST-2)."""
import json

import pytest
import torch

from decoder_models import make_decoder
from llm_tiny import tiny_tokenizer

from captum_normattr.evaluation.decoder_harness import CallableAttributor, RandomAttributor, TaskState, run_round_robin
from captum_normattr.evaluation.decoder_harness_report import DecoderResult, paired_rows
from captum_normattr.evaluation.decoder_tasks import items_from_records, load_jsonl_task, load_sst2


def test_paired_rows_against_hand_computation():
    per_item = {"A": {"m": [3.0, 5.0, 1.0]}, "B": {"m": [1.0, 1.0, 2.0]}, "C": {"x": [1.0]}}
    rows = paired_rows(per_item, "B", ["m"])
    assert set(rows) == {"A"}
    r = rows["A"]["m"]  # differences 2, 4, -1
    assert r["mean"] == pytest.approx(5 / 3) and r["wins"] == 2 and r["n"] == 3 and r["median"] == 2.0
    var = sum((d - 5 / 3) ** 2 for d in (2, 4, -1)) / 2
    assert r["se"] == pytest.approx((var / 3) ** 0.5)


def test_items_from_records():
    tok = tiny_tokenizer()
    items = items_from_records([
        {"prompt": "the cat sat on the mat", "target": "is", "foil": "was", "evidence": ["cat", -3], "meta": {"k": 1}},
        {"prompt": "the dog ran home", "target": 7, "alt_evidence": [0]},
    ], tok)
    a, b = items
    assert a.input_ids == tok("the cat sat on the mat", add_special_tokens=False)["input_ids"]
    assert a.evidence == [1, 3] and a.target == tok.convert_tokens_to_ids("is") and a.meta == {"k": "1"}
    assert b.foil is None and b.target == 7 and b.evidence == [] and b.alt_evidence == [0]
    with_bos = items_from_records([{"prompt": "the cat sat", "target": "is", "evidence": ["cat"]}], tok,
                                  add_special_tokens=True)[0]
    assert with_bos.input_ids[0] == tok.bos_token_id and with_bos.evidence == [2]
    for rec, msg in [({"prompt": "the cat", "target": "is", "foil": "is"}, "same token"),
                     ({"prompt": "the cat", "target": "is", "evidence": [1]}, "outside"),
                     ({"prompt": "the cat sat", "target": "is", "evidence": ["dog"]}, "not in the prompt"),
                     ({"prompt": "the cat sat", "target": "is", "evidence": [1.5]}, "positions or substrings"),
                     ({"target": "is"}, "string 'prompt'")]:
        with pytest.raises(ValueError, match=msg):
            items_from_records([{"prompt": "the dog", "target": "is"}, rec], tok)


def test_load_jsonl_names_the_bad_line(tmp_path):
    path = tmp_path / "items.jsonl"
    path.write_text('{"prompt": "the cat sat", "target": "is"}\n\n{not json}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="line 3"):
        load_jsonl_task(str(path), tiny_tokenizer())


def test_load_sst2_tsv(tmp_path):
    path = tmp_path / "dev.tsv"
    rows = [(f"sentence {i} .", i % 2) for i in range(10)]
    path.write_text("sentence\tlabel\n" + "".join(f"{s} \t{l}\n" for s, l in rows), encoding="utf-8")
    sents, labels = load_sst2(str(path))
    assert sents == [s for s, _ in rows] and labels == [l for _, l in rows]
    s4, l4 = load_sst2(str(path), 4, seed=1)
    assert len(s4) == 4 and s4 == sorted(s4, key=lambda s: int(s.split()[1])) and load_sst2(str(path), 4, seed=1) == (s4, l4)
    assert all(labels[int(s.split()[1])] == l for s, l in zip(s4, l4))
    bad = tmp_path / "bad.tsv"
    bad.write_text("text\tlabel\nx\t1\n", encoding="utf-8")
    with pytest.raises(ValueError, match="sentence"):
        load_sst2(str(bad))


@pytest.fixture(scope="module")
def result():
    model = make_decoder("gpt2")
    tok = tiny_tokenizer()
    items = items_from_records([{"prompt": p, "target": "is", "foil": "was", "evidence": ["cat"]} for p in
                                ["the cat sat on the mat", "a cat ran home today", "the big cat is red", "the cat we said"]],
                               tok)
    g = torch.Generator().manual_seed(0)
    fixed = [torch.randn(len(it.input_ids), generator=g, dtype=torch.float64) for it in items]
    lookup = {tuple(it.input_ids): s for it, s in zip(items, fixed)}
    states = [TaskState("toy", 4, items[:3]), TaskState("toy2", 1, items[3:])]
    methods = {"Fixed": CallableAttributor(lambda ids, t, f: lookup[tuple(ids.tolist())], signed=True),
               "Random": RandomAttributor()}
    run_round_robin(model, states, methods, curves=True)
    return DecoderResult.from_states(states, tokenizer=tok, model="tiny gpt2", seed=0), states


def test_result_json_round_trip_and_values(result, tmp_path):
    res, states = result
    path = tmp_path / "r.json"
    res.to_json(str(path))
    back = DecoderResult.from_json(str(path))
    assert back.tasks == json.loads(path.read_text())["tasks"] and back.meta["model"] == "tiny gpt2"
    t = back.tasks["toy"]
    assert t["evaluated"] == 3 and t["items"][0]["target_text"] == "is"
    vals = states[0].values["Fixed"]["abpc_no_sink"]
    assert t["methods"]["Fixed"]["abpc_no_sink"]["mean"] == pytest.approx(sum(vals) / 3)
    assert t["per_item"]["Fixed"]["abpc_no_sink"] == [round(v, 6) for v in vals]
    assert "morf_1_no_sink" in t["curves"]["Fixed"] and "morf_1_no_sink" not in t["methods"]["Fixed"]
    assert back.methods == ["Fixed", "Random"]


def test_markdown_tables(result):
    res, states = result
    md = res.markdown(reference="Random")
    assert md.count("### toy") == 2 and "Paired differences against Random" in md
    d = [a - b for a, b in zip(states[0].values["Fixed"]["abpc_no_sink"], states[0].values["Random"]["abpc_no_sink"])]
    wins = sum(x > 0 for x in d)
    paired = md.split("### toy2")[0].split("Paired")[1]
    row = [ln for ln in paired.splitlines() if ln.startswith("| Fixed |")][0]
    assert f"; {wins}/3 |" in row
    short = res.markdown(exclude_sink_only=True)
    assert "sink removable" not in short and "ABPC (no sink)" in short and "abpc_with_sink" not in short


def test_plot(result, tmp_path):
    pytest.importorskip("matplotlib", reason="needs matplotlib: the [viz] extra (pip install captum-normattr[viz])")
    res, _ = result
    fig = res.plot(str(tmp_path / "c.png"))
    assert len(fig.axes) == 2 and (tmp_path / "c.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="curves=True"):
        DecoderResult({"t": {"curves": {}}}).plot()
