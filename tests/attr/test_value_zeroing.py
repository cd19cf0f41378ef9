r"""Value Zeroing against a naive reference, padding, chunking, attention implementations and restoration."""
import pytest
import torch
import torch.nn.functional as F
from conftest import make_model, random_batch
from decoder_models import decoder_batch, make_decoder
from vision_models import images, make_vision
from zoo import build
from zoo_frontier import build_frontier

from captum_normattr.models.guard import ConsistencyError, ConsistencyWarning
from captum_normattr.attr.value_zeroing import ValueZeroingAttribution, repeat_examples, value_columns
from captum_normattr.models.adapters import get_adapter, layer_modules

__all__: list = []


def _tiny(family: str, attn: str = "sdpa"):
    return make_model(family, attn=attn) if family == "bert" else make_decoder(family, attn=attn)


def _layers_and_value(model, family: str):
    r"""The layer modules, each one's value projection, and the value columns of its output (written out per family)."""
    if family == "bert":
        return [(layer, layer.attention.self.value, slice(None)) for layer in model.bert.encoder.layer]
    if family == "gpt2":
        d = model.config.n_embd
        return [(layer, layer.attn.c_attn, slice(2 * d, 3 * d)) for layer in model.transformer.h]  # fused q | k | v
    if family == "deepseek_v3":  # latent values: kv_b_proj gives each head [key part | value]
        a = model.model.layers[0].self_attn
        heads = model.config.num_attention_heads
        width = a.qk_nope_head_dim + a.v_head_dim
        cols = torch.cat([torch.arange(h * width + a.qk_nope_head_dim, (h + 1) * width) for h in range(heads)])
        return [(layer, layer.self_attn.kv_b_proj, cols) for layer in model.model.layers]
    return [(layer, layer.self_attn.v_proj, slice(None)) for layer in model.model.layers]


def naive_value_zeroing(model, family: str, ids: torch.Tensor, position: int):
    r"""One unpadded example (1, T): every layer rerun once per source j with j's value row zeroed by a hook.

    Returns (cosine distances (L, T, T), row-normalised maps (L, T, T), rollout (T, T), scores (T,)).
    """
    layers = _layers_and_value(model, family)
    calls, outputs = {}, {}
    handles = []
    for i, (layer, _, _) in enumerate(layers):
        def pre(module, args, kwargs, i=i):
            if args:
                args = (args[0].clone(),) + tuple(args[1:])
            else:
                kwargs = dict(kwargs, hidden_states=kwargs["hidden_states"].clone())
            calls.setdefault(i, (args, dict(kwargs)))

        def post(module, args, output, i=i):
            outputs.setdefault(i, (output[0] if isinstance(output, tuple) else output).clone())

        handles += [layer.register_forward_pre_hook(pre, with_kwargs=True), layer.register_forward_hook(post)]
    try:
        with torch.no_grad():
            model(input_ids=ids, **({} if family == "bert" else {"use_cache": False}))  # a cache would grow in the reruns
    finally:
        for h in handles:
            h.remove()
    t = ids.shape[1]
    dist = torch.zeros(len(layers), t, t, dtype=torch.float64)
    for i, (layer, value, cols) in enumerate(layers):
        args, kwargs = calls[i]
        for j in range(t):
            def zero(module, inp, out, j=j):
                out = out.clone()
                view = out[:, 0] if out.dim() == 4 else out  # DeepSeek-V3's kv_b_proj output is (B, 1, T, W)
                view[:, j, cols] = 0
                return out

            h = value.register_forward_hook(zero)
            try:
                with torch.no_grad():
                    y = layer(*args, **kwargs)
            finally:
                h.remove()
            y = y[0] if isinstance(y, tuple) else y
            dist[i, :, j] = 1 - F.cosine_similarity(outputs[i][0], y[0], dim=-1)
    maps = dist / dist.sum(-1, keepdim=True)
    joint = maps[0]
    for m in maps[1:]:
        joint = m @ joint
    return dist, maps, joint, joint[position]


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_matches_naive_reference(family):
    model = _tiny(family)
    if family == "bert":
        ids, mask = random_batch([7, 5], seed=3)
    else:
        ids, mask = decoder_batch([7, 5], seed=3)
    vz = ValueZeroingAttribution(model)
    res = vz.decompose(ids, additional_forward_args=(mask,))
    assert res.method == "Value Zeroing" and res.rollout_convention == "raw"
    for b in range(ids.shape[0]):
        real = mask[b].bool()
        single = ids[b:b + 1, real]
        t = single.shape[1]
        position = 0 if family == "bert" else t - 1
        dist, maps, joint, scores = naive_value_zeroing(model, family, single, position)
        sel = real.nonzero().flatten()
        ix = (slice(None), sel[:, None], sel[None, :])
        assert torch.allclose(res.extras["cosine_distances"][b][ix], dist, atol=1e-12, rtol=1e-9)
        assert torch.allclose(res.layer_maps[b][ix], maps, atol=1e-10, rtol=0)
        assert torch.allclose(res.rollout[b][sel[:, None], sel[None, :]], joint, atol=1e-10, rtol=0)
        assert torch.allclose(res.scores[b, real], scores, atol=1e-10, rtol=0)
        assert int(res.explained_position[b]) == int(sel[position])
    # the row of the explained position in the full rollout is the score
    rows = res.rollout[torch.arange(ids.shape[0]), res.explained_position]
    assert torch.allclose(rows, res.scores, atol=1e-12, rtol=0)
    assert float(res.delta.max()) < 1e-12


