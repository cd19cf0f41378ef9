r"""Vision-language families beyond LLaVA and Qwen2-VL (issue 38): Qwen2.5-VL, Idefics3 / SmolVLM, Mistral 3,
Gemma 3, PaliGemma (``docs/vlm.md``; their two-way spans: ``tests/attr/test_vlm_two_way.py``).

For every described family, on a tiny float64 model (``tests/fixtures/vlm_families.py``): ALTI-Logit and DecompX
token scores plus no-token terms equal the model's own logit; all four methods on a left-padded batch equal the
single examples; the model is unchanged. The region mapping of each family's geometry is checked on synthetic
scores whose answer is known and on towers whose image tokens each see their own pixels only.
"""
from __future__ import annotations

import pytest
import torch

from captum_normattr import ALTIAttribution, ALTILogitAttribution, DecompXAttribution, GlobEncAttribution
from captum_normattr.attr.vlm_regions import image_geometry, image_heatmaps, image_scores
from captum_normattr.models.adapters import get_adapter, vision_language
from vlm_checks import check_model_unchanged, check_padded_equals_singles
from vlm_families import CASES, check_merged_grid
from vlm_models import merged_embeddings

METHODS = [ALTILogitAttribution, DecompXAttribution, ALTIAttribution, GlobEncAttribution]
FAMILIES = sorted(CASES)


def _real(model, ids, mask, extra):
    r"""The model's own last logits; positions counted over the real tokens where the family takes the package's
    (a left-padded row's positions start at its first real token), the model's own M-RoPE otherwise."""
    if vision_language(model).positions == "package":
        extra = dict(extra, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **extra).logits[:, -1]


@pytest.fixture(scope="module", params=FAMILIES)
def case(request):
    c = CASES[request.param]
    return c, c.make(seed=1)


@pytest.mark.parametrize("cls", [ALTILogitAttribution, DecompXAttribution], ids=lambda c: c.__name__)
def test_complete_against_the_models_logit(case, cls):
    c, model = case
    assert get_adapter(model).family == c.family
    ids, mask, extra = c.batch([3, 6], seed=2)
    t = torch.tensor([5, 9])
    real = _real(model, ids, mask, extra)[[0, 1], t]
    res = cls(model).decompose(ids, t, {"attention_mask": mask, **extra})
    scale = real.abs().max()
    rest = res.no_token_total if cls is ALTILogitAttribution else res.bias_scores[:, 0]  # no-token terms (decoders: C = 1)
    assert ((res.scores.sum(-1) + rest - real).abs() / scale).max() < 1e-10
    assert res.scores[ids == c.image_token].abs().sum() > 0  # the image tokens carry a share
    assert (res.scores[mask == 0] == 0).all()


@pytest.mark.parametrize("cls", METHODS, ids=lambda c: c.__name__)
def test_padded_batch_equals_single_examples(case, cls):
    c, model = case
    ids, mask, extra = c.batch([5, 2], seed=3)
    batch = check_padded_equals_singles(cls(model), ids, mask, extra, torch.tensor([6, 9]), c.single)
    assert batch[ids == c.image_token].abs().sum() > 0


def test_model_unchanged(case):
    c, model = case
    ids, mask, extra = c.batch([4, 3], seed=4)
    check_model_unchanged(model, lambda: ALTILogitAttribution(model).attribute(
        ids, target=torch.tensor([1, 2]), additional_forward_args={"attention_mask": mask, **extra}),
        lambda: _real(model, ids, mask, extra))


# ---- Qwen2.5-VL: Qwen2-VL's merged grid -----------------------------------------------------------------------


def test_qwen2_5_vl_regions_on_the_merged_grid():
    r"""Scores equal to the token index: merged token k of a (2, 3)-token image lands on pixel block
    (k // 3, k % 3) of 4 x 4 pixels (2-pixel patches, 2 x 2 merges)."""
    c = CASES["qwen2_5_vl"]
    check_merged_grid(c.make(seed=0, layers=1), c.image_token)


