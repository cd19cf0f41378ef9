r"""Vision-language models (issue 38, first step): the language model over image and text tokens, and image
regions.

LLaVA's decoder is decomposed over the merged sequence with ``pixel_values`` passed by keyword: token
scores plus no-token terms equal the model's own logit; every method equals its run on the decoder
alone given the merged embeddings (an independent forward of a ``*ForCausalLM`` with the same
weights); padded batches equal single examples; the model is unchanged. The region mapping is
checked on synthetic grids and on a tower whose features each see one patch only.
"""
from __future__ import annotations

import pytest
import torch

from captum_normattr import (
    ALTIAttribution,
    ALTILogitAttribution,
    DecompXAttribution,
    GlobEncAttribution,
    UnsupportedModelError,
)
from captum_normattr.attr.vlm_regions import (
    ImageGeometry,
    grid_scores,
    image_geometry,
    image_heatmaps,
    image_scores,
    patches_to_pixels,
)
from captum_normattr.arch.families.vlm import LLAVA, vision_language_spec
from captum_normattr.arch.registry import ARCHITECTURES
from captum_normattr.models.adapters import get_adapter, language_config
from vlm_models import (
    IMAGE_TOKEN,
    QWEN_IMAGE,
    image_tokens,
    llava_batch,
    make_llava,
    make_qwen2_vl,
    merged_embeddings,
    qwen2_vl_batch,
    text_twin,
)

METHODS = [ALTILogitAttribution, DecompXAttribution, ALTIAttribution, GlobEncAttribution]


@pytest.fixture(scope="module")
def llava():
    return make_llava()


def _real(model, ids, mask, pixels):
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, pixel_values=pixels, position_ids=pos).logits[:, -1]


def _target(cls, t):
    return t if cls.uses_target else None


def test_adapter_reroots_the_text_family(llava):
    spec = get_adapter(llava)
    assert spec.family == "LLaVA (Llama)" and spec.causal
    assert spec.layers == "language_model.layers" and spec.final_norm == "language_model.norm"
    assert spec.lm_head == "lm_head"
    assert language_config(llava) is llava.config.text_config


@pytest.mark.parametrize("text,tower,strategy", [("llama", "clip", "default"), ("qwen2", "siglip", "full"),
                                                 ("llama", "clip", "full")])
def test_alti_logit_sums_to_the_models_logit(text, tower, strategy):
    model = make_llava(text, tower, strategy, seed=2)
    ids, mask, pixels = llava_batch([3, 6], n_image=image_tokens(tower, strategy), seed=1)
    t = torch.tensor([5, 9])
    real = _real(model, ids, mask, pixels)[[0, 1], t]
    res = ALTILogitAttribution(model).decompose(ids, t, {"attention_mask": mask, "pixel_values": pixels})
    scale = real.abs().max()
    assert ((res.scores.sum(-1) + res.no_token_total - real).abs() / scale).max() < 1e-10
    assert ((res.logit - real).abs() / scale).max() < 1e-12 and (res.delta.abs() / scale).max() < 1e-10
    image = ids == IMAGE_TOKEN
    assert res.scores[image].abs().sum() > 0  # the image tokens do carry a share
    assert (res.scores[mask == 0] == 0).all()


