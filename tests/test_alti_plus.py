r"""ALTI+ for encoder-decoders: exactness in float64 on tiny Marian, BART, mBART, M2M100, Pegasus and T5 models.

Every model is built from a config with perturbed biases and norm weights (nothing is
trivially 0 or 1). A naive reference, written here from the definition with explicit loops,
checks the fast implementation.
"""
import pytest
import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    M2M100Config,
    M2M100ForConditionalGeneration,
    MarianConfig,
    MarianMTModel,
    MBartConfig,
    MBartForConditionalGeneration,
    PegasusConfig,
    PegasusForConditionalGeneration,
    T5Config,
    T5ForConditionalGeneration,
)

from captum_normattr import ALTIPlusAttribution, ALTIPlusResult, UnsupportedModelError, explain_generation
from captum_normattr.decompose.alti_plus import OFFICIAL, ALTIPlusConventions
from captum_normattr.models.seq2seq import BLOCKS, get_seq2seq_adapter, recording_seq2seq

VOCAB = 40
PAD = 0
FAMILIES = ["marian", "bart", "mbart", "m2m_100", "pegasus", "t5"]
#: families whose outputs do not depend on left padding (positions counted over real tokens, or relative)
LEFT_PAD_INVARIANT = ["m2m_100", "t5"]

_COMMON = dict(vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=32,
               pad_token_id=PAD, eos_token_id=1, bos_token_id=2, decoder_start_token_id=2, dropout=0.1,
               attention_dropout=0.1)


def _perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_positions" in name:
                continue
            if "embed" in name or "shared" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif p.dim() == 2:
                p.copy_(0.25 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif name.endswith("bias") and "relative_attention_bias" not in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def make_model(family, seed=0):
    torch.manual_seed(seed)
    if family == "marian":
        m = MarianMTModel(MarianConfig(**_COMMON, decoder_vocab_size=VOCAB))
    elif family == "bart":
        m = BartForConditionalGeneration(BartConfig(**_COMMON))
    elif family == "mbart":
        m = MBartForConditionalGeneration(MBartConfig(**_COMMON))
    elif family == "m2m_100":
        m = M2M100ForConditionalGeneration(M2M100Config(**_COMMON))
    elif family == "pegasus":
        m = PegasusForConditionalGeneration(PegasusConfig(**_COMMON))
    elif family == "t5":
        m = T5ForConditionalGeneration(T5Config(
            vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_decoder_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=16, pad_token_id=PAD, eos_token_id=1,
            decoder_start_token_id=PAD, dropout_rate=0.1))
    else:
        raise ValueError(family)
    return _perturb(m.double().eval(), seed)


_CACHE = {}


def model_for(family):
    if family not in _CACHE:
        _CACHE[family] = make_model(family)
    return _CACHE[family]


def pair(seed=0, b=2, s=7, t=6):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, VOCAB, (b, s), generator=g)
    tgt = torch.randint(3, VOCAB, (b, t), generator=g)
    tgt[:, 0] = 2
    return src, tgt


# ------------------------------------------------------------------ naive reference


def naive_block(blk, valid_q, valid_k, ln_scale="exact", l1_eps=0.0):
    r"""One block's contributions with explicit loops over examples, queries, keys and heads."""
    b, h, q, k = blk.probs.shape
    d = blk.head_weight.shape[-1]
    ncol = k + 1 if blk.cross else k
    out = torch.zeros(b, q, ncol, dtype=torch.float64)
    b_o = blk.out_bias if blk.out_bias is not None else torch.zeros(d, dtype=torch.float64)
    for e in range(b):
        for i in range(q):
            if not valid_q[e, i]:
                continue
            parts = []
            for j in range(k):
                p = torch.zeros(d, dtype=torch.float64)
                for hh in range(h):
                    p = p + blk.probs[e, hh, i, j] * (blk.values[e, hh, j] @ blk.head_weight[hh])
                if not blk.cross and j == i:
                    p = p + blk.residual[e, i]
                parts.append(p)
            if blk.cross:
                parts.append(blk.residual[e, i])
            bias = b_o.clone()
            if blk.norm is not None:
                u = blk.norm_input[e, i]
                if ln_scale == "exact":
                    sigma = torch.sqrt(((u - u.mean()) ** 2).mean() + blk.norm.eps)
                else:
                    w = u + blk.norm.eps
                    sigma = torch.sqrt(((w - w.mean()) ** 2).sum() / (d - 1))
                gamma, beta = blk.norm.weight, blk.norm.bias
                parts = [gamma * (p - p.mean()) / sigma for p in parts]
                bias = gamma * (b_o - b_o.mean()) / sigma + beta
            y = sum(parts) + bias
            for j, p in enumerate(parts):
                masked = j < k and not valid_k[e, j]
                if masked:
                    continue
                c = y.abs().sum() - (p - y + l1_eps).abs().sum()
                out[e, i, j] = max(float(c), 0.0)
            out[e, i] /= out[e, i].sum()
    return out


