r"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): routing from the real forward pass, held fixed.

The FF of a token is sum_{e chosen} r_e FF_e(u) [+ sigmoid(u w_s) FF_s(u)], with the experts and
weights the router chose in the real forward pass. Checked here against the model itself (plain
forward passes with hooks of the test's own, no recorded tensors): the FF parts of every token
sum to the real FF output; the routing is the one the experts module was called with (a router
patched to route elsewhere is followed; recomputing the routing from the router's input would
be O(1) off); one token's parts equal a naive per-expert reference written from the equations;
padded batches equal single examples; the capture's FF guard fires when the experts compute
something else than the description says; and the default ``grouped_mm`` kernel, which refuses
float64, is decomposed in float32.
"""
import pytest
import torch
from torch.nn import functional as F

from captum_normattr import ALTILogitAttribution, DecompXAttribution, FFIntegratedDecomposition
from captum_normattr.models.guard import ConsistencyError
from captum_normattr.decompose.kinds.pre_ln import output_bias, pre_ln_ff_parts, residual_parts
from captum_normattr.models.adapters import get_adapter
from captum_normattr.models.capture.session import recording
from decoder_models import decoder_batch
from zoo_moe import build_moe

KEYS = ["mixtral", "qwen2_moe", "qwen3_moe"]
_MODELS = {}


def model_of(key):
    if key not in _MODELS:
        _MODELS[key] = build_moe(key, "lm")
    return _MODELS[key]


def positions(mask):
    return (mask.cumsum(-1) - 1).clamp_min(0)


def real_ff(model, ids, mask, extra_hooks=()):
    r"""Per layer, the real FF output (B, T, D) and the routing the experts module was called with, from a
    plain forward pass (the model's own attention and expert kernels)."""
    out, routing, handles = {}, {}, []
    for l, layer in enumerate(model.model.layers):
        handles.append(layer.mlp.register_forward_hook(lambda m, a, o, l=l: out.__setitem__(l, o.detach().clone())))
        handles.append(layer.mlp.experts.register_forward_pre_hook(
            lambda m, a, l=l: routing.__setitem__(l, (a[1].clone(), a[2].clone()))))
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=positions(mask))
    finally:
        for h in handles:
            h.remove()
    return out, routing


def recorded_layers(model, ids, mask):
    layers = []
    with torch.no_grad(), recording(model, get_adapter(model), layers.append, torch.float64):
        model(input_ids=ids, attention_mask=mask, position_ids=positions(mask))
    return layers


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("key", KEYS)
def test_routing_is_non_trivial(key):
    ids, mask = decoder_batch([6, 4], seed=1)
    _, routing = real_ff(model_of(key), ids, mask)
    for index, _ in routing.values():
        sets = {tuple(sorted(r)) for r in index.tolist()}
        assert len(set(index.flatten().tolist())) >= 3 and len(sets) >= 3, sets  # tokens choose different experts


@pytest.mark.parametrize("key", KEYS)
def test_ff_parts_sum_to_the_real_ff_output_per_token(key):
    model = model_of(key)
    ids, mask = decoder_batch([6, 4], seed=1)
    real, _ = real_ff(model, ids, mask)
    valid = mask.bool()
    for layer in recorded_layers(model, ids, mask):
        t = ids.shape[1]
        parts, bias = pre_ln_ff_parts(layer, slice(0, t))
        total = parts.sum(2) + bias  # (B, T, D)
        want = real[layer.index]
        err = ((total - want).abs().amax(-1) / want.abs().amax(-1))[valid]
        assert float(err.max()) < 1e-10, float(err.max())
        assert float(layer.checks["feed-forward output rebuilt from its input and weights (last position)"]) < 1e-12


@pytest.mark.parametrize("key", KEYS)
def test_routing_is_the_one_of_the_real_forward_pass(key):
    r"""A router patched to send every token to the next expert changes the model's FF output; the decomposition
    follows the real routing (the experts module's arguments), while routing recomputed from the router's input and
    weights, as the module would without the patch, misses the real FF output at O(1)."""
    model = build_moe(key, "lm")
    num = model.config.num_experts if key != "mixtral" else model.config.num_local_experts

    def reroute(module, args, output):
        logits, weights, index = output
        return logits, weights, (index + 1) % num

    handles = [layer.mlp.gate.register_forward_hook(reroute) for layer in model.model.layers]
    try:
        ids, mask = decoder_batch([6, 4], seed=1)
        real, routing = real_ff(model, ids, mask)
        layers = recorded_layers(model, ids, mask)
    finally:
        for h in handles:
            h.remove()
    valid = mask.bool()
    for layer in layers:
        parts, bias = pre_ln_ff_parts(layer, slice(0, ids.shape[1]))
        assert _rel((parts.sum(2) + bias)[valid], real[layer.index][valid]) < 1e-10
        # the wrong variant: the routing recomputed from the FF input and the router weights
        mlp = model.model.layers[layer.index].mlp
        u = layer.ln2_out.reshape(-1, layer.ln2_out.shape[-1])
        with torch.no_grad():
            _, w, idx = mlp.gate(u)
            assert not torch.equal(idx, routing[layer.index][0])
            recomputed = mlp.experts(u, idx, w)
            if hasattr(mlp, "shared_expert"):
                recomputed = recomputed + torch.sigmoid(mlp.shared_expert_gate(u)) * mlp.shared_expert(u)
        assert _rel(recomputed.reshape(real[layer.index].shape)[valid], real[layer.index][valid]) > 1e-2


def _silu_integrals(a):
    r"""I1 = int_0^1 t g'(t a) dt and I2 = int_0^1 g(t a) dt of g = SiLU, by a 200-node Gauss-Legendre rule (numpy)."""
    import numpy as np

    x, w = np.polynomial.legendre.leggauss(200)
    t = torch.tensor((x + 1) / 2, dtype=a.dtype)
    w = torch.tensor(w / 2, dtype=a.dtype)
    s = t[:, None] * a[None]
    sig = torch.sigmoid(s)
    return (w[:, None] * t[:, None] * (sig + s * sig * (1 - sig))).sum(0), (w[:, None] * s * sig).sum(0)


def _expert_parts(u_parts, w_gate, w_up, w_down, scale):
    r"""Integrated-gradient parts of scale * (silu(u W_gate) * (u W_up)) W_down for parts u_parts (P, D) of u."""
    a_p, b_p = u_parts @ w_gate, u_parts @ w_up
    a, b = a_p.sum(0), b_p.sum(0)
    i1, i2 = _silu_integrals(a)
    return scale * ((a_p * b * i1 + b_p * i2) @ w_down)


@pytest.mark.parametrize("key", KEYS)
def test_one_token_equals_a_naive_per_expert_reference(key):
    r"""Token i's FF parts, written out per chosen expert from the model's own 3-D expert weights (chunk into
    gate and up), the real routing weights and, for Qwen2-MoE, the shared expert times its real sigmoid gate."""
    model = model_of(key)
    ids, mask = decoder_batch([6], seed=4)
    _, routing = real_ff(model, ids, mask)
    i = 4
    with torch.no_grad():
        _naive_token(model, ids, mask, routing, i)


def _naive_token(model, ids, mask, routing, i):
    for layer in recorded_layers(model, ids, mask):
        mlp = model.model.layers[layer.index].mlp
        t = ids.shape[1]
        h = residual_parts(layer)[0, i]  # (T, D) parts h_{i<-j} of the LN2 input (validated by the zoo's reference)
        h = torch.cat([h, output_bias(layer)[None]])  # the bias part b_O
        ln2 = model.model.layers[layer.index].post_attention_layernorm
        u_parts = h / torch.sqrt(layer.ln2_in[0, i].pow(2).mean() + ln2.eps) * ln2.weight  # RMSNorm at the real scale
        index, weights = routing[layer.index]
        want = torch.zeros_like(u_parts)
        for slot in range(index.shape[1]):
            e = int(index[i, slot])
            gate, up = mlp.experts.gate_up_proj[e].chunk(2, dim=0)  # (F, D) each: gate first
            want += _expert_parts(u_parts, gate.T, up.T, mlp.experts.down_proj[e].T, float(weights[i, slot]))
        if hasattr(mlp, "shared_expert"):
            s = mlp.shared_expert
            g = float(torch.sigmoid(mlp.shared_expert_gate(layer.ln2_out[0, i])))
            want += _expert_parts(u_parts, s.gate_proj.weight.T, s.up_proj.weight.T, s.down_proj.weight.T, g)
        parts, bias = pre_ln_ff_parts(layer, slice(i, i + 1))
        got = torch.cat([parts[0, 0], bias[0]])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12 * float(want.abs().max()))
        assert float(got[i + 1 : t].abs().max()) == 0  # causal: later tokens have no part


