r"""Gemma 4 (text): the standalone exact decomposition of its layers.

The decomposition (:mod:`captum_normattr.decompose.kinds.per_layer_input`, docs/frontier.md,
"Gemma 4") is checked against the model's own tensors in float64: token scores sum to the
model's own logit, padded == single, the model is left unchanged, the per-layer-input branch
matches a naive reference and goes to its own token, shared keys/values and keys-as-values stay
exact, the expert block beside the dense MLP too, and an attention bias and soft-capping are refused. Gemma4RMSNorm computes in float32 whatever the input
dtype; the exactness tests give the float64 build a float64 norm forward (``float64_norms``).

The attribution classes read Gemma 4 through its own layer kind (tests/arch/test_gemma4_classes.py);
here, the nearest older description (Gemma 3) is shown to differ by
:func:`~captum_normattr.infer_architecture`, and registering it by hand for Gemma 4 raises instead of
returning numbers, and the multimodal ``gemma4`` stays refused with a pointer to its text model.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma4TextConfig"):  # pragma: no cover - older transformers
    pytest.skip("transformers has no Gemma 4", allow_module_level=True)

from transformers import Gemma4ForCausalLM, Gemma4TextConfig  # noqa: E402

from captum_normattr import ALTILogitAttribution, UnsupportedModelError, infer_architecture  # noqa: E402
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


def test_the_multimodal_type_is_a_vision_language_model_not_a_refusal():
    from captum_normattr.arch.registry import VISION_LANGUAGE

    assert refusal("gemma4") is None  # Gemma4ForConditionalGeneration: tests/attr/test_vlm_gemma4.py
    assert VISION_LANGUAGE["gemma4"].family == "Gemma 4" and "gemma4_text" in VISION_LANGUAGE["gemma4"].text_families


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


# --- the exact decomposition -------------------------------------------------------------------
from captum_normattr.decompose.kinds.per_layer_input import (  # noqa: E402
    gemma4_logit_scores, gemma4_token_parts, per_layer_input_branch,
)


@pytest.fixture
def float64_norms(monkeypatch):
    r"""Gemma4RMSNorm in the input's dtype (its own forward casts to float32, even in a float64 model)."""
    from transformers.models.gemma4 import modeling_gemma4

    def forward(self, h):
        out = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon, -0.5)
        return out * self.weight if self.with_scale else out

    monkeypatch.setattr(modeling_gemma4.Gemma4RMSNorm, "forward", forward)


def _exact(**overrides):
    model = _tiny(final_logit_softcapping=None, **overrides)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # a layer scalar away from 1 on every layer
        for layer in model.model.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=g, dtype=torch.float64))
    return model


