r"""Gated DeltaNet and Mamba-2 mixing tensors (docs/linear_mixers.md) against transformers' modules and naive loops.

Three checks per mixer, all float64:

* the per-channel mixing G rebuilt by explicit Python loops over targets, sources and kernel taps
  (products of the per-step matrices, no shared code with the primitive) equals the primitive's;
* Sigma_s G[t, s] u_s + n_t, through the module's ``out_proj``, equals the transformers module's own
  output (its torch path: ``torch_chunk_gated_delta_rule`` / ``mamba2_chunk_scan``), with the
  coefficients recomputed from the module's weights and its gated norm's input recorded by a hook:
  (a) as the module runs, whose kernels cast to float32, at a tolerance from float32's epsilon;
  (b) with those float32 casts promoted to float64 for the call, to 1e-12 relative;
* M applied to values equals the recurrence written step by step, and for Kimi Delta Attention
  (a decay per key channel) transformers' own ``recurrent_kimi_delta_attention``;
* G is causal, target tiles of G concatenate to the whole, and the chunked kernels are covered
  (sequences longer than a chunk); Qwen3.5's ``Qwen3_5GatedDeltaNet`` as well as Qwen3-Next's.
"""

import pytest
import torch
import torch.nn.functional as F

from captum_normattr.decompose.primitives.linear_mixers import (
    apply_channel_mixing,
    conv_composed_mixing,
    delta_rule_mixing,
    gated_delta_net_mixing,
    gated_rmsnorm_scale,
    mamba2_mixing,
    silu_slope,
    ssd_mixing,
)

transformers = pytest.importorskip("transformers")
from transformers.models.kimi_linear import modeling_kimi_linear  # noqa: E402
from transformers.models.mamba2 import modeling_mamba2  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next  # noqa: E402
from zoo_kimi import float32_as_float64  # noqa: E402

DT = torch.float64


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max() / b.detach().abs().max())


def _causal_conv(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    r"""(B, T, C) through a depthwise causal conv of (C, K) weights, no activation."""
    k = weight.shape[1]
    return F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=k - 1, groups=x.shape[-1])[..., :x.shape[1]].transpose(1, 2)


def _record_norm_input(module, x):
    r"""The real forward's output and its gated norm's (core, gate) inputs, by a forward hook on ``module.norm``."""
    seen = {}
    handle = module.norm.register_forward_hook(lambda m, args, out: seen.update(core=args[0], gate=args[1]))
    try:
        with torch.no_grad():
            out = module(x)
    finally:
        handle.remove()
    return out, seen["core"], seen["gate"]


# ------------------------------------------------------------------------------------------- Gated DeltaNet
def _gdn_module(seed: int = 0, key_heads: int = 2, value_heads: int = 4):
    cfg = transformers.Qwen3NextConfig(
        hidden_size=24, linear_num_key_heads=key_heads, linear_num_value_heads=value_heads, linear_key_head_dim=8,
        linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=1, layer_types=["linear_attention"],
        rms_norm_eps=1e-6, num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=16)
    torch.manual_seed(seed)
    mod = modeling_qwen3_next.Qwen3NextGatedDeltaNet(cfg, layer_idx=0).to(DT)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn_like(p) * 0.4)
        mod.A_log.copy_(torch.rand_like(mod.A_log) * 2 - 1.5)
        mod.norm.weight.add_(1.0)
    return mod.eval()


