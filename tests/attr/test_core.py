import pytest
from layer_capture import capture_layers
import torch
from captum.attr import NoiseTunnel

from captum_normattr import ALTIAttribution, GlobEncAttribution, UnsupportedModelError, rollout
from captum_normattr.decompose.kinds.post_ln import post_ln_alti_map, post_ln_layer_maps, post_ln_ln1_parts_sum
from captum_normattr.decompose.primitives.mixing import row_normalize

from conftest import FAMILIES, make_model, random_batch
from reference import naive_alti, naive_fixed_residual, naive_parts, naive_ratio


def capture(model, ids, mask):
    return capture_layers(model, ids, mask)


def test_completeness_ln1_output(tiny_model):
    ids, mask = random_batch([7, 5], seed=1)
    for layer in capture(tiny_model, ids, mask):
        rec = post_ln_ln1_parts_sum(layer)
        assert (rec - layer.ln1_out).abs().max() < 1e-10
        # naive parts + bias part too
        parts = naive_parts(layer)["N_RESLN"].sum(2)
        g, s = layer.ln1.weight, torch.sqrt(layer.ln1_in.var(-1, unbiased=False) + layer.ln1.eps)[..., None]
        bias = g * (layer.out_bias - layer.out_bias.mean()) / s + layer.ln1.bias
        assert (parts + bias - layer.ln1_out).abs().max() < 1e-10


def test_fast_maps_equal_naive(tiny_model):
    ids, mask = random_batch([7, 4], seed=2)
    valid = mask.bool()
    m2 = (valid[:, :, None] & valid[:, None, :]).double()
    for layer in capture(tiny_model, ids, mask):
        maps, ratios = post_ln_layer_maps(layer, valid)
        ref = naive_parts(layer)
        for name in ("N", "N_RES", "N_RESLN", "N_ENC"):
            expect = ref[name].norm(dim=-1) * m2
            assert torch.allclose(maps[name], expect, atol=1e-10, rtol=0), name
            r = naive_ratio(ref[name]) * valid
            assert torch.allclose(ratios[name], r, atol=1e-10), name
        w = layer.probs.mean(1) * m2
        assert torch.allclose(maps["W"], w, atol=1e-12)
        assert torch.allclose(maps["N_FIXEDRES"], naive_fixed_residual(ref["N"].norm(dim=-1) * m2, valid), atol=1e-12)
        eye = torch.eye(7, dtype=torch.bool)
        offw = row_normalize(w.masked_fill(eye, 0))
        r = ratios["N_ENC"][..., None]
        assert torch.allclose(maps["W_RES"], r * offw + (1 - r) * torch.eye(7) * valid[..., None], atol=1e-12)
        assert torch.allclose(maps["W_FIXEDRES"], naive_fixed_residual(w, valid), atol=1e-12)
        for chunk in (None, 1, 3):
            assert torch.allclose(post_ln_alti_map(layer, valid, chunk), naive_alti(layer, valid), atol=1e-10)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["N_ENC", "N_RES", "W_RES", "ALTI"])
def test_padded_batch_equals_single(family, method):
    model = make_model(family)
    attr = ALTIAttribution(model) if method == "ALTI" else GlobEncAttribution(model, method)
    ids, mask = random_batch([8, 5, 3], seed=3)
    res = attr.decompose(ids, additional_forward_args=(mask,))
    for b, n in enumerate([8, 5, 3]):
        single = attr.decompose(ids[b : b + 1, :n], additional_forward_args=(mask[b : b + 1, :n],))
        assert torch.allclose(res.scores[b, :n], single.scores[0], rtol=1e-10, atol=1e-12)
        assert torch.allclose(res.layer_maps[b, :, :n, :n], single.layer_maps[0], rtol=1e-10, atol=1e-12)
        assert (res.scores[b, n:] == 0).all()
        assert (res.layer_maps[b, :, n:, :] == 0).all() and (res.layer_maps[b, :, :, n:] == 0).all()
        ex = res.example(b)
        assert torch.allclose(ex["scores"], single.scores[0], rtol=1e-10, atol=1e-12)
    assert (res.extras["completeness_error"] < 1e-10).all()


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_model_unchanged(attn):
    model = make_model("bert", attn=attn)
    model.train()
    ids, mask = random_batch([6, 4], seed=4)
    model.eval()
    before = model(input_ids=ids, attention_mask=mask).logits
    model.train()
    hooks = _hook_count(model)
    GlobEncAttribution(model).attribute(ids, additional_forward_args=(mask,))
    ALTIAttribution(model).attribute(ids, additional_forward_args=(mask,))
    assert model.training and model.config._attn_implementation == attn
    assert _hook_count(model) == hooks
    model.eval()
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, before)