@pytest.mark.parametrize("cls", METHODS, ids=lambda c: c.__name__)
def test_every_method_is_the_decoder_alone_on_the_merged_embeddings(llava, cls):
    ids, mask, pixels = llava_batch([4, 2], seed=3)
    twin = text_twin(llava)
    x = merged_embeddings(llava, ids, mask, pixels)
    t = torch.tensor([7, 11])
    got = cls(llava).attribute(ids, target=_target(cls, t),
                               additional_forward_args={"attention_mask": mask, "pixel_values": pixels})
    ref = cls(twin).attribute(x, target=_target(cls, t), additional_forward_args={"attention_mask": mask})
    assert got.shape == ids.shape and got.abs().max() > 0
    assert ((got - ref).abs().max() / ref.abs().max()) < 1e-12
    # the twin is independent of the recording: its logits are the VLM's
    assert torch.allclose(_real(llava, ids, mask, pixels),
                          twin(inputs_embeds=x, attention_mask=mask,
                               position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits[:, -1], rtol=0, atol=1e-12)


def test_decompx_completeness(llava):
    ids, mask, pixels = llava_batch([5, 3], seed=4)
    t = torch.tensor([2, 8])
    scores, delta = DecompXAttribution(llava).attribute(
        ids, target=t, additional_forward_args={"attention_mask": mask, "pixel_values": pixels},
        return_convergence_delta=True)
    real = _real(llava, ids, mask, pixels)[[0, 1], t]
    assert (delta.abs() / real.abs().max()).max() < 1e-10


@pytest.mark.parametrize("cls", METHODS, ids=lambda c: c.__name__)
def test_padded_batch_equals_single_examples(llava, cls):
    lengths = [6, 2, 4]
    ids, mask, pixels = llava_batch(lengths, seed=5)
    t = torch.tensor([3, 4, 5])
    attr = cls(llava)
    batch = attr.attribute(ids, target=_target(cls, t),
                           additional_forward_args={"attention_mask": mask, "pixel_values": pixels})
    for b in range(len(lengths)):
        real = mask[b].bool()
        alone = attr.attribute(ids[b:b + 1, real], target=_target(cls, t[b:b + 1]),
                               additional_forward_args={"attention_mask": mask[b:b + 1, real],
                                                        "pixel_values": pixels[b:b + 1]})
        scale = alone.abs().max()
        assert ((batch[b, real] - alone[0]).abs().max() / scale) < 1e-10
        assert (batch[b, ~real] == 0).all()


def test_model_unchanged(llava):
    ids, mask, pixels = llava_batch([4, 3], seed=6)
    out = _real(llava, ids, mask, pixels)  # transformers installs its own output-capturing hooks at a first forward

    def hooks():
        return [(n, tuple(m._forward_hooks), tuple(m._forward_pre_hooks)) for n, m in llava.named_modules()]

    before, hooked = {k: v.clone() for k, v in llava.state_dict().items()}, hooks()
    training = llava.training
    ALTILogitAttribution(llava).attribute(ids, target=torch.tensor([1, 2]),
                                          additional_forward_args={"attention_mask": mask, "pixel_values": pixels})
    after = llava.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert llava.training == training
    assert hooks() == hooked  # every hook of the package removed, transformers' own kept
    assert torch.equal(_real(llava, ids, mask, pixels), out)


def test_input_errors(llava):
    ids, mask, pixels = llava_batch([3], seed=7)
    attr = ALTILogitAttribution(llava)
    with pytest.raises(ValueError, match="pixel_values"):  # the message lists the inputs it may name
        attr.attribute(ids, target=1, additional_forward_args={"attention_mask": mask, "labels": ids})
    with pytest.raises(TypeError, match="pixel_values"):
        attr.attribute(ids, target=1, additional_forward_args={"attention_mask": mask, "pixel_values": [1.0]})
    # a text model still refuses pixel_values by name
    from decoder_models import make_decoder

    text = make_decoder("llama")
    with pytest.raises(ValueError, match="pixel_values"):
        ALTILogitAttribution(text).attribute(ids % 50, target=1, additional_forward_args={"pixel_values": pixels})


@pytest.mark.parametrize("method", METHODS)
def test_image_tokens_without_pixel_values_are_refused(llava, method):
    # the model would run its decoder on the placeholders' own embeddings: an explanation of the model without the
    # image, which the caller did not ask for; every method refuses it (the routes too: tests/attr/test_routes_vlm.py)
    ids, mask, pixels = llava_batch([3], seed=7)
    target = 1 if method in (ALTILogitAttribution, DecompXAttribution) else None  # ALTI, GlobEnc: class-agnostic
    with pytest.raises(ValueError, match="no pixel_values were given"):
        method(llava).attribute(ids, target=target, additional_forward_args={"attention_mask": mask})
    text_only = ids[:, (ids[0] != IMAGE_TOKEN)]  # the same prompt without the image tokens runs as text
    method(llava).attribute(text_only, target=target)


def test_unsupported_language_model_is_refused():
    from transformers import CLIPVisionConfig, CodeGenConfig, LlavaConfig, LlavaForConditionalGeneration

    vc = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                          image_size=8, patch_size=4)
    tc = CodeGenConfig(vocab_size=32, n_embd=16, n_layer=1, n_head=2, rotary_dim=4)
    model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vc, text_config=tc, image_token_index=31))
    with pytest.raises(UnsupportedModelError, match="language model is 'codegen'.*Supported decoders"):
        get_adapter(model)
    with pytest.raises(ValueError, match="must be a decoder"):  # an encoder's description is never re-rooted
        vision_language_spec(LLAVA, ARCHITECTURES["bert"])
    spec = vision_language_spec(LLAVA, ARCHITECTURES["gpt2"])  # a head-projection-free text family, re-rooted
    assert spec.layers == "language_model.h" and spec.final_norm == "language_model.ln_f"


