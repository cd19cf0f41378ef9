r"""ALTI+ for encoder-decoders: exactness in float64 on tiny Marian, BART, mBART, M2M100, Pegasus and T5 models.

Every model is built from a config with perturbed biases and norm weights (nothing is
trivially 0 or 1). A naive reference, written here from the definition with explicit loops,
checks the fast implementation.
"""
import pytest
import torch
from transformers import (
    T5Config,
)

from captum_normattr import ALTIPlusAttribution, ALTIPlusResult, UnsupportedModelError, explain_generation
from captum_normattr.decompose.methods.alti_plus import ALTIPlusConventions
from captum_normattr.models.seq2seq import BLOCKS, get_seq2seq_adapter, recording_seq2seq
from seq2seq_models import PAD, VOCAB, make_model, pair

FAMILIES = ["marian", "bart", "mbart", "m2m_100", "pegasus", "t5"]
#: families whose outputs do not depend on left padding (positions counted over real tokens, or relative)
LEFT_PAD_INVARIANT = ["m2m_100", "t5"]







_CACHE = {}


def model_for(family):
    if family not in _CACHE:
        _CACHE[family] = make_model(family)
    return _CACHE[family]




# ------------------------------------------------------------------ naive reference


def naive_block(blk, valid_q, valid_k, ln_scale="exact", l1_eps=0.0):
    r"""One block's contributions with explicit loops over examples, queries, keys and heads."""
    b, h, q, k = blk.probs.shape
    d = blk.head_weight.shape[-1]
    ncol = k + 1 if blk.cross else k
    out = torch.zeros(b, q, ncol, dtype=torch.float64)
    b_o = blk.out_bias if blk.out_bias is not None else torch.zeros(d, dtype=torch.float64)
    for e in range(b):
        for i in range(q):
            if not valid_q[e, i]:
                continue
            parts = []
            for j in range(k):
                p = torch.zeros(d, dtype=torch.float64)
                for hh in range(h):
                    p = p + blk.probs[e, hh, i, j] * (blk.values[e, hh, j] @ blk.head_weight[hh])
                if not blk.cross and j == i:
                    p = p + blk.residual[e, i]
                parts.append(p)
            if blk.cross:
                parts.append(blk.residual[e, i])
            bias = b_o.clone()
            if blk.norm is not None:
                u = blk.norm_input[e, i]
                if ln_scale == "exact":
                    sigma = torch.sqrt(((u - u.mean()) ** 2).mean() + blk.norm.eps)
                else:
                    w = u + blk.norm.eps
                    sigma = torch.sqrt(((w - w.mean()) ** 2).sum() / (d - 1))
                gamma, beta = blk.norm.weight, blk.norm.bias
                parts = [gamma * (p - p.mean()) / sigma for p in parts]
                bias = gamma * (b_o - b_o.mean()) / sigma + beta
            y = sum(parts) + bias
            for j, p in enumerate(parts):
                masked = j < k and not valid_k[e, j]
                if masked:
                    continue
                c = y.abs().sum() - (p - y + l1_eps).abs().sum()
                out[e, i, j] = max(float(c), 0.0)
            out[e, i] /= out[e, i].sum()
    return out