def test_restored_after_exception():
    model = make_model("bert")
    ids, mask = random_batch([6], seed=5)
    before = model(input_ids=ids, attention_mask=mask).logits
    hooks = _hook_count(model)
    attr = GlobEncAttribution(model)

    def boom(*a, **k):
        raise RuntimeError("boom")

    h = model.bert.encoder.layer[1].output.register_forward_hook(lambda *a: (_ for _ in ()).throw(KeyError("mid")))
    with pytest.raises(KeyError):  # an error inside the forward pass, after layer 0 was decomposed
        attr.attribute(ids, additional_forward_args=mask)
    h.remove()
    assert _hook_count(model) == hooks and model.config._attn_implementation == "sdpa"
    attr.layer_contribution = boom  # an error inside the decomposition of a layer
    with pytest.raises(RuntimeError):
        attr.attribute(ids, additional_forward_args=mask)
    assert _hook_count(model) == hooks and model.config._attn_implementation == "sdpa"
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, before)


def test_clear_errors():
    model = make_model("bert")
    attr = GlobEncAttribution(model)
    ids, mask = random_batch([5], seed=6)
    with pytest.raises(ValueError, match="empty"):
        attr.attribute(ids[:, :0])
    with pytest.raises(ValueError, match="vocabulary"):
        attr.attribute(ids + 1000)
    with pytest.raises(ValueError, match="at most 24"):
        attr.attribute(torch.randint(3, 50, (1, 30)))
    with pytest.raises(ValueError, match="shape"):
        attr.attribute(ids, additional_forward_args=(mask[:, :3],))
    with pytest.raises(TypeError, match="integer"):
        attr.attribute(ids.double())
    with pytest.raises(ValueError, match="no tokens"):
        attr.attribute(ids, additional_forward_args=(torch.zeros_like(mask),))
    with pytest.raises(ValueError, match="map_name"):
        GlobEncAttribution(model, "XYZ")
    from transformers import MambaConfig, MambaModel

    other = MambaModel(MambaConfig(hidden_size=16, num_hidden_layers=1, vocab_size=20, state_size=4))
    with pytest.raises(UnsupportedModelError, match="not an attention model.*BERT.*RoBERTa.*ELECTRA.*DistilBERT"):
        GlobEncAttribution(other)


def test_captum_contract():
    model = make_model("bert")
    attr = GlobEncAttribution(model)
    ids, mask = random_batch([6, 4], seed=7)
    out = attr.attribute(ids, additional_forward_args=(mask,))
    assert out.shape == ids.shape
    tup = attr.attribute((ids,), additional_forward_args=(mask,))
    assert isinstance(tup, tuple) and torch.equal(tup[0], out)
    with torch.no_grad():
        assert torch.equal(attr.attribute(ids, None, mask), out)  # Captum's positional order
    # the maps are class-agnostic: a target would be ignored, so it is refused (not silently dropped)
    with pytest.raises(ValueError, match="do not depend on the target"):
        attr.attribute(ids, target=1, additional_forward_args=mask)
    assert attr.get_name() == "GlobEnc (N_ENC)" and ALTIAttribution(model).get_name() == "ALTI"
    assert GlobEncAttribution.get_name() == "GlobEnc"  # Captum's classmethod form
    assert hasattr(GlobEncAttribution.attribute, "__wrapped__")
    # NoiseTunnel on word embeddings (a float input)
    emb = model.bert.embeddings.word_embeddings(ids).detach()
    clean = attr.attribute(emb, additional_forward_args=(mask,))
    assert torch.allclose(clean, out, rtol=1e-10)
    # without noise every sample is the clean input: the mean (and mean square) of the samples is exact,
    # so the expanded batch kept every example with its own mask
    nt0 = NoiseTunnel(attr).attribute(emb, nt_samples=3, stdevs=0.0, additional_forward_args=(mask,))
    torch.testing.assert_close(nt0, clean, rtol=0, atol=1e-12)
    sq = NoiseTunnel(attr).attribute(emb, nt_type="smoothgrad_sq", nt_samples=3, stdevs=0.0, additional_forward_args=(mask,))
    torch.testing.assert_close(sq, clean ** 2, rtol=0, atol=1e-12)
    # with noise: the mean of the scores of the noised inputs, close to the clean scores, pads 0
    nt = NoiseTunnel(attr).attribute(emb, nt_samples=3, stdevs=1e-3, additional_forward_args=(mask,))
    assert nt.shape == ids.shape and (nt[mask == 0] == 0).all()
    assert 0 < (nt - clean).abs().max() < 1e-2 * clean.abs().max()


def test_rollout_conventions():
    maps = torch.rand(2, 3, 4, 4, dtype=torch.float64)
    raw = rollout(maps)
    assert torch.allclose(raw, maps[:, 2] @ maps[:, 1] @ maps[:, 0])
    rn = row_normalize(maps)
    assert torch.allclose(rollout(maps, "row_normalized"), rn[:, 2] @ rn[:, 1] @ rn[:, 0])
    with pytest.raises(ValueError):
        rollout(maps, "bogus")


def test_explained_position():
    model = make_model("bert")
    ids, mask = random_batch([6, 4], seed=8)
    res = GlobEncAttribution(model, explained_position="last").decompose(ids, additional_forward_args=(mask,))
    assert res.explained_position.tolist() == [5, 3]
    assert torch.equal(res.scores[1], res.rollout[1, 3])
    with pytest.raises(ValueError, match="real"):
        GlobEncAttribution(model, explained_position=5).decompose(ids, additional_forward_args=(mask,))
