r"""Verified inference of a description for a model the registry does not know (docs/architectures.md,
"Does my model work?")."""
import pytest
from decoder_models import make_decoder
from zoo import build

from captum_normattr.arch import ARCHITECTURES
from captum_normattr.attr.inference import infer_architecture, structural_candidates


def _registry_snapshot():
    return {k: id(v) for k, v in ARCHITECTURES.items()}


def test_an_unknown_llama_clone_is_verified_as_llama_and_nothing_is_registered():
    model = make_decoder("llama")
    model.config.model_type = "my_llama_clone"
    before = _registry_snapshot()
    found = infer_architecture(model)
    assert _registry_snapshot() == before  # never applied silently
    assert found.registered is None and found.verified is not None
    assert found.verified.key == "llama" and found.verified.max_relative_error <= found.tolerance
    assert "model_types=('my_llama_clone',)" in found.verified.register_line
    assert "VERIFIED" in str(found) and "register_architecture" in str(found)


def test_a_description_with_another_norm_is_refused_with_the_part_that_differs():
    model = build("gemma")  # RMSNorm with a (1 + w) gain
    found = infer_architecture(model, candidates=["llama", "gemma"])
    assert found.verified.key == "gemma"
    (llama,) = [p for p in found.proposals if p.key == "llama"]
    assert not llama.verified
    assert any("norm rebuilt from its input" in d for d in llama.differs)
    assert llama.max_relative_error > 1e-2  # a gross difference: the guard refuses it


def test_structural_candidates_need_the_parts():
    gpt2 = make_decoder("gpt2")
    assert "llama" not in structural_candidates(gpt2)  # no self_attn.o_proj, no mlp.gate_proj
    assert "gpt2" in structural_candidates(gpt2)


def test_a_failing_proposal_is_reported_not_raised():
    model = make_decoder("llama")
    found = infer_architecture(model, candidates=["granite"])  # Granite reads a config multiplier Llama lacks
    (p,) = found.proposals
    assert not p.verified and "residual_multiplier" in p.differs[0]
    assert found.verified is None


def test_a_string_is_refused():
    with pytest.raises(TypeError, match="loaded model"):
        infer_architecture("HuggingFaceTB/SmolLM2-135M")


def _clone_model():
    r"""A Llama under a model type the registry does not know (a config subclass, as a user's fork would have)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from captum_normattr.models.unregistered import VERIFIED_PROPOSALS

    class MyCloneConfig(LlamaConfig):
        model_type = "my_clone_for_the_error"

    VERIFIED_PROPOSALS.pop(MyCloneConfig.model_type, None)
    torch.manual_seed(0)
    config = MyCloneConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return LlamaForCausalLM(config).double().eval()


def test_the_error_for_an_unregistered_type_names_the_proposals_and_the_verification():
    from captum_normattr import ALTIAttribution, UnsupportedModelError

    model = _clone_model()
    before = _registry_snapshot()
    with pytest.raises(UnsupportedModelError) as err:
        ALTIAttribution(model)
    text = str(err.value)
    assert "'my_clone_for_the_error'" in text and "not verified" in text and "'llama'" in text
    assert "infer_architecture(model)" in text and "not run here" in text
    assert ("register_architecture(dataclasses.replace(ARCHITECTURES['llama'], "
            "model_types=('my_clone_for_the_error',)), key='my_clone_for_the_error')") in text
    assert "'gpt2'" not in text.split("Supported families")[0]  # only descriptions with the model's parts
    assert _registry_snapshot() == before


def test_after_verification_the_error_names_the_verified_description_and_its_line_which_works():
    import dataclasses

    import torch
    from registry_state import restored_registry

    from captum_normattr import ALTIAttribution, UnsupportedModelError
    from captum_normattr.arch import register_architecture

    model = _clone_model()
    found = infer_architecture(model, candidates=["gemma", "llama"])
    assert found.verified.key == "llama"
    with pytest.raises(UnsupportedModelError, match="verified the registered description 'llama'") as err:
        ALTIAttribution(model)  # still refused: a verified proposal is never applied silently
    line = str(err.value).split("register it with\n")[1].splitlines()[1].strip()
    assert line == found.verified.register_line
    with restored_registry():
        exec(line, {"dataclasses": dataclasses, "ARCHITECTURES": ARCHITECTURES,
                    "register_architecture": register_architecture})
        ids = torch.randint(3, 40, (1, 6), generator=torch.Generator().manual_seed(1))
        res = ALTIAttribution(model).decompose(ids)
        assert float(res.extras["completeness_error"].abs().max()) < 1e-5  # the model's float32 RMSNorm floor
    assert "my_clone_for_the_error" not in ARCHITECTURES


def test_the_error_without_any_matching_description_says_so():
    from torch import nn

    from captum_normattr.models.adapters import get_adapter
    from captum_normattr.arch.spec import UnsupportedModelError

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"model_type": "odd_thing"})()
            self.lin = nn.Linear(2, 2)

    with pytest.raises(UnsupportedModelError, match="No registered description has its parts"):
        get_adapter(Odd())
