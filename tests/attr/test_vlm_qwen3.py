r"""Qwen3-VL and Qwen3-VL-MoE with DeepStack (issue 38; docs/vlm.md, "Qwen3-VL (DeepStack)").

After decoder layer l < n the text model adds the tower's l-th DeepStack feature of every image token to that
token's stream; the package records the additions per layer (``LayerTensors.own_after``, folded into ``layer_out``)
and gives each to its token's own part. On tiny float64 models (``tests/fixtures/vlm_qwen3.py``): ALTI-Logit and
DecompX complete against the model's own logit (at a text and at an image position), the map methods complete
(the FF decomposition's whole layer against the stream after the addition), the recorded additions are the model's
own and the next layer's real input is rebuilt from them, the checks fail without them, padded batches equal single
examples, the model is unchanged, image tokens land on the merged grid, the Captum LLM API's image route, and the
refusals (none left: the routes take DeepStack, tests/attr/test_routes_vlm.py; DecompX's adjoint too,
tests/attr/test_decompx_adjoint_frontier.py). The multimodal Qwen3.5 and Qwen3.5-MoE (hybrid decoders on Qwen2-VL's
route, no DeepStack) get the shared checks: completeness, the map methods, padded == single, the model unchanged.
"""
from __future__ import annotations

import pytest
import torch

import captum_normattr.decompose.kinds.pre_ln as pre_ln
from captum_normattr import (
    ALTIAttribution,
    ALTILogitAttribution,
    DecompXAttribution,
    FFIntegratedDecomposition,
    GlobEncAttribution,
)
from captum_normattr.attr.inputs import prepare_inputs
from captum_normattr.attr.routes import InformationFlowRoutes
from captum_normattr.decompose.kinds.base import LayerKind
from captum_normattr.decompose.kinds.pre_ln import own_after_view, residual_parts
from captum_normattr.decompose.methods.alti import l1_contributions
from captum_normattr.decompose.records import LayerTensors
from captum_normattr.models.adapters import get_adapter
from captum_normattr.models.engine import streamed_forward
from map_checks import check_maps_complete
from vlm_checks import check_model_unchanged
from vlm_families import check_merged_grid, qwen2_5_vl_single
from vlm_models import QWEN_IMAGE, qwen2_vl_batch
from vlm_qwen3 import deepstack_inputs, make_qwen3_5, make_qwen3_vl

METHODS = [ALTILogitAttribution, DecompXAttribution, ALTIAttribution, GlobEncAttribution]
#: model type -> (the adapter's family, builder); the first two have DeepStack
FAMILIES = {"qwen3_vl": ("Qwen3-VL (Qwen3)", lambda: make_qwen3_vl(seed=1)),
            "qwen3_vl_moe": ("Qwen3-VL-MoE (Qwen3-MoE)", lambda: make_qwen3_vl(seed=1, moe=True)),
            "qwen3_5": ("Qwen3.5 (Qwen3.5)", lambda: make_qwen3_5(seed=1)),
            "qwen3_5_moe": ("Qwen3.5-MoE (Qwen3.5-MoE)", lambda: make_qwen3_5(seed=1, moe=True))}
DEEPSTACK = ["qwen3_vl", "qwen3_vl_moe"]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def any_case(request):
    family, make = FAMILIES[request.param]
    return family, make()


@pytest.fixture(scope="module", params=DEEPSTACK)
def case(request):
    family, make = FAMILIES[request.param]
    return family, make()


def _real(model, ids, mask, extra, position=-1):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **extra).logits[:, position]


def _layers(model, ids, mask, extra):
    adapter = get_adapter(model)
    prepared = prepare_inputs(model, adapter, ids, {"attention_mask": mask, **extra})
    layers = []
    with streamed_forward(model, adapter, prepared, layers.append):
        pass
    return layers