def naive_alti_plus(model, src, tgt, src_mask=None, tgt_mask=None, ln_scale="exact", l1_eps=0.0, renorm=False):
    src_mask = torch.ones_like(src) if src_mask is None else src_mask
    tgt_mask = torch.ones_like(tgt) if tgt_mask is None else tgt_mask
    vs, vt = src_mask.bool(), tgt_mask.bool()
    adapter = get_seq2seq_adapter(model)
    maps = {n: [] for n in BLOCKS}
    with torch.no_grad(), recording_seq2seq(model, adapter, torch.float64) as rec:
        model(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask,
              use_cache=False)
        for name in BLOCKS:
            vq = vs if name == "encoder_self" else vt
            vk = vt if name == "decoder_self" else vs
            for i in range(len(rec.stack_layers(name))):
                maps[name].append(naive_block(rec.block_tensors(name, i), vq, vk, ln_scale, l1_eps))
    b, s = src.shape
    t = tgt.shape[1]
    enc = maps["encoder_self"][0]
    for c in maps["encoder_self"][1:]:
        enc = torch.einsum("bij,bjk->bik", c, enc)
    # the full (S + T) x (S + T) product of [[I, 0], [M_src, M_tgt]], layer by layer
    total = None
    for l, (cs, cc) in enumerate(zip(maps["decoder_self"], maps["decoder_cross"])):
        big = torch.zeros(b, s + t, s + t, dtype=torch.float64)
        for e in range(b):
            big[e, :s, :s] = torch.eye(s, dtype=torch.float64)
            for i in range(t):
                for j in range(s):
                    big[e, s + i, j] = sum(cc[e, i, m] * enc[e, m, j] for m in range(s))
                for j in range(t):
                    big[e, s + i, s + j] = cc[e, i, s] * cs[e, i, j]
        total = big if total is None else torch.einsum("bij,bjk->bik", big, total)
        if renorm and l > 0:
            rows = total[:, s:]
            sums = rows.sum(-1, keepdim=True)
            total = total.clone()
            total[:, s:] = torch.where(sums > 0, rows / torch.where(sums > 0, sums, torch.ones_like(sums)), rows)
    r = total[:, s:] * vt[..., None]
    return r[..., :s], r[..., s:], maps


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("family", FAMILIES + ["mt5"])
def test_parts_sum_to_real_outputs_rows_sum_to_one_and_causal(family):
    model = model_for(family)
    src, tgt = pair()
    res = ALTIPlusAttribution(model).decompose((src, tgt), return_layer_maps=True)
    assert isinstance(res, ALTIPlusResult)
    for name in BLOCKS:  # every encoder and decoder sub-block, against the hooked tensors
        err = res.extras[f"{name}_completeness_error"]
        assert err.shape == (2,) and float(err.max()) <= 1e-10, (name, err)
    assert float(res.completeness_error) <= 1e-10
    rows = res.source_contributions.sum(-1) + res.target_contributions.sum(-1)
    assert torch.allclose(rows, torch.ones_like(rows), atol=1e-12, rtol=0)
    assert torch.allclose(res.source_share, res.source_contributions.sum(-1), atol=0, rtol=0)
    # later target tokens contribute exactly 0, in every decoder self-attention map and in the rollout
    upper = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)
    assert bool((res.target_contributions[:, upper] == 0).all())
    assert bool((res.decoder_self_maps[:, :, upper] == 0).all())
    for m in (res.encoder_maps, res.decoder_self_maps, res.decoder_cross_maps):
        assert torch.allclose(m.sum(-1), torch.ones_like(m.sum(-1)), atol=1e-12, rtol=0)
    # not trivial: both sides and several tokens contribute
    assert 0.01 < float(res.source_share.min()) and float(res.source_share.max()) < 0.999
    assert float(res.target_contributions[:, -1, :-1].sum(-1).min()) > 1e-4  # earlier prefix tokens count
    assert float(res.source_contributions.min()) >= 0 and float(res.target_contributions.min()) >= 0


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_equals_naive_reference(family):
    model = model_for(family)
    src, tgt = pair(seed=1, b=2, s=5, t=4)
    res = ALTIPlusAttribution(model).decompose((src, tgt), return_layer_maps=True)
    n_src, n_tgt, maps = naive_alti_plus(model, src, tgt)
    assert torch.allclose(res.source_contributions, n_src, atol=1e-12, rtol=0)
    assert torch.allclose(res.target_contributions, n_tgt, atol=1e-12, rtol=0)
    assert torch.allclose(res.encoder_maps, torch.stack(maps["encoder_self"], 1), atol=1e-12, rtol=0)
    assert torch.allclose(res.decoder_cross_maps, torch.stack(maps["decoder_cross"], 1), atol=1e-12, rtol=0)
    assert torch.allclose(res.decoder_self_maps, torch.stack(maps["decoder_self"], 1), atol=1e-12, rtol=0)


