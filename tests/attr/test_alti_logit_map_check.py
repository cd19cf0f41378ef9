r"""ALTI-Logit's check of its ALTI maps (issue 36 item 1): a wrong map is reported, not silent.

The rows of an ALTI map sum to 1 whatever kernel computed them, so a kernel that returns wrong
rows moves logit between tokens and leaves the completeness delta at rounding. ALTI-Logit
recomputes the first rows of every map with the torch path (the map of the layer's first
tokens, exact for causal attention) and the consistency guard judges the difference.
"""
import pytest
import torch

import captum_normattr.attr.alti_logit as attr_alti_logit
import captum_normattr.decompose.methods.alti as alti
import captum_normattr.decompose.methods.alti_logit as alti_logit
from captum_normattr import ALTILogitAttribution
from captum_normattr.decompose.kinds.registry import layer_kind
from captum_normattr.decompose.methods.alti_logit import ALTI_MAP_CHECK, alti_map_check, token_prefix
from captum_normattr.models.guard import ConsistencyError, ConsistencyWarning
from conftest import make_model, random_batch
from decoder_models import DECODER_FAMILIES, decoder_batch, make_decoder
from layer_capture import capture_layers


@pytest.mark.parametrize("family", DECODER_FAMILIES)
def test_the_first_tokens_map_is_the_first_rows_of_the_map(family):
    model = make_decoder(family)
    ids, mask = decoder_batch([9, 7], seed=2)  # example 1 left-padded by 2
    valid = mask.bool()
    for layer in capture_layers(model, ids, mask):
        kind = layer_kind(layer.topology)
        full = kind.alti_map(layer, valid, 128.0)
        for rows in (1, 4, 8):
            first = kind.alti_map(token_prefix(layer, rows), valid[:, :rows], 128.0)
            assert first.shape == (2, rows, rows)
            assert torch.allclose(first, full[:, :rows, :rows], rtol=0, atol=1e-12)
        err = alti_map_check(kind, layer, valid, full, 128.0, rows=5)
        assert err is not None and float(err) < 1e-12
        assert alti_map_check(kind, layer, valid, full, 128.0, rows=9) is None  # the whole sequence: nothing to compare
        wrong = full.clone()
        wrong[0, 3, :4] = wrong[0, 3, :4].flip(-1)  # still a row summing to 1
        assert float(alti_map_check(kind, layer, valid, wrong, 128.0, rows=5)) > 1e-3


def test_token_prefix_refuses_bidirectional_layers():
    model = make_model("bert")
    ids, mask = random_batch([6])
    layer = capture_layers(model, ids, mask)[0]
    with pytest.raises(ValueError, match="causal"):
        token_prefix(layer, 3)


def _faulty_kernel(monkeypatch, rows: int):
    r"""The distance kernel returns wrong rows on the full problem (more rows than the check recomputes): in every
    row but the first, token 0's part is counted as farther from the output than the zero vector."""
    real = alti._tiled_distances

    def wrong(probs, proj_j, residual, target, *args, **kwargs):
        dist = real(probs, proj_j, residual, target, *args, **kwargs)
        if dist.shape[1] > rows:  # the full map, not the check's first rows
            dist = dist.clone()
            dist[:, 1:, 0] += target[:, 1:].abs().sum(-1) + 1.0
        return dist

    monkeypatch.setattr(alti, "_tiled_distances", wrong)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_wrong_map_is_silent_in_the_delta_and_refused_by_the_check(family, monkeypatch):
    model = make_decoder(family)
    ids, mask = decoder_batch([8, 8], seed=3)
    target = torch.tensor([5, 9])
    clean = ALTILogitAttribution(model, strict=True).decompose(ids, target, mask)
    assert float(clean.extras["alti_map_check"].max()) < 1e-12
    monkeypatch.setattr(alti_logit, "ALTI_CHECK_ROWS", 4)
    _faulty_kernel(monkeypatch, 4)
    # without the check the wrong map goes unnoticed: the delta stays at rounding, the scores move
    with monkeypatch.context() as m:
        m.setattr(attr_alti_logit, "alti_map_check", lambda *a, **k: None)
        silent = ALTILogitAttribution(model, strict=True).decompose(ids, target, mask)
    assert float(silent.delta.max()) < 1e-8
    moved = (silent.scores - clean.scores).abs().amax(-1) / clean.scores.abs().amax(-1)
    assert float(moved.min()) > 1e-2
    # with it the guard refuses the call (a difference this large is refused even without strict=True)
    for strict in (False, True):
        with pytest.raises(ConsistencyError, match=ALTI_MAP_CHECK):
            ALTILogitAttribution(model, strict=strict).decompose(ids, target, mask)
    with pytest.raises(ConsistencyError, match=ALTI_MAP_CHECK):
        ALTILogitAttribution(model).explain_positions(ids[0], torch.tensor([5, 7]), torch.tensor([5, 9]))


def test_a_small_map_difference_warns_and_strict_raises(monkeypatch):
    r"""A difference above the tolerance but below the gross limit: one warning, or an error when strict."""
    model = make_decoder("llama")
    ids, mask = decoder_batch([8], seed=4)
    monkeypatch.setattr(alti_logit, "ALTI_CHECK_ROWS", 4)
    real = alti._tiled_distances

    def slightly(probs, proj_j, residual, target, *args, **kwargs):
        dist = real(probs, proj_j, residual, target, *args, **kwargs)
        if dist.shape[1] > 4:
            dist = dist.clone()
            dist[:, 2, 0] += 1e-3 * target[:, 2].abs().sum(-1)
        return dist

    monkeypatch.setattr(alti, "_tiled_distances", slightly)
    with pytest.warns(ConsistencyWarning, match=ALTI_MAP_CHECK):
        res = ALTILogitAttribution(model).decompose(ids, 5, mask)
    assert 1e-5 < float(res.extras["alti_map_check"].max()) < 1e-2
    with pytest.raises(ConsistencyError, match=ALTI_MAP_CHECK):
        ALTILogitAttribution(model, strict=True).decompose(ids, 5, mask)
