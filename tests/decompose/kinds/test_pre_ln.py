r"""Decoders (GPT-2, Llama with GQA, Mistral, Qwen2 with qkv biases): every map and FF scope on pre-LN layers."""
import pytest
from layer_capture import capture_layers
import torch
from captum.attr import NoiseTunnel

from captum_normattr import ALTIAttribution, ALTILogitAttribution, FFIntegratedDecomposition, GlobEncAttribution
from captum_normattr.decompose.kinds.pre_ln import (
    PRE_LN_MAPS,
    pre_ln_alti_map,
    pre_ln_component_scope_maps,
    pre_ln_ff_parts,
    pre_ln_layer_maps,
    residual_parts,
)
from captum_normattr.decompose.primitives.feed_forward import ff_parts
from reference import ln2_parts
from captum_normattr.decompose.primitives.gated_feed_forward import gate_integrals, gated_ff_parts

from decoder_models import DECODER_FAMILIES, decoder_batch, make_decoder
from reference import naive_fixed_residual, naive_parts, naive_pre_ln_parts, naive_ratio

LENGTHS = [6, 4]


def capture(model, ids, mask):
    return capture_layers(model, ids, mask)


def naive_alti(parts, y, valid):
    c = (y.abs().sum(-1)[:, :, None] - (y[:, :, None, :] - parts).abs().sum(-1)).clamp_min(0)
    c = c * (valid[:, :, None] & valid[:, None, :])
    s = c.sum(-1, keepdim=True)
    return torch.where(s > 0, c / s, torch.zeros_like(c))


@pytest.mark.parametrize("family", DECODER_FAMILIES)
@pytest.mark.parametrize("left", [True, False])
def test_attention_block_parts_and_maps(family, left):
    model = make_decoder(family)
    ids, mask = decoder_batch(LENGTHS, seed=1, left=left)
    v = mask.bool()
    m2 = (v[:, :, None] & v[:, None, :]).double().tril()
    for layer in capture(model, ids, mask):
        assert layer.topology == "pre_ln"
        # causal attention: a real query never puts weight on a later key
        probs = layer.probs * v[:, None, :, None]
        assert (probs.triu(1) == 0).all()
        h = residual_parts(layer)
        b_o = layer.out_bias if layer.out_bias is not None else 0.0
        assert ((h.sum(2) + b_o - layer.ln2_in)[v]).abs().max() < 1e-10  # the real residual stream h
        ref = naive_parts(layer)  # head-by-head (B, T, T, D) parts
        assert torch.allclose(h, ref["N_RES"], atol=1e-12)
        u, u_b = ln2_parts(layer)
        assert ((u.sum(2) + u_b - layer.ln2_out)[v]).abs().max() < 1e-10  # the real LN2 output
        maps, ratios = pre_ln_layer_maps(layer, v)
        naive = naive_pre_ln_parts(layer)  # N_RESLN from the definition of the norm, not from ln2_parts
        assert torch.allclose(naive["N_RES"], ref["N_RES"], atol=1e-12)
        for name, parts in naive.items():
            assert torch.allclose(maps[name], parts.norm(dim=-1) * m2, atol=1e-10, rtol=0), name
            # mixing ratio from the parts themselves (sum of the parts = h - b_O, never h)
            assert torch.allclose(ratios[name], naive_ratio(parts) * v, atol=1e-10, rtol=0), name
        assert torch.allclose(maps["W"], layer.probs.mean(1) * m2, atol=1e-14)
        assert torch.allclose(maps["N_FIXEDRES"], naive_fixed_residual(ref["N"].norm(dim=-1) * m2, v) * m2, atol=1e-12)
        assert torch.allclose(maps["W_FIXEDRES"], naive_fixed_residual(layer.probs.mean(1) * m2, v) * m2, atol=1e-12)
        for chunk in (None, 1, 4):
            assert torch.allclose(pre_ln_alti_map(layer, v, chunk), naive_alti(h, layer.ln2_in, v) * m2, atol=1e-12)