def _pad(x, n, left, value):
    extra = torch.full((x.shape[0], n), value, dtype=x.dtype)
    return torch.cat([extra, x], 1) if left else torch.cat([x, extra], 1)


@pytest.mark.parametrize("family,left", [(f, False) for f in FAMILIES] + [(f, True) for f in LEFT_PAD_INVARIANT])
def test_padded_batch_equals_each_example_alone(family, left):
    model = model_for(family)
    alti = ALTIPlusAttribution(model)
    (s1, t1), (s2, t2) = pair(seed=2, b=1, s=4, t=3), pair(seed=3, b=1, s=7, t=6)
    src = torch.cat([_pad(s1, 3, left, PAD), s2])
    tgt = torch.cat([_pad(t1, 3, left, PAD), t2])
    sm = torch.cat([_pad(torch.ones_like(s1), 3, left, 0), torch.ones_like(s2)])
    tm = torch.cat([_pad(torch.ones_like(t1), 3, left, 0), torch.ones_like(t2)])
    batch = alti.decompose((src, tgt), additional_forward_args=(sm, tm), return_layer_maps=True)
    assert float(batch.completeness_error) <= 1e-10
    for i, (s, t) in enumerate([(s1, t1), (s2, t2)]):
        alone = alti.decompose((s, t), return_layer_maps=True).example(0)
        ex = batch.example(i)
        for key in ("scores", "target_scores", "source_contributions", "target_contributions", "source_share",
                    "encoder_maps", "encoder_rollout", "decoder_self_maps", "decoder_cross_maps"):
            assert ex[key].shape == alone[key].shape, key
            assert torch.allclose(ex[key], alone[key], atol=1e-12, rtol=0), (key, (ex[key] - alone[key]).abs().max())
        assert ex["explained_position"] == alone["explained_position"] == t.shape[1] - 1
    # pads are exactly 0 on both sides
    assert bool((batch.source_contributions[0][:, ~sm[0].bool()] == 0).all())
    assert bool((batch.source_contributions[0][~tm[0].bool()] == 0).all())
    assert bool((batch.target_contributions[0][:, ~tm[0].bool()] == 0).all())


@pytest.mark.parametrize("family", ["marian", "m2m_100"])
def test_official_conventions_differ_slightly_and_match_a_naive_official_implementation(family):
    model = model_for(family)
    src, tgt = pair(seed=4, b=1, s=5, t=4)
    default = ALTIPlusAttribution(model).decompose((src, tgt))
    official = ALTIPlusAttribution(model, conventions="official").decompose((src, tgt))
    assert official.conventions == "official" and default.conventions == "default"
    gap = (official.source_contributions - default.source_contributions).abs().max()
    assert 1e-9 < float(gap) < 2e-2
    n_src, n_tgt, _ = naive_alti_plus(model, src, tgt, ln_scale="official" if family == "marian" else "exact",
                                      l1_eps=1e-6, renorm=True)
    assert torch.allclose(official.source_contributions, n_src, atol=1e-12, rtol=0)
    assert torch.allclose(official.target_contributions, n_tgt, atol=1e-12, rtol=0)
    # as in the official code, later target tokens get tiny (not zero) weights through the +1e-6
    assert 0 < float(official.target_contributions[0, 0, 1:].sum()) < 1e-4
    custom = ALTIPlusAttribution(model, conventions=ALTIPlusConventions("official", 0.0, False)).decompose((src, tgt))
    assert bool((custom.target_contributions[0].triu(1) == 0).all())
    assert custom.conventions.startswith("ln_scale=official")


