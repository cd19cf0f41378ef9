r"""Nemotron-H, the single-branch family (``captum_normattr.arch.families.state_space``, ``decompose.kinds.single_branch``).

Each layer is one branch behind its own norm, y = x + B(N(x)), chosen by ``layers_block_type``: a Mamba-2 mixer, grouped-query
attention, a ReLU² MLP or ReLU² experts beside a shared expert. On the tiny float64 model (tests/fixtures/zoo_state_space.py:
linear_attention, full_attention, mlp, linear_attention, moe, mlp): the layers follow the config's types; the recorded Mamba-2
mixing (gated norm per group) is the naive per-token one; each record is the pre-LN layer whose absent branch is exactly 0;
every method (GlobEnc, ALTI, FF, DecompX, ALTI-Logit, routes, the LLM API) on ``NemotronHForCausalLM`` and the bare model:
token scores plus no-token terms equal the model's own logit (relative 1e-10), per-layer tensors complete, a left-padded example
equals the example alone, the model is unchanged; the experts read as relu(a) * a are exactly ReLU², latent projections around
them and FF biases folded exactly; a convolution bias (the config's default), projection biases and Value Zeroing are refused
with the reason.
"""
from __future__ import annotations

import pytest
import torch

from captum_normattr import (
    ALTIAttribution,
    FFIntegratedDecomposition,
    GlobEncAttribution,
    UnsupportedModelError,
)
from captum_normattr.arch import ARCHITECTURES, lookup
from captum_normattr.arch.families.state_space import NEMOTRON_H, NEMOTRON_H_MAMBA2
from captum_normattr.arch.registry import REFUSED
from captum_normattr.arch.spec import (
    ArchitectureSpec,
    Attention,
    Experts,
    FeedForward,
    Head,
    Layer,
    Norm,
    ValueProjection,
)
from captum_normattr.attr.value_zeroing import ValueZeroingAttribution
from captum_normattr.decompose.kinds.registry import LAYER_KINDS, SingleBranchKind
from captum_normattr.decompose.primitives.gated_feed_forward import ReLUGate, gate_integrals
from captum_normattr.models.adapters import family_methods, get_adapter, layer_adapters, layer_modules
from decoder_models import decoder_batch
from hybrid_checks import check_every_method_exact, check_llm_continuation_exact
from layer_capture import capture_layers
from mamba2_reference import naive_mamba2
from zoo_state_space import NEMOTRON_H_CONFIG, build_state_space

