r"""DecompX: completeness against the real tensors, a naive reference, padding, toy model, MiniLM."""
import numpy as np
import pytest
import torch
from conftest import FAMILIES, VOCAB, make_model, random_batch
from layer_capture import capture_layers

from captum_normattr import DecompXAttribution, UnsupportedModelError
from captum_normattr.models.engine import compute_dtype
from captum_normattr.decompose.methods.decompx.parts import BIAS_MODES, SPREAD_MODES, spread_weights
from captum_normattr.decompose.methods.decompx.propagation import propagate_parts
from captum_normattr.models.adapters import get_adapter, get_path, layer_modules, linear_params
from captum_normattr.models.heads import find_classifier_head, head_params

TOL = 1e-9


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return make_model(request.param)


# ----------------------------------------------------------------------- naive reference
def _frozen_layer(x, layer, w_v, b_v, with_bias):
    r"""The layer with its nonlinear quantities frozen at the real values, head by head, no chunking."""
    h = layer.num_heads
    dh = w_v.shape[1] // h
    v = x @ w_v + (b_v if with_bias else 0.0)
    a = torch.zeros_like(x)
    for head in range(h):
        sl = slice(head * dh, (head + 1) * dh)
        a = a + torch.einsum("bij,bjd->bid", layer.probs[:, head], v[..., sl]) @ layer.out_weight[sl]
    if with_bias and layer.out_bias is not None:
        a = a + layer.out_bias
    z = a + x

    def ln(u, real, p):
        s = torch.sqrt(real.var(-1, unbiased=False) + p.eps)[..., None]
        out = p.weight * (u - u.mean(-1, keepdim=True)) / s
        return out + p.bias if with_bias else out

    zt = ln(z, layer.ln1_in, layer.ln1)
    f = layer.ff
    act = f.act
    real_pre = layer.ln1_out @ f.w_in + f.b_in
    g0 = act(torch.zeros((), dtype=x.dtype))
    ratio = (act(real_pre) - g0) / real_pre
    p = zt @ f.w_in + (f.b_in if with_bias else 0.0)
    ff = (p * ratio) @ f.w_out
    if with_bias:
        ff = ff + g0 * f.w_out.sum(0) + f.b_out
    return ln(zt + ff, layer.ln2_in, layer.ln2)


def naive_class_scores(model, ids, mask):
    r"""One source token at a time through the frozen network: (B, T, C) scores, (B, C) bias."""
    adapter = get_adapter(model)
    dtype = compute_dtype(model)
    layers = capture_layers(model, ids, mask, top_model=True)
    vp = [linear_params(get_path(m, adapter.attn_value)) for m in layer_modules(model, adapter)]
    hp = head_params(model, find_classifier_head(model), dtype)
    real_u = layers[-1].layer_out[:, 0] @ hp.w_dense + hp.b_dense
    ratio = (hp.act(real_u) - hp.act(torch.zeros((), dtype=dtype))) / real_u
    e = layers[0].hidden_in
    b, t, _ = e.shape

    def run(x, with_bias):
        for layer, (w, bv) in zip(layers, vp):
            x = _frozen_layer(x, layer, w.detach(), bv.detach(), with_bias)
        u = x[:, 0] @ hp.w_dense + (hp.b_dense if with_bias else 0.0)
        out = (u * ratio) @ hp.w_cls
        return out + hp.b_cls if with_bias else out

    scores = []
    for k in range(t):
        x = torch.zeros_like(e)
        x[:, k] = e[:, k]
        scores.append(run(x, False))
    return torch.stack(scores, 1) * mask[..., None], run(torch.zeros_like(e), True)


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("bias_mode", BIAS_MODES)
def test_completeness_every_layer_and_logits(model, bias_mode):
    ids, mask = random_batch([7, 5, 2], seed=3)
    dx = DecompXAttribution(model, bias_mode=bias_mode, full_last_layer=True)
    res = dx.decompose(ids, additional_forward_args=(mask,), layer_parts=True)
    assert res.algorithm == "forward"
    assert res.layer_errors.shape == (3, model.config.num_hidden_layers if hasattr(model.config, "num_hidden_layers") else 2)
    assert res.layer_errors.max() < TOL
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(res.logits, logits, rtol=0, atol=1e-12)  # recorded (eager) vs sdpa forward
    torch.testing.assert_close(res.class_scores.sum(1) + res.bias_scores, logits, rtol=0, atol=TOL)
    assert res.delta.max() < TOL
    if bias_mode in SPREAD_MODES:
        assert (res.bias_scores == 0).all() and (res.layer_bias_norms == 0).all()
    else:
        assert res.bias_scores.abs().min() > 0  # perturbed biases: a bias part really exists
    # pads: exactly 0 scores and 0 map rows/columns
    assert (res.class_scores[mask == 0] == 0).all()
    assert (res.layer_part_norms[:, :, :, :][mask[:, None, None, :].expand_as(res.layer_part_norms) == 0] == 0).all()


