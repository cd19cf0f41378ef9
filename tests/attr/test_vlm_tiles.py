r"""Tiled images (issue 38): Llama 4 with images, and tiles stitched back onto the image (Idefics3 / SmolVLM, Llama 4).

Llama 4 (``tests/fixtures/vlm_tiled.py``, tiny float64): ALTI-Logit and DecompX token scores plus no-token terms equal
the model's own logit; GlobEnc's, ALTI's and the FF decomposition's parts sum to the model's tensors; all four methods
on a left-padded batch (different tile layouts) equal the single examples; the model unchanged; the methods refused
for the Llama 4 text model are refused for the model with images with the same reason; the pixel shuffle's tokens on
their pixels (a tower whose attention output is zeroed).

Stitching (``captum_normattr.attr.vlm_tiles``): the layouts read from the processors' ids; synthetic scores that
encode the tile and the cell land on the expected pixels, for Idefics3 and Llama 4 (with its padding); the resize
rule against Llama 4's image-processor helpers; the ``ImageMaskInput`` route's segments equal the pixel-overlap sums.
"""
from __future__ import annotations

import pytest
import torch

from captum_normattr import (
    ALTIAttribution,
    ALTILogitAttribution,
    ALTIPlusAttribution,
    DecompXAttribution,
    FFIntegratedDecomposition,
    GlobEncAttribution,
)
from captum_normattr.attr.vlm_regions import image_geometry, image_heatmaps
from captum_normattr.attr.vlm_tiles import (
    TileLayout,
    llama4_resized_size,
    spread_density,
    stitch_tiles,
    tile_layouts,
    tiled_heatmaps,
    view_boxes,
)
from captum_normattr.models.adapters import UnsupportedModelError, get_adapter
from map_checks import check_maps_complete
from vlm_checks import check_model_unchanged
from vlm_tiled import (
    L4_PATCH_TOKEN,
    L4_SIZE,
    llama4_batch,
    llama4_image_ids,
    llama4_single,
    llama4_tokens,
    make_llama4,
)

METHODS = [ALTILogitAttribution, DecompXAttribution, ALTIAttribution, GlobEncAttribution]


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


@pytest.fixture(scope="module")
def llama4():
    return make_llama4(seed=1)


def _real(model, ids, mask, extra):
    pos = (mask.cumsum(-1) - 1).clamp_min(0)  # the package's positions: counted over the real tokens
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos, **extra).logits[:, -1]


def _merged(model, ids, mask, extra):
    r"""The Llama 4 language model's input embeddings (the projector's outputs at the image tokens), read from the
    model's own forward (its decoder is ``language_model.model``)."""
    got = {}
    handle = model.language_model.model.register_forward_pre_hook(
        lambda m, a, k: got.__setitem__("x", k["inputs_embeds"].detach().clone()), with_kwargs=True)
    try:
        _real(model, ids, mask, extra)
    finally:
        handle.remove()
    return got["x"]


# ---- Llama 4 with images: the language model's decomposition ------------------------------------------------


@pytest.mark.parametrize("cls", [ALTILogitAttribution, DecompXAttribution], ids=lambda c: c.__name__)
def test_llama4_complete_against_the_models_logit(llama4, cls):
    model, _ = llama4
    assert get_adapter(model).family == "Llama 4 (Llama 4)"
    ids, mask, extra = llama4_batch([3, 6], seed=2)
    t = torch.tensor([5, 9])
    real = _real(model, ids, mask, extra)[[0, 1], t]
    res = cls(model).decompose(ids, t, {"attention_mask": mask, **extra})
    rest = res.no_token_total if cls is ALTILogitAttribution else res.bias_scores[:, 0]
    err = float(((res.scores.sum(-1) + rest - real).abs() / real.abs().max()).max())
    print(f"{cls.__name__} completeness error (relative to the logit's scale): {err:.1e}")
    assert err < 1e-10
    assert res.scores[ids == L4_PATCH_TOKEN].abs().sum() > 0
    assert (res.scores[mask == 0] == 0).all()


