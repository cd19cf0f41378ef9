r"""Videos in Qwen2-VL and Qwen2.5-VL (issue 38; ``docs/vlm.md``, "Videos"; ``captum_normattr.attr.vlm_video``).

On tiny float64 models (``tests/fixtures/vlm_videos.py``; the shared checks also on Qwen3-VL, Qwen3-VL-MoE, Qwen3.5
and Qwen3.5-MoE in their own frame-group layout, ``tests/fixtures/vlm_videos_qwen3.py``, whose own checks are in
``test_vlm_video_qwen3.py``), prompts with a video, and with an image and a video:
ALTI-Logit and DecompX token scores plus no-token terms equal the model's own logit (Qwen2.5-VL with
``second_per_grid_ts`` that moves it), GlobEnc's, ALTI's and the FF decomposition's parts sum to the model's
tensors; all four methods on a left-padded batch equal the single examples; the model is unchanged. The mapping of
video tokens to (frame group, row, column) is checked on synthetic scores and on towers whose tokens each see their
own patches only, where an image's and a video's changed pixels light their own maps only.
"""
from __future__ import annotations

import pytest
import torch

from captum_normattr import ALTIAttribution, ALTILogitAttribution, DecompXAttribution, GlobEncAttribution
from captum_normattr.arch.spec import UnsupportedModelError
from captum_normattr.attr.vlm_regions import image_heatmaps
from captum_normattr.attr.vlm_video import (
    VideoGeometry,
    video_geometry,
    video_grid_scores,
    video_heatmaps,
    video_scores,
)
from map_checks import check_maps_complete
from vlm_checks import check_complete, check_model_unchanged, check_padded_equals_singles
from vlm_models import QWEN_IMAGE, make_llava, merged_embeddings
from vlm_videos_qwen3 import MAKERS as QWEN3_MAKERS
from vlm_videos_qwen3 import family_video_batch
from vlm_videos import (
    MAKERS,
    check_one_pass,
    mm_types,
    patchify_video,
    video_batch,
    video_row,
    video_single,
    video_token,
)

METHODS = [ALTILogitAttribution, DecompXAttribution, ALTIAttribution, GlobEncAttribution]


def _real(model, ids, mask, extra):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **extra).logits[:, -1]


@pytest.fixture(scope="module", params=sorted(MAKERS) + sorted(QWEN3_MAKERS))
def model(request):
    return {**MAKERS, **QWEN3_MAKERS}[request.param](seed=1)


@pytest.mark.parametrize("image", [False, True], ids=["video", "image+video"])
@pytest.mark.parametrize("cls", [ALTILogitAttribution, DecompXAttribution], ids=lambda c: c.__name__)
def test_complete_against_the_models_logit(model, cls, image):
    ids, mask, extra, _ = family_video_batch(model, [3, 6], image=image, seed=2)
    t = torch.tensor([5, 9])
    res = check_complete(cls(model), ids, mask, extra, t, _real(model, ids, mask, extra)[[0, 1], t])
    assert res.scores[ids == video_token(model)].abs().sum() > 0  # the video tokens carry a share
    if image:
        assert res.scores[ids == QWEN_IMAGE].abs().sum() > 0


def test_qwen2_5_vl_seconds_per_group_move_the_explained_logit():
    r"""Qwen2.5-VL's ``second_per_grid_ts`` spaces the video's temporal M-RoPE positions: the logit it gives differs
    from the default's (1 s), and the decomposition is complete against each (the model computes the positions)."""
    model = MAKERS["qwen2_5_vl"](seed=1)
    ids, mask, extra, _ = video_batch(model, [3, 6], seed=2)
    t = torch.tensor([5, 9])
    plain = {k: v for k, v in extra.items() if k != "second_per_grid_ts"}
    reals = []
    for inputs in (extra, plain):
        real = _real(model, ids, mask, inputs)[[0, 1], t]
        res = ALTILogitAttribution(model).decompose(ids, t, {"attention_mask": mask, **inputs})
        assert ((res.scores.sum(-1) + res.no_token_total - real).abs() / real.abs().max()).max() < 1e-10
        reals.append(real)
    assert ((reals[0] - reals[1]).abs() / reals[0].abs().max()).max() > 1e-3



@pytest.mark.parametrize("cls", [ALTILogitAttribution, DecompXAttribution], ids=lambda c: c.__name__)
def test_one_pass_explains_every_generated_token(model, cls):
    r"""A generation's explanation: the prompt with an image and a video, then three targets explained in one pass,
    each row complete against the model's own logit, each row's video tokens on their own map (``check_one_pass``)."""
    check_one_pass(model, cls, family_video_batch)


