r"""DecompX ``bias_mode="spread"`` against a naive, one-token-at-a-time implementation of the
official DecompX rule (github.com/mohsenfayyaz/DecompX, ``src/modeling_bert.py``; demo
configuration: include_biases=True, bias_decomp_type="absdot", include_LN1/FFN/LN2=True,
FFN_approx_type="GeLU_ZO", include_classifier_w_pooler=True, tanh_approx_type="ZO",
aggregation="vector").

The reference below is written from that definition, with plain Python loops over receiving
tokens i and source tokens k, and the model's weights read from its modules (not from the
package's capture). It leaves out the official code's ``+ 1e-12`` guards (in the |dot|
normalisation and in the zero-origin slopes g(p) / (p + 1e-12)), which change numbers by up
to about 1e-9 relative where a pre-activation is small; everything else is the official
rule:

- the input of layer 0 is the embedding output, all token i's at position i;
- attention, layer 0: b_V stays inside every token's value vector, so token k's part of
  row i is sum_h alpha^h_ik (x_k W_V^h + b_V^h) W_O^h; later layers: the parts' values
  carry no bias, sum_h sum_j alpha^h_ij (x_{j<-k} W_V^h) W_O^h;
- the residual parts are added, then the accumulated attention bias (layer 0: b_O; later:
  W_O b_V + b_O) is spread over those attention-plus-residual parts by |<part, bias>|;
- LN1: gamma c(part) / s(real LN1 input), then beta spread by |<part, beta>|;
- FFN: parts W1, b1 spread by |<part, b1>|, times the zero-origin slope g(p)/p at the real
  pre-activation p, times W2, b2 spread; plus the LN1 parts (residual); LN2 as LN1;
- pooler on token 0: parts W_p, b_p spread, times tanh(p)/p; classifier: parts W_c, b_c
  spread over the class-score parts.
"""
from __future__ import annotations

import math

import pytest
import torch

from captum_normattr import DecompXAttribution

from conftest import make_model, random_batch

TOL = 1e-10


def _spread(parts: list, bias: torch.Tensor) -> list:
    r"""Official absdot rule on one receiving token: parts[k] += |<parts[k], b>| / sum |<.,b>| * b."""
    w = [abs(float(p @ bias)) for p in parts]
    total = sum(w)
    if total == 0.0:
        return parts
    return [p + (wk / total) * bias for p, wk in zip(parts, w)]


def _ln_parts(parts: list, real_in: torch.Tensor, ln: torch.nn.LayerNorm) -> list:
    s = torch.sqrt(real_in.var(unbiased=False) + ln.eps)
    out = [ln.weight * (p - p.mean()) / s for p in parts]
    return _spread(out, ln.bias)


def _zo_slope(p: torch.Tensor, act) -> torch.Tensor:
    return act(p) / p  # the official g(p) / (p + 1e-12), without the guard


