r"""Captum's ``ImageMaskInput`` through :class:`DecompositionLLMAttribution` (vision-language models).

One decomposition pass explains every target token; the image tokens' scores lie on the tower's patch grid and a
segment's score is the patch scores weighted by pixel overlap. Checked: the overlap arithmetic on synthetic grids
and masks whose answer is known, segment scores against an independent pixel heat map, completeness against the
model's own logit (processor outputs + targets through the model's forward), the number of forward passes
(independent of the segments), Captum's own ``LLMAttribution(FeatureAblation)`` result's shape and fields, and
the plots.
"""
import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest
import torch
from captum.attr import FeatureAblation, LLMAttribution, LLMAttributionResult
from captum.attr._utils.interpretable_input import ImageMaskInput
from PIL import Image

from captum_normattr import ALTIAttribution, ALTILogitAttribution, DecompXAttribution
from captum_normattr.attr.llm import DecompositionLLMAttribution
from captum_normattr.attr.llm_images import (
    grid_box,
    pixel_patches,
    segment_overlap,
    segment_scores,
)
from captum_normattr.attr.vlm_regions import image_heatmaps
from decoder_models import make_decoder
from llm_tiny import tiny_tokenizer
from vlm_models import IMAGE_TOKEN, make_llava, make_qwen2_vl
from vlm_processors import llava_processor, qwen2_vl_processor_fn, vlm_tokenizer

PROMPT = "<image> w3 w4 w5"


def _image(h, w, seed=0):
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


def _double(fn):
    def process(image):
        out = dict(fn(image))
        out["pixel_values"] = out["pixel_values"].double()
        return out
    return process


@pytest.fixture(scope="module")
def llava():
    return make_llava(seed=3)


@pytest.fixture(scope="module")
def proc():
    return llava_processor()


def _llava_input(proc, image, mask=None, mask_list=None):
    return ImageMaskInput(image, mask=mask, mask_list=mask_list,
                          processor_fn=_double(lambda im: proc(images=im, text=PROMPT, return_tensors="pt")))


def _real_logits(model, inputs, target):
    ids = torch.cat([inputs["input_ids"], target[None]], 1)
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    if "mm_token_type_ids" in inputs:
        extra["mm_token_type_ids"] = (ids == inputs["mm_token_type_ids"].new_tensor(60)).long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits[0]
    p = inputs["input_ids"].shape[1]
    return logits[torch.arange(p - 1, p - 1 + target.shape[0]), target]


# --- the overlap arithmetic ------------------------------------------------------------------------------------
def test_grid_box_layouts():
    assert grid_box((20, 30), "stretch") == (0.0, 0.0, 20.0, 20.0 + 10.0)
    assert grid_box((20, 30), "center_crop") == (0.0, 5.0, 20.0, 20.0)
    assert grid_box((30, 20), "center_crop") == (5.0, 0.0, 20.0, 20.0)
    assert grid_box((4, 4), (1, 1, 2, 2)) == (1.0, 1.0, 2.0, 2.0)
    with pytest.raises(ValueError, match="layout"):
        grid_box((4, 4), "crop")
    with pytest.raises(ValueError, match="positive"):
        grid_box((4, 4), (0, 0, 0, 2))


def test_pixel_patches_stretch_and_crop():
    got = pixel_patches((4, 6), (2, 3), grid_box((4, 6), "stretch"))
    assert torch.equal(got, torch.tensor([[0, 0, 1, 1, 2, 2]] * 2 + [[3, 3, 4, 4, 5, 5]] * 2))
    got = pixel_patches((4, 6), (2, 2), grid_box((4, 6), "center_crop"))  # the central 4 x 4 in 2 x 2 patches
    assert torch.equal(got, torch.tensor([[-1, 0, 0, 1, 1, -1]] * 2 + [[-1, 2, 2, 3, 3, -1]] * 2))


