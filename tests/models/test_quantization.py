r"""Quantized models: weight-only schemes decompose exactly against the dequantized weights;
schemes that quantize activations are refused with a reason (docs/reliability.md, "Quantized models")."""
import warnings

import pytest
import torch
from decoder_models import decoder_batch, make_decoder

from captum_normattr import ALTIAttribution, ALTILogitAttribution, DecompXAttribution, GlobEncAttribution
from captum_normattr.models.quantization import (
    QuantizedActivationsError,
    activation_quantizing_modules,
    check_quantization,
    dequantized,
)

METHODS = [ALTILogitAttribution, DecompXAttribution, ALTIAttribution, GlobEncAttribution]


def _dynamic_int8(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization is deprecated
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


def test_dynamic_quantization_is_found_and_explained():
    q = _dynamic_int8(make_decoder("llama").float())
    found = activation_quantizing_modules(q)
    assert found and all("quantized.dynamic" in f for f in found)
    assert activation_quantizing_modules(make_decoder("llama")) == []
    with pytest.raises(QuantizedActivationsError, match="not additive over tokens") as err:
        check_quantization(q, "Llama")
    assert "weight" in str(err.value) and "Int8WeightOnlyConfig" in str(err.value)  # what to do instead


@pytest.mark.parametrize("cls", METHODS, ids=lambda c: c.__name__)
def test_dynamic_quantization_is_refused_by_every_method(cls):
    q = _dynamic_int8(make_decoder("llama").float())
    ids, mask = decoder_batch([6, 4])
    kwargs = {"target": 3} if cls in (ALTILogitAttribution, DecompXAttribution) else {}
    with pytest.raises(QuantizedActivationsError, match="quantizes activations"):
        cls(q).attribute(ids, additional_forward_args=(mask,), **kwargs)


def test_dequantized_plain_and_quantized_tensors():
    w = torch.randn(3, 4)
    assert dequantized(w) is w
    qw = torch.quantize_per_tensor(w, 0.05, 0, torch.qint8)
    torch.testing.assert_close(dequantized(qw), qw.dequantize())



@pytest.fixture(scope="module")
def int8_weight_only():
    ao = pytest.importorskip("torchao.quantization", reason="torchao not installed (pip install torchao)")
    model = make_decoder("llama").float()  # torchao's kernels run in float32
    ref = make_decoder("llama").float()
    ao.quantize_(model, ao.Int8WeightOnlyConfig())
    return model, ref


def test_weight_only_int8_is_read_dequantized(int8_weight_only):
    model, _ = int8_weight_only
    w = model.model.layers[0].self_attn.o_proj.weight
    assert type(w) is not torch.Tensor and type(w) is not torch.nn.Parameter  # a torchao tensor subclass
    from captum_normattr.models.weights import module_tensor

    read = module_tensor(model.model.layers[0].self_attn.o_proj, "weight")
    assert type(read) is torch.Tensor
    torch.testing.assert_close(read, w.dequantize())


@pytest.mark.parametrize("cls", [ALTILogitAttribution, DecompXAttribution], ids=lambda c: c.__name__)
def test_weight_only_int8_is_exact_against_the_models_logit(int8_weight_only, cls):
    model, _ = int8_weight_only
    ids, mask = decoder_batch([6, 4])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    scores, delta = cls(model).attribute(ids, additional_forward_args=(mask,), target=3, return_convergence_delta=True)
    last = mask.sum(1) - 1
    real = logits[torch.arange(2), last, 3]
    scale = float(real.abs().max()) + float(scores.abs().sum(1).max())
    assert float(delta.abs().max()) <= 1e-5 * scale, (delta, scale)  # float32 rounding of the model's own kernels


@pytest.mark.parametrize("cls", [ALTIAttribution, GlobEncAttribution], ids=lambda c: c.__name__)
def test_weight_only_int8_maps_run_and_are_finite(int8_weight_only, cls):
    model, _ = int8_weight_only
    ids, mask = decoder_batch([6, 4])
    res = cls(model).decompose(ids, additional_forward_args=(mask,))
    assert torch.isfinite(res.scores).all()
    assert float(res.extras["completeness_error"].max()) <= 1e-4
