r"""Models under accelerate's hooks give the plain model's numbers; half precision stays close to float32."""
import copy
import functools

import pytest
import torch
from accelerate import cpu_offload, disk_offload, dispatch_model, init_empty_weights

from captum_normattr import (
    ALTIAttribution,
    ALTILogitAttribution,
    DecompXAttribution,
    FFIntegratedDecomposition,
    GlobEncAttribution,
)
from captum_normattr.models.weights import WeightsNotReachableError, module_tensor
from conftest import make_model, random_batch
from decoder_models import decoder_batch, make_decoder

# (name, builder, decoders only, encoders only); every result compared on scores and delta
METHODS = [
    ("globenc", lambda m: GlobEncAttribution(m), False, False),
    ("alti", lambda m: ALTIAttribution(m), False, False),
    ("globenc+ff", lambda m: FFIntegratedDecomposition(m), False, False),
    ("alti+ff", lambda m: FFIntegratedDecomposition(m, contribution="alti"), False, False),
    ("alti-logit", lambda m: ALTILogitAttribution(m), True, False),
    ("decompx-adjoint", lambda m: DecompXAttribution(m, algorithm="adjoint"), False, False),
    ("decompx-forward", lambda m: DecompXAttribution(m, algorithm="forward"), False, False),
    ("decompx-spread", lambda m: DecompXAttribution(m, bias_mode="spread"), False, False),
]

# layer 0 on "cpu", layer 1 and the top on "disk"
SPLIT = {
    "bert": {"bert.embeddings": "cpu", "bert.encoder.layer.0": "cpu", "bert.encoder.layer.1": "disk",
             "bert.pooler": "disk", "classifier": "disk", "dropout": "cpu"},
    "llama": {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
              "model.layers.1": "disk", "model.norm": "disk", "lm_head": "disk"},
    "gpt2": {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.drop": "cpu", "transformer.h.0": "cpu",
             "transformer.h.1": "disk", "transformer.ln_f": "disk", "lm_head": "disk"},
}


def _model(family):
    if family == "bert":
        return make_model("bert")
    return make_decoder(family, tied=False)


def _batch(family):
    if family == "bert":
        return random_batch([7, 5])
    return decoder_batch([7, 5])


@functools.lru_cache(maxsize=None)
def _plain(family):
    model = _model(family)
    return model, _results(model, family, *_batch(family))


def _results(model, family, ids, mask, only=None):
    out = {}
    for name, build, dec_only, enc_only in METHODS:
        if (dec_only and family == "bert") or (enc_only and family != "bert") or (only and name not in only):
            continue
        attr = build(model)
        if name.startswith("decompx"):
            res = attr.decompose(ids, additional_forward_args=(mask,), layer_parts=name == "decompx-forward")
            out[name] = (res.scores, res.delta)
        elif name == "alti-logit":
            res = attr.decompose(ids, additional_forward_args=(mask,))
            out[name] = (res.scores, res.delta)
        else:
            res = attr.decompose(ids, additional_forward_args=(mask,))
            out[name] = (res.scores, res.layer_maps)
    return out


def _dispatched(model, family, mode, tmp_path):
    m = copy.deepcopy(model)
    if mode == "cpu_offload":
        return cpu_offload(m)
    if mode == "disk_offload":
        return disk_offload(m, str(tmp_path / "offload"))
    return dispatch_model(m, SPLIT[family], offload_dir=str(tmp_path / "offload"))


def _assert_same(plain, other, tol=1e-12):
    assert plain.keys() == other.keys()
    for name in plain:
        for a, b in zip(plain[name], other[name]):
            assert b.device == a.device, name
            err = (a - b).abs().max().item()
            assert err <= tol, f"{name}: {err}"


