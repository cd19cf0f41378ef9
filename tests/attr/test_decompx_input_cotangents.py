r"""DecompXAttribution.input_cotangents: the adjoint's cotangent of the explained logit at the decoder's input.

g_k . e_k is DecompX's score of token k (the same as decompose()'s, by either algorithm), sum_k g_k . e_k plus the
bias score is the model's logit, the cotangent is 0 at pads, and what is not a decoder in separate mode is refused.
"""
from __future__ import annotations

import pytest
import torch

from captum_normattr import DecompXAttribution, UnsupportedModelError
from decoder_models import decoder_batch, make_decoder


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_cotangent_times_embedding_is_the_decompx_score(family):
    model = make_decoder(family)
    ids, mask = decoder_batch([5, 7])
    cot = DecompXAttribution(model).input_cotangents(ids, additional_forward_args={"attention_mask": mask})
    res = cot.result
    scale = float(res.scores.abs().sum(-1).max().clamp(min=1.0))
    assert cot.cotangent.shape == cot.embeddings.shape == (*ids.shape, model.config.hidden_size)
    scores = (cot.cotangent * cot.embeddings).sum(-1)
    assert (scores * mask - res.scores).abs().max() <= 1e-12 * scale
    assert cot.cotangent[mask == 0].abs().max() == 0  # pads are read by no real row
    forward = DecompXAttribution(model, algorithm="forward").decompose(
        ids, target=res.target, additional_forward_args={"attention_mask": mask})
    assert (forward.scores - res.scores).abs().max() <= 1e-10 * scale
    total = scores.mul(mask).sum(-1) + res.bias_scores[:, 0]
    assert (total - res.logits[:, 0]).abs().max() <= 1e-10 * scale
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
    assert (own[torch.arange(2), res.target] - res.logits[:, 0]).abs().max() <= 1e-10 * scale


def test_cotangent_is_linear_in_the_explained_direction():
    # the foil subtracts its logit: g(target - foil) = g(target) - g(foil), every layer frozen at the same point
    model = make_decoder("llama")
    ids, mask = decoder_batch([6])
    attr = DecompXAttribution(model)
    a = attr.input_cotangents(ids, target=5, additional_forward_args={"attention_mask": mask})
    b = attr.input_cotangents(ids, target=5, additional_forward_args={"attention_mask": mask}, foil=7)
    c = attr.input_cotangents(ids, target=7, additional_forward_args={"attention_mask": mask})
    # the cotangent is linear in the explained direction: g(5 - 7) = g(5) - g(7)
    assert (b.cotangent - (a.cotangent - c.cotangent)).abs().max() <= 1e-12 * float(a.cotangent.abs().max())


def test_refused_where_there_is_no_adjoint_next_token_logit():
    model = make_decoder("llama")
    ids, mask = decoder_batch([4])
    with pytest.raises(UnsupportedModelError, match="separate"):
        DecompXAttribution(model, bias_mode="spread").input_cotangents(ids)
