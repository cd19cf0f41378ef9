r"""Granite 4, the hybrid family with Mamba-2 mixers (``captum_normattr.arch.families.state_space``).

The Mamba-2 mixer against a naive per-token reference (explicit loops over targets, source tokens, scan steps and
kernel taps, from the module's own weights and its real input: the recorded per-channel mixing tensor, the values
and the mixer's output); every method (GlobEnc, ALTI, FF, DecompX, ALTI-Logit, routes, the LLM API) on the tiny
float64 Granite 4 (tests/fixtures/zoo_state_space.py): token scores plus no-token terms equal the model's own logit
(relative 1e-10), a left-padded example equals the example alone, the model is unchanged; the mixer follows
``layer_types``; a convolution bias, experts beside the shared MLP, an input-projection bias and Value Zeroing are
refused with the reason. Nemotron-H's single-branch layers with the same mixer: tests/arch/test_hybrid_nemotron_h.py.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from captum.attr import TextTokenInput

from captum_normattr import (
    ALTIAttribution,
    ALTILogitAttribution,
    FFIntegratedDecomposition,
    GlobEncAttribution,
    UnsupportedModelError,
)
from captum_normattr.arch import ARCHITECTURES, lookup
from captum_normattr.arch.families.state_space import GRANITE4, GRANITE4_MAMBA2
from captum_normattr.arch.registry import REFUSED, refusal
from captum_normattr.arch.spec import Attention, ValueProjection
from captum_normattr.attr.llm import DecompositionLLMAttribution
from captum_normattr.attr.value_zeroing import ValueZeroingAttribution
from captum_normattr.models.adapters import family_methods, get_adapter, layer_adapters, layer_modules
from hybrid_checks import check_every_method_exact
from decoder_models import decoder_batch
from layer_capture import capture_layers
from llm_tiny import tiny_tokenizer
from zoo_state_space import build_state_space


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _silu(a: float) -> float:
    return a / (1.0 + math.exp(-a))


def _naive_mamba2(mixer: torch.nn.Module, x: torch.Tensor, valid: torch.Tensor):
    r"""The mixer by explicit loops: (G (B, C, T, T), u (B, T, C), y (B, T, C) the output projection's input), from
    the module's weights and its input ``x`` (B, T, D); ``valid`` (B, T) the tokens it does not zero."""
    inner, groups, state, heads = mixer.intermediate_size, mixer.n_groups, mixer.ssm_state_size, mixer.num_heads
    w = mixer.conv1d.weight.detach()[:, 0, :]  # (C_conv, K), tap K - 1 on the current token
    k = w.shape[1]
    proj = (x * valid[..., None]) @ mixer.in_proj.weight.detach().T
    z, xbc, dt_raw = proj[..., :inner], proj[..., inner:inner + mixer.conv_dim], proj[..., inner + mixer.conv_dim:]
    bsz, t, _ = x.shape
    pre = torch.zeros_like(xbc)
    for n in range(bsz):
        for ti in range(t):
            for j in range(k):
                s = ti - (k - 1 - j)
                if s >= 0:
                    pre[n, ti] += w[:, j] * xbc[n, s]
    act = pre * torch.sigmoid(pre) * valid[..., None]
    v, b_in, c_out = act[..., :inner], act[..., inner:inner + groups * state], act[..., inner + groups * state:]
    dt = torch.nn.functional.softplus(dt_raw + mixer.dt_bias.detach())
    a = -torch.exp(mixer.A_log.detach().float()).double()
    per_head, per_group = inner // heads, heads // groups
    m = torch.zeros(bsz, heads, t, t, dtype=x.dtype)
    for n in range(bsz):
        for h in range(heads):
            g = h // per_group
            for ti in range(t):
                for s in range(ti + 1):
                    decay = math.exp(sum(float(dt[n, r, h] * a[h]) for r in range(s + 1, ti + 1)))
                    score = float(c_out[n, ti, g * state:(g + 1) * state] @ b_in[n, s, g * state:(g + 1) * state])
                    m[n, h, ti, s] = score * decay * float(dt[n, s, h]) + (float(mixer.D[h]) if s == ti else 0.0)
    core = torch.zeros(bsz, t, inner, dtype=x.dtype)
    for c in range(inner):
        core[..., c] = torch.einsum("bts,bs->bt", m[:, c // per_head], v[..., c])
    gated = core * torch.nn.functional.silu(z)
    size = mixer.norm.group_size
    y = torch.zeros_like(core)
    gamma = torch.zeros_like(core)
    for n in range(bsz):
        for ti in range(t):
            for g0 in range(0, inner, size):
                rms = math.sqrt(float(gated[n, ti, g0:g0 + size].pow(2).mean()) + mixer.norm.variance_epsilon)
                for c in range(g0, g0 + size):
                    gamma[n, ti, c] = float(mixer.norm.weight[c]) * _silu(float(z[n, ti, c])) / rms
                    y[n, ti, c] = gamma[n, ti, c] * core[n, ti, c]
    slope = torch.sigmoid(pre[..., :inner]) * valid[..., None]
    big = torch.zeros(bsz, inner, t, t, dtype=x.dtype)
    for n in range(bsz):
        for c in range(inner):
            for ti in range(t):
                for s in range(ti + 1):
                    p = gamma[n, ti, c] * m[n, c // per_head, ti, s] * slope[n, s, c]
                    for j in range(k):
                        src = s - (k - 1 - j)
                        if src >= 0 and valid[n, src]:
                            big[n, c, ti, src] += p * w[c, j]
    return big, xbc[..., :inner], y


def test_recorded_mixing_is_the_naive_one_rebuilds_the_mixer_and_follows_layer_types():
    model = build_state_space("granitemoehybrid", "lm")
    ids, mask = decoder_batch([7, 5], seed=3)
    layers = capture_layers(model, ids, mask)
    kinds = [la.layer.attention.mixer for la in layer_adapters(model, get_adapter(model))]
    assert kinds == ["mamba2", "softmax", "mamba2", "mamba2"]
    modules = layer_modules(model, get_adapter(model))
    for i in (0, 2):
        lt = layers[i]
        with torch.no_grad():
            g, u, y = _naive_mamba2(modules[i].mamba, lt.ln1_out, mask.bool())
        assert lt.probs.shape == (2, 48, ids.shape[1], ids.shape[1]) and lt.values.shape == (2, 48, ids.shape[1], 1)
        assert _rel(lt.probs, g) < 1e-12 and float(g.abs().max()) > 0
        assert _rel(lt.values[..., 0].transpose(1, 2)[mask.bool()], u[mask.bool()]) < 1e-12
        assert _rel(lt.context[..., 0], y) < 1e-12  # the mixer's own output projection input
        rebuilt = torch.einsum("bcts,bcs->btc", lt.probs, lt.values[..., 0])
        assert _rel(rebuilt, y) < 1e-12
        shifted = torch.einsum("bcts,bcs->btc", torch.roll(lt.probs, 1, dims=-1), lt.values[..., 0])
        assert _rel(shifted, y) > 1e-3
        assert float(lt.probs[1, :, :, :ids.shape[1] - 5].abs().max()) == 0  # padding sources reach nothing
    other = build_state_space("granitemoehybrid", "lm", layer_types=["full_attention", "linear_attention"] * 2)
    assert [la.layer.attention.mixer for la in layer_adapters(other, get_adapter(other))] == ["softmax", "mamba2"] * 2


def test_granite4_is_registered():
    assert ARCHITECTURES["granitemoehybrid"] is GRANITE4 and lookup("granitemoehybrid") is GRANITE4
    assert "granitemoehybrid" not in REFUSED and refusal("granitemoehybrid") is None
    assert family_methods(GRANITE4) == ("GlobEnc", "ALTI", "FF", "DecompX", "ALTI-Logit")
    assert "Mamba-2 mixer layers" in GRANITE4.features()
    assert "Mamba-2" in GRANITE4.mixer_summary()


def test_every_method_is_exact_padding_free_and_leaves_the_model():
    model = build_state_space("granitemoehybrid", "lm")
    check_every_method_exact(model, lengths=(9, 6))


def test_the_zoos_exact_scan_and_norms_are_the_familys_own():
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as mg
    from zoo_state_space import _ORIGINAL_SCAN, exact_chunk_scan

    ids, mask = decoder_batch([9, 6], seed=12)
    exact = build_state_space("granitemoehybrid", "lm")
    with torch.no_grad():
        b = exact(input_ids=ids, attention_mask=mask, use_cache=False).logits[mask.bool()]
    mg.mamba2_chunk_scan = _ORIGINAL_SCAN  # transformers' own chunked scan (float32 inside)
    try:
        own = build_state_space("granitemoehybrid", "lm", exact=False)
        with torch.no_grad():
            a = own(input_ids=ids, attention_mask=mask, use_cache=False).logits[mask.bool()]
    finally:
        mg.mamba2_chunk_scan = exact_chunk_scan
    assert _rel(a, b) < 1e-5


def test_bare_model_maps_are_complete():
    model = build_state_space("granitemoehybrid", "bare")
    ids, mask = decoder_batch([7, 5], seed=9)
    for cls in (GlobEncAttribution, ALTIAttribution, FFIntegratedDecomposition):
        res = cls(model, strict=True).decompose(ids, additional_forward_args=(mask,))
        err = res.extras.get("completeness_error")
        if err is not None:
            assert float(err.max()) < 1e-10 * max(1.0, float(res.layer_maps.abs().max()))


def test_llm_api_explains_a_continuation_exactly():
    model = build_state_space("granitemoehybrid", "lm")
    tok = tiny_tokenizer()
    ex = DecompositionLLMAttribution(ALTILogitAttribution(model), tok).decompose(
        TextTokenInput("the cat sat on the", tok), target="mat today")
    with torch.no_grad():
        real = model(input_ids=ex.input_ids[None]).logits[0, ex.positions, ex.target_ids]
    assert _rel(ex.scores.sum(-1) + ex.details.no_token, real) < 1e-10
    assert float(ex.details.delta.abs().max()) < 1e-10 * float(real.abs().max())


def test_conv_bias_experts_projection_bias_and_value_zeroing_are_refused_with_the_reason():
    with pytest.raises(UnsupportedModelError, match="mamba_conv_bias=True.*no-token term"):
        get_adapter(build_state_space("granitemoehybrid", "lm", mamba_conv_bias=True))
    with pytest.raises(UnsupportedModelError, match="num_local_experts=2.*shared MLP"):
        get_adapter(build_state_space("granitemoehybrid", "lm", num_local_experts=2, num_experts_per_tok=1))
    with pytest.raises(UnsupportedModelError, match="mamba_proj_bias=True.*padding"):
        get_adapter(build_state_space("granitemoehybrid", "lm", mamba_proj_bias=True))
    with pytest.raises(UnsupportedModelError, match="Value Zeroing.*mamba2"):
        ValueZeroingAttribution(build_state_space("granitemoehybrid", "lm"))


def test_the_capture_refuses_a_convolution_bias_it_meets():
    r"""A description registered without the family's refusal still never decomposes the bias silently."""
    from captum_normattr.models.capture.mamba2 import mamba2_mixing_from_projection

    model = build_state_space("granitemoehybrid", "bare", mamba_conv_bias=True)
    mixer = model.layers[0].mamba
    x = torch.randn(1, 4, 24, dtype=torch.float64)
    with pytest.raises(UnsupportedModelError, match="convolution bias.*no-token term"):
        mamba2_mixing_from_projection(mixer, mixer.in_proj(x), torch.ones(1, 4, 48, dtype=torch.float64),
                                      torch.ones(1, 4, 48, dtype=torch.float64), None, torch.float64)


def test_mamba2_mixer_descriptions_are_validated():
    with pytest.raises(ValueError, match="names its conv"):
        Attention("mamba", out="mamba.out_proj", value=ValueProjection("mamba.in_proj", "mamba2_x"), mixer="mamba2")
    with pytest.raises(ValueError, match="mamba2_x"):
        replace(GRANITE4_MAMBA2, value=ValueProjection("mamba.in_proj"))
    with pytest.raises(ValueError, match="belongs to a mamba2 mixer"):
        Attention("self_attn", out="self_attn.o_proj", value=ValueProjection("self_attn.v_proj", "mamba2_x"))
