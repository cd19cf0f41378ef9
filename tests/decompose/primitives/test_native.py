r"""The native ALTI kernel (decompose/native.py) and the recording attention's reused buffers (models/capture.py)."""
import pytest
import torch

from captum_normattr.decompose.methods import alti

from captum_normattr.decompose.primitives import native
from captum_normattr.decompose.methods.alti import alti_map

from alti_reference import alti_layer as _alti_layer, naive_alti as _naive_alti


def _naive_distances(probs, proj_j, target, causal):
    r"""(Q, K) |y_i - sum_h p[h, i, j] u[j, h]|_1 with every part written out."""
    parts = torch.einsum("hij,jhd->ijd", probs, proj_j)
    dist = (target[:, None] - parts).abs().sum(-1)
    return dist.tril() if causal else dist


def _kernel_or_skip(dtype, heads):
    fn = native.alti_l1_kernel(dtype, heads)
    if fn is None:
        pytest.skip(f"no native kernel here: {native.native_unavailable_reason()}")
    return fn


@pytest.mark.parametrize("heads,d", [(1, 8), (3, 37), (9, 40)])
@pytest.mark.parametrize("q,k,causal", [(5, 5, True), (130, 130, True), (300, 300, False), (150, 70, False)])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_distances_equal_explicit_parts(heads, d, q, k, causal, threads):
    r"""float64, every block and tile boundary (128 rows, 16 sources), widths that are not a multiple of
    the vector width, probabilities read through the strides of a non-contiguous view."""
    gen = torch.Generator().manual_seed(heads * 1000 + q + d)
    probs = torch.rand(k, q, heads, dtype=torch.float64, generator=gen).permute(2, 1, 0)  # (H, Q, K), strided
    assert not probs.is_contiguous()
    proj_j = torch.randn(k, heads, d, dtype=torch.float64, generator=gen)
    target = torch.randn(q, d, dtype=torch.float64, generator=gen)
    fn = _kernel_or_skip(torch.float64, heads)
    out = torch.zeros(q, k, dtype=torch.float64)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        native.native_distances(fn, probs, proj_j, target, out, causal)
    finally:
        torch.set_num_threads(old)
    want = _naive_distances(probs, proj_j, target, causal)
    scale = want.abs().max()
    assert ((out - want).abs().max() / scale) < 1e-13
    if causal:
        assert not out.triu(1).any()  # entries j > i untouched (zeros)


def test_native_float32_is_close_to_float64():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(9, 200, 200, dtype=torch.float64, generator=gen), -1)
    proj_j = torch.randn(200, 9, 64, dtype=torch.float64, generator=gen)
    target = torch.randn(200, 64, dtype=torch.float64, generator=gen)
    fn = _kernel_or_skip(torch.float32, 9)
    out = torch.zeros(200, 200)
    native.native_distances(fn, probs.float(), proj_j.float(), target.float(), out, True)
    want = _naive_distances(probs, proj_j, target, True)
    assert ((out.double() - want).abs().max() / want.abs().max()) < 1e-5


def test_native_distances_refuse_mixed_dtypes_and_layouts():
    fn = _kernel_or_skip(torch.float32, 2)
    probs = torch.rand(2, 4, 4)
    with pytest.raises(ValueError, match="one dtype"):
        native.native_distances(fn, probs, torch.rand(4, 2, 3, dtype=torch.float64), torch.rand(4, 3), torch.zeros(4, 4), True)
    with pytest.raises(ValueError, match="contiguous"):
        native.native_distances(fn, probs, torch.rand(2, 4, 3).transpose(0, 1), torch.rand(4, 3), torch.zeros(4, 4), True)


@pytest.mark.parametrize("use_native", ["1", "0"])
@pytest.mark.parametrize("causal", [False, True])
def test_alti_map_with_either_fused_kernel_equals_explicit_parts(use_native, causal, monkeypatch):
    r"""alti_map with the compiled kernels forced on: the native kernel (CAPTUM_NORMATTR_NATIVE=1) and the
    torch.compile kernel (=0) both give the explicit-parts map, pads and residual diagonal included."""
    monkeypatch.setenv(native.NATIVE_ENV, use_native)
    probs, projected, residual, output, scale, valid = _alti_layer(1, 2, 3, 37, 8, causal)
    valid[0, :3] = False
    used = []
    real = alti._native_distances
    monkeypatch.setattr(alti, "_native_distances", lambda *a: used.append(1) or real(*a))
    alti.use_compiled_kernel(True)
    try:
        got = alti_map(probs, projected, residual, output, valid, scale, None, causal)
    finally:
        alti.use_compiled_kernel(None)
    want = _naive_alti(probs, projected, residual, output, valid, scale, causal)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    if use_native == "0":
        assert not used
    elif native.alti_l1_kernel(torch.float64, 3) is not None:
        assert used  # the native kernel ran


