r"""Tests of captum_normattr.evaluation: metrics on toy models with hand-computed answers,
the Captum baselines and the harness on tiny random BERT classifiers (float64)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from captum_normattr.evaluation import (
    CaptumInfidelity,
    CaptumSensitivity,
    DecompXMaskAOPC,
    EraserAOPC,
    FaithfulnessHarness,
    HarnessResult,
    Method,
    SequenceClassifier,
    SpearmanGradXInput,
    baselines,
    make_presets,
    metrics,
)

PAD, CLS, SEP, MASK, KEY = 0, 1, 2, 3, 7
STRENGTH = 4.0
D = 1.0 / (1.0 + math.exp(-STRENGTH)) - 0.5  # p(class 1) with the key token minus without it


class OneTokenModel(nn.Module):
    r"""logit_1 = STRENGTH * (number of KEY tokens), logit_0 = 0: only one token matters.

    Linear in its word embeddings (1-d, 1 for KEY, 0 otherwise), so infidelity of the
    exact scores is 0 by hand.
    """

    def __init__(self, vocab: int = 20) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 1)
        with torch.no_grad():
            self.emb.weight.zero_()
            self.emb.weight[KEY] = 1.0
        self.emb.double()

    def get_input_embeddings(self) -> nn.Module:
        return self.emb

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None):
        e = self.emb(input_ids) if inputs_embeds is None else inputs_embeds
        s = (e[..., 0] * attention_mask.to(e.dtype)).sum(1)
        return torch.stack([torch.zeros_like(s), STRENGTH * s], 1)


def one_token_clf() -> SequenceClassifier:
    return SequenceClassifier(OneTokenModel(), special_token_ids=[PAD, CLS, SEP], mask_token_id=MASK, pad_token_id=PAD)


# ids: [CLS] 5 KEY 6 8 [SEP] -> 4 non-special tokens, KEY at position 2
IDS = torch.tensor([[CLS, 5, KEY, 6, 8, SEP]])
MASK_ = torch.ones_like(IDS)
PERFECT = torch.tensor([[0.0, 0.3, 1.0, 0.2, 0.1, 5.0]])  # KEY first ([SEP] high but never ranked)
REVERSED = torch.tensor([[9.0, 0.3, 0.0, 0.2, 0.4, 0.0]])  # KEY last


# ------------------------------------------------------------------- small helpers
def test_num_selected_and_top_k():
    n = torch.tensor([4, 20, 3, 0])
    assert metrics.num_selected(n, 1).tolist() == [1, 1, 1, 0]
    assert metrics.num_selected(n, 50).tolist() == [2, 10, 2, 0]
    assert metrics.num_selected(n, 50, "floor").tolist() == [2, 10, 1, 0]
    assert metrics.num_selected(n, 0).tolist() == [0, 0, 0, 0]
    assert metrics.num_selected(n, 100).tolist() == [4, 20, 3, 0]
    with pytest.raises(ValueError):
        metrics.num_selected(n, 10, "up")
    order, cnt = metrics.rank_tokens(torch.tensor([[1.0, 2.0, 2.0, 0.0]]), torch.tensor([[True, False, False, False]]))
    assert order[0, :3].tolist() == [1, 2, 3] and cnt.tolist() == [3]  # ties: earlier position first


def test_delete_tokens_repads():
    ids = torch.tensor([[CLS, 5, 6, SEP, PAD], [CLS, 9, 8, 7, SEP]])
    mask = (ids != PAD).long()
    keep = torch.tensor([[True, False, True, True, True], [True, True, False, False, True]])
    new, m = metrics.delete_tokens(ids, mask, keep, PAD)
    assert new.tolist() == [[CLS, 6, SEP], [CLS, 9, SEP]]
    assert m.tolist() == [[1, 1, 1], [1, 1, 1]]


# ---------------------------------------------------------------------- spearman
def test_spearman_perfect_reversed_ties_constant():
    import scipy.stats as scipy_stats  # a dependency of the package: never skipped
    ref = torch.tensor([[0.1, 0.5, 0.3, 0.9, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    assert metrics.spearman_per_example(ref * 3 + 1, ref, mask).item() == pytest.approx(1.0)
    assert metrics.spearman_per_example(-ref, ref, mask).item() == pytest.approx(-1.0)
    assert math.isnan(metrics.spearman_per_example(torch.ones(1, 5), ref, mask).item())
    x = torch.tensor([[1.0, 2.0, 2.0, 3.0, 1.0, 7.0]])
    y = torch.tensor([[0.5, 0.1, 0.9, 0.9, 0.2, 0.0]])
    ours = metrics.spearman_per_example(x, y, torch.ones(1, 6)).item()
    assert ours == pytest.approx(scipy_stats.spearmanr(x[0], y[0]).statistic, abs=1e-12)
    # pads are excluded: a huge pad value changes nothing
    x2 = torch.cat([x, torch.tensor([[100.0]])], 1)
    y2 = torch.cat([y, torch.tensor([[-100.0]])], 1)
    m2 = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    assert metrics.spearman_per_example(x2, y2, m2).item() == pytest.approx(ours, abs=1e-12)


# ------------------------------------------------------------------------ ERASER
def test_eraser_perfect_and_reversed_ranking_give_extreme_values():
    clf = one_token_clf()
    ks = (0, 1, 5, 10, 20, 50)  # ceil: 0, 1, 1, 1, 1, 2 of the 4 non-special tokens
    sp = clf.special_mask(IDS, MASK_)
    good = metrics.eraser_aopc(clf.logits, IDS, MASK_, PERFECT, sp, percents=ks)
    assert good["target"].tolist() == [1]
    assert good["comprehensiveness_per_k"][0].tolist() == pytest.approx([0, D, D, D, D, D], abs=1e-12)
    assert good["sufficiency_per_k"][0].tolist() == pytest.approx([D, 0, 0, 0, 0, 0], abs=1e-12)
    assert good["comprehensiveness"].item() == pytest.approx(5 * D / 6, abs=1e-12)
    assert good["sufficiency"].item() == pytest.approx(D / 6, abs=1e-12)
    bad = metrics.eraser_aopc(clf.logits, IDS, MASK_, REVERSED, sp, percents=ks)
    assert bad["comprehensiveness"].item() == pytest.approx(0.0, abs=1e-12)
    assert bad["sufficiency"].item() == pytest.approx(D, abs=1e-12)
    # any other ranking lies between
    mid = metrics.eraser_aopc(clf.logits, IDS, MASK_, torch.tensor([[0, 0.9, 0.8, 0.1, 0.2, 0]]), sp, percents=ks)
    assert bad["comprehensiveness"] <= mid["comprehensiveness"] <= good["comprehensiveness"]
    assert good["sufficiency"] <= mid["sufficiency"] <= bad["sufficiency"]


def test_eraser_batch_with_padding_equals_single():
    clf = one_token_clf()
    ids = torch.tensor([[CLS, 5, KEY, 6, 8, SEP], [CLS, KEY, 9, SEP, PAD, PAD]])
    mask = (ids != PAD).long()
    sc = torch.tensor([[0, 0.3, 1.0, 0.2, 0.1, 0], [0, 0.0, 1.0, 0, 7.0, 7.0]])  # pads' scores ignored
    both = metrics.eraser_aopc(clf.logits, ids, mask, sc, clf.special_mask(ids, mask))
    for b in range(2):
        i, m = metrics._trim(ids[b : b + 1], mask[b : b + 1])
        one = metrics.eraser_aopc(clf.logits, i, m, sc[b : b + 1, : i.shape[1]], clf.special_mask(i, m))
        assert one["comprehensiveness"].item() == pytest.approx(both["comprehensiveness"][b].item(), abs=1e-12)
        assert one["sufficiency"].item() == pytest.approx(both["sufficiency"][b].item(), abs=1e-12)


# -------------------------------------------------------------------------- DecompX
def test_mask_aopc_perfect_and_reversed():
    clf = one_token_clf()
    sp = clf.special_mask(IDS, MASK_)
    gold = torch.tensor([1])
    good = metrics.mask_aopc(clf.logits, IDS, MASK_, PERFECT, sp, gold, mask_token_id=MASK)
    assert good["aopc"].item() == pytest.approx(D, abs=1e-12)
    assert good["accuracy"].item() == 0.0
    # reversed: KEY masked only when all 4 tokens are (K = 80, 90 with ceil)
    bad = metrics.mask_aopc(clf.logits, IDS, MASK_, REVERSED, sp, gold, mask_token_id=MASK)
    assert bad["aopc"].item() == pytest.approx(2 * D / 9, abs=1e-12)
    assert bad["accuracy"].item() == pytest.approx(7 / 9, abs=1e-12)
    assert bad["accuracy_per_k"][0].tolist() == [1, 1, 1, 1, 1, 1, 1, 0, 0]
    no_labels = metrics.mask_aopc(clf.logits, IDS, MASK_, PERFECT, sp, None, mask_token_id=MASK)
    assert "accuracy" not in no_labels


# --------------------------------------------------------------- Captum metrics
def test_infidelity_zero_for_exact_linear_scores():
    clf = one_token_clf()
    sp = clf.special_mask(IDS, MASK_)
    exact = torch.tensor([[0.0, 0.0, STRENGTH, 0.0, 0.0, 0.0]], dtype=torch.float64)
    tgt = torch.tensor([1])
    for normalize in (False, True):
        v = metrics.token_presence_infidelity(
            clf.logits_from_embeds, clf.embed, IDS, MASK_, exact, sp, tgt,
            replacement_id=MASK, n_perturb_samples=20, normalize=normalize,
        )
        assert v.item() == pytest.approx(0.0, abs=1e-20)
    # normalize=True: scale does not matter
    v = metrics.token_presence_infidelity(
        clf.logits_from_embeds, clf.embed, IDS, MASK_, exact * 1e-3, sp, tgt, replacement_id=MASK, n_perturb_samples=20
    )
    assert v.item() == pytest.approx(0.0, abs=1e-20)
    wrong = torch.tensor([[0.0, STRENGTH, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    v = metrics.token_presence_infidelity(
        clf.logits_from_embeds, clf.embed, IDS, MASK_, wrong, sp, tgt, replacement_id=MASK, n_perturb_samples=20
    )
    assert v.item() > 0.1


def test_sensitivity_max_constant_and_hand_computed():
    ids = torch.tensor([[CLS, 5, 6, SEP]])
    mask = torch.ones_like(ids)
    sp = torch.tensor([[True, False, False, True]])
    const = lambda i, m, t: torch.ones(i.shape, dtype=torch.float64)  # noqa: E731
    v = metrics.token_substitution_sensitivity(const, ids, mask, sp, torch.tensor([0]), replacement_id=MASK)
    assert v.item() == 0.0
    # scores = the token ids: replacing 6 by MASK=3 moves the norm by 3, replacing 5 by 2
    by_id = lambda i, m, t: i.double()  # noqa: E731
    v = metrics.token_substitution_sensitivity(
        by_id, ids, mask, sp, torch.tensor([0]), replacement_id=MASK, n_perturb_samples=20
    )
    assert v.item() == pytest.approx(3 / math.sqrt(1 + 25 + 36 + 4), abs=1e-12)
    # special tokens are never substituted: with no ordinary token nothing changes
    v = metrics.token_substitution_sensitivity(
        by_id, ids[:, [0, 3]], mask[:, :2], sp[:, [0, 3]], torch.tensor([0]), replacement_id=MASK
    )
    assert v.item() == 0.0


def test_metric_input_errors():
    clf = one_token_clf()
    sp = clf.special_mask(IDS, MASK_)
    with pytest.raises(ValueError, match="token scores of shape"):
        metrics.eraser_aopc(clf.logits, IDS, MASK_, torch.ones(1, 6, 3), sp)
    with pytest.raises(TypeError, match="integer"):
        metrics.eraser_aopc(clf.logits, IDS.double(), MASK_, PERFECT, sp)
    with pytest.raises(ValueError, match="NaN"):
        metrics.eraser_aopc(clf.logits, IDS, MASK_, PERFECT * float("nan"), sp)
    with pytest.raises(ValueError, match="percent"):
        metrics.mask_aopc(clf.logits, IDS, MASK_, PERFECT, sp, None, mask_token_id=MASK, percents=[0, 50])
    with pytest.raises(ValueError, match="attention_mask"):
        metrics.eraser_aopc(clf.logits, IDS, MASK_[:, :3], PERFECT, sp)


# ------------------------------------------------------------ tiny random BERT
def tiny_bert(seed: int = 0, num_labels: int = 2):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, num_labels=num_labels, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=PAD,
    )
    model = BertForSequenceClassification(cfg).double().eval()
    with torch.no_grad():  # biases and LayerNorm parameters away from 0 and 1
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif "LayerNorm.weight" in name:
                p.mul_(1 + 0.2 * torch.randn_like(p))
            else:
                p.mul_(5.0)  # sharper predictions than the 0.02 init
    return model


def tiny_batch(n: int = 6, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (n,), generator=g)
    T = int(lengths.max()) + 2
    ids = torch.full((n, T), PAD)
    for b, L in enumerate(lengths.tolist()):
        ids[b, 0] = CLS
        ids[b, 1 : L + 1] = torch.randint(4, 40, (L,), generator=g)
        ids[b, L + 1] = SEP
    mask = (ids != PAD).long()
    labels = torch.randint(0, 2, (n,), generator=g)
    return ids, mask, labels


def tiny_clf(model):
    return SequenceClassifier(model, special_token_ids=[PAD, CLS, SEP], mask_token_id=MASK, pad_token_id=PAD)


@pytest.fixture(scope="module")
def tiny():
    model = tiny_bert()
    clf = tiny_clf(model)
    ids, mask, labels = tiny_batch()
    return model, clf, ids, mask, labels


def test_baselines_shapes_pads_and_padding_invariance(tiny):
    model, clf, ids, mask, labels = tiny
    methods = baselines.default_baselines(clf, ig_steps=8) + [
        baselines.integrated_gradients(clf, 8, "sum", baseline="zero"),
        baselines.integrated_gradients(clf, 8, "l2", layer="embeddings", baseline="mask"),
        baselines.saliency(clf, "sum"),
    ]
    assert len({m.name for m in methods}) == len(methods)
    for m in methods:
        s = m(ids, mask, labels)
        assert s.shape == ids.shape and s.dtype == torch.float64
        assert (s[mask == 0] == 0).all()
        b = int(torch.argmin(mask.sum(1)))  # the shortest example, alone and unpadded
        i, mk = metrics._trim(ids[b : b + 1], mask[b : b + 1])
        alone = m(i, mk, labels[b : b + 1])
        torch.testing.assert_close(alone[0], s[b, : i.shape[1]], rtol=1e-7, atol=1e-9)
    # works under no_grad (the metrics call methods that way)
    with torch.no_grad():
        assert methods[0](ids, mask, labels).shape == ids.shape
    # the model is unchanged: no hooks left, same outputs
    assert all(not mod._forward_hooks for mod in model.modules())


def test_ig_sum_completeness(tiny):
    model, clf, ids, mask, labels = tiny
    ig = baselines.integrated_gradients(clf, 64, "sum")
    s = ig(ids, mask, labels)
    ref = torch.where(clf.special_mask(ids, mask), ids, torch.full_like(ids, PAD))
    with torch.no_grad():
        f = clf.logits(ids, mask).gather(1, labels[:, None])[:, 0]
        f0 = clf.logits(ref, mask).gather(1, labels[:, None])[:, 0]
    torch.testing.assert_close(s.sum(1), f - f0, rtol=1e-4, atol=1e-6)


def test_shared_ig_reductions_equal_separate_ones(tiny):
    model, clf, ids, mask, labels = tiny
    ig_sum, ig_l2 = baselines.integrated_gradients(clf, 6, ("sum", "l2"))
    torch.testing.assert_close(ig_sum(ids, mask, labels), baselines.integrated_gradients(clf, 6, "sum")(ids, mask, labels))
    torch.testing.assert_close(ig_l2(ids, mask, labels), baselines.integrated_gradients(clf, 6, "l2")(ids, mask, labels))
    res = FaithfulnessHarness(clf, [ig_sum, ig_l2], ["eraser_aopc"], progress=False).run(ids, mask, labels)
    assert res.seconds_per_example[ig_sum.name] == res.seconds_per_example[ig_l2.name] > 0


def test_harness_end_to_end(tiny, tmp_path):
    model, clf, ids, mask, labels = tiny
    gxi = baselines.gradient_x_input_embedding_output(clf)
    rnd = Method("random", lambda i, m, t: torch.rand(i.shape, generator=torch.Generator().manual_seed(0),
                                                      dtype=torch.float64), uses_target=False)
    methods = [gxi, baselines.input_x_gradient(clf, "sum"), baselines.integrated_gradients(clf, 6), rnd]
    presets = [
        SpearmanGradXInput(), EraserAOPC(), DecompXMaskAOPC(),
        CaptumInfidelity(n_perturb_samples=4), CaptumSensitivity(n_perturb_samples=2, max_examples=3),
    ]
    h = FaithfulnessHarness(clf, methods, presets, batch_size=4, progress=False)
    res = h.run(ids, mask, labels)
    summ = res.summary()
    n = ids.shape[0]
    # GxI on the embedding output (gold target) is the Spearman reference itself
    assert summ[gxi.name]["spearman"]["mean"] == pytest.approx(1.0)
    for m in res.methods:
        for key in ("eraser_comp", "eraser_suff", "mask_aopc", "mask_acc", "infidelity"):
            assert summ[m][key]["n"] == n, (m, key)
        assert summ[m]["sensitivity_max"]["n"] == 3
        assert all(math.isnan(v) for v in res.per_example[m]["sensitivity_max"][3:])
        assert res.seconds_per_example[m] > 0
        assert 0 <= summ[m]["mask_acc"]["mean"] <= 1
    assert res.forward_seconds_per_example > 0 and res.cost_vs_forward(gxi.name) > 0
    with torch.no_grad():
        acc = (clf.logits(ids, mask).argmax(-1) == labels).double().mean().item()
    assert res.accuracy == pytest.approx(acc)
    table = res.table()
    assert all(m in table for m in res.methods) and "× forward" in table and "ERASER comp." in table
    path = tmp_path / "res.json"
    res.to_json(str(path))
    back = HarnessResult.from_json(str(path))
    assert back.methods == res.methods and back.summary()[gxi.name]["spearman"]["mean"] == pytest.approx(1.0)
    assert json.loads(path.read_text())["presets"]["eraser_aopc"]["percents"] == [0, 1, 5, 10, 20, 50]
    assert back.table() == table


def test_harness_batch_composition_does_not_change_deterministic_metrics(tiny):
    model, clf, ids, mask, labels = tiny
    methods = [baselines.input_x_gradient(clf, "l2"), baselines.saliency(clf)]
    presets = ["globenc_spearman", "eraser_aopc", "decompx_mask"]
    a = FaithfulnessHarness(clf, methods, presets, batch_size=len(ids), progress=False, sort_by_length=False).run(
        ids, mask, labels)
    b = FaithfulnessHarness(clf, methods, presets, batch_size=1, progress=False).run(ids, mask, labels)
    for m in a.methods:
        for key, vals in a.per_example[m].items():
            assert vals == pytest.approx(b.per_example[m][key], abs=1e-9, nan_ok=True), (m, key)


def test_harness_gold_target_recomputed_only_where_prediction_differs(tiny):
    model, clf, ids, mask, labels = tiny
    calls = []

    def fn(i, m, t):
        calls.append(t.clone())
        return t.double()[:, None].expand(i.shape) + torch.arange(i.shape[1], dtype=torch.float64)

    with torch.no_grad():
        pred = clf.logits(ids, mask).argmax(-1)
    h = FaithfulnessHarness(clf, [Method("t", fn)], ["globenc_spearman"], batch_size=len(ids), progress=False,
                            warmup=False, sort_by_length=False)
    h.run(ids, mask, labels)
    assert torch.equal(calls[0], pred)
    wrong = labels != pred
    if wrong.any():
        assert len(calls) == 2 and torch.equal(calls[1], labels[wrong])
    else:  # pragma: no cover - depends on the random model
        assert len(calls) == 1


def test_harness_errors(tiny):
    model, clf, ids, mask, labels = tiny
    m = baselines.saliency(clf)
    with pytest.raises(ValueError, match="unique"):
        FaithfulnessHarness(clf, [m, m], progress=False)
    with pytest.raises(ValueError, match="unknown preset"):
        FaithfulnessHarness(clf, [m], ["nope"], progress=False)
    with pytest.raises(ValueError, match="at least one"):
        FaithfulnessHarness(clf, [], progress=False)
    bad = Method("bad", lambda i, mk, t: torch.ones(i.shape[0], i.shape[1], 2))
    with pytest.raises(ValueError, match="token scores of shape"):
        FaithfulnessHarness(clf, [bad], ["eraser_aopc"], progress=False).run(ids, mask, labels)
    with pytest.raises(ValueError, match="labels"):
        FaithfulnessHarness(clf, [m], ["eraser_aopc"], progress=False).run(ids, mask, labels[:2])
    with pytest.raises(ValueError, match="reduction"):
        baselines.saliency(clf, "max")
    with pytest.raises(TypeError):
        SequenceClassifier("not a model")
    assert [p.name for p in make_presets("all")] == [
        "globenc_spearman", "eraser_aopc", "decompx_mask", "captum_infidelity", "captum_sensitivity"]


def test_methods_from_mapping_and_labels_none(tiny):
    model, clf, ids, mask, labels = tiny
    h = FaithfulnessHarness(clf, {"ixg": baselines.input_x_gradient(clf).fn}, ["decompx_mask"], progress=False)
    res = h.run(ids, mask, None)
    assert math.isnan(res.accuracy)
    assert res.summary()["ixg"]["mask_acc"]["n"] == 0 and res.summary()["ixg"]["mask_aopc"]["n"] == len(ids)


def test_our_methods_in_harness(tiny):
    r"""GlobEnc and ALTI through the adapters."""
    model, clf, ids, mask, labels = tiny
    methods = [baselines.globenc(model, "N_ENC"), baselines.globenc(model, "N"), baselines.alti(model)]
    for m in methods:
        s = m(ids, mask, labels)
        assert s.shape == ids.shape and (s[mask == 0] == 0).all()
        assert not m.uses_target
    res = FaithfulnessHarness(clf, methods, ["globenc_spearman", "eraser_aopc"], batch_size=4, progress=False).run(
        ids, mask, labels)
    assert all(res.summary()[m]["eraser_comp"]["n"] == len(ids) for m in res.methods)


def test_our_methods_come_from_the_registry(tiny):
    r"""Our methods are the registry's: one per encoder entry, ``uses_target`` as declared."""
    from captum_normattr import DecompXAttribution, FFIntegratedDecomposition
    from captum_normattr.attr.methods import METHODS

    model, clf, ids, mask, labels = tiny
    ours = baselines.our_methods(model)
    expected = [k for k, s in METHODS.items() if s.cls is not None and s.applies_to("encoders")]
    assert expected == ["globenc", "alti", "ff", "decompx", "value-zeroing"]  # alti-logit is for causal LMs
    assert [m.name for m in ours] == ["GlobEnc (N_ENC)", "ALTI", "GlobEnc+FF", "DecompX", "Value Zeroing"]
    assert [m.uses_target for m in ours] == [METHODS[k].uses_target for k in expected]
    ff = baselines.ff(model, contribution="alti")
    assert ff.name == "ALTI+FF" and not ff.uses_target
    direct = FFIntegratedDecomposition(model, contribution="alti").attribute(ids, additional_forward_args=(mask,))
    torch.testing.assert_close(ff(ids, mask, labels), direct)
    # a wrapped instance takes uses_target from the registry entry of its class
    assert baselines.normattr_method(DecompXAttribution(model)).uses_target
    assert not baselines.normattr_method(FFIntegratedDecomposition(model)).uses_target
    with pytest.raises(ValueError, match="available: globenc"):
        baselines.ours(model, "nosuch")