@pytest.mark.parametrize("key", KEYS)
def test_padded_equals_single(key):
    model = model_of(key)
    ids, mask = decoder_batch([6, 4], seed=5)
    t = ids.shape[1]
    padded = recorded_layers(model, ids, mask)
    alone = recorded_layers(model, ids[1:, t - 4:], mask[1:, t - 4:])
    for lp, la in zip(padded, alone):
        p, pb = pre_ln_ff_parts(lp, slice(t - 4, t))
        a, ab = pre_ln_ff_parts(la, slice(0, 4))
        scale = float(a.abs().max())
        torch.testing.assert_close(p[1, :, t - 4:], a[0], rtol=0, atol=1e-10 * scale)
        torch.testing.assert_close(pb[1], ab[0], rtol=0, atol=1e-10 * scale)
    dx = DecompXAttribution(model)
    res = dx.decompose(ids, target=5, additional_forward_args=mask)
    one = dx.decompose(ids[1:, t - 4:], target=5)
    torch.testing.assert_close(res.scores[1, t - 4:], one.scores[0], rtol=0, atol=1e-9 * float(one.scores.abs().max()))


def test_the_ff_guard_fires_when_the_experts_compute_something_else():
    r"""An experts module whose output a hook scales (the FF is then no longer the described one): the FF rebuilt
    from the weights and the recorded routing at the last position misses the real FF output."""
    model = build_moe("qwen2_moe", "lm")
    handle = model.model.layers[1].mlp.experts.register_forward_hook(lambda m, a, o: o * 1.5)
    ids, mask = decoder_batch([6, 4], seed=1)
    try:
        with pytest.raises(ConsistencyError, match="layer 1 .*feed-forward output rebuilt"):
            FFIntegratedDecomposition(model, strict=True).attribute(ids, additional_forward_args=(mask,))
    finally:
        handle.remove()