@pytest.mark.parametrize("cls", [ALTILogitAttribution, DecompXAttribution], ids=lambda c: c.__name__)
def test_complete_against_the_models_logit(any_case, cls):
    family, model = any_case
    assert get_adapter(model).family == family
    ids, mask, extra = qwen2_vl_batch([3, 6], seed=2)
    t = torch.tensor([5, 9])
    real = _real(model, ids, mask, extra)[[0, 1], t]
    res = cls(model).decompose(ids, t, {"attention_mask": mask, **extra})
    rest = res.no_token_total if cls is ALTILogitAttribution else res.bias_scores[:, 0]
    err = ((res.scores.sum(-1) + rest - real).abs() / real.abs().max()).max()
    assert err < 1e-10, float(err)
    assert res.scores[ids == QWEN_IMAGE].abs().sum() > 0
    assert (res.scores[mask == 0] == 0).all()


@pytest.mark.parametrize("cls", [ALTILogitAttribution, DecompXAttribution], ids=lambda c: c.__name__)
def test_complete_at_an_image_position_and_not_without_the_additions(case, cls, monkeypatch):
    r"""Explained at an image token (where its own additions reach the final norm directly): complete; with the
    additions left out of the own parts (DecompX) or of the explained position's own term (ALTI-Logit), not."""
    _, model = case
    ids, mask, extra = qwen2_vl_batch([4], seed=5)
    pos = int((ids[0] == QWEN_IMAGE).nonzero()[-1])
    t = torch.tensor([7])
    real = _real(model, ids, mask, extra, pos)[:, 7]

    def error():
        res = cls(model, explained_position=pos).decompose(ids, t, {"attention_mask": mask, **extra})
        rest = res.no_token_total if cls is ALTILogitAttribution else res.bias_scores[:, 0]
        return float(((res.scores.sum(-1) + rest - real).abs() / real.abs()).max())

    assert error() < 1e-10
    if cls is DecompXAttribution:  # the own parts (forward) and the own terms (adjoint, "auto") without the additions
        monkeypatch.setattr(pre_ln, "add_own_after", lambda parts, layer, rows=None: parts)
        monkeypatch.setattr(LayerKind, "frozen_layer_own", lambda self, layer, rows=None: None)
    else:  # every layer handed to ALTI-Logit without its additions (its maps' and its own term's)
        import captum_normattr.attr.alti_logit as alti_logit

        monkeypatch.setattr(alti_logit, "tensors_to",
                            lambda obj, dev: _drop_own(obj) if isinstance(obj, LayerTensors) else obj)
    assert error() > 1e-4


def _drop_own(layer):
    import copy

    layer = copy.copy(layer)
    layer.own_after = None
    return layer


def test_the_recorded_additions_are_the_models_own(case):
    r"""Layer l < n records D_l = the model's l-th DeepStack embeddings on the image positions (0 elsewhere); its
    ``layer_out`` is the next layer's real input, bitwise; the ALTI parts with D_l in the own part (own_after_view)
    plus the feed-forward output rebuild that real input; the layers from n on record none."""
    _, model = case
    ids, mask, extra = qwen2_vl_batch([3, 6], seed=3)
    vmask, embeds = deepstack_inputs(model, ids, mask, extra)
    assert torch.equal(vmask, ids == QWEN_IMAGE) and len(embeds) == 2
    layers = _layers(model, ids, mask, extra)
    assert len(layers) == 3
    for l, layer in enumerate(layers):
        if l >= len(embeds):
            assert layer.own_after is None
            continue
        expected = torch.zeros_like(layer.layer_out)
        expected[vmask] = embeds[l]
        assert torch.equal(layer.own_after, expected) and layer.own_after[vmask].abs().min() > 0
        nxt = layers[l + 1].hidden_in
        assert torch.equal(layer.layer_out, nxt)
        rebuilt = residual_parts(own_after_view(layer)).sum(2) + layer.ff_out  # Qwen3 has no b_O
        valid = mask.bool()
        err = ((rebuilt - nxt).abs().amax(-1)[valid]).max() / nxt.abs().max()
        assert err < 1e-12, float(err)
        wrong = ((residual_parts(layer).sum(2) + layer.ff_out - nxt).abs().amax(-1)[valid]).max() / nxt.abs().max()
        assert wrong > 1e-3  # without the additions the parts miss the next layer's input
        assert all(float(v) < 1e-12 for v in layer.checks.values()), layer.checks


