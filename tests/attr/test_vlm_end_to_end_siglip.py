r"""DecompX end to end through a SigLIP tower: PaliGemma, PaliGemma 2, Gemma 3, Idefics3 and SmolVLM (issue 38,
item 2; docs/vlm_end_to_end.md).

Every image patch's score, the text tokens' scores and the no-token terms add up to the model's own logit, with and
without the processor's ``token_type_ids`` (two-way prefix / image spans); the rebuilt image features and embeddings
equal the model's; the image tokens' scores are DecompX's at the language model's input, each the sum of its row; a
left-padded batch equals its single examples; the model is unchanged; with the tower's attention outputs zeroed each
image token draws on its own patches only, and those patches are the pixels that move its embedding. Idefics3 and
SmolVLM run with split images: examples of 2 and 3 sub-images (the processor's tiles and global view), the shorter
padded with an all-zero image as the processor pads.
"""
from __future__ import annotations

import pytest
import torch

from captum_normattr import DecompXAttribution
from captum_normattr.arch.spec import UnsupportedModelError
from captum_normattr.attr.vlm_end_to_end_siglip import siglip_patch_contributions, siglip_token_parts
from vlm_checks import check_model_unchanged
from vlm_end_to_end_models import make_mixing_llava
from vlm_end_to_end_models import terms_scale as _scale
from vlm_end_to_end_models import total as _total
from vlm_families import (GEMMA_BOI, GEMMA_EOI, GEMMA_IMAGE, GEMMA_PATCH, GEMMA_SIZE, GEMMA_TOKENS, IDEFICS_FAKE, IDEFICS_GLOBAL, IDEFICS_IMAGE,
                          IDEFICS_PATCH, IDEFICS_SCALE, IDEFICS_SIZE, PALI_IMAGE, PALI_PATCH, PALI_SIZE, _left_pad,
                          gemma3_batch, idefics3_tokens, make_gemma3, make_idefics3, make_paligemma, paligemma_batch)
from vlm_models import merged_embeddings

FAMILIES = ("paligemma", "paligemma2", "gemma3", "idefics3", "smolvlm")
SHUFFLED = ("idefics3", "smolvlm")
#: (image token, image size, patch size, patches per image token side)
GEOMETRY = {"paligemma": (PALI_IMAGE, PALI_SIZE, PALI_PATCH, 1), "paligemma2": (PALI_IMAGE, PALI_SIZE, PALI_PATCH, 1),
            "gemma3": (GEMMA_IMAGE, GEMMA_SIZE, GEMMA_PATCH, 2),
            "idefics3": (IDEFICS_IMAGE, IDEFICS_SIZE, IDEFICS_PATCH, IDEFICS_SCALE),
            "smolvlm": (IDEFICS_IMAGE, IDEFICS_SIZE, IDEFICS_PATCH, IDEFICS_SCALE)}
SUB_IMAGES = (2, 3)  # Idefics3 / SmolVLM: sub-images per example of a batch


def _tower(model):
    return getattr(model.model, "vision_tower", None) or model.model.vision_model


def _make(family: str, seed: int = 1, vision_layers: int = 2, isolated: bool = False):
    r"""The family's tiny float64 model with a sharp tower attention (q and k weights times 2), or, ``isolated``,
    with the tower's attention outputs zeroed (each patch token sees itself only)."""
    if family == "gemma3":
        model = make_gemma3(seed=seed, vision_layers=vision_layers)
    elif family in SHUFFLED:
        model = make_idefics3(seed=seed, vision_layers=vision_layers, family=family)
    else:
        text = "gemma2" if family == "paligemma2" else "gemma"
        model = make_paligemma(seed=seed, vision_layers=vision_layers, text=text)
    with torch.no_grad():
        for layer in _tower(model).encoder.layers:
            attn = layer.self_attn
            if isolated:
                attn.out_proj.weight.zero_()
                attn.out_proj.bias.zero_()
            else:
                attn.q_proj.weight.mul_(2.0)
                attn.k_proj.weight.mul_(2.0)
    return model


