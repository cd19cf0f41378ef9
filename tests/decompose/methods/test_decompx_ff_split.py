r"""DecompX's feed-forward split is the closed-form integrated-gradients split of the FF decomposition.

DecompX freezes the FF at per-neuron coefficients (``decompose.methods.decompx.parts.ff_coefficients``):
(g(p) - g(0)) / p for an elementwise g, and b I1(a), I2(a) for a gated g(a) b. The FF
decomposition (``FFIntegratedDecomposition``) splits the FF by integrated gradients with a
zero baseline along the straight path: p_j (g(p) - g(0)) / p (closed form) and
a_j b I1(a) + b_j I2(a) (``decompose.primitives.gated_feed_forward``). Given the same input parts
(summing to the real FF input), both give the same FF-output parts, bias part included:
a DecompX variant "with the FF split of closed-form IG" is DecompX itself. The check fails
on a genuinely different split (the gate frozen at g(a), everything through the up
projection), so it can tell splits apart.
"""
import pytest
import torch
from conftest import make_model, random_batch
from decoder_models import decoder_batch, make_decoder
from layer_capture import capture_layers

from captum_normattr.decompose.methods.decompx.parts import ff_coefficients, frozen_ff_parts
from captum_normattr.decompose.primitives.feed_forward import ff_parts
from captum_normattr.decompose.primitives.gated_feed_forward import gated_ff_parts


def _random_parts(u: torch.Tensor, k: int, seed: int):
    r"""k random parts per row and the bias part that makes them sum to the real FF input u (B, T, D)."""
    g = torch.Generator().manual_seed(seed)
    parts = torch.randn(u.shape[0], u.shape[1], k, u.shape[2], generator=g, dtype=u.dtype)
    return parts, u - parts.sum(2)


def _splits(layer, parts, bias):
    f = layer.ff
    fallback = torch.arange(parts.shape[1])
    dx, dx_b = frozen_ff_parts(parts.clone(), bias, f, ff_coefficients(layer), spread=False, fallback=fallback)
    if f.w_gate is None:
        ig, ig_b = ff_parts(parts.clone(), bias, f.w_in, f.b_in, f.act, f.w_out, f.b_out, method="closed_form")
    else:
        ig, ig_b = gated_ff_parts(parts.clone(), bias, f.w_gate, f.b_gate, f.w_in, f.b_in, f.act, f.w_out, f.b_out)
    return (dx, dx_b), (ig, ig_b)


def _frozen_gate_split(layer, parts, bias):
    r"""A different exact split of a gated FF: g(a) frozen, every part through the up projection."""
    f = layer.ff
    u = parts.sum(2) + bias
    gate = f.act(u @ f.w_gate + (f.b_gate if f.b_gate is not None else 0.0))
    out = ((parts @ f.w_in) * gate.unsqueeze(2)) @ f.w_out
    out_b = ((bias @ f.w_in + (f.b_in if f.b_in is not None else 0.0)) * gate) @ f.w_out
    return out, out_b + (f.b_out if f.b_out is not None else 0.0)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_decoder_ff_split_of_decompx_equals_the_ig_split(family):
    model = make_decoder(family, layers=2)
    ids, mask = decoder_batch([7, 5], seed=2)
    for layer in capture_layers(model, ids, mask):
        u = layer.ln2_out
        parts, bias = _random_parts(u, 4, seed=layer.index)
        (dx, dx_b), (ig, ig_b) = _splits(layer, parts, bias)
        real = layer.ff_out
        scale = float(real.abs().max())
        # both complete against the real FF output ...
        torch.testing.assert_close(ig.sum(2) + ig_b, real, rtol=0, atol=1e-10 * scale)
        torch.testing.assert_close(dx.sum(2) + dx_b, real, rtol=0, atol=1e-10 * scale)
        # ... and equal part by part
        torch.testing.assert_close(dx, ig, rtol=0, atol=1e-12 * scale)
        torch.testing.assert_close(dx_b, ig_b, rtol=0, atol=1e-12 * scale)
        if family == "llama":  # a different exact split is told apart
            fg, fg_b = _frozen_gate_split(layer, parts, bias)
            torch.testing.assert_close(fg.sum(2) + fg_b, real, rtol=0, atol=1e-10 * scale)
            assert float((fg - ig).abs().max()) > 1e-3 * scale


def test_encoder_ff_split_of_decompx_equals_the_ig_split():
    model = make_model("bert")
    ids, mask = random_batch([6, 4], seed=1)
    for layer in capture_layers(model, ids, mask):
        u = layer.ln1_out  # a post-LN layer's FF input
        parts, bias = _random_parts(u, 3, seed=layer.index)
        (dx, dx_b), (ig, ig_b) = _splits(layer, parts, bias)
        scale = float(layer.ff_out.abs().max())
        torch.testing.assert_close(ig.sum(2) + ig_b, layer.ff_out, rtol=0, atol=1e-10 * scale)
        torch.testing.assert_close(dx, ig, rtol=0, atol=1e-12 * scale)
        torch.testing.assert_close(dx_b, ig_b, rtol=0, atol=1e-12 * scale)
