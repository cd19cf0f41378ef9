r"""One Captum-shaped API for every registered method class (``captum_normattr.attr.methods.METHODS``).

For each class and each model family it applies to: ``decompose`` and ``attribute`` take
``(inputs, target=None, additional_forward_args=None, ...)`` in that order;
``attribute(..., return_convergence_delta=True)`` returns ``(attributions, delta)`` with a (B,)
delta equal to ``decompose(...).delta``; an attention mask passed positionally (where
``target`` now is) raises a ValueError pointing to ``additional_forward_args=``; and
``get_name`` keeps Captum's classmethod form.
"""
import inspect

import pytest
import torch
from captum.attr import Attribution

from captum_normattr.attr.methods import METHODS

CLASS_SPECS = [s for s in METHODS.values() if s.cls is not None]
CASES = [(s.key, group) for s in CLASS_SPECS for group in s.model_groups]


def _case(group):
    r"""(model, inputs, additional_forward_args, a target the method's model accepts) of a tiny float64 model."""
    if group == "encoders":
        from conftest import make_model, random_batch

        ids, mask = random_batch([6, 4], seed=3)
        return make_model("bert"), ids, (mask,), 1
    if group == "decoders":
        from decoder_models import decoder_batch, make_decoder

        ids, mask = decoder_batch([6, 4], seed=3)
        return make_decoder("gpt2"), ids, (mask,), 5
    from seq2seq_models import make_model as model_for, pair

    src, tgt = pair(seed=3)
    sm, tm = torch.ones_like(src), torch.ones_like(tgt)
    sm[1, -2:] = 0
    return model_for("marian"), (src, tgt), (sm, tm), 3


def _captum_params(fn):
    return list(inspect.signature(fn).parameters)[1:4]


@pytest.mark.parametrize("key", [s.key for s in CLASS_SPECS])
def test_signature_order_and_get_name(key):
    cls = METHODS[key].cls
    assert issubclass(cls, Attribution)
    assert _captum_params(cls.decompose) == ["inputs", "target", "additional_forward_args"], key
    params = inspect.signature(cls.attribute).parameters
    assert list(params)[1:5] == ["inputs", "target", "additional_forward_args", "return_convergence_delta"], key
    for name in ("target", "additional_forward_args"):
        assert inspect.signature(cls.decompose).parameters[name].default is None
        assert params[name].default is None
    assert params["return_convergence_delta"].default is False
    # Captum's get_name is a classmethod: it works on the class as on an instance
    assert isinstance(cls.get_name(), str) and cls.get_name()
    assert hasattr(cls.attribute, "__wrapped__")  # captum.log.log_usage


@pytest.mark.parametrize("key,group", CASES)
def test_convergence_delta_and_positional_mask(key, group):
    spec = METHODS[key]
    model, inputs, extra, target = _case(group)
    attr = spec.build(model)
    assert attr.get_name().startswith(type(attr).get_name().split(" ")[0])
    tgt = target if attr.uses_target else None  # ALTI+: the explained decoder position
    b = (inputs[0] if isinstance(inputs, tuple) else inputs).shape[0]

    res = attr.decompose(inputs, tgt, extra)  # Captum's positional order
    out, delta = attr.attribute(inputs, tgt, extra, return_convergence_delta=True)
    plain = attr.attribute(inputs, target=tgt, additional_forward_args=extra)
    assert attr.has_convergence_delta()
    assert isinstance(delta, torch.Tensor) and delta.shape == (b,) and bool((delta >= 0).all())
    torch.testing.assert_close(delta, res.delta, rtol=1e-9, atol=0)
    scale = max(1.0, float(res.scores.abs().max()))
    assert float(delta.max()) < 1e-8 * scale, (key, group, delta)  # float64: exact decompositions
    first = out[0] if isinstance(out, tuple) else out
    assert first.shape == res.scores.shape == (b, res.attention_mask.shape[1])
    if isinstance(plain, tuple):
        assert all(torch.equal(p, o) for p, o in zip(plain, out))
    else:
        assert torch.equal(plain, out)

    # the mask where target now is: a ValueError naming additional_forward_args, never a silent target
    for wrong in (extra, extra[0], list(extra)):
        with pytest.raises(ValueError, match="additional_forward_args="):
            attr.decompose(inputs, wrong)
        with pytest.raises(ValueError, match="additional_forward_args="):
            attr.attribute(inputs, wrong)
    if not attr.uses_target:  # class-agnostic maps: a target would be ignored, so it is refused
        with pytest.raises(ValueError, match="do not depend on the target"):
            attr.decompose(inputs, target=1, additional_forward_args=extra)
        with pytest.raises(ValueError, match="do not depend on the target"):
            attr.attribute(inputs, target=1, additional_forward_args=extra, return_convergence_delta=True)


def test_the_delta_of_the_maps_sees_a_wrong_decomposition():
    r"""GlobEnc's and ALTI's delta is the layer kind's attention-block completeness error against the
    model's real tensors: a kind that does not match the layers (the pre-LN parts read from a
    post-LN layer, which do not sum to its real LN2 input) shows in it, and the guard refuses it."""
    from conftest import make_model, random_batch

    from captum_normattr import ALTIAttribution, ConsistencyError, GlobEncAttribution
    from captum_normattr.decompose.kinds.registry import PreLNKind

    ids, mask = random_batch([6, 4], seed=3)
    model = make_model("bert")
    for cls in (GlobEncAttribution, ALTIAttribution):
        attr = cls(model)
        good = attr.attribute(ids, additional_forward_args=(mask,), return_convergence_delta=True)[1]
        assert float(good.max()) < 1e-10

        class WrongKind(type(attr.kind)):
            def example_completeness_error(self, layer, valid):
                return PreLNKind().example_completeness_error(layer, valid)

        attr.kind = WrongKind()
        # a gross difference (0.6 relative): refused by default, not returned with a warning
        with pytest.raises(ConsistencyError, match="completeness of the attention block"):
            attr.attribute(ids, additional_forward_args=(mask,), return_convergence_delta=True)
