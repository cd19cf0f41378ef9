r"""The parallel layer kind (GPT-NeoX/Pythia): y = x + Attn(N1(x)) + FF(N2(x)).

Float64 tiny models of tests/zoo.py. Every method: token scores plus the no-token terms equal
the model's own logit (from a plain forward pass); the GlobEnc / ALTI / FF-scope maps equal a
naive per-token reference written here from the equations (docs/design.md, "Parallel layers")
with the model's own modules; padded batches equal single examples; DecompX's adjoint equals
its forward algorithm; the model is unchanged. Also: one norm module shared by both branches
(GPT-J, Phi-2, Falcon), the sequential variant (``use_parallel_residual=False``, pre-LN), and a
parallel model described as pre-LN, which the consistency guards catch.
"""
import contextlib
import copy
import dataclasses

import pytest
import torch

from captum_normattr import (
    ALTIAttribution,
    ALTILogitAttribution,
    ConsistencyError,
    DecompXAttribution,
    FFIntegratedDecomposition,
    GlobEncAttribution,
    InformationFlowRoutes,
)
from captum_normattr.arch import ARCHITECTURES, register_architecture
from captum_normattr.arch.spec import Norm
from captum_normattr.decompose.kinds.registry import LAYER_KINDS
from decoder_models import decoder_batch
from registry_state import restored_registry
from zoo import build


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _logits(model, ids, mask=None):
    mask = torch.ones_like(ids) if mask is None else mask
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
    return out.logits[:, -1]


@pytest.fixture(scope="module")
def neox():
    return build("gpt_neox", "lm")


@pytest.fixture
def registry():
    r"""Restore the architecture registries after a test that re-registers an entry."""
    with restored_registry():
        yield