TYPES = NEMOTRON_H_CONFIG["layers_block_type"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def test_registered_as_single_branch_layers_that_follow_layers_block_type():
    assert ARCHITECTURES["nemotron_h"] is NEMOTRON_H and lookup("nemotron_h") is NEMOTRON_H
    assert "nemotron_h" not in REFUSED
    assert NEMOTRON_H.topology == "single_branch" and isinstance(LAYER_KINDS["single_branch"], SingleBranchKind)
    assert family_methods(NEMOTRON_H) == ("GlobEnc", "ALTI", "FF", "DecompX", "ALTI-Logit")
    assert "Mamba-2 mixer layers" in NEMOTRON_H.features() and "Mamba-2" in NEMOTRON_H.mixer_summary()
    model = build_state_space("nemotron_h", "lm")
    per_layer = layer_adapters(model, get_adapter(model))
    assert [la.layer.branch for la in per_layer] == ["self_attention", "self_attention", "feed_forward",
                                                     "self_attention", "feed_forward", "feed_forward"]
    assert [la.layer.attention.mixer for la in per_layer[:2]] == ["mamba2", "softmax"]
    assert per_layer[4].layer.ff.kind == "experts" and per_layer[5].layer.ff.kind == "plain"
    assert all(la.topology == "single_branch" for la in per_layer)
    # without the config's types, each layer's parts choose its branch; the legacy type names are understood
    modules = layer_modules(model, get_adapter(model))
    assert [NEMOTRON_H.for_layer(m).layer for m in modules] == [la.layer for la in per_layer]
    assert NEMOTRON_H.for_layer(None, "mamba").layer.attention == NEMOTRON_H_MAMBA2
    assert NEMOTRON_H.for_layer(None, "attention").layer.branch == "self_attention"
    with pytest.raises(ValueError, match="'conv' is not one of the described single-branch layer types"):
        NEMOTRON_H.for_layer(None, "conv")


def test_recorded_records_are_pre_ln_layers_whose_absent_branch_is_zero():
    model = build_state_space("nemotron_h", "lm")
    ids, mask = decoder_batch([7, 5], seed=3)
    layers = capture_layers(model, ids, mask)
    modules = layer_modules(model, get_adapter(model))
    valid = mask.bool()
    for i, lt in enumerate(layers):
        assert lt.topology == "single_branch"
        if TYPES[i] in ("linear_attention", "full_attention"):  # h = x + Attn(N(x)), y = h + 0
            assert float(lt.ff_out.abs().max()) == 0 and lt.ln2.kind == "identity"
            assert torch.equal(lt.ln2_in, lt.layer_out) and lt.ln1.kind == "rmsnorm"
            assert _rel((lt.hidden_in + lt.attention_sum())[valid], lt.layer_out[valid]) < 1e-13
        else:  # h = x + 0, y = h + FF(N(h))
            assert float(lt.probs.abs().max()) == 0 and float(lt.out_weight.abs().max()) == 0
            assert lt.ln1.kind == "identity" and torch.equal(lt.ln2_in, lt.hidden_in) and lt.ln2.kind == "rmsnorm"
            assert _rel(lt.hidden_in + lt.ff_out, lt.layer_out) < 1e-13 and float(lt.ff_out.abs().max()) > 0
        assert all(float(v.max()) < 1e-12 for v in lt.checks.values()), (i, lt.checks)
    for i in (0, 3):  # the Mamba-2 mixers: their gated norm works per group of intermediate_size // n_groups channels
        lt, mixer = layers[i], modules[i].mixer
        assert mixer.norm.group_size == 24 and mixer.intermediate_size == 48
        with torch.no_grad():
            g, u, y, _ = naive_mamba2(mixer, lt.ln1_out, valid)
        assert _rel(lt.probs, g) < 1e-12 and _rel(lt.context[..., 0], y) < 1e-12
        assert float(lt.probs[1, :, :, :ids.shape[1] - 5].abs().max()) == 0  # padding sources reach nothing


def test_every_method_is_exact_padding_free_and_leaves_the_model():
    check_every_method_exact(build_state_space("nemotron_h", "lm"), lengths=(9, 6))


def test_bare_model_per_layer_tensors_are_complete_and_feed_forward_layers_do_not_mix():
    model = build_state_space("nemotron_h", "bare")
    ids, mask = decoder_batch([7, 5], seed=9)
    ffl = [i for i, t in enumerate(TYPES) if t in ("mlp", "moe")]
    for cls in (GlobEncAttribution, ALTIAttribution, FFIntegratedDecomposition):
        res = cls(model, strict=True).decompose(ids, additional_forward_args=(mask,))
        err = res.extras.get("completeness_error")
        assert err is not None and float(err.max()) < 1e-10 * max(1.0, float(res.layer_maps.abs().max()))
        if cls is ALTIAttribution:  # the attention-block map of a feed-forward layer: h = x, each token its own
            eye = torch.diag_embed(mask.double())
            assert torch.allclose(res.layer_maps[:, ffl], eye[:, None].expand(-1, len(ffl), -1, -1), atol=1e-12)
    ff = FFIntegratedDecomposition(model, scope="FF").decompose(ids, additional_forward_args=(mask,))
    mixers = [i for i in range(len(TYPES)) if i not in ffl]
    assert float(ff.layer_maps[:, mixers].abs().max()) == 0 and float(ff.layer_maps[:, ffl].abs().max()) > 0


def test_llm_api_explains_a_continuation_exactly():
    model = build_state_space("nemotron_h", "lm")
    check_llm_continuation_exact(model)


def test_squared_relu_experts_read_as_relu_gates_are_exactly_relu2():
    a = torch.linspace(-5, 5, 41, dtype=torch.float64)
    i1, i2 = gate_integrals(a, ReLUGate(), nodes=3)
    assert torch.equal(a * i1 + i2, torch.relu(a))  # completeness: relu(a) * a = relu(a)^2, exactly
    assert torch.allclose((a * i1 + i2) * a, torch.relu(a) ** 2, rtol=0, atol=0)
    model = build_state_space("nemotron_h", "lm")
    ids, mask = decoder_batch([7, 5], seed=4)
    moe = capture_layers(model, ids, mask)[TYPES.index("moe")]
    f, u = moe.ff, moe.ff_input
    assert isinstance(f.act, ReLUGate) and torch.equal(f.w_gate, f.w_in) and f.width == 4 * 16 + 20
    rebuilt = ((torch.relu(u @ f.w_in) ** 2) * f.hidden_scale) @ f.w_out
    assert _rel(rebuilt[mask.bool()], moe.ff_out[mask.bool()]) < 1e-13
    routed = (f.hidden_scale[..., :64] > 0).reshape(*u.shape[:2], 4, 16).any(-1).sum(-1)
    assert bool((routed[mask.bool()] == 2).all())  # top-2 of 4 experts per token, the shared expert beside


def test_latent_experts_and_feed_forward_biases_are_folded_exactly():
    r"""moe_latent_size: the experts read u W_1 + b_1 and their sum is projected back, folded into W_up, W_down and the
    output bias; mlp_bias: the MLPs', the shared expert's and the latent projections' biases."""
    model = build_state_space("nemotron_h", "lm", moe_latent_size=8, mlp_bias=True,
                              layers_block_type=["linear_attention", "moe", "full_attention", "moe", "mlp"])
    assert model.model.layers[1].mixer.experts.up_proj.shape[-1] == 8
    check_every_method_exact(model, lengths=(7, 5))


def test_the_zoos_float64_logits_scan_and_norms_are_the_models_own():
    from transformers.models.nemotron_h import modeling_nemotron_h as mn
    from zoo_state_space import _ORIGINAL_NEMOTRON_SCAN, exact_nemotron_chunk_scan

    ids, mask = decoder_batch([9, 6], seed=12)
    exact = build_state_space("nemotron_h", "lm")
    with torch.no_grad():
        b = exact(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert b.dtype == torch.float64
    mn.mamba2_chunk_scan = _ORIGINAL_NEMOTRON_SCAN  # transformers' own chunked scan (float32 inside)
    try:
        own = build_state_space("nemotron_h", "lm", exact=False)
        with torch.no_grad():
            a = own(input_ids=ids, attention_mask=mask, use_cache=False).logits
    finally:
        mn.mamba2_chunk_scan = exact_nemotron_chunk_scan
    assert a.dtype == torch.float32 and _rel(a[mask.bool()].double(), b[mask.bool()]) < 1e-5


def test_conv_bias_is_exact_for_every_method_and_its_heads_are_the_naive_ones():
    r"""The config's default ``use_conv_bias=True``: the bias entering the scan at token s belongs to s (as Granite 4's,
    one more head of size 1 per channel), every method exact, padded equal to single."""
    model = build_state_space("nemotron_h", "lm", use_conv_bias=True)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mixer, "conv1d"):
                layer.mixer.conv1d.bias.copy_(0.5 * torch.randn(layer.mixer.conv1d.bias.shape,
                                                                generator=torch.Generator().manual_seed(5),
                                                                dtype=layer.mixer.conv1d.bias.dtype))
    ids, mask = decoder_batch([7, 5], seed=3)
    layers = capture_layers(model, ids, mask)
    modules = layer_modules(model, get_adapter(model))
    for i in (0, 3):
        lt, mixer = layers[i], modules[i].mixer
        inner = mixer.intermediate_size
        with torch.no_grad():
            g, u, y, from_bias = naive_mamba2(mixer, lt.ln1_out, mask.bool())
        assert float(from_bias.abs().max()) > 1e-3  # the bias matters
        b = mixer.conv1d.bias.detach()[:inner]
        assert _rel(lt.probs[:, :inner], g) < 1e-12
        assert _rel(lt.probs[:, inner:] * b[:, None, None], from_bias) < 1e-12
        rebuilt = torch.einsum("bcts,bcs->btc", lt.probs, lt.values[..., 0])
        assert _rel(rebuilt[..., :inner] + rebuilt[..., inner:], y) < 1e-12
    check_every_method_exact(model, lengths=(9, 6))


def test_projection_bias_and_value_zeroing_are_refused_with_the_reason():
    with pytest.raises(UnsupportedModelError, match="use_bias=True.*padding"):
        get_adapter(build_state_space("nemotron_h", "lm", use_bias=True))
    with pytest.raises(UnsupportedModelError, match="Value Zeroing.*single branches"):
        ValueZeroingAttribution(build_state_space("nemotron_h", "lm"))


def test_single_branch_descriptions_are_validated():
    norm = Norm("norm", "rmsnorm")
    att = Attention("mixer", out="mixer.o_proj", value=ValueProjection("mixer.v_proj"), pre_norm=norm)
    mlp = FeedForward(up="mixer.up_proj", act="mixer.act_fn", down="mixer.down_proj", pre_norm=norm)

    def spec(**layer):
        return ArchitectureSpec(family="X", model_types=("x",), layers="layers", causal=True,
                                layer=Layer(attention=att, ff=mlp, **layer), head=Head(final_norm=norm))

    assert spec(single_branches=(("a", att), ("f", mlp)), mixer_types="types").topology == "single_branch"
    with pytest.raises(ValueError, match="mixer_types"):
        spec(single_branches=(("a", att),))
    with pytest.raises(ValueError, match="without mixers"):
        spec(single_branches=(("a", att),), mixers=(("m", att),), mixer_types="types")
    with pytest.raises(ValueError, match="its pre-norm"):
        spec(single_branches=(("f", FeedForward(up="u", act="a", down="d")),), mixer_types="types")
    with pytest.raises(ValueError, match="one of"):
        spec(branch="both")
    with pytest.raises(ValueError, match="shared expert is a plain FeedForward"):
        Experts("mixer.experts", kind="squared_relu", shared=FeedForward(up="u", gate="g", act="a", down="d"))
    with pytest.raises(ValueError, match="latent projections"):
        Experts("mlp.experts", latent=("fc1", "fc2"))
