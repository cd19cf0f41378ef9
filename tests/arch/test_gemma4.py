r"""Gemma 4 (text): refused with every mechanism named, and no registered description verifies for it.

docs/frontier.md, "Gemma 4": what its layers add (per-layer inputs, the layer scalar, shared
keys and values, value norms) and why no layer kind decomposes them yet. These tests keep the
refusal honest: a tiny float64 build is refused by every method, the nearest description (Gemma 3)
is shown to differ by :func:`~captum_normattr.infer_architecture`, and registering it by hand
raises instead of returning numbers.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma4TextConfig"):  # pragma: no cover - older transformers
    pytest.skip("transformers has no Gemma 4", allow_module_level=True)

from transformers import Gemma4ForCausalLM, Gemma4TextConfig, Gemma4TextModel  # noqa: E402

from captum_normattr import (  # noqa: E402
    ALTIAttribution, ALTILogitAttribution, DecompXAttribution, GlobEncAttribution, UnsupportedModelError,
    infer_architecture,
)
from captum_normattr.arch import ARCHITECTURES  # noqa: E402
from captum_normattr.arch.registry import refusal  # noqa: E402


def _tiny(cls=Gemma4ForCausalLM, **overrides):
    config = dict(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, global_head_dim=8, max_position_embeddings=64,
                  layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4,
                  hidden_size_per_layer_input=4, vocab_size_per_layer_input=40, num_kv_shared_layers=2)
    config.update(overrides)
    torch.manual_seed(0)
    model = cls(Gemma4TextConfig(**config)).double().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norm gains away from 1, so that a 1 + w gain reads differently from w
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


@pytest.mark.parametrize("method", [GlobEncAttribution, ALTIAttribution, DecompXAttribution, ALTILogitAttribution])
def test_every_method_refuses_gemma4_text_naming_its_mechanisms(method):
    model = _tiny()
    with pytest.raises(UnsupportedModelError) as err:
        method(model)
    text = str(err.value)
    for mechanism in ("per-layer inputs", "layer_scalar", "num_kv_shared_layers", "v_norm", "attention_k_eq_v",
                      "enable_moe_block", "infer_architecture(model)"):
        assert mechanism in text, mechanism


def test_the_bare_model_is_refused_too():
    with pytest.raises(UnsupportedModelError, match="Gemma 4 \\(gemma4_text\\) is not supported: per-layer inputs"):
        GlobEncAttribution(_tiny(Gemma4TextModel))


def test_the_multimodal_type_names_its_tower_and_the_text_model():
    why = refusal("gemma4")
    assert "vision" in why and "gemma4_text" in why and "per-layer inputs" in why


def test_the_per_layer_input_is_a_function_of_the_token_alone():
    r"""The third branch multiplies act(h W_gate) by a per-layer input that depends on the token only
    (its id and its own embedding, never another position): the same token at two positions, in two
    contexts, gets the same per-layer input (what docs/frontier.md's attribution of it to its own token
    rests on)."""
    model = _tiny()
    ids = torch.tensor([[5, 9, 7, 5], [11, 5, 3, 2]])
    base = model.model
    embeds = base.embed_tokens(ids)
    per_layer = base.project_per_layer_inputs(embeds, base.get_per_layer_inputs(ids, embeds))
    assert per_layer.shape[:3] == (2, 4, model.config.num_hidden_layers)
    for (b1, t1), (b2, t2) in [((0, 0), (0, 3)), ((0, 0), (1, 1))]:
        torch.testing.assert_close(per_layer[b1, t1], per_layer[b2, t2], rtol=1e-12, atol=0)
    assert (per_layer[0, 0] - per_layer[0, 1]).abs().max() > 1e-3  # another token, another input


def test_no_registered_description_verifies_even_without_the_new_branches():
    model = _tiny(hidden_size_per_layer_input=0, num_kv_shared_layers=0)
    before = dict(ARCHITECTURES)
    found = infer_architecture(model, candidates=["gemma3_text", "olmo2", "llama"])
    assert found.verified is None and dict(ARCHITECTURES) == before
    (gemma3,) = [p for p in found.proposals if p.key == "gemma3_text"]
    assert any("norm rebuilt from its input" in d for d in gemma3.differs)  # w, not 1 + w
    assert gemma3.max_relative_error > 1e-2


def test_gemma3s_description_registered_by_hand_raises_instead_of_returning_numbers():
    import dataclasses

    from registry_state import described_as

    from captum_normattr.models.guard import ConsistencyError

    model = _tiny(hidden_size_per_layer_input=0, num_kv_shared_layers=0)
    ids = torch.randint(3, 40, (1, 6), generator=torch.Generator().manual_seed(2))
    with described_as("gemma4_text", dataclasses.replace(ARCHITECTURES["gemma3_text"], model_types=("gemma4_text",))):
        with pytest.raises(ConsistencyError):
            ALTILogitAttribution(model).attribute(ids, target=3)
