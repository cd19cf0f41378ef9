r"""Naive, fully materialised reference implementations (tests only): every part as a vector."""
import torch


def ln_parts(parts, real, gamma, eps):
    s = torch.sqrt(real.var(-1, unbiased=False) + eps)  # (B, T)
    c = parts - parts.mean(-1, keepdim=True)
    return gamma * c / s[:, :, None, None]


def naive_parts(layer):
    r"""All parts as explicit tensors (B, T, T, D), built head by head."""
    b, h, t, dh = layer.values.shape
    w = layer.out_weight.reshape(h, dh, -1)
    attn = torch.zeros(b, t, t, w.shape[-1], dtype=layer.values.dtype)
    for head in range(h):
        f = layer.values[:, head] @ w[head]  # (B, T, D)
        attn += layer.probs[:, head, :, :, None] * f[:, None, :, :]
    eye = torch.eye(t, dtype=attn.dtype)[None, :, :, None]
    res = attn + eye * layer.hidden_in[:, :, None, :]
    zt = ln_parts(res, layer.ln1_in, layer.ln1.weight, layer.ln1.eps)
    enc = ln_parts(zt, layer.ln2_in, layer.ln2.weight, layer.ln2.eps)
    return {"N": attn, "N_RES": res, "N_RESLN": zt, "N_ENC": enc}


def naive_ratio(parts):
    t = parts.shape[1]
    idx = torch.arange(t)
    own = parts[:, idx, idx]
    others = parts.sum(2) - own
    return others.norm(dim=-1) / (others.norm(dim=-1) + own.norm(dim=-1))


def naive_alti(layer, valid):
    zt = naive_parts(layer)["N_RESLN"]
    y = layer.ln1_out[:, :, None, :]
    c = (y.abs().sum(-1) - (y - zt).abs().sum(-1)).clamp_min(0)
    c = c * (valid[:, :, None] & valid[:, None, :])
    s = c.sum(-1, keepdim=True)
    return torch.where(s > 0, c / s, torch.zeros_like(c))
