r"""Model inputs by name (issue 36, item 5): ``additional_forward_args={"attention_mask": ..., "position_ids": ...,
"token_type_ids": ...}`` on every attribution class; positional extras that could be misread are refused."""
from __future__ import annotations

import warnings

import pytest
import torch

from captum_normattr import (
    ALTIAttribution,
    ALTILogitAttribution,
    DecompXAttribution,
    FFIntegratedDecomposition,
    GlobEncAttribution,
    ValueZeroingAttribution,
)
from captum_normattr.attr.routes import InformationFlowRoutes
from conftest import make_model, random_batch
from decoder_models import decoder_batch, make_decoder

CLASSES = {
    "globenc": lambda m: GlobEncAttribution(m),
    "alti": lambda m: ALTIAttribution(m),
    "ff": lambda m: FFIntegratedDecomposition(m),
    "decompx_adjoint": lambda m: DecompXAttribution(m, algorithm="adjoint"),
    "decompx_forward": lambda m: DecompXAttribution(m, algorithm="forward"),
    "alti_logit": lambda m: ALTILogitAttribution(m),
    "value_zeroing": lambda m: ValueZeroingAttribution(m),
}
SIGNED = ("decompx_adjoint", "decompx_forward", "alti_logit")


def _positions(mask: torch.Tensor) -> torch.Tensor:
    r"""Position ids unlike the default (counted from the first real token): a gap of 5 after the second token."""
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return pos + 5 * (pos >= 2)


def _attribute(attr, name, ids, extras, target):
    kw = {"target": target} if name in SIGNED else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return attr.attribute(ids, additional_forward_args=extras, **kw)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("name", sorted(CLASSES))
def test_position_ids_by_name_are_what_the_model_is_called_with(family, name):
    model = make_decoder(family)
    ids, mask = decoder_batch([7, 5], seed=6, t=7)
    pos = _positions(mask)
    attr = CLASSES[name](model)
    with torch.no_grad():
        default = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits
        moved = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    target = 7
    got = _attribute(attr, name, ids, {"attention_mask": mask, "position_ids": pos}, target)
    plain = _attribute(attr, name, ids, (mask,), target)
    # the default positions given by name change nothing
    same = _attribute(attr, name, ids, {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp_min(0)},
                      target)
    assert torch.allclose(same, plain, rtol=0, atol=1e-12 * float(plain.abs().max()))
    # other positions give other scores (the model's output moved by far more than rounding)
    assert float((moved - default)[:, -1].abs().max()) > 1e-3
    assert float((got - plain).abs().max()) > 1e-6 * float(plain.abs().max())
    if name in SIGNED:  # the decomposed logit is the model's own logit with those positions
        res = attr.decompose(ids, target=target, additional_forward_args={"attention_mask": mask, "position_ids": pos})
        real = moved[:, -1, target]
        scale = float(moved[:, -1].abs().max())
        assert torch.allclose(res.logits.reshape(-1), real,
                              rtol=0, atol=1e-9 * scale)
        assert float(res.delta.max()) <= 1e-9 * scale


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_routes_take_position_ids(family):
    model = make_decoder(family)
    ids, mask = decoder_batch([6], seed=2)
    routes = InformationFlowRoutes(model)
    plain = routes.attribute(ids, attention_mask=mask, threshold=0.0)
    moved = routes.attribute(ids, attention_mask=mask, threshold=0.0, position_ids=_positions(mask))
    same = routes.attribute(ids, attention_mask=mask, threshold=0.0, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
    w = lambda g: torch.tensor([e["importance"] for e in g.edges], dtype=torch.float64)
    assert torch.allclose(w(same), w(plain), rtol=0, atol=1e-12)
    assert w(moved).shape != w(plain).shape or not torch.allclose(w(moved), w(plain), rtol=0, atol=1e-9)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("name", ["globenc", "decompx_adjoint", "alti_logit"])
def test_a_second_positional_item_of_a_decoder_is_refused(family, name):
    model = make_decoder(family)
    ids, mask = decoder_batch([6, 4], seed=1)
    with pytest.raises(ValueError, match="position_ids"):
        _attribute(CLASSES[name](model), name, ids, (mask, _positions(mask)), 3)
    with pytest.raises(ValueError, match="additional_forward_args=\\{"):
        _attribute(CLASSES[name](model), name, ids, (mask, None, _positions(mask)), 3)


def test_token_types_positionally_on_bert_and_by_name_everywhere():
    model = make_model("bert")
    ids, mask = random_batch([6, 4], seed=3)
    types = (torch.arange(ids.shape[1]) >= 3).long().expand_as(ids)
    attr = GlobEncAttribution(model)
    positional = attr.attribute(ids, additional_forward_args=(mask, types))
    named = attr.attribute(ids, additional_forward_args={"attention_mask": mask, "token_type_ids": types})
    plain = attr.attribute(ids, additional_forward_args=(mask,))
    assert torch.equal(positional, named)
    assert float((named - plain).abs().max()) > 1e-6
    # a tokenizer's output (input_ids included) works as the mapping
    enc = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    assert torch.equal(attr.attribute(ids, additional_forward_args=enc), named)


def test_bad_mappings_are_refused():
    model = make_decoder("gpt2")
    ids, mask = decoder_batch([6, 4], seed=1)
    attr = GlobEncAttribution(model)
    with pytest.raises(ValueError, match="may name"):
        attr.attribute(ids, additional_forward_args={"attention_mask": mask, "positions": mask})
    with pytest.raises(ValueError, match="is not the inputs"):
        attr.attribute(ids, additional_forward_args={"input_ids": ids.flip(0), "attention_mask": mask})
    with pytest.raises(ValueError, match="position limit"):
        attr.attribute(ids, additional_forward_args={"attention_mask": mask, "position_ids": mask * 1000})
    with pytest.raises(ValueError, match="shape"):
        attr.attribute(ids, additional_forward_args={"position_ids": mask[:, 1:]})
    with pytest.raises(TypeError, match="integer"):
        attr.attribute(ids, additional_forward_args={"position_ids": mask.double()})
