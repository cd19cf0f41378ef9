r"""GlobEnc and ALTI maps of every registered pre-LN decoder against a naive reference from the model itself.

The reference uses none of the package's capture or maths: the model's own eager forward
pass with ``output_attentions`` / ``output_hidden_states`` gives the probabilities and each
layer's input; the model's own modules give the first norm, the value and output projections.
Then, from the equations, token by token and head by head:

    h_{i<-j} = [i = j] x_i + sum_h alpha^h_ij (N1(x_j) W_V^h + b_V^h) W_O^h,    y_i = sum_j h_{i<-j} + b_O,

N_RES_ij = |h_{i<-j}| and ALTI_ij = max(0, |y_i|_1 - |y_i - h_{i<-j}|_1), rows normalised (pads 0).
transformers' eager attention computes its softmax in float32 even in a float64 model, so the
reference's probabilities carry float32 rounding: maps agree to 1e-6 relative (measured 1.5e-7),
while a wrong decomposition differs at O(1).
"""
import pytest
import torch

from captum_normattr import ALTIAttribution, GlobEncAttribution
from captum_normattr.arch import ARCHITECTURES
from decoder_models import decoder_batch
from zoo import build

#: pre-LN decoders whose value projection is its own module (``self_attn.v_proj``) or GPT-2's fused c_attn
#: one-mixer pre-LN decoders (softmax attention in every layer); hybrid layers (``Layer.mixers``, LFM2's
#: short convolutions) have their own naive per-token reference in tests/arch/test_hybrid_lfm2.py
PRE_LN = [k for k, s in ARCHITECTURES.items() if s.modality == "text" and s.causal and s.topology == "pre_ln"
          and not s.layer.mixers]


def _path(root, path):
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _value_and_out(layer, spec, config):
    r"""(W_V (D, Hkv*Dh), b_V, W_O (H*Dh, D), b_O) read from the modules (nn.Linear, Phi-3's fused qkv_proj,
    BLOOM's per-head interleaved query_key_value or GPT-2 Conv1D); W_O times Granite's residual multiplier (its residual join is x + m * o_proj(.))."""
    attn = _path(layer, spec.attention)
    m = getattr(config, "residual_multiplier", 1.0)
    if hasattr(attn, "v_proj"):
        v, o = attn.v_proj, _path(layer, spec.attn_out)
        return v.weight.T, v.bias, m * o.weight.T, None if o.bias is None else m * o.bias
    if hasattr(attn, "qkv_proj"):  # Phi-3: rows [q (H*Dh) | k (Hkv*Dh) | v (Hkv*Dh)]
        dh = config.hidden_size // config.num_attention_heads
        kv = config.num_key_value_heads * dh
        w, o = attn.qkv_proj.weight, attn.o_proj
        return w[w.shape[0] - kv:].T, None, m * o.weight.T, o.bias
    if hasattr(attn, "query_key_value"):  # BLOOM: rows per head [q_h | k_h | v_h], each Dh long
        h = config.num_attention_heads
        w, bias, o = attn.query_key_value.weight, attn.query_key_value.bias, attn.dense
        dh = w.shape[0] // (3 * h)
        wv = w.reshape(h, 3, dh, -1)[:, 2].reshape(h * dh, -1)
        return wv.T, bias.reshape(h, 3, dh)[:, 2].reshape(-1), o.weight.T, o.bias
    d = attn.c_attn.weight.shape[0]  # GPT-2 Conv1D: weight (in, out), out = [q | k | v]
    return attn.c_attn.weight[:, 2 * d:], attn.c_attn.bias[2 * d:], attn.c_proj.weight, attn.c_proj.bias


