r"""DeBERTa-v2/v3 and ModernBERT: recorded probabilities, naive per-token references, class logits.

- The probabilities the capture records are the attention modules' own: compared with the
  eager model's ``output_attentions`` (DeBERTa's disentangled attention with its c2p and p2c
  terms; ModernBERT's global and sliding-window layers, whose eager softmax runs in float32:
  1e-6 relative there).
- GlobEnc's N_RES and the ALTI map of every layer equal a naive reference written from the
  equations, token by token and head by head, with the model's own probabilities and modules
  (none of the package's maths); with DeBERTa's relative-position terms dropped from the
  probabilities the reference is far away, so the comparison would catch a recording that
  missed them.
- DecompX: the token scores plus the bias score equal the model's own class logit (a plain
  forward pass) to 1e-10 relative, padded batches equal single examples, the model is unchanged;
  what cannot be decomposed is refused with its reason.
"""
import copy

import pytest
import torch

from captum_normattr import (
    ALTIAttribution,
    DecompXAttribution,
    FFIntegratedDecomposition,
    GlobEncAttribution,
    UnsupportedModelError,
)
from captum_normattr.models.adapters import get_adapter
from captum_normattr.models.capture.session import recording
from decoder_models import decoder_batch
from zoo import build
from map_checks import check_maps_complete

