r"""Granite 4, the hybrid family with Mamba-2 mixers (``captum_normattr.arch.families.state_space``).

The Mamba-2 mixer against a naive per-token reference (explicit loops over targets, source tokens, scan steps and
kernel taps, from the module's own weights and its real input: the recorded per-channel mixing tensor, the values
and the mixer's output); every method (GlobEnc, ALTI, FF, DecompX, ALTI-Logit, routes, the LLM API) on the tiny
float64 Granite 4 (tests/fixtures/zoo_state_space.py): token scores plus no-token terms equal the model's own logit
(relative 1e-10), a left-padded example equals the example alone, the model is unchanged; the mixer follows
``layer_types``; with the convolution bias of the real checkpoints (``mamba_conv_bias=True``) the bias heads against
explicit sums over source tokens and every method exact and padding-free (experts beside the shared MLP:
test_hybrid_mamba2_moe.py); an input-projection bias (the model itself then depends on padding) and Value Zeroing are
refused with the reason. Nemotron-H's single-branch layers with the same mixer: tests/arch/test_hybrid_nemotron_h.py.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from captum_normattr import (
    GlobEncAttribution,
    UnsupportedModelError,
)
from captum_normattr.arch import ARCHITECTURES, lookup
from captum_normattr.arch.families.state_space import GRANITE4, GRANITE4_MAMBA2
from captum_normattr.arch.registry import REFUSED, refusal
from captum_normattr.arch.spec import Attention, ValueProjection
from captum_normattr.attr.value_zeroing import ValueZeroingAttribution
from captum_normattr.models.adapters import family_methods, get_adapter, layer_adapters, layer_modules
from hybrid_checks import check_every_method_exact, check_llm_continuation_exact
from decoder_models import decoder_batch
from layer_capture import capture_layers
from mamba2_reference import naive_mamba2
from zoo_state_space import build_state_space
from map_checks import check_maps_complete


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


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
            g, u, y, _ = naive_mamba2(modules[i].mamba, lt.ln1_out, mask.bool())
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
    check_maps_complete(model, ids, (mask,))


def test_llm_api_explains_a_continuation_exactly():
    model = build_state_space("granitemoehybrid", "lm")
    check_llm_continuation_exact(model)


def test_projection_bias_and_value_zeroing_are_refused_with_the_reason():
    with pytest.raises(UnsupportedModelError, match="mamba_proj_bias=True.*padding"):
        get_adapter(build_state_space("granitemoehybrid", "lm", mamba_proj_bias=True))
    with pytest.raises(UnsupportedModelError, match="Value Zeroing.*mamba2"):
        ValueZeroingAttribution(build_state_space("granitemoehybrid", "lm"))


def test_an_input_projection_bias_makes_the_model_itself_depend_on_padding_a_convolution_bias_does_not():
    r"""Why ``mamba_proj_bias`` stays refused: the model's own logits of a left-padded example differ from the example
    alone (the padding tokens' projection bias reaches the real tokens through the convolution); with the convolution
    bias alone they agree (the mixer zeroes the convolution's output at padding tokens after the bias is added)."""
    ids, mask = decoder_batch([9, 6], seed=5)

    def gap(model):
        with torch.no_grad():
            positions = (mask[1:].cumsum(-1) - 1).clamp_min(0)  # the positions the example has alone
            padded = model(input_ids=ids[1:], attention_mask=mask[1:], position_ids=positions,
                           use_cache=False).logits[0, -6:]
            alone = model(input_ids=ids[1:, -6:], use_cache=False).logits[0]
        return _rel(padded, alone)

    assert gap(build_state_space("granitemoehybrid", "lm", mamba_conv_bias=True)) < 1e-12
    assert gap(build_state_space("granitemoehybrid", "lm", mamba_conv_bias=True, mamba_proj_bias=True)) > 1e-4


def _biased(head: str = "lm", **extra) -> torch.nn.Module:
    r"""The tiny Granite 4 with the convolution bias on (transformers' default and the real checkpoints')."""
    model = build_state_space("granitemoehybrid", head, mamba_conv_bias=True, **extra)
    layers = layer_modules(model, get_adapter(model))
    assert all(float(m.mamba.conv1d.bias.detach().abs().max()) > 0.1 for m in layers if m.mamba is not None)
    return model


def test_convolution_bias_heads_are_the_naive_per_token_sums_and_complete_the_layer():
    r"""With a convolution bias the capture records C more heads (values b_c, probabilities P[c, t, s] = gamma M sigma):
    P b against explicit sums over the source tokens s (the bias entering the scan at s), G u + P b the mixer's own
    output projection input, the layer's residual join rebuilt from the per-source parts, and a left-padded example's
    heads equal to the example's alone."""
    model = _biased()
    ids, mask = decoder_batch([7, 5], seed=3)
    layers = capture_layers(model, ids, mask)
    alone = capture_layers(model, ids[1:, 2:])
    modules = layer_modules(model, get_adapter(model))
    t = ids.shape[1]
    for i in (0, 2, 3):
        lt, mixer = layers[i], modules[i].mamba
        c = mixer.intermediate_size
        with torch.no_grad():
            g, u, y, from_bias = naive_mamba2(mixer, lt.ln1_out, mask.bool())
        b = mixer.conv1d.bias.detach()[:c]
        assert lt.probs.shape == (2, 2 * c, t, t) and lt.values.shape == (2, 2 * c, t, 1)
        assert lt.out_weight.shape == (2 * c, 24) and torch.equal(lt.out_weight[:c], lt.out_weight[c:])
        assert _rel(lt.probs[:, :c], g) < 1e-12
        assert _rel(lt.probs[:, c:] * b[:, None, None], from_bias) < 1e-12 and float(from_bias.abs().max()) > 1e-3
        assert torch.equal(lt.values[:, c:, :, 0], b[None, :, None].expand(2, c, t))
        rebuilt = torch.einsum("bcts,bcs->btc", lt.probs, lt.values[..., 0])
        both = rebuilt[..., :c] + rebuilt[..., c:]
        assert _rel(both, y) < 1e-12 and _rel(lt.context[..., 0], rebuilt) < 1e-12
        assert _rel(rebuilt[..., :c], y) > 1e-3  # the bias heads are needed
        # the layer's residual join from the per-source parts (the bias part of s in s's column)
        parts = torch.einsum("bhts,bhs,hd->btsd", lt.probs, lt.values[..., 0], lt.out_weight)
        assert _rel(lt.hidden_in + parts.sum(2), lt.ln2_in) < 1e-12
        assert float(lt.probs[1, :, :, :2].abs().max()) == 0  # padding sources reach nothing
        torch.testing.assert_close(lt.probs[1:, :, 2:, 2:], alone[i].probs.dense(), rtol=0, atol=1e-12)


def test_every_method_is_exact_with_the_convolution_bias():
    check_every_method_exact(_biased(), lengths=(9, 6))


def test_llm_api_and_bare_model_with_the_convolution_bias():
    model = _biased()
    check_llm_continuation_exact(model)
    bare = _biased("bare")
    ids, mask = decoder_batch([7, 5], seed=9)
    res = GlobEncAttribution(bare, strict=True).decompose(ids, additional_forward_args=(mask,))
    assert float(res.extras["completeness_error"].max()) < 1e-10 * max(1.0, float(res.layer_maps.abs().max()))


def test_the_capture_records_the_convolution_bias_as_heads_of_its_own():
    r"""The mixing of a biased mixer has C more heads (the bias's), non-zero and causal."""
    from captum_normattr.models.capture.mamba2 import mamba2_mixing_from_projection

    model = _biased("bare")
    mixer = model.layers[0].mamba
    x = torch.randn(1, 4, 24, dtype=torch.float64)
    probs = mamba2_mixing_from_projection(mixer, mixer.in_proj(x).detach(), torch.ones(1, 4, 48, dtype=torch.float64),
                                          torch.ones(1, 4, 48, dtype=torch.float64), None, torch.float64)
    assert probs.shape == (1, 96, 4, 4) and float(probs[:, 48:].abs().max()) > 0
    assert float(probs[:, 48:].triu(1).abs().max()) == 0  # causal


def test_mamba2_mixer_descriptions_are_validated():
    with pytest.raises(ValueError, match="names its conv"):
        Attention("mamba", out="mamba.out_proj", value=ValueProjection("mamba.in_proj", "mamba2_x"), mixer="mamba2")
    with pytest.raises(ValueError, match="mamba2_x"):
        replace(GRANITE4_MAMBA2, value=ValueProjection("mamba.in_proj"))
    with pytest.raises(ValueError, match="belongs to a mamba2 mixer"):
        Attention("self_attn", out="self_attn.o_proj", value=ValueProjection("self_attn.v_proj", "mamba2_x"))
