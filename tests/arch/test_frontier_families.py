r"""The frontier families (2025-2026 decoders, ``captum_normattr.arch.families.frontier``): registered ones exact,
the others refused naming the mechanism.

Every registered frontier family, on its tiny float64 model with perturbed weights
(tests/fixtures/zoo_frontier.py), for every method its layer kind decomposes: the token scores plus the
no-token terms equal the model's own output logit from a plain forward pass (relative 1e-10; the pre-cap
logit where a final soft-cap applies), a left-padded example equals the example alone, the model is
unchanged; the bare ``*Model`` and the ``*ForSequenceClassification`` give complete maps; the LLM API
explains a teacher-forced continuation exactly. The zoo's exact float64 norms are checked against the
family's own (to float32 rounding), and the reported hand clones that are not exact are caught. Every
refused model type names its missing mechanism (``docs/frontier.md``).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from captum.attr import TextTokenInput
from transformers import CONFIG_MAPPING

from captum_normattr import (
    ALTILogitAttribution,
    DecompXAttribution,
    GlobEncAttribution,
    UnsupportedModelError,
)
from captum_normattr.arch import ARCHITECTURES, lookup
from captum_normattr.arch.families import frontier
from captum_normattr.arch.families.base import LLAMA
from captum_normattr.arch.registry import REFUSED, refusal
from captum_normattr.models.guard import ConsistencyError
from captum_normattr.attr.llm import DecompositionLLMAttribution
from captum_normattr.decompose.kinds.registry import LAYER_KINDS
from captum_normattr.models.adapters import get_adapter
from decoder_models import decoder_batch
from llm_tiny import tiny_tokenizer
from registry_state import described_as
from zoo import build
from zoo_frontier import FAMILIES
from map_checks import check_maps_complete
from hybrid_checks import check_every_method_exact

REGISTERED = [key for key, _ in frontier.BUILTIN]
MOE = [key for key in REGISTERED if ARCHITECTURES[key].layer.ff.kind == "experts"]
#: (key, head) for every ``*Model`` and every ``*ForSequenceClassification`` transformers has
HEADS = [(key, "bare") for key in REGISTERED] + [(key, "cls") for key in REGISTERED if FAMILIES[key][0][3] is not None]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _capped(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    r"""The final-logit soft-cap of the family's description applied to ``x`` (the decompositions explain the
    pre-cap logit; the model outputs the capped one)."""
    name = get_adapter(model).head.final_softcap
    cap = getattr(model.config, name, None) if name else None
    return x if cap is None else cap * torch.tanh(x / cap)


def _methods(key: str) -> frozenset:
    return LAYER_KINDS[ARCHITECTURES[key].topology].methods


# --- registration ---------------------------------------------------------------------------------

def test_every_frontier_family_is_registered_once_and_is_transformers_model_type():
    assert len(REGISTERED) == len(set(REGISTERED)) and set(REGISTERED) == set(FAMILIES)
    for key, spec in frontier.BUILTIN:
        assert ARCHITECTURES[key] is spec and spec.model_types == (key,) and spec.causal and spec.notes
        assert key in CONFIG_MAPPING, key
        assert lookup(key) is spec
        assert key not in REFUSED
    for model_type in frontier.REFUSED:
        assert model_type in CONFIG_MAPPING, model_type  # a refusal names a model type transformers has
        assert lookup(model_type) is None
        assert REFUSED[model_type] == frontier.REFUSED[model_type]


@pytest.mark.parametrize("key", REGISTERED)
def test_the_zoos_exact_norms_are_the_familys_own(key):
    r"""The zoo replaces the family's float32-computing norms by float64 ones: the same function (the logits agree
    to float32 rounding), so that the models below are the family's."""
    ids, mask = decoder_batch([6, 4], seed=12)
    own, exact = build(key, "lm", exact_norms=False), build(key, "lm")
    assert type(own.config) is type(exact.config) and own.config.model_type == key
    with torch.no_grad():
        a = own(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        b = exact(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    assert _rel(a, b) < 1e-5


# --- every method, exact against the model's own logit -----------------------------------------------

@pytest.mark.parametrize("key", REGISTERED)
def test_every_method_is_exact_padding_free_and_leaves_the_model(key):
    model = build(key, "lm")
    spec = get_adapter(model)
    methods = _methods(key)
    assert {"maps", "alti", "ff", "decompx", "alti_logit"} <= set(methods)
    res = check_every_method_exact(model, capped=lambda total: _capped(model, total), routes="routes" in methods)
    if spec.head.final_softcap:
        assert res.extras["explained_logit"] == "pre-cap logit"


@pytest.mark.parametrize("key,head", HEADS, ids=[f"{k}-{h}" for k, h in HEADS])
def test_bare_model_and_classifier_maps_are_complete(key, head):
    r"""The maps of the bare ``*Model`` and of the ``*ForSequenceClassification``; DecompX has no decoder
    classification head (refused cleanly)."""
    model = build(key, head)
    ids, mask = decoder_batch([6, 4], seed=9)
    check_maps_complete(model, ids, (mask,))
    if head == "cls":
        with pytest.raises(UnsupportedModelError, match="classification head"):
            DecompXAttribution(model)


@pytest.mark.parametrize("key", REGISTERED)
def test_llm_api_explains_a_continuation_exactly(key):
    model = build(key, "lm")
    tok = tiny_tokenizer()
    ex = DecompositionLLMAttribution(ALTILogitAttribution(model), tok).decompose(
        TextTokenInput("the cat sat on the", tok), target="mat today")
    assert ex.output_tokens == ["mat", "today"] and ex.scores.shape == (2, 8)
    with torch.no_grad():
        real = model(input_ids=ex.input_ids[None]).logits[0, ex.positions, ex.target_ids]
    total = ex.scores.sum(-1) + ex.details.no_token
    assert _rel(_capped(model, total), real) < 1e-10
    assert float(ex.details.delta.abs().max()) < 1e-10 * float(real.abs().max())


# --- mixtures of experts: the routing varies, dense layers are dense ----------------------------------

@pytest.mark.parametrize("key", MOE)
def test_moe_families_route_tokens_differently_and_keep_dense_layers(key):
    model = build(key, "lm")
    ids, mask = decoder_batch([6, 6], seed=4)
    calls = []
    layers = model.model.layers
    experts = ARCHITECTURES[key].layer.ff.experts
    block, name = experts.module.split(".")  # mlp.experts, block_sparse_moe.experts, feed_forward.experts
    sparse = [layer for layer in layers if hasattr(getattr(layer, block), name)]
    if experts.router is not None:  # input-scaled experts (Llama 4): the router's scores, 0 for the others
        hooks = [getattr(layer, block).router.register_forward_hook(
            lambda m, args, out: calls.append((out[0] > 0).nonzero()[:, 1].reshape(out[0].shape[0], -1))) for layer in sparse]
    else:
        hooks = [getattr(getattr(layer, block), name).register_forward_pre_hook(
            lambda m, args: calls.append(args[1].clone())) for layer in sparse]
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        for h in hooks:
            h.remove()
    # layer 0 dense (moe_layer_start_index, first_k_dense_replace, moe_layers)
    dense_first = key in ("ernie4_5_moe", "glm4_moe", "deepseek_v3", "llama4_text")
    assert len(calls) == len(hooks) == (1 if dense_first else 2)
    if dense_first:
        assert not hasattr(getattr(layers[0], block), name) and hasattr(getattr(layers[0], block), "gate_proj")
    for index in calls:
        assert len({tuple(sorted(row.tolist())) for row in index}) > 1  # tokens do not all choose the same experts


# --- the reported hand clones that are not exact are caught -------------------------------------------

def test_glm4_described_without_its_post_norms_is_caught():
    r"""GLM-4 has four norms per layer: described as a pre-LN layer (its post-norms dropped, every module path
    right), the guards refuse the call instead of decomposing another model."""
    model = build("glm4", "lm")
    ids, mask = decoder_batch([6, 4], seed=7)
    spec = ARCHITECTURES["glm4"]
    wrong = replace(spec, layer=replace(spec.layer, attention=replace(spec.layer.attention, post_norm=None),
                                        ff=replace(spec.layer.ff, post_norm=None)))
    assert wrong.topology == "pre_ln"
    with described_as("glm4", wrong):
        with pytest.raises(ConsistencyError):
            ALTILogitAttribution(model, strict=True).decompose(ids, target=3, additional_forward_args=(mask,))


@pytest.mark.parametrize("key,part", [("glm4", "up_proj"), ("arcee", "gate_proj"), ("apertus", "input_layernorm"),
                                      ("nanochat", "down_proj")])
def test_the_reported_llama_clones_name_the_part_that_differs(key, part):
    r"""The hand clones users reported (``replace(ARCHITECTURES["llama"], model_types=(key,))``) stop at the
    module the family does not have: a fused gate-up FF, a plain FF, other norm names, other FF names."""
    model = build(key, "lm")
    ids, mask = decoder_batch([6, 4], seed=7)
    with described_as(key, replace(LLAMA, model_types=(key,))):
        with pytest.raises(AttributeError, match=part):
            DecompXAttribution(model, strict=True).decompose(ids, target=3, additional_forward_args=mask)


# --- refused: the mechanism is named -------------------------------------------------------------------

class _Stub(torch.nn.Module):
    r"""A module carrying only a family's default config (the refusal reads nothing else)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config


@pytest.mark.parametrize("model_type", sorted(frontier.REFUSED))
def test_refused_frontier_families_name_the_missing_mechanism(model_type):
    family, why = frontier.REFUSED[model_type]
    config = CONFIG_MAPPING[model_type]()
    assert refusal(model_type, config).startswith(f"{family} ({model_type}) is not supported: {why}")
    for cls in (GlobEncAttribution, ALTILogitAttribution):
        with pytest.raises(UnsupportedModelError, match=rf"{model_type}\) is not supported"):
            cls(_Stub(config))


def test_granite_moe_described_without_its_multiplier_is_caught():
    r"""Granite-MoE's residual multiplier on the experts branch is folded into the experts' W_down: described
    without it (every path right), the guards refuse the call instead of decomposing another model."""
    model = build("granitemoe", "lm")
    ids, mask = decoder_batch([6, 4], seed=7)
    spec = ARCHITECTURES["granitemoe"]
    wrong = replace(spec, layer=replace(spec.layer, ff=replace(spec.layer.ff, multiplier=None)))
    with described_as("granitemoe", wrong):
        with pytest.raises(ConsistencyError):
            ALTILogitAttribution(model, strict=True).decompose(ids, target=3, additional_forward_args=(mask,))
