"""Word alignment extraction and AER (captum_normattr.evaluation.alignment): hand-computed cases."""

import doctest

import pytest
import torch

from captum_normattr.evaluation import alignment as AL
from captum_normattr.evaluation import alignment_task
from captum_normattr.evaluation.alignment import (
    alignment_counts,
    alignment_error_rate,
    alignment_scores,
    argmax_alignment,
    batch_argmax_alignments,
    format_links,
    parse_links,
    target_rows,
)


# --------------------------------------------------------------------------- AER
def test_aer_perfect_and_disjoint():
    S = [{(0, 0), (1, 2), (2, 1)}]
    assert alignment_error_rate(S, S) == 0.0
    assert alignment_error_rate([{(0, 1), (1, 0)}], S) == 1.0


def test_aer_hand_computed_with_possible_links():
    # A = {(0,0), (1,1), (2,3)}; S = {(0,0), (1,2)}; P-only = {(1,1)}
    # |A|=3 |S|=2 |A∩S|=1 |A∩P|=2 (P includes S) -> AER = 1 - 3/5 = 0.4
    A = [{(0, 0), (1, 1), (2, 3)}]
    S = [{(0, 0), (1, 2)}]
    P = [{(1, 1)}]
    sc = alignment_scores(A, S, P)
    assert sc.aer == pytest.approx(0.4, abs=1e-15)
    assert sc.precision == pytest.approx(2 / 3)
    assert sc.recall == pytest.approx(1 / 2)
    assert (sc.n_hypothesis, sc.n_sure, sc.n_hyp_sure, sc.n_hyp_possible) == (3, 2, 1, 2)
    # giving P with S already inside changes nothing
    assert alignment_error_rate(A, S, [P[0] | S[0]]) == sc.aer
    # without the possible link the hit on (1,1) no longer counts: 1 - 2/5
    assert alignment_error_rate(A, S) == pytest.approx(0.6, abs=1e-15)


def test_aer_is_micro_averaged_over_the_corpus():
    # sentence 1: A=S, 1 link; sentence 2: 3 links, all wrong
    A = [{(0, 0)}, {(0, 1), (1, 2), (2, 0)}]
    S = [{(0, 0)}, {(0, 0), (1, 1), (2, 2)}]
    # summed: |A|=4 |S|=4 |A∩S|=1 |A∩P|=1 -> 1 - 2/8 = 0.75 (per-sentence mean would be 0.5)
    assert alignment_error_rate(A, S) == pytest.approx(0.75, abs=1e-15)


def test_aer_empty_hypothesis_and_empty_gold():
    assert alignment_error_rate([set()], [{(0, 0)}]) == 1.0
    assert alignment_error_rate([set()], [set()]) == 0.0
    sc = alignment_scores([set()], [{(0, 0)}])
    assert sc.precision == 1.0 and sc.recall == 0.0
    assert alignment_counts({(0, 0)}, set(), {(0, 0)}) == (1, 0, 0, 1)


def test_aer_errors():
    with pytest.raises(ValueError, match="one gold alignment per hypothesis"):
        alignment_error_rate([set(), set()], [set()])
    with pytest.raises(ValueError, match="pair"):
        alignment_error_rate([{(0, 1, 2)}], [set()])
    with pytest.raises(ValueError, match=">= 0"):
        alignment_error_rate([{(-1, 0)}], [set()])


# --------------------------------------------------------------------------- extraction
def test_target_rows_settings():
    assert target_rows(4).tolist() == [0, 1, 2, 3]
    assert target_rows(4, "input").tolist() == [1, 2, 3, 4]
    assert target_rows(0).tolist() == []
    with pytest.raises(ValueError, match="setting"):
        target_rows(2, "shifted")