@pytest.mark.parametrize("family", ["bert", "llama", "gpt2"])
@pytest.mark.parametrize("mode", ["cpu_offload", "disk_offload", "dispatch"])
def test_dispatched_models_equal_the_plain_model(family, mode, tmp_path):
    model, plain = _plain(family)
    ids, mask = _batch(family)
    m = _dispatched(model, family, mode, tmp_path)
    if mode != "cpu_offload":  # the offloaded weights really are off the modules
        assert any(p.device.type == "meta" for p in m.parameters())
    _assert_same(plain, _results(m, family, ids, mask))


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_from_pretrained_with_a_device_map(family, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    loader = AutoModelForSequenceClassification if family == "bert" else AutoModelForCausalLM
    _model(family).save_pretrained(tmp_path / "model")
    plain = loader.from_pretrained(tmp_path / "model", dtype=torch.float64).eval()
    split = loader.from_pretrained(
        tmp_path / "model", dtype=torch.float64, device_map=SPLIT[family], offload_folder=str(tmp_path / "off")
    ).eval()
    assert any(p.device.type == "meta" for p in split.parameters())
    ids, mask = _batch(family)
    only = ("alti", "alti-logit", "decompx-adjoint")  # the loading is under test here; every method is above
    _assert_same(_results(plain, family, ids, mask, only), _results(split, family, ids, mask, only))


def test_a_model_without_weights_gets_an_error_naming_what_to_do():
    model = _model("llama")
    with init_empty_weights():
        empty = type(model)(model.config)
    ids, mask = _batch("llama")
    with pytest.raises(WeightsNotReachableError, match="meta.*device_map"):
        ALTIAttribution(empty).attribute(ids, additional_forward_args=(mask,))
    # a dispatched model whose hook lost a weight: the error names the module
    m = cpu_offload(copy.deepcopy(model))
    o_proj = m.model.layers[1].self_attn.o_proj
    o_proj._hf_hook.weights_map = {}
    with pytest.raises(WeightsNotReachableError, match="o_proj.weight|Linear.weight"):
        module_tensor(o_proj, "weight")


# --- half precision ------------------------------------------------------------------------

HALF_TOL = {torch.bfloat16: 0.05, torch.float16: 0.01}  # relative to the largest |score| of float32


@pytest.mark.parametrize("family,dtype", [("bert", torch.bfloat16), ("llama", torch.bfloat16), ("bert", torch.float16)])
def test_half_precision_stays_close_to_float32(family, dtype):
    model = _model(family)
    ids, mask = _batch(family)
    ref = _results(copy.deepcopy(model).float(), family, ids, mask)
    half = _results(copy.deepcopy(model).to(dtype), family, ids, mask)
    for name in ref:
        a, b = ref[name][0], half[name][0]
        assert b.dtype == torch.float32, name  # decomposed in float32
        rel = ((a - b).abs().max() / a.abs().max()).item()
        assert rel < HALF_TOL[dtype], f"{name} {dtype}: relative error {rel}"


def test_a_half_precision_lm_head_is_cast_by_rows_not_whole(monkeypatch):
    r"""ALTI-Logit / DecompX read the unembedding rows they explain (and the logits by blocks of rows),
    so that a bfloat16 LM head of a big model is never copied whole in float32."""
    from captum_normattr.attr import explained_output
    from captum_normattr.models.adapters import get_adapter

    model = make_decoder("llama", tied=False).to(torch.bfloat16)
    out = explained_output.NextTokenLogit(model, get_adapter(model))
    w = model.lm_head.weight
    x = torch.randn(2, w.shape[1], generator=torch.Generator().manual_seed(0))
    full = x @ w.float().T
    monkeypatch.setattr(explained_output, "VOCAB_BLOCK", 7)  # several blocks and a short last one
    assert torch.allclose(out.logits(x), full, rtol=1e-6, atol=1e-6)
    d = out.resolve(torch.tensor([3, 5]), x, foil=torch.tensor([1, 1]))
    assert d.direction.dtype == torch.float32
    assert torch.equal(d.direction, w[[3, 5]].float() - w[[1, 1]].float())
    assert torch.equal(out.resolve(None, x).target, full.argmax(-1))
    # what the methods return is unchanged: the same target through the cast head
    ids, mask = _batch("llama")
    a = ALTILogitAttribution(model).attribute(ids, target=3, additional_forward_args=(mask,))
    assert a.dtype == torch.float32 and torch.isfinite(a).all()
