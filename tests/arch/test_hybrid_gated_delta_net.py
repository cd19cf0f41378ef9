r"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE: Gated DeltaNet layers beside gated attention layers.

The Gated DeltaNet against a naive per-token reference (explicit loops over targets, source tokens, recurrence
steps and kernel taps, from the module's own projections on the real layer input: the recorded per-channel mixing
tensor, the values and the mixer's real output); the gated attention's per-channel probabilities against their
definition; every method (GlobEnc, ALTI, FF, DecompX, ALTI-Logit, routes, the LLM API) on the tiny float64 models
(tests/fixtures/zoo_linear_attention.py): token scores plus no-token terms equal the model's own logit (relative
1e-10), a left-padded example equals the example alone, the model is unchanged; the mixers follow ``layer_types``;
the value layouts read the right weight rows; the multimodal composites and Value Zeroing are refused with the
reason.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from captum_normattr import (
    DecompXAttribution,
    UnsupportedModelError,
)
from captum_normattr.arch import ARCHITECTURES, lookup
from captum_normattr.arch.families.vlm import VISION_LANGUAGE
from captum_normattr.arch.families.hybrid import QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT, QWEN3_NEXT_DELTA_NET
from captum_normattr.arch.registry import REFUSED, refusal
from captum_normattr.arch.spec import Attention, ValueProjection
from captum_normattr.attr.routes import InformationFlowRoutes
from captum_normattr.attr.value_zeroing import ValueZeroingAttribution
from captum_normattr.models.adapters import family_methods, get_adapter, layer_adapters, layer_modules, value_projection
from hybrid_checks import check_every_method_exact, check_llm_continuation_exact
from decoder_models import decoder_batch
from layer_capture import capture_layers
from zoo_linear_attention import build_linear_attention
from map_checks import check_maps_complete

KEYS = ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"]
SPECS = {"qwen3_next": QWEN3_NEXT, "qwen3_5_text": QWEN3_5, "qwen3_5_moe_text": QWEN3_5_MOE}
KINDS = ["gated_delta_net", "softmax", "gated_delta_net", "gated_delta_net"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _projections(mod: torch.nn.Module, u: torch.Tensor):
    r"""q, k, v (B, T, width) and b, a (B, T, H_v) from the module's own projections and reordering."""
    if hasattr(mod, "in_proj_qkvz"):  # Qwen3-Next: its own fix_query_key_value_ordering
        q, k, v, _, b, a = mod.fix_query_key_value_ordering(mod.in_proj_qkvz(u), mod.in_proj_ba(u))
        return (*(t.reshape(*u.shape[:2], -1) for t in (q, k, v)), b, a)
    q, k, v = mod.in_proj_qkv(u).split([mod.key_dim, mod.key_dim, mod.value_dim], -1)
    return q, k, v, mod.in_proj_b(u), mod.in_proj_a(u)


def _naive_delta_net(mod: torch.nn.Module, u: torch.Tensor, gate: torch.Tensor):
    r"""The Gated DeltaNet by explicit loops, from its weights, its input ``u`` (B, T, D) (padding already zeroed)
    and the gate z (B, T, C) of its norm: (G (B, C, T, T), values (B, T, C), output projection input (B, T, C))."""
    with torch.no_grad():
        q, k, v, b, a = _projections(mod, u)
    bsz, t, _ = u.shape
    hk, hv, dk, dv = mod.num_k_heads, mod.num_v_heads, mod.head_k_dim, mod.head_v_dim
    w = mod.conv1d.weight.detach()[:, 0, :]  # (conv_dim, K), tap K - 1 on the current token
    kernel = w.shape[1]
    x = torch.cat([q, k, v], -1).detach()
    pre = torch.zeros_like(x)
    for ti in range(t):
        for j in range(kernel):
            src = ti + j - (kernel - 1)
            if src >= 0:
                pre[:, ti] += w[:, j] * x[:, src]
    pq, pk, pv = pre.split([hk * dk, hk * dk, hv * dv], -1)

    def unit(x):  # transformers' l2norm: x / sqrt(|x|^2 + 1e-6)
        x = F.silu(x).reshape(bsz, t, hk, dk)
        return x / ((x ** 2).sum(-1, keepdim=True) + 1e-6).sqrt()

    query, key = unit(pq), unit(pk)
    beta = torch.sigmoid(b.detach())
    decay = torch.exp(-mod.A_log.detach().exp() * F.softplus(a.detach() + mod.dt_bias.detach()))
    eye = torch.eye(dk, dtype=u.dtype)
    core = torch.zeros(bsz, t, hv * dv, dtype=u.dtype)
    M = torch.zeros(bsz, hv, t, t, dtype=u.dtype)
    for n in range(bsz):
        for h in range(hv):
            kh = h // (hv // hk)
            for ti in range(t):
                for s in range(ti + 1):
                    P = eye.clone()
                    for r in range(s + 1, ti + 1):
                        kr = key[n, r, kh]
                        P = P @ (decay[n, r, h] * (eye - beta[n, r, h] * torch.outer(kr, kr)))
                    M[n, h, ti, s] = beta[n, s, h] * key[n, s, kh] @ P @ query[n, ti, kh] / dk ** 0.5
                    core[n, ti, h * dv:(h + 1) * dv] += M[n, h, ti, s] * F.silu(pv[n, s, h * dv:(h + 1) * dv])
    # the gated RMSNorm (norm before gate), per value head, as a per-target scale
    heads = core.reshape(bsz, t, hv, dv)
    inv = torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + mod.norm.variance_epsilon).expand_as(heads).reshape(core.shape)
    gamma = mod.norm.weight.detach().repeat(hv) * F.silu(gate) * inv
    channels = hv * dv
    G = torch.zeros(bsz, channels, t, t, dtype=u.dtype)
    for n in range(bsz):
        for c in range(channels):
            h = c // dv
            for ti in range(t):
                for s in range(ti + 1):
                    slope = torch.sigmoid(pv[n, s, c])
                    for j in range(kernel):
                        src = s + j - (kernel - 1)
                        if src >= 0:
                            G[n, c, ti, src] += gamma[n, ti, c] * M[n, h, ti, s] * slope * w[2 * hk * dk + c, j]
    return G, v.detach(), gamma * core


