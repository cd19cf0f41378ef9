r"""The description features of the pre-LN zoo families, each with a test that fires if it is ignored.

Granite's residual multipliers (folded into W_O / W_down) and logit scaling (folded into the
explained direction), Phi-3's fused [q | k | v] projection with grouped-query attention and
fused [gate | up] projection, OLMo's parameter-free LayerNorm with the epsilon its code fixes,
StableLM's parallel variant, and the refusals of models that are not (plain) attention models.
The families' completeness, padding and unchanged-model invariants run in tests/test_zoo.py.
"""
from dataclasses import replace

import pytest
import torch
import transformers as tf

from captum_normattr import (
    ALTIAttribution,
    ALTILogitAttribution,
    DecompXAttribution,
    GlobEncAttribution,
    UnsupportedModelError,
)
from captum_normattr.arch import ARCHITECTURES, Norm, ValueProjection, lookup
from captum_normattr.arch.registry import REFUSED
from captum_normattr.models.guard import ConsistencyError
from captum_normattr.attr.explained_output import ExplainedOutputMismatchError, logit_scale
from captum_normattr.decompose.kinds.registry import LAYER_KINDS
from captum_normattr.models.adapters import get_adapter, value_projection
from decoder_models import decoder_batch
from registry_state import described_as
from zoo import build


def _batch(seed=1):
    return decoder_batch([6, 4], seed=seed)


def _real_logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits[:, -1]


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def granite():
    return build("granite", "lm")


@pytest.fixture(scope="module")
def phi3():
    return build("phi3", "lm")


# --- Granite: residual multipliers and logit scaling --------------------------------------
def test_granite_builder_moves_every_multiplier(granite):
    cfg = granite.config
    assert (cfg.residual_multiplier, cfg.logits_scaling, cfg.attention_multiplier, cfg.embedding_multiplier) == (
        0.4, 4.0, 0.3, 3.0)
    assert logit_scale(granite, get_adapter(granite)) == 0.25


def test_granite_explained_logit_is_the_models_own(granite):
    ids, mask = _batch()
    real = _real_logits(granite, ids, mask)
    res = ALTILogitAttribution(granite, strict=True).decompose(ids, target=7, additional_forward_args=(mask,))
    assert _rel(res.logit, real[:, 7]) < 1e-12
    assert _rel(res.scores.sum(-1) + res.no_token_total, real[:, 7]) < 1e-10
    dx = DecompXAttribution(granite, strict=True).decompose(ids, target=7, additional_forward_args=mask)
    assert _rel(dx.class_scores.sum(1) + dx.bias_scores, real[:, 7:8]) < 1e-10


@pytest.mark.parametrize("branch", ["attention", "ff"])
def test_granite_without_a_residual_multiplier_the_guard_fires(granite, branch):
    spec = ARCHITECTURES["granite"]
    lay = spec.layer
    lay = replace(lay, attention=replace(lay.attention, multiplier=None)) if branch == "attention" else replace(
        lay, ff=replace(lay.ff, multiplier=None))
    ids, mask = _batch()
    with described_as("granite", replace(spec, layer=lay)):
        for cls in (GlobEncAttribution, ALTIAttribution, ALTILogitAttribution):
            with pytest.raises(ConsistencyError, match="layer 0"):
                cls(granite, strict=True).decompose(ids, additional_forward_args=(mask,))


def test_granite_without_the_logit_divisor_the_explained_logit_is_off_by_the_scale(granite):
    spec = ARCHITECTURES["granite"]
    ids, mask = _batch()
    real = _real_logits(granite, ids, mask)
    with described_as("granite", replace(spec, head=replace(spec.head, logit_divisor=None))):
        for strict in (True, False):  # far off: an error even when not strict
            with pytest.raises(ExplainedOutputMismatchError, match="differs from the model's own output") as err:
                ALTILogitAttribution(granite, strict=strict).decompose(ids, target=7, additional_forward_args=(mask,))
    # the unscaled logit is logits_scaling (4) times the model's: off by 3 |logit|
    off = float(str(err.value).split("by up to ")[1].split(" ")[0])
    assert off == pytest.approx(3.0 * float(real[:, 7].abs().max()), rel=1e-2)


