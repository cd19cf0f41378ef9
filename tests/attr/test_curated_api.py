r"""The curated API: every exported Attribution class names itself, and the methods explain themselves.

``Cls.get_name()`` (Captum's classmethod form) is the class's readable method name, never the
class name split at its capitals; an instance's name is the one its results carry. Every
registry entry whose class has an ``explain_positions`` hook is an LLM method
(:attr:`~captum_normattr.attr.methods.MethodSpec.llm`), and the LLM API asks the class.
"""
import pytest
import torch
from captum.attr import Attribution

import captum_normattr
from captum_normattr import (
    ALTIAttribution,
    ALTILogitAttribution,
    ALTIPlusAttribution,
    DecompositionLLMAttribution,
    DecompXAttribution,
    FFIntegratedDecomposition,
    GlobEncAttribution,
)
from captum_normattr.attr import llm as llm_module
from captum_normattr.attr.methods import METHODS, get_method
from captum_normattr.attr.positions import PositionExplanation
from decoder_models import make_decoder
from llm_tiny import tiny_tokenizer
from seq2seq_models import make_model as make_seq2seq
from seq2seq_models import pair

EXPORTED = sorted(
    (name for name in captum_normattr.__all__
     if isinstance(getattr(captum_normattr, name), type) and issubclass(getattr(captum_normattr, name), Attribution)),
)

#: the readable name of every exported class, and of an instance with its default options (decoder models)
NAMES = {
    "ValueZeroingAttribution": ("Value Zeroing", "Value Zeroing"),
    "ALTIAttribution": ("ALTI", "ALTI"),
    "ALTILogitAttribution": ("ALTI-Logit", "ALTI-Logit"),
    "ALTIPlusAttribution": ("ALTI+", "ALTI+"),
    "DecompXAttribution": ("DecompX", "DecompX"),
    "DecompositionLLMAttribution": ("LLM attribution", "ALTI-Logit (LLM)"),
    "FFIntegratedDecomposition": ("GlobEnc+FF", None),  # the instance's: its default scope's name
    "GlobEncAttribution": ("GlobEnc", "GlobEnc (N_RESLN)"),
}


@pytest.fixture(scope="module")
def gpt2():
    return make_decoder("gpt2", layers=2, seed=1)


def _instance(name, gpt2):
    if name == "ALTIPlusAttribution":
        return ALTIPlusAttribution(make_seq2seq("bart"))
    if name == "DecompositionLLMAttribution":
        return DecompositionLLMAttribution(ALTILogitAttribution(gpt2), tiny_tokenizer())
    return getattr(captum_normattr, name)(gpt2)


def test_every_exported_attribution_class_is_named():
    assert sorted(NAMES) == EXPORTED  # a new exported class is named here too


@pytest.mark.parametrize("name", EXPORTED)
def test_get_name_is_the_methods_name(name, gpt2):
    cls = getattr(captum_normattr, name)
    class_name, instance_name = NAMES[name]
    assert cls.get_name() == class_name  # not Captum's default, the class name split at its capitals
    got = _instance(name, gpt2).get_name()
    assert got == (class_name if instance_name is None else instance_name) or instance_name is None and got


def test_alti_plus_results_carry_its_name():
    src, tgt = pair()
    assert ALTIPlusAttribution(make_seq2seq("bart")).decompose((src, tgt)).method == "ALTI+"


def test_the_llm_methods_are_those_with_the_hook():
    assert {k for k, spec in METHODS.items() if spec.llm} == {"globenc", "alti", "ff", "decompx", "alti-logit"}
    assert not get_method("alti-plus").llm
    for cls in (ALTIAttribution, ALTILogitAttribution, DecompXAttribution, FFIntegratedDecomposition,
                GlobEncAttribution):
        assert callable(getattr(cls, "explain_positions", None))
    assert not hasattr(ALTIPlusAttribution, "explain_positions")


def test_the_llm_api_asks_the_class(gpt2, monkeypatch):
    r"""No per-method code in attr/llm.py: a class's own hook answers, whatever the class."""
    attr = ALTIAttribution(gpt2)
    calls = []
    real = ALTIAttribution.explain_positions

    def spy(self, *args, **kwargs):
        calls.append(type(self).__name__)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ALTIAttribution, "explain_positions", spy)
    ids = torch.arange(3, 10)
    ex = llm_module.explain_positions(attr, ids, torch.tensor([2, 5]))
    assert calls == ["ALTIAttribution"] and isinstance(ex, PositionExplanation) and ex.scores.shape == (2, 7)
    for forbidden in ("isinstance(attribution, ALTILogitAttribution)", "_explain_alti_logit", "_explain_decompx",
                      "_explain_rollout", "LayerMapStore", "streamed_forward"):
        assert forbidden not in open(llm_module.__file__, encoding="utf-8").read()


def test_unsupported_attributions_are_refused():
    with pytest.raises(TypeError, match="explain_positions"):
        llm_module.explain_positions(object(), torch.arange(4), torch.tensor([1]))
    with pytest.raises(TypeError, match="ALTILogitAttribution"):
        DecompositionLLMAttribution(ALTIPlusAttribution(make_seq2seq("bart")), tiny_tokenizer())


def test_a_classifiers_decompx_is_not_an_llm_method():
    from conftest import make_model

    dx = DecompXAttribution(make_model("bert"))
    assert not dx.explains_next_tokens
    with pytest.raises(ValueError, match="causal LMs"):
        DecompositionLLMAttribution(dx, tiny_tokenizer())
    with pytest.raises(ValueError, match="classifier"):
        dx.explain_positions(torch.arange(3, 8), torch.tensor([2]), torch.tensor([4]))


def test_alti_logit_looks_its_adapter_up_once(gpt2, monkeypatch):
    r"""One adapter lookup per construction, one check of the model (an additive next-token logit)."""
    from captum_normattr.attr import base, explained_output

    lookups, checks = [], []
    real_lookup, real_check = base.get_adapter, explained_output.check_additive_next_token_logit
    monkeypatch.setattr(base, "get_adapter", lambda m: lookups.append(1) or real_lookup(m))
    monkeypatch.setattr("captum_normattr.attr.alti_logit.check_additive_next_token_logit",
                        lambda a, m: checks.append(m) or real_check(a, m))
    ALTILogitAttribution(gpt2)
    assert lookups == [1] and checks == ["ALTILogitAttribution"]


def test_explained_output_asks_the_layer_kind():
    import inspect

    from captum_normattr.attr import explained_output

    assert ".pre_ln" not in inspect.getsource(explained_output)
