r"""The parallel-block families Phi-2, GPT-J, Falcon (every config variant) and Cohere.

Float64 tiny models of tests/zoo_parallel.py (tests/test_zoo.py runs every method on each family's
default build). Here:

- the N_RES and ALTI maps equal a naive per-token reference written from the equations
  (docs/design.md, "Parallel layers") with the model's own modules and its own attention
  probabilities (the zoo's eager attention with a float64 softmax, so the reference is exact):

      h_{i<-j} = [i = j] x_i + sum_h alpha^h_ij (N1(x_j) W_V^h + b_V^h) W_O^h,   y_i = x_i + Attn(N1(x))_i (real),

  N_RES_ij = |h_{i<-j}|, ALTI_ij = max(0, |y_i|_1 - |y_i - h_{i<-j}|_1), rows normalised; the
  value heads are read here from each layout (Falcon's grouped, multi-query and per-head fused
  query_key_value), not through the package;
- every Falcon variant (new decoder architecture with two norms or one, multi-query, per-head
  QKV, sequential pre-LN, ALiBi): every method sums to the model's own logit, padded == single;
- Falcon's in-place ``mlp_output += attention_output``: the recorded FF output is the FF's own
  output (recorded as a copy), and with the in-place detection switched off the guard fires;
- wrong descriptions are caught (Falcon's grouped layout read as [q | k | v]; Cohere without its
  logit scale).
"""
import copy
import dataclasses

import pytest
import torch

from captum_normattr import (
    ALTIAttribution,
    ALTILogitAttribution,
    ConsistencyError,
    DecompXAttribution,
    FFIntegratedDecomposition,
    GlobEncAttribution,
)
from captum_normattr.arch import ARCHITECTURES, ValueProjection, register_architecture
from captum_normattr.attr.explained_output import ExplainedOutputMismatchError
from captum_normattr.models.capture import attention as capture_attention
from captum_normattr.models.capture import recorder as capture
from captum_normattr.models.capture.session import recording
from captum_normattr.models.adapters import get_adapter
from decoder_models import decoder_batch
from registry_state import restored_registry
from zoo import EXACT_ATTENTION, build

#: Falcon's config variants: name -> config overrides (the default build: new architecture, two norms, GQA 4/2)
FALCON_VARIANTS = {
    "new_two_norms": {},
    "new_one_norm": dict(num_ln_in_parallel_attn=1),
    "multi_query": dict(new_decoder_architecture=False, multi_query=True),
    "per_head": dict(new_decoder_architecture=False, multi_query=False, num_kv_heads=4),
    "sequential_alibi": dict(new_decoder_architecture=False, multi_query=False, num_kv_heads=4, parallel_attn=False,
                             alibi=True),
    "sequential_multi_query": dict(new_decoder_architecture=False, multi_query=True, parallel_attn=False),
}
#: (registry key, config overrides) of every model the naive reference checks
REFERENCE_CASES = [("phi", {}), ("gptj", {}), ("cohere", {})] + [("falcon", v) for v in FALCON_VARIANTS.values()]
REFERENCE_IDS = ["phi", "gptj", "cohere"] + [f"falcon-{k}" for k in FALCON_VARIANTS]


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _real_logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits[:, -1]


@pytest.fixture
def registry():
    r"""Restore the architecture registries after a test that re-registers an entry."""
    with restored_registry():
        yield


# --- the naive reference -------------------------------------------------------------------
def _modules(model, key):
    r"""Per layer: (layer, attention module, first norm, output projection)."""
    if key == "phi":
        return [(l, l.self_attn, l.input_layernorm, l.self_attn.dense) for l in model.model.layers]
    if key == "gptj":
        return [(l, l.attn, l.ln_1, l.attn.out_proj) for l in model.transformer.h]
    if key == "cohere":
        return [(l, l.self_attn, l.input_layernorm, l.self_attn.o_proj) for l in model.model.layers]
    cfg = model.config
    first = "ln_attn" if cfg.new_decoder_architecture and cfg.num_ln_in_parallel_attn == 2 else "input_layernorm"
    return [(l, l.self_attention, getattr(l, first), l.self_attention.dense) for l in model.transformer.h]


