r"""Gemma 4 (text) in the attribution classes: exact, padding-free, the model left as found.

``Gemma4ForCausalLM`` / ``Gemma4TextModel`` are read through their description (``gemma4_text``,
:mod:`captum_normattr.arch.families.gemma4`) and layer kind (``sandwich_per_layer_input``,
:mod:`captum_normattr.decompose.kinds.sandwich_per_layer_input`; docs/frontier.md, "Gemma 4"). On tiny
float64 builds (tests/fixtures/zoo_gemma4.py: sliding and full layers, layer scalars in [0.5, 1.5], norm
gains away from 1) covering shared keys/values, keys as values, per-layer inputs on and off, a wider
full-attention head and the expert block:

- DecompX's token scores + its bias score equal the model's own logit (the pre-cap one) and equal the
  standalone decomposition (:func:`~captum_normattr.decompose.kinds.per_layer_input.gemma4_logit_scores`,
  its own recording);
- ALTI-Logit's token scores + no-token terms equal the model's own logit, and its explained logit is the
  standalone one;
- GlobEnc's and ALTI's attention-block parts are complete;
- a left-padded batch equals its examples alone, and the model's weights, hooks and attention
  implementation are as before;
- the LLM API (DecompositionLLMAttribution) explains a continuation exactly with DecompX and ALTI-Logit;
- FFIntegratedDecomposition's scopes (ATB, LN2, FF, RES2: the attention block, the dense FF's input, the
  feed-forward branch after its post-norm, the whole layer with the per-layer-input branch and the layer
  scalar) sum to the model's own tensors, read by hooks of their own, and are padding-free;
- Value Zeroing is refused naming why and the methods that work, as are an attention
  bias and a bidirectional attention (the routes run: tests/attr/test_routes_gemma4.py).
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma4TextConfig"):  # pragma: no cover - older transformers
    pytest.skip("transformers has no Gemma 4", allow_module_level=True)

from captum.attr import TextTokenInput  # noqa: E402

from captum_normattr import (  # noqa: E402
    ALTIAttribution,
    ALTILogitAttribution,
    DecompXAttribution,
    FFIntegratedDecomposition,
    GlobEncAttribution,
    UnsupportedModelError,
    ValueZeroingAttribution,
)
from captum_normattr.attr.llm import DecompositionLLMAttribution  # noqa: E402
from captum_normattr.attr.routes import InformationFlowRoutes  # noqa: E402
from captum_normattr.decompose.kinds import pre_ln  # noqa: E402
from captum_normattr.decompose.kinds.per_layer_input import gemma4_logit_scores  # noqa: E402
from captum_normattr.models.adapters import get_adapter  # noqa: E402
from decoder_models import decoder_batch  # noqa: E402
from llm_tiny import tiny_tokenizer  # noqa: E402
from zoo_gemma4 import MOE, build_gemma4  # noqa: E402

#: the configs every class is checked on (keywords of build_gemma4)
CONFIGS = {
    "plain": dict(num_kv_shared_layers=0),
    "shared_kv": dict(num_kv_shared_layers=2),
    "k_eq_v": dict(num_kv_shared_layers=0, attention_k_eq_v=True),
    "shared_kv_k_eq_v": dict(num_kv_shared_layers=2, attention_k_eq_v=True),
    "no_per_layer_input": dict(num_kv_shared_layers=2, hidden_size_per_layer_input=0),
    "global_head_dim": dict(num_kv_shared_layers=0, global_head_dim=12),
    "experts": dict(num_kv_shared_layers=2, **MOE),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _capped(x: torch.Tensor, cap=30.0) -> torch.Tensor:
    return cap * torch.tanh(x / cap)


def _own_logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits[:, -1]


def _state(model):
    return ({k: v.clone() for k, v in model.state_dict().items()}, model.config._attn_implementation)


def _unchanged(model, state) -> bool:
    weights, implementation = state
    hooks = any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    return (not hooks and model.config._attn_implementation == implementation
            and all(torch.equal(v, weights[k]) for k, v in model.state_dict().items()))


def _pre_cap_model(model):
    r"""The same model without the final soft-cap (the standalone decomposition explains the uncapped logit)."""
    plain = copy.deepcopy(model)
    plain.config.final_logit_softcapping = None
    return plain


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decompx_is_exact_and_is_the_standalone_decomposition(name):
    model = build_gemma4(**CONFIGS[name])
    state = _state(model)
    ids, mask = decoder_batch([7, 4], seed=3)
    t = ids.shape[1]
    own = _own_logits(model, ids, mask)
    dx = DecompXAttribution(model, strict=True)
    for target in (5, 17):
        res = dx.decompose(ids, target=target, additional_forward_args=mask)
        assert res.algorithm == "adjoint"  # what "auto" runs (equal to the forward algorithm: test_decompx_adjoint_frontier)
        assert _rel(_capped(res.scores.sum(-1) + res.bias_scores[:, 0]), own[:, target]) < 1e-10, name
        assert float(res.bias_scores.abs().max()) == 0.0  # Gemma 4 has no bias: no bias part
        assert res.extras["explained_logit"] == "pre-cap logit"
        standalone, logit = gemma4_logit_scores(_pre_cap_model(model), ids, target, mask)
        torch.testing.assert_close(res.scores, standalone, rtol=0, atol=1e-12 * float(standalone.abs().max()))
        torch.testing.assert_close(res.logits[:, 0], logit, rtol=1e-12, atol=0)
    alone = dx.decompose(ids[1:, t - 4:], target=5)
    padded = dx.decompose(ids, target=5, additional_forward_args=mask)
    torch.testing.assert_close(padded.scores[1, t - 4:], alone.scores[0], rtol=0,
                               atol=1e-10 * float(alone.scores.abs().max()))
    assert float(padded.scores[1, :t - 4].abs().max()) == 0.0
    assert _unchanged(model, state)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_alti_logit_is_exact_and_explains_the_standalone_logit(name):
    model = build_gemma4(**CONFIGS[name])
    state = _state(model)
    ids, mask = decoder_batch([7, 4], seed=5)
    t = ids.shape[1]
    own = _own_logits(model, ids, mask)
    target = own.argmax(-1)
    al = ALTILogitAttribution(model, strict=True)
    res = al.decompose(ids, target=target, additional_forward_args=(mask,))
    assert _rel(_capped(res.scores.sum(-1) + res.no_token_total), own.gather(1, target[:, None])[:, 0]) < 1e-10, name
    assert float(res.delta.max()) < 1e-10 * float(res.logit.abs().max())
    _, logit = gemma4_logit_scores(_pre_cap_model(model), ids, 0, mask)  # the explained logit, target 0
    zero = al.decompose(ids, target=0, additional_forward_args=(mask,))
    torch.testing.assert_close(zero.logit, logit, rtol=1e-12, atol=0)
    alone = al.decompose(ids[1:, t - 4:], target=target[1:])
    torch.testing.assert_close(res.scores[1, t - 4:], alone.scores[0], rtol=0,
                               atol=1e-10 * float(alone.scores.abs().max()))
    assert _unchanged(model, state)


@pytest.mark.parametrize("name", ["shared_kv_k_eq_v", "experts", "no_per_layer_input"])
@pytest.mark.parametrize("cls", [GlobEncAttribution, ALTIAttribution])
def test_maps_are_complete_and_padding_free_on_the_bare_model_too(name, cls):
    for head in ("lm", "bare"):
        model = build_gemma4(head, **CONFIGS[name])
        state = _state(model)
        ids, mask = decoder_batch([7, 4], seed=9)
        t = ids.shape[1]
        attr = cls(model, strict=True)
        res = attr.decompose(ids, additional_forward_args=(mask,))
        assert float(res.extras["completeness_error"].max()) < 1e-10 * max(1.0, float(res.layer_maps.abs().max()))
        alone = attr.decompose(ids[1:, t - 4:])
        torch.testing.assert_close(res.scores[1, t - 4:], alone.scores[0], rtol=0,
                                   atol=1e-10 * float(res.scores.abs().max()))
        assert float(res.layer_maps[1, :, :t - 4].abs().max()) == 0.0  # the pads have no part
        assert _unchanged(model, state)


def test_the_bare_model_with_an_unembedding_reads_as_the_lm():
    lm = build_gemma4(final_logit_softcapping=None)
    bare = build_gemma4("bare", final_logit_softcapping=None)
    ids, mask = decoder_batch([7, 4], seed=2)
    w = lm.lm_head.weight.detach()
    for cls in (DecompXAttribution, ALTILogitAttribution):
        a = cls(lm).decompose(ids, target=7, additional_forward_args=(mask,))
        b = cls(bare, unembedding=w).decompose(ids, target=7, additional_forward_args=(mask,))
        torch.testing.assert_close(a.scores, b.scores, rtol=0, atol=1e-12 * float(a.scores.abs().max()))


@pytest.mark.parametrize("method", [DecompXAttribution, ALTILogitAttribution])
def test_llm_api_explains_a_continuation_exactly(method):
    model = build_gemma4()
    tok = tiny_tokenizer()
    ex = DecompositionLLMAttribution(method(model), tok).decompose(TextTokenInput("the cat sat on the", tok),
                                                                   target="mat today")
    assert ex.output_tokens == ["mat", "today"] and ex.scores.shape == (2, 8)
    with torch.no_grad():
        real = model(input_ids=ex.input_ids[None]).logits[0, ex.positions, ex.target_ids]
    assert _rel(_capped(ex.scores.sum(-1) + ex.details.no_token), real) < 1e-10
    assert float(ex.details.delta.abs().max()) < 1e-10 * float(real.abs().max())


def test_float32_weights_decompose_to_float32_rounding():
    r"""A float32 model (its own norms, computing in float32): the weights the step reads are cast to the compute dtype."""
    model = build_gemma4(exact_norms=False, **CONFIGS["experts"]).float()
    ids, mask = decoder_batch([7, 4], seed=3)
    own = _own_logits(model, ids, mask).double()
    res = DecompXAttribution(model).decompose(ids, target=5, additional_forward_args=mask)
    assert _rel(_capped(res.scores.sum(-1).double()), own[:, 5]) < 1e-4
    al = ALTILogitAttribution(model).decompose(ids, target=5, additional_forward_args=(mask,))
    assert _rel(_capped((al.scores.sum(-1) + al.no_token_total).double()), own[:, 5]) < 1e-4


def _scope_reals(model, ids, mask):
    r"""Each layer's real h (N_pre's input), N_pre's output, N_pf's output and the layer output, by hooks of the test's own."""
    base = model.model if hasattr(model, "lm_head") else model
    reals, handles = [dict() for _ in base.layers], []

    def keep(i, key, use_input=False):
        def hook(module, args, output):
            reals[i][key] = (args[0] if use_input else output[0] if isinstance(output, tuple) else output).detach()
        return hook

    for i, layer in enumerate(base.layers):
        handles += [layer.pre_feedforward_layernorm.register_forward_hook(keep(i, "ATB", True)),
                    layer.pre_feedforward_layernorm.register_forward_hook(keep(i, "LN2")),
                    layer.post_feedforward_layernorm.register_forward_hook(keep(i, "FF")),
                    layer.register_forward_hook(keep(i, "RES2"))]
    try:
        _own_logits(model, ids, mask) if hasattr(model, "lm_head") else None
    finally:
        for h in handles:
            h.remove()
    return reals


