r"""The new mechanisms of the frontier families against naive per-token references (explicit sums over source
tokens, experts and neurons, float64).

- learned attention sinks (GPT-OSS): the probabilities with one more logit per head in each softmax row, the
  recorded probabilities equal to the model's own eager ones, the attention output of every token as an explicit
  sum over its source tokens; a description that does not name the sinks is refused;
- multi-head latent attention (DeepSeek-V3): the recorded values are the explicit linear map of the attention
  input through the down-projection, the latent's gain and the up-projection's value columns; the recorded
  probabilities are the model's own times the latent's norm scale of the source token; every token's attention
  output is the explicit sum over its sources;
- clamped SwiGLU experts with biases (GPT-OSS): the experts read as one gated FF with a frozen hidden scale equal
  to an explicit loop over the chosen experts and their neurons, with the clamps exercised; the clamped gate's
  closed-form path integrals against a fine midpoint rule;
- experts on the routing-scaled input (Llama 4): the experts read as one gated FF with the score on the gate and the
  up pre-activations, equal to an explicit loop over the experts and the shared expert; the model with its
  position-dependent query temperature (not padding-invariant itself) decomposed exactly on a padded batch.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from captum_normattr import (
    ALTILogitAttribution,
    DecompXAttribution,
)
from captum_normattr.arch import ARCHITECTURES
from captum_normattr.decompose.primitives.attention import softmax_with_sinks
from captum_normattr.decompose.primitives.gated_feed_forward import ClampedSwiGLUGate, gate_integrals
from captum_normattr.models.adapters import get_adapter, value_projection
from captum_normattr.models.capture.session import recording
from captum_normattr.models.experts import clamped_swiglu_ff_params, input_scaled_ff_params, routing_scale
from decoder_models import decoder_batch
from registry_state import described_as
from zoo import EXACT_ATTENTION, build, real_next_token_logits
from map_checks import check_maps_complete


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# --- attention sinks ------------------------------------------------------------------------------------

def test_softmax_with_sinks_is_the_explicit_sum():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64) * 3
    scores[0, :, :, 0] = torch.finfo(torch.float64).min  # a masked key
    sinks = torch.randn(3, generator=g, dtype=torch.float64) * 2
    got = softmax_with_sinks(scores, sinks)
    want = torch.empty_like(scores)
    for b in range(2):
        for h in range(3):
            for i in range(4):
                denominator = math.exp(float(sinks[h])) + sum(math.exp(float(scores[b, h, i, k])) for k in range(5))
                for j in range(5):
                    want[b, h, i, j] = math.exp(float(scores[b, h, i, j])) / denominator
    assert _rel(got, want) < 1e-14
    assert float(got.sum(-1).max()) < 1  # the sink takes its share of every row


def test_gpt_oss_recorded_probabilities_are_the_models_own_and_mix_tokens_exactly():
    r"""The recording attention's probabilities (sinks included) are the model's own eager ones; their rows sum
    to less than one; every token's attention output is the explicit sum over its sources of p_ij v_j W_O + b_O."""
    model = build("gpt_oss", "lm")
    ids, mask = decoder_batch([6, 4], seed=3)
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    outputs = {}
    hooks = [layer.self_attn.o_proj.register_forward_hook(lambda m, a, o, i=i: outputs.__setitem__(i, o.detach()))
             for i, layer in enumerate(model.model.layers)]
    layers = []
    try:
        with recording(model, get_adapter(model), layers.append, dtype=torch.float64), torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        for h in hooks:
            h.remove()
    assert len(layers) == 2
    real = mask.bool()
    for i, t in enumerate(layers):
        assert _rel(t.probs.transpose(1, 2)[real], own[i].transpose(1, 2)[real]) < 1e-14
        sums = t.probs.sum(-1).transpose(1, 2)[real]  # (tokens, H)
        assert float(sums.max()) < 1 - 1e-3 and float(sums.min()) > 0
        b, h, n, dh = t.values.shape
        w_o = t.out_weight.reshape(h, dh, -1)
        for e in range(b):
            for q in range(n):
                if not real[e, q]:
                    continue
                out = t.out_bias.clone()
                for head in range(h):
                    for src in range(n):
                        out += t.probs[e, head, q, src] * (t.values[e, head, src] @ w_o[head])
                assert _rel(out, outputs[i][e, q]) < 1e-12


def test_undescribed_sinks_are_refused():
    r"""GPT-OSS described without its sinks (every path right): the recording attention refuses the call instead of
    taking the probabilities as summing to one."""
    model = build("gpt_oss", "lm")
    ids, mask = decoder_batch([6, 4], seed=7)
    spec = ARCHITECTURES["gpt_oss"]
    wrong = replace(spec, layer=replace(spec.layer, attention=replace(spec.layer.attention, sinks=None)))
    with described_as("gpt_oss", wrong):
        with pytest.raises(NotImplementedError, match="Attention.sinks"):
            ALTILogitAttribution(model, strict=True).decompose(ids, target=3, additional_forward_args=(mask,))