def _ids(b=2, t=7, seed=3):
    return torch.randint(3, 40, (b, t), generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return float(((a - b).abs() / b.abs().clamp_min(1e-300)).max())


CONFIGS = {
    "plain": dict(num_kv_shared_layers=0),
    "shared_kv": dict(num_kv_shared_layers=2),
    "k_eq_v": dict(num_kv_shared_layers=0, attention_k_eq_v=True),
    "shared_kv_k_eq_v": dict(num_kv_shared_layers=2, attention_k_eq_v=True),
    "global_head_dim": dict(num_kv_shared_layers=0, global_head_dim=12),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_token_scores_sum_to_the_models_own_logit(name, float64_norms):
    model = _exact(**CONFIGS[name])
    ids = _ids()
    for target in (5, 17):
        scores, logit = gemma4_logit_scores(model, ids, target)
        with torch.no_grad():
            own = model(ids).logits[:, -1, target]
        assert _rel(logit, own) < 1e-12
        assert _rel(scores.sum(1), own) < 1e-10, name


def test_parts_sum_to_every_layers_real_output(float64_norms):
    model = _exact(num_kv_shared_layers=2)
    parts, real, rebuilt = gemma4_token_parts(model, _ids())
    assert rebuilt < 1e-12  # the frozen step's real tensors are the model's own, layer by layer
    assert float((parts.sum(2) - real).abs().max() / real.abs().max()) < 1e-13
    causal = torch.triu(torch.ones(7, 7, dtype=torch.bool), 1)
    assert float(parts[:, causal].abs().max()) == 0.0  # no part of a later token
    bare, bare_real, _ = gemma4_token_parts(model.model, _ids())  # the bare Gemma4TextModel reads the same
    assert torch.equal(bare, parts) and torch.equal(bare_real, real)


def test_padded_equals_single(float64_norms):
    model = _exact(num_kv_shared_layers=2)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    scores, logit = gemma4_logit_scores(model, ids, 5, mask)
    for b, start in ((0, 0), (1, 3)):
        single, single_logit = gemma4_logit_scores(model, ids[b:b + 1, start:], 5)
        torch.testing.assert_close(scores[b, start:], single[0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(logit[b], single_logit[0], rtol=1e-12, atol=0)
    assert float(scores[1, :3].abs().max()) == 0.0


def test_the_model_is_left_unchanged(float64_norms):
    model = _exact(num_kv_shared_layers=2)
    ids = _ids()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    implementation = model.config._attn_implementation
    with torch.no_grad():
        before = model(ids).logits
    gemma4_logit_scores(model, ids, 5)
    with pytest.raises(KeyError):  # an error half-way (the model's own: no stored values) restores the model too
        _raise_midway(model, ids)
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(before, after) and model.config._attn_implementation == implementation
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks


def _raise_midway(model, ids):
    r"""A shared layer whose source never stored its values: refused inside the recording."""
    saved = [layer.self_attn.store_full_length_kv for layer in model.model.layers]
    try:
        for layer in model.model.layers:
            layer.self_attn.store_full_length_kv = False
        gemma4_token_parts(model, ids)
    finally:
        for layer, flag in zip(model.model.layers, saved):
            layer.self_attn.store_full_length_kv = flag


def _naive_branch(layer, z, e):
    r"""N_ple((act(z W_gate) * e) W_proj) position by position, neuron by neuron."""
    out = torch.zeros_like(z)
    wg, wp = layer.per_layer_input_gate.weight, layer.per_layer_projection.weight
    norm = layer.post_per_layer_input_norm
    for b in range(z.shape[0]):
        for t in range(z.shape[1]):
            m = torch.stack([layer.act_fn((z[b, t] * wg[n]).sum()) * e[b, t, n] for n in range(wg.shape[0])])
            o = torch.stack([(m * wp[d]).sum() for d in range(wp.shape[0])])
            out[b, t] = norm.weight * o / torch.sqrt((o * o).mean() + norm.variance_epsilon)
    return out


def test_the_per_layer_input_branch_against_a_naive_reference_and_the_model(float64_norms):
    model = _exact(num_kv_shared_layers=0, num_hidden_layers=1, layer_types=["full_attention"])
    layer = model.model.layers[0]
    ids = _ids()
    seen = {}
    layer.register_forward_pre_hook(lambda m, a, k: seen.update(x=a[0], e=a[1]), with_kwargs=True)
    layer.mlp.register_forward_hook(lambda m, a, o: seen.update(f=o))
    layer.self_attn.register_forward_hook(lambda m, a, o: seen.update(a=o[0]))
    layer.register_forward_hook(lambda m, a, o: seen.update(y=o))
    with torch.no_grad():
        model(ids)
        z = seen["x"] + layer.post_attention_layernorm(seen["a"]) + layer.post_feedforward_layernorm(seen["f"])
        branch = per_layer_input_branch(layer, z, seen["e"])
        torch.testing.assert_close(branch, _naive_branch(layer, z, seen["e"]), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close((z + branch) * layer.layer_scalar, seen["y"], rtol=1e-12, atol=1e-14)
    for hooks in (layer._forward_hooks, layer._forward_pre_hooks, layer.mlp._forward_hooks,
                  layer.self_attn._forward_hooks):
        hooks.clear()
    # the branch is token t's own part: removing it changes position t's part of token t only
    parts, _, _ = gemma4_token_parts(model, ids)
    with torch.no_grad():
        layer.per_layer_projection.weight.zero_()
    without, _, _ = gemma4_token_parts(model, ids)
    diagonal = torch.eye(ids.shape[1], dtype=torch.bool)
    assert float((parts - without)[:, ~diagonal].abs().max()) == 0.0
    torch.testing.assert_close((parts - without)[:, diagonal], branch * layer.layer_scalar, rtol=1e-12, atol=1e-14)


def _with_experts():
    model = _exact(num_kv_shared_layers=2, enable_moe_block=True, num_experts=4, top_k_experts=2,
                   moe_intermediate_size=6)
    model.config._experts_implementation = "eager"  # the grouped-matmul default takes no float64
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers:
            for p in (layer.experts.gate_up_proj, layer.experts.down_proj):
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            layer.router.per_expert_scale.copy_(0.5 + torch.rand(4, generator=g, dtype=torch.float64))
    return model


def test_the_expert_block_beside_the_dense_mlp_is_exact(float64_norms):
    model = _with_experts()
    ids = _ids()
    _, _, rebuilt = gemma4_token_parts(model, ids)
    assert rebuilt < 1e-12
    for target in (5, 17):
        scores, _ = gemma4_logit_scores(model, ids, target)
        with torch.no_grad():
            own = model(ids).logits[:, -1, target]
        assert _rel(scores.sum(1), own) < 1e-10
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    scores, _ = gemma4_logit_scores(model, ids, 5, mask)
    single, _ = gemma4_logit_scores(model, ids[1:, 2:], 5)
    torch.testing.assert_close(scores[1, 2:], single[0], rtol=1e-10, atol=1e-12)


def test_an_attention_bias_and_soft_capping_are_refused():
    model = _exact(num_kv_shared_layers=0)
    model.config.attention_bias = True
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        gemma4_token_parts(model, _ids())
    model = _tiny(num_kv_shared_layers=0, final_logit_softcapping=30.0)
    with pytest.raises(UnsupportedModelError, match="final_logit_softcapping"):
        gemma4_logit_scores(model, _ids(), 5)