# --- a naive per-token reference from the model's own modules -------------------------------
@contextlib.contextmanager
def _exact_eager_attention():
    r"""NeoX's eager attention with its softmax in the input dtype (transformers computes it in float32)."""
    from transformers.models.gpt_neox import modeling_gpt_neox as neox_code  # noqa: PLC0415

    def exact(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        w = torch.matmul(query, key.transpose(2, 3)) * scaling
        if attention_mask is not None:
            w = w + attention_mask
        w = torch.softmax(w, dim=-1)
        return torch.matmul(w, value).transpose(1, 2).contiguous(), w

    saved = neox_code.eager_attention_forward
    neox_code.eager_attention_forward = exact
    try:
        yield
    finally:
        neox_code.eager_attention_forward = saved


def _reference(model, ids):
    r"""Per layer: x, the parts h_{i<-j} (T, T, D), the real attention branch output, and the
    FF output split into token i's part and its bias part (closed-form IG), all by loops."""
    base = model.gpt_neox
    seen = {}
    eager = copy.deepcopy(model)  # the same weights, attention probabilities returned
    eager.set_attn_implementation("eager")
    for l, layer in enumerate(eager.gpt_neox.layers):
        layer.register_forward_pre_hook(lambda m, a, k, l=l: seen.setdefault(l, {}).update(
            x=(a[0] if a else k["hidden_states"])[0].detach()), with_kwargs=True)
        layer.attention.dense.register_forward_hook(lambda m, a, o, l=l: seen.setdefault(l, {}).update(attn=o[0].detach()))
    with torch.no_grad(), _exact_eager_attention():
        out = eager(input_ids=ids, output_attentions=True)
    cfg = model.config
    nh, d = cfg.num_attention_heads, cfg.hidden_size
    dh = d // nh
    result = []
    for l, layer in enumerate(base.layers):
        x, attn_real = seen[l]["x"], seen[l]["attn"]
        probs = out.attentions[l][0]  # (H, T, T)
        t = x.shape[0]
        with torch.no_grad():
            qkv = layer.attention.query_key_value(layer.input_layernorm(x)).view(t, nh, 3 * dh)
            v = qkv[..., 2 * dh:]  # per head [q_h | k_h | v_h]: the interleaved layout
            w_o = layer.attention.dense.weight  # (D, H Dh)
            parts = torch.zeros(t, t, d, dtype=x.dtype)
            for i in range(t):
                parts[i, i] += x[i]
                for j in range(t):
                    for h in range(nh):
                        parts[i, j] += probs[h, i, j] * (v[j, h] @ w_o[:, h * dh:(h + 1) * dh].T)
            ln2 = layer.post_attention_layernorm
            u = ln2(x) - ln2.bias  # token i's part of N2(x_i); the bias part is beta
            p_tok = u @ layer.mlp.dense_h_to_4h.weight.T
            p_bias = ln2.bias @ layer.mlp.dense_h_to_4h.weight.T + layer.mlp.dense_h_to_4h.bias
            p = p_tok + p_bias
            act = layer.mlp.act
            coef = (act(p) - act(torch.zeros((), dtype=p.dtype))) / p
            ff_own = (p_tok * coef) @ layer.mlp.dense_4h_to_h.weight.T
            ff_real = layer.mlp(ln2(x))
        result.append(dict(x=x, parts=parts, probs=probs, attn=attn_real, u=u, ff_own=ff_own, ff=ff_real,
                           b_o=layer.attention.dense.bias.detach(), n2=ln2(x).detach()))
    return result


def _l1_alti(parts, y):
    c = (y.abs().sum(-1)[:, None] - (y[:, None] - parts).abs().sum(-1)).clamp_min(0)
    return c / c.sum(-1, keepdim=True)


def test_maps_equal_the_naive_reference(neox):
    ids, _ = decoder_batch([5], seed=4)
    ref = _reference(neox, ids)
    t = ids.shape[1]
    tri = torch.ones(t, t).tril().bool()
    for name in ("N", "N_RES", "W"):
        res = GlobEncAttribution(neox, map_name=name, strict=True).decompose(ids)
        for l, r in enumerate(ref):
            if name == "W":
                torch.testing.assert_close(res.layer_maps[0, l], r["probs"].mean(0) * tri, rtol=1e-12, atol=1e-14)
                continue
            attn_only = r["parts"] - torch.diag_embed(r["x"].T).permute(1, 2, 0)
            expect = (r["parts"] if name == "N_RES" else attn_only).norm(dim=-1) * tri
            torch.testing.assert_close(res.layer_maps[0, l], expect, rtol=1e-10, atol=1e-12 * float(expect.max()))
    alti = ALTIAttribution(neox, strict=True).decompose(ids)
    for l, r in enumerate(ref):
        y = r["x"] + r["attn"]  # the real x + attention (the model never forms it)
        torch.testing.assert_close(r["parts"].sum(1) + r["b_o"], y, rtol=0, atol=1e-12 * float(y.abs().max()))
        torch.testing.assert_close(alti.layer_maps[0, l], _l1_alti(r["parts"], y) * tri, rtol=1e-10, atol=1e-12)
    for contribution in ("norm", "alti"):
        ffd = FFIntegratedDecomposition(neox, contribution=contribution, strict=True).decompose(ids)
        for l, r in enumerate(ref):
            whole = r["parts"].clone()
            whole[range(t), range(t)] += r["ff_own"]
            real = r["x"] + r["attn"] + r["ff"]
            torch.testing.assert_close(whole.sum(1) + r["b_o"] + (r["ff"] - r["ff_own"]), real, rtol=0,
                                       atol=1e-12 * float(real.abs().max()))
            if contribution == "norm":
                expect = {"RES2": whole.norm(dim=-1) * tri, "FF": torch.diag(r["ff_own"].norm(dim=-1)),
                          "LN2": torch.diag(r["u"].norm(dim=-1)), "ATB": r["parts"].norm(dim=-1) * tri}
            else:
                y = r["x"] + r["attn"]
                eye = torch.eye(t, dtype=y.dtype)
                expect = {"RES2": _l1_alti(whole, real) * tri, "ATB": _l1_alti(r["parts"], y) * tri,
                          "FF": eye, "LN2": eye}
            for scope, m in expect.items():
                got = ffd.extras[f"scope_{scope}"][0, l]
                torch.testing.assert_close(got, m, rtol=1e-10, atol=1e-12 * float(m.abs().max()), msg=scope)


def test_every_method_sums_to_the_models_logit(neox):
    ids, mask = decoder_batch([6, 4], seed=5)
    state = copy.deepcopy(neox.state_dict())
    logits = _logits(neox, ids, mask)
    target = logits.argmax(-1)
    expect = logits.gather(1, target[:, None])[:, 0]
    al = ALTILogitAttribution(neox, strict=True).decompose(ids, target=target, additional_forward_args=(mask,))
    assert _rel(al.scores.sum(-1) + al.no_token_total, expect) < 1e-9
    assert float(al.delta.max()) < 1e-9 * float(expect.abs().max())
    assert float(al.extras["completeness_error"].max()) < 1e-12 * float(expect.abs().max()) + 1e-12
    got = {}
    for algorithm in ("forward", "adjoint"):
        res = DecompXAttribution(neox, algorithm=algorithm, strict=True).decompose(
            ids, target=target, additional_forward_args=mask)
        assert res.algorithm == algorithm
        assert _rel(res.scores.sum(-1) + res.bias_scores[:, 0], expect) < 1e-9
        assert float(res.delta.max()) < 1e-9 * float(expect.abs().max())
        got[algorithm] = res.scores
    torch.testing.assert_close(got["adjoint"], got["forward"], rtol=0, atol=1e-10 * float(got["forward"].abs().max()))
    for bias_mode in ("spread", "spread_per_key"):  # the spread rules stay complete
        res = DecompXAttribution(neox, bias_mode=bias_mode, algorithm="forward").decompose(
            ids, target=target, additional_forward_args=mask)
        assert _rel(res.scores.sum(-1) + res.bias_scores[:, 0], expect) < 1e-9
    for cls in (GlobEncAttribution, ALTIAttribution):
        res = cls(neox, strict=True).decompose(ids, additional_forward_args=(mask,))
        assert float(res.extras["completeness_error"].max()) < 1e-12 * 10
    for contribution in ("norm", "alti"):
        res = FFIntegratedDecomposition(neox, contribution=contribution, strict=True).decompose(
            ids, additional_forward_args=(mask,))
        assert float(res.delta.max()) < 1e-12 * 10  # FF parts + bias and layer parts + biases = the real tensors
    assert all(torch.equal(v, state[k]) for k, v in neox.state_dict().items())


def test_padding_equals_single_examples(neox):
    ids, mask = decoder_batch([6, 4], seed=6)
    t = ids.shape[1]
    alone_ids = ids[1:, t - 4:]
    for attr in (DecompXAttribution(neox, algorithm="forward"), DecompXAttribution(neox, algorithm="adjoint")):
        both = attr.decompose(ids, target=7, additional_forward_args=mask).scores
        alone = attr.decompose(alone_ids, target=7).scores
        torch.testing.assert_close(both[1, t - 4:], alone[0], rtol=0, atol=1e-9 * float(both.abs().max()))
    al = ALTILogitAttribution(neox)
    both = al.decompose(ids, target=7, additional_forward_args=(mask,)).scores
    alone = al.decompose(alone_ids, target=7).scores
    torch.testing.assert_close(both[1, t - 4:], alone[0], rtol=0, atol=1e-9 * float(both.abs().max()))
    ffd = FFIntegratedDecomposition(neox, contribution="alti")
    both = ffd.decompose(ids, additional_forward_args=(mask,)).scores
    alone = ffd.decompose(alone_ids).scores
    torch.testing.assert_close(both[1, t - 4:], alone[0], rtol=0, atol=1e-9)


def test_maps_and_options_without_a_parallel_meaning_are_refused(neox):
    kind = LAYER_KINDS["parallel"]
    assert kind.default_map == "N_RES" and kind.whole_layer_scope == "RES2"
    for name in ("N_RESLN", "N_ENC", "W_RES"):
        with pytest.raises(ValueError, match="not defined for parallel layers"):
            GlobEncAttribution(neox, map_name=name)
    with pytest.raises(ValueError, match="ignore_low_gamma"):
        FFIntegratedDecomposition(neox, ignore_low_gamma=0.01)


def test_routes_run_with_the_ff_edge_from_the_layer_input(neox):
    r"""The routes (tests/attr/test_routes_kinds.py checks every edge against a reference): with NeoX's biases
    (b_O inside h_i, no edge), the importances into every node sum to 1 at threshold 0, every FF edge runs from
    the layer input x_{l,i}."""
    g = InformationFlowRoutes(neox).attribute(torch.randint(3, 50, (1, 6), generator=torch.Generator().manual_seed(1)),
                                              threshold=0.0)
    into = {}
    for e in g.edges:
        into[e["target"]] = into.get(e["target"], 0.0) + e["importance"]
    assert into and max(abs(v - 1) for v in into.values()) < 1e-12
    assert abs(float(g.token_flow().sum()) - 1) < 1e-12
    ff = [e for e in g.edges if e["kind"] == "ff"]
    assert ff and all(e["source"] == f"x{e['layer']}_{e['target_position']}" for e in ff)


def test_one_norm_shared_by_both_branches(registry):
    r"""GPT-J, Phi-2, Falcon: one norm module feeds both branches (here NeoX's, called twice)."""
    model = build("gpt_neox", "lm", seed=3)
    for layer in model.gpt_neox.layers:
        layer.post_attention_layernorm = layer.input_layernorm
    spec = ARCHITECTURES["gpt_neox"]
    lay = spec.layer
    shared = dataclasses.replace(lay, ff=dataclasses.replace(lay.ff, pre_norm=Norm("input_layernorm")))
    register_architecture(dataclasses.replace(spec, layer=shared), "gpt_neox", replace=True)
    ids, mask = decoder_batch([5, 3], seed=7)
    logits = _logits(model, ids, mask)
    expect = logits[:, 4]
    al = ALTILogitAttribution(model, strict=True).decompose(ids, target=4, additional_forward_args=(mask,))
    assert _rel(al.scores.sum(-1) + al.no_token_total, expect) < 1e-9
    for algorithm in ("forward", "adjoint"):
        res = DecompXAttribution(model, algorithm=algorithm, strict=True).decompose(
            ids, target=4, additional_forward_args=mask)
        assert _rel(res.scores.sum(-1) + res.bias_scores[:, 0], expect) < 1e-9
    res = FFIntegratedDecomposition(model, contribution="alti", strict=True).decompose(ids, additional_forward_args=(mask,))
    assert float(res.delta.max()) < 1e-11


def test_sequential_variant_is_pre_ln():
    model = build("gpt_neox", "lm", use_parallel_residual=False)
    ids, mask = decoder_batch([6, 4], seed=8)
    expect = _logits(model, ids, mask)[:, 9]
    al = ALTILogitAttribution(model, strict=True)
    assert al.kind.name == "pre_ln"
    res = al.decompose(ids, target=9, additional_forward_args=(mask,))
    assert _rel(res.scores.sum(-1) + res.no_token_total, expect) < 1e-9
    assert float(res.delta.max()) < 1e-9 * float(expect.abs().max())
    for algorithm in ("forward", "adjoint"):
        dx = DecompXAttribution(model, algorithm=algorithm, strict=True).decompose(
            ids, target=9, additional_forward_args=mask)
        assert _rel(dx.scores.sum(-1) + dx.bias_scores[:, 0], expect) < 1e-9


def test_a_parallel_model_described_as_pre_ln_is_caught(neox, registry):
    r"""Issue 23: a plausible pre-LN entry for a parallel model gave ALTI-Logit a delta of 0.0 with wrong maps."""
    spec = ARCHITECTURES["gpt_neox"]
    register_architecture(dataclasses.replace(spec, layer=dataclasses.replace(spec.layer, parallel=False), variants=()),
                          "gpt_neox", replace=True)
    ids, mask = decoder_batch([5, 3], seed=9)
    with pytest.raises(ConsistencyError, match="layer output vs the residual stream plus the feed-forward output"):
        ALTILogitAttribution(neox, strict=True).decompose(ids, target=4, additional_forward_args=(mask,))
    with pytest.raises(ConsistencyError, match="layer output vs the residual stream"):
        ALTIAttribution(neox, strict=True).decompose(ids, additional_forward_args=(mask,))
    with pytest.raises(ConsistencyError, match="refused even without strict"):  # gross: refused by default
        ALTILogitAttribution(neox).decompose(ids, target=4, additional_forward_args=(mask,))
