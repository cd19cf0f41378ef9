r"""DecompX end to end through LLaVA's projector and vision tower (issue 38, item 2; docs/vlm_end_to_end.md).

Every image patch's score, the text tokens' scores and the no-token terms add up to the model's own logit;
the projector's frozen parts equal an explicit per-patch loop; the image tokens' scores are DecompX's at the
language model's input, each the sum of its per-patch row; a left-padded batch equals its single examples;
the model is unchanged; where each image token sees only its own patch, a patch's score is its token's score.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from captum_normattr import DecompXAttribution
from captum_normattr.attr import vlm_end_to_end
from captum_normattr.attr.vlm_end_to_end import patch_contributions, projector_parts, tower_parts
from vlm_end_to_end_models import batch, features_per_image, isolated_llava, make_mixing_llava, own_logit
from vlm_end_to_end_models import terms_scale as _scale
from vlm_end_to_end_models import total as _total
from vlm_models import IMAGE_TOKEN, make_qwen2_vl, qwen2_vl_batch


CASES = [("clip", "default", -2, "llama"), ("clip", "full", -1, "llama"), ("siglip", "default", -2, "llama"),
         ("siglip", "full", -1, "llama"), ("clip", "default", -2, "qwen2")]


@pytest.mark.parametrize("tower,strategy,layer,text", CASES)
def test_patch_scores_complete_against_the_model_logit(tower, strategy, layer, text):
    model = make_mixing_llava(tower, strategy, layer, text)
    ids, mask, px = batch(tower, strategy)
    res = patch_contributions(model, ids, px, attention_mask=mask)
    real = own_logit(model, ids, mask, px, res.target, res.explained_position)
    scale = _scale(res)
    assert (_total(res) - real).abs().max() <= 1e-10 * scale
    assert res.delta.max() <= 1e-10 * scale
    assert res.patch_scores.shape == (2, 4, 4)
    assert max(res.checks.values()) < 1e-12
    names = set(res.no_token)
    assert {"position_embeddings", "tower_biases", "projector_biases", "language_model_biases"} <= names
    assert ("class_embedding" in names) == (tower == "clip")
    assert ("patch_embedding_bias" in names) == (tower == "siglip")
    # the tower mixes: an image token draws on many patches (the LM-input heat map cannot say this)
    patch_part = res.token_sources[..., :16].abs()
    drawn = (patch_part > 1e-3 * patch_part.amax(-1, keepdim=True)).sum(-1)
    assert drawn.min() >= 2 and drawn.double().mean() >= 4


def _naive_projector(projector, parts, bias, features):
    w1, b1, w2, b2 = (projector.linear_1.weight, projector.linear_1.bias, projector.linear_2.weight,
                      projector.linear_2.bias)
    n, f, s, _ = parts.shape
    out = torch.zeros(n, f, s, w2.shape[0], dtype=parts.dtype)
    out_bias = torch.zeros(n, f, w2.shape[0], dtype=parts.dtype)
    const = torch.zeros_like(out_bias)
    for i in range(n):
        for j in range(f):
            u = features[i, j] @ w1.T + b1
            slope = F.gelu(u) / u  # GELU(0) = 0: the frozen ratio act(u) / u per unit
            for k in range(s):
                out[i, j, k] = ((parts[i, j, k] @ w1.T) * slope) @ w2.T
            out_bias[i, j] = ((bias[i, j] @ w1.T) * slope) @ w2.T
            const[i, j] = (b1 * slope) @ w2.T + b2
    return out, out_bias, const


@pytest.mark.parametrize("tower", ["clip", "siglip"])
def test_projector_parts_equal_a_per_patch_loop(tower):
    model = make_mixing_llava(tower)
    _, _, px = batch(tower, "default")
    tp = tower_parts(model, px)
    proj = model.model.multi_modal_projector
    got = projector_parts(proj, tp.parts, tp.bias, tp.features)
    with torch.no_grad():
        want = _naive_projector(proj, tp.parts, tp.bias, tp.features)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-12 * float(b.abs().max().clamp(min=1.0))
    with torch.no_grad():
        real = proj(tp.features)
    assert (got[0].sum(2) + got[1] + got[2] - real).abs().max() <= 1e-12 * float(real.abs().max())
    # and the tower's parts rebuild the features the model's own forward selects
    with torch.no_grad():
        hidden = model.model.vision_tower(px, output_hidden_states=True).hidden_states[-2][:, 1:]
    assert (tp.parts.sum(2) + tp.bias - hidden).abs().max() <= 1e-12 * float(hidden.abs().max())


@pytest.mark.parametrize("tower,strategy", [("clip", "default"), ("siglip", "full")])
def test_language_model_part_is_decompx_at_the_image_tokens(tower, strategy):
    model = make_mixing_llava(tower, strategy)
    ids, mask, px = batch(tower, strategy)
    res = patch_contributions(model, ids, px, attention_mask=mask)
    ref = DecompXAttribution(model).decompose(ids, additional_forward_args={"attention_mask": mask, "pixel_values": px})
    scale = float(ref.scores.abs().max())
    assert (res.image_token_scores + res.text_scores - ref.scores).abs().max() <= 1e-12 * scale
    assert (res.no_token["language_model_biases"] - ref.bias_scores[:, 0]).abs().max() <= 1e-12 * scale
    per_token = res.image_token_scores[ids == IMAGE_TOKEN].view(2, features_per_image(tower, strategy))
    assert (res.token_sources.sum(-1) - per_token).abs().max() <= 1e-12 * scale
    assert res.token_sources.shape[-1] == len(res.source_names)


def test_left_padded_batch_equals_single_examples():
    model = make_mixing_llava("clip")
    ids, mask, px = batch("clip", "default", text_lengths=(2, 6))
    res = patch_contributions(model, ids, px, attention_mask=mask)
    for i in range(2):
        real = mask[i] > 0
        one = patch_contributions(model, ids[i:i + 1, real], px[i:i + 1])
        scale = float(one.patch_scores.abs().max())
        assert (res.patch_scores[i] - one.patch_scores[0]).abs().max() <= 1e-12 * scale
        assert (res.text_scores[i, real] - one.text_scores[0]).abs().max() <= 1e-12 * scale
        assert (res.text_scores[i, ~real] == 0).all()
        for name, v in one.no_token.items():
            assert abs(float(res.no_token[name][i] - v[0])) <= 1e-12 * scale
        assert abs(float(res.logit[i] - one.logit[0])) <= 1e-12 * abs(float(one.logit[0]))


def test_model_unchanged():
    model = make_mixing_llava("siglip")
    ids, mask, px = batch("siglip", "default")
    with torch.no_grad():  # transformers installs its own output-capturing hooks on a first forward
        model(input_ids=ids, attention_mask=mask, pixel_values=px)

    def hooks():
        return [(name, tuple(m._forward_hooks), tuple(m._forward_pre_hooks)) for name, m in model.named_modules()]

    before = {k: v.clone() for k, v in model.state_dict().items()}
    impl = (model.config._attn_implementation, model.model.vision_tower.config._attn_implementation)
    hooked = hooks()
    patch_contributions(model, ids, px, attention_mask=mask)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not model.training
    assert (model.config._attn_implementation, model.model.vision_tower.config._attn_implementation) == impl
    assert hooks() == hooked


@pytest.mark.parametrize("tower", ["clip", "siglip"])
def test_a_patch_seen_by_its_own_token_only_gets_that_token_score(tower):
    model = isolated_llava(tower)
    ids, mask, px = batch(tower, "default")
    res = patch_contributions(model, ids, px, attention_mask=mask)
    tokens = res.image_token_scores[ids == IMAGE_TOKEN].view(2, -1)
    scale = float(tokens.abs().max())
    lead = 0 if tower == "clip" else 1  # SigLIP "default" drops the first patch: no token sees it
    patches = res.patch_scores.flatten(1)
    assert (patches[:, lead:] - tokens).abs().max() <= 1e-12 * scale
    assert (patches[:, :lead] == 0).all()
    src = res.token_sources[..., :16]
    own = torch.zeros_like(src, dtype=torch.bool)
    own[:, torch.arange(tokens.shape[1]), torch.arange(tokens.shape[1]) + lead] = True
    assert (src[~own] == 0).all()
    for name in ("position_embeddings", "projector_biases") + (("class_embedding",) if tower == "clip" else ()):
        assert res.no_token[name].abs().max() <= 1e-12 * scale
    assert scale > 1e-6  # the scores are not trivially zero


def test_refuses_what_it_cannot_carry_to_the_patches(monkeypatch):
    qwen = make_qwen2_vl()
    ids, mask, extra = qwen2_vl_batch([3])
    with pytest.raises(ValueError, match="LLaVA"):
        patch_contributions(qwen, ids, extra["pixel_values"], attention_mask=mask)
    model = make_mixing_llava("clip")
    ids, mask, px = batch("clip", "default")
    monkeypatch.setattr(vlm_end_to_end, "TOWERS", {k: v for k, v in vlm_end_to_end.TOWERS.items()
                                                    if k != "clip_vision_model"})
    with pytest.raises(ValueError, match="not one the package decomposes end to end"):
        patch_contributions(model, ids, px, attention_mask=mask)


def test_inside_inference_mode_gives_the_same_scores():
    model = make_mixing_llava("clip")
    ids, mask, px = batch("clip", "default")
    res = patch_contributions(model, ids, px, attention_mask=mask)
    with torch.inference_mode():
        ids_i, mask_i, px_i = ids.clone(), mask.clone(), px.clone()
        again = patch_contributions(model, ids_i, px_i, attention_mask=mask_i)
    assert torch.equal(res.patch_scores, again.patch_scores)
    assert torch.equal(res.text_scores, again.text_scores)