def _state(model):
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    impls = [m.config._attn_implementation for m in model.modules() if hasattr(m, "config")]
    return hooks, impls, [m.training for m in model.modules()]


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_recording_keeps_the_outputs_and_the_model_is_unchanged_also_after_errors(family, monkeypatch):
    model = make_model(family, seed=5)
    src, tgt = pair(seed=5)
    kw = dict(input_ids=src, decoder_input_ids=tgt, use_cache=False)
    with torch.no_grad():
        before = model(**kw).logits
        with recording_seq2seq(model, get_seq2seq_adapter(model), torch.float64):  # eager recording attention
            inside = model(**kw).logits
    assert torch.allclose(inside, before, atol=1e-12, rtol=0)  # T5's relative position bias included
    import captum_normattr.models.capture.attention as capture

    monkeypatch.setattr(capture, "SCORE_CHUNK_BYTES", 1)  # one head per chunk: the bias is sliced per head
    with torch.no_grad(), recording_seq2seq(model, get_seq2seq_adapter(model), torch.float64):
        assert torch.allclose(model(**kw).logits, before, atol=1e-12, rtol=0)
    monkeypatch.undo()
    layers = model.model.decoder.layers if family == "bart" else model.decoder.block
    model.train()
    layers[0].training = False  # a mixed state must come back as it was
    state = _state(model)
    alti = ALTIPlusAttribution(model)
    alti.decompose((src, tgt))
    assert _state(model) == state
    # an error inside the forward pass
    handle = layers[1].register_forward_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    state = _state(model)
    with pytest.raises(RuntimeError, match="boom"):
        alti.decompose((src, tgt))
    assert _state(model) == state
    handle.remove()
    # an error while a block is decomposed (on its forward hook, inside the forward pass)
    import captum_normattr.attr.alti_plus as mod

    def fail(*a, **k):
        raise ValueError("mid-call")

    monkeypatch.setattr(mod, "block_contributions", fail)
    state = _state(model)
    with pytest.raises(ValueError, match="mid-call"):
        alti.decompose((src, tgt))
    assert _state(model) == state
    monkeypatch.undo()
    model.eval()
    with torch.no_grad():
        assert torch.allclose(model(**kw).logits, before, atol=0, rtol=0)


def test_attribute_returns_the_explained_rows_and_base_models_work():
    model = model_for("marian")
    src, tgt = pair(seed=6)
    alti = ALTIPlusAttribution(model)
    res = alti.decompose((src, tgt))
    s, t = alti.attribute((src, tgt))
    assert torch.equal(s, res.source_contributions[:, -1]) and torch.equal(t, res.target_contributions[:, -1])
    assert torch.allclose(s.sum(-1) + t.sum(-1), torch.ones(2, dtype=torch.float64), atol=1e-12, rtol=0)
    s2, t2 = alti.attribute((src, tgt), target=2, additional_forward_args=(torch.ones_like(src), torch.ones_like(tgt)))
    assert torch.equal(s2, res.source_contributions[:, 2]) and torch.equal(t2, res.target_contributions[:, 2])
    assert bool((t2[:, 3:] == 0).all())
    s3, _ = alti.attribute((src, tgt), target=torch.tensor([1, 4]))
    assert torch.equal(s3[0], res.source_contributions[0, 1]) and torch.equal(s3[1], res.source_contributions[1, 4])
    base = ALTIPlusAttribution(model.model).decompose((src, tgt))  # MarianModel, no LM head
    assert torch.allclose(base.source_contributions, res.source_contributions, atol=0, rtol=0)