def test_alti_map_gives_the_addition_to_the_own_part(case):
    r"""ALTI's map of a layer with additions equals a reference written out from the parts h_{i<-j} with D_i added to
    part i of row i, against h_i + D_i; it differs from the map without them on the image rows only."""
    _, model = case
    ids, mask, extra = qwen2_vl_batch([5], seed=4)
    layer = _layers(model, ids, mask, extra)[0]
    kind = pre_ln.PreLNKind()
    valid = mask.bool()
    with_add = kind.alti_map(layer, valid, 64.0)
    parts = residual_parts(_drop_own(layer))
    t = ids.shape[1]
    parts[:, torch.arange(t), torch.arange(t)] += layer.own_after
    ref = l1_contributions(parts, layer.ln2_in + layer.own_after) * torch.ones(t, t).tril()
    ref = ref / ref.sum(-1, keepdim=True)
    assert (with_add - ref).abs().max() < 1e-12
    without = kind.alti_map(_drop_own(layer), valid, 64.0)[0]
    image = ids[0] == QWEN_IMAGE
    assert torch.allclose(with_add[0, ~image], without[~image], rtol=0, atol=1e-14)
    assert (with_add[0, image] - without[image]).abs().amax(-1).min() > 1e-6


def test_globenc_n_res_holds_the_addition_in_the_own_part(case):
    r"""GlobEnc's ``N_RES`` map (attention + residual) of a layer with additions: the norms of the parts with D_i in
    part i of row i; ``N_RESLN`` (the feed-forward's input, which does not contain D) is the map without them."""
    _, model = case
    ids, mask, extra = qwen2_vl_batch([5], seed=4)
    layer = _layers(model, ids, mask, extra)[0]
    kind, valid, t = pre_ln.PreLNKind(), mask.bool(), ids.shape[1]
    maps, ratios = kind.norm_maps(layer, valid, ("N_RESLN", "N_RES"))
    parts = residual_parts(_drop_own(layer))
    parts[:, torch.arange(t), torch.arange(t)] += layer.own_after
    ref = parts.norm(dim=-1) * torch.ones(t, t).tril()
    assert ((maps["N_RES"] - ref).abs().max() / ref.max()) < 1e-12
    plain, _ = kind.norm_maps(_drop_own(layer), valid, ("N_RESLN", "N_RES"))
    assert torch.equal(maps["N_RESLN"], plain["N_RESLN"]) and set(ratios) == {"N_RESLN", "N_RES"}
    assert (maps["N_RES"] - plain["N_RES"]).abs().max() > 1e-6


def test_map_methods_complete(any_case):
    _, model = any_case
    ids, mask, extra = qwen2_vl_batch([3, 6], seed=6)
    check_maps_complete(model, ids, {"attention_mask": mask, **extra})


def test_ff_decomposition_whole_layer_against_the_stream_after_the_addition(case, monkeypatch):
    r"""The FF decomposition's whole-layer scope (RES2) sums to the recorded layer output, which is the stream after
    the addition (the next layer's real input); without the additions in the own parts it does not."""
    _, model = case
    ids, mask, extra = qwen2_vl_batch([3, 6], seed=6)
    args = {"attention_mask": mask, **extra}
    scale = max(float(layer.layer_out[mask.bool()].abs().max()) for layer in _layers(model, ids, mask, extra))
    res = FFIntegratedDecomposition(model, strict=True).decompose(ids, additional_forward_args=args)
    assert float(res.extras["layer_completeness_error"].max()) < 1e-12 * scale
    monkeypatch.setattr(pre_ln, "add_own_after", lambda parts, layer, rows=None: parts)
    res = FFIntegratedDecomposition(model).decompose(ids, additional_forward_args=args)
    assert float(res.extras["layer_completeness_error"].max()) > 1e-3 * scale


