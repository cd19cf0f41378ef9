r"""ALTI-Logit: token terms + no-token terms = the model's real logit; a naive reference; Captum contract."""
import numpy as np
import pytest
from layer_capture import capture_layers
import torch

from captum_normattr import ALTILogitAttribution

from conftest import make_model
from decoder_models import DECODER_FAMILIES, decoder_batch, make_decoder
from reference import naive_parts


def real_logits(model, ids, mask):
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits


@pytest.mark.parametrize("family", DECODER_FAMILIES)
@pytest.mark.parametrize("tied", [True, False])
def test_sums_to_real_logit(family, tied):
    model = make_decoder(family, tied=tied)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
    ids, mask = decoder_batch([6, 4], seed=1)
    logits = real_logits(model, ids, mask)  # a plain sdpa forward, independent of the recording
    al = ALTILogitAttribution(model)
    t = torch.tensor([3, 7])
    res = al.decompose(ids, t, mask)
    expect = logits[[0, 1], [5, 5], t]
    total = res.scores.sum(-1) + res.no_token_total
    assert (total - expect).abs().max() < 1e-8
    assert (res.logit - expect).abs().max() < 1e-10 and res.delta.abs().max() < 1e-10
    # (target, foil) and another explained position: the 4th real token (example 1 is left-padded by 2)
    al2 = ALTILogitAttribution(model, explained_position=3)
    res2 = al2.decompose(ids, t, mask, foil=11)
    assert res2.explained_position.tolist() == [3, 5]
    expect2 = logits[[0, 1], [3, 5], t] - logits[[0, 1], [3, 5], 11]
    assert (res2.scores.sum(-1) + res2.no_token_total - expect2).abs().max() < 1e-8
    assert (res2.scores[0, 4:] == 0).all()  # later tokens contribute nothing
    assert (res2.scores[1, :2] == 0).all()  # pads
    # rows of the rollout sum to 1: per layer, tokens receive exactly the layer's attention logit
    lt = res.layer_token_contributions.sum(-1)
    assert torch.allclose(lt, res.layer_logit_updates.sum(-1), atol=1e-12)
    if family == "gpt2":
        assert (res.final_bias != 0).all() and (res.attention_bias != 0).all()


def _naive(model, ids, target):
    r"""Everything explicit, one example, no padding: parts vector by vector, ALTI maps from them."""
    layers, (fp, f_in, f_out) = capture_layers(model, ids, with_final=True)
    i = ids.shape[1] - 1
    u = model.lm_head.weight[target].detach()
    x = f_in[0, i]
    if fp.kind == "rmsnorm":
        norm = lambda v: fp.weight * v / torch.sqrt(x.pow(2).mean() + fp.eps)
    else:
        norm = lambda v: fp.weight * (v - v.mean()) / torch.sqrt(x.var(unbiased=False) + fp.eps)
    t = ids.shape[1]
    rollout = torch.eye(t, dtype=torch.float64)
    scores = torch.zeros(t, dtype=torch.float64)
    for layer in layers:
        parts = naive_parts(layer)
        attn_i = parts["N"][0, i]  # (T, D): attention part of j at i
        logit_j = torch.stack([u @ norm(attn_i[j]) for j in range(t)])
        scores = scores + logit_j @ rollout
        y = layer.ln2_in[0]
        res = parts["N_RES"][0]
        c = (y.abs().sum(-1)[:, None] - (y[:, None] - res).abs().sum(-1)).clamp_min(0)
        rollout = (c / c.sum(-1, keepdim=True)) @ rollout
    return scores


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_naive_reference(family):
    model = make_decoder(family, layers=3)
    ids, _ = decoder_batch([5], seed=2)
    got = ALTILogitAttribution(model).attribute(ids, target=9)
    assert torch.allclose(got[0], _naive(model, ids, 9), atol=1e-10)