def _norm_gates(model, ids, mask):
    r"""The gate z (B, T, C) each Gated DeltaNet's norm receives, by layer index (positions from the mask, as the
    decompositions run a left-padded example)."""
    gates, hooks = {}, []
    for i, layer in enumerate(layer_modules(model, get_adapter(model))):
        if hasattr(layer, "linear_attn"):
            hooks.append(layer.linear_attn.norm.register_forward_hook(
                lambda m, args, out, i=i: gates.__setitem__(i, args[1].detach())))
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
    finally:
        for h in hooks:
            h.remove()
    return gates


@pytest.mark.parametrize("key", KEYS)
def test_recorded_mixing_is_the_naive_one_and_follows_layer_types(key):
    model = build_linear_attention(key, "lm")
    ids, mask = decoder_batch([6, 4], seed=3)
    layers = capture_layers(model, ids, mask)
    assert [la.layer.attention.mixer for la in layer_adapters(model, get_adapter(model))] == KINDS
    gates = _norm_gates(model, ids, mask)
    t = ids.shape[1]
    for i, lt in enumerate(layers):
        module = layer_modules(model, get_adapter(model))[i]
        if KINDS[i] == "softmax":
            continue
        mod = module.linear_attn
        u = lt.ln1_out * mask[..., None].to(lt.ln1_out.dtype)  # the mixer zeroes the input of padding tokens
        g, v, y = _naive_delta_net(mod, u, gates[i].reshape(2, t, -1))
        g = g * mask[:, None, None, :].to(g.dtype)  # padding sources: no part (their values are 0 in the model)
        assert lt.probs.shape == (2, 24, t, t) and lt.values.shape == (2, 24, t, 1)
        assert _rel(lt.probs, g) < 1e-12 and float(g.abs().max()) > 0
        assert _rel(lt.values[..., 0].transpose(1, 2)[mask.bool()], v[mask.bool()]) < 1e-12
        assert _rel(lt.context[..., 0], y) < 1e-12  # the module's own output projection input
        ctx = torch.einsum("bcts,bcsd->btc", lt.probs, lt.values)
        assert _rel(ctx, lt.context[..., 0]) < 1e-12
    other = build_linear_attention(key, "lm", layer_types=["full_attention", "linear_attention"] * 2)
    kinds = [la.layer.attention.mixer for la in layer_adapters(other, get_adapter(other))]
    assert kinds == ["softmax", "gated_delta_net"] * 2