# ---- image regions ----------------------------------------------------------------------------


def test_grid_scores_on_synthetic_grids():
    g = ImageGeometry(image_token_id=9, patch=(2, 3), grids=((2, 3),))
    ids = torch.tensor([[1, 9, 9, 9, 9, 9, 9, 5, 9, 9, 9, 9, 9, 9],
                        [0, 0, 0, 0, 0, 0, 0, 1, 9, 9, 9, 9, 9, 9]])
    scores = torch.arange(28.0).reshape(2, 14)
    found = grid_scores(scores, ids == 9, g)
    assert len(found.grids) == 3 and found.example.tolist() == [0, 0, 1] and found.leading is None
    assert torch.equal(found.grids[0], torch.tensor([[1.0, 2, 3], [4, 5, 6]]))
    assert torch.equal(found.grids[1], torch.tensor([[8.0, 9, 10], [11, 12, 13]]))
    assert torch.equal(found.grids[2], torch.tensor([[22.0, 23, 24], [25, 26, 27]]))
    heat = patches_to_pixels(found.grids[0], g.patch)
    assert heat.shape == (4, 9)
    for r in range(2):
        for c in range(3):  # each patch's pixels hold its score, and only there
            block = heat[2 * r:2 * r + 2, 3 * c:3 * c + 3]
            assert (block == found.grids[0][r, c]).all()
    # middle axes (several explained tokens) are kept
    many = grid_scores(torch.stack([scores, -scores], 1), ids == 9, g)
    assert many.grids[0].shape == (2, 2, 3) and torch.equal(many.grids[0][1], -found.grids[0])
    # a larger image: pixels past the last whole patch get NaN
    wide = patches_to_pixels(found.grids[0], g.patch, size=(5, 10))
    assert wide.shape == (5, 10) and wide[4].isnan().all() and wide[:, 9].isnan().all() and not wide[:4, :9].isnan().any()


def test_grid_scores_class_token_and_dropped_features():
    ids = torch.tensor([[7, 7, 7, 7, 7]])
    scores = torch.tensor([[10.0, 1, 2, 3, 4]])
    kept = grid_scores(scores, ids == 7, ImageGeometry(7, (1, 1), ((2, 2),), class_token=True, dropped=0))
    assert kept.leading.tolist() == [10.0] and torch.equal(kept.grids[0], torch.tensor([[1.0, 2], [3, 4]]))
    # a tower without [CLS] whose first feature is dropped ("default" with SigLIP): that patch has no score
    siglip = grid_scores(scores[:, 2:], ids[:, 2:] == 7, ImageGeometry(7, (1, 1), ((2, 2),), dropped=1))
    assert siglip.grids[0][0, 0].isnan() and siglip.grids[0].flatten()[1:].tolist() == [2.0, 3, 4]
    # per-image grids (image_sizes) and a count that does not split into whole images
    two = grid_scores(torch.arange(7.0)[None], torch.ones(1, 7, dtype=torch.bool),
                      ImageGeometry(0, (1, 1), ((1, 3), (2, 2))))
    assert [tuple(x.shape) for x in two.grids] == [(1, 3), (2, 2)]
    with pytest.raises(ValueError, match="whole images"):
        grid_scores(torch.zeros(1, 5), torch.ones(1, 5, dtype=torch.bool), ImageGeometry(0, (1, 1), ((2, 2),)))


def test_geometry_from_the_model(llava):
    g = image_geometry(llava)
    assert g.image_token_id == IMAGE_TOKEN and g.patch == (4, 4) and g.grids == ((4, 4),)
    assert g.class_token and g.dropped == 1 and g.tokens(0) == image_tokens()
    full = image_geometry(make_llava(strategy="full", layers=1))
    assert full.dropped == 0 and full.tokens(0) == 17
    assert image_geometry(llava, image_sizes=torch.tensor([[8, 16]])).grids == ((2, 4),)
    with pytest.raises(ValueError, match="not a vision-language model"):
        from decoder_models import make_decoder

        image_geometry(make_decoder("llama"))