def test_qwen2_5_vl_window_attention_keeps_the_image_order():
    r"""The tower's window attention reorders the merged tokens inside the tower only (the merger's outputs are put
    back in the image's order): pixels through Qwen2-VL's image processor (Qwen2.5-VL's) into a tower whose
    attention outputs are zeroed, so that every image token is its own 2 x 2 patches' alone; changing one 4 x 4
    pixel block of a 16 x 16 image (windows of 2 x 2 tokens) changes one token, and the heat map lights that block."""
    np = pytest.importorskip("numpy")
    from transformers import Qwen2VLImageProcessor

    c = CASES["qwen2_5_vl"]
    model = c.make(seed=5, layers=1, vision_depth=1)
    with torch.no_grad():
        for blk in model.model.visual.blocks:
            blk.attn.proj.weight.zero_()
            blk.attn.proj.bias.zero_()
    proc = Qwen2VLImageProcessor(patch_size=2, temporal_patch_size=2, merge_size=2, min_pixels=16, max_pixels=4096,
                                 do_resize=False, do_rescale=False, do_normalize=False)
    side = 16
    ids, mask, _ = c.batch([2], side=side, seed=6)
    image = np.random.RandomState(0).rand(3, side, side)

    def embeddings(img):
        got = proc(images=[img.astype(np.float32)], return_tensors="pt", input_data_format="channels_first")
        return merged_embeddings(model, ids, mask, got["pixel_values"].double(), image_grid_thw=got["image_grid_thw"],
                                 mm_token_type_ids=(ids == c.image_token).long()), got["image_grid_thw"]

    x0, thw = embeddings(image)
    assert thw.tolist() == [[1, 8, 8]]
    for r, col in ((0, 1), (2, 3), (3, 0)):
        changed = image.copy()
        changed[:, 4 * r:4 * r + 4, 4 * col:4 * col + 4] += 1.0
        change = (embeddings(changed)[0] - x0).norm(dim=-1)
        lit = image_heatmaps(change, ids, model, image_grid_thw=thw)[0] > 1e-9
        expect = torch.zeros(side, side, dtype=torch.bool)
        expect[4 * r:4 * r + 4, 4 * col:4 * col + 4] = True
        assert torch.equal(lit, expect), (r, col)


def test_qwen2_5_vl_image_mask_input():
    r"""Captum's ``ImageMaskInput`` through ``DecompositionLLMAttribution``: complete against the model's own logit on
    the processor's inputs plus the targets, segments equal to their whole merged tokens' sums (stretched grid)."""
    pytest.importorskip("PIL")
    from captum.attr._utils.interpretable_input import ImageMaskInput
    from vlm_processors import qwen_image_mask_case, qwen_target_logits, vlm_tokenizer

    from captum_normattr.attr.llm import DecompositionLLMAttribution

    model = CASES["qwen2_5_vl"].make(seed=4)
    image, mask, fn = qwen_image_mask_case()
    target = torch.tensor([8, 9, 10])
    res = DecompositionLLMAttribution(ALTILogitAttribution(model), vlm_tokenizer({})).attribute(
        ImageMaskInput(image, mask=mask, processor_fn=fn), target=target)
    ex = res.explanation
    assert res.patch_attr.shape == (3, 3, 5) and ex.box == (0.0, 0.0, 12.0, 20.0)
    real = qwen_target_logits(model, fn(image), target)
    assert float(((ex.scores.sum(-1) + ex.details.no_token - real).abs() / real.abs().max()).max()) < 1e-10
    assert torch.allclose(res.token_attr[:, 1], res.patch_attr[:, :, 1].sum(-1), rtol=1e-12, atol=1e-14)