FAMILIES = ["deberta-v2", "modernbert"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def recorded_probs(model, ids, mask):
    got = []
    with torch.no_grad(), recording(model, get_adapter(model), lambda layer: got.append(layer.probs), torch.float64):
        model(input_ids=ids, attention_mask=mask)
    return got


def eager_outputs(model, ids, mask):
    r"""The model's own eager forward with ``output_attentions`` and ``output_hidden_states``."""
    before = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    finally:
        model.config._attn_implementation = before


@pytest.mark.parametrize("key", FAMILIES)
def test_recorded_probabilities_are_the_modules_own(key):
    model = build(key, "bare")
    ids, mask = decoder_batch([7, 5], seed=4, left=False)
    got = recorded_probs(model, ids, mask)
    own = eager_outputs(model, ids, mask).attentions
    assert len(got) == len(own) == model.config.num_hidden_layers
    tol = 1e-12 if key == "deberta-v2" else 1e-6  # ModernBERT's eager softmax computes in float32
    valid = mask.bool()
    for g, o in zip(got, own):
        rows = valid[:, None, :, None] & valid[:, None, None, :]  # real queries and keys (pad rows differ by design)
        assert float((g - o).abs().masked_fill(~rows, 0).max()) < tol
    if key == "modernbert":  # the sliding-window layer attends within |i - j| <= window / 2 only
        i = torch.arange(ids.shape[1])
        far = (i[:, None] - i[None, :]).abs() > model.config.sliding_window
        assert float(got[1][..., far].abs().max()) == 0 and float(got[0][..., far].abs().max()) > 1e-3


def _value_out(layer, key):
    if key == "deberta-v2":
        att = layer.attention
        v, o = att.self.value_proj, att.output.dense
        return v.weight.T, v.bias, o.weight.T, o.bias
    d = layer.attn.Wo.weight.shape[0]
    w, b = layer.attn.Wqkv.weight, layer.attn.Wqkv.bias  # rows [q | k | v]
    return w[2 * d:].T, b[2 * d:], layer.attn.Wo.weight.T, layer.attn.Wo.bias


def naive_layer_maps(model, key, x, probs, layer, mask):
    r"""(N_RES, ALTI) (B, T, T) of one layer, from the equations, token by token and head by head.

    h_{i<-j} = [i = j] x_i + sum_h alpha^h_ij (u_j W_V^h + b_V^h) W_O^h with u = x (DeBERTa, post-LN)
    or u = N1(x) (ModernBERT, pre-LN; the first layer's N1 is the identity); N_RES_ij = |h_{i<-j}|.
    ALTI: post-LN on zt_{i<-j} = gamma1 c(h_{i<-j}) / s(z_i) against y_i = LN1(z_i), pre-LN on
    h_{i<-j} against y_i = sum_j h_{i<-j} + b_O; ALTI_ij = max(0, |y_i|_1 - |y_i - part|_1), rows normalised.
    """
    b, h, t, _ = probs.shape
    wv, bv, wo, bo = _value_out(layer, key)
    u = x if key == "deberta-v2" else layer.attn_norm(x)
    v = u @ wv + bv
    dh = wo.shape[0] // h
    parts = torch.zeros(b, t, t, x.shape[-1], dtype=x.dtype)
    for i in range(t):
        for j in range(t):
            for head in range(h):
                cols = slice(head * dh, (head + 1) * dh)
                parts[:, i, j] += probs[:, head, i, j, None] * (v[:, j, cols] @ wo[cols])
            if i == j:
                parts[:, i, j] += x[:, i]
    z = parts.sum(2) + bo
    if key == "deberta-v2":
        ln = layer.attention.output.LayerNorm
        s = torch.sqrt(z.var(-1, unbiased=False) + ln.eps)
        alti_parts = ln.weight * (parts - parts.mean(-1, keepdim=True)) / s[:, :, None, None]
        y = ln(z)
    else:
        alti_parts, y = parts, z
    pair = mask.bool()[:, :, None] & mask.bool()[:, None, :]
    zero = torch.zeros((), dtype=x.dtype)
    n_res = torch.where(pair, parts.norm(dim=-1), zero)
    c = torch.where(pair, (y.abs().sum(-1)[:, :, None] - (y[:, :, None] - alti_parts).abs().sum(-1)).clamp_min(0), zero)
    total = c.sum(-1, keepdim=True)
    return n_res, torch.where(total > 0, c / total, torch.zeros_like(c))


def _layers(model, key):
    base = model.base_model
    return list(base.encoder.layer if key == "deberta-v2" else base.layers)


@pytest.mark.parametrize("key", FAMILIES)
def test_maps_equal_the_naive_reference(key):
    model = build(key, "cls")
    ids, mask = decoder_batch([6, 4], seed=5, left=False)
    got = GlobEncAttribution(model, map_name="N_RES").decompose(ids, additional_forward_args=(mask,))
    alti = ALTIAttribution(model).decompose(ids, additional_forward_args=(mask,))
    tol = 1e-10 if key == "deberta-v2" else 1e-6  # ModernBERT's reference probabilities: float32 eager softmax
    for b, n in enumerate([6, 4]):
        one = slice(0, n)
        out = eager_outputs(model, ids[b:b + 1, one], mask[b:b + 1, one])
        with torch.no_grad():
            for l, layer in enumerate(_layers(model, key)):
                ref_n, ref_a = naive_layer_maps(model, key, out.hidden_states[l], out.attentions[l], layer, mask[b:b + 1, one])
                scale = float(ref_n.abs().max())
                torch.testing.assert_close(got.layer_maps[b:b + 1, l, one, one], ref_n, rtol=0, atol=tol * scale)
                torch.testing.assert_close(alti.layer_maps[b:b + 1, l, one, one], ref_a, rtol=0, atol=tol)
        if n < ids.shape[1]:
            assert float(got.layer_maps[b, :, n:].abs().max()) == 0  # pad rows exactly 0


def _content_only_probs(att, x, mask):
    r"""DeBERTa's probabilities with the relative-position (c2p, p2c) terms dropped: softmax(q k^T / sqrt(3 Dh))."""
    b, t, d = x.shape
    h = att.num_attention_heads
    q = att.query_proj(x).view(b, t, h, -1).transpose(1, 2)
    k = att.key_proj(x).view(b, t, h, -1).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / (q.shape[-1] * 3) ** 0.5
    return torch.softmax(scores.masked_fill(~mask.bool()[:, None, None, :], torch.finfo(x.dtype).min), -1)


def test_deberta_relative_positions_are_in_the_recorded_probabilities():
    r"""Dropping the disentangled terms moves the probabilities and the maps at O(0.1): the reference
    comparison above, at 1e-10, could not pass with a recording that missed them."""
    model = build("deberta-v2", "cls")
    ids, mask = decoder_batch([6], seed=6, left=False)
    got = recorded_probs(model, ids, mask)
    out = eager_outputs(model, ids, mask)
    layer = _layers(model, "deberta-v2")[1]
    with torch.no_grad():
        content = _content_only_probs(layer.attention.self, out.hidden_states[1], mask)
        assert float((content - got[1]).abs().max()) > 1e-2
        wrong, _ = naive_layer_maps(model, "deberta-v2", out.hidden_states[1], content, layer, mask)
        right, _ = naive_layer_maps(model, "deberta-v2", out.hidden_states[1], got[1], layer, mask)
    res = GlobEncAttribution(model, map_name="N_RES").decompose(ids, additional_forward_args=(mask,))
    assert _rel(res.layer_maps[:, 1], right) < 1e-10
    assert _rel(res.layer_maps[:, 1], wrong) > 1e-2


@pytest.mark.parametrize("algorithm,bias_mode", [("adjoint", "separate"), ("forward", "separate"), ("forward", "spread")])
@pytest.mark.parametrize("key", FAMILIES + ["modernbert-mean"])
def test_decompx_sums_to_the_models_class_logit(key, algorithm, bias_mode):
    r"""``modernbert-mean``: ``classifier_pooling="mean"``, the head reads the mean of the real tokens' final-norm outputs."""
    model = build(key, "cls") if key != "modernbert-mean" else build("modernbert", "cls", classifier_pooling="mean")
    state = copy.deepcopy(model.state_dict())
    ids, mask = decoder_batch([7, 5], seed=8, left=False)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits  # plain forward (sdpa), not recorded tensors
    dx = DecompXAttribution(model, algorithm=algorithm, bias_mode=bias_mode, strict=True)
    res = dx.decompose(ids, additional_forward_args=(mask,))
    assert _rel(res.class_scores.sum(1) + res.bias_scores, logits) < 1e-10
    assert _rel(res.logits, logits) < 1e-12
    scores, delta = dx.attribute(ids, target=1, additional_forward_args=(mask,), return_convergence_delta=True)
    assert float(delta.max()) < 1e-10 * float(logits.abs().max())
    torch.testing.assert_close(scores, res.class_scores[..., 1], rtol=0, atol=1e-10 * float(scores.abs().max()))
    alone = dx.decompose(ids[1:, :5])
    torch.testing.assert_close(res.class_scores[1, :5], alone.class_scores[0], rtol=0,
                               atol=1e-10 * float(res.class_scores.abs().max()))
    assert float(res.class_scores[1, 5:].abs().max()) == 0
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_decompx_head_norms_are_needed():
    r"""ModernBERT's class logit goes through the final norm and the head's LayerNorm: dropping either
    from the head parameters leaves a completeness error far above rounding (the test above can fail)."""
    from captum_normattr.decompose.methods.decompx.readout import head_scores

    model = build("modernbert", "cls")
    ids, mask = decoder_batch([6], seed=9, left=False)
    dx = DecompXAttribution(model, algorithm="forward")
    res = dx.decompose(ids, additional_forward_args=(mask,), layer_parts=True)
    assert float(res.delta.max()) < 1e-10
    hp = dx.output.params(torch.float64)
    seen = []
    hook = model.base_model.final_norm.register_forward_hook(lambda m, args, out: seen.append(args[0][:, 0]))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    hook.remove()
    x_last = seen[0]  # the final norm's real input at the head's token
    parts = x_last[:, None]  # one part: the whole head input
    bias = torch.zeros_like(x_last)
    full = head_scores(parts, bias, x_last, hp.w_dense, hp.b_dense, hp.act, hp.w_cls, hp.b_cls,
                       pre_norm=hp.pre_norm, norm=hp.norm)
    for dropped in (dict(pre_norm=None, norm=hp.norm), dict(pre_norm=hp.pre_norm, norm=None)):
        s, s_b = head_scores(parts, bias, x_last, hp.w_dense, hp.b_dense, hp.act, hp.w_cls, hp.b_cls, **dropped)
        assert _rel(s.sum(1) + s_b, full[0].sum(1) + full[1]) > 1e-2
    assert _rel(full[0].sum(1) + full[1], res.logits) < 1e-10


@pytest.mark.parametrize("key", FAMILIES)
def test_bare_models_maps_and_refusals(key):
    model = build(key, "bare")
    ids, mask = decoder_batch([6, 4], seed=10, left=False)
    check_maps_complete(model, ids, (mask,))
    with pytest.raises(UnsupportedModelError, match="no supported classification head"):
        DecompXAttribution(model)


def test_refused_configurations():
    with pytest.raises(UnsupportedModelError, match="conv_kernel_size"):
        GlobEncAttribution(build("deberta-v2", "cls", conv_kernel_size=3))
    model = build("modernbert", "cls")
    model.config.__dict__["classifier_pooling"] = "max"  # a pooling the decompositions do not follow (the config refuses it)
    with pytest.raises(UnsupportedModelError, match="classifier_pooling='max'"):
        DecompXAttribution(model)
    ids, mask = decoder_batch([5, 3], seed=11, left=False)
    res = ALTIAttribution(model, strict=True).decompose(ids, additional_forward_args=(mask,))  # the maps do not need the head
    assert float(res.extras["completeness_error"].max()) < 1e-12


def test_mean_pooling_is_not_the_first_token():
    r"""With ``classifier_pooling="mean"`` every real token's final-norm output reaches the logit: the same model
    explained as if its head read the first token only is caught by the explained-output guard (the mean
    test above could fail)."""
    from dataclasses import replace

    from captum_normattr.attr.explained_output import ExplainedOutputMismatchError

    model = build("modernbert", "cls", classifier_pooling="mean")
    ids, mask = decoder_batch([6], seed=16, left=False)
    dx = DecompXAttribution(model)
    assert dx.output.head.pooling == "mean"
    dx.output.head = replace(dx.output.head, pooling="first")
    with pytest.raises(ExplainedOutputMismatchError):
        dx.decompose(ids, additional_forward_args=(mask,))


def test_modernbert_first_attention_norm_is_the_identity():
    model = build("modernbert", "cls")
    assert isinstance(model.base_model.layers[0].attn_norm, torch.nn.Identity)
    kinds = []
    ids, mask = decoder_batch([5], seed=12, left=False)
    with torch.no_grad(), recording(model, get_adapter(model), lambda layer: kinds.append(layer.ln1.kind), torch.float64):
        model(input_ids=ids, attention_mask=mask)
    assert kinds == ["identity", "layernorm", "layernorm"]


@pytest.mark.parametrize("contribution", ["norm", "alti"])
@pytest.mark.parametrize("key", FAMILIES)
def test_ff_scopes_and_globenc_maps_complete_and_padding(key, contribution):
    r"""Every FF scope (GlobEnc+FF with ``"norm"``, ALTI+FF with ``"alti"``) and every GlobEnc map of the
    layer kind: completeness at rounding level, padded batch equal to the single example."""
    from captum_normattr.decompose.kinds.registry import layer_kind
    from captum_normattr.decompose.primitives.feed_forward import SCOPES

    model = build(key, "cls")
    ids, mask = decoder_batch([6, 4], seed=13, left=False)
    kind = layer_kind(get_adapter(model).topology)
    runs = [FFIntegratedDecomposition(model, scope=s, contribution=contribution, strict=True) for s in SCOPES]
    if contribution == "norm":
        runs += [GlobEncAttribution(model, map_name=m, strict=True) for m in kind.globenc_maps]
    for attr in runs:
        res = attr.decompose(ids, additional_forward_args=(mask,))
        err = res.extras.get("completeness_error")
        if err is not None:
            assert float(err.max()) < 1e-10 * max(1.0, float(res.layer_maps.abs().max()))
        alone = attr.decompose(ids[1:, :4])
        torch.testing.assert_close(res.scores[1, :4], alone.scores[0], rtol=0, atol=1e-10 * float(res.scores.abs().max()))


@pytest.mark.parametrize("head", ["cls", "bare"])
@pytest.mark.parametrize("key", FAMILIES)
def test_alti_logit_refuses_encoders(key, head):
    from captum_normattr import ALTILogitAttribution

    with pytest.raises(ValueError, match="bidirectional encoder"):
        ALTILogitAttribution(build(key, head))


VARIANTS = [
    ("deberta-v2", dict(share_att_key=False, position_buckets=-1, pos_att_type=["c2p"], norm_rel_ebd="none",
                        position_biased_input=True, type_vocab_size=2, hidden_act="relu")),  # DeBERTa-v2-like
    ("modernbert", dict(norm_bias=False, mlp_bias=False, attention_bias=False, classifier_bias=False,
                        layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2)),  # the defaults' biases
]


@pytest.mark.parametrize("key,config", VARIANTS, ids=[k for k, _ in VARIANTS])
def test_config_variants_every_method(key, config):
    model = build(key, "cls", **config)
    ids, mask = decoder_batch([6, 4], seed=14, left=False)
    extra = (mask,)
    kw = {}
    if config.get("type_vocab_size"):
        types = torch.zeros_like(ids)
        types[:, 3:] = 1
        extra, kw = (mask, types), dict(token_type_ids=types)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, **kw).logits
    res = DecompXAttribution(model, strict=True).decompose(ids, additional_forward_args=extra)
    assert _rel(res.class_scores.sum(1) + res.bias_scores, logits) < 1e-10
    check_maps_complete(model, ids, extra)