# --- multi-head latent attention -------------------------------------------------------------------------

@torch.no_grad()
def test_deepseek_latent_values_are_linear_with_the_norm_scale_in_the_probabilities():
    model = build("deepseek_v3", "lm")
    ids, mask = decoder_batch([6, 4], seed=5)
    model.config._attn_implementation = EXACT_ATTENTION  # the model's probabilities (eager's softmax is float32)
    own = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    model.config._attn_implementation = "sdpa"
    got = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.self_attn.kv_a_layernorm.register_forward_hook(
            lambda m, a, o, i=i: got.__setitem__(("latent", i), a[0].detach())))
        hooks.append(layer.self_attn.o_proj.register_forward_hook(
            lambda m, a, o, i=i: got.__setitem__(("out", i), o.detach())))
    layers = []
    try:
        with recording(model, get_adapter(model), layers.append, dtype=torch.float64):
            model(input_ids=ids, attention_mask=mask)
    finally:
        for h in hooks:
            h.remove()
    real = mask.bool()
    spec = get_adapter(model)
    for i, (t, layer) in enumerate(zip(layers, model.model.layers)):
        attn = layer.self_attn
        rank, nope, dv, heads = attn.kv_lora_rank, attn.qk_nope_head_dim, attn.v_head_dim, attn.num_heads
        x = t.ln1_out
        # explicit: latent c = x W_a[:rank] + b_a[:rank]; v~ = (c * gain) W_b^v per head; s = 1 / rms(c)
        c = x @ attn.kv_a_proj_with_mqa.weight[:rank].T + attn.kv_a_proj_with_mqa.bias[:rank]
        assert _rel(c, got[("latent", i)]) < 1e-13
        s = 1 / torch.sqrt(c.pow(2).mean(-1) + attn.kv_a_layernorm.eps)
        up = attn.kv_b_proj.weight.T.reshape(rank, heads, nope + dv)[..., nope:]
        v_tilde = torch.einsum("btr,r,rhd->bhtd", c, attn.kv_a_layernorm.weight, up)
        assert _rel(t.values, v_tilde) < 1e-13
        w_eff, b_eff = value_projection(layer, spec)
        assert _rel((x @ w_eff + b_eff).reshape(*x.shape[:2], heads, dv).transpose(1, 2), v_tilde) < 1e-13
        rows = t.probs.transpose(1, 2)[real]  # (tokens, H, S)
        assert _rel(rows, (own[i] * s[:, None, None, :]).transpose(1, 2)[real]) < 1e-13
        w_o = t.out_weight.reshape(heads, dv, -1)
        for e in range(x.shape[0]):
            for q in range(x.shape[1]):
                if not real[e, q]:
                    continue
                out = t.out_bias.clone()
                for head in range(heads):
                    for src in range(x.shape[1]):
                        out += t.probs[e, head, q, src] * (t.values[e, head, src] @ w_o[head])
                assert _rel(out, got[("out", i)][e, q]) < 1e-12


# --- clamped SwiGLU experts with biases -------------------------------------------------------------------