def test_matches_naive_reference_and_chunking(model):
    ids, mask = random_batch([6, 4], seed=5)
    ref, ref_bias = naive_class_scores(model, ids, mask)
    for budget in (1e-4, 256.0):  # 1 source token / 1 row per chunk, and no chunking
        res = DecompXAttribution(model, memory_budget_mb=budget, algorithm="forward").decompose(ids, additional_forward_args=(mask,))
        assert res.algorithm == "forward"
        torch.testing.assert_close(res.class_scores, ref, rtol=0, atol=1e-10)
        torch.testing.assert_close(res.bias_scores, ref_bias, rtol=0, atol=1e-10)
    full = DecompXAttribution(model, full_last_layer=True, algorithm="forward").decompose(ids, additional_forward_args=(mask,))
    torch.testing.assert_close(full.class_scores, ref, rtol=0, atol=1e-10)
    # the adjoint algorithm (the default for "separate") gives the same numbers
    adj = DecompXAttribution(model).decompose(ids, additional_forward_args=(mask,))
    assert adj.algorithm == "adjoint" and adj.layer_part_norms is None
    torch.testing.assert_close(adj.class_scores, ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(adj.bias_scores, ref_bias, rtol=0, atol=1e-10)
    assert adj.delta.max() < TOL


@pytest.mark.parametrize("bias_mode", BIAS_MODES)
def test_padded_batch_equals_single_examples(model, bias_mode):
    lengths = [7, 4, 2]
    ids, mask = random_batch(lengths, seed=7)
    dx = DecompXAttribution(model, bias_mode=bias_mode, memory_budget_mb=0.01)
    res = dx.decompose(ids, target=torch.tensor([0, 1, 1]), additional_forward_args=(mask,), layer_parts=True)
    adj = dx.decompose(ids, target=torch.tensor([0, 1, 1]), additional_forward_args=(mask,))
    torch.testing.assert_close(adj.scores, res.scores, rtol=0, atol=1e-10)
    for b, n in enumerate(lengths):
        alone = dx.decompose(ids[b : b + 1, :n], target=[[0, 1, 1][b]], additional_forward_args=(mask[b : b + 1, :n],),
                             layer_parts=True)
        torch.testing.assert_close(res.class_scores[b, :n], alone.class_scores[0], rtol=0, atol=1e-10)
        torch.testing.assert_close(res.scores[b, :n], alone.scores[0], rtol=0, atol=1e-10)
        torch.testing.assert_close(res.bias_scores[b], alone.bias_scores[0], rtol=0, atol=1e-10)
        assert (res.scores[b, n:] == 0).all()
        torch.testing.assert_close(res.example(b)["layer_part_norms"][:-1], alone.layer_part_norms[0, :-1], rtol=0, atol=1e-10)


def test_model_unchanged_no_grad_and_captum_contract(model):
    ids, mask = random_batch([6, 3], seed=2)
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits.clone()
    impl = model.config._attn_implementation
    n_hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    params = {k: v.clone() for k, v in model.state_dict().items()}
    dx = DecompXAttribution(model)
    with torch.no_grad():
        scores, delta = dx.attribute(ids, additional_forward_args=(mask,), return_convergence_delta=True)
    assert scores.shape == ids.shape and delta.shape == (2,) and delta.max() < TOL
    assert not scores.requires_grad
    # default target: the predicted class
    explicit = dx.attribute(ids, target=before.argmax(-1), additional_forward_args=(mask,))
    torch.testing.assert_close(scores, explicit, rtol=0, atol=0)
    # int target and tuple in -> tuple out
    (t1,) = dx.attribute((ids,), target=1, additional_forward_args=mask)
    res = dx.decompose(ids, additional_forward_args=(mask,))
    torch.testing.assert_close(t1, res.class_scores[..., 1], rtol=0, atol=1e-12)  # target-only path = all-class path
    assert dx.has_convergence_delta() and dx.get_name() == "DecompX"
    assert DecompXAttribution(model, bias_mode="spread").get_name() == "DecompX (spread bias)"
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert model.config._attn_implementation == impl
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == n_hooks
    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())
    assert not model.training