def test_maps_complete(model):
    ids, mask, extra, _ = family_video_batch(model, [3, 6], image=True, seed=3)
    check_maps_complete(model, ids, {"attention_mask": mask, **extra})


@pytest.mark.parametrize("cls", METHODS, ids=lambda c: c.__name__)
def test_padded_batch_equals_single_examples(model, cls):
    r"""An image and a video per prompt (Qwen2.5-VL: a different ``second_per_grid_ts`` per example)."""
    ids, mask, extra, _ = family_video_batch(model, [5, 2], image=True, seed=4)
    batch = check_padded_equals_singles(cls(model), ids, mask, extra, torch.tensor([6, 9]), video_single)
    assert batch[ids == video_token(model)].abs().sum() > 0


def test_model_unchanged(model):
    ids, mask, extra, _ = family_video_batch(model, [4, 3], image=True, seed=5)
    check_model_unchanged(model, lambda: DecompXAttribution(model).attribute(
        ids, target=torch.tensor([1, 2]), additional_forward_args={"attention_mask": mask, **extra}),
        lambda: _real(model, ids, mask, extra))


# ---- the mapping -------------------------------------------------------------------------------------------------


def test_video_tokens_on_frame_groups_rows_and_columns():
    r"""Scores equal to the token index, a video of 6 frames of 8 x 12 pixels (``video_grid_thw`` (3, 4, 6): 3 frame
    groups of 2 x 3 tokens of 4 x 4 pixels): token k lies at group k // 6, row (k // 3) % 2, column k % 3; with
    ``frames=True`` frames 2g and 2g + 1 hold group g's map."""
    model = MAKERS["qwen2_vl"](seed=0, layers=1)
    thw = torch.tensor([[3, 4, 6]])
    ids = video_row(model, 1, 18)[None]
    first = int((ids[0] == video_token(model)).nonzero()[0])
    scores = torch.arange(ids.shape[1], dtype=torch.float64)[None]
    g = video_geometry(model, thw)
    assert g.grids == ((3, 2, 3),) and g.patch == (4, 4) and g.frames_per_group == 2 and g.tokens(0) == 18
    heat = video_heatmaps(scores, ids, model, thw)[0]
    assert heat.shape == (3, 8, 12)
    for k in range(18):
        grp, row, col = k // 6, (k // 3) % 2, k % 3
        assert (heat[grp, 4 * row:4 * row + 4, 4 * col:4 * col + 4] == first + k).all(), k
    per_frame = video_heatmaps(scores, ids, model, thw, frames=True)[0]
    assert per_frame.shape == (6, 8, 12)
    assert all(torch.equal(per_frame[f], heat[f // 2]) for f in range(6))
    grid = video_scores(scores, ids, model, thw).grids[0]
    assert grid.shape == (3, 2, 3) and grid.flatten().tolist() == list(range(first, first + 18))
    with pytest.raises(ValueError, match="image grid"):  # a video's grid is no image's
        image_heatmaps(scores, ids, model, image_grid_thw=thw)


def test_several_videos_and_explained_tokens_keep_their_axes():
    r"""Two videos of different shapes in two examples, scores (B, 2, T) for two explained tokens: one
    (2, groups, rows, cols) grid per video, in the model's order; mismatched grids are refused."""
    geometry = VideoGeometry(7, (4, 4), 2, ((1, 2, 2), (2, 1, 2)))
    ids = torch.tensor([[0, 1, 7, 7, 7, 7, 5], [1, 7, 7, 7, 7, 6, 5]])
    scores = torch.arange(2 * 2 * 7, dtype=torch.float64).reshape(2, 2, 7)
    found = video_grid_scores(scores, ids == 7, geometry)
    assert [tuple(x.shape) for x in found.grids] == [(2, 1, 2, 2), (2, 2, 1, 2)] and found.example.tolist() == [0, 1]
    assert found.grids[0][1].flatten().tolist() == [9, 10, 11, 12]
    assert found.grids[1][0].flatten().tolist() == [15, 16, 17, 18]
    with pytest.raises(ValueError, match="video"):
        video_grid_scores(scores, ids == 7, VideoGeometry(7, (4, 4), 2, ((1, 2, 2),) * 3))
    with pytest.raises(ValueError, match="video"):
        video_grid_scores(scores, ids == 7, VideoGeometry(7, (4, 4), 2, ()))


def test_families_without_videos_are_refused():
    with pytest.raises(UnsupportedModelError, match="Qwen2-VL"):
        video_geometry(make_llava(layers=1), torch.tensor([[2, 4, 4]]))


def test_patchify_equals_the_image_processor_on_a_still_frame():
    r"""The fixture's video patchify, on one frame (repeated to a frame group), equals Qwen2-VL's own image
    processor (which repeats an image over the group): the spatial order of the patches is the model's."""
    np = pytest.importorskip("numpy")
    from transformers import Qwen2VLImageProcessor

    proc = Qwen2VLImageProcessor(patch_size=2, temporal_patch_size=2, merge_size=2, min_pixels=16, max_pixels=4096,
                                 do_resize=False, do_rescale=False, do_normalize=False)
    image = np.random.RandomState(0).rand(3, 8, 12)
    got = proc(images=[image.astype(np.float32)], return_tensors="pt", input_data_format="channels_first")
    mine, thw = patchify_video(torch.tensor(image, dtype=torch.float32)[None])
    assert got["image_grid_thw"].tolist() == [list(thw)] == [[1, 4, 6]]
    assert torch.equal(got["pixel_values"].float(), mine)


def _own_patches(name):
    r"""A tower whose video and image tokens each see their own patches only: Qwen2-VL without blocks, Qwen2.5-VL
    with its blocks' attention outputs zeroed (its window order is put back by the tower)."""
    if name == "qwen2_vl":
        return MAKERS[name](seed=5, layers=1, vision_depth=0)
    model = MAKERS[name](seed=5, layers=1, vision_depth=2)
    with torch.no_grad():
        for blk in model.model.visual.blocks:
            blk.attn.proj.weight.zero_()
            blk.attn.proj.bias.zero_()
    return model


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_changed_frames_and_image_light_their_own_maps(name):
    r"""An 8 x 8 image and a 5-frame 8 x 12 video (padded to 6 frames: 3 frame groups) in one prompt: changing one
    2 x 2 patch of frame f lights video group f // 2's 4 x 4 token block only (and nothing of the image); changing
    the last frame also lights the padding frame's group (the same group); changing an image patch lights the
    image's block only (and nothing of the video)."""
    model = _own_patches(name)
    g = torch.Generator().manual_seed(0)
    frames = torch.randn(5, 3, 8, 12, generator=g, dtype=torch.float64)
    image = torch.randn(1, 3, 8, 8, generator=g, dtype=torch.float64)
    ids = video_row(model, 2, 18, n_image=4, g=g)[None]
    mask = torch.ones_like(ids)

    def embeddings(fr, im):
        pv, thw = patchify_video(fr)
        px, ithw = patchify_video(im)
        inputs = {"pixel_values_videos": pv, "video_grid_thw": torch.tensor([thw]), "pixel_values": px,
                  "image_grid_thw": torch.tensor([ithw]), "mm_token_type_ids": mm_types(model, ids)}
        return merged_embeddings(model, ids, mask, **inputs), torch.tensor([thw]), torch.tensor([ithw])

    x0, vthw, ithw = embeddings(frames, image)
    assert vthw.tolist() == [[3, 4, 6]]
    for frame, pr, pc in ((0, 0, 0), (3, 3, 5), (4, 1, 2)):
        changed = frames.clone()
        changed[frame, :, 2 * pr:2 * pr + 2, 2 * pc:2 * pc + 2] += 1.0
        change = (embeddings(changed, image)[0] - x0).norm(dim=-1)
        video = video_heatmaps(change, ids, model, vthw)[0]
        expect = torch.zeros(3, 8, 12, dtype=torch.bool)
        expect[frame // 2, 4 * (pr // 2):4 * (pr // 2) + 4, 4 * (pc // 2):4 * (pc // 2) + 4] = True
        assert torch.equal(video > 1e-9, expect), (frame, pr, pc)
        assert not (image_heatmaps(change, ids, model, image_grid_thw=ithw)[0] > 1e-9).any()
    for pr, pc in ((0, 3), (2, 1)):
        changed = image.clone()
        changed[0, :, 2 * pr:2 * pr + 2, 2 * pc:2 * pc + 2] += 1.0
        change = (embeddings(frames, changed)[0] - x0).norm(dim=-1)
        expect = torch.zeros(8, 8, dtype=torch.bool)
        expect[4 * (pr // 2):4 * (pr // 2) + 4, 4 * (pc // 2):4 * (pc // 2) + 4] = True
        assert torch.equal(image_heatmaps(change, ids, model, image_grid_thw=ithw)[0] > 1e-9, expect), (pr, pc)
        assert not (video_heatmaps(change, ids, model, vthw)[0] > 1e-9).any()