def _idefics3_batch(lengths, seed: int = 2, sub_images=SUB_IMAGES):
    r"""Left-padded rows of the processor's split-image layout, ``[1, (<fake>, <global-img>, image tokens) per
    sub-image, <fake>, text]``; pixel values (B, N, 3, 24, 24) with all-zero padding images and the pixel mask."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n, k in zip(lengths, sub_images):
        block = torch.cat([torch.tensor([IDEFICS_FAKE, IDEFICS_GLOBAL]),
                           torch.full((idefics3_tokens(),), IDEFICS_IMAGE)])
        rows.append(torch.cat([torch.tensor([1]), block.repeat(k), torch.tensor([IDEFICS_FAKE]),
                               torch.randint(3, IDEFICS_FAKE, (n,), generator=g)]))
    ids, mask = _left_pad(rows)
    b = len(rows)
    most = max(sub_images[:b])
    pixels = torch.zeros(b, most, 3, IDEFICS_SIZE, IDEFICS_SIZE, dtype=torch.float64)
    pixel_mask = torch.zeros(b, most, IDEFICS_SIZE, IDEFICS_SIZE, dtype=torch.long)
    for i, k in enumerate(sub_images[:b]):
        pixels[i, :k] = torch.randn(k, 3, IDEFICS_SIZE, IDEFICS_SIZE, generator=g, dtype=torch.float64)
        pixel_mask[i, :k] = 1
    return ids, mask, {"pixel_values": pixels, "pixel_attention_mask": pixel_mask}


def _batch(family: str, lengths, seed: int = 2, token_types: bool = True):
    if family == "gemma3":
        return gemma3_batch(list(lengths), seed, token_types)
    if family in SHUFFLED:
        return _idefics3_batch(list(lengths), seed)
    return paligemma_batch(list(lengths), seed, token_types)


def _single(family: str, extra, i: int, keep):
    r"""Example ``i``'s own further inputs (its real sub-images only)."""
    if family in SHUFFLED:
        k = SUB_IMAGES[i]
        return {"pixel_values": extra["pixel_values"][i:i + 1, :k],
                "pixel_attention_mask": extra["pixel_attention_mask"][i:i + 1, :k]}
    return {"pixel_values": extra["pixel_values"][i:i + 1], "token_type_ids": extra["token_type_ids"][i:i + 1, keep]}


def _run(model, ids, mask, extra):
    return siglip_patch_contributions(model, ids, extra["pixel_values"], attention_mask=mask,
                                      token_type_ids=extra.get("token_type_ids"),
                                      pixel_attention_mask=extra.get("pixel_attention_mask"))


def _own_logit(model, ids, mask, extra, res) -> torch.Tensor:
    r"""The model's own explained logit, the soft-cap undone where the decoder has one (DecompX explains the pre-cap
    logit), positions counted over the real tokens as the package counts them."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, **extra).logits
    out = logits[torch.arange(ids.shape[0]), res.explained_position, res.target]
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    return out if cap is None else cap * torch.atanh(out / cap)


@pytest.mark.parametrize("family,token_types", [(f, t) for f in FAMILIES for t in (True, False)
                                                if t or f not in SHUFFLED])
def test_patch_scores_complete_against_the_model_logit(family, token_types):
    model = _make(family)
    ids, mask, extra = _batch(family, (3, 5), token_types=token_types)
    res = _run(model, ids, mask, extra)
    scale = _scale(res)
    assert (_total(res) - res.logit).abs().max() <= 1e-10 * scale
    assert res.delta.max() <= 1e-10 * scale
    real = _own_logit(model, ids, mask, extra, res)
    assert (real - res.logit).abs().max() <= 1e-10 * float(real.abs().max())
    assert max(res.checks.values()) < 1e-12
    _, size, patch, _ = GEOMETRY[family]
    images = sum(SUB_IMAGES) if family in SHUFFLED else 2
    assert res.patch_scores.shape == (images, size // patch, size // patch)
    assert res.image_example.tolist() == ([0] * SUB_IMAGES[0] + [1] * SUB_IMAGES[1] if family in SHUFFLED else [0, 1])
    assert set(res.no_token) == {"position_embeddings", "patch_embedding_bias", "tower_biases", "projector_biases",
                                 "language_model_biases"}
    # the tower mixes: an image token draws on many patches (the LM-input heat map cannot say this)
    p = res.patch_scores[0].numel()
    patch_part = res.token_sources[..., :p].abs()
    drawn = (patch_part > 1e-3 * patch_part.amax(-1, keepdim=True)).sum(-1)
    assert drawn.min() >= 2 and drawn.double().mean() >= 4


def test_gemma3_several_images_per_example():
    r"""Gemma 3 with two images in the first example and one in the second (each image its own two-way span): every
    image gets its own patch grid and example, and the terms complete against the model's logit."""
    g = torch.Generator().manual_seed(7)
    image = torch.cat([torch.tensor([GEMMA_BOI]), torch.full((GEMMA_TOKENS,), GEMMA_IMAGE), torch.tensor([GEMMA_EOI])])
    ids, mask = _left_pad([torch.cat([torch.tensor([1]), image, torch.tensor([5, 6]), image, torch.tensor([7, 8])]),
                           torch.cat([torch.tensor([1]), image, torch.tensor([9, 10, 11])])])
    extra = {"pixel_values": torch.randn(3, 3, GEMMA_SIZE, GEMMA_SIZE, generator=g, dtype=torch.float64),
             "token_type_ids": (ids == GEMMA_IMAGE).long()}
    model = _make("gemma3")
    res = _run(model, ids, mask, extra)
    assert res.image_example.tolist() == [0, 0, 1]
    assert (_total(res) - _own_logit(model, ids, mask, extra, res)).abs().max() <= 1e-10 * _scale(res)
    assert max(res.checks.values()) < 1e-12
    # moving the second image of example 0 moves its scores (and, through the decoder, its neighbour's in that
    # example), and leaves the other example's image exactly as it was
    moved = dict(extra, pixel_values=extra["pixel_values"].clone())
    moved["pixel_values"][1] += 0.5
    again = _run(model, ids, mask, moved)
    assert not torch.equal(again.patch_scores[1], res.patch_scores[1])
    assert not torch.equal(again.patch_scores[0], res.patch_scores[0])
    assert (again.token_sources[2] - res.token_sources[2]).abs().max() <= 1e-12 * _scale(res)


