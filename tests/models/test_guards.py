r"""Consistency guards of the capture (issue 27 item 9, issue 23 item 4): each one made to fire.

A user's hook (steering vector, head ablation, tokens rolled before attention), a norm that
the architecture description does not match, a layer that runs twice and an in-place change
of a recorded tensor must never give silent numbers; a clean model must not warn.
"""
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from captum_normattr import ALTIAttribution, DecompXAttribution, FFIntegratedDecomposition, GlobEncAttribution
from captum_normattr.models.guard import ConsistencyError, ConsistencyWarning
from captum_normattr.models.capture import recorder as capture
from captum_normattr.models.capture.session import recording
from captum_normattr.models.adapters import get_adapter
from conftest import make_model, random_batch
from decoder_models import decoder_batch, make_decoder

METHODS = {"globenc": GlobEncAttribution, "alti": ALTIAttribution}


def _batch(decoder):
    return decoder_batch([7, 5]) if decoder else random_batch([7, 5])


def _attribute(cls, model, decoder=False, **kw):
    ids, mask = _batch(decoder)
    return cls(model, **kw).attribute(ids, additional_forward_args=(mask,))


def _fires(cls, model, check: str, layer: int = 0, decoder=False):
    r"""The hooked model is refused (naming the layer and the check): a gross difference (above
    GROSS_RELATIVE) raises by default, and strict=True raises too."""
    with pytest.raises(ConsistencyError, match="refused even without strict") as err:
        _attribute(cls, model, decoder)
    assert f"layer {layer} (" in str(err.value) and check in str(err.value), str(err.value)
    with pytest.raises(ConsistencyError, match=check):
        _attribute(cls, model, decoder, strict=True)


