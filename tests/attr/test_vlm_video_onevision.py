r"""LLaVA-OneVision's videos (issue 38; ``docs/vlm.md``, "Videos"; ``captum_normattr.attr.vlm_video_pooled``).

Every frame goes through the tower, its n x n patch grid is pooled bilinearly to ceil(n / 2) x ceil(n / 2) tokens, the
frames' tokens follow each other and one ``image_newline`` ends the video. On tiny float64 models
(``tests/fixtures/vlm_videos_onevision.py``; 8-pixel frames in 2-pixel patches, and 6-pixel frames: an odd 3 x 3
grid), prompts with a video, and with an any-resolution image and a video: ALTI-Logit and DecompX complete against
the model's own logit; GlobEnc's, ALTI's and the FF decomposition's parts sum to the model's tensors; all four methods
on a left-padded batch equal the single examples; the model is unchanged. The mapping: synthetic scores equal to the
token index, and a tower whose tokens see their own patches only (changing one patch of one frame lights that frame's
pooled token; on the odd grid the bilinear weights of the middle patch reach all four tokens).
"""
from __future__ import annotations

import pytest
import torch
from map_checks import check_maps_complete
from vlm_anyres_models import ANYRES_IMAGE, make_llava_onevision
from vlm_checks import check_complete, check_model_unchanged, check_padded_equals_singles
from vlm_models import make_qwen2_vl, merged_embeddings
from vlm_videos_onevision import ONEVISION_VIDEO, onevision_video_batch, onevision_video_single, video_tokens

from captum_normattr import ALTIAttribution, ALTILogitAttribution, DecompXAttribution, GlobEncAttribution
from captum_normattr.arch.spec import UnsupportedModelError
from captum_normattr.attr.vlm_anyres import anyres_heatmaps
from captum_normattr.attr.vlm_video import video_geometry
from captum_normattr.attr.vlm_video_pooled import (
    pooled_video_geometry,
    pooled_video_heatmaps,
    pooled_video_scores,
)

METHODS = [ALTILogitAttribution, DecompXAttribution, ALTIAttribution, GlobEncAttribution]


def _real(model, ids, mask, extra):
    r"""The model's own last logits, positions counted over the real tokens (the package's)."""
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
                     **extra).logits[:, -1]


@pytest.fixture(scope="module")
def model():
    return make_llava_onevision(seed=1)


@pytest.mark.parametrize("case", ["video", "image+video", "odd grid"])
@pytest.mark.parametrize("cls", [ALTILogitAttribution, DecompXAttribution], ids=lambda c: c.__name__)
def test_complete_against_the_models_logit(model, cls, case):
    if case == "odd grid":
        model = make_llava_onevision(seed=2, image_size=6)
    ids, mask, extra = onevision_video_batch(model, [3, 6], image=case == "image+video", seed=2)
    t = torch.tensor([5, 9])
    res = check_complete(cls(model), ids, mask, extra, t, _real(model, ids, mask, extra)[[0, 1], t])
    assert res.scores[ids == ONEVISION_VIDEO].abs().sum() > 0
    if case == "image+video":
        assert res.scores[ids == ANYRES_IMAGE].abs().sum() > 0


def test_maps_complete(model):
    ids, mask, extra = onevision_video_batch(model, [3, 6], image=True, seed=3)
    check_maps_complete(model, ids, {"attention_mask": mask, **extra})


@pytest.mark.parametrize("cls", METHODS, ids=lambda c: c.__name__)
def test_padded_batch_equals_single_examples(model, cls):
    ids, mask, extra = onevision_video_batch(model, [5, 2], image=True, seed=4)
    batch = check_padded_equals_singles(cls(model), ids, mask, extra, torch.tensor([6, 9]), onevision_video_single)
    assert batch[ids == ONEVISION_VIDEO].abs().sum() > 0


def test_model_unchanged(model):
    ids, mask, extra = onevision_video_batch(model, [4, 3], image=True, seed=5)
    check_model_unchanged(model, lambda: DecompXAttribution(model).attribute(
        ids, target=torch.tensor([1, 2]), additional_forward_args={"attention_mask": mask, **extra}),
        lambda: _real(model, ids, mask, extra))


# ---- the mapping -------------------------------------------------------------------------------------------------