# ---- Idefics3 / SmolVLM: pixel shuffle ------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
def test_idefics3_regions_on_the_shuffled_grid(family):
    r"""Scores equal to the token index: token k of the 3 x 3 shuffled grid lands on pixel block (k // 3, k % 3) of
    8 x 8 pixels (4-pixel patches, 2 x 2 shuffled); two sub-images make two grids, in order."""
    from vlm_families import IDEFICS_FAKE, IDEFICS_GLOBAL, idefics3_tokens

    c = CASES[family]
    model = c.make(seed=0, layers=1)
    n = idefics3_tokens()
    g = image_geometry(model)
    assert g.patch == (8, 8) and g.grids == ((3, 3),) and g.tokens(0) == n == 9
    ids = torch.tensor([[1, IDEFICS_FAKE, IDEFICS_GLOBAL] + [c.image_token] * n + [IDEFICS_FAKE, 7]])
    scores = torch.arange(ids.shape[1], dtype=torch.float64)[None]
    heat = image_heatmaps(scores, ids, model)[0]
    assert heat.shape == (24, 24)
    for k in range(n):
        r, col = divmod(k, 3)
        assert (heat[8 * r:8 * r + 8, 8 * col:8 * col + 8] == 3 + k).all()
    two = torch.cat([ids, ids[:, 1:]], 1)
    found = image_scores(torch.arange(two.shape[1], dtype=torch.float64)[None], two, model)
    assert len(found.grids) == 2 and found.grids[1][0, 0] == ids.shape[1] + 2


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
def test_idefics3_heat_map_finds_the_changed_patch(family):
    r"""A tower without layers (each image token sees its own 2 x 2 patches only): changing one 4 x 4 pixel patch
    of one sub-image changes one image token, and that sub-image's heat map lights the patch's 8 x 8 token block.
    Two sub-images per prompt (the split layout: a tile, then the global image, with their text tokens)."""
    from vlm_families import IDEFICS_FAKE, IDEFICS_GLOBAL, idefics3_tokens

    c = CASES[family]
    model = c.make(seed=5, layers=1, vision_layers=0)
    n = idefics3_tokens()
    ids = torch.tensor([[1, IDEFICS_FAKE, 40] + [c.image_token] * n + [41, IDEFICS_FAKE, IDEFICS_GLOBAL]
                        + [c.image_token] * n + [IDEFICS_FAKE, 7]])
    mask = torch.ones_like(ids)
    pixels = torch.randn(1, 2, 3, 24, 24, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def embeddings(px):
        return merged_embeddings(model, ids, mask, px, decoder="text_model")

    x0 = embeddings(pixels)
    for sub, pr, pc in ((0, 0, 0), (1, 3, 4), (0, 5, 1)):
        changed = pixels.clone()
        changed[0, sub, :, 4 * pr:4 * pr + 4, 4 * pc:4 * pc + 4] += 1.0
        change = (embeddings(changed) - x0).norm(dim=-1)
        maps = image_heatmaps(change, ids, model)
        assert len(maps) == 2 and not (maps[1 - sub] > 1e-9).any()
        r, col = pr // 2, pc // 2
        expect = torch.zeros(24, 24, dtype=torch.bool)
        expect[8 * r:8 * r + 8, 8 * col:8 * col + 8] = True
        assert torch.equal(maps[sub] > 1e-9, expect), (sub, pr, pc)


def _image_mask_route(model, fn, image, mask, target, image_token, package_positions):
    r"""Run Captum's ``ImageMaskInput`` through ``DecompositionLLMAttribution`` and the model's own logits of the
    targets on the processor's inputs; returns (result, real logits)."""
    from captum.attr._utils.interpretable_input import ImageMaskInput
    from vlm_processors import vlm_tokenizer

    from captum_normattr.attr.llm import DecompositionLLMAttribution

    def double(im):
        out = dict(fn(im))
        out["pixel_values"] = out["pixel_values"].double()
        return out

    res = DecompositionLLMAttribution(ALTILogitAttribution(model), vlm_tokenizer({})).attribute(
        ImageMaskInput(image, mask=mask, processor_fn=double), target=target)
    inputs = double(image)
    full = torch.cat([inputs["input_ids"], target[None]], 1)
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    for key in ("mm_token_type_ids", "token_type_ids"):  # 1 on the image tokens (the targets are text)
        if key in inputs:
            extra[key] = (full == image_token).long()
    if package_positions:
        extra["position_ids"] = torch.arange(full.shape[1])[None]
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=torch.ones_like(full), **extra).logits[0]
    p = inputs["input_ids"].shape[1]
    return res, logits[torch.arange(p - 1, p - 1 + target.shape[0]), target]


@pytest.mark.parametrize("family,grid", [("idefics3", (3, 3)), ("mistral3", (2, 3))])
def test_image_mask_input_segments_are_their_tokens_sums(family, grid):
    r"""Through the family's own image processor, a 12 x 30 image and segments that are whole token columns of the
    grid stretched over it (Idefics3 without image splitting: squared to 24 x 24, a 3 x 3 grid; Mistral 3: Pixtral's
    processor resizes it whole to 16 x 24, a 2 x 3 grid): complete against the model's own logit, and each segment's
    score the sum of its tokens'."""
    np = pytest.importorskip("numpy")
    from PIL import Image
    import vlm_processors

    c = CASES[family]
    model = c.make(seed=4)
    image = Image.fromarray((np.random.RandomState(8).rand(12, 30, 3) * 255).astype("uint8"))
    mask = torch.zeros(12, 30, dtype=torch.int32)
    mask[:, 10:20] = 1  # exactly token column 1 of the grid stretched over 12 x 30
    mask[:, 20:] = 2
    target = torch.tensor([8, 9, 10])
    fn = getattr(vlm_processors, f"{family}_processor_fn")([5, 6, 7])
    res, real = _image_mask_route(model, fn, image, mask, target, c.image_token, True)
    ex = res.explanation
    assert res.patch_attr.shape == (3, *grid) and ex.box == (0.0, 0.0, 12.0, 30.0)
    assert float(((ex.scores.sum(-1) + ex.details.no_token - real).abs() / real.abs().max()).max()) < 1e-10
    for s in range(3):
        assert torch.allclose(res.token_attr[:, s], res.patch_attr[:, :, s].sum(-1), rtol=1e-12, atol=1e-14)