@pytest.mark.parametrize("family,left", [("bert", False), ("gpt2", True), ("llama", True), ("llama", False)])
def test_padded_batch_equals_single_examples(family, left):
    model = _tiny(family)
    if family == "bert":
        ids, mask = random_batch([7, 4, 6], seed=5)
    else:
        ids, mask = decoder_batch([7, 4, 6], seed=5, left=left)
    vz = ValueZeroingAttribution(model)
    res = vz.decompose(ids, additional_forward_args=(mask,))
    pad = ~mask.bool()
    assert bool((res.scores[pad] == 0).all())
    assert bool((res.layer_maps.transpose(1, 2)[pad] == 0).all()) and bool((res.layer_maps.permute(0, 3, 1, 2)[pad] == 0).all())
    assert bool((res.rollout[pad] == 0).all()) and bool((res.rollout.transpose(1, 2)[pad] == 0).all())
    sums = res.layer_maps.sum(-1)
    assert torch.allclose(sums[mask.bool()[:, None, :].expand_as(sums)], torch.ones(1, dtype=torch.float64), atol=1e-12)
    if family != "bert":  # causal: lower triangular maps
        assert bool((res.layer_maps.triu(1) == 0).all())
    for b in range(ids.shape[0]):
        real = mask[b].bool()
        one = vz.decompose(ids[b:b + 1, real])
        sel = real.nonzero().flatten()
        assert torch.allclose(res.scores[b, real], one.scores[0], atol=1e-12, rtol=0)
        assert torch.allclose(res.layer_maps[b][:, sel[:, None], sel[None, :]], one.layer_maps[0], atol=1e-12, rtol=0)
    scores = vz.attribute(ids, additional_forward_args=(mask,))
    assert torch.equal(scores, res.scores)


def test_chunks_do_not_change_the_scores():
    model = make_decoder("llama")
    ids, mask = decoder_batch([6, 5], seed=2)
    one = ValueZeroingAttribution(model, memory_budget_mb=1e-6).decompose(ids, additional_forward_args=(mask,))
    big = ValueZeroingAttribution(model, memory_budget_mb=4096).decompose(ids, additional_forward_args=(mask,))
    assert ValueZeroingAttribution(model, memory_budget_mb=1e-6).chunk_size(6, 24, 8) == 1
    assert torch.allclose(one.layer_maps, big.layer_maps, atol=1e-13, rtol=0)
    assert torch.allclose(one.scores, big.scores, atol=1e-13, rtol=0)


@pytest.mark.parametrize("family", ["bert", "llama", "gpt2"])
def test_sdpa_and_eager_models_agree(family):
    # right padding: with left padding the decoders' own eager attention makes the pad rows NaN (see below)
    ids, mask = random_batch([6, 4], seed=7) if family == "bert" else decoder_batch([6, 4], seed=7, left=False)
    results = {}
    for attn in ("sdpa", "eager"):
        model = _tiny(family, attn)
        results[attn] = ValueZeroingAttribution(model).decompose(ids, additional_forward_args=(mask,))
        assert model.config._attn_implementation == attn
    # the decoders' eager attention takes its softmax in float32 (transformers' eager_attention_forward): the two
    # models themselves differ by ~1e-8; BERT's eager attention is float64 throughout
    tol = 1e-10 if family == "bert" else 1e-6
    assert torch.allclose(results["sdpa"].layer_maps, results["eager"].layer_maps, atol=tol, rtol=0)
    assert torch.allclose(results["sdpa"].scores, results["eager"].scores, atol=tol, rtol=0)
    assert float(results["sdpa"].delta.max()) < 1e-12 and float(results["eager"].delta.max()) < 1e-12


