r"""LLaVA-NeXT and LLaVA-OneVision (issue 38): the language model over base views, any-resolution tiles and newline
tokens (``docs/vlm.md``, "Any-resolution tiles").

On tiny float64 models (``tests/fixtures/vlm_anyres_models.py``): ALTI-Logit and DecompX token scores plus no-token
terms equal the model's own logit; GlobEnc's, ALTI's and the FF decomposition's parts sum to the model's tensors;
every method's left-padded batch (two images of other shapes, tiles padded as the processor pads them) equals the
single examples; the model is unchanged. The geometry: the token order against the model's own packing (a tower
whose tokens each see their own patch), the processor's placement of the image on the canvas against its own output,
and the pixels of the original image under every token on known-answer inputs (scores equal to the token's index, an
image whose aspect ratio forces unpadding, OneVision's downscaled grid), the newline tokens on no pixel; Captum's
``ImageMaskInput`` route's segments equal to the pixel-overlap sums.
"""
from __future__ import annotations

import math

import pytest
import torch
from map_checks import check_maps_complete
from vlm_anyres_models import (
    ANYRES_IMAGE,
    ANYRES_SIZE,
    PINPOINTS,
    anyres_batch,
    anyres_single,
    make_llava_next,
    make_llava_onevision,
)
from vlm_models import merged_embeddings

from captum_normattr import ALTIAttribution, ALTILogitAttribution, DecompXAttribution, GlobEncAttribution
from captum_normattr.attr.vlm_anyres import AnyresScores, anyres_geometry, anyres_heatmaps, anyres_layout
from captum_normattr.attr.vlm_regions import image_heatmaps, image_scores
from captum_normattr.models.adapters import get_adapter

METHODS = [ALTILogitAttribution, DecompXAttribution, ALTIAttribution, GlobEncAttribution]
MODELS = {"next": (make_llava_next, "LLaVA-NeXT (Llama)"), "next_mistral": (
    lambda **k: make_llava_next(text="mistral", **k), "LLaVA-NeXT (Mistral)"),
          "onevision": (make_llava_onevision, "LLaVA-OneVision (Qwen2)")}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    make, family = MODELS[request.param]
    m = make(seed=1)
    assert get_adapter(m).family == family
    return m


def _real(model, ids, mask, extra):
    r"""The model's own last logits, positions counted over the real tokens (the package's)."""
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
                     **extra).logits[:, -1]


@pytest.mark.parametrize("cls", [ALTILogitAttribution, DecompXAttribution], ids=lambda c: c.__name__)
def test_complete_against_the_models_logit(model, cls):
    ids, mask, extra = anyres_batch(model, [3, 6], seed=2)
    t = torch.tensor([5, 9])
    real = _real(model, ids, mask, extra)[[0, 1], t]
    res = cls(model).decompose(ids, t, {"attention_mask": mask, **extra})
    rest = res.no_token_total if cls is ALTILogitAttribution else res.bias_scores[:, 0]
    assert ((res.scores.sum(-1) + rest - real).abs() / real.abs().max()).max() < 1e-10
    image = ids == ANYRES_IMAGE
    assert res.scores[image].abs().sum() > 0 and (res.scores[mask == 0] == 0).all()
    found = image_scores(res, ids, model, image_sizes=extra["image_sizes"])
    assert isinstance(found, AnyresScores) and len(found.newline) == 2
    assert all(bool(n.abs().sum() > 0) for n in found.newline)  # the newline tokens carry scores of their own


def test_maps_complete(model):
    ids, mask, extra = anyres_batch(model, [2, 4], seed=5)
    check_maps_complete(model, ids, {"attention_mask": mask, **extra})


