r"""OLMo 2, Gemma 3 (text), BLOOM and OPT: what the registry-wide zoo tests (tests/test_zoo.py) do not cover.

BLOOM's probabilities are the ones its own attention module computes (ALiBi inside); OPT's post-LN
variant and its project_in / project_out widths; OLMo 2's missing pre-norms against a wrong
description; Gemma 3's optional final-logit soft-cap; the bare ``*Model`` and the
``*ForSequenceClassification`` of every family; the refused configs. Float64 tiny models with
perturbed weights (tests/zoo_decoders.py); completeness is compared with the model's own outputs.
"""
import math
from dataclasses import replace

import pytest
import torch

from captum_normattr import (
    ALTIAttribution,
    ALTILogitAttribution,
    DecompXAttribution,
    GlobEncAttribution,
    UnsupportedModelError,
)
from captum_normattr.arch import ARCHITECTURES
from captum_normattr.models.guard import ConsistencyError
from captum_normattr.models.adapters import get_adapter, max_positions
from captum_normattr.models.capture.session import recording
from decoder_models import decoder_batch
from zoo import real_next_token_logits
from registry_state import described_as
from zoo import build
from map_checks import check_maps_complete

FAMILIES = ["olmo2", "gemma3_text", "bloom", "opt"]


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _recorded(model, ids, mask):
    got = []
    with torch.no_grad(), recording(model, get_adapter(model), got.append, torch.float64):
        model(input_ids=ids, attention_mask=mask)
    return got


# --- BLOOM: the module's own probabilities ---------------------------------------------------

def _probs_without_alibi(model, layer_idx, x, mask):
    r"""softmax(q k^T / sqrt(Dh) + causal mask) from the layer's own projections, WITHOUT the ALiBi bias."""
    layer = model.transformer.h[layer_idx]
    attn = layer.self_attention
    h, dh = attn.num_heads, attn.head_dim
    b, t, _ = x.shape
    qkv = attn.query_key_value(layer.input_layernorm(x)).view(b, t, h, 3, dh)
    q, k = qkv[..., 0, :].transpose(1, 2), qkv[..., 1, :].transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(dh)
    keep = torch.tril(torch.ones(t, t, dtype=torch.bool)) & mask.bool()[:, None, None, :]
    return torch.softmax(scores.masked_fill(~keep, torch.finfo(scores.dtype).min), -1)


def test_bloom_records_the_probabilities_its_attention_module_computes():
    model = build("bloom", "lm")
    ids, mask = decoder_batch([6, 6], seed=4)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    layers = _recorded(model, ids, mask)
    assert len(layers) == len(out.attentions) == 2
    for idx, layer in enumerate(layers):
        torch.testing.assert_close(layer.probs, out.attentions[idx], rtol=0, atol=1e-14)
        # ALiBi is in them: the same scores without the position bias give other probabilities
        with torch.no_grad():
            plain = _probs_without_alibi(model, idx, out.hidden_states[idx], mask)
        assert float((plain - layer.probs).abs().max()) > 1e-2
        # the value states are the module's per-head value blocks of query_key_value
        torch.testing.assert_close(layer.context.flatten(2), (layer.probs @ layer.values).transpose(1, 2).flatten(2),
                                   rtol=0, atol=1e-12)


def test_bloom_first_layer_input_is_after_the_embedding_layernorm():
    model = build("bloom", "lm")
    ids, mask = decoder_batch([5], seed=2)
    layers = _recorded(model, ids, mask)
    with torch.no_grad():
        emb = model.transformer.word_embeddings(ids)
        torch.testing.assert_close(layers[0].hidden_in, model.transformer.word_embeddings_layernorm(emb), rtol=0, atol=0)


def test_bloom_residual_post_layernorm_is_refused():
    model = build("bloom", "lm", apply_residual_connection_post_layernorm=True)
    with pytest.raises(UnsupportedModelError, match="apply_residual_connection_post_layernorm"):
        ALTIAttribution(model)


# --- OPT: post-LN variant, projections, flattened FF, positions ----------------------------