def official_spread_bert(model, ids: torch.Tensor) -> torch.Tensor:
    r"""(T, C) official DecompX scores of one example (no padding) of a BertForSequenceClassification."""
    bert = model.bert
    t = ids.shape[0]
    with torch.no_grad():
        out = bert(input_ids=ids[None], output_hidden_states=True)
        hidden = [h[0] for h in out.hidden_states]  # embedding output, then every layer's output
        x_real = hidden[0]
        parts = [[x_real[i] if k == i else torch.zeros_like(x_real[i]) for k in range(t)] for i in range(t)]
        for l, layer in enumerate(bert.encoder.layer):
            sa, so = layer.attention.self, layer.attention.output
            h, dh = sa.num_attention_heads, sa.attention_head_size
            x = hidden[l]
            # the real attention probabilities, from the layer's own weights
            q = (x @ sa.query.weight.T + sa.query.bias).view(t, h, dh).transpose(0, 1)
            kk = (x @ sa.key.weight.T + sa.key.bias).view(t, h, dh).transpose(0, 1)
            probs = torch.softmax(q @ kk.transpose(-1, -2) / math.sqrt(dh), -1)  # (H, T, T)
            w_o = so.dense.weight.view(-1, h, dh)  # (D, H, Dh)
            real_v = (x @ sa.value.weight.T + sa.value.bias).view(t, h, dh)
            z_real = torch.einsum("hij,jhe,dhe->id", probs, real_v, w_o) + so.dense.bias + x
            zt_real = so.LayerNorm(z_real)
            pre_real = zt_real @ layer.intermediate.dense.weight.T + layer.intermediate.dense.bias
            act = layer.intermediate.intermediate_act_fn
            ff_real = act(pre_real) @ layer.output.dense.weight.T + layer.output.dense.bias
            y_real = layer.output.LayerNorm(ff_real + zt_real)
            assert torch.allclose(y_real, hidden[l + 1], rtol=0, atol=1e-12)

            def value_of(vec, with_bias):  # (D,) -> (H, Dh)
                v = vec @ sa.value.weight.T + (sa.value.bias if with_bias else 0.0)
                return v.view(h, dh)

            if l == 0:
                acc_bias = so.dense.bias
                vals = [[value_of(x[j], True) if k == j else torch.zeros(h, dh, dtype=x.dtype) for k in range(t)]
                        for j in range(t)]
            else:
                acc_bias = so.dense.weight @ sa.value.bias + so.dense.bias
                vals = [[value_of(parts[j][k], False) for k in range(t)] for j in range(t)]
            new = []
            for i in range(t):
                row = []
                for k in range(t):
                    a = sum(torch.einsum("h,he,dhe->d", probs[:, i, j], vals[j][k], w_o) for j in range(t))
                    row.append(a + parts[i][k])
                row = _spread(row, acc_bias)
                row = _ln_parts(row, z_real[i], so.LayerNorm)
                pre = _spread([p @ layer.intermediate.dense.weight.T for p in row], layer.intermediate.dense.bias)
                slope = _zo_slope(pre_real[i], act)
                ff = _spread([(p * slope) @ layer.output.dense.weight.T for p in pre], layer.output.dense.bias)
                row = _ln_parts([zp + fp for zp, fp in zip(row, ff)], ff_real[i] + zt_real[i], layer.output.LayerNorm)
                new.append(row)
            parts = new
        pooler = bert.pooler.dense
        pooled_pre = hidden[-1][0] @ pooler.weight.T + pooler.bias
        pp = _spread([p @ pooler.weight.T for p in parts[0]], pooler.bias)
        slope = _zo_slope(pooled_pre, torch.tanh)
        scores = _spread([(p * slope) @ model.classifier.weight.T for p in pp], model.classifier.bias)
    return torch.stack(scores)  # (T, C)


@pytest.mark.parametrize("seed", [0, 1])
def test_spread_is_the_official_rule_bert(seed):
    model = make_model("bert", attn="eager", seed=seed)
    ids, mask = random_batch([7, 5], seed=seed + 10)
    res = DecompXAttribution(model, bias_mode="spread").decompose(ids, additional_forward_args=(mask,))
    for b in range(ids.shape[0]):
        n = int(mask[b].sum())
        ref = official_spread_bert(model, ids[b, :n])
        assert (res.logits[b] - ref.sum(0)).abs().max() < TOL  # the reference is complete too
        diff = (res.class_scores[b, :n] - ref).abs().max()
        assert diff < TOL, f"example {b}: max |ours - official| = {diff:.3e}"
        assert (res.class_scores[b, n:] == 0).all()
    # the per-key rule is a different rule: it misses the reference by far more than rounding
    per_key = DecompXAttribution(model, bias_mode="spread_per_key").decompose(ids, additional_forward_args=(mask,))
    n = int(mask[0].sum())
    assert (per_key.class_scores[0, :n] - official_spread_bert(model, ids[0, :n])).abs().max() > 1e-4


def test_spread_per_key_is_the_previous_rule():
    r"""Layer 0: both rules put b_V in each token's own value; they differ in b_O (after vs. before
    the residual) and, from layer 1 on, in b_V. With b_O = 0 everywhere and one layer they agree."""
    model = make_model("bert", attn="eager", seed=3)
    model.bert.encoder.layer = model.bert.encoder.layer[:1]
    model.config.num_hidden_layers = 1
    with torch.no_grad():
        model.bert.encoder.layer[0].attention.output.dense.bias.zero_()
    ids, mask = random_batch([6, 4], seed=4)
    a = DecompXAttribution(model, bias_mode="spread").decompose(ids, additional_forward_args=(mask,))
    b = DecompXAttribution(model, bias_mode="spread_per_key").decompose(ids, additional_forward_args=(mask,))
    torch.testing.assert_close(a.class_scores, b.class_scores, rtol=0, atol=1e-12)
    assert a.method == "DecompX (spread bias)" and b.method == "DecompX (spread bias per key)"
    assert b.bias_mode == "spread_per_key"


