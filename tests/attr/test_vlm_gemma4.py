r"""Gemma 4 with images (``Gemma4ForConditionalGeneration``; docs/vlm.md, "Gemma 4").

On tiny float64 models (tests/fixtures/vlm_gemma4.py: a Gemma 4 vision tower with 2 x 2 pooling before the zoo's
tiny Gemma 4 text model, with and without experts; two examples with images of different sizes, left-padded):

- ALTI-Logit and DecompX are complete against the model's own logit, for the two-way call (``mm_token_type_ids``
  with ``use_bidirectional_attention="vision"``: the reference forward differs from the causal one) and the
  causal call (no types);
- GlobEnc's and ALTI's maps are non-zero above the diagonal exactly at the image spans' pairs on the
  sliding-window layers and nowhere above it on the full-attention layers (Gemma 4's mask), and every map's parts
  sum to the model's real tensors;
- a left-padded batch equals its examples alone; the model is left as found;
- the image tokens lie on the grid the model's own pooler makes (checked by pooling the patches' positions with
  it) and the heat maps cover each resized image; audio and video inputs are refused naming why;
- Captum's ``ImageMaskInput`` through Gemma 4's own image processor is complete and shares the image tokens'
  scores out over the segments.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma4ForConditionalGeneration"):  # pragma: no cover - older transformers
    pytest.skip("transformers has no Gemma 4", allow_module_level=True)

from captum_normattr import (  # noqa: E402
    ALTIAttribution,
    ALTILogitAttribution,
    DecompXAttribution,
    GlobEncAttribution,
    UnsupportedModelError,
)
from captum_normattr.arch.families.vlm_gemma4 import gemma4_image_sizes  # noqa: E402
from captum_normattr.attr.vlm_regions import image_heatmaps, image_scores  # noqa: E402
from captum_normattr.models.adapters import get_adapter  # noqa: E402
from map_checks import check_maps_complete  # noqa: E402
from vlm_gemma4 import IMAGE, PATCH, POOL, gemma4_vlm_batch, make_gemma4_vlm  # noqa: E402
from zoo_gemma4 import MOE  # noqa: E402

SIZES = ((16, 16), (16, 24))  # 2 x 2 and 2 x 3 tokens
CONFIGS = {"plain": {}, "experts_shared_kv": dict(num_kv_shared_layers=2, **MOE)}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    return make_gemma4_vlm(seed=1, **CONFIGS[request.param])


def _real(model, ids, mask, extra):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
                     **extra).logits[:, -1]


def _causal(extra):
    return {k: v for k, v in extra.items() if k != "mm_token_type_ids"}


@pytest.mark.parametrize("cls", [ALTILogitAttribution, DecompXAttribution], ids=lambda c: c.__name__)
def test_complete_against_the_models_logit_two_way_and_causal(model, cls):
    ids, mask, extra = gemma4_vlm_batch(SIZES, [2, 4], seed=2)
    assert get_adapter(model).family == "Gemma 4 (Gemma 4)"
    two_way, causal = _real(model, ids, mask, extra), _real(model, ids, mask, _causal(extra))
    scale = two_way.abs().max()
    assert ((two_way - causal).abs() / scale).max() > 1e-3  # the image spans are two-way on the sliding layers
    t = torch.tensor([5, 9])
    for inputs, real in ((extra, two_way), (_causal(extra), causal)):
        res = cls(model, strict=True).decompose(ids, t, {"attention_mask": mask, **inputs})
        rest = res.no_token_total if cls is ALTILogitAttribution else res.bias_scores[:, 0]
        err = float(((res.scores.sum(-1) + rest - real[[0, 1], t]).abs() / scale).max())
        assert err < 1e-10, err
        assert (res.scores[mask == 0] == 0).all() and res.scores[ids == IMAGE].abs().sum() > 0


def _span_pairs(ids, mask):
    r"""(B, T, T): i < j both in one run of image tokens (Gemma 4's two-way pairs, written out from the ids)."""
    image = (ids == IMAGE) & mask.bool()
    run = torch.cumsum(image & ~torch.cat([torch.zeros_like(image[:, :1]), image[:, :-1]], 1), 1)
    same = image[:, :, None] & image[:, None, :] & (run[:, :, None] == run[:, None, :])
    return same & torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1)