def _value_heads(key, attn, cfg):
    r"""(W_V (Hkv, Dh, D) rows of nn.Linear weights, b_V (Hkv, Dh) or None), read from the layout by hand."""
    h, d = cfg.num_attention_heads, cfg.hidden_size
    dh = d // h
    if key in ("phi", "gptj", "cohere"):
        w, b = attn.v_proj.weight, attn.v_proj.bias
        kv = w.shape[0] // dh
        return w.view(kv, dh, d), None if b is None else b.view(kv, dh)
    w, b = attn.query_key_value.weight, attn.query_key_value.bias
    if cfg.new_decoder_architecture:  # per key/value head: its h / kv query heads, its key, its value
        kv = cfg.num_kv_heads
        pick = lambda t: t.view(kv, h // kv + 2, dh, *t.shape[1:])[:, -1]
    elif cfg.multi_query:  # [q (h dh) | k (dh) | v (dh)]
        pick = lambda t: t[(h + 1) * dh:(h + 2) * dh].reshape(1, dh, *t.shape[1:])
    else:  # per head [q_h | k_h | v_h]
        pick = lambda t: t.view(h, 3, dh, *t.shape[1:])[:, 2]
    return pick(w), None if b is None else pick(b)


def naive_maps(model, key, ids):
    r"""(N_RES (L, T, T), ALTI (L, T, T)) of one example without padding, by loops over tokens and heads."""
    eager = copy.deepcopy(model)
    eager.config._attn_implementation = EXACT_ATTENTION  # transformers' eager code with a float64 softmax
    seen = {}
    mods = _modules(eager, key)
    for l, (layer, attn, _, out) in enumerate(mods):
        layer.register_forward_pre_hook(lambda m, a, k, l=l: seen.setdefault(l, {}).update(
            x=(a[0] if a else k["hidden_states"])[0]), with_kwargs=True)
        attn.register_forward_hook(lambda m, a, o, l=l: seen[l].update(probs=o[1][0]))
        out.register_forward_hook(lambda m, a, o, l=l: seen[l].update(attn=o[0]))
    with torch.no_grad():
        eager(input_ids=ids)
    cfg = model.config
    n_res, alti = [], []
    with torch.no_grad():
        for l, (_, attn, norm, out) in enumerate(mods):
            x, probs, attn_real = seen[l]["x"], seen[l]["probs"], seen[l]["attn"]
            heads, t, _ = probs.shape
            wv, bv = _value_heads(key, attn, cfg)
            groups = heads // wv.shape[0]
            u = norm(x)  # (T, D)
            dh = wv.shape[1]
            parts = torch.zeros(t, t, x.shape[-1], dtype=x.dtype)
            for i in range(t):
                parts[i, i] += x[i]
                for j in range(t):
                    for hd in range(heads):
                        v = wv[hd // groups] @ u[j] + (0 if bv is None else bv[hd // groups])  # (Dh,)
                        parts[i, j] += probs[hd, i, j] * (out.weight[:, hd * dh:(hd + 1) * dh] @ v)
            y = x + attn_real  # the real attention block output
            bias = torch.zeros_like(x[0]) if out.bias is None else out.bias
            assert _rel(parts.sum(1) + bias, y) < 1e-12  # the reference is complete
            tri = torch.ones(t, t, dtype=torch.bool).tril()
            n_res.append(parts.norm(dim=-1) * tri)
            c = (y.abs().sum(-1)[:, None] - (y[:, None] - parts).abs().sum(-1)).clamp_min(0) * tri
            alti.append(c / c.sum(-1, keepdim=True))
    return torch.stack(n_res), torch.stack(alti)


@pytest.mark.parametrize("key,extra", REFERENCE_CASES, ids=REFERENCE_IDS)
def test_maps_equal_the_naive_reference(key, extra):
    r"""The package on a left-padded batch; the reference on each example alone."""
    model = build(key, "lm", **extra)
    lengths = [5, 3]
    ids, mask = decoder_batch(lengths, seed=7)
    got = GlobEncAttribution(model, map_name="N_RES", strict=True).decompose(ids, additional_forward_args=(mask,))
    alti = ALTIAttribution(model, strict=True).decompose(ids, additional_forward_args=(mask,))
    t = ids.shape[1]
    for b, n in enumerate(lengths):
        one = slice(t - n, t)
        ref_n, ref_alti = naive_maps(model, key, ids[b:b + 1, one])
        torch.testing.assert_close(got.layer_maps[b, :, one, one], ref_n, rtol=0, atol=1e-10 * float(ref_n.max()))
        torch.testing.assert_close(alti.layer_maps[b, :, one, one], ref_alti, rtol=0, atol=1e-10)
        if n < t:
            assert float(got.layer_maps[b, :, : t - n].abs().max()) == 0  # pad rows exactly 0
    assert float(got.extras["completeness_error"].max()) < 1e-12 * float(got.layer_maps.abs().max())


# --- Falcon: every variant, every method ----------------------------------------------------
def test_falcon_config_flags_choose_the_nested_variant():
    r"""The architecture flag, then the norm count or the query layout, then parallel_attn select the description."""
    expect = {  # variant -> (topology, first norm, second norm, value layout)
        "new_two_norms": ("parallel", "ln_attn", "ln_mlp", "grouped"),
        "new_one_norm": ("parallel", "input_layernorm", "input_layernorm", "grouped"),
        "multi_query": ("parallel", "input_layernorm", "input_layernorm", "fused_gqa"),
        "per_head": ("parallel", "input_layernorm", "input_layernorm", "interleaved"),
        "sequential_alibi": ("pre_ln", "input_layernorm", "post_attention_layernorm", "interleaved"),
        "sequential_multi_query": ("pre_ln", "input_layernorm", "post_attention_layernorm", "fused_gqa"),
    }
    for variant, (topology, n1, n2, layout) in expect.items():
        spec = get_adapter(build("falcon", "bare", **FALCON_VARIANTS[variant]))
        assert (spec.topology, spec.ln1, spec.ln2, spec.layer.attention.value.layout) == (topology, n1, n2, layout), variant


@pytest.mark.parametrize("variant", list(FALCON_VARIANTS))
def test_falcon_variants_every_method_sums_to_the_models_logit(variant):
    model = build("falcon", "lm", **FALCON_VARIANTS[variant])
    spec = get_adapter(model)
    assert spec.topology == ("pre_ln" if variant.startswith("sequential") else "parallel")
    ids, mask = decoder_batch([6, 4], seed=5)
    state = copy.deepcopy(model.state_dict())
    logits = _real_logits(model, ids, mask)
    target = logits.argmax(-1)
    expect = logits.gather(1, target[:, None])[:, 0]
    al = ALTILogitAttribution(model, strict=True)
    res = al.decompose(ids, target=target, additional_forward_args=(mask,))
    assert _rel(res.scores.sum(-1) + res.no_token_total, expect) < 1e-10
    assert float(res.delta.max()) < 1e-10 * float(expect.abs().max())
    t = ids.shape[1]
    alone = al.decompose(ids[1:, t - 4:], target=target[1:]).scores
    torch.testing.assert_close(res.scores[1, t - 4:], alone[0], rtol=0, atol=1e-10 * float(res.scores.abs().max()))
    for algorithm in ("forward", "adjoint"):
        dx = DecompXAttribution(model, algorithm=algorithm, strict=True).decompose(
            ids, target=target, additional_forward_args=mask)
        assert _rel(dx.scores.sum(-1) + dx.bias_scores[:, 0], expect) < 1e-10
    for cls in (GlobEncAttribution, ALTIAttribution):
        got = cls(model, strict=True).decompose(ids, additional_forward_args=(mask,))
        assert float(got.extras["completeness_error"].max()) < 1e-12 * 10
    ff = FFIntegratedDecomposition(model, contribution="alti", strict=True).decompose(ids, additional_forward_args=(mask,))
    assert float(ff.delta.max()) < 1e-12 * 10
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


# --- Falcon's in-place `mlp_output += attention_output` ---------------------------------------
@pytest.fixture
def fresh_clone_keys(monkeypatch):
    r"""The recorder's memory of in-place changes, empty for the test (as in a fresh process)."""
    monkeypatch.setattr(capture, "_CLONE_KEYS", {})


def test_falcon_in_place_add_is_recorded_as_a_copy(fresh_clone_keys):
    model = build("falcon", "lm")
    base = model.transformer
    ids, mask = decoder_batch([5, 3], seed=3)
    ff_real, attn_real, recorded = {}, {}, []

    def keep(store, l):
        def hook(module, args, out):  # returns None: the module's output stays the model's own tensor
            store[l] = out.detach().clone()
        return hook

    for l, layer in enumerate(base.h):
        layer.mlp.dense_4h_to_h.register_forward_hook(keep(ff_real, l))
        layer.self_attention.dense.register_forward_hook(keep(attn_real, l))
    with torch.no_grad():
        with pytest.raises(capture.RecordedTensorModifiedError, match="ff_out"):  # the FF output changed after recording
            with recording(model, get_adapter(model), recorded.append, torch.float64):
                base(input_ids=ids, attention_mask=mask)
        assert capture._CLONE_KEYS[type(base.h[0])] == frozenset({"ff_out"})
        with recording(model, get_adapter(model), recorded.append, torch.float64):
            base(input_ids=ids, attention_mask=mask)
    for layer in recorded:  # the FF's own output, not FF + attention
        torch.testing.assert_close(layer.ff_out, ff_real[layer.index], rtol=0, atol=0)
        torch.testing.assert_close(layer.attn_branch_out, attn_real[layer.index], rtol=0, atol=0)
        assert float((layer.ff_out - ff_real[layer.index] - attn_real[layer.index]).abs().max()) > 1e-3


def test_falcon_attribution_retries_and_is_exact_after_the_in_place_add(fresh_clone_keys):
    model = build("falcon", "lm")
    ids, mask = decoder_batch([6, 4], seed=4)
    expect = _real_logits(model, ids, mask)[:, 3]
    res = ALTILogitAttribution(model, strict=True).decompose(ids, target=3, additional_forward_args=(mask,))
    assert _rel(res.scores.sum(-1) + res.no_token_total, expect) < 1e-10


def test_falcon_without_the_in_place_detection_the_guard_fires(fresh_clone_keys, monkeypatch):
    r"""Recorded as a view, the FF output would hold FF + attention: the residual-join check catches it."""
    monkeypatch.setattr(capture.Recorder, "_changed_in_place", lambda self, idx, rec: None)
    model = build("falcon", "lm")
    ids, mask = decoder_batch([6, 4], seed=4)
    with pytest.raises(ConsistencyError, match="layer output vs the layer input plus both branch outputs"):
        ALTILogitAttribution(model, strict=True).decompose(ids, target=3, additional_forward_args=(mask,))


# --- wrong descriptions are caught ----------------------------------------------------------
def test_falcon_grouped_qkv_read_as_q_k_v_is_caught(registry):
    r"""Falcon's grouped layout has the width of a [q | k | v] one (4 + 2 + 2 heads of 8): read as that,
    DecompX propagates the wrong value weights and misses the model's logit."""
    model = build("falcon", "lm")
    ids, mask = decoder_batch([6, 4], seed=6)
    expect = _real_logits(model, ids, mask)[:, 2]
    good = ARCHITECTURES["falcon"].variants[0].spec
    att = good.layer.attention
    wrong = dataclasses.replace(good, variants=(), layer=dataclasses.replace(good.layer, attention=dataclasses.replace(
        att, value=ValueProjection(att.value.path, "fused_gqa", 2, 3))))
    register_architecture(wrong, "falcon", replace=True)
    dx = DecompXAttribution(model, algorithm="forward").decompose(ids, target=2, additional_forward_args=mask)
    assert _rel(dx.scores.sum(-1) + dx.bias_scores[:, 0], expect) > 1e-3


def test_cohere_explains_its_scaled_logit_and_without_the_scale_it_is_refused(registry):
    model = build("cohere", "lm")
    assert model.config.logit_scale == 0.3
    ids, mask = decoder_batch([6, 4], seed=8)
    real = _real_logits(model, ids, mask)
    res = ALTILogitAttribution(model, strict=True).decompose(ids, target=5, additional_forward_args=(mask,))
    assert _rel(res.logit, real[:, 5]) < 1e-12
    assert _rel(res.scores.sum(-1) + res.no_token_total, real[:, 5]) < 1e-10
    spec = ARCHITECTURES["cohere"]
    register_architecture(dataclasses.replace(spec, head=dataclasses.replace(spec.head, logit_multiplier=None)), "cohere",
                          replace=True)
    with pytest.raises(ExplainedOutputMismatchError, match="differs from the model's own output"):
        ALTILogitAttribution(model).decompose(ids, target=5, additional_forward_args=(mask,))


def test_bare_models_and_classifiers():
    r"""The bare ``*Model`` (with the LM head's matrix as an explicit unembedding) and ``*ForSequenceClassification``:
    the maps are complete and the logit methods sum to u . final-norm output."""
    ids, mask = decoder_batch([6, 4], seed=9)
    for key in ("phi", "gptj", "falcon", "cohere"):
        lm, bare = build(key, "lm"), build(key, "bare")
        u = lm.lm_head.weight.detach()
        with torch.no_grad():
            h = bare(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).last_hidden_state
        expect = h[:, -1] @ u[4]
        al = ALTILogitAttribution(bare, unembedding=u, strict=True).decompose(ids, target=4, additional_forward_args=(mask,))
        assert _rel(al.scores.sum(-1) + al.no_token_total, expect) < 1e-10, key
        dx = DecompXAttribution(bare, unembedding=u, strict=True).decompose(ids, target=4, additional_forward_args=mask)
        assert _rel(dx.scores.sum(-1) + dx.bias_scores[:, 0], expect) < 1e-10, key
        models = [bare] + ([build(key, "cls")] if key != "cohere" else [])
        for model in models:
            for cls in (GlobEncAttribution, ALTIAttribution):
                got = cls(model, strict=True).decompose(ids, additional_forward_args=(mask,))
                assert float(got.extras["completeness_error"].max()) < 1e-12 * 10, (key, cls)


def test_falcon_alibi_mask_with_one_row_per_head_in_head_chunks(monkeypatch):
    r"""ALiBi Falcon adds its per-head bias to the mask (B, H, T, S): the recording attention, computing one head
    at a time (as for long inputs), takes each chunk's heads from it, and gives the unchunked result."""
    model = build("falcon", "lm", **FALCON_VARIANTS["sequential_alibi"])
    ids, mask = decoder_batch([6, 4], seed=10)
    expect = _real_logits(model, ids, mask)[:, 6]
    whole = ALTILogitAttribution(model, strict=True).decompose(ids, target=6, additional_forward_args=(mask,))
    monkeypatch.setattr(capture_attention, "SCORE_CHUNK_BYTES", 1)  # one head per chunk
    chunked = ALTILogitAttribution(model, strict=True).decompose(ids, target=6, additional_forward_args=(mask,))
    assert _rel(chunked.scores.sum(-1) + chunked.no_token_total, expect) < 1e-10
    torch.testing.assert_close(chunked.scores, whole.scores, rtol=0, atol=1e-12 * float(whole.scores.abs().max()))


@pytest.mark.parametrize("key", ["phi", "gptj", "falcon", "cohere"])
def test_a_parallel_family_described_as_pre_ln_is_caught(key, registry):
    r"""Issue 23's silent case (ALTI-Logit delta 0.0 with wrong maps): with ``parallel=False`` the layer output is
    not the residual stream plus the FF output, and the guard names that join."""
    model = build(key, "lm")
    spec = get_adapter(model)
    register_architecture(dataclasses.replace(spec, variants=(), layer=dataclasses.replace(spec.layer, parallel=False)),
                          key, replace=True)
    ids, mask = decoder_batch([5, 3], seed=9)
    with pytest.raises(ConsistencyError, match="layer output vs the residual stream plus the feed-forward output"):
        ALTILogitAttribution(model, strict=True).decompose(ids, target=4, additional_forward_args=(mask,))
