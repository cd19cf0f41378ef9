r"""DecompX's adjoint on Gemma 4 (keys and values shared across layers, per-layer inputs) and on Qwen3-VL (DeepStack).

Issues 34 and 38; docs/decompx.md, "The adjoint with shared values and token-own additions". On tiny float64
models (``tests/fixtures/zoo_gemma4.py``, ``tests/fixtures/vlm_qwen3.py``): the adjoint's token scores and bias
score equal the forward algorithm's (1e-12 relative), their sum is the model's own logit (1e-10), ``"auto"``
chooses the adjoint, several explained positions in one walk equal the forward algorithm's and stay the same
when the stacked cotangents are split into chunks, padded batches equal single examples, the model is
unchanged. Each new term is checked to matter: without the cotangent handed to the layer whose values are
reused, without the per-layer-input branch or without the DeepStack vectors, the scores are not complete.
``input_cotangents`` is refused where token-own vectors join the stream after the embeddings.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma4TextConfig"):  # pragma: no cover - older transformers
    pytest.skip("transformers has no Gemma 4", allow_module_level=True)

from captum_normattr import DecompXAttribution, UnsupportedModelError  # noqa: E402
from captum_normattr.decompose.kinds.base import LayerKind  # noqa: E402
from captum_normattr.decompose.kinds.sandwich_per_layer_input import SandwichPerLayerInputKind  # noqa: E402
from captum_normattr.decompose.methods.decompx import adjoint as adjoint_module  # noqa: E402
from decoder_models import decoder_batch  # noqa: E402
from vlm_checks import check_model_unchanged  # noqa: E402
from vlm_families import qwen2_5_vl_single  # noqa: E402
from vlm_models import QWEN_IMAGE, qwen2_vl_batch  # noqa: E402
from vlm_qwen3 import make_qwen3_vl  # noqa: E402
from zoo_gemma4 import MOE, build_gemma4  # noqa: E402

#: Gemma 4 configs (keywords of build_gemma4): without and with shared keys and values, keys as values, experts
GEMMA4 = {name: dict(num_kv_shared_layers=shared, **more) for name, shared, more in (
    ("plain", 0, {}), ("shared_kv", 2, {}), ("shared_kv_k_eq_v", 2, dict(attention_k_eq_v=True)),
    ("no_per_layer_input", 2, dict(hidden_size_per_layer_input=0)), ("experts_shared_kv", 2, MOE))}
QWEN3_VL = {"qwen3_vl": dict(seed=1), "qwen3_vl_moe": dict(seed=1, moe=True)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _capped(x: torch.Tensor, cap: float = 30.0) -> torch.Tensor:
    return cap * torch.tanh(x / cap)


def _gemma4_logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits[:, -1]


def _same(adjoint, forward) -> None:
    r"""The adjoint's scores and bias score equal the forward algorithm's (1e-12 of the largest score)."""
    assert adjoint.algorithm == "adjoint" and forward.algorithm == "forward"
    scale = float(forward.scores.abs().max())
    torch.testing.assert_close(adjoint.scores, forward.scores, rtol=0, atol=1e-12 * scale)
    torch.testing.assert_close(adjoint.bias_scores, forward.bias_scores, rtol=0, atol=1e-12 * scale)


# --- Gemma 4 ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(GEMMA4))
def test_gemma4_adjoint_equals_forward_and_is_complete(name):
    model = build_gemma4(**GEMMA4[name])
    implementation = model.config._attn_implementation
    ids, mask = decoder_batch([7, 4], seed=3)
    own = _gemma4_logits(model, ids, mask)
    forward = DecompXAttribution(model, algorithm="forward", strict=True)
    auto = DecompXAttribution(model, strict=True)

    def run():
        for target in (5, 17):
            a = auto.decompose(ids, target=target, additional_forward_args=mask)
            _same(a, forward.decompose(ids, target=target, additional_forward_args=mask))
            assert float(_rel(_capped(a.scores.sum(-1) + a.bias_scores[:, 0]), own[:, target])) < 1e-10, name
            assert float(a.bias_scores.abs().max()) == 0.0  # no bias in Gemma 4, the branch is token-own

    check_model_unchanged(model, run, lambda: _gemma4_logits(model, ids, mask))
    assert model.config._attn_implementation == implementation


def test_gemma4_padded_equals_single_examples():
    model = build_gemma4(**GEMMA4["experts_shared_kv"])
    dx = DecompXAttribution(model, algorithm="adjoint", strict=True)
    ids, mask = decoder_batch([7, 4], seed=3)
    t = ids.shape[1]
    padded = dx.decompose(ids, target=5, additional_forward_args=mask)
    alone = dx.decompose(ids[1:, t - 4:], target=5)
    torch.testing.assert_close(padded.scores[1, t - 4:], alone.scores[0], rtol=0,
                               atol=1e-10 * float(alone.scores.abs().max()))
    assert float(padded.scores[1, :t - 4].abs().max()) == 0.0


@pytest.mark.parametrize("name", ["shared_kv", "experts_shared_kv"])
def test_gemma4_several_positions_in_one_walk_and_in_chunks(name, monkeypatch):
    model = build_gemma4(**GEMMA4[name])
    ids, _ = decoder_batch([8], seed=4)
    positions, target = torch.tensor([3, 5, 7]), torch.tensor([5, 9, 11])
    forward = DecompXAttribution(model, algorithm="forward").explain_positions(ids[0], positions, target)
    adjoint = DecompXAttribution(model, algorithm="adjoint").explain_positions(ids[0], positions, target)
    scale = float(forward.scores.abs().max())
    torch.testing.assert_close(adjoint.scores, forward.scores, rtol=0, atol=1e-12 * scale)
    torch.testing.assert_close(adjoint.no_token, forward.no_token, rtol=0, atol=1e-12 * scale)
    monkeypatch.setattr(adjoint_module, "STACK_BYTES", 1)  # one cotangent per transpose call
    chunked = DecompXAttribution(model, algorithm="adjoint").explain_positions(ids[0], positions, target)
    torch.testing.assert_close(chunked.scores, adjoint.scores, rtol=0, atol=1e-13 * scale)


def _gemma4_error(name: str) -> float:
    model = build_gemma4(**GEMMA4[name])
    ids, mask = decoder_batch([7, 4], seed=3)
    res = DecompXAttribution(model, algorithm="adjoint").decompose(ids, target=5, additional_forward_args=mask)
    return _rel(_capped(res.scores.sum(-1) + res.bias_scores[:, 0]), _gemma4_logits(model, ids, mask)[:, 5])


def test_gemma4_each_new_term_matters(monkeypatch):
    r"""Without the per-layer-input branch's own term, or without the cotangent of the shared values' source,
    the adjoint is not complete."""
    assert _gemma4_error("shared_kv") < 1e-10
    with monkeypatch.context() as m:
        m.setattr(SandwichPerLayerInputKind, "frozen_layer_own", lambda self, layer, rows=None: None)
        assert _gemma4_error("plain") > 1e-4
    real = SandwichPerLayerInputKind.frozen_layer_source_vjp

    def no_source(self, *args, **kwargs):
        g_x, g_s = real(self, *args, **kwargs)
        return g_x, torch.zeros_like(g_s)

    monkeypatch.setattr(SandwichPerLayerInputKind, "frozen_layer_source_vjp", no_source)
    assert _gemma4_error("no_per_layer_input") > 1e-4


def test_gemma4_input_cotangents_with_and_without_per_layer_inputs():
    ids, mask = decoder_batch([6, 4], seed=2)
    with pytest.raises(UnsupportedModelError, match="token-own"):
        DecompXAttribution(build_gemma4()).input_cotangents(ids, target=5, additional_forward_args=mask)
    cot = DecompXAttribution(build_gemma4(**GEMMA4["no_per_layer_input"])).input_cotangents(
        ids, target=5, additional_forward_args=mask)
    torch.testing.assert_close((cot.cotangent * cot.embeddings).sum(-1) * mask, cot.result.scores, rtol=0,
                               atol=1e-13 * float(cot.result.scores.abs().max()))


# --- Qwen3-VL (DeepStack) --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=sorted(QWEN3_VL))
def qwen3(request):
    return make_qwen3_vl(**QWEN3_VL[request.param])


def _qwen_logits(model, ids, mask, extra, position):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **extra).logits[:, position]


def test_qwen3_vl_adjoint_equals_forward_at_text_and_image_positions(qwen3):
    ids, mask, extra = qwen2_vl_batch([3, 6], seed=2)
    args = {"attention_mask": mask, **extra}
    t = torch.tensor([5, 9])
    image = torch.stack([(row == QWEN_IMAGE).nonzero()[-1, 0] for row in ids])  # each example's last image token
    for position in ("last", image):
        auto = DecompXAttribution(qwen3, explained_position=position, strict=True).decompose(ids, t, args)
        forward = DecompXAttribution(qwen3, explained_position=position, algorithm="forward").decompose(ids, t, args)
        _same(auto, forward)
        logits = _qwen_logits(qwen3, ids, mask, extra, slice(None))  # (B, T, V)
        at = torch.full_like(image, ids.shape[1] - 1) if isinstance(position, str) else position
        real = logits[[0, 1], at, t]
        assert _rel(auto.scores.sum(-1) + auto.bias_scores[:, 0], real) < 1e-10
        assert auto.scores[ids == QWEN_IMAGE].abs().sum() > 0 and (auto.scores[mask == 0] == 0).all()
        if not isinstance(position, str):  # tokens after the explained position get exactly 0
            assert float(auto.scores[1, int(image[1]) + 1:].abs().max()) == 0.0


def test_qwen3_vl_without_the_additions_is_not_complete(qwen3, monkeypatch):
    ids, mask, extra = qwen2_vl_batch([4], seed=5)
    pos = int((ids[0] == QWEN_IMAGE).nonzero()[-1])
    real = _qwen_logits(qwen3, ids, mask, extra, pos)[:, 7]

    def error():
        res = DecompXAttribution(qwen3, explained_position=pos, algorithm="adjoint").decompose(
            ids, torch.tensor([7]), {"attention_mask": mask, **extra})
        return _rel(res.scores.sum(-1) + res.bias_scores[:, 0], real)

    assert error() < 1e-10
    monkeypatch.setattr(LayerKind, "frozen_layer_own", lambda self, layer, rows=None: None)
    assert error() > 1e-4


def test_qwen3_vl_padded_equals_single_positions_refusal_and_model_unchanged(qwen3):
    ids, mask, extra = qwen2_vl_batch([5, 2], seed=3)
    t = torch.tensor([6, 9])
    attr = DecompXAttribution(qwen3, algorithm="adjoint")
    batch = attr.attribute(ids, target=t, additional_forward_args={"attention_mask": mask, **extra})
    for b in range(2):
        keep = mask[b].bool()
        alone = attr.attribute(ids[b:b + 1, keep], target=t[b:b + 1],
                               additional_forward_args={"attention_mask": mask[b:b + 1, keep],
                                                        **qwen2_5_vl_single(extra, b, keep)})
        assert _rel(batch[b, keep], alone[0]) < 1e-10
        assert (batch[b, ~keep] == 0).all()
    one = qwen2_vl_batch([6], seed=4)
    positions, target = torch.tensor([4, 7, one[0].shape[1] - 1]), torch.tensor([3, 5, 8])
    args = {"attention_mask": one[1], **one[2]}
    forward = DecompXAttribution(qwen3, algorithm="forward").explain_positions(
        one[0][0], positions, target, additional_forward_args=args)
    adjoint = attr.explain_positions(one[0][0], positions, target, additional_forward_args=args)
    torch.testing.assert_close(adjoint.scores, forward.scores, rtol=0, atol=1e-12 * float(forward.scores.abs().max()))
    with pytest.raises(UnsupportedModelError, match="token-own"):
        attr.input_cotangents(ids, target=t, additional_forward_args={"attention_mask": mask, **extra})
    check_model_unchanged(qwen3, lambda: attr.attribute(ids, target=t, additional_forward_args={
        "attention_mask": mask, **extra}), lambda: _qwen_logits(qwen3, ids, mask, extra, -1))