@pytest.mark.parametrize("cls", METHODS, ids=lambda c: c.__name__)
def test_padded_batch_equals_single_examples(any_case, cls):
    _, model = any_case
    ids, mask, extra = qwen2_vl_batch([5, 2], seed=3)
    t = torch.tensor([6, 9])
    attr = cls(model)
    tgt = (lambda x: x) if cls.uses_target else (lambda x: None)
    batch = attr.attribute(ids, target=tgt(t), additional_forward_args={"attention_mask": mask, **extra})
    for b in range(2):
        keep = mask[b].bool()
        alone = attr.attribute(ids[b:b + 1, keep], target=tgt(t[b:b + 1]),
                               additional_forward_args={"attention_mask": mask[b:b + 1, keep],
                                                        **qwen2_5_vl_single(extra, b, keep)})
        assert ((batch[b, keep] - alone[0]).abs().max() / alone.abs().max()) < 1e-10
        assert (batch[b, ~keep] == 0).all()
    assert batch[ids == QWEN_IMAGE].abs().sum() > 0


def test_model_unchanged(any_case):
    _, model = any_case
    ids, mask, extra = qwen2_vl_batch([4, 3], seed=4)

    def run():
        for cls in (ALTILogitAttribution, DecompXAttribution):
            cls(model).attribute(ids, target=torch.tensor([1, 2]),
                                 additional_forward_args={"attention_mask": mask, **extra})

    check_model_unchanged(model, run, lambda: _real(model, ids, mask, extra))


def test_refusals(case):
    _, model = case
    assert InformationFlowRoutes(model).kind.name == "pre_ln"  # routes take DeepStack (tests/attr/test_routes_vlm.py)
    # DecompX's adjoint takes the additions (tests/attr/test_decompx_adjoint_frontier.py): what "auto" runs
    assert DecompXAttribution(model)._algorithm(False) == "adjoint"


def test_regions_on_the_merged_grid():
    r"""Scores equal to the token index: merged token k of a (2, 3)-token image lands on pixel block (k // 3, k % 3)
    of 4 x 4 pixels (2-pixel patches, 2 x 2 merges), as for Qwen2-VL."""
    check_merged_grid(make_qwen3_vl(seed=0, layers=1, deepstack=(0,)), QWEN_IMAGE)


def test_image_mask_input_route_complete():
    r"""The Captum LLM API's ``ImageMaskInput`` through Qwen2-VL's image processor (Qwen3-VL's, with its 2-pixel
    patches): ALTI-Logit and DecompX complete against the model's own logits of the processor's inputs, and the
    segments share out the patch scores."""
    from captum.attr import ImageMaskInput

    from captum_normattr.attr.llm import DecompositionLLMAttribution
    from vlm_processors import qwen_image_mask_case, qwen_target_logits, vlm_tokenizer

    model = make_qwen3_vl(seed=4)
    image, mask, fn = qwen_image_mask_case()
    target = torch.tensor([8, 9, 10])
    real = qwen_target_logits(model, fn(image), target)
    for cls in (ALTILogitAttribution, DecompXAttribution):
        res = DecompositionLLMAttribution(cls(model), vlm_tokenizer({})).attribute(
            ImageMaskInput(image, mask=mask, processor_fn=fn), target=target)
        ex = res.explanation
        assert ex.box == (0.0, 0.0, 12.0, 20.0) and res.patch_attr.shape == (3, 3, 5)
        err = ((ex.scores.sum(-1) + ex.details.no_token - real).abs() / real.abs().max()).max()
        assert err < 1e-10, (cls.__name__, float(err))
        assert torch.allclose(res.token_attr.sum(-1), ex.image_total, rtol=1e-12, atol=1e-14)