def _gdn_record(mod, x, core, gate):
    r"""Every coefficient of the real forward, recomputed from the module's weights as its forward does."""
    bsz, length, _ = x.shape
    if hasattr(mod, "in_proj_qkvz"):  # Qwen3-Next: head-interleaved fused projections
        q, k, v, _, b, a = mod.fix_query_key_value_ordering(mod.in_proj_qkvz(x), mod.in_proj_ba(x))
        q, k, u = (t.reshape(bsz, length, -1) for t in (q, k, v))
    else:  # Qwen3.5: one projection per part
        q, k, u = mod.in_proj_qkv(x).split([mod.key_dim, mod.key_dim, mod.value_dim], -1)
        b, a = mod.in_proj_b(x), mod.in_proj_a(x)
    weight = mod.conv1d.weight[:, 0]
    pre = _causal_conv(torch.cat([q, k, u], -1), weight, mod.conv1d.bias)
    pq, pk, pv = pre.split([mod.key_dim, mod.key_dim, mod.value_dim], -1)
    query = modeling_qwen3_next.l2norm(F.silu(pq).reshape(bsz, length, -1, mod.head_k_dim), eps=1e-6)
    key = modeling_qwen3_next.l2norm(F.silu(pk).reshape(bsz, length, -1, mod.head_k_dim), eps=1e-6)
    beta = b.sigmoid()
    log_decay = -mod.A_log.float().exp() * F.softplus(a.float() + mod.dt_bias)
    scale = gated_rmsnorm_scale(core.reshape(bsz, length, -1), gate.reshape(bsz, length, -1), mod.norm.weight,
                                mod.norm.variance_epsilon, mod.head_v_dim, norm_before_gate=True)
    return dict(query=query, key=key, beta=beta, log_decay=log_decay, value_pre_activation=pv,
                conv_weight=weight[2 * mod.key_dim:], target_scale=scale), u


def _naive_delta_G(query, key, beta, log_decay, pre_v, conv_w, scale_out, v_heads):
    r"""G by explicit loops: M[t, s] = beta_s k_s^T A_{s+1} ... A_t q_t / sqrt(d), then conv taps and scale."""
    bsz, length, k_heads, d = query.shape
    channels = pre_v.shape[-1]
    dv = channels // v_heads
    kernel = conv_w.shape[1]
    G = torch.zeros(bsz, length, length, channels, dtype=DT)
    eye = torch.eye(d, dtype=DT)
    for bi in range(bsz):
        for h in range(v_heads):
            kh = h // (v_heads // k_heads)
            M = torch.zeros(length, length, dtype=DT)
            for t in range(length):
                for s in range(t + 1):
                    P = eye.clone()
                    for r in range(s + 1, t + 1):
                        kr = key[bi, r, kh]
                        P = P @ (log_decay[bi, r, h].exp() * (eye - beta[bi, r, h] * torch.outer(kr, kr)))
                    M[t, s] = beta[bi, s, h] * key[bi, s, kh] @ P @ query[bi, t, kh] / d ** 0.5
            for c in range(h * dv, (h + 1) * dv):
                for t in range(length):
                    for s in range(t + 1):
                        slope = torch.sigmoid(pre_v[bi, s, c])
                        for j in range(kernel):
                            src = s + j - (kernel - 1)
                            if src >= 0:
                                G[bi, t, src, c] += scale_out[bi, t, c] * M[t, s] * slope * conv_w[c, j]
    return G


@pytest.mark.parametrize("value_heads", [2, 4])
def test_gated_delta_net_equals_naive_loops(value_heads):
    mod = _gdn_module(seed=1, value_heads=value_heads)
    x = torch.randn(2, 7, 24, dtype=DT, generator=torch.Generator().manual_seed(2))
    _, core, gate = _record_norm_input(mod, x)
    rec, _ = _gdn_record(mod, x, core, gate)
    G, no_token = gated_delta_net_mixing(**rec)
    assert no_token is None
    naive = _naive_delta_G(rec["query"], rec["key"], rec["beta"], rec["log_decay"], rec["value_pre_activation"],
                           rec["conv_weight"], rec["target_scale"], value_heads)
    assert _rel(G, naive) < 1e-12
    assert torch.all(G.permute(0, 3, 1, 2).triu(1) == 0)  # causal: no source after its target