# ---- Mistral 3: Pixtral tower, patch merger, row breaks -------------------------------------------------------


def test_mistral3_regions_skip_the_row_breaks():
    r"""Scores equal to the token index on a 16 x 24 image (a 2 x 3 merged grid, a break after row 0, an end after
    row 1): token (r, c) lands on pixel block (r, c) of 8 x 8 pixels; the break and end tokens land nowhere."""
    from vlm_families import MISTRAL_BREAK, MISTRAL_END, mistral3_image_ids

    c = CASES["mistral3"]
    model = c.make(seed=0, layers=1)
    ids = torch.cat([torch.tensor([1]), mistral3_image_ids(16, 24), torch.tensor([7])])[None]
    assert ids[0, 1:9].tolist() == [c.image_token] * 3 + [MISTRAL_BREAK] + [c.image_token] * 3 + [MISTRAL_END]
    scores = torch.arange(ids.shape[1], dtype=torch.float64)[None]
    sizes = torch.tensor([[16, 24]])
    g = image_geometry(model, image_sizes=sizes)
    assert g.patch == (8, 8) and g.grids == ((2, 3),)
    heat = image_heatmaps(scores, ids, model, image_sizes=sizes)[0]
    assert heat.shape == (16, 24)
    expect = [[1, 2, 3], [5, 6, 7]]  # index 4 is the break
    for r in range(2):
        for col in range(3):
            assert (heat[8 * r:8 * r + 8, 8 * col:8 * col + 8] == expect[r][col]).all()
    with pytest.raises(ValueError, match="image_sizes"):
        image_geometry(model)


