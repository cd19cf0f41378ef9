r"""Kimi Linear: Kimi Delta Attention mixers beside multi-head latent attention (``captum_normattr.arch.families.kimi``).

The delta attention against a naive per-token reference (from the module's own weights and the real input: the
convolutions by explicit taps, the per-key-channel-decay delta rule run step by step with its state matrix, once
per unit value at each source token and channel, the gated norm's scale from the real run): the recorded
per-channel mixing tensor, the values and the mixer output; every method (GlobEnc, ALTI, FF, DecompX,
ALTI-Logit, routes, the LLM API) on the tiny float64 Kimi Linear (tests/fixtures/zoo_kimi.py): token scores plus
no-token terms equal the model's own logit (relative 1e-10), a left-padded example equals the example alone, the
model is unchanged; the chunked kernel past one chunk; the mixer follows ``layer_types``; Kimi's own float32
kernels are caught by the consistency guard; Value Zeroing is refused with the reason.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from captum_normattr import (
    ALTIAttribution,
    ConsistencyError,
    UnsupportedModelError,
)
from captum_normattr.arch import ARCHITECTURES, lookup
from captum_normattr.arch.families.kimi import KIMI_DELTA_ATTENTION, KIMI_LINEAR
from captum_normattr.arch.registry import REFUSED, refusal
from captum_normattr.arch.spec import Attention, ValueProjection
from captum_normattr.attr.routes import InformationFlowRoutes
from captum_normattr.attr.value_zeroing import ValueZeroingAttribution
from captum_normattr.models.adapters import family_methods, get_adapter, layer_adapters, layer_modules
from captum_normattr.models.capture.kimi_delta import REBUILD_CHECK, kimi_delta_hooks
from hybrid_checks import check_every_method_exact, check_llm_continuation_exact
from decoder_models import decoder_batch
from layer_capture import capture_layers
from zoo_kimi import build_kimi
from map_checks import check_maps_complete

DT = torch.float64


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _naive_kda(kda: torch.nn.Module, u: torch.Tensor):
    r"""Kimi delta attention by explicit loops, from the module's weights and its (masked) input ``u`` (B, T, D).

    Returns (G (B, C, T, T), the value projection's output (B, T, C), the gated norm's output (B, T, C)).
    """
    w = {n: getattr(kda, n).weight.detach() for n in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj")}
    fg = kda.forget_gate
    bsz, t_len, _ = u.shape
    heads, d = kda.num_heads, kda.head_dim
    c_len = heads * d
    conv = kda.conv1d.weight.detach()[:, 0]  # (3C, K), tap K - 1 on the current token
    k_len = conv.shape[1]

    def causal(z: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(z)
        for t in range(t_len):
            for j in range(k_len):
                src = t - (k_len - 1) + j
                if src >= 0:
                    out[:, t] += taps[:, j] * z[:, src]
        return out

    def l2(x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    vu = u @ w["v_proj"].T
    pq = causal(u @ w["q_proj"].T, conv[:c_len])
    pk = causal(u @ w["k_proj"].T, conv[c_len:2 * c_len])
    pv = causal(vu, conv[2 * c_len:])
    q = l2(F.silu(pq).reshape(bsz, t_len, heads, d)) * d ** -0.5
    k = l2(F.silu(pk).reshape(bsz, t_len, heads, d))
    a = (u @ fg.f_a_proj.weight.detach().T) @ fg.f_b_proj.weight.detach().T + fg.dt_bias.detach()
    alpha = torch.exp(-fg.A_log.detach().exp().reshape(heads, 1) * F.softplus(a.reshape(bsz, t_len, heads, d)))
    beta = torch.sigmoid(u @ w["b_proj"].T)  # (B, T, H)
    gate = ((u @ w["g_a_proj"].T) @ w["g_b_proj"].T).reshape(bsz, t_len, heads, d)
    slope = torch.sigmoid(pv)

    def run(n: int, h: int, v: torch.Tensor) -> torch.Tensor:
        r"""The recurrence of head h of example n on values v (T, d): S_t = (I - b k k^T) diag(alpha) S + b k v^T."""
        state = torch.zeros(d, d, dtype=u.dtype)
        out = torch.zeros(t_len, d, dtype=u.dtype)
        for t in range(t_len):
            state = alpha[n, t, h][:, None] * state
            kt = k[n, t, h]
            state = state + beta[n, t, h] * torch.outer(kt, v[t] - state.T @ kt)
            out[t] = state.T @ q[n, t, h]
        return out

    core = torch.zeros(bsz, t_len, heads, d, dtype=u.dtype)
    values = F.silu(pv).reshape(bsz, t_len, heads, d)
    for n in range(bsz):
        for h in range(heads):
            core[n, :, h] = run(n, h, values[n, :, h])
    weight = kda.o_norm.weight.detach()
    scale = weight * torch.sigmoid(gate) / torch.sqrt(core.pow(2).mean(-1, keepdim=True) + kda.o_norm.variance_epsilon)
    g = torch.zeros(bsz, c_len, t_len, t_len, dtype=u.dtype)
    for n in range(bsz):
        for c in range(c_len):
            h, j = divmod(c, d)
            for s in range(t_len):
                unit = torch.zeros(t_len, d, dtype=u.dtype)  # a unit value at (s, c) through the convolution
                for t in range(s, min(t_len, s + k_len)):
                    unit[t, j] = slope[n, t, c] * conv[2 * c_len + c, s - t + k_len - 1]
                g[n, c, :, s] = scale[n, :, h, j] * run(n, h, unit)[:, j]
    return g, vu, (scale * core).reshape(bsz, t_len, c_len)


def test_recorded_mixing_is_the_naive_one_and_follows_layer_types():
    model = build_kimi("lm")
    ids, mask = decoder_batch([6, 4], seed=3)
    layers = capture_layers(model, ids, mask)
    adapter = get_adapter(model)
    kinds = [la.layer.attention.mixer for la in layer_adapters(model, adapter)]
    assert kinds == ["kimi_delta", "softmax", "kimi_delta", "kimi_delta"]
    for i, lt in enumerate(layers):
        module = layer_modules(model, adapter)[i]
        if kinds[i] == "softmax":  # latent attention: 4 heads, values of size v_head_dim
            assert lt.probs.shape == (2, 4, ids.shape[1], ids.shape[1]) and lt.values.shape[-1] == 5
            continue
        u = lt.ln1_out * mask[..., None].to(DT)  # the module zeroes its input at padding tokens
        g, vu, out = _naive_kda(module.self_attn, u)
        assert float(g[1, :, 2:, :2].abs().max()) > 0  # a unit value at a pad would reach later tokens through the conv,
        g = g * mask[:, None, None, :].to(DT)  # but pads' values are 0 (masked input): their columns are recorded as 0
        assert lt.probs.shape == (2, 12, ids.shape[1], ids.shape[1]) and lt.values.shape == (2, 12, ids.shape[1], 1)
        assert _rel(lt.probs, g) < 1e-12 and float(g.abs().max()) > 0
        assert _rel(lt.values[..., 0].transpose(1, 2), vu) < 1e-12
        assert _rel(out, lt.context.reshape(out.shape)) < 1e-12  # the naive mixer is the module's real output
        assert float(lt.checks[REBUILD_CHECK].max()) < 1e-13
        upper = torch.triu_indices(ids.shape[1], ids.shape[1], 1)
        assert float(lt.probs[:, :, upper[0], upper[1]].abs().max()) == 0  # causal
        assert float(lt.probs[1, :, :, :2].abs().max()) == 0  # padded sources carry nothing
    other = build_kimi("lm", layer_types=["full_attention", "linear_attention", "full_attention", "linear_attention"])
    kinds = [la.layer.attention.mixer for la in layer_adapters(other, get_adapter(other))]
    assert kinds == ["softmax", "kimi_delta", "softmax", "kimi_delta"]


def test_recorded_mixing_rebuilds_the_mixer_output_and_a_shifted_one_does_not():
    model = build_kimi("lm")
    ids, mask = decoder_batch([6, 4], seed=3)
    lt = capture_layers(model, ids, mask)[0]
    real = lt.ln2_in - lt.hidden_in
    assert _rel(lt.attention_sum(), real) < 1e-10
    ctx = torch.einsum("bhts,bhsd->bthd", lt.probs, lt.values).reshape(2, ids.shape[1], -1) @ lt.out_weight
    assert _rel(ctx, real) < 1e-10
    shifted = torch.roll(lt.probs, 1, dims=-1)
    wrong = torch.einsum("bhts,bhsd->bthd", shifted, lt.values).reshape(2, ids.shape[1], -1) @ lt.out_weight
    assert _rel(wrong, real) > 1e-3


def test_the_chunked_kernel_past_one_chunk_is_recorded_exactly():
    r"""70 tokens: transformers' chunked KDA runs two chunks of 64; G still rebuilds the real output."""
    model = build_kimi("bare", max_position_embeddings=128)
    ids = torch.randint(3, 50, (1, 70), generator=torch.Generator().manual_seed(5))
    for lt in capture_layers(model, ids):
        assert _rel(lt.attention_sum(), lt.ln2_in - lt.hidden_in) < 1e-10
        if lt.probs.shape[1] == 12:
            assert float(lt.checks[REBUILD_CHECK].max()) < 1e-12


