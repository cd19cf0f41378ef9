r"""DecompX end to end through Qwen2-VL's and Qwen2.5-VL's vision tower and patch merger (docs/vlm_end_to_end.md).

Every patch's score, the text tokens' scores and the no-token terms add up to the model's own logit, with several
images of different grids per example and Qwen2.5-VL's windowed patch order; each image token's per-patch row sums
to its DecompX score at the language model's input; a left-padded batch equals its single examples; the model is
unchanged; where the tower's attention outputs are zeroed each image token's score comes from its own 2 x 2 patches
only (the window order undone exactly); without blocks a per-patch loop through the merger gives the same scores;
a tower norm that computes in float32 and what is not Qwen2-VL are refused.
"""
from __future__ import annotations

import pytest
import torch

from captum_normattr import DecompXAttribution, UnsupportedModelError
from captum_normattr.attr import vlm_end_to_end_qwen
from captum_normattr.attr.vlm_end_to_end_qwen import merged_patch_contributions, patch_cells
from vlm_end_to_end_models import make_mixing_llava
from vlm_end_to_end_qwen_models import KINDS, make_qwen, own_logit, qwen_batch
from vlm_models import QWEN_IMAGE, QWEN_START

# two examples: one image of 4 x 8 patches (Qwen2.5-VL: two windows, the patches reordered) and a text; two images
# (8 x 8: four windows; 4 x 4) and a longer text
ROWS = [(3, [(4, 8)]), (5, [(8, 8), (4, 4)])]


def _run(model, ids, mask, extra, **kw):
    return merged_patch_contributions(model, ids, extra["pixel_values"], extra["image_grid_thw"], attention_mask=mask,
                                      mm_token_type_ids=extra["mm_token_type_ids"], **kw)


def _explained(kind: str):
    r"""(the model, the ROWS batch, its end-to-end result)."""
    model = make_qwen(kind)
    inputs = qwen_batch(ROWS)
    return model, inputs, _run(model, *inputs)


def _total(res) -> torch.Tensor:
    b = res.logit.shape[0]
    patches = torch.zeros(b, dtype=res.logit.dtype)
    for ex, p in zip(res.image_example.tolist(), res.patch_scores):
        patches[ex] += p.sum()
    return patches + res.text_scores.sum(1) + sum(res.no_token.values())


def _scale(res) -> float:
    terms = [p.abs().sum() for p in res.patch_scores] + [res.text_scores.abs().sum()]
    return float(max(1.0, *terms, *[v.abs().sum() for v in res.no_token.values()]))


def _single(ids, mask, extra, b: int):
    r"""Example b's own ids, mask and inputs (its images' patches) from a :func:`qwen_batch` batch."""
    sizes = extra["image_grid_thw"].prod(-1).tolist()
    counts = [int(((ids[r] == QWEN_START) & (mask[r] > 0)).sum()) for r in range(ids.shape[0])]  # images per row
    first = sum(counts[:b])
    start = sum(sizes[:first])
    stop = start + sum(sizes[first:first + counts[b]])
    keep = mask[b] > 0
    one = {"pixel_values": extra["pixel_values"][start:stop],
           "image_grid_thw": extra["image_grid_thw"][first:first + counts[b]], "mm_token_type_ids": extra["mm_token_type_ids"][b:b + 1, keep]}
    return ids[b:b + 1, keep], mask[b:b + 1, keep], one


@pytest.mark.parametrize("kind", KINDS)
def test_patch_scores_complete_against_the_model_logit(kind):
    model, (ids, mask, extra), res = _explained(kind)
    scale = _scale(res)
    position = res.explained_position
    own = own_logit(model, ids, mask, extra, res.target, position)
    assert (res.logit - own).abs().max() <= 1e-10 * scale
    assert (_total(res) - own).abs().max() <= 1e-10 * scale
    assert res.delta.max() <= 1e-10 * scale
    assert max(res.checks.values()) <= 1e-12
    assert [tuple(p.shape) for p in res.patch_scores] == [(1, 4, 8), (1, 8, 8), (1, 4, 4)]
    assert res.image_example.tolist() == [0, 1, 1]
    # the tower's attention mixes the patches: an image token draws on patches outside its own 2 x 2 block
    src = res.token_sources[0][:, :-2].abs()
    own_block = torch.zeros_like(src, dtype=torch.bool)
    own_block[torch.arange(src.shape[0]).repeat_interleave(4), torch.arange(src.shape[1])] = True
    assert src[~own_block].max() > 1e-4 * src.max()
    if kind == "qwen2_5_vl":
        order = vlm_end_to_end_qwen._tower_order(model.model.visual, extra["image_grid_thw"], 32 + 64 + 16)
        assert not torch.equal(order, torch.arange(order.shape[0]))  # the windows really reorder the patches