@pytest.mark.parametrize("length", [9, 70])  # 70 > the kernel's chunk of 64: two chunks
def test_gated_delta_net_reproduces_the_transformers_module(length):
    mod = _gdn_module(seed=3)
    x = torch.randn(2, length, 24, dtype=DT, generator=torch.Generator().manual_seed(4))
    # (a) the module as it runs (its delta-rule kernel and gated norm compute in float32)
    out, core, gate = _record_norm_input(mod, x)
    rec, u = _gdn_record(mod, x, core, gate)
    G, no_token = gated_delta_net_mixing(**rec)
    mine = mod.out_proj(apply_channel_mixing(G, u, no_token))
    assert _rel(mine, out) < 200 * torch.finfo(torch.float32).eps
    # (b) the same torch code with its float32 casts promoted to float64: exact
    with float32_as_float64(modeling_qwen3_next):
        out64, core64, gate64 = _record_norm_input(mod, x)
        rec64, u = _gdn_record(mod, x, core64, gate64)
    G64, no_token = gated_delta_net_mixing(**rec64)
    mine64 = mod.out_proj(apply_channel_mixing(G64, u, no_token))
    assert _rel(mine64, out64) < 1e-12
    # the core itself (before the norm) from the unscaled mixing
    bare, _ = gated_delta_net_mixing(**{**rec64, "target_scale": None})
    assert _rel(apply_channel_mixing(bare, u), core64.reshape(x.shape[0], length, -1)) < 1e-12


def test_qwen3_5_gated_delta_net_reproduces_the_transformers_module():
    r"""Qwen3.5's layer (separate q/k/v, z, b, a projections) is the same mixer: exact with the casts lifted."""
    cfg = transformers.Qwen3_5TextConfig(
        hidden_size=24, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=1, layer_types=["linear_attention"],
        rms_norm_eps=1e-6, num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=16)
    torch.manual_seed(15)
    mod = modeling_qwen3_5.Qwen3_5GatedDeltaNet(cfg, layer_idx=0).to(DT).eval()
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn_like(p) * 0.4)
        mod.A_log.copy_(torch.rand_like(mod.A_log) * 2 - 1.5)
    x = torch.randn(2, 66, 24, dtype=DT, generator=torch.Generator().manual_seed(16))
    out, core, gate = _record_norm_input(mod, x)
    rec, u = _gdn_record(mod, x, core, gate)
    G, no_token = gated_delta_net_mixing(**rec)
    assert _rel(mod.out_proj(apply_channel_mixing(G, u, no_token)), out) < 200 * torch.finfo(torch.float32).eps
    with float32_as_float64(modeling_qwen3_5):
        out64, core64, gate64 = _record_norm_input(mod, x)
        rec64, u = _gdn_record(mod, x, core64, gate64)
    G64, no_token = gated_delta_net_mixing(**rec64)
    assert _rel(mod.out_proj(apply_channel_mixing(G64, u, no_token)), out64) < 1e-12


@pytest.mark.parametrize("block", [1, 5, 64])
def test_delta_rule_mixing_is_the_recurrence(block):
    r"""M applied to arbitrary values equals the state recurrence written out step by step (any block size)."""
    g = torch.Generator().manual_seed(5)
    bsz, length, heads, d, dv = 2, 13, 3, 5, 4
    q = F.normalize(torch.randn(bsz, length, heads, d, dtype=DT, generator=g), dim=-1)
    k = F.normalize(torch.randn(bsz, length, heads, d, dtype=DT, generator=g), dim=-1)
    beta = torch.rand(bsz, length, heads, dtype=DT, generator=g)
    log_decay = -torch.rand(bsz, length, heads, dtype=DT, generator=g)
    v = torch.randn(bsz, length, heads, dv, dtype=DT, generator=g)
    M = delta_rule_mixing(q, k, beta, log_decay, scale=0.7, block=block)
    state = torch.zeros(bsz, heads, d, dv, dtype=DT)
    for t in range(length):
        state = state * log_decay[:, t].exp()[..., None, None]
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t])) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        want = torch.einsum("bhkv,bhk->bhv", state, 0.7 * q[:, t])
        got = torch.einsum("bhs,bshv->bhv", M[:, :, t], v)
        assert _rel(got, want) < 1e-12
    assert torch.all(M.triu(1) == 0)