def test_the_ff_guard_fires_when_the_expert_weights_are_read_in_another_layout():
    r"""The eager experts always split gate_up_proj as [gate | up]; a module flag claiming the interleaved layout
    makes the package read other weights than the model computes with: the FF guard names it."""
    model = build_moe("mixtral", "lm")
    model.model.layers[0].mlp.experts.is_concatenated = False
    ids, mask = decoder_batch([6, 4], seed=1)
    with pytest.raises(ConsistencyError, match="layer 0 .*feed-forward output rebuilt"):
        FFIntegratedDecomposition(model, strict=True).attribute(ids, additional_forward_args=(mask,))


def test_dense_layers_of_a_sparse_family():
    r"""Qwen2-MoE with layer 1 dense (``mlp_only_layers``): that layer is read as the dense gated FF of the
    description; every method still sums to the model's logit."""
    model = build_moe("qwen2_moe", "lm", mlp_only_layers=[1])
    assert not hasattr(model.model.layers[1].mlp, "experts") and hasattr(model.model.layers[0].mlp, "experts")
    ids, mask = decoder_batch([6, 4], seed=2)
    layers = recorded_layers(model, ids, mask)
    assert layers[0].ff.hidden_scale is not None and layers[1].ff.hidden_scale is None
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits[:, -1]
    target = logits.argmax(-1)
    expect = logits.gather(1, target[:, None])[:, 0]
    res = ALTILogitAttribution(model, strict=True).decompose(ids, target=target, additional_forward_args=(mask,))
    assert _rel(res.scores.sum(-1) + res.no_token_total, expect) < 1e-10
    dx = DecompXAttribution(model, strict=True).decompose(ids, target=target, additional_forward_args=mask)
    assert _rel(dx.class_scores.sum(1)[:, 0] + dx.bias_scores[:, 0], expect) < 1e-10
    ff = FFIntegratedDecomposition(model, strict=True).decompose(ids, additional_forward_args=(mask,))
    assert float(ff.extras["completeness_error"].max()) < 1e-10 * float(layers[0].ff_out.abs().max())