def test_explain_generation_token_by_token():
    model = model_for("marian")
    src, _ = pair(seed=7, b=2, s=6)
    sm = torch.ones_like(src)
    sm[0, -2:] = 0
    with torch.no_grad():
        gen = model.generate(input_ids=src, attention_mask=sm, max_new_tokens=5, do_sample=False, num_beams=1)
    gen = gen.clone()
    gen[0, 3] = 1  # an end-of-sequence token in the first sequence: what follows is unused
    gen[0, 4:] = PAD
    steps = explain_generation(model, src, gen, sm)
    assert len(steps) == 2
    assert steps[0].tokens.tolist() == gen[0, 1:4].tolist() and steps[1].tokens.tolist() == gen[1, 1:].tolist()
    res = ALTIPlusAttribution(model).decompose((src[1:], gen[1:, :-1]), additional_forward_args=sm[1:])
    assert torch.allclose(steps[1].source, res.source_contributions[0], atol=1e-12, rtol=0)
    assert torch.allclose(steps[1].prefix, res.target_contributions[0], atol=1e-12, rtol=0)
    one = steps[0]
    assert one.source.shape == (3, 4) and one.prefix.shape == (3, 3)
    total = one.source.sum(-1) + one.prefix.sum(-1)
    assert torch.allclose(total, torch.ones(3, dtype=torch.float64), atol=1e-12, rtol=0)
    alone = ALTIPlusAttribution(model).decompose((src[:1, :4], gen[:1, :3]))
    assert torch.allclose(one.source, alone.source_contributions[0], atol=1e-12, rtol=0)


def test_clear_errors_for_unsupported_models_and_bad_inputs():
    from transformers import BertConfig, BertModel, LEDConfig, LEDForConditionalGeneration

    bert = BertModel(BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=16))
    with pytest.raises(UnsupportedModelError, match="not an encoder-decoder.*Supported encoder-decoder families: BART"):
        ALTIPlusAttribution(bert)
    led = LEDForConditionalGeneration(LEDConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
                                                encoder_attention_heads=2, decoder_attention_heads=2,
                                                encoder_ffn_dim=16, decoder_ffn_dim=16, attention_window=[4]))
    with pytest.raises(UnsupportedModelError, match="encoder-decoder model type 'led'.*T5/mT5"):
        ALTIPlusAttribution(led)
    from transformers import T5EncoderModel

    enc_only = T5EncoderModel(T5Config(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=16, num_layers=1, num_heads=2))
    with pytest.raises(UnsupportedModelError, match="no encoder and decoder"):
        ALTIPlusAttribution(enc_only)
    model = model_for("marian")
    alti = ALTIPlusAttribution(model)
    src, tgt = pair()
    with pytest.raises(ValueError, match="conventions must be"):
        ALTIPlusAttribution(model, conventions="fairseq")
    with pytest.raises(ValueError, match="source ids is empty"):
        alti.decompose((src[:, :0], tgt))
    with pytest.raises(ValueError, match="decoder input ids is empty"):
        alti.decompose((src, tgt[:0]))
    with pytest.raises(ValueError, match="use ids.unsqueeze"):
        alti.decompose((src[0], tgt))
    with pytest.raises(TypeError, match="integer tensor"):
        alti.decompose((src.double(), tgt))
    with pytest.raises(ValueError, match="same number of examples; got 2 and 1"):
        alti.decompose((src, tgt[:1]))
    with pytest.raises(ValueError, match=r"vocabulary"):
        alti.decompose((src + VOCAB, tgt))
    with pytest.raises(ValueError, match=r"source attention mask must have the shape"):
        alti.decompose((src, tgt), additional_forward_args=torch.ones(2, 3))
    with pytest.raises(ValueError, match="only 0 \\(pad\\) and 1"):
        alti.decompose((src, tgt), additional_forward_args=2 * torch.ones_like(src))
    bad = torch.ones_like(tgt)
    bad[0, 2] = 0
    with pytest.raises(ValueError, match="contiguous"):
        alti.decompose((src, tgt), additional_forward_args=(None, bad))
    with pytest.raises(ValueError, match="no tokens"):
        alti.decompose((src, tgt), additional_forward_args=torch.zeros_like(src))
    with pytest.raises(ValueError, match="at most 32"):
        alti.decompose((torch.randint(3, VOCAB, (1, 40)), tgt[:1]))
    with pytest.raises(ValueError, match="pair"):
        alti.attribute(src)
    with pytest.raises(ValueError, match="outside example"):
        alti.attribute((src, tgt), target=10)