@pytest.mark.parametrize("tower,strategy", [("clip", "default"), ("clip", "full"), ("siglip", "full")])
def test_heat_map_finds_the_changed_patch(tower, strategy):
    r"""A tower read at its embeddings (``vision_feature_layer=-3``): each image token sees one patch only, so
    changing the pixels of patch (r, c) changes one image token, and the heat map must light exactly that patch."""
    model = make_llava(tower=tower, strategy=strategy, layers=1, feature_layer=-3)  # the 2-layer tower's embeddings
    n = image_tokens(tower, strategy)
    ids, mask, pixels = llava_batch([2], n_image=n, seed=8)
    x0 = merged_embeddings(model, ids, mask, pixels)
    for r, c in ((0, 0), (1, 2), (3, 3)):
        changed = pixels.clone()
        changed[..., 4 * r:4 * r + 4, 4 * c:4 * c + 4] += 1.0
        change = (merged_embeddings(model, ids, mask, changed) - x0).norm(dim=-1)  # (1, T) per-token "scores"
        heat = image_heatmaps(change, ids, model)[0]
        assert heat.shape == (16, 16)
        lit = heat > 1e-9
        expect = torch.zeros(16, 16, dtype=torch.bool)
        expect[4 * r:4 * r + 4, 4 * c:4 * c + 4] = True
        assert torch.equal(lit, expect), (r, c)
        found = image_scores(change, ids, model)
        if tower == "clip" and strategy == "full":
            assert found.leading is not None and found.leading.abs().max() < 1e-12  # [CLS] sees no pixels here


def test_heat_map_of_a_decomposition(llava):
    ids, mask, pixels = llava_batch([3, 5], seed=9)
    res = ALTILogitAttribution(llava).decompose(ids, torch.tensor([4, 6]),
                                                {"attention_mask": mask, "pixel_values": pixels})
    maps = image_heatmaps(res, ids, llava)
    assert len(maps) == 2 and all(m.shape == (16, 16) for m in maps)
    for b in range(2):  # every image token's score is on its 16 pixels: the map sums to 16 x the image share
        share = res.scores[b, ids[b] == IMAGE_TOKEN].sum()
        assert torch.allclose(maps[b].sum(), 16 * share, rtol=1e-12, atol=0)


def test_two_images_per_prompt(llava):
    r"""Two images in each prompt (``[1, image, text, image, text]``): complete, padded batch = singles, two maps each."""
    g = torch.Generator().manual_seed(10)
    n = image_tokens()
    rows = [torch.cat([torch.tensor([1]), torch.full((n,), IMAGE_TOKEN), torch.randint(3, 60, (k,), generator=g),
                       torch.full((n,), IMAGE_TOKEN), torch.randint(3, 60, (2,), generator=g)]) for k in (1, 4)]
    t_len = max(len(r) for r in rows)
    ids = torch.zeros(2, t_len, dtype=torch.long)
    mask = torch.zeros(2, t_len, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, t_len - len(r):], mask[i, t_len - len(r):] = r, 1
    pixels = torch.randn(4, 3, 16, 16, generator=g, dtype=torch.float64)  # images of example 0, then of example 1
    t = torch.tensor([5, 6])
    attr = ALTILogitAttribution(llava)
    res = attr.decompose(ids, t, {"attention_mask": mask, "pixel_values": pixels})
    real = _real(llava, ids, mask, pixels)[[0, 1], t]
    assert ((res.scores.sum(-1) + res.no_token_total - real).abs() / real.abs().max()).max() < 1e-10
    for b in range(2):
        keep = mask[b].bool()
        alone = attr.decompose(ids[b:b + 1, keep], t[b:b + 1], {"attention_mask": mask[b:b + 1, keep],
                                                               "pixel_values": pixels[2 * b:2 * b + 2]})
        assert (res.scores[b, keep] - alone.scores[0]).abs().max() / alone.scores.abs().max() < 1e-10
    found = image_scores(res, ids, llava)
    assert found.example.tolist() == [0, 0, 1, 1]
    first = res.scores[1, ids[1] == IMAGE_TOKEN][:n]  # example 1's first image: its first n image tokens
    assert torch.equal(found.grids[2].flatten(), first)


# ---- Qwen2-VL: M-RoPE positions computed by the model ----------------------------------------


def _qwen_real(model, ids, mask, extra):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **extra).logits[:, -1]


def _rows(extra, b, keep, n_patch=16):
    return {"pixel_values": extra["pixel_values"][b * n_patch:(b + 1) * n_patch],
            "image_grid_thw": extra["image_grid_thw"][b:b + 1],
            "mm_token_type_ids": extra["mm_token_type_ids"][b:b + 1, keep]}