@pytest.mark.parametrize("key", KEYS)
def test_gated_attention_is_recorded_per_channel(key):
    r"""p[h Dh + c, t, s] = p_h[t, s] sigmoid(g_t[h, c]) with g from q_proj's gate half: divided by the gate, the
    Dh channels of a head are one softmax row summing to 1 over the real sources; sum_s p v is the o_proj input."""
    model = build_linear_attention(key, "lm")
    ids, mask = decoder_batch([6, 4], seed=5)
    lt = capture_layers(model, ids, mask)[1]
    attn = layer_modules(model, get_adapter(model))[1].self_attn
    t, heads, dh = ids.shape[1], 4, 6
    with torch.no_grad():
        gate = attn.q_proj(lt.ln1_out).reshape(2, t, heads, 2 * dh)[..., dh:]
    assert lt.probs.shape == (2, heads * dh, t, t) and lt.values.shape == (2, heads * dh, t, 1)
    p = lt.probs.reshape(2, heads, dh, t, t) / torch.sigmoid(gate).permute(0, 2, 3, 1)[..., None]
    assert float((p - p[:, :, :1]).abs().max()) < 1e-12  # one p_h per head
    real = mask.bool()
    assert float((p[:, :, 0].sum(-1) - 1).abs()[real[:, None, :].expand(2, heads, t)].max()) < 1e-12
    assert _rel(torch.einsum("bcts,bcsd->btc", lt.probs, lt.values), lt.context[..., 0]) < 1e-12
    # the values are the value projection's columns, one per query-head channel (GQA expanded)
    w_v, _ = value_projection(layer_modules(model, get_adapter(model))[1], get_adapter(model))
    assert w_v.shape == (24, heads * dh)
    assert _rel((lt.ln1_out @ w_v.to(lt.ln1_out.dtype)).transpose(1, 2)[..., None][:, :, real[1]][1:],
                lt.values[:, :, real[1]][1:]) < 1e-12


@pytest.mark.parametrize("key", KEYS)
def test_delta_net_value_layout_reads_the_value_rows(key):
    r"""The value projection's columns (delta_grouped: per key head [q | k | v | z]; delta_split: [q | k | v]) give
    the recorded values: the value channels the mixer's forward reads."""
    model = build_linear_attention(key, "lm")
    ids, mask = decoder_batch([6, 6], seed=7)
    lt = capture_layers(model, ids, mask)[0]
    w_v, b_v = value_projection(layer_modules(model, get_adapter(model))[0], get_adapter(model))
    assert b_v is None and w_v.shape == (24, 24)
    assert _rel(lt.ln1_out @ w_v.to(lt.ln1_out.dtype), lt.values[..., 0].transpose(1, 2)) < 1e-12


def test_families_are_registered_and_the_composites_are_vision_language_families():
    for key, spec in SPECS.items():
        assert ARCHITECTURES[key] is spec and lookup(key) is spec and key not in REFUSED
        assert family_methods(spec) == ("GlobEnc", "ALTI", "FF", "DecompX", "ALTI-Logit")
        assert "Gated DeltaNet mixer layers" in spec.features()
        assert "attention output gated per channel" in spec.features()
        assert spec.mixer_summary() == "softmax attention (output gate) + Gated DeltaNet, per layer type"
    # the multimodal wrappers are vision-language families around these decoders (tests/attr/test_vlm_qwen3.py)
    assert refusal("qwen3_5") is None and VISION_LANGUAGE["qwen3_5"].text_families == ("qwen3_5_text",)
    assert refusal("qwen3_5_moe") is None and VISION_LANGUAGE["qwen3_5_moe"].text_families == ("qwen3_5_moe_text",)


@pytest.mark.parametrize("key", KEYS)
def test_every_method_is_exact_padding_free_and_leaves_the_model(key):
    model = build_linear_attention(key, "lm")
    check_every_method_exact(model)