@pytest.mark.parametrize("family", FAMILIES)
def test_token_parts_rebuild_the_models_image_features(family):
    model = _make(family)
    _, _, extra = _batch(family, (3,))
    px = extra["pixel_values"]
    (parts, bias, const), tp, features = siglip_token_parts(model, px)
    with torch.no_grad():
        tower = _tower(model)(px.flatten(0, 1) if family in SHUFFLED else px).last_hidden_state
        real = model.model.get_image_features(px).pooler_output
    real = torch.cat(list(real)) if isinstance(real, (list, tuple)) else real
    assert (features - tower).abs().max() <= 1e-12 * float(tower.abs().max())
    assert (parts.sum(2) + bias + const - real.view(parts.shape[0], parts.shape[1], -1)).abs().max() \
        <= 1e-12 * float(real.abs().max())
    assert tp.error <= 1e-12 * float(tp.features.abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_image_token_rows_are_decompx_scores(family):
    model = _make(family)
    ids, mask, extra = _batch(family, (4, 2))
    res = _run(model, ids, mask, extra)
    ref = DecompXAttribution(model).decompose(ids, additional_forward_args={"attention_mask": mask, **extra})
    scale = float(ref.scores.abs().max())
    assert (res.image_token_scores + res.text_scores - ref.scores).abs().max() <= 1e-12 * scale
    assert (res.no_token["language_model_biases"] - ref.bias_scores[:, 0]).abs().max() <= 1e-12 * scale
    image = ids == GEOMETRY[family][0]
    per_token = res.image_token_scores[image].view(res.token_sources.shape[:2])
    assert (res.token_sources.sum(-1) - per_token).abs().max() <= 1e-12 * scale
    assert res.token_sources.shape[-1] == len(res.source_names)
    assert (res.text_scores[image] == 0).all() and (res.image_token_scores[~image] == 0).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padded_batch_equals_single_examples(family):
    model = _make(family)
    ids, mask, extra = _batch(family, (2, 6))
    res = _run(model, ids, mask, extra)
    for i in range(2):
        keep = mask[i] > 0
        one = _run(model, ids[i:i + 1, keep], mask[i:i + 1, keep], _single(family, extra, i, keep))
        scale = _scale(one)
        assert (res.patch_scores[res.image_example == i] - one.patch_scores).abs().max() <= 1e-10 * scale
        assert (res.text_scores[i, keep] - one.text_scores[0]).abs().max() <= 1e-10 * scale
        assert (res.text_scores[i, ~keep] == 0).all()
        for name, v in one.no_token.items():
            assert abs(float(res.no_token[name][i] - v[0])) <= 1e-10 * scale
        assert abs(float(res.logit[i] - one.logit[0])) <= 1e-10 * abs(float(one.logit[0]))


@pytest.mark.parametrize("family", ["paligemma", "gemma3", "idefics3"])
def test_model_unchanged(family):
    model = _make(family)
    ids, mask, extra = _batch(family, (4, 3))

    def forward():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, **extra).logits

    forward()  # transformers installs its own output-capturing hooks on a first forward
    impl = (model.config._attn_implementation, _tower(model).config._attn_implementation)
    check_model_unchanged(model, lambda: _run(model, ids, mask, extra), forward)
    assert (model.config._attn_implementation, _tower(model).config._attn_implementation) == impl