@pytest.mark.parametrize("name", ["plain", "no_per_layer_input", "experts", "shared_kv_k_eq_v"])
def test_ff_scopes_sum_to_the_models_own_tensors(name, monkeypatch):
    r"""Every scope's parts of every row chunk, summed over the sources, against the tensor the model computed."""
    model = build_gemma4(**CONFIGS[name])
    state = _state(model)
    ids, mask = decoder_batch([7, 4], seed=9)
    reals = _scope_reals(model, ids, mask)
    sums = []
    scorer = pre_ln.scope_scorer

    def recording_scorer(contribution, outputs):
        score = scorer(contribution, outputs)
        if not sums or "RES2" in sums[-1]:
            sums.append({})

        def wrapped(scope, parts, rows):
            full = sums[-1].setdefault(scope, torch.full_like(outputs[scope], float("nan")))
            full[:, rows] = parts.sum(2)
            return score(scope, parts, rows)
        return wrapped

    monkeypatch.setattr(pre_ln, "scope_scorer", recording_scorer)
    res = FFIntegratedDecomposition(model, strict=True, chunk_rows=3).decompose(ids, additional_forward_args=(mask,))
    assert res.extras["completeness_error"].max() < 1e-12 and res.extras["layer_completeness_error"].max() < 1e-12
    assert len(sums) == len(reals)
    valid = mask.bool()
    for layer, (got, real) in enumerate(zip(sums, reals)):
        for scope in ("ATB", "LN2", "FF", "RES2"):
            want = real[scope][valid]
            err = float((got[scope][valid] - want).abs().max())
            assert err < 1e-12 * max(1.0, float(want.abs().max())), (name, layer, scope, err)
    assert _unchanged(model, state)


