r"""ALTI+FF on pre-LN layers (ViT, DINOv2 with layer scale, GPT-2, Llama): every scope scored by ALTI.

The parts of every scope are built here from the definitions (head by head, explicit norm
parts, integrated gradients of the FF) and checked against the model's real tensors; the
maps are then compared with ALTI written as per-token loops.
"""
import pytest
import torch
from layer_capture import capture_layers
from vision_models import images, make_vision

from captum_normattr import ALTIAttribution, FFIntegratedDecomposition
from captum_normattr.decompose.kinds.pre_ln import PRE_LN_SCOPES, pre_ln_alti_map, pre_ln_component_scope_maps
from captum_normattr.decompose.primitives.gated_feed_forward import gated_ff_parts
from decoder_models import decoder_batch, make_decoder
from reference import naive_norm_parts, naive_pre_ln_parts

MODELS = ["vit", "dinov2", "gpt2", "llama"]


def _model_and_batch(name, left=True):
    r"""(model, inputs, additional_forward_args, valid (B, T) bool, causal)."""
    if name in ("vit", "dinov2"):
        model = make_vision(name)
        x = images(2, seed=3)
        t = capture_layers(model, x)[0].hidden_in.shape[1]
        return model, x, None, torch.ones(2, t, dtype=torch.bool), False
    model = make_decoder(name)
    ids, mask = decoder_batch([6, 4], seed=5, left=left)
    return model, ids, mask, mask.bool(), True


def naive_ff(u, u_b, ff):
    r"""FF parts by integrated gradients with a zero baseline, written out: elementwise g in closed form
    IG_j = p_j (g(p) - g(0)) / p; a gated FF through the package's quadrature (tested in test_decoders)."""
    if ff.w_gate is not None:
        return gated_ff_parts(u, u_b, ff.w_gate, ff.b_gate, ff.w_in, ff.b_in, ff.act, ff.w_out, ff.b_out)
    p = u @ ff.w_in  # (B, T, T, F)
    p_b = u_b @ ff.w_in + (ff.b_in if ff.b_in is not None else 0.0)
    total = p.sum(2) + p_b
    g0 = ff.act(torch.zeros((), dtype=total.dtype))
    coef = (ff.act(total) - g0) / total  # no pre-activation is exactly 0 in these float64 models
    parts = (p * coef[:, :, None]) @ ff.w_out
    bias = (p_b * coef + g0) @ ff.w_out + (ff.b_out if ff.b_out is not None else 0.0)
    return parts, bias


def naive_scope_parts(layer):
    r"""Explicit parts (B, T, T, D) and bias parts (B, T, D) of every pre-LN scope, and the real tensors."""
    h = naive_pre_ln_parts(layer)["N_RES"]  # h_{i<-j} = [i = j] x_i + sum_h alpha^h_ij f^h(LN1(x_j))
    b_o = layer.out_bias if layer.out_bias is not None else torch.zeros_like(layer.hidden_in[0, 0])
    u = naive_norm_parts(h, layer.ln2_in, layer.ln2)
    u_b = naive_norm_parts(b_o.expand_as(layer.hidden_in)[:, :, None, :], layer.ln2_in, layer.ln2)[:, :, 0]
    if layer.ln2.bias is not None:
        u_b = u_b + layer.ln2.bias
    ffp, ff_b = naive_ff(u, u_b, layer.ff)
    parts = {"ATB": (h, b_o.expand_as(layer.hidden_in)), "LN2": (u, u_b), "FF": (ffp, ff_b), "RES2": (h + ffp, b_o + ff_b)}
    real = {"ATB": layer.ln2_in, "LN2": layer.ln2_out, "FF": layer.ff_out, "RES2": layer.layer_out}
    return parts, real


def naive_alti_loops(parts, y, valid, causal):
    r"""ALTI from its definition, one (example, receiver, source) at a time: c_ij = max(0, |y_i|_1 -
    |y_i - part_ij|_1) over real j (and j <= i if causal), real rows divided by their sum."""
    b, t = valid.shape
    out = torch.zeros(b, t, t, dtype=y.dtype)
    for e in range(b):
        for i in range(t):
            if not valid[e, i]:
                continue
            for j in range(t):
                if valid[e, j] and not (causal and j > i):
                    c = float(y[e, i].abs().sum() - (y[e, i] - parts[e, i, j]).abs().sum())
                    out[e, i, j] = max(0.0, c)
            s = out[e, i].sum()
            if s > 0:
                out[e, i] /= s
    return out