def test_mistral3_heat_map_finds_the_changed_patch():
    r"""A one-layer Pixtral tower whose attention output is zeroed (each image token sees its own 2 x 2 merged
    patches only), two images of different shapes in one prompt: changing one 4 x 4 patch of one image lights that
    image's 8 x 8 token block."""
    from vlm_families import mistral3_image_ids

    c = CASES["mistral3"]
    model = c.make(seed=5, layers=1, vision_layers=1)
    with torch.no_grad():
        for layer in model.model.vision_tower.transformer.layers:
            layer.attention.o_proj.weight.zero_()
    sizes = torch.tensor([[16, 24], [24, 8]])
    ids = torch.cat([torch.tensor([1]), mistral3_image_ids(16, 24), torch.tensor([7]), mistral3_image_ids(24, 8),
                     torch.tensor([9])])[None]
    mask = torch.ones_like(ids)
    pixels = torch.zeros(2, 3, 24, 24, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    for i, (h, w) in enumerate(sizes.tolist()):
        pixels[i, :, :h, :w] = torch.randn(3, h, w, generator=g, dtype=torch.float64)

    def embeddings(px):
        return merged_embeddings(model, ids, mask, px, image_sizes=sizes)

    x0 = embeddings(pixels)
    for img, pr, pc in ((0, 0, 5), (0, 3, 2), (1, 5, 1), (1, 2, 0)):
        changed = pixels.clone()
        changed[img, :, 4 * pr:4 * pr + 4, 4 * pc:4 * pc + 4] += 1.0
        change = (embeddings(changed) - x0).norm(dim=-1)
        maps = image_heatmaps(change, ids, model, image_sizes=sizes)
        assert [tuple(m.shape) for m in maps] == [(16, 24), (24, 8)]
        assert not (maps[1 - img] > 1e-9).any()
        expect = torch.zeros(maps[img].shape, dtype=torch.bool)
        expect[8 * (pr // 2):8 * (pr // 2) + 8, 8 * (pc // 2):8 * (pc // 2) + 8] = True
        assert torch.equal(maps[img] > 1e-9, expect), (img, pr, pc)
        assert (change[ids != c.image_token] < 1e-12).all()  # breaks and text untouched


# ---- Gemma 3: pooled grid (two-way image spans: tests/attr/test_vlm_two_way.py) ---------------------------------------------------


def test_gemma3_regions_on_the_pooled_grid():
    r"""Scores equal to the token index: token k of the 2 x 2 pooled grid lands on pixel block (k // 2, k % 2) of
    8 x 8 pixels (a 4 x 4 patch grid pooled 2 x 2)."""
    from vlm_families import GEMMA_BOI, GEMMA_EOI

    c = CASES["gemma3"]
    model = c.make(seed=0, layers=1)
    g = image_geometry(model)
    assert g.patch == (8, 8) and g.grids == ((2, 2),) and g.tokens(0) == 4
    ids = torch.tensor([[1, GEMMA_BOI] + [c.image_token] * 4 + [GEMMA_EOI, 7]])
    scores = torch.arange(ids.shape[1], dtype=torch.float64)[None]
    heat = image_heatmaps(scores, ids, model)[0]
    assert heat.shape == (16, 16)
    for k in range(4):
        r, col = divmod(k, 2)
        assert (heat[8 * r:8 * r + 8, 8 * col:8 * col + 8] == 2 + k).all()


def test_gemma3_heat_map_finds_the_changed_patch():
    r"""A one-layer SigLIP tower whose attention output is zeroed (each image token sees its own pooled 2 x 2
    patches only): changing one 4 x 4 patch changes one image token, and the heat map lights its 8 x 8 block."""
    c = CASES["gemma3"]
    model = c.make(seed=5, layers=1)
    with torch.no_grad():
        for layer in model.model.vision_tower.encoder.layers:
            layer.self_attn.out_proj.weight.zero_()
            layer.self_attn.out_proj.bias.zero_()
    ids, mask, extra = c.batch([2], seed=6)

    def embeddings(px):
        return merged_embeddings(model, ids, mask, px)

    x0 = embeddings(extra["pixel_values"])
    for pr, pc in ((0, 0), (1, 3), (3, 2)):
        changed = extra["pixel_values"].clone()
        changed[0, :, 4 * pr:4 * pr + 4, 4 * pc:4 * pc + 4] += 1.0
        change = (embeddings(changed) - x0).norm(dim=-1)
        expect = torch.zeros(16, 16, dtype=torch.bool)
        expect[8 * (pr // 2):8 * (pr // 2) + 8, 8 * (pc // 2):8 * (pc // 2) + 8] = True
        assert torch.equal(image_heatmaps(change, ids, model)[0] > 1e-9, expect), (pr, pc)


def test_gemma3_image_mask_input_with_and_without_token_types():
    r"""The ``ImageMaskInput`` route with a ``processor_fn`` that gives ``token_type_ids`` (Gemma 3's processor does)
    is complete against the model's own two-way forward (the targets typed 0, as the model's ``generate`` types
    them); without them, against the causal forward; the two differ (``tests/attr/test_vlm_two_way.py``)."""
    np = pytest.importorskip("numpy")
    from PIL import Image
    from vlm_families import GEMMA_BOI, GEMMA_EOI, GEMMA_SIZE

    c = CASES["gemma3"]
    model = c.make(seed=4)
    image = Image.fromarray((np.random.RandomState(8).rand(GEMMA_SIZE, GEMMA_SIZE, 3) * 255).astype("uint8"))
    ids = torch.tensor([[1, GEMMA_BOI] + [c.image_token] * 4 + [GEMMA_EOI, 5, 6]])

    def fn(types):
        def process(im):
            px = torch.tensor(np.array(im), dtype=torch.float64).permute(2, 0, 1)[None] / 255.0
            out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": px}
            return dict(out, token_type_ids=(ids == c.image_token).long()) if types else out
        return process

    mask = torch.zeros(GEMMA_SIZE, GEMMA_SIZE, dtype=torch.int32)
    mask[:, 8:] = 1
    target = torch.tensor([8, 9])
    reals = []
    for types in (True, False):
        res, real = _image_mask_route(model, fn(types), image, mask, target, c.image_token, True)
        ex = res.explanation
        assert res.patch_attr.shape == (2, 2, 2)
        assert float(((ex.scores.sum(-1) + ex.details.no_token - real).abs() / real.abs().max()).max()) < 1e-10
        assert torch.allclose(res.token_attr[:, 1], res.patch_attr[:, :, 1].sum(-1), rtol=1e-12, atol=1e-14)
        reals.append(real)
    assert float((reals[0] - reals[1]).abs().max() / reals[0].abs().max()) > 1e-3
