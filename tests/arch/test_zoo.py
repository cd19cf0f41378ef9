r"""Every registered text family, every applicable method, on the tiny zoo (tests/zoo.py).

Parametrised over the architecture registry, so a new family gets these invariants: token
scores plus the no-token terms equal the model's own output logit (from a plain forward pass,
not from recorded tensors); padded batches equal single examples; the model is unchanged.
"""
import copy

import pytest
import torch

from captum_normattr import (
    ALTIAttribution,
    ALTILogitAttribution,
    DecompXAttribution,
    FFIntegratedDecomposition,
    GlobEncAttribution,
    UnsupportedModelError,
)
from captum_normattr.arch import ARCHITECTURES
from captum_normattr.decompose.kinds.registry import LAYER_KINDS
from decoder_models import decoder_batch
from zoo import BUILDERS, build
from zoo import real_next_token_logits  # noqa: F401

TEXT = [k for k, s in ARCHITECTURES.items() if s.modality == "text"]
DECODERS = [k for k in TEXT if ARCHITECTURES[k].causal]
#: families whose topology kind does not decompose a method yet: refused, never decomposed as another kind
METHODS = {"globenc": "maps", "alti": "alti", "ff": "ff", "decompx": "decompx", "alti_logit": "alti_logit"}


def _implemented(key: str, method: str) -> bool:
    kind = LAYER_KINDS.get(ARCHITECTURES[key].topology)
    return kind is not None and METHODS[method] in kind.methods


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))




def softcap(model):
    r"""The final-logit soft-cap of the family's description (None: none): the scores explain the pre-cap logit."""
    name = ARCHITECTURES[model.config.model_type].head.final_softcap
    return getattr(model.config, name, None) if name else None


def capped(x, cap):
    return x if cap is None else cap * torch.tanh(x / cap)


def test_every_registered_text_family_has_a_zoo_builder():
    assert set(TEXT) <= set(BUILDERS), sorted(set(TEXT) - set(BUILDERS))


@pytest.mark.parametrize("key", DECODERS)
def test_alti_logit_sums_to_the_models_logit(key):
    model = build(key, "lm")
    ids, mask = decoder_batch([6, 4], seed=1)
    if not _implemented(key, "alti_logit"):
        with pytest.raises(UnsupportedModelError, match="not implemented|no layer kind"):
            ALTILogitAttribution(model)
        return
    state = copy.deepcopy(model.state_dict())
    logits = real_next_token_logits(model, ids, mask)
    target = logits.argmax(-1)
    res = ALTILogitAttribution(model).decompose(ids, target=target, additional_forward_args=(mask,))
    expect = logits.gather(1, target[:, None])[:, 0]
    total = res.scores.sum(-1) + res.no_token_total
    cap = softcap(model)  # Gemma 2: the explained logit is the pre-cap one, cap(pre) is the model's output
    assert _rel(capped(res.logit, cap), expect) < 1e-6  # the explained logit is the model's own
    assert _rel(capped(total, cap), expect) < 1e-9 and float(res.delta.max()) < 1e-9 * float(res.logit.abs().max())
    if cap is not None:
        assert res.extras["explained_logit"] == "pre-cap logit"
        assert _rel(res.extras["capped_logit"], expect) < 1e-9
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("key", DECODERS)
def test_decompx_sums_to_the_models_logit_and_padding(key):
    model = build(key, "lm")
    ids, mask = decoder_batch([6, 4], seed=2)
    if not _implemented(key, "decompx"):
        with pytest.raises(UnsupportedModelError, match="not implemented|no layer kind"):
            DecompXAttribution(model)
        return
    logits = real_next_token_logits(model, ids, mask)
    dx = DecompXAttribution(model)
    res = dx.decompose(ids, target=5, additional_forward_args=mask)
    expect = logits[:, 5]
    cap = softcap(model)  # Gemma 2: the scores explain the pre-cap logit
    assert _rel(capped(res.class_scores.sum(1) + res.bias_scores, cap), expect[:, None]) < 1e-9
    if cap is not None:
        assert res.extras["explained_logit"] == "pre-cap logit"
        assert _rel(res.extras["capped_logit"], expect) < 1e-9
    t = ids.shape[1]
    alone = dx.decompose(ids[1:, t - 4:], target=5)
    torch.testing.assert_close(res.scores[1, t - 4:], alone.scores[0], rtol=0, atol=1e-9 * float(res.scores.abs().max()))


@pytest.mark.parametrize("method", ["globenc", "alti", "ff"])
@pytest.mark.parametrize("key", TEXT)
def test_maps_complete_and_padding(key, method):
    spec = ARCHITECTURES[key]
    model = build(key, "lm" if spec.causal else "cls")
    cls = {"globenc": GlobEncAttribution, "alti": ALTIAttribution, "ff": FFIntegratedDecomposition}[method]
    if not _implemented(key, method):
        with pytest.raises(UnsupportedModelError, match="not implemented|no layer kind"):
            cls(model)
        return
    ids, mask = decoder_batch([6, 4], seed=3, left=spec.causal)
    attr = cls(model, strict=True)
    res = attr.decompose(ids, additional_forward_args=(mask,))
    err = res.extras.get("completeness_error")
    if err is not None:
        assert float(err.max()) < 1e-9 * max(1.0, float(res.layer_maps.abs().max()))
    if method == "alti":
        rows = res.layer_maps.sum(-1)[mask.bool()[:, None].expand(-1, rows_dim(res), -1)]
        torch.testing.assert_close(rows, torch.ones_like(rows), rtol=0, atol=1e-9)
    t = ids.shape[1]
    sl = slice(t - 4, t) if spec.causal else slice(0, 4)
    alone = attr.decompose(ids[1:, sl])
    torch.testing.assert_close(res.scores[1, sl], alone.scores[0], rtol=0, atol=1e-9 * float(res.scores.abs().max()))


def rows_dim(res) -> int:
    return res.layer_maps.shape[1]
