r"""Mathematical fidelity (issue 14): ALTI-Logit with large attention biases, inference mode.

DecompX's "spread" rule against a naive implementation of the official rule is in
``tests/test_decompx_official.py``.
"""
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import captum_normattr as C
from captum_normattr import ALTIAttribution, ALTILogitAttribution

from conftest import make_model
from decoder_models import _exact_rms_norms, decoder_batch, make_decoder


# ---------------------------------------------------------------------------------------------
# ALTI-Logit with a value bias AND an output bias (issue 14, item 4)
# ---------------------------------------------------------------------------------------------
def biased_decoder(family: str, seed: int, layers: int = 3) -> torch.nn.Module:
    r"""GPT-2 with c_attn and attn.c_proj biases ~ N(0, 0.5), or Llama with attention_bias=True
    and every bias ~ N(0, 0.5); float64, exact norms."""
    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = GPT2Config(vocab_size=50, n_positions=32, n_embd=24, n_layer=layers, n_head=4,
                         bos_token_id=1, eos_token_id=2)
        model = GPT2LMHeadModel(cfg).double().eval()
        with torch.no_grad():
            for block in model.transformer.h:
                block.attn.c_attn.bias.normal_(0, 0.5)
                block.attn.c_proj.bias.normal_(0, 0.5)
        return model
    cfg = LlamaConfig(vocab_size=50, hidden_size=24, intermediate_size=40, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
    model = LlamaForCausalLM(cfg).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    _exact_rms_norms(model)
    return model


def _real_logits(model, ids, mask):
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_alti_logit_exact_with_value_and_output_biases(family):
    r"""delta <= 1e-10 in float64 for several seeds; the logit that the ALTI rollout routes
    through all-zero ALTI rows is ``unattributed``, equal to an independent computation from
    ALTIAttribution's maps: sum_j q_l[j] (1 - sum_k R_{l-1}[j, k])."""
    seen_lost = 0.0
    for seed in range(4):
        model = biased_decoder(family, seed)
        ids, mask = decoder_batch([9, 6], seed=seed)
        target = torch.tensor([5, 7])
        res = ALTILogitAttribution(model).decompose(ids, target, mask)
        expect = _real_logits(model, ids, mask)[:, -1].gather(1, target[:, None])[:, 0]
        assert (res.logit - expect).abs().max() < 1e-10
        assert res.delta.abs().max() < 1e-10, (seed, res.delta)
        assert (res.scores.sum(-1) + res.no_token_total - expect).abs().max() < 1e-10
        # independent: ALTI's own maps, rows of the rollout of the layers below
        maps = ALTIAttribution(model).decompose(ids, additional_forward_args=mask).layer_maps  # (B, L, T, T)
        vm = mask.to(torch.float64)
        mass = vm.clone()
        for l in range(maps.shape[1]):
            if l > 0:
                mass = (maps[:, l - 1] @ mass.unsqueeze(-1)).squeeze(-1)
            lost = (res.layer_logit_updates[:, l] * (vm - mass)).sum(-1)
            assert torch.allclose(res.unattributed[:, l], lost, rtol=0, atol=1e-12)
        assert (res.unattributed[:, 0] == 0).all()  # layer 0 is carried by R = I
        seen_lost = max(seen_lost, float(res.unattributed.abs().max()))
    assert seen_lost > 1e-4  # these seeds do have empty ALTI rows: the test exercises the term


def test_alti_logit_unattributed_zero_when_rows_sum_to_one():
    model = make_decoder("gpt2", layers=3)
    ids, mask = decoder_batch([6, 4], seed=1)
    res = ALTILogitAttribution(model).decompose(ids, 3, mask)
    assert res.unattributed.abs().max() < 1e-14
    assert res.delta.abs().max() < 1e-10


# ---------------------------------------------------------------------------------------------
# torch.inference_mode() (issue 14, item 5: DecompX, FF on Llama, FF riemann)
# ---------------------------------------------------------------------------------------------
def _encoder_cases():
    return [
        ("DecompXAttribution", {}, True),
        ("DecompXAttribution", {"bias_mode": "spread"}, True),
        ("DecompXAttribution", {"algorithm": "forward"}, True),
        ("FFIntegratedDecomposition", {"method": "riemann", "steps": 8}, False),
        ("FFIntegratedDecomposition", {}, False),
    ]


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_inference_mode(family):
    r"""Every case gives, under inference mode, exactly what it gives outside, with ids, mask (and
    embeddings) created inside inference mode."""
    model = make_model(family) if family == "bert" else make_decoder(family)
    vocab = 60 if family == "bert" else 50
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (2, 6), generator=g)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0 if family != "bert" else 1
    mask[1, 4:] = 0 if family == "bert" else 1
    cases = _encoder_cases() + [("GlobEncAttribution", {}, False), ("ALTIAttribution", {}, False)]
    if family != "bert":
        cases += [("ALTILogitAttribution", {}, True), ("FFIntegratedDecomposition", {"nodes": 8}, False)]
    for name, kwargs, targeted in cases:
        if family == "llama" and kwargs.get("method") == "riemann":
            continue  # gated FFs have no Riemann option
        attr = getattr(C, name)(model, **kwargs)
        extra = {"target": 1} if targeted else {}
        ref = attr.attribute(ids, additional_forward_args=mask, **extra)
        with torch.inference_mode():
            ids_i, mask_i = ids.clone(), mask.clone()
            assert ids_i.is_inference()
            got = attr.attribute(ids_i, additional_forward_args=mask_i, **extra)
            if hasattr(attr, "decompose"):
                res = attr.decompose(ids_i, additional_forward_args=mask_i, **extra)
                assert torch.allclose(res.scores, ref, rtol=0, atol=1e-12), (name, kwargs)
        assert torch.allclose(got, ref, rtol=0, atol=1e-12), (name, kwargs)