def test_baseline_values_against_plain_autograd(tiny):
    r"""Every gradient baseline equals its definition computed here with plain autograd, per example."""
    from captum_normattr import ALTIAttribution, DecompXAttribution, GlobEncAttribution

    model, clf, ids, mask, labels = tiny
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    logit = model(inputs_embeds=emb, attention_mask=mask).logits.gather(1, labels[:, None]).sum()
    (g,) = torch.autograd.grad(logit, emb)
    captured = {}
    handle = model.bert.embeddings.register_forward_hook(lambda mod, a, out: captured.setdefault("e", out))
    logit = model(input_ids=ids, attention_mask=mask).logits.gather(1, labels[:, None]).sum()
    handle.remove()
    (ge,) = torch.autograd.grad(logit, captured["e"])
    real = mask.bool()
    expect = {
        "saliency_l2": g.norm(dim=-1),
        "saliency_sum": g.abs().sum(-1),
        "ixg_l2": (emb * g).norm(dim=-1),
        "ixg_sum": (emb * g).sum(-1),
        "gxi_l2": (captured["e"] * ge).norm(dim=-1),
    }
    got = {
        "saliency_l2": baselines.saliency(clf, "l2"),
        "saliency_sum": baselines.saliency(clf, "sum"),
        "ixg_l2": baselines.input_x_gradient(clf, "l2"),
        "ixg_sum": baselines.input_x_gradient(clf, "sum"),
        "gxi_l2": baselines.gradient_x_input_embedding_output(clf, "l2"),
    }
    for name, method in got.items():
        s = method(ids, mask, labels)
        torch.testing.assert_close(s, (expect[name] * real).detach(), rtol=1e-9, atol=1e-12, msg=name)
    # our methods through the adapters are the classes' own scores
    torch.testing.assert_close(baselines.globenc(model, "N")(ids, mask, labels),
                               GlobEncAttribution(model, "N").attribute(ids, additional_forward_args=(mask,)))
    torch.testing.assert_close(baselines.alti(model)(ids, mask, labels),
                               ALTIAttribution(model).attribute(ids, additional_forward_args=(mask,)))
    dx = DecompXAttribution(model).attribute(ids, target=labels, additional_forward_args=(mask,))
    torch.testing.assert_close(baselines.decompx(model)(ids, mask, labels), dx * real)
