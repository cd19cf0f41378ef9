r"""Round 5 speed paths give the plain formulas' numbers: token blocks, the compiled quadratic forms,
the blocked completeness check and the finiteness check that reads each layer output once."""
import dataclasses

import pytest
from layer_capture import capture_layers
import torch

from captum_normattr import GlobEncAttribution
from captum_normattr.models import engine
from captum_normattr.decompose.primitives import attention
from captum_normattr.decompose.primitives import chunking
from captum_normattr.decompose.primitives import compiled
from captum_normattr.decompose.kinds.pre_ln import pre_ln_layer_maps
from captum_normattr.decompose.kinds.post_ln import post_ln_completeness_error, post_ln_layer_maps, post_ln_ln1_parts_sum
from captum_normattr.decompose.primitives.layer_norm import norm_scale
from captum_normattr.decompose.records import NormParams

from conftest import make_model, random_batch
from decoder_models import decoder_batch, make_decoder
from reference import naive_parts, naive_pre_ln_parts, naive_ratio

NORM_MAPS = ("N", "N_RES", "N_RESLN", "N_ENC")


@pytest.fixture
def tiny_blocks(monkeypatch):
    r"""The smallest blocks: 16 tokens per Gram block, one token per vector block."""
    monkeypatch.setattr(attention, "CACHE_TILE_BYTES", 1)
    monkeypatch.setattr(chunking, "VECTOR_BLOCK_BYTES", 1)


@pytest.fixture
def forced_compile():
    compiled.use_compiled_kernels(True)
    yield
    compiled.use_compiled_kernels(None)


def _no_fallback(fn):
    assert not compiled.has_failed(fn), "the compiled kernel fell back to the eager one"


@pytest.mark.parametrize("family", ["bert", "distilbert"])
@pytest.mark.parametrize("kernel", ["eager", "compiled"])
def test_blocked_post_ln_maps_ratios_and_completeness_equal_naive(family, kernel, tiny_blocks, request):
    r"""60 tokens in ragged blocks (16-token Gram blocks, 1-token vector blocks), padded batch:
    every norm map and ratio equals the explicit parts, the completeness error equals the
    unblocked sum of parts' error and stays below 1e-10."""
    if kernel == "compiled":
        request.getfixturevalue("forced_compile")
    model = make_model(family)
    ids, mask = random_batch([24, 19, 17], seed=4)
    valid = mask.bool()
    m2 = (valid[:, :, None] & valid[:, None, :]).double()
    for layer in capture_layers(model, ids, mask):
        maps, ratios = post_ln_layer_maps(layer, valid, NORM_MAPS)
        ref = naive_parts(layer)
        for name in NORM_MAPS:
            torch.testing.assert_close(maps[name], ref[name].norm(dim=-1) * m2, atol=1e-10, rtol=0, msg=name)
            torch.testing.assert_close(ratios[name], naive_ratio(ref[name]) * valid, atol=1e-10, rtol=0, msg=name)
        err = post_ln_completeness_error(layer, valid)
        unblocked = ((post_ln_ln1_parts_sum(layer) - layer.ln1_out).abs().amax(-1) * valid).max()
        assert err < 1e-10
        torch.testing.assert_close(err, unblocked, atol=1e-13, rtol=0)
    if kernel == "compiled":
        _no_fallback(attention._quadratic_forms_tile)


def test_blocked_completeness_sees_a_wrong_output_projection(tiny_blocks):
    r"""The blocked check measures the parts against the real tensors: a perturbed W_O shows."""
    model = make_model("bert")
    ids, mask = random_batch([9, 6], seed=5)
    layer = capture_layers(model, ids, mask)[0]
    assert post_ln_completeness_error(layer, mask.bool()) < 1e-10
    layer = dataclasses.replace(layer, out_weight=layer.out_weight * 1.01)
    assert post_ln_completeness_error(layer, mask.bool()) > 1e-4