@pytest.mark.parametrize("family", ["paligemma", "gemma3", "idefics3"])
def test_each_token_draws_on_its_own_patches_where_the_tower_does_not_mix(family):
    r"""The tower's attention outputs zeroed: image token j is a function of its own patches' pixels only (PaliGemma:
    patch j; Gemma 3: the k x k block pooled into it; Idefics3: the s x s block its pixel shuffle concatenates, in
    each sub-image). Its patch parts are exactly 0 elsewhere, a patch's score is its token's part from it, and
    changing that patch's pixels moves that token's embedding and no other (Idefics3: in the second sub-image)."""
    model = _make(family, isolated=True)
    ids, mask, extra = _batch(family, (3,))
    res = _run(model, ids, mask, extra)
    image_token, size, patch, k = GEOMETRY[family]
    side = size // patch
    t = side // k
    sub = 1 if family in SHUFFLED else 0  # the (sub-)image perturbed
    src = res.token_sources[sub, :, :side * side]  # (tokens, patches)
    own = torch.zeros_like(src, dtype=torch.bool)
    for r in range(side):
        for c in range(side):
            own[(r // k) * t + c // k, r * side + c] = True
    assert (src[~own] == 0).all()
    assert (src[own] != 0).all()
    assert torch.equal(res.patch_scores[sub].flatten(), src.sum(0))
    inputs = {k: v for k, v in extra.items() if k != "pixel_values"}
    decoder = "text_model" if family in SHUFFLED else "language_model"
    x0 = merged_embeddings(model, ids, mask, extra["pixel_values"], decoder, **inputs)
    tokens = (ids[0] == image_token).nonzero()[:, 0].view(-1, t * t)[sub]  # the sub-image's image tokens
    for r, c in ((0, 0), (1, side - 1), (side - 1, 1)):
        moved = extra["pixel_values"].clone()
        block = moved[0, sub] if family in SHUFFLED else moved[0]
        block[:, patch * r:patch * (r + 1), patch * c:patch * (c + 1)] += 1.0
        x1 = merged_embeddings(model, ids, mask, moved, decoder, **inputs)
        change = (x1 - x0)[0].norm(dim=-1)
        expect = torch.zeros_like(change, dtype=torch.bool)
        expect[tokens[own[:, r * side + c]]] = True
        assert torch.equal(change > 1e-9, expect), (r, c)


def _gemma3_with_its_own_projector_norm():
    r"""The Gemma 3 model with transformers' own ``Gemma3RMSNorm`` (computing in float32) back in its projector."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    model = _make("gemma3")
    proj = model.model.multi_modal_projector
    own = Gemma3RMSNorm(proj.mm_soft_emb_norm.weight.shape[0], eps=proj.mm_soft_emb_norm.eps).double()
    with torch.no_grad():
        own.weight.copy_(proj.mm_soft_emb_norm.weight)
    proj.mm_soft_emb_norm = own
    return model


@pytest.mark.parametrize("family", ["paligemma", "gemma3", "idefics3"])
def test_float32_models_complete(family):
    r"""Float32 models (Gemma 3 with transformers' own projector norm) complete to float32's rounding."""
    model = (_gemma3_with_its_own_projector_norm() if family == "gemma3" else _make(family)).float()
    ids, mask, extra = _batch(family, (3, 5))
    extra = {k: v.float() if v.is_floating_point() else v for k, v in extra.items()}
    res = _run(model, ids, mask, extra)
    assert res.patch_scores.dtype == torch.float32
    real = _own_logit(model, ids, mask, extra, res)
    scale = _scale(res)
    assert (_total(res) - real).abs().max() <= 1e-5 * scale
    assert max(res.checks.values()) < 1e-5


def test_refuses_what_it_cannot_carry():
    llava = make_mixing_llava("siglip")
    with pytest.raises(UnsupportedModelError, match="PaliGemma, Gemma 3"):
        siglip_patch_contributions(llava, torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 3, 16, 16))
    # transformers' own Gemma 3 RMSNorm computes in float32: in a float64 model the rebuilt embeddings differ by
    # its rounding, far above float64's tolerance, and the call says so instead of returning inexact scores
    model = _gemma3_with_its_own_projector_norm()
    ids, mask, extra = _batch("gemma3", (3,))
    with pytest.raises(ValueError, match="differ from the model's"):
        _run(model, ids, mask, extra)
    # an Idefics3 image with padded pixels inside (the tower would read fewer patches): refused with the reason
    model = _make("idefics3")
    ids, mask, extra = _batch("idefics3", (3,))
    extra["pixel_attention_mask"][0, 0, :, -4:] = 0
    with pytest.raises(UnsupportedModelError, match="padded pixels"):
        _run(model, ids, mask, extra)