@pytest.mark.parametrize("cls", METHODS, ids=lambda c: c.__name__)
def test_padded_batch_equals_single_examples(model, cls):
    ids, mask, extra = anyres_batch(model, [5, 2], seed=3)
    t = torch.tensor([6, 9])
    attr = cls(model)

    def run(i, m, e, tt):
        return attr.attribute(i, target=tt if cls.uses_target else None,
                              additional_forward_args={"attention_mask": m, **e})

    batch = run(ids, mask, extra, t)
    for b in range(2):
        keep = mask[b].bool()
        alone = run(ids[b:b + 1, keep], mask[b:b + 1, keep], anyres_single(extra, b), t[b:b + 1])
        assert ((batch[b, keep] - alone[0]).abs().max() / alone.abs().max()) < 1e-10
        assert (batch[b, ~keep] == 0).all()


def test_model_unchanged(model):
    ids, mask, extra = anyres_batch(model, [4, 3], seed=4)
    out = _real(model, ids, mask, extra)

    def hooks():
        return [(n, tuple(m._forward_hooks), tuple(m._forward_pre_hooks)) for n, m in model.named_modules()]

    before, hooked = {k: v.clone() for k, v in model.state_dict().items()}, hooks()
    ALTILogitAttribution(model).attribute(ids, target=torch.tensor([1, 2]),
                                          additional_forward_args={"attention_mask": mask, **extra})
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not model.training and hooks() == hooked
    assert torch.equal(_real(model, ids, mask, extra), out)


# ---- the geometry against the model and the processor ---------------------------------------------------------


def _processor(which: str, **kwargs):
    r"""The family's own (PIL) image processor at the tiny tower's size."""
    import transformers

    if which == "next":
        return transformers.LlavaNextImageProcessorPil(size={"shortest_edge": ANYRES_SIZE}, image_grid_pinpoints=PINPOINTS,
                                                       crop_size={"height": ANYRES_SIZE, "width": ANYRES_SIZE}, **kwargs)
    return transformers.LlavaOnevisionImageProcessorPil(size={"height": ANYRES_SIZE, "width": ANYRES_SIZE},
                                                        image_grid_pinpoints=PINPOINTS, **kwargs)


