r"""Videos in Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE (issue 38; ``docs/vlm.md``, "Videos";
``captum_normattr.attr.vlm_video``): what is their own.

These processors write a video frame group by frame group, each group its own ``<vision_start> ... <vision_end>``
span after its timestamp text, and the model splits ``video_grid_thw`` per group for its M-RoPE positions; Qwen3-VL's
DeepStack adds the tower's intermediate features at the video positions as at the image positions. The shared checks
(ALTI-Logit and DecompX complete against the model's own logit, also one pass over three generated tokens; the map
methods complete; padded == single for all four methods; the model unchanged) run on these four families in
``test_vlm_video.py`` (``vlm_videos_qwen3.family_video_batch``). Here, on tiny float64 models: the recorded DeepStack
additions at the video positions are the tower's own video features; the video tokens map to (frame group, row,
column) across the timestamp text (synthetic scores, and a tower whose tokens see their own patches only, in the
merged embeddings and in every DeepStack addition).
"""
from __future__ import annotations

import pytest
import torch

from captum_normattr.attr.inputs import prepare_inputs
from captum_normattr.attr.vlm_regions import image_heatmaps
from captum_normattr.attr.vlm_video import video_geometry, video_heatmaps, video_scores
from captum_normattr.models.adapters import get_adapter
from captum_normattr.models.engine import streamed_forward
from vlm_models import QWEN_END, QWEN_IMAGE, QWEN_START, merged_embeddings
from vlm_videos import mm_types, patchify_video, video_token
from vlm_qwen3 import deepstack_inputs
from vlm_videos_qwen3 import MAKERS, STAMP, qwen3_video_batch, qwen3_video_row

DEEPSTACK = ["qwen3_vl", "qwen3_vl_moe"]


# ---- DeepStack at the video positions ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", DEEPSTACK)
@pytest.mark.parametrize("image", [False, True], ids=["video", "image+video"])
def test_deepstack_additions_at_the_video_positions_are_the_towers_video_features(name, image):
    r"""The recorded additions of layer l < n at the video positions are, in order, the tower's l-th DeepStack
    features of the videos (computed here from ``pixel_values_videos`` alone, ``get_video_features``); at the image
    positions the image's; zero elsewhere; and each recorded layer output is the next layer's real input."""
    model = MAKERS[name](seed=1)
    ids, mask, extra, _ = qwen3_video_batch(model, [3, 6], image=image, seed=7)
    vmask, embeds = deepstack_inputs(model, ids, mask, extra)
    video, pics = ids == video_token(model), ids == QWEN_IMAGE
    assert torch.equal(vmask, video | pics) and len(embeds) == 2
    with torch.no_grad():
        tower = model.model.get_video_features(extra["pixel_values_videos"], extra["video_grid_thw"], return_dict=True)
        own_video = [torch.cat(list(f)) for f in tower.deepstack_features]
        if image:
            imgs = model.model.get_image_features(extra["pixel_values"], extra["image_grid_thw"], return_dict=True)
            own_image = [torch.cat(list(f)) for f in imgs.deepstack_features]
    adapter = get_adapter(model)
    layers = []
    with streamed_forward(model, adapter, prepare_inputs(model, adapter, ids, {"attention_mask": mask, **extra}),
                          layers.append):
        pass
    for l, layer in enumerate(layers):
        if l >= len(embeds):
            assert layer.own_after is None
            continue
        scale = own_video[l].abs().max()
        assert ((layer.own_after[video] - own_video[l]).abs().max() / scale) < 1e-12, l
        assert layer.own_after[video].abs().amin(-1).min() > 0
        if image:
            assert ((layer.own_after[pics] - own_image[l]).abs().max() / scale) < 1e-12, l
        assert (layer.own_after[~(video | pics)] == 0).all()
        assert torch.equal(layer.layer_out, layers[l + 1].hidden_in)


# ---- the mapping -------------------------------------------------------------------------------------------------


