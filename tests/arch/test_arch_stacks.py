r"""Encoder-decoders as data: two stacks and a cross-attention branch in one description.

ALTI+ reads its attention blocks from the registered descriptions; these tests check that
every path a description names exists in a tiny model of the family, that a description
registered at run time is served, and that malformed stacks are refused.
"""
import dataclasses

import pytest
import torch

from captum_normattr import ALTIPlusAttribution, GlobEncAttribution, UnsupportedModelError
from captum_normattr.arch import ENCODER_DECODERS, Layer, lookup_encoder_decoder, register_architecture
from captum_normattr.arch import registry as arch_registry
from captum_normattr.models.seq2seq import get_seq2seq_adapter, seq2seq_base
from seq2seq_models import make_model, pair

FAMILIES = ["bart", "marian", "mbart", "m2m_100", "pegasus", "t5", "mt5"]


def _get(root, path):
    for part in path.split("."):
        root = getattr(root, part)
    return root


@pytest.mark.parametrize("family", FAMILIES)
def test_every_described_path_exists(family):
    model = make_model(family)
    spec = lookup_encoder_decoder(model.config.model_type, model.config)
    assert spec is not None and spec.is_encoder_decoder
    base = seq2seq_base(model)
    for name, path, layer in spec.stacks:
        layers = _get(base, path)
        assert len(layers) == 2, (name, path)
        for _, branch in layer.branches():
            mod = layers[0]
            paths = ([branch.module, branch.out, branch.value.path] if hasattr(branch, "module")
                     else [branch.up, branch.act, branch.down] + ([branch.gate] if branch.gate else []))
            for p in paths:
                _get(mod, p)
        for norm in spec.norms(layer):
            assert isinstance(_get(layers[0], norm.path), torch.nn.Module), norm.path
    if spec.head.final_norm is not None:
        _get(base, spec.head.final_norm.path)
    gated = getattr(model.config, "is_gated_act", False)
    assert (spec.layer.ff.gate is not None) == gated  # mT5 / T5 v1.1: the gated variant


def test_a_description_registered_at_run_time_is_served():
    model = make_model("bart")
    src, tgt = pair()
    ref = ALTIPlusAttribution(model).decompose((src, tgt))
    spec = dataclasses.replace(ENCODER_DECODERS["bart"], family="MyBART", model_types=("my_bart",), variants=())
    register_architecture(spec)
    try:
        model.config.model_type = "my_bart"
        assert get_seq2seq_adapter(model).family == "MyBART"
        got = ALTIPlusAttribution(model).decompose((src, tgt))
        torch.testing.assert_close(got.scores, ref.scores, rtol=0, atol=1e-12)
        with pytest.raises(UnsupportedModelError, match="ALTIPlusAttribution"):
            GlobEncAttribution(model)
    finally:
        model.config.model_type = "bart"
        arch_registry.ENCODER_DECODERS.pop("my_bart", None)


def test_a_wrong_description_gives_wrong_blocks_and_the_completeness_check_sees_it():
    r"""The description is what ALTI+ reads: naming the cross-attention's norm as the self-attention's
    output makes the block's parts miss its real output, which the completeness error reports."""
    model = make_model("bart")
    src, tgt = pair()
    good = ALTIPlusAttribution(model).decompose((src, tgt))
    spec = ENCODER_DECODERS["bart"]
    norms = spec.decoder_layer.stream_norms
    wrong = dataclasses.replace(spec, model_types=("bart_wrong",), variants=(),
                                decoder_layer=dataclasses.replace(spec.decoder_layer,
                                                                  stream_norms=(norms[1], norms[0], norms[2])))
    register_architecture(wrong)
    try:
        model.config.model_type = "bart_wrong"
        err_good = float(good.completeness_error)
        try:
            bad = ALTIPlusAttribution(model).decompose((src, tgt))
            err_bad = float(bad.extras["decoder_self_completeness_error"].max())
        except (RuntimeError, ValueError):
            err_bad = float("inf")  # refused outright: also caught
        assert err_good < 1e-10 and err_bad > 1e-3
    finally:
        model.config.model_type = "bart"
        arch_registry.ENCODER_DECODERS.pop("bart_wrong", None)


def test_malformed_stacks_are_refused():
    spec = ENCODER_DECODERS["bart"]
    with pytest.raises(ValueError, match="cross-attention"):
        dataclasses.replace(spec, layer=spec.decoder_layer)  # the encoder layer has no cross-attention
    with pytest.raises(ValueError, match="cross-attention"):
        dataclasses.replace(spec, decoder_layer=spec.layer)  # the decoder layer has one
    with pytest.raises(ValueError, match="one stream norm per branch"):
        dataclasses.replace(spec, decoder_layer=dataclasses.replace(spec.decoder_layer,
                                                                    stream_norms=spec.decoder_layer.stream_norms[:2]))
    with pytest.raises(ValueError, match="both decoder_layers and decoder_layer"):
        dataclasses.replace(spec, decoder_layers=None)
    pre = ENCODER_DECODERS["mbart"]
    no_norm = dataclasses.replace(pre.decoder_layer.cross_attention, pre_norm=None)
    with pytest.raises(ValueError, match="pre-norm on every branch"):
        dataclasses.replace(pre, decoder_layer=dataclasses.replace(pre.decoder_layer, cross_attention=no_norm))
    assert isinstance(spec.decoder_layer, Layer) and [n for n, _ in spec.decoder_layer.branches()] == [
        "self_attention", "cross_attention", "feed_forward"]