def test_a_small_difference_warns_once_and_strict_raises():
    r"""Below the gross threshold (a tiny steering vector: relative ~1e-3) the guard warns once per call."""
    model = make_model("bert")
    v = 2e-3 * torch.randn(24, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    model.bert.encoder.layer[0].register_forward_hook(lambda m, a, out: (out[0] + v,) + tuple(out[1:])
                                                      if isinstance(out, tuple) else out + v)
    with pytest.warns(ConsistencyWarning) as caught:
        _attribute(GlobEncAttribution, model, False)
    messages = [str(w.message) for w in caught if issubclass(w.category, ConsistencyWarning)]
    assert len(messages) == 1 and "layer 0 (" in messages[0], messages
    with pytest.raises(ConsistencyError, match="layer 0"):
        _attribute(GlobEncAttribution, model, False, strict=True)


def test_a_wrong_description_is_refused_by_default():
    r"""Gemma's (1 + w) norms read with Llama's description: numbers refused, not returned with a warning."""
    from registry_state import described_as
    from zoo import build

    from captum_normattr import ALTILogitAttribution
    from captum_normattr.arch import ARCHITECTURES

    model = build("gemma")
    ids, mask = _batch(True)
    with described_as("gemma", __import__("dataclasses").replace(ARCHITECTURES["llama"], model_types=("gemma",))):
        with pytest.raises(ConsistencyError, match="norm rebuilt from its input"):
            ALTILogitAttribution(model).attribute(ids, target=3, additional_forward_args=(mask,))


@pytest.mark.parametrize("family", ["bert", "distilbert", "gpt2", "llama"])
def test_clean_models_do_not_warn(family):
    decoder = family in ("gpt2", "llama")
    model = make_decoder(family, exact_norms=False) if decoder else make_model(family)
    for dtype in (torch.float64, torch.float32):
        model = model.to(dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ConsistencyWarning)
            for cls in (GlobEncAttribution, ALTIAttribution, FFIntegratedDecomposition, DecompXAttribution):
                _attribute(cls, model, decoder)
            _attribute(GlobEncAttribution, model, decoder, strict=True)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_steering_vector_on_a_layer_output(name):
    model = make_model("bert")
    v = 0.5 * torch.randn(24, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    model.bert.encoder.layer[0].register_forward_hook(lambda m, a, out: (out[0] + v,) + tuple(out[1:])
                                                      if isinstance(out, tuple) else out + v)
    _fires(METHODS[name], model, "layer output vs the second norm's output")


@pytest.mark.parametrize("name", sorted(METHODS))
def test_head_ablation_before_the_output_projection(name):
    model = make_model("bert")
    dh = 24 // 4

    def ablate(module, args):
        x = args[0].clone()
        x[..., dh:2 * dh] = 0  # head 1
        return (x,)

    model.bert.encoder.layer[1].attention.output.dense.register_forward_pre_hook(ablate)
    _fires(METHODS[name], model, "output projection input vs the attention context", layer=1)


def _roll_hidden_states(module, args, kwargs):
    if args:
        return (args[0].roll(1, dims=1),) + tuple(args[1:]), kwargs
    return args, dict(kwargs, hidden_states=kwargs["hidden_states"].roll(1, dims=1))


@pytest.mark.parametrize("name", sorted(METHODS))
def test_tokens_rolled_before_attention_encoder(name):
    model = make_model("bert")
    ids, mask = _batch(False)
    clean = METHODS[name](model).attribute(ids, additional_forward_args=(mask,))
    model.bert.encoder.layer[0].attention.self.register_forward_pre_hook(_roll_hidden_states, with_kwargs=True)
    # the completeness check alone sees nothing here (parts sum to the rolled tensors) while the scores move:
    # the consistency check refuses the call
    assert clean.abs().sum() > 0
    _fires(METHODS[name], model, "attention input vs the layer input")


def test_tokens_rolled_before_attention_decoder():
    model = make_decoder("llama")
    model.model.layers[1].self_attn.register_forward_pre_hook(_roll_hidden_states, with_kwargs=True)
    _fires(GlobEncAttribution, model, "attention input vs the first norm's output", layer=1, decoder=True)


def test_norm_with_another_gain_than_described():
    r"""A Gemma-like norm x / rms(x) * (1 + w) read as plain RMSNorm (gamma = w): the rebuilt output differs."""
    model = make_decoder("llama")
    norm = model.model.layers[0].post_attention_layernorm
    norm.forward = lambda x: F.rms_norm(x, (x.shape[-1],), 1 + norm.weight, norm.eps)
    # the pre-LN completeness is measured before the norm: only the rebuilt norm shows the mismatch
    _fires(GlobEncAttribution, model, "second norm rebuilt from its input", decoder=True)


def test_layer_that_runs_twice_is_an_error():
    model = make_model("bert")
    encoder, first = model.bert.encoder, model.bert.encoder.layer[0]
    original = encoder.forward

    def twice(hidden_states, attention_mask=None, *args, **kwargs):
        out = first(hidden_states, attention_mask)
        return original(out[0] if isinstance(out, tuple) else out, attention_mask, *args, **kwargs)

    encoder.forward = twice
    with pytest.raises(capture.LayerRunError, match="layer 0 .* ran twice"):
        _attribute(GlobEncAttribution, model)
    encoder.forward = original
    _attribute(GlobEncAttribution, model)  # the hooks and flags were restored


def test_shared_layer_modules_are_an_error():
    model = make_model("bert")
    model.bert.encoder.layer[1] = model.bert.encoder.layer[0]  # ALBERT-style sharing
    with pytest.raises(capture.LayerRunError, match="same module more than once"):
        _attribute(GlobEncAttribution, model)


def test_recorded_tensor_changed_in_place_is_recorded_as_a_copy(monkeypatch):
    r"""A hook that doubles the FF output in place after it was recorded (as Falcon's
    ``mlp_output += attention_output``): the recorded FF output stays the FF module's output."""
    monkeypatch.setattr(capture, "_CLONE_KEYS", {})
    model = make_model("bert")
    ids, mask = _batch(False)
    layer = model.bert.encoder.layer[0]
    seen = []
    layer.output.dense.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    layer.output.dropout.register_forward_hook(lambda m, a, out: out.mul_(2.0))  # after the recording hook
    recorded = []
    with torch.no_grad():
        # the raw recording meets the in-place change at hand-over and refuses the changed tensor
        with pytest.raises(capture.RecordedTensorModifiedError, match="ff_out"):
            with recording(model, get_adapter(model), recorded.append, torch.float64):
                model.bert(input_ids=ids, attention_mask=mask)
        assert capture._CLONE_KEYS[type(layer)] == frozenset({"ff_out"})
        seen.clear()
        with recording(model, get_adapter(model), recorded.append, torch.float64):
            model.bert(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(recorded[0].ff_out, seen[0], rtol=0, atol=0)
    # attributions retry by themselves; the doubled FF output then shows at the residual join
    monkeypatch.setattr(capture, "_CLONE_KEYS", {})
    _fires(GlobEncAttribution, model, "second norm input vs the first norm's output plus the feed-forward output")


@pytest.mark.parametrize("name", ["decompx", "alti-logit"])
def test_strict_logit_methods_raise_on_a_steering_vector(name):
    r"""DecompX and ALTI-Logit judge the same checks: a gross difference raises ConsistencyError, with or without strict."""
    from captum_normattr import ALTILogitAttribution

    cls = DecompXAttribution if name == "decompx" else ALTILogitAttribution
    model = make_decoder("llama", exact_norms=False)
    v = 0.5 * torch.randn(model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    model.model.layers[0].register_forward_hook(
        lambda m, a, out: (out[0] + v,) + tuple(out[1:]) if isinstance(out, tuple) else out + v)
    ids, mask = _batch(True)
    with pytest.raises(ConsistencyError, match="layer 0"):  # a gross difference: refused by default
        cls(model).attribute(ids, target=3, additional_forward_args=(mask,))
    with pytest.raises(ConsistencyError, match="layer 0"):
        cls(model, strict=True).attribute(ids, target=3, additional_forward_args=(mask,))
    with pytest.raises(TypeError, match="strict"):
        cls(model, strict="yes")