@pytest.mark.parametrize("cls", METHODS, ids=lambda c: c.__name__)
def test_qwen2_vl_complete_and_padded_batch_equals_singles(cls):
    model = make_qwen2_vl(seed=1)
    assert get_adapter(model).family == "Qwen2-VL (Qwen2)"
    ids, mask, extra = qwen2_vl_batch([5, 2], seed=2)
    t = torch.tensor([6, 9])
    attr = cls(model)
    batch = attr.attribute(ids, target=_target(cls, t), additional_forward_args={"attention_mask": mask, **extra},
                           **({"return_convergence_delta": True} if cls.uses_target else {}))
    if cls.uses_target:  # signed: complete against the model's own logit (M-RoPE computed by the model)
        batch, delta = batch
        real = _qwen_real(model, ids, mask, extra)[[0, 1], t]
        assert (delta.abs() / real.abs().max()).max() < 1e-10
    for b in range(2):
        keep = mask[b].bool()
        alone = attr.attribute(ids[b:b + 1, keep], target=_target(cls, t[b:b + 1]),
                               additional_forward_args={"attention_mask": mask[b:b + 1, keep], **_rows(extra, b, keep)})
        assert ((batch[b, keep] - alone[0]).abs().max() / alone.abs().max()) < 1e-10
        assert (batch[b, ~keep] == 0).all()
    assert batch[ids == QWEN_IMAGE].abs().sum() > 0


def test_qwen2_vl_alti_logit_sums_to_logit_and_maps_to_merged_patches():
    model = make_qwen2_vl(seed=3)
    ids, mask, extra = qwen2_vl_batch([3, 4], side=8, seed=4)
    t = torch.tensor([4, 7])
    res = ALTILogitAttribution(model).decompose(ids, t, {"attention_mask": mask, **extra})
    real = _qwen_real(model, ids, mask, extra)[[0, 1], t]
    assert ((res.scores.sum(-1) + res.no_token_total - real).abs() / real.abs().max()).max() < 1e-10
    g = image_geometry(model, image_grid_thw=extra["image_grid_thw"])
    assert g.patch == (4, 4) and g.grids == ((2, 2), (2, 2)) and not g.class_token and g.dropped == 0
    maps = image_heatmaps(res, ids, model, image_grid_thw=extra["image_grid_thw"])
    assert [tuple(m.shape) for m in maps] == [(8, 8), (8, 8)]
    for b in range(2):
        tokens = res.scores[b, ids[b] == QWEN_IMAGE]
        assert torch.equal(maps[b][4:, :4], tokens[2].expand(4, 4))  # token 2: merged block row 1, column 0
    with pytest.raises(ValueError, match="image_grid_thw"):
        image_geometry(model)


def test_qwen2_vl_heat_map_finds_the_changed_block():
    r"""Pixels through Qwen2-VL's own image processor into a tower without blocks (each token sees its 2 x 2 merged
    patches only): changing one 4 x 4 pixel block changes one image token, and the heat map lights that block."""
    np = pytest.importorskip("numpy")
    from transformers import Qwen2VLImageProcessor

    proc = Qwen2VLImageProcessor(patch_size=2, temporal_patch_size=2, merge_size=2, min_pixels=16, max_pixels=4096,
                                 do_resize=False, do_rescale=False, do_normalize=False)
    model = make_qwen2_vl(seed=5, layers=1, vision_depth=0)
    ids, mask, _ = qwen2_vl_batch([2], side=8, seed=6)
    image = np.random.RandomState(0).rand(3, 8, 8)

    def embeddings(img):
        got = proc(images=[img.astype(np.float32)], return_tensors="pt", input_data_format="channels_first")
        return merged_embeddings(model, ids, mask, got["pixel_values"].double(), image_grid_thw=got["image_grid_thw"],
                                 mm_token_type_ids=(ids == QWEN_IMAGE).long()), got["image_grid_thw"]

    x0, thw = embeddings(image)
    for r, c in ((0, 1), (1, 0), (1, 1)):
        changed = image.copy()
        changed[:, 4 * r:4 * r + 4, 4 * c:4 * c + 4] += 1.0
        change = (embeddings(changed)[0] - x0).norm(dim=-1)
        lit = image_heatmaps(change, ids, model, image_grid_thw=thw)[0] > 1e-9
        expect = torch.zeros(8, 8, dtype=torch.bool)
        expect[4 * r:4 * r + 4, 4 * c:4 * c + 4] = True
        assert torch.equal(lit, expect), (r, c)