@pytest.mark.parametrize("name", ["plain", "no_per_layer_input", "experts"])
@pytest.mark.parametrize("contribution", ["norm", "alti"])
def test_ff_scopes_are_padding_free(name, contribution):
    model = build_gemma4(**CONFIGS[name])
    ids, mask = decoder_batch([7, 4], seed=4)
    t = ids.shape[1]
    for scope in ("ATB", "LN2", "FF", "RES2"):
        ffd = FFIntegratedDecomposition(model, scope=scope, contribution=contribution, strict=True)
        padded = ffd.decompose(ids, additional_forward_args=(mask,))
        alone = ffd.decompose(ids[1:, t - 4:])
        torch.testing.assert_close(padded.scores[1, t - 4:], alone.scores[0], rtol=0,
                                   atol=1e-10 * float(alone.scores.abs().max()))
        torch.testing.assert_close(padded.layer_maps[1][:, t - 4:, t - 4:], alone.layer_maps[0], rtol=0,
                                   atol=1e-10 * float(alone.layer_maps.abs().max()))
        assert float(padded.layer_maps[1, :, :, :t - 4].abs().max()) == 0.0  # the pads have no part
    assert ffd.get_name() == ("GlobEnc+FF" if contribution == "norm" else "ALTI+FF")  # RES2: the whole layer