@pytest.mark.parametrize("overrides", [
    dict(do_layer_norm_before=False),
    dict(do_layer_norm_before=False, word_embed_proj_dim=16),
    dict(word_embed_proj_dim=16),
], ids=["post_ln", "post_ln_projected", "pre_ln_projected"])
def test_opt_variants_are_exact(overrides):
    model = build("opt", "lm", **overrides)
    spec = get_adapter(model)
    assert spec.topology == ("post_ln" if overrides.get("do_layer_norm_before", True) is False else "pre_ln")
    ids, mask = decoder_batch([6, 4], seed=5)
    logits = real_next_token_logits(model, ids, mask)
    check_maps_complete(model, ids, (mask,))
    dx = DecompXAttribution(model, strict=True)
    res = dx.decompose(ids, target=7, additional_forward_args=mask)
    assert _rel(res.class_scores.sum(1) + res.bias_scores, logits[:, 7:8]) < 1e-10
    t = ids.shape[1]
    alone = dx.decompose(ids[1:, t - 4:], target=7)
    torch.testing.assert_close(res.scores[1, t - 4:], alone.scores[0], rtol=0, atol=1e-10 * float(res.scores.abs().max()))
    if spec.topology == "post_ln":  # ALTI-Logit splits additive residual updates: refused for post-LN layers
        with pytest.raises(UnsupportedModelError, match="post_ln layers.*alti_logit"):
            ALTILogitAttribution(model)
    else:
        target = logits.argmax(-1)
        res = ALTILogitAttribution(model, strict=True).decompose(ids, target=target, additional_forward_args=(mask,))
        expect = logits.gather(1, target[:, None])[:, 0]
        assert _rel(res.scores.sum(-1) + res.no_token_total, expect) < 1e-10


def test_opt_projection_is_needed():
    r"""Without project_out folded into the unembedding the explained logit is not the model's (the guard says so)."""
    model = build("opt", "lm", word_embed_proj_dim=16)
    ids, mask = decoder_batch([6], seed=5)
    spec = ARCHITECTURES["opt"]
    with described_as("opt", replace(spec, head=replace(spec.head, projection=None))):
        with pytest.raises(RuntimeError, match="size"):  # the (V, 16) head does not fit the 24-wide final norm output
            DecompXAttribution(model, strict=True).decompose(ids, target=3, additional_forward_args=mask)


def test_opt_flattened_feed_forward_is_recorded_per_token():
    model = build("opt", "lm")
    ids, mask = decoder_batch([6, 4], seed=6)
    for layer in _recorded(model, ids, mask):
        for name in ("ln2_in", "ln2_out", "ff_out", "layer_out"):
            assert getattr(layer, name).shape == (2, 6, 24), name
        torch.testing.assert_close(layer.layer_out, layer.ln2_in + layer.ff_out, rtol=0, atol=1e-12)


def test_opt_position_limit_is_the_configs_despite_the_offset():
    model = build("opt", "lm")
    assert model.model.decoder.embed_positions.num_embeddings == model.config.max_position_embeddings + 2
    assert max_positions(model, get_adapter(model)) == model.config.max_position_embeddings


# --- OLMo 2: no pre-norms --------------------------------------------------------------------

def test_olmo2_without_pre_norms_and_a_wrong_description_is_caught():
    model = build("olmo2", "lm")
    ids, mask = decoder_batch([6, 4], seed=7)
    spec = ARCHITECTURES["olmo2"]
    assert spec.topology == "sandwich" and spec.layer.attention.pre_norm is None and spec.norm1.kind == "identity"
    res = GlobEncAttribution(model, strict=True).decompose(ids, additional_forward_args=(mask,))
    assert float(res.extras["completeness_error"].max()) < 1e-10 * float(res.layer_maps.abs().max())
    # described as if its norms were pre-norms (a Llama-like layer): the guards refuse it
    wrong = replace(spec, layer=replace(
        spec.layer,
        attention=replace(spec.layer.attention, pre_norm=spec.layer.attention.post_norm, post_norm=None),
        ff=replace(spec.layer.ff, pre_norm=spec.layer.ff.post_norm, post_norm=None)))
    with described_as("olmo2", wrong):
        with pytest.raises(ConsistencyError):
            GlobEncAttribution(model, strict=True).decompose(ids, additional_forward_args=(mask,))