@pytest.mark.parametrize("family", DECODER_FAMILIES)
def test_ff_scopes_complete(family):
    model = make_decoder(family)
    ids, mask = decoder_batch(LENGTHS, seed=2)
    v = mask.bool()
    m2 = (v[:, :, None] & v[:, None, :]).double().tril()
    for layer in capture(model, ids, mask):
        maps, err = pre_ln_component_scope_maps(layer, v, chunk_rows=2)
        assert err["ff"] < 1e-10 and err["layer"] < 1e-10, err  # FF parts -> real MLP output; h + FF -> layer output
        full, _ = pre_ln_component_scope_maps(layer, v)
        dense, dense_err = pre_ln_component_scope_maps(layer, v, chunk_rows=4, causal=False)  # every source column
        assert dense_err["ff"] < 1e-10
        for s in maps:
            assert torch.allclose(maps[s], full[s], atol=1e-13)
            assert torch.allclose(maps[s], dense[s] * m2, atol=1e-13)
        naive = naive_pre_ln_parts(layer)
        assert torch.allclose(maps["ATB"], naive["N_RES"].norm(dim=-1) * m2, atol=1e-12)
        assert torch.allclose(maps["LN2"], naive["N_RESLN"].norm(dim=-1) * m2, atol=1e-12)
        assert (maps["FF"].triu(1) == 0).all() and (maps["RES2"].triu(1) == 0).all()
        # the head-mixed pre-activations equal explicit LN2 parts pushed through the generic FF functions
        u, u_b = ln2_parts(layer)
        assert torch.allclose(u, naive["N_RESLN"], atol=1e-12)
        f = layer.ff
        if f.w_gate is not None:
            ref, ref_b = gated_ff_parts(u, u_b, f.w_gate, f.b_gate, f.w_in, f.b_in, f.act, f.w_out, f.b_out)
        else:
            ref, ref_b = ff_parts(u, u_b, f.w_in, f.b_in, f.act, f.w_out, f.b_out)
        got, got_b = pre_ln_ff_parts(layer, slice(0, u.shape[1]))
        assert torch.allclose(got, ref, atol=1e-12) and torch.allclose(got_b, ref_b, atol=1e-12)
        assert torch.allclose(maps["FF"], ref.norm(dim=-1) * m2, atol=1e-12)


def test_elementwise_riemann_converges():
    model = make_decoder("gpt2")
    ids, mask = decoder_batch([6], seed=3)
    layer = capture(model, ids, mask)[0]
    exact, _ = pre_ln_ff_parts(layer, slice(0, 6))
    errs = [float((pre_ln_ff_parts(layer, slice(0, 6), "riemann", m)[0] - exact).abs().max()) for m in (4, 16, 64)]
    assert errs[0] > errs[1] > errs[2] and errs[2] < 1e-3 * exact.abs().max(), errs


def test_gated_quadrature_converges():
    model = make_decoder("llama")
    ids, mask = decoder_batch([7], seed=3)
    layer = capture(model, ids, mask)[1]
    v = mask.bool()
    errs = [float(pre_ln_component_scope_maps(layer, v, nodes=n)[1]["ff"]) for n in (2, 4, 8, 16)]
    assert errs[0] > errs[1] > errs[2] > errs[3] and errs[3] < 1e-12 and errs[0] > 1e-6, errs
    # the 1-D integrals on a wide range of gate values: a I1 + I2 = g(a)
    a = torch.linspace(-30, 30, 301, dtype=torch.float64)
    g = torch.nn.functional.silu
    gaps = []
    for n in (8, 16, 32, 48):  # 48 = the default
        i1, i2 = gate_integrals(a, g, n)
        gaps.append(float((a * i1 + i2 - g(a)).abs().max()))
    assert gaps[0] > gaps[1] > gaps[2] > gaps[3] and gaps[3] < 1e-12, gaps


