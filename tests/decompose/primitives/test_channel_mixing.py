r"""The factored per-channel mixing (decompose/primitives/channel_mixing.py) against its dense tensor, float64.

The dense reference is built here by explicit loops over targets, sources, channels and taps
(G[n, t, s] = gamma_{t,n} rho_{s,n} sum_j w[n, j] M_h[t, s + l_j] sigma[s + l_j, n]), and, for the
recurrences, by the existing dense builders of linear_mixers.py.
"""
from __future__ import annotations

import pytest
import torch

from captum_normattr.decompose.primitives.channel_mixing import DENSE_MIXING_ENV, ChannelMixing, channel_parts_rows
from captum_normattr.decompose.primitives.linear_mixers import conv_composed_mixing, delta_rule_mixing, silu_slope

DT = torch.float64


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _naive_dense(g: ChannelMixing) -> torch.Tensor:
    b, n, t, _ = g.shape
    k = g.kernel
    head = {}
    for h, n0, n1 in g.head_ranges:
        for c in range(n0, n1):
            head.setdefault(c, []).append(h)
    out = torch.zeros(b, n, t, t, dtype=DT)
    for bi in range(b):
        for c in range(n):
            for tt in range(t):
                for s in range(t):
                    acc = 0.0
                    for j in range(k):
                        r = s + k - 1 - j
                        if r >= t:
                            continue
                        m = float(tt == r) if g.mixing is None else sum(float(g.mixing[bi, h, tt, r]) for h in head[c])
                        sig = 1.0 if g.slope is None else float(g.slope[bi, r, c])
                        acc += float(g.conv_weight[c, j]) * m * sig
                    gam = 1.0 if g.target_scale is None else float(g.target_scale[bi, tt, c])
                    rho = 1.0 if g.source_scale is None else float(g.source_scale[bi, s, c])
                    out[bi, c, tt, s] = gam * rho * acc
    return out


def _random(identity: bool, seed: int = 0, b: int = 2, t: int = 7, heads: int = 2, per: int = 3, k: int = 3,
            repeat: bool = False, uneven: bool = False) -> ChannelMixing:
    gen = torch.Generator().manual_seed(seed)
    n = heads * per
    ranges = [(h, h * per, (h + 1) * per) for h in range(heads)]
    if uneven:  # ranges of different sizes: the per-range path of ChannelMixing.rows
        ranges = [(0, 0, 2), (1, 2, n)]
    if repeat:  # a second copy of the channels (Mamba-2's bias heads) reading the same heads
        ranges += [(h, n + h * per, n + (h + 1) * per) for h in range(heads)]
        n *= 2
    mixing = None if identity else torch.randn(b, heads, t, t, generator=gen, dtype=DT).tril()
    return ChannelMixing(mixing, ranges, torch.randn(n, k, generator=gen, dtype=DT),
                         torch.rand(b, t, n, generator=gen, dtype=DT), torch.randn(b, t, n, generator=gen, dtype=DT),
                         torch.rand(b, t, n, generator=gen, dtype=DT))


@pytest.mark.parametrize("identity,repeat,uneven", [(False, False, False), (True, False, False), (False, True, False),
                                                    (False, False, True)])
def test_factored_operations_equal_the_naive_dense_tensor(identity, repeat, uneven):
    g = _random(identity, repeat=repeat, uneven=uneven)
    ref = _naive_dense(g)
    assert _rel(g.dense(), ref) < 1e-14
    b, n, t, _ = g.shape
    u = torch.randn(b, n, t, 1, dtype=DT)
    assert _rel(g.context(u), ref @ u) < 1e-13
    y = torch.randn(3, b, t, n, dtype=DT)  # a stack of cotangents
    want = torch.einsum("bnts,kbtn->kbsn", ref, y)
    assert _rel(g.transposed_context(y), want) < 1e-13
    assert _rel(g.diagonal(), torch.diagonal(ref, dim1=-2, dim2=-1)) < 1e-14
    assert _rel(g.rows(2, 5, 4), ref[:, :, 2:5, :4].permute(0, 2, 3, 1)) < 1e-14
    assert _rel(g.mean_over_heads(), ref.mean(1)) < 1e-14
    assert _rel(g.with_columns(4).dense(), ref[..., :4]) < 1e-14
    assert _rel(g[..., :5].rows(0, t), ref[..., :5].permute(0, 2, 3, 1)) < 1e-14
    w = torch.randn(n, 1, 5, dtype=DT)
    parts = channel_parts_rows(g, u, w, 1, 6)
    want_parts = torch.einsum("bnts,bns,nd->btsd", ref[:, :, 1:6], u[..., 0], w[:, 0])
    assert _rel(parts, want_parts) < 1e-13
    one = g.select(torch.tensor([1]))
    assert _rel(one.dense(), ref[1:]) < 1e-14
    moved = g.cpu().float()
    assert isinstance(moved, ChannelMixing) and moved.dtype == torch.float32 and g.double().dtype == DT
    assert _rel(moved.dense().double(), ref) < 1e-6


def test_truncation_of_a_causal_mixing_is_the_mixing_of_the_prefix():
    g = _random(False)
    assert _rel(g.truncate(4).dense(), g.dense()[:, :, :4, :4]) < 1e-15
    scale = torch.rand(2, 7, dtype=DT)
    assert _rel(g.scale_sources(scale).dense(), g.dense() * scale[:, None, None, :]) < 1e-15