def _latent_values(attn, n1x):
    r"""Multi-head latent attention (DeepSeek-V3): the values from the model's own modules, v = kv_b_proj(N(c))'s value
    columns with c the first kv_lora_rank outputs of kv_a_proj_with_mqa; (v (B, T, H*Dv), W_O, b_O)."""
    b, t, _ = n1x.shape
    c = attn.kv_a_proj_with_mqa(n1x)[..., :attn.kv_lora_rank]
    kv = attn.kv_b_proj(attn.kv_a_layernorm(c)).view(b, t, attn.num_heads, attn.qk_nope_head_dim + attn.v_head_dim)
    return kv[..., attn.qk_nope_head_dim:].reshape(b, t, -1), attn.o_proj.weight.T, attn.o_proj.bias


def naive_maps(model, ids, mask, spec):
    eager = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
                        output_attentions=True, output_hidden_states=True)
    finally:
        model.config._attn_implementation = eager
    body = model.base_model if model.base_model is not model else model.model  # Llama 4's LM: prefix language_model
    layers = list(_path(body, spec.layers))
    valid = mask.bool()
    n_res, alti = [], []
    with torch.no_grad():
        for l, layer in enumerate(layers):
            x, probs = out.hidden_states[l], out.attentions[l]  # (B, T, D), (B, H, T, T)
            b, h, t, _ = probs.shape
            if hasattr(_path(layer, spec.attention), "kv_b_proj"):  # values from a normalised latent
                v, wo, bo = _latent_values(_path(layer, spec.attention), _path(layer, spec.ln1)(x))
            else:
                wv, bv, wo, bo = _value_and_out(layer, spec, model.config)
                v = _path(layer, spec.ln1)(x) @ wv + (0 if bv is None else bv)  # (B, T, Hkv*Dh)
            dh = wo.shape[0] // h
            groups = h // (v.shape[-1] // dh)
            parts = torch.zeros(b, t, t, x.shape[-1], dtype=x.dtype)
            for i in range(t):
                for j in range(t):
                    for head in range(h):
                        vj = v[:, j, (head // groups) * dh:(head // groups + 1) * dh]
                        parts[:, i, j] += probs[:, head, i, j, None] * (vj @ wo[head * dh:(head + 1) * dh])
                    if i == j:
                        parts[:, i, j] += x[:, i]
            y = parts.sum(2) + (0 if bo is None else bo)
            pair = valid[:, :, None] & valid[:, None, :]
            zero = torch.zeros((), dtype=x.dtype)
            n_res.append(torch.where(pair, parts.norm(dim=-1), zero))
            c = torch.where(pair, (y.abs().sum(-1)[:, :, None] - (y[:, :, None] - parts).abs().sum(-1)).clamp_min(0), zero)
            s = c.sum(-1, keepdim=True)
            alti.append(torch.where(s > 0, c / s, torch.zeros_like(c)))
    return torch.stack(n_res, 1), torch.stack(alti, 1)


@pytest.mark.parametrize("key", PRE_LN)
def test_pre_ln_maps_equal_the_naive_reference(key):
    r"""The package on a left-padded batch; the reference on each example alone (the model's own eager
    softmax gives NaN on fully masked pad rows, which then spread through the pads' keys)."""
    spec = ARCHITECTURES[key]
    model = build(key, "lm")
    lengths = [5, 3]
    ids, mask = decoder_batch(lengths, seed=7)
    got = GlobEncAttribution(model, map_name="N_RES").decompose(ids, additional_forward_args=(mask,))
    alti = ALTIAttribution(model).decompose(ids, additional_forward_args=(mask,))
    t = ids.shape[1]
    for b, n in enumerate(lengths):
        one = slice(t - n, t)
        ref_n, ref_alti = naive_maps(model, ids[b:b + 1, one], mask[b:b + 1, one], spec)
        scale = float(ref_n.abs().max())
        torch.testing.assert_close(got.layer_maps[b:b + 1, :, one, one], ref_n, rtol=0, atol=1e-6 * scale)
        torch.testing.assert_close(alti.layer_maps[b:b + 1, :, one, one], ref_alti, rtol=0, atol=1e-6)
        if n < t:
            assert float(got.layer_maps[b, :, : t - n].abs().max()) == 0  # pad rows exactly 0
    assert float(got.extras["completeness_error"].max()) < 1e-9 * float(got.layer_maps.abs().max())