def test_plots_and_captum_interop():
    pytest.importorskip("matplotlib")
    from captum_normattr.present.visualization_seq2seq import (
        generation_to_llm_attribution_result,
        plot_contribution_matrix,
        plot_source_share,
    )

    model = model_for("marian")
    src, tgt = pair(seed=8)
    sm = torch.ones_like(src)
    sm[0, :2] = 0
    res = ALTIPlusAttribution(model).decompose((src, tgt), additional_forward_args=sm)
    fig = plot_contribution_matrix(res, 0, [f"s{i}" for i in range(7)], [f"t{i}" for i in range(6)])
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()][:5] == ["s2", "s3", "s4", "s5", "s6"]
    assert ax.images[0].get_array().shape == (6, 5 + 6)
    assert plot_source_share(res).axes[0].get_ylim() == (0.0, 1.0)
    assert len(plot_source_share(res, 1, [f"t{i}" for i in range(6)], skip_first=True).axes[0].patches) == 5
    with torch.no_grad():
        gen = model.generate(input_ids=src[1:], max_new_tokens=3, do_sample=False, num_beams=1)
    step = explain_generation(model, src[1:], gen)[0]
    assert plot_contribution_matrix(step).axes[0].images[0].get_array().shape == (3, 7 + 3)
    llm = generation_to_llm_attribution_result(step, [f"s{i}" for i in range(7)])
    assert tuple(llm.token_attr.shape) == (3, 7)
    with pytest.raises(TypeError, match="ALTIPlusResult"):
        plot_contribution_matrix(torch.zeros(3))


def test_non_finite_examples_are_nan_with_a_warning():
    model = make_model("marian", seed=9)
    with torch.no_grad():
        model.model.shared.weight[39] = float("nan")
    src, tgt = pair(seed=9)
    src[0, 2] = 39
    with pytest.warns(RuntimeWarning, match=r"example\(s\) \[0\]"):
        res = ALTIPlusAttribution(model).decompose((src, tgt))
    assert bool(torch.isnan(res.source_contributions[0]).all()) and bool(torch.isnan(res.source_share[0]).all())
    assert bool(torch.isfinite(res.source_contributions[1]).all()) and float(res.completeness_error) <= 1e-10
    alone = ALTIPlusAttribution(model).decompose((src[1:], tgt[1:]))
    assert torch.allclose(res.source_contributions[1], alone.source_contributions[0], atol=1e-12, rtol=0)


@pytest.mark.parametrize("family", ["marian", "mbart", "t5"])
def test_streamed_recording_drops_each_blocks_probabilities(family, monkeypatch):
    r"""Every block's probabilities are freed as soon as its layer has run: at the end of every layer no
    recorded probability tensor is alive (a recorder that keeps them all until the end of the forward
    pass has 3 L - 1 alive at the last layer)."""
    import weakref

    from captum_normattr.models import seq2seq
    from captum_normattr.models.adapters import get_path

    model = model_for(family)
    adapter = get_seq2seq_adapter(model)
    refs = []
    original = seq2seq.Seq2SeqRecorder.record_attention

    def spy(self, module, probs, values, context=None):
        original(self, module, probs, values, context)
        refs.append(weakref.ref(self.records[self._attn_keys[id(module)]]["probs"]))  # the tensor the recorder keeps

    monkeypatch.setattr(seq2seq.Seq2SeqRecorder, "record_attention", spy)
    base = seq2seq.seq2seq_base(model)
    layers = list(get_path(base, adapter.encoder_layers)) + list(get_path(base, adapter.decoder_layers))
    alive = []
    handles = [layer.register_forward_hook(lambda *a: alive.append(sum(r() is not None for r in refs)))
               for layer in layers]
    try:
        src, tgt = pair(seed=10)
        ALTIPlusAttribution(model).attribute((src, tgt))
    finally:
        for h in handles:
            h.remove()
    assert len(refs) == 6 and len(alive) == 4  # 2 encoder blocks, 2 x 2 decoder blocks; 4 layers
    assert alive == [0, 0, 0, 0], alive