def test_gated_parts_against_riemann_autograd():
    torch.manual_seed(0)
    d, f, p = 5, 7, 3
    parts, bias = torch.randn(1, 2, p, d, dtype=torch.float64), torch.randn(1, 2, d, dtype=torch.float64)
    wg, wu, wd = (torch.randn(d, f, dtype=torch.float64), torch.randn(d, f, dtype=torch.float64),
                  torch.randn(f, d, dtype=torch.float64))
    bg, bu, bd = torch.randn(f, dtype=torch.float64), torch.randn(f, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    act = torch.nn.functional.silu
    out, out_b = gated_ff_parts(parts, bias, wg, bg, wu, bu, act, wd, bd)
    # IG of phi(a, b) = g(a) * b along t * (a, b) by a fine midpoint rule with autograd
    a_p, b_p = parts @ wg, parts @ wu
    a_tot, b_tot = a_p.sum(2) + bias @ wg + bg, b_p.sum(2) + bias @ wu + bu
    m = 4000
    ga, gb = torch.zeros_like(a_tot), torch.zeros_like(b_tot)
    for k in range(m):
        t = (k + 0.5) / m
        x, y = (t * a_tot).requires_grad_(True), (t * b_tot).requires_grad_(True)
        dx, dy = torch.autograd.grad((act(x) * y).sum(), (x, y))
        ga, gb = ga + dx / m, gb + dy / m
    ref = (a_p * ga[:, :, None] + b_p * gb[:, :, None]) @ wd
    assert torch.allclose(out, ref, atol=1e-6)
    assert torch.allclose(out.sum(2) + out_b, (act(a_tot) * b_tot) @ wd + bd, atol=1e-12)


def test_authentic_hf_rmsnorm_completeness():
    r"""Unmodified Llama RMSNorm computes in float32 even in a float64 model: the FF delta is that rounding."""
    model = make_decoder("qwen2", exact_norms=False)
    ids, mask = decoder_batch(LENGTHS, seed=4)
    v = mask.bool()
    for layer in capture(model, ids, mask):
        h = residual_parts(layer)
        assert layer.out_bias is None  # Qwen2: q/k/v biases, no o_proj bias
        assert ((h.sum(2) - layer.ln2_in)[v]).abs().max() < 1e-10
        _, err = pre_ln_component_scope_maps(layer, v)
        assert err["ff"] < 1e-5 * layer.ff_out.abs().max()
    _, delta = FFIntegratedDecomposition(model).attribute(ids, additional_forward_args=mask, return_convergence_delta=True)
    assert (delta < 1e-5).all()


METHODS = ["globenc", "N_RES", "alti", "ff", "ff_LN2", "alti_logit"]


def _method(model, name, **kw):
    if name == "globenc":
        return GlobEncAttribution(model, **kw)
    if name == "N_RES":
        return GlobEncAttribution(model, "N_RES", **kw)
    if name == "alti":
        return ALTIAttribution(model, **kw)
    if name == "ff":
        return FFIntegratedDecomposition(model, **kw)
    if name == "ff_LN2":
        return FFIntegratedDecomposition(model, scope="LN2", **kw)
    return ALTILogitAttribution(model, **kw)


def _run(attr, ids, mask):
    if isinstance(attr, ALTILogitAttribution):
        res = attr.decompose(ids, 5, mask)
        return res.scores, res.layer_token_contributions
    res = attr.decompose(ids, additional_forward_args=mask)
    return res.scores, res.layer_maps


@pytest.mark.parametrize("family", DECODER_FAMILIES)
@pytest.mark.parametrize("method", METHODS)
def test_padded_batch_equals_single_and_causal(family, method):
    model = make_decoder(family)
    attr = _method(model, method)
    lengths = [6, 4, 2]
    for left in (True, False):
        ids, mask = decoder_batch(lengths, seed=5, left=left)
        scores, maps = _run(attr, ids, mask)
        for b, n in enumerate(lengths):
            sl = slice(6 - n, 6) if left else slice(0, n)
            s1, m1 = _run(attr, ids[b : b + 1, sl], mask[b : b + 1, sl])
            assert torch.allclose(scores[b, sl], s1[0], rtol=1e-9, atol=1e-12), (left, b)
            assert (scores[b][~mask[b].bool()] == 0).all()
            if maps.dim() == 4:
                assert torch.allclose(maps[b, :, sl, sl], m1[0], rtol=1e-9, atol=1e-12)
                assert (maps.triu(1) == 0).all()  # causality: no token receives from a later one
    # an earlier explained position: later tokens get exactly 0
    early = _method(model, method, explained_position=2)
    ids, mask = decoder_batch([6], seed=6)
    s, _ = _run(early, ids, mask)
    assert (s[0, 3:] == 0).all() and (s[0, :3] != 0).any()


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_model_unchanged(family, attn):
    model = make_decoder(family, attn=attn)
    ids, mask = decoder_batch([6, 4], seed=7)
    before = model(input_ids=ids, attention_mask=mask).logits
    model.train()
    hooks = _hook_count(model)
    for name in METHODS:
        _run(_method(model, name), ids, mask)
    assert model.training and model.config._attn_implementation == attn
    assert _hook_count(model) == hooks
    model.eval()
    # bit-identical (HF eager attention itself returns NaN for this left-padded batch, before and after alike)
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, before, rtol=0, atol=0, equal_nan=True)


