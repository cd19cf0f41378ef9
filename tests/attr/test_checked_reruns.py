r"""Checked reruns (issue 36, item 2): every layer the DecompX adjoint or the routes rerun from its
checkpointed input is compared with the layer's output in the recorded forward pass, under the
consistency guard's tolerances, in every attention implementation (eager, sdpa, flex_attention)."""
from __future__ import annotations

import warnings

import pytest
import torch

from captum_normattr import DecompXAttribution
from captum_normattr.attr.routes import InformationFlowRoutes
from captum_normattr.models.capture.recorder import Recorder
from captum_normattr.models.guard import RERUN_CHECK, ConsistencyError, ConsistencyWarning
from decoder_models import decoder_batch, make_decoder


def _flex_available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


IMPLEMENTATIONS = ["eager", "sdpa", pytest.param("flex_attention", marks=pytest.mark.skipif(
    not _flex_available(), reason="this torch has no flex_attention"))]


def _model(attn: str, dtype: torch.dtype) -> torch.nn.Module:
    return make_decoder("llama", attn=attn).to(dtype)


@pytest.mark.parametrize("attn", IMPLEMENTATIONS)
@pytest.mark.parametrize("padded", [False, True])
def test_adjoint_gives_the_models_logit_in_every_attention_implementation(attn, padded):
    # flex_attention runs in float32 on CPU (no float64 kernel); the others in float64
    dtype = torch.float32 if attn == "flex_attention" else torch.float64
    model = _model(attn, dtype)
    ids, mask = decoder_batch([7, 5] if padded else [7, 7], seed=4)
    # the model's own eager forward gives NaN at a left-padded row in float64 (its softmax is taken in float32,
    # where the float64 mask minimum is -inf): its logits are read from the same weights under sdpa
    reference = _model("sdpa", dtype) if attn == "eager" else model
    with torch.no_grad():
        # the package counts a left-padded example's positions from its first real token
        position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
        logits = reference(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, -1]
    assert bool(torch.isfinite(logits).all())
    target = logits.argmin(-1)  # not the argmax: a wrong pass would not agree by chance
    real = logits.gather(1, target[:, None])[:, 0]
    scale = logits.abs().max()
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    got = {}
    for algorithm in ("adjoint", "forward"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", ConsistencyWarning)
            res = DecompXAttribution(model, algorithm=algorithm, strict=True).decompose(
                ids, target=target, additional_forward_args=(mask,))
        assert res.algorithm == algorithm
        # res.logits is the model's own logit, and the delta is honest: the scores add up to it
        assert torch.allclose(res.logits.reshape(-1).to(real.dtype), real, rtol=0, atol=tol * scale)
        total = res.scores.sum(-1) + (res.bias_scores.reshape(-1) if res.bias_scores is not None else 0)
        err = (total.to(real.dtype) - real).abs()
        assert bool((err <= res.delta.to(real.dtype) + tol * scale).all()), (err, res.delta)
        assert float(res.delta.max()) <= (1e-4 if dtype == torch.float32 else 1e-10) * scale
        got[algorithm] = res.scores
    same = 1e-4 if dtype == torch.float32 else 1e-10
    assert torch.allclose(got["adjoint"], got["forward"], rtol=0, atol=same * float(got["forward"].abs().max()))


def _perturbed_reruns(monkeypatch, factor: float) -> None:
    r"""Every rerun layer computes on its checkpoint times ``factor``: a rerun that is not the recorded layer."""
    original = Recorder.rerun_layer

    def wrong(self, idx, hidden_in):
        return original(self, idx, hidden_in * factor)

    monkeypatch.setattr(Recorder, "rerun_layer", wrong)


def test_a_wrong_rerun_warns_and_strict_raises(monkeypatch):
    model = _model("sdpa", torch.float64)
    ids, mask = decoder_batch([6, 4], seed=1)
    # a relative change of ~1e-4: far above float64 rounding (tolerance 1e-5), below the gross threshold
    _perturbed_reruns(monkeypatch, 1 + 1e-4)
    with pytest.warns(ConsistencyWarning, match="rerun layer output"):
        DecompXAttribution(model, algorithm="adjoint").attribute(ids, target=3, additional_forward_args=(mask,))
    with pytest.raises(ConsistencyError, match="rerun layer output"):
        DecompXAttribution(model, algorithm="adjoint", strict=True).attribute(
            ids, target=3, additional_forward_args=(mask,))
    # the forward algorithm reruns nothing: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConsistencyWarning)
        DecompXAttribution(model, algorithm="forward").attribute(ids, target=3, additional_forward_args=(mask,))


def test_a_grossly_wrong_rerun_raises_without_strict(monkeypatch):
    model = _model("eager", torch.float64)
    ids, mask = decoder_batch([6, 6], seed=2)
    _perturbed_reruns(monkeypatch, 1.5)
    with pytest.raises(ConsistencyError, match="refused even without strict"):
        DecompXAttribution(model, algorithm="adjoint").attribute(ids, target=3, additional_forward_args=(mask,))


def test_routes_reruns_are_checked(monkeypatch):
    model = make_decoder("llama", layers=3)
    ids, mask = decoder_batch([6], seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConsistencyWarning)
        InformationFlowRoutes(model).attribute(ids, attention_mask=mask, threshold=0.0)
    _perturbed_reruns(monkeypatch, 1 + 1e-4)
    with pytest.warns(ConsistencyWarning, match=RERUN_CHECK.split(" vs")[0]):
        InformationFlowRoutes(model).attribute(ids, attention_mask=mask, threshold=0.0)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_modernbert_eager_nan_of_the_model_is_told(pooling):
    from captum_normattr.models.capture.attention import ModelAttentionWarning
    from zoo_encoders import build_modernbert

    ids = torch.randint(3, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 3:], ids[1, 3:] = 0, 0  # example 1: 9 pads, most outside every real token's sliding window
    eager = build_modernbert(attn_implementation="eager", classifier_pooling=pooling)
    sdpa = build_modernbert(attn_implementation="sdpa", classifier_pooling=pooling)
    with torch.no_grad():
        own = eager(input_ids=ids, attention_mask=mask).logits
        finite = sdpa(input_ids=ids, attention_mask=mask).logits
    assert torch.isfinite(own[0]).all() and not torch.isfinite(own[1]).all()  # the model's own eager forward: NaN
    with pytest.warns(ModelAttentionWarning, match=r"'eager', ModernBertAttention\) gives NaN for example\(s\) \[1\]"):
        res = DecompXAttribution(eager).decompose(ids, additional_forward_args=(mask,))
    # the package's numbers are the finite (sdpa) computation
    assert torch.allclose(res.logits, finite, rtol=0, atol=1e-9 * float(finite.abs().max()))
    # float32 eager and sdpa models are not NaN: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelAttentionWarning)
        DecompXAttribution(sdpa).decompose(ids, additional_forward_args=(mask,))
        DecompXAttribution(eager.float()).decompose(ids, additional_forward_args=(mask,))


def test_value_zeroing_refuses_a_grossly_different_rerun_without_strict():
    from captum_normattr import ValueZeroingAttribution

    model = make_decoder("llama")
    ids, mask = decoder_batch([6], seed=2)
    calls = [0]

    def drift(module, args, output):  # every call of the layer adds another offset: the reruns compute something else
        calls[0] += 1
        return (output[0] + calls[0],) + tuple(output[1:]) if isinstance(output, tuple) else output + calls[0]

    h = model.model.layers[0].register_forward_hook(drift)
    try:
        with pytest.raises(ConsistencyError, match="refused even without strict"):
            ValueZeroingAttribution(model).decompose(ids, additional_forward_args=(mask,))
    finally:
        h.remove()