def test_decompose_takes_the_captum_tuple_form_and_the_old_form_warns():
    model = model_for("bart")
    alti = ALTIPlusAttribution(model)
    src, tgt = pair(seed=12)
    sm, tm = torch.ones_like(src), torch.ones_like(tgt)
    sm[0, -2:] = 0
    tm[0, -1:] = 0
    new = alti.decompose((src, tgt), 2, (sm, tm), return_layer_maps=True)
    assert new.explained_position.tolist() == [2, 2] and new.encoder_maps is not None
    with pytest.warns(DeprecationWarning, match=r"decompose\(\(src_ids, tgt_ids\), target"):
        old = alti.decompose(src, tgt, sm, tm, True, 2)
    with pytest.warns(DeprecationWarning):
        old_kw = alti.decompose(src, tgt, src_attention_mask=sm, tgt_attention_mask=tm, return_layer_maps=True,
                                explained_position=2)
    for res in (old, old_kw):
        for key in ("scores", "target_scores", "source_contributions", "target_contributions", "delta",
                    "encoder_maps", "decoder_cross_maps", "explained_position"):
            assert torch.equal(getattr(res, key), getattr(new, key)), key
    s, t = alti.attribute((src, tgt), 2, (sm, tm))
    assert torch.equal(s, new.scores) and torch.equal(t, new.target_scores)
    assert torch.equal(alti.decompose((src, tgt), additional_forward_args=sm).scores,
                       alti.decompose((src, tgt), None, (sm, None)).scores)
    with pytest.raises(TypeError, match="unexpected arguments"):
        alti.decompose((src, tgt), None, (sm, tm), tm)
    with pytest.raises(TypeError, match="unexpected arguments.*explained_position"):
        alti.decompose((src, tgt), explained_position=2)
    with pytest.raises(ValueError, match="pair"):
        alti.decompose((src,))


def test_compiled_kernel_and_one_row_tiles_give_the_same_maps(monkeypatch):
    r"""The shared ALTI kernel on ALTI+'s rectangular cross-attention blocks: the fused compiled kernel (forced
    on, float64) and the eager kernel with one query row per tile equal the naive reference."""
    from captum_normattr.decompose.methods import alti as alti_kernel

    model = model_for("marian")
    src, tgt = pair(seed=13, b=2, s=6, t=4)
    sm = torch.ones_like(src)
    sm[1, :2] = 0
    n_src, n_tgt, maps = naive_alti_plus(model, src, tgt, sm)
    tiny = ALTIPlusAttribution(model, memory_budget_mb=1e-6).decompose((src, tgt), None, sm, return_layer_maps=True)
    alti_kernel.use_compiled_kernel(True)
    try:
        fused = ALTIPlusAttribution(model).decompose((src, tgt), None, sm, return_layer_maps=True)
    finally:
        alti_kernel.use_compiled_kernel(None)
    from captum_normattr.decompose.primitives import compiled

    assert not compiled.has_failed(alti_kernel._l1_distance_tile), "the compiled kernel fell back to the eager one"
    for res in (tiny, fused):
        assert torch.allclose(res.source_contributions, n_src, atol=1e-12, rtol=0)
        assert torch.allclose(res.target_contributions, n_tgt, atol=1e-12, rtol=0)
        assert torch.allclose(res.decoder_cross_maps, torch.stack(maps["decoder_cross"], 1), atol=1e-12, rtol=0)
        assert torch.allclose(res.decoder_self_maps, torch.stack(maps["decoder_self"], 1), atol=1e-12, rtol=0)