def test_no_compiler_falls_back_with_a_reason(monkeypatch, tmp_path):
    monkeypatch.setenv(native.KERNEL_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(native, "_compiler", lambda: None)
    monkeypatch.setattr(native, "_LIBS", {})
    monkeypatch.setattr(native, "_REASON", {})
    assert native.alti_l1_kernel(torch.float32, 5) is None
    assert "no C compiler" in native.native_unavailable_reason()
    probs, projected, residual, output, scale, valid = _alti_layer(2, 1, 5, 20, 8, True)
    alti.use_compiled_kernel(True)
    try:
        got = alti_map(probs, projected, residual, output, valid, scale, None, True)  # the torch.compile kernel
    finally:
        alti.use_compiled_kernel(None)
    torch.testing.assert_close(got, _naive_alti(probs, projected, residual, output, valid, scale, True), rtol=0, atol=1e-12)


def test_a_failing_build_falls_back_with_the_compiler_message(monkeypatch, tmp_path):
    monkeypatch.setenv(native.KERNEL_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.setattr(native, "_LIBS", {})
    monkeypatch.setattr(native, "_REASON", {})
    assert native.alti_l1_kernel(torch.float32, 7) is None
    assert "failed" in native.native_unavailable_reason()
    assert not list(tmp_path.glob("*.so"))  # nothing half-built left in the cache


def test_native_switch_off(monkeypatch):
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert native.alti_l1_kernel(torch.float32, 9) is None


# --- the recording attention's reused buffers ------------------------------------------------
def test_probability_buffers_reuse_only_free_memory():
    from captum_normattr.models.capture.attention import ProbabilityBuffers

    pool = ProbabilityBuffers()
    with torch.no_grad():
        a = pool.take((2, 3), torch.float32, torch.device("cpu"))
        a_ptr = a.data_ptr()
        held = a[0]  # a view of it is still held: the memory is not free
        del a
        b = pool.take((2, 3), torch.float32, torch.device("cpu"))
        assert b.data_ptr() != a_ptr
        del held, b
        c = pool.take((2, 3), torch.float32, torch.device("cpu"))
        c_ptr = c.data_ptr()
        del c
        d = pool.take((2, 3), torch.float32, torch.device("cpu"))
        assert d.data_ptr() == c_ptr  # nothing held it: reused
        keep = d.numpy()  # a numpy array over it holds it too
        del d
        assert pool.take((2, 3), torch.float32, torch.device("cpu")).data_ptr() != c_ptr
        del keep
    with torch.enable_grad():  # autograd may save it: never handed out twice
        e = pool.take((2, 3), torch.float32, torch.device("cpu"))
        e_ptr = e.data_ptr()
        del e
        assert pool.take((2, 3), torch.float32, torch.device("cpu")).data_ptr() != e_ptr
    pool.clear()


def test_kept_layer_probabilities_are_never_overwritten(monkeypatch):
    r"""A caller that keeps every layer's probabilities (tests/layer_capture.py) gets each layer's own,
    equal to the model's eager attention weights, while a streaming consumer gets one reused buffer."""
    from captum_normattr.models.capture import attention as capture
    from decoder_models import decoder_batch, make_decoder
    from layer_capture import capture_layers

    monkeypatch.setattr(capture, "_MIN_BLOCK_ROWS", 2)
    model = make_decoder("llama", lm_head=False)
    ids, mask = decoder_batch([30, 23], seed=1, left=False)
    with torch.no_grad():
        layers = capture_layers(model, ids, mask)
        model.config._attn_implementation = "eager"
        try:
            eager = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        finally:
            model.config._attn_implementation = "sdpa"
    assert len({layer.probs.data_ptr() for layer in layers}) == len(layers)  # distinct memory per kept layer
    valid = mask.bool()
    for layer, want in zip(layers, eager):  # transformers' eager softmax runs in float32: 1e-6
        got = layer.probs.to(want.dtype)
        for e in range(ids.shape[0]):
            n = int(valid[e].sum())
            torch.testing.assert_close(got[e, :, :n, :n], want[e, :, :n, :n], atol=1e-6, rtol=0)
    # and bit for bit what fresh buffers give
    monkeypatch.setattr(capture.ProbabilityBuffers, "take", lambda self, shape, dtype, device, name="probs":
                        torch.empty(shape, dtype=dtype, device=device))
    with torch.no_grad():
        fresh = capture_layers(model, ids, mask)
    for layer, other in zip(layers, fresh):
        assert torch.equal(layer.probs, other.probs)
    monkeypatch.undo()
    monkeypatch.setattr(capture, "_MIN_BLOCK_ROWS", 2)

    from captum_normattr.models.engine import streamed_forward
    from captum_normattr.attr.inputs import prepare_inputs
    from captum_normattr.models.adapters import get_adapter

    adapter = get_adapter(model)
    ptrs, sums = [], []
    prepared = prepare_inputs(model, adapter, ids, (mask,))
    with torch.no_grad():
        with streamed_forward(model, adapter, prepared, lambda layer: (ptrs.append(layer.probs.data_ptr()),
                                                                       sums.append(layer.probs.sum()))):
            pass
    assert len(set(ptrs)) < len(ptrs)  # the streaming consumer drops each layer: its buffer is reused
    for s, layer in zip(sums, layers):
        torch.testing.assert_close(s, layer.probs.sum(), rtol=1e-12, atol=0)


# --- DecompX's checkpoint pass: the model's own attention, no probabilities ------------------
def test_plain_causal_mask_detection():
    from captum_normattr.models.capture.attention import _plain_causal

    t = 6
    neg = torch.finfo(torch.float64).min
    causal = torch.zeros(2, 1, t, t, dtype=torch.float64).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), neg)
    assert _plain_causal(causal)
    padded = causal.clone()
    padded[1, ..., :2] = neg  # a left-padded example
    assert not _plain_causal(padded)
    biased = causal.clone()
    biased[0, 0, 3, 1] = -0.5  # an additive bias on a kept key (ALiBi-like)
    assert not _plain_causal(biased)
    assert _plain_causal(torch.ones(t, t, dtype=torch.bool).tril().expand(1, 1, t, t))
    assert not _plain_causal(None)
    import gc
    import weakref

    ref = weakref.ref(causal)
    assert _plain_causal(causal)
    del causal
    gc.collect()
    assert ref() is None  # the judged mask is not kept alive


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("left", [False, True])
def test_decompx_checkpoint_pass_runs_the_models_attention(family, left, monkeypatch):
    r"""The adjoint's first pass records no probabilities and runs the model's sdpa (no eager attention there);
    the scores equal those of a first pass that records them, to 1e-12 (float64, padded batches)."""
    import captum_normattr as cn
    from captum_normattr.models import engine
    from captum_normattr.models.capture import attention as capture
    from decoder_models import decoder_batch, make_decoder

    model = make_decoder(family)
    ids, mask = decoder_batch([9, 6], seed=2, left=left)
    attr = cn.DecompXAttribution(model)
    eager_calls = []
    real_eager = capture._eager_attention
    monkeypatch.setattr(capture, "_eager_attention", lambda *a, **k: eager_calls.append(1) or real_eager(*a, **k))
    got = attr.decompose(ids, target=5, additional_forward_args=(mask,))
    n_layers = model.config.num_hidden_layers if hasattr(model.config, "num_hidden_layers") else model.config.n_layer
    assert len(eager_calls) == n_layers  # only the reruns of the walk down record probabilities
    real_stream = engine.streamed_forward
    monkeypatch.setattr("captum_normattr.attr.decompx.streamed_forward",
                        lambda *a, **k: real_stream(*a, **dict(k, probabilities=True)))
    want = attr.decompose(ids, target=5, additional_forward_args=(mask,))
    assert len(eager_calls) == 3 * n_layers  # this time the first pass recorded them too
    scale = want.scores.abs().max()
    assert ((got.scores - want.scores).abs().max() / scale) < 1e-12
    assert got.delta.max() < 1e-10 * got.logits.abs().max()