def test_the_delta_rule_mixing_factored_equals_the_dense_builder():
    gen = torch.Generator().manual_seed(1)
    b, t, hk, h, d, dv, k = 1, 9, 1, 2, 4, 3, 4
    q = torch.nn.functional.normalize(torch.randn(b, t, hk, d, generator=gen, dtype=DT), dim=-1)
    kk = torch.nn.functional.normalize(torch.randn(b, t, hk, d, generator=gen, dtype=DT), dim=-1)
    m = delta_rule_mixing(q, kk, torch.rand(b, t, h, generator=gen, dtype=DT), -torch.rand(b, t, h, generator=gen, dtype=DT))
    pre = torch.randn(b, t, h * dv, generator=gen, dtype=DT)
    w = torch.randn(h * dv, k, generator=gen, dtype=DT)
    scale = torch.randn(b, t, h * dv, generator=gen, dtype=DT)
    dense, _ = conv_composed_mixing(m, silu_slope(pre), w, scale)
    g = ChannelMixing(m, [(i, i * dv, (i + 1) * dv) for i in range(h)], w, silu_slope(pre), scale, None)
    assert _rel(g.dense(), dense.permute(0, 3, 1, 2)) < 1e-14
    bare = ChannelMixing(m, g.head_ranges, w, None, None, None)  # the shape from the mixing alone
    assert bare.shape == (b, h * dv, t, t)
    assert _rel(bare.dense(), conv_composed_mixing(m, torch.ones_like(pre), w)[0].permute(0, 3, 1, 2)) < 1e-14
    with pytest.raises(ValueError, match="no token count"):
        ChannelMixing(None, [(0, 0, 2)], torch.ones(2, 1, dtype=DT), None, None, None).shape


def test_any_other_use_answers_on_the_dense_tensor_or_raises_when_told(monkeypatch):
    g = _random(False)
    ref = g.dense()
    assert _rel(torch.matmul(g, torch.ones(7, 1, dtype=DT)), ref @ torch.ones(7, 1, dtype=DT)) < 1e-14
    assert _rel(g.mean(1), ref.mean(1)) < 1e-14
    assert _rel(g[:, :, 2], ref[:, :, 2]) < 1e-15
    assert tuple(g.shape) == tuple(ref.shape) and g.dtype == DT
    monkeypatch.setenv(DENSE_MIXING_ENV, "error")
    g.context(torch.ones(2, g.shape[1], 7, 1, dtype=DT))  # the factored paths still run
    with pytest.raises(RuntimeError, match="dense per-channel mixing"):
        g.mean(1)


@pytest.mark.parametrize("blocks", [False, True])
@pytest.mark.parametrize("identity", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_the_factored_per_pair_paths_equal_the_dense_tensor_paths(identity, causal, blocks, monkeypatch):
    r"""GlobEnc's norms and ALTI's map from the factored mixing equal the Gram / tile kernels on the dense tensor
    (``blocks``: in blocks of 2 rows, the band's sources before each block left out)."""
    from captum_normattr.decompose.primitives import channel_mixing

    if blocks:
        monkeypatch.setattr(channel_mixing, "BAND_BLOCK_ROWS", 2)
        monkeypatch.setattr(channel_mixing, "ROW_BLOCK_BYTES", 1)
    from captum_normattr.decompose.methods.alti import alti_map, contributions_from_distances
    from captum_normattr.decompose.primitives.attention import norm_maps_and_ratios, project_values
    from captum_normattr.decompose.primitives.channel_mixing import channel_part_distances

    g = _random(identity, seed=4)
    if causal and not identity:
        g.mixing = g.mixing.tril()
    b, n, t, _ = g.shape
    gen = torch.Generator().manual_seed(5)
    d = 5
    values = torch.randn(b, n, t, 1, generator=gen, dtype=DT)
    head_weight = torch.randn(n, 1, d, generator=gen, dtype=DT)
    residual = torch.randn(b, t, d, generator=gen, dtype=DT)
    dense = g.dense()
    if causal:
        dense_c = dense * torch.ones(t, t, dtype=DT).tril()
        assert _rel(dense_c, dense) < 1e-15 or identity  # the factors are causal already
    total = residual + torch.einsum("bnts,bns,nd->btd", dense, values[..., 0], head_weight[:, 0])
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, :2] = False
    mask2d = (valid[:, :, None] & valid[:, None, :]).to(DT)
    lin = torch.randn(d, d, generator=gen, dtype=DT)
    row_scale = torch.rand(b, t, generator=gen, dtype=DT) + 0.5
    spec = lambda name: {"N": (None, None, False), "N_RES": (None, None, True), "N_LIN": (lin, row_scale, True)}[name]
    names = ["N", "N_RES", "N_LIN"]
    want = norm_maps_and_ratios(dense, values, head_weight, residual, total, names, spec, mask2d, valid, causal)
    got = norm_maps_and_ratios(g, values, head_weight, residual, total, names, spec, mask2d, valid, causal)
    for name in names:
        assert _rel(got[0][name], want[0][name]) < 1e-12, name
        assert _rel(got[1][name], want[1][name]) < 1e-12, name
    output = total + 0.1
    projected = project_values(values, head_weight, token_major=True)
    ref = alti_map(dense, projected, residual, output, valid, None, None, causal, tile_bytes=2**16)
    dist = channel_part_distances(g, values, head_weight, residual, output, causal)
    mine = contributions_from_distances(dist, output.abs().sum(-1), valid, None, causal)
    assert _rel(mine, ref) < 1e-12