@pytest.mark.parametrize("block", [1, 4, 64])
def test_kda_per_channel_decay_equals_the_kimi_kernels(block):
    r"""Kimi Delta Attention (a decay per key channel): M against transformers' recurrent and chunked KDA."""
    g = torch.Generator().manual_seed(14)
    bsz, length, heads, d, dv = 2, 21, 2, 6, 3
    q = F.normalize(torch.randn(bsz, length, heads, d, dtype=DT, generator=g), dim=-1)
    k = F.normalize(torch.randn(bsz, length, heads, d, dtype=DT, generator=g), dim=-1)
    beta = torch.rand(bsz, length, heads, dtype=DT, generator=g)
    log_decay = -torch.rand(bsz, length, heads, d, dtype=DT, generator=g)
    v = torch.randn(bsz, length, heads, dv, dtype=DT, generator=g)
    M = delta_rule_mixing(q, k, beta, log_decay, block=block)
    got = torch.einsum("bhts,bshv->bthv", M, v)
    with float32_as_float64(modeling_kimi_linear):
        recurrent, _ = modeling_kimi_linear.recurrent_kimi_delta_attention(q, k, v, log_decay, beta, None, False)
    assert recurrent.dtype == DT and _rel(got, recurrent) < 1e-12
    # scalar decay given per channel is the scalar decay
    scalar = -torch.rand(bsz, length, heads, dtype=DT, generator=g)
    assert _rel(delta_rule_mixing(q, k, beta, scalar.unsqueeze(-1).expand(-1, -1, -1, d), block=block),
                delta_rule_mixing(q, k, beta, scalar, block=block)) < 1e-13


# ---------------------------------------------------------------------------------------------------- Mamba-2
def _mamba_module(seed: int = 0, groups: int = 2, conv_bias: bool = True):
    cfg = transformers.Mamba2Config(
        hidden_size=16, num_heads=4, head_dim=8, expand=2, state_size=5, n_groups=groups, conv_kernel=4,
        use_conv_bias=conv_bias, use_bias=False, chunk_size=8, num_hidden_layers=1, vocab_size=32)
    torch.manual_seed(seed)
    mod = modeling_mamba2.Mamba2Mixer(cfg, layer_idx=0).to(DT)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn_like(p) * 0.4)
        mod.A_log.copy_(torch.rand_like(mod.A_log) * 2 - 1.0)
        mod.norm.weight.add_(1.0)
    return mod.eval()


def _mamba_record(mod, x, core, gate):
    r"""Every coefficient of the real forward (torch path), recomputed from the module's weights."""
    bsz, length, _ = x.shape
    inner, groups, state = mod.intermediate_size, mod.n_groups, mod.ssm_state_size
    _, xbc, dt = mod.in_proj(x).split([inner, mod.conv_dim, mod.num_heads], -1)
    weight, bias = mod.conv1d.weight[:, 0], mod.conv1d.bias
    pre = _causal_conv(xbc, weight, bias)
    pre_x, pre_b, pre_c = pre.split([inner, groups * state, groups * state], -1)
    dt = torch.clamp(F.softplus(dt + mod.dt_bias), *mod.time_step_limit)
    scale = gated_rmsnorm_scale(core, gate, mod.norm.weight, mod.norm.variance_epsilon, mod.norm.group_size,
                                norm_before_gate=False)
    rec = dict(dt=dt, A=-torch.exp(mod.A_log.float()).to(DT), B=F.silu(pre_b).reshape(bsz, length, groups, state),
               C=F.silu(pre_c).reshape(bsz, length, groups, state), D=mod.D, x_pre_activation=pre_x,
               conv_weight=weight[:inner], target_scale=scale,
               conv_bias=bias[:inner] if bias is not None else None)
    return rec, xbc[..., :inner]