def test_the_experts_input_guard_fires():
    model = build_moe("mixtral", "lm")

    def shift(module, args):
        return (args[0] + 0.1,) + tuple(args[1:])

    handle = model.model.layers[0].mlp.experts.register_forward_pre_hook(shift)
    ids, mask = decoder_batch([6, 4], seed=1)
    try:
        with pytest.raises(ConsistencyError, match="experts input vs the second norm's output"):
            FFIntegratedDecomposition(model, strict=True).attribute(ids, additional_forward_args=(mask,))
    finally:
        handle.remove()


#: float32 with the default grouped_mm kernel: the logits are sums of O(10) terms of magnitude O(10) through
#: 2 layers computed in float32 by the model and by the decomposition (eps 6e-8); measured at most 5.3e-7
#: relative (ALTI-Logit 2.5e-7, DecompX 2.0e-7, FF parts 5.3e-7 of the largest FF output): a 40x margin
FLOAT32_TOLERANCE = 2e-5


@pytest.mark.parametrize("key", KEYS)
def test_float32_with_the_default_grouped_mm_kernel(key):
    model = build_moe(key, "lm", dtype=torch.float32, experts_implementation="grouped_mm")
    assert model.config._experts_implementation == "grouped_mm"
    ids, mask = decoder_batch([6, 4], seed=1)
    with pytest.raises(RuntimeError, match="Float32|Double"):  # the kernel refuses float64
        with torch.no_grad():
            build_moe(key, "lm", experts_implementation="grouped_mm")(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits[:, -1].double()
    target = logits.argmax(-1)
    expect = logits.gather(1, target[:, None])[:, 0]
    res = ALTILogitAttribution(model, strict=True).decompose(ids, target=target, additional_forward_args=(mask,))
    assert _rel((res.scores.sum(-1) + res.no_token_total).double(), expect) < FLOAT32_TOLERANCE
    dx = DecompXAttribution(model, strict=True).decompose(ids, target=target, additional_forward_args=mask)
    assert _rel((dx.class_scores.sum(1)[:, 0] + dx.bias_scores[:, 0]).double(), expect) < FLOAT32_TOLERANCE
    ff = FFIntegratedDecomposition(model, strict=True).decompose(ids, additional_forward_args=(mask,))
    real, _ = real_ff(model, ids, mask)
    scale = max(float(v.abs().max()) for v in real.values())
    assert float(ff.extras["completeness_error"].max()) < FLOAT32_TOLERANCE * scale


@pytest.mark.parametrize("head", ["bare", "cls"])
@pytest.mark.parametrize("key", KEYS)
def test_bare_and_classifier_models(key, head):
    r"""The bare ``*Model`` and ``*ForSequenceClassification``: the attention maps and FF scopes complete (the
    FF parts against the recorded real FF output), padded == single for the FF maps."""
    from captum_normattr import ALTIAttribution, GlobEncAttribution

    model = build_moe(key, head)
    ids, mask = decoder_batch([6, 4], seed=3)
    t = ids.shape[1]
    for cls in (GlobEncAttribution, ALTIAttribution, FFIntegratedDecomposition):
        attr = cls(model, strict=True)
        res = attr.decompose(ids, additional_forward_args=(mask,))
        err = res.extras.get("completeness_error")
        if err is not None:
            assert float(err.max()) < 1e-9 * max(1.0, float(res.layer_maps.abs().max()))
        alone = attr.decompose(ids[1:, t - 4:])
        torch.testing.assert_close(res.scores[1, t - 4:], alone.scores[0], rtol=0,
                                   atol=1e-9 * float(res.scores.abs().max()))