def test_llama4_complete_with_the_query_temperature():
    r"""With the NoPE layers' query temperature (it reads the absolute position, pads included: the model itself then
    depends on the padding), ALTI-Logit is complete against the padded model's own logit."""
    model, _ = make_llama4(seed=2, attn_temperature_tuning=True, floor_scale=2, attn_scale=0.5)
    ids, mask, extra = llama4_batch([6, 2], seed=9)
    t = torch.tensor([4, 11])
    real = _real(model, ids, mask, extra)[[0, 1], t]
    res = ALTILogitAttribution(model).decompose(ids, t, {"attention_mask": mask, **extra})
    err = float(((res.scores.sum(-1) + res.no_token_total - real).abs() / real.abs().max()).max())
    print(f"ALTI-Logit completeness with the query temperature: {err:.1e}")
    assert err < 1e-10


def test_llama4_maps_complete(llama4):
    model, _ = llama4
    ids, mask, extra = llama4_batch([4, 2], seed=5)
    check_maps_complete(model, ids, {"attention_mask": mask, **extra})


def test_llama4_scores_equal_the_text_model_on_the_merged_embeddings(llama4):
    r"""The language model of the model with images is the Llama 4 text model: given the merged embeddings (the
    projector's outputs at the image tokens), the text model's ALTI-Logit scores are those of the model with images."""
    model, lm = llama4
    ids, mask, extra = llama4_batch([3], seed=6)
    x = _merged(model, ids, mask, extra)
    t = torch.tensor([7])
    vlm = ALTILogitAttribution(model).decompose(ids, t, {"attention_mask": mask, **extra})
    text = ALTILogitAttribution(lm).decompose(x, t, {"attention_mask": mask})
    err = _rel(text.scores, vlm.scores)
    print(f"text model vs model with images, ALTI-Logit scores: {err:.1e}")
    assert err < 1e-12


@pytest.mark.parametrize("cls", METHODS, ids=lambda c: c.__name__)
def test_llama4_padded_batch_equals_single_examples(llama4, cls):
    model, _ = llama4
    ids, mask, extra = llama4_batch([5, 2], seed=3)
    t = torch.tensor([6, 9])
    attr = cls(model)
    target = (lambda t: t) if cls.uses_target else (lambda t: None)
    batch = attr.attribute(ids, target=target(t), additional_forward_args={"attention_mask": mask, **extra})
    worst = 0.0
    for b in range(2):
        keep = mask[b].bool()
        alone = attr.attribute(ids[b:b + 1, keep], target=target(t[b:b + 1]),
                               additional_forward_args={"attention_mask": mask[b:b + 1, keep],
                                                        **llama4_single(extra, b)})
        worst = max(worst, _rel(batch[b, keep], alone[0]))
        assert (batch[b, ~keep] == 0).all()
    print(f"{cls.__name__} padded vs single: {worst:.1e}")
    assert worst < 1e-10
    assert batch[ids == L4_PATCH_TOKEN].abs().sum() > 0


def test_llama4_model_unchanged(llama4):
    model, _ = llama4
    ids, mask, extra = llama4_batch([4, 3], seed=4)

    def run():
        for cls in (ALTILogitAttribution, DecompXAttribution):
            cls(model).attribute(ids, target=torch.tensor([1, 2]),
                                 additional_forward_args={"attention_mask": mask, **extra})

    check_model_unchanged(model, run, lambda: _real(model, ids, mask, extra))


def _outcome(make, model, ids, mask, extra):
    r"""("ok", None) or (error type, message with the model's names made neutral)."""
    try:
        make(model).attribute(ids, additional_forward_args={"attention_mask": mask, **extra})
    except (UnsupportedModelError, NotImplementedError, ValueError) as err:
        msg = str(err)
        for name, neutral in (("Llama4ForConditionalGeneration", "M"), ("Llama4ForCausalLM", "M"),
                              ("'llama4_text'", "T"), ("'llama4'", "T")):
            msg = msg.replace(name, neutral)
        return type(err), msg
    return "ok", None