def test_inference_mode_embeddings_input():
    r"""Input embeddings made inside inference mode (Llama hands them straight to layer 0)."""
    model = make_decoder("llama")
    ids = torch.randint(3, 50, (1, 5), generator=torch.Generator().manual_seed(1))
    emb = model.get_input_embeddings()(ids).detach()
    dx = C.DecompXAttribution(model)
    ref = dx.attribute(emb, target=2)
    with torch.inference_mode():
        emb_i = model.get_input_embeddings()(ids)
        assert emb_i.is_inference()
        got = dx.attribute(emb_i, target=2)
        ff = C.FFIntegratedDecomposition(model).attribute(emb_i)
    assert torch.allclose(got, ref, rtol=0, atol=1e-12)
    assert torch.allclose(ff, C.FFIntegratedDecomposition(model).attribute(emb), rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Captum's infidelity on embeddings with the package's token scores (issue 27, item 18)
# ---------------------------------------------------------------------------------------------
def test_captum_infidelity_on_embeddings_with_broadcast_scores():
    r"""``captum.metrics.infidelity`` refuses (B, T) scores for (B, T, D) embeddings; broadcast with
    ``broadcast_to_embeddings`` the documented call runs, is finite, and equals the package's
    ``token_presence_infidelity`` (same baseline, same drops, same seed)."""
    from captum.metrics import infidelity

    from captum_normattr.evaluation import metrics as M

    model = make_model("bert")
    ids = torch.tensor([[2, 11, 23, 35, 47, 3], [2, 15, 27, 3, 0, 0]])
    mask = (ids != 0).long()
    special = (ids == 2) | (ids == 3) | (mask == 0)
    target = torch.tensor([1, 0])
    scores = ALTIAttribution(model).decompose(ids, additional_forward_args=(mask,)).scores
    emb = model.get_input_embeddings()
    x = emb(ids).detach()
    baseline = emb(torch.tensor([[4]])).detach()  # the "absent token" embedding ([MASK]-like id 4)

    def forward(inputs_embeds, attention_mask):
        return model(inputs_embeds=inputs_embeds, attention_mask=attention_mask).logits

    perturb = M.token_drop_perturbation(~special, baseline, drop_prob=0.25, seed=0)
    with pytest.raises(Exception):  # Captum needs attributions of the inputs' shape
        infidelity(forward, perturb, x, scores, additional_forward_args=(mask,), target=target,
                   n_perturb_samples=4)
    attributions = M.broadcast_to_embeddings(scores, x, baseline)
    assert attributions.shape == x.shape
    assert torch.allclose((attributions * (x - baseline)).sum(-1), scores.to(x.dtype), rtol=1e-12, atol=0.0)
    perturb = M.token_drop_perturbation(~special, baseline, drop_prob=0.25, seed=0)
    value = infidelity(forward, perturb, x, attributions, additional_forward_args=(mask,), target=target,
                       n_perturb_samples=10, normalize=True)
    assert value.shape == (2,) and torch.isfinite(value).all()
    ours = M.token_presence_infidelity(forward, emb, ids, mask, scores, special, target, replacement_id=4,
                                       n_perturb_samples=10, drop_prob=0.25, seed=0)
    assert torch.allclose(value.double(), ours.double(), rtol=1e-8, atol=1e-12 * float(value.abs().max()))
    uniform = M.broadcast_to_embeddings(scores, x, mode="uniform")
    assert torch.allclose(uniform.sum(-1), scores.to(x.dtype)) and torch.equal(uniform[0, 1, 0], uniform[0, 1, 5])
    with pytest.raises(ValueError, match="do not fit"):
        M.broadcast_to_embeddings(scores[:, :3], x)
