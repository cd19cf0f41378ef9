r"""Granite 4 with experts beside the shared MLP (``GRANITE4_MOE``, granite-4.0-h-tiny / -small's form).

The tiny float64 Granite 4 with 4 experts (top 2) beside the shared MLP and the convolution bias on
(tests/fixtures/zoo_state_space.py, ``GRANITE4_MOE``): the variant is chosen by ``num_local_experts``; the recorded
feed-forward output is the experts block's plus the shared MLP's, against a naive per-token reference (the router's
top-k and softmax, each chosen expert and the shared MLP by explicit sums) at every token; the frozen gated FF
(experts' neurons times their routing weights beside the shared MLP's) rebuilds it at every token; every method
(GlobEnc, ALTI, FF, DecompX, ALTI-Logit, routes, the LLM API; DecompX also by its forward algorithm and in its spread
bias modes) complete against the model's own logit (1e-10), padded equal to single, the model unchanged; transformers'
default config (experts, convolution bias) is the experts variant, not refused.
"""
from __future__ import annotations

import pytest
import torch

from captum_normattr import DecompXAttribution
from captum_normattr.arch import ARCHITECTURES, lookup
from captum_normattr.arch.families.state_space import GRANITE4, GRANITE4_MOE
from captum_normattr.arch.spec import Experts, FeedForward
from captum_normattr.models.adapters import family_methods, get_adapter, layer_modules
from decoder_models import decoder_batch
from hybrid_checks import check_every_method_exact, check_llm_continuation_exact
from layer_capture import capture_layers
from zoo import real_next_token_logits
from zoo_state_space import GRANITE4_MOE as MOE_CONFIG
from zoo_state_space import build_state_space


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _moe(head: str = "lm") -> torch.nn.Module:
    return build_state_space("granitemoehybrid", head, **MOE_CONFIG)


def _naive_ff(layer: torch.nn.Module, u: torch.Tensor) -> torch.Tensor:
    r"""FF(u) of one Granite 4 MoE layer token by token (B, T, D): the router's top-k logits, their softmax (in float32,
    as transformers' router computes them), the
    chosen experts' SwiGLU by explicit sums over their neurons, plus the shared MLP's (before the multiplier)."""
    moe, shared = layer.block_sparse_moe, layer.shared_mlp
    k = moe.router.top_k
    router = moe.router.weight.detach()
    gate_up, down = moe.experts.gate_up_proj.detach(), moe.experts.down_proj.detach()  # (E, 2F, D), (E, D, F)
    f = down.shape[-1]
    w_in, w_out = shared.input_linear.weight.detach(), shared.output_linear.weight.detach()
    fs = w_out.shape[-1]
    silu = torch.nn.functional.silu
    out = torch.zeros_like(u)
    for b in range(u.shape[0]):
        for t in range(u.shape[1]):
            x = u[b, t]
            logits = (router @ x).float()  # the router's logits and softmax are float32, as the model's
            top = torch.topk(logits, k).indices.tolist()
            weights = torch.softmax(logits[top], -1).double()
            for e, r in zip(top, weights):
                for n in range(f):
                    out[b, t] += r * silu(gate_up[e, n] @ x) * (gate_up[e, f + n] @ x) * down[e, :, n]
            for n in range(fs):
                out[b, t] += silu(w_in[n] @ x) * (w_in[fs + n] @ x) * w_out[:, n]
    return out


def test_the_experts_variant_is_chosen_by_num_local_experts():
    model = _moe()
    assert ARCHITECTURES["granitemoehybrid"] is GRANITE4 and lookup("granitemoehybrid") is GRANITE4
    assert lookup("granitemoehybrid", model.config) is GRANITE4_MOE and get_adapter(model) is GRANITE4_MOE
    assert get_adapter(build_state_space("granitemoehybrid", "lm")) is GRANITE4  # num_local_experts=0: dense
    assert GRANITE4_MOE.layer.ff.kind == "experts" and GRANITE4.layer.ff.kind == "fused_gate_up"
    assert family_methods(GRANITE4_MOE) == ("GlobEnc", "ALTI", "FF", "DecompX", "ALTI-Logit")