def test_video_tokens_on_frames_rows_and_columns(model):
    r"""Scores equal to the token index, two examples with one 3-frame video each, scores (B, 2, T) for two explained
    tokens: video token k < 12 lies at frame k // 4, row (k // 2) % 2, column k % 2 (4 x 4 pixels of the 8-pixel
    frame); the 13th is the newline, on no pixel; a wrong token count is refused."""
    ids, mask, extra = onevision_video_batch(model, [1, 3], seed=6)
    pv = extra["pixel_values_videos"]
    g = pooled_video_geometry(model, pv)
    assert (g.videos, g.frames, g.grid, g.size, g.tokens) == (2, 3, 2, 8, 13) == (2, 3, 2, 8, video_tokens(model, 3))
    scores = torch.arange(2 * 2 * ids.shape[1], dtype=torch.float64).reshape(2, 2, -1)
    found = pooled_video_scores(scores, ids, model, pv)
    heat = pooled_video_heatmaps(scores, ids, model, pv)
    assert found.example.tolist() == [0, 1] and [tuple(h.shape) for h in heat] == [(2, 3, 8, 8)] * 2
    for b in range(2):
        where = (ids[b] == ONEVISION_VIDEO).nonzero()[:, 0]
        for k in range(12):
            f, r, c = k // 4, (k // 2) % 2, k % 2
            assert (heat[b][:, f, 4 * r:4 * r + 4, 4 * c:4 * c + 4] == scores[b, :, where[k], None, None]).all()
            assert torch.equal(found.grids[b][:, f, r, c], scores[b, :, where[k]])
        assert torch.equal(found.newline[b], scores[b, :, where[12]])
        assert not torch.isin(scores[b, :, where[12]], heat[b]).any()  # the newline covers no pixel
    with pytest.raises(ValueError, match="video tokens"):
        pooled_video_scores(scores, ids, model, pv[:1])
    with pytest.raises(ValueError, match="frames"):
        pooled_video_geometry(model, (1, 3, 3, 6, 6))


def test_odd_grid_boxes():
    r"""6-pixel frames in 2-pixel patches: a 3 x 3 grid pooled to 2 x 2; pooled row r covers the pixel rows whose
    centre has floor((y + 1/2) 2 / 6) = r: rows 0-2 and 3-5."""
    model = make_llava_onevision(seed=0, layers=1, image_size=6)
    g = pooled_video_geometry(model, (1, 2, 3, 6, 6))
    assert g.grid == 2 and g.pixel_tokens().tolist() == [0, 0, 0, 1, 1, 1]


def _own_patches(image_size):
    r"""A SigLIP tower whose attention outputs are zeroed: each patch's feature is its own (the position embedding,
    the MLP and the norms act per patch), so a pooled token sees the patches its bilinear weights reach."""
    model = make_llava_onevision(seed=5, layers=1, image_size=image_size)
    with torch.no_grad():
        for name, module in model.model.vision_tower.named_modules():
            if name.endswith("self_attn.out_proj"):
                module.weight.zero_()
                module.bias.zero_()
    return model


@pytest.mark.parametrize("image_size", [8, 6], ids=["even", "odd"])
def test_changed_frame_patches_light_their_own_tokens(image_size):
    r"""An any-resolution image (8-pixel tower only) and a 3-frame video in one prompt: changing one 2 x 2 patch
    (pr, pc) of frame f lights frame f's pooled token(s) only, never the newline nor the image. Even grid: the token
    (pr // 2, pc // 2), its 4 x 4 pixel box; odd 3 x 3 grid: a corner patch lights its corner token's 3 x 3 box, the
    middle patch all four tokens (the bilinear weights 3/4, 1/4 reach it from every side)."""
    model = _own_patches(image_size)
    ids, mask, extra = onevision_video_batch(model, [2], image=image_size == 8, seed=7)
    x0 = merged_embeddings(model, ids, mask, **extra)
    pv = extra["pixel_values_videos"]
    newline = (ids[0] == ONEVISION_VIDEO).nonzero()[-1, 0]
    cases = ([(0, 0, 0, {(0, 0)}), (2, 3, 1, {(1, 0)}), (1, 2, 3, {(1, 1)})] if image_size == 8 else
             [(0, 0, 0, {(0, 0)}), (2, 2, 2, {(1, 1)}), (1, 0, 2, {(0, 1)}),
              (1, 1, 1, {(0, 0), (0, 1), (1, 0), (1, 1)})])
    for frame, pr, pc, tokens in cases:
        changed = pv.clone()
        changed[0, frame, :, 2 * pr:2 * pr + 2, 2 * pc:2 * pc + 2] += 1.0
        change = (merged_embeddings(model, ids, mask, **dict(extra, pixel_values_videos=changed)) - x0).norm(dim=-1)
        grid = pooled_video_scores(change, ids, model, pv).grids[0]
        expect = torch.zeros(grid.shape, dtype=torch.bool)
        for r, c in tokens:
            expect[frame, r, c] = True
        assert torch.equal(grid > 1e-9, expect), (frame, pr, pc)
        heat = pooled_video_heatmaps(change, ids, model, pv)[0]
        side = image_size // 2
        pixels = torch.zeros(heat.shape, dtype=torch.bool)
        for r, c in tokens:
            pixels[frame, side * r:side * r + side, side * c:side * c + side] = True
        assert torch.equal(heat > 1e-9, pixels)
        assert change[0, newline] == 0
        assert (change[0, ids[0] != ONEVISION_VIDEO] == 0).all()  # the image's tokens and the text
    if image_size == 8:
        assert anyres_heatmaps(change, ids, model, extra["image_sizes"])[0].abs().max() == 0


def test_refusals(model):
    with pytest.raises(UnsupportedModelError, match="vlm_video_pooled"):
        video_geometry(model, torch.tensor([[2, 4, 4]]))
    with pytest.raises(UnsupportedModelError, match="LLaVA-OneVision"):
        pooled_video_geometry(make_qwen2_vl(layers=1), (1, 2, 3, 8, 8))