@pytest.mark.parametrize("name", MODELS)
def test_scope_parts_complete_and_alti_equals_naive(name):
    model, x, mask, valid, causal = _model_and_batch(name)
    m2 = (valid[:, :, None] & valid[:, None, :]).double()
    if causal:
        m2 = m2.tril()
    for layer in capture_layers(model, x, mask):
        assert layer.topology == "pre_ln" and layer.causal == causal
        parts, real = naive_scope_parts(layer)
        for s in PRE_LN_SCOPES:  # the parts of every scope sum to the model's real tensor
            p, bias = parts[s]
            assert ((p.sum(2) + bias - real[s])[valid]).abs().max() < 1e-10, s
        full, err = pre_ln_component_scope_maps(layer, valid, causal=causal, contribution="alti")
        assert err["ff"] < 1e-10 and err["layer"] < 1e-10
        for s in PRE_LN_SCOPES:
            naive = naive_alti_loops(parts[s][0], real[s], valid, causal)
            assert torch.allclose(full[s], naive, atol=1e-12, rtol=0), s
            # real rows sum to 1, or are all 0 where every part lies farther from y_i than the zero vector
            rows = full[s].sum(-1)[valid]
            full_rows = (full[s] > 0).any(-1)[valid]
            assert full_rows.any(), s
            assert torch.allclose(rows[full_rows], torch.ones_like(rows[full_rows]), atol=1e-12, rtol=0), s
            assert (rows[~full_rows] == 0).all(), s
            assert (full[s] * (1 - m2) == 0).all(), s  # pad rows, pad columns and (causal) j > i: exactly 0
        # chunked rows and the dense (non-causal) path give the same maps; ATB is plain ALTI
        for kw in (dict(chunk_rows=1), dict(chunk_rows=3), dict(memory_budget_mb=1e-9)):
            got, _ = pre_ln_component_scope_maps(layer, valid, causal=causal, contribution="alti", **kw)
            for s in PRE_LN_SCOPES:
                assert torch.allclose(got[s], full[s], atol=1e-13, rtol=0), (s, kw)
        assert torch.allclose(full["ATB"], pre_ln_alti_map(layer, valid, None, causal), atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_causal_rows_give_nothing_to_later_tokens(name):
    model, ids, mask, valid, _ = _model_and_batch(name)
    res = FFIntegratedDecomposition(model, contribution="alti").decompose(ids, additional_forward_args=(mask,))
    assert res.extras["layer_completeness_error"].max() < 1e-10
    maps = [res.layer_maps] + [res.extras[f"scope_{s}"] for s in PRE_LN_SCOPES]
    for m in maps:
        assert m.shape[-2:] == (ids.shape[1], ids.shape[1])
        assert (m.triu(1) == 0).all()  # exactly 0, not merely small
        rows = m.sum(-1)[valid[:, None].expand(-1, m.shape[1], -1)]
        assert ((rows - 1).abs() < 1e-12).logical_or(rows == 0).all()
    assert torch.equal(res.layer_maps, res.extras["scope_RES2"])  # ALTI+FF = the whole-layer scope
    plain = ALTIAttribution(model).decompose(ids, additional_forward_args=(mask,))
    assert torch.allclose(res.extras["scope_ATB"], plain.layer_maps, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name,left", [("gpt2", True), ("llama", True), ("llama", False), ("vit", None)])
def test_padded_batch_equals_each_example_alone(name, left):
    model, x, mask, valid, _ = _model_and_batch(name, left=bool(left))
    for scope in ("RES2", "FF"):
        attr = FFIntegratedDecomposition(model, contribution="alti", scope=scope, chunk_rows=2)
        batch = attr.decompose(x, additional_forward_args=None if mask is None else (mask,))
        assert (batch.delta < 1e-10).all() and (batch.scores[~valid] == 0).all()
        assert (batch.layer_maps * ~(valid[:, None, :, None] & valid[:, None, None, :]) == 0).all()
        for e in range(x.shape[0]):
            keep = valid[e]
            if mask is None:
                alone = attr.decompose(x[e : e + 1])
            else:
                alone = attr.decompose(x[e : e + 1, keep], additional_forward_args=(mask[e : e + 1, keep],))
            assert torch.allclose(batch.scores[e, keep], alone.scores[0], atol=1e-10, rtol=0), (scope, e)
            got = batch.layer_maps[e][:, keep][:, :, keep]
            assert torch.allclose(got, alone.layer_maps[0], atol=1e-10, rtol=0), (scope, e)


def test_names_and_refusals():
    gpt2, vit = make_decoder("gpt2"), make_vision("vit")
    for model in (gpt2, vit):
        assert FFIntegratedDecomposition(model, contribution="alti").get_name() == "ALTI+FF"
        assert FFIntegratedDecomposition(model, contribution="alti").scope == "RES2"
        assert FFIntegratedDecomposition(model, contribution="alti", scope="FF").get_name() == "ALTI, FF decomposition (FF)"
        with pytest.raises(ValueError, match="pre-LN model: ignore_low_gamma"):
            FFIntegratedDecomposition(model, ignore_low_gamma=0.01)
        with pytest.raises(ValueError, match="contribution='norm'"):
            FFIntegratedDecomposition(model, contribution="alti", ignore_low_gamma=0.01)
    layer = capture_layers(gpt2, *decoder_batch([3]))[0]
    with pytest.raises(ValueError, match="contribution must be one of"):
        pre_ln_component_scope_maps(layer, torch.ones(1, 3, dtype=torch.bool), contribution="l1")
