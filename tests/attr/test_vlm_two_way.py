r"""Decoders whose attention is two-way over part of the sequence (issue 38): Gemma 3 with ``token_type_ids``
(each image span two-way) and PaliGemma and PaliGemma 2 (its prefix two-way, the suffix causal); ``docs/vlm.md``,
"Two-way spans".

On tiny float64 models (``tests/fixtures/vlm_families.py``): the two-way forward differs from the causal one, and
ALTI-Logit and DecompX are complete against the two-way forward's own logit; ALTI's and GlobEnc's layer maps are
non-zero above the diagonal exactly at the pairs the processor's ``token_type_ids`` open (built here from the ids),
and one layer's ALTI map equals a naive reference that soft-maxes under that mask itself
(``tests/fixtures/two_way_reference.py``); a left-padded batch equals its examples; the model is unchanged.
"""
from __future__ import annotations

import pytest
import torch

from captum_normattr import ALTIAttribution, ALTILogitAttribution, DecompXAttribution, GlobEncAttribution
from captum_normattr.attr.explained_output import apply_final_softcap, final_softcap
from captum_normattr.attr.vlm_regions import two_way_pairs
from captum_normattr.models.adapters import get_adapter, vision_language
from vlm_checks import check_model_unchanged, check_padded_equals_singles
from vlm_families import GEMMA_IMAGE, gemma3_batch, make_gemma3, make_paligemma, paligemma_batch

METHODS = [ALTILogitAttribution, DecompXAttribution, ALTIAttribution, GlobEncAttribution]
FAMILIES = {"gemma3": (make_gemma3, gemma3_batch), "paligemma": (make_paligemma, paligemma_batch),
            "paligemma2": (lambda **k: make_paligemma(text="gemma2", **k), paligemma_batch)}  # Gemma 2 decoder


def _open_pairs(family, ids, mask, types):
    r"""(B, T, T) the pairs (i, j > i) of real tokens that attend two-way, from the ids and types as the docs say:
    Gemma 3: i and j in the same run of image tokens; PaliGemma: i and j both in the prefix (type 0)."""
    t = ids.shape[1]
    real = mask.bool()
    if family == "gemma3":
        image = ids == GEMMA_IMAGE
        assert torch.equal(image, types.bool())
        run = torch.cumsum(image & ~torch.cat([torch.zeros_like(image[:, :1]), image[:, :-1]], 1), 1)
        same = image[:, :, None] & image[:, None, :] & (run[:, :, None] == run[:, None, :])
    else:
        prefix = (types == 0) & real
        same = prefix[:, :, None] & prefix[:, None, :]
    return same & real[:, :, None] & real[:, None, :] & torch.ones(t, t, dtype=torch.bool).triu(1)


def _real(model, ids, mask, extra):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
                     **extra).logits[:, -1]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def case(request):
    make, batch = FAMILIES[request.param]
    return request.param, make(seed=1), batch


@pytest.mark.parametrize("cls", [ALTILogitAttribution, DecompXAttribution], ids=lambda c: c.__name__)
def test_complete_against_the_two_way_forward(case, cls):
    family, model, batch = case
    ids, mask, extra = batch([3, 6], seed=2)
    causal = {k: v for k, v in extra.items() if k != "token_type_ids"}
    real = _real(model, ids, mask, extra)
    scale = real.abs().max()
    assert ((real - _real(model, ids, mask, causal)).abs() / scale).max() > 1e-3  # the reference is two-way
    t = torch.tensor([5, 9])
    res = cls(model).decompose(ids, t, {"attention_mask": mask, **extra})
    rest = res.no_token_total if cls is ALTILogitAttribution else res.bias_scores[:, 0]
    cap = final_softcap(model, get_adapter(model))  # PaliGemma 2: the scores explain the pre-cap logit
    err = ((apply_final_softcap(res.scores.sum(-1) + rest, cap) - real[[0, 1], t]).abs() / scale).max()
    assert err < 1e-10, float(err)
    assert (res.scores[mask == 0] == 0).all()


