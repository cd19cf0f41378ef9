r"""DecompX's fast paths against the naive ones, in float64: the SiLU gate integrals in closed form
(against a 40-digit reference and the 48-node Gauss-Legendre rule), the written-out transpose of a
frozen layer (against torch.autograd; causal blocks; rows; padding), the layer constants, the gate
and up pre-activations kept from the rerun (against recomputing them) and the adjoint's bias score."""
import math

import pytest
import torch
from conftest import make_model
from layer_capture import capture_layers

from captum_normattr import DecompXAttribution
from captum_normattr.attr import decompx as attr_decompx
from captum_normattr.decompose.methods.decompx import frozen as fz
from captum_normattr.decompose.primitives import gated_feed_forward as gff
from captum_normattr.decompose.methods.decompx.adjoint import FrozenLayer, frozen_layer
from captum_normattr.decompose.methods.decompx.parts import ff_coefficients
from captum_normattr.decompose.primitives.gated_feed_forward import (
    DEFAULT_NODES,
    gate_integrals,
    is_silu,
    quadrature_gate_integrals,
    silu_gate_integrals,
)
from captum_normattr.models.adapters import get_adapter, layer_modules, value_projection
from decoder_models import decoder_batch, make_decoder

silu = torch.nn.functional.silu
F64 = torch.float64

# ----------------------------------------------------------------------- gate integrals
EDGES = [0.0, 5e-324, -5e-324, 1e-300, -1e-300, 1e-8, -1e-8, 0.3, -0.3,
         1 - 1e-15, -(1 - 1e-15), 1.0, -1.0, 1 + 1e-15, -(1 + 1e-15),  # the switch between the two evaluations
         2.5, -2.5, 7.0, -7.0, 33.3, -45.0, 60.0, -60.0, 95.0, -95.0, 300.0, -300.0, 1e4, -1e4]


def _reference(a: float):
    r"""(I1, I2) to 40 digits: S(a) = int_0^a s sigmoid(s) ds by mpmath, I2 = S / a, I1 = (g(a) - I2) / a."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 40
    if abs(a) < 1e-6:  # the Taylor series (g(x) = x/2 + x^2/4 - x^4/48 + ...), exact to far below 1e-16 here
        return 0.25 + a / 6 - a**3 / 60, a / 4 + a * a / 12 - a**4 / 240
    x = mpmath.mpf(a)
    g = lambda s: s / (1 + mpmath.e ** (-s))
    i2 = mpmath.quad(g, [0, x]) / x
    return float((g(x) - i2) / x), float(i2)


def test_silu_closed_form_against_40_digits():
    a = torch.tensor(EDGES + torch.linspace(-12, 12, 49).tolist(), dtype=F64)
    i1, i2 = silu_gate_integrals(a)
    for k, v in enumerate(a.tolist()):
        r1, r2 = _reference(v)
        assert abs(float(i1[k]) - r1) <= 4e-16, (v, float(i1[k]), r1)
        assert abs(float(i2[k]) - r2) <= 4e-16 * max(1.0, abs(r2)), (v, float(i2[k]), r2)


def test_silu_closed_form_equals_48_node_rule():
    r"""The default rule's values to 2e-12 where the rule itself is that accurate (|a| <= 95), 1e-14 for |a| <= 60."""
    a = torch.cat([torch.linspace(-95, 95, 19001, dtype=F64), torch.tensor(EDGES[:-4], dtype=F64),
                   torch.randn(2000, generator=torch.Generator().manual_seed(0), dtype=F64) * 4])
    i1, i2 = silu_gate_integrals(a)
    q1, q2 = quadrature_gate_integrals(a, silu, DEFAULT_NODES)
    assert (i1 - q1).abs().max() < 2e-12 and ((i2 - q2).abs() / q2.abs().clamp(min=1.0)).max() < 2e-12
    inner = a.abs() <= 60
    assert (i1 - q1)[inner].abs().max() < 1e-14 and ((i2 - q2).abs() / q2.abs().clamp(min=1.0))[inner].max() < 1e-14
    # the completeness that the rule leaves (> 0) is gone: a I1 + I2 = g(a) to rounding
    assert (a * i1 + i2 - silu(a)).abs().max() <= 4 * torch.finfo(F64).eps * silu(a).abs().clamp(min=1.0).max()
    # far out the rule is the inexact one (its own error grows), the closed form stays exact
    big = torch.tensor([300.0, -300.0, 1e4], dtype=F64)
    b1, b2 = silu_gate_integrals(big)
    torch.testing.assert_close(big * b1 + b2, silu(big), rtol=1e-15, atol=1e-13)
    torch.testing.assert_close(b1, torch.tensor([0.5, 0.0, 0.5], dtype=F64), rtol=0, atol=1e-4)


