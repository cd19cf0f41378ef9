r"""PaliGemma 2 (issue 38): the ``paligemma`` model type with a Gemma 2 decoder (``docs/vlm.md``).

On a tiny float64 PaliGemma 2 (``make_paligemma(text="gemma2")``: sandwich norms, attention soft-cap 5, final
soft-cap 30, layer 0 sliding over 4 tokens, the zoo's float64 eager attention): the description picks Gemma 2's
sandwich layer under the language model; without ``token_type_ids`` (a causal forward) ALTI-Logit and DecompX are
complete against the model's own logit through the final soft-cap (the scores explain the pre-cap logit), and
GlobEnc's, ALTI's and the FF decomposition's parts sum to the model's tensors with and without ``token_type_ids``;
a left-padded batch equals its examples; the model is unchanged; transformers' own eager attention (its softmax in
float32) is explained to its float32 rounding. The two-way prefix (``token_type_ids``) is tested with PaliGemma's in
``tests/attr/test_vlm_two_way.py`` (completeness, the open pairs, a naive ALTI reference, padding).
"""
from __future__ import annotations

import pytest
import torch

from captum_normattr import ALTIAttribution, ALTILogitAttribution, DecompXAttribution, GlobEncAttribution
from captum_normattr.attr.explained_output import apply_final_softcap
from captum_normattr.attr.vlm_regions import image_geometry, image_heatmaps
from captum_normattr.models.adapters import get_adapter
from map_checks import check_maps_complete
from vlm_checks import check_model_unchanged, check_padded_equals_singles
from vlm_families import PALI_IMAGE, make_paligemma, paligemma_batch, paligemma_tokens

METHODS = [ALTILogitAttribution, DecompXAttribution, ALTIAttribution, GlobEncAttribution]
CAP = 30.0  # the tiny model's final_logit_softcapping


@pytest.fixture(scope="module")
def model():
    return make_paligemma(seed=1, text="gemma2")


def _real(model, ids, mask, extra):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
                     **extra).logits[:, -1]


def test_description_is_gemma2s_sandwich_layer(model):
    spec = get_adapter(model)
    assert spec.family == "PaliGemma (Gemma 2)" and spec.layers == "language_model.layers"
    attn, ff = spec.layer.attention, spec.layer.ff
    assert attn.post_norm is not None and attn.post_norm.path == "post_attention_layernorm"  # the sandwich
    assert ff.pre_norm.path == "pre_feedforward_layernorm" and ff.post_norm.path == "post_feedforward_layernorm"
    assert attn.softcap == "attn_logit_softcapping" and spec.head.final_softcap == "final_logit_softcapping"
    plain = get_adapter(make_paligemma(seed=1, layers=1))  # PaliGemma (1): Gemma's layer, no sandwich, no cap
    assert plain.family == "PaliGemma (Gemma)" and plain.layer.attention.post_norm is None


@pytest.mark.parametrize("cls", [ALTILogitAttribution, DecompXAttribution], ids=lambda c: c.__name__)
def test_complete_against_the_models_capped_logit(model, cls):
    ids, mask, extra = paligemma_batch([3, 6], seed=2, token_types=False)
    t = torch.tensor([5, 9])
    real = _real(model, ids, mask, extra)[[0, 1], t]
    res = cls(model).decompose(ids, t, {"attention_mask": mask, **extra})
    rest = res.no_token_total if cls is ALTILogitAttribution else res.bias_scores[:, 0]
    pre = res.scores.sum(-1) + rest
    assert res.extras["explained_logit"] == "pre-cap logit"
    err = ((apply_final_softcap(pre, CAP) - real).abs() / real.abs().max()).max()
    assert err < 1e-10, float(err)
    assert ((res.extras["capped_logit"].reshape(-1) - real).abs() / real.abs().max()).max() < 1e-10
    assert ((pre - CAP * torch.atanh(real / CAP)).abs() / pre.abs().max()).max() < 1e-10  # the pre-cap logit itself
    assert res.scores[ids == PALI_IMAGE].abs().sum() > 0
    assert (res.scores[mask == 0] == 0).all()


@pytest.mark.parametrize("token_types", [False, True], ids=["causal", "prefix"])
def test_maps_complete(model, token_types):
    ids, mask, extra = paligemma_batch([3, 6], seed=3, token_types=token_types)
    check_maps_complete(model, ids, {"attention_mask": mask, **extra})


@pytest.mark.parametrize("cls", METHODS, ids=lambda c: c.__name__)
def test_padded_batch_equals_single_examples(model, cls):
    r"""The causal forward (the two-way prefix's padding: ``tests/attr/test_vlm_two_way.py``)."""
    ids, mask, extra = paligemma_batch([5, 2], seed=4, token_types=False)
    check_padded_equals_singles(cls(model), ids, mask, extra, torch.tensor([6, 9]),
                                lambda extra, b, keep: {"pixel_values": extra["pixel_values"][b:b + 1]})


@pytest.mark.parametrize("token_types", [False, True], ids=["causal", "prefix"])
def test_model_unchanged(model, token_types):
    ids, mask, extra = paligemma_batch([4, 3], seed=5, token_types=token_types)
    check_model_unchanged(model, lambda: DecompXAttribution(model).attribute(
        ids, target=torch.tensor([1, 2]), additional_forward_args={"attention_mask": mask, **extra}),
        lambda: _real(model, ids, mask, extra))


def test_transformers_eager_attention_to_its_float32_rounding():
    r"""transformers' own eager Gemma 2 attention takes its softmax in float32 even in a float64 model: the
    decomposition follows the recorded probabilities, so it is complete to that rounding (not to 1e-10); sdpa
    refuses the attention soft-cap itself."""
    model = make_paligemma(seed=1, text="gemma2")
    model.config._attn_implementation = "eager"
    ids, mask, extra = paligemma_batch([3, 6], seed=2)
    t = torch.tensor([5, 9])
    real = _real(model, ids, mask, extra)[[0, 1], t]
    res = ALTILogitAttribution(model).decompose(ids, t, {"attention_mask": mask, **extra})
    err = ((apply_final_softcap(res.scores.sum(-1) + res.no_token_total, CAP) - real).abs() / real.abs().max()).max()
    assert err < 1e-6, float(err)


def test_regions_on_the_patch_grid(model):
    r"""Every SigLIP patch is one token: token k of the 3 x 3 grid on pixel block (k // 3, k % 3) of 4 x 4 pixels."""
    g = image_geometry(model)
    assert g.patch == (4, 4) and g.grids == ((3, 3),) and g.tokens(0) == paligemma_tokens() == 9
    ids = torch.tensor([[PALI_IMAGE] * 9 + [1, 7]])
    heat = image_heatmaps(torch.arange(11, dtype=torch.float64)[None], ids, model)[0]
    for k in range(9):
        assert (heat[4 * (k // 3):4 * (k // 3) + 4, 4 * (k % 3):4 * (k % 3) + 4] == k).all()