def test_the_ff_output_is_experts_plus_shared_mlp_the_naive_per_token_sums():
    model = _moe()
    ids, mask = decoder_batch([7, 5], seed=4)
    layers = capture_layers(model, ids, mask)
    modules = layer_modules(model, get_adapter(model))
    m = model.config.residual_multiplier
    chosen = set()
    for lt, layer in zip(layers, modules):
        with torch.no_grad():
            naive = _naive_ff(layer, lt.ln2_out)
            index = torch.topk(lt.ln2_out @ layer.block_sparse_moe.router.weight.T, 2).indices
        chosen |= {tuple(sorted(r)) for r in index[mask.bool()].tolist()}
        assert _rel(lt.ff_out, m * naive) < 1e-12
        assert _rel(lt.ln2_in + lt.ff_out, lt.layer_out) < 1e-12
        ff = lt.ff  # the frozen gated FF, at every token
        hidden = torch.nn.functional.silu(lt.ln2_out @ ff.w_gate) * (lt.ln2_out @ ff.w_in) * ff.hidden_scale
        assert _rel(hidden @ ff.w_out, lt.ff_out) < 1e-12
        experts = ff.hidden_scale[..., :4 * 16].reshape(*ff.hidden_scale.shape[:2], 4, 16)
        assert torch.equal((experts[..., 0] != 0).sum(-1), torch.full(ids.shape, 2))  # top 2 of 4
        assert bool((ff.hidden_scale[..., 4 * 16:] == 1).all())  # the shared MLP, ungated
        without = (hidden[..., :4 * 16] @ ff.w_out[:4 * 16])
        assert _rel(without, lt.ff_out) > 1e-2  # the shared MLP's part is needed
    assert len(chosen) >= 3  # tokens choose different experts


def test_every_method_is_exact_with_experts_and_the_convolution_bias():
    check_every_method_exact(_moe(), lengths=(9, 6))


def test_llm_api_explains_a_continuation_exactly():
    model = _moe()
    check_llm_continuation_exact(model)


def test_shared_beside_names_an_ungated_shared_expert():
    shared = GRANITE4_MOE.layer.ff.experts.shared
    with pytest.raises(ValueError, match="shared_beside"):
        Experts("block_sparse_moe.experts", shared_beside="shared_mlp")
    with pytest.raises(ValueError, match="shared_beside"):
        Experts("block_sparse_moe.experts", shared=shared, shared_gate="gate", shared_beside="shared_mlp")
    assert isinstance(shared, FeedForward) and shared.kind == "fused_gate_up"


@pytest.mark.parametrize("algorithm,bias_mode", [("forward", "separate"), ("forward", "spread"),
                                                 ("forward", "spread_per_key")])
def test_decompx_forward_and_spread_modes_are_complete(algorithm, bias_mode):
    r"""The convolution bias's heads (b_V inside) and the experts under DecompX's other algorithm and bias modes."""
    model = _moe()
    ids, mask = decoder_batch([9, 6], seed=3)
    logits = real_next_token_logits(model, ids, mask)
    dx = DecompXAttribution(model, strict=True, algorithm=algorithm, bias_mode=bias_mode)
    res = dx.decompose(ids, target=5, additional_forward_args=mask)
    assert _rel(res.class_scores.sum(1) + res.bias_scores, logits[:, 5:6]) < 1e-10
    alone = dx.decompose(ids[1:, 3:], target=5)
    torch.testing.assert_close(res.scores[1, 3:], alone.scores[0], rtol=0, atol=1e-10 * float(res.scores.abs().max()))


def test_transformers_default_config_is_the_experts_variant_with_the_convolution_bias():
    import transformers as tf

    config = tf.GraniteMoeHybridConfig()  # granite-4.0-h-tiny / -small's form: experts, convolution bias
    assert config.mamba_conv_bias and config.num_local_experts > 0 and not config.mamba_proj_bias
    assert lookup("granitemoehybrid", config) is GRANITE4_MOE and GRANITE4_MOE.refusal(config) is None