def test_segment_overlap_known_answer():
    pp = pixel_patches((4, 4), (2, 2), (0, 0, 4, 4))  # four 2 x 2 patches
    left = torch.zeros(4, 4, dtype=torch.bool)
    left[:, :2] = True
    one_pixel = torch.zeros(4, 4, dtype=torch.bool)
    one_pixel[0, 3] = True
    middle = torch.zeros(4, 4, dtype=torch.bool)
    middle[:, 1:3] = True  # half of every patch
    ov = segment_overlap([left, one_pixel, middle], pp, 4)
    assert torch.equal(ov, torch.tensor([[1.0, 0, 1, 0], [0, 0.25, 0, 0], [0.5, 0.5, 0.5, 0.5]], dtype=torch.float64))
    patches = torch.tensor([[[1.0, 2.0], [3.0, float("nan")]]], dtype=torch.float64)  # NaN: a dropped patch
    assert torch.equal(segment_scores(patches, ov), torch.tensor([[4.0, 0.5, 3.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="shape"):
        segment_overlap([torch.ones(3, 4, dtype=torch.bool)], pp, 4)


# --- LLaVA through its own processor ---------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [ALTILogitAttribution, DecompXAttribution])
def test_llava_complete_and_segments_from_patches(llava, proc, cls):
    image = _image(16, 24, seed=1)  # the CLIP processor keeps the central 16 x 16 (columns 4 to 19)
    mask = torch.zeros(16, 24, dtype=torch.int32)
    mask[:, 12:] = 1  # left and right halves
    mask[8:, :] += 2  # and top / bottom: four quadrants
    inp = _llava_input(proc, image, mask)
    llm = DecompositionLLMAttribution(cls(llava), proc.tokenizer)
    target = torch.tensor([7, 8, 9])
    res = llm.attribute(inp, target=target)
    ex = res.explanation
    assert ex.box == (0.0, 4.0, 16.0, 16.0)
    # completeness against the model's own logit
    real = _real_logits(llava, inp.to_model_input(), target)
    total = ex.scores.sum(-1) + ex.details.no_token
    assert float(((total - real).abs() / real.abs().max()).max()) < 1e-10
    # the quadrants partition the image: the segments share out the image tokens' scores exactly
    assert torch.allclose(res.token_attr.sum(-1), ex.image_total, rtol=1e-12, atol=1e-12 * float(ex.image_total.abs().max()))
    # each quadrant is 2 x 2 whole patches of the 4 x 4 grid
    p = res.patch_attr
    expect = torch.stack([p[:, :2, :2].sum((1, 2)), p[:, :2, 2:].sum((1, 2)), p[:, 2:, :2].sum((1, 2)),
                          p[:, 2:, 2:].sum((1, 2))], -1)
    assert torch.allclose(res.token_attr, expect, rtol=1e-12, atol=1e-14)
    assert torch.allclose(res.seq_attr, res.token_attr.sum(0))


def test_llava_segments_equal_the_pixel_heat_map(llava, proc):
    r"""Segments not aligned with the patches: every pixel of the crop carries its patch's score / 16 (its share of
    the patch), so a segment's score is the sum of the heat map over its pixels / 16 (independent route)."""
    image = _image(16, 24, seed=2)
    g = torch.Generator().manual_seed(0)
    mask = torch.randint(0, 5, (16, 24), generator=g, dtype=torch.int32)  # ragged segments
    inp = _llava_input(proc, image, mask)
    res = DecompositionLLMAttribution(ALTILogitAttribution(llava), proc.tokenizer).attribute(inp, target="w6 w7")
    ex = res.explanation
    heat = image_heatmaps(ex.scores[None], ex.input_ids[None], llava)[0]  # (n, 16, 16) over the crop
    full = torch.zeros(heat.shape[0], 16, 24, dtype=heat.dtype)
    full[:, :, 4:20] = heat
    expect = torch.stack([full[:, mask == s].sum(-1) / 16 for s in range(5)], -1)
    assert torch.allclose(res.token_attr, expect, rtol=1e-12, atol=1e-14)


def test_mask_list_and_layouts(llava, proc):
    image = _image(16, 24, seed=3)
    whole = torch.ones(16, 24, dtype=torch.bool)
    border = torch.zeros(16, 24, dtype=torch.bool)
    border[:, :4] = True  # outside the centre crop: no patch
    inp = _llava_input(proc, image, mask_list=[whole, border])
    llm = DecompositionLLMAttribution(ALTILogitAttribution(llava), proc.tokenizer)
    res = llm.attribute(inp, target="w6")
    ex = res.explanation
    assert torch.allclose(res.token_attr[:, 0], ex.image_total) and float(res.token_attr[:, 1].abs().max()) == 0.0
    stretched = llm.attribute(inp, target="w6", layout="stretch").explanation
    assert stretched.box == (0.0, 0.0, 16.0, 24.0) and float(stretched.segment_attr[:, 1].abs().max()) > 0


def test_one_pass_whatever_the_segments(llava, proc):
    r"""The forward passes of one call do not grow with the segments (FeatureAblation: one per segment)."""
    image = _image(16, 16, seed=4)
    llm = DecompositionLLMAttribution(ALTILogitAttribution(llava), proc.tokenizer)
    counts = []
    for k in (1, 4, 16):
        mask = (torch.arange(16)[:, None] * 16 + torch.arange(16)[None]) % k
        inp = _llava_input(proc, image, mask.int())
        calls = []
        handle = llava.model.language_model.register_forward_pre_hook(lambda *a: calls.append(1))
        try:
            res = llm.attribute(inp, target="w6 w7 w8")
        finally:
            handle.remove()
        assert res.token_attr.shape == (3, k)
        counts.append(len(calls))
    assert counts[0] == counts[1] == counts[2] and counts[0] <= 2, counts


def test_same_result_fields_as_captums_feature_ablation(llava, proc):
    image = _image(16, 16, seed=5)
    mask = torch.zeros(16, 16, dtype=torch.int32)
    mask[:, 8:] = 3  # ids 0 and 3: Captum names them image_feature_0 / image_feature_3
    inp = _llava_input(proc, image, mask)
    target = "w6 w7"
    ours = DecompositionLLMAttribution(ALTILogitAttribution(llava), proc.tokenizer).attribute(inp, target=target)
    theirs = LLMAttribution(FeatureAblation(llava), proc.tokenizer).attribute(inp, target=target)
    assert type(ours) is type(theirs) is LLMAttributionResult
    assert ours.input_tokens == theirs.input_tokens == ["image_feature_0", "image_feature_3"]
    assert ours.output_tokens == theirs.output_tokens
    assert ours.seq_attr.shape == theirs.seq_attr.shape and ours.token_attr.shape == theirs.token_attr.shape
    assert ours.inp is inp and theirs.inp is inp
    assert ours.output_probs is not None and ours.output_probs.shape == (2,)


def test_plots_run(llava, proc):
    import matplotlib.pyplot as plt

    image = _image(16, 20, seed=6)
    mask = torch.zeros(16, 20, dtype=torch.int32)
    mask[8:, :] = 1
    inp = _llava_input(proc, image, mask)
    res = DecompositionLLMAttribution(ALTILogitAttribution(llava), proc.tokenizer).attribute(inp, target="w6 w7")
    for fig, _ in (res.plot_image_heatmap(), res.plot_image_heatmap(target_token_pos=1), res.plot_token_attr(),
                   res.plot_seq_attr()):
        assert fig is not None
    plt.close("all")


def test_rollout_method_rows(llava, proc):
    r"""ALTI's rows are class-agnostic and unsigned: the segments still partition the image tokens' share."""
    inp = _llava_input(proc, _image(16, 16, seed=7), torch.zeros(16, 16, dtype=torch.int32))
    res = DecompositionLLMAttribution(ALTIAttribution(llava), proc.tokenizer).attribute(inp, target="w6")
    assert torch.allclose(res.token_attr[:, 0], res.explanation.image_total)


# --- Qwen2-VL: merged grid, M-RoPE, stretched resize ------------------------------------------------------------
def test_qwen2_vl_complete_and_stretched():
    model = make_qwen2_vl(seed=4)
    image = _image(12, 20, seed=8)  # resized to 12 x 20: a 6 x 10 patch grid, 3 x 5 merged tokens over the image
    mask = torch.zeros(12, 20, dtype=torch.int32)
    mask[:, 4:8] = 1  # exactly merged-token column 1
    mask[:, 8:] = 2
    fn = _double(qwen2_vl_processor_fn([5, 6, 7]))
    inp = ImageMaskInput(image, mask=mask, processor_fn=fn)
    target = torch.tensor([8, 9, 10])
    res = DecompositionLLMAttribution(ALTILogitAttribution(model), vlm_tokenizer({})).attribute(inp, target=target)
    ex = res.explanation
    assert ex.box == (0.0, 0.0, 12.0, 20.0) and res.patch_attr.shape == (3, 3, 5)
    real = _real_logits(model, fn(image), target)
    total = ex.scores.sum(-1) + ex.details.no_token
    assert float(((total - real).abs() / real.abs().max()).max()) < 1e-10
    assert torch.allclose(res.token_attr[:, 1], res.patch_attr[:, :, 1].sum(-1), rtol=1e-12, atol=1e-14)
    assert torch.allclose(res.token_attr.sum(-1), ex.image_total, rtol=1e-12, atol=1e-14)


# --- refusals -------------------------------------------------------------------------------------------------
def test_refusals(llava, proc):
    image = _image(16, 16)
    llm = DecompositionLLMAttribution(ALTILogitAttribution(llava), proc.tokenizer)
    with pytest.raises(TypeError, match="processor_fn must return the model's inputs"):
        llm.attribute(ImageMaskInput(image), target="w6")
    no_image = ImageMaskInput(image, processor_fn=lambda im: {"input_ids": torch.tensor([[1, 5, 6]])})
    with pytest.raises(ValueError, match="no image token"):
        llm.attribute(no_image, target="w6")
    with pytest.raises(ValueError, match="not additive"):
        llm.attribute(_llava_input(proc, image), target="w6", quantity="log_prob")
    text = DecompositionLLMAttribution(ALTILogitAttribution(make_decoder("llama", layers=1)), tiny_tokenizer())
    ids = ImageMaskInput(image, processor_fn=lambda im: {"input_ids": torch.tensor([[1, 5, IMAGE_TOKEN % 50]])})
    with pytest.raises(ValueError, match="vision-language model"):
        text.attribute(ids, target=torch.tensor([4]))
    with pytest.warns(UserWarning, match="num_trials"):
        llm.attribute(_llava_input(proc, image), target="w6", num_trials=2)


def test_generate_first_then_explain(llava, proc):
    r"""``target=None``: the model generates from the processor's inputs (gen_args), then the tokens are explained;
    the rows equal the teacher-forced call on the generated tokens."""
    inp = _llava_input(proc, _image(16, 16, seed=9), torch.zeros(16, 16, dtype=torch.int32))
    llm = DecompositionLLMAttribution(ALTILogitAttribution(llava), proc.tokenizer)
    gen = llm.attribute(inp, gen_args={"max_new_tokens": 3, "do_sample": False})
    ids = gen.explanation.target_ids
    assert ids.shape == (3,)
    forced = llm.attribute(inp, target=ids)
    assert torch.allclose(gen.token_attr, forced.token_attr, rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="gen_args"):
        llm.attribute(inp, target="w6", gen_args={"max_new_tokens": 2})
