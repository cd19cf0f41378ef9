r"""Reliability (issue 14): non-finite examples, option validation, positions under left
padding, token types, NaN in the visualisation, the command line's -m / explain / truncation,
and SequenceClassifier's model state."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from captum_normattr import (
    ALTIAttribution,
    ALTILogitAttribution,
    DecompXAttribution,
    FFIntegratedDecomposition,
    GlobEncAttribution,
)
from captum_normattr.evaluation import SequenceClassifier
from captum_normattr.present.captum_interop import normalize_scores
from conftest import make_model, random_batch
from decoder_models import decoder_batch, make_decoder
from cli_models import TEXTS, run, tiny_model  # noqa: F401 (tiny_model is a fixture)

ENCODER = {
    "globenc": lambda m: GlobEncAttribution(m),
    "alti": lambda m: ALTIAttribution(m),
    "ff_norm": lambda m: FFIntegratedDecomposition(m),
    "ff_alti": lambda m: FFIntegratedDecomposition(m, contribution="alti"),
    "ff_riemann": lambda m: FFIntegratedDecomposition(m, method="riemann", steps=4),
    "decompx_adjoint": lambda m: DecompXAttribution(m, algorithm="adjoint"),
    "decompx_forward": lambda m: DecompXAttribution(m, algorithm="forward"),
    "decompx_spread": lambda m: DecompXAttribution(m, bias_mode="spread"),
}
DECODER = dict(
    ENCODER,
    alti_logit=lambda m: ALTILogitAttribution(m),
)
SIGNED = ("decompx", "alti_logit")


def _scores(attr, name, x, mask):
    kw = {"target": 1} if name.startswith(SIGNED) else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return attr.attribute(x, additional_forward_args=(mask,), **kw)


def _model(decoder, family=None):
    return make_decoder(family or "gpt2") if decoder else make_model(family or "bert")


def _batch(decoder):
    return decoder_batch([6, 4], seed=3) if decoder else random_batch([6, 4], seed=3)


# ------------------------------------------------------------------ item 3: non-finite inputs


def _embeds(model, ids):
    return model.get_input_embeddings()(ids).detach().clone()


CASES = [(False, n) for n in sorted(ENCODER)] + [(True, n) for n in sorted(DECODER)]


@pytest.mark.parametrize("how", ["nan_embedding", "inf_inside"])
@pytest.mark.parametrize("decoder,name", CASES, ids=[f"{'gpt2' if d else 'bert'}-{n}" for d, n in CASES])
def test_non_finite_example_gets_nan_scores_and_others_are_unaffected(decoder, how, name):
    table = DECODER if decoder else ENCODER
    model = _model(decoder)
    ids, mask = _batch(decoder)
    e = _embeds(model, ids)
    attr = table[name](model)
    clean = _scores(attr, name, e, mask)
    bad = e.clone()
    handle = None
    if how == "nan_embedding":
        bad[0, 4, 3] = float("nan")  # a real token of example 0 (both batches: example 0 has 6 tokens)
    else:  # a finite input whose forward pass overflows inside layer 1's feed-forward block
        ff = model.transformer.h[1].mlp.c_fc if decoder else model.bert.encoder.layer[1].intermediate.dense

        def overflow(module, args, out):
            out = out.clone()
            out[0, 2, 0] = float("inf")
            return out

        handle = ff.register_forward_hook(overflow)
    try:
        with pytest.warns(RuntimeWarning, match=r"example\(s\) \[0\]"):
            kw = {"target": 1} if name.startswith(SIGNED) else {}
            got = attr.attribute(bad, additional_forward_args=(mask,), **kw)
    finally:
        if handle is not None:
            handle.remove()
    assert torch.isnan(got[0]).all(), f"{name}: finite scores came out of a non-finite example: {got[0]}"
    torch.testing.assert_close(got[1], clean[1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("decoder", [False, True], ids=["bert", "gpt2"])
def test_non_finite_example_decompose_results_are_nan(decoder):
    model = _model(decoder)
    ids, mask = _batch(decoder)
    e = _embeds(model, ids)
    e[0, 4] = float("nan")
    with pytest.warns(RuntimeWarning):
        res = ALTIAttribution(model).decompose(e, additional_forward_args=(mask,))
    for field in (res.scores, res.layer_maps, res.rollout):
        assert torch.isnan(field[0]).all() and torch.isfinite(field[1]).all()
    with pytest.warns(RuntimeWarning):
        ff = FFIntegratedDecomposition(model).decompose(e, additional_forward_args=(mask,))
    assert torch.isnan(ff.delta[0]) and torch.isfinite(ff.delta[1])
    with pytest.warns(RuntimeWarning):
        dx = DecompXAttribution(model, algorithm="forward").decompose(e, target=1, additional_forward_args=(mask,))
    assert torch.isnan(dx.class_scores[0]).all() and torch.isnan(dx.delta[0]) and torch.isfinite(dx.class_scores[1]).all()


def test_finite_inputs_raise_no_warning():
    model = make_model("bert")
    ids, mask = random_batch([6, 4], seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        ALTIAttribution(model).attribute(ids, additional_forward_args=(mask,))


# ------------------------------------------------------------------ item 6: options


BAD_OPTIONS = [
    (FFIntegratedDecomposition, dict(method="riemann", steps=0), "steps"),
    (FFIntegratedDecomposition, dict(method="riemann", steps=-5), "steps"),
    (FFIntegratedDecomposition, dict(steps=2.5), "steps"),
    (FFIntegratedDecomposition, dict(steps=True), "steps"),
    (FFIntegratedDecomposition, dict(nodes=0), "nodes"),
    (FFIntegratedDecomposition, dict(chunk_rows=0), "chunk_rows"),
    (FFIntegratedDecomposition, dict(chunk_rows=1.5), "chunk_rows"),
    (FFIntegratedDecomposition, dict(memory_budget_mb=0), "memory_budget_mb"),
    (FFIntegratedDecomposition, dict(memory_budget_mb=float("nan")), "memory_budget_mb"),
    (FFIntegratedDecomposition, dict(memory_budget_mb=float("inf")), "memory_budget_mb"),
    (FFIntegratedDecomposition, dict(ignore_low_gamma=1.0), "ignore_low_gamma"),
    (FFIntegratedDecomposition, dict(ignore_low_gamma=float("nan")), "ignore_low_gamma"),
    (FFIntegratedDecomposition, dict(ignore_low_gamma=-0.1), "ignore_low_gamma"),
    (ALTIAttribution, dict(memory_budget_mb=-1), "memory_budget_mb"),
    (ALTIAttribution, dict(memory_budget_mb="big"), "memory_budget_mb"),
    (DecompXAttribution, dict(nodes=0), "nodes"),
    (DecompXAttribution, dict(memory_budget_mb=0), "memory_budget_mb"),
    (GlobEncAttribution, dict(explained_position=1.5), "explained_position"),
    (GlobEncAttribution, dict(explained_position=True), "explained_position"),
    (GlobEncAttribution, dict(explained_position="first"), "explained_position"),
    (ALTIAttribution, dict(explained_position=torch.tensor([0.0, 1.0])), "explained_position"),
    (ALTIAttribution, dict(explained_position=torch.tensor([True, False])), "explained_position"),
]


@pytest.mark.parametrize("cls,kwargs,option", BAD_OPTIONS, ids=[f"{c.__name__}-{o}-{i}" for i, (c, _, o) in enumerate(BAD_OPTIONS)])
def test_bad_options_are_refused_at_construction(cls, kwargs, option):
    model = make_decoder("gpt2") if cls is DecompXAttribution and "nodes" in kwargs else make_model("bert")
    with pytest.raises((ValueError, TypeError), match=option):
        cls(model, **kwargs)


def test_bad_options_of_decoder_classes():
    model = make_decoder("llama")
    with pytest.raises(ValueError, match="nodes"):
        FFIntegratedDecomposition(model, nodes=0)
    with pytest.raises(ValueError, match="memory_budget_mb"):
        ALTILogitAttribution(model, memory_budget_mb=0)
    with pytest.raises(TypeError, match="explained_position"):
        ALTILogitAttribution(model, explained_position=2.0)
    with pytest.raises(TypeError, match="explained_position"):
        DecompXAttribution(model, explained_position=-1.0)


def test_riemann_with_one_step_and_integer_like_options_work():
    import numpy as np

    model = make_model("bert")
    ids, mask = random_batch([5, 3], seed=1)
    s = FFIntegratedDecomposition(model, method="riemann", steps=np.int64(1), chunk_rows=np.int32(2)).attribute(
        ids, additional_forward_args=(mask,))
    assert torch.isfinite(s).all() and (s[0] > 0).all()


# ------------------------------------------------------------------ item 7: positions under left padding


POSITION_METHODS = {
    "globenc": lambda m, p: GlobEncAttribution(m, explained_position=p),
    "alti": lambda m, p: ALTIAttribution(m, explained_position=p),
    "ff": lambda m, p: FFIntegratedDecomposition(m, explained_position=p),
    "alti_logit": lambda m, p: ALTILogitAttribution(m, explained_position=p),
    "decompx": lambda m, p: DecompXAttribution(m, explained_position=p),
}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("name", sorted(POSITION_METHODS))
def test_integer_positions_count_from_the_first_real_token(family, name):
    model = make_decoder(family)
    ids, mask = decoder_batch([6, 4], seed=4)  # example 1 is left-padded by 2
    kw = {"target": 5} if name in ("alti_logit", "decompx") else {}
    for p in (1, 3, -2):
        attr = POSITION_METHODS[name](model, p)
        res = attr.decompose(ids, additional_forward_args=(mask,), **kw)
        n = [6, 4]
        expect = [(2 + p if b else p) if p >= 0 else 5 + 1 + p for b in range(2)]
        assert res.explained_position.tolist() == expect
        for b in range(2):  # the same text alone, without padding, gives the same scores
            sl = slice(6 - n[b], 6)
            alone = attr.decompose(ids[b:b + 1, sl], additional_forward_args=(mask[b:b + 1, sl],), **kw)
            torch.testing.assert_close(res.scores[b, sl], alone.scores[0], rtol=1e-9, atol=1e-12)


def test_positions_outside_an_example_and_float_tensors_are_refused():
    model = make_decoder("gpt2")
    ids, mask = decoder_batch([6, 4], seed=4)
    with pytest.raises(ValueError, match=r"explained_position 4 .*first real token.*\[1\].*\[4\]"):
        ALTIAttribution(model, explained_position=4).attribute(ids, additional_forward_args=(mask,))
    with pytest.raises(ValueError, match="last real token"):
        ALTIAttribution(model, explained_position=-5).attribute(ids, additional_forward_args=(mask,))
    with pytest.raises(TypeError, match="integer dtype"):
        ALTIAttribution(model, explained_position=torch.tensor([5.0, 5.9])).attribute(ids, additional_forward_args=(mask,))
    # a (B,) integer tensor is read as positions in the padded tensor (what results return)
    res = ALTIAttribution(model, explained_position=torch.tensor([4, 5])).decompose(ids, additional_forward_args=(mask,))
    assert res.explained_position.tolist() == [4, 5]


# ------------------------------------------------------------------ item 8: small ones


@pytest.mark.parametrize("family,bad", [("bert", 2), ("roberta", -1)])
def test_token_types_out_of_range(family, bad):
    model = make_model(family)
    ids, mask = random_batch([5, 3])
    types = torch.zeros_like(ids)
    types[0, 1] = bad
    with pytest.raises(ValueError, match=r"token_type_ids must lie in \[0, 1\]"):
        GlobEncAttribution(model).attribute(ids, additional_forward_args=(mask, types))
    with pytest.raises(TypeError, match="token_type_ids must be an integer"):
        GlobEncAttribution(model).attribute(ids, additional_forward_args=(mask, types.double()))
    ok = GlobEncAttribution(model).attribute(ids, additional_forward_args=(mask, torch.zeros_like(ids)))
    assert torch.isfinite(ok).all()


def test_normalize_scores_keeps_nan_and_scales_over_finite_values():
    out = normalize_scores([float("nan"), 1.0, 2.0])
    assert math.isnan(out[0]) and out[1:].tolist() == [0.5, 1.0]
    out = normalize_scores([[float("nan"), -4.0, 2.0], [float("inf"), 1.0, 0.0]])
    assert math.isnan(out[0, 0]) and out[0, 1:].tolist() == [-1.0, 0.5]
    assert out[1].tolist() == [1.0, 1.0, 0.0]


def test_sequence_classifier_leaves_training_flags():

    model = make_model("bert")
    model.train()
    model.bert.embeddings.eval()
    before = {n: m.training for n, m in model.named_modules()}
    clf = SequenceClassifier(model)
    ids, mask = random_batch([5, 3])
    a = clf.logits(ids, mask)
    b = clf.logits(ids, mask)  # eval mode inside: dropout off, deterministic
    assert torch.equal(a, b)
    assert clf.logits_from_embeds(clf.embed(ids), mask).shape == a.shape
    assert {n: m.training for n, m in model.named_modules()} == before


# ------------------------------------------------------------------ item 8: the command line


def _texts(out):
    import json

    data = json.loads(out)
    return [r["text"] for r in data["results"]], data["meta"]["methods"]


def test_cli_explain_subcommand(capsys, tiny_model):  # noqa: F811
    code, out, err = run(capsys, "explain", TEXTS[0], "--model", tiny_model, "--format", "json", "-q")
    assert code == 0 and _texts(out) == ([TEXTS[0]], ["globenc"])
    code, out, err = run(capsys, "explain", "explain", "--model", tiny_model, "--format", "json", "-q")
    assert code == 0 and _texts(out)[0] == ["explain"]
    code, out, err = run(capsys, "-m", "alti", "explain", TEXTS[0], "--model", tiny_model, "--format", "json", "-q")
    assert code == 0 and "recognised only as the first argument" in err


@pytest.mark.parametrize("argv", [
    ["-m", "globenc", "alti", "TEXT"],
    ["-m", "globenc,alti", "TEXT"],
    ["-m", "globenc", "-m", "alti", "TEXT"],
    ["TEXT", "-m", "globenc", "alti"],
    ["-m", "globenc", "TEXT", "-m", "alti"],
])
def test_cli_methods_and_text_in_any_order(capsys, tiny_model, argv):  # noqa: F811
    argv = [TEXTS[1] if a == "TEXT" else a for a in argv]
    code, out, err = run(capsys, *argv, "--model", tiny_model, "--format", "json", "-q")
    assert code == 0, err
    assert _texts(out) == ([TEXTS[1]], ["globenc", "alti"])


def test_cli_misspelt_method_is_refused(capsys, tiny_model):  # noqa: F811
    code, out, err = run(capsys, "-m", "globenc", "alit", TEXTS[1], "--model", tiny_model, "-q")
    assert code == 2 and "did you mean 'alti'" in err


def test_cli_warns_when_it_truncates(capsys, tiny_model):  # noqa: F811
    long_text = " ".join(["film"] * 70)  # 72 tokens with [CLS] and [SEP]; the tiny model takes 64
    code, out, err = run(capsys, TEXTS[0], long_text, "--model", tiny_model, "-m", "alti", "--format", "json", "-q")
    assert code == 0
    assert "text 2 has 72 tokens but the limit is 64: its last 8 token(s) were cut" in err
    assert "text 1" not in err
    code, out, err = run(capsys, long_text, "--model", tiny_model, "-m", "alti", "--max-length", "10", "-q")
    assert "its last 62 token(s) were cut" in err


# --- issue 27 items 13 and 17 (engine parts) -----------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int8, torch.uint8, torch.bool, torch.float32])
def test_masks_of_every_integer_dtype_and_bool_accepted(dtype):
    model = make_model("bert")
    ids, mask = random_batch([6, 4])
    expected = GlobEncAttribution(model).attribute(ids, additional_forward_args=(mask,))
    got = GlobEncAttribution(model).attribute(ids.to(torch.int16), additional_forward_args=(mask.to(dtype),))
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="only 0"):
        GlobEncAttribution(model).attribute(ids, additional_forward_args=((2 * mask).to(torch.int16),))


def test_padded_ids_without_a_mask_warn():
    model = make_model("bert")  # pad_token_id 0
    ids, mask = random_batch([6, 4])
    with pytest.warns(UserWarning, match="pad token"):
        GlobEncAttribution(model).attribute(ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GlobEncAttribution(model).attribute(ids, additional_forward_args=(mask,))
        GlobEncAttribution(model).attribute(ids[1:, :4])  # no pad in the ids: no warning


def test_bert_as_decoder_runs_the_decompx_adjoint():
    r"""``is_decoder=True`` makes BERT build a key/value cache by default; the adjoint's rerun of
    a layer then appended to it (scores of 16 keys against a mask of 8). The engine passes
    ``use_cache=False``."""
    from transformers import BertConfig, BertForSequenceClassification

    from conftest import VOCAB, _perturb

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40, vocab_size=VOCAB,
                     max_position_embeddings=24, num_labels=2, is_decoder=True)
    model = _perturb(BertForSequenceClassification(cfg).double().eval(), 0)
    ids, mask = random_batch([8, 6])
    adjoint = DecompXAttribution(model, algorithm="adjoint")
    scores, delta = adjoint.attribute(ids, additional_forward_args=(mask,), return_convergence_delta=True)
    forward = DecompXAttribution(model, algorithm="forward").attribute(ids, additional_forward_args=(mask,))
    scale = float(forward.abs().max())  # tolerances scaled to the scores (other CPUs round differently)
    assert float(delta.abs().max()) < 1e-10 * scale
    torch.testing.assert_close(scores, forward, rtol=0, atol=1e-10 * scale)


def test_overflowed_scores_are_told_apart_from_a_non_finite_forward_pass():
    r"""Scores that leave the dtype's range in the method's own arithmetic inside a layer are NaN
    with a warning that says so and what to do, not one that blames the inputs; a non-finite
    forward pass keeps its own message. (A raw rollout past the range is carried with a power
    of two instead: tests/test_rollout_overflow.py.)"""
    from dataclasses import replace

    from captum_normattr.models.engine import mark_non_finite

    ids, mask = random_batch([6, 4])
    res = GlobEncAttribution(make_model("bert")).decompose(ids, additional_forward_args=(mask,))
    scores = res.scores.clone()
    scores[1, 0] = float("inf")
    with pytest.warns(RuntimeWarning, match=r"example\(s\) \[1\] overflowed.*inside a layer.*float64") as caught:
        out = mark_non_finite(replace(res, scores=scores), torch.tensor([True, True]))
    assert not any("inputs or forward pass" in str(w.message) for w in caught)
    assert torch.isnan(out.scores[1]).all() and torch.isfinite(out.scores[0]).all()
    with pytest.warns(RuntimeWarning, match=r"example\(s\) \[0\] hold NaN or infinite values in their inputs"):
        mark_non_finite(replace(res, scores=scores), torch.tensor([False, True]))
