r"""peft LoRA models and torch.compile wrappers: the numbers of the merged / eager model, exactly.

An unmerged ``lora.Linear`` computes base(x) + sum_a scaling_a B_a A_a x; its ``.weight`` is the
BASE weight. Every method must read the effective weight (models/weights.py), so that its scores
equal those of ``merge_and_unload()``'s plain model to rounding, with completeness intact.
lora_B is initialised randomly (peft starts it at 0, which would hide the bug).
"""
import copy

import pytest
import torch

peft = pytest.importorskip("peft")
from peft import LoraConfig, PromptTuningConfig, get_peft_model  # noqa: E402

import captum_normattr as cn  # noqa: E402
from captum_normattr.models.weights import UnsupportedAdapterLayerError  # noqa: E402
from conftest import make_model, random_batch  # noqa: E402
from decoder_models import decoder_batch, make_decoder  # noqa: E402

# Merged and unmerged models differ only in the order of float64 roundings (W + sBA then x W, or
# x W + s (x A) B): a few hundred eps of the values' magnitude.
RTOL = 1e-12

BERT_TARGETS = ["query", "key", "value", "dense", "intermediate.dense", "output.dense", "classifier"]
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def randomise_lora(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_A" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.eval()


def lora(model, targets, adapters=("default",), r=2, fan_in_fan_out=False, **kw):
    pm = get_peft_model(copy.deepcopy(model), LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=0.1,
                                                         fan_in_fan_out=fan_in_fan_out, **kw))
    for name in adapters[1:]:
        pm.add_adapter(name, LoraConfig(r=r + 1, lora_alpha=r, target_modules=targets, fan_in_fan_out=fan_in_fan_out))
    if len(adapters) > 1:
        pm.base_model.set_adapter(list(adapters))  # several adapters active at once
    return randomise_lora(pm)


def merged(pm):
    return copy.deepcopy(pm).merge_and_unload().eval()


def close(a, b, rtol=RTOL):
    return float((a - b).abs().max()) <= rtol * max(1.0, float(b.abs().max()))


@pytest.fixture(scope="module")
def bert_lora():
    return lora(make_model("bert"), BERT_TARGETS, adapters=("default", "second"))


@pytest.mark.parametrize("cls", ["GlobEncAttribution", "ALTIAttribution", "DecompXAttribution"])
def test_bert_lora_equals_merged(bert_lora, cls):
    ids, mask = random_batch([6, 4])
    plain = merged(bert_lora)
    ref = getattr(cn, cls)(plain).decompose(ids, additional_forward_args=(mask,))
    assert not close(getattr(cn, cls)(make_model("bert")).decompose(ids, additional_forward_args=(mask,)).scores,
                     ref.scores, 1e-3)  # the adapters change the scores: the comparison below means something
    # the PeftModel wrapper, its LoraModel and the LoRA-injected transformers model
    for model in (bert_lora, bert_lora.base_model, bert_lora.get_base_model()):
        res = getattr(cn, cls)(model).decompose(ids, additional_forward_args=(mask,))
        assert close(res.scores, ref.scores), cls
        if cls == "DecompXAttribution":
            real = bert_lora(input_ids=ids, attention_mask=mask).logits
            assert close(res.class_scores, ref.class_scores) and float(res.delta.max()) < 1e-12 * max(1.0, float(real.abs().max()))
            assert torch.allclose(res.logits, real, rtol=0, atol=1e-12 * float(real.abs().max()))
        else:
            assert float(res.extras["completeness_error"].max()) < 1e-12