def test_a_logit_multiplier_is_folded_too(granite):
    # Cohere-style: logits * config.<attribute>; here 1 / logits_scaling as a multiplier gives Granite's own logits
    spec = ARCHITECTURES["granite"]
    ids, mask = _batch()
    real = _real_logits(granite, ids, mask)
    granite.config.test_logit_multiplier = 0.25
    try:
        head = replace(spec.head, logit_divisor=None, logit_multiplier="test_logit_multiplier")
        with described_as("granite", replace(spec, head=head)):
            res = ALTILogitAttribution(granite, strict=True).decompose(ids, target=3, additional_forward_args=(mask,))
    finally:
        del granite.config.test_logit_multiplier
    assert _rel(res.logit, real[:, 3]) < 1e-12


def test_a_named_multiplier_the_config_lacks_is_an_error(granite):
    spec = ARCHITECTURES["granite"]
    lay = replace(spec.layer, ff=replace(spec.layer.ff, multiplier="no_such_multiplier"))
    ids, mask = _batch()
    with described_as("granite", replace(spec, layer=lay)):
        with pytest.raises(ValueError, match="no_such_multiplier"):
            GlobEncAttribution(granite).decompose(ids, additional_forward_args=(mask,))


def test_a_multiplier_with_a_post_norm_is_refused_by_the_description():
    spec = ARCHITECTURES["gemma2"]
    with pytest.raises(ValueError, match="multiplier"):
        replace(spec, layer=replace(spec.layer, ff=replace(spec.layer.ff, multiplier="residual_multiplier")))


# --- Phi-3: fused projections ------------------------------------------------------------
def test_phi3_fused_gqa_value_columns(phi3):
    layer = phi3.model.layers[0]
    attn = layer.self_attn
    assert attn.num_key_value_heads < phi3.config.num_attention_heads  # GQA: unequal slices
    x = torch.randn(3, phi3.config.hidden_size, dtype=torch.float64)
    w, b = value_projection(layer, get_adapter(phi3))
    q = phi3.config.num_attention_heads * attn.head_dim
    kv = attn.num_key_value_heads * attn.head_dim
    assert w.shape == (phi3.config.hidden_size, kv) and b is None
    torch.testing.assert_close(x @ w, attn.qkv_proj(x)[:, q + kv:], rtol=0, atol=1e-12)
    # equal thirds (GPT-2's layout) would read the wrong columns: the width itself differs
    wrong = replace(get_adapter(phi3), layer=replace(get_adapter(phi3).layer, attention=replace(
        get_adapter(phi3).layer.attention, value=ValueProjection("self_attn.qkv_proj", "fused", 2, 3))))
    assert value_projection(layer, wrong)[0].shape[1] != kv


def test_phi3_fused_gate_up_in_the_wrong_order_the_guard_fires(phi3):
    spec = ARCHITECTURES["phi3"]
    ids, mask = _batch()
    real = _real_logits(phi3, ids, mask)
    res = DecompXAttribution(phi3, strict=True).decompose(ids, target=5, additional_forward_args=mask)
    assert _rel(res.class_scores.sum(1) + res.bias_scores, real[:, 5:6]) < 1e-10
    with described_as("phi3", replace(spec, layer=replace(spec.layer, ff=replace(spec.layer.ff, gate_first=False)))):
        for cls, kw in ((DecompXAttribution, dict(target=5)), (ALTILogitAttribution, dict(target=5)),
                        (GlobEncAttribution, {})):
            with pytest.raises(ConsistencyError, match="feed-forward output rebuilt"):
                cls(phi3, strict=True).decompose(ids, additional_forward_args=(mask,), **kw)


def test_fused_gate_up_names_no_separate_gate():
    spec = ARCHITECTURES["phi3"]
    with pytest.raises(ValueError, match="fused_gate_up"):
        replace(spec.layer.ff, gate="mlp.gate_proj")


# --- OLMo: LayerNorm without parameters, the epsilon its code fixes ------------------------
def test_olmo_norms_have_no_parameters_and_the_described_eps():
    model = build("olmo", "lm")
    norm = model.model.layers[0].input_layernorm
    assert not list(norm.parameters()) and not hasattr(norm, "eps")
    ids, mask = _batch()
    real = _real_logits(model, ids, mask)
    res = ALTILogitAttribution(model, strict=True).decompose(ids, target=4, additional_forward_args=(mask,))
    assert _rel(res.scores.sum(-1) + res.no_token_total, real[:, 4]) < 1e-10
    spec = ARCHITECTURES["olmo"]
    lay = spec.layer
    for eps, error, match in ((None, ValueError, "Norm\\(..., eps=...\\)"), (1e-3, ConsistencyError, "first norm rebuilt")):
        wrong = replace(lay, attention=replace(lay.attention, pre_norm=Norm("input_layernorm", eps=eps)))
        with described_as("olmo", replace(spec, layer=wrong)):
            with pytest.raises(error, match=match):
                GlobEncAttribution(model, strict=True).decompose(ids, additional_forward_args=(mask,))