def test_clear_errors():
    model = make_decoder("llama")
    for bad in ("N_ENC", "W_RES"):
        with pytest.raises(ValueError, match="N_RESLN"):
            GlobEncAttribution(model, bad)
    ids, mask = decoder_batch([5], seed=8)
    gap = mask.clone()
    gap[0, 2] = 0
    with pytest.raises(ValueError, match="contiguous"):
        GlobEncAttribution(model).attribute(ids, additional_forward_args=gap)
    with pytest.raises(ValueError, match="real"):
        ALTIAttribution(model, explained_position=7).attribute(ids)


def test_defaults_and_contract():
    model = make_decoder("gpt2")
    ids, mask = decoder_batch([6, 4], seed=9)
    g = GlobEncAttribution(model)
    assert g.map_name == "N_RESLN" and g.get_name() == "GlobEnc (N_RESLN)"
    res = g.decompose(ids, additional_forward_args=mask)
    assert res.explained_position.tolist() == [5, 5]  # left padding: the last real token is the last column
    assert res.mixing_ratio.shape == (2, 2, 6)
    assert FFIntegratedDecomposition(model).scope == "RES2"
    assert set(PRE_LN_MAPS) == {"W", "W_FIXEDRES", "N", "N_FIXEDRES", "N_RES", "N_RESLN"}
    out = g.attribute(ids, additional_forward_args=(mask,))
    tup = g.attribute((ids,), additional_forward_args=(mask,))
    assert isinstance(tup, tuple) and torch.equal(tup[0], out)
    emb = model.transformer.wte(ids).detach()
    assert torch.allclose(g.attribute(emb, additional_forward_args=mask), out, rtol=1e-10)
    alti = ALTIAttribution(model)
    clean = alti.attribute(emb, additional_forward_args=(mask,))
    with torch.no_grad():
        nt0 = NoiseTunnel(alti).attribute(emb, nt_samples=2, stdevs=0.0, additional_forward_args=(mask,))
        nt = NoiseTunnel(alti).attribute(emb, nt_samples=2, stdevs=1e-3, additional_forward_args=(mask,))
    torch.testing.assert_close(nt0, clean, rtol=0, atol=1e-12)  # no noise: exactly the clean scores, per example
    assert nt.shape == ids.shape and (nt[mask == 0] == 0).all()
    assert 0 < (nt - clean).abs().max() < 1e-2 * clean.abs().max()