def naive_alti_plus(model, src, tgt, src_mask=None, tgt_mask=None, ln_scale="exact", l1_eps=0.0, renorm=False):
    src_mask = torch.ones_like(src) if src_mask is None else src_mask
    tgt_mask = torch.ones_like(tgt) if tgt_mask is None else tgt_mask
    vs, vt = src_mask.bool(), tgt_mask.bool()
    adapter = get_seq2seq_adapter(model)
    maps = {n: [] for n in BLOCKS}
    with torch.no_grad(), recording_seq2seq(model, adapter, torch.float64) as rec:
        model(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask,
              use_cache=False)
        for name in BLOCKS:
            vq = vs if name == "encoder_self" else vt
            vk = vt if name == "decoder_self" else vs
            for i in range(len(rec.stack_layers(name))):
                maps[name].append(naive_block(rec.block_tensors(name, i), vq, vk, ln_scale, l1_eps))
    b, s = src.shape
    t = tgt.shape[1]
    enc = maps["encoder_self"][0]
    for c in maps["encoder_self"][1:]:
        enc = torch.einsum("bij,bjk->bik", c, enc)
    # the full (S + T) x (S + T) product of [[I, 0], [M_src, M_tgt]], layer by layer
    total = None
    for l, (cs, cc) in enumerate(zip(maps["decoder_self"], maps["decoder_cross"])):
        big = torch.zeros(b, s + t, s + t, dtype=torch.float64)
        for e in range(b):
            big[e, :s, :s] = torch.eye(s, dtype=torch.float64)
            for i in range(t):
                for j in range(s):
                    big[e, s + i, j] = sum(cc[e, i, m] * enc[e, m, j] for m in range(s))
                for j in range(t):
                    big[e, s + i, s + j] = cc[e, i, s] * cs[e, i, j]
        total = big if total is None else torch.einsum("bij,bjk->bik", big, total)
        if renorm and l > 0:
            rows = total[:, s:]
            sums = rows.sum(-1, keepdim=True)
            total = total.clone()
            total[:, s:] = torch.where(sums > 0, rows / torch.where(sums > 0, sums, torch.ones_like(sums)), rows)
    r = total[:, s:] * vt[..., None]
    return r[..., :s], r[..., s:], maps


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("family", FAMILIES)
def test_parts_sum_to_real_outputs_rows_sum_to_one_and_causal(family):
    model = model_for(family)
    src, tgt = pair()
    res = ALTIPlusAttribution(model).decompose(src, tgt, return_layer_maps=True)
    assert isinstance(res, ALTIPlusResult)
    for name in BLOCKS:  # every encoder and decoder sub-block, against the hooked tensors
        err = res.extras[f"{name}_completeness_error"]
        assert err.shape == (2,) and float(err.max()) <= 1e-10, (name, err)
    assert float(res.completeness_error) <= 1e-10
    rows = res.source_contributions.sum(-1) + res.target_contributions.sum(-1)
    assert torch.allclose(rows, torch.ones_like(rows), atol=1e-12, rtol=0)
    assert torch.allclose(res.source_share, res.source_contributions.sum(-1), atol=0, rtol=0)
    # later target tokens contribute exactly 0, in every decoder self-attention map and in the rollout
    upper = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)
    assert bool((res.target_contributions[:, upper] == 0).all())
    assert bool((res.decoder_self_maps[:, :, upper] == 0).all())
    for m in (res.encoder_maps, res.decoder_self_maps, res.decoder_cross_maps):
        assert torch.allclose(m.sum(-1), torch.ones_like(m.sum(-1)), atol=1e-12, rtol=0)
    # not trivial: both sides and several tokens contribute
    assert 0.01 < float(res.source_share.min()) and float(res.source_share.max()) < 0.999
    assert float(res.target_contributions[:, -1, :-1].sum(-1).min()) > 1e-4  # earlier prefix tokens count
    assert float(res.source_contributions.min()) >= 0 and float(res.target_contributions.min()) >= 0


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_equals_naive_reference(family):
    model = model_for(family)
    src, tgt = pair(seed=1, b=2, s=5, t=4)
    res = ALTIPlusAttribution(model).decompose(src, tgt, return_layer_maps=True)
    n_src, n_tgt, maps = naive_alti_plus(model, src, tgt)
    assert torch.allclose(res.source_contributions, n_src, atol=1e-12, rtol=0)
    assert torch.allclose(res.target_contributions, n_tgt, atol=1e-12, rtol=0)
    assert torch.allclose(res.encoder_maps, torch.stack(maps["encoder_self"], 1), atol=1e-12, rtol=0)
    assert torch.allclose(res.decoder_cross_maps, torch.stack(maps["decoder_cross"], 1), atol=1e-12, rtol=0)
    assert torch.allclose(res.decoder_self_maps, torch.stack(maps["decoder_self"], 1), atol=1e-12, rtol=0)