@pytest.mark.parametrize("key,head", [(k, "bare") for k in KEYS] + [(k, "cls") for k in KEYS[:2]])
def test_bare_model_and_classifier_maps_are_complete(key, head):
    model = build_linear_attention(key, head)
    ids, mask = decoder_batch([6, 4], seed=9)
    check_maps_complete(model, ids, (mask,))
    if head == "cls":
        with pytest.raises(UnsupportedModelError, match="classification head"):
            DecompXAttribution(model)


@pytest.mark.parametrize("key", KEYS)
def test_llm_api_explains_a_continuation_exactly(key):
    model = build_linear_attention(key, "lm")
    check_llm_continuation_exact(model)


def test_the_zoos_float64_kernels_are_the_familys_own():
    r"""The float64 builds change only rounding: the model as transformers runs it (float32 norms and kernels)."""
    ids, mask = decoder_batch([6, 4], seed=12)
    for key in KEYS:
        own, exact = build_linear_attention(key, "lm", exact=False), build_linear_attention(key, "lm")
        with torch.no_grad():
            a = own(input_ids=ids, attention_mask=mask).logits[mask.bool()]
            b = exact(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        assert 0 < _rel(a, b) < 1e-5


def test_value_zeroing_is_refused_with_the_reason():
    with pytest.raises(UnsupportedModelError, match="Value Zeroing.*gated_delta_net"):
        ValueZeroingAttribution(build_linear_attention("qwen3_next", "lm"))


def test_mixer_descriptions_are_validated():
    with pytest.raises(ValueError, match="names its conv"):
        replace(QWEN3_NEXT_DELTA_NET, conv=None)
    with pytest.raises(ValueError, match="gated_delta_net mixer reads its values"):
        replace(QWEN3_NEXT_DELTA_NET, value=ValueProjection("linear_attn.in_proj_qkvz", "fused", 2, 4))
    with pytest.raises(ValueError, match="belongs to a gated_delta_net mixer"):
        Attention("self_attn", out="self_attn.o_proj", value=ValueProjection("x", "delta_split", 2, 3))
    with pytest.raises(ValueError, match="slice 2 of 4"):
        ValueProjection("linear_attn.in_proj_qkvz", "delta_grouped", 3, 4)
    with pytest.raises(ValueError, match="output gate"):
        Attention("self_attn", out="self_attn.o_proj", value=ValueProjection("qkv", "fused", 2, 3),
                  output_gate="self_attn.q_proj")
    with pytest.raises(ValueError, match="mixer_types"):
        replace(QWEN3_NEXT, layer=replace(QWEN3_NEXT.layer, mixer_types=None))


def test_a_description_on_a_wrong_module_is_refused_with_the_reason():
    r"""A Gated DeltaNet description whose sizes do not give the projection's width names the numbers."""
    model = build_linear_attention("qwen3_next", "lm")
    layer = layer_modules(model, get_adapter(model))[0]
    spec = replace(QWEN3_NEXT, layer=replace(QWEN3_NEXT.layer, mixers=(("linear_attention", replace(
        QWEN3_NEXT_DELTA_NET, value=ValueProjection("linear_attn.in_proj_qkvz", "delta_split", 2, 3))),)))
    with pytest.raises(ValueError, match="delta_split input projection has 80 outputs, not the 56"):
        value_projection(layer, spec.for_layer(layer, "linear_attention"))


@pytest.mark.parametrize("last", ["linear_attention", "full_attention"])
def test_routes_head_tables_span_layers_with_different_head_counts(last):
    r"""A Gated DeltaNet layer has one head per value channel (24), a gated attention layer one per channel (24)."""
    model = build_linear_attention("qwen3_5_text", "lm", layer_types=["linear_attention", "full_attention",
                                                                      "linear_attention", last])
    ids = torch.randint(3, 50, (1, 6), generator=torch.Generator().manual_seed(0))
    g = InformationFlowRoutes(model).attribute(ids, threshold=0.0, granularity="head")
    assert g.num_heads == 24
    assert g.head_importance().shape == (4, 24) and float(g.head_importance()[1].sum()) > 0