def test_argmax_alignment_basic_ties_mask_and_null():
    scores = torch.tensor(
        [
            [0.1, 0.5, 0.5, 0.0],  # tie between 1 and 2 -> first (1)
            [0.9, 0.1, 0.0, 0.0],  # -> 0
            [0.0, 0.1, 0.2, 0.7],  # -> 3 (the EOS column: null)
            [0.0, 0.3, 0.2, 0.1],  # -> 1
        ],
        dtype=torch.float64,
    )
    assert argmax_alignment(scores) == {(0, 1), (1, 0), (2, 3), (3, 1)}
    assert argmax_alignment(scores, null_columns=[3]) == {(0, 1), (1, 0), (3, 1)}
    assert argmax_alignment(scores, null_columns=[-1]) == {(0, 1), (1, 0), (3, 1)}
    # masking column 3 forces a link for row 2 to the best remaining column (2)
    m = torch.tensor([True, True, True, False])
    assert argmax_alignment(scores, source_mask=m) == {(0, 1), (1, 0), (2, 2), (3, 1)}
    # masking column 1 moves rows 0 and 3
    m = torch.tensor([True, False, True, True])
    assert argmax_alignment(scores, source_mask=m) == {(0, 2), (1, 0), (2, 3), (3, 2)}
    # negative scores work (signed attributions): argmax, not argmax of |x|
    assert argmax_alignment(torch.tensor([[-3.0, -1.0, -2.0]])) == {(0, 1)}


