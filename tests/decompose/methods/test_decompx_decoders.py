r"""DecompX on decoders (GPT-2, Llama with GQA, Mistral, Qwen2 with qkv bias): completeness against the
real tensors, a naive reference, adjoint == forward, quadrature convergence, padding, causality, contract."""
import numpy as np
import pytest
import torch
from conftest import make_model

from captum_normattr import DecompXAttribution
from captum_normattr.decompose.methods.decompx.parts import BIAS_MODES, SPREAD_MODES
from captum_normattr.models.adapters import get_adapter, layer_modules, value_projection
from decoder_models import DECODER_FAMILIES, decoder_batch, make_decoder
from layer_capture import capture_layers

TOL = 1e-9


def real_logits(model, ids, mask):
    r"""A plain forward pass (the model's own attention implementation), positions from the mask."""
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits


def capture(model, ids, mask=None):
    r"""(every layer's tensors, the final norm's (params, input, output)) of one recorded forward pass (float64 models)."""
    return capture_layers(model, ids, mask, with_final=True)


# ----------------------------------------------------------------------- naive reference
def _norm(u, real, p, with_bias):
    if p.kind == "rmsnorm":
        out = p.weight * u / torch.sqrt(real.pow(2).mean(-1, keepdim=True) + p.eps)
    else:
        out = p.weight * (u - u.mean(-1, keepdim=True)) / torch.sqrt(real.var(-1, unbiased=False, keepdim=True) + p.eps)
    return out + p.bias if (with_bias and p.bias is not None) else out


def _simpson_gate_integrals(a, n=4000):
    r"""I1 = int_0^1 t silu'(t a) dt, I2 = int_0^1 silu(t a) dt by composite Simpson (analytic silu')."""
    t = torch.linspace(0, 1, n + 1, dtype=a.dtype)
    w = torch.ones(n + 1, dtype=a.dtype)
    w[1:-1:2], w[2:-1:2] = 4.0, 2.0
    w = w / (3 * n)
    x = t[:, None] * a.reshape(1, -1)
    s = torch.sigmoid(x)
    silu, dsilu = x * s, s * (1 + x * (1 - s))
    i1 = (w[:, None] * t[:, None] * dsilu).sum(0).reshape(a.shape)
    i2 = (w[:, None] * silu).sum(0).reshape(a.shape)
    return i1, i2