def _naive_ssd_G(rec, heads):
    r"""G by explicit loops: M[t, s] = C_t.B_s exp(sum_{r=s+1..t} dt_r A) dt_s + D [s = t], conv taps, scale."""
    dt, A, B, C, D = rec["dt"], rec["A"], rec["B"], rec["C"], rec["D"]
    pre_x, conv_w, scale_out, bias = rec["x_pre_activation"], rec["conv_weight"], rec["target_scale"], rec["conv_bias"]
    bsz, length, channels = pre_x.shape
    per_head, per_group = channels // heads, heads // B.shape[2]
    kernel = conv_w.shape[1]
    G = torch.zeros(bsz, length, length, channels, dtype=DT)
    n = torch.zeros(bsz, length, channels, dtype=DT)
    for bi in range(bsz):
        for c in range(channels):
            h = c // per_head
            grp = h // per_group
            for t in range(length):
                for s in range(t + 1):
                    decay = 1.0
                    for r in range(s + 1, t + 1):
                        decay = decay * torch.exp(dt[bi, r, h] * A[h])
                    m = (C[bi, t, grp] @ B[bi, s, grp]) * decay * dt[bi, s, h] + (D[h] if s == t else 0.0)
                    weight = scale_out[bi, t, c] * m * torch.sigmoid(pre_x[bi, s, c])
                    n[bi, t, c] += weight * bias[c]
                    for j in range(kernel):
                        src = s + j - (kernel - 1)
                        if src >= 0:
                            G[bi, t, src, c] += weight * conv_w[c, j]
    return G, n


def test_mamba2_equals_naive_loops():
    mod = _mamba_module(seed=6)
    x = torch.randn(2, 6, 16, dtype=DT, generator=torch.Generator().manual_seed(7))
    _, core, gate = _record_norm_input(mod, x)
    rec, _ = _mamba_record(mod, x, core, gate)
    G, no_token = mamba2_mixing(**rec)
    naive_G, naive_n = _naive_ssd_G(rec, mod.num_heads)
    assert _rel(G, naive_G) < 1e-12 and _rel(no_token, naive_n) < 1e-12


@pytest.mark.parametrize("groups,conv_bias,length", [(2, True, 11), (1, False, 20), (4, True, 5)])
def test_mamba2_reproduces_the_transformers_module(groups, conv_bias, length):
    mod = _mamba_module(seed=8, groups=groups, conv_bias=conv_bias)
    x = torch.randn(2, length, 16, dtype=DT, generator=torch.Generator().manual_seed(9))
    out, core, gate = _record_norm_input(mod, x)  # (a) as it runs: the chunk scan computes in float32
    rec, u = _mamba_record(mod, x, core, gate)
    G, no_token = mamba2_mixing(**rec)
    assert (no_token is None) == (not conv_bias)
    assert _rel(mod.out_proj(apply_channel_mixing(G, u, no_token)), out) < 200 * torch.finfo(torch.float32).eps
    with float32_as_float64(modeling_mamba2):  # (b) its float32 casts promoted to float64: exact
        out64, core64, gate64 = _record_norm_input(mod, x)
        rec64, u = _mamba_record(mod, x, core64, gate64)
    G64, no_token = mamba2_mixing(**rec64)
    assert _rel(mod.out_proj(apply_channel_mixing(G64, u, no_token)), out64) < 1e-12
    bare, bare_n = mamba2_mixing(**{**rec64, "target_scale": None})
    assert _rel(apply_channel_mixing(bare, u, bare_n), core64) < 1e-12


