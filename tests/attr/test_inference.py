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