def test_authentic_rmsnorm_delta():
    r"""HF's RMSNorm computes in float32 inside a float64 model: delta is that rounding, reported, not hidden."""
    model = make_decoder("llama", exact_norms=False)
    ids, mask = decoder_batch([6, 4], seed=3)
    scores, delta = ALTILogitAttribution(model).attribute(ids, 4, mask, return_convergence_delta=True)
    logit = real_logits(model, ids, mask)[:, -1, 4]
    assert delta.abs().max() < 1e-5 * logit.abs().max()
    assert torch.isfinite(scores).all()


def test_bare_model_and_unembedding():
    lm = make_decoder("llama", tied=False)
    ids, mask = decoder_batch([6, 3], seed=4)
    ref = ALTILogitAttribution(lm).attribute(ids, 2, mask)
    bare = lm.model
    with pytest.raises(ValueError, match="LM head"):
        ALTILogitAttribution(bare)
    got = ALTILogitAttribution(bare, unembedding=lm.lm_head.weight).attribute(ids, 2, mask)
    assert torch.allclose(got, ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match="unembedding"):
        ALTILogitAttribution(bare, unembedding=torch.zeros(5, 3))


def test_contract_and_errors():
    model = make_decoder("gpt2")
    ids, mask = decoder_batch([6, 4], seed=5)
    al = ALTILogitAttribution(model)
    assert al.get_name() == "ALTI-Logit" and al.has_convergence_delta()
    assert hasattr(ALTILogitAttribution.attribute, "__wrapped__")
    s = al.attribute(ids, target=torch.tensor([1, 2]), additional_forward_args=(mask,))
    assert s.shape == ids.shape
    tup, delta = al.attribute((ids,), target=[1, 2], additional_forward_args=mask, return_convergence_delta=True)
    assert isinstance(tup, tuple) and torch.equal(tup[0], s) and delta.shape == (2,)
    pair = al.attribute(ids, target=torch.tensor([1, 2]), foil=[3, 3], additional_forward_args=mask)
    assert torch.allclose(pair, al.attribute(ids, target=[1, 2], foil=np.int64(3), additional_forward_args=mask))
    assert torch.allclose(pair, al.attribute(ids, target=np.array([1, 2]), foil=torch.tensor(3), additional_forward_args=mask))
    for old in ((torch.tensor([1, 2]), 3), (1, 3)):  # the old contrast form: a clear error naming foil=
        with pytest.raises(ValueError, match="foil="):
            al.attribute(ids, target=old, additional_forward_args=mask)
    with pytest.raises(ValueError, match="foil=t"):  # the old (B, 2) rows
        al.attribute(ids, target=torch.tensor([[1, 3], [2, 3]]), additional_forward_args=mask)
    with torch.no_grad():
        assert torch.equal(al.attribute(ids, 1, mask), al.attribute(ids, torch.tensor(1), mask))
    # no target: the model's own prediction at the explained (last real) position
    logits = real_logits(model, ids, mask)
    res_default = al.decompose(ids, None, mask)
    last = mask.shape[1] - 1 - mask.flip(-1).argmax(-1)  # last real token (left or right padding)
    assert torch.equal(res_default.explained_position, last)
    predicted = logits[torch.arange(2), last].argmax(-1)
    assert torch.equal(res_default.target, predicted)
    assert torch.equal(al.attribute(ids, additional_forward_args=mask), al.attribute(ids, predicted, mask))
    with pytest.raises(ValueError, match="token ids must lie"):
        al.attribute(ids, target=999)
    with pytest.raises(ValueError, match="bidirectional encoder.*DecompXAttribution"):
        ALTILogitAttribution(make_model("bert"))  # the post-LN kind does not decompose ALTI-Logit
    res = al.decompose(ids, 1, mask)
    assert res.layer_logit_updates.shape == (2, 2, 6) and res.ff.shape == (2, 2)
    assert (res.extras["completeness_error"] < 1e-10).all()