def test_ssd_mixing_is_the_recurrence():
    g = torch.Generator().manual_seed(10)
    bsz, length, heads, groups, n, p = 2, 9, 4, 2, 3, 5
    dt = torch.rand(bsz, length, heads, dtype=DT, generator=g)
    A = -torch.rand(heads, dtype=DT, generator=g) * 2
    B = torch.randn(bsz, length, groups, n, dtype=DT, generator=g)
    C = torch.randn(bsz, length, groups, n, dtype=DT, generator=g)
    D = torch.randn(heads, dtype=DT, generator=g)
    x = torch.randn(bsz, length, heads, p, dtype=DT, generator=g)
    M = ssd_mixing(dt, A, B, C, D)
    Bh, Ch = B.repeat_interleave(2, dim=2), C.repeat_interleave(2, dim=2)
    h = torch.zeros(bsz, heads, n, p, dtype=DT)
    for t in range(length):
        h = torch.exp(dt[:, t] * A)[..., None, None] * h + dt[:, t, :, None, None] * Bh[:, t, :, :, None] * x[:, t, :, None, :]
        want = torch.einsum("bhnp,bhn->bhp", h, Ch[:, t]) + D[:, None] * x[:, t]
        assert _rel(torch.einsum("bhs,bshp->bhp", M[:, :, t], x), want) < 1e-12


# ------------------------------------------------------------------------------------------------ small parts
def test_silu_slope_and_gated_norm_scale_are_exact():
    a = torch.randn(3, 7, dtype=DT)
    assert _rel(silu_slope(a) * a, F.silu(a)) < 1e-15
    core, gate = torch.randn(2, 3, 8, dtype=DT), torch.randn(2, 3, 8, dtype=DT)
    norm = modeling_mamba2.Mamba2RMSNormGated(8, group_size=4, eps=1e-5).to(DT)
    with torch.no_grad():
        norm.weight.normal_()
    with float32_as_float64(modeling_mamba2):
        want = norm(core, gate)
    assert _rel(gated_rmsnorm_scale(core, gate, norm.weight, 1e-5, 4, norm_before_gate=False) * core, want) < 1e-14


def test_conv_composition_with_identity_mixing_is_the_convolution():
    r"""With M = I and unit scale, G is the depthwise convolution itself and n its bias times the slope."""
    g = torch.Generator().manual_seed(11)
    bsz, length, heads, channels, kernel = 1, 6, 2, 4, 3
    u = torch.randn(bsz, length, channels, dtype=DT, generator=g)
    w, b = torch.randn(channels, kernel, dtype=DT, generator=g), torch.randn(channels, dtype=DT, generator=g)
    pre = _causal_conv(u, w, b)
    G, n = conv_composed_mixing(torch.eye(length, dtype=DT).expand(bsz, heads, length, length), silu_slope(pre), w,
                                conv_bias=b)
    assert _rel(apply_channel_mixing(G, u, n), F.silu(pre)) < 1e-14


def test_shape_errors_are_actionable():
    with pytest.raises(ValueError, match="multiple of"):
        delta_rule_mixing(torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 3), torch.zeros(1, 3, 3))
    with pytest.raises(ValueError, match="conv_weight"):
        conv_composed_mixing(torch.zeros(1, 2, 3, 3), torch.zeros(1, 3, 4), torch.zeros(3, 2))


def test_target_tiles_concatenate_to_the_whole():
    r"""G computed per tile of targets (the way to bound its T x S x C memory) equals the whole G."""
    mod = _mamba_module(seed=12)
    x = torch.randn(1, 10, 16, dtype=DT, generator=torch.Generator().manual_seed(13))
    _, core, gate = _record_norm_input(mod, x)
    rec, u = _mamba_record(mod, x, core, gate)
    whole, whole_n = mamba2_mixing(**rec)
    tiles = [mamba2_mixing(**rec, rows=slice(lo, lo + 4)) for lo in range(0, 10, 4)]
    assert torch.equal(torch.cat([g for g, _ in tiles], 1), whole)
    assert torch.equal(torch.cat([n for _, n in tiles], 1), whole_n)
    assert _rel(apply_channel_mixing(tiles[1][0], u, tiles[1][1]), apply_channel_mixing(whole, u, whole_n)[:, 4:8]) < 1e-15