def test_kimi_linear_is_registered_and_no_longer_refused():
    assert ARCHITECTURES["kimi_linear"] is KIMI_LINEAR and lookup("kimi_linear") is KIMI_LINEAR
    assert "kimi_linear" not in REFUSED and refusal("kimi_linear") is None
    assert family_methods(KIMI_LINEAR) == ("GlobEnc", "ALTI", "FF", "DecompX", "ALTI-Logit")
    assert "Kimi delta attention mixer layers" in KIMI_LINEAR.features()
    assert "multi-head latent attention" in KIMI_LINEAR.features()
    assert KIMI_LINEAR.mixer_summary() == "softmax attention (latent values) + Kimi delta attention, per layer type"
    model = build_kimi("lm")
    assert not hasattr(model.model, "rotary_emb")  # Kimi's latent attention has no rotary positions (NoPE)


def test_every_method_is_exact_padding_free_and_leaves_the_model():
    model = build_kimi("lm")
    check_every_method_exact(model)


def test_bare_model_maps_are_complete():
    model = build_kimi("bare")
    ids, mask = decoder_batch([6, 4], seed=9)
    check_maps_complete(model, ids, (mask,))


def test_llm_api_explains_a_continuation_exactly():
    model = build_kimi("lm")
    check_llm_continuation_exact(model)