@pytest.mark.parametrize("kind", KINDS)
def test_image_token_rows_sum_to_decompx_scores(kind):
    model, (ids, mask, extra), res = _explained(kind)
    dx = DecompXAttribution(model).decompose(ids, target=res.target, additional_forward_args={"attention_mask": mask,
                                                                                               **extra})
    scale = float(dx.scores.abs().sum(-1).max().clamp(min=1.0))
    assert (res.image_token_scores + res.text_scores - dx.scores).abs().max() <= 1e-12 * scale
    image = res.image_token_scores != 0
    rows = torch.cat([s.sum(1) for s in res.token_sources])
    assert (rows - res.image_token_scores[image]).abs().max() <= 1e-12 * scale
    assert (res.no_token["language_model_biases"] - dx.bias_scores[:, 0]).abs().max() <= 1e-12 * scale


@pytest.mark.parametrize("kind", KINDS)
def test_left_padded_batch_equals_single_examples(kind):
    model, (ids, mask, extra), res = _explained(kind)
    scale = _scale(res)
    image = 0
    for b in range(ids.shape[0]):
        one = _run(model, *_single(ids, mask, extra, b))
        assert (one.logit[0] - res.logit[b]).abs() <= 1e-10 * scale
        for p in one.patch_scores:
            assert (p - res.patch_scores[image]).abs().max() <= 1e-10 * scale
            image += 1
        for name, v in one.no_token.items():
            assert (v[0] - res.no_token[name][b]).abs() <= 1e-10 * scale
    assert image == len(res.patch_scores)


@pytest.mark.parametrize("kind", KINDS)
def test_model_unchanged(kind):
    model = make_qwen(kind)
    ids, mask, extra = qwen_batch(ROWS[:1])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    impl = (model.config._attn_implementation, model.model.visual.config._attn_implementation)
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask, **extra).logits
    _run(model, ids, mask, extra)
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask, **extra).logits
    assert torch.equal(before, after)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert (model.config._attn_implementation, model.model.visual.config._attn_implementation) == impl
    assert not model.training
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("kind", KINDS)
def test_without_attention_mixing_a_token_draws_on_its_own_patches_only(kind):
    # the tower's attention outputs zeroed: every block acts on each patch alone, so image token j's score comes
    # from the 2 x 2 patches merged into it and from nothing else; with Qwen2.5-VL's windows reordering the patches
    # this holds only if the order is undone exactly
    model = make_qwen(kind)
    with torch.no_grad():
        for blk in model.model.visual.blocks:
            blk.attn.proj.weight.zero_()
    ids, mask, extra = qwen_batch(ROWS)
    res = _run(model, ids, mask, extra)
    scale = _scale(res)
    assert (_total(res) - res.logit).abs().max() <= 1e-10 * scale
    for src in res.token_sources:
        patches = src[:, :-2]
        own_block = torch.zeros_like(patches, dtype=torch.bool)
        own_block[torch.arange(patches.shape[0]).repeat_interleave(4), torch.arange(patches.shape[1])] = True
        assert patches[~own_block].abs().max() <= 1e-14 * scale
        assert patches[own_block].abs().min() > 0
    # and a patch's place on the grid: patch_cells puts the 2 x 2 block of token j at rows 2 (j // w), cols 2 (j % w)
    grid = res.patch_scores[0][0]  # (4, 8): 2 x 4 tokens
    blocks = grid.view(2, 2, 4, 2).permute(0, 2, 1, 3).reshape(8, 4)
    own = res.token_sources[0][:, :-2].view(8, 8, 4)[torch.arange(8), torch.arange(8)]  # token j, its patches 4j..4j+3
    assert (blocks - own).abs().max() <= 1e-14 * scale


