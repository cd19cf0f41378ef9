r"""Guards on the explained output (issue 23, item 4), each made to fire.

1. The explained logit is compared with the model's own output logit (after every scaling,
   cap or hook of the real forward), not only rebuilt from recorded tensors: a Granite-like
   ``logits / logits_scaling`` raises, a mismatch just beyond rounding warns, a clean model is silent.
2. ALTI-Logit's delta includes every layer's attention-block completeness: an attention
   decomposition that is wrong away from the explained row no longer gives delta ~0.
"""
import dataclasses
import warnings

import pytest
import torch

import captum_normattr.attr.alti_logit as alti_logit_module
from captum_normattr import ALTILogitAttribution, DecompXAttribution
from captum_normattr.attr.explained_output import ExplainedOutputMismatchError, ExplainedOutputMismatchWarning
from conftest import make_model, random_batch
from decoder_models import decoder_batch, make_decoder


def scale_logits(model, factor):
    r"""A forward hook that scales the model's output logits (Granite's logits_scaling, Cohere's logit_scale)."""
    def hook(module, args, output):
        output.logits = output.logits * factor
        return output

    return model.register_forward_hook(hook)


def no_guard_warning():
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("error", ExplainedOutputMismatchWarning)
    return ctx


DECODER_METHODS = [
    ("ALTI-Logit", lambda m: ALTILogitAttribution(m)),
    ("DecompX adjoint", lambda m: DecompXAttribution(m)),
    ("DecompX forward", lambda m: DecompXAttribution(m, algorithm="forward")),
]


@pytest.mark.parametrize("name,make", DECODER_METHODS)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_next_token_logit_is_the_models(family, name, make):
    model = make_decoder(family)
    ids, mask = decoder_batch([6, 4], seed=3)
    attr = make(model)
    ctx = no_guard_warning()
    try:  # a clean model: silent, with and without a foil
        attr.attribute(ids, target=5, additional_forward_args=mask)
        attr.attribute(ids, target=[5, 6], foil=7, additional_forward_args=mask)
    finally:
        ctx.__exit__(None, None, None)
    handle = scale_logits(model, 0.25)  # the model's logits are a quarter of what the head weights give
    try:
        with pytest.raises(ExplainedOutputMismatchError, match="logit scale"):
            attr.attribute(ids, target=5, additional_forward_args=mask)
    finally:
        handle.remove()
    handle = scale_logits(model, 1 + 1e-9)  # far above float64 rounding, far below a change of meaning
    try:
        with pytest.warns(ExplainedOutputMismatchWarning, match="differs from the model's own output"):
            attr.attribute(ids, target=5, foil=7, additional_forward_args=mask)
    finally:
        handle.remove()


def test_explicit_unembedding_has_no_model_logit_to_compare():
    model = make_decoder("llama")
    ids, mask = decoder_batch([5], seed=1)
    handle = scale_logits(model, 0.25)
    try:  # the user's matrix defines the explained logit: nothing to compare, nothing raised
        ALTILogitAttribution(model, unembedding=model.lm_head.weight.detach() * 2).attribute(ids, 3, mask)
    finally:
        handle.remove()


@pytest.mark.parametrize("family", ["bert", "distilbert"])
def test_class_logit_is_the_models(family):
    model = make_model(family)
    ids, mask = random_batch([5, 3])
    dx = DecompXAttribution(model)
    ctx = no_guard_warning()
    try:
        dx.attribute(ids, target=1, additional_forward_args=(mask,))
    finally:
        ctx.__exit__(None, None, None)
    head = model.classifier.out_proj if family == "roberta" else model.classifier
    handle = head.register_forward_hook(lambda m, a, o: o * 2.0)  # a customised head the package does not model
    try:
        with pytest.raises(ExplainedOutputMismatchError, match="class logits"):
            dx.attribute(ids, target=1, additional_forward_args=(mask,))
    finally:
        handle.remove()


def test_alti_logit_delta_carries_attention_completeness(monkeypatch):
    r"""The recorded attention replaced (probabilities and context, consistently) in every row but the
    explained one, as an adapter with the wrong topology would decompose it: the logit terms still add up
    (|logit - reconstruction| ~ 1e-15, the old delta), the ALTI maps below are wrong, delta shows it."""
    model = make_decoder("gpt2")
    ids, mask = decoder_batch([6], seed=2)
    al = ALTILogitAttribution(model)
    clean = al.decompose(ids, 5, mask)
    assert float(clean.delta.max()) < 1e-12 * max(1.0, float(clean.logit.abs().max()))  # scaled: other CPUs round differently
    real_tensors_to = alti_logit_module.tensors_to

    def wrong_attention(layer, device):
        layer = real_tensors_to(layer, device)
        if not hasattr(layer, "probs"):
            return layer
        t = layer.probs.shape[-1]
        uniform = torch.tril(torch.ones(t, t, dtype=layer.probs.dtype))
        uniform /= uniform.sum(-1, keepdim=True)  # causal rows summing to 1: plausible, but not the model's
        probs = layer.probs.clone()
        probs[:, :, :-1] = uniform[:-1]  # every row but the explained (last) one
        context = None if layer.context is None else torch.einsum("bhij,bhjd->bihd", probs, layer.values)
        return dataclasses.replace(layer, probs=probs, context=context)  # parts consistent with each other, not with h

    monkeypatch.setattr(alti_logit_module, "tensors_to", wrong_attention)
    res = al.decompose(ids, 5, mask)
    old_delta = (res.logit - res.scores.sum(-1) - res.no_token_total).abs()
    assert float(old_delta.max()) < 1e-12 * max(1.0, float(res.logit.abs().max()))  # what the delta was before: blind to it
    assert not torch.allclose(res.scores, clean.scores, atol=1e-6)  # the scores did change
    assert float(res.delta.min()) > 1e-3 and float(res.extras["completeness_error"].max()) > 1e-3


def test_many_positions_check_the_most_common_one(monkeypatch):
    r"""Right padding puts the explained positions apart; past the logit budget only the most common
    position's examples are compared (the LM head never runs on B x B rows of a large vocabulary)."""
    import captum_normattr.attr.explained_output as eo

    model = make_decoder("llama")
    ids, mask = decoder_batch([6, 4, 4], seed=5, left=False)  # positions 5, 3, 3
    monkeypatch.setattr(eo, "GUARD_LOGIT_ELEMENTS", 1)
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, a, o: seen.append(tuple(o.shape)))
    handle = scale_logits(model, 0.25)
    try:
        with pytest.raises(ExplainedOutputMismatchError, match=r"example\(s\) \[1, 2\]"):
            ALTILogitAttribution(model).attribute(ids, target=5, additional_forward_args=mask)
    finally:
        handle.remove()
        hook.remove()
    assert seen == [(3, 1, model.config.vocab_size)]
