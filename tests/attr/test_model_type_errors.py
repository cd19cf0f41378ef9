r"""A model name, a path, a tokenizer or None where a model belongs: every class says to load it, and how.

Every attribution class reaches :func:`captum_normattr.models.adapters.require_loaded_model`
(through ``get_adapter``, or the encoder-decoder adapter for ALTI+), so each one raises the same
``TypeError``: ``expected a loaded model (torch.nn.Module), got the string 'gpt2'; load it
first: AutoModelForCausalLM.from_pretrained('gpt2')``, the Auto class read from the
checkpoint's config.json where it is local. The LLM API also checks its tokenizer and a
model name given where the attribution belongs.
"""
import json
import re

import pytest
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
    InformationFlowRoutes,
    ValueZeroingAttribution,
)
from captum_normattr.models.adapters import require_loaded_model
from decoder_models import make_decoder
from llm_tiny import tiny_tokenizer

HEAD = "expected a loaded model (torch.nn.Module), got"


def _llm_by_name(model):
    return DecompositionLLMAttribution("alti-logit", tiny_tokenizer(), model=model)


#: every class that takes a model, and how it is built from one
BUILDERS = {
    "GlobEncAttribution": GlobEncAttribution,
    "ALTIAttribution": ALTIAttribution,
    "ALTILogitAttribution": ALTILogitAttribution,
    "ALTIPlusAttribution": ALTIPlusAttribution,
    "DecompXAttribution": DecompXAttribution,
    "FFIntegratedDecomposition": FFIntegratedDecomposition,
    "InformationFlowRoutes": InformationFlowRoutes,
    "ValueZeroingAttribution": ValueZeroingAttribution,
    "DecompositionLLMAttribution": _llm_by_name,
}


def test_every_exported_class_is_covered():
    exported = {n for n in captum_normattr.__all__ if isinstance(getattr(captum_normattr, n), type)
                and issubclass(getattr(captum_normattr, n), Attribution)}
    assert exported | {"InformationFlowRoutes"} == set(BUILDERS)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_a_model_name_says_to_load_it(name):
    given = "no-such-org/no-such-model-zz9"  # in no cache: the Auto class is the class's default
    with pytest.raises(TypeError) as info:
        BUILDERS[name](given)
    msg = str(info.value)
    assert msg.startswith(f"{HEAD} the string {given!r}; load it first: "), msg
    loader = {"ALTIPlusAttribution": "AutoModelForSeq2SeqLM"}.get(name, "AutoModelForCausalLM")
    assert f"{loader}.from_pretrained({given!r})" in msg


@pytest.mark.parametrize("name", list(BUILDERS))
def test_a_folder_names_the_auto_class_of_its_config(name, tmp_path):
    folder = tmp_path / "my-classifier"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["BertForSequenceClassification"],
                                                    "model_type": "bert"}))
    for given in (str(folder), folder):  # a string that is a folder, and a Path
        with pytest.raises(TypeError) as info:
            BUILDERS[name](given)
        msg = str(info.value)
        assert msg.startswith(f"{HEAD} the path {str(folder)!r}; load it first: "), msg
        assert f"AutoModelForSequenceClassification.from_pretrained({str(folder)!r})" in msg


@pytest.mark.parametrize("name", list(BUILDERS))
def test_a_tokenizer_or_none_where_the_model_belongs(name):
    if name == "DecompositionLLMAttribution":
        with pytest.raises(ValueError, match="pass model= as well"):  # by name, without a model
            BUILDERS[name](None)
    else:
        with pytest.raises(TypeError, match=f"^{re.escape(HEAD)} None; load a model first: "):
            BUILDERS[name](None)
    with pytest.raises(TypeError, match=f"^{re.escape(HEAD)} a tokenizer \\(\\w+\\); pass the model itself"):
        BUILDERS[name](tiny_tokenizer())


@pytest.mark.parametrize("config,loader", [
    ({"architectures": ["GPT2LMHeadModel"]}, "AutoModelForCausalLM"),
    ({"architectures": ["LlamaForCausalLM"]}, "AutoModelForCausalLM"),
    ({"architectures": ["MarianMTModel"], "is_encoder_decoder": True}, "AutoModelForSeq2SeqLM"),
    ({"architectures": ["BartForConditionalGeneration"], "is_encoder_decoder": True}, "AutoModelForSeq2SeqLM"),
    ({"architectures": ["ViTForImageClassification"]}, "AutoModelForImageClassification"),
    ({"architectures": ["BertModel"]}, "AutoModel.from_pretrained("),  # a base model
    ({"model_type": "bert"}, "AutoModelForCausalLM.from_pretrained("),  # no architecture: the usual Auto classes

])
def test_the_auto_class_follows_the_config(tmp_path, config, loader):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(TypeError) as info:
        require_loaded_model(str(tmp_path))
    msg = str(info.value)
    assert loader in msg
    assert ("AutoModelForSeq2SeqLM for an encoder-decoder" in msg) == ("architectures" not in config), msg


def test_a_loaded_model_passes():
    require_loaded_model(make_decoder("gpt2"))


def test_the_llm_api_checks_its_tokenizer_and_a_model_name_as_the_method():
    model = make_decoder("gpt2")
    with pytest.raises(TypeError, match="expected a loaded tokenizer, got the string 'gpt2'; load it first: "
                                        "AutoTokenizer.from_pretrained\\('gpt2'\\)"):
        DecompositionLLMAttribution(ALTILogitAttribution(model), "gpt2")
    with pytest.raises(TypeError, match="expected a tokenizer, got the model GPT2LMHeadModel"):
        DecompositionLLMAttribution(ALTILogitAttribution(model), model)
    with pytest.raises(TypeError, match="got None"):
        DecompositionLLMAttribution(ALTILogitAttribution(model), None)
    with pytest.raises(TypeError, match="got the string 'gpt2'; for a model, load it first: model = "
                                        "AutoModelForCausalLM.from_pretrained\\('gpt2'\\)"):
        DecompositionLLMAttribution("gpt2", tiny_tokenizer())
    with pytest.raises(TypeError, match="got the model GPT2LMHeadModel; wrap it in a method"):
        DecompositionLLMAttribution(model, tiny_tokenizer())
    assert DecompositionLLMAttribution("alti-logit", tiny_tokenizer(), model=model).get_name() == "ALTI-Logit (LLM)"