def test_silu_closed_form_dtypes_shapes_and_pieces(monkeypatch):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(2, 7, 300, generator=g, dtype=F64) * 5
    a[0, 0, :4] = torch.tensor([0.0, 1.0, -1.0, 1e-30])
    i1, i2 = silu_gate_integrals(a)
    assert i1.shape == a.shape and i2.shape == a.shape
    monkeypatch.setattr(gff, "SILU_CHUNK", 1000)  # in pieces, as a long input is computed
    p1, p2 = silu_gate_integrals(a)
    assert torch.equal(p1, i1) and torch.equal(p2, i2)
    s1, s2 = silu_gate_integrals(a.transpose(0, 2))  # not contiguous
    assert torch.equal(s1, i1.transpose(0, 2)) and torch.equal(s2, i2.transpose(0, 2))
    f1, f2 = silu_gate_integrals(a.float())
    assert f1.dtype == torch.float32
    assert (f1.double() - i1).abs().max() < 1e-6 and ((f2.double() - i2).abs() / i2.abs().clamp(min=1)).max() < 1e-6
    h1, _ = silu_gate_integrals(a.to(torch.bfloat16))
    assert h1.dtype == torch.bfloat16
    n1, n2 = silu_gate_integrals(torch.tensor([float("nan"), 2.0], dtype=F64))  # a NaN stays where it is
    assert n1[0].isnan() and n2[0].isnan() and n1[1:].isfinite().all() and n2[1:].isfinite().all()


def test_gate_integrals_dispatch():
    a = torch.linspace(-40, 40, 801, dtype=F64)
    closed = silu_gate_integrals(a)

    class ReplacedSiLU(torch.nn.SiLU):
        def forward(self, x):
            return torch.nn.functional.gelu(x)

    from transformers.activations import ACT2FN

    for act in (silu, torch.nn.SiLU(), ACT2FN["silu"]):
        assert is_silu(act)
        got = gate_integrals(a, act)  # default: 48 nodes
        assert torch.equal(got[0], closed[0]) and torch.equal(got[1], closed[1])
        assert torch.equal(gate_integrals(a, act, 96)[0], closed[0])
    assert not is_silu(ReplacedSiLU()) and not is_silu(torch.nn.GELU()) and not is_silu(torch.tanh)
    for act, nodes in ((silu, 16), (torch.nn.GELU(), DEFAULT_NODES), (ReplacedSiLU(), DEFAULT_NODES)):
        got = gate_integrals(a, act, nodes)  # the rule the caller asked for
        want = quadrature_gate_integrals(a, act, nodes)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ----------------------------------------------------------------------- frozen layers
def _value_param(model, layer):
    adapter = get_adapter(model)
    w, b = value_projection(layer_modules(model, adapter)[layer.index], adapter)
    return w.detach(), None if b is None else b.detach()


def _autograd_vjp(g, layer, w_v, coefs, rows):
    x = layer.hidden_in.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        y = frozen_layer(x, layer, w_v, None, False, coefs, rows)
        return torch.autograd.grad(y, x, grad_outputs=g)[0]


def _cases():
    ids, mask = decoder_batch([9, 6], seed=4)  # left padding, T = 9 >= 2 * CAUSAL_BLOCKS
    for family in ("gpt2", "llama", "mistral", "qwen2"):
        yield family, make_decoder(family), ids, mask
    bert = make_model("bert")
    b_ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(2))
    b_mask = torch.ones_like(b_ids)
    b_mask[1, 6:] = 0
    yield "bert", bert, b_ids, b_mask


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c[0])
def test_written_out_vjp_equals_autograd(case):
    family, model, ids, mask = case
    layers = capture_layers(model, ids, mask)
    t = ids.shape[1]
    g = torch.Generator().manual_seed(5)
    for layer in layers:
        w_v, b_v = _value_param(model, layer)
        coefs = ff_coefficients(layer)
        frozen = FrozenLayer(layer, w_v, b_v, coefs)
        for rows in (None, torch.tensor([t - 1]), torch.tensor([2, 5, t - 1])):
            r = t if rows is None else rows.shape[0]
            cot = torch.randn(ids.shape[0], r, layer.hidden_in.shape[-1], generator=g, dtype=F64)
            got = frozen.vjp(cot, rows)
            want = _autograd_vjp(cot, layer, w_v, coefs, rows)
            scale = float(want.abs().max())
            assert got.shape == want.shape and (got - want).abs().max() <= 1e-12 * scale, (family, layer.index, rows)