def test_the_zoos_float64_kernels_are_the_familys_own_and_a_changed_mixer_output_is_caught():
    r"""Kimi's own code (float32 norms and KDA kernels in a float64 model) computes the same function to float32's
    rounding, which the rebuild check measures (inside float64's guard tolerance); a hook that changes the mixer's
    output (what G does not describe) is refused, even without strict."""
    ids, mask = decoder_batch([6, 4], seed=12)
    own, exact = build_kimi("lm", exact_norms=False), build_kimi("lm")
    with torch.no_grad():
        a = own(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        b = exact(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    assert _rel(a, b) < 1e-5
    checks = capture_layers(own, ids, mask)[0].checks
    assert 1e-9 < float(checks[REBUILD_CHECK].max()) < 1e-5
    norm = layer_modules(exact, get_adapter(exact))[2].self_attn.o_norm
    handle = norm.register_forward_hook(lambda mod, args, out: out * 1.5)
    try:
        with pytest.raises(ConsistencyError, match="Kimi delta attention output vs its mixing rebuilt"):
            ALTIAttribution(exact).decompose(ids, additional_forward_args=(mask,))
    finally:
        handle.remove()


def test_value_zeroing_is_refused_with_the_reason():
    with pytest.raises(UnsupportedModelError, match="Value Zeroing.*kimi_delta"):
        ValueZeroingAttribution(build_kimi("lm"))


def test_mixer_descriptions_are_validated():
    with pytest.raises(ValueError, match="names its conv"):
        Attention("self_attn", out="self_attn.o_proj", value=ValueProjection("self_attn.v_proj"), mixer="kimi_delta")
    with pytest.raises(ValueError, match="kimi_delta mixer reads its values"):
        replace(KIMI_DELTA_ATTENTION, value=ValueProjection("self_attn.qkv", "fused", 2, 3))
    with pytest.raises(ValueError, match="kimi_delta mixer reads its values"):
        replace(KIMI_DELTA_ATTENTION, value=None)
    with pytest.raises(ValueError, match="mixer_types"):
        replace(KIMI_LINEAR, layer=replace(KIMI_LINEAR.layer, mixer_types=None))
    # a module that is not Kimi's delta attention: the capture names the parts it lacks
    model = build_kimi("lm")
    layer = layer_modules(model, get_adapter(model))[1]  # a latent-attention layer
    wrong = replace(KIMI_LINEAR, layer=replace(KIMI_LINEAR.layer, attention=KIMI_DELTA_ATTENTION, mixers=(),
                                               mixer_types=None))
    with pytest.raises(ValueError, match=r"no \['k_proj', 'v_proj', 'forget_gate', 'b_proj', 'o_norm'\]"):
        kimi_delta_hooks(None, 1, layer, wrong)


@pytest.mark.parametrize("last", ["linear_attention", "full_attention"])
def test_routes_head_tables_span_layers_with_different_head_counts(last):
    r"""A delta-attention layer has one head per channel (12), a latent-attention layer 4: the (L, H) tables take
    the largest, whichever layer runs last."""
    model = build_kimi("lm", layer_types=["linear_attention", "full_attention", "linear_attention", last])
    ids = torch.randint(3, 50, (1, 6), generator=torch.Generator().manual_seed(0))
    g = InformationFlowRoutes(model).attribute(ids, threshold=0.0, granularity="head")
    assert g.num_heads == 12
    table = g.head_importance()
    assert table.shape == (4, 12) and float(table[1, 4:].abs().max()) == 0 and float(table[0].sum()) > 0