@pytest.mark.parametrize("make", [ALTIPlusAttribution, ALTIAttribution, GlobEncAttribution, FFIntegratedDecomposition],
                         ids=lambda c: c.__name__)
def test_llama4_refuses_what_its_text_model_refuses(llama4, make):
    r"""A method refused for the Llama 4 text model is refused for the model with images, with the same reason (ALTI+:
    an encoder-decoder method); the text model's methods run on both."""
    model, lm = llama4
    ids, mask, extra = llama4_batch([3], seed=7)
    text = _outcome(make, lm, ids, mask, {})
    assert text == _outcome(make, model, ids, mask, extra)
    assert (text[0] == "ok") == (make is not ALTIPlusAttribution)


# ---- Llama 4: the pixel shuffle's tokens on their pixels ---------------------------------------------------


def test_llama4_pixel_shuffle_lights_the_changed_patch():
    r"""A one-layer tower whose attention output is zeroed (each image token sees its own 2 x 2 patches): changing one
    4 x 4 patch of one sub-image (two tiles and the global view) changes one image token, and that sub-image's heat
    map lights the patch's 8 x 8 token block (the tower's [CLS], last in its sequence, dropped)."""
    model, _ = make_llama4(seed=5)
    with torch.no_grad():
        for layer in model.vision_model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    g = image_geometry(model)
    assert g.patch == (8, 8) and g.grids == ((3, 3),) and g.tokens(0) == llama4_tokens() == 9
    ids, mask, extra = llama4_batch([2], seed=8, tiles=((1, 2),))
    pixels = extra["pixel_values"]

    def embeddings(px):
        return _merged(model, ids, mask, {"pixel_values": px})

    x0 = embeddings(pixels)
    for sub, pr, pc in ((0, 0, 0), (1, 3, 4), (2, 5, 1), (0, 2, 5)):
        changed = pixels.clone()
        changed[sub, :, 4 * pr:4 * pr + 4, 4 * pc:4 * pc + 4] += 1.0
        change = (embeddings(changed) - x0).norm(dim=-1)
        maps = image_heatmaps(change, ids, model)
        assert len(maps) == 3 and all(not (maps[k] > 1e-9).any() for k in range(3) if k != sub)
        expect = torch.zeros(L4_SIZE, L4_SIZE, dtype=torch.bool)
        expect[8 * (pr // 2):8 * (pr // 2) + 8, 8 * (pc // 2):8 * (pc // 2) + 8] = True
        assert torch.equal(maps[sub] > 1e-9, expect), (sub, pr, pc)


# ---- layouts read from the ids -----------------------------------------------------------------------------


def test_llama4_layouts_from_the_ids(llama4):
    r"""Three images in one row (2 x 3 tiles, one tile, 3 x 1 tiles) and a left-padded row (1 x 2 tiles): the layouts
    in the model's order; ``tiles=`` overrides; an image span without its end is refused."""
    model, _ = llama4
    row = torch.cat([torch.tensor([1]), llama4_image_ids(2, 3), torch.tensor([5]), llama4_image_ids(1, 1),
                     llama4_image_ids(3, 1), torch.tensor([6])])
    other = llama4_image_ids(1, 2)
    ids = torch.stack([row, torch.cat([torch.zeros(len(row) - len(other), dtype=torch.long), other])])
    assert tile_layouts(ids, model) == [TileLayout(2, 3), TileLayout(1, 1, False), TileLayout(3, 1), TileLayout(1, 2)]
    assert tile_layouts(ids, model, tiles=[(1, 1)]) == [TileLayout(1, 1, False)]
    with pytest.raises(ValueError, match="image_end"):
        tile_layouts(other[:-1][None], model)


def test_idefics3_layouts_from_the_ids():
    from vlm_families import CASES
    from vlm_tiled import idefics3_split_ids, idefics3_tile_tokenizer

    model = CASES["idefics3"].make(seed=0, layers=1)
    tok = idefics3_tile_tokenizer()
    ids = torch.cat([torch.tensor([1]), idefics3_split_ids(2, 3), torch.tensor([7]), idefics3_split_ids(0, 0),
                     idefics3_split_ids(1, 2)])[None]
    assert tile_layouts(ids, model, tokenizer=tok) == [TileLayout(2, 3), TileLayout(0, 0), TileLayout(1, 2)]
    assert tile_layouts(ids, model, tiles=[(2, 3), (0, 0), (1, 2)]) == [TileLayout(2, 3), TileLayout(0, 0),
                                                                        TileLayout(1, 2)]
    unsplit = torch.cat([idefics3_split_ids(0, 0), torch.tensor([7]), idefics3_split_ids(0, 0)])[None]
    assert tile_layouts(unsplit, model) == [TileLayout(0, 0)] * 2
    with pytest.raises(ValueError, match="tokenizer"):  # split tiles are never guessed
        tile_layouts(ids, model)


# ---- stitching on synthetic scores ----------------------------------------------------------------------------


def _encoded(ids, token, n):
    r"""Scores whose image tokens read 1000 (sub-image + 1) + 10 cell row + cell column (cells of a 3 x 3 grid);
    the other tokens 0."""
    scores = torch.zeros(ids.shape, dtype=torch.float64)
    where = (ids[0] == token).nonzero().flatten()
    for k, pos in enumerate(where.tolist()):
        sub, cell = divmod(k, n)
        scores[0, pos] = 1000 * (sub + 1) + 10 * (cell // 3) + cell % 3
    return scores


def test_stitch_tiles_places_every_tile():
    subs = [torch.full((2, 2), float(k)) for k in range(7)]  # 2 x 3 tiles, then the global view
    tile, glob = stitch_tiles(subs, TileLayout(2, 3))
    assert tile.shape == (4, 6) and torch.equal(glob, subs[6])
    for k in range(6):
        r, c = divmod(k, 3)
        assert (tile[2 * r:2 * r + 2, 2 * c:2 * c + 2] == k).all()
    one, none = stitch_tiles(subs[:1], TileLayout(1, 1, False))
    assert torch.equal(one, subs[0]) and none is None
    with pytest.raises(ValueError, match="sub-image"):
        stitch_tiles(subs[:3], TileLayout(2, 3))


def test_spread_density_shares_out_each_token():
    r"""Three tokens 2 pixels wide over a 5-pixel-wide image: the last straddles the edge and gives its score to its one
    column inside; 3 pixels wide over 4: the last lies past the image, its score off the image."""
    grid = torch.tensor([[3.0, 6.0, 9.0]], dtype=torch.float64)
    dens, off = spread_density(grid, (2, 5), (0.0, 0.0, 2.0, 6.0))
    assert torch.equal(dens, torch.tensor([[0.75, 0.75, 1.5, 1.5, 4.5]] * 2, dtype=torch.float64))
    assert float(off) == 0.0
    dens, off = spread_density(grid, (2, 4), (0.0, 0.0, 2.0, 9.0))
    assert torch.equal(dens, torch.tensor([[0.5, 0.5, 0.5, 3.0]] * 2, dtype=torch.float64)) and float(off) == 9.0


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
def test_idefics3_tiles_stitched_on_the_image(family):
    r"""Idefics3 split 2 x 3: over the image the tiles were cut from (48 x 72 pixels), cell (i, j) of tile (r, c)
    lands on pixels [24 r + 8 i, + 8) x [24 c + 8 j, + 8) with its score / 64 per pixel; the global view's cell (i, j)
    on [16 i, + 16) x [24 j, + 24), score / 384; the combined map sums to every image token's score."""
    from vlm_families import CASES, IDEFICS_IMAGE, idefics3_tokens
    from vlm_tiled import idefics3_split_ids, idefics3_tile_tokenizer

    model = CASES[family].make(seed=0, layers=1)
    ids = torch.cat([torch.tensor([1]), idefics3_split_ids(2, 3), torch.tensor([7])])[None]
    scores = _encoded(ids, IDEFICS_IMAGE, idefics3_tokens())
    heat = tiled_heatmaps(scores, ids, model, tokenizer=idefics3_tile_tokenizer())
    assert len(heat) == 1
    h = heat[0]
    assert h.layout == TileLayout(2, 3) and h.combined.shape == (48, 72) and h.tile_grid.shape == (6, 9)
    assert h.tile_box == h.global_box == (0.0, 0.0, 48.0, 72.0)
    for r in range(2):
        for c in range(3):
            for i in range(3):
                for j in range(3):
                    block = h.tiles[24 * r + 8 * i:24 * r + 8 * i + 8, 24 * c + 8 * j:24 * c + 8 * j + 8]
                    assert (block == (1000 * (3 * r + c + 1) + 10 * i + j) / 64).all()
    for i in range(3):
        for j in range(3):
            assert (h.global_view[16 * i:16 * i + 16, 24 * j:24 * j + 24] == (7000 + 10 * i + j) / 384).all()
    assert torch.equal(h.combined, h.tiles + h.global_view)
    assert abs(float(h.combined.sum()) - float(scores.sum())) < 1e-12 * float(scores.sum())
    assert float(h.off_image) == 0.0
    small = tiled_heatmaps(scores, ids, model, image_hw=[(12, 30)], tiles=[(2, 3)])[0]  # over the original image
    assert small.combined.shape == (12, 30) and abs(float(small.combined.sum()) / float(scores.sum()) - 1) < 1e-12


def test_llama4_tiles_stitched_on_the_image_with_its_padding(llama4):
    r"""Llama 4, a 20 x 60 image on a 1 x 3 canvas of 24-pixel tiles: the processor's resize keeps it 20 x 60 at the
    canvas's top left (padding below and to the right). Over the image, tile token (i, j) of the stitched 3 x 9 grid
    covers [8 i, + 8) x [8 j, + 8) cut at the image's edge (its score over its pixels inside); the last token column
    (64 to 72) lies on padding only: its scores are off the image. The global view's 3 x 3 tokens cover the whole
    image (rows of 7, 6 and 7 pixels by their centres, columns of 20)."""
    model, _ = llama4
    n = llama4_tokens()
    ids = torch.cat([torch.tensor([1]), llama4_image_ids(1, 3), torch.tensor([7])])[None]
    scores = _encoded(ids, L4_PATCH_TOKEN, n)
    with pytest.raises(ValueError, match="image_hw"):
        tiled_heatmaps(scores, ids, model)
    h = tiled_heatmaps(scores, ids, model, image_hw=[(20, 60)])[0]
    assert h.layout == TileLayout(1, 3) and h.tile_box == (0.0, 0.0, 24.0, 72.0) and h.combined.shape == (20, 60)
    grid = h.tile_grid
    for i in range(3):
        for j in range(9):
            assert float(grid[i, j]) == 1000 * (j // 3 + 1) + 10 * i + j % 3
            y0, x0 = 8 * i, 8 * j
            y1, x1 = min(y0 + 8, 20), min(x0 + 8, 60)
            if x0 >= 60:
                continue
            assert (h.tiles[y0:y1, x0:x1] == grid[i, j] / ((y1 - y0) * (x1 - x0))).all(), (i, j)
    assert float(h.off_image) == float(grid[:, 8].sum())
    rows, cols = [0, 7, 13, 20], [0, 20, 40, 60]
    for i in range(3):
        for j in range(3):
            block = h.global_view[rows[i]:rows[i + 1], cols[j]:cols[j + 1]]
            assert (block == (4000 + 10 * i + j) / block.numel()).all()
    total = float(scores.sum())
    assert abs(float(h.combined.sum()) + float(h.off_image) - total) < 1e-12 * total
    one = tiled_heatmaps(_encoded(ids := torch.cat([llama4_image_ids(1, 1), torch.tensor([7])])[None],
                                  L4_PATCH_TOKEN, n), ids, model, image_hw=[(12, 24)])[0]
    assert one.layout == TileLayout(1, 1, False) and one.global_grid is None and one.global_box is None
    assert one.tile_box == (0.0, 0.0, 24.0, 24.0)  # 12 x 24 kept, padded below to the 24 x 24 tile
    assert float(one.off_image) == float(one.tile_grid[2].sum()) and not one.global_view.any()


def _llama4_processor_helpers():
    r"""Llama 4's image-processor helpers, read from transformers' source (the processor module itself imports
    torchvision, which the test environment lacks)."""
    import ast
    import functools
    import importlib.util
    import math
    import pathlib

    spec = importlib.util.find_spec("transformers.models.llama4")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "image_processing_llama4.py"
    tree = ast.parse(path.read_text())
    names = ("get_factors", "get_max_res_without_distortion", "find_supported_resolutions", "get_best_fit")
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    ns = {"math": math, "torch": torch, "lru_cache": functools.lru_cache, "defaultdict": __import__("collections").defaultdict,
          "SizeDict": object}
    exec(compile(ast.Module(fns, []), str(path), "exec"), ns)
    return ns


def test_llama4_resize_rule_is_the_processors():
    r"""The canvas the processor chooses (its ``get_best_fit``) and the size it resizes to (its
    ``get_max_res_without_distortion`` after its own clamp, ``_preprocess``) against :func:`llama4_resized_size`,
    for 200 random image sizes; tile 24, 16 tiles at most."""
    from collections import namedtuple

    ns = _llama4_processor_helpers()
    tile = 24
    possible = torch.tensor(ns["find_supported_resolutions"](16, namedtuple("Size", "height width")(tile, tile)))
    g = torch.Generator().manual_seed(0)
    for h, w in torch.randint(5, 200, (200, 2), generator=g).tolist():
        canvas = [int(v) for v in ns["get_best_fit"]((h, w), possible)]
        clamp = (min(max(h, tile), canvas[0]), min(max(w, tile), canvas[1]))
        expect = tuple(max(v, 1) for v in ns["get_max_res_without_distortion"]((h, w), clamp))
        assert llama4_resized_size((h, w), canvas, tile) == expect, (h, w, canvas)
        assert llama4_resized_size((h, w), canvas, tile, resize_to_max_canvas=True) == tuple(
            max(v, 1) for v in ns["get_max_res_without_distortion"]((h, w), canvas))


def test_view_boxes_default_frame():
    from vlm_families import CASES

    model = CASES["idefics3"].make(seed=0, layers=1)
    assert view_boxes(model, TileLayout(0, 0)) == ((24, 24), None, (0.0, 0.0, 24.0, 24.0))
    assert view_boxes(model, TileLayout(2, 1), (10, 7)) == ((10, 7), (0.0, 0.0, 10.0, 7.0), (0.0, 0.0, 10.0, 7.0))


# ---- Captum's ImageMaskInput on a tiled image -----------------------------------------------------------------


def _route(model, fn, image, mask, target, tokenizer):
    from captum.attr._utils.interpretable_input import ImageMaskInput

    from captum_normattr.attr.llm import DecompositionLLMAttribution

    res = DecompositionLLMAttribution(ALTILogitAttribution(model), tokenizer).attribute(
        ImageMaskInput(image, mask=mask, processor_fn=fn), target=target)
    inputs = fn(image)
    full = torch.cat([inputs["input_ids"], target[None]], 1)
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=torch.ones_like(full), position_ids=torch.arange(full.shape[1])[None],
                       **extra).logits[0]
    p = inputs["input_ids"].shape[1]
    real = logits[torch.arange(p - 1, p - 1 + target.shape[0]), target]
    ex = res.explanation
    err = float(((ex.scores.sum(-1) + ex.details.no_token - real).abs() / real.abs().max()).max())
    return res, err


def _pixel_overlap_sums(res, model, image_hw, masks, **kw):
    r"""Every segment's pixel sum of the combined heat map of the explained scores."""
    ex = res.explanation
    heat = tiled_heatmaps(ex.scores[None], ex.input_ids[None], model, image_hw=[image_hw], **kw)[0]
    return torch.stack([(heat.combined * m.to(heat.combined.dtype)).sum((-2, -1)) for m in masks], -1), heat


def test_idefics3_image_mask_input_split():
    r"""Through Idefics3's own image processor with splitting (a 12 x 30 image: resized to 20 x 48, then to 24 x 48,
    cut into 1 x 2 tiles plus the global view) and the processor's text layout: complete against the model's own
    logit; every segment's score is its pixels' sum of the combined heat map, and for segments of whole tokens the sum
    of those tokens' scores (tiles and global view)."""
    np = pytest.importorskip("numpy")
    from PIL import Image
    from transformers import Idefics3ImageProcessor
    from vlm_families import CASES, IDEFICS_SIZE
    from vlm_tiled import idefics3_split_ids, idefics3_tile_tokenizer

    model = CASES["idefics3"].make(seed=4)
    ip = Idefics3ImageProcessor(do_image_splitting=True, size={"longest_edge": 2 * IDEFICS_SIZE},
                                max_image_size={"longest_edge": IDEFICS_SIZE})

    def fn(image):
        got = ip(images=[[image]], return_tensors="pt")
        assert got["pixel_values"].shape[1] == 3  # two tiles and the global image
        ids = torch.cat([torch.tensor([1]), idefics3_split_ids(1, 2), torch.tensor([5, 6, 7])])[None]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "pixel_values": got["pixel_values"].double(), "pixel_attention_mask": got["pixel_attention_mask"]}

    image = Image.fromarray((np.random.RandomState(8).rand(12, 30, 3) * 255).astype("uint8"))
    mask = torch.zeros(12, 30, dtype=torch.int32)
    mask[:, 10:20] = 1  # tile-token columns 2 and 3 (5 pixels each), global-token column 1 (10 pixels)
    mask[:, 20:] = 2
    target = torch.tensor([8, 9, 10])
    res, err = _route(model, fn, image, mask, target, idefics3_tile_tokenizer())
    print(f"Idefics3 split ImageMaskInput completeness error: {err:.1e}")
    assert err < 1e-10
    ex = res.explanation
    assert res.patch_attr.shape == (3, 3, 6) and ex.box == (0.0, 0.0, 12.0, 30.0) and ex.overlap.shape == (3, 27)
    masks = [torch.as_tensor(m).bool() for m in res.inp.get_mask_list()]
    sums, heat = _pixel_overlap_sums(res, model, (12, 30), masks, tokenizer=idefics3_tile_tokenizer())
    assert torch.allclose(res.token_attr, sums, rtol=1e-12, atol=1e-12 * float(sums.abs().max()))
    whole = res.patch_attr[:, :, 2:4].sum((-2, -1)) + heat.global_grid[:, :, 1].sum(-1)
    assert torch.allclose(res.token_attr[:, 1], whole, rtol=1e-12, atol=1e-14)
    image_total = ex.image_total
    assert torch.allclose(res.token_attr.sum(-1), image_total, rtol=1e-12, atol=1e-12 * float(image_total.abs().max()))


def test_llama4_image_mask_input():
    r"""Llama 4's layout (a 20 x 60 image on a 1 x 3 canvas of 24-pixel tiles plus the global view, the processor's
    tokens; pixel values of the right shape: the processor itself needs torchvision): complete against the model's
    own logit; every segment's score is its pixels' sum of the combined heat map; the segments, a partition, sum to
    the image tokens' total less the scores on padding only."""
    np = pytest.importorskip("numpy")
    from PIL import Image
    from vlm_processors import vlm_tokenizer

    model, _ = make_llama4(seed=4)
    pixels = torch.randn(4, 3, L4_SIZE, L4_SIZE, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def fn(image):
        ids = torch.cat([torch.tensor([1]), llama4_image_ids(1, 3), torch.tensor([5, 6])])[None]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}

    image = Image.fromarray((np.random.RandomState(8).rand(20, 60, 3) * 255).astype("uint8"))
    mask = torch.zeros(20, 60, dtype=torch.int32)
    mask[3:11, 13:47] = 1
    mask[:, 50:] = 2
    target = torch.tensor([8, 9])
    res, err = _route(model, fn, image, mask, target, vlm_tokenizer({}))
    print(f"Llama 4 ImageMaskInput completeness error: {err:.1e}")
    assert err < 1e-10
    ex = res.explanation
    assert res.patch_attr.shape == (2, 3, 9) and ex.box == (0.0, 0.0, 24.0, 72.0)
    masks = [torch.as_tensor(m).bool() for m in res.inp.get_mask_list()]
    sums, heat = _pixel_overlap_sums(res, model, (20, 60), masks)
    assert torch.allclose(res.token_attr, sums, rtol=1e-12, atol=1e-12 * float(sums.abs().max()))
    expect = ex.image_total - heat.off_image
    assert torch.allclose(res.token_attr.sum(-1), expect, rtol=1e-12, atol=1e-12 * float(expect.abs().max()))
    assert float(heat.off_image.abs().min()) > 0
    with pytest.raises(ValueError, match="layout"):
        from captum.attr._utils.interpretable_input import ImageMaskInput

        from captum_normattr.attr.llm import DecompositionLLMAttribution
        from captum_normattr.attr.llm_images import decompose_image_input

        decompose_image_input(DecompositionLLMAttribution(ALTILogitAttribution(model), vlm_tokenizer({})),
                              ImageMaskInput(image, mask=mask, processor_fn=fn), target, layout="stretch")


def test_idefics3_processor_tiles_land_where_stitched():
    r"""Through Idefics3's own image processor with splitting (a 24 x 48 image, already whole tiles: cut into 1 x 2
    tiles plus the global view) and a tower without layers (each image token sees its own 2 x 2 patches): changing
    one 8 x 8 pixel block of the image changes one tile token, and the stitched tile map lights that block of the
    image exactly."""
    np = pytest.importorskip("numpy")
    from PIL import Image
    from transformers import Idefics3ImageProcessor
    from vlm_families import CASES, IDEFICS_SIZE
    from vlm_models import merged_embeddings
    from vlm_tiled import idefics3_split_ids, idefics3_tile_tokenizer

    model = CASES["idefics3"].make(seed=5, layers=1, vision_layers=0)
    ip = Idefics3ImageProcessor(do_image_splitting=True, size={"longest_edge": 2 * IDEFICS_SIZE},
                                max_image_size={"longest_edge": IDEFICS_SIZE})
    ids = torch.cat([torch.tensor([1]), idefics3_split_ids(1, 2), torch.tensor([7])])[None]
    mask = torch.ones_like(ids)
    tok = idefics3_tile_tokenizer()
    base = (np.random.RandomState(3).rand(24, 48, 3) * 200).astype("uint8")

    def embeddings(array):
        got = ip(images=[[Image.fromarray(array)]], return_tensors="pt")
        assert got["pixel_values"].shape[1] == 3
        return merged_embeddings(model, ids, mask, got["pixel_values"].double(), decoder="text_model",
                                 pixel_attention_mask=got["pixel_attention_mask"])

    x0 = embeddings(base)
    for r, c in ((0, 0), (1, 4), (2, 3), (1, 5)):
        changed = base.copy()
        changed[8 * r:8 * r + 8, 8 * c:8 * c + 8] += 40
        change = (embeddings(changed) - x0).norm(dim=-1)
        heat = tiled_heatmaps(change, ids, model, tokenizer=tok)[0]
        expect = torch.zeros(24, 48, dtype=torch.bool)
        expect[8 * r:8 * r + 8, 8 * c:8 * c + 8] = True
        assert torch.equal(heat.tiles > 1e-9, expect), (r, c)
        assert int((heat.tile_grid > 1e-9).sum()) == 1