def test_a_head_description_without_its_norm_is_caught():
    r"""The explained class logit is compared with the model's own: a ModernBERT head described without its
    LayerNorm is an error on the first call, not a number."""
    from dataclasses import replace

    from captum_normattr.arch import ARCHITECTURES, register_architecture
    from captum_normattr.attr.explained_output import ExplainedOutputMismatchError

    spec = ARCHITECTURES["modernbert"]
    wrong = replace(spec, head=replace(spec.head, classifier=replace(spec.head.classifier, norm=None)))
    model = build("modernbert", "cls")
    ids, mask = decoder_batch([5], seed=15, left=False)
    register_architecture(wrong, "modernbert", replace=True)
    try:
        with pytest.raises(ExplainedOutputMismatchError):
            DecompXAttribution(model).decompose(ids, additional_forward_args=(mask,))
    finally:
        register_architecture(spec, "modernbert", replace=True)
    assert ARCHITECTURES["modernbert"] is spec


@pytest.mark.parametrize("key", FAMILIES)
def test_model_unchanged_afterwards(key):
    r"""After every method: the same weights, attention implementation, training flag and outputs; no hook is
    left behind (DeBERTa's attention is asked for its probabilities only during the recorded pass)."""
    model = build(key, "cls")
    ids, mask = decoder_batch([6, 4], seed=17, left=False)
    state = copy.deepcopy(model.state_dict())
    impl = model.config._attn_implementation
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask)
    for attr in (GlobEncAttribution(model), ALTIAttribution(model), FFIntegratedDecomposition(model),
                 DecompXAttribution(model), DecompXAttribution(model, algorithm="forward")):
        attr.decompose(ids, additional_forward_args=(mask,))
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask)
    assert torch.equal(before.logits, after.logits) and after.attentions is None
    assert model.config._attn_implementation == impl and not model.training
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    hooks = [m for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]
    assert not hooks, [type(m).__name__ for m in hooks]
