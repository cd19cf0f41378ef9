r"""Naive, fully materialised reference implementations (tests only): every part as a vector."""
from typing import Optional, Tuple

import torch
from torch import Tensor

from captum_normattr.decompose.attention import project_values
from captum_normattr.decompose.decoder import output_bias, residual_parts
from captum_normattr.decompose.feed_forward import _ln1_parts_rows, ff_parts
from captum_normattr.decompose.layer_norm import apply_norm_to_parts, norm_bias_part
from captum_normattr.decompose.records import LayerTensors


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


# --- explicit (materialised) parts, the references of the chunked paths ---

def ln1_output_parts(layer: LayerTensors, chunk_rows: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    r"""Explicit parts zt_{i<-j} = gamma1 c(a_{i<-j} + [i=j] x_i) / s(z_i) and the bias part.

    Returns:
        ((B, T, T, D), (B, T, D)).
    """
    t = layer.hidden_in.shape[1]
    projected = project_values(layer.values, layer.head_out_weight())
    chunk = chunk_rows or t
    parts = torch.cat([_ln1_parts_rows(layer, projected, slice(s, min(s + chunk, t))) for s in range(0, t, chunk)], 1)
    return parts, norm_bias_part(layer.out_bias, layer.ln1_in, layer.ln1)


def post_ln_whole_layer_parts(
    layer: LayerTensors, chunk_rows: Optional[int] = None, method: str = "closed_form", steps: int = 50
) -> Tuple[Tensor, Tensor]:
    r"""Parts of the post-LN layer output: yt_{i<-j} = gamma2 c(zt_{i<-j} + FF_{i<-j}) / s(ln2_in_i).

    Materialises (B, T, T, D); prefer :func:`component_scope_maps` for maps (row chunks).

    Returns:
        (parts (B, T, T, D), bias (B, T, D)), summing to the real LN2 output.
    """
    zt, zt_b = ln1_output_parts(layer, chunk_rows)
    f = layer.ff
    ffp, ff_b = ff_parts(zt, zt_b, f.w_in, f.b_in, f.act, f.w_out, f.b_out, method, steps)
    parts = apply_norm_to_parts(zt + ffp, layer.ln2_in, layer.ln2)
    return parts, norm_bias_part(zt_b + ff_b, layer.ln2_in, layer.ln2)


def ln2_parts(layer: LayerTensors, rows: Optional[slice] = None) -> Tuple[Tensor, Tensor]:
    r"""Parts of the LN2 output (the FF input) gamma2 c(h_{i<-j}) / s(h_i), and the bias part.

    The bias part is gamma2 c(b_O) / s(h_i) + beta2. With an exact norm the parts sum to the
    real LN2 output.

    Args:
        layer: the layer's tensors.
        rows: query rows (all by default).

    Returns:
        ((B, R, T, D), (B, R, D)).
    """
    t = layer.hidden_in.shape[1]
    rows = rows if rows is not None else slice(0, t)
    h = layer.ln2_in[:, rows]
    parts = apply_norm_to_parts(residual_parts(layer, rows), h, layer.ln2)
    return parts, norm_bias_part(output_bias(layer), h, layer.ln2)


# --- naive references written from the definitions (no package helper inside) ---

def naive_row_normalize(m):
    r"""Each row divided by its sum (rows summing to 0 stay 0)."""
    s = m.sum(-1, keepdim=True)
    return torch.where(s != 0, m / torch.where(s != 0, s, torch.ones_like(s)), torch.zeros_like(m))


def naive_fixed_residual(m, valid, w=0.5):
    r"""Abnar & Zuidema: (1 - w) * row-normalised map + w * I on real tokens."""
    t = m.shape[-1]
    eye = torch.eye(t, dtype=m.dtype) * valid[..., None].to(m.dtype)
    return (1 - w) * naive_row_normalize(m) + w * eye


def naive_norm_parts(parts, real, norm):
    r"""Parts of a LayerNorm/RMSNorm output, linearised at the real input's scale: (B, T, T, D)."""
    if norm.kind == "rmsnorm":
        rms = torch.sqrt((real ** 2).mean(-1) + norm.eps)
        out = parts / rms[:, :, None, None]
    else:
        s = torch.sqrt(real.var(-1, unbiased=False) + norm.eps)
        out = (parts - parts.mean(-1, keepdim=True)) / s[:, :, None, None]
    return out if norm.weight is None else norm.weight * out


def naive_pre_ln_parts(layer):
    r"""Pre-LN parts built head by head: N (attention), N_RES = h_{i<-j} (with the residual, no b_O)
    and N_RESLN (LN2 output parts), each (B, T, T, D)."""
    ref = naive_parts_attention(layer)
    t = layer.hidden_in.shape[1]
    res = ref + torch.eye(t, dtype=ref.dtype)[None, :, :, None] * layer.hidden_in[:, :, None, :]
    return {"N": ref, "N_RES": res, "N_RESLN": naive_norm_parts(res, layer.ln2_in, layer.ln2)}


def naive_parts_attention(layer):
    r"""sum_h alpha^h_ij f^h(x_j): (B, T, T, D), head by head."""
    b, h, t, dh = layer.values.shape
    w = layer.out_weight.reshape(h, dh, -1)
    attn = torch.zeros(b, t, t, w.shape[-1], dtype=layer.values.dtype)
    for head in range(h):
        attn += layer.probs[:, head, :, :, None] * (layer.values[:, head] @ w[head])[:, None, :, :]
    return attn


def naive_alti_from_parts(parts, y, valid):
    r"""ALTI map from explicit parts (B, T, T, D) and the real output y (B, T, D), rows normalised."""
    c = (y.abs().sum(-1)[:, :, None] - (y[:, :, None, :] - parts).abs().sum(-1)).clamp_min(0)
    c = c * (valid[:, :, None] & valid[:, None, :])
    return naive_row_normalize(c)


def naive_rollout(maps, convention="raw"):
    r"""Product of the layer maps (B, L, T, T), bottom layer first; rows normalised first for ``row_normalized``."""
    prep = naive_row_normalize if convention == "row_normalized" else (lambda m: m)
    joint = prep(maps[:, 0])
    for l in range(1, maps.shape[1]):
        joint = prep(maps[:, l]) @ joint
    return joint