@pytest.mark.parametrize("kind", KINDS)
def test_a_tower_without_blocks_equals_a_per_patch_loop_through_the_merger(kind):
    # known answer: token j = W2 g(W1 concat_q LN(P_q) + b1) + b2 of its four patch embeddings P_q; with the norm at
    # each patch's real scale and g at its real slope s, patch q's score is g_j . W2 (s * W1 [0 .. LN_lin(P_q) .. 0])
    model = make_qwen(kind, vision_depth=0)
    ids, mask, extra = qwen_batch(ROWS[:1])
    res = _run(model, ids, mask, extra)
    cot = DecompXAttribution(model).input_cotangents(ids, res.target, {"attention_mask": mask, **extra})
    g = cot.cotangent[ids == QWEN_IMAGE]
    tower = model.model.visual
    p = tower.patch_embed(extra["pixel_values"])  # (32, D)
    ln, (lin1, act, lin2) = tower.merger.ln_q, tower.merger.mlp
    d = p.shape[-1]
    if isinstance(ln, torch.nn.LayerNorm):
        sigma = (p.var(-1, unbiased=False, keepdim=True) + ln.eps).sqrt()
        lin = lambda v, i: (v - v.mean()) / sigma[i] * ln.weight  # noqa: E731
    else:
        sigma = (p.pow(2).mean(-1, keepdim=True) + ln.eps).sqrt()
        lin = lambda v, i: v / sigma[i] * ln.weight  # noqa: E731
    u = lin1(ln(p).view(-1, 4 * d))
    slope = (act(u) - act(torch.zeros_like(u))) / u
    expected = torch.zeros(g.shape[0], p.shape[0], dtype=p.dtype)
    for q in range(p.shape[0]):
        j, slot = divmod(q, 4)
        z = torch.zeros(4 * d, dtype=p.dtype)
        z[slot * d:(slot + 1) * d] = lin(p[q], q)
        expected[j, q] = g[j] @ lin2.weight @ (slope[j] * (lin1.weight @ z))
    scale = _scale(res)
    assert (res.token_sources[0][:, :-2] - expected).abs().max() <= 1e-12 * scale
    assert expected.abs().max() > 1e-6


def test_patch_cells_are_block_major():
    tt, rr, cc = patch_cells(torch.tensor([[1, 2, 4]]), 2)[0]
    assert rr.tolist() == [0, 0, 1, 1, 0, 0, 1, 1] and cc.tolist() == [0, 1, 0, 1, 2, 3, 2, 3]
    assert tt.tolist() == [0] * 8
    with pytest.raises(ValueError, match="2 x 2 blocks"):
        patch_cells(torch.tensor([[1, 3, 4]]), 2)


def test_refusals():
    # a tower RMSNorm that computes in float32 inside a float64 model: the rebuilt tokens differ from the model's
    model = make_qwen("qwen2_5_vl", exact_tower_norms=False)
    ids, mask, extra = qwen_batch(ROWS[:1])
    with pytest.raises(ValueError, match="differ from the model's"):
        _run(model, ids, mask, extra)
    llava = make_mixing_llava("clip")
    with pytest.raises(UnsupportedModelError, match="Qwen2-VL"):
        merged_patch_contributions(llava, ids, extra["pixel_values"], extra["image_grid_thw"])


@pytest.mark.parametrize("kind", KINDS)
def test_float32_model_with_transformers_own_norms_completes_to_its_rounding(kind):
    model = make_qwen(kind, exact_tower_norms=False).float()
    ids, mask, extra = qwen_batch(ROWS)
    extra["pixel_values"] = extra["pixel_values"].float()
    res = _run(model, ids, mask, extra)
    assert res.patch_scores[0].dtype == torch.float32
    assert res.delta.max() <= 1e-5 * _scale(res)
    assert max(res.checks.values()) <= 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_eager_attention_gives_the_same_decomposition(kind):
    # the tower's eager attention runs (inside the package's recording) with a float64 softmax per segment: the
    # rebuilt probabilities are the same; the model's own eager softmax is float32, so its logit differs by ~1e-8
    model = make_qwen(kind)
    ids, mask, extra = qwen_batch(ROWS[1:])
    sdpa = _run(model, ids, mask, extra)
    model.set_attn_implementation("eager")
    assert model.model.visual.config._attn_implementation == "eager"
    res = _run(model, ids, mask, extra)
    scale = _scale(res)
    assert max(res.checks.values()) <= 1e-12 and res.delta.max() <= 1e-10 * scale
    for a, b in zip(res.patch_scores, sdpa.patch_scores):
        assert (a - b).abs().max() <= 1e-10 * scale
    own = own_logit(model, ids, mask, extra, res.target, res.explained_position)
    assert (res.logit - own).abs().max() <= 1e-6 * scale
