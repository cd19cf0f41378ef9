r"""AttnLRP on BERT sequence classifiers (competitors.attnlrp_classifier) on tiny float64 BERTs.

lxt is optional and benchmark-only: every test here skips without it, naming the install.
"""
import pytest
import torch

from captum_normattr.evaluation.competitors import (
    LXT_INSTALL,
    attnlrp_classifier,
    bert_attnlrp_map,
    lxt_available,
    lxt_patched,
)
from conftest import make_model, random_batch

pytestmark = pytest.mark.skipif(not lxt_available(), reason="AttnLRP needs lxt, which is not installed: " + LXT_INSTALL)

LENGTHS = [7, 5, 3]
TARGET = torch.tensor([1, 0, 1])


def close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    scale = max(float(a.abs().max()), float(b.abs().max()), 1e-300)
    return float((a.double() - b.double()).abs().max()) <= rel * scale


def logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def grad_x_input(model, ids, mask, target):
    x = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    chosen = model(inputs_embeds=x, attention_mask=mask).logits.gather(1, target[:, None]).sum()
    (g,) = torch.autograd.grad(chosen, x)
    return (x * g).sum(-1).detach()


def patched_state(model):
    r"""Everything the BERT patch map touches: the functions and methods that must come back."""
    import transformers.models.bert.modeling_bert as mb

    return (torch.nn.LayerNorm.forward, torch.nn.Dropout.forward, mb.eager_attention_forward,
            mb.BertIntermediate.forward, mb.BertPooler.forward, mb.BertPredictionHeadTransform.forward,
            {k: mb.ALL_ATTENTION_FUNCTIONS[k] for k in list(mb.ALL_ATTENTION_FUNCTIONS)})


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_runs_shape_finite_and_patch_undone(attn):
    model = make_model("bert", attn=attn)
    ids, mask = random_batch(LENGTHS)
    before_state = patched_state(model)
    before_logits, before_gxi = logits(model, ids, mask), grad_x_input(model, ids, mask, TARGET)
    method = attnlrp_classifier(model)
    assert (method.name, method.uses_target) == ("AttnLRP", True)
    assert method.info["lxt_commit"] and "bert_attnlrp_map" in method.info["patch"]
    scores = method(ids, mask, TARGET)
    assert scores.shape == ids.shape and scores.dtype == torch.float64
    assert torch.isfinite(scores).all() and bool((scores[mask.bool()] != 0).all())
    assert bool((scores[~mask.bool()] == 0).all())
    # the model computes exactly what it computed before: values and plain gradients
    assert patched_state(model) == before_state
    assert torch.equal(logits(model, ids, mask), before_logits)
    assert torch.equal(grad_x_input(model, ids, mask, TARGET), before_gxi)
    # the patch changed the gradients (it is not gradient x input in disguise)
    assert not close(scores, before_gxi, 1e-3)


def test_patched_forward_computes_the_same_values():
    model = make_model("bert")
    ids, mask = random_batch(LENGTHS)
    ref = logits(model, ids, mask)
    with lxt_patched(model, bert_attnlrp_map()):
        got = logits(model, ids, mask)
    assert close(got, ref, 1e-12)


def test_eager_and_sdpa_agree_and_padding_does_not_change_scores():
    ids, mask = random_batch(LENGTHS)
    sdpa = attnlrp_classifier(make_model("bert", attn="sdpa"))(ids, mask, TARGET)
    eager = attnlrp_classifier(make_model("bert", attn="eager"))(ids, mask, TARGET)
    assert close(sdpa, eager, 1e-10)
    single = attnlrp_classifier(make_model("bert"))
    for b, n in enumerate(LENGTHS):
        alone = single(ids[b:b + 1, :n], mask[b:b + 1, :n], TARGET[b:b + 1])
        assert close(alone[0], sdpa[b, :n], 1e-10)


def test_conservative_without_layers_biases_and_position_embeddings():
    r"""Embedding LayerNorm -> pooler (tanh) -> classifier: with the identity rules and no bias, sum(R) = logit.

    The sum is exact up to lxt's epsilon: its identity rule scales the gradient by
    f(z) / (z + 1e-10). Plain gradient x input is not conservative here (LayerNorm and tanh are not linear): the
    check sees the identity rules at work on the LayerNorm and on the pooler's tanh.
    """
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=60, hidden_size=24, num_hidden_layers=0, num_attention_heads=4, intermediate_size=40,
                     max_position_embeddings=24, num_labels=2, initializer_range=0.5)
    model = BertForSequenceClassification(cfg).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "position_embeddings" in name or "token_type_embeddings" in name:
                p.zero_()
    ids, mask = random_batch(LENGTHS)
    lg = logits(model, ids, mask).gather(1, TARGET[:, None])[:, 0]
    scores = attnlrp_classifier(model)(ids, mask, TARGET)
    err = float((scores.sum(1) - lg).abs().max() / lg.abs().max())
    assert err <= 1e-8, err  # lxt's identity rule divides by (input + 1e-10): not exact to rounding
    assert not close(grad_x_input(model, ids, mask, TARGET).sum(1), lg, 1e-3)


def test_patch_undone_after_an_error():
    model = make_model("bert")
    ids, mask = random_batch(LENGTHS)
    before = patched_state(model)
    with pytest.raises(RuntimeError):
        attnlrp_classifier(model)(ids, mask, torch.tensor([1, 0, 7]))  # class 7 does not exist: gather fails inside
    assert patched_state(model) == before


def test_refusals():
    model = make_model("roberta")
    with pytest.raises(ValueError, match="modeling_bert"):
        attnlrp_classifier(model)
    ids, mask = random_batch(LENGTHS)
    with pytest.raises(ValueError, match="one class per example"):
        attnlrp_classifier(make_model("bert"))(ids, mask, torch.tensor([1]))