# --- Gemma 3: final-logit soft-cap when set --------------------------------------------------

def test_gemma3_final_softcap_explains_the_pre_cap_logit():
    model = build("gemma3_text", "lm", final_logit_softcapping=3.0)
    ids, mask = decoder_batch([6, 4], seed=8)
    logits = real_next_token_logits(model, ids, mask)
    target = logits.argmax(-1)
    res = ALTILogitAttribution(model, strict=True).decompose(ids, target=target, additional_forward_args=(mask,))
    expect = logits.gather(1, target[:, None])[:, 0]
    assert res.extras["explained_logit"] == "pre-cap logit"
    total = res.scores.sum(-1) + res.no_token_total
    assert _rel(3.0 * torch.tanh(total / 3.0), expect) < 1e-10
    assert _rel(res.extras["capped_logit"], expect) < 1e-10
    assert float((total - expect).abs().max()) > 1e-3  # the cap is visible: the pre-cap logit is another number


def test_gemma3_bidirectional_is_refused():
    model = build("gemma3_text", "lm", use_bidirectional_attention=True)
    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        GlobEncAttribution(model)


# --- every family: bare model and classifier -------------------------------------------------

@pytest.mark.parametrize("head", ["bare", "cls"])
@pytest.mark.parametrize("key", FAMILIES)
def test_bare_model_and_classifier_maps_are_complete(key, head):
    r"""The maps of the bare ``*Model`` and of the ``*ForSequenceClassification`` (the package explains no
    decoder classification head yet: DecompX refuses it cleanly)."""
    model = build(key, head)
    ids, mask = decoder_batch([6, 4], seed=9)
    check_maps_complete(model, ids, (mask,))
    if head == "cls":
        with pytest.raises(UnsupportedModelError, match="classification head"):
            DecompXAttribution(model)


@pytest.mark.parametrize("key,overrides", [("bloom", {}), ("olmo2", {}), ("opt", dict(do_layer_norm_before=False))],
                         ids=["bloom", "olmo2", "opt_post_ln"])
def test_decompx_adjoint_reruns_the_layers_exactly(key, overrides):
    r"""The adjoint algorithm reruns each layer (BLOOM: through its returned-probabilities hooks) and gives the
    forward algorithm's scores."""
    model = build(key, "lm", **overrides)
    ids, mask = decoder_batch([6, 4], seed=11)
    fwd = DecompXAttribution(model, strict=True, algorithm="forward").decompose(ids, target=4, additional_forward_args=mask)
    adj = DecompXAttribution(model, strict=True, algorithm="adjoint").decompose(ids, target=4, additional_forward_args=mask)
    torch.testing.assert_close(adj.scores, fwd.scores, rtol=0, atol=1e-10 * float(fwd.scores.abs().max()))


def test_bloom_described_through_the_attention_interface_records_nothing():
    r"""BLOOM never calls transformers' attention function: described as if it did, no probability is recorded
    and the call says so (instead of decomposing other probabilities)."""
    model = build("bloom", "lm")
    ids, mask = decoder_batch([5], seed=3)
    spec = ARCHITECTURES["bloom"]
    wrong = replace(spec, layer=replace(spec.layer, attention=replace(spec.layer.attention, probabilities="interface")))
    with described_as("bloom", wrong):
        with pytest.raises(RuntimeError, match="recorded no.*probs"):
            GlobEncAttribution(model).decompose(ids, additional_forward_args=(mask,))


def test_refused_configs_and_descriptions():
    with pytest.raises(UnsupportedModelError, match="_remove_final_layer_norm"):
        GlobEncAttribution(build("opt", "lm", _remove_final_layer_norm=True))
    spec = ARCHITECTURES["olmo2"]
    with pytest.raises(ValueError, match="pre-norm on every branch, or post-norms on every"):
        replace(spec, layer=replace(spec.layer, attention=replace(spec.layer.attention, post_norm=None),
                                    ff=replace(spec.layer.ff, post_norm=None)))