def naive_scores(model, ids, target):
    r"""One example, no padding, last position: one source token at a time through the frozen decoder,
    head by head (key/value head of query head h: h // groups), the gate integrals by Simpson's rule."""
    adapter = get_adapter(model)
    layers, (fp, f_in, _) = capture(model, ids)
    vp = [tuple(None if t is None else t.detach() for t in value_projection(m, adapter)) for m in layer_modules(model, adapter)]
    u = model.lm_head.weight[target].detach()
    t_len = ids.shape[1]
    frozen = []
    for layer in layers:
        f = layer.ff
        pre = layer.ln2_out @ f.w_in + (f.b_in if f.b_in is not None else 0.0)
        if f.w_gate is None:
            g0 = f.act(torch.zeros((), dtype=torch.float64))
            frozen.append({"slope": (f.act(pre) - g0) / pre, "g0": g0})
        else:
            gate = layer.ln2_out @ f.w_gate + (f.b_gate if f.b_gate is not None else 0.0)
            i1, i2 = _simpson_gate_integrals(gate)
            frozen.append({"gate": pre * i1, "up": i2})

    def run(x, with_bias):
        for layer, (w_v, b_v), c in zip(layers, vp, frozen):
            h = layer.num_heads
            dh = layer.out_weight.shape[0] // h
            groups = h // (w_v.shape[1] // dh)
            z1 = _norm(x, layer.ln1_in, layer.ln1, with_bias)
            a = torch.zeros_like(x)
            for head in range(h):
                kv = slice((head // groups) * dh, (head // groups + 1) * dh)
                v = z1 @ w_v[:, kv] + (b_v[kv] if (with_bias and b_v is not None) else 0.0)
                a = a + (layer.probs[:, head] @ v) @ layer.out_weight[head * dh : (head + 1) * dh]
            hh = x + a + (layer.out_bias if (with_bias and layer.out_bias is not None) else 0.0)
            z = _norm(hh, layer.ln2_in, layer.ln2, with_bias)
            f = layer.ff
            lin = lambda w, b: z @ w + (b if (with_bias and b is not None) else 0.0)
            if f.w_gate is None:
                ig = lin(f.w_in, f.b_in) * c["slope"] + (c["g0"] if with_bias else 0.0)
            else:
                ig = lin(f.w_gate, f.b_gate) * c["gate"] + lin(f.w_in, f.b_in) * c["up"]
            x = hh + ig @ f.w_out + (f.b_out if (with_bias and f.b_out is not None) else 0.0)
        y = _norm(x[0, -1], f_in[0, -1], fp, with_bias)
        return y @ u

    e = layers[0].hidden_in
    scores = []
    for k in range(t_len):
        x = torch.zeros_like(e)
        x[:, k] = e[:, k]
        scores.append(run(x, False))
    return torch.stack(scores), run(torch.zeros_like(e), True)


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("family", DECODER_FAMILIES)
def test_value_projection_matches_recorded_values(family):
    r"""GPT-2: the last third of the fused c_attn; Llama family: v_proj, GQA heads repeated per query head."""
    model = make_decoder(family)
    adapter = get_adapter(model)
    ids, mask = decoder_batch([5, 3], seed=0)
    layers, _ = capture(model, ids, mask)
    for layer, m in zip(layers, layer_modules(model, adapter)):
        w, b = value_projection(m, adapter)
        v = layer.ln1_out @ w.detach() + (0.0 if b is None else b.detach())
        dh = layer.values.shape[-1]
        v = v.view(2, 5, -1, dh).repeat_interleave(layer.num_heads // (w.shape[1] // dh), 2).transpose(1, 2)
        torch.testing.assert_close(v, layer.values, rtol=0, atol=1e-12)


@pytest.mark.parametrize("bias_mode", BIAS_MODES)
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("family", DECODER_FAMILIES)
def test_completeness_every_layer_and_logit(family, tied, bias_mode):
    model = make_decoder(family, tied=tied)
    ids, mask = decoder_batch([6, 4], seed=1)
    logits = real_logits(model, ids, mask)[:, -1]  # sdpa forward, independent of the recording
    dx = DecompXAttribution(model, bias_mode=bias_mode, full_last_layer=True)
    res = dx.decompose(ids, additional_forward_args=mask, layer_parts=True)
    assert res.algorithm == "forward" and res.layer_errors.shape == (2, 2)
    assert res.layer_errors.max() < TOL  # parts + bias == every layer's real output
    torch.testing.assert_close(res.target, logits.argmax(-1), rtol=0, atol=0)  # default: the predicted next token
    expect = logits.gather(1, res.target[:, None])
    torch.testing.assert_close(res.logits, expect, rtol=0, atol=1e-12)
    torch.testing.assert_close(res.class_scores.sum(1) + res.bias_scores, expect, rtol=0, atol=TOL)
    assert res.delta.max() < TOL
    assert (res.scores[1, :2] == 0).all() and (res.layer_part_norms[1, :, :2] == 0).all()
    if bias_mode in SPREAD_MODES:
        assert (res.bias_scores == 0).all()
    elif family in ("gpt2", "qwen2"):
        assert res.bias_scores.abs().min() > 1e-6  # perturbed biases: a bias part really exists
    if family != "gpt2":
        assert 0 < res.extras["quadrature_error"].max() < 1e-11


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_matches_naive_reference_forward_and_adjoint(family):
    model = make_decoder(family, tied=False, layers=3)
    ids, _ = decoder_batch([6], seed=2)
    ref, ref_bias = naive_scores(model, ids, 9)
    for algorithm, budget in (("forward", 1e-4), ("forward", 256.0), ("adjoint", 256.0)):
        res = DecompXAttribution(model, algorithm=algorithm, memory_budget_mb=budget).decompose(ids, target=9)
        assert res.algorithm == algorithm
        torch.testing.assert_close(res.scores[0], ref, rtol=0, atol=1e-10)
        torch.testing.assert_close(res.bias_scores[0, 0], ref_bias, rtol=0, atol=1e-10)


def test_gated_quadrature_error_shrinks_with_nodes():
    model = make_decoder("llama")
    ids, mask = decoder_batch([7, 5], seed=3)
    deltas, quads = [], []
    for nodes in (1, 2, 4, 8, 48):
        res = DecompXAttribution(model, nodes=nodes).decompose(ids, target=5, additional_forward_args=mask, layer_parts=True)
        deltas.append(float(res.delta.max()))
        quads.append(float(res.extras["quadrature_error"].max()))
        assert res.layer_errors.max() < 1e3 * quads[-1] + 1e-12  # the only error left is the quadrature's
    assert deltas[0] > 1e-3 and quads[0] > 1e-3  # one node is visibly inexact
    assert all(a > b for a, b in zip(quads, quads[1:])) and deltas[1] > deltas[3] > deltas[4]
    assert deltas[-1] < 1e-12 and quads[-1] < 1e-12


@pytest.mark.parametrize("family", ["gpt2", "mistral"])
@pytest.mark.parametrize("bias_mode", BIAS_MODES)
def test_padded_batch_equals_single_examples(family, bias_mode):
    model = make_decoder(family)
    lengths = [7, 4, 2]
    targets = torch.tensor([3, 8, 11])
    for left in (True, False):  # right padding: a different explained position per example
        ids, mask = decoder_batch(lengths, seed=4, left=left)
        dx = DecompXAttribution(model, bias_mode=bias_mode, memory_budget_mb=0.01)
        res = dx.decompose(ids, target=targets, additional_forward_args=mask, layer_parts=True)
        if bias_mode == "separate":
            adj = dx.decompose(ids, target=targets, additional_forward_args=mask)
            assert adj.algorithm == "adjoint"
            torch.testing.assert_close(adj.scores, res.scores, rtol=0, atol=1e-10)
        t = ids.shape[1]
        for b, n in enumerate(lengths):
            sl = slice(t - n, t) if left else slice(0, n)
            alone = dx.decompose(ids[b : b + 1, sl], target=int(targets[b]), layer_parts=True)
            torch.testing.assert_close(res.scores[b, sl], alone.scores[0], rtol=0, atol=1e-10)
            torch.testing.assert_close(res.bias_scores[b], alone.bias_scores[0], rtol=0, atol=1e-10)
            torch.testing.assert_close(res.logits[b], alone.logits[0], rtol=0, atol=1e-10)
            assert (res.scores[b][mask[b] == 0] == 0).all()
            assert int(res.explained_position[b]) == (t - 1 if left else n - 1)


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_causality_later_tokens_get_exactly_zero(family):
    model = make_decoder(family)
    ids, _ = decoder_batch([7], seed=5)
    for bias_mode, algorithm in (("separate", "adjoint"), ("separate", "forward"), ("spread", "forward")):
        res = DecompXAttribution(model, bias_mode=bias_mode, algorithm=algorithm, explained_position=3).decompose(ids, target=4)
        assert int(res.explained_position[0]) == 3
        assert (res.scores[0, 4:] == 0).all()  # not masked afterwards: the propagated parts are exactly 0
        assert res.scores[0, :4].abs().min() > 0
        prefix = DecompXAttribution(model, bias_mode=bias_mode, algorithm=algorithm).decompose(ids[:, :4], target=4)
        torch.testing.assert_close(res.scores[0, :4], prefix.scores[0], rtol=0, atol=1e-10)
        torch.testing.assert_close(res.logits, real_logits(model, ids, torch.ones_like(ids))[:, 3, 4:5], rtol=0, atol=1e-12)


def test_target_foil_is_the_difference():
    model = make_decoder("qwen2", tied=False)
    ids, mask = decoder_batch([6, 5], seed=6)
    for bias_mode in BIAS_MODES:
        dx = DecompXAttribution(model, bias_mode=bias_mode)
        both = dx.decompose(ids, target=torch.tensor([3, 4]), additional_forward_args=mask, foil=7)
        logits = real_logits(model, ids, mask)[:, -1]
        torch.testing.assert_close(both.logits[:, 0], logits[:, [3, 4]].diagonal() - logits[:, 7], rtol=0, atol=1e-12)
        assert both.delta.max() < TOL and both.foil.tolist() == [7, 7]
        pair = dx.attribute(ids, target=np.array([3, 4]), additional_forward_args=mask, foil=[7, np.int32(7)])
        torch.testing.assert_close(pair, both.scores, rtol=0, atol=1e-12)
        with pytest.raises(ValueError, match="foil="):  # the old (target, foil) tuple: an error that says what to write
            dx.attribute(ids, target=(3, 7), additional_forward_args=mask)
        if bias_mode == "separate":  # linear in the unembedding direction
            diff = dx.attribute(ids, target=[3, 4], additional_forward_args=mask) - dx.attribute(ids, 7, mask)
            torch.testing.assert_close(both.scores, diff, rtol=0, atol=1e-12)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_model_unchanged_no_grad_and_captum_contract(attn):
    model = make_decoder("llama", attn=attn)
    ids, mask = decoder_batch([6, 3], seed=7, left=False)  # HF's own eager forward gives NaN rows for left pads
    before = real_logits(model, ids, mask).clone()
    assert torch.isfinite(before).all()
    impl = model.config._attn_implementation
    n_hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    params = {k: v.clone() for k, v in model.state_dict().items()}
    dx = DecompXAttribution(model)
    assert dx.has_convergence_delta() and dx.get_name() == "DecompX"
    assert hasattr(DecompXAttribution.attribute, "__wrapped__")  # @log_usage
    with torch.no_grad():
        scores, delta = dx.attribute(ids, additional_forward_args=(mask,), return_convergence_delta=True)
    assert scores.shape == ids.shape and delta.shape == (2,) and delta.max() < TOL and not scores.requires_grad
    explicit = dx.attribute(ids, target=before[[0, 1], [5, 2]].argmax(-1), additional_forward_args=mask)
    torch.testing.assert_close(scores, explicit, rtol=0, atol=0)
    (tup,) = dx.attribute((ids,), target=2, additional_forward_args=mask)
    torch.testing.assert_close(tup, dx.attribute(ids, torch.tensor(2), mask), rtol=0, atol=0)
    torch.testing.assert_close(real_logits(model, ids, mask), before, rtol=0, atol=0)
    assert model.config._attn_implementation == impl
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == n_hooks
    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())
    assert not model.training


def test_bare_decoder_needs_an_unembedding_and_errors():
    lm = make_decoder("gpt2", tied=False)
    ids, mask = decoder_batch([6, 3], seed=8)
    ref = DecompXAttribution(lm).attribute(ids, 5, mask)
    with pytest.raises(ValueError, match="no LM head.*unembedding"):
        DecompXAttribution(lm.transformer)
    got = DecompXAttribution(lm.transformer, unembedding=lm.lm_head.weight).attribute(ids, 5, mask)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    dx = DecompXAttribution(lm)
    with pytest.raises(ValueError, match="token ids must lie"):
        dx.attribute(ids, target=999, additional_forward_args=mask)
    with pytest.raises(ValueError, match="real"):
        DecompXAttribution(lm, explained_position=torch.tensor([0, 0])).attribute(ids, 5, mask)  # a pad (left padding)
    with pytest.raises(ValueError, match="nodes"):
        DecompXAttribution(make_decoder("llama"), nodes=0)
    with pytest.raises(ValueError, match="decoders only"):
        DecompXAttribution(make_model("bert"), explained_position=0)
    with pytest.raises(ValueError, match="forward"):
        DecompXAttribution(lm, bias_mode="spread", algorithm="adjoint")


def test_authentic_rmsnorm_delta_is_reported():
    r"""HF's RMSNorm computes in float32 inside a float64 model: delta shows that rounding, nothing hides it."""
    model = make_decoder("llama", exact_norms=False)
    ids, mask = decoder_batch([6, 4], seed=9)
    res = DecompXAttribution(model).decompose(ids, target=4, additional_forward_args=mask)
    logit = real_logits(model, ids, mask)[:, -1, 4]
    torch.testing.assert_close(res.logits[:, 0], logit, rtol=0, atol=1e-12)
    assert 0 < res.delta.max() < 1e-5 * logit.abs().max()


def test_spread_weights_per_example_fallback():
    from captum_normattr.decompose.methods.decompx.parts import spread_weights
    from captum_normattr.decompose.methods.decompx.readout import logit_scores
    from captum_normattr.decompose.records import NormParams

    dots = torch.zeros(2, 1, 3)
    w = spread_weights(dots, torch.tensor([[2], [0]]))
    torch.testing.assert_close(w, torch.tensor([[[0.0, 0.0, 1.0]], [[1.0, 0.0, 0.0]]]))
    # an LM-head bias with all token logits 0 goes to the explained position, per example
    parts = torch.zeros(2, 3, 4, dtype=torch.float64)
    real = torch.randn(2, 4, dtype=torch.float64)
    p = NormParams(torch.ones(4, dtype=torch.float64), None, 1e-6, "rmsnorm")
    s, s_b = logit_scores(parts, torch.zeros(2, 4, dtype=torch.float64), p, real, torch.randn(2, 4, dtype=torch.float64),
                          torch.tensor([1.5, -2.0], dtype=torch.float64), "spread", fallback=torch.tensor([1, 2]))
    torch.testing.assert_close(s, torch.tensor([[0.0, 1.5, 0.0], [0.0, 0.0, -2.0]], dtype=torch.float64))
    assert (s_b == 0).all()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_float32_decoder(family):
    model = make_decoder(family, tied=False).float()
    ids, mask = decoder_batch([6, 4], seed=10)
    adj = DecompXAttribution(model).decompose(ids, target=3, additional_forward_args=mask)
    fwd = DecompXAttribution(model, algorithm="forward").decompose(ids, target=3, additional_forward_args=mask)
    assert adj.scores.dtype == torch.float32
    for res in (adj, fwd):
        assert res.delta.max() < 1e-5 * res.logits.abs().max()
    torch.testing.assert_close(adj.scores, fwd.scores, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------- toy model
KEY_ID, TOY_TARGET = 11, 5


def toy_gpt2():
    r"""A GPT-2 whose next-token logit of TOY_TARGET depends on the KEY_ID tokens only (and on the length).

    Features split into A = 0..11 and B = 12..23. Every token and position has one embedding
    (in A, features 0 and 1 equal) except KEY_ID, whose features 0 and 1 differ. Layer 1
    attends uniformly (zero queries and keys) and its values read feature 0 minus feature 1
    of LN1's output (LN1 gamma/beta equal there), 0 for every token but KEY; W_O writes into
    B. Layer 2 has zero values, the FFs zero input weights. The final norm keeps only B and
    the LM-head row of TOY_TARGET lives in B with entries summing to 0, so the centering's
    constant (which carries the last token's own embedding) is removed.
    """
    m = make_decoder("gpt2", tied=False, seed=3)
    A, B = slice(0, 12), slice(12, 24)
    d = 24
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        wte, wpe = m.transformer.wte.weight, m.transformer.wpe.weight
        wte[:] = wte[0]
        wte[:, 1] = wte[:, 0]
        wte[:, B] = 0.0
        wpe.zero_()
        wte[KEY_ID, A] += torch.randn(12, generator=g, dtype=torch.float64)
        wte[KEY_ID, 0] += 3.0
        for i, block in enumerate(m.transformer.h):
            block.ln_1.weight[1] = block.ln_1.weight[0]
            block.ln_1.bias[1] = block.ln_1.bias[0]
            c = block.attn.c_attn
            c.weight[:, : 3 * d] = 0.0
            c.bias[:] = 0.0
            if i == 0:
                w = 5.0 * torch.randn(d, generator=g, dtype=torch.float64)
                c.weight[0, 2 * d :] = w
                c.weight[1, 2 * d :] = -w
            block.attn.c_proj.weight[:, A] = 0.0  # Conv1D [in, out]: W_O writes into B only
            block.mlp.c_fc.weight.zero_()
            block.mlp.c_fc.bias.zero_()
        m.transformer.ln_f.weight[A] = 0.0
        m.transformer.ln_f.weight[B] = 1.0
        m.transformer.ln_f.bias[A] = 0.0
        u = torch.randn(12, generator=g, dtype=torch.float64)
        m.lm_head.weight[TOY_TARGET] = 0.0
        m.lm_head.weight[TOY_TARGET, B] = u - u.mean()
    return m


def test_toy_decoder_one_token_gets_all_the_score():
    m = toy_gpt2()
    ids = torch.tensor([[7, 5, KEY_ID, 9, 7, 3], [8, KEY_ID, 6, 4, 5, 4]])
    mask = torch.ones_like(ids)
    logit = real_logits(m, ids, mask)[:, -1, TOY_TARGET]
    other = ids.clone()
    other[0, [0, 1, 3, 4, 5]] = torch.tensor([13, 17, 19, 23, 29])
    other[1, [0, 2, 3, 4, 5]] = torch.tensor([31, 37, 41, 43, 47])
    torch.testing.assert_close(real_logits(m, other, mask)[:, -1, TOY_TARGET], logit, rtol=0, atol=1e-12)
    without = ids.clone()
    without[0, 2] = 17
    assert (real_logits(m, without, mask)[0, -1, TOY_TARGET] - logit[0]).abs() > 1e-3  # KEY does matter
    key = ids == KEY_ID
    for bias_mode, algorithm in (("separate", "adjoint"), ("separate", "forward")):
        res = DecompXAttribution(m, bias_mode=bias_mode, algorithm=algorithm).decompose(ids, target=TOY_TARGET)
        assert res.scores[~key].abs().max() < 1e-12
        torch.testing.assert_close(res.scores[key], logit - res.bias_scores[:, 0], rtol=0, atol=1e-12)
        assert res.scores[key].abs().min() > 1e-3
        res0 = DecompXAttribution(m, algorithm=algorithm).decompose(without[:1], target=TOY_TARGET)
        assert res0.scores.abs().max() < 1e-12


# ------------------------------------------------------------------ streaming: one layer at a time
class LayerWatch:
    r"""Watches a Recorder: the layers rerun (in order) and, whenever a layer's tensors are made,
    how many earlier LayerTensors (and attention probabilities of earlier reruns) are still alive."""

    def __init__(self, monkeypatch):
        import weakref

        from captum_normattr.models.capture.recorder import Recorder

        self.reruns, self.layers_made = [], 0
        self.most_alive = self.most_alive_probs = 0
        self._tensors, self._probs, self._in_rerun = [], [], False
        make, rerun = Recorder.layer_tensors, Recorder.rerun_layer

        def layer_tensors(rec, idx, recorded):
            self.most_alive = max(self.most_alive, sum(r() is not None for r in self._tensors))
            self.most_alive_probs = max(self.most_alive_probs, sum(r() is not None for r in self._probs))
            out = make(rec, idx, recorded)
            self.layers_made += 1
            self._tensors.append(weakref.ref(out))
            if self._in_rerun:
                self._probs.append(weakref.ref(out.probs))
            return out

        def rerun_layer(rec, idx, hidden_in):
            self.reruns.append(idx)
            self._in_rerun = True
            try:
                return rerun(rec, idx, hidden_in)
            finally:
                self._in_rerun = False

        monkeypatch.setattr(Recorder, "layer_tensors", layer_tensors)
        monkeypatch.setattr(Recorder, "rerun_layer", rerun_layer)


def _six_layer_bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=60, hidden_size=24, num_hidden_layers=6, num_attention_heads=4, intermediate_size=40,
                     max_position_embeddings=24, num_labels=3)
    return BertForSequenceClassification(cfg).double().eval()


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_streaming_holds_one_layer_at_a_time(family, monkeypatch):
    r"""Adjoint: the forward pass keeps no layer, then layers L-1..0 are rerun once each, in reverse order,
    and no layer's tensors or attention probabilities outlive its own step. Forward: no rerun, one layer alive."""
    if family == "bert":
        model = _six_layer_bert()
        ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        mask[1, 5:] = 0
        runs = [("adjoint", "decompose", None), ("adjoint", "attribute", 2), ("forward", "decompose", None)]
    else:
        model = make_decoder(family, layers=6)
        ids, mask = decoder_batch([7, 5], seed=11)
        runs = [("adjoint", "decompose", 4), ("adjoint", "attribute", 4), ("forward", "decompose", 4)]
    n = 6
    for algorithm, call, target in runs:
        watch = LayerWatch(monkeypatch)
        dx = DecompXAttribution(model, algorithm=algorithm)
        if call == "decompose":
            res = dx.decompose(ids, target=target, additional_forward_args=mask)
            assert res.algorithm == algorithm and res.delta.max() < TOL
        else:
            foil = None if dx.output is None or not dx.decoder else 9  # a contrast on the decoder
            _, delta = dx.attribute(ids, target=target, additional_forward_args=mask, return_convergence_delta=True,
                                    foil=foil)
            assert delta.max() < TOL
        monkeypatch.undo()
        expect = list(range(n - 1, -1, -1)) if algorithm == "adjoint" else []
        assert watch.reruns == expect, (algorithm, call, watch.reruns)
        assert watch.layers_made == n + len(expect)
        assert watch.most_alive == 0, (algorithm, call, watch.most_alive)  # earlier layers' tensors are gone
        assert watch.most_alive_probs == 0  # the rerun's probabilities die with its step
