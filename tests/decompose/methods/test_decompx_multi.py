r"""DecompX with many explained outputs: the frozen layers' transposes take a stack of cotangents
(n, B, R, D) in one call, equal to one call per cotangent (float64), and the adjoint walk pushes all
its outputs through each layer in one call (in chunks when the stack is large)."""
import pytest
import torch
from conftest import make_model
from layer_capture import capture_layers

from captum_normattr.decompose.methods.decompx import adjoint as dd
from captum_normattr.decompose.methods.decompx import frozen as fz
from captum_normattr.decompose.methods.decompx.adjoint import AdjointPass, FrozenLayer
from captum_normattr.decompose.methods.decompx.parts import ff_coefficients
from captum_normattr.models.adapters import get_adapter, layer_modules, value_projection
from decoder_models import decoder_batch, make_decoder

F64 = torch.float64


def _value_param(model, layer):
    adapter = get_adapter(model)
    w, b = value_projection(layer_modules(model, adapter)[layer.index], adapter)
    return w.detach(), None if b is None else b.detach()


def _case(family):
    if family == "bert":
        model = make_model("bert")
        ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(2))
        mask = torch.ones_like(ids)
        mask[1, 6:] = 0
        return model, ids, mask
    ids, mask = decoder_batch([9, 6], seed=4)  # left padding, T = 9 >= 2 * CAUSAL_BLOCKS
    return make_decoder(family), ids, mask


def _rel(got, want):
    return float((got - want).abs().max()) / float(want.abs().max())


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_stacked_vjp_equals_one_call_per_cotangent(family, monkeypatch):
    model, ids, mask = _case(family)
    layers = capture_layers(model, ids, mask)
    t = ids.shape[1]
    gen = torch.Generator().manual_seed(7)
    causal_flags = []
    mix = fz.mix_transpose
    monkeypatch.setattr(fz, "mix_transpose", lambda *a: causal_flags.append(len(a) > 3 and a[3]) or mix(*a))
    for layer in layers:
        w_v, b_v = _value_param(model, layer)
        frozen = FrozenLayer(layer, w_v, b_v, ff_coefficients(layer), valid=mask.bool())
        for rows in (None, torch.tensor([t - 1]), torch.tensor([2, 5, t - 1])):
            r = t if rows is None else rows.shape[0]
            for pads in ("random", "zero"):
                stack = torch.randn(5, ids.shape[0], r, layer.hidden_in.shape[-1], generator=gen, dtype=F64)
                if pads == "zero" and rows is None:  # as in the adjoint walk: the causal blocks are skipped
                    stack[:, mask == 0] = 0
                causal_flags.clear()
                got = frozen.vjp(stack, rows)
                assert len(causal_flags) == 1  # one mixing product for the whole stack
                stacked_causal = causal_flags[0]
                want = torch.stack([frozen.vjp(g, rows) for g in stack])
                assert causal_flags[1:] == [stacked_causal] * 5  # the stack skips blocks exactly when each would
                assert got.shape == want.shape == (5, ids.shape[0], t, layer.hidden_in.shape[-1])
                assert _rel(got, want) < 1e-12, (family, layer.index, rows, pads)
                if layer.causal and rows is None and pads == "zero":
                    assert stacked_causal
                # any leading shape; a stack of one is the single call
                got2 = frozen.vjp(stack[:4].reshape(2, 2, *stack.shape[1:]), rows)
                assert _rel(got2.reshape(4, *got2.shape[2:]), want[:4]) < 1e-12
                assert _rel(frozen.vjp(stack[:1], rows)[0], want[0]) < 1e-12


@pytest.mark.parametrize("family", ["qwen2", "bert"])
def test_adjoint_walk_one_call_per_layer_and_chunks(family, monkeypatch):
    r"""All outputs in one vjp call per layer; chunked stacks (tiny STACK_BYTES) give the same
    gradients and constants; each output alone gives its own gradient and constant."""
    model, ids, mask = _case(family)
    layers = capture_layers(model, ids, mask)
    steps = [FrozenLayer(layer, *_value_param(model, layer), ff_coefficients(layer), mask.bool()) for layer in layers]
    n_layers, d = len(layers), layers[0].hidden_in.shape[-1]
    rows = torch.tensor([0]) if family == "bert" else torch.tensor([5, 8])
    us = torch.randn(7, rows.shape[0], d, generator=torch.Generator().manual_seed(3), dtype=F64)
    outputs = lambda y: [(y * u).sum((1, 2)) + 0.25 * k for k, u in enumerate(us)]
    calls = []

    class Counting:
        def __init__(self, step):
            self.step = step

        layer = property(lambda self: self.step.layer)

        def constant(self, r):
            return self.step.constant(r)

        def own(self, r):
            return self.step.own(r)

        def value_source(self):
            return self.step.value_source()

        def vjp(self, g, r):
            calls.append(g.shape[0])
            return self.step.vjp(g, r)

    def walk(outs):
        adj = AdjointPass(n_layers, rows)
        for layer in layers:
            adj.forward(layer.hidden_in)
        grads = adj.backward(lambda l, x: Counting(steps[l]), outs)
        return torch.stack(grads), torch.stack(adj.constants)

    grads, consts = walk(outputs)
    assert calls == [7] * n_layers
    assert consts.abs().min() > 1e-3 and grads.shape == (7,) + tuple(layers[0].hidden_in.shape)
    calls.clear()
    width = max(d, layers[0].ff.w_out.shape[0])  # the widest intermediate per output: (B, T, max(D, F))
    per = layers[0].hidden_in[..., :1].numel() * width * layers[0].hidden_in.element_size()
    monkeypatch.setattr(dd, "STACK_BYTES", 3 * per + 1)
    c_grads, c_consts = walk(outputs)
    assert calls == [3, 3, 1] * n_layers
    assert _rel(c_grads, grads) < 1e-12 and _rel(c_consts, consts) < 1e-12
    for k in (0, 6):
        g1, c1 = walk(lambda y: [outputs(y)[k]])
        assert _rel(g1[0], grads[k]) < 1e-12 and _rel(c1[0], consts[k]) < 1e-12