@torch.no_grad()
def test_clamped_swiglu_experts_are_the_explicit_loop_over_experts_and_neurons():
    model = build("gpt_oss", "lm")
    ids, mask = decoder_batch([6, 5], seed=4)
    experts = model.model.layers[0].mlp.experts
    got = {}

    def pre(mod, args):
        got["u"], got["index"], got["weights"] = (a.detach() for a in args[:3])

    def post(mod, args, out):
        got["out"] = out.detach()

    handles = [experts.register_forward_pre_hook(pre), experts.register_forward_hook(post)]
    try:
        model(input_ids=ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
    u, index, weights = got["u"], got["index"], got["weights"]
    lim, alpha = experts.limit, experts.alpha
    n, d = u.shape
    naive = torch.zeros(n, d, dtype=torch.float64)
    gates_clamped = ups_clamped = 0
    for tok in range(n):
        for slot in range(index.shape[1]):
            e, r = int(index[tok, slot]), weights[tok, slot]
            gate_up = u[tok] @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
            for f in range(gate_up.shape[0] // 2):
                a, b = float(gate_up[2 * f]), float(gate_up[2 * f + 1])
                gates_clamped += a > lim
                ups_clamped += abs(b) > lim
                c = min(a, lim)
                hidden = (max(-lim, min(b, lim)) + 1) * c / (1 + math.exp(-alpha * c))
                naive[tok] += r * hidden * experts.down_proj[e, f]
            naive[tok] += r * experts.down_proj_bias[e]
    assert gates_clamped > 0 and ups_clamped > 0  # the test exercises both clamps
    assert _rel(naive, got["out"]) < 1e-12
    routing = routing_scale(index, weights, experts.num_experts)
    ff = clamped_swiglu_ff_params(experts, "mlp.experts", u, routing, torch.float64, u.device, (1, n))
    h = ff.act(u @ ff.w_gate + ff.b_gate) * (u @ ff.w_in + ff.b_in) * ff.hidden_scale[0]
    assert ff.width == experts.num_experts * (experts.gate_up_proj.shape[-1] // 2 + 1)  # + one bias neuron per expert
    assert _rel(h @ ff.w_out, naive) < 1e-12


def test_clamped_gate_integrals_are_the_path_integrals():
    r"""I1 = int_0^1 g'(t a) t dt and I2 = int_0^1 g(t a) dt in closed form, also across the clamp's kink, against a
    2-million-point midpoint rule; a I1 + I2 = g(a) to rounding."""
    gate = ClampedSwiGLUGate(7.0, 1.702)
    a = torch.tensor([-30.0, -3.0, -0.4, 0.0, 0.3, 2.0, 6.9, 7.0, 7.5, 12.0, 40.0], dtype=torch.float64)
    i1, i2 = gate_integrals(a, gate)
    assert float((a * i1 + i2 - gate(a)).abs().max()) < 1e-14
    steps = 2_000_000
    t = (torch.arange(steps, dtype=torch.float64) + 0.5) / steps
    for k in range(a.shape[0]):
        x = (t * a[k]).requires_grad_(True)
        y = gate(x)
        (grad,) = torch.autograd.grad(y.sum(), x)
        assert abs(float((grad * t).mean() - i1[k])) < 1e-6  # the midpoint rule's own error at the kink: ~1e-7
        assert abs(float(y.detach().mean() - i2[k])) < 1e-10


# --- experts on the routing-scaled input (Llama 4) ---------------------------------------------------------

@torch.no_grad()
def test_input_scaled_experts_are_the_explicit_loop_over_experts():
    model = build("llama4_text", "lm")
    ids, mask = decoder_batch([6, 5], seed=4)
    layer = model.model.layers[1]
    moe = layer.feed_forward
    got = {}
    handles = [moe.register_forward_pre_hook(lambda m, a: got.__setitem__("u", a[0].detach())),
               moe.register_forward_hook(lambda m, a, o: got.__setitem__("out", o[0].detach())),
               moe.router.register_forward_hook(lambda m, a, o: got.__setitem__("scores", o[0].detach()))]
    try:
        model(input_ids=ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
    u, scores = got["u"].reshape(-1, got["u"].shape[-1]), got["scores"]
    ex, shared = moe.experts, moe.shared_expert
    f = ex.gate_up_proj.shape[-1] // 2
    silu = torch.nn.functional.silu
    naive = torch.zeros_like(u)
    for tok in range(u.shape[0]):
        naive[tok] = shared.down_proj(silu(shared.gate_proj(u[tok])) * shared.up_proj(u[tok]))
        for e in range(ex.gate_up_proj.shape[0]):
            x = scores[tok, e] * u[tok]  # the expert reads the scaled input
            for n in range(f):
                a, b = x @ ex.gate_up_proj[e, :, n], x @ ex.gate_up_proj[e, :, f + n]
                naive[tok] += silu(a) * b * ex.down_proj[e, n]
    assert float((scores > 0).sum(-1).max()) == 2 and float((scores == 0).sum()) > 0  # top-2 of 4, others exactly 0
    assert _rel(naive, got["out"]) < 1e-12
    rec = {"ln2_out": got["u"], "expert_scores": scores}
    ff = input_scaled_ff_params(layer, get_adapter(model).layer.ff, ex, rec, torch.float64, u.device)
    gated = ff.act((u @ ff.w_gate) * ff.gate_scale.reshape(u.shape[0], -1)) * (u @ ff.w_in) * ff.hidden_scale.reshape(
        u.shape[0], -1)
    assert _rel(gated @ ff.w_out, naive) < 1e-12


def test_llama4_with_its_query_temperature_is_exact_on_a_padded_batch():
    r"""Llama 4's NoPE layers scale the queries by a temperature of the absolute cache position: the model itself
    gives a left-padded example other logits than alone; the decompositions reproduce its own padded logits."""
    model = build("llama4_text", "lm", attn_temperature_tuning=True)
    assert model.config.no_rope_layers == [1, 0]  # layer 1 NoPE: its queries scaled by the temperature
    ids, mask = decoder_batch([6, 4], seed=3)
    logits = real_next_token_logits(model, ids, mask)
    with torch.no_grad():
        alone = model(input_ids=ids[1:, 2:]).logits[0, -1]
    assert float((alone - logits[1]).abs().max()) > 1e-3  # the model's own padding dependence
    target = logits.argmax(-1)
    res = ALTILogitAttribution(model, strict=True).decompose(ids, target=target, additional_forward_args=(mask,))
    assert _rel(res.scores.sum(-1) + res.no_token_total, logits.gather(1, target[:, None])[:, 0]) < 1e-10
    res = DecompXAttribution(model, strict=True).decompose(ids, target=5, additional_forward_args=mask)
    assert _rel(res.class_scores.sum(1) + res.bias_scores, logits[:, 5:6]) < 1e-10
    check_maps_complete(model, ids, (mask,))
