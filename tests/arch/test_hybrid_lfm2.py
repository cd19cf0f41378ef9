r"""LFM2, the hybrid family with gated short-convolution mixers (``captum_normattr.arch.families.hybrid``).

The short convolution against a naive per-token reference (explicit sums over source tokens, from the module's
own weights and the real input: the recorded per-channel mixing tensor, the values and the mixer output); every
method (GlobEnc, ALTI, FF, DecompX, ALTI-Logit, routes, the LLM API) on the tiny float64 LFM2
(tests/fixtures/zoo_hybrid.py): token scores plus no-token terms equal the model's own logit (relative 1e-10),
a left-padded example equals the example alone, the model is unchanged; the mixer follows ``layer_types``; a
convolution bias and Value Zeroing are refused with the reason.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from captum_normattr import (
    UnsupportedModelError,
)
from captum_normattr.arch import ARCHITECTURES, lookup
from captum_normattr.arch.families.hybrid import LFM2, LFM2_SHORT_CONV
from captum_normattr.arch.registry import REFUSED
from captum_normattr.arch.spec import Attention, ValueProjection
from captum_normattr.attr.routes import InformationFlowRoutes
from captum_normattr.attr.value_zeroing import ValueZeroingAttribution
from captum_normattr.decompose.primitives.short_conv import short_conv_mixing
from captum_normattr.models.adapters import family_methods, get_adapter, layer_adapters, layer_modules
from hybrid_checks import check_every_method_exact, check_llm_continuation_exact
from decoder_models import decoder_batch
from layer_capture import capture_layers
from zoo_hybrid import build_hybrid
from map_checks import check_maps_complete


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _naive_short_conv(conv: torch.nn.Module, u: torch.Tensor):
    r"""The mixer by explicit loops over targets, source tokens and channels: (G (B, C, T, T), x (B, T, C),
    y (B, T, C) the output projection's input), from the module's weights and its input ``u`` (B, T, D)."""
    w_in = conv.in_proj.weight.detach()  # (3C, D)
    c = w_in.shape[0] // 3
    kernel = conv.conv.weight.detach()[:, 0, :]  # (C, K), tap K - 1 on the current token
    k = kernel.shape[1]
    bcx = u @ w_in.T
    b_gate, c_gate, x = bcx[..., :c], bcx[..., c:2 * c], bcx[..., 2 * c:]
    bsz, t, _ = u.shape
    g = torch.zeros(bsz, c, t, t, dtype=u.dtype)
    y = torch.zeros(bsz, t, c, dtype=u.dtype)
    for n in range(bsz):
        for ti in range(t):
            for s in range(max(0, ti - k + 1), ti + 1):
                for ch in range(c):
                    g[n, ch, ti, s] = c_gate[n, ti, ch] * kernel[ch, k - 1 - (ti - s)] * b_gate[n, s, ch]
                    y[n, ti, ch] += g[n, ch, ti, s] * x[n, s, ch]
    return g, x, y


def test_short_conv_mixing_is_the_naive_sum_over_source_tokens_and_the_modules_output():
    model = build_hybrid("lfm2", "bare")
    conv = model.layers[0].conv
    u = torch.randn(2, 7, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    g, x, y = _naive_short_conv(conv, u)
    c = x.shape[-1]
    with torch.no_grad():
        bcx = conv.in_proj(u)
        fast = short_conv_mixing(bcx[..., :c], bcx[..., c:2 * c], conv.conv.weight[:, 0, :])
    assert _rel(fast, g) < 1e-14 and float(fast.abs().max()) > 0
    assert float(g[:, :, torch.triu_indices(7, 7, 1)[0], torch.triu_indices(7, 7, 1)[1]].abs().max()) == 0  # causal
    assert float(g[:, :, 5, :3].abs().max()) == 0  # outside the window of K = 3
    seen = {}
    hook = conv.out_proj.register_forward_pre_hook(lambda mod, args: seen.setdefault("y", args[0].detach()))
    with torch.no_grad():
        conv(u)
    hook.remove()
    assert _rel(y, seen["y"]) < 1e-13  # the mixer's own output: y_t = sum_s G[t, s] x_s


def test_recorded_mixing_is_the_naive_one_and_follows_layer_types():
    model = build_hybrid("lfm2", "lm")
    ids, mask = decoder_batch([6, 4], seed=3)
    layers = capture_layers(model, ids, mask)
    kinds = [la.layer.attention.mixer for la in layer_adapters(model, get_adapter(model))]
    assert kinds == ["short_conv", "softmax", "short_conv", "short_conv"]
    for i, lt in enumerate(layers):
        module = layer_modules(model, get_adapter(model))[i]
        if kinds[i] == "softmax":
            assert lt.probs.shape[1] == 4 and lt.values.shape[-1] == 6
            continue
        u = lt.ln1_out * mask[..., None].to(lt.ln1_out.dtype)  # LFM2 zeroes the mixer input of padding tokens
        g, x, _ = _naive_short_conv(module.conv, u)
        assert lt.probs.shape == (2, 24, ids.shape[1], ids.shape[1]) and lt.values.shape == (2, 24, ids.shape[1], 1)
        assert _rel(lt.probs, g) < 1e-12
        assert _rel(lt.values[..., 0].transpose(1, 2), x) < 1e-12
    other = build_hybrid("lfm2", "lm", layer_types=["full_attention", "conv", "full_attention", "conv"])
    kinds = [la.layer.attention.mixer for la in layer_adapters(other, get_adapter(other))]
    assert kinds == ["softmax", "short_conv", "softmax", "short_conv"]


def test_lfm2_is_registered_and_no_longer_refused():
    assert ARCHITECTURES["lfm2"] is LFM2 and lookup("lfm2") is LFM2 and "lfm2" not in REFUSED
    assert family_methods(LFM2) == ("GlobEnc", "ALTI", "FF", "DecompX", "ALTI-Logit")
    assert "gated short-convolution mixer layers" in LFM2.features()


def test_every_method_is_exact_padding_free_and_leaves_the_model():
    model = build_hybrid("lfm2", "lm")
    check_every_method_exact(model)


def test_recorded_mixing_rebuilds_the_mixer_output_and_a_shifted_one_does_not():
    r"""sum_s G[t, s] x_s W_O is the real mixer output (h - x); the mixing shifted by one source token is not."""
    model = build_hybrid("lfm2", "lm")
    ids, mask = decoder_batch([6, 4], seed=3)
    layers = capture_layers(model, ids, mask)
    lt = layers[0]
    assert float((lt.attention_sum() - (lt.ln2_in - lt.hidden_in)).abs().max()) < 1e-10 * float(lt.ln2_in.abs().max())
    ctx = torch.einsum("bhts,bhsd->bthd", lt.probs, lt.values).reshape(2, ids.shape[1], -1) @ lt.out_weight
    assert _rel(ctx, lt.ln2_in - lt.hidden_in) < 1e-10
    shifted = torch.roll(lt.probs, 1, dims=-1)
    wrong = torch.einsum("bhts,bhsd->bthd", shifted, lt.values).reshape(2, ids.shape[1], -1) @ lt.out_weight
    assert _rel(wrong, lt.ln2_in - lt.hidden_in) > 1e-3


def test_the_zoos_exact_norms_are_the_familys_own():
    ids, mask = decoder_batch([6, 4], seed=12)
    own, exact = build_hybrid("lfm2", "lm", exact_norms=False), build_hybrid("lfm2", "lm")
    with torch.no_grad():
        a = own(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        b = exact(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    assert _rel(a, b) < 1e-5


def test_bare_model_maps_are_complete():
    model = build_hybrid("lfm2", "bare")
    ids, mask = decoder_batch([6, 4], seed=9)
    check_maps_complete(model, ids, (mask,))


def test_llm_api_explains_a_continuation_exactly():
    model = build_hybrid("lfm2", "lm")
    check_llm_continuation_exact(model)


def test_conv_bias_and_value_zeroing_are_refused_with_the_reason():
    with pytest.raises(UnsupportedModelError, match="conv_bias=True.*no-token term"):
        get_adapter(build_hybrid("lfm2", "lm", conv_bias=True))
    with pytest.raises(UnsupportedModelError, match="Value Zeroing.*short_conv"):
        ValueZeroingAttribution(build_hybrid("lfm2", "lm"))


def test_mixer_descriptions_are_validated():
    with pytest.raises(ValueError, match="mixer must be one of"):
        Attention("conv", out="conv.out_proj", mixer="mamba")
    with pytest.raises(ValueError, match="names its conv"):
        Attention("conv", out="conv.out_proj", value=ValueProjection("conv.in_proj", "fused", 2, 3), mixer="short_conv")
    with pytest.raises(ValueError, match="fused"):
        replace(LFM2_SHORT_CONV, value=ValueProjection("conv.in_proj"))
    with pytest.raises(ValueError, match="mixer_types"):
        replace(LFM2, layer=replace(LFM2.layer, mixer_types=None))


@pytest.mark.parametrize("last", ["conv", "full_attention"])
def test_routes_head_tables_span_layers_with_different_head_counts(last):
    r"""A conv layer has one head per channel (24), an attention layer 4: the (L, H) tables take the largest and an
    attention layer's columns past its 4 heads stay 0, whichever layer runs last."""
    model = build_hybrid("lfm2", "lm", layer_types=["conv", "full_attention", "conv", last])
    ids = torch.randint(3, 50, (1, 6), generator=torch.Generator().manual_seed(0))
    for granularity in ("token", "head"):
        g = InformationFlowRoutes(model).attribute(ids, threshold=0.0, granularity=granularity)
        assert g.num_heads == 24
        for table in (g.head_importance(), g.head_flow()):
            assert table.shape == (4, 24) and float(table[1, 4:].abs().max()) == 0 and float(table[0].sum()) > 0
        assert len(g.top_heads(3)) == 3