def test_the_whole_layer_scope_gives_each_token_its_per_layer_input_branch():
    r"""The branch is token i's own part: without it RES2's diagonal would differ (and the layer would not be complete)."""
    ids, mask = decoder_batch([7, 4], seed=4)
    with_branch = build_gemma4(num_kv_shared_layers=0)
    res = FFIntegratedDecomposition(with_branch, strict=True).decompose(ids, additional_forward_args=(mask,))
    assert float(res.extras["layer_completeness_error"].max()) < 1e-12
    base = with_branch.model
    for layer in base.layers:  # the same model with the branch switched off and its output removed
        layer.hidden_size_per_layer_input = 0
    without = FFIntegratedDecomposition(with_branch, strict=True).decompose(ids, additional_forward_args=(mask,))
    diag = torch.diagonal(res.layer_maps[0, 0]) - torch.diagonal(without.layer_maps[0, 0])
    assert float(diag.abs().max()) > 1e-3  # the first layer's maps see the same input: only the branch differs


def test_ff_options_are_refused_and_the_routes_run():
    with pytest.raises(ValueError, match="ignore_low_gamma"):
        FFIntegratedDecomposition(build_gemma4(), ignore_low_gamma=0.01)
    # the routes' exactness is tests/attr/test_routes_gemma4.py's
    assert InformationFlowRoutes(build_gemma4()).attribute(torch.tensor([[5, 6, 7]]), threshold=0.05).edges


def test_value_zeroing_is_refused_naming_the_shared_values():
    with pytest.raises(UnsupportedModelError, match="num_kv_shared_layers.*attention_k_eq_v.*DecompXAttribution"):
        ValueZeroingAttribution(build_gemma4())


def test_decompx_auto_runs_the_adjoint_and_spread_the_forward_algorithm():
    model = build_gemma4()
    ids, _ = decoder_batch([6], seed=1)
    a = DecompXAttribution(model).decompose(ids, target=3)
    b = DecompXAttribution(model, bias_mode="spread").decompose(ids, target=3)  # no bias: spreading changes nothing
    assert a.algorithm == "adjoint" and b.algorithm == "forward"
    torch.testing.assert_close(a.scores, b.scores, rtol=0, atol=1e-12 * float(b.scores.abs().max()))


def test_the_description_is_found_and_unsupported_configs_are_refused():
    model = build_gemma4()
    spec = get_adapter(model)
    assert spec.family == "Gemma 4" and spec.topology == "sandwich_per_layer_input"
    model.config.attention_bias = True
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        DecompXAttribution(model)
    model.config.attention_bias = False
    model.config.use_bidirectional_attention = "all"
    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        ALTILogitAttribution(model)


def test_the_zoos_exact_norms_are_gemma4s_own():
    r"""The builder's float64 norms compute Gemma 4's own function (its norms compute in float32: float32 rounding)."""
    ids, mask = decoder_batch([7, 4], seed=12)
    own, exact = build_gemma4(exact_norms=False, **MOE), build_gemma4(**MOE)
    assert _rel(_own_logits(own, ids, mask), _own_logits(exact, ids, mask)) < 1e-5