def test_input_errors():
    model = make_model("bert")
    ids, mask = random_batch([4, 3])
    dx = DecompXAttribution(model)
    with pytest.raises(ValueError, match="out of range"):
        dx.attribute(ids, target=2, additional_forward_args=(mask,))
    with pytest.raises(ValueError, match="shape"):
        dx.attribute(ids, target=torch.tensor([0, 1, 0]), additional_forward_args=(mask,))
    with pytest.raises(TypeError, match="integer"):
        dx.attribute(ids, target=torch.tensor([0.0, 1.0]), additional_forward_args=(mask,))
    # Captum's target conventions: a tuple indexes the output's dimensions (one index for (B, C) logits)
    with pytest.raises(ValueError, match="list"):
        dx.attribute(ids, target=(1, 0), additional_forward_args=(mask,))
    with pytest.raises(ValueError, match="foil= applies to the next-token logit"):
        dx.attribute(ids, target=1, foil=0, additional_forward_args=(mask,))
    one = dx.attribute(ids, target=1, additional_forward_args=(mask,))
    for same in ((1,), np.int64(1), torch.tensor(1), np.array(1), [1, 1], np.array([1, 1])):
        torch.testing.assert_close(dx.attribute(ids, target=same, additional_forward_args=(mask,)), one, rtol=0, atol=0)
    with pytest.raises(ValueError, match="separate"):
        DecompXAttribution(model, bias_mode="absdot")
    with pytest.raises(ValueError, match="auto"):
        DecompXAttribution(model, algorithm="backward")
    with pytest.raises(ValueError, match="forward"):
        DecompXAttribution(model, bias_mode="spread", algorithm="adjoint")
    with pytest.raises(ValueError, match="budget"):
        DecompXAttribution(model, memory_budget_mb=0)
    with pytest.raises(UnsupportedModelError, match="BertForSequenceClassification|BERT"):
        DecompXAttribution(model.bert)  # a bare encoder has no classes to explain


def test_spread_weights_fallback():
    dots = torch.tensor([[[1.0, -3.0, 0.0], [0.0, 0.0, 0.0]]])
    w = spread_weights(dots, torch.tensor([0, 1]))
    torch.testing.assert_close(w, torch.tensor([[[0.25, 0.75, 0.0], [0.0, 1.0, 0.0]]]))


# ------------------------------------------------------------------------- toy model
KEY_ID = 11


def toy_bert():
    r"""A BERT classifier whose logits depend on the KEY_ID tokens only (and on the length).

    Features split into A = 0..11 and B = 12..23. All other tokens and all positions share
    one embedding output x (nonzero; the norm scales would otherwise depend on token 0),
    which lives in A, and its feature 0 minus feature 1 is nonzero only for KEY_ID; layer 1 attends uniformly
    (zero queries and keys) and its values read only x_0 - x_1, so only KEY tokens feed
    the attention output, which W_O writes into B. The norms zero A (gamma_A = beta_A = 0)
    and keep B with a constant gamma, so the residual of token 0 reaches B only as a
    constant vector, which the pooler (columns summing to 0 over B, 0 over A) removes. The
    FF blocks are 0 except their output bias, and layer 2 moves nothing between tokens.
    """
    m = make_model("bert", seed=4)
    A, B = slice(0, 12), slice(12, 24)
    with torch.no_grad():
        emb = m.bert.embeddings
        for table in (emb.word_embeddings.weight, emb.position_embeddings.weight, emb.token_type_embeddings.weight):
            table[:] = table[0]  # every token and position alike (the norm scales then depend on KEY only)
            table[:, 1] = table[:, 0]
        emb.word_embeddings.weight[KEY_ID, :12] += torch.randn(12, dtype=torch.float64)
        emb.word_embeddings.weight[KEY_ID, 0] += 3.0
        emb.LayerNorm.weight[A] = 1.0
        emb.LayerNorm.weight[B] = 0.0
        emb.LayerNorm.bias[1] = emb.LayerNorm.bias[0]
        emb.LayerNorm.bias[B] = 0.0
        for i, layer in enumerate(m.bert.encoder.layer):
            att = layer.attention
            for lin in (att.self.query, att.self.key):
                lin.weight.zero_()
                lin.bias.zero_()
            w = 20.0 * torch.randn(24, dtype=torch.float64)
            att.self.value.weight.zero_()
            if i == 0:
                att.self.value.weight[:, 0] = w
                att.self.value.weight[:, 1] = -w
            att.output.dense.weight[A] = 0.0
            for ln in (att.output.LayerNorm, layer.output.LayerNorm):
                ln.weight[A] = 0.0
                ln.bias[A] = 0.0
                ln.weight[B] = 1.0
            layer.intermediate.dense.weight.zero_()
            layer.intermediate.dense.bias.zero_()
        pw = m.bert.pooler.dense.weight
        pw[:, A] = 0.0
        pw[:, B] -= pw[:, B].mean(1, keepdim=True)
    return m