@pytest.mark.parametrize("cls", [ALTIAttribution, GlobEncAttribution], ids=lambda c: c.__name__)
def test_maps_open_the_image_spans_on_the_sliding_layers_only(model, cls):
    ids, mask, extra = gemma4_vlm_batch(SIZES, [3, 2], seed=3)
    want = _span_pairs(ids, mask)
    assert want.any()
    maps = cls(model).decompose(ids, additional_forward_args={"attention_mask": mask, **extra}).layer_maps
    upper = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1)
    types = model.config.text_config.layer_types
    for l in range(maps.shape[1]):
        m = maps[:, l]
        if types[l] == "sliding_attention":
            assert (m[want] > 0).all() if cls is GlobEncAttribution else bool((m[want] > 0).any()), l
            assert (m[~want & upper] == 0).all(), l
        else:
            assert (m[..., upper] == 0).all(), l
    plain = cls(model).decompose(ids, additional_forward_args={"attention_mask": mask, **_causal(extra)}).layer_maps
    assert (plain[..., upper] == 0).all()
    check_maps_complete(model, ids, {"attention_mask": mask, **extra})


@pytest.mark.parametrize("cls", [ALTILogitAttribution, DecompXAttribution, ALTIAttribution],
                         ids=lambda c: c.__name__)