def test_olmo_in_float32_is_exact_to_float32_rounding():
    # OLMo's own norm computes in float32 whatever the model's dtype: 1e-6 relative, not 1e-10
    model = build("olmo", "lm")
    model.model.layers[0].input_layernorm = type(tf.OlmoModel(model.config).norm)(model.config.hidden_size)
    ids, mask = _batch()
    real = _real_logits(model, ids, mask)
    res = ALTILogitAttribution(model).decompose(ids, target=4, additional_forward_args=(mask,))
    assert _rel(res.scores.sum(-1) + res.no_token_total, real[:, 4]) < 1e-6


# --- StableLM: the parallel variant --------------------------------------------------------
def test_stablelm_parallel_residual_selects_the_parallel_description():
    seq = build("stablelm", "lm")
    assert get_adapter(seq).topology == "pre_ln"
    par = build("stablelm", "lm", use_parallel_residual=True)
    spec = get_adapter(par)
    assert spec.topology == "parallel" and spec.layer.ff.pre_norm.path == "input_layernorm"
    assert lookup("stablelm", par.config) is spec
    ids, mask = _batch()
    kind = LAYER_KINDS.get("parallel")
    if kind is None or "alti_logit" not in kind.methods:
        with pytest.raises(UnsupportedModelError):
            ALTILogitAttribution(par)
        return
    real = _real_logits(par, ids, mask)
    res = ALTILogitAttribution(par, strict=True).decompose(ids, target=5, additional_forward_args=(mask,))
    assert _rel(res.scores.sum(-1) + res.no_token_total, real[:, 5]) < 1e-10


def test_smollm3_builder_has_a_layer_without_rotary_positions():
    model = build("smollm3", "lm")
    assert [bool(layer.self_attn.use_rope) for layer in model.model.layers] == [True, False]


# --- refusals --------------------------------------------------------------------------------
def _tiny(kind):
    if kind == "mamba":
        return tf.MambaModel(tf.MambaConfig(vocab_size=50, hidden_size=16, state_size=4, num_hidden_layers=1))
    if kind == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                                         num_heads=4))
    if kind == "albert":
        return tf.AlbertForSequenceClassification(tf.AlbertConfig(
            vocab_size=50, embedding_size=8, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=32))
    if kind == "swin":
        return tf.SwinModel(tf.SwinConfig(image_size=16, patch_size=4, embed_dim=8, depths=[1, 1], num_heads=[1, 2],
                                          window_size=2))
    if kind == "funnel":
        return tf.FunnelModel(tf.FunnelConfig(vocab_size=50, block_sizes=[1, 1], d_model=16, n_head=2, d_head=8,
                                              d_inner=32))
    raise KeyError(kind)


@pytest.mark.parametrize("kind,cls,match", [
    ("mamba", GlobEncAttribution, "not an attention model"),
    ("mamba", ALTILogitAttribution, "not an attention model"),
    ("t5", ALTIAttribution, "encoder-decoder.*ALTIPlusAttribution"),
    ("t5", GlobEncAttribution, "encoder-decoder.*ALTIPlusAttribution"),
    ("albert", GlobEncAttribution, "ALBERT.*shared"),
    ("swin", ALTIAttribution, "Swin.*patch merging"),
    ("funnel", GlobEncAttribution, "Funnel.*pools the sequence"),
])
def test_refusals_say_why(kind, cls, match):
    with pytest.raises(UnsupportedModelError, match=match):
        cls(_tiny(kind))


def test_a_state_space_config_outside_the_list_is_not_an_attention_model():
    from captum_normattr.arch.registry import refusal

    class Config:
        model_type, state_size = "my_ssm", 16

    assert "not an attention model" in refusal("my_ssm", Config())
    assert set(REFUSED) >= {"mamba", "mamba2", "rwkv", "swin", "funnel", "albert"}