def test_causal_blocks_equal_the_full_transpose(monkeypatch):
    model = make_decoder("llama", layers=1)
    ids, mask = decoder_batch([13, 9, 4], seed=6)
    (layer,) = capture_layers(model, ids, mask)
    assert layer.causal
    w_v, b_v = _value_param(model, layer)
    coefs = ff_coefficients(layer)
    frozen = FrozenLayer(layer, w_v, b_v, coefs, valid=mask.bool())
    cot = torch.randn(3, 13, 24, generator=torch.Generator().manual_seed(0), dtype=F64)
    assert frozen.layer.probs[2, :, 0, 1:].abs().max() > 0.01  # a fully masked pad row attends to later keys
    calls = []
    mix = fz.mix_transpose
    monkeypatch.setattr(fz, "mix_transpose", lambda *a: calls.append(a[3]) or mix(*a))
    for pads in ("random", "zero"):  # the adjoint's cotangents are 0 at the pad rows: only then are blocks skipped
        if pads == "zero":
            cot[mask == 0] = 0
        want = _autograd_vjp(cot, layer, w_v, coefs, None)
        for blocks in (1, 2, 3, 4, 6):
            monkeypatch.setattr(fz, "CAUSAL_BLOCKS", blocks)
            calls.clear()
            got = frozen.vjp(cot)
            assert calls == [pads == "zero"]
            assert (got - want).abs().max() <= 1e-12 * float(want.abs().max()), (pads, blocks)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "bert"])