def test_padded_batch_equals_single_examples_and_the_model_is_unchanged(model, cls):
    ids, mask, extra = gemma4_vlm_batch(SIZES, [4, 1], seed=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    implementation = model.config._attn_implementation
    t = torch.tensor([6, 9]) if cls.uses_target else None
    attr = cls(model)
    batch = attr.attribute(ids, target=t, additional_forward_args={"attention_mask": mask, **extra})
    for b in range(2):
        keep = mask[b].bool()
        n = int((extra["image_position_ids"][b] >= 0).all(-1).sum())
        alone_extra = {"pixel_values": extra["pixel_values"][b:b + 1, :n],
                       "image_position_ids": extra["image_position_ids"][b:b + 1, :n],
                       "mm_token_type_ids": extra["mm_token_type_ids"][b:b + 1, keep]}
        alone = attr.attribute(ids[b:b + 1, keep], target=None if t is None else t[b:b + 1],
                               additional_forward_args={"attention_mask": mask[b:b + 1, keep], **alone_extra})
        assert float((batch[b, keep] - alone[0]).abs().max() / alone.abs().max()) < 1e-10
        assert (batch[b, ~keep] == 0).all()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.config._attn_implementation == implementation
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_image_tokens_lie_on_the_grid_of_the_models_own_pooler():
    model = make_gemma4_vlm(seed=2)
    ids, mask, extra = gemma4_vlm_batch(SIZES, [2, 2], seed=5)
    positions = extra["image_position_ids"]
    sizes = gemma4_image_sizes(positions, model.config.vision_config.patch_size)
    assert sizes.tolist() == [list(s) for s in SIZES]
    # the pooler, fed each patch's own (x, y), gives each token the mean position of the patches it pools
    pooler = model.model.vision_tower.pooler
    pad = (positions == -1).all(-1)
    with torch.no_grad():
        means, kept = pooler(positions.to(torch.float64), positions, pad, positions.shape[1] // POOL ** 2)
    means = means / pooler.root_hidden_size
    tokens = [means[n][kept[n]] for n in range(len(SIZES))]  # (tokens, 2) in the model's order, per image
    scores = torch.zeros(ids.shape, dtype=torch.float64)
    scores[ids == IMAGE] = torch.cat([torch.arange(len(tk), dtype=torch.float64) for tk in tokens])
    grids = image_scores(scores, ids, model, image_sizes=sizes).grids
    for n, (h, w) in enumerate(SIZES):
        rows, cols = h // (PATCH * POOL), w // (PATCH * POOL)
        assert grids[n].shape == (rows, cols)
        for k, (x, y) in enumerate(tokens[n].tolist()):  # token k's pooled patches are centred in its grid cell
            r, c = int(y // POOL), int(x // POOL)
            assert grids[n][r, c] == k and abs(x - (POOL * c + (POOL - 1) / 2)) < 1e-12
    heat = image_heatmaps(scores, ids, model, image_sizes=sizes)
    assert [tuple(hm.shape) for hm in heat] == list(SIZES)
    assert heat[1][8:16, 16:24].unique().tolist() == [grids[1][1, 2].item()]
    by_positions = image_scores(scores, ids, model, image_position_ids=positions).grids  # the sizes read from them
    assert all(torch.equal(a, b) for a, b in zip(by_positions, grids))
    with pytest.raises(ValueError, match="image_position_ids"):
        image_scores(scores, ids, model)


def test_audio_and_video_inputs_are_refused_naming_why():
    model = make_gemma4_vlm(seed=0)
    ids, mask, extra = gemma4_vlm_batch(SIZES[:1], [2], seed=6)
    for name in ("input_features", "input_features_mask", "pixel_values_videos"):
        with pytest.raises(UnsupportedModelError, match=f"Gemma 4 with {name}.*not checked"):
            ALTILogitAttribution(model).decompose(ids, torch.tensor([3]),
                                                  {"attention_mask": mask, **extra, name: torch.zeros(1, 2)})


def test_image_mask_input_through_gemma4s_own_image_processor():
    r"""Captum's ``ImageMaskInput`` through ``DecompositionLLMAttribution``, the image resized and patchified by
    ``Gemma4ImageProcessorPil`` itself (a 12 x 30 image, at most 70 tokens: resized to 40 x 104, a 5 x 13 token grid),
    the processor's ``mm_token_type_ids`` extended over the targets as text: complete against the model's own
    two-way logit, and the segments' scores sum to the image tokens' (every token shared out over the segments)."""
    np = pytest.importorskip("numpy")
    from PIL import Image
    from captum.attr._utils.interpretable_input import ImageMaskInput
    from transformers import Gemma4ImageProcessorPil
    from vlm_gemma4 import BOI, EOI
    from vlm_processors import vlm_tokenizer

    from captum_normattr.attr.llm import DecompositionLLMAttribution

    model = make_gemma4_vlm(seed=3, max_position_embeddings=128)
    processor = Gemma4ImageProcessorPil(patch_size=PATCH, pooling_kernel_size=POOL, max_soft_tokens=70)

    def fn(image):
        px = processor(images=image, return_tensors="pt")
        n = int(px["num_soft_tokens_per_image"][0])
        ids = torch.cat([torch.tensor([1, BOI]), torch.full((n,), IMAGE), torch.tensor([EOI, 5, 6, 7])])[None]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": px["pixel_values"].double(),
                "image_position_ids": px["image_position_ids"], "mm_token_type_ids": (ids == IMAGE).long()}

    image = Image.fromarray((np.random.RandomState(8).rand(12, 30, 3) * 255).astype("uint8"))
    mask = torch.zeros(12, 30, dtype=torch.int32)
    mask[:, 10:20], mask[:, 20:] = 1, 2
    target = torch.tensor([8, 9, 10])
    res = DecompositionLLMAttribution(ALTILogitAttribution(model), vlm_tokenizer({})).attribute(
        ImageMaskInput(image, mask=mask, processor_fn=fn), target=target)
    ex = res.explanation
    inputs = fn(image)
    full = torch.cat([inputs["input_ids"], target[None]], 1)
    extra = {"pixel_values": inputs["pixel_values"], "image_position_ids": inputs["image_position_ids"],
             "mm_token_type_ids": (full == IMAGE).long(), "position_ids": torch.arange(full.shape[1])[None]}
    p = inputs["input_ids"].shape[1]
    with torch.no_grad():
        real = model(input_ids=full, attention_mask=torch.ones_like(full), **extra).logits[0]
    real = real[torch.arange(p - 1, p - 1 + 3), target]
    assert res.patch_attr.shape[:3] == (3, 5, 13) and ex.box == (0.0, 0.0, 12.0, 30.0)  # the grid stretched over it
    assert float(((ex.scores.sum(-1) + ex.details.no_token - real).abs() / real.abs().max()).max()) < 1e-10
    image_total = ex.scores[:, full[0] == IMAGE].sum(-1)
    assert torch.allclose(res.token_attr[:, :3].sum(-1), image_total, rtol=1e-10, atol=1e-12), (
        res.token_attr, image_total)