def test_argmax_alignment_errors_and_empty():
    assert argmax_alignment(torch.zeros(0, 3)) == set()
    with pytest.raises(ValueError, match="NaN"):
        argmax_alignment(torch.tensor([[0.0, float("nan")]]))
    with pytest.raises(ValueError, match="no column"):
        argmax_alignment(torch.ones(1, 2), source_mask=torch.zeros(2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\(n_target, n_source\)"):
        argmax_alignment(torch.ones(2))
    with pytest.raises(ValueError, match="source_mask has 3"):
        argmax_alignment(torch.ones(1, 2), source_mask=torch.ones(3, dtype=torch.bool))


def _decoder_rows():
    # one sentence: 3 source words + EOS (+ 1 pad); decoder input [start, y1, y2] -> 3 rows,
    # n_target = 2 (y1, y2); row 2 predicts EOS and is never aligned in "output".
    s = torch.tensor(
        [
            [0.1, 0.2, 0.6, 0.1, 9.0],  # row 0 predicts y1 -> word 2 (pad column ignored)
            [0.1, 0.1, 0.1, 0.7, 0.0],  # row 1 predicts y2 -> EOS wins
            [0.8, 0.1, 0.0, 0.1, 0.0],  # row 2 predicts EOS
        ]
    )
    return s.unsqueeze(0), torch.tensor([[1, 1, 1, 1, 0]])


def test_batch_argmax_alignments_settings_eos_and_pad():
    s, m = _decoder_rows()
    assert batch_argmax_alignments(s, m, [2]) == [{(0, 2)}]
    # EOS excluded: row 1's runner-up among words is the first of the tied 0.1s -> word 0
    assert batch_argmax_alignments(s, m, [2], null_eos=False) == [{(0, 2), (1, 0)}]
    # "input": y1 read from row 1 (EOS wins, no link), y2 from row 2 -> word 0
    assert batch_argmax_alignments(s, m, [2], setting="input") == [{(1, 0)}]
    with pytest.raises(ValueError, match="need row 3"):
        batch_argmax_alignments(s, m, [3], setting="input")


def test_batch_equals_single_sentences_with_padding():
    g = torch.Generator().manual_seed(0)
    lens_src, n_tgt = [4, 6, 2], [3, 5, 1]
    S, T = max(lens_src), max(n_tgt) + 2
    scores = torch.rand(3, T, S, generator=g)
    mask = torch.zeros(3, S, dtype=torch.long)
    for b, L in enumerate(lens_src):
        mask[b, :L] = 1
    batch = batch_argmax_alignments(scores, mask, n_tgt)
    for b, (L, n) in enumerate(zip(lens_src, n_tgt)):
        single = argmax_alignment(scores[b, :n, :L], null_columns=[L - 1])
        assert batch[b] == single
        assert all(t < n and s < L - 1 for t, s in batch[b])


def test_batch_errors():
    with pytest.raises(ValueError, match=r"\(B, T, S\)"):
        batch_argmax_alignments(torch.ones(2, 3), torch.ones(2, 3), [1, 1])
    with pytest.raises(ValueError, match="source_mask must be"):
        batch_argmax_alignments(torch.ones(1, 2, 3), torch.ones(1, 2), [1])
    with pytest.raises(ValueError, match="n_target has"):
        batch_argmax_alignments(torch.ones(1, 2, 3), torch.ones(1, 3), [1, 1])
    with pytest.raises(ValueError, match="no source token"):
        batch_argmax_alignments(torch.ones(1, 2, 3), torch.zeros(1, 3), [1])


# --------------------------------------------------------------------------- text format
def test_parse_and_format_links_round_trip():
    sure, possible = parse_links("0-1 2p3 4-4")
    assert sure == {(1, 0), (4, 4)}
    assert possible == {(1, 0), (3, 2), (4, 4)}
    assert parse_links("1-0", source_first=False)[0] == {(1, 0)}
    assert format_links(sure) == "0-1 4-4"
    assert parse_links(format_links({(3, 1), (0, 2)}))[0] == {(3, 1), (0, 2)}
    with pytest.raises(ValueError, match="not a link"):
        parse_links("0-1 x")


def test_docstring_examples():
    res = doctest.testmod(AL, optionflags=doctest.ELLIPSIS)
    assert res.failed == 0 and res.attempted > 5


# --------------------------------------------------------------------------- the synthetic task (evaluation.alignment_task)
def test_synthetic_task_gold_alignments_follow_the_rules():
    import random

    M = alignment_task  # the synthetic translation task of benchmarks/faithfulness/mt_alignment.py
    lp = M.build_language_pair(0)
    assert M.build_language_pair(0).translation == lp.translation  # seeded
    rng = random.Random(3)
    cat = {w: c for c, ws in lp.src.items() for w in ws}
    for _ in range(200):
        ex = M.generate_example(rng, lp)
        links = sorted(ex.sure | ex.possible)
        # every target word has exactly one link, to a source word that translates into it
        assert [t for t, _ in links] == list(range(len(ex.tgt)))
        for t, s in ex.sure:
            assert ex.tgt[t] in lp.translation[ex.src[s]]
        (t_p, s_p), = ex.possible  # the object particle, possible only
        assert ex.tgt[t_p] == lp.particle and cat[ex.src[s_p]] == "noun"
        # SOV: the verb's translation ends the target; adverbs move to the front
        v = [s for s, w in enumerate(ex.src) if cat[w] == "verb"][0]
        assert max(t for t, s in ex.sure if s == v) == len(ex.tgt) - 1
        if cat[ex.src[-1]] == "adv":
            assert (0, len(ex.src) - 1) in ex.sure
        # adjective-noun swap: inside the target, a noun precedes the adjectives of its phrase
        for t, s in ex.sure:
            if cat[ex.src[s]] == "adj":
                noun_s = next(k for k in range(s, len(ex.src)) if cat[ex.src[k]] == "noun")
                assert min(tt for tt, ss in ex.sure if ss == noun_s) < t


def test_gold_scores_give_zero_aer_and_shuffled_gold_does_not():
    M = alignment_task  # the synthetic translation task of benchmarks/faithfulness/mt_alignment.py
    lp = M.build_language_pair(1)
    test, _ = M.make_datasets(lp, 1, 40)
    enc = M.encode(test)
    B, T = enc["dec"].shape
    S = enc["src"].shape[1]
    gold = torch.zeros(B, T, S)
    for b, ex in enumerate(test):
        for t, s in ex.sure | ex.possible:
            gold[b, t, s] = 1.0
        gold[b, len(ex.tgt), len(ex.src)] = 1.0  # the EOS row reads the source EOS
    hyp = batch_argmax_alignments(gold, enc["src_mask"], [len(e.tgt) for e in test])
    sure, poss = [e.sure for e in test], [e.possible for e in test]
    assert alignment_error_rate(hyp, sure, poss) == 0.0
    # the "input" setting reads the next row: far from perfect on this reordered task
    hyp_in = batch_argmax_alignments(gold, enc["src_mask"], [len(e.tgt) for e in test], setting="input")
    assert alignment_error_rate(hyp_in, sure, poss) > 0.5