def test_video_tokens_on_frame_groups_across_the_timestamps():
    r"""Scores equal to the token index, a video of 6 frames of 8 x 12 pixels (``video_grid_thw`` (3, 4, 6)) written
    as 3 spans of 2 x 3 tokens, each after its timestamp: the k-th video token lies at group k // 6, row (k // 3) % 2,
    column k % 3; the timestamps and span markers land nowhere."""
    model = MAKERS["qwen3_vl"](seed=0, layers=1, deepstack=(0,))
    thw = torch.tensor([[3, 4, 6]])
    ids = qwen3_video_row(model, 1, 3, 6)[None]
    where = (ids[0] == video_token(model)).nonzero()[:, 0]
    assert where.tolist() == [1 + g * (STAMP + 8) + STAMP + 1 + k for g in range(3) for k in range(6)]
    scores = torch.arange(ids.shape[1], dtype=torch.float64)[None]
    g = video_geometry(model, thw)
    assert g.grids == ((3, 2, 3),) and g.patch == (4, 4) and g.frames_per_group == 2
    heat = video_heatmaps(scores, ids, model, thw)[0]
    assert heat.shape == (3, 8, 12)
    for k in range(18):
        grp, row, col = k // 6, (k // 3) % 2, k % 3
        assert (heat[grp, 4 * row:4 * row + 4, 4 * col:4 * col + 4] == where[k]).all(), k
    grid = video_scores(scores, ids, model, thw).grids[0]
    assert grid.flatten().tolist() == where.tolist()