@pytest.mark.parametrize("cls", [ALTIAttribution, GlobEncAttribution], ids=lambda c: c.__name__)
def test_maps_open_above_the_diagonal_exactly_at_the_two_way_pairs(case, cls):
    family, model, batch = case
    ids, mask, extra = batch([3, 6], seed=3)
    want = _open_pairs(family, ids, mask, extra["token_type_ids"])
    assert want.any()
    assert torch.equal(two_way_pairs(vision_language(model).two_way, extra["token_type_ids"], mask), want)
    maps = cls(model).decompose(ids, additional_forward_args={"attention_mask": mask, **extra}).layer_maps
    upper = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1)
    for l in range(maps.shape[1]):
        m = maps[:, l]
        # GlobEnc's norms are positive at every open pair; ALTI's max(0, ...) may be exactly 0 at some
        assert (m[want] > 0).all() if cls is GlobEncAttribution else bool((m[want] > 0).any()), l
        assert (m[~want & upper] == 0).all(), l
    causal = {k: v for k, v in extra.items() if k != "token_type_ids"}
    plain = cls(model).decompose(ids, additional_forward_args={"attention_mask": mask, **causal}).layer_maps
    assert (plain[..., upper] == 0).all()


def test_one_layers_alti_map_equals_a_naive_reference(case):
    r"""Every layer's ALTI map against :func:`naive_layer_alti` on the layer's real input, under the mask built
    here; the reference's parts also rebuild the layer's real attention-block output (the mask is the model's)."""
    from two_way_reference import naive_layer_alti

    family, model, batch = case
    ids, mask, extra = batch([3, 6], seed=4)
    allowed = (torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
               | _open_pairs(family, ids, mask, extra["token_type_ids"])) & mask.bool()[:, None, :]
    layers = model.model.language_model.layers
    got = {}

    def keep(l):
        def hook(module, args, kwargs):
            got[l] = (args[0] if args else kwargs["hidden_states"], kwargs["position_embeddings"])
        return hook

    def keep_h(l):
        return lambda module, args: got.__setitem__(("h", l), args[0])

    sandwich = hasattr(layers[0], "pre_feedforward_layernorm")  # Gemma 2 and 3: h is the pre-FF norm's input
    after = "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"
    handles = [layer.register_forward_pre_hook(keep(l), with_kwargs=True) for l, layer in enumerate(layers)]
    handles += [getattr(layer, after).register_forward_pre_hook(keep_h(l)) for l, layer in enumerate(layers)]
    try:
        _real(model, ids, mask, extra)
    finally:
        for h in handles:
            h.remove()
    maps = ALTIAttribution(model).decompose(ids, additional_forward_args={"attention_mask": mask, **extra}).layer_maps
    valid = mask.bool()
    for l, layer in enumerate(layers):
        window = getattr(layer.self_attn, "sliding_window", None)  # Gemma 3's sliding layers: AND(window, OR(causal,
        near = torch.ones_like(allowed[0]) if window is None else (  # two-way)): keys j > i - window
            torch.arange(ids.shape[1])[None, :] > torch.arange(ids.shape[1])[:, None] - window)
        layer_mask = allowed & near
        if window is not None and family == "paligemma2":  # transformers' PaliGemma 2 sliding layers: OR(the causal
            prefix = _open_pairs(family, ids, mask, extra["token_type_ids"])  # window, the whole prefix both ways)
            layer_mask = ((allowed & near) | prefix | prefix.transpose(1, 2)) & valid[:, None, :]
        with torch.no_grad():
            ref, h = naive_layer_alti(layer, got[l][0], got[l][1], layer_mask, valid)
        real_h = got[("h", l)]
        assert ((h - real_h)[valid].abs().max() / real_h[valid].abs().max()) < 1e-12, l
        assert (ref[..., torch.ones_like(ref[0], dtype=torch.bool).triu(1)] > 0).any()
        assert (maps[:, l] - ref).abs().max() < 1e-12, l


def _single(extra, b, keep):
    return {"pixel_values": extra["pixel_values"][b:b + 1], "token_type_ids": extra["token_type_ids"][b:b + 1, keep]}


@pytest.mark.parametrize("cls", METHODS, ids=lambda c: c.__name__)
def test_padded_batch_equals_single_examples(case, cls):
    family, model, batch = case
    ids, mask, extra = batch([5, 2], seed=5)
    check_padded_equals_singles(cls(model), ids, mask, extra, torch.tensor([6, 9]), _single)


def test_model_unchanged(case):
    family, model, batch = case
    ids, mask, extra = batch([4, 3], seed=6)
    check_model_unchanged(model, lambda: ALTILogitAttribution(model).attribute(
        ids, target=torch.tensor([1, 2]), additional_forward_args={"attention_mask": mask, **extra}),
        lambda: _real(model, ids, mask, extra))