@pytest.mark.parametrize("which", ["next", "onevision"])
def test_token_order_is_the_models_packing(which):
    r"""A tower whose attention output is zeroed (each patch feature its own patch's alone): changing patch (pr, pc)
    of tile k of a 12 x 20 image (a 2 x 2 tile canvas, big-grid rows 2 to 5 kept) changes exactly the token the
    geometry puts there: base patch (pr, pc) -> token 4 pr + pc; tile k = (tr, tc), cell (4 tr + pr, 4 tc + pc) ->
    token 16 + 9 (row - 2) + col when 2 <= row < 6 (8 cells and a newline per row), none otherwise. OneVision without
    downscaling (anyres_max_9)."""
    model = make_llava_next(seed=5, layers=1) if which == "next" else make_llava_onevision(seed=5, layers=1,
                                                                                           max_patches=9)
    with torch.no_grad():
        for name, module in model.model.vision_tower.named_modules():
            if name.endswith("self_attn.out_proj"):
                module.weight.zero_()
                module.bias.zero_()
    ids, mask, extra = anyres_batch(model, [2], sizes=((12, 20),), seed=6)
    assert int((ids == ANYRES_IMAGE).sum()) == 52

    def embeddings(px):
        return merged_embeddings(model, ids, mask, px, image_sizes=extra["image_sizes"])

    x0 = embeddings(extra["pixel_values"])
    for k, pr, pc in ((0, 0, 0), (0, 3, 1), (1, 0, 2), (1, 2, 3), (2, 1, 0), (3, 1, 3), (4, 0, 0), (4, 3, 3)):
        changed = extra["pixel_values"].clone()
        changed[0, k, :, 2 * pr:2 * pr + 2, 2 * pc:2 * pc + 2] += 1.0
        moved = ((embeddings(changed) - x0).norm(dim=-1)[0] > 1e-9).nonzero().flatten().tolist()
        if k == 0:
            expect = [1 + 4 * pr + pc]
        else:
            row, col = 4 * ((k - 1) // 2) + pr, 4 * ((k - 1) % 2) + pc
            expect = [1 + 16 + 9 * (row - 2) + col] if 2 <= row < 6 else []
        assert moved == expect, (k, pr, pc)


@pytest.mark.parametrize("which", ["next", "onevision"])
@pytest.mark.parametrize("size", [(12, 20), (20, 6), (7, 7), (30, 11)])
def test_canvas_placement_is_the_processors(size, which):
    r"""The processor (nearest resampling, no normalisation) on an image whose pixels hold their own row and column:
    the canvas stitched back from its tiles holds the image exactly on rows [t, t + h') and columns [l, l + w') of
    the geometry, and canvas row t + c holds original row floor((c + 1/2) H / h') (columns likewise): the linear map
    between the original image and the canvas that the geometry carries pixel centres by."""
    np = pytest.importorskip("numpy")
    from PIL import Image

    h, w = size
    pixels = np.zeros((h, w, 3), dtype=np.uint8)
    pixels[..., 0] = np.arange(1, h + 1)[:, None]
    pixels[..., 1] = np.arange(1, w + 1)[None, :]
    proc = _processor(which, resample=0, do_rescale=False, do_normalize=False)
    out = proc(images=Image.fromarray(pixels), return_tensors="pt")
    assert out["image_sizes"].tolist() == [list(size)]
    im = anyres_layout(size, PINPOINTS, ANYRES_SIZE, 2)
    bh, bw = im.canvas
    ty, tx = bh // ANYRES_SIZE, bw // ANYRES_SIZE
    tiles = out["pixel_values"][0, 1:1 + ty * tx].reshape(ty, tx, 3, ANYRES_SIZE, ANYRES_SIZE)
    canvas = tiles.permute(2, 0, 3, 1, 4).reshape(3, bh, bw).round().long()
    (t, l), (rh, rw) = im.offset, im.resized
    held = canvas[0] > 0
    assert held[t:t + rh, l:l + rw].all() and int(held.sum()) == rh * rw
    rows = torch.floor((torch.arange(rh) + 0.5) * h / rh).long() + 1  # the linear map v = t + y h' / H, sampled
    cols = torch.floor((torch.arange(rw) + 0.5) * w / rw).long() + 1
    assert torch.equal(canvas[0, t:t + rh, l], rows) and torch.equal(canvas[1, t, l:l + rw], cols)


def _naive_tokens(y: int, x: int, h: int, w: int, t: float, rh: int, l: float, rw: int, kept, out):
    r"""The tokens over original pixel (y, x), in plain floats: (base token, tile token or None); 2-pixel patches, a
    4 x 4 base grid, ``kept`` = (r0, r1, c0, c1) cells, ``out`` = (o_h, o_w) tile tokens."""
    base = math.floor((y + 0.5) * 4 / h) * 4 + math.floor((x + 0.5) * 4 / w)
    r0, r1, c0, c1 = kept
    i = math.floor(((t + (y + 0.5) * rh / h) / 2 - r0) * out[0] / (r1 - r0))
    j = math.floor(((l + (x + 0.5) * rw / w) / 2 - c0) * out[1] / (c1 - c0))
    inside = 0 <= i < out[0] and 0 <= j < out[1]
    return base, (16 + i * (out[1] + 1) + j) if inside else None


#: hand-worked layouts: (H, W), max_patches -> canvas offset t, l, resized h', w', kept cells, tile tokens, and the
#: original pixels no tile token covers (the unpadding cuts whole cells, a little more than the processor padded)
KNOWN = {
    ((12, 20), None): (3, 0, 10, 16, (2, 6, 0, 8), (4, 8), 40),  # 2 x 2 tiles; rows cut: image rows 0 and 11 uncovered
    ((20, 6), None): (0, 1, 16, 5, (0, 8, 1, 3), (8, 2), 20),  # 2 x 1 tiles; columns cut: image column 0 uncovered
    ((12, 20), 1): (3, 0, 10, 16, (2, 6, 0, 8), (2, 5), 40),  # OneVision: 4 x 8 kept cells downscaled to 2 x 5
}


@pytest.mark.parametrize("size,max_patches", sorted(KNOWN, key=str))
def test_regions_known_answer(size, max_patches):
    r"""Scores equal to each token's sequence index: every original pixel's base and tile values are the indices of
    the tokens :func:`_naive_tokens` puts over it; the newline tokens' indices are on no pixel; the sum view is their
    sum, the tiles' part 0 where no tile token covers the pixel (the rows the unpadding cut)."""
    t, l, rh, rw, kept, out, cut = KNOWN[(size, max_patches)]
    model = make_llava_next(seed=0, layers=1) if max_patches is None else make_llava_onevision(seed=0, layers=1)
    sizes = torch.tensor([size])
    im = anyres_geometry(model, sizes).images[0]
    assert (im.offset, im.resized, im.kept, im.grid) == ((t, l), (rh, rw), kept, out)
    ids, _, _ = anyres_batch(model, [2], sizes=(size,))
    assert int((ids == ANYRES_IMAGE).sum()) == 16 + out[0] * (out[1] + 1)
    scores = torch.arange(ids.shape[1], dtype=torch.float64)[None]
    base, tiles = (anyres_heatmaps(scores, ids, model, sizes, view=v)[0] for v in ("base", "tiles"))
    total = image_heatmaps(scores, ids, model, image_sizes=sizes)[0]
    assert base.shape == tiles.shape == total.shape == size
    h, w = size
    uncovered = 0
    for y in range(h):
        for x in range(w):
            b, tile = _naive_tokens(y, x, h, w, t, rh, l, rw, kept, out)
            assert base[y, x] == 1 + b, (y, x)  # the sequence starts with <s>
            if tile is None:
                uncovered += 1
                assert torch.isnan(tiles[y, x]) and total[y, x] == 1 + b
            else:
                assert tiles[y, x] == 1 + tile and total[y, x] == 2 + b + tile, (y, x)
    newlines = [1 + 16 + i * (out[1] + 1) + out[1] for i in range(out[0])]
    assert not torch.isin(tiles[~torch.isnan(tiles)], torch.tensor(newlines, dtype=torch.float64)).any()
    assert uncovered == cut
    assert im.newline_mask().nonzero().flatten().add(1).tolist() == newlines
    found = image_scores(scores, ids, model, image_sizes=sizes)
    assert found.newline[0].tolist() == newlines and found.tiles[0].shape == out and found.base[0][0, 0] == 1


def test_several_images_untiled_with_batch_num_images():
    r"""OneVision with two images in one prompt (``batch_num_images`` 2): each image is its base view and one newline,
    as the model packs it (its forward takes the 2 x 17 tokens); the newline is on no pixel."""
    model = make_llava_onevision(seed=0, layers=1)
    sizes = torch.tensor([[12, 20], [20, 6]])
    g = anyres_geometry(model, sizes, torch.tensor([2]))
    assert [im.tokens for im in g.images] == [17, 17]
    ids = torch.tensor([[1] + [ANYRES_IMAGE] * 34 + [5]])
    pixels = torch.randn(2, 1, 3, ANYRES_SIZE, ANYRES_SIZE, dtype=torch.float64)
    with torch.no_grad():
        model(input_ids=ids, pixel_values=pixels, image_sizes=sizes, batch_num_images=torch.tensor([2]))
    scores = torch.arange(ids.shape[1], dtype=torch.float64)[None]
    maps = anyres_heatmaps(scores, ids, model, sizes, torch.tensor([2]))
    assert [tuple(m.shape) for m in maps] == [(12, 20), (20, 6)]
    assert maps[0][0, 0] == 1 and maps[1][0, 0] == 18 and not torch.isin(maps[0], torch.tensor([17.0, 34.0])).any()
    with pytest.raises(ValueError, match="image_sizes"):
        anyres_heatmaps(scores, ids, model, sizes)  # tiled, the ids hold too few tokens


# ---- Captum's ImageMaskInput ----------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["next", "onevision"])
def test_image_mask_input_segments_are_pixel_overlap_sums(which):
    r"""Through the family's own (PIL) image processor, a 12 x 20 image and ragged segments: complete against the
    model's own logit on the processor's inputs plus the targets; every segment's score is
    sum_t s_t |pixels of t in the segment| / |pixels of t| over the base and tile tokens (:func:`_naive_tokens`), the
    newline tokens in none; the (n, H, W) pixel shares sum to the segments."""
    np = pytest.importorskip("numpy")
    from captum.attr._utils.interpretable_input import ImageMaskInput
    from PIL import Image
    from vlm_processors import vlm_tokenizer

    from captum_normattr.attr.llm import DecompositionLLMAttribution

    model = make_llava_next(seed=4) if which == "next" else make_llava_onevision(seed=4)
    t0, l0, rh, rw, kept, out, _ = KNOWN[((12, 20), None if which == "next" else 1)]
    proc = _processor(which)
    n_image = 16 + out[0] * (out[1] + 1)
    prompt = torch.tensor([[1] + [ANYRES_IMAGE] * n_image + [5, 6, 7]])

    def fn(im):
        got = proc(images=im, return_tensors="pt")
        return {"input_ids": prompt, "attention_mask": torch.ones_like(prompt),
                "pixel_values": got["pixel_values"].double(), "image_sizes": got["image_sizes"]}

    image = Image.fromarray((np.random.RandomState(8).rand(12, 20, 3) * 255).astype("uint8"))
    mask = torch.randint(0, 4, (12, 20), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    target = torch.tensor([8, 9, 10])
    res = DecompositionLLMAttribution(ALTILogitAttribution(model), vlm_tokenizer({})).attribute(
        ImageMaskInput(image, mask=mask, processor_fn=fn), target=target)
    ex = res.explanation
    inputs = fn(image)
    full = torch.cat([prompt, target[None]], 1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=torch.ones_like(full), position_ids=torch.arange(full.shape[1])[None],
                       pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"]).logits[0]
    p = prompt.shape[1]
    real = logits[torch.arange(p - 1, p + 2), target]
    assert float(((ex.scores.sum(-1) + ex.details.no_token - real).abs() / real.abs().max()).max()) < 1e-10
    # the pixel-overlap sums, pixel by pixel in plain Python
    token_scores = ex.scores[:, 1:1 + n_image]
    pixels_of = {}
    for y in range(12):
        for x in range(20):
            for tok in _naive_tokens(y, x, 12, 20, t0, rh, l0, rw, kept, out):
                if tok is not None:
                    pixels_of.setdefault(tok, []).append((y, x))
    expect = torch.zeros(3, 4, dtype=torch.float64)
    for tok, where in pixels_of.items():
        for y, x in where:
            expect[:, int(mask[y, x])] += token_scores[:, tok] / len(where)
    scale = float(token_scores.abs().max())
    assert torch.allclose(res.token_attr, expect, rtol=1e-12, atol=1e-12 * scale)
    assert res.patch_attr.shape == (3, 12, 20) and ex.box == (0.0, 0.0, 12.0, 20.0)
    assert torch.allclose(res.patch_attr.sum((1, 2)), res.token_attr.sum(-1), rtol=1e-12, atol=1e-12 * scale)
    newline = [16 + i * (out[1] + 1) + out[1] for i in range(out[0])]
    assert (ex.overlap[:, newline] == 0).all() and not set(newline) & set(pixels_of)
    with pytest.raises(ValueError, match="layout"):
        DecompositionLLMAttribution(ALTILogitAttribution(model), vlm_tokenizer({})).attribute(
            ImageMaskInput(image, mask=mask, processor_fn=fn), target=target, layout="stretch")