def _norm_parts(parts: list, real_in: torch.Tensor, ln: torch.nn.LayerNorm) -> list:
    return _ln_parts(parts, real_in, ln)


def analogue_spread_gpt2(model, ids: torch.Tensor, target: int) -> torch.Tensor:
    r"""(T,) scores of the next-token logit at the last token under the pre-LN analogue of the
    official rule (docs/design.md, section 8): LN betas spread at every norm; layer 0 keeps b_V
    in each token's value; (mixed b_V) W_O + b_O (layer 0: b_O) spread over the
    attention-plus-residual parts; FF biases where they enter; one example, no padding."""
    tr = model.transformer
    t = ids.shape[0]
    with torch.no_grad():
        out = tr(input_ids=ids[None], output_hidden_states=True, output_attentions=True)
        hidden = [h[0] for h in out.hidden_states[:-1]] + [None]  # inputs of every layer (last: before ln_f)
        parts = [[hidden[0][i] if k == i else torch.zeros_like(hidden[0][i]) for k in range(t)] for i in range(t)]
        d = hidden[0].shape[-1]
        x = hidden[0]
        for l, block in enumerate(tr.h):
            probs = out.attentions[l][0]  # (H, T, T), the model's own eager probabilities
            h = probs.shape[0]
            dh = d // h
            w_v, b_v = block.attn.c_attn.weight[:, 2 * d:], block.attn.c_attn.bias[2 * d:]
            w_o, b_o = block.attn.c_proj.weight.view(h, dh, d), block.attn.c_proj.bias
            u = [_norm_parts(parts[j], x[j], block.ln_1) for j in range(t)]
            vals = [[(u[j][k] @ w_v + (b_v if (l == 0 and k == j) else 0.0)).view(h, dh) for k in range(t)]
                    for j in range(t)]
            real_v = (block.ln_1(x) @ w_v + b_v).view(t, h, dh)
            h_real = x + torch.einsum("hij,jhe,hed->id", probs, real_v, w_o) + b_o
            acc = b_o if l == 0 else b_v @ block.attn.c_proj.weight + b_o
            mlp = block.mlp
            pre_real = block.ln_2(h_real) @ mlp.c_fc.weight + mlp.c_fc.bias
            new = []
            for i in range(t):
                row = [sum(torch.einsum("h,he,hed->d", probs[:, i, j], vals[j][k], w_o) for j in range(t)) + parts[i][k]
                       for k in range(t)]
                row = _spread(row, acc)
                z = _norm_parts(row, h_real[i], block.ln_2)
                pre = _spread([p @ mlp.c_fc.weight for p in z], mlp.c_fc.bias)
                slope = _zo_slope(pre_real[i], mlp.act)
                ff = _spread([(p * slope) @ mlp.c_proj.weight for p in pre], mlp.c_proj.bias)
                new.append([rp + fp for rp, fp in zip(row, ff)])
            parts = new
            x = torch.stack([sum(r) for r in parts])  # the real layer output (the parts are complete)
            if l + 1 < len(tr.h):
                assert torch.allclose(x, hidden[l + 1], rtol=0, atol=1e-12)
        final = _norm_parts(parts[t - 1], x[t - 1], tr.ln_f)
        u_dir = model.lm_head.weight[target]
        return torch.stack([p @ u_dir for p in final])


@pytest.mark.parametrize("seed", [0, 1])
def test_spread_decoder_analogue_gpt2(seed):
    from decoder_models import make_decoder

    model = make_decoder("gpt2", attn="eager", seed=seed)
    ids = torch.randint(3, 50, (1, 6), generator=torch.Generator().manual_seed(seed))
    res = DecompXAttribution(model, bias_mode="spread").decompose(ids, target=4)
    ref = analogue_spread_gpt2(model, ids[0], 4)
    assert (res.logits[0, 0] - ref.sum()).abs() < TOL
    diff = (res.scores[0] - ref).abs().max()
    assert diff < TOL, f"max |ours - reference| = {diff:.3e}"