def _own_patches(name):
    r"""A tower whose tokens each see their own patches only: its blocks' attention outputs zeroed (the position
    embeddings, MLPs, mergers and DeepStack mergers act per patch or per merged token)."""
    model = MAKERS[name](seed=5, **({"layers": 2} if name in DEEPSTACK else {}))
    with torch.no_grad():
        for blk in model.model.visual.blocks:
            blk.attn.proj.weight.zero_()
            blk.attn.proj.bias.zero_()
    return model


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen3_5"])
def test_changed_frames_and_image_light_their_own_maps(name):
    r"""An 8 x 8 image and a 5-frame 8 x 12 video (padded to 6 frames: 3 frame groups, 3 spans): changing one 2 x 2
    patch of frame f lights video group f // 2's 4 x 4 token block only (and nothing of the image), in the merged
    embeddings and (Qwen3-VL) in every DeepStack addition; changing an image patch lights the image's block only."""
    model = _own_patches(name)
    g = torch.Generator().manual_seed(0)
    frames = torch.randn(5, 3, 8, 12, generator=g, dtype=torch.float64)
    image = torch.randn(1, 3, 8, 8, generator=g, dtype=torch.float64)
    ids = qwen3_video_row(model, 2, 3, 6, n_image=4, g=g)[None]
    mask = torch.ones_like(ids)
    assert ids[0, 1] == QWEN_START and ids[0, 6] == QWEN_END

    def inputs(fr, im):
        pv, thw = patchify_video(fr)
        px, ithw = patchify_video(im)
        return {"pixel_values_videos": pv, "video_grid_thw": torch.tensor([thw]), "pixel_values": px,
                "image_grid_thw": torch.tensor([ithw]), "mm_token_type_ids": mm_types(model, ids)}

    def changes(fr, im):
        r"""Per-token change norms against the originals: the merged embeddings, then each DeepStack addition."""
        now, base = inputs(fr, im), inputs(frames, image)
        out = [(merged_embeddings(model, ids, mask, **now) - merged_embeddings(model, ids, mask, **base)).norm(dim=-1)]
        if name in DEEPSTACK:
            vmask, new = deepstack_inputs(model, ids, mask, now)
            _, old = deepstack_inputs(model, ids, mask, base)
            for a, b in zip(new, old):
                full = torch.zeros(ids.shape, dtype=torch.float64)
                full[vmask] = (a - b).norm(dim=-1)
                out.append(full)
        return out

    vthw, ithw = inputs(frames, image)["video_grid_thw"], inputs(frames, image)["image_grid_thw"]
    assert vthw.tolist() == [[3, 4, 6]]
    for frame, pr, pc in ((0, 0, 0), (3, 3, 5), (4, 1, 2)):
        changed = frames.clone()
        changed[frame, :, 2 * pr:2 * pr + 2, 2 * pc:2 * pc + 2] += 1.0
        expect = torch.zeros(3, 8, 12, dtype=torch.bool)
        expect[frame // 2, 4 * (pr // 2):4 * (pr // 2) + 4, 4 * (pc // 2):4 * (pc // 2) + 4] = True
        found = changes(changed, image)
        assert len(found) == (3 if name in DEEPSTACK else 1)
        for change in found:
            assert torch.equal(video_heatmaps(change, ids, model, vthw)[0] > 1e-9, expect), (frame, pr, pc)
            assert not (image_heatmaps(change, ids, model, image_grid_thw=ithw)[0] > 1e-9).any()
            assert not (change[0, ids[0] != video_token(model)] > 1e-9).any()  # nor the timestamps
    for pr, pc in ((0, 3), (2, 1)):
        changed = image.clone()
        changed[0, :, 2 * pr:2 * pr + 2, 2 * pc:2 * pc + 2] += 1.0
        expect = torch.zeros(8, 8, dtype=torch.bool)
        expect[4 * (pr // 2):4 * (pr // 2) + 4, 4 * (pc // 2):4 * (pc // 2) + 4] = True
        for change in changes(frames, changed):
            assert torch.equal(image_heatmaps(change, ids, model, image_grid_thw=ithw)[0] > 1e-9, expect), (pr, pc)
            assert not (video_heatmaps(change, ids, model, vthw)[0] > 1e-9).any()


# ---- the fixtures' layout against transformers' own processor (Qwen3.5 uses Qwen3-VL's) ------------------------


def test_patchify_equals_the_video_processors():
    r"""The fixtures' frames -> ``pixel_values_videos`` equals ``Qwen3VLVideoProcessor.patchify`` (the last frame
    repeated to a whole frame group, the same patch order)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    video = torch.randn(1, 5, 3, 8, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    got, t, h, w = Qwen3VLVideoProcessor.patchify(None, video, 2, 2, 2)  # a method that reads no state
    mine, thw = patchify_video(video[0])
    assert (t, h, w) == thw == (3, 4, 6) and torch.equal(got[0], mine)


def test_the_processors_placeholder_is_the_fixtures_layout():
    r"""``Qwen3VLProcessor.replace_video_token`` for ``video_grid_thw`` (3, 4, 6), 5 frames at 2 fps: per frame group
    its timestamp text, then ``<vision_start>``, 6 video tokens, ``<vision_end>``: the layout of
    :func:`qwen3_video_row`."""
    import re
    from types import SimpleNamespace

    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    proc = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
                           vision_start_token="<vs>", vision_end_token="<ve>", video_token="<v>",
                           _calculate_timestamps=lambda *a: Qwen3VLProcessor._calculate_timestamps(None, *a))
    meta = SimpleNamespace(fps=2.0, frames_indices=list(range(5)))
    text = Qwen3VLProcessor.replace_video_token(proc, {"video_grid_thw": torch.tensor([[3, 4, 6]]),
                                                       "video_metadata": [meta]}, 0)
    assert text == "".join(f"<{s:.1f} seconds><vs>{'<v>' * 6}<ve>" for s in (0.25, 1.25, 2.0))
    kinds = re.findall(r"<\d+\.\d seconds>|<vs>|<ve>|<v>", text)
    model = MAKERS["qwen3_vl"](seed=0, layers=1, deepstack=(0,))
    row = qwen3_video_row(model, 0, 3, 6)[1:]
    word = {QWEN_START: "<vs>", QWEN_END: "<ve>", video_token(model): "<v>"}
    mine = [word.get(int(i), "t") for i in row]
    theirs = ["t" if k.endswith("seconds>") else k for k in kinds]
    # one timestamp text (STAMP ids in the fixture) per group, then the same markers and tokens
    assert [k for i, k in enumerate(mine) if k != "t" or mine[i - 1] != "t"] == theirs