def test_toy_model_one_token_gets_all_the_score():
    m = toy_bert()
    ids = torch.tensor([[2, 5, KEY_ID, 9, 7, 3], [2, 8, 6, KEY_ID, 5, 4]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        logits = m(input_ids=ids, attention_mask=mask).logits
        # the construction: other tokens (position 0 included) do not change the logits
        other = ids.clone()
        other[0, [0, 1, 3, 4, 5]] = torch.tensor([13, 17, 19, 23, 29])
        other[1, [0, 1, 2, 4, 5]] = torch.tensor([31, 37, 41, 43, 47])
        torch.testing.assert_close(m(input_ids=other, attention_mask=mask).logits, logits, rtol=0, atol=1e-12)
        without = ids.clone()
        without[0, 2] = 17
        assert (m(input_ids=without, attention_mask=mask).logits - logits).abs().max() > 1e-3  # KEY does matter
    key = ids == KEY_ID
    for algorithm in ("adjoint", "forward"):
        dx = DecompXAttribution(m, algorithm=algorithm)
        res = dx.decompose(ids, additional_forward_args=(mask,))
        assert res.class_scores[~key].abs().max() < 1e-12
        torch.testing.assert_close(res.class_scores[key], logits - res.bias_scores, rtol=0, atol=1e-12)
        assert res.class_scores[key].abs().min() > 1e-3
        # no KEY token: every score 0, the logit is all bias
        res0 = dx.decompose(without[:1], additional_forward_args=(mask[:1],))
        assert res0.class_scores.abs().max() < 1e-12


# ---------------------------------------------------------------------- real MiniLM
def test_minilm_float32_completeness():
    from transformers import AutoTokenizer, BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    from captum_normattr import default_model_path

    torch.manual_seed(0)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = BertForSequenceClassification.from_pretrained(default_model_path(), num_labels=2).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
    tok = AutoTokenizer.from_pretrained(default_model_path())
    batch = tok(["a gripping, funny and moving film", "dull"], return_tensors="pt", padding=True)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    scores = {}
    for mode, algorithm in (("separate", "adjoint"), ("separate", "forward"), ("spread", "forward")):
        res = DecompXAttribution(model, bias_mode=mode, algorithm=algorithm).decompose(ids, additional_forward_args=(mask,))
        assert res.class_scores.dtype == torch.float32
        scale = res.logits.abs().max()
        rel = (res.class_scores.sum(1) + res.bias_scores - res.logits).abs().max() / scale
        assert rel < 1e-4, (mode, algorithm, float(rel))
        if algorithm == "forward":
            assert res.layer_errors[:, :-1].max() < 1e-4 * 10  # layer outputs are O(1)-O(10)
        scores[mode, algorithm] = res.class_scores
    torch.testing.assert_close(scores["separate", "adjoint"], scores["separate", "forward"], rtol=1e-4, atol=1e-5)


def test_baselines_decompx_in_harness():
    from captum_normattr.evaluation import FaithfulnessHarness, SequenceClassifier, baselines

    model = make_model("bert", seed=1)
    ids, mask = random_batch([8, 6, 5, 3], seed=9)
    ids[:, 0] = 2
    for b, n in enumerate(mask.sum(1).tolist()):
        ids[b, n - 1] = 3
    clf = SequenceClassifier(model, special_token_ids=[0, 2, 3], mask_token_id=4, pad_token_id=0)
    m = baselines.decompx(model)
    assert m.uses_target and m.name == "DecompX"
    labels = torch.tensor([0, 1, 1, 0])
    s = m(ids, mask, labels)
    ref = DecompXAttribution(model).attribute(ids, target=labels, additional_forward_args=(mask,))
    torch.testing.assert_close(s, ref, rtol=0, atol=0)
    res = FaithfulnessHarness(clf, [m, baselines.decompx(model, "spread")], ["eraser_aopc"], batch_size=2, progress=False).run(
        ids, mask, labels)
    assert all(res.summary()[name]["eraser_comp"]["n"] == len(ids) for name in res.methods)


def test_spread_mode_splits_a_bias_by_abs_dot_products():
    r"""Only the classifier bias nonzero: "spread" = "separate" scores + |<s_k, b>|-weighted shares of b."""
    m = make_model("bert", seed=2)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if (name.endswith("bias") and not name.startswith("classifier")) or name.endswith("token_type_embeddings.weight"):
                p.zero_()
    ids, mask = random_batch([6, 4], seed=4)
    sep = DecompXAttribution(m).decompose(ids, additional_forward_args=(mask,))
    spr = DecompXAttribution(m, bias_mode="spread").decompose(ids, additional_forward_args=(mask,))
    b_c = m.classifier.bias.detach()
    torch.testing.assert_close(sep.bias_scores, b_c.expand_as(sep.bias_scores), rtol=0, atol=1e-12)
    dots = (sep.class_scores * b_c).sum(-1).abs()
    w = dots / dots.sum(-1, keepdim=True)
    torch.testing.assert_close(spr.class_scores, sep.class_scores + w[..., None] * b_c, rtol=0, atol=1e-10)