def test_merged_and_disabled_adapters():
    base = make_model("bert")
    pm = lora(base, BERT_TARGETS)
    ids, mask = random_batch([5, 3], seed=2)
    dx = lambda m: cn.DecompXAttribution(m).attribute(ids, additional_forward_args=(mask,), return_convergence_delta=True)
    ref, _ = dx(merged(pm))
    pm.merge_adapter()  # merged in place: the base weights hold the update, the forward skips the adapters
    got, delta = dx(pm)
    assert close(got, ref) and float(delta.max()) < 1e-12 * max(1.0, float(got.abs().sum(-1).max()))
    with pm.disable_adapter():  # disabled (the forward unmerges first): the base model's numbers
        got, delta = dx(pm)
    assert close(got, dx(base)[0]) and float(delta.max()) < 1e-12 * max(1.0, float(got.abs().sum(-1).max()))
    assert not close(got, ref, 1e-3)


def test_llama_lora_alti_logit_ff_decompx():
    base = make_decoder("llama", tied=False)  # a LoRA on a tied lm_head would change the embeddings when merged
    pm = lora(base, LLAMA_TARGETS, adapters=("default", "second"))
    plain = merged(pm)
    ids, mask = decoder_batch([6, 4], seed=1)
    for cls, kw in (("ALTILogitAttribution", {"target": 7}), ("DecompXAttribution", {"target": 7}),
                    ("FFIntegratedDecomposition", {})):
        ref = getattr(cn, cls)(plain).decompose(ids, additional_forward_args=(mask,), **kw)
        res = getattr(cn, cls)(pm).decompose(ids, additional_forward_args=(mask,), **kw)
        assert close(res.scores, ref.scores), cls
        assert not close(getattr(cn, cls)(base).decompose(ids, additional_forward_args=(mask,), **kw).scores,
                         ref.scores, 1e-3), cls
        if cls == "FFIntegratedDecomposition":
            assert float(res.extras["layer_completeness_error"].max()) < 1e-9
        else:
            assert float(res.delta.abs().max()) < 1e-9, cls
            pos = (mask.cumsum(-1) - 1).clamp_min(0)
            real = pm(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1, 7]
            assert torch.allclose(res.logits.flatten(), real, rtol=0, atol=1e-10 * float(real.abs().max()))


def test_gpt2_conv1d_lora_fan_in_fan_out():
    base = make_decoder("gpt2")
    pm = lora(base, ["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
    ids, mask = decoder_batch([5, 3])
    ref = cn.DecompXAttribution(merged(pm)).decompose(ids, 3, (mask,))
    res = cn.DecompXAttribution(pm).decompose(ids, 3, (mask,))
    assert close(res.scores, ref.scores) and float(res.delta.max()) < 1e-9


def test_unsupported_tuner_layers_are_refused():
    ids, mask = random_batch([4])
    pm = lora(make_model("bert"), ["dense"], use_dora=True)  # W_O is read by every method
    for cls in (cn.GlobEncAttribution, cn.DecompXAttribution):
        with pytest.raises(UnsupportedAdapterLayerError, match="DoRA.*merge_and_unload"):
            cls(pm).attribute(ids, additional_forward_args=(mask,))
    pt = get_peft_model(make_model("bert"), PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=2))
    with pytest.raises(cn.UnsupportedModelError, match="prompt learning"):
        cn.ALTIAttribution(pt)


def test_compiled_model_decompx_without_compiling():
    r"""torch.compile's wrapper is unwrapped: the eager module runs under the hooks (the compiled
    forward is never called, so no compilation happens in the test suite)."""
    model = make_model("distilbert")
    compiled = torch.compile(model, backend="eager")
    assert type(compiled).__name__ == "OptimizedModule"
    ids, mask = random_batch([5, 3])
    ref = cn.DecompXAttribution(model).decompose(ids, additional_forward_args=(mask,))
    res = cn.DecompXAttribution(compiled).decompose(ids, additional_forward_args=(mask,))
    assert torch.equal(res.class_scores, ref.class_scores) and torch.equal(res.logits, ref.logits)
    dec = make_decoder("qwen2")
    ids, mask = decoder_batch([5, 3])
    ref = cn.DecompXAttribution(dec).attribute(ids, 4, (mask,))
    assert torch.equal(cn.DecompXAttribution(torch.compile(dec, backend="eager")).attribute(ids, 4, (mask,)), ref)