def test_layer_constant(family):
    model = make_model("bert") if family == "bert" else make_decoder(family)
    ids, mask = decoder_batch([9, 6], seed=4)
    layer = capture_layers(model, ids, mask)[0]
    w_v, b_v = _value_param(model, layer)
    frozen = FrozenLayer(layer, w_v, b_v, ff_coefficients(layer))
    zero_map = frozen_layer(torch.zeros_like(layer.hidden_in), layer, w_v, b_v, True, frozen.coefs, None)
    if family == "llama":  # no bias anywhere: the constant is exactly 0 and not computed
        assert not frozen.has_constant() and frozen.constant() is None and (zero_map == 0).all()
    else:
        assert frozen.has_constant() and zero_map.abs().max() > 1e-3
        torch.testing.assert_close(frozen.constant(), zero_map, rtol=0, atol=0)
        torch.testing.assert_close(frozen.constant(torch.tensor([8])), zero_map[:, [8]], rtol=0, atol=1e-14)
    # affine: F(x) = J x + c, with the transpose of J
    x = torch.randn(layer.hidden_in.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    lin = frozen_layer(x, layer, w_v, b_v, False, frozen.coefs, None)
    torch.testing.assert_close(frozen(x), lin + zero_map, rtol=0, atol=1e-12)
    cot = torch.randn(lin.shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    torch.testing.assert_close((cot * lin).sum(), (frozen.vjp(cot) * x).sum(), rtol=1e-12, atol=0)


# ----------------------------------------------------------------------- the attribution
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_kept_preactivations_equal_recomputed(family, monkeypatch):
    r"""The gate and up pre-activations taken from the rerun give the coefficients of the FF input times the weights."""
    model = make_decoder(family, layers=3)
    ids, mask = decoder_batch([9, 6], seed=7)
    used = []
    checked = attr_decompx._checked_preactivations

    def spy(layer, got):
        out = checked(layer, got)
        used.append(out is not None)
        return out

    monkeypatch.setattr(attr_decompx, "_checked_preactivations", spy)
    fast = DecompXAttribution(model).decompose(ids, target=5, additional_forward_args=mask)
    assert used == [True, True, True]
    layers = capture_layers(model, ids, mask)
    for layer in layers:
        f = layer.ff
        a, b = layer.ln2_out @ f.w_gate, layer.ln2_out @ f.w_in + (f.b_in if f.b_in is not None else 0)
        if f.b_gate is not None:
            a = a + f.b_gate
        kept = ff_coefficients(layer, preactivations=(a.clone(), b.clone()))
        own = ff_coefficients(layer)
        for key in own:
            torch.testing.assert_close(kept[key], own[key], rtol=0, atol=1e-13)
    monkeypatch.setattr(attr_decompx, "_checked_preactivations", lambda layer, got: None)
    slow = DecompXAttribution(model).decompose(ids, target=5, additional_forward_args=mask)
    torch.testing.assert_close(fast.scores, slow.scores, rtol=0, atol=1e-12)
    torch.testing.assert_close(fast.bias_scores, slow.bias_scores, rtol=0, atol=1e-12)
    torch.testing.assert_close(fast.extras["quadrature_error"], slow.extras["quadrature_error"], rtol=0, atol=1e-15)


def test_preactivations_not_taken_when_they_differ():
    model = make_decoder("llama", layers=1)
    ids, mask = decoder_batch([6], seed=1)
    (layer,) = capture_layers(model, ids, mask)
    f = layer.ff
    a, b = layer.ln2_out @ f.w_gate, layer.ln2_out @ f.w_in
    assert attr_decompx._checked_preactivations(layer, {"gate": a, "up": b}) is not None
    assert attr_decompx._checked_preactivations(layer, {"gate": a + 1e-3, "up": b}) is None  # not this FF input
    assert attr_decompx._checked_preactivations(layer, {"gate": a.float(), "up": b.float()}) is None  # other dtype
    assert attr_decompx._checked_preactivations(layer, {"gate": a}) is None


@pytest.mark.parametrize("family", ["gpt2", "qwen2", "bert"])
def test_adjoint_bias_score_is_the_constant(family):
    r"""The adjoint's bias score (the frozen network's constant, accumulated layer by layer) equals the
    forward algorithm's bias part and F(e) - sum of the scores of the frozen network applied to e."""
    if family == "bert":
        model = make_model("bert")
        ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(2))
        mask = torch.ones_like(ids)
        mask[1, 6:] = 0
    else:
        model = make_decoder(family, layers=3)
        ids, mask = decoder_batch([9, 6], seed=8)
    adj = DecompXAttribution(model, algorithm="adjoint").decompose(ids, additional_forward_args=mask)
    fwd = DecompXAttribution(model, algorithm="forward").decompose(ids, additional_forward_args=mask)
    assert adj.bias_scores.abs().min() > 1e-6  # biases really exist
    torch.testing.assert_close(adj.bias_scores, fwd.bias_scores, rtol=0, atol=1e-10)
    torch.testing.assert_close(adj.class_scores, fwd.class_scores, rtol=0, atol=1e-10)
    assert adj.delta.max() < 1e-9 and math.isfinite(float(adj.delta.max()))


def test_adjoint_pass_with_the_last_layer_kept():
    r"""``AdjointPass.forward(x, last_step)`` keeps the last frozen layer: the same gradients and
    constants, and the backward phase asks only for the layers below it."""
    from captum_normattr.decompose.methods.decompx.adjoint import AdjointPass

    model = make_decoder("qwen2", layers=3)
    ids, mask = decoder_batch([9, 6], seed=9)
    layers = capture_layers(model, ids, mask)
    steps = [FrozenLayer(layer, *_value_param(model, layer), ff_coefficients(layer), mask.bool()) for layer in layers]
    u = torch.randn(24, generator=torch.Generator().manual_seed(1), dtype=F64)
    rows = torch.tensor([8])
    outputs = lambda y: [(y[:, 0] * u).sum(-1) + 0.5]
    results = []
    for keep in (False, True):
        adj, asked = AdjointPass(3, rows), []
        for l, layer in enumerate(layers):
            adj.forward(layer.hidden_in, steps[l] if keep else None)
        grads = adj.backward(lambda l, x: asked.append(l) or steps[l], outputs)
        assert asked == ([1, 0] if keep else [2, 1, 0])
        results.append((grads[0], adj.constants[0]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)
    # F(e) = sum of the scores + the constant, F the frozen network applied layer by layer
    x = layers[0].hidden_in
    for l, step in enumerate(steps):
        x = step(x, rows if l == 2 else None)
    scores = (results[0][0] * layers[0].hidden_in).sum(-1)
    torch.testing.assert_close(outputs(x)[0], scores.sum(1) + results[0][1], rtol=0, atol=1e-12)