def test_a_forward_pass_that_is_not_finite_gives_nan_scores():
    r"""The reruns are the model's own layers: where its forward pass is NaN at a real token (eager Llama in float64
    turns fully masked left-pad rows into NaN, which the next layer mixes in with probability 0), the example is NaN."""
    model = make_decoder("llama", attn="eager")
    ids, mask = decoder_batch([6, 4], seed=7)
    with pytest.warns(RuntimeWarning, match=r"example\(s\) \[1\] hold NaN"):
        res = ValueZeroingAttribution(model).decompose(ids, additional_forward_args=(mask,))
    assert bool(torch.isnan(res.scores[1]).all()) and bool(torch.isfinite(res.scores[0]).all())
    alone = ValueZeroingAttribution(model).decompose(ids[:1])
    assert torch.allclose(alone.scores, res.scores[:1], atol=1e-12, rtol=0)


def _hook_counts(model):
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]


def test_model_unchanged_after_a_call():
    model = make_decoder("gpt2", lm_head=False)
    model.train()
    model.h[0].eval()  # a mixed state must come back as it was
    flags = [m.training for m in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    hooks = _hook_counts(model)
    impl = model.config._attn_implementation
    ids, mask = decoder_batch([6, 3], seed=1)
    res = ValueZeroingAttribution(model).decompose(ids, additional_forward_args=(mask,))
    assert [m.training for m in model.modules()] == flags
    assert _hook_counts(model) == hooks
    assert model.config._attn_implementation == impl
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    model.eval()
    again = ValueZeroingAttribution(model).decompose(ids, additional_forward_args=(mask,))
    assert torch.equal(res.scores, again.scores)  # eval mode was used inside the call


def test_model_restored_after_an_error():
    model = make_model("bert")
    model.train()
    flags = [m.training for m in model.modules()]
    hooks = _hook_counts(model)
    impl = model.config._attn_implementation
    ids, mask = random_batch([6, 4], seed=1)

    def fail_in_reruns(module, args, output):
        if output.shape[0] > ids.shape[0]:
            raise RuntimeError("boom")

    h = model.bert.encoder.layer[1].attention.self.value.register_forward_hook(fail_in_reruns)
    with pytest.raises(RuntimeError, match="boom"):
        ValueZeroingAttribution(model, memory_budget_mb=4096).decompose(ids, additional_forward_args=(mask,))
    h.remove()
    assert [m.training for m in model.modules()] == flags
    assert _hook_counts(model) == hooks
    assert model.config._attn_implementation == impl
    model.eval()
    res = ValueZeroingAttribution(model).decompose(ids, additional_forward_args=(mask,))
    assert float(res.delta.max()) < 1e-12


def test_attribute_follows_captum():
    model = make_model("bert")
    ids, mask = random_batch([6, 4], seed=4)
    vz = ValueZeroingAttribution(model)
    assert ValueZeroingAttribution.get_name() == "Value Zeroing" and vz.get_name() == "Value Zeroing"
    scores = vz.attribute(ids, additional_forward_args=(mask,))
    assert scores.shape == ids.shape and scores.dtype == torch.float64
    out, delta = vz.attribute((ids,), additional_forward_args=(mask,), return_convergence_delta=True)
    assert isinstance(out, tuple) and torch.equal(out[0], scores) and delta.shape == (2,)
    with pytest.raises(ValueError, match="target"):
        vz.attribute(ids, target=1, additional_forward_args=(mask,))
    res = vz.decompose(ids, additional_forward_args=(mask,), return_layer_maps=False, return_rollout=False)
    assert res.layer_maps is None and res.rollout is None and "cosine_distances" not in res.extras
    assert torch.equal(res.scores, scores) and res.extras["rerun_error"].shape == (2, 2)
    last = ValueZeroingAttribution(model, explained_position="last").attribute(ids, additional_forward_args=(mask,))
    full = vz.decompose(ids, additional_forward_args=(mask,))
    assert torch.allclose(last[1], full.rollout[1, 3], atol=1e-12, rtol=0)


def test_a_layer_that_reruns_differently_warns_or_raises():
    model = make_model("bert")
    ids, mask = random_batch([5], seed=2)
    calls = [0]

    def drift(module, args, output):  # a stateful hook: every call changes the output differently
        calls[0] += 1
        return (output[0] + 1e-3 * calls[0],) + tuple(output[1:]) if isinstance(output, tuple) else output + 1e-3 * calls[0]

    h = model.bert.encoder.layer[0].register_forward_hook(drift)
    try:
        with pytest.warns(ConsistencyWarning, match="does not reproduce"):
            ValueZeroingAttribution(model).decompose(ids, additional_forward_args=(mask,))
        with pytest.raises(ConsistencyError, match="does not reproduce"):
            ValueZeroingAttribution(model, strict=True).decompose(ids, additional_forward_args=(mask,))
    finally:
        h.remove()


def test_value_columns_of_the_layouts():
    gpt2 = make_decoder("gpt2")
    a = get_adapter(gpt2)
    d = gpt2.config.n_embd
    assert torch.equal(value_columns(layer_modules(gpt2, a)[0], a, gpt2), torch.arange(2 * d, 3 * d))
    llama = make_decoder("llama")
    a = get_adapter(llama)
    assert torch.equal(value_columns(layer_modules(llama, a)[0], a, llama), torch.arange(llama.model.layers[0].self_attn.v_proj.out_features))


def test_repeat_examples():
    rows = torch.tensor([1, 1, 0])
    mask = torch.arange(2 * 3 * 3.0).view(2, 1, 3, 3)
    alibi = torch.arange(2 * 4 * 3.0).view(8, 1, 3)
    out = repeat_examples({"mask": mask, "cache_position": torch.arange(2), "alibi": alibi, "pe": (mask[:1], None)},
                          rows, 2, heads=4)
    assert torch.equal(out["mask"], mask[rows])
    assert torch.equal(out["cache_position"], torch.arange(2))
    assert torch.equal(out["alibi"], alibi.view(2, 4, 1, 3)[rows].reshape(12, 1, 3))
    assert out["pe"][0] is not None and out["pe"][0].shape[0] == 1 and out["pe"][1] is None


@pytest.mark.parametrize("key", ["gpt_neox", "phi3", "falcon", "bloom", "deberta-v2", "modernbert"])
def test_value_layouts_of_the_zoo(key):
    r"""Interleaved (GPT-NeoX), fused grouped-query (Phi-3), grouped (Falcon) projections, ALiBi (BLOOM), DeBERTa."""
    try:
        model = build(key, "bare")
    except NotImplementedError:
        model = build(key, "cls")
    causal = get_adapter(model).causal
    ids = torch.randint(3, 40, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 6, dtype=torch.long)
    if causal:
        mask[1, :2] = 0  # left padding
    else:
        mask[1, 4:] = 0
    vz = ValueZeroingAttribution(model)
    res = vz.decompose(ids, additional_forward_args=(mask,))
    assert float(res.delta.max()) < 1e-12
    for b in range(2):
        real = mask[b].bool()
        one = vz.decompose(ids[b:b + 1, real])
        assert torch.allclose(res.scores[b, real], one.scores[0], atol=1e-12, rtol=0)
        assert float(one.delta.max()) < 1e-12


def test_vision_transformer_pixels():
    model = make_vision("vit")
    x = images()
    vz = ValueZeroingAttribution(model)
    pixels, delta = vz.attribute(x, return_convergence_delta=True)
    assert pixels.shape == x.shape and float(delta.max()) < 1e-12
    res = vz.decompose(x)
    assert res.scores.shape == (2, res.layer_maps.shape[-1]) and "patch_grid" in res.extras
    assert torch.allclose(res.scores.sum(-1), torch.ones(2, dtype=torch.float64), atol=1e-12)


def test_latent_values_match_the_naive_reference():
    r"""DeepSeek-V3's multi-head latent attention: a token's value zeroed in the up-projection's output
    (its value columns) equals the naive per-source reruns; padded batch equals single examples."""
    model = build_frontier("deepseek_v3")
    ids = torch.randint(3, 40, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    vz = ValueZeroingAttribution(model)
    res = vz.decompose(ids, additional_forward_args=(mask,))
    assert float(res.delta.max()) < 1e-10
    for b in range(2):
        real = mask[b].bool()
        single = ids[b:b + 1, real]
        t = single.shape[1]
        dist, maps, joint, scores = naive_value_zeroing(model, "deepseek_v3", single, t - 1)
        scale = float(dist.abs().max())
        sel = real.nonzero().flatten()
        got = res.extras["cosine_distances"][b][(slice(None), sel[:, None], sel[None, :])]
        assert torch.allclose(got, dist, atol=1e-9 * scale, rtol=1e-7)
        assert torch.allclose(res.scores[b, real], scores, atol=1e-8, rtol=0)