@pytest.mark.parametrize("family,lengths", [("gpt2", [30, 21]), ("llama", [40, 29])])
@pytest.mark.parametrize("kernel", ["eager", "compiled"])
def test_blocked_pre_ln_maps_equal_naive(family, lengths, kernel, tiny_blocks, request):
    r"""Pre-LN maps with the bias subtracted block by block (left padding; 40 tokens: the
    compiled kernel's causal row blocks) equal the explicit parts."""
    if kernel == "compiled":
        request.getfixturevalue("forced_compile")
    model = make_decoder(family)
    ids, mask = decoder_batch(lengths, seed=6, left=True)
    v = mask.bool()
    m2 = (v[:, :, None] & v[:, None, :]).double().tril()
    for layer in capture_layers(model, ids, mask):
        maps, ratios = pre_ln_layer_maps(layer, v)
        for name, parts in naive_pre_ln_parts(layer).items():
            torch.testing.assert_close(maps[name], parts.norm(dim=-1) * m2, atol=1e-10, rtol=0, msg=name)
            torch.testing.assert_close(ratios[name], naive_ratio(parts) * v, atol=1e-10, rtol=0, msg=name)
    if kernel == "compiled":
        _no_fallback(attention._quadratic_forms_tile)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b", [1, 3])
def test_compiled_quadratic_forms_equal_the_batched_products(causal, b, forced_compile):
    gen = torch.Generator().manual_seed(7)
    h, t = 4, 70
    scores = torch.randn(b, h, t, t, dtype=torch.float64, generator=gen)
    if causal:
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    probs = scores.softmax(-1)
    u = torch.randn(b, t, h, 5, dtype=torch.float64, generator=gen)
    gram = u @ u.transpose(-1, -2)
    got = attention._quadratic_norms(probs, gram, causal)
    _no_fallback(attention._quadratic_forms_tile)
    want = torch.einsum("bhij,bjhg,bgij->bij", probs, gram, probs)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_quadratic_kernel_default_selection(monkeypatch):
    r"""By default, float32 layers from QUAD_COMPILE_MIN_ELEMENTS probabilities compile once the eager
    kernel has taken QUAD_COMPILE_AFTER_SECONDS on such layers; float64 and small layers never do,
    and the time of small layers does not count; layers of more than QUAD_COMPILE_MAX_HEADS heads never do."""
    monkeypatch.delenv(compiled.COMPILE_ENV, raising=False)
    monkeypatch.setattr(attention, "_EAGER_QUAD_SECONDS", [0.0])
    monkeypatch.setattr(attention, "QUAD_COMPILE_AFTER_SECONDS", 1e-9)
    calls = []

    def fake(fn, wanted):
        calls.append(wanted)
        return None

    monkeypatch.setattr(compiled, "compiled_kernel", fake)
    n = attention.QUAD_COMPILE_MIN_ELEMENTS

    def run(dtype, examples, t=8):
        attention._quadratic_norms(torch.zeros(examples, 2, t, t, dtype=dtype), torch.zeros(examples, t, 2, 2, dtype=dtype), False)

    run(torch.float32, 1)  # small: no time counted
    assert attention._EAGER_QUAD_SECONDS[0] == 0.0
    run(torch.float32, n // 128 + 1)  # large, but no eager time yet
    assert attention._EAGER_QUAD_SECONDS[0] > 0
    run(torch.float32, n // 128 + 1)  # large, after the eager time
    run(torch.float64, n // 128 + 1)
    run(torch.float32, 1)
    assert calls == [False, False, True, False, False]
    heads = attention.QUAD_COMPILE_MAX_HEADS + 1  # one head per channel (hybrid mixers): never by default
    attention._quadratic_norms(torch.zeros(n // (64 * heads) + 1, heads, 8, 8), torch.zeros(n // (64 * heads) + 1, 8,
                                                                                             heads, heads), False)
    assert calls[-1] is False


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_blocked_norm_scale_equals_the_whole_tensor(kind, monkeypatch):
    gen = torch.Generator().manual_seed(8)
    u = 3 + torch.randn(3, 11, 7, dtype=torch.float64, generator=gen)
    params = NormParams(kind=kind, weight=None, bias=None, eps=1e-5)
    whole = norm_scale(u, params)
    monkeypatch.setattr(chunking, "VECTOR_BLOCK_BYTES", 5 * 7 * 8)  # 5-token blocks, a ragged last one
    blocked = norm_scale(u, params)
    torch.testing.assert_close(blocked, whole, atol=1e-15, rtol=0)
    c = u - u.mean(-1, keepdim=True) if kind == "layernorm" else u
    torch.testing.assert_close(blocked, torch.sqrt(c.pow(2).mean(-1) + 1e-5), atol=1e-14, rtol=0)


def test_finiteness_reads_each_layer_output_once_and_still_sees_the_input(monkeypatch):
    r"""Layers after the first skip their input (the previous output, already checked); the
    first layer's input is checked, so a NaN embedding still marks its example."""
    model = make_model("bert")
    ids, mask = random_batch([6, 4], seed=9)
    seen = []
    real = engine.layer_finite

    def spy(layer, valid, input_checked=False):
        seen.append(input_checked)
        return real(layer, valid, input_checked)

    monkeypatch.setattr(engine, "layer_finite", spy)
    attr = GlobEncAttribution(model)
    attr.attribute(ids, additional_forward_args=(mask,))
    assert seen == [False, True]
    emb = model.get_input_embeddings()(ids).detach().clone()
    emb[1, 2, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match=r"example\(s\) \[1\]"):
        got = attr.attribute(emb, additional_forward_args=(mask,))
    assert torch.isnan(got[1]).all() and torch.isfinite(got[0]).all()


def test_attention_in_blocks_of_one_example_equals_each_example_alone(monkeypatch):
    r"""The recording attention's example blocks (masks and T5's position bias sliced per block):
    padded batches decomposed one example per block equal each example decomposed alone."""
    from captum_normattr import ALTIAttribution, ALTIPlusAttribution
    from captum_normattr.models.capture import attention as capture
    from seq2seq_models import PAD, pair
    from seq2seq_models import make_model as model_for

    def _pad(x, n, left, value):
        extra = torch.full((x.shape[0], n), value, dtype=x.dtype)
        return torch.cat([extra, x], 1) if left else torch.cat([x, extra], 1)

    monkeypatch.setattr(capture, "EXAMPLE_BLOCK_BYTES", 1)
    bert = make_model("bert")
    lengths = [9, 4, 7]
    ids, mask = random_batch(lengths, seed=10)
    for attr in (ALTIAttribution(bert), GlobEncAttribution(bert)):
        batch = attr.decompose(ids, additional_forward_args=(mask,))
        for i, n in enumerate(lengths):
            alone = attr.decompose(ids[i : i + 1, :n], additional_forward_args=(mask[i : i + 1, :n],))
            torch.testing.assert_close(batch.layer_maps[i, :, :n, :n], alone.layer_maps[0], atol=1e-12, rtol=0)
            torch.testing.assert_close(batch.scores[i, :n], alone.scores[0], atol=1e-12, rtol=0)
    t5 = ALTIPlusAttribution(model_for("t5"))
    (s1, t1), (s2, t2) = pair(seed=2, b=1, s=4, t=3), pair(seed=3, b=1, s=7, t=6)
    src, tgt = torch.cat([_pad(s1, 3, False, PAD), s2]), torch.cat([_pad(t1, 3, False, PAD), t2])
    sm = torch.cat([_pad(torch.ones_like(s1), 3, False, 0), torch.ones_like(s2)])
    tm = torch.cat([_pad(torch.ones_like(t1), 3, False, 0), torch.ones_like(t2)])
    batch = t5.decompose((src, tgt), additional_forward_args=(sm, tm), return_layer_maps=True)
    assert float(batch.completeness_error) <= 1e-10
    for i, (s, t) in enumerate([(s1, t1), (s2, t2)]):
        alone, ex = t5.decompose((s, t), return_layer_maps=True).example(0), batch.example(i)
        for key in ("source_contributions", "target_contributions", "encoder_maps", "decoder_self_maps"):
            torch.testing.assert_close(ex[key], alone[key], atol=1e-12, rtol=0, msg=key)
